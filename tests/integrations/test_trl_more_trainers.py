"""The rest of TRL's stable trainers under context parallelism: CPRewardTrainer, CPKTOTrainer and
CPDistillationTrainer under torchrun (2 ranks) against the plain trainers on one process (eager).

Ground truth: examples/train_reward.py, train_kto.py and train_distill.py with ``--single``: the plain
trainer on one process holding the CP group's rows (a per-device batch of the CP run's times the
ranks), eager attention, SGD at a constant learning rate. Every logged number of every step and the
final weights must agree to 1e-5 (tests/integrations/test_trl_rl.py's ``check_same_training``).

The model is a tiny gpt-oss (sliding-window layers of 8 tokens with attention sinks, a MoE), gradient
checkpointing and 2 accumulation steps. KTO trains its router loss (gpt-oss's router_aux_loss_coef);
a reward model's classification head and TRL's distillation loss have none. Distillation: a second
tiny gpt-oss as the teacher, the completions from a fixed stub (the place of each prompt in the
global generation batch decides it), or generated greedily by ``model.generate`` on every process."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("trl")

from test_trl import ROOT  # noqa: E402
from test_trl_rl import _run_pair, check_same_training  # noqa: E402

pytestmark = [pytest.mark.multirank, pytest.mark.transformers]
REWARD = os.path.join(ROOT, "examples", "train_reward.py")
KTO = os.path.join(ROOT, "examples", "train_kto.py")
DISTILL = os.path.join(ROOT, "examples", "train_distill.py")

REWARD_CASES = [
    {"name": "reward"},
    {"name": "center-margin", "set": {"center_rewards_coefficient": 0.05}, "margin": True},
    {"name": "lora", "peft": True},  # LoRA on the attention, the score head trained with it (task SEQ_CLS)
]
KTO_CASES = [
    {"name": "kto"},
    {"name": "weights", "set": {"desirable_weight": 1.5, "undesirable_weight": 0.7}},
    {"name": "lora", "peft": True},  # the reference: the adapter off
    {"name": "eval", "eval": True},  # the loss and metrics on held-out rows after every step, under CP
]
DISTILL_CASES = [
    {"name": "reverse-kl"},  # TRL's default, beta = 1
    {"name": "forward-kl", "set": {"beta": 0.0}},
    {"name": "jsd", "set": {"beta": 0.5, "temperature": 0.8}},
    {"name": "lora", "peft": True},
    {"name": "generate", "generate": True, "set": {"generation_kwargs": {"do_sample": False}}},
    {"name": "eval", "eval": True},
]


@pytest.fixture(scope="module")
def reward_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("reward")
    _run_pair(out, REWARD, REWARD_CASES)
    return out


@pytest.fixture(scope="module")
def kto_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("kto")
    _run_pair(out, KTO, KTO_CASES)
    return out


@pytest.fixture(scope="module")
def distill_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("distill")
    _run_pair(out, DISTILL, DISTILL_CASES)
    return out


@pytest.mark.parametrize("case", [c["name"] for c in REWARD_CASES])
def test_cp_reward_trainer_equals_one_process(reward_runs, case):
    """CPRewardTrainer on 2 gloo ranks against RewardTrainer on one process: the pooled rewards of the
    group's pairs (each row's last token on one rank or the other), the loss with margins and
    ``center_rewards_coefficient``, accuracy, margin, min/mean/max reward, the token count, LoRA."""
    check_same_training(reward_runs / "cp" / case, reward_runs / "single" / case)


@pytest.mark.parametrize("case", [c["name"] for c in KTO_CASES])
def test_cp_kto_trainer_equals_one_process(kto_runs, case):
    """CPKTOTrainer on 2 gloo ranks against KTOTrainer on one process: the KL estimate from the group's
    mismatched pairs, desirable and undesirable weights, rewards, log-probabilities, logits, entropy,
    the router loss, LoRA."""
    check_same_training(kto_runs / "cp" / case, kto_runs / "single" / case)


@pytest.mark.parametrize("case", [c["name"] for c in DISTILL_CASES])
def test_cp_distillation_trainer_equals_one_process(distill_runs, case):
    """CPDistillationTrainer on 2 gloo ranks against DistillationTrainer on one process: forward and
    reverse KL and the generalised JSD (with a temperature) over the whole vocabulary, each rank on its
    shard's tokens; the entropy metric; completions from the stub or greedy ``model.generate``; LoRA."""
    check_same_training(distill_runs / "cp" / case, distill_runs / "single" / case)


@pytest.mark.slow  # 4 ranks on 2 cores
@pytest.mark.parametrize("script", [REWARD, KTO, DISTILL], ids=["reward", "kto", "distill"])
def test_dp_by_cp_equals_data_parallel(tmp_path, script):
    """4 ranks as 2 (data parallel) x 2 (CP): each CP group trains as one data-parallel process holding
    its rows; plain data parallelism on 2 processes (eager) is the reference."""
    _run_pair(tmp_path, script, [{"name": "run", "accumulation": 1, "batch": 2}], nproc=4, single_nproc=2,
              cp=("--cp-size", "2"))
    check_same_training(tmp_path / "cp" / "run", tmp_path / "single" / "run")
