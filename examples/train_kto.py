"""A TRL KTO script trained under context parallelism, with two changed lines.

    torchrun --nproc_per_node=2 examples/train_kto.py --out /tmp/cp        # CPKTOTrainer, cp_flash, CP = 2
    python examples/train_kto.py --single --out /tmp/single                # plain KTOTrainer, eager, 1 process

Each training step joins the CP group's unpaired examples (a prompt, a completion, desirable or not,
and the mismatched completion of KTO's KL term) into one micro-batch, packs its sequences (padding
removed) as the documents of one row, shards it and runs the policy's, the reference model's and the
KL forwards on this rank's shard; the per-sequence log-probability sums, the KL estimate and every
loss term are then those of one process holding all the examples. The lines that differ from a plain
script are marked ``# CP``.

The model: a tiny random gpt-oss (sliding-window layers of 8 tokens with attention sinks, a MoE
whose router loss is trained), gradient checkpointing and gradient accumulation, SGD at a constant
learning rate; ``--single`` runs plain KTOTrainer on one process with eager attention and a
per-device batch of ``--batch x --world`` examples, so both runs see the same global batches.
``--set key=value`` sets any KTOConfig field (``--set desirable_weight=1.5``).

Each run writes ``logs.json``, ``params.pt``, ``initial.pt`` and ``cp.json`` to ``--out`` (see
``train_grpo.py``).
"""

from __future__ import annotations

import argparse
import os

import torch
from datasets import Dataset
from trl import KTOConfig, KTOTrainer

from cp_attention.integrations.trainers import CPKTOTrainer  # CP
from train_grpo import (VOCAB, Logs, cases, common_arguments, cp_group, evaluation, finish, lora, settings, tokenizer,
                        train)


def examples(n: int = 32, seed: int = 0) -> Dataset:
    """``n`` unpaired examples: a prompt of 3-16 words, a completion of 1-24 words, desirable about
    two times in three."""
    g = torch.Generator().manual_seed(seed)

    def text(lo, hi):
        ids = torch.randint(3, VOCAB, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()
        return " ".join(f"t{i}" for i in ids)

    return Dataset.from_list([{"prompt": text(3, 16), "completion": " " + text(1, 24),
                               "label": bool(torch.rand(1, generator=g) < 0.65)} for _ in range(n)])


def run(options, out: str) -> None:
    """One KTO training run."""
    os.makedirs(out, exist_ok=True)
    attention = "eager" if options.single else "cp_flash"  # CP
    fields, held_out = evaluation(options, examples(8, seed=1))  # sequential sampling: KTO's KL pairs need it
    config = settings(options, out, KTOConfig,
                      {"beta": 0.1, "model_init_kwargs": {"attn_implementation": attention, "dtype": torch.float32}},
                      fields, options.set)
    logs = Logs()
    trainer_class = KTOTrainer if options.single else CPKTOTrainer  # CP
    trainer = trainer_class(model=options.path, args=KTOConfig(**config), train_dataset=examples(),
                            processing_class=tokenizer(), callbacks=[logs], **held_out, **lora(options),
                            **cp_group(options))
    train(trainer, logs, out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common_arguments(parser, "gpt_oss (window + sinks + MoE) or a hybrid: qwen3_next, olmo_hybrid")
    parser.add_argument("--batch", type=int, default=2, help="per-device examples of the CP run")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    for options, out in cases(args):
        run(options, out)
    finish()


if __name__ == "__main__":
    main()
