"""PyTorch's own flash kernels (flash-attn 2 inside ATen, sm80+): see :mod:`.interface`."""

from __future__ import annotations

import torch

from .interface import Interface, fa2_max_seqlen_k, head_dim_reasons

__all__ = ["AtenFlash", "aten_flash_forward", "aten_flash_backward"]


def aten_flash_forward(*args, **kwargs):
    return torch.ops.aten._flash_attention_forward(*args, **kwargs)


def aten_flash_backward(*args, **kwargs):
    return torch.ops.aten._flash_attention_backward(*args, **kwargs)


class AtenFlash(Interface):
    """PyTorch's built-in flash kernels (flash-attn 2 inside ATen)."""

    name = "aten"
    label = "PyTorch flash (aten._flash_attention_forward)"
    module_name = "torch"
    empty_lse = float("inf")

    def _resolve(self):
        op = getattr(torch.ops.aten, "_flash_attention_forward", None)
        if op is None:
            return "this PyTorch has no aten._flash_attention_forward"
        if "window_size_left" not in {a.name for a in op.default._schema.arguments}:
            return "this PyTorch's flash kernels predate sliding windows"
        return None

    def _reasons(self, *, head_dim, softcap):
        reasons = head_dim_reasons(head_dim, 256)
        if softcap:
            reasons.append("no softcap (PyTorch's flash kernels have none)")
        return reasons

    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, scale, is_causal,
                window_size_left, window_size_right, softcap):
        if softcap:
            raise ValueError("PyTorch's flash kernels have no softcap")
        max_k = fa2_max_seqlen_k(max_seqlen_q, max_seqlen_k)  # its FA2 reads window sides against it
        out, lse, *_ = aten_flash_forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_k, 0.0, is_causal, False, scale=scale,
            window_size_left=window_size_left, window_size_right=window_size_right)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, scale,
                 is_causal, window_size_left, window_size_right, softcap):
        rng = torch.zeros(2, dtype=torch.int64, device=q.device)
        unused = torch.empty(0, device=q.device)
        max_k = fa2_max_seqlen_k(max_seqlen_q, max_seqlen_k)  # its FA2 reads window sides against it
        dq, dk, dv = aten_flash_backward(
            dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_k, 0.0, is_causal, rng,
            unused, scale=scale, window_size_left=window_size_left, window_size_right=window_size_right)
        return dq, dk, dv
