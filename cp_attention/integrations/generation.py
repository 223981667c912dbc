"""Generation under context parallelism: a KV cache sharded by sequence (issue 40; work in progress).

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

import torch

__all__ = ["ShardedCacheLayer", "GenState", "decode_owner", "generation_call", "generation_state", "start_prefill"]


def decode_owner(position: int, world_size: int, block: int) -> int:
    """The rank that stores the K/V of the decoded token at global ``position``: blocks of ``block``
    positions dealt to the ranks in turn."""
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
                 window: int | None = None, chunk: int | None = None, block: int = 16):
        super().__init__()
        self.rank, self.world_size, self.block = rank, world_size, block
        self.prefill_positions = prefill_positions.to("cpu", torch.long)
        self.prompt_length, self.window, self.chunk = int(prompt_length), window, chunk
        self.cumulative_length = 0
        self.positions = torch.zeros(0, dtype=torch.long)

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
            keep = torch.tensor([decode_owner(int(p), self.world_size, self.block) == self.rank for p in new])
            self.cumulative_length += Ln
        idx = torch.nonzero(keep).flatten().to(key_states.device)
        self.keys = torch.cat([self.keys, key_states.index_select(-2, idx)], dim=-2)
        self.values = torch.cat([self.values, value_states.index_select(-2, idx)], dim=-2)
        self.positions = torch.cat([self.positions, new[keep]])
        first_query = int(new[0]) if new.numel() else self.cumulative_length
        self._drop_before(self._visible_from(first_query))
        return self.keys, self.values

    def _visible_from(self, query: int) -> int:
        """The first position a query at ``query`` or later may see (window, chunk); 0 without either."""
        start = 0
        if self.window is not None:
            start = max(start, query - self.window + 1)
        if self.chunk is not None:
            start = max(start, (query // self.chunk) * self.chunk)
        return start

    def _drop_before(self, start: int) -> None:
        if start <= 0 or self.positions.numel() == 0:
            return
        keep = torch.nonzero(self.positions >= start).flatten()
        if keep.numel() == self.positions.numel():
            return
        self.positions = self.positions[keep]
        dev = keep.to(self.keys.device)
        self.keys, self.values = self.keys.index_select(-2, dev), self.values.index_select(-2, dev)

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


_COMBINED = []


def _combined_class():
    """A :class:`ShardedCacheLayer` that also keeps a mixer's states (transformers'
    ``LinearAttentionAndFullAttentionLayer``, sharded), built once."""
    if not _COMBINED:
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

        _COMBINED.append(ShardedLinearAndAttentionLayer)
    return _COMBINED[0]


class GenState:
    """A generation under context parallelism, kept on its cache (``cache._cp_generation``): the context,
    the sharded layers by layer index, the prompt's length."""

    def __init__(self, cp, layers: dict, prompt_length: int):
        self.cp, self.layers, self.prompt_length = cp, layers, prompt_length


def generation_state(cache) -> GenState | None:
    """The :class:`GenState` of a cache that :func:`start_prefill` sharded, else None."""
    return getattr(cache, "_cp_generation", None)


def _cache_of(kwargs: dict):
    from transformers.cache_utils import Cache

    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    return cache if isinstance(cache, Cache) else None


def generation_call(kwargs: dict | None):
    """What a top-level model forward inside a multi-rank block is with respect to generation: ("prefill",
    cache) for a call with an empty transformers cache and unsharded ``input_ids`` (generate's first
    forward), ("decode", state) for a call continuing a cache :func:`start_prefill` sharded, else None."""
    from ..engine.batch import batch_of

    if not kwargs:
        return None
    cache = _cache_of(kwargs)
    if cache is None:
        return None
    state = generation_state(cache)
    if state is not None:
        return "decode", state
    ids = kwargs.get("input_ids")
    if cache.get_seq_length() == 0 and isinstance(ids, torch.Tensor) and batch_of(ids) is None:
        return "prefill", cache
    return None


def start_prefill(model, kwargs: dict, cache, cp) -> None:
    """Shard generate's first forward: its ``input_ids`` / ``position_ids`` / ``attention_mask`` become
    this rank's shard (``cp.shard_batch``, in the call's own dict), and each attention layer of ``cache``
    a :class:`ShardedCacheLayer` of this rank's tokens."""
    from transformers.cache_utils import DynamicLayer

    from .. import layout as layout_mod
    from .models import layer_mask, text_config

    ids = kwargs["input_ids"]
    N = int(ids.shape[1])
    given = {name: kwargs[name] for name in ("input_ids", "position_ids", "attention_mask")
             if isinstance(kwargs.get(name), torch.Tensor)}
    batch = cp.shard_batch(**given)
    kwargs.update({name: batch[name] for name in given if name in batch})
    record = batch_record(batch["input_ids"])
    config = text_config(model)
    positions = layout_mod.global_index(N, cp.world_size, record.layout, cp.rank)
    layers, linear = {}, []
    for i, layer in enumerate(cache.layers):
        if type(layer).__name__ == "LinearAttentionLayer":  # a mixer's states: each rank's own after the
            linear.append(i)                                  # prefill, then the last token's owner's
            continue
        if type(layer).__name__ == "DummyLayer":  # a layer that caches nothing (Nemotron-H's MLP layers)
            continue
        if type(layer).__name__ == "LinearAttentionAndFullAttentionLayer":  # Falcon-H1: K/V and mixer states
            sharded = _combined_class()(number_of_states=layer.number_of_states, rank=cp.rank,
                                        world_size=cp.world_size, prefill_positions=positions, prompt_length=N)
            cache.layers[i] = layers[i] = sharded
            linear.append(i)
            continue
        if type(layer) not in (DynamicLayer,) and type(layer).__name__ != "DynamicSlidingWindowLayer":
            raise NotImplementedError(f"cp_flash: generation under context parallelism shards dynamic caches only; "
                                      f"layer {i} of this cache is a {type(layer).__name__}")
        spec = layer_mask(config, i)
        sharded = ShardedCacheLayer(rank=cp.rank, world_size=cp.world_size, prefill_positions=positions,
                                    prompt_length=N, window=spec.window, chunk=spec.chunk_size)
        cache.layers[i] = sharded
        layers[i] = sharded
    state = GenState(cp, layers, N)
    state.cache, state.linear = cache, linear
    state.last_owner = next(r for r in range(cp.world_size)
                            if bool((layout_mod.global_index(N, cp.world_size, record.layout, r) == N - 1).any()))
    cache._cp_generation = state
    return state


def finish_prefill(state: GenState) -> None:
    """After the prefill forward: every rank's mixer states (convolution inputs, recurrent state) become
    those of the rank holding the prompt's last token (the state after it, its last inputs), so that the
    decode steps run the mixers replicated, as on one device."""
    comm = state.cp.comm
    for i in state.linear:
        layer = state.cache.layers[i]
        for name in ("conv_states", "recurrent_states"):
            held = getattr(layer, name, None)
            for j, t in (enumerate(held) if isinstance(held, list) else (held or {}).items()):
                if isinstance(t, torch.Tensor):
                    t.copy_(comm.all_gather(t, "a mixer's state after the prefill")[state.last_owner])


def batch_record(tensor):
    from ..engine.batch import batch_of

    return batch_of(tensor)
