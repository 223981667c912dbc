"""The planner: every visible pair computed exactly once, and K/V moved only where the mask needs it.

Expected pairs and halos come from the independent oracle (``oracle.py``, no cp_attention code);
the library's ``SequenceMeta``/``MaskSpec`` only describe the case to the planner under test.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from cp_attention import layout as layout_mod
from cp_attention.masks import MaskSpec, SequenceMeta, doc_starts_from_position_ids
from cp_attention.plan import build_plan
from oracle import halo_keys, oracle_mask
from planutil import covered_pairs

HKV, D, ITEM = 2, 8, 4
TOKEN_BYTES = 2 * HKV * D * ITEM  # K and V of one token, one batch row


def _positions(docs):
    """(B, L) position ids restarting at 0 in every document, or None for one document per row."""
    return None if docs is None else torch.tensor([[p for n in row for p in range(n)] for row in docs])


def _meta(L, docs=None, B=1):
    if docs is None:
        return SequenceMeta(batch=B, seq_len=L)
    pos = _positions(docs)
    return SequenceMeta(batch=B, seq_len=L, doc_start=doc_starts_from_position_ids(pos))


def _want(L, docs, B, **flags):
    """The oracle's (B, L, L) mask as int64 counts (every visible pair exactly once)."""
    return oracle_mask(B, L, position_ids=_positions(docs), **flags).long()


def _plans(meta, spec, P, lay):
    return [build_plan(meta, spec, world_size=P, layout=lay, rank=r, head_kv=HKV, head_dim=D, itemsize=ITEM)
            for r in range(P)]


def _random_docs(rng, L, longest):
    out = []
    while sum(out) < L:
        out.append(min(rng.randint(1, longest), L - sum(out)))
    return out


def _pairs(mask_LL):
    return {(q, k) for q, k in mask_LL.nonzero().tolist()}


def test_oracle_mask_follows_the_documented_examples():
    """The oracle itself, on hand-written pairs (README "Use")."""
    # causal window W = 3: 0 <= q - k < 3
    assert _pairs(oracle_mask(1, 5, window=3)[0]) == {(q, k) for q in range(5) for k in range(5) if 0 <= q - k < 3}
    assert (4, 2) in _pairs(oracle_mask(1, 5, window=3)[0]) and (4, 1) not in _pairs(oracle_mask(1, 5, window=3)[0])
    # bidirectional window W = 2: |q - k| < 2
    assert _pairs(oracle_mask(1, 4, causal=False, window=2)[0]) == {
        (0, 0), (0, 1), (1, 0), (1, 1), (1, 2), (2, 1), (2, 2), (2, 3), (3, 2), (3, 3)}
    # documents where position_ids do not rise by exactly 1: [0, 1 | 0 | 5, 6]
    pos = torch.tensor([[0, 1, 0, 5, 6]])
    assert _pairs(oracle_mask(1, 5, position_ids=pos)[0]) == {(0, 0), (1, 0), (1, 1), (2, 2), (3, 3), (4, 3), (4, 4)}
    # chunks by position // C: a document continued from position 5 with C = 4: {5, 6, 7}, {8, 9}
    pos = torch.tensor([[5, 6, 7, 8, 9]])
    chunked = _pairs(oracle_mask(1, 5, position_ids=pos, causal=False, chunk_size=4)[0])
    assert chunked == {(q, k) for q in range(5) for k in range(5) if (q < 3) == (k < 3)}
    # cu_seqlens: positions count from 0 at each document's first token; an empty document is no token
    cu = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    got = _pairs(oracle_mask(1, 7, cu_seqlens=cu, causal=False, chunk_size=2)[0])
    groups = [{0, 1}, {2}, {3, 4}, {5, 6}]
    assert got == {(q, k) for g in groups for q in g for k in g}
    # two rows, each its own documents
    two = oracle_mask(2, 3, position_ids=torch.tensor([[0, 1, 2], [0, 0, 1]]))
    assert _pairs(two[0]) == {(0, 0), (1, 0), (1, 1), (2, 0), (2, 1), (2, 2)}
    assert _pairs(two[1]) == {(0, 0), (1, 1), (2, 1), (2, 2)}


def test_every_visible_pair_is_computed_exactly_once():
    rng = random.Random(0)
    for trial in range(160):
        P = rng.choice([1, 2, 3, 4, 5, 8])
        lay = rng.choice(layout_mod.LAYOUTS)
        L = rng.randint(P, 70)
        B = rng.choice([1, 2])
        docs = None
        if rng.random() < 0.5:
            docs = [_random_docs(rng, L, rng.choice([1, 3, 12, L])) for _ in range(B)]
        flags = dict(causal=rng.random() < 0.7, window=rng.choice([None, None, 1, 2, 5, 9, 31]),
                     chunk_size=rng.choice([None, None, 1, 4, 13]))
        meta = _meta(L, docs, B)
        count, plans = covered_pairs(meta, MaskSpec(**flags), P, lay, head_kv=HKV, head_dim=D)
        want = _want(L, docs, B, **flags)
        assert torch.equal(count, want), (trial, P, lay, L, B, flags, docs)
        assert sum(p.stats.entries_visible for p in plans) == int(want.sum())
        assert all(p.stats.entries_computed >= p.stats.entries_visible for p in plans)
        # K/V travel for every row of a span together: each rank receives, for all B rows, exactly
        # the keys of other ranks that some query of some row sees (no token more)
        for r, plan in enumerate(plans):
            needed = int(halo_keys(want.bool(), P, lay, r).any(0).sum())
            assert plan.stats.kv_bytes_recv == needed * B * TOKEN_BYTES, (trial, P, lay, L, B, flags, docs, r)
        assert sum(p.stats.kv_bytes_sent for p in plans) == sum(p.stats.kv_bytes_recv for p in plans)


@pytest.mark.parametrize("lay", layout_mod.LAYOUTS)
def test_long_groups_with_gaps_span_several_work_tiles(lay):
    # groups longer than a work tile whose rows are not all live (bidirectional windows on zigzag)
    meta = _meta(300)
    for flags in (dict(causal=False, window=40), dict(window=140)):
        count, plans = covered_pairs(meta, MaskSpec(**flags), 2, lay)
        assert torch.equal(count, _want(300, None, 1, **flags))
        assert all(p.stats.entries_computed >= p.stats.entries_visible for p in plans)


@pytest.mark.parametrize("P", [2, 3, 4])
def test_window_below_shard_sends_exactly_one_halo_round(P):
    L, W = 64 * P + 1, 20  # contiguous shards of 64-65 tokens
    plans = _plans(_meta(L), MaskSpec(window=W), P, "contiguous")
    for r, plan in enumerate(plans):
        st = plan.stats
        if r == 0:
            assert st.rounds == 1 and st.peers_recv == () and st.kv_bytes_recv == 0
        else:
            assert st.peers_recv == (r - 1,), "one neighbour only"
            assert st.kv_bytes_recv == (W - 1) * TOKEN_BYTES, "exactly the W-1 token halo"
        assert st.kv_bytes_sent == (0 if r == P - 1 else (W - 1) * TOKEN_BYTES)
        assert st.kernel_calls == (1 if r == 0 else 2)


@pytest.mark.parametrize("W", [65, 100, 150, 300])
def test_window_spanning_shards_reaches_only_needed_predecessors(W):
    P, S = 6, 64
    L = P * S
    plans = _plans(_meta(L), MaskSpec(window=W), P, "contiguous")
    reach = math.ceil((W - 1) / S)
    for r, plan in enumerate(plans):
        assert plan.stats.peers_recv == tuple(range(r - 1, max(-1, r - 1 - reach), -1))
        assert plan.stats.kv_bytes_recv == min(W - 1, r * S) * TOKEN_BYTES


@pytest.mark.parametrize("lay", layout_mod.LAYOUTS)
@pytest.mark.parametrize("causal", [True, False])
def test_separated_documents_exchange_nothing(lay, causal):
    P = 4
    L = 8 * 24
    n = 2 * P if lay == "zigzag" else P
    # documents that never cross a slice edge: each slice holds 3 documents of 8 tokens
    docs = [[8] * (L // 8)]
    assert L % n == 0 and (L // n) % 8 == 0
    for plan in _plans(_meta(L, docs), MaskSpec(causal=causal, window=None), P, lay):
        assert plan.stats.kv_bytes_recv == 0 and plan.stats.kv_bytes_sent == 0
        assert plan.rounds == ()


def test_plain_causal_zigzag_sends_what_a_ring_sends_and_no_more():
    # rank r needs every other rank's K/V, except the late slice of earlier ranks (causally after
    # all of r's tokens): a ring delivers P-1 whole shards, the plan drops only that slice
    P, L = 4, 256
    half = L // (2 * P)
    for r, plan in enumerate(_plans(_meta(L), MaskSpec(), P, "zigzag")):
        st = plan.stats
        assert st.rounds == P - 1
        assert st.ring_kv_bytes_recv == (P - 1) * 2 * half * TOKEN_BYTES
        assert st.kv_bytes_recv == (r * half + (P - 1 - r) * 2 * half) * TOKEN_BYTES
        assert st.kv_bytes_recv <= st.ring_kv_bytes_recv
        assert st.kernel_calls == P, "one call per (query shard, kv shard) pair"
    assert _plans(_meta(L), MaskSpec(), P, "zigzag")[0].stats.kv_bytes_recv == (P - 1) * 2 * half * TOKEN_BYTES


def test_plain_causal_contiguous_receives_only_earlier_shards():
    P, L = 4, 256
    for r, plan in enumerate(_plans(_meta(L), MaskSpec(), P, "contiguous")):
        assert plan.stats.kv_bytes_recv == r * (L // P) * TOKEN_BYTES
        assert plan.stats.kernel_calls == r + 1


def test_packed_sliding_window_is_one_call_per_pair():
    # documents shorter and longer than the window share one kernel call on the diagonal
    P, L = 2, 512
    docs = [[40, 300, 12, 160]]
    for plan in _plans(_meta(L, docs), MaskSpec(window=64), P, "contiguous"):
        assert all(len(st.calls) == 1 for st in plan.steps())


def test_plan_is_deterministic():
    meta = _meta(300, [[100, 50, 150]])
    a = _plans(meta, MaskSpec(window=33, chunk_size=40), 3, "zigzag")
    b = _plans(meta, MaskSpec(window=33, chunk_size=40), 3, "zigzag")
    for pa, pb in zip(a, b):
        assert pa.stats == pb.stats
        for sa, sb in zip(pa.steps(), pb.steps()):
            assert sa.spans == sb.spans
            for ca, cb in zip(sa.calls, sb.calls):
                assert torch.equal(ca.cu_seqlens_q, cb.cu_seqlens_q) and ca.window == cb.window


def _corrupt(plan, step_index: int, **change):
    """The plan with one field of the first call (``window``) or of the step (``spans``) changed."""
    import dataclasses

    steps = plan.steps()
    step = steps[step_index]
    if "spans" in change:
        new_step = dataclasses.replace(step, spans=change["spans"])
    else:
        new_step = dataclasses.replace(step, calls=(dataclasses.replace(step.calls[0], **change),) + step.calls[1:])
    if step is plan.local:
        return dataclasses.replace(plan, local=new_step)
    rounds = tuple(dataclasses.replace(r, recv=new_step) if r.recv is step else r for r in plan.rounds)
    return dataclasses.replace(plan, rounds=rounds)


def test_plan_verification_rejects_a_wrong_call_and_an_extra_halo_token():
    from cp_attention.plan import verify_plan

    meta = _meta(300, [[120, 30, 150]])
    spec = MaskSpec(window=33)
    plan = build_plan(meta, spec, world_size=3, layout="contiguous", rank=1, head_kv=1, head_dim=1, itemsize=4,
                      verify=True)
    left, right = plan.local.calls[0].window
    with pytest.raises(AssertionError, match="exactly the visible pairs"):
        verify_plan(_corrupt(plan, 0, window=(left - 1, right)), meta, spec, "contiguous")
    (a, b), = plan.rounds[0].recv.spans
    with pytest.raises(AssertionError):  # one key more than the queries see
        verify_plan(_corrupt(plan, 1, spans=((a - 1, b),)), meta, spec, "contiguous")


def test_work_per_tile_closed_form_matches_a_count_per_tile():
    # entries_computed of a sequence sums, tile by tile of WORK_TILE query rows, the keys from the
    # tile's first row's first key to its last row's last: counted here one tile at a time
    from cp_attention.plan.build import WORK_TILE, _seq

    rng = random.Random(3)
    for _ in range(3000):
        Lq = rng.choice([1, WORK_TILE - 1, WORK_TILE, WORK_TILE + 1, 3 * WORK_TILE, rng.randint(1, 3000)])
        Lk = rng.randint(1, 4000)
        left, right = rng.choice([None, rng.randint(0, 4000)]), rng.choice([None, 0, rng.randint(0, 4000)])
        off, want = Lk - Lq, 0
        for a in range(0, Lq, WORK_TILE):
            b = min(a + WORK_TILE, Lq) - 1
            first = 0 if left is None else max(0, a + off - left)
            last = Lk if right is None else min(Lk, b + off + right + 1)
            want += (b - a + 1) * (last - first)
        assert _seq((0, Lq, 0, Lk, left, right), 0, 0).work == want, (Lq, Lk, left, right)


@pytest.mark.parametrize("docs", [None, [[1000] * 1048]])
def test_planning_cost_follows_documents_not_tokens(docs):
    # 2^20 tokens: a per-token planner allocates O(L) per rank pair; the plan of one rank here is
    # built from pieces (counted, not timed: at most a few per document and rank pair)
    import cp_attention.plan.build as plan_mod

    L = 1048 * 1000 if docs else 1 << 20
    meta = _meta(L, docs)
    calls = []
    original = plan_mod._fit
    plan_mod._fit = lambda *a: calls.append(1) or original(*a)
    try:
        plan = build_plan(meta, MaskSpec(window=4096), world_size=8, layout="zigzag", rank=3, head_kv=1, head_dim=1,
                          itemsize=2, verify=False)
    finally:
        plan_mod._fit = original
    assert plan.stats.entries_visible > 0
    n_docs = 1 if docs is None else len(docs[0])
    assert len(calls) <= 4 * (n_docs // 8 + 2 * 8), len(calls)
