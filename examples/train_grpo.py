"""A TRL GRPO (or RLOO) script whose training step runs under context parallelism, with two changed lines.

    torchrun --nproc_per_node=2 examples/train_grpo.py --out /tmp/cp          # CPGRPOTrainer, cp_flash, CP = 2
    python examples/train_grpo.py --single --out /tmp/single                  # plain GRPOTrainer, eager, 1 process
    torchrun --nproc_per_node=2 examples/train_grpo.py --trainer rloo --out /tmp/cp   # CPRLOOTrainer

Generation stays where it is (each process generates and scores its own prompts); then the CP group's
sequences (prompt + completion, padding removed) are joined into one packed row of documents,
sharded, and every forward of the step runs on this rank's shard: the reference model's, the old
policy's and the policy's. The lines that differ from a plain script are marked ``# CP``.

The model: a tiny random gpt-oss (sliding-window layers of 8 tokens with attention sinks, a MoE
whose router loss is trained; ``--model qwen3_next``: a hybrid of gated-DeltaNet and attention
layers), a reference model (``beta`` > 0), gradient checkpointing and gradient accumulation, SGD at
a constant learning rate. The completions: ``--generate`` samples them with ``model.generate``;
by default a fixed stub (GRPO's ``rollout_func``; RLOO: ``_generate_single_turn``) derives each
completion from its prompt and its place in the global generation batch, so a single-process run
(``--single``: per-device batch ``--batch x --world``, eager attention) sees the same completions
and must train to the same numbers. ``--set key=value`` sets any GRPOConfig / RLOOConfig field
(``--set loss_type=dapo --set top_entropy_quantile=0.5``).

Each run writes ``logs.json`` (every logged value per step), ``params.pt`` (the final weights),
``initial.pt`` and ``cp.json`` (the world size of the last cp_flash layer call's plan, null under
eager) to ``--out``.

Nothing is downloaded: the tokenizer is a word-level one over the model's 128 ids.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import zlib

import torch
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

import cp_attention
from cp_attention.integrations.trainers import CPGRPOTrainer, CPRLOOTrainer  # CP
from cp_attention.tools.launch import leave_together
from cp_attention.tools.tiny_models import tiny_model
from train_sft import VOCAB
from train_sft import tokenizer as word_tokenizer

EOS = 1


def tokenizer():
    """train_sft's word-level tokenizer, splitting text at spaces ("t5 t17" -> [5, 17])."""
    from tokenizers import pre_tokenizers

    tok = word_tokenizer()
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def prompts(n: int = 32, seed: int = 0) -> Dataset:
    """``n`` prompts of 4-20 words ("t5 t17 ..."), the word-level tokenizer's ids."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(3, VOCAB, (int(torch.randint(4, 21, (1,), generator=g)),), generator=g).tolist()
        rows.append({"prompt": " ".join(f"t{i}" for i in ids)})
    return Dataset.from_list(rows)


def completion(prompt_ids: list[int], place: int, step: int, longest: int) -> list[int]:
    """A completion fixed by the prompt, its place in the global generation batch and the step: 1 to
    ``longest`` tokens, most ending with EOS, some cut at ``longest`` (truncated)."""
    seed = zlib.crc32(f"{prompt_ids}|{place}|{step}".encode())
    g = torch.Generator().manual_seed(seed)
    n = min(longest, int(torch.randint(1, longest + 5, (1,), generator=g)))
    ids = torch.randint(3, VOCAB, (n,), generator=g).tolist()
    if n < longest or seed % 2:
        ids[-1] = EOS
    return ids


def _place(trainer, i: int, count: int) -> int:
    return trainer.accelerator.process_index * count + i


def rollout(prompt_texts: list[str], trainer) -> dict:
    """GRPO's ``rollout_func``: the fixed completions of this process's prompts."""
    ids = [[int(w[1:]) for w in text.split()] for text in prompt_texts]
    step = trainer.state.global_step
    longest = trainer.args.max_completion_length
    return {"prompt_ids": ids, "logprobs": None,
            "completion_ids": [completion(p, _place(trainer, i, len(ids)), step, longest) for i, p in enumerate(ids)]}


class _FixedRLOO:
    """RLOO's stub: ``_generate_single_turn`` returns the fixed completions (RLOO has no rollout_func)."""

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields):
        step, longest = self.state.global_step, self.args.max_completion_length
        return [completion(list(p), _place(self, i, len(prompt_ids)), step, longest) for i, p in enumerate(prompt_ids)]


class FixedRLOOTrainer(_FixedRLOO, RLOOTrainer):
    pass


class FixedCPRLOOTrainer(_FixedRLOO, CPRLOOTrainer):  # CP
    pass


def reward(completion_ids, **kwargs) -> list[float]:
    """Fraction of even token ids, minus a length penalty: varied, deterministic rewards."""
    return [sum(1 for t in ids if t % 2 == 0) / max(1, len(ids)) - 0.01 * len(ids) for ids in completion_ids]


class Logs(TrainerCallback):
    """Every logged number, per logging step."""

    def __init__(self):
        self.rows = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.rows.append({k: v for k, v in (logs or {}).items() if isinstance(v, (int, float))})


def setting(item: str) -> tuple[str, object]:
    """``--set key=value``: the value as a Python literal where it reads as one, else the string."""
    key, text = item.split("=", 1)
    try:
        return key, ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return key, text


def model_dir(out: str, family: str, rank: int) -> str:
    """The tiny model of ``family`` saved for this process (policy and reference load from it)."""
    path = os.path.join(out, f"model-{family}-{rank}")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    if family == "gpt_oss":
        model = tiny_model("gpt_oss", "eager", seed=0, window=8)
    else:
        from cp_attention.tools.sweeps import configs

        model = tiny_model(family, "eager", seed=0, config=configs.tiny_config(family))
    model.config.pad_token_id, model.config.eos_token_id = 0, EOS
    model.save_pretrained(path)
    return path


def common_arguments(parser: argparse.ArgumentParser, model_help: str) -> None:
    """The options train_grpo.py and train_dpo.py share."""
    parser.add_argument("--out", required=True, help="folder for logs.json and params.pt")
    parser.add_argument("--single", action="store_true", help="the plain trainer on one process, eager attention")
    parser.add_argument("--world", type=int, default=2, help="with --single: the CP run's process count")
    parser.add_argument("--accumulation", type=int, default=2, help="gradient accumulation steps")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--model", default="gpt_oss", help=model_help)
    parser.add_argument("--peft", action="store_true", help="train a LoRA adapter (reference: the adapter off)")
    parser.add_argument("--cp-size", type=int, default=None,
                        help="ranks per CP group (default: all); the others are data-parallel replicas (dp x cp)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config field")
    parser.add_argument("--eval", action="store_true", help="evaluate on held-out rows after every step")
    parser.add_argument("--cases", default=None,
                        help='several runs in one launch, a JSON list of {"name": ..., and any option: "set": '
                             '{field: value}, "model", "trainer", "peft", "accumulation", ...}; each writes to '
                             '--out/NAME')


def cases(args) -> list:
    """(options, out folder) of each run of this launch; every model they use saved first (the
    process group that the first config starts would keep the other processes from saving)."""
    runs = []
    for case in (json.loads(args.cases) if args.cases else [{}]):
        case = dict(case)
        name = case.pop("name", None)
        options = argparse.Namespace(**{**vars(args), **{k.replace("-", "_"): v for k, v in case.items()}})
        options.set = dict(setting(item) for item in args.set) | case.get("set", {})
        runs.append((options, args.out if name is None else os.path.join(args.out, name)))
    rank = int(os.environ.get("RANK", 0))
    for options, _ in runs:
        options.path = model_dir(args.out, options.model, rank)
    return runs


def evaluation(options, rows) -> tuple[dict, dict]:
    """With --eval: the config fields and the held-out rows of an evaluation after every step."""
    if not options.eval:
        return {}, {}
    per_device = options.batch * (options.world if options.single else 1)
    return ({"eval_strategy": "steps", "eval_steps": 1, "per_device_eval_batch_size": per_device},
            {"eval_dataset": rows})


def lora(options) -> dict:
    if not options.peft:
        return {}
    from peft import LoraConfig

    return {"peft_config": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)}


def cp_group(options) -> dict:
    """CP: with --cp-size, a dp x cp mesh and the trainer's CP group its "cp" dimension."""
    if options.single or not options.cp_size:
        return {}
    from torch.distributed.device_mesh import init_device_mesh

    world = int(os.environ["WORLD_SIZE"])
    mesh = init_device_mesh("cpu", (world // options.cp_size, options.cp_size), mesh_dim_names=("dp", "cp"))
    return {"cp_group": mesh["cp"]}


def settings(options, out: str, config_class, *layers: dict, sequential: bool = True) -> dict:
    """The config fields the preference, reward and distillation scripts' runs share: SGD at a constant
    learning rate, gradient checkpointing, logging every step, no saving, the per-device batch (the
    single run's: the CP run's times its ranks) and, with ``sequential``, the same batches in both runs
    (sequential sampling, transformers >= 5.24; older releases sample at random); then each of
    ``layers`` in turn (the script's fields, the evaluation's, --set)."""
    base = dict(output_dir=out, per_device_train_batch_size=options.batch * (options.world if options.single else 1),
                gradient_accumulation_steps=options.accumulation, max_steps=options.steps, learning_rate=0.5,
                optim="sgd", lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[],
                use_cpu=True, seed=0, bf16=False, ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None,
                gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
    if sequential and "train_sampling_strategy" in config_class.__dataclass_fields__:
        base["train_sampling_strategy"] = "sequential"
    for layer in layers:
        base = base | layer
    return base


def train(trainer, logs: Logs, out: str) -> None:
    """Train, then (rank 0) write the logs, the weights before and after, and the CP world size."""
    rank = int(os.environ.get("RANK", 0))
    if rank == 0:
        torch.save({k: v.detach().cpu().clone() for k, v in trainer.model.state_dict().items()},
                   os.path.join(out, "initial.pt"))
    trainer.train()
    if rank == 0:
        with open(os.path.join(out, "logs.json"), "w") as f:
            json.dump(logs.rows, f)
        torch.save({k: v.detach().cpu() for k, v in trainer.model.state_dict().items()},
                   os.path.join(out, "params.pt"))
        stats = cp_attention.last_plan_stats()  # the last cp_flash layer call: how many ranks shared its sequence
        eager = trainer.accelerator.unwrap_model(trainer.model).config._attn_implementation == "eager"
        with open(os.path.join(out, "cp.json"), "w") as f:
            json.dump({"world_size": None if stats is None or eager else stats.world_size}, f)


def finish() -> None:
    leave_together()  # torchrun hygiene: the ranks leave together, past the interpreter's teardown of gloo


def run(options, out: str) -> None:
    """One GRPO or RLOO training run."""
    os.makedirs(out, exist_ok=True)
    attention = "eager" if options.single else "cp_flash"  # CP
    config_class = GRPOConfig if options.trainer == "grpo" else RLOOConfig
    settings = dict(
        output_dir=out, per_device_train_batch_size=options.batch * (options.world if options.single else 1),
        gradient_accumulation_steps=options.accumulation, max_steps=options.steps, num_generations=4,
        max_completion_length=12, learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, seed=0, bf16=False, beta=0.1,
        ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None, gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False}, disable_dropout=True,
        model_init_kwargs={"attn_implementation": attention, "dtype": torch.float32},
        generation_kwargs={"do_sample": True, "top_k": 0, "top_p": 1.0})
    fields, held_out = evaluation(options, prompts(8, seed=1))
    settings.update(fields)
    settings.update(options.set)
    logs = Logs()
    kwargs = dict(model=options.path, reward_funcs=reward, args=config_class(**settings), train_dataset=prompts(),
                  processing_class=tokenizer(), callbacks=[logs], **held_out, **lora(options), **cp_group(options))
    if options.trainer == "grpo":
        trainer_class = GRPOTrainer if options.single else CPGRPOTrainer  # CP
        if not options.generate:
            kwargs["rollout_func"] = rollout
    elif options.generate:
        trainer_class = RLOOTrainer if options.single else CPRLOOTrainer  # CP
    else:
        trainer_class = FixedRLOOTrainer if options.single else FixedCPRLOOTrainer  # CP
    train(trainer_class(**kwargs), logs, out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common_arguments(parser, "gpt_oss (window + sinks + MoE) or a hybrid: qwen3_next, olmo_hybrid")
    parser.add_argument("--trainer", default="grpo", choices=("grpo", "rloo"))
    parser.add_argument("--batch", type=int, default=4, help="per-device rows (completions) of the CP run")
    parser.add_argument("--generate", action="store_true", help="sample completions with model.generate")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    for options, out in cases(args):
        run(options, out)
    finish()


if __name__ == "__main__":
    main()
