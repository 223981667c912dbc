"""Peak memory per rank of a distillation training step under context parallelism, against one process.

    python benchmarks/bench_trainer_memory.py --out benchmarks/results/cpu      # 16k tokens, P = 1 and 2
    python benchmarks/bench_trainer_memory.py --smoke --out bench_out           # tiny

Each run is TRL's DistillationTrainer (plain, one process) or CPDistillationTrainer (torchrun, P ranks), with
cp_flash in both (the same attention code: what differs is only that the sequence is sharded), a student and a
teacher of one tiny gpt-oss shape with a vocabulary of 32k ids, and one long completion per prompt from a fixed
stub (two prompts in all: one per rank under CP). The measured step is the second: its peak resident memory
above the resident memory at its start (the process's high-water mark reset at the step's start, large buffers
returned to the system when freed), so what the step allocates is counted, logits included, and the weights,
optimizer state and libraries are not. Also given: what the whole sequence's vocabulary logits of one model
would take in float32 (TRL projects the hidden states in chunks, so no run holds them).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import harness  # noqa: E402

GRID = dict(completion=8188, vocabs=(2048, 8192), hidden=512, layers=4, world_sizes=(1, 2))
SMOKE = dict(completion=512, vocabs=(1024,), hidden=64, layers=2, world_sizes=(1, 2))
PROMPT = 8


def _status(field: str) -> int:
    """A field of /proc/self/status in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark (VmHWM) back to the current resident size


def worker(args) -> None:
    """One process of a run (under torchrun when P > 1): train 2 steps, write the second's peak."""
    from transformers import TrainerCallback
    from trl import DistillationConfig, DistillationTrainer

    from cp_attention.integrations.trainers import CPDistillationTrainer
    from cp_attention.tools.launch import leave_together
    from cp_attention.tools.tiny_models import tiny_config, tiny_model

    torch.set_num_threads(1)
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from train_grpo import prompts, tokenizer

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    config = tiny_config("gpt_oss", window=128, vocab=args.vocab, layers=args.layers)
    config.hidden_size, config.intermediate_size = args.hidden, 2 * args.hidden
    config.max_position_embeddings = 2 * (PROMPT + args.completion)
    student = tiny_model("gpt_oss", "cp_flash", seed=0, config=config).train()
    teacher = tiny_model("gpt_oss", "cp_flash", seed=1, config=config)
    length = args.completion

    class Stub:
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, has_tool_images=False):
            g = torch.Generator().manual_seed(self.state.global_step)
            return [torch.randint(3, 128, (length,), generator=g).tolist() for _ in prompt_ids]

    base = DistillationTrainer if world == 1 else CPDistillationTrainer
    trainer_class = type("MemoryTrainer", (Stub, base), {})
    peaks = []

    class Peak(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start = _status("VmRSS")
            _reset_peak()

        def on_step_end(self, *a, **k):
            peaks.append(_status("VmHWM") - self.start)

    settings = dict(output_dir=args.out_dir, per_device_train_batch_size=2 // world, max_steps=2,
                    max_completion_length=length, learning_rate=1e-3, optim="sgd", logging_steps=1,
                    save_strategy="no", report_to=[], use_cpu=True, seed=0, bf16=False, gradient_checkpointing=True,
                    gradient_checkpointing_kwargs={"use_reentrant": False}, disable_dropout=True,
                    ddp_backend="gloo" if world > 1 else None)
    trainer = trainer_class(model=student, teacher_model=teacher, args=DistillationConfig(**settings),
                            train_dataset=prompts(8).map(lambda r: {"prompt": " ".join(r["prompt"].split()[:PROMPT])}),
                            processing_class=tokenizer(), callbacks=[Peak()])
    trainer.train()
    with open(os.path.join(args.out_dir, f"peak-{world}-{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world": world, "peaks": peaks}, f)
    leave_together()


def measure(world: int, vocab: int, grid: dict, folder: str, timeout: float) -> dict:
    completion = grid["completion"]
    out_dir = os.path.join(folder, f"world{world}-vocab{vocab}")
    os.makedirs(out_dir, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", MALLOC_MMAP_THRESHOLD_="65536",
               PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "examples"), os.environ.get("PYTHONPATH", "")]))
    me = [os.path.abspath(__file__), "--worker", "--out-dir", out_dir, "--completion", str(completion),
          "--vocab", str(vocab), "--hidden", str(grid["hidden"]), "--layers", str(grid["layers"])]
    if world == 1:
        cmd = [sys.executable, *me]
    else:
        from cp_attention.tools.launch import free_port

        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
               f"--master_port={free_port()}", *me]
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"world {world} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    ranks = [json.load(open(os.path.join(out_dir, f"peak-{world}-{r}.json"))) for r in range(world)]
    peak = max(r["peaks"][-1] for r in ranks)
    tokens = 2 * (PROMPT + completion)
    return dict(world_size=world, tokens=tokens, vocab=vocab, peak_mib=peak / 2**20,
                per_rank_mib=[r["peaks"][-1] / 2**20 for r in ranks],
                whole_logits_mib=tokens * vocab * 4 / 2**20, wall_s=time.perf_counter() - started)


def tables(results: list[dict]) -> list[str]:
    rows = ["| ranks | tokens | vocabulary | peak above the step's start, busiest rank (MiB) | vs one process | "
            "one model's whole logits, float32 (MiB) |", "|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        one = next((o for o in results if o["world_size"] == 1 and o["vocab"] == r["vocab"]), None)
        ratio = "" if one is None else f"{r['peak_mib'] / one['peak_mib']:.2f}"
        rows.append(f"| {r['world_size']} | {r['tokens']} | {r['vocab']} | {r['peak_mib']:.0f} | {ratio} | "
                    f"{r['whole_logits_mib']:.0f} |")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_run_arguments(parser, warmup=0, repeats=1, smoke="a short completion, a small vocabulary")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--completion", type=int, default=None, help="completion tokens per prompt")
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=None, help="the models' hidden size (the MLP: twice it)")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    grid = dict(SMOKE if args.smoke else GRID)
    grid.update({k: getattr(args, k) for k in ("completion", "hidden", "layers") if getattr(args, k) is not None})
    if args.vocab is not None:
        grid["vocabs"] = (args.vocab,)
    started = time.perf_counter()
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        results = [measure(w, v, grid, folder, args.timeout) for v in grid["vocabs"] for w in grid["world_sizes"]]
    config = dict(grid=grid, prompt_tokens=PROMPT, model="gpt-oss shape (hidden, MLP 2x hidden), student and teacher",
                  attention="cp_flash in every run", threads=1, measured="the second step's VmHWM - VmRSS at its start")
    harness.finish_run(args, "trainer_memory", torch.device("cpu"), config, results, tables(results), started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
