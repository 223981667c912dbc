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
would treat a cp_flash mask as a dense tensor).

Qwen4's block indexer (QSA) has the other form adapted here::

    forward(hidden_states, position_embeddings, attention_mask, cache)   -> (B, 1, S, T) bool

It cuts each query's visible keys into blocks of ``compress_ratio`` from the first one, scores the
blocks' mean-pooled keys (RoPE'd at each block's first position) and keeps the top blocks plus the
incomplete tail, as a dense mask its attention ANDs with the layer's. Its attention class (found by
calling such an indexer) gets a forward that hands both a :class:`SelectingMask`: the indexer runs the
family's own code on the whole row's keys, on the rotary tables of the whole row followed by this
rank's (its code reads the queries' as the last ``S`` rows and the blocks' by global index) and on this
rank's mask rows, and returns a :class:`KeySelection`; the attention's ``mask & selection`` then gives
back the cp_flash mask carrying the selection, which ``cp_flash`` reads as above. Other indexer forms
(MiniMax-M3's key blocks per KV head, DeepSeek-V4's compressed entries, GLM-5-Next's pools) are not
adapted and stay refused.

Legend: ``B`` batch, ``S`` this rank's tokens, ``T`` tokens of the whole row, ``D`` indexer head dim.
"""

from __future__ import annotations

import functools
import inspect
import torch

from ....engine.batch import resolve
from ....engine.context import active_context
from ....engine.local import local_meta
from ....layout import global_index, local_lengths, unshard
from ....masks import MaskSpec
from ....plan.select import visible_rows
from ....refusals import refuse
from .. import source
from .. import state
from ..class_admission import first_use
from ..selection import CanonicalTopk, KeySelection, MaskRows, SelectingMask
from .base import Adapter
from ...patches import patch

__all__ = ["ADAPTER", "adapt_module", "adapted_indexer"]

SIGNATURES = (("hidden_states", "q_resid", "position_embeddings", "attention_mask", "position_ids", "cache"),
              ("hidden_states", "position_embeddings", "attention_mask", "position_ids", "cache"),
              ("hidden_states", "q_resid", "position_embeddings", "attention_mask", "position_ids", "past_key_values"))
"""The forward parameters (after ``self``) of the token-level DSA indexers (with and without ``q_resid``; the
cache is ``past_key_values`` on transformers 5.17)."""
_CACHE_NAMES = ("cache", "past_key_values")
BLOCK_SIGNATURE = ("hidden_states", "position_embeddings", "attention_mask", "cache")
"""The forward parameters (after ``self``) of Qwen4's block indexer (QSA); 5.17 names the cache ``past_key_values``."""
_BLOCK_SIGNATURES = (BLOCK_SIGNATURE, BLOCK_SIGNATURE[:-1] + ("past_key_values",))
_ADAPTED = "_cp_attention_indexer"


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


def _layer_batch(info, B: int, S: int, family: str):
    """(batch, whole_row) of a layer's cp_flash mask ``info``: the batch its attention runs on (refused
    over a KV cache) and whether it is sharded (the indexer then needs every rank's keys)."""
    if info.q_offset or info.kv_offset or info.q_length != info.kv_length:
        raise refuse("selection_with_kv_cache", family=family, queries=info.q_length, offset=info.q_offset,
                     keys=info.kv_length)
    # the documents are the mask's (its batch), as for the layer's attention: the indexer's position_ids
    # may be a model's own numbering (M-RoPE rows) that cp.shard_batch did not return
    batch, error = resolve(None, active_context(), mask_batch=info.batch)
    if error is not None:
        raise error
    return batch, batch is not None and batch.cp.world_size > 1


def _cache_name(bound) -> str:
    """The name of the indexer forward's cache parameter (``cache``; ``past_key_values`` on 5.17)."""
    params = bound.signature.parameters
    return next((name for name in _CACHE_NAMES if name in params), "cache")


def _adapted(original, applies, run):
    """``original`` (a forward) that calls ``run(original, bound, mask)`` instead when ``applies`` to its
    ``attention_mask`` (``bound``: its arguments, bound), marked as adapted."""
    sig = inspect.signature(original)

    @functools.wraps(original)
    @torch.compiler.disable  # the context, the batch record and the exchange: eager, one graph break
    def forward(self, *args, **kwargs):
        bound = sig.bind(self, *args, **kwargs)
        mask = bound.arguments.get("attention_mask")
        if not applies(mask):  # eager, sdpa, ...: the family's own forward
            return original(self, *args, **kwargs)
        return run(original, bound, mask)

    setattr(forward, _ADAPTED, True)
    return forward


def _token_selection(original, bound, rows: MaskRows):
    """A DSA indexer's forward on the whole row: global top-k key indices (B, S, k), marked."""
    info, hidden = rows.mask, bound.arguments["hidden_states"]
    B, S = hidden.shape[:2]
    first_use(type(bound.arguments["self"]), "forward", lambda: _indexer_reason(original, bound, _select_tokens))
    batch, whole_row = _layer_batch(info, B, S, info.family or "this model")
    selection = _select_tokens(original, bound, _rows(info, batch, whole_row, B, S, hidden.device),
                               _gather_keys(batch, whole_row))
    state.INDEXER_SELECTIONS[selection] = True
    return selection


def _select_tokens(original, bound, rows_BST: torch.Tensor, gather, whole_row: bool = False) -> torch.Tensor:
    """The family's token indexer on the mask rows ``rows_BST`` and the keys ``gather`` returns."""
    bound.arguments["attention_mask"] = rows_BST
    name = _cache_name(bound)
    bound.arguments[name] = _WholeRowKeys(gather, bound.arguments.get(name))
    with CanonicalTopk():
        return original(*bound.args, **bound.kwargs)


def _block_selection(original, bound, mask: SelectingMask) -> KeySelection:
    """Qwen4's block indexer on the whole row: its (B, 1, S, T) mask as global key indices (B, S, k)."""
    info, hidden = mask.mask, bound.arguments["hidden_states"]
    B, S = hidden.shape[:2]
    first_use(type(bound.arguments["self"]), "forward", lambda: _indexer_reason(original, bound, _select_blocks))
    batch, whole_row = _layer_batch(info, B, S, info.family or "this model")
    rows_BST = _rows(info, batch, whole_row, B, S, hidden.device)
    chosen_BST = _select_blocks(original, bound, rows_BST, _gather_keys(batch, whole_row), whole_row)
    T = chosen_BST.shape[-1]
    j_T = torch.arange(T, device=chosen_BST.device)
    width = max(int(chosen_BST.sum(-1).max()), 1) if chosen_BST.numel() else 1
    keys_BSk = torch.where(chosen_BST, j_T, T).sort(-1).values[..., :width]
    return KeySelection(keys_BSk.masked_fill(keys_BSk == T, -1))


def _select_blocks(original, bound, rows_BST: torch.Tensor, gather, whole_row: bool = False) -> torch.Tensor:
    """The family's block indexer on the mask rows ``rows_BST`` and the keys ``gather`` returns: (B, S, T)
    bool, the keys of its chosen blocks that the rows show."""
    cos, sin = bound.arguments["position_embeddings"]
    if whole_row:  # the row's tables, then this rank's: the code reads the queries' as the last S rows
        cos, sin = torch.cat([gather(cos), cos], dim=1), torch.cat([gather(sin), sin], dim=1)
    bound.arguments["position_embeddings"] = (cos, sin)
    bound.arguments["attention_mask"] = rows_BST[:, None]
    name = _cache_name(bound)
    bound.arguments[name] = _WholeRowKeys(gather, bound.arguments.get(name))
    with CanonicalTopk():
        chosen_B1ST = original(*bound.args, **bound.kwargs)
    return chosen_B1ST[:, 0] & rows_BST


# ----------------------------------------------------------------------------------------------
# admission: what a rank's indexer selects with the adapter's inputs is what eager selects for its queries

_CHECK_TOKENS, _CHECK_TOPK = 24, 6


class _Recorder:
    """A cache stub that keeps the indexer keys it is handed (and returns them)."""

    def __init__(self):
        self.keys = None

    def update_indexer(self, k_BSD, layer_idx):
        self.keys = k_BSD
        return k_BSD


def _synthetic(bound, T: int, lo: int):
    """A copy of the indexer call ``bound`` on one random row of ``T`` tokens, for its queries ``lo..T-1``:
    every (B, S, ...) tensor argument random (B = 1; the same values whatever ``lo``), the rotary tables of
    random angles, positions ``lo..T-1``, a :class:`_Recorder` for the cache."""
    g = torch.Generator().manual_seed(0)
    hidden = bound.arguments["hidden_states"]
    B, S = hidden.shape[:2]
    out = bound.signature.bind_partial(bound.arguments["self"])
    for name, value in bound.arguments.items():
        if name == "self":
            continue
        if name == "position_embeddings" and isinstance(value, tuple):
            angles = torch.rand(1, T, *value[0].shape[2:], generator=g).to(value[0]) * 6.3
            value = (torch.cos(angles)[:, lo:], torch.sin(angles)[:, lo:])
        elif name == "position_ids":
            value = torch.arange(lo, T, device=hidden.device)[None]
        elif name in _CACHE_NAMES:
            value = _Recorder()
        elif isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == (B, S) and \
                value.is_floating_point():
            value = torch.randn(1, T, *value.shape[2:], generator=g).to(value)[:, lo:]
        out.arguments[name] = value
    name = _cache_name(out)
    if name not in out.arguments:
        out.arguments[name] = _Recorder()
    return out


def _indexer_reason(original, bound, select) -> str | None:
    """None when the indexer (``bound``: its real call) selects for a rank's queries, with the adapter's
    inputs, what it selects for them as eager runs it on one device, else why not.

    One synthetic row of :data:`_CHECK_TOKENS` tokens (the instance's top-k lowered to :data:`_CHECK_TOPK`
    so that the row is ranked): eager's selection on the whole row, with its additive mask (``finfo.min``
    where hidden; a boolean one for code that takes only that: transformers 5.17's block indexer) and its
    own keys; and the second half's queries as the last rank of two holds them, with
    boolean mask rows over the whole row and the row's keys from ``cache.update_indexer`` (the first half's
    from the eager run, its own after them: what the all-gather returns), the block indexer's rotary tables
    of the whole row before its own. Ties are broken alike in both (the adapter's canonical top-k)."""
    self = bound.arguments["self"]
    block = select is _select_blocks
    T = _CHECK_TOKENS if not block else 6 * max(int(getattr(self, "compress_ratio", 4)), 1) + 3
    lo = T // 2
    topk = [name for name in ("index_topk", "topk", "top_k") if isinstance(getattr(self, name, None), int)]
    saved = {name: getattr(self, name) for name in topk}
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            for name in topk:
                patch(self, name, min(saved[name], _CHECK_TOPK), site="probe_state",
                      admitted="indexers._indexer_reason (its check's own top-k)")
            device = bound.arguments["hidden_states"].device
            hidden = torch.ones(T, T, dtype=torch.bool, device=device).triu(1)
            additive = torch.zeros(1, T, T, device=device).masked_fill(hidden, torch.finfo(torch.float32).min)
            for mask in (additive, ~hidden[None]):  # eager's additive mask; a boolean one where the code takes only that
                eager = _synthetic(bound, T, 0)
                eager.arguments["attention_mask"] = mask[:, None] if block else mask
                recorder = eager.arguments[_cache_name(eager)]
                try:
                    with CanonicalTopk():
                        want = original(*eager.args, **eager.kwargs)
                    break
                except (RuntimeError, TypeError, NotImplementedError):
                    if mask.dtype == torch.bool:
                        raise
            rank = _synthetic(bound, T, lo)
            rank.arguments[_cache_name(rank)] = None
            cos, sin = rank.arguments.get("position_embeddings") or (None, None)
            whole_cos, whole_sin = eager.arguments.get("position_embeddings") or (None, None)

            def gather(t):  # the all-gather of every rank's part: the row's
                if t is cos or t is sin:
                    return whole_cos if t is cos else whole_sin
                return torch.cat([recorder.keys[:, :lo], t], dim=1)

            got = select(original, rank, ~hidden[None, lo:], gather, True)
        want = want[:, 0, lo:] & ~hidden[None, lo:] if block else want[:, lo:]
        if block:
            same = got.shape == want.shape and bool(torch.equal(got, want))
        else:  # each query's first min(k, visible) choices: its visible keys, ranked alike
            k = want.shape[-1]
            shown = torch.arange(k, device=device)[None, :] < torch.arange(lo + 1, T + 1, device=device)[:, None]
            same = got.shape == want.shape and bool(torch.equal(got.long()[0][shown], want.long()[0][shown]))
        if not same:
            return ("for a rank's queries, with the adapter's inputs (boolean mask rows over the row, the row's "
                    "keys from the cache) it selects other keys than eager selects for them on one device")
        return None
    except Exception as exc:
        return f"checking it raised {type(exc).__name__}: {str(exc)[:200]}"
    finally:
        for name, value in saved.items():
            patch(self, name, value, site="probe_state", admitted="indexers._indexer_reason (restoring)")


def _cp_flash_mask(mask) -> bool:
    """A cp_flash mask (its type has ``selecting``: read on the type, so no tensor is touched)."""
    return getattr(type(mask), "selecting", None) is not None


def _selecting(original, bound, mask):
    """An attention whose block indexer is adapted: the cp_flash mask reaches it (and its indexer) as a
    :class:`SelectingMask`."""
    bound.arguments["attention_mask"] = mask.selecting()
    return original(*bound.args, **bound.kwargs)


def _params(cls: type) -> tuple | None:
    forward = vars(cls).get("forward")
    if forward is None:
        return None
    try:  # the named parameters after ``self`` (5.25 adds ``**kwargs``)
        return tuple(name for name, p in inspect.signature(forward).parameters.items()
                     if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))[1:]
    except (TypeError, ValueError):
        return None


def _fits_blocks(cls: type) -> bool:
    """Qwen4's block indexer: :data:`BLOCK_SIGNATURE`, the row's keys from the cache, blocks, a top-k."""
    if not cls.__name__.endswith("Indexer") or _params(cls) not in _BLOCK_SIGNATURES:
        return False
    code = source.class_source(cls)
    return "update_indexer(" in code and ".topk(" in code and "compress_ratio" in code


def _calls_block_indexer(cls: type, indexers: list) -> bool:
    """An attention class whose forward hands one of ``indexers`` (adapted block indexers) its mask."""
    params = _params(cls)
    if not params or "attention_mask" not in params or not cls.__name__.endswith("Attention"):
        return False
    code = source.class_source(cls)
    return "self.indexer(" in code and any(f"{ind.__name__}(" in code for ind in indexers)


def _fits(cls: type) -> bool:
    """A token-level DSA indexer: one of :data:`SIGNATURES`, and its forward asks the cache for the
    row's indexer keys and takes a top-k."""
    if not cls.__name__.endswith("Indexer") or _params(cls) not in SIGNATURES:
        return False
    code = source.class_source(cls)
    return "update_indexer(" in code and ".topk(" in code


def adapt_module(mod) -> bool:
    """Give the DSA indexer classes of one modeling module the adapted forward (idempotent); whether
    the module has one."""
    found, blocks = False, []
    classes = [v for v in list(vars(mod).values()) if isinstance(v, type) and v.__module__ == mod.__name__]
    for value in classes:
        if adapted_indexer(value):
            found = True
        elif _fits(value):
            patch(value, "forward", _adapted(value.forward, lambda m: isinstance(m, MaskRows), _token_selection),
                  site="indexers", admitted="indexers._fits (signature and structure)")
            found = True
        elif _fits_blocks(value):
            patch(value, "forward", _adapted(value.forward, lambda m: isinstance(m, SelectingMask), _block_selection),
                  site="indexers", admitted="indexers._fits_blocks (signature and structure)")
            blocks.append(value)
            found = True
    for value in classes if blocks else ():
        if not adapted_indexer(value) and _calls_block_indexer(value, blocks):
            patch(value, "forward", _adapted(value.forward, _cp_flash_mask, _selecting), site="indexers",
                  admitted="indexers._calls_block_indexer (it calls an adapted block indexer)")
    return found


def adapted_indexer(cls: type) -> bool:
    """Whether ``cls`` is a DSA indexer class whose forward :func:`adapt_module` adapted."""
    return bool(getattr(vars(cls).get("forward"), _ADAPTED, False))


class Indexers(Adapter):
    """DeepSeek Sparse Attention's token indexers and Qwen4's block indexer (see the module docstring): their
    forwards (and the attention class calling a block indexer) adapted as each modeling module loads, each
    instance checked at its first call under context parallelism."""

    name = "indexers"
    sites = ("indexers", "probe_state")
    adapts = ("the forward of DeepSeek Sparse Attention's token indexers, of Qwen4's block indexer and of the "
              "attention class calling it")
    admission = ("the class's signature and structure; at the first call under context parallelism the instance's "
                 "selection for a rank's queries against eager's on one device")

    def adapt(self, mod) -> bool:
        return adapt_module(mod)

    def computes(self, module) -> bool:
        return adapted_indexer(type(module))


ADAPTER = Indexers()
