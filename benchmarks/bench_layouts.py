"""Layouts for packed batches, from the plans alone (no kernels, no process group): per layout
(zigzag, contiguous, balanced) on drawn packed rows of a realistic document-length mix, the busiest
rank's cost over the mean, the largest token count over L / P, the busiest rank's received K/V
bytes (against zigzag's and a full ring's) and the time to compute the layout.

    python benchmarks/bench_layouts.py --out benchmarks/results/cpu           # the default grid
    python benchmarks/bench_layouts.py --grid 32768x4 --seeds 1 --traffic-seeds 1

Documents: lognormal lengths (median 1000 tokens, sigma 1.2, capped by the row), positions restart
per document. Cost: visible (query, key) pairs summed over the layer mix + token_weight x tokens
(``cp_attention.layout.token_costs``). Traffic: forward K/V bytes received by the busiest rank for
the mix's most demanding layer (its full layer if it has one), bfloat16, 8 K/V heads of 128, from
``cp_attention.plan_stats``. A simple step-time model: the step waits for the busiest rank, so the
predicted speedup of balanced over zigzag is zigzag's busiest cost over balanced's. Layout time is
CPU time (``time.process_time``: a loaded machine does not inflate it).

The goals of issue #14, checked on every drawn batch and summarised after the table:
(a) busiest cost <= 1.05 x mean; (b) no rank above 1.25 x L / P tokens; (c) busiest K/V within
1.25 x zigzag's and at most half a full ring's ((P-1)/P of the row's K/V). The floor column is a lower
bound on (c)'s second ratio for any layout meeting (a) and (b) (:func:`full_ring_floor`): where it
exceeds 0.5 the goals conflict.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

import cp_attention
from cp_attention.layout import token_costs
from cp_attention.layout import Layout
from cp_attention.masks import SequenceMeta

MIXES = {"causal": [{}], "window-4096": [{"window": 4096}], "5x window-1024 + full": [{"window": 1024}] * 5 + [{}]}
HEAD_KV, HEAD_DIM = 8, 128
GOALS = {"a": ("busiest / mean cost", 1.05), "b": ("max tokens / (L/P)", 1.25),
         "c1": ("busiest K/V / zigzag's", 1.25), "c2": ("busiest K/V / full ring's", 0.5)}


def draw_positions(L: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < L:
        n = int(math.exp(math.log(1000) + 1.2 * float(torch.randn(1, generator=g))))
        lengths.append(max(2, min(n, L - sum(lengths))))
    return torch.cat([torch.arange(n) for n in lengths])[None]


def measure(L: int, P: int, mix: str, token_weight: float, seed: int, traffic: bool) -> dict:
    pos = draw_positions(L, seed)
    meta = SequenceMeta.from_inputs(1, L, position_ids=pos)
    cost = token_costs(meta, MIXES[mix], token_weight)
    heavy = {} if {} in MIXES[mix] else MIXES[mix][0]
    rows = {}
    for name in ("zigzag", "contiguous", "balanced"):
        start = time.process_time()
        if name == "balanced":
            layout = cp_attention.balanced_layout(P, position_ids=pos, masks=MIXES[mix], token_weight=token_weight)
        else:
            layout = Layout.named(name, L, P)
        seconds = time.process_time() - start
        loads = [float(cost[layout.indices(r)].sum()) for r in range(P)]
        row = dict(busiest_over_mean=max(loads) / (sum(loads) / P),
                   max_tokens_over_mean=max(layout.local_lengths()) / (L / P), layout_seconds=seconds,
                   busiest_cost=max(loads), documents=int((pos[0] == 0).sum()))
        if traffic and name != "contiguous":
            stats = [cp_attention.plan_stats(layout, r, position_ids=pos, head_kv=HEAD_KV, head_dim=HEAD_DIM, **heavy)
                     for r in range(P)]
            row["kv_recv_busiest"] = max(s.kv_bytes_recv for s in stats)
            row["ring_kv_recv"] = (L - L // P) * 2 * HEAD_KV * HEAD_DIM * 2  # K and V of (P-1)/P of the row, bf16
        rows[name] = row
    rows["full_ring_floor"] = full_ring_floor(pos, MIXES[mix], token_weight, P)
    return rows


def full_ring_floor(pos: torch.Tensor, masks: list, token_weight: float, P: int) -> float:
    """A lower bound on the busiest K/V over a full ring's for any layout meeting goals (a) and (b),
    where the heaviest layer is a full causal one: the rank holding a document's last token receives
    every other token of that document it does not hold, and it holds at most ``s`` of them: the
    token cap, and no more than the document's cheapest (first) tokens costing 1.05 x the mean."""
    if {} not in masks:
        return 0.0
    L = pos.shape[1]
    meta = SequenceMeta.from_inputs(1, L, position_ids=pos)
    csum = torch.cat([torch.zeros(1, dtype=torch.float64), token_costs(meta, masks, token_weight).cumsum(0)])
    budget, cap = GOALS["a"][1] * float(csum[-1]) / P, GOALS["b"][1] * L / P
    starts = torch.nonzero(pos[0] == 0).flatten().tolist() + [L]
    worst = 0
    for a, b in zip(starts[:-1], starts[1:]):
        s = min(int(torch.searchsorted(csum, csum[a] + budget, right=True)) - 1 - a, int(cap), b - a)
        worst = max(worst, b - a - s)
    return worst / (L - L // P)


def goal_values(run: dict) -> dict:
    """Goal name -> this run's value (None where traffic was not measured)."""
    bal, zig = run["balanced"], run["zigzag"]
    out = dict(a=bal["busiest_over_mean"], b=bal["max_tokens_over_mean"], c1=None, c2=None)
    if "kv_recv_busiest" in bal:
        out["c1"] = bal["kv_recv_busiest"] / max(zig["kv_recv_busiest"], 1)
        out["c2"] = bal["kv_recv_busiest"] / bal["ring_kv_recv"]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--grid", nargs="+", default=["32768x4", "65536x8", "131072x16", "262144x32"],
                        help="LxP pairs: row length and world size")
    parser.add_argument("--token-weights", nargs="+", type=float, default=[0.0, 3000.0, 30000.0],
                        help="dense per-token work in units of one visible pair of one layer")
    parser.add_argument("--seeds", type=int, default=3, help="drawn batches per configuration")
    parser.add_argument("--traffic-seeds", type=int, default=None,
                        help="of those, how many also get traffic figures (default: all)")
    parser.add_argument("--out", default=None, help="folder for layouts.json")
    args = parser.parse_args(argv)
    traffic_seeds = args.seeds if args.traffic_seeds is None else args.traffic_seeds
    torch.set_num_threads(1)
    records = []
    print("| L | P | layers | token weight | busiest / mean: zigzag | contiguous | balanced | max tokens / (L/P): "
          "balanced | busiest K/V: balanced / zigzag | balanced / full ring | zigzag / full ring | floor / full ring | "
          "predicted speedup over zigzag | layout ms |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    worst: dict[str, tuple] = {}
    zigzag_over_half, infeasible = [], []
    for cell in args.grid:
        L, P = (int(x) for x in cell.split("x"))
        for mix in MIXES:
            for tw in args.token_weights:
                runs = [measure(L, P, mix, tw, seed, traffic=seed < traffic_seeds) for seed in range(args.seeds)]
                records.append(dict(L=L, P=P, mix=mix, token_weight=tw, runs=runs))
                for seed, run in enumerate(runs):
                    for goal, value in goal_values(run).items():
                        if value is not None and value > worst.get(goal, (-math.inf,))[0]:
                            worst[goal] = (value, L, P, mix, tw, seed)
                    if "kv_recv_busiest" in run["zigzag"]:
                        z = run["zigzag"]["kv_recv_busiest"] / run["zigzag"]["ring_kv_recv"]
                        if z > GOALS["c2"][1]:
                            zigzag_over_half.append((L, P, mix, tw, seed))
                        if run["full_ring_floor"] > GOALS["c2"][1]:
                            infeasible.append(((L, P, mix, tw, seed), goal_values(run)["c2"], run["full_ring_floor"]))

                def worst_of(layout, key):
                    return max(r[layout][key] for r in runs)

                kv = [r for r in runs if "kv_recv_busiest" in r["balanced"]]
                if kv:
                    kv_zig = max(goal_values(r)["c1"] for r in kv)
                    kv_ring = max(goal_values(r)["c2"] for r in kv)
                    zig_ring = max(r["zigzag"]["kv_recv_busiest"] / r["zigzag"]["ring_kv_recv"] for r in kv)
                    floor = max(r["full_ring_floor"] for r in kv)
                    kv_cells = f"{kv_zig:.2f} | {kv_ring:.3f} | {zig_ring:.3f} | {floor:.3f}"
                else:
                    kv_cells = "- | - | - | -"
                speedup = min(r["zigzag"]["busiest_cost"] / r["balanced"]["busiest_cost"] for r in runs)
                print(f"| {L} | {P} | {mix} | {tw:g} | {worst_of('zigzag', 'busiest_over_mean'):.3f} | "
                      f"{worst_of('contiguous', 'busiest_over_mean'):.3f} | "
                      f"{worst_of('balanced', 'busiest_over_mean'):.3f} | "
                      f"{worst_of('balanced', 'max_tokens_over_mean'):.3f} | {kv_cells} | "
                      f"{speedup:.2f}x | {1e3 * worst_of('balanced', 'layout_seconds'):.0f} |", flush=True)
    summary = {}
    print("\nWorst case per goal over every drawn batch:")
    for goal, (name, limit) in GOALS.items():
        if goal not in worst:
            continue
        value, L, P, mix, tw, seed = worst[goal]
        ok = value <= limit
        summary[goal] = dict(name=name, limit=limit, worst=value, met=ok, L=L, P=P, mix=mix, token_weight=tw, seed=seed)
        print(f"  ({goal}) {name} <= {limit}: worst {value:.3f} at L={L} P={P} {mix} token weight {tw:g} seed {seed}"
              f" -> {'met' if ok else 'MISSED'}")
    feasible = [goal_values(r)["c2"] for rec in records for r in rec["runs"]
                if "kv_recv_busiest" in r["balanced"] and r["full_ring_floor"] <= GOALS["c2"][1]]
    if feasible:
        print(f"  (c2) on the batches where (a), (b) and (c2) can hold together (floor <= 0.5): "
              f"worst {max(feasible):.3f}")
    if infeasible:
        print(f"  (c2) cannot hold with (a) and (b) on {len(infeasible)} batches (floor > 0.5); there balanced / floor "
              f"is at most {max(v / f for _, v, f in infeasible):.3f}: "
              + ", ".join(f"L={k[0]} P={k[1]} {k[2]} tw={k[3]:g} seed {k[4]}: {v:.3f} vs {f:.3f}"
                          for k, v, f in infeasible[:4]) + (" ..." if len(infeasible) > 4 else ""))
    if zigzag_over_half:
        print(f"  zigzag itself receives more than half a full ring on {len(zigzag_over_half)} batches: "
              + ", ".join(f"L={L} P={P} {mix} tw={tw:g} seed {seed}" for L, P, mix, tw, seed in zigzag_over_half[:6])
              + (" ..." if len(zigzag_over_half) > 6 else ""))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "layouts.json"), "w") as f:
            json.dump(dict(note="worst case over the drawn batches per row; plan-level, no kernels; layout time is "
                                "CPU time", goals=summary, zigzag_over_half_ring=zigzag_over_half,
                           c2_infeasible=[dict(batch=k, balanced=v, floor=f) for k, v, f in infeasible],
                           records=records), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
