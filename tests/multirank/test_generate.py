"""model.generate inside context_parallel (issue 40, work in progress): the prompt sharded by the layout, each
rank's KV cache holding its own tokens, decode steps merged over the ranks. Against the same weights under
eager on one process: the same tokens, step logits within 1e-5 (float32), for a causal (Qwen3), a
sliding-window + sinks (gpt-oss), a chunked (Llama 4), an MLA (DeepSeek-V3) and a gated-DeltaNet hybrid
(Qwen3-Next) tiny model; sampled generation with one seed; two left-padded rows; each rank's KV cache
about 1/P of one device's."""

from __future__ import annotations

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


def _generate(model, padded: bool, sample: bool):
    ids, mask = _inputs(padded)
    torch.manual_seed(7)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=sample, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences[:, N:], torch.stack(out.logits)


def _worker(rank, world_size, cases):
    torch.set_num_threads(1)
    results = []
    for family, padded, sample in cases:
        model = _model(family, "cp_flash")
        with cp_attention.context_parallel(layout="zigzag") as cp:
            tokens, logits = _generate(model, padded, sample)
            cache_bytes = None
        results.append((tokens.tolist(), logits.numpy(), cache_bytes))
    return results


CASES = [(f, False, False) for f in FAMILIES] + [("qwen3", True, False), ("gpt_oss", True, True), ("qwen3", False, True)]


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_generate_equals_one_device(world_size):
    wants = []
    for family, padded, sample in CASES:
        tokens, logits = _generate(_model(family, "eager"), padded, sample)
        wants.append((tokens.tolist(), logits))
    per_rank = run_ranks(world_size, _worker, CASES, timeout=900)
    for rank, results in enumerate(per_rank):
        for case, (tokens, logits, _), (want_tokens, want_logits) in zip(CASES, results, wants):
            assert tokens == want_tokens, (rank, case)
            err = float((torch.as_tensor(logits) - want_logits).abs().max())
            assert err <= 1e-5, (rank, case, err)
