"""Planning off the critical path (``cp.prepare``, ``cp.prefetch``; issue 36): a step whose batch was
prepared ahead plans nothing itself (no metadata, layout, checksum or plan is computed on its thread),
computes exactly what the unprepared step computes (and what one device computes: docs-alone eager for
a cp_flash model, the dense float64 oracle for the bare calls), also when the next batch is prepared in
a background thread while the step runs; a batch prepared for other masks, shapes or dtype falls back
to planning on the step, exactly, and says so. The workers: tests/support/prepare_cases.py."""

from __future__ import annotations

import pytest

import prepare_cases as pc
from cp_attention.tools.launch import run_ranks
from hf_cases import failures, ground_truth

pytestmark = pytest.mark.transformers  # builds transformers models

LAYOUTS, STRATEGIES = ("zigzag", "balanced"), ("ring", "auto")


def _planned_nothing(results: list[dict]) -> list[str]:
    """Problems: a prepared step that called a planning function, or an unprepared one that called none
    (the counting itself would then be broken)."""
    problems = []
    for r in results:
        if any(r["counts"].values()):
            problems.append(f"{r['where']}: the prepared step planned on its critical path: {r['counts']}")
        if not r["unprepared_counts"].get("build_rank_plan") or not r["unprepared_counts"].get("SequenceMeta.__init__"):
            problems.append(f"{r['where']}: the unprepared step planned nothing?! {r['unprepared_counts']}")
        if "balanced" in r["where"] and not r["unprepared_counts"].get("balanced_layout_of"):
            problems.append(f"{r['where']}: the unprepared balanced step computed no layout?! {r['unprepared_counts']}")
        if not r["equal"]:
            problems.append(f"{r['where']}: the prepared step's results differ from the unprepared step's")
    return problems


def test_prepared_model_step_plans_nothing_and_is_exact():
    refs = {pc.case(0)["name"]: ground_truth(pc.case(0), pc.tiny_model("qwen3", "eager", window=pc.WINDOW))}
    per_rank = run_ranks(2, pc.model_steps, LAYOUTS, STRATEGIES, refs, timeout=600)
    results = [r for rank in per_rank for r in rank]
    assert len(results) == 2 * len(LAYOUTS) * len(STRATEGIES)
    problems = _planned_nothing(results) + failures([r["compared"] for r in results])
    for r in results:
        s = r["stats"]  # two distinct layer masks (window, full), both prepared and found
        if (r["plans"], s.batches_prepared_found, s.batches_computed, s.plans_reused, s.plans_built) != (2, 1, 0, 2, 0):
            problems.append(f"{r['where']}: planning statistics {s}, prepared {r['plans']} plans")
        if r["unprepared_stats"].plans_built != 2 or r["unprepared_stats"].batches_computed != 1:
            problems.append(f"{r['where']}: unprepared statistics {r['unprepared_stats']}")
    assert not problems, "\n".join(problems)


def test_prepared_bare_calls_plan_nothing_and_match_the_oracle():
    per_rank = run_ranks(2, pc.bare_steps, LAYOUTS, STRATEGIES, timeout=600)
    results = [r for rank in per_rank for r in rank]
    assert len(results) == 2 * len(LAYOUTS) * len(STRATEGIES)
    problems = _planned_nothing(results)
    for r in results:
        if not r["error"] <= 1e-9:
            problems.append(f"{r['where']}: error against the float64 oracle {r['error']:.2e}")
        if (r["stats"].plans_reused, r["stats"].plans_built) != (2, 0):
            problems.append(f"{r['where']}: planning statistics {r['stats']}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("layout,strategy", [("balanced", "auto"), ("zigzag", "ring")])
def test_next_batch_prepared_in_a_background_thread(layout, strategy):
    per_rank = run_ranks(2, pc.threaded_steps, layout, strategy, timeout=600)
    problems = []
    for rank, found in enumerate(per_rank):
        for how in ("prefetch", "thread"):
            steps = found[how]
            assert len(steps) == len(pc.DOCS)
            for i, step in enumerate(steps):
                # with prefetch every batch is prepared before the loop gets it; by the thread from step 1 on
                prepared = how == "prefetch" or i > 0
                if prepared and any(step["counts"].values()):
                    problems.append(f"rank {rank} {how} step {i}: planned on its critical path: {step['counts']}")
                if not prepared and not step["counts"].get("build_rank_plan"):
                    problems.append(f"rank {rank} {how} step {i}: an unprepared step planned nothing?!")
                if not step["equal"]:
                    problems.append(f"rank {rank} {how} step {i}: results differ from the unprepared step's")
                if not step.get("overlapped", True):
                    problems.append(f"rank {rank} thread step {i}: the thread did not prepare during the step")
        prefetched, threaded = found["prefetch_stats"], found["thread_stats"]
        if (prefetched.batches_prepared_found, prefetched.plans_built) != (3, 0):
            problems.append(f"rank {rank} prefetch: {prefetched}")
        if (threaded.batches_prepared, threaded.batches_prepared_found, threaded.plans_built) != (2, 2, 2):
            problems.append(f"rank {rank} thread: {threaded}")
    assert not problems, "\n".join(problems)


def test_prepared_for_other_calls_plans_on_the_step_exactly_and_says_so():
    per_rank = run_ranks(2, pc.mismatched_steps, timeout=600)
    expected = {  # (found the documents, computed them, plans built on the step, of which misses, lines logged)
        "other masks": (1, 0, 2, 2, 2), "other dtype": (1, 0, 2, 2, 2), "other heads": (1, 0, 2, 2, 2),
        "no model": (0, 1, 2, 0, 0),  # balanced: the layout is the model's, prepared without it: not found
    }
    problems = []
    for rank, results in enumerate(per_rank):
        assert [r["what"] for r in results] == list(expected)
        for r in results:
            s = r["stats"]
            got = (s.batches_prepared_found, s.batches_computed, s.plans_built, s.prepared_misses, r["misses_logged"])
            if got != expected[r["what"]]:
                problems.append(f"rank {rank} {r['what']}: (found, computed, built, misses, logged) = {got}, "
                                f"expected {expected[r['what']]}: {s}")
            if not r["equal"]:
                problems.append(f"rank {rank} {r['what']}: results differ from the unprepared step's")
    assert not problems, "\n".join(problems)
