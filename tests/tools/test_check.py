"""``python -m cp_attention check``: the sweep's verdict on checkpoints the test saves (the family sweep's
fast subset), the first differing layer of a wrong model, the exit status and ``--json``."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from cp_attention.tools import check
from cp_attention.tools.sweeps.configs import build_model, tiny_config

from remote_models import save_remote_model
from sweep_support import sweep_env
from test_family_sweep import FAST, FAST_EXACT

pytestmark = [pytest.mark.multirank, pytest.mark.transformers]


def _spec(path, **extra) -> dict:
    spec = dict(model=str(path), trust_remote_code=False, random=False, layers=0, tiny=False, docs=[13, 22, 9],
                nproc=2, layout="zigzag", strategy="ring", dtype="float32", device="cpu", timeout=240.0)
    spec.update(extra)
    return spec


@pytest.mark.slow  # about a minute; the next test runs the command in CI
def test_check_gives_the_sweeps_verdict_on_saved_checkpoints(tmp_path):
    """Each family of the sweep's fast subset, saved by the test: exact where the sweep says exact, refused
    (with the run's reason) where it says refused."""
    for family in FAST:
        path = tmp_path / family
        build_model(tiny_config(family), "eager").save_pretrained(path)
        report = check.check(_spec(path, explain=False))  # (the refused model's layers: the next test)
        want = "exact" if family in FAST_EXACT else "refused"
        assert report["verdict"] == want, (family, report["verdict"], report["runs"])
        if want == "refused":
            reason = next(r["reason"] for r in report["runs"].values() if r["verdict"] == "refused")
            assert "context parallelism" in reason or "cp_flash" in reason, reason


def test_check_names_the_first_differing_layer_and_exits_nonzero(tmp_path):
    """A remote-code model that rolls its tokens in its MLP from layer 1 on (a 3-layer checkpoint whose first
    layer is plain: mix_from_layer = 1): refused at CP = 2 by the model check (layer 1's roll named), wrong at
    world size 1; both tables name layer 1 as the first differing layer (layer 0 within the tolerance); exit 1,
    as JSON. The model without the roll: exact, exit 0."""
    path = save_remote_model(tmp_path, "roll", layers=3)
    plain = save_remote_model(tmp_path, None, layers=3)
    config = json.loads((path / "config.json").read_text())
    config["mix_from_layer"] = 1
    (path / "config.json").write_text(json.dumps(config))
    cmd = [sys.executable, "-m", "cp_attention", "check", str(path), "--trust-remote-code", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=sweep_env(), timeout=600)
    assert proc.returncode == 1, proc.stderr[-2000:]
    report = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert report["verdict"] == "refused"  # at CP = 2 the model check's trace refuses it, naming layer 1's roll
    run = report["runs"]["2"]
    assert run["verdict"] == "refused" and "model.layers.1.mlp" in run["reason"] and "roll at" in run["reason"], run
    for run in report["runs"].values():  # what it computes (at CP = 2: with the model check off)
        assert run.get("unchecked", run["verdict"]) == "wrong" and run["first_layer"] == 1, run
        assert run["layers"][0]["error"] <= report["tolerance"] < run["layers"][1]["error"], run["layers"]
    proc = subprocess.run([sys.executable, "-m", "cp_attention", "check", str(plain), "--trust-remote-code"],
                          capture_output=True, text=True, env=sweep_env(), timeout=600)
    assert proc.returncode == 0 and "verdict: exact" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_keep_layers_keeps_the_models_own_mix():
    config = tiny_config("gemma3_text")
    config.layer_types = ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 5 + \
        ["full_attention"]
    config.num_hidden_layers = 12
    kept = check.keep_layers(config, 2)
    assert kept.layer_types == ["sliding_attention", "sliding_attention", "full_attention", "full_attention"]
    assert kept.num_hidden_layers == 4 and config.num_hidden_layers == 12


@pytest.mark.slow
def test_a_100m_checkpoint_checks_in_under_a_minute(tmp_path):
    """A ~100M-parameter Qwen3 checkpoint (most of it embeddings), 2 layers kept: under a minute on 2 cores."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=40000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=64, tie_word_embeddings=False)
    Qwen3ForCausalLM(config).save_pretrained(tmp_path / "ckpt")
    start = time.monotonic()
    report = check.check(_spec(tmp_path / "ckpt", layers=2))
    seconds = time.monotonic() - start
    assert report["verdict"] == "exact", report["runs"]
    assert report["params"] >= 90e6
    assert seconds < 60, seconds
