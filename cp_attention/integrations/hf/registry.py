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
  DeltaNet; :mod:`.mixers`): wrappers that call the original unchanged except for the tagged mixers
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

import dataclasses

import importlib
import re
import sys
from dataclasses import dataclass, field, fields
from types import MappingProxyType

import torch

from .token_trace import stand_in_attention, tracing
from . import state
from ..patches import patch, record
from ...engine.layer import LayerDocs, attend_layer, compiling_outside_cp, layer_mask_batch
from ...masks import MaskSpec
from ...refusals import refuse
from .adapters.indexers import MaskRows, SelectingMask, global_selection
from .adapters.compressed import adapt_module as adapt_compressed
from .adapters.compressed import take_selection
from .generation import decode_attention, running_decode
from .adapters.indexers import adapt_module as adapt_indexers
from .adapters.router_loss import adapt_module as adapt_loss_functions
from .adapters.mixer_functions import adapt_module as adapt_mixer_functions
from .adapters.mixer_classes import adapt_module as adapt_mixer_classes
from .check import guard_position_start, guard_sub_model, install_guard, layer_position_ids, note_cp_flash_call
from .models import config_crc, layer_mask, text_config
from .versions import check_version
from .overlays import check_spans, mask_pairs, overlay_structure, probe_adjacent, probe_whole_mask

__all__ = ["NAME", "CPMask", "cp_flash_attention", "cp_flash_mask", "register", "FLASH_NAME_SITES",
           "adapted_sites"]

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


_UNPROBED = object()  # CPMask.sees_no_later_key not computed yet

@dataclass(eq=False)
class CPMask:
    """What "cp_flash" layers receive as ``attention_mask``: sizes, offsets and O(L) metadata.

    ``q_offset``/``kv_offset``: absolute position of the first query / key (non-zero after a KV
    cache; a sliding-window cache keeps only the last keys). ``valid`` (B, T) bool: the 2D padding
    mask over absolute positions, or None. ``opens`` (B, Lq) bool: document starts transformers
    itself detected in packed ``position_ids`` (no KV cache only), or None. ``local_size``: the
    window (or chunk) transformers' sliding-window (chunked) mask builder applies, None for a full
    mask: a layer whose module passes no ``sliding_window`` (Qwen2-MoE, PhiMoE: the window lives
    only in the mask) takes its window from here. ``mask_function``: transformers' own mask function, probed by
    :meth:`sees_no_later_key` for layers that declare themselves bidirectional. ``span_next`` (B, Lq)
    bool: one device, no KV cache: query ``i`` sees key ``i + 1`` (the bidirectional spans of
    :mod:`.overlays`), or None when no query sees a later key. ``key_select`` (B, Lq, k): one layer's
    copy of the mask carrying the global keys its block indexer selected (:meth:`with_selection`), or None.
    """

    batch_size: int
    q_length: int
    kv_length: int
    q_offset: int
    kv_offset: int
    valid: torch.Tensor | None
    opens: torch.Tensor | None
    batch: object = field(default=None, repr=False)
    local_size: int | None = None
    family: str = ""
    mask_function: object = field(default=None, repr=False)
    span_next: torch.Tensor | None = field(default=None, repr=False)
    key_select: torch.Tensor | None = field(default=None, repr=False)
    _no_later_key: object = field(default=_UNPROBED, repr=False)
    _checked: dict = field(default_factory=dict, repr=False)

    def opens_spans(self, window: int | None) -> bool:
        """Whether a causal layer with this mask (and its own ``window``) opens bidirectional spans
        (:mod:`.overlays`). One device: the probed ``span_next`` holds some, checked against the span
        model once per window (an overlay of another shape raises NotImplementedError). Under context
        parallelism, where the function is the shard's: it contains transformers' block overlay (the
        batch's spans, which ``cp.shard_batch(..., model=model)`` reads, then apply); any other
        overlay raises NotImplementedError naming it, on every rank (the function has the same shape
        on each)."""
        if torch.compiler.is_compiling():
            # traced on one device: the probe is a tensor (no data-dependent branch); a layer opening no
            # span plans as without spans, and the span model's check runs eagerly only. Traced inside
            # context parallelism the function cannot be read: the multi-rank op refuses batches with spans
            return self.span_next is not None if compiling_outside_cp() else False
        if window in self._checked:
            return self._checked[window]
        if self.span_next is not None:
            check_spans(self.mask_function, self.span_next, window, self.family)
            opens = True
        elif getattr(getattr(self.batch, "cp", None), "world_size", 1) > 1:
            opens, foreign, windowed, ids = overlay_structure(self.mask_function)
            if opens and not getattr(self.batch, "spans_read", True) and not any(bool((t >= 0).any()) for t in ids):
                # shard_batch read no spans (no model=) and this rank's tokens hold no block (Gemma 4-unified
                # hands its overlay ids of -1 on text): nothing opens here. A rank whose tokens hold one
                # refuses the batch (the engine's local error), and every rank with it
                opens = False
            if opens and window is not None and not windowed:
                _refuse_spans_past_window(self.batch, window, self.family)
            if foreign:
                raise refuse("foreign_mask_overlay", family=self.family or "this model",
                             functions=", ".join(sorted(set(foreign))))
        else:
            opens = False
        self._checked[window] = opens
        return opens

    def check_window(self, window: int) -> None:
        """One device: transformers' mask function hides every key ``window`` or more positions before
        its query, as the layer's window does (probed on those pairs, O(B * L), once per window). A
        mask that shows some (an overlay OR-ed over the window: unlimited_ocr's prefill keys) raises
        NotImplementedError instead of being cut to the window. Under context parallelism the shard's
        function is read by its structure instead (:meth:`opens_spans`); traced by torch.compile the
        probe does not run (it would break the graph): such a model is refused when run eagerly."""
        if torch.compiler.is_compiling():
            return
        key = ("window", window)
        if key in self._checked or self.mask_function is None or \
                getattr(getattr(self.batch, "cp", None), "world_size", 1) > 1:
            return
        self._checked[key] = True
        first = max(self.kv_offset + window - self.q_offset, 0)
        if first >= self.q_length:  # no query has a key `window` or more positions back
            return
        q = torch.arange(first, self.q_length) + self.q_offset
        if q.numel() and bool(mask_pairs(self.mask_function, self.batch_size, q, q - window).any()):
            raise refuse("overlay_past_window", family=self.family or "this model", window=window)

    @torch.compiler.disable
    def sees_no_later_key(self) -> bool | None:
        """Whether transformers' mask function lets no query see the key right after it, in any row:
        a causal mask (probed on the (query, next key) pairs, O(B * L), once per mask; eager under
        torch.compile). None when there is nothing to probe. A layer whose module says it is
        bidirectional (``is_causal = False``: BigBird-Pegasus's decoder, which leaves the flag at its
        default) but is handed a causal mask attends causally under eager, which follows the mask."""
        if self._no_later_key is _UNPROBED:
            self._no_later_key = _probe_no_later_key(self.mask_function, self.batch_size, self.q_length,
                                                     self.q_offset, self.kv_offset + self.kv_length)
        return self._no_later_key

    # generate() with a static cache prepares the masks in advance; models that build one mask (no
    # ``layer_types``: Mistral, Phi-3) hand it back to ``create_*_mask``, whose argument check reads
    # ``.ndim`` and only treats ``ndim == 2`` as a padding mask: a CPMask stands for a prepared mask.
    ndim = 4

    def contiguous(self) -> CPMask:
        """transformers' generation calls ``.contiguous()`` on prepared masks: nothing to do."""
        return self

    # Any other use is model code treating the mask as a dense tensor (adding it to scores as a bias,
    # slicing it, reading its dtype): a CPMask must never stand in for one silently.
    def _misused(self, how: str):
        family = self.family or "this model"
        raise refuse("mask_used_as_tensor", family=family, how=how)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        flat = [a for a in (*args, *(kwargs or {}).values())]
        flat += [b for a in flat if isinstance(a, (list, tuple)) for b in a]
        mask = next((a for a in flat if isinstance(a, CPMask)), None)
        (mask or CPMask(0, 0, 0, 0, 0, None, None))._misused(f"torch.{getattr(func, '__name__', func)}")

    def __getattr__(self, name):
        if name.startswith("__") or name in _CPMASK_FIELDS:
            raise AttributeError(name)
        self._misused(f".{name}")

    def selecting(self) -> SelectingMask:
        """This mask as an attention whose block indexer is adapted hands it around (:mod:`.indexers`)."""
        return SelectingMask(self)

    def with_selection(self, key_select: torch.Tensor) -> CPMask:
        """This mask for one layer, with the keys its block indexer selected (B, Lq, k) global indices."""
        return dataclasses.replace(self, key_select=key_select)

    def __getitem__(self, index):
        if _is_rows_index(index):  # a DSA layer hands its indexer the mask's rows: read by the adapted indexers
            return MaskRows(self)
        self._misused("indexing")

    def _arith(self, other):
        self._misused("arithmetic")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __and__ = __rand__ = __or__ = __ror__ = _arith
    __lt__ = __le__ = __gt__ = __ge__ = __invert__ = __neg__ = _arith


_CPMASK_FIELDS = frozenset(f.name for f in fields(CPMask))  # looked up before __init__ (copy): AttributeError


def _is_rows_index(index) -> bool:
    """``[:, 0]`` or ``[:, 0, :, :]``: the (B, S, T) rows of a (B, 1, S, T) mask."""
    if not isinstance(index, tuple) or len(index) not in (2, 4) or index[1] != 0 or isinstance(index[1], bool):
        return False
    return all(isinstance(i, slice) and i == slice(None) for i in index[:1] + index[2:])


def _probe_no_later_key(mask_function, batch_size: int, q_length: int, q_offset: int, kv_end: int) -> bool | None:
    """For :meth:`CPMask.sees_no_later_key`: no query sees the key after it (probed on every row)."""
    if mask_function is None:
        return None
    q_idx = torch.arange(q_offset, q_offset + q_length)
    q_idx = q_idx[q_idx + 1 < kv_end]
    if q_idx.numel() == 0:
        return None
    return not bool(mask_pairs(mask_function, batch_size, q_idx, q_idx + 1).any())


def cp_flash_mask(*, batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                  mask_function=None, attention_mask: torch.Tensor | None = None, local_size: int | None = None,
                  **kwargs) -> CPMask:
    """The mask function registered for "cp_flash": returns a :class:`CPMask`, never (L x L) data."""
    decoding = running_decode()
    if decoding is not None:  # a decode step over a sharded cache: its attention reads the cache's positions
        if isinstance(attention_mask, torch.Tensor):  # and this padding mask
            decoding.valid = attention_mask.detach().to(torch.bool)
        return None
    if isinstance(attention_mask, CPMask):  # prepared by generate for this forward: keep its padding
        attention_mask = attention_mask.valid
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"cp_flash expects a 2D (B, L) padding mask; got a {attention_mask.dim()}D attention_mask")
    family = str(getattr(kwargs.get("config"), "model_type", "") or "")
    if not torch.compiler.is_compiling():
        info = _bound_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask)
        info.local_size = None if local_size is None else int(local_size)
        info.family = family
        return info
    if not compiling_outside_cp():
        # traced inside context parallelism: the layers' op binds the batch when it runs, from the raw
        # padding mask (the tensor shard_batch returned) kept in ``valid``
        return CPMask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=int(q_offset),
                      kv_offset=int(kv_offset), valid=attention_mask, opens=None, batch=None,
                      local_size=None if local_size is None else int(local_size), family=family,
                      mask_function=mask_function)
    # traced by torch.compile outside context parallelism: no data-dependent branch, no bookkeeping (the
    # single-device op notes the forward's plans itself)
    opens = span_next = None
    if q_offset == 0 and kv_offset == 0 and q_length == kv_length:
        opens = probe_adjacent(mask_function, batch_size, q_length, later=False)
        span_next = probe_adjacent(mask_function, batch_size, q_length, later=True)
    return CPMask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=int(q_offset),
                  kv_offset=int(kv_offset), valid=None if attention_mask is None else attention_mask.detach().bool(),
                  opens=opens, batch=layer_mask_batch(attention_mask, batch_size, q_length),
                  local_size=None if local_size is None else int(local_size), family=family,
                  mask_function=mask_function, span_next=span_next)


@torch.compiler.disable
def _bound_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask) -> CPMask:
    """The mask of a forward that may run under context parallelism; eager (torch.compile breaks the
    graph here: the active context is a contextvar and the forward's bookkeeping thread-local)."""
    valid = None
    if attention_mask is not None:
        valid = attention_mask.detach().to(torch.bool)
        if bool(valid.all()):
            valid = None
    batch = layer_mask_batch(attention_mask, batch_size, q_length)  # also starts the forward's statistics
    opens, span_next = (None, None) if q_offset or kv_offset or q_length != kv_length else \
        probe_whole_mask(mask_function, batch, batch_size, q_length)
    return CPMask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=int(q_offset),
                  kv_offset=int(kv_offset), valid=valid, opens=opens, batch=batch, mask_function=mask_function,
                  span_next=span_next)


# ----------------------------------------------------------------------------------------------
# the attention function


def layer_mask_spec(module, *, sliding_window=None, softcap=None, scaling=None, is_causal=None,
                    mask_window: int | None = None, mask_causal=None, mask_spans=None) -> MaskSpec:
    """The MaskSpec of one transformers attention layer: causal from the call or ``module.is_causal``
    (a layer declared bidirectional is causal when its mask is: ``mask_causal``, a callable,
    :meth:`CPMask.sees_no_later_key`), chunks from the configuration (:func:`~.models.layer_mask`),
    the window the layer passes, else the one its causal mask applies (``mask_window``:
    :attr:`CPMask.local_size`; not on chunked layers, whose builder reports the chunk there), and
    whether a causal layer's mask opens bidirectional spans (``mask_spans(window)``, a callable:
    :meth:`CPMask.opens_spans`)."""
    config = getattr(module, "config", None)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if not causal and mask_causal is not None and mask_causal():
        causal = True  # eager follows the mask, not the flag
    chunk = None if config is None else layer_mask(text_config(config), getattr(module, "layer_idx", None)).chunk_size
    window = int(sliding_window) if sliding_window is not None else None
    if window is None and mask_window is not None and chunk is None and causal:
        # transformers' causal sliding mask keeps 0 <= q - k < local_size: the MaskSpec window's meaning
        # (its bidirectional builder counts local_size differently; those layers pass their window)
        window = int(mask_window)
    spans = bool(causal) and chunk is None and mask_spans is not None and mask_spans(window)
    return MaskSpec(causal=bool(causal), window=window, chunk_size=chunk,
                    softcap=float(softcap) if softcap is not None else None,
                    scale=float(scaling) if scaling is not None else None, spans=spans)


def _llama4_temperature(positions: torch.Tensor, module) -> torch.Tensor:
    """Llama 4's NoPE attention temperature for absolute positions (its own formula)."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0


def _llama4_adjust(module):
    """Llama 4 scales NoPE-layer queries by a temperature of ``arange(local length)``; on a shard the
    true positions are global: the engine calls the returned function with them, which rescales by
    temperature(global) / temperature(local) (1 wherever the temperature does not change, i.e. below
    ``floor_scale``). None for every other layer."""
    if not (getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True)):
        return None

    def adjust(q_BLHD: torch.Tensor, positions_L: torch.Tensor) -> torch.Tensor:
        L = q_BLHD.shape[1]
        ratio = _llama4_temperature(positions_L, module) / _llama4_temperature(torch.arange(L), module)
        if bool((ratio == 1).all()):
            return q_BLHD
        return (q_BLHD * ratio.to(q_BLHD.device, torch.float32).view(1, L, 1, 1)).to(q_BLHD.dtype)

    return adjust


def _autocast(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Under autocast, q, k and v in the autocast dtype (as sdpa computes them): a float32 model under
    bf16 autocast hands over float32 queries and keys (RoPE upcasts) but bfloat16 values."""
    dtypes = {t.dtype for t in tensors}
    device = tensors[0].device.type
    if len(dtypes) == 1 or not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) for t in tensors)


def _refuse_spans_past_window(batch, window: int, family: str) -> None:
    """Under context parallelism, a layer whose mask ORs the block overlay over its sliding window
    (:func:`~.overlays.overlay_structure`: a block seen whole, however far its first key lies behind a
    query): a bidirectional span of the batch longer than the window is refused (the engine cuts
    spans to the window); shorter ones are the same mask either way."""
    meta = getattr(batch, "meta", None)
    longest = max((int((e - s).max()) for s, e in (getattr(meta, "spans", None) or ()) if len(s)), default=0)
    if longest > window:  # (spans end exclusively) its last token is `window` or more past its first
        raise refuse("span_longer_than_window", longest=longest, window=window, family=family or "this model")


SELECTION_ARGUMENT = re.compile(r"(^|_)indices$")
"""Keyword names of a selection of keys per query (DSA's ``indices``, MiniMax-M3's ``block_indices``)."""
SCORE_ARGUMENTS = frozenset({"sinks", "position_bias", "alibi", "attention_bias", "attn_bias", "score_bias"})
"""Keyword names of a tensor added to the scores whatever its shape (Inkling2's per-query ``sinks`` (B, H, Lq, 1);
cp_flash's own sinks are the ``s_aux`` parameter)."""


def _refuse_score_tensors(kwargs: dict, q_length: int, kv_length: int, info) -> None:
    """A keyword tensor over (query, key) pairs, ``(..., Lq, Lk)`` with at least 3 dims, is a score
    bias or a dense mask (Inkling's relative-position ``position_bias``), and one named ``indices``
    or ``*_indices`` is a sparse-attention indexer's selection of keys: cp_flash cannot apply either,
    so the layer raises instead of dropping it."""
    for name, value in kwargs.items():
        if not isinstance(value, torch.Tensor):
            continue
        family = (info.family if info is not None else "") or "this model"
        if name == "indices" and global_selection(value):  # an adapted DSA indexer's choice: read as key_select
            continue
        if SELECTION_ARGUMENT.search(name):  # DSA's indices=, MiniMax-M3's block_indices=: keys chosen per query
            raise refuse("selected_keys_argument", family=family, name=name, shape=tuple(value.shape))
        if name in SCORE_ARGUMENTS or (value.dim() >= 3 and tuple(value.shape[-2:]) == (q_length, kv_length)):
            raise refuse("score_tensor_argument", family=family, name=name, shape=tuple(value.shape))


def cp_flash_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                       dropout: float = 0.0, scaling: float | None = None, sliding_window: int | None = None,
                       softcap: float | None = None, s_aux: torch.Tensor | None = None, **kwargs):
    """The attention function registered for "cp_flash".

    query (B, H, Lq, D), key/value (B, H_kv, Lk, D) (GQA not repeated) -> ((B, Lq, H, D), None).
    """
    if tracing():  # the model check's trace: what cp_flash refuses in the call, else it answers per token
        if isinstance(attention_mask, torch.Tensor):
            raise refuse("dense_mask", shape=tuple(attention_mask.shape),
                         family=str(getattr(getattr(module, "config", None), "model_type", "") or "this model"))
        _refuse_score_tensors(kwargs, query.shape[2], key.shape[2],
                              attention_mask if isinstance(attention_mask, CPMask) else None)
        return stand_in_attention(query, key, value), None
    if dropout and getattr(module, "training", False):
        raise refuse("attention_dropout", dropout=dropout)
    decoding = running_decode()
    if decoding is not None:  # a decode step over the KV cache sharded by .generation
        spec = layer_mask_spec(module, sliding_window=sliding_window, softcap=softcap, scaling=scaling)
        return decode_attention(decoding, spec, *_autocast(query, key, value), s_aux, cached=key), None
    if isinstance(attention_mask, torch.Tensor):
        family = str(getattr(getattr(module, "config", None), "model_type", "") or "this model")
        raise refuse("dense_mask", shape=tuple(attention_mask.shape), family=family)
    info = attention_mask if isinstance(attention_mask, CPMask) else None
    tower = guard_sub_model(module)
    if tower is not None:
        raise refuse("sub_model_attention", tower=tower)
    note_cp_flash_call(module)
    if info is not None and not getattr(info.batch, "positions_given", True) and guard_position_start():
        raise refuse("position_start", family=info.family or "this model", start=guard_position_start())
    query, key, value = _autocast(query, key, value)
    _refuse_score_tensors(kwargs, query.shape[2], key.shape[2], info)
    spec = layer_mask_spec(module, sliding_window=sliding_window, softcap=softcap, scaling=scaling,
                           is_causal=kwargs.get("is_causal"), mask_window=info.local_size if info is not None else None,
                           mask_causal=info.sees_no_later_key if info is not None else None,
                           mask_spans=info.opens_spans if info is not None else None)
    if info is not None and spec.window is not None and spec.chunk_size is None:
        info.check_window(spec.window)
    collator = kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None
    position_ids = layer_position_ids(module, kwargs.get("position_ids"), collator)
    if info is None:
        docs = LayerDocs(cu_seqlens=kwargs.get("cu_seq_lens_q"), collator_documents=collator)
    else:
        docs = LayerDocs(mask=True, batch=info.batch, q_offset=info.q_offset,
                         kv_offset=info.kv_offset, kv_length=info.kv_length, valid=info.valid, opens=info.opens,
                         cu_seqlens=kwargs.get("cu_seq_lens_q"), collator_documents=collator,
                         span_next=info.span_next if spec.spans else None)
    extra_kv = None
    recorded = take_selection(module) if getattr(module, "compressor", None) is not None else None
    if recorded is not None:  # DeepSeek-V4: the window's tokens, then the compressed entries (.compressed)
        kwargs["indices"], entries = recorded
        S = key.shape[2] - entries
        key, value, extra_kv = key[:, :, :S], value[:, :, :S], (key[:, :, S:].transpose(1, 2),
                                                                value[:, :, S:].transpose(1, 2))
    key_select = kwargs.get("indices")  # DeepSeek Sparse Attention: the keys each query selected (.indexers)
    if info is not None and info.key_select is not None:  # Qwen4's block indexer: carried by the mask
        key_select = info.key_select
    if key_select is not None:
        if spec.spans and info is not None and info.span_next is not None and bool(info.span_next.any()):
            raise refuse("selection_with_spans", family=info.family or "this model")
        # spans=True without any span: a compiled one-device mask that may open some (the probe is a tensor)
        spec = dataclasses.replace(spec, selection=True, spans=False)
    out = attend_layer(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), spec,
                       position_ids=position_ids, docs=docs, sinks=s_aux,
                       layer=getattr(module, "layer_idx", None), model_crc=lambda: config_crc(module),
                       adjust_q=_llama4_adjust(module), key_select=key_select, extra_kv=extra_kv)
    return out, None


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
    tells whether that class reaches cp_flash), its sequence-mixer functions run across ranks
    under context parallelism (:mod:`.mixers`), and so does its MoE router loss (:mod:`.losses`).
    Returns whether anything was adapted."""
    adapted = _wrap_flash_name_check(mod) if hasattr(mod, "is_flash_attention_requested") else False
    adapted = adapt_mixer_functions(mod) or adapted
    adapted = adapt_mixer_classes(mod) or adapted
    adapted = adapt_loss_functions(mod) or adapted
    adapted = adapt_indexers(mod) or adapted
    adapted = adapt_compressed(mod) or adapted
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
