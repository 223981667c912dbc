"""The varlen contract every backend implements, and what a backend declares about itself (its
semantics, :func:`~cp_attention.masks.row_key_intervals` and
:func:`~cp_attention.masks.accumulation_dtype`, live with the masks).

Tensors are packed as (total_tokens, heads, head_dim); K/V heads are not repeated for GQA
(``H_q`` must be a multiple of ``H_kv``; query head ``h`` uses K/V head ``h // (H_q // H_kv)``).
q and k share one head dim ``D``; v (and so out and dout) has its own, ``Dv``, which may differ
(multi-head latent attention: DeepSeek-V2/V3, MiniCPM3, ... have ``D = 192, Dv = 128``)::

    q (Tq, H_q, D)    k (Tk, H_kv, D)    v (Tk, H_kv, Dv)  ->  out (Tq, H_q, Dv), lse (H_q, Tq)
    dout (Tq, H_q, Dv)  ->  dq (Tq, H_q, D), dk (Tk, H_kv, D), dv (Tk, H_kv, Dv)

The softmax scale is the caller's (``D ** -0.5`` by default upstream, never ``Dv``'s).
Sequence ``i`` owns query rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` and key rows
``cu_seqlens_k[i]:cu_seqlens_k[i+1]``; either length may be zero.

Causal and window masks are aligned to the bottom-right of each sequence exactly as flash-attn's
varlen functions define them: with ``Lq``/``Lk`` the sequence's lengths, query ``i`` sees key ``j``
when::

    i + (Lk - Lq) - left  <=  j  <=  i + (Lk - Lq) + right

where ``left``/``right`` of ``-1`` mean unlimited and ``causal=True`` means ``right = 0``.
For example ``Lq = 3, Lk = 5, causal=True, window=(1, 0)`` keeps (1 = visible)::

    0 0 1 1 0
    0 0 0 1 1
    0 0 0 0 1

A query that sees no key gets ``out = 0`` and ``lse = -inf``, never NaN.
Every returned tensor is new: neither a view of an input nor kept by the backend, so the caller
may adopt it as an accumulator and write into it.
``lse`` is float32 (float64 for float64 inputs) with layout (H_q, total_q).
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..masks import MaskSpec

__all__ = ["VarlenBackend"]


class VarlenBackend(Protocol):
    name: str

    def not_supported_reasons(
        self, *, device: torch.device, dtype: torch.dtype, head_dim: int, spec: MaskSpec,
        head_dim_v: int | None = None,
    ) -> list[str]:
        """Why this backend cannot run these inputs (empty list: supported). ``head_dim`` is q's and
        k's, ``head_dim_v`` v's (None: the same as ``head_dim``)."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
        *, scale: float, causal: bool, window: tuple[int, int] = (-1, -1), softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q (Tq, Hq, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv) -> out (Tq, Hq, Dv) in q's dtype, lse (Hq, Tq)
        float32."""

    def backward(
        self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        out: torch.Tensor, lse: torch.Tensor,
        cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
        *, scale: float, causal: bool, window: tuple[int, int] = (-1, -1), softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients dq (Tq, Hq, D), dk (Tk, Hkv, D), dv (Tk, Hkv, Dv) given dout and the *final* out
        (Tq, Hq, Dv) and lse of each query row (after every merge
        and sink), so a partial block's backward is exact. Returned in float32 (float64 for float64
        inputs) so the caller can accumulate partial blocks without rounding."""
