"""Every mask-bearing transformers family under attn_implementation="cp_flash" (issue 3, item 1).

Logits and one backward step's parameter gradients at world sizes 1, 2 and 4, both layouts, packed
and unpacked, B in {1, 2}, windows (Llama 4: chunks) inside one shard and across several, must
equal the ground truth within 1e-4 (float32, max abs): the same weights under "eager" on one
device with each packed document run alone. Cases and rank workers live in hf_cases.py.
"""

from __future__ import annotations

import pytest
import torch

import hf_cases
from cp_attention.tools.launch import run_ranks
from cp_attention.tools.tiny_models import FAMILIES

pytestmark = [pytest.mark.multirank, pytest.mark.transformers]  # spawns gloo ranks; builds transformers models

# ModernBERT builds its masks without position_ids and passes none to attention: without a
# context, cp_flash cannot know packed documents there (transformers' eager cannot either), so its
# packed cases go through context_parallel() + shard_batch. Llama 4 passes no position_ids to
# attention either, but its mask builder detects the packed documents; it is run both ways.
DOCS_ONLY_FROM_SHARD_BATCH = ("modernbert",)
BOTH_WAYS = ("llama4",)

CASES = hf_cases.family_cases()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: intra-op threads only contend (10x slower on 2 busy cores); restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def refs(one_thread) -> dict:
    """Docs-alone eager ground truth per case (independent of world size and layout)."""
    out, models = {}, {}
    for case in CASES:
        key = (case["family"], case["window"])
        if key not in models:
            models[key] = hf_cases.model_for(case, "eager")
        out[case["name"]] = hf_cases.ground_truth(case, models[key])
    return out


def _assert_ok(results: list[dict]) -> None:
    fails = hf_cases.failures(results)
    assert not fails, f"{len(fails)} failures out of {len(results)} checks:\n" + "\n".join(fails[:60])


def test_cases_cover_the_spec():
    assert {c["family"] for c in CASES} == set(FAMILIES)
    for family in FAMILIES:
        mine = [c for c in CASES if c["family"] == family]
        assert {c["B"] for c in mine} == {1, 2}
        assert {c["packed"] for c in mine} == {True, False}
        assert {c["L"] % 2 for c in mine} == {0, 1}  # odd and even lengths
    # world size 4: SMALL fits inside a zigzag slice, LARGE spans several contiguous shards
    assert all(c["window"] < c["L"] // 8 for c in CASES if c["window"] == hf_cases.SMALL)
    assert all(c["window"] > c["L"] // 4 + 1 for c in CASES if c["window"] == hf_cases.LARGE)


def test_world_size_1_without_context(refs):
    """Plain model(ids, position_ids=pos) under cp_flash in this process, no context, no process group."""
    results, models = [], {}
    for case in CASES:
        key = (case["family"], case["window"])
        if key not in models:
            models[key] = hf_cases.model_for(case, "cp_flash")
        model = models[key]
        ways = [False]
        if case["packed"] and case["family"] in DOCS_ONLY_FROM_SHARD_BATCH:
            ways = [True]
        elif case["packed"] and case["family"] in BOTH_WAYS:
            ways = [False, True]
        for use_context in ways:
            logits, grads = hf_cases.run_plain(case, model, use_context=use_context)
            where = "no process group, " + ("context_parallel() + shard_batch" if use_context else "no context")
            results.append(hf_cases.compare(case, model, logits, grads, refs[case["name"]], where=where))
    assert len(results) == len(CASES) + sum(c["packed"] for c in CASES if c["family"] in BOTH_WAYS)
    _assert_ok(results)


@pytest.mark.parametrize("world_size", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_cp_flash_matches_docs_alone_eager(world_size: int, refs):
    layouts = ("zigzag", "contiguous")
    per_rank = run_ranks(world_size, hf_cases.run_cp_cases, CASES, refs, layouts, timeout=600)
    assert len(per_rank) == world_size
    for results in per_rank:
        assert len(results) == len(CASES) * len(layouts)
    _assert_ok([r for results in per_rank for r in results])


@pytest.mark.parametrize("world_size, layout, strategy", [
    pytest.param(2, "contiguous", "ulysses", marks=pytest.mark.slow),
    pytest.param(4, "zigzag", "ulysses", marks=pytest.mark.slow), (2, "zigzag", "auto"),
    pytest.param(4, "contiguous", "auto", marks=pytest.mark.strategies)])
def test_cp_flash_under_ulysses_and_auto_matches_docs_alone_eager(world_size: int, layout: str, strategy: str, refs):
    """Every family under strategy="ulysses" (all-to-all head parallelism: 4 query heads, 2 K/V
    heads, so K/V heads are replicated at world size 4) and "auto" (per layer, the cheapest of ring,
    usp and ulysses by a bytes-only cost model; each layer's choice checked against its model)
    against each document alone under eager."""
    per_rank = run_ranks(world_size, hf_cases.run_cp_cases, CASES, refs, (layout,), strategy, timeout=900)
    for results in per_rank:
        assert len(results) == len(CASES)
    _assert_ok([r for results in per_rank for r in results])
    if strategy == "auto":  # auto chose per layer: the families' window and full layers do not all agree
        choices = {c for results in per_rank for r in results for c in r.get("chosen", ())}
        assert len(choices) >= 2, choices
