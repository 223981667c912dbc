"""Backends implementing the varlen contract, and the dispatcher that picks one."""

from __future__ import annotations

import logging
from types import MappingProxyType

import torch

from ..masks import MaskSpec
from .base import VarlenBackend
from .cpu import CPUFlashBackend
from .flash import FlashBackend
from .reference import ReferenceBackend
from .triton import TritonBackend

__all__ = ["VarlenBackend", "BACKENDS", "select_backend"]

BACKENDS: dict[str, VarlenBackend] = {"flash": FlashBackend(), "triton": TritonBackend(),
                                      "cpu": CPUFlashBackend(), "reference": ReferenceBackend()}
AUTO_ORDER = ("flash", "triton", "cpu", "reference")  # "auto" takes the first that supports the inputs
# "auto" never picks Triton's CPU interpreter (a testing tool, orders of magnitude slower than the
# reference); name backend="triton" to use it
AUTO_DEVICES = MappingProxyType({"triton": ("cuda",)})

log = logging.getLogger(__name__)


def select_backend(name: str, *, device: torch.device, dtype: torch.dtype, head_dim: int,
                   spec: MaskSpec, head_dim_v: int | None = None) -> VarlenBackend:
    """The backend called ``name`` (or the first suitable one for ``"auto"``) for q/k of ``head_dim``
    and v of ``head_dim_v`` (None: ``head_dim``).

    Raises ValueError naming every rejected backend and its reasons when none fits.
    """
    if name != "auto" and name not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {sorted(BACKENDS)}, got {name!r}")
    candidates = AUTO_ORDER if name == "auto" else (name,)
    rejected = []
    for candidate in candidates:
        backend = BACKENDS[candidate]
        reasons = backend.not_supported_reasons(device=device, dtype=dtype, head_dim=head_dim, spec=spec,
                                                head_dim_v=head_dim_v)
        if name == "auto" and candidate in AUTO_DEVICES and torch.device(device).type not in AUTO_DEVICES[candidate]:
            reasons = reasons + [f"'auto' uses {candidate} only on {', '.join(AUTO_DEVICES[candidate])}"]
        if not reasons:
            if log.isEnabledFor(logging.DEBUG):
                log.debug("backend %r for %s (asked %r: %s, %s, head_dim %d, v head_dim %d)%s", candidate,
                          getattr(backend, "describe", lambda **kw: candidate)(
                              device=device, dtype=dtype, head_dim=head_dim, spec=spec, head_dim_v=head_dim_v),
                          name, torch.device(device).type, dtype, head_dim, head_dim_v or head_dim,
                          f"; rejected {' | '.join(rejected)}" if rejected else "")
            return backend
        rejected.append(f"{candidate}: {'; '.join(reasons)}")
    raise ValueError("no attention backend supports these inputs: " + " | ".join(rejected))
