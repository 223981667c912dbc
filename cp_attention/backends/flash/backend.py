"""The flash backend: the first interface (:data:`PREFERENCE`) whose declared support covers the inputs,
its two kernels as custom ops with fake implementations (so the ring can be traced), and the
contract's conventions around them (lse of rows that see no key, float32 gradients, a v head dim
padded to q's; see :mod:`.interface`).

Legend: ``T`` packed query rows, ``S`` packed key rows, ``H``/``K`` query/key heads, ``D`` head dim
of q/k, ``Dv`` head dim of v/out, ``P = max(D, Dv)``.
"""

from __future__ import annotations

import logging

import torch

from ...masks import MaskSpec, accumulation_dtype
from .aten import AtenFlash
from .fa2 import FlashAttn2
from .fa3 import FlashAttn3
from .fa4 import FlashAttn4
from .interface import Interface, kernel_arguments

log = logging.getLogger("cp_attention.backends.flash")

__all__ = ["FlashBackend", "pick_interface", "new_interfaces", "INTERFACES", "PREFERENCE"]

_DTYPES = (torch.float16, torch.bfloat16)
PREFERENCE = ("fa3", "fa4", "fa2", "aten")


def _ready(name: str) -> Interface:
    """The adapter called ``name``, its entry points resolved; raises if it cannot be used here."""
    iface = INTERFACES[name]
    reason = iface.unavailable()
    if reason is not None:
        raise RuntimeError(f"{iface.label}: {reason}")
    return iface


def new_interfaces() -> dict[str, Interface]:
    return {cls.name: cls() for cls in (FlashAttn3, FlashAttn4, FlashAttn2, AtenFlash)}


INTERFACES: dict[str, Interface] = new_interfaces()


def pick_interface(*, capability: tuple[int, int] | None, head_dim: int, softcap: bool,
                   candidates=PREFERENCE) -> tuple[str | None, list[str]]:
    """The first of ``candidates`` (default :data:`PREFERENCE`) that can run these inputs, and one
    reason per interface rejected before it (``"<label>: <why>"``)."""
    rejected = []
    for name in candidates:
        iface = INTERFACES[name]
        reasons = iface.not_supported_reasons(capability=capability, head_dim=head_dim, softcap=softcap)
        if not reasons:
            return name, rejected
        rejected.append(f"{iface.label}: {', '.join(reasons)}")
    return None, rejected


# ----------------------------------------------------------------------------------------------
# the two kernels, as custom ops with fake implementations (so the ring can be traced)


@torch.library.custom_op("cp_attention::flash_varlen_fwd", mutates_args=())
def flash_varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, scale: float, is_causal: bool,
                     window_size_left: int, window_size_right: int, softcap: float,
                     interface: str) -> tuple[torch.Tensor, torch.Tensor]:
    """q (T, H, D), k/v (S, K, D) -> out (T, H, D), lse (H, T) float32 in ``interface``'s convention."""
    out_THD, lse_HT = _ready(interface).forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=scale, is_causal=is_causal,
        window_size_left=window_size_left, window_size_right=window_size_right, softcap=softcap)
    return out_THD, lse_HT


@flash_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, is_causal, window_size_left,
      window_size_right, softcap, interface):
    return q.new_empty((*q.shape[:2], v.shape[-1])), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("cp_attention::flash_varlen_bwd", mutates_args=())
def flash_varlen_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                     max_seqlen_k: int, scale: float, is_causal: bool, window_size_left: int, window_size_right: int,
                     softcap: float, interface: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq (T, H, D), dk/dv (S, K, D) in the input dtype, given the final out and lse (H, T) in
    ``interface``'s convention."""
    return _ready(interface).backward(
        dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=scale,
        is_causal=is_causal, window_size_left=window_size_left, window_size_right=window_size_right, softcap=softcap)


@flash_varlen_bwd.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, is_causal,
      window_size_left, window_size_right, softcap, interface):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _contract_lse(lse_HT: torch.Tensor) -> torch.Tensor:
    """Rows that see no key: flash-attn 2 and PyTorch write ``+inf``, 3 and 4 ``-inf``; the contract
    says ``-inf``."""
    return torch.where(torch.isposinf(lse_HT), torch.full_like(lse_HT, float("-inf")), lse_HT)


def _kernel_lse(lse_HT: torch.Tensor, empty: float) -> torch.Tensor:
    """The contract's lse (H, T) as the backward of a kernel expects it: contiguous float32, rows that
    see no key as ``empty``."""
    lse_HT = lse_HT.float()
    if empty != float("-inf"):
        lse_HT = torch.where(torch.isneginf(lse_HT), torch.full_like(lse_HT, empty), lse_HT)
    return lse_HT.contiguous()


# ----------------------------------------------------------------------------------------------
# the backend


def _capability(device: torch.device) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(device))


def _common_width(head_dim: int, head_dim_v: int | None) -> int:
    """The head dim the kernels run at: q/k's and v's, padded to the larger (module docstring)."""
    return max(head_dim, head_dim_v or head_dim)


def _pad_to(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` (..., d) zero padded to (..., width) (``x`` itself when d == width)."""
    return x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))


def _width(x: torch.Tensor, d: int) -> torch.Tensor:
    """A kernel result (..., P) cut back to its true head dim ``d`` (a new contiguous tensor)."""
    return x if x.shape[-1] == d else x[..., :d].contiguous()


class FlashBackend:
    """Flash kernels on CUDA for float16/bfloat16; see the module docstring for the interfaces.

    ``interface`` forces one of :data:`PREFERENCE`; None (default) takes the first, in that order,
    that supports the inputs on their device.
    """

    name = "flash"

    def __init__(self, interface: str | None = None):
        if interface is not None and interface not in PREFERENCE:
            raise ValueError(f"interface must be None or one of {list(PREFERENCE)}, got {interface!r}")
        self.interface = interface
        self._picks: dict[tuple, tuple[str | None, list[str]]] = {}

    def _pick(self, device, head_dim: int, softcap: bool) -> tuple[str | None, list[str]]:
        capability = _capability(device) if torch.device(device).type == "cuda" else None
        key = (capability, head_dim, softcap)
        if key not in self._picks:
            candidates = PREFERENCE if self.interface is None else (self.interface,)
            self._picks[key] = pick_interface(capability=capability, head_dim=head_dim, softcap=softcap,
                                              candidates=candidates)
            name, rejected = self._picks[key]
            log.debug("flash interface for capability %s, head_dim %d, softcap %s: %s%s", capability, head_dim,
                      softcap, INTERFACES[name].label if name else "none", f"; rejected {rejected}" if rejected else "")
        return self._picks[key]

    def describe(self, *, device, dtype, head_dim: int, spec: MaskSpec, head_dim_v: int | None = None) -> str:
        """The backend and the flash interface it runs for such inputs (for logs)."""
        name = self._pick(device, _common_width(head_dim, head_dim_v), spec.softcap is not None)[0]
        return f"flash via {INTERFACES[name].label}" if name is not None else "flash (no interface fits)"

    def interface_for(self, *, device, head_dim: int, softcap: bool = False,
                      head_dim_v: int | None = None) -> str | None:
        """The interface this backend runs for such inputs on ``device`` (None: none fits)."""
        return self._pick(device, _common_width(head_dim, head_dim_v), softcap)[0]

    def not_supported_reasons(self, *, device, dtype, head_dim, spec: MaskSpec, head_dim_v=None) -> list[str]:
        reasons = []
        if torch.device(device).type != "cuda":
            reasons.append(f"flash kernels need CUDA tensors, got {torch.device(device).type}")
        if dtype not in _DTYPES:
            reasons.append(f"flash kernels take float16/bfloat16, got {dtype}")
        if reasons and self.interface is None:
            return reasons
        name, rejected = self._pick(device, _common_width(head_dim, head_dim_v), spec.softcap is not None)
        return reasons if name is not None else reasons + rejected

    def _interface(self, q: torch.Tensor, width: int, softcap) -> str:
        name, rejected = self._pick(q.device, width, softcap is not None)
        if name is None:
            raise ValueError("no flash interface supports these inputs: " + " | ".join(rejected))
        return name

    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                scale, causal, window=(-1, -1), softcap=None):
        """q (T, H, D), k (S, K, D), v (S, K, Dv) -> out (T, H, Dv), lse (H, T) float32 (``-inf``: no
        key); run at width ``P = max(D, Dv)`` (module docstring)."""
        P = _common_width(q.shape[-1], v.shape[-1])
        iface = self._interface(q, P, softcap)
        kw = kernel_arguments(scale=scale, causal=causal, window=window, softcap=softcap)
        out_THP, lse_HT = flash_varlen_fwd(
            _pad_to(q, P).contiguous(), _pad_to(k, P).contiguous(), _pad_to(v, P).contiguous(),
            cu_seqlens_q.int().contiguous(), cu_seqlens_k.int().contiguous(), int(max_seqlen_q), int(max_seqlen_k),
            kw["scale"], kw["is_causal"], kw["window_size_left"], kw["window_size_right"], kw["softcap"], iface)
        return _width(out_THP, v.shape[-1]), _contract_lse(lse_HT)

    def backward(self, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                 scale, causal, window=(-1, -1), softcap=None):
        """dout/out (T, H, Dv), lse (H, T) final -> dq (T, H, D), dk (S, K, D), dv (S, K, Dv) in float32
        (float64 for float64 inputs) as the contract says: the ring's accumulation dtype, so it adopts
        them without a copy. The kernels write the input dtype; the upcast is exact. Run at width
        ``P = max(D, Dv)`` (module docstring)."""
        P = _common_width(q.shape[-1], v.shape[-1])
        iface = self._interface(q, P, softcap)
        kw = kernel_arguments(scale=scale, causal=causal, window=window, softcap=softcap)
        acc = accumulation_dtype(q.dtype)
        grads = flash_varlen_bwd(
            _pad_to(dout, P).contiguous(), _pad_to(q, P).contiguous(), _pad_to(k, P).contiguous(),
            _pad_to(v, P).contiguous(), _pad_to(out, P).contiguous(), _kernel_lse(lse, INTERFACES[iface].empty_lse),
            cu_seqlens_q.int().contiguous(), cu_seqlens_k.int().contiguous(), int(max_seqlen_q), int(max_seqlen_k),
            kw["scale"], kw["is_causal"], kw["window_size_left"], kw["window_size_right"], kw["softcap"], iface)
        return tuple(_width(g, x.shape[-1]).to(acc) for g, x in zip(grads, (q, k, v)))
