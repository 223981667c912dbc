"""Hybrid families under cp_flash (issue 21): attention mixed with short convolutions (LFM2), Mamba
(Jamba), Mamba-2 (Nemotron-H, Falcon-H1, Granite-4.0-H, Bamba, Zamba2) and gated DeltaNet (Qwen3.5
dense and MoE, Qwen3-Next, OLMo-hybrid) layers, exact under context parallelism.

* every family at CP = 2 and 4 in zigzag, contiguous and balanced layouts, two packed rows with
  documents crossing every rank and one-token documents: logits and parameter gradients against
  each document run alone under eager (hf_cases' tolerances: 1e-4; gradients max(1e-4, 1e-5 x the
  largest)), and every forward reports its mixers' traffic;
* the training stack: DDP and FSDP2 (the mean convention), gradient checkpointing inside the block
  (reentrant and not) and of the whole model with backward after the block, packed rows and the
  flattening collator's output, against each document alone under eager.
"""

from __future__ import annotations

import pytest
import torch

import cp_attention
import hf_cases
import hybrid_cases as hc
import training_workers as tw
from cp_attention.tools.launch import run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.transformers]  # spawns gloo ranks; builds transformers models

LAYOUTS = ("zigzag", "contiguous", "balanced")


@pytest.fixture(scope="module")
def refs() -> dict:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {family: hc.ground_truth(hc.models(family)[0]) for family in hc.HYBRIDS + hc.MORE_MIXERS}
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("world_size, families", [
    pytest.param(1, "HYBRIDS", marks=pytest.mark.slow), pytest.param(1, "MORE_MIXERS", marks=pytest.mark.slow),
    (2, "HYBRIDS"), (2, "MORE_MIXERS"),
    pytest.param(4, "HYBRIDS", marks=pytest.mark.slow), pytest.param(4, "MORE_MIXERS", marks=pytest.mark.slow)])
def test_hybrid_families_match_docs_alone_eager(world_size, families, refs):
    """World size 1 (a one-rank block: the documents kept apart on one device), CP = 2 and 4."""
    families = getattr(hc, families)
    layouts = LAYOUTS if world_size > 1 else ("contiguous",)
    per_rank = run_ranks(world_size, hc.run_cases, families, refs, layouts, timeout=900)
    results = [r for rank in per_rank for r in rank]
    assert len(results) == world_size * len(families) * len(layouts)
    fails = hf_cases.failures(results)
    assert not fails, f"{len(fails)} failures:\n" + "\n".join(fails[:40])
    for r in results:  # every family has a mixer that ran across ranks
        assert r["mixer_calls"] > 0, r["where"] + " " + r["name"]
    # a contiguous layout's first rank receives nothing; zigzag and balanced pieces do
    assert all(r["mixer_bytes"] > 0 for r in results if r["where"].startswith(f"world={world_size} zigzag"))
    assert world_size > 1 or all(r["mixer_bytes"] == 0 for r in results)


def test_hybrid_training_ddp_fsdp2_checkpointing_cp2():
    per_rank = run_ranks(2, tw.run_setups, tw.HYBRID_SETUPS, 1, timeout=900)
    assert per_rank and all(per_rank)
    for rank, per_setup in enumerate(per_rank):
        assert set(per_setup) == {s[0] for s in tw.HYBRID_SETUPS}
        for name, e in per_setup.items():
            assert e["loss_err"] <= tw.REL_TOL, f"rank {rank} {name}: loss relative error {e['loss_err']:.2e}"
            assert e["grad_err"] <= tw.REL_TOL, f"rank {rank} {name}: gradient error {e['grad_err']:.2e}"


@pytest.mark.slow  # 26 s: the hybrids' training stacks are also trained by the TRL trainers' hybrid cases
def test_more_mixers_training_ddp_fsdp2_checkpointing_cp2():
    """Issue 39's mixers through the training stack: lightning attention (DDP, reentrant checkpointing),
    KDA (FSDP2, non-reentrant), RG-LRU (the whole model checkpointed), RWKV and a pure Mamba (forwards
    without position_ids: the documents come from the batch record) and xLSTM."""
    per_rank = run_ranks(2, tw.run_setups, tw.MORE_MIXER_SETUPS, 1, timeout=900)
    for rank, per_setup in enumerate(per_rank):
        assert set(per_setup) == {s[0] for s in tw.MORE_MIXER_SETUPS}
        for name, e in per_setup.items():
            assert e["loss_err"] <= tw.REL_TOL, f"rank {rank} {name}: loss relative error {e['loss_err']:.2e}"
            assert e["grad_err"] <= tw.REL_TOL, f"rank {rank} {name}: gradient error {e['grad_err']:.2e}"


@pytest.mark.parametrize("families", [("qwen3_next", "minimax"),  # a function- and a class-adapted mixer
                                      pytest.param(("nemotron_h", "rwkv"), marks=pytest.mark.slow)])
def test_hybrids_compiled_under_cp2(refs, families):
    """torch.compile'd hybrids inside a block: the mixers' calls leave the graph (the context is a
    contextvar) and run across ranks, exact. By default one family of each kind of adapted mixer (CI time);
    two more behind -m slow."""
    per_rank = run_ranks(2, hc.run_compiled, families, {f: refs[f] for f in families}, timeout=900)
    fails = hf_cases.failures([r for rank in per_rank for r in rank])
    assert not fails, "\n".join(fails)


def test_hybrid_compiled_in_a_one_rank_block_keeps_documents_apart(refs):
    """torch.compile'd inside a one-rank block: the mixers leave the graph and read the batch's documents
    as they do eagerly (traced in place, they ran across the packed documents: logits 0.09 off)."""
    _, model = hc.models("qwen3_next")
    compiled = torch.compile(model, backend="eager")
    ids, pos, R = hc.inputs(model.config.get_text_config().vocab_size)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with cp_attention.context_parallel() as cp:
            out = compiled(**cp.shard_batch(input_ids=ids, position_ids=pos), use_cache=False)
            (out.logits * R).sum().backward()
    finally:
        torch.set_num_threads(before)
    res = hc.compare("qwen3_next", out.logits.detach(), hf_cases.flat_grads(model), refs["qwen3_next"], "one rank")
    assert not hf_cases.failures([res])
