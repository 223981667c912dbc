"""Generation under context parallelism: a KV cache sharded by sequence.

:class:`ShardedCacheLayer` stands in for one attention layer's ``DynamicLayer`` of transformers' cache: it
keeps only this rank's K/V, with the global position of each cached key, and reports the one-device lengths
(``get_seq_length``, ``get_mask_sizes``) so that transformers builds its masks and positions as on one
device:

* the prefill stores this rank's shard of the prompt (its positions: the layout's ``global_index``);
* a decode step's new tokens are stored on one rank each, chosen by :func:`decode_owner` (blocks of
  ``block`` tokens dealt round-robin, so the caches stay balanced);
* keys no later query can see are dropped (a sliding window's ``W``, a chunk's start), by position;
* after each ``update`` the layer's :attr:`positions` are those of the keys it returned, which the decode
  step's attention (:func:`cp_attention.engine.decode.attend_sharded_cache`) reads.

Legend: ``B`` rows, ``K`` K/V heads, ``n`` this rank's cached keys, ``D`` head dim, ``P`` ranks.
"""

from __future__ import annotations

import inspect
import functools

import torch

from .forward import FORWARD
from ..patches import patch
from ...refusals import refuse

__all__ = ["ShardedCacheLayer", "GenState", "decode_attention", "decode_owner", "finish_prefill", "generation_call",
           "generation_state", "hand_over", "running_decode", "start_decode", "start_prefill"]


def decode_owner(position, world_size: int, block: int):
    """The rank that stores the K/V of the decoded token at global ``position`` (an int, or a tensor of
    positions: their ranks): blocks of ``block`` positions dealt to the ranks in turn."""
    return (position // block) % world_size


def _layer_base():
    from transformers.cache_utils import DynamicLayer

    return DynamicLayer


class ShardedCacheLayer(_layer_base()):
    """One attention layer's cache of this rank's tokens (module docstring). ``prefill_positions``: the
    global positions of this rank's prompt tokens (increasing); ``window`` / ``chunk``: the layer's mask
    (keys outside every later query's view are dropped); ``block``: :func:`decode_owner`'s."""

    is_sliding = False

    def __init__(self, *, rank: int, world_size: int, prefill_positions: torch.Tensor, prompt_length: int,
                 window: int | None = None, chunk: int | None = None, block: int = 16, layer_index: int = 0):
        super().__init__()
        self.layer_index = layer_index
        self.rank, self.world_size, self.block = rank, world_size, block
        self.prefill_positions = prefill_positions.to("cpu", torch.long)
        self.prompt_length, self.window, self.chunk = int(prompt_length), window, chunk
        self.cumulative_length = 0
        self.positions = torch.zeros(0, dtype=torch.long)
        self.held_from = 0  # every key before this position was dropped (no later query could see it)
        self.row_starts = (0,)  # each row's first token that is not padding (chunks count from there)
        self.generation = None  # the GenState, told which layer the running attention updated last

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store this rank's part of the new keys (B, K, Ln, D) and return its cached keys and values
        (B, K, n, D), at :attr:`positions`."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        Ln = key_states.shape[-2]
        if self.cumulative_length == 0:  # the prefill: this rank's shard of the prompt
            if Ln != self.prefill_positions.numel():
                raise ValueError(f"cp_flash: the prefill handed this rank's cache {Ln} keys, but it holds "
                                 f"{self.prefill_positions.numel()} prompt tokens")
            new = self.prefill_positions
            keep = torch.ones(Ln, dtype=torch.bool)
            self.cumulative_length = self.prompt_length
        else:  # a decode step: the same new tokens on every rank, stored on their owner only
            new = torch.arange(self.cumulative_length, self.cumulative_length + Ln)
            keep = decode_owner(new, self.world_size, self.block) == self.rank
            self.cumulative_length += Ln
        if bool(keep.any()):  # (a rank that stores none of them copies nothing)
            idx = torch.nonzero(keep).flatten().to(key_states.device)
            self.keys = torch.cat([self.keys, key_states.index_select(-2, idx)], dim=-2)
            self.values = torch.cat([self.values, value_states.index_select(-2, idx)], dim=-2)
            self.positions = torch.cat([self.positions, new[keep]])
        first_query = int(new[0]) if new.numel() else self.cumulative_length
        self._drop_before(self._visible_from(first_query))
        if self.generation is not None:
            self.generation.updated = self
        return self.keys, self.values

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens (assisted and prompt-lookup decoding reject
        candidates so; a positive count is the length to keep, as transformers before 5.18 passed it): the
        keys at those positions, on whichever rank holds them. Refused where the window or chunk already
        dropped a key a query at the new length could see."""
        if tokens_to_remove > 0:  # the length to keep (transformers before 5.18): longer keeps everything
            tokens_to_remove = min(0, tokens_to_remove - self.cumulative_length)
        end = self.cumulative_length + tokens_to_remove
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        if self._visible_from(end) < self.held_from:
            raise refuse("generation_crop", layer=self.layer_index, length=self.cumulative_length, end=end,
                         held=self.held_from)
        self._keep(0, int(torch.searchsorted(self.positions, end)))  # positions increase: a prefix
        self.cumulative_length = end
        self._drop_before(self._visible_from(end))  # the next query is at ``end``

    def _visible_from(self, query: int) -> int:
        """The first position a query at ``query`` or later may see (window, chunk); 0 without either."""
        start = 0
        if self.window is not None:
            start = max(start, query - self.window + 1)
        if self.chunk is not None:  # the earliest chunk start over the rows (left padding shifts a row's chunks)
            start = max(start, min(f + (query - f) // self.chunk * self.chunk if query >= f else 0
                                   for f in self.row_starts))
        return start

    def _drop_before(self, start: int) -> None:
        if start <= self.held_from:
            return
        self.held_from = start
        self._keep(int(torch.searchsorted(self.positions, start)), self.positions.numel())  # a suffix

    def _keep(self, first: int, stop: int) -> None:
        """Keep the cached keys ``first`` to ``stop`` (views: positions increase, so what goes is a prefix
        or a suffix)."""
        if first == 0 and stop == self.positions.numel():
            return
        self.positions = self.positions[first:stop]
        self.keys, self.values = self.keys[..., first:stop, :], self.values[..., first:stop, :]

    def get_seq_length(self) -> int:
        """The one-device length: every token so far, on any rank."""
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The one-device mask sizes (``DynamicLayer``'s): every position so far and the new ones."""
        return self.cumulative_length + query_length, 0

    def local_bytes(self) -> int:
        """Bytes of the K/V this rank holds."""
        if not self.is_initialized:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


@functools.cache
def _combined_class():
    """A :class:`ShardedCacheLayer` that also keeps a mixer's states (transformers'
    ``LinearAttentionAndFullAttentionLayer`` / ``...SlidingWindowAttentionLayer``, sharded: the window is
    the layer's mask's)."""
    from transformers.cache_utils import LinearAttentionLayer

    class ShardedLinearAndAttentionLayer(ShardedCacheLayer, LinearAttentionLayer):
        def __init__(self, number_of_states: int = 1, **kwargs):
            ShardedCacheLayer.__init__(self, **kwargs)
            LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

        def lazy_initialization(self, *args, **kwargs) -> None:
            if len(args) == 2 and not kwargs:  # the attention's update(keys, values)
                ShardedCacheLayer.lazy_initialization(self, *args)
            elif not args:  # update_conv_state / update_recurrent_state
                LinearAttentionLayer.lazy_initialization(self, **kwargs)

        def crop(self, tokens_to_remove: int) -> None:
            LinearAttentionLayer.crop(self, tokens_to_remove)
            ShardedCacheLayer.crop(self, tokens_to_remove)

        def reorder_cache(self, beam_idx: torch.Tensor) -> None:
            LinearAttentionLayer.reorder_cache(self, beam_idx)
            ShardedCacheLayer.reorder_cache(self, beam_idx)

    return ShardedLinearAndAttentionLayer


_ATTENTION_LAYERS = ("DynamicLayer", "DynamicSlidingWindowLayer")
_COMBINED_LAYERS = ("LinearAttentionAndFullAttentionLayer", "LinearAttentionAndSlidingWindowAttentionLayer")


class GenState:
    """One generation under context parallelism, kept on its cache (``cache._cp_generation``).

    ``cp``: the context; ``layers``: the sharded attention layers by cache index; ``linear``: the cache
    indices of the mixers' states; ``prompt_length``; ``ranks_positions``: each rank's prompt positions
    (increasing); ``last_owner``: the rank holding the prompt's last token. During the prefill, ``held``:
    mixer states kept on modules, and ``whole``: cache indices whose convolution state is already the
    sequence's (:func:`hand_over`). Per decode step: ``valid`` (B, T) the padding mask, ``updated`` the
    layer the running attention updated last, ``plans`` the step's plans
    (:func:`cp_attention.engine.decode.partial_over_cache`)."""

    def __init__(self, cp, cache, layers: dict, linear: list, prompt_length: int, ranks_positions: list):
        self.cp, self.cache, self.layers, self.linear = cp, cache, layers, linear
        self.prompt_length, self.ranks_positions = prompt_length, ranks_positions
        self.last_owner = next(r for r, pos in enumerate(ranks_positions) if pos.numel() and
                               int(pos[-1]) == prompt_length - 1)
        self.held, self.whole = [], set()
        self.valid = self.updated = None
        self.plans = {}


def hand_over(holder, name: str, kind: str, layer_index: int | None = None) -> None:
    """Called by a mixer computed in its class during generate's prefill under context parallelism
    (nothing otherwise): ``holder.<name>``, a state it keeps on a module, is made the sequence's after the
    prefill (``kind`` "state": the prompt's last token owner's; "conv": a convolution's last inputs,
    gathered from the ranks holding them); or ``kind`` "whole" with ``layer_index``: that cache layer's
    convolution state already holds the sequence's last inputs (taken from the last token's owner)."""
    gen = getattr(FORWARD, "prefill", None)
    if gen is None:
        return
    if kind == "whole":
        gen.whole.add(layer_index)
    else:
        gen.held.append((holder, name, kind))


def running_decode() -> GenState | None:
    """The generation whose decode step this thread's model forward runs, else None (always None in code
    torch.compile traces: a compiled forward with a cache is refused, and reading the thread's guard there
    would make every later batch recompile)."""
    if torch.compiler.is_compiling():
        return None
    return getattr(FORWARD, "decode", None)


def generation_state(cache) -> GenState | None:
    """The :class:`GenState` of a cache that :func:`start_prefill` sharded, else None."""
    return getattr(cache, "_cp_generation", None)


def _cache_of(kwargs: dict):
    from transformers.cache_utils import Cache

    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    return cache if isinstance(cache, Cache) else None


def _empty(cache) -> bool:
    """Whether a transformers cache holds nothing yet (a cache of mixer states alone has no length)."""
    try:
        return cache.get_seq_length() == 0
    except ValueError:  # only LinearAttentionLayers (Mamba): empty while none is initialised
        return not any(getattr(layer, "is_initialized", False) for layer in cache.layers)


def _takes_cache_params(cls: type) -> bool:
    """A model whose forward takes ``cache_params``: a cache of its own class (Mamba and Mamba-2 on transformers
    5.17), which generation under context parallelism does not shard."""
    try:
        return "cache_params" in inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return False


def generation_call(model, kwargs: dict | None, attends) -> tuple | None:
    """What a top-level forward of ``model`` inside a multi-rank block is with respect to generation:
    ("prefill", cache) for a call with an empty transformers cache and unsharded ``input_ids`` (generate's
    first forward), ("decode", state) for a call continuing a cache :func:`start_prefill` sharded, else
    None. Refuses a model with attention (``attends()``) whose forward builds a cache of its own class."""
    from ...engine.batch import batch_of

    if not kwargs:
        return None
    ids = kwargs.get("input_ids")
    unsharded = isinstance(ids, torch.Tensor) and batch_of(ids) is None
    cache = _cache_of(kwargs)
    if cache is None:
        own = getattr(type(model), "_supports_default_dynamic_cache", None)
        if unsharded and kwargs.get("use_cache") and kwargs.get("past_key_values", kwargs.get("cache")) is None \
                and ((own is not None and not own() and attends()) or _takes_cache_params(type(model))):
            raise refuse("generation_own_cache", model=type(model).__name__)
        return None
    state = generation_state(cache)
    if state is not None:
        return "decode", state
    if unsharded and _empty(cache):
        return "prefill", cache
    return None


def _same_tokens(cp, ids: torch.Tensor, what: str) -> None:
    """Every rank was handed the same ``ids`` (the prompt, a decode step's tokens): else refused on every
    rank. One all-gather of a fixed-size fingerprint (shape and three sums), so ranks handed tensors of
    different shapes are refused too."""
    flat = ids.detach().reshape(-1).to("cpu", torch.long)
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.long)
    shape = list(ids.shape) + [0] * (3 - ids.dim())
    mark = torch.tensor([ids.dim(), *shape[:3], int(flat.sum()), int((flat * weights).sum()),
                         int((flat * flat).sum())], dtype=torch.long)
    everyone = cp.comm.all_gather(mark, what)
    if any(not torch.equal(other, everyone[0]) for other in everyone):
        raise refuse("generation_ranks_differ", what=what.replace("the decode step's", "a decode step's"))


def _same_random_state(cp) -> None:
    """The ranks' random generators take rank 0's state (the CPU one, and the current CUDA device's when
    there is one): sampling then draws the same tokens on every rank from the same logits."""
    state = torch.get_rng_state()
    torch.set_rng_state(cp.comm.all_gather(state, "the random state")[0].to(state.device))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state = torch.cuda.get_rng_state()
        torch.cuda.set_rng_state(cp.comm.all_gather(state.cuda(), "the random state")[0].cpu())


def _sharded_layers(model, cache, prompt_length: int) -> list[str]:
    """The kinds of ``cache``'s layers, refused where generation under context parallelism cannot shard
    them; a dynamic cache built without a config (no layers yet) gets them now."""
    from transformers.cache_utils import DynamicCache

    from .models import text_config

    if getattr(cache, "offloading", False):
        raise refuse("generation_cache", layer="every", kind=f"offloaded {type(cache).__name__}")
    if not cache.layers and type(cache) is DynamicCache:  # DynamicCache(): its layers appear on first update
        cache.layers[:] = DynamicCache(config=text_config(model)).layers
    kinds = [type(layer).__name__ for layer in cache.layers]
    if not kinds:
        raise refuse("generation_cache", layer="every", kind=f"{type(cache).__name__} without layers")
    indexed = next((k for k in kinds if "Indexed" in k), None)
    if indexed is not None:  # a sparse-attention indexer's keys: no decode step over a selection yet
        raise refuse("selection_with_kv_cache", family=getattr(model.config, "model_type", type(model).__name__),
                     queries=prompt_length, offset=0, keys=prompt_length)
    for i, kind in enumerate(kinds):
        if kind not in (*_ATTENTION_LAYERS, *_COMBINED_LAYERS, "LinearAttentionLayer", "DummyLayer"):
            raise refuse("generation_cache", layer=i, kind=kind)
    return kinds


def start_prefill(model, kwargs: dict, cache, cp) -> GenState:
    """Shard generate's first forward: its ``input_ids`` / ``position_ids`` / ``attention_mask`` become
    this rank's shard (``cp.shard_batch``, in the call's own dict), and each attention layer of ``cache``
    a :class:`ShardedCacheLayer` of this rank's tokens. Every rank must be handed the same prompt."""
    from ... import layout as layout_mod
    from ...engine.batch import batch_of
    from .models import layer_mask, text_config

    ids = kwargs["input_ids"]
    kinds = _sharded_layers(model, cache, int(ids.shape[1]))
    _same_tokens(cp, ids, "the prompt")
    _same_random_state(cp)
    N = int(ids.shape[1])
    mask = kwargs.get("attention_mask")
    row_starts = (0,)
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:  # left padding: each row's first real token
        row_starts = tuple(sorted(set(mask.detach().to("cpu", torch.bool).to(torch.uint8).argmax(1).tolist())))
    given = {name: kwargs[name] for name in ("input_ids", "position_ids", "attention_mask")
             if isinstance(kwargs.get(name), torch.Tensor)}
    batch = cp.shard_batch(**given)
    kwargs.update({name: batch[name] for name in given if name in batch})
    layout = batch_of(batch["input_ids"]).layout
    config = text_config(model)
    ranks_positions = [layout_mod.global_index(N, cp.world_size, layout, r).to("cpu", torch.long)
                       for r in range(cp.world_size)]
    positions = ranks_positions[cp.rank]
    layers, linear = {}, []
    for i, kind in enumerate(kinds):
        if kind in ("LinearAttentionLayer", "DummyLayer"):  # a mixer's states (each rank's own after the
            linear += [i] if kind == "LinearAttentionLayer" else []  # prefill, then the sequence's); a
            continue                                                 # layer caching nothing
        spec = layer_mask(config, i)
        common = dict(rank=cp.rank, world_size=cp.world_size, prefill_positions=positions, prompt_length=N,
                      window=spec.window, chunk=spec.chunk_size, layer_index=i)
        if kind in _COMBINED_LAYERS:  # Falcon-H1 and the like: K/V and a mixer's states in one layer
            layers[i] = _combined_class()(number_of_states=cache.layers[i].number_of_states, **common)
            linear.append(i)
        else:
            layers[i] = ShardedCacheLayer(**common)
        layers[i].row_starts = row_starts
        cache.layers[i] = layers[i]
    state = GenState(cp, cache, layers, linear, N, ranks_positions)
    for layer in layers.values():
        layer.generation = state
    cache._cp_generation = state
    return state


def start_decode(state: GenState, kwargs: dict) -> None:
    """Before a decode forward: its new tokens are the same on every rank (else refused)."""
    state.valid = state.updated = None
    state.plans = {}  # the step's plans, shared by its layers of one mask
    ids = kwargs.get("input_ids")
    if isinstance(ids, torch.Tensor):
        _same_tokens(state.cp, ids, "the decode step's tokens")


def _sequence_tail(state: GenState, everyone: list[torch.Tensor]) -> torch.Tensor:
    """A convolution's state for the whole prompt, from every rank's (B, C, W): each rank's columns are
    its last W prompt tokens (right-aligned, zeros before its first), the result's the prompt's last W
    (zeros before position 0), each column taken from the rank holding that position."""
    W, N = everyone[0].shape[-1], state.prompt_length
    out = torch.zeros_like(everyone[0])
    for r, pos in enumerate(state.ranks_positions):
        tail = pos[-W:]  # this rank's last W tokens: columns W - len(tail) ... W - 1
        take = tail >= N - W
        if bool(take.any()):
            src = torch.nonzero(take).flatten() + (W - tail.numel())
            dst = tail[take] - (N - W)
            out[..., dst.to(out.device)] = everyone[r][..., src.to(out.device)]
    return out


def _settle(state: GenState, tensor: torch.Tensor, kind: str) -> torch.Tensor:
    everyone = state.cp.comm.all_gather(tensor.contiguous(), "a mixer's state after the prefill")
    return everyone[state.last_owner] if kind != "conv" else _sequence_tail(state, everyone)


def finish_prefill(state: GenState) -> None:
    """After the prefill forward: every rank's mixer states become the sequence's, so that the decode steps
    run the mixers replicated, as on one device. A recurrent state is the one after the prompt's last
    token (its owner's); a convolution's state the prompt's last inputs, each from the rank holding it.
    One all-gather per state tensor, once."""
    for i in state.linear:
        layer = state.cache.layers[i]
        for name in ("conv_states", "recurrent_states"):
            held = getattr(layer, name, None)
            kind = "conv" if name == "conv_states" and i not in state.whole else "state"
            for j, t in (enumerate(held) if isinstance(held, list) else (held or {}).items()):
                if isinstance(t, torch.Tensor):
                    t.copy_(_settle(state, t, kind))
    for holder, name, kind in state.held:
        t = getattr(holder, name, None)
        if isinstance(t, torch.Tensor):
            patch(holder, name, _settle(state, t, kind), site="state_handover",
                  admitted="the mixer's own state after generate's prefill (generation.hand_over)")


def decode_attention(state: GenState, spec, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     sinks: torch.Tensor | None, cached: torch.Tensor | None = None) -> torch.Tensor:
    """A decode step's attention (transformers' layout: q (B, H, Lq, D), k/v (B, K, n, D) this rank's
    cached keys, as the layer's cache update returned them) over the cache sharded by this module: merged
    over the ranks by :func:`cp_attention.engine.decode.attend_sharded_cache`. ``cached``: the key tensor
    as the attention was handed it (a layer sharing another's K/V hands that layer's). Returns
    (B, Lq, H, Dv)."""
    from ...engine.decode import attend_sharded_cache

    layer = state.updated
    if cached is not None and (layer is None or layer.keys is not cached):  # a layer sharing another's K/V
        layer = next((lay for lay in state.layers.values() if lay.keys is cached), layer)
    if layer is None or key.shape[2] != layer.positions.numel():
        raise RuntimeError(f"cp_flash: a decode step's attention got {key.shape[2]} keys, but the sharded cache "
                           f"layer it updated holds {None if layer is None else layer.positions.numel()}: this "
                           f"model's attention does not attend to what its cache update returned. Generate with "
                           f"it outside cp_attention.context_parallel()")
    end, Lq = layer.cumulative_length, query.shape[2]
    return attend_sharded_cache(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), spec,
                                state.cp.comm, q_pos=torch.arange(end - Lq, end), k_pos=layer.positions,
                                sinks=sinks, valid=state.valid, plans=state.plans)
