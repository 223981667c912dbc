"""The flash-attn 4 adapter (CuTe DSL; Blackwell, sm100/sm110): see :mod:`.interface`."""

from __future__ import annotations

from .interface import Interface, call_kernel, head_dim_reasons, import_optional, parameters

__all__ = ["FlashAttn4"]


class FlashAttn4(Interface):
    """flash-attn 4 (CuTe DSL) on Blackwell."""

    name = "fa4"
    label = "flash-attn 4 (flash_attn.cute.interface)"
    empty_lse = float("-inf")  # forward writes -inf; backward preprocess reads -inf as "no key"

    def _resolve(self):
        mod = import_optional("flash_attn.cute.interface")
        if mod is None:
            return "not installed"
        self.module_name = mod.__name__
        if not (hasattr(mod, "_flash_attn_fwd") and hasattr(mod, "_flash_attn_bwd")):
            return "flash_attn.cute.interface has no _flash_attn_fwd/_flash_attn_bwd"
        self._fwd, self._bwd = mod._flash_attn_fwd, mod._flash_attn_bwd
        self._fwd_params, self._bwd_params = parameters(self._fwd), parameters(self._bwd)
        need_fwd = {"cu_seqlens_q", "window_size_left", "return_lse"} - set(self._fwd_params)
        need_bwd = {"cu_seqlens_q", "window_size_left"} - set(self._bwd_params)
        if need_fwd or need_bwd:
            return (f"this release lacks {sorted(need_fwd)} in _flash_attn_fwd / {sorted(need_bwd)} in "
                    "_flash_attn_bwd (varlen + window backward)")
        return None

    def _capability_reasons(self, capability):
        # On sm90 several releases' backward asserts "varlen backward is not yet supported on sm90"
        # and "local not supported yet on 9.x"; Hopper uses flash-attn 3 instead.
        if capability[0] not in (10, 11):
            return [f"used on Blackwell (sm100/sm110) only, got sm{capability[0]}{capability[1]}"]
        return []

    def _reasons(self, *, head_dim, softcap):
        reasons = head_dim_reasons(head_dim, 128)
        if softcap:
            reasons.append("no softcap in its varlen backward")
        return reasons

    @staticmethod
    def _mask(is_causal, left, right) -> dict:
        """FA4's mask arguments: an unlimited side is None (a negative int would be read literally,
        and ``left + right < 0`` turns the window off); causal only without a left window."""
        if is_causal and left < 0:
            return dict(causal=True, window_size_left=None, window_size_right=None)
        return dict(causal=False, window_size_left=None if left < 0 else left,
                    window_size_right=None if right < 0 else right)

    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, scale, is_causal,
                window_size_left, window_size_right, softcap):
        if softcap:
            raise ValueError("flash-attn 4 has no softcap in its varlen backward; use another interface")
        kw = dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, softmax_scale=scale,
                  return_lse=True, **self._mask(is_causal, window_size_left, window_size_right))
        if "max_seqlen_q" in self._fwd_params:
            kw.update(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
        result = call_kernel(self, self._fwd, self._fwd_params, **kw)  # (out, lse) or (out, lse, p, row_max)
        out_THD, lse_HT = result[0], result[1]
        if lse_HT is None:
            raise RuntimeError("flash-attn 4 returned no lse although return_lse=True")
        return out_THD, lse_HT

    def backward(self, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, scale,
                 is_causal, window_size_left, window_size_right, softcap):
        if softcap:
            raise ValueError("flash-attn 4 has no softcap in its varlen backward; use another interface")
        kw = dict(q=q, k=k, v=v, out=out, dout=dout, lse=lse, softmax_scale=scale, cu_seqlens_q=cu_seqlens_q,
                  cu_seqlens_k=cu_seqlens_k, **self._mask(is_causal, window_size_left, window_size_right))
        if "max_seqlen_q" in self._bwd_params:
            kw.update(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
        dq, dk, dv = call_kernel(self, self._bwd, self._bwd_params, **kw)[:3]
        return dq, dk, dv
