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

SOURCES = ("cu_seqlens", "position_ids")
MASKS = {"causal": MaskSpec(), "window-4096": MaskSpec(window=4096), "chunked-8192": MaskSpec(chunk_size=8192)}


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[131072, 1048576], help="tokens per row")
    parser.add_argument("--world-size", type=int, default=8, help="P (default 8)")
    parser.add_argument("--docs", type=int, default=1000, help="documents per row (default 1000)")
    parser.add_argument("--repeats", type=int, default=7, help="runs per configuration, median reported")
    parser.add_argument("--sources", nargs="+", default=list(SOURCES), choices=SOURCES,
                        help="what the metadata is built from (default both)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, two repeats")
    parser.add_argument("--out", default=None, help="directory for planning.json")
    args = parser.parse_args(argv)
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
