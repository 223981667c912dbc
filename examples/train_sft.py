"""An ordinary TRL SFTTrainer script, trained under context parallelism with two changed lines.

    torchrun --nproc_per_node=2 examples/train_sft.py --out /tmp/cp      # CPSFTTrainer, cp_flash, CP = 2
    python examples/train_sft.py --single --out /tmp/single               # plain SFTTrainer, eager, 1 process

The data: random pre-tokenized documents of 5-60 tokens, packed by SFTTrainer (BFD packing into
rows of ``--max-length`` tokens; ``--no-packing``: documents as they are) and collated padding-free
(``padding_free=True``: one row of documents per micro-batch, told apart by ``position_ids``); the model: a tiny random Mistral with a
sliding window of 8 tokens on every layer (``--model qwen2_moe``: a tiny Qwen2-MoE, its router's load-balancing loss
weighted 0.5); gradient checkpointing and gradient accumulation
(``--accumulation`` micro-batches per optimizer step) on; SGD at a constant learning rate. The
lines that differ from a plain SFTTrainer script are marked ``# CP``. With ``--single`` the same
data trains on one process with ``attn_implementation="eager"`` and a per-device batch of
``--batch x --world`` packed rows or documents (the global micro-batch of the CP run), so both runs see the same
global batches. Each run writes ``losses.json`` (the logged loss per step), ``params.pt`` (the
final weights) and ``cp.json`` (the world size of the last cp_flash layer call's plan, null under
eager) to ``--out``; the two runs match to float32 rounding.

Nothing is downloaded: the tokenizer is a word-level one over the model's 128 ids, built here.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from datasets import Dataset
from transformers import PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

import cp_attention
from cp_attention.integrations.trainers import CPSFTTrainer  # CP
from cp_attention.tools.launch import leave_together
from cp_attention.tools.tiny_models import tiny_model

VOCAB = 128


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ids 0..VOCAB-1 ("<pad>" = 0, "<eos>" = 1, "<bos>" = 2)."""
    from tokenizers import Tokenizer, models

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")),
                                   pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")


def dataset(n: int = 64, seed: int = 0) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    rows = [{"input_ids": torch.randint(3, VOCAB, (int(torch.randint(5, 61, (1,), generator=g)),),
                                        generator=g).tolist()} for _ in range(n)]
    return Dataset.from_list(rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder for losses.json and params.pt")
    parser.add_argument("--single", action="store_true", help="plain SFTTrainer on one process, eager attention")
    parser.add_argument("--batch", type=int, default=2, help="per-device batch of the CP run (packed rows)")
    parser.add_argument("--world", type=int, default=2, help="with --single: the CP run's process count")
    parser.add_argument("--accumulation", type=int, default=2, help="gradient accumulation steps")
    parser.add_argument("--max-length", type=int, default=64, help="tokens per packed row")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--reentrant", action="store_true", help="reentrant gradient checkpointing")
    parser.add_argument("--peft", default="", choices=("", "lora", "dora"),
                        help="train a PEFT adapter (LoRA or DoRA on the attention and MLP projections) instead")
    parser.add_argument("--model", default="mistral", choices=("mistral", "qwen2_moe"),
                        help="the tiny model: Mistral, or Qwen2-MoE trained with its router auxiliary loss (weight 0.5)")
    parser.add_argument("--no-packing", action="store_true",
                        help="padding-free without packing: each micro-batch is --batch whole documents")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    model = tiny_model(args.model, "eager" if args.single else "cp_flash", seed=0, window=8)  # CP: cp_flash
    moe = {"router_aux_loss_coef": 0.5} if args.model == "qwen2_moe" else {}
    config = SFTConfig(
        output_dir=args.out, per_device_train_batch_size=args.batch * (args.world if args.single else 1),
        gradient_accumulation_steps=args.accumulation, max_steps=args.steps,
        learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, seed=0, dataloader_drop_last=True, ddp_backend=None if args.single else "gloo",
        bf16=False,  # SFTConfig turns on bf16 autocast by default: this float32 model trains in float32
        gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": args.reentrant},
        packing=not args.no_packing, packing_strategy="bfd", padding_free=True, **moe,
        max_length=None if args.no_packing else args.max_length,  # SFTTrainer: no max_length without packing
        # the same batches in both runs (transformers >= 5.24; older releases sample at random)
        **({"train_sampling_strategy": "sequential"} if "train_sampling_strategy" in SFTConfig.__dataclass_fields__
           else {}))
    trainer_class = SFTTrainer if args.single else CPSFTTrainer  # CP
    peft = {}
    if args.peft:  # SFTTrainer wraps the model itself
        from train_trainer import lora

        peft = {"peft_config": lora(args.peft)}
    trainer = trainer_class(model=model, args=config, train_dataset=dataset(), processing_class=tokenizer(), **peft)
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
        stats = cp_attention.last_plan_stats()  # the last cp_flash layer call: how many ranks shared its sequence
        with open(os.path.join(args.out, "cp.json"), "w") as f:
            json.dump({"world_size": None if stats is None else stats.world_size}, f)
    leave_together()  # torchrun hygiene: the ranks leave together, past the interpreter's teardown of gloo


if __name__ == "__main__":
    main()
