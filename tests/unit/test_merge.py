"""Log-sum-exp merging and sinks against direct computation, and the ring's use of both against
the independent float64 oracle (``oracle.py``)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from cp_attention import layout as layout_mod
from cp_attention.backends import BACKENDS
from cp_attention.masks import MaskSpec, SequenceMeta, doc_starts_from_position_ids
from cp_attention.strategies.merge import apply_sinks, merge_partials
from cp_attention.plan import build_plan
from cp_attention.strategies.ring import ring_attention
from oracle import oracle_attention, oracle_mask, rank_tokens

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from harness import SimComm  # noqa: E402  one process stands in for every rank


def _attend(scores_HTS, v_SHD):
    lse = torch.logsumexp(scores_HTS, -1)
    p = torch.exp(scores_HTS - lse[..., None])
    return torch.einsum("hts,shd->thd", p, v_SHD), lse


def test_merge_equals_attention_over_union():
    gen = torch.Generator().manual_seed(0)
    H, T, S1, S2, D = 3, 5, 4, 6, 8
    s = torch.randn(H, T, S1 + S2, generator=gen, dtype=torch.float64) * 3
    v = torch.randn(S1 + S2, H, D, generator=gen, dtype=torch.float64)
    full_out, full_lse = _attend(s, v)
    o1, l1 = _attend(s[..., :S1], v[:S1])
    o2, l2 = _attend(s[..., S1:], v[S1:])
    out, lse = merge_partials(o1, l1, o2, l2)
    torch.testing.assert_close(out, full_out)
    torch.testing.assert_close(lse, full_lse)


def test_merge_with_empty_parts_is_nan_free():
    out_a = torch.zeros(4, 2, 3)
    lse_a = torch.full((2, 4), float("-inf"))
    out_b = torch.randn(4, 2, 3)
    lse_b = torch.tensor([[0.5, float("-inf"), 1.0, float("-inf")]] * 2)
    out, lse = merge_partials(out_a, lse_a, out_b, lse_b)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out[0], out_b[0])
    assert (out[1] == 0).all() and torch.isneginf(lse[:, 1]).all()
    out2, lse2 = merge_partials(out_a, lse_a, out_a, lse_a)
    assert (out2 == 0).all() and torch.isneginf(lse2).all()


def test_sinks_equal_an_extra_valueless_logit():
    gen = torch.Generator().manual_seed(1)
    H, T, S, D = 2, 3, 5, 4
    s = torch.randn(H, T, S, generator=gen, dtype=torch.float64)
    v = torch.randn(S, H, D, generator=gen, dtype=torch.float64)
    sinks = torch.randn(H, generator=gen, dtype=torch.float64)
    with_sink = torch.cat([s, sinks.view(H, 1, 1).expand(H, T, 1)], -1)
    v0 = torch.cat([v, torch.zeros(1, H, D, dtype=torch.float64)])
    want_out, want_lse = _attend(with_sink, v0)
    out, lse = apply_sinks(*_attend(s, v), sinks)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    # a row that saw no key outputs zero, and its lse becomes the sink
    out0, lse0 = apply_sinks(torch.zeros(1, H, D), torch.full((H, 1), float("-inf")), sinks.float())
    assert (out0 == 0).all()
    torch.testing.assert_close(lse0[:, 0], sinks.float())


# ------------------------------------------------------------------------------------------------
# the ring's use of the merge and of sinks, against the independent oracle (one process)




@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("sinks_on", [True, False])
def test_ring_merges_partials_and_applies_sinks_like_the_oracle(layout, sinks_on):
    """Three simulated ranks (so every query merges partial results from several K/V shards), packed
    documents, a window, softcap, GQA and sinks: each rank's out, dq and share of dsinks equal the
    oracle's (sinks applied once, after the merge, as a value-less logit)."""
    L, P, H, K, D = 61, 3, 4, 2, 8
    gen = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(1, L, n, D, generator=gen, dtype=torch.float64) for n in (H, K, K, H))
    sinks = torch.randn(H, generator=gen, dtype=torch.float64) * 2 if sinks_on else None
    pos = torch.tensor([list(range(25)) + list(range(36))])
    mask = oracle_mask(1, L, position_ids=pos, window=30)
    leaves = [q.clone().requires_grad_()] + ([sinks.clone().requires_grad_()] if sinks_on else [])
    want = oracle_attention(leaves[0], k, v, mask, softcap=3.0, sinks=leaves[1] if sinks_on else None)
    want_grads = torch.autograd.grad(want, leaves, dout)
    spec = MaskSpec(window=30, softcap=3.0)
    meta = SequenceMeta(batch=1, seq_len=L, doc_start=doc_starts_from_position_ids(pos), position=pos)
    ks = [layout_mod.shard(k, 1, P, layout, r) for r in range(P)]
    vs = [layout_mod.shard(v, 1, P, layout, r) for r in range(P)]
    dsinks = torch.zeros(H, dtype=torch.float64)
    merged_somewhere = False
    for r in range(P):
        mine = rank_tokens(L, P, layout, r)
        plan = build_plan(meta, spec, world_size=P, layout=layout, rank=r, head_kv=K, head_dim=D, itemsize=8)
        merged_somewhere |= plan.stats.rounds > 0 and plan.local is not None
        qq = layout_mod.shard(q, 1, P, layout, r).clone().requires_grad_()
        ss = sinks.clone().requires_grad_() if sinks_on else None
        out = ring_attention(qq, ks[r], vs[r], ss, plan, SimComm(plan, ks, vs), BACKENDS["reference"],
                             scale=D ** -0.5, softcap=3.0)
        torch.testing.assert_close(out, want.detach()[:, mine], atol=1e-10, rtol=0)
        out.backward(dout[:, mine])
        torch.testing.assert_close(qq.grad, want_grads[0][:, mine], atol=1e-10, rtol=0)
        if sinks_on:
            dsinks += ss.grad
    assert merged_somewhere
    if sinks_on:
        torch.testing.assert_close(dsinks, want_grads[1], atol=1e-10, rtol=0)
