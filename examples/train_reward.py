"""A TRL reward-model script trained under context parallelism, with two changed lines.

    torchrun --nproc_per_node=2 examples/train_reward.py --out /tmp/cp     # CPRewardTrainer, cp_flash, CP = 2
    python examples/train_reward.py --single --out /tmp/single             # plain RewardTrainer, eager, 1 process

Each training step joins the CP group's preference pairs into one micro-batch (every rank's chosen
sequences, then every rank's rejected ones, with their margins), shards every row along the sequence
and runs the reward model on this rank's shard; the head pools each row's last token from the gathered
per-token scores, so the rewards, the loss and its metrics are those of one process holding all the
pairs. The lines that differ from a plain script are marked ``# CP``.

The model: a tiny random gpt-oss sequence classifier with one label (sliding-window layers of 8 tokens
with attention sinks, a MoE; transformers' classification heads add no router loss), gradient
checkpointing and gradient accumulation, SGD at a constant learning rate; ``--single`` runs plain
RewardTrainer on one process with eager attention and a per-device batch of ``--batch x --world``
pairs, so both runs see the same global batches. ``--margin`` gives every pair a margin; ``--set
key=value`` sets any RewardConfig field (``--set center_rewards_coefficient=0.01``); ``--peft`` trains a
LoRA adapter (and the score head).

Each run writes ``logs.json``, ``params.pt``, ``initial.pt`` and ``cp.json`` to ``--out`` (see
``train_grpo.py``).
"""

from __future__ import annotations

import argparse
import os

import torch
from datasets import Dataset
from trl import RewardConfig, RewardTrainer

from cp_attention.integrations.trainers import CPRewardTrainer  # CP
from cp_attention.tools.tiny_models import tiny_config
from train_grpo import (EOS, VOCAB, Logs, cases, common_arguments, cp_group, evaluation, finish, settings, tokenizer,
                        train)


def pairs(n: int = 32, seed: int = 0, margin: bool = False) -> Dataset:
    """``n`` tokenized preference pairs: two sequences of 4-40 tokens (a shared prompt and each its own
    completion, ending in EOS), with a margin in [0, 1) when ``margin``."""
    g = torch.Generator().manual_seed(seed)

    def ids(lo, hi):
        return torch.randint(3, VOCAB, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()

    rows = []
    for _ in range(n):
        prompt = ids(3, 16)
        row = {"chosen_ids": prompt + ids(1, 23) + [EOS], "rejected_ids": prompt + ids(1, 23) + [EOS]}
        if margin:
            row["margin"] = float(torch.rand(1, generator=g))
        rows.append(row)
    return Dataset.from_list(rows)


def reward_model(attention: str):
    """The tiny gpt-oss with a one-label classification head (weights drawn from seed 0)."""
    import transformers as tf

    config = tiny_config("gpt_oss", window=8)
    config.num_labels, config.pad_token_id, config.eos_token_id = 1, 0, EOS
    torch.manual_seed(0)
    return tf.AutoModelForSequenceClassification.from_config(config, attn_implementation=attention,
                                                             dtype=torch.float32)


def run(options, out: str) -> None:
    """One reward-model training run."""
    os.makedirs(out, exist_ok=True)
    attention = "eager" if options.single else "cp_flash"  # CP
    fields, held_out = evaluation(options, pairs(8, seed=1, margin=options.margin))
    config = settings(options, out, RewardConfig, fields, options.set)
    logs = Logs()
    peft = {}
    if options.peft:
        from peft import LoraConfig

        peft = {"peft_config": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                          task_type="SEQ_CLS", init_lora_weights=False)}
    trainer_class = RewardTrainer if options.single else CPRewardTrainer  # CP
    trainer = trainer_class(model=reward_model(attention), args=RewardConfig(**config),
                            train_dataset=pairs(margin=options.margin), processing_class=tokenizer(),
                            callbacks=[logs], **held_out, **peft, **cp_group(options))
    train(trainer, logs, out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common_arguments(parser, "gpt_oss (window + sinks + MoE)")
    parser.add_argument("--batch", type=int, default=2, help="per-device pairs of the CP run")
    parser.add_argument("--margin", action="store_true", help="a margin for every pair")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    for options, out in cases(args):
        run(options, out)
    finish()


if __name__ == "__main__":
    main()
