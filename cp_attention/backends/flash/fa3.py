"""The flash-attn 3 adapter (Hopper, sm90): see :mod:`.interface` for the conventions it translates."""

from __future__ import annotations

import torch

from .interface import Interface, call_kernel, head_dim_reasons, import_optional, parameters, window_kwargs

__all__ = ["FlashAttn3"]


class FlashAttn3(Interface):
    """flash-attn 3 (Hopper): varlen through the unified ``_flash_attn_forward/_backward``."""

    name = "fa3"
    label = "flash-attn 3 (flash_attn_interface)"
    empty_lse = float("-inf")  # its backward preprocess reads -inf as "no key" (log2 lse 0, all masked)
    modules = ("flash_attn_interface", "flash_attn_3.flash_attn_interface")
    # 3.0 betas (plain functions) declare every optional tensor without a default
    none_params = frozenset({
        "k_new", "v_new", "qv", "out", "cu_seqlens_k_new", "seqused_q", "seqused_k", "page_table", "kv_batch_idx",
        "leftpad_k", "rotary_cos", "rotary_sin", "seqlens_rotary", "q_descale", "k_descale", "v_descale",
        "sequed_q", "sequed_k"})

    def _resolve(self):
        mod = next((m for m in map(import_optional, self.modules) if m is not None), None)
        if mod is None:
            return "not installed"
        self.module_name = mod.__name__
        if not (hasattr(mod, "_flash_attn_forward") and hasattr(mod, "_flash_attn_backward")):
            return "flash_attn_interface has no _flash_attn_forward/_flash_attn_backward"
        self._fwd, self._bwd = mod._flash_attn_forward, mod._flash_attn_backward
        self._fwd_params, self._bwd_params = parameters(self._fwd), parameters(self._bwd)
        if "cu_seqlens_q" not in self._fwd_params or "cu_seqlens_q" not in self._bwd_params:
            return "this flash_attn_interface predates varlen _flash_attn_forward/_backward(cu_seqlens_q=...)"
        self._causal_name = "is_causal" if "is_causal" in self._bwd_params else "causal"
        return None

    def _capability_reasons(self, capability):
        if capability[0] != 9:
            return [f"needs a Hopper GPU (sm90), got sm{capability[0]}{capability[1]}"]
        return []

    def _reasons(self, *, head_dim, softcap):
        reasons = head_dim_reasons(head_dim, 256)
        if softcap and "softcap" not in self._fwd_params:
            reasons.append("this release has no softcap")
        return reasons

    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, scale, is_causal,
                window_size_left, window_size_right, softcap):
        kw = dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                  max_seqlen_k=max_seqlen_k, softmax_scale=scale, causal=is_causal,
                  **window_kwargs(self._fwd_params, window_size_left, window_size_right))
        if softcap:
            kw["softcap"] = softcap
        out_THD, lse_HT, *_ = call_kernel(self, self._fwd, self._fwd_params, **kw)
        return out_THD, lse_HT

    def backward(self, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, scale,
                 is_causal, window_size_left, window_size_right, softcap):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        kw = dict(dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse, cu_seqlens_q=cu_seqlens_q,
                  cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, dq=dq, dk=dk,
                  dv=dv, softmax_scale=scale, **{self._causal_name: is_causal},
                  **window_kwargs(self._bwd_params, window_size_left, window_size_right))
        if softcap:
            kw["softcap"] = softcap
        if "deterministic" in self._bwd_params:
            kw["deterministic"] = False
        call_kernel(self, self._bwd, self._bwd_params, **kw)
        return dq, dk, dv
