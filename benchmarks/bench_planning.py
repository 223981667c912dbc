"""Planning time per step: layout + document metadata + one rank's plan, on one CPU thread.

    OMP_NUM_THREADS=1 python benchmarks/bench_planning.py --out benchmarks/results/cpu   # 128k and 1M tokens
    python benchmarks/bench_planning.py --smoke                                          # tiny, seconds
    python benchmarks/bench_planning.py --sources cu_seqlens                             # one input form

A packed data loader gives a new document layout every step, so a rank pays this every step: the
global document metadata (``SequenceMeta.from_inputs``, what ``cp.shard_batch`` computes) from the
batch's ``cu_seqlens`` or its ``position_ids`` (``--sources``, default both), the balanced layout of
those documents (``balance.balanced_layout_of``, as ``shard_batch`` calls it; zigzag costs nothing)
and its own plan for each mask (``cp_attention.build_plan``). Documents: ``--docs`` documents
(default 1000) with lognormal lengths (sigma 1) scaled to fill the row, so the same number of
documents at every length. Metadata from ``cu_seqlens`` and the layout and plan from either source
cost per document, nothing per token; metadata from ``position_ids`` reads them once per token
(O(L): its ``metadata ms`` column). Reported: the median over ``--repeats`` runs of each part, in
milliseconds, and the ratios at 1M tokens to 128k of layout + plan (the issue's measure) and of the
total with the metadata. Each configuration is also timed with torch using every core
(``torch.set_num_threads(os.cpu_count())``), the setting of a training process: the planner must
not slow down there.

``--scale`` measures how planning grows with the world size (issue #36), one rank's view, one
thread, from ``cu_seqlens``: for P in ``--world-sizes`` (default 8 ... 1024), L in ``--lengths``
(default 128k, 1M, 4M tokens) and ``--docs-list`` (default 1,000 and 10,000 documents), and the
layer mixes of :data:`MIXES` (one plan per distinct mask), the balanced layout, this rank's ring plan
of every distinct mask, and per distinct mask ``strategy="auto"``'s choice (every candidate priced,
``strategies.choice.price``) and the chosen candidate's plan of this rank (H 64 / K 8 / D 128, float16
K/V); and the whole step's planning under auto. Prints the table, the growth exponent in P (64 to the largest P) and in L (smallest to
largest length), and writes ``planning_scale.json`` and ``planning_scale.png`` to ``--out``. A
configuration whose previous world size took more than ``--budget`` seconds is skipped (marked).

    OMP_NUM_THREADS=1 python benchmarks/bench_planning.py --scale --out benchmarks/results/cpu
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cp_attention.layout import balanced_layout_of  # noqa: E402
from cp_attention.masks import MaskSpec, SequenceMeta  # noqa: E402
from cp_attention.plan import build_plan  # noqa: E402
from cp_attention.strategies.choice import CostModel, price, rank_plans  # noqa: E402

SOURCES = ("cu_seqlens", "position_ids")
MASKS = {"causal": MaskSpec(), "window-4096": MaskSpec(window=4096), "chunked-8192": MaskSpec(chunk_size=8192)}
MIXES = {"causal": [MaskSpec()], "window-4096": [MaskSpec(window=4096)], "chunked-8192": [MaskSpec(chunk_size=8192)],
         "window-1024": [MaskSpec(window=1024)], "gemma-3 (5 x window-1024 + full)": [MaskSpec(window=1024)] * 5 + [MaskSpec()]}
"""The layer mixes of ``--scale``: the layout sees every layer, one plan per distinct mask."""
SHAPE = dict(heads=64, kv_heads=8, head_dim=128, head_dim_v=128, itemsize=2)


def packed_lengths(L: int, docs: int, seed: int) -> np.ndarray:
    """(docs,) lognormal document lengths scaled to fill ``L`` tokens."""
    rng = np.random.default_rng(seed)
    weights = rng.lognormal(0.0, 1.0, docs)
    lengths = np.maximum(1, (weights / weights.sum() * L).astype(np.int64))
    lengths[np.argmax(lengths)] += L - int(lengths.sum())
    return lengths


def packed_positions(L: int, docs: int, seed: int) -> torch.Tensor:
    """(1, L) position ids of the documents of :func:`packed_lengths`, restarting at 0 in each."""
    return torch.from_numpy(np.concatenate([np.arange(n) for n in packed_lengths(L, docs, seed)]))[None]


def packed_inputs(L: int, docs: int, seed: int, source: str) -> dict:
    """The documents of :func:`packed_lengths` as ``SequenceMeta.from_inputs`` takes them from
    ``source``: ``cu_seqlens`` (docs + 1,) or ``position_ids`` (:func:`packed_positions`)."""
    if source == "cu_seqlens":
        return dict(cu_seqlens=torch.from_numpy(np.concatenate([[0], np.cumsum(packed_lengths(L, docs, seed))])))
    return dict(position_ids=packed_positions(L, docs, seed))


def time_once(inputs: dict, L: int, P: int, layout_name: str, spec: MaskSpec, rank: int) -> dict:
    t0 = time.perf_counter()
    meta = SequenceMeta.from_inputs(1, L, **inputs)
    t1 = time.perf_counter()
    layout = balanced_layout_of(meta, P, masks=[dict(causal=spec.causal, window=spec.window,
                                                     chunk_size=spec.chunk_size)]) \
        if layout_name == "balanced" else layout_name
    t2 = time.perf_counter()
    build_plan(meta, spec, world_size=P, layout=layout, rank=rank, head_kv=8, head_dim=128, itemsize=2, verify=False)
    t3 = time.perf_counter()
    return dict(meta_ms=1e3 * (t1 - t0), layout_ms=1e3 * (t2 - t1), plan_ms=1e3 * (t3 - t2),
                layout_plan_ms=1e3 * (t3 - t1), total_ms=1e3 * (t3 - t0))


def measure(L: int, P: int, docs: int, source: str, layout_name: str, mask: str, repeats: int,
            threads: int) -> dict:
    torch.set_num_threads(threads)
    runs = []
    for i in range(repeats):
        inputs = packed_inputs(L, docs, i, source)
        runs.append(time_once(inputs, L, P, layout_name, MASKS[mask], rank=i % P))
    torch.set_num_threads(1)
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def scale_once(L: int, P: int, docs: int, mix: str, seed: int) -> dict:
    """One step's planning at scale, one rank's view: (ms) metadata from cu_seqlens, balanced layout,
    this rank's ring plans of the distinct masks; per distinct mask, ``strategy="auto"``'s choice (every
    candidate priced) and the chosen candidate's plan of this rank; and the step under auto."""
    rank = seed % P
    t0 = time.perf_counter()
    meta = SequenceMeta.from_inputs(1, L, **packed_inputs(L, docs, seed, "cu_seqlens"))
    t1 = time.perf_counter()
    layers = MIXES[mix]
    layout = balanced_layout_of(meta, P, masks=[dict(causal=m.causal, window=m.window, chunk_size=m.chunk_size)
                                                for m in layers])
    t2 = time.perf_counter()
    distinct = list(dict.fromkeys(layers))
    for spec in distinct:
        build_plan(meta, spec, world_size=P, layout=layout, rank=rank, head_kv=SHAPE["kv_heads"],
                   head_dim=SHAPE["head_dim"], itemsize=SHAPE["itemsize"], verify=False)
    t3 = time.perf_counter()
    choice_s = chosen_s = 0.0
    for spec in distinct:
        s0 = time.perf_counter()
        cand, _ = price(meta, spec, layout, P, CostModel(), **SHAPE)
        s1 = time.perf_counter()
        rank_plans(meta, spec, cand, layout, ranks=(rank,), **SHAPE)
        choice_s, chosen_s = choice_s + s1 - s0, chosen_s + time.perf_counter() - s1
    n = len(distinct)
    return dict(meta_ms=1e3 * (t1 - t0), layout_ms=1e3 * (t2 - t1), plan_ms=1e3 * (t3 - t2),
                layout_plan_ms=1e3 * (t3 - t1), auto_ms_per_mask=1e3 * choice_s / n,
                auto_plan_ms_per_mask=1e3 * chosen_s / n, auto_step_ms=1e3 * (t2 - t1 + choice_s + chosen_s))


def exponent(xs: list, ys: list) -> float | None:
    """The least-squares slope of log y against log x (None with fewer than two points)."""
    if len(xs) < 2:
        return None
    return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


def run_scale(args) -> int:
    torch.set_num_threads(1)
    records, slow = [], set()
    print("| L | docs | mix | P | metadata ms | layout ms | plan ms | layout + plan ms | auto's choice ms per mask | "
          "auto's plan ms per mask | step under auto ms |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for L in args.lengths:
        for docs in args.docs_list:
            for mix in MIXES:
                for P in args.world_sizes:
                    key = (L, docs, mix)
                    if key in slow:
                        records.append(dict(L=L, docs=docs, mix=mix, P=P, skipped=True))
                        print(f"| {L} | {docs} | {mix} | {P} | skipped: the previous P took over {args.budget} s |")
                        continue
                    start = time.perf_counter()
                    runs = [scale_once(L, P, docs, mix, seed) for seed in range(args.repeats)]
                    row = dict(L=L, docs=docs, mix=mix, P=P, **{k: statistics.median(r[k] for r in runs) for k in runs[0]})
                    records.append(row)
                    print(f"| {L} | {docs} | {mix} | {P} | {row['meta_ms']:.1f} | {row['layout_ms']:.1f} | "
                          f"{row['plan_ms']:.1f} | {row['layout_plan_ms']:.1f} | {row['auto_ms_per_mask']:.1f} | "
                          f"{row['auto_plan_ms_per_mask']:.1f} | {row['auto_step_ms']:.1f} |",
                          flush=True)
                    if (time.perf_counter() - start) / args.repeats > args.budget:
                        slow.add(key)
    done = [r for r in records if not r.get("skipped")]
    growth = []
    print("\nGrowth exponents (log-log slope; P log P from 64 to 1024 is 1.18):")
    for L in args.lengths:
        for docs in args.docs_list:
            for mix in MIXES:
                mine = sorted((r for r in done if (r["L"], r["docs"], r["mix"]) == (L, docs, mix) and r["P"] >= 64),
                              key=lambda r: r["P"])
                g = dict(L=L, docs=docs, mix=mix, P_from=64, P_to=mine[-1]["P"] if mine else None,
                         layout_plan=exponent([r["P"] for r in mine], [r["layout_plan_ms"] for r in mine]),
                         auto=exponent([r["P"] for r in mine], [r["auto_ms_per_mask"] for r in mine]))
                growth.append(g)
                fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
                print(f"  in P, L={L} docs={docs} {mix}: layout + plan {fmt(g['layout_plan'])}, auto {fmt(g['auto'])}")
    for P in args.world_sizes:
        for docs in args.docs_list:
            for mix in MIXES:
                mine = sorted((r for r in done if (r["P"], r["docs"], r["mix"]) == (P, docs, mix)), key=lambda r: r["L"])
                e = exponent([r["L"] for r in mine], [r["layout_plan_ms"] for r in mine])
                growth.append(dict(P=P, docs=docs, mix=mix, in_L=e))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "planning_scale.json"), "w") as f:
            json.dump(dict(note="median ms per step, one thread, one rank's view, from cu_seqlens; layout + this "
                                "rank's plans of the distinct masks; auto's choice per distinct mask",
                           records=records, growth=growth), f, indent=1)
        plot_scale(done, os.path.join(args.out, "planning_scale.png"))
    return 0


def plot_scale(records: list, path: str) -> None:
    """Layout + plan and auto per mask against P, log-log, the worst over lengths and documents."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, key, title in ((axes[0], "layout_plan_ms", "balanced layout + one rank's plans"),
                           (axes[1], "auto_ms_per_mask", "auto's choice, per mask")):
        for mix in MIXES:
            Ps = sorted({r["P"] for r in records if r["mix"] == mix})
            worst = [max(r[key] for r in records if r["mix"] == mix and r["P"] == P) for P in Ps]
            if Ps:
                ax.loglog(Ps, worst, marker="o", label=mix)
        ax.axhline(50, color="grey", ls=":", lw=1)
        ax.axhline(500, color="grey", ls="--", lw=1)
        ax.set_xlabel("ranks P")
        ax.set_title(title)
    axes[0].set_ylabel("ms (worst over L and documents)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[131072, 1048576], help="tokens per row")
    parser.add_argument("--world-size", type=int, default=8, help="P (default 8)")
    parser.add_argument("--docs", type=int, default=1000, help="documents per row (default 1000)")
    parser.add_argument("--repeats", type=int, default=7, help="runs per configuration, median reported")
    parser.add_argument("--sources", nargs="+", default=list(SOURCES), choices=SOURCES,
                        help="what the metadata is built from (default both)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, two repeats")
    parser.add_argument("--out", default=None, help="directory for planning.json (planning_scale.json/.png)")
    parser.add_argument("--scale", action="store_true", help="growth with the world size (see above)")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256, 512, 1024],
                        help="--scale: world sizes")
    parser.add_argument("--docs-list", type=int, nargs="+", default=[1000, 10000], help="--scale: documents per row")
    parser.add_argument("--budget", type=float, default=30.0, help="--scale: seconds per configuration before "
                        "larger world sizes of it are skipped")
    args = parser.parse_args(argv)
    if args.scale:
        if args.lengths == [131072, 1048576]:
            args.lengths = [131072, 1048576, 4194304]
        if args.smoke:
            args.lengths, args.world_sizes, args.docs_list, args.repeats = [8192], [4, 128], [60], 1
        elif args.repeats == 7:
            args.repeats = 3
        return run_scale(args)
    if args.smoke:
        args.lengths, args.docs, args.repeats = [4096, 16384], 50, 2
    torch.set_num_threads(1)
    records = []
    many = os.cpu_count() or 1
    for source in args.sources:
        for mask in MASKS:
            for layout_name in ("zigzag", "balanced"):
                for L in args.lengths:
                    row = dict(L=L, P=args.world_size, docs=args.docs, source=source, mask=mask, layout=layout_name,
                               **measure(L, args.world_size, args.docs, source, layout_name, mask, args.repeats, 1))
                    row["total_ms_all_threads"] = measure(L, args.world_size, args.docs, source, layout_name, mask,
                                                          max(1, args.repeats // 2), many)["total_ms"]
                    records.append(row)
    print(f"| source | mask | layout | L | metadata ms | layout ms | plan ms | layout + plan ms | ... / same at "
          f"{args.lengths[0]} | total ms | total / same at {args.lengths[0]} | total, {many} torch threads |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in records:
        base = next(x for x in records if (x["source"], x["mask"], x["layout"]) == (r["source"], r["mask"], r["layout"])
                    and x["L"] == args.lengths[0])
        r["layout_plan_ratio_to_first_length"] = r["layout_plan_ms"] / base["layout_plan_ms"]
        r["ratio_to_first_length"] = r["total_ms"] / base["total_ms"]
        print(f"| {r['source']} | {r['mask']} | {r['layout']} | {r['L']} | {r['meta_ms']:.1f} | {r['layout_ms']:.1f} | "
              f"{r['plan_ms']:.1f} | {r['layout_plan_ms']:.1f} | {r['layout_plan_ratio_to_first_length']:.2f} | "
              f"{r['total_ms']:.1f} | {r['ratio_to_first_length']:.2f} | {r['total_ms_all_threads']:.1f} |")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "planning.json"), "w") as f:
            json.dump(dict(note="median ms per step on one CPU thread; layout + metadata (from each record's "
                                "source) + one rank's plan",
                           records=records), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
