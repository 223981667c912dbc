"""Triton implementation of the varlen contract (see ``backends/base.py``).

Layers (STYLE item 3): ``cp_attention/kernels/varlen_attention.py`` holds the Triton kernels and
launchers; this module registers them as ``torch.library.custom_op`` s with fake (meta)
implementations, so the ring can be traced by ``torch.compile``, and exposes :class:`TritonBackend`.
Triton is imported lazily: this module imports without it, and the backend then reports
"triton is not installed".

Legend: ``T`` packed query rows, ``S`` packed key rows, ``H`` query heads, ``K`` K/V heads, ``D`` head dim of
q/k, ``Dv`` head dim of v/out (may differ: MLA; the kernels carry both).
"""

from __future__ import annotations

import importlib.util
import os

import torch

from ..masks import MaskSpec
from ..masks import accumulation_dtype

__all__ = ["TritonBackend"]

MAX_HEAD_DIM = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _kernels():
    from ..kernels import varlen_attention
    return varlen_attention


@torch.library.custom_op("cp_attention::triton_varlen_fwd", mutates_args=())
def _triton_varlen_fwd(q_THD: torch.Tensor, k_SKD: torch.Tensor, v_SKDv: torch.Tensor, cu_seqlens_q: torch.Tensor,
                       cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, scale: float,
                       causal: bool, window_left: int, window_right: int,
                       softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """q (Tq, Hq, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv) -> out (Tq, Hq, Dv), lse (Hq, Tq) float32/float64."""
    return _kernels().varlen_fwd(q_THD, k_SKD, v_SKDv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 scale=scale, causal=causal, window=(window_left, window_right), softcap=softcap)


@_triton_varlen_fwd.register_fake
def _(q_THD, k_SKD, v_SKDv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal, window_left,
      window_right, softcap):
    Tq, Hq, _ = q_THD.shape
    return (q_THD.new_empty((Tq, Hq, v_SKDv.shape[2])),
            q_THD.new_empty((Hq, Tq), dtype=accumulation_dtype(q_THD.dtype)))


@torch.library.custom_op("cp_attention::triton_varlen_bwd", mutates_args=())
def _triton_varlen_bwd(dout_THD: torch.Tensor, q_THD: torch.Tensor, k_SKD: torch.Tensor, v_SKD: torch.Tensor,
                       out_THD: torch.Tensor, lse_HT: torch.Tensor, cu_seqlens_q: torch.Tensor,
                       cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, scale: float,
                       causal: bool, window_left: int, window_right: int,
                       softcap: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> dq (Tq, Hq, D), dk (Tk, Hkv, D), dv (Tk, Hkv, Dv), float32 (float64 for float64 inputs)."""
    return _kernels().varlen_bwd(dout_THD, q_THD, k_SKD, v_SKD, out_THD, lse_HT, cu_seqlens_q, cu_seqlens_k,
                                 max_seqlen_q, max_seqlen_k, scale=scale, causal=causal,
                                 window=(window_left, window_right), softcap=softcap)


@_triton_varlen_bwd.register_fake
def _(dout_THD, q_THD, k_SKD, v_SKD, out_THD, lse_HT, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      scale, causal, window_left, window_right, softcap):
    acc = accumulation_dtype(q_THD.dtype)
    return (q_THD.new_empty(q_THD.shape, dtype=acc), k_SKD.new_empty(k_SKD.shape, dtype=acc),
            v_SKD.new_empty(v_SKD.shape, dtype=acc))


class TritonBackend:
    """FlashAttention-2 style Triton kernels: CUDA/ROCm tensors, or CPU tensors under TRITON_INTERPRET=1;
    float16/bfloat16/float32/float64; head dims (q/k's and v's, which may differ) <= 256 (each padded to a
    power of two inside the kernel); every window/causal/softcap/GQA feature of the contract."""

    name = "triton"

    def not_supported_reasons(self, *, device, dtype, head_dim, spec: MaskSpec, head_dim_v=None) -> list[str]:
        reasons = []
        if importlib.util.find_spec("triton") is None:
            reasons.append("triton is not installed")
        device = torch.device(device)
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
            reasons.append("CPU tensors need TRITON_INTERPRET=1 (the Triton interpreter; slow)")
        elif device.type not in ("cpu", "cuda"):
            reasons.append(f"device type {device.type!r} is not supported (cuda, or cpu with TRITON_INTERPRET=1)")
        if dtype not in _DTYPES:
            reasons.append(f"dtype {dtype} is not one of {[str(d) for d in _DTYPES]}")
        elif device.type == "cpu" and dtype == torch.bfloat16:
            reasons.append("bfloat16 is wrong under Triton's CPU interpreter (its tl.dot of bfloat16 tiles returns "
                           "garbage): use float16, float32 or float64 there, or a GPU")
        if not 0 < head_dim <= MAX_HEAD_DIM:
            reasons.append(f"head_dim {head_dim} is not in [1, {MAX_HEAD_DIM}]")
        if head_dim_v is not None and not 0 < head_dim_v <= MAX_HEAD_DIM:
            reasons.append(f"v's head_dim {head_dim_v} is not in [1, {MAX_HEAD_DIM}]")
        return reasons

    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                scale, causal, window=(-1, -1), softcap=None):
        """q (Tq, Hq, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv) -> out (Tq, Hq, Dv) in q's dtype, lse (Hq, Tq)
        float32."""
        cu_q, cu_k = (c.to(device=q.device, dtype=torch.int32) for c in (cu_seqlens_q, cu_seqlens_k))
        return _triton_varlen_fwd(q, k, v, cu_q, cu_k, int(max_seqlen_q), int(max_seqlen_k), float(scale),
                                  bool(causal), int(window[0]), int(window[1]),
                                  None if softcap is None else float(softcap))

    def backward(self, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                 scale, causal, window=(-1, -1), softcap=None):
        """Gradients (float32/float64) of q, k, v given dout and the final out (Tq, Hq, Dv) and lse (Hq, Tq)."""
        cu_q, cu_k = (c.to(device=q.device, dtype=torch.int32) for c in (cu_seqlens_q, cu_seqlens_k))
        return _triton_varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, int(max_seqlen_q), int(max_seqlen_k),
                                  float(scale), bool(causal), int(window[0]), int(window[1]),
                                  None if softcap is None else float(softcap))
