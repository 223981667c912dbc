"""The flash-attn 2 adapter (sm80+): see :mod:`.interface`."""

from __future__ import annotations

import torch

from .interface import Interface, call_kernel, fa2_max_seqlen_k, head_dim_reasons, import_optional, parameters, window_kwargs

__all__ = ["FlashAttn2"]


class FlashAttn2(Interface):
    """flash-attn 2.x varlen functions."""

    name = "fa2"
    label = "flash-attn 2 (flash_attn.flash_attn_interface)"
    empty_lse = float("inf")  # its forward writes +inf for rows that see nothing
    # optional arguments some 2.x releases declare without a default
    none_params = frozenset({"block_table", "leftpad_k", "seqused_k", "rng_state"})

    def _resolve(self):
        mod = import_optional("flash_attn.flash_attn_interface")
        if mod is None:
            return "not installed"
        self.module_name = mod.__name__
        self._fwd, self._bwd = mod._flash_attn_varlen_forward, mod._flash_attn_varlen_backward
        self._fwd_params, self._bwd_params = parameters(self._fwd), parameters(self._bwd)
        if not {"window_size_left", "window_size"} & set(self._fwd_params):
            return "this flash-attn 2 release predates sliding windows"
        return None

    def _reasons(self, *, head_dim, softcap):
        reasons = head_dim_reasons(head_dim, 256)
        if softcap and "softcap" not in self._fwd_params:
            reasons.append("this flash-attn 2 release has no softcap (2.6+ has)")
        return reasons

    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, scale, is_causal,
                window_size_left, window_size_right, softcap):
        max_k = fa2_max_seqlen_k(max_seqlen_q, max_seqlen_k)  # FA2 reads window sides against it
        kw = dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                  max_seqlen_k=max_k, dropout_p=0.0, softmax_scale=scale, causal=is_causal,
                  alibi_slopes=None, return_softmax=False,
                  **window_kwargs(self._fwd_params, window_size_left, window_size_right))
        if "softcap" in self._fwd_params:
            kw["softcap"] = softcap
        elif softcap:
            raise ValueError("this flash-attn 2 release has no softcap")
        result = call_kernel(self, self._fwd, self._fwd_params, **kw)
        # 2.7+: (out, lse, S_dmask, rng_state); earlier: (out, q, k, v, out_padded, lse, S_dmask, rng_state)
        return (result[0], result[5]) if len(result) == 8 else (result[0], result[1])

    def backward(self, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, scale,
                 is_causal, window_size_left, window_size_right, softcap):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        max_k = fa2_max_seqlen_k(max_seqlen_q, max_seqlen_k)  # FA2 reads window sides against it
        kw = dict(dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse, dq=dq, dk=dk, dv=dv, cu_seqlens_q=cu_seqlens_q,
                  cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_k, dropout_p=0.0,
                  softmax_scale=scale, causal=is_causal, alibi_slopes=None, deterministic=False,
                  **window_kwargs(self._bwd_params, window_size_left, window_size_right))
        if "softcap" in self._bwd_params:
            kw["softcap"] = softcap
        call_kernel(self, self._bwd, self._bwd_params, **kw)
        return dq, dk, dv
