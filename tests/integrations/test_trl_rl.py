"""TRL's post-training trainers under context parallelism: CPGRPOTrainer, CPRLOOTrainer and CPDPOTrainer
under torchrun against the plain trainers on one process (eager), and what they refuse.

Ground truth: examples/train_grpo.py and examples/train_dpo.py with ``--single``: the plain trainer on
one process holding the CP group's rows (a per-device batch of the CP run's times the ranks), eager
attention, the same completions (a fixed generation stub both runs share), SGD at a constant learning
rate. Every logged number of every step (losses, KL, entropy, clip ratios, rewards, completion
lengths, the router loss, DPO's rewards and log-probabilities) and the final weights must agree to
1e-5. A dp x cp run (4 ranks: two CP groups of 2) is compared with plain data parallelism on 2
processes, each holding one group's rows.

The model is a tiny gpt-oss: sliding-window layers (8 tokens) with attention sinks and a MoE whose
router loss is trained (gpt-oss's router_aux_loss_coef), plus a reference model (beta = 0.1),
gradient checkpointing and 2 accumulation steps unless a case says otherwise; the hybrid cases use
Qwen3-Next and OLMo-Hybrid (gated DeltaNet and attention layers)."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("trl")

from test_trl import ROOT, _python, _torchrun  # noqa: E402  (offline, one thread per process)

pytestmark = [pytest.mark.multirank, pytest.mark.transformers]
TOL = 1e-5
GRPO = os.path.join(ROOT, "examples", "train_grpo.py")
DPO = os.path.join(ROOT, "examples", "train_dpo.py")
# not compared: wall-clock figures (step_time, *_runtime, *_per_second), and Trainer's FLOP estimate (6 x parameters
# x input tokens, padding included: each rank pads its own micro-batch, one process pads all of them to the longest)
UNCOMPARED = ("step_time", "total_flos")


def _compared(key: str) -> bool:
    return key not in UNCOMPARED and not key.endswith(("_runtime", "_per_second"))

GRPO_CASES = [
    {"name": "dapo"},  # TRL's default loss, its normaliser the generation batch's token count
    *({"name": lt, "set": {"loss_type": lt}} for lt in ("grpo", "cispo", "vespo")),
    {"name": "sequence-ratio", "set": {"importance_sampling_level": "sequence", "loss_type": "grpo"}},
    {"name": "entropy-quantile", "set": {"top_entropy_quantile": 0.3, "entropy_coef": 0.05}},
    {"name": "iterations", "set": {"num_iterations": 2, "steps_per_generation": 4}, "steps": 3},
    {"name": "truncated", "set": {"mask_truncated_completions": True}},
    {"name": "no-reference", "set": {"beta": 0.0}},
    {"name": "lora", "peft": True},
    {"name": "hybrid", "model": "qwen3_next"},
    {"name": "rloo", "trainer": "rloo"},
    {"name": "rloo-hybrid", "trainer": "rloo", "model": "olmo_hybrid", "set": {"normalize_advantages": True}},
    {"name": "rloo-eval", "trainer": "rloo", "eval": True},  # generation, scoring and the loss on held-out prompts
]
GRPO_SLOW_CASES = [  # the same path as the cases above (-m slow, for CI time)
    *({"name": lt, "set": {"loss_type": lt}} for lt in ("bnpo", "dr_grpo", "sapo", "luspo")),
    {"name": "eval", "eval": True},
]
DPO_CASES = [
    {"name": "sigmoid"},
    *({"name": lt, "set": {"loss_type": [lt]}} for lt in ("ipo", "nca_pair", "aot", "apo_zero", "sft", "sigmoid_norm")),
    {"name": "mixed", "set": {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]}},
    {"name": "ld_alpha", "set": {"ld_alpha": 0.5}},
    {"name": "weighting", "set": {"use_weighting": True}},
    {"name": "precompute", "set": {"precompute_ref_log_probs": True}},
    {"name": "lora", "peft": True},
    {"name": "hybrid", "model": "qwen3_next"},
    {"name": "eval", "eval": True},
]
DPO_SLOW_CASES = [  # the same path as the cases above (-m slow, for CI time)
    *({"name": lt, "set": {"loss_type": [lt]}} for lt in (
        "hinge", "robust", "bco_pair", "sppo_hard", "aot_unpaired", "apo_down", "discopop")),
    {"name": "exo_pair", "set": {"loss_type": ["exo_pair"], "label_smoothing": 0.1}},
]


def _run_pair(out, script: str, cases: list, *, nproc: int = 2, single_nproc: int = 1, cp: tuple = ()) -> None:
    """The CP run on ``nproc`` ranks and the plain run (``single_nproc`` data-parallel processes) of ``cases``."""
    spec = json.dumps(cases)
    run = _torchrun(script, "--out", str(out / "cp"), "--cases", spec, *cp, nproc=nproc, timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    plain = ("--single", "--out", str(out / "single"), "--cases", spec)
    base = (_python(script, *plain, timeout=1200) if single_nproc == 1 else
            _torchrun(script, *plain, "--world", str(nproc // single_nproc), nproc=single_nproc, timeout=1200))
    assert base.returncode == 0, base.stdout[-3000:] + base.stderr[-3000:]


def check_same_training(cp_dir, single_dir) -> None:
    """Every logged number of every step and the final weights agree; training moved the weights; the
    CP run ran its cp_flash layers over 2 ranks, the other run under eager."""
    assert json.load(open(os.path.join(cp_dir, "cp.json"))) == {"world_size": 2}
    assert json.load(open(os.path.join(single_dir, "cp.json"))) == {"world_size": None}
    logs = [json.load(open(os.path.join(d, "logs.json"))) for d in (cp_dir, single_dir)]
    assert len(logs[0]) == len(logs[1]) >= 3
    for step, (a, b) in enumerate(zip(*logs)):
        keys = set(a) | set(b)
        assert {k for k in keys if k not in a or k not in b} == set(), f"step {step}: logged keys differ"
        for k in sorted(filter(_compared, keys)):
            assert abs(a[k] - b[k]) <= TOL * max(1.0, abs(b[k])), f"step {step}: {k} = {a[k]} under CP, {b[k]} alone"
    params = [torch.load(os.path.join(d, "params.pt")) for d in (cp_dir, single_dir)]
    initial = torch.load(os.path.join(single_dir, "initial.pt"))
    assert initial.keys() == params[0].keys() == params[1].keys()
    moved = max(float((params[1][k] - initial[k]).abs().max()) for k in initial)
    assert moved > 1e-3, "training did not change the weights: the comparison would prove nothing"
    for k, v in params[1].items():
        assert float((params[0][k] - v).abs().max()) <= TOL * max(1.0, float(v.abs().max())), k


@pytest.fixture(scope="module")
def grpo_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo")
    _run_pair(out, GRPO, GRPO_CASES)
    return out


@pytest.fixture(scope="module")
def dpo_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dpo")
    _run_pair(out, DPO, DPO_CASES)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("script, cases", [(GRPO, GRPO_SLOW_CASES), (DPO, DPO_SLOW_CASES)], ids=["grpo", "dpo"])
def test_more_loss_types_equal_one_process(tmp_path, script, cases):
    """The other GRPO and DPO loss types (and GRPO's evaluation), as the cases above."""
    _run_pair(tmp_path, script, cases)
    for case in cases:
        check_same_training(tmp_path / "cp" / case["name"], tmp_path / "single" / case["name"])


@pytest.mark.parametrize("case", [c["name"] for c in GRPO_CASES])
def test_cp_grpo_and_rloo_equal_one_process(grpo_runs, case):
    """CPGRPOTrainer / CPRLOOTrainer on 2 gloo ranks against GRPOTrainer / RLOOTrainer on one process:
    every loss type (each normalises over other tokens: per sequence, per micro-batch, per
    generation batch), sequence-level importance ratios, the entropy quantile mask (a quantile over
    every completion token) with the entropy bonus, old log-probabilities reused over 2 iterations
    and 4 micro-batches per generation (the shuffled split), masked truncated completions, LoRA (the
    reference is the adapter off), the router loss, hybrids."""
    check_same_training(grpo_runs / "cp" / case, grpo_runs / "single" / case)


@pytest.mark.parametrize("case", [c["name"] for c in DPO_CASES])
def test_cp_dpo_equals_one_process(dpo_runs, case):
    """CPDPOTrainer on 2 gloo ranks against DPOTrainer on one process: every loss type (sums of
    log-probabilities per sequence, per-token means for IPO / sigmoid_norm / SFT, batch-wide sorts
    for AOT), the LD-alpha split, WPO weights, precomputed reference log-probabilities, LoRA, a hybrid."""
    check_same_training(dpo_runs / "cp" / case, dpo_runs / "single" / case)


@pytest.mark.slow  # 4 ranks on 2 cores: 26-37 s each
@pytest.mark.parametrize("script", [GRPO, DPO], ids=["grpo", "dpo"])
def test_dp_by_cp_equals_data_parallel(tmp_path, script):
    """4 ranks as 2 (data parallel) x 2 (CP): each CP group trains as one data-parallel process holding
    its rows; plain data parallelism on 2 processes (eager) is the reference. One accumulation step:
    the generation batch is shuffled by each group's first rank, whose random state is not a 2-process
    run's."""
    _run_pair(tmp_path, script, [{"name": "run", "accumulation": 1, "batch": 2}], nproc=4, single_nproc=2,
              cp=("--cp-size", "2"))
    check_same_training(tmp_path / "cp" / "run", tmp_path / "single" / "run")


@pytest.mark.slow  # 2 launches, 25 s
def test_fsdp2_equals_one_process(tmp_path):
    """CPGRPOTrainer with Trainer's FSDP2 (fully_shard, reshard after forward; TRL's fused head gathers
    the LM head's DTensor) on 2 gloo ranks against GRPOTrainer on one process without FSDP."""
    fsdp = ("--set", "fsdp=full_shard", "--set", "fsdp_config={'fsdp_version': 2, 'reshard_after_forward': True}")
    _run_pair(tmp_path, GRPO, [{"name": "run"}], cp=fsdp)
    check_same_training(tmp_path / "cp" / "run", tmp_path / "single" / "run")


@pytest.mark.slow
def test_real_generation_runs_end_to_end(tmp_path):
    """model.generate samples the completions (outside the CP block, each process its own prompts),
    then the step trains under CP: GRPO and RLOO, 2 ranks."""
    cases = [{"name": "grpo", "generate": True}, {"name": "rloo", "trainer": "rloo", "generate": True}]
    run = _torchrun(GRPO, "--out", str(tmp_path), "--cases", json.dumps(cases), timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for name in ("grpo", "rloo"):
        assert json.load(open(tmp_path / name / "cp.json")) == {"world_size": 2}
        logs = json.load(open(tmp_path / name / "logs.json"))
        assert logs and all(row.get("completions/mean_length", 1) > 0 for row in logs[:-1])
        params, initial = (torch.load(tmp_path / name / f) for f in ("params.pt", "initial.pt"))
        assert max(float((params[k] - initial[k]).abs().max()) for k in initial) > 1e-4



def test_one_process_cp_trainers_equal_the_plain_ones(tmp_path):
    """World size 1 (no launcher): CPGRPOTrainer, CPRLOOTrainer (examples/train_rloo.py) and
    CPDPOTrainer with cp_flash train to the plain trainers' numbers (eager); the packed scoring path
    runs all the same."""
    import train_dpo
    import train_grpo
    import train_rloo

    for module, cases in ((train_grpo, [{"name": "grpo", "set": {"loss_type": "grpo"}}]),
                          (train_rloo, [{"name": "rloo"}]), (train_dpo, [{"name": "dpo"}])):
        spec = json.dumps(cases)
        module.main(["--out", str(tmp_path / "cp"), "--world", "1", "--cases", spec])
        module.main(["--single", "--out", str(tmp_path / "single"), "--world", "1", "--cases", spec])
        name = cases[0]["name"]
        assert json.load(open(tmp_path / "cp" / name / "cp.json")) == {"world_size": 1}
        with open(tmp_path / "cp" / name / "cp.json", "w") as f:  # check_same_training wants the CP run's 2 ranks
            json.dump({"world_size": 2}, f)
        check_same_training(tmp_path / "cp" / name, tmp_path / "single" / name)


def _grpo(tmp_path, attention="cp_flash", **config):
    import train_grpo
    from trl import GRPOConfig

    from cp_attention.integrations.trainers.trl import CPGRPOTrainer

    path = train_grpo.model_dir(str(tmp_path), "gpt_oss", 0)
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, report_to=[], use_cpu=True, bf16=False,
                      model_init_kwargs={"attn_implementation": attention, "dtype": torch.float32}, **config)
    return CPGRPOTrainer(model=path, reward_funcs=train_grpo.reward, args=args, train_dataset=train_grpo.prompts(),
                         processing_class=train_grpo.tokenizer(), rollout_func=train_grpo.rollout)


def test_the_post_training_trainers_refuse_what_they_cannot_make_exact(tmp_path):
    """A policy without cp_flash (the reference model is loaded like it); paged generation through
    cp_flash (untested); inputs besides the tokens, and rows that are not one span, in the scoring."""
    import cp_attention
    from cp_attention.integrations.trainers.packed_rows import packed_fused_forward

    with pytest.raises(ValueError, match="cp_flash"):
        _grpo(tmp_path, attention="eager")
    with pytest.raises(NotImplementedError, match="use_transformers_continuous_batching"):
        _grpo(tmp_path, use_transformers_continuous_batching=True)
    trainer = _grpo(tmp_path)
    ids = torch.randint(3, 100, (2, 6))
    labels = ids.clone()
    labels[:, :2] = -100
    with cp_attention.context_parallel() as cp:
        with pytest.raises(NotImplementedError, match="pixel_values"):
            packed_fused_forward(trainer.model.forward, trainer.model, cp,
                                 dict(input_ids=ids, labels=labels, pixel_values=torch.zeros(2, 3, 4, 4)))
        mask = torch.ones_like(ids)
        mask[0, 3] = 0
        with pytest.raises(NotImplementedError, match="contiguous span"):
            trainer.model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
