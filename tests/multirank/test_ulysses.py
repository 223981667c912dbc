"""All-to-all head parallelism (strategy="ulysses") against the float64 dense oracle.

* The head split: every query head attends with the K/V head of its GQA group (h // (H / K)), each
  rank receives the fewest K/V heads that keep one per ``gcd`` group of its query heads, H not
  divisible by P raises on every rank together.
* Exactness at world sizes 2, 3 and 4 (one spawned group each runs every case): causal and
  bidirectional, windows below, at and above a shard, chunks with documents not starting at 0,
  packed documents (position_ids and cu_seqlens), softcap, sinks, GQA with K = 1 and K = 2 at
  P = 4 (replication), B = 2, odd L, zigzag / contiguous / balanced layouts; forward and backward
  (dq, dk, dv and the sinks' gradient summed over ranks) <= 1e-9 in float64, one float32 case
  <= 1e-5.
* The exchanges per call: the agreement once, then two all-to-alls forward and two backward.
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

import cp_attention
from cp_attention.comm import Comm
from cp_attention.engine.agreement import Header
from cp_attention.tools.launch import run_ranks
from cp_attention.strategies.ulysses import head_split
from oracle import oracle_attention, oracle_mask


@pytest.mark.parametrize("H, K, P", [(4, 2, 2), (8, 2, 4), (4, 1, 4), (12, 6, 4), (24, 6, 4), (12, 3, 4), (6, 3, 3),
                                     (8, 8, 2), (16, 4, 8), (6, 2, 3)])
def test_head_split_follows_the_gqa_groups(H, K, P):
    split = head_split(H, K, P)
    G, h = H // K, H // P
    assert split.q_per_rank == h and [split.q_range(r) for r in range(P)] == [(r * h, (r + 1) * h) for r in range(P)]
    for r in range(P):
        lo, hi = split.q_range(r)
        # the K/V heads received are exactly the distinct ones its query heads use (GQA: q // G)
        needed = sorted({q // G for q in range(lo, hi)})
        assert list(range(*split.kv_range(r))) == needed
        for local in range(h):  # and the kernel's head for local query head i is i // group
            assert split.kv_slots[r][local // split.group] == (lo + local) // G
        repeats = split.repeats(r) or (1,) * len(needed)
        assert sum(repeats) == h // split.group and len(repeats) == len(needed)
    # every K/V head reaches each rank that uses it, and only those
    assert split.kv_sent == sum(len({q // G for q in range(*split.q_range(r))}) for r in range(P))


def test_head_split_needs_heads_divisible_by_ranks():
    with pytest.raises(ValueError, match="6 heads are not a multiple of 4; use strategy='ring'"):
        head_split(6, 2, 4)
    with pytest.raises(ValueError, match="strategy must be one of"):
        with cp_attention.context_parallel(strategy="zigzag"):
            pass
    with pytest.raises(ValueError, match="ulysses_size is the head-group size of strategy='usp'"):
        with cp_attention.context_parallel(strategy="ring", ulysses_size=2):
            pass
    with pytest.raises(ValueError, match="strategy='usp'\\) needs ulysses_size"):
        with cp_attention.context_parallel(strategy="usp"):
            pass


# -- exactness on several ranks ------------------------------------------------------------------

def _cases(world_size: int) -> list[dict]:
    """Every mask kind; windows relative to a shard of L / P tokens (P = 6: a few, for usp with a
    ring of 3 head groups and head groups of 3)."""
    if world_size == 6:
        docs = [[9, 25, 33], [40, 27]]
        return [dict(name="causal-K2", L=67, heads=(12, 2)),
                dict(name="window-docs-sinks", L=67, heads=(12, 2), window=8, docs=docs, sinks=True),
                dict(name="bidir-chunks-softcap-K3", L=67, heads=(12, 3), causal=False, chunk_size=7, docs=docs,
                     offset=2, softcap=2.0)]
    L = 61 if world_size != 2 else 48
    shard = L // world_size
    docs = [[7, 20, L - 27], [L - 30, 30]]
    cases = [
        dict(name="causal", L=L, heads=(4 if world_size != 3 else 6, 2)),
        dict(name="bidirectional-softcap", L=L, causal=False, softcap=2.5, heads=(6 if world_size == 3 else 4, 2)),
        dict(name="window-below-shard", L=L, window=max(2, shard // 2), docs=docs),
        dict(name="window-at-shard", L=L, window=shard, docs=docs, sinks=True),
        dict(name="window-above-shard-bidir", L=L, window=shard + 5, causal=False, docs=docs),
        dict(name="chunks-docs-not-at-0", L=L, chunk_size=6, docs=docs, offset=3),
        dict(name="cu-seqlens-sinks-softcap", L=L, cu=[11, L - 25, 14], sinks=True, softcap=3.0),
        dict(name="mqa-K1", L=L, heads=(world_size * 2, 1), window=9, docs=docs),
        dict(name="gqa-K2-replicated", L=L, heads=(world_size * 3, 2) if world_size == 4 else (world_size * 2, 2),
             sinks=True, docs=docs),
        dict(name="float32", L=L, window=shard, docs=docs, dtype=torch.float32),
    ]
    if world_size == 4:  # GQA groups of 4 over ranks of 3 query heads: ranks receive 1, 2, 2, 1 K/V heads
        cases.append(dict(name="gqa-K3-uneven", L=L, heads=(12, 3), window=shard + 1, docs=docs, sinks=True))
    for c in cases:
        c.setdefault("heads", (world_size * 2, 2) if world_size != 3 else (6, 3))
    return cases


def _inputs(case: dict):
    B = 1 if "cu" in case else 2
    L, (H, K) = case["L"], case["heads"]
    gen = torch.Generator().manual_seed(len(case["name"]))
    dtype = case.get("dtype", torch.float64)
    q, k, v = (torch.randn(B, L, n, 8, generator=gen, dtype=torch.float64) for n in (H, K, K))
    dout = torch.randn(B, L, H, 8, generator=gen, dtype=torch.float64)
    sinks = torch.randn(H, generator=gen, dtype=torch.float64) if case.get("sinks") else None
    position_ids = cu_seqlens = None
    if "docs" in case:
        position_ids = torch.tensor([[p + case.get("offset", 0) * (i == 1) for i, n in enumerate(row)
                                      for p in range(n)] for row in case["docs"]])
    if "cu" in case:
        cu_seqlens = torch.tensor([0] + case["cu"]).cumsum(0).to(torch.int32)
    return [t.to(dtype) for t in (q, k, v, dout)], None if sinks is None else sinks.to(dtype), position_ids, cu_seqlens


def _want(case: dict):
    (q, k, v, dout), sinks, position_ids, cu_seqlens = _inputs(case)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    s = None if sinks is None else sinks.double().requires_grad_()
    mask = oracle_mask(q.shape[0], q.shape[1], position_ids=position_ids, cu_seqlens=cu_seqlens,
                       causal=case.get("causal", True), window=case.get("window"), chunk_size=case.get("chunk_size"))
    out = oracle_attention(*leaves, mask, softcap=case.get("softcap"), sinks=s)
    out.backward(dout.double())
    return [out.detach(), *(x.grad for x in leaves)] + ([s.grad] if s is not None else [])


def _layout_for(name: str, world_size: int, case: dict, position_ids, cu_seqlens):
    if name != "balanced":
        return name
    mask = dict(causal=case.get("causal", True), window=case.get("window"), chunk_size=case.get("chunk_size"))
    seq_len = case["L"] if position_ids is None and cu_seqlens is None else None
    return cp_attention.balanced_layout(world_size, position_ids=position_ids, cu_seqlens=cu_seqlens, seq_len=seq_len,
                                        masks=[mask])


def _exactness_worker(rank: int, world_size: int, strategy: str, ulysses_size,
                      layouts=("zigzag", "contiguous", "balanced")) -> dict:
    errors = {}
    for case in _cases(world_size):
        (q, k, v, dout), sinks, position_ids, cu_seqlens = _inputs(case)
        for layout_name in layouts:
            layout = _layout_for(layout_name, world_size, case, position_ids, cu_seqlens)
            with cp_attention.context_parallel(layout=layout, strategy=strategy, ulysses_size=ulysses_size,
                                               cost_model=WORK_ONLY if strategy == "auto" else None) as cp:
                leaves = [cp.shard(t).requires_grad_() for t in (q, k, v)]
                s = None if sinks is None else sinks.clone().requires_grad_()
                out = cp_attention.attention(
                    *leaves, position_ids=None if position_ids is None else cp.shard(position_ids),
                    cu_seqlens=cu_seqlens, causal=case.get("causal", True), window=case.get("window"),
                    chunk_size=case.get("chunk_size"), softcap=case.get("softcap"), sinks=s)
                out.backward(cp.shard(dout))
                got = [cp.gather(t) for t in (out.detach(), *(x.grad for x in leaves))]
                if s is not None:
                    dist.all_reduce(s.grad)  # each rank holds its heads' share of the sinks' gradient
                    got.append(s.grad)
                stats = cp_attention.last_plan_stats()
            errors[(case["name"], layout_name)] = ([float((a.double() - b).abs().max()) for a, b in zip(got, _want(case))],
                                                   (stats.strategy, stats.ulysses_size, stats.predicted))
    return errors


# auto under a model where only the busiest rank's work counts: it takes head parallelism where the
# layout leaves the ring's work unbalanced (contiguous shards of a causal mask), the ring where it ties
WORK_ONLY = cp_attention.CostModel(latency=0.0, bandwidth=1e18, inter_node_bandwidth=1e18, throughput=1e9)

# (world size, strategy, ulysses_size): every valid usp split (1: the ring's code path; P: ulysses') and auto
GRID = [(2, "ulysses", None), (2, "usp", 1), (2, "auto", None), (3, "ulysses", None),
        pytest.param(3, "usp", 1, marks=pytest.mark.strategies),  # the ring's code path, as at P = 2
        (3, "auto", None), pytest.param(4, "ulysses", None, marks=pytest.mark.slow), (4, "usp", 2),
        pytest.param(4, "auto", None, marks=pytest.mark.slow)]  # P = 4's ulysses/auto: as at P = 3 (CI's time)


@pytest.mark.parametrize("world_size, strategy, ulysses_size", GRID)
def test_strategies_exact_against_the_oracle(world_size, strategy, ulysses_size):
    per_rank = run_ranks(world_size, _exactness_worker, strategy, ulysses_size, timeout=900)
    cases = {c["name"]: c for c in _cases(world_size)}
    assert len(per_rank[0]) == 3 * len(cases)
    want = {"ulysses": ("ulysses", world_size), "usp": ("ring", 1) if ulysses_size == 1 else ("usp", ulysses_size)}
    chosen = set()
    for errors in per_rank:
        for (name, layout), (errs, (ran, size, predicted)) in errors.items():
            bound = 1e-5 if cases[name].get("dtype") == torch.float32 else 1e-9
            assert max(errs) <= bound, (world_size, strategy, name, layout, errs)
            if strategy != "auto":
                assert (ran, size) == want[strategy] and predicted == (), (ran, size, predicted)
                continue
            # auto ran the candidate its model rated cheapest (the first of the cheapest), and weighed every valid one
            names = [n for n, _ in predicted]
            assert names[0] == "ring" and len(names) == len(set(names)) >= 2, predicted
            best = min(predicted, key=lambda item: item[1])[0]
            label = {"ring": "ring", "ulysses": "ulysses"}.get(ran, f"usp{size}x{world_size // size}")
            assert label == best, (name, layout, ran, size, predicted)
            chosen.add(label)
    if strategy == "auto":  # the small cases' costs differ enough that auto switches between strategies
        assert len(chosen) >= 2, chosen


@pytest.mark.parametrize("ulysses_size", [pytest.param(2, marks=pytest.mark.slow),  # six ranks: with -m slow
                                          pytest.param(3, marks=pytest.mark.strategies)])
def test_usp_at_six_ranks_exact(ulysses_size):
    """usp with a ring of 3 head groups (its rounds send and receive with different head groups) and
    with head groups of 3 (K/V heads shared by two members), against the float64 oracle."""
    per_rank = run_ranks(6, _exactness_worker, "usp", ulysses_size, ("zigzag", "balanced"), timeout=900)
    for errors in per_rank:
        assert len(errors) == 2 * len(_cases(6))
        for (name, layout), (errs, (ran, size, _)) in errors.items():
            assert (ran, size) == ("usp", ulysses_size) and max(errs) <= 1e-9, (name, layout, errs)


# -- exchanges per call ---------------------------------------------------------------------------

def _count(name: str) -> list[int]:
    counter = [0]
    original = getattr(Comm, name)

    def counted(self, *args, **kwargs):
        counter[0] += 1
        return original(self, *args, **kwargs)

    setattr(Comm, name, counted)
    return counter


def _sent_bytes() -> list[int]:
    """Count the bytes of every point-to-point send posted (the traffic, measured)."""
    sent = [0]
    original = Comm._post

    def post(self, ops, what):
        sent[0] += sum(t.numel() * t.element_size() for kind, t, _, _ in ops if kind == "send")
        return original(self, ops, what)

    Comm._post = post
    return sent


def _exchanges_worker(rank: int, world_size: int) -> dict:
    a2a, gathers, posts = _count("all_to_all"), _count("all_gather"), _count("_post")
    sent = _sent_bytes()
    q, k, v = (torch.randn(1, 24, n, 8, generator=torch.Generator().manual_seed(n)) for n in (4, 2, 2))
    found = {}
    with cp_attention.context_parallel(strategy="ulysses") as cp:
        leaves = [cp.shard(t).requires_grad_() for t in (q, k, v)]
        cp_attention.attention(*leaves, window=5)  # the agreement's header, once
        sent[0] = 0
        out = cp_attention.attention(*leaves, window=5, layout="zigzag")
        stats = cp_attention.last_plan_stats()
        found["sent"] = (sent[0], stats.kv_bytes_sent, stats.grad_bytes_sent)
        sent[0] = a2a[0] = gathers[0] = posts[0] = 0
        out = cp_attention.attention(*leaves, window=5)
        found["forward"] = (a2a[0], gathers[0], posts[0])
        sent[0] = a2a[0] = gathers[0] = posts[0] = 0
        out.sum().backward()
        found["backward"] = (a2a[0], gathers[0], posts[0], sent[0])
        # H = 6 over 4 ranks: raised on every rank together, after the agreement; the group stays usable
        try:
            cp_attention.attention(*(cp.shard(torch.randn(1, 24, 6, 8)) for _ in range(3)))
            found["indivisible"] = "no error"
        except ValueError as exc:
            found["indivisible"] = str(exc)
        found["after"] = tuple(cp_attention.attention(*leaves).shape)
        # the strategy of a call is its own: ring, then ulysses, on the same inputs and cached plans
        ring = cp_attention.attention(*leaves, window=5, strategy="ring")
        found["switch"] = (cp_attention.last_plan_stats().strategy,
                           float((cp_attention.attention(*leaves, window=5) - ring).abs().max()),
                           cp_attention.last_plan_stats().strategy)
        try:  # ranks that disagree on the strategy raise together
            cp_attention.attention(*leaves, strategy="ring" if rank == 2 else "ulysses")
            found["disagree"] = "no error"
        except ValueError as exc:
            found["disagree"] = str(exc)
    return found


def test_exchanges_per_call_and_indivisible_heads():
    header = len(Header.names()) * 8 * 3  # the agreement's header (one int64 a field) to each of the 3 other ranks
    for found in run_ranks(4, _exchanges_worker, timeout=300):
        measured, forward, backward = found["sent"]
        assert measured - header == forward, found  # the statistics are the bytes actually sent
        assert found["forward"] == (2, 1, 3), found  # agreement (one all-gather), then two all-to-alls
        assert found["backward"][:3] == (2, 0, 2), found  # the reverse all-to-alls, nothing else
        assert found["backward"][3] == backward, found
        assert "6 query heads over head groups of 4 ranks, but 6 is not a multiple of 4" in found["indivisible"], found
        assert found["after"] == (1, 6, 4, 8)
        assert found["switch"][0] == "ring" and found["switch"][2] == "ulysses" and found["switch"][1] < 1e-6, found
        assert "ranks disagree on strategy: [1, 1, 0, 1]" in found["disagree"], found


def _usp_exchanges_worker(rank: int, world_size: int) -> dict:
    posts = _count("_post")
    sent = _sent_bytes()
    q, k, v = (torch.randn(2, 40, n, 8, generator=torch.Generator().manual_seed(n)) for n in (4, 2, 2))
    found = {}
    with cp_attention.context_parallel(strategy="usp", ulysses_size=2) as cp:
        leaves = [cp.shard(t).requires_grad_() for t in (q, k, v)]
        for window in (None, 6):
            cp_attention.attention(*leaves, window=window)  # the plan, built and cached
            sent[0] = posts[0] = 0
            out = cp_attention.attention(*leaves, window=window)
            stats = cp_attention.last_plan_stats()
            forward = (posts[0], sent[0])
            sent[0] = posts[0] = 0
            out.sum().backward()
            found[window] = dict(forward=forward, backward=(posts[0], sent[0]), stats=stats)
    # auto with a different cost model on rank 1: every rank raises, before anything moves
    model = cp_attention.CostModel(latency=1e-5 if rank == 1 else 2e-5)
    with cp_attention.context_parallel(strategy="auto", cost_model=model) as cp:
        try:
            cp_attention.attention(*(cp.shard(t) for t in (q, k, v)))
            found["models"] = "no error"
        except ValueError as exc:
            found["models"] = str(exc)
        found["after"] = cp_attention.attention(*(cp.shard(t) for t in (q, k, v)), strategy="ring").shape
    return found


def test_usp_exchanges_are_its_own():
    """usp at P = 4 in head groups of 2: per call the agreement's header (one post), the two
    all-to-alls within the head group and the ring's rounds over the two head groups, nothing else;
    the bytes posted are the statistics' (the ring's backward sends its K/V again)."""
    header = len(Header.names()) * 8 * 3
    for rank, found in enumerate(run_ranks(4, _usp_exchanges_worker, timeout=300)):
        assert "ranks disagree on cost_model_crc" in found.pop("models"), found
        assert tuple(found.pop("after")) == (2, 10, 4, 8)
        for window, got in found.items():
            stats = got["stats"]
            assert (stats.strategy, stats.ulysses_size) == ("usp", 2), stats
            ring_rounds = stats.rounds - 2
            assert ring_rounds == 1, stats  # two head groups: one ring round
            head_peer, ring_peer = rank ^ 1, (rank + 2) % 4  # head groups {0, 1}, {2, 3}; rings {0, 2}, {1, 3}
            assert set(stats.peers_send) == {head_peer, ring_peer}, stats
            assert got["forward"] == (1 + 2 + ring_rounds, header + stats.kv_bytes_sent), (window, got)
            assert got["backward"][0] == 2 + 2 * ring_rounds, got  # per ring round: K/V again, then dK/dV
            # each all-to-all, by hand: 10 tokens x B 2 of the partner's 2 query heads and its K/V head
            # (2 x 8 + 8 + 8 floats) = 2560 B, then 10 tokens x 2 of its 2 heads' outputs (2 x 8) = 1280 B,
            # each way; the rest of the forward is the ring's K/V, which the backward sends again, with
            # the all-to-alls' reverse and the ring's dK/dV (the rest of grad_bytes_sent)
            a2a = 2560 + 1280
            assert got["backward"][1] == a2a + (stats.kv_bytes_sent - a2a) + (stats.grad_bytes_sent - a2a), got
            assert stats.kv_bytes_sent > a2a and stats.grad_bytes_sent > a2a, stats
