"""PEFT models under context parallelism: the weight adapters (LoRA, DoRA, IA3) exact through the bare API
with ``cp.shard_batch(..., model=peft_model)`` (the trainers: tests/integrations/test_training.py and
tests/integrations/test_trl.py), prompt learning refused naming its PEFT type.

Ground truth: the same PEFT model (same seed) with eager attention on one process, full batch."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")

from cp_attention.tools.launch import run_ranks  # noqa: E402
from cp_attention.tools.tiny_models import tiny_model  # noqa: E402

pytestmark = [pytest.mark.multirank, pytest.mark.transformers]  # spawns gloo ranks; builds transformers models

L = 48


def _peft_model(kind: str, impl: str):
    from peft import IA3Config, LoraConfig, PrefixTuningConfig, PromptTuningConfig, get_peft_model

    model = tiny_model("mistral", impl, seed=0, window=8).train()
    if kind == "prompt":
        config = PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    elif kind == "prefix":
        config = PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    elif kind == "ia3":
        config = IA3Config(task_type="CAUSAL_LM", target_modules=["k_proj", "v_proj", "down_proj"],
                           feedforward_modules=["down_proj"], init_ia3_weights=False)
    else:
        config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, use_dora=kind == "dora", init_lora_weights="gaussian",
                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    torch.manual_seed(1)
    return get_peft_model(model, config)


def _batch() -> dict:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 128, (1, L), generator=g)
    positions = torch.cat([torch.arange(20), torch.arange(28)])[None]  # two packed documents
    labels = ids.clone()
    labels[0, 20] = -100  # as DataCollatorWithFlattening: no token predicts the next document's first
    return dict(input_ids=ids, labels=labels, position_ids=positions)


def _trained(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for n, p in model.named_parameters() if p.requires_grad])


def _reference(kind: str):
    model = _peft_model(kind, "eager")
    full = _batch()
    docs = [(0, 20), (20, 48)]  # eager sees the packed row as one sequence: run each document alone
    loss_sum, count = 0.0, 0
    for s, e in docs:
        out = model(input_ids=full["input_ids"][:, s:e], labels=full["labels"][:, s:e], use_cache=False)
        n = e - s - 1
        (out.loss * n).backward()
        loss_sum, count = loss_sum + float(out.loss.detach()) * n, count + n
    return loss_sum / count, _trained(model) / count


def _worker(rank: int, world_size: int, kinds):
    import cp_attention

    out = {}
    for kind in kinds:
        model = _peft_model(kind, "cp_flash")
        with cp_attention.context_parallel() as cp:
            loss = model(**cp.shard_batch(**_batch(), model=model), use_cache=False).loss
        loss.backward()
        out[kind] = (float(loss.detach()), _trained(model).numpy())
    return out


def test_weight_adapters_exact_under_cp():
    """LoRA, DoRA and IA3: mean over ranks of the loss and of the adapters' gradients equal one device."""
    kinds = ("lora", "dora", "ia3")
    refs = {k: _reference(k) for k in kinds}
    per_rank = run_ranks(2, _worker, kinds, timeout=600)
    for kind in kinds:
        loss = sum(r[kind][0] for r in per_rank) / 2
        grads = sum(torch.from_numpy(r[kind][1]) for r in per_rank) / 2
        ref_loss, ref_grads = refs[kind]
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (kind, loss, ref_loss)
        assert float((grads - ref_grads).abs().max()) <= 1e-5 * float(ref_grads.abs().max()), kind


@pytest.mark.parametrize("kind, name", [("prompt", "PROMPT_TUNING"), ("prefix", "PREFIX_TUNING")])
def test_prompt_learning_refused_by_name(tmp_path, kind, name):
    """Prompt and prefix tuning: shard_batch(model=) and CPTrainer refuse them naming the PEFT type."""
    import cp_attention
    from transformers import TrainingArguments

    from cp_attention.integrations.trainers.trainer import CPTrainer

    model = _peft_model(kind, "cp_flash")
    with cp_attention.context_parallel() as cp:
        with pytest.raises(NotImplementedError, match=f"PEFT {name} adds 4 virtual tokens"):
            cp.shard_batch(**_batch(), model=model)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=1,
                             per_device_train_batch_size=1)
    with pytest.raises(NotImplementedError, match=f"PEFT {name}"):  # at construction, before any step
        CPTrainer(model=model, args=args, train_dataset=[{"input_ids": [3, 4, 5], "labels": [3, 4, 5]}])
