"""Pure-torch implementation of the varlen contract (see ``backends/base.py``).

It is the oracle the GPU backends are tested against and the CPU path of the engine. It never
materialises a (total_q x total_k) score matrix: queries are processed in tiles of at most
``TILE_Q`` rows of one sequence (several whole short sequences may share a tile), each against the
smallest key span its rows can see, so memory is O(tile * (tile + window)) beyond the inputs and
the results, and work follows the mask.

Inside a tile, key columns that every row of the tile sees are *full*: they get no mask arithmetic.
Only the columns at the edges of the span (the diagonal of a causal or window band, document
boundaries) are masked. Query heads that share a K/V head are folded into the rows of one batched
matrix product (``M = T * G`` rows per K/V head); K/V are read through strided views (no copies of
the whole inputs), every elementwise step works in place on one score buffer reused by every tile,
and dK/dV accumulate straight into the returned tensors.

Legend: ``T`` query rows of one tile, ``S`` key rows of its span, ``K`` K/V heads, ``G`` query
heads per K/V head, ``M = T * G`` rows of a tile's matrices (ordered token-major: row ``t * G + g``),
``D`` head dim of q and k, ``Dv`` head dim of v and out (may differ from ``D``: MLA), ``Tq``/``Tk``
packed query/key rows of the call, ``H = K * G`` query heads.
"""

from __future__ import annotations

import torch

from ..masks import MaskSpec
from ..masks import accumulation_dtype, row_key_intervals

__all__ = ["ReferenceBackend", "row_key_intervals", "TILE_Q"]  # row_key_intervals: defined by the contract (base)

TILE_Q = 128
"""Query rows per tile (the planner's ``WORK_TILE`` counts work with the same tiles)."""
BLOCK_ENTRIES = 1 << 22
"""Score entries per block of K/V heads of a tile (16 MiB in float32): fewer, larger batched
products beat cache-sized ones on CPU, where per-call overhead dominates."""


def _tile_rows(cu_seqlens_q: torch.Tensor) -> list[tuple[int, int]]:
    """Row ranges ``[q0, q1)`` of the tiles: every sequence is cut into tiles of its own, at most
    ``TILE_Q`` rows each. A tile never holds two sequences, so it never reads another sequence's
    keys: a NaN or Inf in one document cannot reach another through ``0 * NaN`` in a product."""
    bounds = cu_seqlens_q.detach().to("cpu", torch.int64).tolist()
    return [(s, min(b, s + TILE_Q)) for a, b in zip(bounds[:-1], bounds[1:]) for s in range(a, b, TILE_Q)]


class _Tile:
    """One query tile: rows ``[q0, q1)``, key span ``[k0, k1)``, the column ranges ``(a, b)``
    (relative to ``k0``) that need masking and the rows' visible key intervals ``lo``/``hi``
    (absolute, on the compute device; None when no column needs masking)."""

    __slots__ = ("q0", "q1", "k0", "k1", "ranges", "lo", "hi")

    def __init__(self, q0, q1, k0, k1, ranges, lo, hi):
        self.q0, self.q1, self.k0, self.k1, self.ranges, self.lo, self.hi = q0, q1, k0, k1, ranges, lo, hi


def _tiles(cu_seqlens_q, cu_seqlens_k, causal, window, device) -> list[_Tile]:
    """The tiles that see at least one key, with their spans and masked column ranges."""
    lo_T, hi_T = row_key_intervals(cu_seqlens_q, cu_seqlens_k, causal=causal, window=window)
    tiles = []
    for q0, q1 in _tile_rows(cu_seqlens_q):
        lo, hi = lo_T[q0:q1], hi_T[q0:q1]
        live = hi > lo
        n_live = int(live.sum())
        if n_live == 0:
            continue
        if n_live == q1 - q0:
            k0, k1 = int(lo.min()), int(hi.max())
            full0, full1 = int(lo.max()), int(hi.min())  # columns every row sees
        else:
            k0, k1 = int(lo[live].min()), int(hi[live].max())
            full0 = full1 = k1  # a row that sees nothing: mask every column
        if full1 <= full0:
            ranges = [(k0, k1)]
        else:
            ranges = [(a, b) for a, b in ((k0, full0), (full1, k1)) if b > a]
        bounds = (lo.to(device)[:, None], hi.to(device)[:, None]) if ranges else (None, None)
        tiles.append(_Tile(q0, q1, k0, k1, [(a - k0, b - k0) for a, b in ranges], *bounds))
    return tiles


def _tile_masks(tile: _Tile, dtype: torch.dtype, device) -> list[tuple[int, int, torch.Tensor]]:
    """The additive masks of a tile's partial columns: ``(a, b, bias)`` with bias (T, 1, b - a),
    0 where visible and -inf where hidden. Built for one tile at a time (and shared by its head
    blocks), so they never add up to O(Tq * window)."""
    masks = []
    for a, b in tile.ranges:
        j_S = torch.arange(tile.k0 + a, tile.k0 + b, device=device)[None, :]
        bias_TS = torch.zeros(tile.q1 - tile.q0, b - a, dtype=dtype, device=device)
        bias_TS.masked_fill_((j_S < tile.lo) | (j_S >= tile.hi), float("-inf"))
        masks.append((a, b, bias_TS[:, None, :]))
    return masks


def _mask_(s_KMS: torch.Tensor, masks: list[tuple[int, int, torch.Tensor]], groups: int) -> None:
    """Add a tile's masks (:func:`_tile_masks`) to its (K, M, S) score buffer, in the partial
    columns only (an add broadcast over heads is several times faster than ``masked_fill_``)."""
    K, M, S = s_KMS.shape
    s_KTGS = s_KMS.view(K, M // groups, groups, S)
    for a, b, bias_T1S in masks:
        s_KTGS[..., a:b].add_(bias_T1S)


def _rows_KMD(x_THD: torch.Tensor, kv_heads: int, acc: torch.dtype, scale: float | None = None) -> torch.Tensor:
    """A tile's (T, H, D) rows -> (K, T * G, D) in the compute dtype, scaled if asked: each K/V
    head's query heads as rows ``t * G + g`` (a view when nothing needs copying)."""
    T, H, D = x_THD.shape
    x_KMD = x_THD.view(T, kv_heads, H // kv_heads, D).transpose(0, 1).reshape(kv_heads, T * (H // kv_heads), D)
    if scale is not None:
        return x_KMD.to(acc) * scale
    return x_KMD.to(acc)


def _per_head_KM1(x_HT: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Per-row statistics of a tile, (H, T) -> (K, T * G, 1)."""
    H, T = x_HT.shape
    return x_HT.view(kv_heads, H // kv_heads, T).transpose(1, 2).reshape(kv_heads, T * (H // kv_heads), 1)


class _Scratch:
    """Score buffers reused by every tile of one call (no allocation, and the memory stays warm)."""

    def __init__(self, tiles: list[_Tile], kv_heads: int, groups: int, dtype, device, buffers: int):
        size = max(_head_blocks(kv_heads, (t.q1 - t.q0) * groups * (t.k1 - t.k0))[0][1]
                   * (t.q1 - t.q0) * groups * (t.k1 - t.k0) for t in tiles)
        self.flat = torch.empty(buffers, size, dtype=dtype, device=device)

    def view(self, index: int, *shape: int) -> torch.Tensor:
        n = 1
        for d in shape:
            n *= d
        return self.flat[index, :n].view(shape)


def _head_blocks(kv_heads: int, entries_per_head: int) -> list[tuple[int, int]]:
    """K/V head ranges ``[h0, h1)`` processed together, so one score buffer holds at most
    ``BLOCK_ENTRIES`` entries (a cache-sized buffer; every elementwise pass walks it)."""
    most = max(1, min(kv_heads, BLOCK_ENTRIES // max(1, entries_per_head)))
    step = -(-kv_heads // -(-kv_heads // most))  # balanced blocks of at most `most` heads
    return [(h, min(kv_heads, h + step)) for h in range(0, kv_heads, step)]


class ReferenceBackend:
    """Plain torch, any device, float16/bfloat16/float32/float64, every mask feature."""

    name = "reference"

    def not_supported_reasons(self, *, device, dtype, head_dim, spec: MaskSpec, head_dim_v=None) -> list[str]:
        if dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            return [f"dtype {dtype} is not a supported float type"]
        return []

    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                scale, causal, window=(-1, -1), softcap=None):
        Tq, H, _ = q.shape
        K, Dv = k.shape[1], v.shape[2]
        G = H // K
        acc = accumulation_dtype(q.dtype)
        out_THDv = torch.zeros(Tq, H, Dv, dtype=q.dtype, device=q.device)
        lse_HT = torch.full((H, Tq), float("-inf"), dtype=acc, device=q.device)
        tiles = _tiles(cu_seqlens_q, cu_seqlens_k, causal, window, q.device)
        scratch = _Scratch(tiles, K, G, acc, q.device, buffers=1) if tiles else None
        k_KSD, v_KSDv = k.transpose(0, 1), v.transpose(0, 1)  # strided views
        out_KTGDv = out_THDv.view(Tq, K, G, Dv).transpose(0, 1)
        lse_KGT = lse_HT.view(K, G, Tq)
        for tile in tiles:
            q0, q1, k0, k1 = tile.q0, tile.q1, tile.k0, tile.k1
            T = q1 - q0
            masks = _tile_masks(tile, acc, q.device)
            q_KMD = _rows_KMD(q[q0:q1], K, acc, scale)
            for h0, h1 in _head_blocks(K, T * G * (k1 - k0)):
                heads = slice(h0, h1)
                s_KMS = torch.bmm(q_KMD[heads], k_KSD[heads, k0:k1].to(acc).transpose(1, 2),
                                  out=scratch.view(0, h1 - h0, T * G, k1 - k0))
                if softcap is not None:
                    s_KMS.div_(softcap).tanh_().mul_(softcap)
                _mask_(s_KMS, masks, G)
                m_KM1 = s_KMS.amax(dim=-1, keepdim=True)
                m_KM1.masked_fill_(torch.isneginf(m_KM1), 0.0)  # rows that see nothing
                p_KMS = s_KMS.sub_(m_KM1).exp_()
                l_KM1 = p_KMS.sum(dim=-1, keepdim=True)
                o_KMDv = torch.bmm(p_KMS, v_KSDv[heads, k0:k1].to(acc))
                o_KMDv.div_(torch.where(l_KM1 > 0, l_KM1, torch.ones_like(l_KM1)))
                out_KTGDv[heads, q0:q1].copy_(o_KMDv.view(h1 - h0, T, G, Dv))
                lse_KGT[heads, :, q0:q1] = (m_KM1 + torch.log(l_KM1)).view(h1 - h0, T, G).transpose(1, 2)
        return out_THDv, lse_HT

    def backward(self, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                 scale, causal, window=(-1, -1), softcap=None):
        Tq, H, D = q.shape
        K = k.shape[1]
        G = H // K
        acc = accumulation_dtype(q.dtype)
        dq_THD = torch.zeros(Tq, H, D, dtype=acc, device=q.device)
        dk_SKD = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv_SKDv = torch.zeros(v.shape, dtype=acc, device=v.device)
        tiles = _tiles(cu_seqlens_q, cu_seqlens_k, causal, window, q.device)
        scratch = _Scratch(tiles, K, G, acc, q.device, buffers=2) if tiles else None
        k_KSD, v_KSDv = k.transpose(0, 1), v.transpose(0, 1)  # strided views
        dk_KSD, dv_KSDv = dk_SKD.transpose(0, 1), dv_SKDv.transpose(0, 1)
        dq_KTGD = dq_THD.view(Tq, K, G, D).transpose(0, 1)
        for tile in tiles:
            q0, q1, k0, k1 = tile.q0, tile.q1, tile.k0, tile.k1
            T = q1 - q0
            keys = slice(k0, k1)
            masks = _tile_masks(tile, acc, q.device)
            q_KMD = _rows_KMD(q[q0:q1], K, acc, scale)  # scaled: dK = dS^T (scale * Q)
            do_KMDv = _rows_KMD(dout[q0:q1], K, acc)
            # delta = rowsum(dO * O); rows that see nothing get lse = +inf, so exp(s - lse) = 0
            delta_KM1 = _per_head_KM1((dout[q0:q1].to(acc) * out[q0:q1].to(acc)).sum(-1).t(), K)
            lse_KM1 = _per_head_KM1(lse[:, q0:q1].to(acc), K)
            lse_KM1 = lse_KM1.masked_fill(torch.isneginf(lse_KM1), float("inf"))
            for h0, h1 in _head_blocks(K, T * G * (k1 - k0)):
                heads = slice(h0, h1)
                shape = (h1 - h0, T * G, k1 - k0)
                k_tile, v_tile = k_KSD[heads, keys].to(acc), v_KSDv[heads, keys].to(acc)
                q_tile, do_tile = q_KMD[heads], do_KMDv[heads]
                s_KMS = torch.bmm(q_tile, k_tile.transpose(1, 2), out=scratch.view(0, *shape))
                tanh_KMS = None
                if softcap is not None:
                    tanh_KMS = s_KMS.div_(softcap).tanh_()
                    s_KMS = tanh_KMS * softcap
                _mask_(s_KMS, masks, G)
                p_KMS = s_KMS.sub_(lse_KM1[heads]).exp_()
                dv_KSDv[heads, keys].baddbmm_(p_KMS.transpose(1, 2), do_tile)
                ds_KMS = torch.bmm(do_tile, v_tile.transpose(1, 2), out=scratch.view(1, *shape))  # dP
                ds_KMS.sub_(delta_KM1[heads]).mul_(p_KMS)
                if tanh_KMS is not None:
                    ds_KMS.mul_(tanh_KMS.square_().neg_().add_(1.0))
                dq_KMD = torch.bmm(ds_KMS, k_tile)
                dq_KTGD[heads, q0:q1].copy_(dq_KMD.view(h1 - h0, T, G, D))
                dk_KSD[heads, keys].baddbmm_(ds_KMS.transpose(1, 2), q_tile)
        if tiles:
            dq_THD.mul_(scale)
        return dq_THD, dk_SKD, dv_SKDv
