"""The ``bench`` command: single-device ``cp_attention.attention`` against the peers a user has.

Times the forward (and with ``--backward`` the forward + backward) of one mask on the current
device (CUDA when available, else CPU), batch 1, as many K/V heads as query heads, against the
``--peers``:

* ``sdpa_dense``: ``torch.nn.functional.scaled_dot_product_attention`` given the same mask as a
  dense (L, L) boolean mask (the benchmarks' oracle, :mod:`cp_attention.tools.harness`);
* ``sdpa_causal``: SDPA with ``is_causal=True`` (the fused kernel), for the plain causal mask only;
* ``flex``: ``torch.compile(flex_attention)`` with the mask's block mask (compiled before the timing,
  which takes seconds); forward only on CPU, where FlexAttention has no backward.

It prints the median times and, per peer, the speedup: the peer's time over cp_attention's (> 1:
cp_attention is faster). On a shared CPU absolute times mean little: compare the speedups.

    cp-attention bench [--mask causal|window:W|documents:N|chunked:C] [--seq-len 2048] [--backward]
                       [--peers sdpa_dense,sdpa_causal,flex]
"""

from __future__ import annotations

import argparse
import sys
from types import MappingProxyType

import torch
import torch.nn.functional as F

import cp_attention
from cp_attention.masks import MaskSpec
from cp_attention.tools.harness import DTYPES, MaskCase, median_time, pick_device

__all__ = ["mask_case", "dense_mask", "parse_args", "main"]

MAX_SEQ_LEN = 32768  # the baseline materialises an (L, L) mask, and on CPU (H, L, L) scores
MASKS = "causal, window:W, documents:N or chunked:C"
PEERS = MappingProxyType({"sdpa_dense": "SDPA dense mask", "sdpa_causal": "SDPA is_causal", "flex": "compiled Flex"})


def _peers_arg(text: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in PEERS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(PEERS)}, got {text!r}")
    return names


def _mask_arg(text: str) -> tuple[str, int | None]:
    kind, sep, value = text.partition(":")
    if kind == "causal" and not sep:
        return kind, None
    if kind in ("window", "documents", "chunked") and value.isdigit() and int(value) >= 1:
        return kind, int(value)
    raise argparse.ArgumentTypeError(f"expected {MASKS} with a positive integer, got {text!r}")


def mask_case(kind: str, value: int | None, seq_len: int) -> MaskCase:
    """The mask of ``--mask KIND:VALUE`` over ``seq_len`` tokens, always causal: window:W (keys
    less than W tokens back), chunked:C (chunks of C tokens), documents:N (N packed documents whose
    lengths differ by at most one)."""
    if kind == "documents":
        base, extra = divmod(seq_len, value)
        lengths = tuple(base + (d < extra) for d in range(value))
        return MaskCase(name=f"documents:{value}", spec=MaskSpec(), documents=lengths)
    spec = MaskSpec(window=value if kind == "window" else None, chunk_size=value if kind == "chunked" else None)
    return MaskCase(name=kind if value is None else f"{kind}:{value}", spec=spec)


def dense_mask(kind: str, value: int | None, seq_len: int, device=None) -> torch.Tensor:
    """(L, L) bool, True where query ``q`` (row) sees key ``k`` (column): same document and
    ``0 <= q - k``; also ``|q - k| < W`` for window:W, the same ``position // C`` for chunked:C."""
    return mask_case(kind, value, seq_len).dense(seq_len, "cpu" if device is None else device)


def parse_args(argv=None, *, prog: str = "python -m cp_attention bench") -> argparse.Namespace:
    """The bench's options; a bad value exits 2 with a one-line ``parser.error`` message."""
    parser = argparse.ArgumentParser(prog=prog, description=(
        "Time single-device cp_attention.attention against its peers (SDPA with the same mask as a dense boolean "
        "mask, SDPA is_causal, compiled FlexAttention) and print each peer's speedup: its time over "
        "cp_attention's. On a shared CPU absolute times mean little: compare the speedups."))
    parser.add_argument("--mask", type=_mask_arg, default=("causal", None), metavar="MASK",
                        help="always causal: causal, window:W (keys less than W tokens back), documents:N "
                             "(N packed documents of equal length) or chunked:C (chunks of C tokens) "
                             "(default causal)")
    parser.add_argument("--seq-len", type=int, default=2048, help=f"tokens, 1 to {MAX_SEQ_LEN} (default 2048)")
    parser.add_argument("--heads", type=int, default=8, help="query and K/V heads, at least 1 (default 8)")
    parser.add_argument("--head-dim", type=int, default=64, help="head dimension, at least 1 (default 64)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="element type (default float32)")
    parser.add_argument("--backward", action="store_true", help="also time forward + backward")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs, the median is shown (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs first, at least 0 (default 1)")
    parser.add_argument("--peers", type=_peers_arg, default=list(PEERS), metavar="LIST",
                        help="comma-separated peers to time next to cp_attention: sdpa_dense (SDPA with the dense "
                             "mask), sdpa_causal (SDPA is_causal, causal mask only), flex (compiled FlexAttention, "
                             "forward only on CPU) (default all three)")
    args = parser.parse_args(argv)
    for name in ("heads", "head_dim", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be at least 0, got {args.warmup}")
    if not 1 <= args.seq_len <= MAX_SEQ_LEN:
        parser.error(f"--seq-len must be between 1 and {MAX_SEQ_LEN}, got {args.seq_len}")
    kind, value = args.mask
    if kind == "documents" and value > args.seq_len:
        parser.error(f"--mask documents:{value} needs at least {value} tokens, got --seq-len {args.seq_len}")
    return args


def main(argv=None, *, prog: str = "python -m cp_attention bench") -> int:
    args = parse_args(argv, prog=prog)
    (kind, value), L, H, D = args.mask, args.seq_len, args.heads, args.head_dim
    device = pick_device()
    dtype = DTYPES[args.dtype]
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, grad = (torch.randn(1, L, H, D, generator=gen, device=device, dtype=dtype) for _ in range(4))
    ours = [t.clone().requires_grad_() for t in (q, k, v)]  # (1, L, H, D)
    theirs = [t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]  # (1, H, L, D), SDPA's layout
    grad_theirs = grad.transpose(1, 2).contiguous()
    case = mask_case(kind, value, L)
    mask_kw = case.attention_kwargs(L)
    if mask_kw["position_ids"] is not None:
        mask_kw["position_ids"] = mask_kw["position_ids"].to(device)
    mask_LL = case.dense(L, device)

    def run_ours():
        return cp_attention.attention(*ours, **mask_kw)

    peers = {"sdpa_dense": lambda: F.scaled_dot_product_attention(*theirs, attn_mask=mask_LL)}
    if kind == "causal":  # is_causal expresses no other mask
        peers["sdpa_causal"] = lambda: F.scaled_dot_product_attention(*theirs, is_causal=True)
    if "flex" in args.peers:
        peers["flex"] = _flex(case, L, device, theirs)

    def with_backward(fn, leaves, grad_out):
        def step():
            for t in leaves:
                t.grad = None
            fn().backward(grad_out)
        return step

    names = [n for n in args.peers if n in peers]
    passes = {"forward": (torch.no_grad()(run_ours), {n: torch.no_grad()(peers[n]) for n in names})}
    if args.backward:  # FlexAttention has no backward on CPU
        passes["forward+backward"] = (with_backward(run_ours, ours, grad), {
            n: with_backward(peers[n], theirs, grad_theirs) for n in names if n != "flex" or device.type != "cpu"})
    with torch.no_grad():
        diff = (run_ours() - peers["sdpa_dense"]().transpose(1, 2)).abs().max().item()
    print(f"cp_attention bench: mask {kind}{'' if value is None else f':{value}'}, L={L}, {H} heads, head dim {D}, "
          f"{args.dtype}, {device.type}; median of {args.repeats} runs after {args.warmup} warmup")
    skipped = [PEERS[n] for n in args.peers if n not in peers]
    if skipped:
        print(f"not run: {', '.join(skipped)} (is_causal expresses the plain causal mask only)")
    for name, (ours_fn, peer_fns) in passes.items():
        t_ours = 1e3 * median_time(ours_fn, device=device, warmup=args.warmup, repeats=args.repeats)
        cells = [f"{name:<17} cp_attention {t_ours:9.2f} ms"]
        for peer, fn in peer_fns.items():
            t_peer = 1e3 * median_time(fn, device=device, warmup=args.warmup, repeats=args.repeats)
            cells.append(f"{PEERS[peer]} {t_peer:.2f} ms: speedup {t_peer / t_ours:.2f}x")
        print(" | ".join(cells))
    print("speedup = the peer's time / cp_attention's time (> 1: cp_attention is faster)")
    print(f"max |cp_attention - SDPA| on the output: {diff:.1e}")
    if device.type == "cpu":
        print("on a shared CPU absolute times mean little: compare the speedups")
    return 0


def _flex(case: MaskCase, L: int, device, theirs):
    """compiled flex_attention over ``case``'s mask, as a zero-argument call on the (1, H, L, D) inputs."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    doc = torch.zeros(L, dtype=torch.int64, device=device)
    if case.documents is not None:
        doc = torch.repeat_interleave(torch.arange(len(case.documents), device=device),
                                      torch.tensor(case.documents, device=device))
    spec = case.spec

    def mask_mod(b, h, qi, ki):
        keep = ki <= qi
        if case.documents is not None:
            keep = keep & (doc[qi] == doc[ki])
        if spec.window is not None:
            keep = keep & (qi - ki < spec.window)
        if spec.chunk_size is not None:
            keep = keep & (qi // spec.chunk_size == ki // spec.chunk_size)
        return keep

    block = create_block_mask(mask_mod, 1, 1, L, L, device=device)
    compiled = torch.compile(flex_attention)
    inputs = [t.detach() for t in theirs] if device.type == "cpu" else theirs  # no backward on CPU: no grad

    def call():
        return compiled(*inputs, block_mask=block)
    call()  # compiles: never inside the timing
    return call


if __name__ == "__main__":
    sys.exit(main())
