"""PNG plots from the benchmark JSON files of one results folder (needs matplotlib: ``pip install -e ".[bench]"``).

    python benchmarks/plot.py benchmarks/results/cpu      # writes the PNGs next to the JSON files

* ``attention_time.png`` (from every ``attention*.json``, merged): forward+backward time versus L,
  one panel per mask measured at two lengths or more, one line per implementation, log-log. On a
  GPU in milliseconds; on a CPU relative to cp_flash at the smallest L of the panel (a CPU run
  reports ratios, not absolute times).
* ``cp_traffic.png`` (from ``cp*.json``): K/V MiB received by the busiest rank versus the window
  (as a fraction of the shard length S), at the largest world size: ours (both layouts), a full
  ring, an all-gather, and the halo the mask needs.
* ``cp_speedup.png`` (from ``cp*.json``): compute speedup of the slowest rank over world size 1,
  per mask, for ours, the full ring and the all-gather.
* ``strategies.png`` (from ``strategies*.json``, ``bench_strategies.py``): per model mix, the modeled
  attention step time of ulysses-only, the best usp-only and auto against ring-only, over the world
  size, packed batches at the shortest and longest length.
* ``model_speedup.png`` (from ``model*.json``): cp_flash's training tokens/s over sdpa and eager.
* ``cp_layouts*.png`` (one per ``cp_layouts*.json``, ``bench_cp_layouts.py``): per world size, the
  busiest rank's work over the mean, the predicted speedup of balanced over zigzag and the busiest
  rank's K/V received against a full ring (worst case over the drawn batches), and the real ranks'
  measured compute speedup over zigzag against the plan's prediction.

Returns the list of files written; missing inputs are skipped.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402

STYLE = {"cp_flash": ("C0", "o", "-"), "sdpa_causal": ("C2", "s", "--"), "sdpa_dense": ("C1", "^", "--"),
         "eager_dense": ("C3", "v", ":"), "ours": ("C0", "o", "-"), "full_ring": ("C1", "^", "--"),
         "all_gather": ("C3", "v", ":")}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _load(folder: str, prefix: str) -> list[dict]:
    return [harness.load_results(p) for p in sorted(glob.glob(os.path.join(folder, f"{prefix}*.json")))]


def _machine_title(payload: dict) -> str:
    m = payload["machine"]
    if m.get("note"):
        return m["note"]
    return f"{m.get('gpu') if m['device'] == 'cuda' else 'CPU'}; torch {m['torch']}"


def _panels(plt, masks: list[str]):
    """One panel per mask, three per row: (figure, axes iterable, one per mask)."""
    cols = min(3, len(masks))
    nrows = (len(masks) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.2 * nrows), squeeze=False)
    for ax in list(axes.flat)[len(masks):]:
        ax.axis("off")
    return fig, list(axes.flat)[:len(masks)]


def _save(plt, fig, path: str, suptitle: str | None = None) -> str:
    if suptitle:
        fig.suptitle(suptitle, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return path


def plot_attention(payload: dict, path: str) -> str:
    plt = _pyplot()
    rows = [r for r in payload["results"] if not r.get("summary") and r.get("pass") == "fwd_bwd" and "time" in r]
    lengths = {}
    for r in rows:
        lengths.setdefault(r["mask"], set()).add(r["seq_len"])
    masks = [m for m, ls in lengths.items() if len(ls) > 1]  # a panel needs two lengths
    gpu = payload["machine"]["device"] == "cuda"
    fig, axes = _panels(plt, masks)
    for ax, mask in zip(axes, masks):
        mine = [r for r in rows if r["mask"] == mask]
        ours = sorted((r for r in mine if r["impl"] == "cp_flash"), key=lambda r: r["seq_len"])
        unit = 1e-3 if gpu else (ours[0]["time"]["median_s"] if ours else 1.0)
        for impl in dict.fromkeys(r["impl"] for r in mine):
            pts = sorted((r for r in mine if r["impl"] == impl), key=lambda r: r["seq_len"])
            color, marker, line = STYLE.get(impl, ("k", ".", "-"))
            ax.plot([r["seq_len"] for r in pts], [r["time"]["median_s"] / unit for r in pts], color=color,
                    marker=marker, linestyle=line, label=impl)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(mask, fontsize=10)
        ax.set_xlabel("L (tokens)")
        ax.set_ylabel("ms" if gpu else "time / cp_flash at smallest L")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    return _save(plt, fig, path, f"attention forward+backward, world size 1 ({_machine_title(payload)})")


def plot_traffic(payload: dict, path: str) -> str:
    plt = _pyplot()
    table = [r for r in payload["results"] if r.get("traffic")]
    P = max(r["world_size"] for r in table)
    fig, ax = plt.subplots(figsize=(6, 4))
    windows = {lay: sorted((r for r in table if r["world_size"] == P and r["layout"] == lay and r["kind"] == "window"),
                           key=lambda r: r["window_over_shard"]) for lay in ("zigzag", "contiguous")}
    mib = harness.MIB
    zz = windows["zigzag"]
    x = [r["window_over_shard"] for r in zz]
    ax.plot(x, [r["ring_sent_max"] / mib for r in zz], color="C1", marker="^", linestyle="--", label="full ring")
    ax.plot(x, [r["allgather_recv_max"] / mib for r in zz], color="C3", marker="v", linestyle=":", label="all-gather")
    for lay, marker in (("zigzag", "o"), ("contiguous", "s")):
        pts = windows[lay]
        ax.plot([r["window_over_shard"] for r in pts], [r["ours_recv_max"] / mib for r in pts], color="C0",
                marker=marker, linestyle="-" if lay == "zigzag" else "-.", label=f"ours ({lay})")
    ax.plot(x, [r["halo_needed_recv_max"] / mib for r in zz], color="k", linewidth=5, alpha=0.15, zorder=0,
            label="halo the mask needs (zigzag)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("window W / shard length S")
    ax.set_ylabel("K/V MiB received, busiest rank (forward)")
    ax.set_title(f"K/V traffic at world size {P}, L = {payload['config']['seq_len']} "
                 f"({payload['config']['kv_heads']} K/V heads x {payload['config']['head_dim']}, "
                 f"{payload['config']['dtype']})", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def plot_speedup(payload: dict, path: str) -> str:
    plt = _pyplot()
    rows = [r for r in payload["results"] if not r.get("traffic") and "speedup_vs_world_size_1" in r]
    masks = list(dict.fromkeys(r["mask"] for r in rows))
    fig, axes = _panels(plt, masks)
    sizes = sorted({r["world_size"] for r in rows})
    for ax, mask in zip(axes, masks):
        for approach in ("ours", "full_ring", "all_gather"):
            pts = sorted((r for r in rows if r["mask"] == mask and (r["approach"] == approach or r["world_size"] == 1)),
                         key=lambda r: r["world_size"])
            pts = [r for r in pts if r["world_size"] == 1 or r["approach"] == approach]
            if len(pts) < 2:
                continue
            color, marker, line = STYLE[approach]
            ax.plot([r["world_size"] for r in pts], [r["speedup_vs_world_size_1"] for r in pts], color=color,
                    marker=marker, linestyle=line, label=approach)
        ax.plot(sizes, sizes, color="k", alpha=0.3, linewidth=1, label="ideal")
        ax.set_xticks(sizes)
        ax.set_title(mask, fontsize=10)
        ax.set_xlabel("world size P")
        ax.set_ylabel("compute speedup (slowest rank)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    return _save(plt, fig, path, f"per-rank compute, forward+backward, L = {payload['config']['seq_len']} "
                                 f"({_machine_title(payload)})")


def plot_model(payload: dict, path: str) -> str:
    plt = _pyplot()
    summary = [s for s in payload["results"] if s.get("summary")]
    labels = list(dict.fromkeys(f"{s['model']} {s['data']}\nL={s['seq_len']}" for s in summary))
    baselines = list(dict.fromkeys(s["baseline"] for s in summary))
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(labels), 3.6))
    width = 0.8 / max(1, len(baselines))
    for i, base in enumerate(baselines):
        vals = [next((s["speedup"] for s in summary if s["baseline"] == base and
                      f"{s['model']} {s['data']}\nL={s['seq_len']}" == lab), 0.0) for lab in labels]
        ax.bar([j + i * width for j in range(len(labels))], vals, width, label=f"vs {base}", color=f"C{i + 1}")
    ax.axhline(1.0, color="k", linewidth=1, alpha=0.5)
    ax.set_xticks([j + width * (len(baselines) - 1) / 2 for j in range(len(labels))])
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("cp_flash training tokens/s ratio")
    ax.set_title(f"training step, one device ({_machine_title(payload)})", fontsize=9)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


LAYOUT_COLORS = {"zigzag": "C0", "contiguous": "C1", "balanced": "C2"}
MIX_LINES = ("-", "--", ":", "-.")


def plot_layouts(payload: dict, path: str) -> str:
    plt = _pyplot()
    results = payload["results"]
    summary = [s for s in results if s["kind"] == "plan_summary"]
    ranks = [r for r in results if r["kind"] == "ranks"]
    mixes = list(dict.fromkeys(s["mix"] for s in summary))
    weights = list(dict.fromkeys(s["token_weight"] for s in summary))
    layouts = list(dict.fromkeys(s["layout"] for s in summary))
    fig, axes = plt.subplots(1, 4 if ranks else 3, figsize=(18 if ranks else 13.5, 5.2))

    def series(key, layout, mix, tw):
        pts = sorted((s for s in summary if (s["layout"], s["mix"], s["token_weight"]) == (layout, mix, tw)),
                     key=lambda s: s["world_size"])
        return [s["world_size"] for s in pts], [s[key] for s in pts]

    tw0 = weights[0]
    for i, mix in enumerate(mixes):
        line = MIX_LINES[i % len(MIX_LINES)]
        for layout in layouts:
            x, y = series("busiest_over_mean", layout, mix, tw0)
            axes[0].plot(x, y, color=LAYOUT_COLORS.get(layout, "k"), linestyle=line, marker="o",
                         label=f"{layout}, {mix}")
            x, y = series("kv_vs_full_ring", layout, mix, tw0)
            axes[2].plot(x, y, color=LAYOUT_COLORS.get(layout, "k"), linestyle=line, marker="o",
                         label=f"{layout}, {mix}")
        for j, tw in enumerate(weights):
            x, y = series("predicted_speedup_over_zigzag", "balanced", mix, tw)
            axes[1].plot(x, y, color=f"C{j + 3}", linestyle=line, marker="o", label=f"{mix}, token weight {tw:g}")
    for ax, title, ylabel in (
            (axes[0], f"busiest rank's work / mean (token weight {tw0:g})", "busiest / mean (worst batch)"),
            (axes[1], "predicted step speedup of balanced over zigzag", "zigzag busiest / balanced busiest"),
            (axes[2], f"busiest rank's K/V received (token weight {tw0:g})", "fraction of a full ring")):
        ax.set_xscale("log", base=2)
        sizes = sorted({s["world_size"] for s in summary})
        ax.set_xticks(sizes, [str(p) for p in sizes])
        ax.set_xlabel("world size P")
        ax.set_title(title, fontsize=9)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.17), ncol=2)
    axes[1].axhline(1.0, color="k", linewidth=1, alpha=0.4)
    if ranks:
        ax = axes[3]
        for r in ranks:
            if r["layout"] == "zigzag":
                continue
            marker = "o" if r["layout"] == "balanced" else "s"
            ax.scatter(r["predicted_speedup_over_zigzag"], r["compute_speedup_over_zigzag"], marker=marker,
                       color=LAYOUT_COLORS.get(r["layout"], "k"), s=14 * r["world_size"],
                       label=f"{r['layout']}, P = {r['world_size']}, {r['mix']}")
        lo = min([0.9] + [min(r["predicted_speedup_over_zigzag"], r["compute_speedup_over_zigzag"]) for r in ranks])
        hi = max([1.1] + [max(r["predicted_speedup_over_zigzag"], r["compute_speedup_over_zigzag"]) for r in ranks])
        ax.plot([lo, hi], [lo, hi], color="k", alpha=0.3, linewidth=1)
        ax.set_xlabel("predicted (visible pairs of the busiest rank)")
        ax.set_ylabel("measured compute speedup (slowest rank)")
        ax.set_title(f"real ranks, L = {ranks[0]['seq_len']}: speedup over zigzag", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.17), ncol=2)
    cfg = payload["config"]
    return _save(plt, fig, path, f"layouts on packed batches, L = {cfg['seq_len']}, worst of {len(cfg['seeds'])} "
                                 f"drawn batches ({_machine_title(payload)})")


def plot_strategies(payload: dict, path: str) -> str:
    """Per model, the modeled attention step time of each strategy used for every layer, and of
    auto, as a ratio to ring-only, against the world size; packed batches, one line style per length."""
    plt = _pyplot()
    summary = [r for r in payload["results"] if r["kind"] == "summary" and r["data"] == "packed"]
    models = list(dict.fromkeys(r["model"] for r in summary))
    fig, axes = _panels(plt, models)
    lengths = sorted({r["seq_len"] for r in summary})
    shown = [lengths[0], lengths[-1]] if len(lengths) > 1 else lengths
    for ax, model in zip(axes, models):
        for L, style in zip(shown, ("-", "--")):
            rows = sorted((r for r in summary if r["model"] == model and r["seq_len"] == L),
                          key=lambda r: r["world_size"])
            P = [r["world_size"] for r in rows]
            nan = float("nan")
            series = {"ulysses only": [r["step_s"].get("ulysses", nan) / r["step_s"]["ring"] for r in rows],
                      "best usp only": [min([v for k, v in r["step_s"].items() if k.startswith("usp")] or [nan])
                                        / r["step_s"]["ring"] for r in rows],
                      "auto (per layer)": [r["auto_over_ring"] for r in rows]}
            for (name, ys), color in zip(series.items(), ("C1", "C2", "C0")):
                ax.plot(P, ys, style, color=color, marker="o", label=f"{name}, L={L // 1024}k")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks([r for r in sorted({r["world_size"] for r in summary})])
        ax.get_xaxis().set_major_formatter(plt.matplotlib.ticker.ScalarFormatter())
        ax.set_title(model, fontsize=9)
        ax.set_xlabel("world size P")
        ax.set_ylabel("modeled step time / ring-only")
        ax.legend(fontsize=6)
    return _save(plt, fig, path, "strategies, packed batches (cost model defaults; below 1: faster than the ring)")


def main(argv=None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", help="folder holding attention*.json, cp*.json, model*.json")
    parser.add_argument("--out", default=None, help="where to write the PNGs (default: the folder)")
    args = parser.parse_args(argv)
    out = args.out or args.folder
    os.makedirs(out, exist_ok=True)
    written = []
    attention = _load(args.folder, "attention")
    if attention:  # every attention run of the folder, merged (a later run wins for the same point)
        merged = {}
        for payload in attention:
            for r in payload["results"]:
                if not r.get("summary"):
                    merged[(r["mask"], r["seq_len"], r["impl"], r["pass"])] = r
        written.append(plot_attention(dict(attention[0], results=list(merged.values())),
                                      os.path.join(out, "attention_time.png")))
    cp = harness.latest_results(args.folder, "cp")
    if cp is not None:
        written.append(plot_traffic(cp, os.path.join(out, "cp_traffic.png")))
        written.append(plot_speedup(cp, os.path.join(out, "cp_speedup.png")))
    for path in sorted(glob.glob(os.path.join(args.folder, "cp_layouts*.json"))):  # one PNG per run (tag)
        layouts = harness.load_results(path)
        if layouts.get("benchmark") == "cp_layouts":
            name = os.path.splitext(os.path.basename(path))[0] + ".png"
            written.append(plot_layouts(layouts, os.path.join(out, name)))
    strategies = harness.latest_results(args.folder, "strategies")
    if strategies is not None:
        written.append(plot_strategies(strategies, os.path.join(out, "strategies.png")))
    model = harness.latest_results(args.folder, "model")
    if model is not None:
        written.append(plot_model(model, os.path.join(out, "model_speedup.png")))
    for path in written:
        print(f"wrote {path}")
    return written


if __name__ == "__main__":
    main()
