"""The sharded KV cache layer (cp_attention.integrations.hf.generation), simulated for P ranks in one process: the
union of the ranks' keys is every position exactly once (or, with a window or chunks, every position a later
query may see), each key equal to one device's at its position; the one-device lengths reported; balance."""

from __future__ import annotations

import pytest
import torch

from cp_attention import layout
from cp_attention.integrations.hf.generation import ShardedCacheLayer, decode_owner


def _run(P: int, N: int, steps: int, layout_name: str, **mask):
    g = torch.Generator().manual_seed(P)
    B, K, D = 2, 2, 3
    full_k = torch.randn(B, K, N + steps, D, generator=g)
    full_v = torch.randn(B, K, N + steps, D, generator=g)
    layers = []
    for r in range(P):
        pos = layout.global_index(N, P, layout_name, r)
        layer = ShardedCacheLayer(rank=r, world_size=P, prefill_positions=pos, prompt_length=N, block=4, **mask)
        layer.update(full_k[:, :, pos], full_v[:, :, pos])
        layers.append(layer)
    for t in range(N, N + steps):
        for layer in layers:
            k, _ = layer.update(full_k[:, :, t:t + 1], full_v[:, :, t:t + 1])
            assert k.shape[-2] == layer.positions.numel()
            assert layer.get_seq_length() == t + 1 and layer.get_mask_sizes(1) == (t + 2, 0)
    return layers, full_k, full_v


@pytest.mark.parametrize("P, layout_name", [(1, "contiguous"), (2, "zigzag"), (4, "zigzag"), (3, "contiguous")])
def test_every_position_on_exactly_one_rank(P, layout_name):
    N, steps = 40, 9
    layers, full_k, full_v = _run(P, N, steps, layout_name)
    allpos = torch.cat([layer.positions for layer in layers])
    assert sorted(allpos.tolist()) == list(range(N + steps))
    for layer in layers:
        assert torch.equal(layer.keys, full_k[:, :, layer.positions])
        assert torch.equal(layer.values, full_v[:, :, layer.positions])
        assert bool((layer.positions[1:] > layer.positions[:-1]).all())
    decoded = [int(((layer.positions >= N)).sum()) for layer in layers]
    assert max(decoded) - min(decoded) <= 4  # blocks of 4 dealt in turn
    assert decode_owner(N, P, 4) == decode_owner(N + 1, P, 4)


@pytest.mark.parametrize("mask, first", [(dict(window=6), lambda q: q - 5), (dict(chunk=8), lambda q: q // 8 * 8)])
def test_keys_no_later_query_sees_are_dropped(mask, first):
    N, steps = 40, 9
    layers, _, _ = _run(2, N, steps, "zigzag", **mask)
    last_query = N + steps - 1
    held = sorted(torch.cat([layer.positions for layer in layers]).tolist())
    assert held == list(range(first(last_query), N + steps))


@pytest.mark.parametrize("mask", [{}, dict(window=6)])
def test_crop_forgets_the_last_tokens_on_every_rank(mask):
    """Assisted and prompt-lookup decoding verify several candidates in one step, then crop the rejected
    ones: the keys at those positions go, wherever they are held, and the lengths follow."""
    N = 40
    layers, prompt_k, _ = _run(3, N, 0, "zigzag", **mask)
    full_k = torch.cat([prompt_k, torch.randn(*prompt_k.shape[:2], 5, prompt_k.shape[3])], dim=2)
    for layer in layers:  # a verification step of five tokens, three of them rejected
        layer.update(full_k[:, :, N:N + 5], full_k[:, :, N:N + 5])
        layer.crop(-3)
        assert layer.get_seq_length() == N + 2 and layer.get_mask_sizes(1) == (N + 3, 0)
        assert torch.equal(layer.keys, full_k[:, :, layer.positions])
    held = sorted(torch.cat([layer.positions for layer in layers]).tolist())
    assert held == list(range(N + 2 - mask["window"] + 1 if mask else 0, N + 2))  # the next query's window


def test_crop_past_keys_the_window_dropped_is_refused():
    layers, full_k, _ = _run(2, 40, 6, "zigzag", window=4)
    with pytest.raises(NotImplementedError, match="already dropped the keys before position 42"):
        layers[0].crop(-5)
    layers[0].crop(60)  # a positive count: the length to keep (transformers before 5.18); longer keeps all
    assert layers[0].get_seq_length() == 46
    layers[0].crop(45)  # = crop(-1)
    assert layers[0].get_seq_length() == 45 and int(layers[0].positions.max()) <= 44
