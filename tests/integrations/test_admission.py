"""Adapters admit a foreign function by its behaviour (issue 52): before :mod:`cp_attention.integrations.hf.adapters.mixer_functions`
wraps a transformers mixer function, it runs it on synthetic inputs and checks that it does what the adapter
assumes (:func:`cp_attention.integrations.hf.function_admission.admit`).

* every mixer function of the installed transformers' hybrid families is admitted (none declined);
* stand-ins written here from each function's definition (a float64 loop) are admitted, and the same
  stand-ins with one planted change of convention or behaviour are declined, with the reason;
* a declined function is left as it is (the module's attribute is the stand-in itself, so eager runs it
  untouched), and the family is refused under context parallelism before any layer runs, naming the
  transformers version and the function.
"""

from __future__ import annotations

import importlib

import pytest

import cp_attention  # noqa: F401  (registers cp_flash and adapts modeling modules as they load)
from admission_cases import conv_fn, declined_family_worker, delta_rule, mamba2_scan, selective_scan
from cp_attention.integrations.hf import mixing
from cp_attention.integrations.hf.adapters import mixer_functions as mixers
from cp_attention.integrations.hf.adapters import step_functions
from cp_attention.integrations.hf import forward, state
from cp_attention.integrations.hf.function_admission import admit
from cp_attention.tools.launch import run_ranks

pytestmark = pytest.mark.transformers

HYBRID_MODULES = ("qwen3_next", "qwen3_5", "olmo_hybrid", "nemotron_h", "falcon_h1", "granitemoehybrid", "bamba",
                  "zamba2", "jamba", "lfm2", "kimi_linear", "mamba", "mamba2", "falcon_mamba", "zamba")


CASES = [
    ("causal_conv1d_fn", conv_fn, ("swapped", "centred", "no_activation", "tuple")),
    ("torch_chunk_gated_delta_rule", delta_rule, ("ignores_state", "shifted_output")),
    ("chunk_kimi_delta_attention", lambda plant=None: delta_rule(plant, per_channel=True),
     ("ignores_state", "shifted_output")),
    ("mamba2_chunk_scan", mamba2_scan, ("ignores_state",)),
    ("mamba_selective_scan", selective_scan, ("no_softplus",)),
]


@pytest.mark.parametrize("name, make, plants", CASES, ids=[c[0] for c in CASES])
def test_stand_ins_from_the_definition_are_admitted_and_planted_changes_declined(name, make, plants):
    assert admit(name, make(), None) is None
    for plant in plants:
        reason = admit(name, make(plant), None)
        assert reason is not None, f"{name} with {plant} was admitted"


def test_every_mixer_function_of_the_installed_transformers_is_admitted():
    found = 0
    for family in HYBRID_MODULES:
        try:
            mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        except ImportError:
            continue
        for name in mixers.CONVOLUTIONS + mixers.RECURRENCES:
            if getattr(mod, name, None) is not None:
                found += 1
                assert getattr(getattr(mod, name), "_cp_attention_mixer_function", False), f"{family}.{name}"
    with state.INTEGRATIONS_LOCK:
        declined = dict(state.INTEGRATIONS["declined"])
    assert not declined, declined
    assert found >= 20


def test_a_call_off_the_convention_is_refused_under_cp_and_untouched_outside():
    """A wrapped function called with arguments its convention does not bind (a stray positional) is
    refused under context parallelism, with the version; outside it the original runs as called."""
    calls = []

    def original(*args, **kwargs):
        calls.append((args, kwargs))
        return "original"

    wrapper = mixers._convolution(original)
    assert wrapper(1, 2, 3, 4, 5) == "original" and calls[-1] == ((1, 2, 3, 4, 5), {})
    forward.FORWARD.mixers = 1
    try:
        with pytest.raises(NotImplementedError, match=r"transformers \d+\.\d+.*causal_conv1d_fn"):
            wrapper(1, 2, 3, 4, 5)
    finally:
        forward.FORWARD.mixers = 0


# ----------------------------------------------------------------------------------------------
# a declined function: untouched, and its family refused under context parallelism


@pytest.mark.multirank
def test_a_declined_function_leaves_eager_untouched_and_refuses_its_family_under_cp():
    per_rank = run_ranks(2, declined_family_worker, "qwen3_next", "torch_chunk_gated_delta_rule", timeout=300)
    for message, version in per_rank:
        assert message is not None, "the family ran under context parallelism with a declined function"
        assert f"transformers {version}" in message and "torch_chunk_gated_delta_rule" in message, message
        assert "not do what cp_attention's adapter assumes" in message, message


def test_a_declined_function_is_the_planted_one_itself(monkeypatch):
    """Eager bit-identical: the module's attribute is the stand-in object, so eager calls it directly."""
    mod = importlib.import_module("transformers.models.qwen3_next.modeling_qwen3_next")
    key = (mod.__name__, "torch_chunk_gated_delta_rule")
    plant = delta_rule("ignores_state")
    monkeypatch.setattr(mod, "torch_chunk_gated_delta_rule", plant)
    try:
        mixers.adapt_module(mod)
        assert mod.torch_chunk_gated_delta_rule is plant
        assert "torch_chunk_gated_delta_rule" in mixing.declined(mod.__name__)
    finally:
        with state.INTEGRATIONS_LOCK:
            state.INTEGRATIONS["declined"].pop(key, None)


def test_the_version_range_is_the_tested_releases_and_a_newer_one_warns():
    """pyproject.toml admits the tested releases (lowest to newest) and nothing newer; a newer release installed by
    hand gets the warning, a tested one none."""
    import os
    import re

    from cp_attention.integrations.hf.versions import TESTED_VERSIONS, parse, untested_warning

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "pyproject.toml")) as f:
        text = f.read()
    spec = re.search(r'"transformers>=([\d.]+),<=([\d.]+)"', text)
    assert spec is not None, "pyproject.toml's transformers requirement is not '>=LOWEST,<=NEWEST'"
    assert parse(spec.group(1)) == min(map(parse, TESTED_VERSIONS))
    assert parse(spec.group(2)) == max(map(parse, TESTED_VERSIONS))
    assert all(untested_warning(v) is None for v in TESTED_VERSIONS)
    assert "5.26.0 is newer" in untested_warning("5.26.0") and untested_warning("5.25.1") is not None
    assert untested_warning("5.26.0.dev0") is not None and untested_warning("5.20.1") is None


def test_a_step_function_that_skips_the_adapted_functions_is_refused_under_cp():
    """transformers 5.25's step functions (``causal_conv1d_forward``, ...) can be replaced by a hub kernel that computes
    the convolution itself: under context parallelism a call that reaches no adapted function is refused; one that
    hands the convolution to the adapted ``causal_conv1d_fn`` runs; outside the block both run untouched."""
    import torch
    import torch.nn.functional as F

    conv_fn_wrapped = mixers._convolution(conv_fn())

    def delegating(conv1d, hidden_states, cache, layer_idx, activation=None, **kwargs):
        return conv_fn_wrapped(hidden_states, conv1d.weight.squeeze(1), conv1d.bias, activation=activation)

    def own_kernel(conv1d, hidden_states, cache, layer_idx, activation=None, **kwargs):
        return F.silu(F.conv1d(hidden_states, conv1d.weight, conv1d.bias, padding=3, groups=3)[..., :-3])

    good = step_functions._forward("causal_conv1d_forward", delegating)
    bad = step_functions._forward("causal_conv1d_forward", own_kernel)
    conv = torch.nn.Conv1d(3, 3, 4, groups=3, padding=3)
    x = torch.randn(1, 3, 12)
    want = bad(conv, x, None, 0, activation="silu")  # outside the block: the original, untouched
    assert torch.equal(want, own_kernel(conv, x, None, 0, activation="silu"))
    pos = torch.arange(12)[None]
    with cp_attention.context_parallel() as cp:
        batch = cp.shard_batch(input_ids=torch.zeros_like(pos), position_ids=pos)  # alive: the mixers' batch
        forward.FORWARD.mixers = 1  # inside a tagged mixer of a cp_flash model
        try:
            with torch.no_grad():
                assert torch.allclose(good(conv, x, None, 0, activation="silu"), want, atol=1e-6)
                with pytest.raises(NotImplementedError, match=r"computed its sequence mixing without"):
                    bad(conv, x, None, 0, activation="silu")
        finally:
            forward.FORWARD.mixers = 0
        del batch
