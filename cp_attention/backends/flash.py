"""The varlen contract on flash kernels: the flash-attn package when installed, else PyTorch's own.

Kernels (every version difference lives in this module):

* ``flash-attn`` 2.x: ``flash_attn.flash_attn_interface._flash_attn_varlen_forward/_backward``
  (softcap supported).
* PyTorch's built-in flash kernels: ``torch.ops.aten._flash_attention_forward/_backward`` with
  ``cum_seq_q/k``, ``window_size_left/right`` (CUDA, float16/bfloat16; no softcap).

:func:`kernel_arguments` turns the contract's arguments into the kernel's (pure, tested on CPU by
running the reference backend with exactly those arguments); the kernels' conventions for rows
that see no key (flash writes ``lse = +inf``) are mapped back to the contract's ``-inf``.

Legend: ``T`` packed query rows, ``S`` packed key rows, ``H``/``K`` query/key heads, ``D`` head dim.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect

import torch

from ..masks import MaskSpec

__all__ = ["FlashBackend", "kernel_arguments", "flash_attn_available"]

_DTYPES = (torch.float16, torch.bfloat16)


def flash_attn_available() -> bool:
    """Whether the flash-attn 2 package (with its CUDA extension) can be imported."""
    if importlib.util.find_spec("flash_attn") is None:
        return False
    try:
        importlib.import_module("flash_attn.flash_attn_interface")
    except Exception:  # an installed package whose CUDA extension does not load
        return False
    return True


def kernel_arguments(*, scale: float, causal: bool, window: tuple[int, int], softcap: float | None) -> dict:
    """The contract's mask arguments in flash's conventions: ``is_causal``, ``window_size_left/right``
    (-1 unlimited; a causal call has right 0), ``scale``, ``softcap`` (0.0 off)."""
    left, right = int(window[0]), int(window[1])
    if causal:
        right = 0
    return dict(is_causal=right == 0, window_size_left=left, window_size_right=right, scale=float(scale),
                softcap=0.0 if softcap is None else float(softcap))


def _call_flash_attn(fn, *args, window_size_left: int, window_size_right: int, softcap: float, **kwargs):
    """Call a flash-attn private varlen function across its 2.x signatures: ``window_size=(l, r)``
    in older releases, ``window_size_left/right`` in newer ones; ``softcap`` only where it exists."""
    params = inspect.signature(fn).parameters
    if "window_size_left" in params:
        kwargs.update(window_size_left=window_size_left, window_size_right=window_size_right)
    else:
        kwargs["window_size"] = (window_size_left, window_size_right)
    if "softcap" in params:
        kwargs["softcap"] = softcap
    elif softcap:
        raise ValueError("this flash-attn version has no softcap; upgrade flash-attn or use backend='triton'")
    return fn(*args, **{k: v for k, v in kwargs.items() if k in params})


def _contract_lse(lse_HT: torch.Tensor) -> torch.Tensor:
    """Flash writes ``+inf`` for rows that see no key; the contract says ``-inf``."""
    return torch.where(torch.isposinf(lse_HT), torch.full_like(lse_HT, float("-inf")), lse_HT)


def _kernel_lse(lse_HT: torch.Tensor) -> torch.Tensor:
    """Back to flash's convention for the backward (``+inf`` makes such rows' probabilities 0)."""
    return torch.where(torch.isneginf(lse_HT), torch.full_like(lse_HT, float("inf")), lse_HT).float().contiguous()


def _aten_flash_forward(*args, **kwargs):
    return torch.ops.aten._flash_attention_forward(*args, **kwargs)


def _aten_flash_backward(*args, **kwargs):
    return torch.ops.aten._flash_attention_backward(*args, **kwargs)


# ----------------------------------------------------------------------------------------------
# the two kernels, as custom ops with fake implementations (so the ring can be traced)


@torch.library.custom_op("cp_attention::flash_varlen_fwd", mutates_args=())
def flash_varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, scale: float, is_causal: bool,
                     window_size_left: int, window_size_right: int, softcap: float,
                     use_flash_attn: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q (T, H, D), k/v (S, K, D) -> out (T, H, D), lse (H, T) float32 in flash's convention."""
    if use_flash_attn:
        from flash_attn import flash_attn_interface as fa

        out, lse, *_ = _call_flash_attn(
            fa._flash_attn_varlen_forward, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            dropout_p=0.0, softmax_scale=scale, causal=is_causal, window_size_left=window_size_left,
            window_size_right=window_size_right, softcap=softcap, alibi_slopes=None, return_softmax=False)
        return out, lse
    out, lse, *_ = _aten_flash_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0, is_causal, False, scale=scale,
        window_size_left=window_size_left, window_size_right=window_size_right)
    return out, lse


@flash_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, is_causal, window_size_left,
      window_size_right, softcap, use_flash_attn):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("cp_attention::flash_varlen_bwd", mutates_args=())
def flash_varlen_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                     max_seqlen_k: int, scale: float, is_causal: bool, window_size_left: int, window_size_right: int,
                     softcap: float, use_flash_attn: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of q, k, v (input dtype) given the final out and lse (flash's convention)."""
    if use_flash_attn:
        from flash_attn import flash_attn_interface as fa

        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _call_flash_attn(
            fa._flash_attn_varlen_backward, dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
            max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=scale, causal=is_causal,
            window_size_left=window_size_left, window_size_right=window_size_right, softcap=softcap,
            alibi_slopes=None, deterministic=False)
        return dq, dk, dv
    rng = torch.zeros(2, dtype=torch.int64, device=q.device)
    unused = torch.empty(0, device=q.device)
    dq, dk, dv = _aten_flash_backward(
        dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0, is_causal, rng, unused,
        scale=scale, window_size_left=window_size_left, window_size_right=window_size_right)
    return dq, dk, dv


@flash_varlen_bwd.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, is_causal,
      window_size_left, window_size_right, softcap, use_flash_attn):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


# ----------------------------------------------------------------------------------------------
# the backend


class FlashBackend:
    """Flash kernels on CUDA for float16/bfloat16; see the module docstring for which kernel."""

    name = "flash"

    def __init__(self, use_flash_attn: bool | None = None):
        self._use_flash_attn = use_flash_attn

    @property
    def use_flash_attn(self) -> bool:
        if self._use_flash_attn is None:
            self._use_flash_attn = flash_attn_available()
        return self._use_flash_attn

    def not_supported_reasons(self, *, device, dtype, head_dim, spec: MaskSpec) -> list[str]:
        reasons = []
        if torch.device(device).type != "cuda":
            reasons.append(f"flash kernels need CUDA tensors, got {torch.device(device).type}")
        if dtype not in _DTYPES:
            reasons.append(f"flash kernels take float16/bfloat16, got {dtype}")
        if head_dim % 8 != 0 or head_dim > 256:
            reasons.append(f"head_dim {head_dim} must be a multiple of 8 and at most 256")
        if spec.softcap is not None and not self.use_flash_attn:
            reasons.append("softcap needs the flash-attn package (PyTorch's flash kernels have none)")
        return reasons

    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                scale, causal, window=(-1, -1), softcap=None):
        kw = kernel_arguments(scale=scale, causal=causal, window=window, softcap=softcap)
        out_THD, lse_HT = flash_varlen_fwd(
            q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens_q.int(), cu_seqlens_k.int(), int(max_seqlen_q),
            int(max_seqlen_k), kw["scale"], kw["is_causal"], kw["window_size_left"], kw["window_size_right"],
            kw["softcap"], self.use_flash_attn)
        return out_THD, _contract_lse(lse_HT)

    def backward(self, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                 scale, causal, window=(-1, -1), softcap=None):
        kw = kernel_arguments(scale=scale, causal=causal, window=window, softcap=softcap)
        return flash_varlen_bwd(
            dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(), _kernel_lse(lse),
            cu_seqlens_q.int(), cu_seqlens_k.int(), int(max_seqlen_q), int(max_seqlen_k), kw["scale"],
            kw["is_causal"], kw["window_size_left"], kw["window_size_right"], kw["softcap"], self.use_flash_attn)
