"""attn_implementation="cp_flash": registration, every adapted transformers code path, generation,
from_pretrained, Llama 4's temperature, padding, and clear errors."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch

import cp_attention
from cp_attention.tools.launch import run_ranks
from cp_attention.tools.tiny_models import FAMILIES, is_causal_lm, tiny_config, tiny_model

transformers = pytest.importorskip("transformers")
from transformers import AttentionInterface  # noqa: E402  loading the modeling code registers cp_flash

from cp_attention.integrations.hf import registry as integ  # noqa: E402

pytestmark = [pytest.mark.multirank, pytest.mark.transformers]  # spawns gloo ranks; builds transformers models


def test_import_registers_lazily_and_idempotently():
    code = ("import sys, cp_attention; assert 'transformers.modeling_utils' not in sys.modules; "
            "from transformers import AttentionInterface, AttentionMaskInterface; "
            "assert 'cp_flash' in AttentionInterface._global_mapping; "
            "assert 'cp_flash' in AttentionMaskInterface._global_mapping; "
            "import cp_attention.integrations.hf.registry as t; t.register(); t.register(); print('ok')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]


@pytest.mark.parametrize("site", sorted(integ.FLASH_NAME_SITES))
def test_each_flash_name_site_is_adapted_for_cp_flash_only(site):
    mod = importlib.import_module(site)
    assert "cp_flash" in AttentionInterface._global_mapping
    assert site in integ.adapted_sites()
    check = mod.is_flash_attention_requested
    assert check(requested_attention_implementation="cp_flash") is False
    assert check(requested_attention_implementation="flash_attention_2") is True
    assert check(requested_attention_implementation="sdpa") is False


def test_construction_site_model_init_does_not_look_for_a_flash_package():
    # transformers.modeling_utils: without the adaptation, from_config raises "Could not find the
    # currently requested flash attention implementation at `cp_flash`"
    model = tiny_model("qwen3", "cp_flash")
    assert model.config._attn_implementation == "cp_flash"
    model.set_attn_implementation("eager")
    model.set_attn_implementation("cp_flash")
    assert model.config._attn_implementation == "cp_flash"


def _save_and_load(family, tmp_path, **cfg):
    model = tiny_model(family, "eager", **cfg)
    model.save_pretrained(tmp_path)
    auto = transformers.AutoModelForCausalLM
    loaded = auto.from_pretrained(tmp_path, attn_implementation="cp_flash", dtype=torch.float32).eval()
    return model, loaded


def test_from_pretrained_gpt_oss_keeps_cp_flash_and_fetches_no_kernel(tmp_path, monkeypatch):
    # transformers.modeling_utils also swaps "flash" names for gpt-oss's hub kernels
    import transformers.integrations.hub_kernels as hub

    def no_fetch(*a, **k):
        raise AssertionError("a hub kernel was requested")

    monkeypatch.setattr(hub, "load_and_register_attn_kernel", no_fetch, raising=False)
    eager, model = _save_and_load("gpt_oss", tmp_path)
    assert model.config._attn_implementation == "cp_flash"
    ids = torch.randint(3, 128, (2, 40))
    with torch.no_grad():
        assert (model(ids).logits - eager(ids).logits).abs().max() < 1e-4


def test_from_pretrained_llama4_beyond_one_chunk(tmp_path):
    # transformers.masking_utils: the chunked mask builder refuses flash names beyond one chunk
    eager, model = _save_and_load("llama4", tmp_path, chunk=8)
    ids = torch.randint(3, 128, (2, 29))
    with torch.no_grad():
        err = (model(ids).logits - eager(ids).logits).abs().max()
    assert err < 1e-4


GENERATE_FAMILIES = [(f, dict(chunk=8) if f == "llama4" else dict(window=6)) for f in FAMILIES if is_causal_lm(f)]


def _generate_both(family, cfg, ids, **kw):
    """(tokens, logits) of greedy generate under eager and under cp_flash, same weights."""
    kw = dict(max_new_tokens=kw.pop("max_new_tokens", 20), do_sample=False, output_logits=True,
              return_dict_in_generate=True, **kw)
    out = [tiny_model(family, impl, **cfg).generate(ids, **kw) for impl in ("eager", "cp_flash")]
    return [o.sequences for o in out], [torch.stack(o.logits) for o in out]


@pytest.mark.parametrize("family,cfg", GENERATE_FAMILIES)
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_matches_eager(family, cfg, cache):
    # queries after cached keys, sliding-window caches that drop keys, chunks; static caches go
    # through transformers.generation.utils' flash-name branch, and families with one mask type
    # (Mistral, Phi-3) hand the prepared CPMask back to transformers' mask builders
    tokens, logits = _generate_both(family, cfg, torch.randint(3, 128, (1, 13)), cache_implementation=cache)
    assert torch.equal(*tokens)
    assert (logits[0] - logits[1]).abs().max() < 1e-4


@pytest.mark.parametrize("family,cfg", [("qwen3", dict(window=6)), ("mistral", dict(window=6)), ("phi3", {})])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_with_left_padding_matches_eager(family, cfg, cache):
    ids = torch.randint(3, 128, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :5] = 0
    ids[1, :5] = 0
    tokens, logits = _generate_both(family, cfg, ids, max_new_tokens=12, attention_mask=mask, pad_token_id=0,
                                    cache_implementation=cache)
    assert torch.equal(*tokens)
    assert (logits[0] - logits[1]).abs().max() < 1e-4


def test_padding_mask_single_device_matches_eager_on_real_tokens():
    eager = tiny_model("qwen3", "eager", window=6)
    model = tiny_model("qwen3", "cp_flash", window=6)
    ids = torch.randint(3, 128, (2, 20))
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[0, :4] = 0
    mask[1, 15:] = 0
    with torch.no_grad():
        a = model(ids, attention_mask=mask).logits
        b = eager(ids, attention_mask=mask).logits
    real = mask.bool()
    assert (a - b)[real].abs().max() < 1e-4


def test_mask_function_returns_linear_size_metadata():
    info = integ.cp_flash_mask(batch_size=2, q_length=4096, kv_length=4096,
                               attention_mask=torch.ones(2, 4096, dtype=torch.bool))
    assert isinstance(info, integ.CPMask)
    sizes = [t.numel() for t in (info.valid, info.opens) if t is not None]
    assert all(n <= 2 * 4096 for n in sizes)


def test_unsupported_inputs_raise_clear_errors():
    model = tiny_model("qwen3", "cp_flash")
    ids = torch.randint(3, 128, (1, 10))
    dense = torch.ones(1, 1, 10, 10, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"cp_flash received a dense \(1, 1, 10, 10\) attention_mask") as info:
        model.model.layers[0].self_attn(model.model.embed_tokens(ids),
                                        model.model.rotary_emb(model.model.embed_tokens(ids),
                                                               torch.arange(10)[None]),
                                        attention_mask=dense)
    assert isinstance(info.value, NotImplementedError)  # also a refusal (a family that builds dense masks: BLT)
    cfg = tiny_config("qwen3")
    cfg.attention_dropout = 0.1
    train = tiny_model("qwen3", "cp_flash", config=cfg).train()
    with pytest.raises(NotImplementedError, match="attention dropout"):
        train(ids)


# ---------------------------------------------------------------------------------------------
# under context parallelism: one spawn of 3 ranks checks every case (spawning is the slow part)


def _cp_errors(found):
    model = tiny_model("qwen3", "cp_flash")
    ids = torch.randint(3, 128, (1, 16), generator=torch.Generator().manual_seed(0))
    with cp_attention.context_parallel() as cp:
        try:
            model(input_ids=cp.shard(ids))
        except ValueError as e:
            found["no_shard_batch"] = str(e)
        batch = cp.shard_batch(input_ids=ids)
        mask = torch.ones(1, 16, dtype=torch.long)
        mask[0, :3] = 0
        for key, extra in (("padding_not_recorded", dict(attention_mask=cp.shard(mask))),
                           ("cu_seq_lens", dict(cu_seq_lens_q=torch.tensor([0, 16]), cu_seq_lens_k=torch.tensor([0, 16])))):
            try:
                with torch.no_grad():
                    model(**batch, **extra, use_cache=False)
            except ValueError as e:
                found[key] = str(e)
        with torch.no_grad():
            out = model(**batch, use_cache=True)
        try:
            with torch.no_grad():
                model(input_ids=batch["input_ids"][:, -1:], past_key_values=out.past_key_values)
        except ValueError as e:
            found["kv_cache"] = str(e)


def _llama4_temperature(layout):
    config = tiny_config("llama4", chunk=8)
    config.floor_scale = 4  # the NoPE temperature changes every 4 positions: shards see other values
    model = tiny_model("llama4", "cp_flash", config=config)
    eager = tiny_model("llama4", "eager", config=config)
    ids = torch.randint(3, 128, (2, 45), generator=torch.Generator().manual_seed(1))
    with cp_attention.context_parallel(layout=layout) as cp:
        with torch.no_grad():
            logits = cp.gather(model(**cp.shard_batch(input_ids=ids), use_cache=False).logits)
    with torch.no_grad():
        ref = eager(ids, use_cache=False).logits
    return (logits - ref).abs().max().item()


def _padding(layout):
    model = tiny_model("qwen3", "cp_flash", window=5)
    eager = tiny_model("qwen3", "eager", window=5)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 128, (2, 33), generator=gen)
    mask = torch.ones(2, 33, dtype=torch.long)
    mask[0, :7] = 0   # left padding
    mask[1, 26:] = 0  # right padding
    with cp_attention.context_parallel(layout=layout) as cp:
        with torch.no_grad():
            logits = cp.gather(model(**cp.shard_batch(input_ids=ids, attention_mask=mask), use_cache=False).logits)
    with torch.no_grad():
        ref = eager(ids, attention_mask=mask, use_cache=False).logits
    return (logits - ref)[mask.bool()].abs().max().item()


def _cp_worker(rank, world_size):
    found = {}
    _cp_errors(found)
    for layout in ("zigzag", "contiguous"):
        found[f"llama4_temperature/{layout}"] = _llama4_temperature(layout)
        found[f"padding/{layout}"] = _padding(layout)
    return found


@pytest.fixture(scope="module")
def cp_results():
    return run_ranks(3, _cp_worker, timeout=600)


def test_cp_errors_no_shard_batch_and_filled_kv_cache(cp_results):
    for found in cp_results:
        assert "cp.shard_batch" in found["no_shard_batch"]
        assert "KV cache that context parallelism did not shard" in found["kv_cache"]
        assert "did not see" in found["padding_not_recorded"]  # "rank 0 rejected its inputs: ..." elsewhere
        assert "cu_seq_lens_* are not used under context parallelism" in found["cu_seq_lens"]


def test_packed_documents_after_a_kv_cache_raise():
    model = tiny_model("qwen3", "cp_flash")
    ids = torch.randint(3, 128, (1, 10))
    with torch.no_grad():
        out = model(ids, use_cache=True)
        with pytest.raises(ValueError, match="restarting position_ids"):
            model(torch.randint(3, 128, (1, 4)), past_key_values=out.past_key_values,
                  position_ids=torch.tensor([[10, 11, 0, 1]]))


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_llama4_temperature_uses_global_positions_under_cp(cp_results, layout):
    errs = [found[f"llama4_temperature/{layout}"] for found in cp_results]
    assert max(errs) < 1e-4, errs


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_padding_under_cp_matches_single_device(cp_results, layout):
    errs = [found[f"padding/{layout}"] for found in cp_results]
    assert max(errs) < 1e-4, errs
