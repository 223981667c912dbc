"""A TRL DPO script trained under context parallelism, with two changed lines.

    torchrun --nproc_per_node=2 examples/train_dpo.py --out /tmp/cp        # CPDPOTrainer, cp_flash, CP = 2
    python examples/train_dpo.py --single --out /tmp/single                # plain DPOTrainer, eager, 1 process

Each training step joins the CP group's preference pairs into one micro-batch (every rank's chosen
sequences, then every rank's rejected ones), packs its sequences (padding removed) as the documents
of one row, shards it and runs the policy's and the reference model's forwards on this rank's
shard; the per-sequence log-probability sums and every loss term are then those of one process
holding all the pairs. The lines that differ from a plain script are marked ``# CP``.

The model: a tiny random gpt-oss (sliding-window layers of 8 tokens with attention sinks, a MoE
whose router loss is trained; ``--model qwen3_next``: a hybrid of gated-DeltaNet and attention
layers), gradient checkpointing and gradient accumulation, SGD at a constant learning rate;
``--single`` runs plain DPOTrainer on one process with eager attention and a per-device batch of
``--batch x --world`` pairs, so both runs see the same global batches. ``--set key=value`` sets any
DPOConfig field (``--set loss_type="['ipo']"``, ``--set precompute_ref_log_probs=True``).

Each run writes ``logs.json``, ``params.pt``, ``initial.pt`` and ``cp.json`` to ``--out`` (see
``train_grpo.py``).

Nothing is downloaded: the tokenizer is a word-level one over the model's 128 ids.
"""

from __future__ import annotations

import argparse
import os
import shutil

import torch
from datasets import Dataset, load_from_disk
from trl import DPOConfig, DPOTrainer

from cp_attention.integrations.trainers import CPDPOTrainer  # CP
from train_grpo import (VOCAB, Logs, cases, common_arguments, cp_group, evaluation, finish, lora, settings, tokenizer,
                        train)


def pairs(n: int = 32, seed: int = 0) -> Dataset:
    """``n`` preference pairs: a prompt of 3-16 words and two completions of 1-24 words."""
    g = torch.Generator().manual_seed(seed)

    def text(lo, hi):
        ids = torch.randint(3, VOCAB, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()
        return " ".join(f"t{i}" for i in ids)

    return Dataset.from_list([{"prompt": text(3, 16), "chosen": text(1, 24), "rejected": text(1, 24)}
                              for _ in range(n)])


def pairs_on_disk(folder: str) -> Dataset:
    """:func:`pairs` saved once in ``folder`` and loaded from there by every process: TRL's
    ``precompute_ref_log_probs`` writes the reference log-probabilities next to the dataset's files on
    the main process and the others read them (an in-memory dataset has no shared folder)."""
    path = os.path.join(folder, "pairs")
    if not os.path.exists(path):
        mine = f"{path}-{os.getpid()}"
        pairs().save_to_disk(mine)
        try:
            os.rename(mine, path)  # atomic: the first process's copy stays
        except OSError:
            shutil.rmtree(mine, ignore_errors=True)
    return load_from_disk(path)


def run(options, out: str) -> None:
    """One DPO training run."""
    os.makedirs(out, exist_ok=True)
    attention = "eager" if options.single else "cp_flash"  # CP
    fields, held_out = evaluation(options, pairs(8, seed=1))
    config = settings(options, out, DPOConfig,
                      {"beta": 0.1, "model_init_kwargs": {"attn_implementation": attention, "dtype": torch.float32}},
                      fields, options.set)
    logs = Logs()
    trainer_class = DPOTrainer if options.single else CPDPOTrainer  # CP
    trainer = trainer_class(model=options.path, args=DPOConfig(**config), train_dataset=pairs_on_disk(options.data),
                            processing_class=tokenizer(), callbacks=[logs], **held_out, **lora(options),
                            **cp_group(options))
    train(trainer, logs, out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common_arguments(parser, "gpt_oss (window + sinks + MoE) or a hybrid: qwen3_next, olmo_hybrid")
    parser.add_argument("--batch", type=int, default=2, help="per-device pairs of the CP run")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    for options, out in cases(args):
        options.data = args.out
        pairs_on_disk(args.out)  # before the process group starts (the other processes wait for nothing)
        run(options, out)
    finish()


if __name__ == "__main__":
    main()
