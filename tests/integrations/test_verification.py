"""Verification at first use (cp_attention.integrations.hf.verification): a model the library has never seen,
whose own code mixes tokens along the sequence, is refused on every rank before its first forward under a
multi-rank block computes; the same model without the term is exact. The truth is each document alone on
one device under eager (the family sweep's), computed here from the checkpoint, not from the library.
"""

from __future__ import annotations

import pytest
import torch

import cp_attention
from cp_attention.integrations.hf import state
from cp_attention.integrations.hf import verification
from cp_attention.tools.launch import run_ranks

from vlm_cases import BUILDERS
from remote_models import MIXING_OPS, load_remote_model, save_remote_model

pytestmark = [pytest.mark.multirank, pytest.mark.transformers]


def _docs(world_size: int, packed: bool) -> list[int]:
    """Document lengths of a 24 * P-token row: three (the first crosses every rank) or one."""
    n = 24 * world_size
    return [n // 2 + 5, n // 3, n - n // 2 - 5 - n // 3] if packed else [n]


def _batch(world_size: int, packed: bool):
    docs = _docs(world_size, packed)
    ids = torch.randint(0, 128, (1, sum(docs)), generator=torch.Generator().manual_seed(7))
    pos = torch.cat([torch.arange(n) for n in docs])[None]
    return ids, pos, docs


def _alone(path, ids, docs) -> torch.Tensor:
    """Each document alone on one device, under eager."""
    model = load_remote_model(path, "eager", dtype=torch.float64)
    with torch.no_grad():
        parts, start = [], 0
        for n in docs:
            parts.append(model(input_ids=ids[:, start:start + n]).logits)
            start += n
    return torch.cat(parts, dim=1)


def _remote_worker(rank, world_size, paths: dict, packed: bool, verify: bool = True, known_on: int | None = None,
                   phases=("check", "verification")):
    """Every model under one block: its logits in sequence order, or the refusal's message; per phase: the
    model check as it is ("check"), then with its trace finding nothing ("verification": what is left to
    verification at first use, as for token mixing the trace cannot see)."""
    from cp_attention.integrations.hf import token_trace

    ids, pos, docs = _batch(world_size, packed)
    results = {}
    for phase in phases:
        if phase == "verification":
            token_trace.trace_findings = lambda *args, **kwargs: []
            state.TRACED.clear()
        with cp_attention.context_parallel(timeout=120, verify=verify) as cp:
            for op, path in paths.items():
                model = load_remote_model(path, "cp_flash", dtype=torch.float64)
                if rank == known_on:  # this rank verified this class and configuration before (its memo says so)
                    key = verification.verification_key(model, cp, packed)
                    state.VERIFIED[key] = None
                batch = cp.shard_batch(input_ids=ids, position_ids=pos, model=model)
                try:
                    with torch.no_grad():
                        results[phase, op] = cp.gather(model(**batch).logits)
                except NotImplementedError as exc:
                    results[phase, op] = str(exc)
    return results


# the operation the model check's trace names for each kind (its source line is in modeling_mixlm.py)
FIRST_OP = {"cumulative_mean": "cumsum", "previous_token": "__getitem__", "shifted_slice": "__getitem__",
            "roll": "roll", "sequence_mean": "mean", "avg_pool": "avg_pool1d", "conv": "pad", "sort": "sort",
            "token_matmul": "matmul", "gather": "index_select"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote")
    return {op: str(save_remote_model(root, op, dtype=torch.float64)) for op in (None, *MIXING_OPS)}


def _assert_refused_or_exact(per_rank: list[dict], checkpoints: dict, world_size: int, packed: bool) -> None:
    ids, _, docs = _batch(world_size, packed)
    phases = sorted({phase for phase, _ in per_rank[0]})
    for op, path in checkpoints.items():
        for phase in phases:
            got = [r[phase, op] for r in per_rank]
            if op is None:
                want = _alone(path, ids, docs)
                for logits in got:
                    assert isinstance(logits, torch.Tensor), logits
                    torch.testing.assert_close(logits, want, rtol=1e-6, atol=1e-6)  # eager: a float32 softmax
                continue
            assert all(isinstance(m, str) for m in got), (phase, op, got)
            assert len(set(got)) == 1, f"{phase} {op}: the ranks disagree: {got}"  # the same refusal on every rank
            message = got[0]
            assert "model.layers.0.mlp" in message, (phase, op, message)
            if phase == "check":  # the model check's trace: the module, the operation and its source line
                assert "token mixing outside the calls run across ranks" in message, message
                assert f"the first operation doing it: {FIRST_OP[op]} at modeling_mixlm.py:" in message, message
            else:
                assert "verified at first use" in message, message


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_remote_code_that_mixes_tokens_is_refused_on_every_rank(checkpoints, world_size):
    """Each kind of token-mixing op, in a trust_remote_code module: refused alike on every rank at CP = 2 and
    4, by the model check's trace (naming the module, the operation and its line) and, with the trace finding
    nothing, by verification at first use (naming the module); the same checkpoint without the op is exact."""
    per_rank = run_ranks(world_size, _remote_worker, checkpoints, True, timeout=600)
    _assert_refused_or_exact(per_rank, checkpoints, world_size, True)


def test_remote_code_refused_on_rows_of_one_document(checkpoints):
    subset = {op: checkpoints[op] for op in (None, "roll", "cumulative_mean", "avg_pool")}
    per_rank = run_ranks(2, _remote_worker, subset, False, timeout=300)
    _assert_refused_or_exact(per_rank, subset, 2, False)


def test_a_rank_that_verified_before_verifies_with_the_others(checkpoints):
    """Rank 1's memo says the class and configuration were verified: it must still run the test with rank 0
    (the ranks agree first), so both refuse instead of one computing and one refusing."""
    subset = {op: checkpoints[op] for op in (None, "sequence_mean")}
    per_rank = run_ranks(2, _remote_worker, subset, True, True, 1, ("verification",), timeout=300)
    _assert_refused_or_exact(per_rank, subset, 2, True)


def test_verify_false_skips_the_test(checkpoints):
    """verify=False: no test batch runs, and (where the model check's trace finds nothing) the guarantee is off:
    the roll's model runs, wrongly."""
    subset = {op: checkpoints[op] for op in ("roll",)}
    per_rank = run_ranks(2, _remote_worker, subset, True, False, None, ("verification",), timeout=300)
    ids, _, docs = _batch(2, True)
    want = _alone(checkpoints["roll"], ids, docs)
    for result in per_rank:
        assert isinstance(result["verification", "roll"], torch.Tensor), result
        assert not torch.allclose(result["verification", "roll"], want, atol=1e-3)  # wrong, as the option says


def _needs_more_worker(rank, world_size, path: str, verify: bool):
    """A model whose forward raises on the first-use test batch (as UDOP's does without bounding boxes): the
    length of the test batch stands for the input it lacks."""
    ids, pos, _ = _batch(world_size, False)
    ids, pos = ids[:, :-4], pos[:, :-4]  # the user's batch: another length than the test's 16 * P tokens
    model = load_remote_model(path, "cp_flash", dtype=torch.float64)
    embed, test_length = model.model.embed_tokens, 16 * world_size

    def lacking(module, args):
        if args[0].shape[1] == test_length:
            raise ValueError("Bbox is required for this model's relative position bias")

    embed.register_forward_pre_hook(lacking)
    with cp_attention.context_parallel(timeout=120, verify=verify) as cp:
        batch = cp.shard_batch(input_ids=ids, position_ids=pos, model=model)
        try:
            with torch.no_grad():
                return cp.gather(model(**batch).logits)
        except NotImplementedError as exc:
            return str(exc)


def test_a_model_the_test_batch_cannot_run_is_refused_with_the_way_out(checkpoints):
    """Verification cannot run the test batch (the model needs inputs it lacks): refused on every rank, naming
    the model's error and verify=False; with verify=False the user's batch runs (and equals one device)."""
    for result in run_ranks(2, _needs_more_worker, checkpoints[None], True, timeout=300):
        assert isinstance(result, str) and "cannot verify" in result and "Bbox is required" in result and \
            "verify=False" in result, result
    ids, _, _ = _batch(2, False)
    want = _alone(checkpoints[None], ids[:, :-4], [ids.shape[1] - 4])
    for result in run_ranks(2, _needs_more_worker, checkpoints[None], False, timeout=300):
        assert isinstance(result, torch.Tensor), result
        torch.testing.assert_close(result, want, rtol=1e-5, atol=1e-6)  # (eager's float32 softmax)


def _vlm_worker(rank, world_size):
    torch.manual_seed(0)
    model = BUILDERS["qwen2_5_vl"]().eval()
    for config in (model.config, model.config.text_config):
        config._attn_implementation = "cp_flash"
    ids = torch.randint(0, 100, (1, 32), generator=torch.Generator().manual_seed(3))
    out = {}
    for packed, docs in ((True, [20, 12]), (False, [32])):
        pos = torch.cat([torch.arange(n) for n in docs])[None]
        with torch.no_grad(), cp_attention.context_parallel(timeout=120) as cp:
            batch = cp.shard_batch(input_ids=ids, position_ids=pos, model=model)
            try:
                out[packed] = cp.gather(model(**batch).logits)
            except NotImplementedError as exc:
                out[packed] = str(exc)
    return out


def test_packed_text_read_another_way_on_one_device():
    """Qwen2.5-VL on packed text with (B, L) position_ids: on one device its documents attend to each other
    (eager), under the block cp_flash would keep them apart: refused with that reason. One document per
    row (the same model, after the refusal): equal to one device."""
    per_rank = run_ranks(2, _vlm_worker, timeout=300)
    assert all(isinstance(r[True], str) and "on packed rows" in r[True] and "attend to each other" in r[True]
               for r in per_rank), per_rank
    torch.manual_seed(0)
    model = BUILDERS["qwen2_5_vl"]().eval()
    with torch.no_grad():
        want = model(input_ids=torch.randint(0, 100, (1, 32), generator=torch.Generator().manual_seed(3))).logits
    for result in per_rank:
        assert isinstance(result[False], torch.Tensor), result[False]
        torch.testing.assert_close(result[False], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_next", "mamba2", "rwkv", "deepseek_v32"])
def test_the_trace_finds_nothing_in_exact_families(family):
    """The model check's trace on families the sweep finds exact (attention, adapted mixer functions and
    classes, an indexer): nothing, since the attention and the adapted mixers answer per token under it."""
    from cp_attention.integrations.hf import check as model_check
    from cp_attention.tools.sweeps.configs import build_model, tiny_config

    model = build_model(tiny_config(family), "cp_flash")
    assert model_check.model_findings(model) == ()


def test_the_trace_names_the_operation_and_its_line(checkpoints):
    """One process, no ranks: each kind found by the model check's trace, the module, the operation and the
    line of modeling_mixlm.py that holds it; the checkpoint without the op has no finding."""
    from cp_attention.integrations.hf import check as model_check

    for op, path in checkpoints.items():
        findings = model_check.model_findings(load_remote_model(path, "cp_flash", dtype=torch.float64))
        if op is None:
            assert findings == ()
            continue
        assert [f.module for f in findings] == ["model.layers.0.mlp"], (op, findings)
        assert f"the first operation doing it: {FIRST_OP[op]} at modeling_mixlm.py:" in findings[0].why, findings
