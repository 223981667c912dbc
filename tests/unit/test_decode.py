"""The decode step over a KV cache sharded by sequence (cp_attention.engine.decode), simulated in one process:
the cached keys dealt to P ranks (each rank's positions increasing, not contiguous), each rank's partial
over its own keys, merged in rank order with the sinks once, against a float64 dense oracle of the
softmax over all keys (causal, a sliding window, chunks, padding, sinks, softcap, GQA, Dv != D)."""

from __future__ import annotations

import pytest
import torch

from cp_attention.engine.decode import merge_ranks, partial_over_cache
from cp_attention.masks import MaskSpec
from cp_attention.plan import build_local_plan


def oracle(q, k, v, spec: MaskSpec, q_pos, k_pos, valid, sinks):
    """Dense float64 attention: query at p sees key at s when s <= p (causal), p - s < W (window), the same
    chunk (chunk C, counted from the row's first token that is not padding, as transformers' chunked mask
    does with left padding), and s is not padding; one extra value-less logit per head (sinks)."""
    B, Lq, H, D = q.shape
    K = k.shape[2]
    rep = H // K
    kk, vv = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * spec.resolved_scale(D)
    if spec.softcap is not None:
        s = spec.softcap * torch.tanh(s / spec.softcap)
    p, t = q_pos[None, :, None], k_pos[None, None, :]
    ok = (t <= p).expand(B, -1, -1).clone()
    if spec.window is not None:
        ok &= p - t < spec.window
    if spec.chunk_size is not None:
        first = torch.zeros(B, 1, 1, dtype=torch.long) if valid is None else \
            valid.to(torch.long).argmax(1)[:, None, None]
        ok &= (p - first) // spec.chunk_size == (t - first) // spec.chunk_size
    ok = ok[:, None].expand(B, H, -1, -1).clone()
    if valid is not None:
        ok &= valid[:, k_pos][:, None, None, :]
    s = s.masked_fill(~ok, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks[None, :, None, None].expand(B, H, Lq, 1)], dim=-1)
    w = torch.softmax(s, dim=-1).nan_to_num(0.0)[..., :kk.shape[1]]
    return torch.einsum("bhqk,bkhd->bqhd", w, vv)


def deal(T: int, P: int, seed: int) -> list[torch.Tensor]:
    """Positions 0..T-1 dealt to P ranks in random runs (each rank increasing)."""
    g = torch.Generator().manual_seed(seed)
    owner = torch.randint(0, P, (T,), generator=g)
    return [torch.nonzero(owner == r).flatten() for r in range(P)]


@pytest.mark.parametrize("spec, sinks", [
    (MaskSpec(), False), (MaskSpec(window=7), True), (MaskSpec(chunk_size=8), False), (MaskSpec(window=5), False),
    (MaskSpec(window=6, softcap=2.0), False)])  # softcap: Gemma 2's (some backends have none)
@pytest.mark.parametrize("P", [1, 2, 4])
def test_sharded_cache_step_equals_attention_over_all_keys(spec, sinks, P):
    g = torch.Generator().manual_seed(3)
    B, T, Lq, H, K, D, Dv = 2, 37, 2, 4, 2, 8, 6
    q = torch.randn(B, Lq, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, T + Lq, K, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, T + Lq, K, Dv, generator=g, dtype=torch.float64)
    s = torch.randn(H, generator=g, dtype=torch.float64) if sinks else None
    valid = torch.ones(B, T + Lq, dtype=torch.bool)
    valid[1, :5] = False  # left padding in the second row
    q_pos = torch.arange(T, T + Lq)  # the new tokens; their own K/V on the last rank
    ranks = deal(T, P, seed=P)
    ranks[-1] = torch.cat([ranks[-1], q_pos])
    parts = [partial_over_cache(q, k[:, pos], v[:, pos], spec, q_pos=q_pos, k_pos=pos, valid=valid) for pos in ranks]
    got, _ = merge_ranks(parts, s)
    want = oracle(q, k, v, spec, q_pos, torch.arange(T + Lq), valid, s)
    assert float((got - want).abs().max()) <= 1e-12
    if P > 1:  # a rank's keys alone are not the answer
        alone, _ = merge_ranks(parts[:1], s)
        assert float((alone - want).abs().max()) > 1e-3


def test_a_rank_with_no_visible_key_contributes_nothing():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 1, 2, 4, generator=g, dtype=torch.float64)
    k, v = torch.randn(1, 20, 2, 4, generator=g, dtype=torch.float64), torch.randn(1, 20, 2, 4, generator=g,
                                                                                  dtype=torch.float64)
    spec, q_pos = MaskSpec(window=4), torch.tensor([19])
    far, near = torch.arange(0, 10), torch.arange(10, 20)  # the first rank's keys all outside the window
    out, lse = partial_over_cache(q, k[:, far], v[:, far], spec, q_pos=q_pos, k_pos=far)
    assert bool(torch.isneginf(lse).all()) and float(out.abs().max()) == 0.0
    got, _ = merge_ranks([(out, lse), partial_over_cache(q, k[:, near], v[:, near], spec, q_pos=q_pos, k_pos=near)])
    want = oracle(q, k, v, spec, q_pos, torch.arange(20), None, None)
    assert float((got - want).abs().max()) <= 1e-12


def test_softcap_in_float32_picks_a_backend_that_has_it():
    """Gemma 2's softcap in a float32 model: the backend is chosen for the whole mask (the cpu backend has no
    softcap), and the step equals the float64 oracle to float32 rounding."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 1, 2, 8, generator=g)
    k, v = torch.randn(1, 30, 2, 8, generator=g), torch.randn(1, 30, 2, 8, generator=g)
    spec, q_pos = MaskSpec(softcap=2.0), torch.tensor([29])
    halves = [torch.arange(0, 30, 2), torch.arange(1, 30, 2)]
    got, _ = merge_ranks([partial_over_cache(q, k[:, p], v[:, p], spec, q_pos=q_pos, k_pos=p) for p in halves])
    want = oracle(q.double(), k.double(), v.double(), spec, q_pos, torch.arange(30), None, None)
    assert float((got.double() - want).abs().max()) <= 1e-5


def test_a_steps_plans_are_shared_only_over_the_same_positions(monkeypatch):
    """Layers of one decode step share a plan when their mask and cached positions agree (planned once); keys
    at other positions (as many, the same first and last) are planned anew."""
    import cp_attention.engine.decode as decode

    built = []
    monkeypatch.setattr(decode, "build_local_plan", lambda *a, **kw: built.append(1) or build_local_plan(*a, **kw))
    g = torch.Generator().manual_seed(6)
    q = torch.randn(1, 1, 2, 4, generator=g, dtype=torch.float64)
    k, v = torch.randn(1, 12, 2, 4, generator=g, dtype=torch.float64), torch.randn(1, 12, 2, 4, generator=g,
                                                                                  dtype=torch.float64)
    spec, q_pos, plans = MaskSpec(window=5), torch.tensor([11]), {}
    for pos in (torch.tensor([0, 7, 9, 11]), torch.tensor([0, 7, 9, 11]), torch.tensor([0, 8, 10, 11])):
        got, _ = merge_ranks([partial_over_cache(q, k[:, pos], v[:, pos], spec, q_pos=q_pos, k_pos=pos, plans=plans)])
        assert len(plans) == 1
        want = oracle(q, k[:, pos], v[:, pos], spec, q_pos, pos, None, None)
        assert float((got - want).abs().max()) <= 1e-12
    assert len(built) == 2  # the second layer reused the first's plan; the third planned its own
