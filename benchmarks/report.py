"""Markdown tables from the benchmark JSON files of one results folder.

    python benchmarks/report.py benchmarks/results/cpu > tables.md

CPU results are reported as ratios measured side by side in one run (speedup, memory fraction,
bytes fraction); absolute times appear only for GPU runs (they are in the JSON either way).
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402


def _fmt(x, digits=2, suffix="x"):
    return "-" if x is None else f"{x:.{digits}f}{suffix}"


def _mask_order(name: str) -> tuple:
    """causal, windows (small first), documents, chunked."""
    kind, _, arg = name.partition(":")
    return ({"causal": 0, "window": 1, "documents": 2, "chunked": 3}.get(kind, 4), int(arg) if arg.isdigit() else 0)


def _attention_rows(folder: str) -> tuple[list[dict], dict | None]:
    merged, machine = {}, None
    for path in sorted(glob.glob(os.path.join(folder, "attention*.json"))):
        payload = harness.load_results(path)
        machine = machine or payload["machine"]
        for r in payload["results"]:
            if not r.get("summary"):
                merged[(r["mask"], r["seq_len"], r["impl"], r["pass"])] = r
    return list(merged.values()), machine


def attention_table(folder: str) -> list[str]:
    rows, machine = _attention_rows(folder)
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
    keys = sorted({(r["mask"], r["seq_len"]) for r in rows}, key=lambda k: (_mask_order(k[0]), k[1]))
    for mask, L in keys:
        mem, mem_mask = memory(mask, L, "sdpa_dense", False), memory(mask, L, "sdpa_dense", True)
        line = (f"| {mask} | {L} | {_fmt(speed(mask, L, 'sdpa_dense', 'fwd'))} | "
                f"{_fmt(speed(mask, L, 'sdpa_dense', 'fwd_bwd'))} | {_fmt(speed(mask, L, 'eager_dense', 'fwd_bwd'))} | "
                f"{_fmt(speed(mask, L, 'sdpa_causal', 'fwd_bwd'))} | "
                f"{_fmt(mem, 3, '')} ({_fmt(mem_mask, 3, '')}) |")
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
                          key=lambda k: (_mask_order(k[0]), k[1])):
        ours, ring, ag = (get.get((mask, P, a)) for a in ("ours", "full_ring", "all_gather"))
        if not ours or not ring or not ag:
            continue
        sent = max(ours["kv_bytes_sent_per_rank"])
        lines.append(f"| {mask} | {P} | {_fmt(sent / max(ring['kv_bytes_sent_per_rank']), 3, '')} | "
                     f"{_fmt(sent / max(ag['kv_bytes_sent_per_rank']), 3, '')} | "
                     f"{max(ours['rounds_per_rank'])} / {max(ring['rounds_per_rank'])} | "
                     f"{_fmt(ours.get('speedup_vs_world_size_1'))} | {_fmt(ring.get('speedup_vs_world_size_1'))} | "
                     f"{_fmt(ag.get('speedup_vs_world_size_1'))} |")
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
                         f"{_fmt(zz['ours_recv_max'] / zz['allgather_recv_max'], 3, '')} | "
                         f"{_fmt(zz['halo_needed_recv_max'] / zz['allgather_recv_max'], 3, '')} | "
                         f"{_fmt(ct['ours_recv_max'] / ct['allgather_recv_max'], 3, '')} |")
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
        lines.append(f"| {model} | {data} | {L} | {_fmt(sd.get('speedup'))} | {_fmt(ea.get('speedup'))} | "
                     f"{_fmt(sd.get('memory_fraction'), 3, '')} | {_fmt(ea.get('memory_fraction'), 3, '')} | "
                     f"{max(s['loss_diff'] for s in mine.values()):.1e} |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder")
    args = parser.parse_args(argv)
    for title, lines in (("Attention, world size 1 (cp_flash speedup; memory = cp_flash / baseline)",
                          attention_table(args.folder)),
                         ("Context parallelism", cp_tables(args.folder)),
                         ("Training step, one device (cp_flash / baseline)", model_table(args.folder))):
        if lines:
            print(f"### {title}\n")
            print("\n".join(lines))
            print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
