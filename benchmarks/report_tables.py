"""The tables of the benchmarks page, each computed from the JSON files of one results folder, and the
small formatting helpers of the page (see ``report.py``)."""

from __future__ import annotations

import glob
import json
import os
import sys
import textwrap

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402

MIB = 1 << 20


def fmt(x, digits=2, suffix="x"):
    return "-" if x is None else f"{x:.{digits}f}{suffix}"


def span(values, digits=2, suffix="") -> str:
    """``lo-hi`` of some values (one value when they round alike)."""
    lo, hi = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return (lo if lo == hi else f"{lo}-{hi}") + suffix


def mask_order(name: str) -> tuple:
    """causal, windows (small first), documents, chunked."""
    kind, _, arg = name.partition(":")
    return ({"causal": 0, "window": 1, "documents": 2, "chunked": 3}.get(kind, 4), int(arg) if arg.isdigit() else 0)


def attention_rows(folder: str) -> tuple[list[dict], dict | None]:
    merged, machine = {}, None
    for path in sorted(glob.glob(os.path.join(folder, "attention*.json"))):
        payload = harness.load_results(path)
        machine = machine or payload["machine"]
        for r in payload["results"]:
            if not r.get("summary"):
                merged[(r["mask"], r["seq_len"], r["impl"], r["pass"])] = r
    return list(merged.values()), machine


def attention_table(folder: str) -> list[str]:
    rows, machine = attention_rows(folder)
    if not rows:
        return []
    gpu = machine["device"] == "cuda"
    get = {(r["mask"], r["seq_len"], r["impl"], r["pass"]): r for r in rows}

    def speed(mask, L, base, ps):
        a, b = get.get((mask, L, "cp_flash", ps)), get.get((mask, L, base, ps))
        if not a or not b or "time" not in a or "time" not in b:
            return None
        return b["time"]["median_s"] / a["time"]["median_s"]

    def memory(mask, L, base, with_mask):
        a, b = get.get((mask, L, "cp_flash", "fwd_bwd")), get.get((mask, L, base, "fwd_bwd"))
        if not a or not b or not a.get("peak_bytes") or not b.get("peak_bytes"):
            return None
        extra = (lambda r: r.get("mask_bytes", 0)) if with_mask else (lambda r: 0)
        return (a["peak_bytes"] + extra(a)) / (b["peak_bytes"] + extra(b))

    lines = ["| mask | L | vs SDPA dense mask: fwd | fwd+bwd | vs eager: fwd+bwd | vs SDPA is_causal: fwd+bwd "
             "| memory vs SDPA dense (with its mask) |" + (" cp_flash fwd+bwd ms | TFLOP/s |" if gpu else ""),
             "|---|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if gpu else "")]
    keys = sorted({(r["mask"], r["seq_len"]) for r in rows}, key=lambda k: (mask_order(k[0]), k[1]))
    for mask, L in keys:
        mem, mem_mask = memory(mask, L, "sdpa_dense", False), memory(mask, L, "sdpa_dense", True)
        line = (f"| {mask} | {L} | {fmt(speed(mask, L, 'sdpa_dense', 'fwd'))} | "
                f"{fmt(speed(mask, L, 'sdpa_dense', 'fwd_bwd'))} | {fmt(speed(mask, L, 'eager_dense', 'fwd_bwd'))} | "
                f"{fmt(speed(mask, L, 'sdpa_causal', 'fwd_bwd'))} | "
                f"{fmt(mem, 3, '')} ({fmt(mem_mask, 3, '')}) |")
        if gpu:
            ours = get.get((mask, L, "cp_flash", "fwd_bwd"))
            line += (f" {ours['time']['median_s'] * 1e3:.2f} | {ours['flops_per_s'] / 1e12:.1f} |"
                     if ours and "time" in ours else " - | - |")
        lines.append(line)
    return lines


def cp_tables(folder: str) -> list[str]:
    payload = harness.latest_results(folder, "cp")
    if payload is None:
        return []
    rows = [r for r in payload["results"] if not r.get("traffic")]
    get = {(r["mask"], r["world_size"], r["approach"]): r for r in rows}
    lines = [f"Per rank, L = {payload['config']['seq_len']}, {payload['config']['layout']} layout, forward K/V "
             f"(busiest rank); compute speedup = world size 1 compute / slowest rank's compute.", "",
             "| mask | P | K/V sent vs full ring | vs all-gather | rounds ours / ring | compute speedup: ours "
             "| full ring | all-gather |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for mask, P in sorted({(r["mask"], r["world_size"]) for r in rows if r["world_size"] > 1},
                          key=lambda k: (mask_order(k[0]), k[1])):
        ours, ring, ag = (get.get((mask, P, a)) for a in ("ours", "full_ring", "all_gather"))
        if not ours or not ring or not ag:
            continue
        sent = max(ours["kv_bytes_sent_per_rank"])
        lines.append(f"| {mask} | {P} | {fmt(sent / max(ring['kv_bytes_sent_per_rank']), 3, '')} | "
                     f"{fmt(sent / max(ag['kv_bytes_sent_per_rank']), 3, '')} | "
                     f"{max(ours['rounds_per_rank'])} / {max(ring['rounds_per_rank'])} | "
                     f"{fmt(ours.get('speedup_vs_world_size_1'))} | {fmt(ring.get('speedup_vs_world_size_1'))} | "
                     f"{fmt(ag.get('speedup_vs_world_size_1'))} |")
    traffic = [r for r in payload["results"] if r.get("traffic")]
    if traffic:
        P = max(t["world_size"] for t in traffic)
        lines += ["", f"Traffic from the plans at world size {P} (busiest rank, K/V received; the full ring and "
                      f"the all-gather receive (P-1) shards):", "",
                  "| mask | W / S | zigzag: vs full ring | needed halo vs full ring | contiguous: vs full ring |",
                  "|---|---:|---:|---:|---:|"]
        for mask in dict.fromkeys(t["mask"] for t in traffic if t["world_size"] == P):
            zz = next(t for t in traffic if (t["world_size"], t["layout"], t["mask"]) == (P, "zigzag", mask))
            ct = next(t for t in traffic if (t["world_size"], t["layout"], t["mask"]) == (P, "contiguous", mask))
            frac = zz["window_over_shard"]
            lines.append(f"| {mask} | {'-' if frac is None else f'{frac:g}'} | "
                         f"{fmt(zz['ours_recv_max'] / zz['allgather_recv_max'], 3, '')} | "
                         f"{fmt(zz['halo_needed_recv_max'] / zz['allgather_recv_max'], 3, '')} | "
                         f"{fmt(ct['ours_recv_max'] / ct['allgather_recv_max'], 3, '')} |")
    return lines


def model_table(folder: str) -> list[str]:
    payload = harness.latest_results(folder, "model")
    if payload is None:
        return []
    summary = [s for s in payload["results"] if s.get("summary")]
    lines = ["| model | data | L | tokens/s vs sdpa | vs eager | peak memory vs sdpa | vs eager | max loss diff |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for model, data, L in dict.fromkeys((s["model"], s["data"], s["seq_len"]) for s in summary):
        mine = {s["baseline"]: s for s in summary if (s["model"], s["data"], s["seq_len"]) == (model, data, L)}
        sd, ea = mine.get("sdpa", {}), mine.get("eager", {})
        lines.append(f"| {model} | {data} | {L} | {fmt(sd.get('speedup'))} | {fmt(ea.get('speedup'))} | "
                     f"{fmt(sd.get('memory_fraction'), 3, '')} | {fmt(ea.get('memory_fraction'), 3, '')} | "
                     f"{max(s['loss_diff'] for s in mine.values()):.1e} |")
    return lines


# ----------------------------------------------------------------------------------------------
# the tables of the other benchmarks (their scripts print them too)


def k_tokens(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n >> 10}k"


def pick_label(mask: str) -> str:
    """``window 1024`` -> ``w1024`` (the strategies' layer masks)."""
    return "w" + mask.split()[-1] if mask.startswith("window") else mask


def strategy_model_tables(results: list[dict]) -> list[str]:
    """Per model: rows (batch, L), columns P; a cell is auto's pick per layer mask, then auto's
    modeled step time over ring-only and over ulysses-only."""
    summary = [r for r in results if r["kind"] == "summary"]
    lines = []
    for model in dict.fromkeys(s["model"] for s in summary):
        mine = [s for s in summary if s["model"] == model]
        sizes = sorted({s["world_size"] for s in mine})
        by = {(s["data"], s["seq_len"], s["world_size"]): s for s in mine}
        lines += [f"**{model}** (cells: auto's pick per layer mask; modeled step time of auto / ring-only, "
                  "auto / ulysses-only)", "",
                  "| batch | L | " + " | ".join(f"P = {P}" for P in sizes) + " |",
                  "|---|---:|" + "---|" * len(sizes)]
        for data in sorted({s["data"] for s in mine}):
            for L in sorted({s["seq_len"] for s in mine}):
                cells = []
                for P in sizes:
                    s = by.get((data, L, P))
                    if s is None:
                        cells.append("-")
                        continue
                    picks = ", ".join(f"{pick_label(m)} {p}" for m, p in s["auto_picks"].items())
                    uly = "n/a" if s["auto_over_ulysses"] is None else f"{s['auto_over_ulysses']:.2f}"
                    cells.append(f"{picks}; {s['auto_over_ring']:.2f}, {uly}")
                lines.append(f"| {data} | {k_tokens(L)} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines[:-1]


def strategy_rank_table(results: list[dict]) -> list[str]:
    ranks = [r for r in results if r["kind"] == "ranks"]
    if not ranks:
        return []
    lines = ["| P | batch, layout | strategy | layers ran | wall / ring: measured | predicted | busiest compute / "
             "ring: measured | predicted | max abs diff vs ring |",
             "|---:|---|---|---|---:|---:|---:|---:|---:|"]
    for r in ranks:
        lines.append(f"| {r['world_size']} | {r['data']}, {r['layout']} | {r['strategy']} | {', '.join(r['picks'])} | "
                     f"{r['measured_over_ring']:.2f} | {r['predicted_over_ring']:.2f} | {r['compute_over_ring']:.2f} | "
                     f"{r['predicted_compute_over_ring']:.2f} | {r['max_abs_diff_vs_ring']:.1e} |")
    return lines


def layouts_goal_table(payload: dict) -> list[str]:
    """The goals of ``bench_layouts.py``: worst value over the drawn batches, the largest world size
    apart (its rows are longer)."""
    records = payload["records"]
    P_max = max(r["P"] for r in records)
    groups = ([r for r in records if r["P"] != P_max], [r for r in records if r["P"] == P_max])

    def runs(group):
        return [run for rec in group for run in rec["runs"]]

    def traffic(group):
        return [run for run in runs(group) if "kv_recv_busiest" in run["balanced"]]

    def c1(run):
        return run["balanced"]["kv_recv_busiest"] / max(run["zigzag"]["kv_recv_busiest"], 1)

    def c2(run):
        return run["balanced"]["kv_recv_busiest"] / run["balanced"]["ring_kv_recv"]

    def c1_cell(group):
        Ls = sorted({rec["L"] for rec in group})
        worst = {L: max(c1(run) for rec in group if rec["L"] == L for run in rec["runs"]
                        if "kv_recv_busiest" in run["balanced"]) for L in Ls}
        if len(Ls) == 1:
            return f"{worst[Ls[0]]:.2f}"
        return ", ".join(f"{worst[L]:.2f} ({k_tokens(L)})" for L in Ls)

    def c2_cell(group):
        ok = [c2(run) for run in traffic(group) if run["full_ring_floor"] <= 0.5]
        bad = [(rec["L"], c2(run), run["full_ring_floor"]) for rec in group for run in rec["runs"]
               if "kv_recv_busiest" in run["balanced"] and run["full_ring_floor"] > 0.5]
        cell = f"{max(ok):.3f}" + (" where reachable" if bad else "")
        if bad:
            Ls = sorted({L for L, _, _ in bad})
            spans = " and ".join(span([v for L2, v, _ in bad if L2 == L], 3) for L in Ls)
            floors = " and ".join(f"{min(f for L2, _, f in bad if L2 == L):.3f}" for L in Ls)
            cell += f"; {spans} on {len(bad)} batches whose floor is {floors}"
        return cell

    def label(group):
        Ps = sorted({r["P"] for r in group})
        Ls = sorted({r["L"] for r in group})
        lengths = k_tokens(Ls[0]) + (f"-{k_tokens(Ls[-1])}" if len(Ls) > 1 else "")
        return f"P = {', '.join(map(str, Ps))} ({lengths})"

    lines = [f"| goal | limit | worst, {label(groups[0])} | worst, {label(groups[1])} |", "|---|---:|---:|---:|"]
    def balanced(key):
        return lambda g: f"{max(r['balanced'][key] for r in runs(g)):.3f}"

    cells = {"busiest rank's cost / mean": ("<= 1.05", balanced("busiest_over_mean")),
             "max tokens / (L / P)": ("<= 1.25", balanced("max_tokens_over_mean")),
             "busiest rank's K/V / zigzag's": ("<= 1.25", c1_cell),
             "busiest rank's K/V / full ring": ("<= 0.5", c2_cell)}
    for goal, (limit, cell) in cells.items():
        lines.append(f"| {goal} | {limit} | {cell(groups[0])} | {cell(groups[1])} |")
    return lines


def layouts_table(payload: dict) -> list[str]:
    """Every line of ``bench_layouts.py``'s grid, worst case over its drawn batches."""
    lines = ["| L | P | layers | token weight | busiest / mean: zigzag | contiguous | balanced | max tokens / (L/P): "
             "balanced | busiest K/V: balanced / zigzag | balanced / full ring | zigzag / full ring | floor / full "
             "ring | predicted speedup over zigzag | layout ms |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for rec in payload["records"]:
        runs = rec["runs"]

        def worst(layout, key):
            return max(r[layout][key] for r in runs)

        kv = [r for r in runs if "kv_recv_busiest" in r["balanced"]]
        if kv:
            kv_cells = (f"{max(r['balanced']['kv_recv_busiest'] / max(r['zigzag']['kv_recv_busiest'], 1) for r in kv):.2f}"
                        f" | {max(r['balanced']['kv_recv_busiest'] / r['balanced']['ring_kv_recv'] for r in kv):.3f}"
                        f" | {max(r['zigzag']['kv_recv_busiest'] / r['zigzag']['ring_kv_recv'] for r in kv):.3f}"
                        f" | {max(r['full_ring_floor'] for r in kv):.3f}")
        else:
            kv_cells = "- | - | - | -"
        speedup = min(r["zigzag"]["busiest_cost"] / r["balanced"]["busiest_cost"] for r in runs)
        lines.append(f"| {rec['L']} | {rec['P']} | {rec['mix']} | {rec['token_weight']:g} | "
                     f"{worst('zigzag', 'busiest_over_mean'):.3f} | {worst('contiguous', 'busiest_over_mean'):.3f} | "
                     f"{worst('balanced', 'busiest_over_mean'):.3f} | {worst('balanced', 'max_tokens_over_mean'):.3f} | "
                     f"{kv_cells} | {speedup:.2f}x | {1e3 * worst('balanced', 'layout_seconds'):.0f} |")
    return lines


def planning_table(payload: dict) -> list[str]:
    records = payload["records"]
    first = min(r["L"] for r in records)
    lines = [f"| source | mask | layout | L | metadata ms | layout ms | plan ms | layout + plan ms | ... / same at "
             f"{first} | total ms | total / same at {first} | total, every torch thread |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        lines.append(f"| {r['source']} | {r['mask']} | {r['layout']} | {r['L']} | {r['meta_ms']:.1f} | "
                     f"{r['layout_ms']:.1f} | {r['plan_ms']:.1f} | {r['layout_plan_ms']:.1f} | "
                     f"{r['layout_plan_ratio_to_first_length']:.2f} | {r['total_ms']:.1f} | "
                     f"{r['ratio_to_first_length']:.2f} | {r['total_ms_all_threads']:.1f} |")
    return lines


# ----------------------------------------------------------------------------------------------
# formatting


def para(text: str) -> list[str]:
    return textwrap.wrap(" ".join(text.split()), width=110, break_long_words=False, break_on_hyphens=False) + [""]


def bullet(text: str) -> list[str]:
    wrapped = textwrap.wrap(" ".join(text.split()), width=108, break_long_words=False, break_on_hyphens=False)
    return ["- " + wrapped[0]] + ["  " + w for w in wrapped[1:]]


def code(*commands: str) -> list[str]:
    return ["```bash", *commands, "```", ""]


def image(folder: str, page_dir: str, name: str, alt: str) -> list[str]:
    path = os.path.join(folder, name)
    if not os.path.exists(path):
        return []
    return [f"![{alt}]({os.path.relpath(path, page_dir).replace(os.sep, '/')})"]


def load(folder: str, name: str) -> dict | None:
    path = os.path.join(folder, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        payload = json.load(f)
    return harness.load_results(path) if "schema" in payload else payload
