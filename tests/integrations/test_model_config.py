"""The one reading of a transformers config into per-layer masks (``integrations/hf/models.py``), used by
the cp_flash adapter (chunks), the balanced layout of ``shard_batch(model=...)`` and the probe.

Expected masks are written from transformers' config conventions: ``layer_types[i]`` names layer
i's kind ("sliding_attention" with ``sliding_window``, "chunked_attention" with
``attention_chunk_size``, else full); a config without ``layer_types`` whose attention passes
``config.sliding_window`` to every layer (Mistral, Phi-3) slides on every layer when it is set;
ModernBERT is bidirectional."""

from __future__ import annotations

import pytest

from cp_attention.integrations.hf.models import layer_masks, model_masks
from cp_attention.integrations.hf.attention import layer_mask_spec
from cp_attention.masks import MaskSpec
from cp_attention.tools.tiny_models import tiny_config, tiny_model

pytestmark = pytest.mark.transformers  # builds transformers models


def test_layer_types_windows_and_chunks():
    qwen3 = tiny_config("qwen3", window=8)  # layer_types: sliding, full
    assert layer_masks(qwen3) == [MaskSpec(window=8), MaskSpec()]
    llama4 = tiny_config("llama4", chunk=8)  # chunked x 3, full
    assert layer_masks(llama4) == [MaskSpec(chunk_size=8)] * 3 + [MaskSpec()]
    modernbert = tiny_config("modernbert", window=8)  # full, sliding, sliding; bidirectional
    w = modernbert.sliding_window + 1  # a half-window in the config; its layers pass one more
    assert layer_masks(modernbert) == [MaskSpec(causal=False), MaskSpec(causal=False, window=w),
                                       MaskSpec(causal=False, window=w)]


def test_a_window_without_layer_types_is_on_every_layer():
    mistral = tiny_config("mistral", window=8)
    assert getattr(mistral, "layer_types", None) is None
    assert layer_masks(mistral) == [MaskSpec(window=8)] * mistral.num_hidden_layers
    phi3 = tiny_config("phi3")  # no window: full layers
    assert layer_masks(phi3) == [MaskSpec()] * phi3.num_hidden_layers


def test_balanced_cost_model_and_adapter_read_the_same_masks():
    model = tiny_model("llama4", "cp_flash", chunk=8)
    masks, weight = model_masks(model)
    assert masks == [dict(causal=True, chunk_size=8)] * 3 + [dict(causal=True)]
    assert weight > 0
    # the adapter: chunks from the config, the window the layer passes, causal from the module
    layers = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "is_causal")]
    specs = [layer_mask_spec(m) for m in sorted(layers, key=lambda m: m.layer_idx)]
    assert [s.chunk_size for s in specs] == [8, 8, 8, None]
    mistral = tiny_model("mistral", "cp_flash", window=8)
    assert model_masks(mistral)[0] == [dict(causal=True, window=8)] * mistral.config.num_hidden_layers


def test_probe_describes_the_config_reading():
    from cp_attention.tools.probe import _describe

    assert _describe("qwen3", "own mix", 8, [16]) == "own mix SF"
    assert _describe("llama4", "own mix", 8, [16]) == "own mix CCCF"
    assert _describe("mistral", "own mix", 8, [16]) == "own mix SS"


def test_balanced_cost_model_counts_a_hybrids_mixers_per_token():
    """A hybrid's convolution / Mamba / linear-attention layers are not attention layers of the
    balanced cost model (their work is per token, in the token weight with the projections)."""
    from cp_attention.tools.sweeps.configs import build_model, tiny_config

    for family, attention in (("qwen3_next", 1), ("nemotron_h", 1), ("granitemoehybrid", 1)):
        model = build_model(tiny_config(family), "cp_flash")
        masks, weight = model_masks(model)
        assert masks == [dict(causal=True)] * attention, (family, masks)
        assert weight > 0


def test_balanced_cost_model_of_mixers_alone():
    """A model without attention (Mamba, RWKV, xLSTM: no num_attention_heads) has no attention masks and
    costs per token: shard_batch(..., model=model) in a balanced layout splits its tokens evenly (it raised
    AttributeError before)."""
    import cp_attention
    from cp_attention.tools.sweeps import family as sweep
    from cp_attention.tools.sweeps.configs import build_model, tiny_config

    for family in ("mamba", "rwkv", "xlstm"):
        model = build_model(tiny_config(family), "cp_flash")
        assert model_masks(model) == ([], 1.0), family
        ids, pos = sweep.make_inputs()
        with cp_attention.context_parallel(layout="balanced") as cp:
            assert cp.shard_batch(input_ids=ids, position_ids=pos, model=model)["input_ids"].shape == ids.shape
