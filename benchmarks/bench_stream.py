"""The balanced layout's two partitions side by side at hundreds of ranks: the search of steps 1-4
(used up to 64 ranks) and the stream (above), on the same batches.

    OMP_NUM_THREADS=1 python benchmarks/bench_stream.py --out benchmarks/results/cpu
    python benchmarks/bench_stream.py --smoke

Batches: ``bench_planning.py``'s (lognormal documents, sigma 1, filling 1M tokens: ``--docs``
documents), the layer mixes of its ``--scale`` run. Per partition: the busiest rank's cost over the
mean (cost: visible pairs summed over the layers, ``token_costs``), the most tokens on a rank over
L / P (cap 1.25), the K/V tokens the busiest receiver receives under the layer that reaches
furthest and the mean over the ranks (the planner's count for a rank holding those runs:
``cp_attention.layout.costs.Traffic``), and the layout's time (ms, one thread). Writes
``stream.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_planning import MIXES, packed_inputs  # noqa: E402
from cp_attention.layout import balanced as balanced_mod  # noqa: E402
from cp_attention.layout import token_costs  # noqa: E402
from cp_attention.layout.costs import Traffic, layer_specs  # noqa: E402
from cp_attention.masks import SequenceMeta  # noqa: E402


def quality(meta: SequenceMeta, layout, masks: list) -> dict:
    """Busiest cost / mean, max tokens / (L / P), busiest and mean K/V tokens received."""
    L, P = meta.seq_len, layout.world_size
    cost = token_costs(meta, masks).cumsum(0)
    prefix = torch.cat([torch.zeros(1, dtype=cost.dtype), cost])
    loads = [sum(float(prefix[b] - prefix[a]) for a, b in runs) for runs in layout.ranges]
    traffic = Traffic(meta, layer_specs(masks))
    recv = [traffic.recv(list(runs))[0] for runs in layout.ranges]
    return dict(busiest_over_mean=max(loads) / (sum(loads) / P),
                max_tokens_over_mean=max(layout.local_lengths()) / (L / P),
                recv_busiest=max(recv), recv_mean=sum(recv) / P)


def measure(L: int, P: int, docs: int, mix: str, seed: int, search: bool) -> dict:
    meta = SequenceMeta.from_inputs(1, L, **packed_inputs(L, docs, seed, "cu_seqlens"))
    masks = [dict(causal=m.causal, window=m.window, chunk_size=m.chunk_size) for m in MIXES[mix]]
    saved = balanced_mod.STREAM_ABOVE
    balanced_mod.STREAM_ABOVE = 1 << 30 if search else 0
    try:
        start = time.perf_counter()
        layout = balanced_mod.balanced_layout_of(meta, P, masks=masks)
        ms = 1e3 * (time.perf_counter() - start)
    finally:
        balanced_mod.STREAM_ABOVE = saved
    return dict(layout_ms=ms, **quality(meta, layout, masks))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=1048576, help="tokens per row")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[128, 256, 1024])
    parser.add_argument("--docs", type=int, nargs="+", default=[1000, 10000], help="documents per row")
    parser.add_argument("--seeds", type=int, default=2, help="drawn batches per configuration")
    parser.add_argument("--smoke", action="store_true", help="a small batch, one seed")
    parser.add_argument("--out", default=None, help="folder for stream.json")
    args = parser.parse_args(argv)
    if args.smoke:
        args.length, args.world_sizes, args.docs, args.seeds = 65536, [128], [200], 1
    torch.set_num_threads(1)
    records = []
    print("| L | documents | P | mix | partition | busiest / mean | max tokens / (L/P) | busiest K/V recv | "
          "mean K/V recv | layout ms |")
    print("|---:|---:|---:|---|---|---:|---:|---:|---:|---:|")
    for P in args.world_sizes:
        for docs in args.docs:
            for mix in MIXES:
                for search in (True, False):
                    runs = [measure(args.length, P, docs, mix, seed, search) for seed in range(args.seeds)]
                    row = dict(L=args.length, P=P, docs=docs, mix=mix, partition="search" if search else "stream",
                               busiest_over_mean=max(r["busiest_over_mean"] for r in runs),
                               max_tokens_over_mean=max(r["max_tokens_over_mean"] for r in runs),
                               recv_busiest=sum(r["recv_busiest"] for r in runs) / len(runs),
                               recv_mean=sum(r["recv_mean"] for r in runs) / len(runs),
                               layout_ms=sum(r["layout_ms"] for r in runs) / len(runs))
                    records.append(row)
                    print(f"| {row['L']} | {docs} | {P} | {mix} | {row['partition']} | "
                          f"{row['busiest_over_mean']:.3f} | {row['max_tokens_over_mean']:.3f} | "
                          f"{row['recv_busiest']:.0f} | {row['recv_mean']:.0f} | {row['layout_ms']:.0f} |", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "stream.json"), "w") as f:
            json.dump(dict(note="worst busiest/mean and max tokens over the seeds; K/V tokens and ms: the seeds' mean",
                           seeds=args.seeds, records=records), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
