"""One GPU check: correctness of every GPU backend against the reference, then timings.

    python benchmarks/gpu_check.py            # on a CUDA machine; prints the timing table last
    python benchmarks/gpu_check.py --smoke    # tiny shapes, any device (exercises the code on CPU)

1. Correctness: every GPU backend's forward and backward against the reference backend in float32
   on the same device (the oracle), for causal, sliding window, packed documents with a window,
   softcap and GQA, in bfloat16; next to the bfloat16 errors of a plain torch implementation with
   the equivalent dense mask (SDPA; for softcap, which SDPA lacks, eager bfloat16 attention). A
   backend passes a case when its out, dq, dk and dv errors are each finite and within 2x of that
   baseline's (:func:`case_failures`). The run fails (exit 1) when any case fails, and on a CUDA
   device also when no GPU backend ran at all (:func:`overall_verdict`); a CPU ``--smoke`` run only
   exercises the check on the reference backend and says so: it is never a GPU pass.
2. Timing (median of CUDA-event timed repeats, after warm-up) of forward and forward+backward for
   each backend against ``scaled_dot_product_attention``: flash SDPA with ``is_causal`` for plain
   causal, SDPA with the dense mask for window and packed masks; the flash backend also against a
   direct call of the kernel it wraps (our overhead). TFLOP/s count visible (query, key) pairs only:
   4 * pairs * D * H for the forward, 3.5x that for forward+backward. Timing, dense masks and FLOPs
   come from the benchmarks' shared harness, :mod:`cp_attention.tools.harness`.

Meant to finish well within 8 minutes on one H200.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

import torch
import torch.nn.functional as F

from cp_attention.backends import BACKENDS
from cp_attention.backends.base import row_key_intervals
from cp_attention.masks import MaskSpec
from cp_attention.tools import harness


def _cu(lengths, device):
    return torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)


def mask_and_pairs(cu_q, cu_k, causal, window, device) -> tuple[torch.Tensor, int]:
    """(Tq, Tk) bool mask of the contract's semantics on ``device``, for the SDPA baselines, and the
    number of visible pairs (its True entries)."""
    lo, hi = row_key_intervals(cu_q, cu_k, causal=causal, window=window)
    return harness.interval_mask(lo, hi, int(cu_k[-1]), device), harness.interval_pairs(lo, hi)


def _sdpa(q, k, v, mask, scale, is_causal=False):
    """q (T, H, D), k/v (S, K, D) -> (T, H, D) with GQA by repetition (the baseline's cost)."""
    rep = q.shape[1] // k.shape[1]
    qb, kb, vb = (t.transpose(0, 1).unsqueeze(0) for t in (q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)))
    out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, is_causal=is_causal, scale=scale)
    return out.squeeze(0).transpose(0, 1)


CASES = {  # name: (sequence lengths as fractions of L, causal, window, softcap, (H, K))
    "causal": ([1.0], True, (-1, -1), None, (16, 16)),
    "window": ([1.0], True, (1023, 0), None, (16, 16)),
    "packed+window": ([0.25, 0.125, 0.5, 0.125], True, (511, 0), None, (16, 4)),
    "softcap": ([1.0], True, (-1, -1), 30.0, (16, 16)),
    "gqa": ([1.0], True, (-1, -1), None, (32, 4)),
}


def _inputs(case, L, D, device, dtype, seed=0):
    fracs, causal, window, softcap, (H, K) = case
    lengths = [max(1, int(f * L)) for f in fracs]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    T = sum(lengths)
    q = torch.randn(T, H, D, generator=gen).to(device, dtype)
    k = torch.randn(T, K, D, generator=gen).to(device, dtype)
    v = torch.randn(T, K, D, generator=gen).to(device, dtype)
    dout = torch.randn(T, H, D, generator=gen).to(device, dtype)
    cu = _cu(lengths, device)
    return q, k, v, dout, cu, max(lengths), dict(scale=D ** -0.5, causal=causal, window=window, softcap=softcap)


QUANTITIES = ("out", "dq", "dk", "dv")
FACTOR = 2.0
"""A backend's error may be at most this many times the baseline's (flash-attn's test rule)."""


@dataclasses.dataclass(frozen=True)
class CaseResult:
    """One backend on one case: skipped (with why), or its errors next to the baseline's."""

    case: str
    backend: str
    skipped: str | None = None
    errors: dict = dataclasses.field(default_factory=dict)
    baseline: dict = dataclasses.field(default_factory=dict)
    failures: tuple[str, ...] = ()


def case_failures(errors: dict, baseline: dict, factor: float = FACTOR) -> list[str]:
    """Why one backend fails one case (empty: it passes). ``errors`` and ``baseline`` map each of
    :data:`QUANTITIES` (forward out and the three gradients) to a max abs error against the float32
    oracle; every one must be finite and at most ``factor`` x the baseline's. A quantity missing
    from either side, or a baseline that is not finite, fails: nothing passes unmeasured."""
    failures = []
    for key in QUANTITIES:
        err, base = errors.get(key), baseline.get(key)
        if err is None or base is None or not math.isfinite(base):
            failures.append(f"{key}: not measured (err {err}, baseline {base})")
            continue
        ok = math.isfinite(err) and err <= factor * base
        if not ok:
            failures.append(f"{key} err {err:.2e} > {factor:g}x baseline {base:.2e}")
    return failures


def overall_verdict(results: list[CaseResult], *, device_type: str) -> tuple[int, str]:
    """Exit status and verdict line of a run. 1 when any case failed; on CUDA also 1 when no GPU
    backend (anything but ``reference``) ran a single case; 0 otherwise. Off CUDA (``--smoke`` on
    CPU) a clean run is reported as a smoke run of the check, never as a GPU pass."""
    ran = [r for r in results if r.skipped is None]
    failed = [r for r in ran if r.failures]
    gpu_ran = sorted({r.backend for r in ran if r.backend != "reference"})
    if failed:
        return 1, f"verdict: FAIL ({len(failed)} of {len(ran)} checks: " + ", ".join(
            f"{r.case}/{r.backend}" for r in failed) + ")"
    if device_type == "cuda":
        ok = bool(gpu_ran)
        if not ok:
            skipped = sorted({r.backend for r in results})
            return 1, ("verdict: FAIL (no GPU backend ran on this CUDA device; every backend was skipped: "
                       f"{', '.join(skipped) or 'none given'})")
        return 0, f"verdict: PASS on {device_type} ({len(ran)} checks; GPU backends: {', '.join(gpu_ran)})"
    names = sorted({r.backend for r in ran})
    return 0, (f"verdict: no GPU backend on {device_type}; smoke run of the check only "
               f"({len(ran)} checks on {', '.join(names) or 'no backend'}), not a GPU pass")


def _eager(q, k, v, mask, scale, softcap):
    """Plain attention in the inputs' dtype (the softcap baseline, which SDPA cannot express)."""
    rep = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q, kr) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", p, vr)


def _max_err(x, ref) -> float:
    return (x.float() - ref.float()).abs().max().item()  # NaN propagates


def _errors(out, grads, ref_out, ref_grads) -> dict:
    errors = {"out": _max_err(out, ref_out)}
    errors.update({key: _max_err(g, r) for key, g, r in zip(QUANTITIES[1:], grads, ref_grads)})
    return errors


def _baseline(q, k, v, dout, mask, kw, ref_out, ref_grads) -> dict:
    """Errors of a plain torch implementation in the inputs' dtype (forward and gradients)."""
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    if kw["softcap"] is None:
        out = _sdpa(qg, kg, vg, mask, kw["scale"])
    else:
        out = _eager(qg, kg, vg, mask, kw["scale"], kw["softcap"])
    out.backward(dout)
    return _errors(out.detach(), (qg.grad, kg.grad, vg.grad), ref_out, ref_grads)


def correctness(backends, L, D, device) -> list[CaseResult]:
    results, ref = [], BACKENDS["reference"]
    for name, case in CASES.items():
        q, k, v, dout, cu, mx, kw = _inputs(case, L, D, device, torch.bfloat16)
        f32 = [t.float() for t in (q, k, v, dout)]
        ref_out, ref_lse = ref.forward(*f32[:3], cu, cu, mx, mx, **kw)
        ref_grads = ref.backward(f32[3], *f32[:3], ref_out, ref_lse, cu, cu, mx, mx, **kw)
        mask, _ = mask_and_pairs(cu.cpu(), cu.cpu(), kw["causal"], kw["window"], device)
        baseline = _baseline(q, k, v, dout, mask, kw, ref_out, ref_grads)
        for bname, backend in backends.items():
            spec = MaskSpec(softcap=kw["softcap"])
            reasons = backend.not_supported_reasons(device=device, dtype=torch.bfloat16, head_dim=D, spec=spec)
            if reasons:
                results.append(CaseResult(name, bname, skipped="; ".join(reasons)))
                continue
            out, lse = backend.forward(q, k, v, cu, cu, mx, mx, **kw)
            grads = backend.backward(dout, q, k, v, out, lse, cu, cu, mx, mx, **kw)
            errors = _errors(out, grads, ref_out, ref_grads)
            if bname == "flash":  # which flash interface ran this case
                bname = f"flash/{backend.interface_for(device=device, head_dim=D, softcap=spec.softcap is not None)}"
            results.append(CaseResult(name, bname, errors=errors, baseline=baseline,
                                      failures=tuple(case_failures(errors, baseline))))
    return results


def format_result(r: CaseResult) -> str:
    if r.skipped is not None:
        return f"{r.case:14s} {r.backend:10s} skipped: {r.skipped}"
    errs = "  ".join(f"{key} {r.errors[key]:.2e} (base {r.baseline[key]:.2e})" for key in QUANTITIES)
    return f"{r.case:14s} {r.backend:10s} {errs}  " + ("OK" if not r.failures else "FAIL: " + "; ".join(r.failures))


def timing(backends, L, D, device, repeats) -> list[str]:
    rows = []
    for name in ("causal", "window", "packed+window"):
        q, k, v, dout, cu, mx, kw = _inputs(CASES[name], L, D, device, torch.bfloat16)
        mask, pairs = mask_and_pairs(cu.cpu(), cu.cpu(), kw["causal"], kw["window"], device)
        fwd_flops = harness.pair_flops(pairs, heads=q.shape[1], head_dim=D, backward=False)
        fwd_bwd_flops = harness.pair_flops(pairs, heads=q.shape[1], head_dim=D, backward=True)
        entries = {}
        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
        if name == "causal":
            entries["sdpa is_causal"] = (lambda: _sdpa(q, k, v, None, kw["scale"], True),
                                         lambda: _sdpa(qg, kg, vg, None, kw["scale"], True).backward(dout))
        entries["sdpa dense mask"] = (lambda: _sdpa(q, k, v, mask, kw["scale"]),
                                      lambda: _sdpa(qg, kg, vg, mask, kw["scale"]).backward(dout))
        for bname, backend in backends.items():
            if backend.not_supported_reasons(device=device, dtype=q.dtype, head_dim=D, spec=MaskSpec()):
                continue

            def fwd(b=backend):
                return b.forward(q, k, v, cu, cu, mx, mx, **kw)

            def fwd_bwd(b=backend):
                out, lse = b.forward(q, k, v, cu, cu, mx, mx, **kw)
                b.backward(dout, q, k, v, out, lse, cu, cu, mx, mx, **kw)

            entries[bname] = (fwd, fwd_bwd)
            if bname == "flash" and device.type == "cuda":  # the kernel it wraps, called directly
                from cp_attention.backends import flash as flash_mod

                iface = backend.interface_for(device=device, head_dim=D)
                args = flash_mod.kernel_arguments(**kw)
                entries[f"{iface} direct"] = (
                    lambda i=iface, a=args: flash_mod.INTERFACES[i].forward(q, k, v, cu, cu, mx, mx, **a), None)
        base = None
        for ename, (fwd, fwd_bwd) in entries.items():
            t_f = harness.median_time(fwd, device=device, warmup=3, repeats=repeats)
            t_fb = (harness.median_time(fwd_bwd, device=device, warmup=3, repeats=repeats) if fwd_bwd is not None
                    else float("nan"))
            if device.type != "cuda":  # no absolute CPU times: ratios to the first row of the case
                base = base or (t_f, t_fb)
                rows.append(f"{name:14s} {ename:18s} fwd x{t_f / base[0]:6.2f}   fwd+bwd x{t_fb / base[1]:6.2f}"
                            f"   (time relative to {next(iter(entries))})")
                continue
            rows.append(f"{name:14s} {ename:18s} fwd {t_f * 1e3:8.3f} ms {fwd_flops / t_f / 1e12:7.1f} TFLOP/s   "
                        f"fwd+bwd {t_fb * 1e3:8.3f} ms {fwd_bwd_flops / t_fb / 1e12:7.1f} TFLOP/s")
    return rows


def main(argv=None, backends=None) -> int:
    """Run the check; ``backends`` (name -> backend) replaces the backends under test (tests)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on any device")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("gpu_check needs a CUDA device (use --smoke for a tiny run on any device)")
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    L, D, repeats = (128, 16, 2) if args.smoke else (args.seq_len, args.head_dim, args.repeats)
    if backends is None:
        backends = {n: b for n, b in BACKENDS.items() if n != "reference"}
        if not cuda:  # no GPU backend can run here: exercise the check on the reference
            backends = {"reference": BACKENDS["reference"]}
    print(f"device: {torch.cuda.get_device_name() if cuda else 'cpu'}; torch {torch.__version__}; L={L}, D={D}")
    if "flash" in backends and cuda:
        from cp_attention.backends import flash as flash_mod

        name, rejected = flash_mod.pick_interface(capability=torch.cuda.get_device_capability(), head_dim=D,
                                                  softcap=False)
        label = flash_mod.INTERFACES[name].label if name else "none"
        print(f"flash interface: {label}" + "".join(f"\n  passed over {r}" for r in rejected))
    print("== correctness (bfloat16 vs float32 reference on the same device; errors: max abs, "
          "base = plain torch bfloat16) ==")
    results = correctness(backends, min(L, 2048), D, device)
    print("\n".join(map(format_result, results)))
    print("== timing (bfloat16) ==")
    print("\n".join(timing(backends, L, D, device, repeats)))
    status, line = overall_verdict(results, device_type=device.type)
    print(line)
    return status


if __name__ == "__main__":
    sys.exit(main())
