"""Layouts for packed batches: zigzag, contiguous and balanced, from the plans and on real ranks.

    python benchmarks/bench_cp_layouts.py --out benchmarks/results/cpu   # L = 131072, P = 4-32; real ranks 2, 4
    python benchmarks/bench_cp_layouts.py --smoke --out bench_out        # tiny, any device
    python benchmarks/bench_cp.py --layouts [options]                    # the same run (bench_cp.py hands it over)

Compares the zigzag, contiguous and balanced layouts on drawn packed batches (the document-length
mix of ``bench_layouts.py``), writing ``cp_layouts.json``:

* from the plans alone (every rank's ``cp_attention.plan_stats``, no process group) at world sizes
  ``--world-sizes`` (default 4 8 16 32) and length ``--seq-len``: per layout the busiest rank's
  work over the mean (work = visible (query, key) pairs summed over the model's attention layers,
  plus ``token_weight`` x tokens, balanced_layout's cost model), the largest token count over
  L / P, the busiest rank's K/V bytes received over the model's layers (against a full ring and
  zigzag), planning time (the layout plus the slowest rank's plans of the model's distinct masks,
  CPU time of one thread) and the step time a simple model predicts: the step waits for the
  busiest rank, so balanced's speedup over zigzag is zigzag's busiest work over balanced's. Worst
  case over ``--seeds`` drawn batches.
* real ranks (``--rank-world-sizes``, default 2 4; spawned gloo processes on CPU, one GPU and NCCL
  per rank on a GPU machine): forward+backward of every attention layer of the model on one packed
  batch of ``--rank-seq-len`` tokens under each layout, the layouts interleaved in one run; per
  layout the slowest rank's compute (time inside kernel calls) and wall time as ratios to zigzag's,
  next to the plan's prediction, and the outputs checked against zigzag's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
from bench_layouts import MIXES, draw_positions  # noqa: E402

import cp_attention  # noqa: E402
from cp_attention import layout as layout_mod  # noqa: E402
from cp_attention.plan import build_plan  # noqa: E402
from cp_attention.tools.launch import run_ranks  # noqa: E402

LAYOUT_NAMES = ("zigzag", "contiguous", "balanced")
LAYOUTS_CPU = dict(seq_len=131072, world_sizes=[4, 8, 16, 32], mixes=["causal", "5x window-1024 + full"],
                   token_weights=[0.0, 30000.0], seeds=3, first_seed=0, rank_seq_len=16384,
                   rank_world_sizes=[2, 4], heads=2, kv_heads=2, head_dim=32, dtype="float32")
LAYOUTS_GPU = dict(LAYOUTS_CPU, rank_seq_len=131072, rank_world_sizes=[2, 4, 8], heads=16, kv_heads=4,
                   head_dim=128, dtype="bfloat16")
LAYOUTS_SMOKE = dict(seq_len=2048, world_sizes=[4, 8], mixes=["causal", "5x window-1024 + full"],
                     token_weights=[0.0, 3000.0], seeds=2, first_seed=4, rank_seq_len=1024,  # seeds 4, 5: packed
                     rank_world_sizes=[2], heads=1, kv_heads=1, head_dim=8, dtype="float32")
PLAN_KV = dict(head_kv=8, head_dim=128, dtype=torch.bfloat16)  # the K/V bytes of the plan-level table


def layer_masks(mix: str) -> list[tuple[dict, int]]:
    """The distinct attention masks of a layer mix of ``bench_layouts.MIXES`` with their layer
    counts, in first-seen order: ``"5x window-1024 + full"`` -> [({window: 1024}, 5), ({}, 1)]."""
    distinct: list[tuple[dict, int]] = []
    for mask in MIXES[mix]:
        at = next((i for i, (m, _) in enumerate(distinct) if m == mask), None)
        if at is None:
            distinct.append((dict(mask), 1))
        else:
            distinct[at] = (distinct[at][0], distinct[at][1] + 1)
    return distinct


def mask_label(mask: dict) -> str:
    """``{}`` -> ``"causal"``, ``{"window": 1024}`` -> ``"window:1024"`` (the harness' names)."""
    parts = ([] if mask.get("causal", True) else ["bidirectional"]) + \
        [f"{'chunked' if k == 'chunk_size' else k}:{v}" for k, v in mask.items() if k != "causal" and v is not None]
    return "+".join(parts) or "causal"


def document_lengths_of(position_ids: torch.Tensor) -> list[int]:
    """Lengths of the documents of one (1, L) row of position ids (a document opens wherever the
    position does not increase by exactly 1)."""
    pos = position_ids[0]
    opens = torch.ones(pos.numel(), dtype=torch.bool)
    opens[1:] = pos[1:] != pos[:-1] + 1
    starts = torch.nonzero(opens).flatten().tolist() + [pos.numel()]
    return [b - a for a, b in zip(starts[:-1], starts[1:])]


def _make_layout(name: str, position_ids: torch.Tensor, P: int, mix: str, token_weight: float):
    """zigzag and contiguous by name (as ``attention()`` takes them); balanced for this batch."""
    if name == "balanced":
        return cp_attention.balanced_layout(P, position_ids=position_ids, masks=MIXES[mix], token_weight=token_weight)
    return name


def _local_lengths(layout, L: int, P: int) -> list[int]:
    return layout_mod.local_lengths(L, P, layout)


def _rank_stats(layout, P: int, position_ids: torch.Tensor, mix: str) -> tuple[list[list], list[float]]:
    """Every rank's PlanStats for each distinct mask of ``mix`` (``[rank][mask]``) and each rank's
    planning seconds (its plans of the distinct masks, as one rank of a real job builds them)."""
    stats, seconds = [], []
    for r in range(P):
        mine, t = [], 0.0
        for mask, _ in layer_masks(mix):
            t0 = time.thread_time()
            mine.append(cp_attention.plan_stats(layout, r, world_size=P, position_ids=position_ids, **PLAN_KV, **mask))
            t += time.thread_time() - t0
        stats.append(mine)
        seconds.append(t)
    return stats, seconds


def layout_row(name: str, layout, layout_s: float, stats, plan_s, *, L: int, P: int, mix: str,
               token_weight: float) -> dict:
    """One layout on one batch: per-rank work (visible pairs over the model's layers + token_weight
    x tokens), tokens and K/V received over the model's layers, and the summary figures."""
    layers = layer_masks(mix)
    tokens = _local_lengths(layout, L, P)
    by_layer = {mask_label(m): [st[j].entries_visible for st in stats] for j, (m, _) in enumerate(layers)}
    entries = [sum(c * st[j].entries_visible for j, (_, c) in enumerate(layers)) for st in stats]
    computed = [sum(c * st[j].entries_computed for j, (_, c) in enumerate(layers)) for st in stats]
    kv = [sum(c * st[j].kv_bytes_recv for j, (_, c) in enumerate(layers)) for st in stats]
    ring = [sum(c * st[j].ring_kv_bytes_recv for j, (_, c) in enumerate(layers)) for st in stats]
    calls = [sum(c * st[j].kernel_calls for j, (_, c) in enumerate(layers)) for st in stats]
    work = [e + token_weight * n for e, n in zip(entries, tokens)]
    return dict(
        layout=name, tokens_per_rank=tokens, entries_visible_per_rank=entries, entries_computed_per_rank=computed,
        entries_visible_by_layer=by_layer, work_per_rank=work, kv_bytes_recv_per_rank=kv,
        ring_kv_bytes_recv_per_rank=ring, kernel_calls_per_rank=calls, kernel_calls_max=max(calls),
        busiest_work=max(work), busiest_over_mean=max(work) / (sum(work) / P),
        token_spread=max(tokens) / (L / P), kv_recv_busiest=max(kv), kv_vs_full_ring=max(kv) / (sum(ring) / P),
        layout_ms=1e3 * layout_s, plan_ms_per_rank=[1e3 * s for s in plan_s],
        planning_ms=1e3 * (layout_s + max(plan_s)))


def plan_level(L: int, P: int, mix: str, token_weight: float, seed: int, cache: dict) -> list[dict]:
    """Every layout on the batch drawn with ``seed``, from the plans of every rank; zigzag's and
    contiguous' plans do not depend on the token weight (``cache``)."""
    pos = draw_positions(L, seed)
    rows = []
    for name in LAYOUT_NAMES:
        key = (name, L, P, mix, seed)
        if name == "balanced" or key not in cache:
            t0 = time.thread_time()
            layout = _make_layout(name, pos, P, mix, token_weight)
            layout_s = time.thread_time() - t0
            cache[key] = (layout, layout_s) + _rank_stats(layout, P, pos, mix)
        layout, layout_s, stats, plan_s = cache[key]
        if name == "balanced":
            del cache[key]
        rows.append(dict(kind="plan", seq_len=L, world_size=P, mix=mix, token_weight=token_weight, seed=seed,
                         **layout_row(name, layout, layout_s, stats, plan_s, L=L, P=P, mix=mix,
                                      token_weight=token_weight)))
    zz = rows[0]
    for r in rows:
        r["predicted_speedup_over_zigzag"] = zz["busiest_work"] / r["busiest_work"]
        r["kv_vs_zigzag"] = r["kv_recv_busiest"] / zz["kv_recv_busiest"] if zz["kv_recv_busiest"] else None
    return rows


def plan_summaries(rows: list[dict]) -> list[dict]:
    """Worst case over the drawn batches, per (P, mix, token weight, layout)."""
    out = []
    keys = dict.fromkeys((r["seq_len"], r["world_size"], r["mix"], r["token_weight"], r["layout"]) for r in rows)
    for L, P, mix, tw, name in keys:
        mine = [r for r in rows if (r["seq_len"], r["world_size"], r["mix"], r["token_weight"], r["layout"]) ==
                (L, P, mix, tw, name)]
        kv_zig = [r["kv_vs_zigzag"] for r in mine if r["kv_vs_zigzag"] is not None]
        out.append(dict(
            kind="plan_summary", seq_len=L, world_size=P, mix=mix, token_weight=tw, layout=name,
            seeds=[r["seed"] for r in mine],
            busiest_over_mean=max(r["busiest_over_mean"] for r in mine),
            token_spread=max(r["token_spread"] for r in mine),
            kv_recv_busiest=max(r["kv_recv_busiest"] for r in mine),
            kv_vs_full_ring=max(r["kv_vs_full_ring"] for r in mine),
            kv_vs_zigzag=max(kv_zig) if kv_zig else None,
            layout_ms=max(r["layout_ms"] for r in mine), planning_ms=max(r["planning_ms"] for r in mine),
            kernel_calls_max=max(r["kernel_calls_max"] for r in mine),
            predicted_speedup_over_zigzag=min(r["predicted_speedup_over_zigzag"] for r in mine)))
    return out


def _layouts_rank_main(rank, world_size, cfg):
    """One spawned rank: forward+backward of every layer of each mix under each layout, the layouts
    interleaved (rotating order) after a barrier; per layout the kernel and wall seconds of every
    repeat, the rank's summed output of the last one, and its forward kernel calls and varlen query
    sequences over the layers."""
    device, comm = harness.rank_device(rank, cfg)
    group = comm.group
    full = harness.attention_inputs(cfg, device)
    L = cfg["seq_len"]
    meta = harness.MaskCase(name="documents", spec=cp_attention.MaskSpec(), documents=tuple(cfg["documents"])).meta(L)
    itemsize = full[1].element_size()
    timed = harness.timed_backend(cfg, device, full[0].dtype)
    scale = cfg["head_dim"] ** -0.5
    records = []
    for mix, layouts in cfg["layouts"].items():
        runs, shapes = {}, {}
        for name, layout in layouts.items():
            shards = [layout_mod.shard(t, 1, world_size, layout, rank).contiguous() for t in full]
            plans = [(build_plan(meta, cp_attention.MaskSpec(**mask), world_size=world_size, layout=layout, rank=rank,
                                 head_kv=cfg["kv_heads"], head_dim=cfg["head_dim"], itemsize=itemsize), count)
                     for mask, count in layer_masks(mix)]
            runs[name] = (shards, plans)
            calls = [c for plan, count in plans for _ in range(count) for s in plan.steps() for c in s.calls]
            shapes[name] = (len(calls), sum(c.cu_seqlens_q.numel() - 1 for c in calls))

        def step(name):
            shards, plans = runs[name]
            total = None
            for plan, count in plans:
                for _ in range(count):
                    out = harness.ring_step(plan, shards, comm, timed, scale).float()
                    total = out if total is None else total + out
            return total

        names = list(runs)
        compute = {n: [] for n in names}
        wall = {n: [] for n in names}
        outs = {}
        for i in range(cfg["warmup"] + cfg["repeats"]):
            for name in names[i % len(names):] + names[:i % len(names)]:
                outs[name], seconds, elapsed = harness.timed_step(
                    timed, lambda: step(name), before=lambda: dist.barrier(group=group),
                    sync=lambda: harness.synchronize(device))
                if i >= cfg["warmup"]:
                    compute[name].append(seconds)
                    wall[name].append(elapsed)
        records.append(dict(mix=mix, rank=rank, compute_s=compute, wall_s=wall,
                            kernel_calls={n: c for n, (c, _) in shapes.items()},
                            varlen_sequences={n: q for n, (_, q) in shapes.items()},
                            out={n: o.cpu().numpy() for n, o in outs.items()}))  # numpy: no shared memory
    return records


def real_ranks(cfg: dict, P: int, timeout: float) -> list[dict]:
    """Spawned ranks at world size ``P`` on one drawn batch: per (mix, layout) the slowest rank's
    compute and wall time as ratios to zigzag's, the plan's prediction, and the output's largest
    difference from zigzag's."""
    L = cfg["seq_len"]
    pos = draw_positions(L, cfg["seed"])
    layouts = {mix: {name: _make_layout(name, pos, P, mix, 0.0) for name in LAYOUT_NAMES} for mix in cfg["mixes"]}
    run_cfg = dict(cfg, documents=document_lengths_of(pos), layouts=layouts)
    per_rank = run_ranks(P, _layouts_rank_main, run_cfg, timeout=timeout)
    rows = []
    for mix in cfg["mixes"]:
        recs = sorted((rec for recs in per_rank for rec in recs if rec["mix"] == mix), key=lambda r: r["rank"])
        full = {name: layout_mod.unshard([torch.from_numpy(rec["out"][name]) for rec in recs], 1, layouts[mix][name])
                for name in LAYOUT_NAMES}
        plans = {}
        for name in LAYOUT_NAMES:
            stats, plan_s = _rank_stats(layouts[mix][name], P, pos, mix)
            plans[name] = layout_row(name, layouts[mix][name], 0.0, stats, plan_s, L=L, P=P, mix=mix, token_weight=0.0)
        for name in LAYOUT_NAMES:
            compute = [statistics.median(rec["compute_s"][name]) for rec in recs]
            wall = [statistics.median(rec["wall_s"][name]) for rec in recs]
            rows.append(dict(
                kind="ranks", seq_len=L, world_size=P, mix=mix, layout=name, seed=cfg["seed"],
                compute_s_per_rank=compute, wall_s_per_rank=wall, compute_s_max=max(compute), wall_s_max=max(wall),
                compute_s_runs=[rec["compute_s"][name] for rec in recs],
                kernel_calls_per_rank=[rec["kernel_calls"][name] for rec in recs],
                varlen_sequences_per_rank=[rec["varlen_sequences"][name] for rec in recs],
                tokens_per_rank=plans[name]["tokens_per_rank"], busiest_over_mean=plans[name]["busiest_over_mean"],
                entries_visible_per_rank=plans[name]["entries_visible_per_rank"],
                entries_computed_per_rank=plans[name]["entries_computed_per_rank"],
                max_abs_diff_vs_zigzag=float((full[name] - full["zigzag"]).abs().max())))
        zz = rows[-len(LAYOUT_NAMES)]
        for r in rows[-len(LAYOUT_NAMES):]:
            r["compute_speedup_over_zigzag"] = zz["compute_s_max"] / r["compute_s_max"]
            r["wall_speedup_over_zigzag"] = zz["wall_s_max"] / r["wall_s_max"]
            r["predicted_speedup_over_zigzag"] = (max(zz["entries_visible_per_rank"]) /
                                                  max(r["entries_visible_per_rank"]))
            r["predicted_speedup_computed_entries"] = (max(zz["entries_computed_per_rank"]) /
                                                       max(r["entries_computed_per_rank"]))
    return rows


def layouts_tables(results: list[dict]) -> list[str]:
    """The markdown tables of a ``cp_layouts`` run: plan level (worst case over the batches), real ranks."""
    summary = [r for r in results if r["kind"] == "plan_summary"]
    lines = []
    if summary:
        lines += ["| L | P | layers | token weight | busiest / mean: zigzag | contiguous | balanced | "
                  "max tokens / (L/P): zigzag | contiguous | balanced | busiest K/V vs full ring: zigzag | "
                  "contiguous | balanced | planning ms: zigzag | contiguous | balanced | "
                  "predicted speedup over zigzag: contiguous | balanced | kernel calls, busiest: zigzag | "
                  "balanced |",
                  "|---:|---:|---|---:|" + "---:|" * 15]
        for L, P, mix, tw in dict.fromkeys((s["seq_len"], s["world_size"], s["mix"], s["token_weight"])
                                           for s in summary):
            by = {s["layout"]: s for s in summary
                  if (s["seq_len"], s["world_size"], s["mix"], s["token_weight"]) == (L, P, mix, tw)}
            cells = [f"{by[n]['busiest_over_mean']:.3f}" for n in LAYOUT_NAMES]
            cells += [f"{by[n]['token_spread']:.3f}" for n in LAYOUT_NAMES]
            cells += [f"{by[n]['kv_vs_full_ring']:.3f}" for n in LAYOUT_NAMES]
            cells += [f"{by[n]['planning_ms']:.0f}" for n in LAYOUT_NAMES]
            cells += [f"{by[n]['predicted_speedup_over_zigzag']:.2f}x" for n in ("contiguous", "balanced")]
            cells += [f"{by[n]['kernel_calls_max']}" for n in ("zigzag", "balanced")]
            lines.append(f"| {L} | {P} | {mix} | {tw:g} | " + " | ".join(cells) + " |")
    ranks = [r for r in results if r["kind"] == "ranks"]
    if ranks:
        lines += ["", "| L | P | layers | layout | busiest / mean (plan) | predicted speedup over zigzag: visible "
                      "pairs | computed entries | measured: compute | wall | kernel calls / varlen sequences "
                      "(most on a rank) | max abs diff vs zigzag |",
                  "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in ranks:
            lines.append(f"| {r['seq_len']} | {r['world_size']} | {r['mix']} | {r['layout']} | "
                         f"{r['busiest_over_mean']:.3f} | {r['predicted_speedup_over_zigzag']:.2f}x | "
                         f"{r['predicted_speedup_computed_entries']:.2f}x | {r['compute_speedup_over_zigzag']:.2f}x | "
                         f"{r['wall_speedup_over_zigzag']:.2f}x | {max(r['kernel_calls_per_rank'])} / "
                         f"{max(r['varlen_sequences_per_rank'])} | {r['max_abs_diff_vs_zigzag']:.1e} |")
    return lines


def main(argv=None) -> int:
    """The plan-level table over world sizes, then the real ranks; one JSON file."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_run_arguments(parser, warmup=1, repeats=3, smoke="tiny shapes", threads="torch threads per rank on CPU")
    harness.add_shape_arguments(parser, masks=False)
    parser.add_argument("--world-sizes", type=int, nargs="+", help="world sizes of the plan-level table")
    parser.add_argument("--seq-len", type=int, help="tokens of the plan-level batches")
    parser.add_argument("--timeout", type=float, default=3600.0, help="per world size, spawned ranks")
    parser.add_argument("--mixes", nargs="+", choices=list(MIXES), help="the model's attention layers")
    parser.add_argument("--token-weights", nargs="+", type=float,
                        help="dense per-token work in units of one visible pair of one layer (balanced_layout's)")
    parser.add_argument("--seeds", type=int, help="drawn batches per plan-level line (worst case reported)")
    parser.add_argument("--first-seed", type=int, help="seed of the first drawn batch (also the real ranks' batch)")
    parser.add_argument("--rank-seq-len", type=int, help="tokens of the batch the real ranks run")
    parser.add_argument("--rank-world-sizes", type=int, nargs="*",
                        help="world sizes of the real-rank timings (none: skip them)")
    args = parser.parse_args(argv)
    device = harness.pick_device(args.device)
    defaults = LAYOUTS_SMOKE if args.smoke else (LAYOUTS_GPU if device.type == "cuda" else LAYOUTS_CPU)
    L = args.seq_len or defaults["seq_len"]
    world_sizes = args.world_sizes or defaults["world_sizes"]
    mixes = args.mixes or defaults["mixes"]
    token_weights = defaults["token_weights"] if args.token_weights is None else args.token_weights
    first = defaults["first_seed"] if args.first_seed is None else args.first_seed
    seeds = list(range(first, first + (args.seeds or defaults["seeds"])))
    rank_sizes = defaults["rank_world_sizes"] if args.rank_world_sizes is None else args.rank_world_sizes
    for P in world_sizes + rank_sizes:
        if P < 2:
            raise SystemExit(f"world sizes must be >= 2 to compare layouts, got {P}")
    rank_cfg = dict(seq_len=args.rank_seq_len or defaults["rank_seq_len"], mixes=mixes,
                    heads=args.heads or defaults["heads"], kv_heads=args.kv_heads or defaults["kv_heads"],
                    head_dim=args.head_dim or defaults["head_dim"], dtype=args.dtype or defaults["dtype"],
                    backend=args.backend or ("reference" if device.type == "cpu" else "auto"),
                    warmup=0 if args.smoke else args.warmup, repeats=1 if args.smoke else args.repeats,
                    threads=args.threads, device=device.type, seed=first)
    started = time.perf_counter()
    rows, cache = [], {}
    for P in world_sizes:
        t0 = time.perf_counter()
        for mix in mixes:
            for tw in token_weights:
                for seed in seeds:
                    rows.extend(plan_level(L, P, mix, tw, seed, cache))
        cache.clear()
        print(f"plans at P = {P} done in {time.perf_counter() - t0:.0f}s", flush=True)
    plan_s = time.perf_counter() - started
    batches = [dict(kind="batch", seq_len=L, seed=s, document_lengths=document_lengths_of(draw_positions(L, s)))
               for s in seeds]
    ranks = []
    if rank_sizes:
        rank_L = rank_cfg["seq_len"]
        batches.append(dict(kind="batch", seq_len=rank_L, seed=first,
                            document_lengths=document_lengths_of(draw_positions(rank_L, first))))
    for P in rank_sizes:
        t0 = time.perf_counter()
        ranks.extend(real_ranks(rank_cfg, P, args.timeout))
        print(f"real ranks at P = {P} done in {time.perf_counter() - t0:.0f}s", flush=True)
    results = batches + rows + plan_summaries(rows) + ranks
    config = dict(
        seq_len=L, world_sizes=world_sizes, mixes={m: MIXES[m] for m in mixes}, token_weights=token_weights,
        seeds=seeds, layouts=list(LAYOUT_NAMES), documents="bench_layouts.draw_positions: lognormal lengths, "
        "median 1000 tokens, positions restart per document", plan_kv=dict(head_kv=PLAN_KV["head_kv"],
                                                                            head_dim=PLAN_KV["head_dim"],
                                                                            dtype="bfloat16"),
        work="entries_visible of every rank's plan summed over the mix's layers + token_weight x tokens",
        predicted_speedup="step waits for the busiest rank: zigzag's busiest work / the layout's",
        planning="layout + the slowest rank's plans of the mix's distinct masks (plan_stats): CPU time of "
                 "this one thread",
        plan_seconds=plan_s, ranks=dict(rank_cfg, world_sizes=rank_sizes), rank_seconds=time.perf_counter() - started -
        plan_s, compute_time=("CUDA events around kernel calls" if device.type == "cuda"
                              else "CPU time of the rank's thread inside kernel calls"))
    harness.finish_run(args, "cp_layouts", device, config, results, layouts_tables(results), started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
