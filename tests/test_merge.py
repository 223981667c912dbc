"""Log-sum-exp merging and sinks against direct computation."""

from __future__ import annotations

import torch

from cp_attention.merge import apply_sinks, merge_partials


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
