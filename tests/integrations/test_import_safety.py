"""Importing the package never changes a model that does not use cp_flash (issue 52): for each family, the
eager logits and parameter gradients of a tiny model are bit-identical in a process that never imports
cp_attention and in one that imports it before transformers (its import hooks then adapt every modeling
module the model loads: mixer functions, mixer classes, router losses, indexers, RoPE).

The default run covers the families whose modeling modules the adapters touch (every kind of adapter) and a
few plain ones; ``-m families`` runs every causal-LM family of the installed transformers.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from cp_attention.tools.sweeps import configs

pytestmark = [pytest.mark.multirank, pytest.mark.transformers]  # starts two Python processes

WORKER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support", "import_safety.py")
ADAPTED = ("qwen3_next", "qwen3_5", "falcon_h1", "jamba", "granitemoehybrid", "lfm2", "mamba2", "kimi_linear",
           "nemotron_h", "mamba", "olmo_hybrid", "minimax", "recurrent_gemma", "rwkv", "xlstm", "zamba2",
           "deepseek_v32", "qwen4_exp", "mixtral", "qwen3_moe", "gpt_oss", "llama4", "qwen3", "gemma3_text")
"""Mixer functions (convolutions, gated DeltaNet, Mamba-2, Mamba, KDA), mixer classes (lightning, RG-LRU,
RWKV, xLSTM), indexers, router losses, and plain families; those the installed transformers lacks are skipped
by name (5.17 has no qwen4_exp)."""


def _compare(families: list[str], tmp_path) -> None:
    tiny = {}
    for family in families:
        try:
            tiny[family] = configs.tiny_config(family)
        except Exception:  # unbuildable here: the sweep's tables name these
            continue
    assert tiny, families
    path = tmp_path / "configs.pt"
    torch.save(tiny, path)
    env = dict(os.environ, OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error")
    results = {}
    for mode in ("without", "with"):
        out = tmp_path / f"{mode}.pt"
        cmd = [sys.executable, WORKER, str(path), str(out)] + (["--with-cp-attention"] if mode == "with" else [])
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3000)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
        results[mode] = torch.load(out, weights_only=False)
    without, with_ = results["without"], results["with"]
    assert set(without) == set(with_) == set(tiny)
    diffs, ran = [], 0
    for family in tiny:
        a, b = without[family], with_[family]
        if "error" in a or "error" in b:
            if a.get("error") != b.get("error"):
                diffs.append(f"{family}: without the import {a.get('error', 'ran')}; with it {b.get('error', 'ran')}")
            continue
        ran += 1
        if not torch.equal(a["logits"], b["logits"]):
            diffs.append(f"{family}: logits differ by {float((a['logits'] - b['logits']).abs().max()):.3g}")
        if set(a["grads"]) != set(b["grads"]):
            diffs.append(f"{family}: gradients of other parameters")
            continue
        bad = [n for n in a["grads"] if not torch.equal(a["grads"][n], b["grads"][n])]
        if bad:
            diffs.append(f"{family}: gradients of {', '.join(bad[:3])} ({len(bad)} parameters) differ")
    assert not diffs, "\n".join(diffs)
    assert ran >= min(len(tiny), 3), (ran, {f: r.get("error") for f, r in without.items()})


def test_import_changes_no_eager_model_of_the_adapted_families(tmp_path):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    _compare([f for f in ADAPTED if f in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES], tmp_path)


@pytest.mark.families
def test_import_changes_no_eager_model_of_any_family(tmp_path):
    _compare(configs.families(), tmp_path)
