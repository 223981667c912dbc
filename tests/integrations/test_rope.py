"""RoPE that depends on the sequence length, under context parallelism (issue 33).

* Which rotary modules depend on the length: for every rope type of transformers' rope registry, a
  rotary module is computed twice, on positions 0..3 alone and with a far position appended; its rows
  for 0..3 change exactly when :func:`~cp_attention.integrations.hf.adapters.rope.length_dependent` says so (the
  oracle is the module's own output, not the rule). A type added to the registry without parameters
  here fails the test, so the rule cannot silently fall behind the registry.
* Phi-3 ``longrope``, Phi-MoE ``longrope`` (its own length-dependent attention scale) and Llama
  ``dynamic`` NTK at CP = 2 (zigzag: the shards' largest positions are 63 and 47) and CP = 4
  (contiguous), on a batch longer than the original context, against one-device eager: logits and
  gradients. Planted: every rank reading its own shard's length, they differ.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cp_attention
from cp_attention.integrations.hf.adapters import rope
from cp_attention.tools.launch import run_ranks

from hf_cases import TOL, grad_tol

pytestmark = [pytest.mark.multirank, pytest.mark.transformers]  # spawns gloo ranks; builds transformers models

VOCAB, L, ORIGINAL = 128, 64, 56  # the zigzag shards of 64 tokens at CP = 2 reach 63 and 47: either side of 56
HALF = 8  # rotary dimension / 2 (head_dim 16)

# rope parameters per registered type (a new type needs its entry here)
RECIPES = {
    "default": {},
    "linear": {"factor": 2.0},
    "dynamic": {"factor": 2.0},
    "yarn": {"factor": 2.0, "original_max_position_embeddings": 16},
    "longrope": {"short_factor": [1.0] * HALF, "long_factor": [1.0 + i / 2 for i in range(HALF)],
                 "original_max_position_embeddings": 16},
    "llama3": {"factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "proportional": {"factor": 2.0},
}


def _llama_config(rope_type: str, **extra):
    from transformers import LlamaConfig

    params = {"rope_type": rope_type, "rope_theta": 10000.0, **RECIPES[rope_type], **extra.pop("rope", {})}
    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=32,
                       rope_parameters=params, **extra)


def _rows(module, positions: list[int]) -> torch.Tensor:
    x = torch.zeros(1, len(positions), 64)
    cos, sin = module(x, torch.tensor([positions]))
    return torch.cat([cos, sin], -1)[0, :4]


def test_registry_types_classified_by_what_they_compute():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    missing = sorted(set(ROPE_INIT_FUNCTIONS) - set(RECIPES))
    assert not missing, f"rope types without parameters in RECIPES (add them): {missing}"
    seen = {}
    for rope_type in ["default", *ROPE_INIT_FUNCTIONS]:
        config = _llama_config(rope_type)
        near = _rows(LlamaRotaryEmbedding(config), [0, 1, 2, 3])
        far = _rows(LlamaRotaryEmbedding(config), [0, 1, 2, 3, 4 * config.max_position_embeddings])
        depends = not torch.equal(near, far)
        seen[rope_type] = depends
        assert rope.length_dependent(LlamaRotaryEmbedding(config)) == depends, (rope_type, depends)
    assert seen["dynamic"] and seen["longrope"] and not seen["default"], seen  # the probe itself can tell


def test_phimoe_reads_the_length_itself():
    """Phi-MoE's rotary forward picks its attention scale from max(position_ids) in its own code."""
    module = _model("phimoe", "eager").model.rotary_emb
    assert rope.length_dependent(module)


# ----------------------------------------------------------------------------------------------
# under context parallelism


def _model(family: str, attn: str):
    torch.manual_seed(0)
    if family == "llama-dynamic":
        from transformers import LlamaForCausalLM

        config = _llama_config("dynamic", rope={"factor": 16.0})
        model = LlamaForCausalLM(config)
    elif family == "phi3":
        from transformers import Phi3Config, Phi3ForCausalLM

        config = Phi3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4 * ORIGINAL,
                            original_max_position_embeddings=ORIGINAL, pad_token_id=0,
                            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                             "short_factor": [1.0] * HALF,
                                             "long_factor": [1.0 + i / 2 for i in range(HALF)]})
        model = Phi3ForCausalLM(config)
    elif family == "phimoe":
        from transformers import PhimoeConfig, PhimoeForCausalLM

        config = PhimoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, num_local_experts=2,
                              num_experts_per_tok=2, max_position_embeddings=4 * ORIGINAL, router_jitter_noise=0.0,
                              input_jitter_noise=0.0,
                              rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                               "short_factor": [1.0] * HALF,
                                               "long_factor": [1.0 + i / 2 for i in range(HALF)],
                                               "short_mscale": 1.0, "long_mscale": 1.25,
                                               "original_max_position_embeddings": ORIGINAL})
        model = PhimoeForCausalLM(config)
    else:
        raise ValueError(family)
    model.config._attn_implementation = attn
    for module in model.modules():
        if hasattr(module, "config") and hasattr(module.config, "_attn_implementation"):
            module.config._attn_implementation = attn
    return model.float()


FAMILIES = ("phi3", "phimoe", "llama-dynamic")


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (2, L), generator=g)
    R = torch.randn(2, L, VOCAB, generator=g)
    return ids, R


def _flat_grads(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel())
                      for p in model.parameters()])


def _reference(family: str):
    model = _model(family, "eager")
    ids, R = _batch()
    out = model(input_ids=ids, use_cache=False)
    (out.logits * R).sum().backward()
    return out.logits.detach(), _flat_grads(model)


def _worker(rank, world_size, layout, plant):
    import torch.distributed as dist

    torch.set_num_threads(1)
    if plant:  # every rank reads its own shard's largest position
        rope._largest_position = lambda cp, position_ids: position_ids.amax()
    results = {}
    for family in FAMILIES:
        model = _model(family, "cp_flash")
        ids, R = _batch()
        with cp_attention.context_parallel(layout=layout) as cp:
            local = cp.shard_batch(input_ids=ids)
            out = model(**local, use_cache=False)
            (out.logits * cp.shard(R, dim=1)).sum().backward()
            logits = cp.gather(out.logits.detach(), dim=1)
        grads = _flat_grads(model)
        dist.all_reduce(grads)
        results[family] = (logits.numpy(), grads.numpy())
    # sharded by hand (no record of the full positions): the group's maximum of the shards' positions
    from cp_attention.masks import SequenceMeta

    model = _model("phi3", "cp_flash")
    ids, R = _batch()
    with cp_attention.context_parallel(layout=layout) as cp:
        local = {"input_ids": cp.shard(ids, dim=1), "position_ids": cp.shard(torch.arange(L).expand(2, L), dim=1)}
        cp.bind_batch(local, meta=SequenceMeta.from_inputs(2, L))
        out = model(**local, use_cache=False)
        (out.logits * cp.shard(R, dim=1)).sum().backward()
        logits = cp.gather(out.logits.detach(), dim=1)
    grads = _flat_grads(model)
    dist.all_reduce(grads)
    results["phi3 by hand"] = (logits.numpy(), grads.numpy())
    return results


@pytest.mark.parametrize("world_size, layout", [(2, "zigzag"), pytest.param(4, "contiguous", marks=pytest.mark.slow)])
def test_length_dependent_rope_under_cp(world_size, layout):
    refs = {family: _reference(family) for family in FAMILIES}
    for rank, results in enumerate(run_ranks(world_size, _worker, layout, False, timeout=600)):
        for family in (*FAMILIES, "phi3 by hand"):
            ref = refs[family.split()[0]]
            logits, grads = (torch.from_numpy(x) for x in results[family])
            err = (logits - ref[0]).abs().max().item()
            gerr = (grads - ref[1]).abs().max().item()
            assert err <= TOL and gerr <= grad_tol(ref[1].abs().max().item()), \
                (family, world_size, layout, rank, err, gerr)


def test_local_length_planted():
    refs = {family: _reference(family) for family in FAMILIES}
    results = run_ranks(2, _worker, "zigzag", True, timeout=600)[0]
    for family in (*FAMILIES, "phi3 by hand"):
        err = np.abs(results[family][0] - refs[family.split()[0]][0].numpy()).max()
        assert err > 1e-3, (family, err)


# ----------------------------------------------------------------------------------------------
# admitted by behaviour (issue 52): the hook's assumption checked on a copy of each rotary module


class _Stand:
    """Stand-ins of a length-dependent rotary (their forwards read ``position_ids.max()``): frequencies
    scaled once the row passes 16 tokens, by the row's largest position (what the hook assumes) or, planted,
    by the count of positions given."""

    def __init__(self, by_count: bool):
        self.by_count = by_count

    def cls(self):
        by_count = self.by_count

        class Rotary(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16),
                                     persistent=False)
                self.original_max_seq_len = 16

            def forward(self, x, position_ids):
                longest = position_ids.shape[-1] if by_count else int(position_ids.max()) + 1
                scale = max(1.0, longest / self.original_max_seq_len)
                freqs = position_ids[..., None].float() * (self.inv_freq / scale)
                emb = torch.cat([freqs, freqs], dim=-1)
                return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

        return Rotary


def test_the_rope_hook_admits_by_behaviour():
    """The families' length-dependent rotaries pass the check; of two stand-ins that read the largest
    position in their source, the one scaling by the largest passes and the one scaling by the count of
    positions (a rank would see its shard's count) is declined: not hooked, and the model check refuses it
    naming the transformers version and the class."""
    from cp_attention.integrations.hf.versions import transformers_version

    for family in FAMILIES:
        module = _model(family, "cp_flash").model.rotary_emb
        assert rope.length_dependent(module) and rope.rope_reason(module) is None, family
    good, planted = _Stand(False).cls()(), _Stand(True).cls()()
    assert rope.length_dependent(good) and rope.length_dependent(planted)
    assert rope.rope_reason(good) is None
    assert "differ from those of the whole row" in rope.rope_reason(planted)
    found = rope.rope_findings([("model.rotary_emb", planted), ("other", good)])
    assert [where for where, _ in found] == ["model.rotary_emb"]
    assert f"transformers {transformers_version()}" in found[0][1] and "Rotary" in found[0][1]
    rope.tag_ropes([("model.rotary_emb", planted), ("other", good)])
    assert not rope.hooked(planted) and rope.hooked(good)
    assert not planted._forward_pre_hooks and not planted._forward_hooks  # eager runs it untouched


def test_a_declined_rope_refuses_its_model():
    """A phi3 model whose rotary computes from the count of positions: the model check refuses it (before
    any layer runs), naming the version; its eager forward is untouched."""
    from cp_attention.integrations.hf.check import model_findings

    model = _model("phi3", "cp_flash")
    assert not [f for f in model_findings(model) if "rope" in f.what]
    planted = _model("phi3", "cp_flash")
    planted.model.rotary_emb = _Stand(True).cls()()
    found = [f for f in model_findings(planted) if "rope" in f.what]
    assert found and "does not compute its rows as cp_attention's rope hook assumes" in found[0].why, found
