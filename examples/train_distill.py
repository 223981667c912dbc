"""A TRL distillation script trained under context parallelism, with two changed lines.

    torchrun --nproc_per_node=2 examples/train_distill.py --out /tmp/cp    # CPDistillationTrainer, cp_flash, CP = 2
    python examples/train_distill.py --single --out /tmp/single            # plain DistillationTrainer, eager

Generation stays where it is (each process completes its own prompts); then the CP group's sequences
(prompt + completion, padding removed) are joined into one packed row of documents, sharded, and the
student's and the teacher's backbones run on this rank's shard; each rank projects its own tokens
through both LM heads in TRL's chunks for the divergence. The lines that differ from a plain script
are marked ``# CP``.

The student: a tiny random gpt-oss (sliding-window layers of 8 tokens with attention sinks, a MoE);
the teacher: another one, drawn from another seed (TRL's distillation loss is the divergence alone:
no router loss enters it). Gradient checkpointing and gradient accumulation, SGD at a constant
learning rate. The completions: by default a fixed stub (``_generate_single_turn``, as
``train_grpo.py``'s) derives each completion from its prompt and its place in the global generation
batch, so a single-process run (``--single``: per-device batch ``--batch x --world``, eager
attention) sees the same completions and must train to the same numbers; ``--generate`` samples them
with ``model.generate`` instead (on-policy; the runs then differ in what they sample). ``--set
key=value`` sets any DistillationConfig field (``--set beta=0.0``: forward KL; 1.0: reverse KL; 0.5:
the generalised JSD).

Each run writes ``logs.json``, ``params.pt``, ``initial.pt`` and ``cp.json`` to ``--out`` (see
``train_grpo.py``).
"""

from __future__ import annotations

import argparse
import os

import torch
from trl import DistillationConfig, DistillationTrainer

from cp_attention.integrations.trainers import CPDistillationTrainer  # CP
from cp_attention.tools.tiny_models import tiny_model
from train_grpo import (EOS, Logs, _place, cases, common_arguments, completion, cp_group, evaluation, finish, prompts,
                        settings, tokenizer, train)


def teacher_dir(out: str, rank: int) -> str:
    """The teacher (a tiny gpt-oss from seed 1) saved for this process."""
    path = os.path.join(out, f"teacher-{rank}")
    if not os.path.exists(os.path.join(path, "config.json")):
        model = tiny_model("gpt_oss", "eager", seed=1, window=8)
        model.config.pad_token_id, model.config.eos_token_id = 0, EOS
        model.save_pretrained(path)
    return path


class _Fixed:
    """The stub: ``_generate_single_turn`` returns the fixed completions of this process's prompts."""

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, has_tool_images=False):
        step, longest = self.state.global_step, self.args.max_completion_length
        return [completion(list(p), _place(self, i, len(prompt_ids)), step, longest) for i, p in enumerate(prompt_ids)]


class FixedDistillationTrainer(_Fixed, DistillationTrainer):
    pass


class FixedCPDistillationTrainer(_Fixed, CPDistillationTrainer):  # CP
    pass


def lora(options) -> dict:
    """With --peft: a LoRA adapter on the student's attention, both its matrices drawn at random (the
    divergence's gradient is small: an adapter starting at zero would barely move in a short run)."""
    if not options.peft:
        return {}
    from peft import LoraConfig

    return {"peft_config": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                      init_lora_weights=False)}


def run(options, out: str) -> None:
    """One distillation run."""
    os.makedirs(out, exist_ok=True)
    attention = "eager" if options.single else "cp_flash"  # CP
    init = {"attn_implementation": attention, "dtype": torch.float32}
    fields, held_out = evaluation(options, prompts(8, seed=1))
    config = settings(options, out, DistillationConfig,  # the prompts' sampler is TRL's own
                      {"max_completion_length": 12, "disable_dropout": True, "model_init_kwargs": init,
                       "teacher_model_init_kwargs": {**init, "dtype": "float32"}},  # the teacher's dtype: a name
                      fields, options.set, sequential=False)
    logs = Logs()
    if options.generate:
        trainer_class = DistillationTrainer if options.single else CPDistillationTrainer  # CP
    else:
        trainer_class = FixedDistillationTrainer if options.single else FixedCPDistillationTrainer  # CP
    rank = int(os.environ.get("RANK", 0))
    trainer = trainer_class(model=options.path, teacher_model=teacher_dir(options.data, rank),
                            args=DistillationConfig(**config), train_dataset=prompts(), processing_class=tokenizer(),
                            callbacks=[logs], **held_out, **lora(options), **cp_group(options))
    train(trainer, logs, out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common_arguments(parser, "gpt_oss (window + sinks + MoE) or a hybrid: qwen3_next, olmo_hybrid")
    parser.add_argument("--batch", type=int, default=2, help="per-device prompts of the CP run")
    parser.add_argument("--generate", action="store_true", help="sample completions with model.generate")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    for options, out in cases(args):
        options.data = args.out
        teacher_dir(args.out, int(os.environ.get("RANK", 0)))  # before the process group starts
        run(options, out)
    finish()


if __name__ == "__main__":
    main()
