"""model.generate inside context_parallel (issue 40, work in progress): the prompt sharded by the layout, each
rank's KV cache holding its own tokens, decode steps merged over the ranks. Against the same weights under
eager on one process: the same tokens, step logits within 1e-5 (float32), for a causal (Qwen3), a
sliding-window + sinks (gpt-oss), a chunked (Llama 4), an MLA (DeepSeek-V3) and a gated-DeltaNet hybrid
(Qwen3-Next) tiny model; sampled generation with one seed; two left-padded rows; each rank's KV cache
about 1/P of one device's."""

from __future__ import annotations

import inspect

import pytest
import torch

import cp_attention
from cp_attention.tools.launch import run_ranks
from cp_attention.tools.sweeps import configs as sweep_configs
from cp_attention.tools.tiny_models import tiny_config, tiny_model

pytestmark = [pytest.mark.multirank, pytest.mark.transformers]

FAMILIES = ("qwen3", "gpt_oss", "llama4", "deepseek_v3", "qwen3_next")
N, NEW = 400, 32


def _model(family: str, impl: str):
    torch.manual_seed(0)
    if family in ("qwen3", "gpt_oss", "llama4"):
        return tiny_model(family, impl, config=tiny_config(family)).eval()
    return sweep_configs.build_model(sweep_configs.tiny_config(family), impl).eval()


def _inputs(padded: bool):
    B = 2 if padded else 1
    ids = torch.randint(3, 100, (B, N), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(B, N, dtype=torch.long)
    if padded:
        mask[1, :37], ids[1, :37] = 0, 0
    return ids, mask


def _windowed(layer) -> bool:
    return bool(getattr(layer, "is_sliding", False) or getattr(layer, "window", None) or getattr(layer, "chunk", None))


def _cache_bytes(cache, windowed: bool = False) -> int:
    """Bytes of the K/V an attention cache holds in its full layers (``windowed``: its sliding-window and
    chunked layers instead); its mixers' states left out."""
    total = 0
    for layer in cache.layers:
        if _windowed(layer) != windowed:
            continue
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


MODES = {"greedy": {}, "sample": dict(do_sample=True), "beams": dict(num_beams=2),
         "lookup": dict(prompt_lookup_num_tokens=3)}  # lookup: candidates verified, rejected ones cropped


def _generate_cache(model, padded: bool, mode: str, prompt: int = N):
    ids, mask = _inputs(padded)
    ids, mask = ids[:, -prompt:], mask[:, -prompt:]
    torch.manual_seed(7)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True, **{"do_sample": False, **MODES[mode]})
    return out


def _worker(rank, world_size, cases):
    torch.set_num_threads(1)
    results = []
    for family, padded, mode in cases:
        model = _model(family, "cp_flash")
        with cp_attention.context_parallel(layout="zigzag") as cp:
            calls = []
            gather = cp.comm.all_gather
            cp.comm.all_gather = lambda t, what="": (calls.append(what), gather(t, what))[1]
            out = _generate_cache(model, padded, mode)  # decode forwards: every new token but the first
            per_token = sum(1 for c in calls if "decode step" in c) / (out.sequences.shape[1] - N - 1)
            per_token_half = per_token
            if mode in ("greedy", "sample"):  # one forward per token (lookup verifies several at once)
                calls.clear()
                half = _generate_cache(model, padded, mode, prompt=N // 2)  # a prompt half as long
                per_token_half = sum(1 for c in calls if "decode step" in c) / (half.sequences.shape[1] - N // 2 - 1)
            cp.comm.all_gather = gather
        results.append((out.sequences[:, N:].tolist(), torch.stack(out.logits).numpy(),
                        (_cache_bytes(out.past_key_values), _cache_bytes(out.past_key_values, True)), per_token,
                        per_token_half))
    return results


CASES = [(f, False, "greedy") for f in FAMILIES] + [("qwen3", True, "greedy"), ("gpt_oss", True, "sample"),
                                                    ("llama4", True, "greedy"),  # chunks count from a row's start
                                                    ("qwen3", False, "sample"), ("gpt_oss", False, "beams"),
                                                    ("gpt_oss", False, "lookup")]


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_generate_equals_one_device(world_size):
    """Tokens and step logits; each rank's K/V bytes in full-attention layers at most 1/P of one device's plus
    one decode block of 16 tokens (in windowed layers at most one device's window over all ranks); the decode
    step's collectives per token the same for a prompt half as long (one all-gather per attention layer)."""
    wants = []
    for family, padded, mode in CASES:
        model = _model(family, "eager")
        out = _generate_cache(model, padded, mode)
        full = [layer for layer in out.past_key_values.layers
                if getattr(layer, "keys", None) is not None and not _windowed(layer)]
        block = sum(layer.keys[:, :, :16].numel() * layer.keys.element_size() * 2 for layer in full)  # K and V
        token = sum(layer.keys[:, :, :1].numel() * layer.keys.element_size() * 2 for layer in out.past_key_values.layers
                    if getattr(layer, "keys", None) is not None and _windowed(layer))
        wants.append((out.sequences[:, N:].tolist(), torch.stack(out.logits),
                      (_cache_bytes(out.past_key_values), _cache_bytes(out.past_key_values, True)), block, token))
    per_rank = run_ranks(world_size, _worker, CASES, timeout=900)
    for i, case in enumerate(CASES):  # windowed layers, over all ranks: one device's window (and the key of the
        windowed = sum(results[i][2][1] for results in per_rank)  # step's first query it still holds)
        assert windowed <= wants[i][2][1] + wants[i][4], (case, windowed, wants[i][2][1])
    for rank, results in enumerate(per_rank):
        for case, got, want in zip(CASES, results, wants):
            tokens, logits, cache_bytes, per_token, per_token_half = got
            want_tokens, want_logits, want_bytes, block_bytes, _ = want
            assert tokens == want_tokens, (rank, case)
            err = float((torch.as_tensor(logits) - want_logits).abs().max())
            assert err <= 1e-5, (rank, case, err)
            # full layers: 1/P of one device's and one decode block; windowed layers: at most one device's window
            assert cache_bytes[0] <= want_bytes[0] / world_size + block_bytes, (rank, case, cache_bytes, want_bytes)
            assert cache_bytes[1] <= want_bytes[1], (rank, case, cache_bytes, want_bytes)
            assert per_token == per_token_half and per_token > 0, (rank, case, per_token, per_token_half)


def _refusal(call) -> str:
    try:
        call()
    except (NotImplementedError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return "ran"


def _refusals_worker(rank, world_size):
    from transformers import DynamicCache

    torch.set_num_threads(1)
    ids = torch.randint(3, 100, (1, 48), generator=torch.Generator().manual_seed(1))
    qwen3 = _model("qwen3", "cp_flash")
    minimax = _model("minimax", "cp_flash")
    dsa = _model("deepseek_v32", "cp_flash")

    def generate(model, prompt=ids, **kw):
        with torch.no_grad():
            return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, pad_token_id=0,
                                  **{"do_sample": False, **kw})

    def sampled_per_rank():
        torch.manual_seed(rank)  # each rank its own seed: the ranks draw from rank 0's random state
        return generate(qwen3, do_sample=True, top_k=0).tolist()

    def greedy_apart():  # a rank-dependent logits processor: rank 1 never picks the token rank 0 picks
        first = generate(qwen3)[0, 48:].tolist()
        return generate(qwen3, suppress_tokens=first[:1] if rank == 1 else None)

    def compiled():
        with torch.no_grad():
            torch.compile(qwen3)(input_ids=ids, past_key_values=DynamicCache(config=qwen3.config), use_cache=True)

    found = {}
    with cp_attention.context_parallel(layout="zigzag"):
        found["static"] = _refusal(lambda: generate(qwen3, cache_implementation="static"))
        found["prompts"] = _refusal(lambda: generate(qwen3, prompt=ids + rank))
        found["seeds"] = sampled_per_rank()
        found["apart"] = _refusal(greedy_apart)
        found["lengths"] = _refusal(lambda: generate(qwen3, prompt=ids[:, :40 + 8 * rank]))
        found["no_config"] = generate(qwen3, past_key_values=DynamicCache()).tolist()  # its layers made here
        found["own_cache"] = _refusal(lambda: generate(minimax))
        found["selection"] = _refusal(lambda: generate(dsa))
        found["compiled"] = _refusal(compiled)
        found["no_cache"] = _refusal(lambda: generate(qwen3, use_cache=False))
        found["after"] = generate(qwen3).tolist()  # the block still generates after every refusal
    return found


def test_generate_refusals():
    """What generation under context parallelism refuses, on every rank, before it decodes a wrong token: a
    static cache, ranks handed different prompts (or of different lengths) or picking different tokens (a
    rank-dependent logits processor), a model building its own cache class (MiniMax), selected keys
    (DeepSeek-V3.2), a compiled forward with a cache, generate(use_cache=False) (a message that says what to do). Ranks seeded differently sample rank 0's draw (the
    random state is rank 0's from the prefill on); a DynamicCache() built without a config is sharded too."""
    eager, ids = _model("qwen3", "eager"), torch.randint(3, 100, (1, 48), generator=torch.Generator().manual_seed(1))
    want = eager.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0).tolist()
    torch.manual_seed(0)
    seeded = eager.generate(ids, max_new_tokens=8, do_sample=True, top_k=0, pad_token_id=0).tolist()
    for found in run_ranks(2, _refusals_worker, timeout=600):
        assert found["static"].startswith("NotImplementedError: cp_flash: generation under context parallelism "
                                          "shards transformers' dynamic cache") and "a Static" in found["static"]
        assert found["prompts"].startswith("ValueError: cp_flash: the ranks of the context-parallel group were "
                                           "handed different tokens for the prompt"), found["prompts"]
        assert found["seeds"] == seeded  # rank 0's draw, on every rank
        assert "different tokens for a decode step's tokens" in found["apart"], found["apart"]
        assert "different tokens for the prompt" in found["lengths"], found["lengths"]
        assert found["no_config"] == want
        assert "MiniMaxForCausalLM builds a cache of its own class" in found["own_cache"], found["own_cache"]
        assert "deepseek_v32 selects keys per query over a KV cache" in found["selection"], found["selection"]
        assert "was called compiled with a KV cache under context parallelism" in found["compiled"], found["compiled"]
        assert "generate(use_cache=False) inside the block ends here too" in found["no_cache"], found["no_cache"]
        assert "generate with its cache (use_cache=True, the default" in found["no_cache"], found["no_cache"]
        assert found["after"] == want


CACHES = (("jamba", 96), ("nemotron_h", 96), ("falcon_h1", 96), ("qwen3_5", 96), ("mamba", 96),
          ("recurrent_gemma", 96), ("mamba2", 10), ("zamba2", 10), ("gemma4_shared_kv", 48))
"""(family, prompt): Mamba / gated DeltaNet / RG-LRU states beside K/V (Falcon-H1: both in one cache layer;
RecurrentGemma: kept on its modules), prompts whose last rank's run is shorter than a convolution (zigzag at
P = 2: runs of 2 or 3 tokens), and Gemma 4's layers reusing an earlier layer's K/V."""


def _cache_model(family: str, impl: str):
    if family != "gemma4_shared_kv":
        return _model(family, impl)
    config = sweep_configs.tiny_config("gemma4_text").to_dict()
    config.update(num_hidden_layers=6, num_kv_shared_layers=2, layer_types=["sliding_attention"] * 3 + [
        "full_attention", "sliding_attention", "full_attention"])
    config.pop("kv_sharing_modes", None)
    torch.manual_seed(0)
    return sweep_configs.build_model(type(sweep_configs.tiny_config("gemma4_text"))(**config), impl).eval()


def _short(model, prompt: int):
    ids = torch.randint(3, 100, (1, prompt), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[:, prompt:].tolist(), torch.stack(out.logits).numpy()


def _own_cache_class(model) -> bool:
    """A model whose forward builds a cache of its own class (transformers 5.17's MambaCache, passed as
    ``cache_params``): its generate under context parallelism is refused before its prefill."""
    return "cache_params" in inspect.signature(type(model).forward).parameters


def _caches_worker(rank, world_size):
    torch.set_num_threads(1)
    out = []
    with cp_attention.context_parallel(layout="zigzag"):  # loaded inside the block: cp_flash registers there
        for family, prompt in CACHES:
            model = _cache_model(family, "cp_flash")
            if _own_cache_class(model):
                with pytest.raises(NotImplementedError) as info:
                    _short(model, prompt)
                out.append(("refused", str(info.value)))
            else:
                out.append(_short(model, prompt))
    return out


def test_mixer_states_and_shared_kv_generate_equal_one_device():
    """After the prefill every rank decodes from the sequence's mixer states: a recurrent state from the rank
    holding the prompt's last token, a convolution's last inputs each from the rank holding it; a layer
    reusing another's K/V attends over that layer's shard. Greedy tokens equal one device's, step logits
    within 1e-5. A model building a cache of its own class (Mamba on transformers 5.17) is refused."""
    wants = [_short(_cache_model(family, "eager"), prompt) for family, prompt in CACHES]
    for results in run_ranks(2, _caches_worker, timeout=600):
        for case, (tokens, logits), (want_tokens, want_logits) in zip(CACHES, results, wants):
            if tokens == "refused":  # a cache class of the model's own (5.17's Mamba): refused, never a wrong token
                assert "builds a cache of its own class" in logits, (case, logits)
                continue
            assert tokens == want_tokens, case
            err = float(abs(logits - want_logits).max())
            assert err <= 1e-5, (case, err)
