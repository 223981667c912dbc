"""cp_attention's engine against the peers a CPU user has, side by side in one run.

    OMP_NUM_THREADS=1 python benchmarks/bench_peers.py --out benchmarks/results/cpu   # L 4k and 16k
    python benchmarks/bench_peers.py --smoke --out bench_out                          # tiny, seconds

World size 1, inputs (1, L, H, D) queries and (1, L, K, D) keys and values (float32, H 8, K 2, D 64
by default), one thread per process, every implementation of a (mask, L, pass) timed in rotating
order (:func:`harness.measure`, median of ``--repeats``):

* ``ours``: ``cp_attention.attention`` without a process group (backend ``auto``: the fused CPU
  backend, ``backends/cpu.py``), given the mask as window / position ids;
* ``reference``: the same call on the pure-torch reference backend (the oracle-grade path, and
  what ``auto`` ran on CPU before the fused backend), forward only;
* ``sdpa_causal``: ``scaled_dot_product_attention(is_causal=True)``, aten's fused CPU flash kernel;
  exact for the causal mask only, so it runs for that mask only;
* ``sdpa_dense``: SDPA with the equivalent (L, L) boolean mask, the only way SDPA honours windows
  and documents;
* ``flex``: ``torch.compile(flex_attention)`` with the mask's block mask (built once, outside the
  timing); forward only, because FlexAttention has no backward on CPU.

Masks: ``causal``, ``window:512``, ``documents`` (packed documents, the log-normal mix of
``harness.document_lengths``, median 768: at L 4096 its first document holds 3586 tokens),
``documents:1024`` (the same mix with documents of at most 1024 tokens, median 512, as an SFT packer
gives) and ``documents:1024+window:512``. Each row also gives the bound a dense mask sets: L^2 over
the visible (query, key) pairs, the most any kernel that skips hidden pairs can gain over SDPA with
a dense mask. Reported speedups are peer time / our
time (> 1: we are faster). Peak memory of forward+backward beyond the inputs is measured in a
fresh process per run (:func:`harness.peak_memory`, after a warm-up run at L 1024 that loads
the code paths) for ours and for SDPA ``is_causal`` (the reference point of every mask). Accuracy at the smallest L: the largest error of out and of
dq/dk/dv against a float64 dense oracle (float32), and for bfloat16 the ratio of our error to
SDPA's (dense mask) on the same inputs.

``--world 2`` adds the two-rank comparison: both ranks spawned on gloo, one thread each; ours
(zigzag ring, forward) against the Flex CP scheme of torch's experimental context parallelism as
stated in its design: K and V all-gathered on every rank, then compiled FlexAttention of the local
queries over the whole sequence (head-tail sharding, the same tokens per rank as our zigzag).
Results go to ``peers[_TAG].json``; ``--readme`` prints the README table.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_attention  # noqa: E402
import harness  # noqa: E402

import cp_attention  # noqa: E402
from cp_attention.tools.harness import visible_pairs  # noqa: E402

DEFAULTS = dict(seq_lens=[4096, 16384], heads=8, kv_heads=2, head_dim=64,
                masks=["causal", "window:512", "documents", "documents:1024", "documents:1024+window:512"])
SMOKE = dict(seq_lens=[256], heads=4, kv_heads=2, head_dim=16, masks=["causal", "window:64", "documents:96",
                                                                        "documents:96+window:32"])
PEERS = ("reference", "sdpa_causal", "sdpa_dense", "flex")


def mask_case(name: str, seq_len: int) -> harness.MaskCase:
    """``harness.parse_mask`` plus ``"documents[:N]+window:W"`` (packed documents, each windowed)."""
    docs, plus, window = name.partition("+")
    if not plus:
        return harness.parse_mask(name, seq_len)
    case = harness.parse_mask(docs, seq_len)
    return harness.MaskCase(name=name, spec=harness.parse_mask(window, seq_len).spec, documents=case.documents)


def _inputs(L, heads, kv_heads, head_dim, dtype, backward, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, L, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(1, L, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(1, L, kv_heads, head_dim, generator=gen).to(dtype)
    dout = torch.randn(1, L, heads, head_dim, generator=gen).to(dtype)
    if backward:
        for t in (q, k, v):
            t.requires_grad_()
    return q, k, v, dout


def _sdpa(q, k, v, **kw):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          enable_gqa=True, **kw).transpose(1, 2)


def _flex_call(case: harness.MaskCase, L: int):
    """A compiled FlexAttention call for the mask, its block mask built here (outside the timing)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    doc = torch.zeros(L, dtype=torch.int64)
    if case.documents is not None:
        doc = torch.repeat_interleave(torch.arange(len(case.documents)), torch.tensor(case.documents))
    window = case.spec.window

    def mask_mod(b, h, qi, ki):
        keep = ki <= qi
        if case.documents is not None:  # (a captured tensor only where needed: inductor's CPU template
            keep = keep & (doc[qi] == doc[ki])  # failed to compile the causal mask with it at L 16k)
        return keep & (qi - ki < window) if window is not None else keep

    block = create_block_mask(mask_mod, 1, 1, L, L, device="cpu")
    torch._dynamo.reset()  # one compile per mask: past dynamo's recompile limit flex falls back to dense scores
    compiled = torch.compile(flex_attention)

    def call(q, k, v):
        return compiled(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block,
                        enable_gqa=True).transpose(1, 2)
    return call


def workload(*, impl, mask, seq_len, heads, kv_heads, head_dim, dtype="float32", backward, flex=None):
    """A zero-argument callable running one implementation once (forward, or forward+backward)."""
    dtype = getattr(torch, dtype)
    case = mask_case(mask, seq_len)
    q, k, v, dout = _inputs(seq_len, heads, kv_heads, head_dim, dtype, backward)
    if impl in ("ours", "reference"):
        kw = case.attention_kwargs(seq_len)
        backend = None if impl == "ours" else "reference"

        def call():
            return cp_attention.attention(q, k, v, backend=backend, **kw)
    elif impl == "sdpa_causal":
        def call():
            return _sdpa(q, k, v, is_causal=True)
    elif impl == "sdpa_dense":
        dense = case.dense(seq_len)

        def call():
            return _sdpa(q, k, v, attn_mask=dense)
    elif impl == "flex":
        fn = flex or _flex_call(case, seq_len)

        def call():
            return fn(q, k, v)
    else:
        raise ValueError(f"unknown implementation {impl!r}")
    return bench_attention.one_pass(call, (q, k, v), dout, backward)


def accuracy(mask: str, L: int, heads: int, kv_heads: int, head_dim: int) -> dict:
    """Our largest errors against a float64 dense oracle (float32 inputs: out, dq, dk, dv) and the
    ratio of our bfloat16 out error to SDPA's (dense mask) on the same bfloat16 inputs."""
    case = mask_case(mask, L)
    dense = case.dense(L)
    kw = case.attention_kwargs(L)
    q64, k64, v64, dout64 = (t.detach().double() for t in _inputs(L, heads, kv_heads, head_dim, torch.float64, False))
    leaves = [t.clone().requires_grad_() for t in (q64, k64, v64)]
    ref = _sdpa(*leaves, attn_mask=dense)
    ref_grads = torch.autograd.grad(ref, leaves, dout64)
    q, k, v = (t.float().requires_grad_() for t in (q64, k64, v64))
    out = cp_attention.attention(q, k, v, **kw)
    grads = torch.autograd.grad(out, (q, k, v), dout64.float())
    errors = {"out": float((out.double() - ref).abs().max())}
    errors.update({name: float((g.double() - r).abs().max()) for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads)})
    qb, kb, vb = (t.bfloat16() for t in (q64, k64, v64))
    ref_b = _sdpa(*(t.double() for t in (qb, kb, vb)), attn_mask=dense)
    ours_b = cp_attention.attention(qb, kb, vb, **kw)
    torch_b = _sdpa(qb, kb, vb, attn_mask=dense)
    errors["bf16_out_vs_torch"] = float((ours_b.double() - ref_b).abs().max() / (torch_b.double() - ref_b).abs().max())
    return errors


def run_world_size_1(args, cfg, results: list[dict], save) -> None:
    shape = dict(heads=cfg["heads"], kv_heads=cfg["kv_heads"], head_dim=cfg["head_dim"])
    script = os.path.abspath(__file__)
    for L in cfg["seq_lens"]:
        for mask in cfg["masks"]:
            case = mask_case(mask, L)
            flex = _flex_call(case, L)
            for backward in (False, True):
                impls = ["ours", "sdpa_dense"] + (["sdpa_causal"] if case.kind == "causal" else [])
                impls += [] if backward else ["reference", "flex"]
                fns = {impl: workload(impl=impl, mask=mask, seq_len=L, backward=backward,
                                      flex=flex if impl == "flex" else None, **shape) for impl in impls}
                timings = harness.measure(fns, device=torch.device("cpu"), warmup=1, repeats=args.repeats)
                row = dict(mask=mask, seq_len=L, passes="fwd_bwd" if backward else "fwd",
                           dense_bound=L * L / visible_pairs(case.meta(L), case.spec),
                           seconds={n: t.median for n, t in timings.items()},
                           speedup={n: t.median / timings["ours"].median for n, t in timings.items() if n != "ours"})
                results.append(row)
                save()
                print(f"L {L:6d} {mask:22s} {row['passes']:7s} ours {timings['ours'].median:8.3f}s  " + "  ".join(
                    f"{n} {s:5.2f}x" for n, s in row["speedup"].items()), flush=True)
            if args.memory:
                loads = [harness.Workload(script, "workload", dict(impl=impl, mask=mask, seq_len=L, backward=True,
                                                                   **shape)) for impl in ("ours", "sdpa_causal")]
                warm = [harness.Workload(script, "workload", dict(load.kwargs, seq_len=min(L, 1024))) for load in loads]
                peaks = harness.peak_memory(loads, device=torch.device("cpu"), warm=warm)
                results.append(dict(mask=mask, seq_len=L, passes="memory", peak_bytes=dict(zip(("ours", "sdpa_causal"), peaks)),
                                    memory_ratio=peaks[0] / peaks[1]))
                save()
                print(f"L {L:6d} {mask:22s} peak memory fwd+bwd: ours / SDPA is_causal = {peaks[0] / peaks[1]:.2f}",
                      flush=True)
        if L == min(cfg["seq_lens"]) and args.accuracy:
            for mask in cfg["masks"]:
                errors = accuracy(mask, L, **shape)
                results.append(dict(mask=mask, seq_len=L, passes="accuracy", errors=errors))
                save()
                print(f"L {L:6d} {mask:22s} accuracy " + "  ".join(f"{n} {e:.2e}" for n, e in errors.items()), flush=True)


# ----------------------------------------------------------------------------------------------
# two ranks


def _rank_main(rank, world, port, cfg, mask, L, repeats, queue):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        case = mask_case(mask, L)
        q, k, v, _ = _inputs(L, cfg["heads"], cfg["kv_heads"], cfg["head_dim"], torch.float32, False)
        from cp_attention.layout import Layout

        layout = Layout.named("zigzag", L, world)
        indices = [torch.cat([torch.arange(x, y) for x, y in layout.rank_ranges(L, world, r)]) for r in range(world)]
        index = indices[rank]
        ql, kl, vl = (t[:, index] for t in (q, k, v))
        kw = case.attention_kwargs(L)
        pos = kw.pop("position_ids")
        local_pos = (pos if pos is not None else torch.arange(L)[None])[:, index]

        def ours():
            with torch.no_grad():
                return cp_attention.attention(ql, kl, vl, position_ids=local_pos, group=dist.group.WORLD,
                                              layout="zigzag", **kw)

        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        doc = torch.zeros(L, dtype=torch.int64) if case.documents is None else torch.repeat_interleave(
            torch.arange(len(case.documents)), torch.tensor(case.documents))
        window = case.spec.window

        def mask_mod(b, h, qi, ki):
            g = index[qi]
            keep = (ki <= g) & (doc[g] == doc[ki])
            return keep & (g - ki < window) if window is not None else keep

        block = create_block_mask(mask_mod, 1, 1, ql.shape[1], L, device="cpu")
        compiled = torch.compile(flex_attention)
        order = torch.argsort(torch.cat(indices))  # gathered rows -> global order

        def flex_cp():
            with torch.no_grad():
                parts = [torch.empty_like(kl) for _ in range(world)], [torch.empty_like(vl) for _ in range(world)]
                dist.all_gather(parts[0], kl.contiguous())
                dist.all_gather(parts[1], vl.contiguous())
                kg = torch.cat(parts[0], 1)[:, order]
                vg = torch.cat(parts[1], 1)[:, order]
                return compiled(ql.transpose(1, 2), kg.transpose(1, 2), vg.transpose(1, 2), block_mask=block,
                                enable_gqa=True).transpose(1, 2)

        fns = {"ours": ours, "flex_cp": flex_cp}
        for fn in fns.values():
            fn()
        dist.barrier()
        timings = harness.measure(fns, device=torch.device("cpu"), warmup=1, repeats=repeats)
        diff = float((ours() - flex_cp()).abs().max())
        queue.put((rank, {n: t.median for n, t in timings.items()}, diff))
    except BaseException as exc:  # report, never leave the parent waiting
        queue.put((rank, None, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        dist.barrier()
        dist.destroy_process_group()


def run_world_size_2(args, cfg, results: list[dict], save) -> None:
    import multiprocessing as mp
    import socket

    ctx = mp.get_context("spawn")
    for L in cfg["seq_lens"]:
        for mask in cfg["masks"]:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            queue = ctx.Queue()
            procs = [ctx.Process(target=_rank_main, args=(r, 2, port, cfg, mask, L, args.repeats, queue))
                     for r in range(2)]
            for p in procs:
                p.start()
            got = [queue.get(timeout=3600) for _ in procs]
            for p in procs:
                p.join()
            failed = [g[2] for g in got if g[1] is None]
            if failed:
                raise RuntimeError(f"two-rank run of {mask} at L {L} failed: {failed[0]}")
            slowest = {n: max(g[1][n] for g in got) for n in ("ours", "flex_cp")}
            row = dict(mask=mask, seq_len=L, passes="fwd", world_size=2, seconds=slowest,
                       speedup={"flex_cp": slowest["flex_cp"] / slowest["ours"]}, max_abs_diff=max(g[2] for g in got))
            results.append(row)
            save()
            print(f"P 2 L {L:6d} {mask:22s} fwd ours {slowest['ours']:8.3f}s  flex_cp {row['speedup']['flex_cp']:5.2f}x"
                  f"  |ours - flex_cp| {row['max_abs_diff']:.1e}", flush=True)


def readme_table(results: list[dict]) -> str:
    """The README's table: one row per mask, speedups (peer time / ours) at every L."""
    lines = ["| mask | L | dense bound | vs SDPA dense, fwd+bwd | vs SDPA is_causal, fwd / fwd+bwd | vs compiled Flex, fwd "
             "| vs reference, fwd | peak memory / SDPA is_causal | vs Flex CP (2 ranks), fwd |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    by = {(r["mask"], r["seq_len"], r["passes"], r.get("world_size", 1)): r for r in results}
    for mask, L in dict.fromkeys((r["mask"], r["seq_len"]) for r in results if r["passes"] == "fwd"):
        fwd, both = by.get((mask, L, "fwd", 1)), by.get((mask, L, "fwd_bwd", 1))
        mem, two = by.get((mask, L, "memory", 1)), by.get((mask, L, "fwd", 2))

        def x(row, name):
            return f"{row['speedup'][name]:.2f}" if row and name in row.get("speedup", {}) else "-"
        causal = f"{x(fwd, 'sdpa_causal')} / {x(both, 'sdpa_causal')}" if x(fwd, "sdpa_causal") != "-" else "-"
        lines.append(f"| {mask} | {L} | {fwd['dense_bound']:.1f} | {x(both, 'sdpa_dense')} | {causal} | {x(fwd, 'flex')} | {x(fwd, 'reference')} "
                     f"| {mem['memory_ratio']:.2f} |" if mem else "| - |")
        lines[-1] = lines[-1] + f" {x(two, 'flex_cp')} |"
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="folder for peers[_TAG].json")
    parser.add_argument("--tag", default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, two repeats")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=None)
    parser.add_argument("--masks", nargs="+", default=None)
    parser.add_argument("--world", type=int, nargs="+", default=[1], choices=[1, 2])
    parser.add_argument("--no-memory", dest="memory", action="store_false")
    parser.add_argument("--no-accuracy", dest="accuracy", action="store_false")
    parser.add_argument("--table", nargs="+", default=None, metavar="JSON",
                        help="print the README table of these result files and exit")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cfg = dict(SMOKE if args.smoke else DEFAULTS)
    if args.smoke:
        args.repeats = min(args.repeats, 2)
    cfg["seq_lens"] = args.seq_lens or cfg["seq_lens"]
    cfg["masks"] = args.masks or cfg["masks"]
    if args.table:
        print(readme_table([r for path in args.table for r in harness.load_results(path)["results"]]))
        return 0
    results: list[dict] = []

    def save() -> None:  # after every row, so a run that is stopped keeps what it measured
        if args.out:
            harness.write_results(os.path.join(args.out, f"peers{'_' + args.tag if args.tag else ''}.json"),
                                  benchmark="peers", machine=harness.machine_info(torch.device("cpu")),
                                  config=dict(cfg, dtype="float32", repeats=args.repeats, threads=1), results=results)
    if 1 in args.world:
        run_world_size_1(args, cfg, results, save)
    if 2 in args.world:
        run_world_size_2(args, cfg, results, save)
    print(readme_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
