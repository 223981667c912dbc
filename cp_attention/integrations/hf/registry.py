"""transformers integration: ``attn_implementation="cp_flash"``.

Importing :mod:`cp_attention` registers the name as soon as transformers' ``modeling_utils`` is
imported (lazily, so ``import cp_attention`` stays cheap). Registration installs:

* an attention function that turns ``(module, query, key, value, attention_mask, **kwargs)`` into one
  :class:`~cp_attention.masks.MaskSpec` per layer (causal or bidirectional from ``module.is_causal``,
  ``sliding_window``, chunked layers from ``config.layer_types``, ``softcap``, sinks ``s_aux``,
  ``scaling``) and runs the engine: under an active :func:`~cp_attention.context_parallel` group
  of several ranks with the documents recorded by ``cp.shard_batch``; otherwise on one device;
* a mask function that returns a small :class:`CPMask` (offsets, the 2D padding mask, document
  starts transformers detected) instead of an (L x L) mask;
* the adaptations transformers needs because the name contains "flash" (it would otherwise look
  for a flash-attn package or hub kernel, swap gpt-oss to a hub kernel, refuse chunked masks...).
  They replace ``is_flash_attention_requested`` in the modules listed in :data:`FLASH_NAME_SITES`
  by a wrapper that answers False for "cp_flash" only, for transformers >= 5.17 and < 6;
* the sequence-mixer functions of each modeling module (short convolutions, Mamba, Mamba-2, gated
  DeltaNet; :mod:`.adapters.mixer_functions`): wrappers that call the original unchanged except for the tagged mixers
  of a "cp_flash" model under context parallelism, which then run across ranks and documents.
Nothing else of transformers is changed: losses, other attention implementations and models that
do not use "cp_flash" behave exactly as without ``import cp_attention``.

This module only translates: kwargs -> MaskSpec, the tensor transposes, family quirks (Llama 4's
temperature), :class:`CPMask` and registration. Everything else (which batch a layer runs on, the
checks every rank raises together, the strategy) is the engine's one entry for integrations,
:func:`cp_attention.engine.attend_layer`; the rule by which a layer finds its batch is written down in
:mod:`cp_attention.engine.batch`.

``torch.compile``. On one device a layer is the custom op of :mod:`cp_attention.engine.local`, which gets
the documents as tensors and builds its plan inside: traced outside context parallelism, the mask
function and the layers contain nothing dynamo cannot trace (no data-dependent branch, no context
lookup), so a model compiles without a graph break and a new document layout does not recompile.
Whether a context is active is asked once per trace (dynamo cannot guard on a contextvar) and checked
again by the op when it runs. Traced inside context parallelism, a layer is the multi-rank op
(:func:`cp_attention.engine.layer.bound_attention`), which binds the batch, agrees, plans and runs the
strategy's exchanges when it runs: no graph break either, and no recompilation per batch. Llama 4's
layers (a query adjustment that is a function of the module) still run eagerly there, one break each.

Legend: ``B`` batch, ``L``/``Lq`` query tokens, ``Lk`` key tokens, ``H`` heads, ``D`` head dim.
"""

from __future__ import annotations

import importlib
import sys
from types import MappingProxyType

import torch

from . import state
from .adapters import ADAPTERS
from .attention import cp_flash_attention
from .guard import install_guard
from .masks import CPMask, cp_flash_mask
from .versions import check_version
from ..patches import patch, record

__all__ = ["NAME", "CPMask", "cp_flash_attention", "cp_flash_mask", "register", "FLASH_NAME_SITES",
           "adapted_sites", "adapt_modeling_module", "is_modeling_module"]

NAME = "cp_flash"
# Modules whose by-name import of is_flash_attention_requested treats any name containing "flash"
# as flash-attn, and what goes wrong for "cp_flash" there (transformers 5.17-5.23):
FLASH_NAME_SITES = MappingProxyType({
    "transformers.modeling_utils": "model init imports a flash package or hub kernel for the name and "
                                   "raises; gpt-oss swaps the name for a hub kernel",
    "transformers.masking_utils": "the chunked mask builder raises beyond one chunk (Llama 4)",
    "transformers.generation.utils": "generate keeps the all-ones padding mask with a static cache and "
                                     "turns off fullgraph compilation",
    "transformers.generation.continuous_batching.continuous_api": "continuous batching would run "
                                                                  "without masks",
    "transformers.generation.continuous_batching.initialization": "continuous batching setup",
    "transformers.generation.continuous_batching.cache": "continuous batching cache layout",
})


def adapted_sites() -> list[str]:
    """The modules whose flash-name check was adapted for "cp_flash" (for tests and diagnostics)."""
    with state.INTEGRATIONS_LOCK:
        return list(state.INTEGRATIONS["adapted_sites"])


# ----------------------------------------------------------------------------------------------
# the mask function: O(L) metadata instead of an (L x L) mask


# ----------------------------------------------------------------------------------------------
# the attention function


# ----------------------------------------------------------------------------------------------
# registration


def _adapt_flash_name_check(module_name: str) -> bool:
    try:
        mod = importlib.import_module(module_name)
    except ImportError:
        return False
    return _wrap_flash_name_check(mod)


def _wrap_flash_name_check(mod) -> bool:
    original = getattr(mod, "is_flash_attention_requested", None)
    if original is None:
        return False
    if getattr(original, "_cp_attention_wrapped", False):
        return True

    def is_flash_attention_requested(config=None, requested_attention_implementation=None, version=None, **kw):
        name = config._attn_implementation if config is not None else requested_attention_implementation
        if name == NAME:
            return False
        return original(config=config, requested_attention_implementation=requested_attention_implementation,
                        version=version, **kw)

    is_flash_attention_requested._cp_attention_wrapped = True
    is_flash_attention_requested.__wrapped__ = original
    patch(mod, "is_flash_attention_requested", is_flash_attention_requested, site="flash_name_check",
          admitted="versions.check_version")
    return True


def _is_class_table(value) -> bool:
    """A module-level {implementation name: attention class} table (Falcon, GPT-Neo, GIT, ...)."""
    return (isinstance(value, dict) and "eager" in value and NAME not in value
            and all(isinstance(name, str) and name in _IMPLEMENTATIONS for name in value)
            and all(isinstance(cls, type) and issubclass(cls, torch.nn.Module) for cls in value.values()))


_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention", "paged_attention")


def adapt_modeling_module(mod) -> bool:
    """Adapt one ``transformers.models.*.modeling_*`` module for "cp_flash", found generically: its
    by-name ``is_flash_attention_requested`` answers False for "cp_flash" (so no FlashAttention-2
    class is picked, with or without flash-attn installed), and every table of attention classes
    keyed by implementation name gets a "cp_flash" entry: its eager class (the model check then
    tells whether that class reaches cp_flash); then each adapter of the table (:mod:`.adapters`) adapts
    what it adapts there. Returns whether anything was adapted."""
    adapted = _wrap_flash_name_check(mod) if hasattr(mod, "is_flash_attention_requested") else False
    for adapter in ADAPTERS:
        adapted = adapter.adapt(mod) or adapted
    for value in list(vars(mod).values()):
        if _is_class_table(value):
            value[NAME] = value["eager"]
            record("class_tables", f"{mod.__name__} (a table of attention classes)[{NAME!r}]", value[NAME],
                   admitted="transformers._is_class_table")
            adapted = True
    if adapted:
        with state.INTEGRATIONS_LOCK:
            sites = state.INTEGRATIONS["adapted_sites"]
            if mod.__name__ not in sites:
                sites.append(mod.__name__)
    return adapted


def is_modeling_module(name: str) -> bool:
    """Whether ``name`` is a modeling (or configuration) module of a transformers model, adapted when imported:
    a configuration may check the implementation's name too (HRM-Text's prefix-LM check)."""
    return name.startswith("transformers.models.") and \
        name.rsplit(".", 1)[-1].startswith(("modeling_", "configuration_"))


def register() -> None:
    """Register "cp_flash" with transformers (idempotent). Called automatically once transformers'
    modeling code is imported after ``import cp_attention``."""
    with state.INTEGRATIONS_LOCK:
        if NAME in state.INTEGRATIONS["registered"]:
            return
    check_version()
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(NAME, cp_flash_attention)
    AttentionMaskInterface.register(NAME, cp_flash_mask)
    record("attention_registration", f"transformers.AttentionInterface[{NAME!r}]", cp_flash_attention,
           admitted="versions.check_version")
    record("attention_registration", f"transformers.AttentionMaskInterface[{NAME!r}]", cp_flash_mask,
           admitted="versions.check_version")
    adapted = [site for site in FLASH_NAME_SITES if _adapt_flash_name_check(site)]
    with state.INTEGRATIONS_LOCK:
        sites = state.INTEGRATIONS["adapted_sites"]
        sites.extend(site for site in adapted if site not in sites)
        state.INTEGRATIONS["registered"].add(NAME)
    # the modeling modules loaded already; later ones are adapted as they load (integrations.install)
    for name, mod in list(sys.modules.items()):
        if mod is not None and is_modeling_module(name):
            adapt_modeling_module(mod)
    install_guard()
