"""Context parallelism: our plans against a full ring and an all-gather of K/V, per rank.

    python benchmarks/bench_cp.py                          # CPU: gloo ranks 1, 2, 4; GPU: 1, 2, 4, 8
    python benchmarks/bench_cp.py --smoke --out bench_out  # tiny, any device
    python benchmarks/bench_cp.py --mode simulate          # every rank in this process, in turn
    python benchmarks/bench_cp.py --layouts                # zigzag, contiguous, balanced: bench_cp_layouts.py

For every mask and world size P, each approach runs forward+backward of attention over a sequence
of L tokens sharded with the zigzag layout (``--layout``), through the same ring
(``cp_attention.strategies.ring``) and the same backend kernels:

* ``ours``: the plan of ``cp_attention.build_plan`` (only the K/V spans the mask needs, only the
  rank pairs that see each other).
* ``full_ring``: a plan that visits every shard: in round t each rank receives the whole shard of
  rank - t; the kernel calls still cover exactly the visible pairs, so only traffic differs.
* ``all_gather``: K/V of every rank gathered first (``all_gather``; its backward returns dK/dV with
  ``reduce_scatter``), then one local attention of the rank's queries over the whole sequence, as
  Llama-3-style context parallelism and PyTorch's FlexAttention CP do.

Reported per rank: compute time (time inside kernel calls: CUDA events on a GPU, the rank
thread's CPU time on a CPU, which a busy shared machine does not inflate), wall time of the step,
K/V bytes sent and received, exchange rounds. A traffic table over windows and world sizes is
computed from the plans alone (no run).

Modes: ``spawn`` runs P processes (gloo on CPU, NCCL when there are P GPUs); ``simulate`` runs the
P ranks' plans one after another in this process (``harness.SimComm`` delivers the K/V spans a
rank would receive), so per-rank compute and traffic are exact on a single GPU. ``auto``: spawn on
CPU and when enough GPUs exist, else simulate. World size 1 always runs in this process.

``--layouts`` hands the rest of the command line to ``bench_cp_layouts.py`` (the zigzag,
contiguous and balanced layouts on packed batches, ``cp_layouts.json``; its options there).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_cp_layouts  # noqa: E402
import harness  # noqa: E402

from cp_attention import layout as layout_mod  # noqa: E402
from cp_attention.comm import Comm  # noqa: E402
from cp_attention.plan import build_plan  # noqa: E402
from cp_attention.tools.launch import run_ranks  # noqa: E402

APPROACHES = ("ours", "full_ring", "all_gather")
CPU_DEFAULTS = dict(seq_len=8192, world_sizes=[1, 2, 4], heads=8, kv_heads=8, head_dim=64, dtype="float32",
                    masks=["causal", "window:512", "window:2048", "documents", "documents:2048", "chunked:2048"])
GPU_DEFAULTS = dict(seq_len=65536, world_sizes=[1, 2, 4, 8], heads=16, kv_heads=4, head_dim=128, dtype="bfloat16",
                    masks=["causal", "window:1024", "window:4096", "documents", "documents:8192", "chunked:8192"])
SMOKE = dict(seq_len=512, world_sizes=[1, 2], heads=2, kv_heads=1, head_dim=16, dtype="float32",
             masks=["window:64", "documents:128"])
TRAFFIC_WINDOW_FRACTIONS = (1 / 16, 1 / 8, 1 / 4, 1 / 2, 1, 2)  # of the shard length S = L / P


# ----------------------------------------------------------------------------------------------
# the all-gather baseline's collective


class _GatherKV(torch.autograd.Function):
    """(B, S_r, K, D) shard -> (B, L, K, D) in global order on every rank; backward sums the
    gradient over ranks and returns each its own shard (reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group, world_size, layout, seq_len):
        sizes = layout_mod.local_lengths(seq_len, world_size, layout)
        longest = max(sizes)
        padded = x.new_zeros(x.shape[0], longest, *x.shape[2:])
        padded[:, :x.shape[1]] = x
        parts = [torch.empty_like(padded) for _ in range(world_size)]
        dist.all_gather(parts, padded.contiguous(), group=group)
        ctx.group, ctx.world_size, ctx.layout, ctx.sizes = group, world_size, layout, sizes
        return layout_mod.unshard([p[:, :n] for p, n in zip(parts, sizes)], 1, layout)

    @staticmethod
    def backward(ctx, grad):
        sizes, longest = ctx.sizes, max(ctx.sizes)
        chunks = []
        for r in range(ctx.world_size):
            part = layout_mod.shard(grad, 1, ctx.world_size, ctx.layout, r)
            padded = grad.new_zeros(grad.shape[0], longest, *grad.shape[2:])
            padded[:, :part.shape[1]] = part
            chunks.append(padded)
        out = torch.empty_like(chunks[0])
        dist.reduce_scatter(out, chunks, group=ctx.group)
        return out[:, :sizes[dist.get_rank(ctx.group)]], None, None, None, None


# ----------------------------------------------------------------------------------------------
# one rank


def _plans(cfg, case, P, rank):
    meta = case.meta(cfg["seq_len"])
    kw = dict(world_size=P, layout=cfg["layout"], rank=rank)
    sizes = dict(head_kv=cfg["kv_heads"], head_dim=cfg["head_dim"], itemsize=harness.dtype_of(cfg["dtype"]).itemsize)
    plans = {"ours": build_plan(meta, case.spec, **kw, **sizes)}
    if P > 1:
        plans["full_ring"] = harness.full_ring_plan(meta, case.spec, **kw, **sizes)
        plans["all_gather"] = harness.all_gather_plan(meta, case.spec, **kw)
    return plans


def _step(approach, plan, shards, comm, timed, scale, gather=None):
    """Forward+backward of one approach on one rank; returns the output (detached). The all-gather
    baseline gathers K/V first (``gather``; already gathered in ``shards`` when None) and runs its
    plan locally."""
    if approach == "all_gather":
        return harness.ring_step(plan, shards, Comm(single=True), timed, scale, gather=gather)
    return harness.ring_step(plan, shards, comm, timed, scale)


def _rank_main(rank, world_size, cfg):
    """One spawned rank: every mask, every approach; returns per-run measurements."""
    device, comm = harness.rank_device(rank, cfg)
    group = comm.group
    full = harness.attention_inputs(cfg, device)
    shards = [layout_mod.shard(t, 1, world_size, cfg["layout"], rank).contiguous() for t in full]
    timed = harness.timed_backend(cfg, device, full[0].dtype)
    scale = cfg["head_dim"] ** -0.5
    sync = functools.partial(harness.synchronize, device)

    def gather(x):
        return _GatherKV.apply(x, group, world_size, cfg["layout"], cfg["seq_len"])

    records = []
    for mask in cfg["masks"]:
        case = harness.parse_mask(mask, cfg["seq_len"])
        plans = _plans(cfg, case, world_size, rank)
        reference = None
        for approach, plan in plans.items():
            out, compute, wall = _repeat(
                cfg, timed, lambda: dist.barrier(group=group),
                lambda: _step(approach, plan, shards, comm, timed, scale, gather), sync)
            reference = out if reference is None else reference
            records.append(_record(mask, approach, rank, compute, wall, out, reference))
    return records


def _repeat(cfg, timed, before, run, sync):
    """Warm-up then repeats of ``run``: (last output, per-repeat compute seconds, wall seconds)."""
    compute, wall = [], []
    out = None
    for i in range(cfg["warmup"] + cfg["repeats"]):
        out, seconds, elapsed = harness.timed_step(timed, run, before=before, sync=sync)
        if i >= cfg["warmup"]:
            compute.append(seconds)
            wall.append(elapsed)
    return out, compute, wall


def _record(mask, approach, rank, compute, wall, out, reference) -> dict:
    return dict(mask=mask, approach=approach, rank=rank, compute_s=compute, wall_s=wall,
                max_abs_diff_vs_ours=float((out.float() - reference.float()).abs().max()))


def _simulate(cfg, world_size):
    """Every rank of a world of ``world_size`` in this process, one after another."""
    device = torch.device(cfg["device"])
    full = harness.attention_inputs(cfg, device)
    P = world_size
    shards = [[layout_mod.shard(t, 1, P, cfg["layout"], r).contiguous() for t in full] for r in range(P)]
    timed = harness.timed_backend(cfg, device, full[0].dtype)
    scale = cfg["head_dim"] ** -0.5
    sync = functools.partial(harness.synchronize, device)
    records = []
    for mask in cfg["masks"]:
        case = harness.parse_mask(mask, cfg["seq_len"])
        for rank in range(P):
            plans = _plans(cfg, case, P, rank)
            reference = None
            for approach, plan in plans.items():
                if approach == "all_gather":
                    mine = [shards[rank][0], full[1], full[2], shards[rank][3]]  # the gathered K/V
                    comm = None
                else:
                    mine = shards[rank]
                    comm = harness.SimComm(plan, [s[1] for s in shards], [s[2] for s in shards])
                out, compute, wall = _repeat(cfg, timed, sync, lambda: _step(approach, plan, mine, comm, timed, scale),
                                             sync)
                reference = out if reference is None else reference
                records.append(_record(mask, approach, rank, compute, wall, out, reference))
    return records


# ----------------------------------------------------------------------------------------------
# aggregation


def _aggregate(cfg, P, records, mode):
    """Per (mask, approach): per-rank medians, the slowest rank, and the plan-level traffic."""
    rows = []
    itemsize = harness.dtype_of(cfg["dtype"]).itemsize
    for mask in cfg["masks"]:
        case = harness.parse_mask(mask, cfg["seq_len"])
        traffic = harness.traffic(case.meta(cfg["seq_len"]), case.spec, world_size=P, layout=cfg["layout"],
                                  head_kv=cfg["kv_heads"], head_dim=cfg["head_dim"], itemsize=itemsize)
        for approach in APPROACHES:
            mine = sorted((r for r in records if r["mask"] == mask and r["approach"] == approach),
                          key=lambda r: r["rank"])
            if not mine:
                continue
            prefix = {"ours": "ours", "full_ring": "ring", "all_gather": "allgather"}[approach]
            compute = [statistics.median(r["compute_s"]) for r in mine]
            wall = [statistics.median(r["wall_s"]) for r in mine]
            rows.append(dict(
                mask=mask, kind=case.kind, world_size=P, approach=approach, mode=mode,
                compute_s_per_rank=compute, compute_s_max=max(compute), wall_s_per_rank=wall, wall_s_max=max(wall),
                compute_s_runs=[r["compute_s"] for r in mine],
                kv_bytes_sent_per_rank=[t[f"{prefix}_sent"] for t in traffic],
                kv_bytes_recv_per_rank=[t[f"{prefix}_recv"] for t in traffic],
                rounds_per_rank=[t[f"{prefix}_rounds"] for t in traffic],
                halo_needed_recv_per_rank=[t["halo_needed_recv"] for t in traffic],
                max_abs_diff_vs_ours=max(r["max_abs_diff_vs_ours"] for r in mine)))
    return rows


def traffic_table(cfg, world_sizes) -> list[dict]:
    """Plan-level K/V traffic (no run) over windows W = fraction x S and the document masks, for
    every world size and both layouts: per rank, ours against a full ring and an all-gather."""
    L = cfg["seq_len"]
    itemsize = harness.dtype_of(cfg["dtype"]).itemsize
    rows = []
    for P in [p for p in world_sizes if p > 1]:
        S = L // P
        masks = [f"window:{max(1, int(f * S))}" for f in TRAFFIC_WINDOW_FRACTIONS]
        masks += ["causal", f"documents:{S}", "documents"]
        for layout in ("zigzag", "contiguous"):
            for mask in masks:
                case = harness.parse_mask(mask, L)
                per_rank = harness.traffic(case.meta(L), case.spec, world_size=P, layout=layout,
                                           head_kv=cfg["kv_heads"], head_dim=cfg["head_dim"], itemsize=itemsize)
                rows.append(dict(
                    world_size=P, layout=layout, mask=mask, kind=case.kind, window=case.spec.window, shard_len=S,
                    window_over_shard=None if case.spec.window is None else case.spec.window / S,
                    ours_sent_max=max(t["ours_sent"] for t in per_rank),
                    ours_recv_max=max(t["ours_recv"] for t in per_rank),
                    ring_sent_max=max(t["ring_sent"] for t in per_rank),
                    allgather_recv_max=max(t["allgather_recv"] for t in per_rank),
                    halo_needed_recv_max=max(t["halo_needed_recv"] for t in per_rank),
                    ours_rounds_max=max(t["ours_rounds"] for t in per_rank), per_rank=per_rank))
    return rows


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--layouts" in argv:  # the layouts benchmark: its own script, with its own options
        argv.remove("--layouts")
        for option in ("--masks", "--layout", "--mode"):
            if any(a == option or a.startswith(option + "=") for a in argv):
                raise SystemExit(f"{option} does not apply to --layouts (it compares every layout on packed batches)")
        return bench_cp_layouts.main(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_run_arguments(parser, warmup=1, repeats=3, smoke="tiny shapes", threads="torch threads per rank on CPU")
    harness.add_shape_arguments(parser)
    parser.add_argument("--mode", choices=("auto", "spawn", "simulate"), default="auto")
    parser.add_argument("--world-sizes", type=int, nargs="+")
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--layout", choices=layout_mod.LAYOUTS, default="zigzag")
    parser.add_argument("--timeout", type=float, default=3600.0, help="per world size, spawned ranks")
    parser.add_argument("--layouts", action="store_true",
                        help="run bench_cp_layouts.py instead, with the other options (zigzag, contiguous and "
                             "balanced layouts on packed batches; writes cp_layouts.json; see its --help)")
    args = parser.parse_args(argv)

    device = harness.pick_device(args.device)
    defaults = SMOKE if args.smoke else (GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS)
    cfg = dict(seq_len=args.seq_len or defaults["seq_len"], masks=args.masks or defaults["masks"],
               heads=args.heads or defaults["heads"], kv_heads=args.kv_heads or defaults["kv_heads"],
               head_dim=args.head_dim or defaults["head_dim"], dtype=args.dtype or defaults["dtype"],
               layout=args.layout, backend=args.backend or ("reference" if device.type == "cpu" else "auto"),
               warmup=0 if args.smoke else args.warmup, repeats=1 if args.smoke else args.repeats,
               threads=args.threads, device=device.type, seed=0)
    world_sizes = args.world_sizes or defaults["world_sizes"]
    if device.type == "cpu":
        torch.set_num_threads(args.threads)

    rows = []
    for P in world_sizes:
        mode = args.mode
        if P == 1:
            mode = "local"  # nothing to exchange: this process
        elif mode == "auto":
            mode = "spawn" if device.type == "cpu" or torch.cuda.device_count() >= P else "simulate"
        if mode == "spawn" and device.type == "cuda" and torch.cuda.device_count() < P:
            raise SystemExit(f"--mode spawn needs {P} GPUs, found {torch.cuda.device_count()}; use --mode simulate")
        started = time.perf_counter()
        if mode == "spawn":
            per_rank = run_ranks(P, _rank_main, cfg, timeout=args.timeout)
            records = [rec for recs in per_rank for rec in recs]
        else:
            records = _simulate(cfg, P)
        rows.extend(_aggregate(cfg, P, records, mode))
        print(f"world size {P} ({mode}) done in {time.perf_counter() - started:.0f}s", flush=True)

    base = {r["mask"]: r["compute_s_max"] for r in rows if r["world_size"] == 1 and r["approach"] == "ours"}
    for r in rows:
        if r["mask"] in base:
            r["speedup_vs_world_size_1"] = base[r["mask"]] / r["compute_s_max"]
        ours = next(o for o in rows
                    if (o["mask"], o["world_size"], o["approach"]) == (r["mask"], r["world_size"], "ours"))
        r["kv_bytes_sent_vs_ours"] = (max(r["kv_bytes_sent_per_rank"]) / max(ours["kv_bytes_sent_per_rank"])
                                      if max(ours["kv_bytes_sent_per_rank"]) else None)
    traffic = traffic_table(cfg, world_sizes)
    config = dict(cfg, world_sizes=world_sizes,
                  compute_time=("CUDA events around kernel calls" if device.type == "cuda"
                                else "CPU time of the rank's thread inside kernel calls"),
                  traffic="forward K/V bytes from the plans (a backward moves the same K/V again and returns "
                          "float32 dK/dV for every received span)")
    name = "cp" + (f"_{args.tag}" if args.tag else "") + ".json"
    path = harness.write_results(os.path.join(args.out, name), benchmark="cp",
                                 machine=harness.machine_info(device, args.note), config=config,
                                 results=rows + [dict(traffic=True, **t) for t in traffic])
    print(f"\nwrote {path}")
    print(f"{'mask':16s} {'P':>2s} {'approach':10s} {'compute max':>12s} {'speedup':>8s} {'KV sent max':>12s} "
          f"{'vs ours':>8s} {'rounds':>6s}")
    for r in rows:
        sent = max(r["kv_bytes_sent_per_rank"])
        print(f"{r['mask']:16s} {r['world_size']:2d} {r['approach']:10s} {r['compute_s_max'] * 1e3:10.1f}ms "
              f"{r.get('speedup_vs_world_size_1', float('nan')):7.2f}x {sent / harness.MIB:10.2f}MiB "
              f"{(r['kv_bytes_sent_vs_ours'] or float('nan')):7.2f}x {max(r['rounds_per_rank']):6d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
