"""The adapter interface: what one adapted thing of transformers' modeling code tells the rest of the wing.

An adapter adapts something a modeling module computes along the sequence outside the attention interface
(module-level mixer functions, a mixer class's method, an indexer, a compressor, a router loss, a rotary
module), so that under context parallelism it computes across ranks what it computes on one device. The wing
reads every adapter through this interface only, looping over the table of :mod:`.adapters`
(``ADAPTERS``): the registry calls :meth:`Adapter.adapt` on each modeling module as it loads, the model
check adds :meth:`Adapter.findings`, the guard calls :meth:`Adapter.prepare` before a model's first forward
under context parallelism, the trace and verification ask :meth:`Adapter.stands_in` and
:meth:`Adapter.computes`, and cp_flash's attention function hands each layer call to
:meth:`Adapter.layer_call`. None of them names an adapter.

Adding an adapter is one file in this folder with a module-level ``ADAPTER`` (an instance of a subclass of
:class:`Adapter`) and one row in the table; every change it makes to foreign code goes through
:func:`cp_attention.integrations.patches.patch` or ``record`` under a site of ``patches.SITES``, after the
admission check that the site names passed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch

__all__ = ["Adapter", "LayerCall"]


@dataclass
class LayerCall:
    """One cp_flash attention call, as an adapter may amend it before the engine runs it.

    ``module``: the attention module; ``key``/``value`` (B, H_kv, Lk, D) as the layer handed them;
    ``kwargs``: the call's keyword arguments; ``key_select``: the keys each query selected (global key
    indices), or None; ``extra_kv``: keys and values (B, E, H_kv, D) every query of a row may see besides its
    own, or None; ``latent``: a :class:`~cp_attention.strategies.latent.LatentKV` whose expansion ``key`` and
    ``value`` are (multi-head latent attention), or None."""

    module: torch.nn.Module
    key: torch.Tensor
    value: torch.Tensor
    kwargs: dict = field(default_factory=dict)
    key_select: object = None
    extra_kv: tuple | None = None
    latent: object = None


class Adapter:
    """One adapted thing (see the module docstring). Every method has a default that does nothing, so an
    adapter implements only what it contributes. ``name``: its row in the table; ``sites``: the keys of
    ``patches.SITES`` under which it changes foreign code; ``adapts`` and ``admission``: what it adapts and how
    it admits it, in words."""

    name: str = ""
    sites: tuple[str, ...] = ()
    adapts: str = ""
    """What it adapts: module functions, a class's method, ... (docs/patches.md's table of adapters)."""
    admission: str = ""
    """How it admits a foreign object before adapting it: the behavioural check that must pass."""

    def adapt(self, mod) -> bool:
        """Adapt the modeling module ``mod`` as it loads (idempotent); whether anything of it was adapted."""
        return False

    def findings(self, modules: list) -> Iterable[tuple[str, str, str]]:
        """The model check's rules of this adapter over ``modules`` ((name, module) pairs of a model's text
        sequence): ``(where, what, why)`` for what it cannot compute and a forward on one device cannot show."""
        return ()

    def prepare(self, model, modules: list) -> None:
        """Before ``model``'s first forward under context parallelism (once per model object): mark or hook
        the instances this adapter computes across ranks."""

    def computes(self, module) -> bool:
        """Whether this adapter computes ``module``'s sequence mixing across ranks (verification at first use
        then compares the model's outputs under context parallelism with one device's)."""
        return False

    def stands_in(self, module) -> bool:
        """Whether the model check's trace replaces ``module``'s output by a per-token stand-in: its mixing
        is this adapter's, computed across ranks (the trace reads everything around it)."""
        return False

    def layer_call(self, call: LayerCall) -> None:
        """Amend one cp_flash attention call (what the layer's adapted parts recorded for it)."""
