"""Index-sparse attention (issue 38): each query sees only the keys it selected, intersected with
causality, windows, chunks and documents, at world sizes 1-4, and only the selected keys move.

The oracle is the float64 dense attention of tests/support/fuzz_cases.py with its mask (written
from the documented semantics) AND-ed with the selection's membership, built here with loops over
the selected indices: ``mask[b, q, j]`` is True when the rest of the mask lets ``q`` see ``j`` and
``j`` is among ``key_select[b, q]``. The selections cross every rank (each query picks keys spread
over its whole past), hold empty slots (-1), repeats, keys in the future and in other documents (which
must stay hidden), and one query selects nothing.

The traffic check counts by hand, from the oracle's mask, the distinct keys each rank's queries
keep that another rank holds: the bytes the rank receives are those keys' K/V rows, not the shards.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import cp_attention
from cp_attention.layout import global_index
from fuzz_cases import oracle_attention, oracle_mask, positions_and_cu
from rank_pool import RankPool

D, DV, S = 8, 6, 6


def _selection(case: dict, gen: torch.Generator) -> torch.Tensor:
    """(B, L, S) int64: half random keys of the whole row (-1 included: empty slots, future keys,
    other documents), half spread evenly over the query's past (crossing every rank's shard), one
    repeat, and query 3 of row 0 selecting nothing."""
    B, L = case["B"], case["L"]
    sel = torch.randint(-1, L, (B, L, S), generator=gen)
    q = torch.arange(L)
    for m in range(S // 2):
        sel[:, :, S // 2 + m] = (q * (2 * m + 1)) // S
    sel[:, :, 1] = sel[:, :, 0]
    sel[0, 3] = -1
    return sel


def _selected_oracle_mask(case: dict, sel: torch.Tensor) -> torch.Tensor:
    B, L = case["B"], case["L"]
    chosen = torch.zeros(B, L, L, dtype=torch.bool)
    for b in range(B):
        for i in range(L):
            for j in sel[b, i].tolist():
                if j >= 0:
                    chosen[b, i, j] = True
    return oracle_mask(case) & chosen


def _worker(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    reports = []
    for case in cases:
        B, L, (H, K), Dv = case["B"], case["L"], case["heads"], case.get("dv", DV)
        dtype = getattr(torch, case.get("dtype", "float64"))
        gen = torch.Generator().manual_seed(case["seed"])
        q = torch.randn(B, L, H, D, generator=gen, dtype=torch.float64).to(dtype).double()
        k = torch.randn(B, L, K, D, generator=gen, dtype=torch.float64).to(dtype).double()
        v = torch.randn(B, L, K, Dv, generator=gen, dtype=torch.float64).to(dtype).double()
        dout = torch.randn(B, L, H, Dv, generator=gen, dtype=torch.float64).to(dtype).double()
        sinks = torch.randn(H, generator=gen, dtype=torch.float64) if case["sinks"] else None
        sel = _selection(case, gen)
        mask = _selected_oracle_mask(case, sel)
        leaves = [t.requires_grad_() for t in (q, k, v)] + ([sinks.requires_grad_()] if sinks is not None else [])
        ref = oracle_attention(q, k, v, mask, scale=D ** -0.5, sinks=sinks)
        ref_grads = torch.autograd.grad(ref, leaves, dout)
        position_ids, cu_seqlens = positions_and_cu(case)
        layout = case["layout"]
        with cp_attention.context_parallel(layout=layout) as cp:
            ours = [cp.shard(t.detach().to(dtype)).requires_grad_() for t in (q, k, v)]
            sinks_in = sinks.detach().to(dtype).requires_grad_() if sinks is not None else None
            out = cp_attention.attention(
                *ours, position_ids=cp.shard(position_ids) if position_ids is not None else None,
                cu_seqlens=cu_seqlens, causal=case["causal"], window=case.get("window"),
                chunk_size=case.get("chunk_size"), sinks=sinks_in, key_select=cp.shard(sel),
                backend=case.get("backend"))
            stats = cp_attention.last_plan_stats()
            out.backward(cp.shard(dout).to(dtype))
            got = dict(out=out, dq=ours[0].grad, dk=ours[1].grad, dv=ours[2].grad)
            want = dict(out=cp.shard(ref.detach()), dq=cp.shard(ref_grads[0]), dk=cp.shard(ref_grads[1]),
                        dv=cp.shard(ref_grads[2]))
            if sinks is not None:
                dsinks = sinks_in.grad.double()
                if world_size > 1:
                    dist.all_reduce(dsinks)
                got["dsinks"], want["dsinks"] = dsinks, ref_grads[3]
            mine = global_index(L, world_size, layout, rank)
        # by hand: the distinct (row, key) pairs this rank's queries keep whose key another rank holds
        others = torch.ones(L, dtype=torch.bool)
        others[mine] = False
        remote = mask[:, mine].any(1) & others[None]
        by_hand = int(remote.sum()) * K * (D + Dv) * torch.finfo(dtype).bits // 8
        errs = {name: (got[name].double() - want[name]).abs().max().item() for name in got}
        reports.append(dict(errs=errs, kv_bytes_recv=stats.kv_bytes_recv, by_hand=by_hand, remote=int(remote.sum()),
                            ring=stats.ring_kv_bytes_recv, strategy=stats.strategy,
                            index_bytes=stats.index_bytes_sent, pairs=stats.entries_visible,
                            pairs_by_hand=int(mask[:, mine].sum())))
    return reports


def _cases() -> list[dict]:
    base = dict(B=2, L=29, heads=(4, 2), causal=True, sinks=False, docs=None)
    cases = [
        dict(base, tag="one document"),
        dict(base, tag="documents", docs=("pos", [[(0, 11), (0, 18)], [(0, 29)]])),
        dict(base, tag="documents + sinks", docs=("pos", [[(0, 4), (0, 25)], [(0, 15), (0, 14)]]), sinks=True),
        dict(base, tag="window", window=7, docs=("pos", [[(0, 20), (0, 9)], [(0, 29)]])),
        dict(base, tag="chunks", chunk_size=5, docs=("pos", [[(3, 12), (0, 17)], [(0, 29)]])),
        dict(base, tag="bidirectional", causal=False, docs=("pos", [[(0, 13), (0, 16)], [(0, 29)]])),
        dict(base, tag="MQA, cu_seqlens", B=1, heads=(4, 1), docs=("cu", [10, 19])),
    ]
    return [dict(c, seed=i + 1) for i, c in enumerate(cases)]


@pytest.fixture(scope="module")
def pools():
    made = {}
    yield lambda n: made.setdefault(n, RankPool(n))
    for pool in made.values():
        pool.close()


@pytest.mark.parametrize("world_size,layout", [(1, "zigzag"), (2, "zigzag"), (2, "contiguous"), (3, "zigzag"),
                                               (4, "zigzag"), (4, "contiguous")])
def test_selected_keys_equal_the_dense_oracle_and_move_only_what_is_selected(pools, world_size, layout):
    cases = [dict(c, layout=layout) for c in _cases()]
    per_rank = pools(world_size).run(_worker, cases, timeout=600)
    failures = []
    for rank, reports in enumerate(per_rank):
        for case, rep in zip(cases, reports):
            where = f"rank {rank} {case['tag']}"
            failures += [f"{where}: {name} error {err:.1e}" for name, err in rep["errs"].items() if not err <= 1e-12]
            if rep["strategy"] != "select":
                failures.append(f"{where}: strategy {rep['strategy']}")
            if rep["kv_bytes_recv"] != rep["by_hand"]:
                failures.append(f"{where}: received {rep['kv_bytes_recv']} B of K/V, the kept remote keys are "
                                f"{rep['by_hand']} B")
            if rep["index_bytes"] != 8 * rep["remote"]:
                failures.append(f"{where}: asked for {rep['index_bytes']} B of indices for {rep['remote']} keys")
            if rep["pairs"] != rep["pairs_by_hand"]:
                failures.append(f"{where}: {rep['pairs']} pairs attended, {rep['pairs_by_hand']} kept")
    assert not failures, "\n".join(failures[:30])
    if world_size > 1:  # the crossing selections keep fewer remote keys than a ring delivers
        assert all(rep["kv_bytes_recv"] < rep["ring"] for reports in per_rank for rep in reports)
        assert any(rep["kv_bytes_recv"] > 0 for reports in per_rank for rep in reports)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_every_cpu_backend_runs_the_selection(backend):
    """The selection is a non-causal varlen call per query: each backend of the contract runs it (the
    Triton one under the interpreter: tests/unit/test_triton.py)."""
    precision = dict(reference=("float64", DV, 1e-12), cpu=("float32", D, 1e-5))  # cpu: float32, one head dim
    dtype, dv, tol = precision[backend]
    cases = [dict(c, layout="zigzag", backend=backend, dtype=dtype, dv=dv) for c in _cases()]
    reports = RankPool(1).run(_worker, cases)[0]
    bad = [f"{c['tag']}: {n} {e:.1e}" for c, r in zip(cases, reports) for n, e in r["errs"].items() if not e <= tol]
    assert not bad, bad


def test_selection_runs_in_chunks_of_queries(monkeypatch):
    """Gathered keys are bounded per chunk of queries (``GATHER_BYTES``): with room for 7 key rows the
    queries run in many chunks, some alone, forward and backward, and the result is the same."""
    from cp_attention.strategies import select

    monkeypatch.setattr(select, "GATHER_BYTES", 7 * 2 * (D + DV) * 8)  # 7 rows of 2 K/V heads in float64
    cases = [dict(c, layout="zigzag") for c in _cases()]
    reports = RankPool(1).run(_worker, cases)[0]
    bad = [f"{c['tag']}: {n} {e:.1e}" for c, r in zip(cases, reports) for n, e in r["errs"].items() if not e <= 1e-12]
    assert not bad, bad


def test_selection_validates_its_tensor():
    q = torch.randn(1, 8, 2, D)
    k = v = torch.randn(1, 8, 2, D)
    with pytest.raises(TypeError, match="key_select must be an integer tensor"):
        cp_attention.attention(q, k, v, key_select=torch.zeros(1, 8, 2))
    with pytest.raises(ValueError, match=r"key_select must have shape \(B, L_local, k\) = \(1, 8, k\)"):
        cp_attention.attention(q, k, v, key_select=torch.zeros(1, 7, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="no key_select was given"):
        cp_attention.attention(q, k, v, mask=cp_attention.MaskSpec(selection=True))
    with pytest.raises(ValueError, match="cannot be combined with spans"):
        cp_attention.MaskSpec(selection=True, spans=True)


def _extra_worker(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """Selected keys plus ``E`` extra keys every rank holds whole (index ``T + e``), through the engine."""
    from cp_attention.engine.attend import attend

    reports = []
    for case in cases:
        B, L, (H, K), E = case["B"], case["L"], case["heads"], case["extra"]
        gen = torch.Generator().manual_seed(case["seed"])
        q = torch.randn(B, L, H, D, generator=gen, dtype=torch.float64)
        k = torch.randn(B, L + E, K, D, generator=gen, dtype=torch.float64)  # the row's tokens, then the extras
        v = torch.randn(B, L + E, K, DV, generator=gen, dtype=torch.float64)
        dout = torch.randn(B, L, H, DV, generator=gen, dtype=torch.float64)
        sel = _selection(case, gen)
        picks = torch.randint(L, L + E, (B, L, 3), generator=gen)  # extras, a repeat included
        picks[..., 2] = picks[..., 1]
        sel = torch.cat([sel, picks], dim=-1)
        mask = torch.zeros(B, L, L + E, dtype=torch.bool)
        mask[..., :L] = _selected_oracle_mask(case, sel.masked_fill(sel >= L, -1))
        for b in range(B):
            for i in range(L):
                for j in picks[b, i].tolist():
                    mask[b, i, j] = True
        leaves = [t.requires_grad_() for t in (q, k, v)]
        ref = oracle_attention(q, k, v, mask, scale=D ** -0.5)
        ref_grads = torch.autograd.grad(ref, leaves, dout)
        layout = case["layout"]
        with cp_attention.context_parallel(layout=layout) as cp:
            mine = [cp.shard(t.detach()).requires_grad_() for t in (q, k[:, :L], v[:, :L])]
            extra = [t[:, L:].detach().clone().requires_grad_() for t in (k, v)]
            position_ids, cu_seqlens = positions_and_cu(case)
            spec = cp_attention.MaskSpec(selection=True, causal=case["causal"], window=case.get("window"),
                                         chunk_size=case.get("chunk_size"))
            out = attend(*mine, spec, key_select=cp.shard(sel), extra_kv=tuple(extra), cu_seqlens=cu_seqlens,
                         position_ids=cp.shard(position_ids) if position_ids is not None else None,
                         group=cp.group if world_size > 1 else None, layout=layout)
            out.backward(cp.shard(dout))
            d_extra = [t.grad.clone() for t in extra]
            if world_size > 1:
                for t in d_extra:
                    dist.all_reduce(t)
            got = dict(out=out, dq=mine[0].grad, dk=mine[1].grad, dv=mine[2].grad, dk_extra=d_extra[0],
                       dv_extra=d_extra[1])
            want = dict(out=cp.shard(ref.detach()), dq=cp.shard(ref_grads[0]), dk=cp.shard(ref_grads[1][:, :L]),
                        dv=cp.shard(ref_grads[2][:, :L]), dk_extra=ref_grads[1][:, L:], dv_extra=ref_grads[2][:, L:])
        reports.append({name: (got[name] - want[name]).abs().max().item() for name in got})
    return reports


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_extra_keys_every_rank_holds(pools, world_size):
    """Keys beyond the row's tokens that every rank holds whole (DeepSeek-V4's compressed entries),
    selected by index ``T + e``: out and every gradient (the extras' summed over the ranks) equal the
    oracle over the tokens and the extras together."""
    cases = [dict(c, layout="zigzag", extra=5) for c in _cases()[:4]]
    per_rank = pools(world_size).run(_extra_worker, cases, timeout=600)
    bad = [f"rank {r} {c['tag']}: {n} {e:.1e}" for r, reps in enumerate(per_rank) for c, rep in zip(cases, reps)
           for n, e in rep.items() if not e <= 1e-12]
    assert not bad, "\n".join(bad[:20])
