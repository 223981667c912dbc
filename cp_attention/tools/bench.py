"""The ``bench`` command: single-device ``cp_attention.attention`` against SDPA with a dense mask.

Times the forward (and with ``--backward`` the forward + backward) of one mask on the current
device (CUDA when available, else CPU), batch 1, as many K/V heads as query heads, against
``torch.nn.functional.scaled_dot_product_attention`` given the same mask as a dense (L, L) boolean
mask (the benchmarks' oracle, :mod:`cp_attention.tools.harness`), and prints median times and their
ratios. On a shared CPU absolute times mean little: compare the ratios.

    cp-attention bench [--mask causal|window:W|documents:N|chunked:C] [--seq-len 2048] [--backward]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

import cp_attention
from cp_attention.masks import MaskSpec
from cp_attention.tools.harness import DTYPES, MaskCase, median_time, pick_device

__all__ = ["mask_case", "dense_mask", "parse_args", "main"]

MAX_SEQ_LEN = 32768  # the baseline materialises an (L, L) mask, and on CPU (H, L, L) scores
MASKS = "causal, window:W, documents:N or chunked:C"


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


def parse_args(argv=None, *, prog: str = "python -m cp_attention.bench") -> argparse.Namespace:
    """The bench's options; a bad value exits 2 with a one-line ``parser.error`` message."""
    parser = argparse.ArgumentParser(prog=prog, description=(
        "Time single-device cp_attention.attention against torch SDPA given the same mask as a dense boolean "
        "mask. On a shared CPU absolute times mean little: compare the ratios."))
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


def main(argv=None, *, prog: str = "python -m cp_attention.bench") -> int:
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

    def run_theirs():
        return F.scaled_dot_product_attention(*theirs, attn_mask=mask_LL)

    def with_backward(fn, leaves, grad_out):
        def step():
            for t in leaves:
                t.grad = None
            fn().backward(grad_out)
        return step

    passes = {"forward": (torch.no_grad()(run_ours), torch.no_grad()(run_theirs))}
    if args.backward:
        passes["forward+backward"] = (with_backward(run_ours, ours, grad),
                                      with_backward(run_theirs, theirs, grad_theirs))
    with torch.no_grad():
        diff = (run_ours() - run_theirs().transpose(1, 2)).abs().max().item()
    print(f"cp_attention bench: mask {kind}{'' if value is None else f':{value}'}, L={L}, {H} heads, head dim {D}, "
          f"{args.dtype}, {device.type}; median of {args.repeats} runs after {args.warmup} warmup")
    print(f"{'pass':<18}{'cp_attention':>14}{'SDPA dense mask':>18}  ratio cp_attention / SDPA")
    for name, (a, b) in passes.items():
        t_ours, t_theirs = (1e3 * median_time(f, device=device, warmup=args.warmup, repeats=args.repeats)
                            for f in (a, b))
        print(f"{name:<18}{t_ours:>11.2f} ms{t_theirs:>15.2f} ms  {t_ours / t_theirs:.2f}")
    print(f"max |cp_attention - SDPA| on the output: {diff:.1e}")
    if device.type == "cpu":
        print("on a shared CPU absolute times mean little: compare the ratios")
    return 0


if __name__ == "__main__":
    sys.exit(main())
