"""Backends implementing the varlen contract, and the dispatcher that picks one."""

from __future__ import annotations

import torch

from ..masks import MaskSpec
from .base import VarlenBackend
from .flash import FlashBackend
from .reference import ReferenceBackend

__all__ = ["VarlenBackend", "BACKENDS", "select_backend"]

BACKENDS: dict[str, VarlenBackend] = {"flash": FlashBackend(), "reference": ReferenceBackend()}
AUTO_ORDER = ("flash", "reference")  # "auto" takes the first that supports the inputs


def select_backend(name: str, *, device: torch.device, dtype: torch.dtype, head_dim: int,
                   spec: MaskSpec) -> VarlenBackend:
    """The backend called ``name`` (or the first suitable one for ``"auto"``).

    Raises ValueError naming every rejected backend and its reasons when none fits.
    """
    if name != "auto" and name not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {sorted(BACKENDS)}, got {name!r}")
    candidates = AUTO_ORDER if name == "auto" else (name,)
    rejected = []
    for candidate in candidates:
        backend = BACKENDS[candidate]
        reasons = backend.not_supported_reasons(device=device, dtype=dtype, head_dim=head_dim, spec=spec)
        if not reasons:
            return backend
        rejected.append(f"{candidate}: {'; '.join(reasons)}")
    raise ValueError("no attention backend supports these inputs: " + " | ".join(rejected))
