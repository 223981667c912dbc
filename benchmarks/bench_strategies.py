"""Strategies per layer: ring, ulysses, usp and auto, from the plans and on real ranks.

    python benchmarks/bench_strategies.py --out benchmarks/results/cpu   # the grid below; real gloo ranks 2, 4
    python benchmarks/bench_strategies.py --smoke --out bench_out        # tiny, any device

Writes ``strategies.json``:

* plan level (every rank's plan of every candidate, no process group): for three layer mixes
  shaped like real models (:data:`MODELS`), lengths ``--seq-lens`` and world sizes
  ``--world-sizes``, one document or a packed realistic mix (``bench_layouts.draw_positions``),
  zigzag layout: per distinct layer mask and candidate the busiest rank's bytes (forward +
  backward, the larger of sent and received per exchange), exchange rounds, busiest rank's work
  (score entries x heads) and the modeled forward+backward time
  (:func:`cp_attention.strategies.choice.layer_time`, the default :class:`~cp_attention.CostModel`); per
  configuration the modeled step time (attention only) of each strategy used for every layer and of
  auto, which picks per layer; auto's choice per mask; and auto's per-layer time against the
  cheapest candidate's (never above it: auto takes the minimum).
* real ranks (``--rank-world-sizes``, default 2 4; gloo processes on CPU, one thread each, or one
  GPU and NCCL per rank): forward+backward of a small window/full layer mix under each strategy,
  interleaved in one run, for one document and a packed batch in the zigzag layout and one
  document in contiguous shards (:data:`RANK_SETTINGS`); per strategy the slowest rank's wall time as a ratio to the ring's, next
  to the model's prediction with constants calibrated on the same ranks (attention throughput of
  one rank, point-to-point latency and bandwidth between two), and the outputs checked against
  the ring's.

Models (attention layers only; sinks change neither the plans nor the traffic):

* ``qwen3-8b``: 36 full causal layers, 32 query heads, 8 K/V heads, head dim 128;
* ``gemma-3-27b``: 62 layers, 5 sliding-window (1024) layers per full layer (52 + 10), 32 / 16
  heads, head dim 128;
* ``gpt-oss-120b``: 36 layers alternating sliding window 128 and full, 64 / 8 heads, head dim 64,
  sinks.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
from bench_layouts import draw_positions  # noqa: E402

import cp_attention  # noqa: E402
from cp_attention.backends import BACKENDS  # noqa: E402
from cp_attention.masks import MaskSpec, SequenceMeta  # noqa: E402
from cp_attention.strategies.choice import Candidate, CostModel, candidates, choose, exchange_parts, layer_time, rank_plans  # noqa: E402
from cp_attention.tools.launch import run_ranks  # noqa: E402

MODELS = {
    "qwen3-8b": dict(masks=[({}, 36)], heads=32, kv_heads=8, head_dim=128),
    "gemma-3-27b": dict(masks=[({"window": 1024}, 52), ({}, 10)], heads=32, kv_heads=16, head_dim=128),
    "gpt-oss-120b": dict(masks=[({"window": 128}, 18), ({}, 18)], heads=64, kv_heads=8, head_dim=64),
}
GRID = dict(seq_lens=[32768, 131072, 524288, 1048576], world_sizes=[4, 8, 16, 32], data=["single", "packed"],
            rank_seq_len=1024, rank_world_sizes=[2, 4])
SMOKE = dict(seq_lens=[4096], world_sizes=[4, 8], data=["single", "packed"], rank_seq_len=256, rank_world_sizes=[2])
RANK_MIX = [({"window": 256}, 2), ({}, 2)]  # the real ranks' layers: window and full
# the real ranks' batches and layouts: zigzag (the ring balanced), and contiguous shards of one
# document, where the ring's causal work is unbalanced and the model predicts head parallelism faster
RANK_SETTINGS = [("single", "zigzag"), ("packed", "zigzag"), ("single", "contiguous")]
RANK_SHAPE = dict(heads=16, kv_heads=4, head_dim=64)  # enough heads per rank that per-tile overheads do not dominate
ITEMSIZE = 2  # bfloat16 in the plan-level table


def _meta(L: int, data: str, seed: int = 0) -> SequenceMeta:
    if data == "single":
        return SequenceMeta.from_inputs(1, L)
    return SequenceMeta.from_inputs(1, L, position_ids=draw_positions(L, seed))


def _busiest(plans: dict, heads: int) -> dict:
    """The busiest rank's bytes (forward + backward, as the cost model counts them), rounds and work."""
    out = dict(bytes=0, rounds=0, work=0)
    for plan in plans.values():
        whole, ring = exchange_parts(plan)
        stats = whole or ring
        if whole is None:  # the ring: K/V forward and again backward, dK/dV back
            moved = 2 * max(ring.kv_bytes_sent, ring.kv_bytes_recv) + max(ring.grad_bytes_sent, ring.grad_bytes_recv)
        else:  # the exchanges both ways, plus the ring's share as above
            a2a = max(whole.kv_bytes_sent - ring.kv_bytes_sent, whole.kv_bytes_recv - ring.kv_bytes_recv)
            moved = 2 * a2a + 2 * max(ring.kv_bytes_sent, ring.kv_bytes_recv) + max(ring.grad_bytes_sent,
                                                                                  ring.grad_bytes_recv)
        out = dict(bytes=max(out["bytes"], moved), rounds=max(out["rounds"], stats.rounds),
                   work=max(out["work"], stats.entries_computed * heads))
    return out


def plan_level(model_name: str, L: int, P: int, data: str, cost: CostModel) -> tuple[list[dict], dict]:
    """Per (mask, candidate) rows and the configuration's summary (module docstring)."""
    model = MODELS[model_name]
    dims = dict(heads=model["heads"], head_dim=model["head_dim"], head_dim_v=model["head_dim"])
    meta = _meta(L, data)
    rows, per_mask, auto = [], [], 0.0
    worst_layer = planning = 0.0
    for mask, count in model["masks"]:
        spec = MaskSpec(**mask)
        times = {}
        for cand in candidates(P, model["heads"]):
            plans = rank_plans(meta, spec, cand, "zigzag", kv_heads=model["kv_heads"], itemsize=ITEMSIZE, **dims)
            t = layer_time(cost, plans, **dims)
            times[cand.name] = t
            rows.append(dict(kind="layer", model=model_name, seq_len=L, world_size=P, data=data,
                             mask=_label(mask), layers=count, strategy=cand.name, modeled_s=t,
                             **{f"busiest_{k}": v for k, v in _busiest(plans, model["heads"]).items()}))
        # what the engine's auto runs for this layer (rank 0's plan, chosen as every rank chooses), at its modeled time
        t0 = time.perf_counter()
        picked = choose(meta, spec, "zigzag", 0, P, cost, kv_heads=model["kv_heads"], itemsize=ITEMSIZE, **dims).stats
        planning = max(planning, time.perf_counter() - t0)
        name = _name(picked)
        auto += count * times[name]
        worst_layer = max(worst_layer, times[name] / min(times.values()))
        per_mask.append((mask, count, times, name))
    names = list(per_mask[0][2])
    uniform = {n: sum(count * times[n] for _, count, times, _ in per_mask) for n in names}
    picks = {_label(mask): name for mask, _, _, name in per_mask}
    summary = dict(kind="summary", model=model_name, seq_len=L, world_size=P, data=data, step_s=uniform, auto_s=auto,
                   auto_picks=picks, auto_over_ring=auto / uniform["ring"],
                   auto_over_ulysses=auto / uniform["ulysses"] if "ulysses" in uniform else None,
                   auto_over_best_uniform=auto / min(uniform.values()), best_uniform=min(uniform, key=uniform.get),
                   auto_over_cheapest_per_layer=worst_layer, auto_planning_s=planning)
    return rows, summary


def _name(stats) -> str:
    """The candidate name (:attr:`Candidate.name`) of a plan's statistics."""
    return Candidate(stats.world_size, stats.ulysses_size).name


def _label(mask: dict) -> str:
    return f"window {mask['window']}" if mask.get("window") else "full"


# ----------------------------------------------------------------------------------------------
# real ranks


def _strategies(P: int, heads: int) -> list[tuple[str, str, int | None]]:
    """(label, strategy, ulysses_size) of every fixed candidate, then auto."""
    out = []
    for cand in candidates(P, heads):
        if cand.ulysses == 1:
            out.append(("ring", "ring", None))
        elif cand.ulysses == P:
            out.append(("ulysses", "ulysses", None))
        else:
            out.append((cand.name, "usp", cand.ulysses))
    return out + [("auto", "auto", None)]


def _calibrate(comm, cfg: dict, device, full) -> dict:
    """The cost model's constants measured on these ranks: one rank's attention throughput (rank 0's
    single-device forward+backward of the full layer), point-to-point latency (8 bytes) and
    bandwidth (a large message) between ranks 0 and 1; broadcast so every rank models alike."""
    found = torch.zeros(3, dtype=torch.float64)
    if comm.rank < 2:
        peer = 1 - comm.rank
        for size in (1, 1 << 21):  # float32 elements: 4 B, then 8 MiB
            buf = torch.zeros(size, device=device)
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                for first in ((comm.send, comm.recv) if comm.rank == 0 else (comm.recv, comm.send)):
                    first(buf, peer)
                    comm.commit("a calibration message").wait()
                times.append((time.perf_counter() - t0) / 2)
            found[0 if size == 1 else 1] = statistics.median(times)
    if comm.rank == 0:
        q, k, v = (t[:, :cfg["seq_len"]].detach().clone().requires_grad_() for t in full)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            cp_attention.attention(q, k, v, group=None, backend=cfg["backend"]).sum().backward()
            harness.synchronize(device)
            times.append(time.perf_counter() - t0)
        stats = cp_attention.last_plan_stats()
        work = stats.entries_computed * cfg["heads"] * 2 * 2 * cfg["head_dim"] * (1 + CostModel().backward)
        found[2] = work / statistics.median(times)
    parts = comm.all_gather(found)
    latency = float(parts[0][0])
    bandwidth = (1 << 21) * 4 / max(float(parts[0][1]) - latency, 1e-9)
    return dict(latency=latency, bandwidth=bandwidth, inter_node_bandwidth=bandwidth, throughput=float(parts[0][2]))


def _strategies_rank_main(rank, world_size, cfg):
    """One spawned rank: calibration, then forward+backward of every layer of RANK_MIX under each
    strategy, interleaved (rotating order) after a barrier; per strategy the wall seconds of every
    repeat, the predicted seconds, and the rank's gathered output of the last repeat."""
    device, comm = harness.rank_device(rank, cfg)
    full = harness.attention_inputs(cfg, device)[:3]
    pos = draw_positions(cfg["seq_len"], cfg["seed"]) if cfg["data"] == "packed" else None
    model = _calibrate(comm, cfg, device, full)
    cost = CostModel(**model, ranks_per_node=world_size)
    strategies = _strategies(world_size, cfg["heads"])
    results = {label: [] for label, _, _ in strategies}
    compute = {label: [] for label, _, _ in strategies}
    outs, picks = {}, {}
    # the backend wrapped to add up the time inside kernel calls (this rank's thread CPU time on a CPU,
    # which a preempted rank does not inflate), registered under a name for this process only
    timed = harness.timed_backend(cfg, device, full[0].dtype)
    BACKENDS["timed"] = timed
    with cp_attention.context_parallel(comm.group, layout=cfg["layout"], cost_model=cost, backend="timed") as cp:
        leaves = [cp.shard(t).detach().requires_grad_() for t in full]
        ids = None if pos is None else cp.shard(pos)

        def step(strategy, size):
            total, chosen = None, []
            for mask, count in RANK_MIX:
                for _ in range(count):
                    out = cp_attention.attention(*leaves, position_ids=ids, strategy=strategy, ulysses_size=size,
                                                 **mask)
                    out.sum().backward()
                    stats = cp_attention.last_plan_stats()
                    chosen.append(_name(stats))
                    total = out.detach() if total is None else total + out.detach()
            return total, chosen

        for i in range(cfg["warmup"] + cfg["repeats"]):
            order = strategies[i % len(strategies):] + strategies[:i % len(strategies)]
            for label, strategy, size in order:
                comm.all_gather(torch.zeros(1), "a barrier")
                out, seconds, elapsed = harness.timed_step(timed, lambda: step(strategy, size), before=lambda: None,
                                                           sync=lambda: harness.synchronize(device))
                out, chosen = out
                if i >= cfg["warmup"]:
                    results[label].append(elapsed)
                    compute[label].append(seconds)
                outs[label] = cp.gather(out, dim=1).cpu().numpy()
                picks[label] = chosen
    # every fixed strategy's modeled step time under the calibrated model, from this rank's plans of all ranks
    meta = _meta(cfg["seq_len"], cfg["data"], cfg["seed"])
    dims = dict(heads=cfg["heads"], head_dim=cfg["head_dim"], head_dim_v=cfg["head_dim"])
    free = dataclasses.replace(cost, bandwidth=1e30, inter_node_bandwidth=1e30, latency=0.0)  # compute alone
    predicted = {label: 0.0 for label, _, _ in strategies}
    predicted_compute = dict(predicted)
    for mask, count in RANK_MIX:
        plans = {c.name: rank_plans(meta, MaskSpec(**mask), c, cfg["layout"], kv_heads=cfg["kv_heads"],
                                    itemsize=full[1].element_size(), **dims) for c in candidates(world_size, cfg["heads"])}
        times = {n: layer_time(cost, p, **dims) for n, p in plans.items()}
        best = min(times, key=times.get)
        for label in predicted:
            name = best if label == "auto" else label
            predicted[label] += count * times[name]
            predicted_compute[label] += count * layer_time(free, plans[name], **dims)
    return dict(rank=rank, wall_s=results, compute_s=compute, predicted_s=predicted,
                predicted_compute_s=predicted_compute, picks=picks, model=model, out=outs if rank == 0 else None)


def real_ranks(cfg: dict, P: int, timeout: float) -> list[dict]:
    per_rank = run_ranks(P, _strategies_rank_main, cfg, timeout=timeout)
    rows = []
    first = per_rank[0]
    for label in first["wall_s"]:
        wall = max(statistics.median(r["wall_s"][label]) for r in per_rank)
        busy = max(statistics.median(r["compute_s"][label]) for r in per_rank)
        rows.append(dict(kind="ranks", world_size=P, seq_len=cfg["seq_len"], data=cfg["data"], layout=cfg["layout"],
                         strategy=label,
                         wall_s_max=wall, compute_s_max=busy, predicted_s=first["predicted_s"][label],
                         predicted_compute_s=first["predicted_compute_s"][label], picks=first["picks"][label],
                         model=first["model"], wall_s_runs=[r["wall_s"][label] for r in per_rank],
                         max_abs_diff_vs_ring=float(abs(first["out"][label] - first["out"]["ring"]).max())))
    ring = next(r for r in rows if r["strategy"] == "ring")
    for r in rows:
        r["measured_over_ring"] = r["wall_s_max"] / ring["wall_s_max"]
        r["predicted_over_ring"] = r["predicted_s"] / ring["predicted_s"]
        r["compute_over_ring"] = r["compute_s_max"] / ring["compute_s_max"]
        r["predicted_compute_over_ring"] = r["predicted_compute_s"] / ring["predicted_compute_s"]
    return rows


# ----------------------------------------------------------------------------------------------
# tables


def strategies_tables(results: list[dict]) -> list[str]:
    """Markdown: per model and data, what auto picks and its modeled step time against ring-only,
    ulysses-only and the best single strategy; then the real ranks."""
    lines = []
    summary = [r for r in results if r["kind"] == "summary"]
    if summary:
        lines += ["| model | data | L | P | auto picks | auto / ring-only | auto / ulysses-only | best single | "
                  "auto / best single | auto / cheapest per layer |",
                  "|---|---|---:|---:|---|---:|---:|---|---:|---:|"]
        for s in summary:
            picks = ", ".join(f"{mask}: {pick}" for mask, pick in s["auto_picks"].items())
            uly = "n/a" if s["auto_over_ulysses"] is None else f"{s['auto_over_ulysses']:.2f}"
            lines.append(f"| {s['model']} | {s['data']} | {_k(s['seq_len'])} | {s['world_size']} | {picks} | "
                         f"{s['auto_over_ring']:.2f} | {uly} | {s['best_uniform']} | "
                         f"{s['auto_over_best_uniform']:.3f} | {s['auto_over_cheapest_per_layer']:.3f} |")
    ranks = [r for r in results if r["kind"] == "ranks"]
    if ranks:
        lines += ["", "| P | L | data | layout | strategy | layers ran | wall / ring: measured | predicted | "
                      "busiest compute / ring: measured | predicted | max abs diff vs ring |",
                  "|---:|---:|---|---|---|---|---:|---:|---:|---:|---:|"]
        for r in ranks:
            lines.append(f"| {r['world_size']} | {r['seq_len']} | {r['data']} | {r['layout']} | {r['strategy']} | "
                         f"{'/'.join(r['picks'])} | {r['measured_over_ring']:.2f} | {r['predicted_over_ring']:.2f} | "
                         f"{r['compute_over_ring']:.2f} | {r['predicted_compute_over_ring']:.2f} | "
                         f"{r['max_abs_diff_vs_ring']:.1e} |")
    return lines


def _k(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n >> 10}k"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_run_arguments(parser, warmup=1, repeats=3, smoke="tiny shapes", threads="torch threads per rank on CPU")
    parser.add_argument("--seq-lens", type=int, nargs="+")
    parser.add_argument("--world-sizes", type=int, nargs="+")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--rank-seq-len", type=int)
    parser.add_argument("--rank-world-sizes", type=int, nargs="*")
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args(argv)
    device = harness.pick_device(args.device)
    grid = SMOKE if args.smoke else GRID
    started = time.perf_counter()
    cost = CostModel()
    rows, summaries = [], []
    for model in args.models:
        for data in grid["data"]:
            for L in args.seq_lens or grid["seq_lens"]:
                for P in args.world_sizes or grid["world_sizes"]:
                    layer_rows, summary = plan_level(model, L, P, data, cost)
                    rows += layer_rows
                    summaries.append(summary)
            print(f"plans of {model}, {data} done ({time.perf_counter() - started:.0f}s)", flush=True)
    plan_s = time.perf_counter() - started
    rank_cfg = dict(seq_len=args.rank_seq_len or grid["rank_seq_len"], batch=1, dtype="float32",
                    backend="reference" if device.type == "cpu" else "auto", device=device.type, threads=args.threads,
                    warmup=0 if args.smoke else args.warmup, repeats=1 if args.smoke else args.repeats, seed=0,
                    data="packed", **RANK_SHAPE)
    ranks = []
    for P in grid["rank_world_sizes"] if args.rank_world_sizes is None else args.rank_world_sizes:
        for data, layout in RANK_SETTINGS:
            ranks += real_ranks(dict(rank_cfg, data=data, layout=layout), P, args.timeout)
        print(f"real ranks at P = {P} done ({time.perf_counter() - started:.0f}s)", flush=True)
    results = rows + summaries + ranks
    config = dict(models=MODELS, grid=dict(grid, seq_lens=args.seq_lens or grid["seq_lens"],
                                           world_sizes=args.world_sizes or grid["world_sizes"]),
                  layout="zigzag", itemsize=ITEMSIZE, cost_model=dataclasses.asdict(cost),
                  documents="bench_layouts.draw_positions: lognormal lengths, median 1000 tokens",
                  ranks=dict(rank_cfg, mix=RANK_MIX), plan_seconds=plan_s)
    harness.finish_run(args, "strategies", device, config, results, strategies_tables(results), started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
