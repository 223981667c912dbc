"""Attention alone at world size 1: cp_flash against SDPA and a dense-mask eager attention.

    python benchmarks/bench_attention.py                 # CPU: L 1k..16k; GPU: L 4k..64k
    python benchmarks/bench_attention.py --smoke --out bench_out   # tiny, any device
    python benchmarks/bench_attention.py --masks window:512 --seq-lens 8192 \\
        --impls cp_flash sdpa_dense --passes fwd_bwd --tag window512   # one comparison

Implementations (inputs (1, L, H, D) queries, (1, L, K, D) keys and values):

* ``cp_flash``: ``cp_attention.attention`` without a process group (the reference backend on
  CPU, ``auto`` on a GPU), given the mask as window / chunk size / position ids.
* ``sdpa_causal``: ``scaled_dot_product_attention(is_causal=True)``; exact for the causal mask
  only, so it runs for that mask only.
* ``sdpa_dense``: SDPA with the equivalent (L, L) boolean mask: the only way SDPA honours
  windows, chunks and documents.
* ``eager_dense``: ``softmax(q k^T * scale + bias) v`` with an additive float mask, as
  transformers' eager attention does (skipped where its L x L tensors do not fit).

Masks: ``causal``, ``window:W``, ``documents`` (packed documents, a log-normal length mix with a
median of 768 tokens), ``chunked:C``. Each (mask, L, pass) times every implementation side by
side (:func:`harness.measure`), records FLOPs over visible pairs only, and measures the peak extra
memory of forward+backward (:func:`harness.peak_memory`). Results go to ``attention[_TAG].json``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402

import cp_attention  # noqa: E402

IMPLS = ("cp_flash", "sdpa_causal", "sdpa_dense", "eager_dense")
PASSES = ("fwd", "fwd_bwd")
CPU_DEFAULTS = dict(seq_lens=[1024, 2048, 4096, 8192, 16384], heads=8, kv_heads=8, head_dim=64, dtype="float32",
                    masks=["causal", "window:256", "window:1024", "window:4096", "documents", "chunked:2048"])
GPU_DEFAULTS = dict(seq_lens=[4096, 8192, 16384, 32768, 65536], heads=16, kv_heads=4, head_dim=128, dtype="bfloat16",
                    masks=["causal", "window:256", "window:1024", "window:4096", "documents", "chunked:8192"])
SMOKE = dict(seq_lens=[128, 256], heads=2, kv_heads=1, head_dim=16, dtype="float32",
             masks=["window:64", "documents:96"])


def _inputs(seq_len, heads, kv_heads, head_dim, dtype, device, backward, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, seq_len, heads, head_dim, generator=gen).to(device, dtype)
    k = torch.randn(1, seq_len, kv_heads, head_dim, generator=gen).to(device, dtype)
    v = torch.randn(1, seq_len, kv_heads, head_dim, generator=gen).to(device, dtype)
    dout = torch.randn(1, seq_len, heads, head_dim, generator=gen).to(device, dtype)
    if backward:
        for t in (q, k, v):
            t.requires_grad_()
    return q, k, v, dout


def _sdpa(q, k, v, *, mask=None, is_causal=False):
    """(1, L, H, D) inputs -> (1, L, H, D), GQA through SDPA's own ``enable_gqa``."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         is_causal=is_causal, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def _eager(q, k, v, *, bias):
    """transformers-style eager attention: (1, L, H, D) inputs, ``bias`` (1, 1, L, L) additive."""
    rep = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2)
    kh, vh = k.repeat_interleave(rep, 2).transpose(1, 2), v.repeat_interleave(rep, 2).transpose(1, 2)
    scores = torch.matmul(qh, kh.transpose(2, 3)) * q.shape[-1] ** -0.5 + bias
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, vh).transpose(1, 2)


def make_workload(*, impl, mask, seq_len, heads, kv_heads, head_dim, dtype, device, backward, backend="auto",
                  seed=0):
    """Build inputs for one (implementation, mask, L, pass) and return a callable running it once
    (module level, so a fresh process can rebuild it for the memory measurement)."""
    device = torch.device(device)
    dt = harness.dtype_of(dtype)
    case = harness.parse_mask(mask, seq_len, seed=seed)
    q, k, v, dout = _inputs(seq_len, heads, kv_heads, head_dim, dt, device, backward, seed)
    if impl == "cp_flash":
        kwargs = case.attention_kwargs(seq_len)
        if kwargs["position_ids"] is not None:
            kwargs["position_ids"] = kwargs["position_ids"].to(device)

        def call():
            return cp_attention.attention(q, k, v, backend=backend, **kwargs)
    elif impl == "sdpa_causal":
        def call():
            return _sdpa(q, k, v, is_causal=True)
    elif impl == "sdpa_dense":
        dense = case.dense(seq_len, device)[None, None]

        def call():
            return _sdpa(q, k, v, mask=dense)
    elif impl == "eager_dense":
        bias = torch.zeros(1, 1, seq_len, seq_len, dtype=dt, device=device)
        bias.masked_fill_(~case.dense(seq_len, device)[None, None], torch.finfo(dt).min)

        def call():
            return _eager(q, k, v, bias=bias)
    else:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return one_pass(call, (q, k, v), dout, backward)


def one_pass(call, leaves, dout, backward: bool):
    """A zero-argument run of ``call``: its forward under no_grad, or forward + backward of ``dout``
    (the leaves' gradients cleared first)."""
    if not backward:
        def run():
            with torch.no_grad():
                return call()
        return run

    def run_backward():
        for t in leaves:
            t.grad = None
        call().backward(dout)
    return run_backward


def mask_bytes(impl: str, seq_len: int, itemsize: int) -> int:
    """Bytes of the (L, L) mask an implementation needs besides q, k, v: a bool mask for SDPA (the
    smallest form it accepts), an additive mask in the input dtype for eager attention."""
    return {"sdpa_dense": seq_len * seq_len, "eager_dense": seq_len * seq_len * itemsize}.get(impl, 0)


def estimated_bytes(impl: str, seq_len: int, heads: int, itemsize: int) -> int:
    """Rough extra memory of a dense baseline's forward+backward (for skipping what cannot fit)."""
    if impl == "eager_dense":
        return seq_len * seq_len * (itemsize + 4 * heads * 4)  # bias + scores, softmax and their grads
    if impl == "sdpa_dense":
        return seq_len * seq_len * (1 + 4)  # bool mask and its float form
    return 0


def _summaries(results: list[dict]) -> list[dict]:
    """Per (mask, L, pass): cp_flash's speedup over, and memory fraction of, every baseline."""
    rows = []
    keys = sorted({(r["mask"], r["seq_len"], r["pass"]) for r in results}, key=lambda x: (x[0], x[1], x[2]))
    for mask, L, ps in keys:
        group = {r["impl"]: r for r in results if (r["mask"], r["seq_len"], r["pass"]) == (mask, L, ps)}
        ours = group.get("cp_flash")
        if ours is None or "time" not in ours:
            continue
        for name, base in group.items():
            if name == "cp_flash" or "time" not in base:
                continue
            row = dict(mask=mask, seq_len=L, baseline=name, **{"pass": ps},
                       speedup=base["time"]["median_s"] / ours["time"]["median_s"])
            if ours.get("peak_bytes") and base.get("peak_bytes"):
                row["memory_fraction"] = ours["peak_bytes"] / base["peak_bytes"]
                row["memory_fraction_with_mask"] = ((ours["peak_bytes"] + ours["mask_bytes"])
                                                    / (base["peak_bytes"] + base["mask_bytes"]))
            rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_run_arguments(parser, warmup=2, repeats=5, smoke="tiny shapes")
    harness.add_shape_arguments(parser)
    parser.add_argument("--seq-lens", type=int, nargs="+")
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    parser.add_argument("--passes", nargs="+", choices=PASSES, default=list(PASSES))
    parser.add_argument("--max-seconds", type=float, default=60.0, help="per (mask, L, pass): stop repeating after")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurements")
    parser.add_argument("--memory-max-len", type=int, default=None, help="measure memory only up to this L")
    args = parser.parse_args(argv)

    device = harness.pick_device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    defaults = SMOKE if args.smoke else (GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS)
    seq_lens = args.seq_lens or defaults["seq_lens"]
    masks = args.masks or defaults["masks"]
    H, K = args.heads or defaults["heads"], args.kv_heads or defaults["kv_heads"]
    D = args.head_dim or defaults["head_dim"]
    dtype = args.dtype or defaults["dtype"]
    backend = args.backend or ("reference" if device.type == "cpu" else "auto")
    warmup, repeats = (1, 1) if args.smoke else (args.warmup, args.repeats)
    itemsize = harness.dtype_of(dtype).itemsize
    budget = harness.memory_budget(device)
    script = os.path.abspath(__file__)

    results, memory_jobs = [], []
    config = dict(seq_lens=seq_lens, masks=masks, impls=args.impls, passes=args.passes, heads=H, kv_heads=K,
                  head_dim=D, dtype=dtype, backend=backend, warmup=warmup, repeats=repeats,
                  threads=args.threads if device.type == "cpu" else None,
                  memory_method=("torch.cuda.max_memory_allocated minus allocated before the run"
                                 if device.type == "cuda" else
                                 "resident-set high-water mark of a fresh process minus its resident set before the "
                                 "run (glibc returns freed blocks >= 64 KiB)")
                  + "; mask_bytes: the (L, L) mask a dense baseline holds besides q, k, v (not in peak_bytes)",
                  timing=("CUDA events" if device.type == "cuda" else "wall clock") + ", implementations interleaved")
    name = "attention" + (f"_{args.tag}" if args.tag else "") + ".json"

    def save() -> str:  # after every length too, so a long run that is stopped keeps what it measured
        summary = _summaries(results)
        return harness.write_results(os.path.join(args.out, name), benchmark="attention",
                                     machine=harness.machine_info(device, args.note), config=config,
                                     results=results + [dict(summary=True, **s) for s in summary])

    for L in seq_lens:
        for mask in masks:
            case = harness.parse_mask(mask, L)
            if (case.spec.window or 0) >= L or (case.spec.chunk_size or 0) >= L:
                continue  # the same as plain causal at this length
            meta = case.meta(L)
            pairs = harness.visible_pairs(meta, case.spec)
            for ps in args.passes:
                backward = ps == "fwd_bwd"
                fl = harness.flops(meta, case.spec, heads=H, head_dim=D, backward=backward)
                common = dict(mask=mask, seq_len=L, heads=H, kv_heads=K, head_dim=D, dtype=dtype,
                              device=device.type, backward=backward)
                runs, rows = {}, {}
                for impl in args.impls:
                    row = dict(mask=mask, kind=case.kind, seq_len=L, impl=impl, **{"pass": ps}, visible_pairs=pairs,
                               flops=fl)
                    rows[impl] = row
                    row["mask_bytes"] = mask_bytes(impl, L, itemsize)
                    if impl == "sdpa_causal" and case.kind != "causal":
                        del rows[impl]
                        continue
                    need = estimated_bytes(impl, L, H, itemsize)
                    if need > budget:
                        row["skipped"] = f"needs about {need / 2**30:.1f} GiB, budget {budget / 2**30:.1f} GiB"
                        continue
                    runs[impl] = make_workload(impl=impl, backend=backend, **common)
                if "cp_flash" in runs and "sdpa_dense" in runs and not backward and L <= 4096:
                    ours, ref = runs["cp_flash"](), runs["sdpa_dense"]()
                    rows["cp_flash"]["max_abs_diff_vs_sdpa_dense"] = float((ours.float() - ref.float()).abs().max())
                timings = harness.measure(runs, device=device, warmup=warmup, repeats=repeats,
                                          min_repeats=1 if args.smoke else 2, max_seconds=args.max_seconds)
                for impl, timing in timings.items():
                    rows[impl]["time"] = timing.as_dict()
                    rows[impl]["flops_per_s"] = fl / timing.median
                runs.clear()
                if backward and not args.no_memory and (args.memory_max_len is None or L <= args.memory_max_len):
                    for impl in timings:
                        kw = dict(common, impl=impl, backend=backend)
                        tiny = dict(kw, seq_len=64, mask="causal")
                        memory_jobs.append((rows[impl], harness.Workload(script, "make_workload", kw),
                                            harness.Workload(script, "make_workload", tiny)))
                results.extend(rows.values())
                _print_rows(list(rows.values()))
        if memory_jobs:  # one fresh process measures every workload of this length, one after another
            peaks = harness.peak_memory([w for _, w, _ in memory_jobs], device=device,
                                        warm=[w for _, _, w in memory_jobs], threads=args.threads)
            for (row, _, _), peak in zip(memory_jobs, peaks):
                row["peak_bytes"] = peak
            _print_rows([row for row, _, _ in memory_jobs])
            memory_jobs.clear()
        save()

    path = save()
    print(f"\nwrote {path}")
    for s in _summaries(results):
        mem = (f"  memory {s['memory_fraction']:.3f}x ({s['memory_fraction_with_mask']:.3f}x counting the mask)"
               if "memory_fraction" in s else "")
        print(f"{s['mask']:14s} L={s['seq_len']:6d} {s['pass']:8s} cp_flash vs {s['baseline']:12s} "
              f"speedup {s['speedup']:7.2f}x{mem}")
    return 0


def _print_rows(rows: list[dict]) -> None:
    for r in rows:
        if "time" in r:
            t = r["time"]
            mem = f" peak {r['peak_bytes'] / harness.MIB:9.1f} MiB" if r.get("peak_bytes") is not None else ""
            print(f"{r['mask']:14s} L={r['seq_len']:6d} {r['pass']:8s} {r['impl']:12s} "
                  f"median {t['median_s'] * 1e3:10.2f} ms "
                  f"[{t['min_s'] * 1e3:.2f}, {t['max_s'] * 1e3:.2f}] n={t['repeats']}{mem}", flush=True)
        elif "skipped" in r:
            print(f"{r['mask']:14s} L={r['seq_len']:6d} {r['pass']:8s} {r['impl']:12s} skipped: {r['skipped']}",
                  flush=True)


if __name__ == "__main__":
    sys.exit(main())
