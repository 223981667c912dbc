"""An ordinary transformers Trainer script, trained under context parallelism with two changed lines.

    torchrun --nproc_per_node=2 examples/train_trainer.py --out /tmp/cp      # CPTrainer, cp_flash, CP = 2
    python examples/train_trainer.py --single --out /tmp/single               # plain Trainer, eager, 1 process

The data: random documents of 5-60 tokens packed by transformers' ``DataCollatorWithFlattening``
(padding-free, one row per micro-batch); the model: a tiny random Mistral with a sliding window of
8 tokens on every layer (``--model qwen2_moe``: a tiny Qwen2-MoE with its router's load-balancing loss,
weight 0.5; ``--peft lora|dora``: a PEFT adapter trained on it), gradient checkpointing on. The lines
that differ from a plain Trainer script are marked ``# CP``. With ``--single`` the same data trains on one process with
``attn_implementation="eager"`` and a per-device batch of ``--batch x --world`` samples (the
global batch of the CP run). Each run writes ``losses.json`` (Trainer's logged loss per step) and
``params.pt`` (the final weights, ``initial.pt`` the first) to ``--out``; the two runs match to float32 rounding.

``--head sequence|qa`` trains a head that reads one output per row instead: a Mistral sequence classifier
(3 classes, pooled at each row's last non-padding token, rows of 5-60 tokens padded on the right, ``--left``:
on the left) or a question-answering head (start/end positions into windows of 48 tokens); the group's rows
stay rows and each is sharded along the sequence.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

from cp_attention.integrations.trainers import CPTrainer  # CP
from cp_attention.tools.launch import leave_together
from cp_attention.tools.tiny_models import tiny_config, tiny_model


def dataset(n: int = 32, seed: int = 0, vocab: int = 128) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, vocab, (int(torch.randint(5, 61, (1,), generator=g)),), generator=g).tolist()
        out.append({"input_ids": ids, "labels": ids})
    return out


def row_dataset(head: str, n: int = 32, seed: int = 1, vocab: int = 128) -> list[dict]:
    """Rows with one target per row: 5-60 tokens and a class in 0..2 (``head="sequence"``), or windows
    of 48 tokens and a span's start and end positions (``"qa"``: a span loss is a softmax over every
    position, so its rows carry no padding)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(5, 61, (1,), generator=g)) if head == "sequence" else 48
        row = {"input_ids": torch.randint(3, vocab, (length,), generator=g).tolist()}
        if head == "sequence":
            row["labels"] = int(torch.randint(0, 3, (1,), generator=g))
        else:
            start = int(torch.randint(0, length, (1,), generator=g))
            row["start_positions"] = start
            row["end_positions"] = int(torch.randint(start, length, (1,), generator=g))
        out.append(row)
    return out


class PadRows:
    """Pads a list of rows to the longest with token 0 (on the right, or the left), with their
    ``attention_mask``; the per-row targets become (B,) tensors."""

    def __init__(self, left: bool = False):
        self.left = left

    def __call__(self, rows: list[dict]) -> dict:
        width = max(len(r["input_ids"]) for r in rows)
        ids, mask = torch.zeros(len(rows), width, dtype=torch.int64), torch.zeros(len(rows), width, dtype=torch.int64)
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            at = slice(width - n, width) if self.left else slice(0, n)
            ids[i, at], mask[i, at] = torch.tensor(r["input_ids"]), 1
        out = {"input_ids": ids, "attention_mask": mask}
        for key in ("labels", "start_positions", "end_positions"):
            if key in rows[0]:
                out[key] = torch.tensor([r[key] for r in rows])
        return out


def head_model(head: str, implementation: str):
    """A tiny Mistral (sliding window of 8 tokens) with a sequence-classification (3 classes) or QA head."""
    import transformers as tf

    config = tiny_config("mistral", window=8)
    config.num_labels = 3
    cls = tf.MistralForSequenceClassification if head == "sequence" else tf.MistralForQuestionAnswering
    torch.manual_seed(0)
    return cls._from_config(config, attn_implementation=implementation, dtype=torch.float32)


def lora(kind: str):
    """A LoRA (``kind="dora"``: DoRA) config over the attention and MLP projections, its B matrices
    initialised at random (PEFT's default zeros would make the first steps' adapters no-ops)."""
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, use_dora=kind == "dora", init_lora_weights="gaussian",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder for losses.json and params.pt")
    parser.add_argument("--single", action="store_true", help="plain Trainer on one process, eager attention")
    parser.add_argument("--batch", type=int, default=2, help="per-device batch of the CP run (samples)")
    parser.add_argument("--world", type=int, default=2, help="with --single: the CP run's process count")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--reentrant", action="store_true", help="reentrant gradient checkpointing")
    parser.add_argument("--peft", default="", choices=("", "lora", "dora"),
                        help="train a PEFT adapter (LoRA or DoRA on the attention and MLP projections) instead")
    parser.add_argument("--model", default="mistral", choices=("mistral", "qwen2_moe"),
                        help="the tiny model: Mistral, or Qwen2-MoE trained with its router auxiliary loss (weight 0.5)")
    parser.add_argument("--head", default="", choices=("", "sequence", "qa"),
                        help="train a sequence-classification or question-answering head on padded rows instead")
    parser.add_argument("--left", action="store_true", help="with --head: rows padded on the left")
    parser.add_argument("--accumulation", type=int, default=1, help="gradient accumulation steps")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    config = tiny_config(args.model, window=8)
    if args.model == "qwen2_moe":  # the router's load-balancing loss in the model's loss
        config.output_router_logits, config.router_aux_loss_coef = True, 0.5
    implementation = "eager" if args.single else "cp_flash"  # CP
    if args.head:
        model = head_model(args.head, implementation)
    else:
        model = tiny_model(args.model, implementation, seed=0, config=config)
    if args.peft:
        from peft import get_peft_model

        model = get_peft_model(model, lora(args.peft))
    training_args = TrainingArguments(
        output_dir=args.out, per_device_train_batch_size=args.batch * (args.world if args.single else 1),
        max_steps=args.steps, gradient_accumulation_steps=args.accumulation, learning_rate=0.5, optim="sgd",
        lr_scheduler_type="constant",
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
        gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": args.reentrant},
        dataloader_drop_last=True, ddp_backend=None if args.single else "gloo",
        # the same batches in both runs (transformers >= 5.24; older releases sample at random)
        **({"train_sampling_strategy": "sequential"} if "train_sampling_strategy" in TrainingArguments.__dataclass_fields__
           else {}))
    trainer_class = Trainer if args.single else CPTrainer  # CP
    trainer = trainer_class(model=model, args=training_args,
                            train_dataset=row_dataset(args.head) if args.head else dataset(),
                            data_collator=PadRows(args.left) if args.head else DataCollatorWithFlattening())
    if int(os.environ.get("RANK", 0)) == 0:  # the weights before training: training must move them
        torch.save({k: v.detach().cpu().clone() for k, v in trainer.model.state_dict().items()},
                   os.path.join(args.out, "initial.pt"))
    trainer.train()
    if int(os.environ.get("RANK", 0)) == 0:
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        with open(os.path.join(args.out, "losses.json"), "w") as f:
            json.dump(losses, f)
        torch.save({k: v.detach().cpu() for k, v in trainer.model.state_dict().items()},
                   os.path.join(args.out, "params.pt"))
    leave_together()  # torchrun hygiene: the ranks leave together, past the interpreter's teardown of gloo


if __name__ == "__main__":
    main()
