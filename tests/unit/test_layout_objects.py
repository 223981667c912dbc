"""Layouts as objects: names are parsed once into Zigzag() / Contiguous() / the Balanced() policy, an
object gives the same shards as its name, and the policy's options reach the layout of each batch.
The expected token assignments are written from the documented definitions (layout.py's docstring),
not from the code under test."""

from __future__ import annotations

import math

import pytest
import torch

import cp_attention
from cp_attention import layout as layout_mod
from cp_attention.masks import SequenceMeta


def _slices(L: int, n: int) -> list[range]:
    """n consecutive slices of L tokens whose sizes differ by at most one, the first L % n longer."""
    base, extra = divmod(L, n)
    out, at = [], 0
    for i in range(n):
        size = base + (1 if i < extra else 0)
        out.append(range(at, at + size))
        at += size
    return out


@pytest.mark.parametrize("L, P", [(10, 2), (37, 3), (64, 4), (5, 4)])
def test_objects_hold_the_documented_tokens(L, P):
    zig, contiguous = _slices(L, 2 * P), _slices(L, P)
    for r in range(P):
        want_zig = list(zig[r]) + list(zig[2 * P - 1 - r])
        assert layout_mod.global_index(L, P, cp_attention.Zigzag(), r).tolist() == want_zig
        assert layout_mod.global_index(L, P, "zigzag", r).tolist() == want_zig
        assert layout_mod.global_index(L, P, cp_attention.Contiguous(), r).tolist() == list(contiguous[r])
        x = torch.arange(L)[None]
        assert torch.equal(layout_mod.shard(x, 1, P, "contiguous", r), layout_mod.shard(x, 1, P, cp_attention.Contiguous(), r))


def test_names_are_parsed_once_into_objects():
    assert layout_mod.as_layout("zigzag") == cp_attention.Zigzag()
    assert layout_mod.as_layout("contiguous") == cp_attention.Contiguous()
    assert layout_mod.as_policy("balanced") == cp_attention.Balanced()
    custom = cp_attention.Layout.named("zigzag", 10, 2)
    assert layout_mod.as_layout(custom) is custom
    # the three kinds are told apart across ranks
    assert len({layout_mod.layout_code(x) for x in ("zigzag", "contiguous", custom)}) == 3
    with pytest.raises(ValueError, match="layout must be one of"):
        layout_mod.as_layout("balanced")  # a per-batch policy is not the layout of one call
    with pytest.raises(ValueError, match="layout must be one of"):
        layout_mod.as_layout("zig-zag")
    with cp_attention.context_parallel(layout=cp_attention.Contiguous()) as cp:
        assert cp.current_layout() == cp_attention.Contiguous()
    with pytest.raises(ValueError, match="layout must be one of"):
        cp_attention.attention(*(torch.randn(1, 8, 2, 4) for _ in range(3)), layout="balanced")


def _packed(seed: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    lengths = [int(n) for n in torch.randint(20, 400, (12,), generator=g)]
    lengths[0] = 1500
    return torch.cat([torch.arange(n) for n in lengths])[None]


def test_balanced_policy_options_reach_each_batch():
    """Balanced(max_token_ratio=r): no rank holds more than ceil(r * L / P) tokens (the documented cap);
    the batch drawn here needs more than 1.05 x L / P on some rank under the default cap."""
    pos = _packed()
    L, P = pos.shape[1], 4
    meta = SequenceMeta.from_inputs(1, L, position_ids=pos)
    default = cp_attention.Balanced().for_batch(meta, P)
    assert max(default.local_lengths()) > 1.05 * L / P  # the tight cap below has something to change
    tight = cp_attention.Balanced(max_token_ratio=1.05).for_batch(meta, P)
    assert max(tight.local_lengths()) <= math.ceil(1.05 * L / P)
    # the policy's own cost model wins over the model's
    own = cp_attention.Balanced(masks=({"window": 16},)).for_batch(meta, P, masks=[{}])
    assert own.ranges == cp_attention.balanced_layout(P, position_ids=pos, masks=[{"window": 16}]).ranges
    with pytest.raises(ValueError, match="max_token_ratio"):
        cp_attention.Balanced(max_token_ratio=0.5)


def test_balanced_policy_in_a_context_lays_out_each_batch():
    pos = _packed()
    with cp_attention.context_parallel(layout=cp_attention.Balanced()) as cp:
        local = cp.shard_batch(input_ids=pos % 7, position_ids=pos)
        record = cp_attention.engine.batch.batch_of(local["input_ids"])
        assert isinstance(record.layout, cp_attention.Layout) and record.layout.name == "balanced"
        assert cp.current_layout() is record.layout


def test_balanced_policy_with_its_own_masks_in_a_context():
    """A policy with masks of its own is hashable and usable as a context's layout, and equal to its name."""
    pos = _packed()
    policy = cp_attention.Balanced(masks=({"window": 16}, {}), max_token_ratio=1.1)
    assert policy == "balanced" and cp_attention.Zigzag() == "zigzag" and cp_attention.Contiguous() != "zigzag"
    with cp_attention.context_parallel(layout=policy) as cp:
        local = cp.shard_batch(input_ids=pos % 7, position_ids=pos)
        assert cp_attention.engine.batch.batch_of(local["position_ids"]).layout.name == "balanced"
        assert repr(cp).endswith("layout='balanced')")
