"""Hybrid models under context parallelism on real ranks: the bytes each mixer layer moves, and the
step time against the same model on one rank.

    python benchmarks/bench_hybrids.py --out benchmarks/results/cpu   # the grid below; gloo ranks 2, 4
    python benchmarks/bench_hybrids.py --smoke --out bench_out        # tiny

Writes ``hybrids.json``. For each model (the family sweep's tiny config of a hybrid family, its own
layer mix: gated DeltaNet, Mamba-2, Mamba or short convolutions with attention), each length and
world size: one packed row of realistic documents (``harness.document_lengths``), zigzag layout,
forward + backward of ``sum(logits)`` inside ``context_parallel``:

* per mixer layer, the bytes this rank received in the forward (the backward returns as many): the
  convolution halos and the recurrence states (``forward_mixer_stats``), busiest rank; next to what
  head parallelism (an all-to-all of the mixer's inputs and outputs, every rank all tokens of 1/P of
  the channels) would move: ``2 (P-1)/P x L/P x (C_in + C_out) x itemsize``;
* the step time: the slowest rank's wall time and its thread CPU time, each over the same model on
  one rank (``context_parallel()`` of one process, the same code path), medians of the repeats. On
  a machine with fewer cores than ranks the wall time includes waiting for a core; the CPU time
  does not (it is the rank's own work).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import harness  # noqa: E402

from cp_attention.tools.launch import run_ranks  # noqa: E402

MODELS = ("qwen3_next", "nemotron_h", "jamba", "lfm2",
          # issue 39: KDA, lightning attention, RG-LRU + convolution, Zaya's convolutions, RWKV, xLSTM, pure Mamba-2
          "kimi_linear", "minimax", "recurrent_gemma", "zaya", "rwkv", "xlstm", "mamba2")
GRID = dict(seq_lens=(4096, 16384), world_sizes=(2, 4))
# transformers' torch reference of Mamba's selective scan (what Jamba runs without mamba_ssm) steps
# through the tokens in Python, slicing a (B, D, L, N) tensor per step; its backward grows as L^2
# (0.07 s, 0.16 s, 0.59 s at L = 512, 1024, 2048, D = 32, N = 16, one thread). Longer Jamba runs
# would measure that, not context parallelism.
MAX_LEN = {"jamba": 4096, "recurrent_gemma": 4096, "rwkv": 4096}  # their torch paths step through tokens too
SMOKE = dict(seq_lens=(96,), world_sizes=(2,))


def _model(family: str):
    import hybrid_cases

    _, model = hybrid_cases.models(family)
    return model.train()


def _mixer_channels(model) -> tuple[int, int]:
    """(channels into the sequence operations, channels out) of the model's first mixer: its
    convolution's channels, and its output projection's inputs."""
    from torch import nn

    for module in model.modules():
        conv = next((m for m in module.children() if isinstance(m, nn.Conv1d) and m.kernel_size[0] > 1), None)
        out = getattr(module, "out_proj", None)
        if conv is not None:
            return conv.in_channels, out.in_features if isinstance(out, nn.Linear) else conv.in_channels
    hidden = model.config.get_text_config().hidden_size  # no convolution (lightning attention, RWKV, xLSTM):
    return hidden, hidden                                  # the mixer's input and output at the hidden size


def _inputs(family: str, L: int, vocab: int):
    docs = harness.document_lengths(L, seed=1, median=max(8, L // 6))
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, vocab - 1, (1, L), generator=g)
    pos = torch.cat([torch.arange(n) for n in docs])[None]
    return ids, pos, docs


def _rank_main(rank: int, world_size: int, cfg: dict) -> dict:
    import cp_attention
    import hybrid_cases

    torch.set_num_threads(cfg["threads"])
    torch.manual_seed(0)
    model = _model(cfg["family"])
    ids, pos, _ = _inputs(cfg["family"], cfg["seq_len"], model.config.get_text_config().vocab_size)
    walls, cpus, stats, logits = [], [], [], None
    for i in range(cfg["warmup"] + cfg["repeats"]):
        if world_size > 1:
            torch.distributed.barrier()
        t0, c0 = time.perf_counter(), time.thread_time()
        with cp_attention.context_parallel(layout="zigzag") as cp:
            batch = cp.shard_batch(input_ids=ids, position_ids=pos)
            if not hybrid_cases.takes_positions(model):
                batch.pop("position_ids")  # the pure state-space models, RWKV, xLSTM: documents from the batch
            out = model(**batch, use_cache=False)
            stats = cp_attention.forward_mixer_stats()
            out.logits.sum().backward()
            if i == 0:  # by value (a tensor would travel as a shared-memory handle the rank may outlive)
                logits = cp.gather(out.logits.detach(), dim=1).numpy()
        c1 = time.thread_time()
        if world_size > 1:
            torch.distributed.barrier()
        if i >= cfg["warmup"]:
            walls.append(time.perf_counter() - t0)
            cpus.append(c1 - c0)
        model.zero_grad(set_to_none=True)
    return dict(wall_s=walls, cpu_s=cpus, logits=logits,
                mixers=[dict(kind=s.kind, bytes_recv=s.bytes_recv, bytes_sent=s.bytes_sent, tokens=s.tokens_recv,
                             pieces=s.pieces, runs=s.segment_runs) for s in stats])


def _one_rank(cfg: dict) -> dict:
    threads = torch.get_num_threads()
    try:
        return _rank_main(0, 1, cfg)
    finally:
        torch.set_num_threads(threads)


def measure(family: str, L: int, world_sizes, args) -> list[dict]:
    cfg = dict(family=family, seq_len=L, threads=args.threads, warmup=0 if args.smoke else args.warmup,
               repeats=1 if args.smoke else args.repeats)
    base = _one_rank(cfg)
    model = _model(family)
    c_in, c_out = _mixer_channels(model)
    itemsize = next(model.parameters()).element_size()
    _, _, docs = _inputs(family, L, model.config.get_text_config().vocab_size)
    rows = []
    for P in world_sizes:
        per_rank = run_ranks(P, _rank_main, cfg, timeout=args.timeout)
        wall = max(statistics.median(r["wall_s"]) for r in per_rank)
        cpu = max(statistics.median(r["cpu_s"]) for r in per_rank)
        layers = {}
        for r in per_rank:
            for i, s in enumerate(r["mixers"]):
                key = (i, s["kind"])
                layers[key] = max(layers.get(key, 0), s["bytes_recv"])
        conv = [b for (i, kind), b in sorted(layers.items()) if kind == "convolution"]
        rec = [b for (i, kind), b in sorted(layers.items()) if kind == "recurrence"]
        heads = int(2 * (P - 1) / P * (L / P) * (c_in + c_out) * itemsize)
        rows.append(dict(kind="hybrid", model=family, seq_len=L, world_size=P, documents=len(docs),
                         wall_s_max=wall, cpu_s_max=cpu, wall_one_rank_s=statistics.median(base["wall_s"]),
                         cpu_one_rank_s=statistics.median(base["cpu_s"]),
                         wall_over_one_rank=wall / statistics.median(base["wall_s"]),
                         cpu_over_one_rank=cpu / statistics.median(base["cpu_s"]),
                         conv_layers=len(conv), recurrence_layers=len(rec),
                         conv_bytes_per_layer=max(conv, default=0), state_bytes_per_layer=max(rec, default=0),
                         head_parallel_bytes_per_layer=heads, mixer_channels=(c_in, c_out),
                         max_abs_diff_vs_one_rank=float(abs(per_rank[0]["logits"] - base["logits"]).max())))
    return rows


def tables(results: list[dict]) -> list[str]:
    lines = ["| model | L | P | documents | halo B / conv layer | state B / recurrence layer | head-parallel B / layer "
             "(modeled) | step wall / one rank | step CPU / one rank | logits vs one rank |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['model']} | {r['seq_len']} | {r['world_size']} | {r['documents']} | "
                     f"{r['conv_bytes_per_layer']} | {r['state_bytes_per_layer']} | "
                     f"{r['head_parallel_bytes_per_layer']} | {r['wall_over_one_rank']:.2f} | "
                     f"{r['cpu_over_one_rank']:.2f} | {r['max_abs_diff_vs_one_rank']:.1e} |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_run_arguments(parser, warmup=1, repeats=3, smoke="one tiny model", threads="torch threads per rank")
    parser.add_argument("--models", nargs="+", choices=list(MODELS))
    parser.add_argument("--seq-lens", type=int, nargs="+")
    parser.add_argument("--world-sizes", type=int, nargs="+")
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args(argv)
    grid = SMOKE if args.smoke else GRID
    models = args.models or (MODELS[:1] if args.smoke else MODELS)
    started = time.perf_counter()
    results = []
    for family in models:
        for L in args.seq_lens or grid["seq_lens"]:
            if L > MAX_LEN.get(family, L):
                continue
            results += measure(family, L, args.world_sizes or grid["world_sizes"], args)
            print(f"{family} L={L} done ({time.perf_counter() - started:.0f}s)", flush=True)
    config = dict(grid=grid, models=models, layout="zigzag", threads=args.threads, max_len=MAX_LEN,
                  documents="harness.document_lengths(L, median=L/6), one packed row")
    harness.finish_run(args, "hybrids", torch.device("cpu"), config, results, tables(results), started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
