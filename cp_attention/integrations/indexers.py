"""Sparse-attention indexers under ``cp_flash``: DeepSeek Sparse Attention's lightning indexer and the
families that copy it, exact on one device and across ranks.

A DSA layer's indexer scores every query against every earlier key (one key head of 64-128 dims per
token) and keeps the top k; the layer then attends to those keys only (``indices=`` to the attention
interface, read by :func:`cp_attention.engine.layer.attend_layer` as a selection:
:mod:`cp_attention.strategies.select`). transformers 5.24 has seven such indexers with one forward
signature::

    forward(hidden_states, q_resid, position_embeddings, attention_mask, position_ids, cache=None)
                                       (MistralLarge4's has no q_resid)

    deepseek_v32, glm_moe_dsa, hy_v4, hy_v4_vl, axk2, dots3_note, mistral_large4

The only inputs of such an indexer that span the sequence are the keys it gets back from
``cache.update_indexer(k, layer_idx)`` and the rows of the layer's mask (``attention_mask[:, 0]``,
(B, S, T)); everything else is per query token. So when a modeling module loads, every class of it
that has this signature and calls ``update_indexer`` and ``topk`` gets a forward that, when its mask
is a ``cp_flash`` mask's rows (:class:`MaskRows`), runs the family's own forward with

* a cache whose ``update_indexer`` returns the keys of the whole row: every rank's indexer keys,
  all-gathered into global order (one head per token: ``B * T * D_idx`` values, gathered once per
  indexer layer, without gradient: a selection is not differentiable);
* as ``attention_mask``, the (B, S, T) boolean rows of this rank's queries over the whole row:
  causal within each document of the engine's batch (:func:`cp_attention.plan.select.visible_rows`);
* ties broken one way (:func:`canonical_topk`): ``torch.topk`` leaves the order of equal scores
  unspecified (it changes with the row's length, the device and the kernel), and after the ReLU many
  index scores are exactly 0 (15-19 % of rows of the tiny models tie at the k-th place). cp_flash's
  indexers keep, among equal scores, the earliest key, on one device and under every layout.

The selection it returns holds global key indices, marked as such (:func:`global_selection`);
``cp_flash`` reads only marked selections. Any other use of the mask's rows raises (the model's code
would treat a cp_flash mask as a dense tensor). Other indexer forms (Qwen4's block selection,
MiniMax-M3's key blocks, DeepSeek-V4's compressed entries, GLM-5-Next's pools) are not adapted and
stay refused.

Legend: ``B`` batch, ``S`` this rank's tokens, ``T`` tokens of the whole row, ``D`` indexer head dim.
"""

from __future__ import annotations

import functools
import inspect
import torch
from torch.overrides import TorchFunctionMode

from ..engine.batch import resolve
from ..engine.context import active_context
from ..engine.local import local_meta
from ..layout import global_index, local_lengths, unshard
from ..masks import MaskSpec
from ..plan.select import visible_rows
from ..refusals import refuse
from . import source, state

__all__ = ["MaskRows", "adapt_module", "adapted_indexer", "canonical_topk", "global_selection", "SIGNATURES"]

SIGNATURES = (("hidden_states", "q_resid", "position_embeddings", "attention_mask", "position_ids", "cache"),
              ("hidden_states", "position_embeddings", "attention_mask", "position_ids", "cache"))
"""The forward parameters (after ``self``) of the token-level DSA indexers (with and without ``q_resid``)."""
_ADAPTED = "_cp_attention_indexer"


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


def canonical_topk(scores: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
    """``torch.topk`` with ties broken one way: among equal scores the lower index comes first (a
    stable sort), so the same scores select the same keys whatever the row's length or layout.
    Returns ``torch.return_types.topk`` (``.values``, ``.indices``), sorted."""
    values, indices = torch.sort(scores, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


class _CanonicalTopk(TorchFunctionMode):
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


class _WholeRowKeys:
    """The cache an adapted indexer gets: ``update_indexer`` returns the whole row's indexer keys (the
    model's own cache, if any, still stores this rank's)."""

    def __init__(self, gather, cache):
        self._gather, self._cache = gather, cache

    def update_indexer(self, k_BSD: torch.Tensor, layer_idx: int) -> torch.Tensor:
        if self._cache is not None:
            k_BSD = self._cache.update_indexer(k_BSD, layer_idx)
        return self._gather(k_BSD)


def _gather_keys(batch, whole_row: bool):
    """The all-gather of every rank's indexer keys into the row's order (identity on one device)."""
    if not whole_row:
        return lambda k_BSD: k_BSD
    cp = batch.cp
    comm, layout = cp.comm, batch.layout

    def gather(k_BSD: torch.Tensor) -> torch.Tensor:
        k_BSD = k_BSD.detach().contiguous()
        sizes = local_lengths(batch.seq_len, cp.world_size, layout)
        padded = k_BSD.new_zeros((k_BSD.shape[0], max(sizes)) + tuple(k_BSD.shape[2:]))
        padded[:, :k_BSD.shape[1]] = k_BSD
        with comm.reporting("the indexer keys' all-gather"):
            parts = comm.all_gather(padded, "the indexer keys' all-gather")
        return unshard([p[:, :n] for p, n in zip(parts, sizes)], 1, layout)

    return gather


def _rows(info, batch, whole_row: bool, B: int, S: int, device) -> torch.Tensor:
    """(B, S, T) bool: the indexer's mask rows, causal within the documents the layer's attention reads:
    the sharded batch's, else those of the cp_flash mask (transformers' packed detection, padding)."""
    causal = MaskSpec(causal=True)
    if whole_row:
        cp = batch.cp
        q_index = global_index(batch.seq_len, cp.world_size, batch.layout, cp.rank)
        return visible_rows(batch.meta, causal, q_index).to(device)
    if batch is not None and batch.seq_len == S and batch.meta.batch == B:
        meta = batch.meta
    else:
        meta = local_meta(B, S, S, valid=info.valid, opens=info.opens)[0]
    return visible_rows(meta, causal, torch.arange(S)).to(device)


def _adapted_forward(original):
    sig = inspect.signature(original)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        bound = sig.bind(self, *args, **kwargs)
        rows = bound.arguments.get("attention_mask")
        if not isinstance(rows, MaskRows):  # eager, sdpa, ...: the family's own forward
            return original(self, *args, **kwargs)
        info = rows.mask
        hidden = bound.arguments["hidden_states"]
        B, S = hidden.shape[:2]
        family = info.family or "this model"
        if info.q_offset or info.kv_offset or info.q_length != info.kv_length:
            raise refuse("selection_with_kv_cache", family=family, queries=info.q_length, offset=info.q_offset,
                         keys=info.kv_length)
        # the documents are the mask's (its batch), as for the layer's attention: the indexer's position_ids
        # may be a model's own numbering (M-RoPE rows) that cp.shard_batch did not return
        batch, error = resolve(None, active_context(), mask_batch=info.batch)
        if error is not None:
            raise error
        whole_row = batch is not None and batch.cp.world_size > 1  # a sharded batch: the keys of every rank
        bound.arguments["attention_mask"] = _rows(info, batch, whole_row, B, S, hidden.device)
        bound.arguments["cache"] = _WholeRowKeys(_gather_keys(batch, whole_row), bound.arguments.get("cache"))
        with _CanonicalTopk():
            selection = original(*bound.args, **bound.kwargs)
        state.INDEXER_SELECTIONS[selection] = True
        return selection

    setattr(forward, _ADAPTED, True)
    return forward


def _fits(cls: type) -> bool:
    """A token-level DSA indexer: one of :data:`SIGNATURES`, and its forward asks the cache for the
    row's indexer keys and takes a top-k."""
    forward = vars(cls).get("forward")
    if forward is None or not cls.__name__.endswith("Indexer"):
        return False
    try:
        params = tuple(inspect.signature(forward).parameters)[1:]
    except (TypeError, ValueError):
        return False
    code = source.class_source(cls)
    return params in SIGNATURES and "update_indexer(" in code and ".topk(" in code


def adapt_module(mod) -> bool:
    """Give the DSA indexer classes of one modeling module the adapted forward (idempotent); whether
    the module has one."""
    found = False
    for value in list(vars(mod).values()):
        if not isinstance(value, type) or value.__module__ != mod.__name__:
            continue
        if adapted_indexer(value):
            found = True
        elif _fits(value):
            value.forward = _adapted_forward(value.forward)
            found = True
    return found


def adapted_indexer(cls: type) -> bool:
    """Whether ``cls`` is a DSA indexer class whose forward :func:`adapt_module` adapted."""
    return bool(getattr(vars(cls).get("forward"), _ADAPTED, False))
