"""Key selections: what an adapted indexer (:mod:`.adapters.indexers`) hands cp_flash's attention, and the mask
objects it reads them through.

:class:`MaskRows` and :class:`SelectingMask` are what a cp_flash mask gives an indexer's own code in place of
a dense mask; :class:`KeySelection` is what Qwen4's block indexer returns through it; a DSA indexer's
``indices`` are marked global (:func:`global_selection`) and cp_flash reads only marked ones.
:func:`canonical_topk` breaks ties the same way on one device and under every layout.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from . import state

__all__ = ["MaskRows", "KeySelection", "SelectingMask", "canonical_topk", "CanonicalTopk", "global_selection"]


class MaskRows:
    """``cp_flash_mask[:, 0]`` (a DSA layer hands its indexer the mask's rows, (B, S, T)): stands for
    those rows until an adapted indexer reads them; any other use raises as the mask itself does."""

    __slots__ = ("mask",)

    def __init__(self, mask):
        self.mask = mask

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        self.mask._misused(f"[:, 0].{name} (an indexer cp_flash does not adapt)")

    def __getitem__(self, index):
        self.mask._misused("[:, 0] indexed again")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        rows = next(a for a in (*args, *(kwargs or {}).values()) if isinstance(a, MaskRows))
        rows.mask._misused(f"[:, 0] in torch.{getattr(func, '__name__', func)}")

    def _arith(self, other):
        self.mask._misused("[:, 0] in arithmetic")

    __add__ = __radd__ = __and__ = __rand__ = __or__ = __invert__ = __eq__ = _arith


class KeySelection:
    """What an adapted block indexer returns for a :class:`SelectingMask`: ``key_select`` (B, S, k) int64
    global key indices per query (``-1``: none)."""

    __slots__ = ("key_select",)

    def __init__(self, key_select: torch.Tensor):
        self.key_select = key_select


class SelectingMask:
    """A cp_flash mask as an adapted block-indexer attention sees it: its indexer reads the mask's
    documents from it, ``dtype`` says boolean (so the family's code ANDs its selection in) and
    ``mask & KeySelection`` gives back the cp_flash mask carrying the selection. Anything else raises
    as the mask itself does."""

    __slots__ = ("mask",)
    dtype = torch.bool

    def __init__(self, mask):
        self.mask = mask

    def __and__(self, other):
        if not isinstance(other, KeySelection):
            self.mask._misused("& a tensor")
        return self.mask.with_selection(other.key_select)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        self.mask._misused(f".{name}")

    def __getitem__(self, index):
        self.mask._misused("indexing")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        mask = next(a for a in (*args, *(kwargs or {}).values()) if isinstance(a, SelectingMask))
        mask.mask._misused(f"torch.{getattr(func, '__name__', func)}")


def canonical_topk(scores: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
    """``torch.topk`` with ties broken one way: among equal scores the lower index comes first (a
    stable sort), so the same scores select the same keys whatever the row's length or layout.
    Returns ``torch.return_types.topk`` (``.values``, ``.indices``), sorted."""
    values, indices = torch.sort(scores, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


class CanonicalTopk(TorchFunctionMode):
    """Inside an adapted indexer's forward: ``topk`` calls are :func:`canonical_topk`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.topk, torch.Tensor.topk):
            return canonical_topk(*args, **kwargs)
        return func(*args, **kwargs)


def global_selection(selection) -> bool:
    """Whether ``selection`` (an ``indices=`` tensor a layer hands cp_flash) is an adapted indexer's
    choice of global keys."""
    return isinstance(selection, torch.Tensor) and selection in state.INDEXER_SELECTIONS
