"""Sharding layouts: exact coverage, balanced sizes, round trips, clear errors."""

from __future__ import annotations

import pytest
import torch

from cp_attention import layout


@pytest.mark.parametrize("name", layout.LAYOUTS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 8])
def test_shard_unshard_round_trip(name, world_size):
    for L in list(range(world_size, 3 * world_size + 6)) + [97, 130]:
        x = torch.arange(L).view(1, L, 1).expand(2, L, 3).clone()
        parts = [layout.shard(x, 1, world_size, name, r) for r in range(world_size)]
        sizes = [p.shape[1] for p in parts]
        assert sizes == layout.local_lengths(L, world_size, name)
        assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1, sizes
        for r, p in enumerate(parts):
            assert torch.equal(p[0, :, 0], layout.global_index(L, world_size, name, r))
        assert torch.equal(layout.unshard(parts, 1, name), x)
        assert layout.infer_seq_len(sizes, world_size, name) == L


def test_zigzag_gives_rank_r_slices_r_and_2p_minus_1_minus_r():
    L, P = 16, 4
    for r in range(P):
        idx = layout.global_index(L, P, "zigzag", r).tolist()
        assert idx == [2 * r, 2 * r + 1, 2 * (2 * P - 1 - r), 2 * (2 * P - 1 - r) + 1]


def test_inconsistent_lengths_and_bad_layout_raise():
    with pytest.raises(ValueError, match="do not match the 'zigzag' layout"):
        layout.infer_seq_len([5, 3], 2, "zigzag")
    with pytest.raises(ValueError, match="layout must be one of"):
        layout.check_layout("ring")
    with pytest.raises(ValueError, match="every rank needs at least one token"):
        layout.shard(torch.zeros(1, 2), 1, 3, "contiguous", 0)
