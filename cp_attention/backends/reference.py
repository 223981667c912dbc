"""Pure-torch implementation of the varlen contract (see ``backends/base.py``).

It is the oracle the GPU backends are tested against and the CPU path of the engine. It never
materialises a (total_q x total_k) score matrix: queries are processed in tiles of ``TILE_Q`` rows,
each against the smallest key span its rows can see, so memory is O(tile * (tile + window)) and
work follows the mask.

Legend: ``T``/``S`` packed query/key rows of one tile, ``K`` K/V heads, ``G`` query heads per K/V
head, ``D`` head dim.
"""

from __future__ import annotations

import torch

from ..masks import MaskSpec

__all__ = ["ReferenceBackend", "row_key_intervals"]

TILE_Q = 128


def row_key_intervals(
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, *, causal: bool, window: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """For every packed query row, the packed key rows ``[lo, hi)`` it sees (CPU int64, (Tq,) each).

    Implements the bottom-right alignment of the contract; ``hi <= lo`` means the row sees nothing.
    """
    cu_q = cu_seqlens_q.detach().to("cpu", torch.int64)
    cu_k = cu_seqlens_k.detach().to("cpu", torch.int64)
    len_q, len_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    total_q = int(cu_q[-1])
    seq_of_T = torch.repeat_interleave(torch.arange(len(len_q)), len_q, output_size=total_q)
    i_T = torch.arange(total_q) - cu_q[seq_of_T]
    lk_T = len_k[seq_of_T]
    diag_T = i_T + lk_T - len_q[seq_of_T]  # key aligned with query i (bottom-right)
    left, right = window
    if causal:
        right = 0
    lo_T = torch.zeros_like(i_T) if left < 0 else (diag_T - left).clamp(min=0)
    hi_T = lk_T.clone() if right < 0 else torch.minimum(lk_T, diag_T + right + 1)
    base_T = cu_k[:-1][seq_of_T]
    return lo_T + base_T, torch.maximum(hi_T, lo_T) + base_T


def _tiles(cu_seqlens_q, cu_seqlens_k, causal, window, device):
    """Yield (q0, q1, k0, k1, lo, hi) for each query tile that sees at least one key: its rows
    ``[q0, q1)``, the key span ``[k0, k1)`` they see, and each row's interval on ``device``."""
    lo_T, hi_T = row_key_intervals(cu_seqlens_q, cu_seqlens_k, causal=causal, window=window)
    lo_dev, hi_dev = lo_T.to(device), hi_T.to(device)
    total = lo_T.numel()
    for q0 in range(0, total, TILE_Q):
        q1 = min(total, q0 + TILE_Q)
        lo, hi = lo_T[q0:q1], hi_T[q0:q1]
        live = hi > lo
        if not bool(live.any()):
            continue
        yield q0, q1, int(lo[live].min()), int(hi[live].max()), lo_dev[q0:q1], hi_dev[q0:q1]


def _by_kv_head(x_THD: torch.Tensor, kv_heads: int, acc: torch.dtype) -> torch.Tensor:
    """(T, H, D) -> (K, G, T, D) in the compute dtype: query heads grouped by their K/V head."""
    T, H, D = x_THD.shape
    return x_THD.to(acc).view(T, kv_heads, H // kv_heads, D).permute(1, 2, 0, 3)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class ReferenceBackend:
    """Plain torch, any device, float16/bfloat16/float32/float64, every mask feature."""

    name = "reference"

    def not_supported_reasons(self, *, device, dtype, head_dim, spec: MaskSpec) -> list[str]:
        if dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            return [f"dtype {dtype} is not a supported float type"]
        return []

    @staticmethod
    def _scores(q_KGTD, k_SKD, lo_T, hi_T, k0, scale, softcap):
        """Masked scores (K, G, T, S) in the compute dtype, plus tanh values for softcap's backward."""
        s_KGTS = torch.matmul(q_KGTD, k_SKD.permute(1, 2, 0).unsqueeze(1)) * scale
        tanh_KGTS = None
        if softcap is not None:
            tanh_KGTS = torch.tanh(s_KGTS / softcap)
            s_KGTS = tanh_KGTS * softcap
        j_S = torch.arange(k0, k0 + k_SKD.shape[0], device=q_KGTD.device)
        visible_TS = (j_S[None, :] >= lo_T[:, None]) & (j_S[None, :] < hi_T[:, None])
        return s_KGTS, tanh_KGTS, visible_TS

    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                scale, causal, window=(-1, -1), softcap=None):
        Tq, Hq, D = q.shape
        Hkv = k.shape[1]
        acc = _compute_dtype(q.dtype)
        out_THD = torch.zeros(Tq, Hq, D, dtype=q.dtype, device=q.device)
        lse_HT = torch.full((Hq, Tq), float("-inf"), dtype=acc, device=q.device)
        for q0, q1, k0, k1, lo, hi in _tiles(cu_seqlens_q, cu_seqlens_k, causal, window, q.device):
            T = q1 - q0
            s_KGTS, _, visible_TS = self._scores(_by_kv_head(q[q0:q1], Hkv, acc), k[k0:k1].to(acc), lo, hi,
                                                 k0, scale, softcap)
            s_KGTS = s_KGTS.masked_fill(~visible_TS, float("-inf"))
            m_KGT1 = s_KGTS.amax(dim=-1, keepdim=True)
            m_KGT1 = torch.where(torch.isneginf(m_KGT1), torch.zeros_like(m_KGT1), m_KGT1)
            p_KGTS = torch.exp(s_KGTS - m_KGT1)
            l_KGT1 = p_KGTS.sum(dim=-1, keepdim=True)
            o_KGTD = torch.matmul(p_KGTS, v[k0:k1].to(acc).permute(1, 0, 2).unsqueeze(1))
            o_KGTD = o_KGTD / torch.where(l_KGT1 > 0, l_KGT1, torch.ones_like(l_KGT1))
            out_THD[q0:q1] = o_KGTD.permute(2, 0, 1, 3).reshape(T, Hq, D).to(q.dtype)
            lse_HT[:, q0:q1] = (m_KGT1 + torch.log(l_KGT1)).reshape(Hq, T)
        return out_THD, lse_HT

    def backward(self, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                 scale, causal, window=(-1, -1), softcap=None):
        Tq, Hq, D = q.shape
        Hkv = k.shape[1]
        acc = _compute_dtype(q.dtype)
        dq_THD = torch.zeros(Tq, Hq, D, dtype=acc, device=q.device)
        dk_SKD = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv_SKD = torch.zeros(v.shape, dtype=acc, device=v.device)
        for q0, q1, k0, k1, lo, hi in _tiles(cu_seqlens_q, cu_seqlens_k, causal, window, q.device):
            T = q1 - q0
            q_KGTD = _by_kv_head(q[q0:q1], Hkv, acc)
            do_KGTD = _by_kv_head(dout[q0:q1], Hkv, acc)
            o_KGTD = _by_kv_head(out[q0:q1], Hkv, acc)
            k_SKD, v_SKD = k[k0:k1].to(acc), v[k0:k1].to(acc)
            s_KGTS, tanh_KGTS, visible_TS = self._scores(q_KGTD, k_SKD, lo, hi, k0, scale, softcap)
            lse_KGT1 = lse[:, q0:q1].to(acc).reshape(Hkv, Hq // Hkv, T, 1)
            live_KGT1 = torch.isfinite(lse_KGT1)
            p_KGTS = torch.exp(s_KGTS - torch.where(live_KGT1, lse_KGT1, torch.zeros_like(lse_KGT1)))
            p_KGTS = torch.where(visible_TS & live_KGT1, p_KGTS, torch.zeros_like(p_KGTS))
            v_K1DS = v_SKD.permute(1, 2, 0).unsqueeze(1)
            dv_SKD[k0:k1] += torch.matmul(p_KGTS.transpose(-1, -2), do_KGTD).sum(1).permute(1, 0, 2)
            dp_KGTS = torch.matmul(do_KGTD, v_K1DS)
            delta_KGT1 = (do_KGTD * o_KGTD).sum(-1, keepdim=True)
            ds_KGTS = p_KGTS * (dp_KGTS - delta_KGT1)
            if softcap is not None:
                ds_KGTS = ds_KGTS * (1 - tanh_KGTS * tanh_KGTS)
            ds_KGTS = ds_KGTS * scale
            dq_KGTD = torch.matmul(ds_KGTS, k_SKD.permute(1, 0, 2).unsqueeze(1))
            dq_THD[q0:q1] = dq_KGTD.permute(2, 0, 1, 3).reshape(T, Hq, D)
            dk_SKD[k0:k1] += torch.matmul(ds_KGTS.transpose(-1, -2), q_KGTD).sum(1).permute(1, 0, 2)
        return dq_THD, dk_SKD, dv_SKD
