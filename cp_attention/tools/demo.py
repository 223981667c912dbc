"""CPU demo: 2 gloo ranks run a sliding-window attention over packed documents.

Prints the largest difference between the context-parallel result and the single-device result
(forward and gradients), what the common "replace the mask by plain causal" CP path would get
wrong, and the K/V traffic of each rank against a full ring. Exits 1 if CP and single device
disagree.

    python -m cp_attention demo [--nproc 2] [--seq-len 2048] [--window 256]
"""

from __future__ import annotations

import argparse
import sys

import torch

import cp_attention
from cp_attention.tools.launch import run_ranks

TOLERANCE = 1e-5


def _inputs(args):
    gen = torch.Generator().manual_seed(0)
    L, H, K, D = args.seq_len, 4, 2, 32
    q = torch.randn(1, L, H, D, generator=gen)
    k = torch.randn(1, L, K, D, generator=gen)
    v = torch.randn(1, L, K, D, generator=gen)
    grad = torch.randn(1, L, H, D, generator=gen)
    # three packed documents; positions restart at 0 at every document
    lengths = [L * 11 // 32, L * 5 // 32]
    lengths.append(L - sum(lengths))
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    return q, k, v, grad, position_ids, lengths


def _run(q, k, v, grad, position_ids, window, cp=None):
    shard = cp.shard if cp is not None else (lambda t: t)
    leaves = [shard(t).clone().requires_grad_() for t in (q, k, v)]
    out = cp_attention.attention(*leaves, position_ids=shard(position_ids) if position_ids is not None else None,
                                 window=window)
    stats = cp_attention.last_plan_stats()
    out.backward(shard(grad))
    return [out.detach()] + [t.grad for t in leaves], stats


def _rank_main(rank, world_size, args):
    torch.set_num_threads(1)
    q, k, v, grad, position_ids, _ = _inputs(args)
    single, _ = _run(q, k, v, grad, position_ids, args.window)  # no context: single device
    with cp_attention.context_parallel(layout=args.layout) as cp:
        ours, stats = _run(q, k, v, grad, position_ids, args.window, cp)
        dropped, _ = _run(q, k, v, grad, None, None, cp)  # what "plain causal" CP computes
        errors = [(cp.gather(a) - b).abs().max().item() for a, b in zip(ours, single)]
        dropped_err = (cp.gather(dropped[0]) - single[0]).abs().max().item()
    return dict(errors=errors, dropped=dropped_err, stats=stats)


def parse_args(argv=None, *, prog: str = "python -m cp_attention demo") -> argparse.Namespace:
    """The demo's options; a bad value exits 2 with a one-line ``parser.error`` message."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="number of gloo ranks spawned on CPU (default 2)")
    parser.add_argument("--seq-len", type=int, default=2048,
                        help="tokens in the packed sequence (three documents), at least nproc (default 2048)")
    parser.add_argument("--window", type=int, default=256,
                        help="sliding window in tokens, at least 1 (default 256)")
    parser.add_argument("--layout", default="zigzag", choices=cp_attention.layout.LAYOUTS,
                        help=f"how tokens are sharded over ranks: {' or '.join(cp_attention.layout.LAYOUTS)} "
                             "(default zigzag)")
    args = parser.parse_args(argv)
    if args.nproc < 1:
        parser.error(f"--nproc must be at least 1, got {args.nproc}")
    if args.seq_len < args.nproc:
        parser.error(f"--seq-len must be at least nproc = {args.nproc} (every rank needs a token), "
                     f"got {args.seq_len}")
    if args.window < 1:
        parser.error(f"--window must be at least 1 token, got {args.window}")
    return args


def main(argv=None, *, prog: str = "python -m cp_attention demo") -> int:
    args = parse_args(argv, prog=prog)
    _, _, _, _, _, lengths = _inputs(args)
    results = run_ranks(args.nproc, _rank_main, args, timeout=600)
    print(f"cp_attention demo: {args.nproc} gloo ranks, {args.layout} layout, L={args.seq_len}, "
          f"window={args.window}, packed documents of {lengths} tokens, float32")
    names = ("out", "dq", "dk", "dv")
    worst = [max(r["errors"][i] for r in results) for i in range(4)]
    print("max |CP - single device|: " + ", ".join(f"{n} {e:.1e}" for n, e in zip(names, worst)))
    print(f"same inputs under CP with the mask replaced by plain causal: max |out error| "
          f"{max(r['dropped'] for r in results):.2f}")
    for r, res in enumerate(results):
        st = res["stats"]
        share = st.kv_bytes_recv / st.ring_kv_bytes_recv if st.ring_kv_bytes_recv else 0.0
        print(f"rank {r}: K/V received {st.kv_bytes_recv / 1024:.1f} KiB from ranks {list(st.peers_recv)} "
              f"= {100 * share:.1f}% of a full ring ({st.ring_kv_bytes_recv / 1024:.1f} KiB); "
              f"{st.kernel_calls} kernel calls, {st.entries_computed} scores for {st.entries_visible} visible")
    ok = max(worst) <= TOLERANCE
    print("OK: CP equals single device" if ok else f"FAIL: CP differs from single device by > {TOLERANCE}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
