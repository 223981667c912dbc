"""Hypothesis fuzzing of the whole engine against an independent float64 oracle.

Each hypothesis example is a *batch*: one world size (1-4) and a list of cases, each with its own
layout (zigzag, contiguous or the batch's own balanced layout), B, L, GQA head counts, head dim, causal/bidirectional, window, chunk size, documents
(``position_ids`` with arbitrary first positions, or ``cu_seqlens`` with empty documents allowed),
softcap, sinks, scale, input gain and dtype (see ``fuzz_cases.py`` for the case format and the
oracle). One persistent group of ranks per world size (``rank_pool.RankPool``) evaluates the
batches, so neither the examples nor hypothesis' shrinking of a failure pay for spawning ranks;
a failure is reported as the minimal batch hypothesis found (a ready reproducer: pass the printed
cases to ``fuzz_cases.run_fuzz_cases`` on that many ranks).

Tolerance: float64 inputs within 1e-9, float32 inputs within 1e-5 (``tests/multirank/test_distributed.py``),
both relative to the oracle's largest magnitude when that exceeds 1 (long rows sum many terms).
The oracle gets the very values the engine gets (float32 inputs rounded first). Float32 cases keep
unit-scale logits (no input gain, default or smaller scale): with 4x larger logits, cancellation
in ``dp - delta`` alone reaches 2.4e-5 in float32 (one key, L = 1, where plain torch is exact by
luck); float64 cases explore those scales.

* ``test_fuzz_short`` runs in the default run: a few derandomized batches at world sizes 1 and 3.
* ``test_fuzz_long`` is marked ``fuzz`` (excluded by default; ``python -m pytest -m fuzz``). It
  runs for ``CP_ATTENTION_FUZZ_MINUTES`` minutes (default 30), prints progress and the number of
  cases, and, when ``CP_ATTENTION_FUZZ_REPORT`` names a file, writes a JSON summary there.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fuzz_cases import run_fuzz_cases  # noqa: E402
from rank_pool import RankPool  # noqa: E402

TOL = {"float64": 1e-9, "float32": 1e-5}
HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example]
BATCH_TIMEOUT = 600.0


def _lengths(cuts: list[int], total: int) -> list[int]:
    bounds = [0] + sorted(cuts) + [total]
    return [b - a for a, b in zip(bounds, bounds[1:])]


@st.composite
def attention_cases(draw, world_size: int, max_len: int) -> dict:
    """One case for ``world_size`` ranks (see ``fuzz_cases.py`` for the format)."""
    L = draw(st.integers(world_size, max(world_size, max_len)))
    B = draw(st.integers(1, 3))
    kv_heads = draw(st.integers(1, 3))
    heads = kv_heads * draw(st.integers(1, 3))
    mode = draw(st.sampled_from(["none", "pos", "cu"] if B == 1 else ["none", "pos"]))
    docs = None
    if mode == "pos":
        rows = []
        for _ in range(B):
            cuts = draw(st.sets(st.integers(1, L - 1), max_size=min(8, L - 1))) if L > 1 else set()
            lengths = _lengths(list(cuts), L)
            firsts = draw(st.lists(st.one_of(st.just(0), st.integers(0, 2 * L)), min_size=len(lengths),
                                   max_size=len(lengths)))
            rows.append([(first, n) for first, n in zip(firsts, lengths)])
        docs = ("pos", rows)
    elif mode == "cu":  # duplicate cuts give empty documents
        docs = ("cu", _lengths(draw(st.lists(st.integers(0, L), max_size=8)), L))
    dtype = draw(st.sampled_from(["float64", "float32"]))
    if dtype == "float64":  # large logits (gain, scale) only where rounding cannot hide behind them
        scale, qk_gain = draw(st.sampled_from([None, None, 0.1, 0.6])), draw(st.sampled_from([1.0, 1.0, 4.0]))
    else:
        scale, qk_gain = draw(st.sampled_from([None, 0.1])), 1.0
    return dict(
        layout=draw(st.sampled_from(["zigzag", "contiguous", "balanced"])), B=B, L=L, heads=(heads, kv_heads),
        head_dim=draw(st.sampled_from([4, 8, 16, 24])), causal=draw(st.booleans()),
        window=draw(st.one_of(st.none(), st.integers(1, L + 2))),
        chunk_size=draw(st.one_of(st.none(), st.integers(1, L + 2))),
        softcap=draw(st.sampled_from([None, None, 0.7, 2.5, 20.0])), sinks=draw(st.booleans()),
        scale=scale, qk_gain=qk_gain, docs=docs, dtype=dtype, seed=draw(st.integers(0, 1000)))


@st.composite
def batches(draw, world_sizes: tuple[int, ...], max_cases: int, max_len: int):
    world_size = draw(st.sampled_from(world_sizes))
    cases = draw(st.lists(attention_cases(world_size, max_len), min_size=1, max_size=max_cases))
    return world_size, cases


def check_batch(pools: dict, world_size: int, cases: list[dict]) -> None:
    """Run a batch on the pool of ``world_size`` ranks; assert every case on every rank."""
    if world_size not in pools:
        pools[world_size] = RankPool(world_size)
    per_rank = pools[world_size].run(run_fuzz_cases, cases, timeout=BATCH_TIMEOUT)
    failures = []
    for rank, reports in enumerate(per_rank):
        assert len(reports) == len(cases)
        for i, (case, rep) in enumerate(zip(cases, reports)):
            if not rep["finite"]:
                failures.append(f"rank {rank} case {i}: non-finite values")
            for name, err in rep["errs"].items():
                bound = TOL[case["dtype"]] * max(1.0, rep["mags"][name])
                if not err <= bound:
                    failures.append(f"rank {rank} case {i}: {name} error {err:.3e} > {bound:.1e}\n    {case}")
    assert not failures, f"{len(failures)} failures at world size {world_size}:\n" + "\n".join(failures[:20])


@pytest.fixture(scope="module")
def pools():
    found: dict[int, RankPool] = {}
    yield found
    for pool in found.values():
        pool.close()


@pytest.mark.parametrize("world_size", [1, 3])
@settings(max_examples=3, derandomize=True, deadline=None, database=None, suppress_health_check=HEALTH)
@given(data=st.data())
def test_fuzz_short(pools, world_size, data):
    cases = data.draw(st.lists(attention_cases(world_size, max_len=64), min_size=1, max_size=10), label="cases")
    check_batch(pools, world_size, cases)


def _summary(stats: Counter, started: float, failure: str | None) -> dict:
    return dict(minutes=round((time.monotonic() - started) / 60, 2), cases=stats["cases"], batches=stats["batches"],
                per_world_size={k: v for k, v in sorted(stats.items()) if k.startswith("ws")},
                group_starts=stats["group_starts"], failure=failure)


@pytest.mark.fuzz
def test_fuzz_long(pools, record_property):
    """Fuzz for CP_ATTENTION_FUZZ_MINUTES minutes (default 30); fails on the first minimal failure."""
    minutes = float(os.environ.get("CP_ATTENTION_FUZZ_MINUTES", "30"))
    report_path = os.environ.get("CP_ATTENTION_FUZZ_REPORT")
    started = time.monotonic()
    stop = started + 60 * minutes
    stats: Counter = Counter()

    @settings(max_examples=8, deadline=None, database=None, suppress_health_check=HEALTH)
    @given(batch=batches(world_sizes=(1, 2, 3, 4), max_cases=40, max_len=160))
    def fuzz(batch):
        world_size, cases = batch
        check_batch(pools, world_size, cases)
        stats["cases"] += len(cases)
        stats["batches"] += 1
        stats[f"ws{world_size}"] += len(cases)

    failure = None
    try:
        while time.monotonic() < stop:
            fuzz()
            print(f"fuzz: {(time.monotonic() - started) / 60:.1f} min, {stats['cases']} cases in "
                  f"{stats['batches']} batches", flush=True)
    except BaseException as exc:
        failure = f"{type(exc).__name__}: {exc}"[:20000]
        raise
    finally:
        stats["group_starts"] = sum(p.started for p in pools.values())
        summary = _summary(stats, started, failure)
        print("fuzz summary:", json.dumps(summary), flush=True)
        record_property("fuzz_cases", stats["cases"])
        if report_path:
            with open(report_path, "w") as f:
                json.dump(summary, f, indent=1)
    assert stats["cases"] > 0
