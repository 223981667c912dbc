"""Training through the real tools: DDP and FSDP2 over CP and dp x cp meshes, gradient checkpointing
(reentrant and not, backward inside and after the context), transformers' packing collator passed
whole, Trainer under torchrun, stale batches, errors that leave the group usable, torch's own
context parallelism, DeviceMesh groups, and no side effect of ``import cp_attention``.

Ground truth: the same weights under "eager" on one process, each packed document run alone
(tests/support/training_workers.py); the gradient convention under test is the ecosystem's: the MEAN over
ranks (what DDP and FSDP2 compute) is the single-device gradient, the MEAN of the ranks' losses the
single-device loss."""

from __future__ import annotations

import json
import os
import time
import subprocess
import sys

import pytest
import torch

import training_workers as tw
from cp_attention.tools.launch import free_port, run_command, run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.transformers]  # spawns gloo ranks; builds transformers models

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _assert_exact(results: list[dict]) -> None:
    assert results and all(results)
    for rank, per_setup in enumerate(results):
        for name, e in per_setup.items():
            assert e["loss_err"] <= tw.REL_TOL, f"rank {rank} {name}: loss relative error {e['loss_err']:.2e}"
            assert e["grad_err"] <= tw.REL_TOL, (f"rank {rank} {name}: gradient error {e['grad_err']:.2e} of the "
                                                 f"largest gradient (mean norm ratio {e['grad_ratio']:.3f})")


def test_ddp_fsdp2_checkpointing_collator_cp2():
    """2 ranks, CP = 2: DDP and FSDP2 over the CP ranks, every checkpointing mode, backward inside
    and after the block, the flattening collator's output and packed rows."""
    _assert_exact(run_ranks(2, tw.run_setups, tw.CP2_SETUPS, 1, timeout=600))


def test_ddp_fsdp2_over_dp_x_cp_mesh():
    """4 ranks as dp = 2 x cp = 2: DDP / FSDP2 over the flattened mesh average the two replicas'
    single-device gradients; the CP mean of the losses is each replica's loss."""
    _assert_exact(run_ranks(4, tw.run_setups, tw.DPCP_SETUPS, 2, timeout=900))


@pytest.mark.parametrize("strategy", ["ulysses", "auto"])
def test_ddp_fsdp2_checkpointing_under_ulysses_and_auto_cp2(strategy):
    """The training stack (DDP and FSDP2 mean convention, gradient checkpointing inside the block,
    checkpointing of the whole model with its backward after the block) under strategy="ulysses"
    and "auto" (each layer's choice checked against its cost model)."""
    setups = [s for s in tw.CP2_SETUPS if s[0] in ("ddp/qwen3/rows/gc-reentrant/inside", "ddp/mistral/flatten/gc-nonreentrant/after",
                                                   "fsdp2/mistral/flatten/gc-nonreentrant/after",
                                                   "checkpoint-whole/qwen3/flatten/after")]
    assert len(setups) == 4
    _assert_exact(run_ranks(2, tw.run_setups, setups, 1, strategy, timeout=600))


@pytest.mark.slow  # CP = 4 (the CP = 2 stacks run by default)
def test_ddp_cp4():
    """4 ranks, CP = 4 (shards of 24 tokens, window 6, documents across shards)."""
    _assert_exact(run_ranks(4, tw.run_setups, tw.CP2_SETUPS[:3], 1, timeout=900))


@pytest.fixture(scope="module")
def extras():
    return run_ranks(2, tw.run_extras, timeout=600)


def test_stale_batch_uses_its_own_documents(extras):
    for found in extras:
        assert found["stale_a"] <= 1e-4 and found["stale_b"] <= 1e-4, found
        assert found["unambiguous"] <= 1e-4, found


def test_forward_plan_stats_under_cp(extras):
    for found in extras:  # both layers of the Mistral forward, at world size 2, with halo traffic
        assert [(layer, ws) for layer, ws, _ in found["forward_stats"]] == [(0, 2), (1, 2)], found
        assert all(recv > 0 for _, _, recv in found["forward_stats"])


def test_ambiguous_batch_raises_on_every_rank(extras):
    for found in extras:
        assert found["ambiguous"].startswith("ValueError") and "several batches" in found["ambiguous"], found


def test_device_mesh_groups(extras):
    for found in extras:
        assert found["mesh_dim"] <= 1e-4, found
        assert "mesh_dim='cp'" in found["mesh_2d_unnamed"], found


def test_torch_context_parallel_active_is_refused(extras):
    for found in extras:
        assert found["torch_cp"].startswith("RuntimeError") and "torch's context_parallel" in found["torch_cp"]


def _torchrun(script: str, *args: str, nproc: int = 2, timeout: float = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={free_port()}", script, *args]
    return run_command(cmd, env=ENV, timeout=timeout, cwd=ROOT)  # on a timeout, torchrun's workers die too


@pytest.mark.parametrize("repeat", range(2))
def test_errors_leave_the_group_usable_and_exit_cleanly(repeat):
    proc = _torchrun(os.path.join(ROOT, "tests", "support", "cp_errors_script.py"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "SIGABRT" not in proc.stderr and "terminate called" not in proc.stderr
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert sorted(r["rank"] for r in results) == [0, 1], proc.stdout[-2000:]
    for r in results:
        assert "cp.shard_batch" in r["forgot"], r
        assert r["fresh"] <= 1e-4 and r["same"] <= 1e-4, r
    failure = {r["rank"]: r["failure"] for r in results}
    assert failure[1] == "own: injected failure on rank 1"
    assert failure[0].startswith("RankFailedError rank=1") and "injected failure on rank 1" in failure[0]


@pytest.mark.parametrize("reentrant, model, peft", [(False, "mistral", ""), pytest.param(True, "mistral", "", marks=pytest.mark.slow),
                                                    (False, "qwen2_moe", ""), (False, "mistral", "lora"),
                                                    pytest.param(False, "mistral", "dora", marks=pytest.mark.slow)])
def test_trainer_under_torchrun_equals_single_device(tmp_path, reentrant, model, peft):
    """examples/train_trainer.py: CPTrainer on 2 gloo processes (cp_flash, packing collator, gradient
    checkpointing) against a plain single-process Trainer (eager) on the same global batches; Qwen2-MoE
    with its router's load-balancing loss in the model's loss (Trainer scales it with the token loss); a
    PEFT model (LoRA, DoRA) handed to CPTrainer as Trainer takes it."""
    extra = (["--reentrant"] if reentrant else []) + ["--model", model] + (["--peft", peft] if peft else [])
    _compare_trainer_runs(tmp_path, extra)


@pytest.mark.parametrize("extra", [["--head", "sequence"],
                                   pytest.param(["--head", "sequence", "--left"], marks=pytest.mark.slow),
                                   ["--head", "qa"]], ids=["sequence", "sequence-left-padded", "qa"])
def test_trainer_with_row_heads_under_torchrun_equals_single_device(tmp_path, extra):
    """CPTrainer with a head that reads one output per row: a sequence classifier (pooled at each row's
    last non-padding token; rows of 5-60 tokens padded on the right, or on the left) and a QA head (span
    positions into windows of 48 tokens); 2 accumulation steps, gradient checkpointing. The group's rows
    stay rows and each is sharded along the sequence: every logged loss and the final weights equal
    plain Trainer on one process (eager) holding both ranks' rows."""
    _compare_trainer_runs(tmp_path, [*extra, "--accumulation", "2", "--steps", "3"], steps=3)


def _compare_trainer_runs(tmp_path, extra: list, steps: int = 4) -> None:
    script = os.path.join(ROOT, "examples", "train_trainer.py")
    cp = _torchrun(script, "--out", str(tmp_path / "cp"), *extra)
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-3000:]
    single = subprocess.run([sys.executable, script, "--single", "--out", str(tmp_path / "single"), *extra],
                            env=ENV, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert single.returncode == 0, single.stderr[-3000:]
    losses = [json.load(open(tmp_path / run / "losses.json")) for run in ("cp", "single")]
    assert len(losses[0]) == len(losses[1]) == steps
    for step, (a, b) in enumerate(zip(*losses)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step + 1}: CP loss {a} vs single-device {b}"
    params = [torch.load(tmp_path / run / "params.pt") for run in ("cp", "single")]
    initial = torch.load(tmp_path / "single" / "initial.pt")
    assert initial.keys() == params[0].keys() == params[1].keys()
    moved = max(float((params[1][k] - initial[k]).abs().max()) for k in initial)
    assert moved > 1e-3, "training did not change the weights: the comparison would prove nothing"
    for k, v in params[1].items():
        assert float((params[0][k] - v).abs().max()) <= 1e-5 * max(1.0, float(v.abs().max())), k


_TRAINER_LOSS = r"""
import sys, torch
if sys.argv[1] == "import":
    import cp_attention
from transformers import AutoModelForCausalLM, DataCollatorForLanguageModeling, Qwen3Config, Trainer, TrainingArguments
assert ("cp_attention" in sys.modules) == (sys.argv[1] == "import")  # the plain run never imports it
torch.set_num_threads(1)
torch.manual_seed(0)
config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, num_hidden_layers=2, pad_token_id=0)
model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
g = torch.Generator().manual_seed(0)
data = [{"input_ids": torch.randint(3, 128, (24,), generator=g).tolist()} for _ in range(4)]
class Tok:  # what DataCollatorForLanguageModeling needs of a tokenizer
    pad_token_id = 0
    def pad(self, features, return_tensors="pt", **kw):
        return {"input_ids": torch.tensor([f["input_ids"] for f in features])}
args = TrainingArguments(output_dir=sys.argv[2], per_device_train_batch_size=4, max_steps=1, report_to=[],
                         use_cpu=True, save_strategy="no", logging_steps=1, seed=0)
trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=DataCollatorForLanguageModeling(Tok(), mlm=False))
trainer.train()
print("LOSS", repr([e["loss"] for e in trainer.state.log_history if "loss" in e][0]))
"""


def test_import_leaves_an_eager_models_trainer_loss_unchanged(tmp_path):
    losses = []
    for mode in ("plain", "import"):
        proc = subprocess.run([sys.executable, "-c", _TRAINER_LOSS, mode, str(tmp_path / mode)], env=ENV,
                              capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
        losses.append([line for line in proc.stdout.splitlines() if line.startswith("LOSS")][0])
    assert losses[0] == losses[1], losses


def test_join_micro_batches_keeps_parts_apart():
    """CPTrainer's join of the ranks' micro-batches: part boundaries open documents, the first label
    of a later part is never predicted, positions restart per part, collator keys are translated."""
    from cp_attention.integrations.trainers.trainer import join_micro_batches

    a = dict(input_ids=torch.tensor([[5, 6, 7], [8, 9, 10]]), labels=torch.tensor([[5, 6, 7], [8, 9, 10]]),
             attention_mask=torch.tensor([[1, 1, 1], [0, 1, 1]]))
    b = dict(input_ids=torch.tensor([[11, 12], [13, 14]]), labels=torch.tensor([[11, 12], [13, 14]]),
             attention_mask=torch.ones(2, 2, dtype=torch.long))
    joined, starts = join_micro_batches([a, b])
    assert joined["input_ids"].tolist() == [[5, 6, 7, 11, 12], [8, 9, 10, 13, 14]]
    assert joined["labels"].tolist() == [[5, 6, 7, -100, 12], [8, 9, 10, -100, 14]]
    assert joined["position_ids"].tolist() == [[0, 1, 2, 0, 1]] * 2
    assert starts.tolist() == [[True, False, False, True, False]] * 2
    assert joined["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [0, 1, 1, 1, 1]]
    # the flattening collator's document keys become document starts and are not passed on
    c = dict(input_ids=torch.tensor([[1, 2, 3, 4]]), labels=torch.tensor([[-100, 2, -100, 4]]),
             position_ids=torch.tensor([[0, 1, 0, 1]]), cu_seq_lens_q=torch.tensor([0, 2, 4], dtype=torch.int32),
             cu_seq_lens_k=torch.tensor([0, 2, 4], dtype=torch.int32), max_length_q=2, max_length_k=2,
             seq_idx=torch.tensor([[0, 0, 1, 1]], dtype=torch.int32))
    joined, starts = join_micro_batches([c, dict(c)])
    assert sorted(joined) == ["input_ids", "labels", "position_ids"]
    assert starts.tolist() == [[True, False, True, False] * 2]
    with pytest.raises(ValueError, match="same number of rows"):
        join_micro_batches([a, dict(b, input_ids=b["input_ids"][:1], labels=b["labels"][:1],
                                    attention_mask=b["attention_mask"][:1])])


def test_shard_batch_takes_the_flattening_collator_output_whole():
    """Every key of DataCollatorWithFlattening is sharded or translated; anything else is refused by
    name; the documents come from cu_seq_lens / seq_idx even without position_ids."""
    import cp_attention

    docs = tw.documents(0)
    batch = tw.flattened(docs)
    with cp_attention.context_parallel() as cp:
        local = cp.shard_batch(**batch)
        assert sorted(local) == ["input_ids", "labels", "num_items_in_batch", "position_ids", "shift_labels"]
        record = cp_attention.engine.batch.batch_of(local["input_ids"])
        starts = record.meta.doc_start[0]
        no_pos = cp.shard_batch(**{k: v for k, v in batch.items() if k != "position_ids"})
        assert torch.equal(cp_attention.engine.batch.batch_of(no_pos["input_ids"]).meta.doc_start[0], starts)
        lengths = [d.numel() for d in docs]
        expected = torch.repeat_interleave(torch.tensor([0, *lengths[:-1]]).cumsum(0), torch.tensor(lengths))
        assert torch.equal(starts, expected)
        assert float(local["num_items_in_batch"]) == sum(n - 1 for n in lengths)
        with pytest.raises(ValueError, match="foo"):
            cp.shard_batch(**batch, foo=3)
        bad = dict(batch, cu_seq_lens_q=batch["cu_seq_lens_q"][:-1])
        with pytest.raises(ValueError, match="cu_seq_lens_q"):
            cp.shard_batch(**bad)


@pytest.mark.slow  # 17 s: balanced layouts of models are also exact in test_latent.py's families at CP = 2
def test_cp_flash_models_under_balanced_layouts():
    """context_parallel(layout="balanced"): shard_batch(model=...) lays each batch out by its documents
    and the model's layers; logits, loss and DDP gradients equal each document alone under eager."""
    for world_size in (2, 4):
        for rank, found in enumerate(run_ranks(world_size, tw.run_balanced, timeout=600)):
            for family, e in found.items():
                where = f"P={world_size} rank {rank} {family}"
                assert e["logits"] <= 1e-4, (where, e)
                assert e["loss_err"] <= tw.REL_TOL and e["grad_err"] <= tw.REL_TOL, (where, e)


def test_position_ids_not_from_the_batch_are_refused():
    """Untagged position_ids (e.g. moved or rebuilt by the user) must equal the bound batch's:
    equal values run, other values raise instead of mixing two batches' positions and documents."""
    import cp_attention

    model, ref = tw.models("mistral")
    docs = tw.documents(0)
    batch = tw.flattened(docs)
    with torch.no_grad(), cp_attention.context_parallel() as cp:
        local = cp.shard_batch(**batch)
        same = dict(local, position_ids=local["position_ids"].clone())  # untagged, same values
        got = model(**same, use_cache=False).logits
        assert (got - tw._doc_logits(ref, docs)).abs().max() <= 1e-4
        other = dict(local, position_ids=torch.arange(local["position_ids"].shape[1])[None])
        with pytest.raises(ValueError, match="did not return for this batch"):
            model(**other, use_cache=False)


def test_position_check_syncs_once_per_batch_and_tensor(monkeypatch):
    """The comparison of untagged position_ids with the batch's syncs with the device: it runs once
    per batch and tensor (and again after an in-place change), not at every layer of every forward."""
    import cp_attention
    from cp_attention.engine import batch as batch_mod

    computed = []
    fact = batch_mod.tensor_fact

    def counting(record, tensor, name, compute):
        return fact(record, tensor, name, lambda: computed.append(name) or compute())

    monkeypatch.setattr(batch_mod, "tensor_fact", counting)
    model, _ = tw.models("mistral")
    assert model.config.num_hidden_layers >= 2
    with torch.no_grad(), cp_attention.context_parallel() as cp:
        local = cp.shard_batch(**tw.flattened(tw.documents(0)))
        same = dict(local, position_ids=local["position_ids"].clone())
        first = model(**same, use_cache=False).logits
        model(**same, use_cache=False)
        assert computed == ["positions match"]
        same["position_ids"].add_(0)  # an in-place change: checked again
        model(**same, use_cache=False)
        assert computed == ["positions match"] * 2
        assert torch.equal(model(**local, use_cache=False).logits, first)  # tagged: no check at all
        assert len(computed) == 2


def test_tensor_fact_is_weak_and_versioned():
    """A memoised fact is returned only for the same live tensor at the same version: an entry whose
    tensor died (its id may be reused by a new tensor) or changed in place is computed again."""
    from cp_attention.engine.batch import tensor_fact

    class Record:
        facts = {}

    t, calls = torch.ones(3), []
    assert tensor_fact(Record, t, "x", lambda: calls.append(1) or True)
    assert tensor_fact(Record, t, "x", lambda: calls.append(1) or False) and len(calls) == 1
    assert not tensor_fact(Record, t, "y", lambda: calls.append(1) or False) and len(calls) == 2
    t.mul_(2)
    assert not tensor_fact(Record, t, "x", lambda: calls.append(1) or False) and len(calls) == 3
    u = torch.ones(3)
    Record.facts[("x", id(u))] = (lambda: None, u._version, True)  # a dead tensor's entry under u's id
    assert not tensor_fact(Record, u, "x", lambda: False)


def test_run_command_kills_the_whole_group_on_timeout(tmp_path):
    """A timed-out torchrun must not leave its workers behind: run_command kills the process group."""
    import pytest

    marker = tmp_path / "child.pid"
    with pytest.raises(subprocess.TimeoutExpired):
        run_command(["bash", "-c", f"sleep 60 >/dev/null 2>&1 & echo $! > {marker}; wait"], timeout=1.0)
    pid = int(marker.read_text())
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    raise AssertionError(f"the timed-out command's child {pid} is still alive")
