"""Layouts for packed batches, from the plans alone (no kernels, no process group): per layout
(zigzag, contiguous, balanced) on drawn packed rows of a realistic document-length mix, the busiest
rank's cost over the mean, the largest token count over L / P, the busiest rank's received K/V
bytes (against zigzag's and a full ring's) and the time to compute the layout.

    python benchmarks/bench_layouts.py --out benchmarks/results/cpu           # the default grid
    python benchmarks/bench_layouts.py --grid 32768x4 --seeds 1 --traffic-seeds 1

Documents: lognormal lengths (median 1000 tokens, sigma 1.2, capped by the row), positions restart
per document. Cost: visible (query, key) pairs summed over the layer mix + token_weight x tokens
(``cp_attention.balance.token_costs``). Traffic: forward K/V bytes received by the busiest rank for
the mix's most demanding layer (its full layer if it has one), bfloat16, 8 K/V heads of 128.
A simple step-time model: the step waits for the busiest rank, so the predicted speedup of balanced
over zigzag is zigzag's busiest cost over balanced's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

import cp_attention
from cp_attention.balance import token_costs
from cp_attention.layout import Layout
from cp_attention.masks import SequenceMeta, doc_starts

MIXES = {"causal": [{}], "window-4096": [{"window": 4096}], "5x window-1024 + full": [{"window": 1024}] * 5 + [{}]}


def draw_positions(L: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < L:
        n = int(math.exp(math.log(1000) + 1.2 * float(torch.randn(1, generator=g))))
        lengths.append(max(2, min(n, L - sum(lengths))))
    return torch.cat([torch.arange(n) for n in lengths])[None]


def measure(L: int, P: int, mix: str, token_weight: float, seed: int, traffic: bool) -> dict:
    pos = draw_positions(L, seed)
    meta = SequenceMeta(batch=1, seq_len=L, doc_start=doc_starts(1, L, position_ids=pos), position=pos)
    cost = token_costs(meta, MIXES[mix], token_weight)
    heavy = {} if {} in MIXES[mix] else MIXES[mix][0]
    rows = {}
    for name in ("zigzag", "contiguous", "balanced"):
        start = time.perf_counter()
        if name == "balanced":
            layout = cp_attention.balanced_layout(P, position_ids=pos, masks=MIXES[mix], token_weight=token_weight)
        else:
            layout = Layout.named(name, L, P)
        seconds = time.perf_counter() - start
        loads = [float(cost[layout.indices(r)].sum()) for r in range(P)]
        row = dict(busiest_over_mean=max(loads) / (sum(loads) / P),
                   max_tokens_over_mean=max(layout.local_lengths()) / (L / P), layout_seconds=seconds,
                   busiest_cost=max(loads))
        if traffic:
            stats = [cp_attention.plan_stats(layout, r, position_ids=pos, head_kv=8, head_dim=128, **heavy)
                     for r in range(P)]
            row["kv_recv_busiest"] = max(s.kv_bytes_recv for s in stats)
            row["ring_kv_recv"] = stats[0].ring_kv_bytes_recv
        rows[name] = row
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--grid", nargs="+", default=["32768x4", "65536x8", "131072x16"],
                        help="LxP pairs: row length and world size")
    parser.add_argument("--token-weights", nargs="+", type=float, default=[0.0, 3000.0, 30000.0],
                        help="dense per-token work in units of one visible pair of one layer")
    parser.add_argument("--seeds", type=int, default=3, help="drawn batches per configuration")
    parser.add_argument("--traffic-seeds", type=int, default=2, help="of those, how many also get traffic figures")
    parser.add_argument("--out", default=None, help="folder for layouts.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    records = []
    print("| L | P | layers | token weight | busiest / mean: zigzag | contiguous | balanced | max tokens / (L/P): "
          "balanced | busiest K/V: balanced / zigzag | balanced / full ring | predicted speedup over zigzag | "
          "layout ms |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for cell in args.grid:
        L, P = (int(x) for x in cell.split("x"))
        for mix in MIXES:
            for tw in args.token_weights:
                runs = [measure(L, P, mix, tw, seed, traffic=seed < args.traffic_seeds and tw == args.token_weights[0])
                        for seed in range(args.seeds)]
                records.append(dict(L=L, P=P, mix=mix, token_weight=tw, runs=runs))

                def worst(layout, key):
                    return max(r[layout][key] for r in runs)

                kv = [r for r in runs if "kv_recv_busiest" in r["balanced"]]
                kv_zig = max(r["balanced"]["kv_recv_busiest"] / max(r["zigzag"]["kv_recv_busiest"], 1) for r in kv) \
                    if kv else None
                kv_ring = max(r["balanced"]["kv_recv_busiest"] / r["balanced"]["ring_kv_recv"] for r in kv) \
                    if kv else None
                speedup = min(r["zigzag"]["busiest_cost"] / r["balanced"]["busiest_cost"] for r in runs)
                kv_cells = f"{kv_zig:.2f} | {kv_ring:.3f}" if kv else "- | -"
                print(f"| {L} | {P} | {mix} | {tw:g} | {worst('zigzag', 'busiest_over_mean'):.3f} | "
                      f"{worst('contiguous', 'busiest_over_mean'):.3f} | {worst('balanced', 'busiest_over_mean'):.3f} | "
                      f"{worst('balanced', 'max_tokens_over_mean'):.3f} | {kv_cells} | "
                      f"{speedup:.2f}x | {1e3 * worst('balanced', 'layout_seconds'):.0f} |", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "layouts.json"), "w") as f:
            json.dump(dict(note="worst case over the drawn batches per row; plan-level, no kernels", records=records),
                      f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
