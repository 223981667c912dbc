"""One GPU check: correctness of every GPU backend against the reference, then timings.

    python benchmarks/gpu_check.py            # on a CUDA machine, from a checkout (no install needed)
    python benchmarks/gpu_check.py --smoke    # tiny shapes, any device (exercises the code on CPU)

1. Correctness: every GPU backend's forward and backward against the reference backend in float32
   on the same device (the oracle), in bfloat16, on two sets of cases:

   * fixed cases (:data:`CASES`): causal, sliding window, packed documents with a window, softcap
     and GQA, queries and keys of one length;
   * real context-parallel calls (:func:`plan_cases`): every distinct kernel call of every rank's
     plan for a causal layer with window L/2 over L tokens (L = min(--seq-len, 8192)), zigzag and
     contiguous, P = 2 and 4, one document and packed documents: more queries than keys, keys
     before the queries, rows that see nothing. One row per plan and backend, from its worst call.

   Next to each, the bfloat16 errors of a plain torch implementation with the equivalent dense mask
   (SDPA; eager bfloat16 attention for softcap, which SDPA lacks, and for the plan calls, whose rows
   may see no key). A backend passes a case when its out, dq, dk and dv errors are each finite and
   within 2x of that baseline's (:func:`case_failures`). Every backend gets a row for every case:
   one that raises is recorded as a failure (:class:`CaseResult`), and on a CUDA device of sm80 or
   newer the flash backend skipped for any reason but a feature it declares unsupported (softcap
   on PyTorch's kernels) is a failure too (:func:`flash_skip_failure`), as is a flash package that
   is installed but does not import (:func:`flash_import_failures`). A fault that leaves the device
   unusable fails the rows not yet run, which are still printed. The verdict
   (:func:`overall_verdict`) is printed before any timing: exit 1 when any case fails, and on a
   CUDA device also when no GPU backend ran at all; a CPU ``--smoke`` run only exercises the check
   on the reference backend and says so: it is never a GPU pass. A timing that raises also makes
   the exit status 1; the last line states it.
2. Timing (median of CUDA-event timed repeats, after warm-up) of forward and forward+backward for
   each backend against ``scaled_dot_product_attention``: flash SDPA with ``is_causal`` for plain
   causal, SDPA with the dense mask for window and packed masks; the flash backend also against a
   direct call of the kernel it wraps (our overhead). TFLOP/s count visible (query, key) pairs only:
   4 * pairs * D * H for the forward, 3.5x that for forward+backward. Timing, dense masks and FLOPs
   come from the benchmarks' shared harness, :mod:`cp_attention.tools.harness`.

3. Strategies (:func:`strategy_timing`): ring, each usp split and ulysses side by side for a
   Qwen3-8B-shaped layer (H 32, K 8, D 128, bfloat16, L 32k) at simulated world sizes 4 and 8, one
   document and a packed batch, full and windowed masks: every candidate's busiest rank's
   forward+backward compute measured on this device (the other ranks simulated), the cost model's
   modeled layer time with its default constants and with the throughput calibrated on the ring's
   measured compute, and what auto picks under each. Exchanges are modeled (one device); real
   ranks: ``bench_strategies.py`` on a machine with several GPUs.

Meant to finish well within 8 minutes on one H200.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `python benchmarks/gpu_check.py` from a checkout: no install needed (the GPU
    sys.path.insert(0, ROOT)  # machine is offline: nothing to build an editable install with)

import cp_attention  # noqa: E402
from cp_attention.backends import BACKENDS  # noqa: E402
from cp_attention.masks import row_key_intervals  # noqa: E402
from cp_attention.masks import MaskSpec, SequenceMeta  # noqa: E402
from cp_attention.plan import build_plan  # noqa: E402
from cp_attention.tools import harness  # noqa: E402


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


@dataclasses.dataclass(frozen=True)
class Call:
    """One varlen call to check: query and key lengths per sequence and the contract's mask."""

    lengths_q: tuple[int, ...]
    lengths_k: tuple[int, ...]
    causal: bool
    window: tuple[int, int]
    softcap: float | None
    heads: tuple[int, int]


def fixed_cases(L: int) -> dict[str, list[Call]]:
    """:data:`CASES` at length ``L``: one call each, queries and keys of one length."""
    cases = {}
    for name, (fracs, causal, window, softcap, heads) in CASES.items():
        lengths = tuple(max(1, int(f * L)) for f in fracs)
        cases[name] = [Call(lengths, lengths, causal, window, softcap, heads)]
    return cases


PLAN_DOCUMENTS = {"1doc": None, "6docs": (0.014, 0.079, 0.626, 0.121, 0.076, 0.084)}
"""Documents of the plan cases as fractions of L (the second mix: a document longer than the window
among short ones, as in tests/unit/test_flash_translation.py)."""


def _document_lengths(fracs, L):
    lengths = [max(1, round(f * L)) for f in fracs[:-1]]
    return lengths + [L - sum(lengths)]


def plan_cases(L: int, heads=(16, 4)) -> dict[str, list[Call]]:
    """Every distinct kernel call of every rank's plan for a causal layer with window ``L // 2``
    over ``L`` tokens: zigzag and contiguous, P = 2 and 4, one document and :data:`PLAN_DOCUMENTS`;
    one case per (layout, P, documents), calls seen in an earlier case left out."""
    cases, seen = {}, set()
    for docs_name, fracs in PLAN_DOCUMENTS.items():
        cu = None if fracs is None else torch.tensor([0] + _document_lengths(fracs, L)).cumsum(0)
        meta = SequenceMeta.from_inputs(1, L, cu_seqlens=cu)
        for layout in ("zigzag", "contiguous"):
            for P in (2, 4):
                calls = []
                for rank in range(P):
                    plan = build_plan(meta, MaskSpec(window=L // 2), world_size=P, layout=layout, rank=rank,
                                      head_kv=heads[1], head_dim=8, itemsize=2)
                    for step in plan.steps():
                        for c in step.calls:
                            call = Call(tuple(c.cu_seqlens_q.diff().tolist()), tuple(c.cu_seqlens_k.diff().tolist()),
                                        c.causal, c.window, None, heads)
                            if call not in seen:
                                seen.add(call)
                                calls.append(call)
                if calls:
                    cases[f"plan:{layout}:P{P}:{docs_name}"] = calls
    return cases


def _inputs(call: Call, D, device, dtype, seed=0):
    """q (T, H, D), k/v (S, K, D), dout, cu_seqlens_q/k, max lengths and the mask keywords."""
    H, K = call.heads
    gen = torch.Generator(device="cpu").manual_seed(seed)
    T, S = sum(call.lengths_q), sum(call.lengths_k)
    q = torch.randn(T, H, D, generator=gen).to(device, dtype)
    k = torch.randn(S, K, D, generator=gen).to(device, dtype)
    v = torch.randn(S, K, D, generator=gen).to(device, dtype)
    dout = torch.randn(T, H, D, generator=gen).to(device, dtype)
    cu_q, cu_k = _cu(list(call.lengths_q), device), _cu(list(call.lengths_k), device)
    kw = dict(scale=D ** -0.5, causal=call.causal, window=call.window, softcap=call.softcap)
    return q, k, v, dout, cu_q, cu_k, max(call.lengths_q), max(call.lengths_k), kw


QUANTITIES = ("out", "dq", "dk", "dv")
FACTOR = 2.0
"""A backend's error may be at most this many times the baseline's (flash-attn's test rule)."""


@dataclasses.dataclass(frozen=True)
class CaseResult:
    """One backend on one case: skipped (with why), or its errors next to the baseline's (of the
    case's worst call). ``failures`` non-empty: the row fails, also for a skip that counts as a
    failure (:func:`flash_skip_failure`) and for a backend that raised."""

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


def flash_skip_failure(backend, reasons: list[str], *, capability, device, head_dim: int,
                       spec: MaskSpec) -> str | None:
    """Why skipping the flash backend on a case is a failure (None: it is not). On a CUDA device
    of sm80 or newer (``capability``; None: not CUDA) some flash interface is always there
    (PyTorch's own), so the flash backend must run every case but one that needs a feature it
    declares unsupported: the case counts as that only when the backend supports the same inputs
    without it (the softcap, the one optional feature of the cases). Anything else (an interface
    that does not import, a head dim none takes, a wrong device or dtype) fails the run."""
    if capability is None or tuple(capability) < (8, 0):
        return None
    if spec.softcap is not None and not backend.not_supported_reasons(
            device=device, dtype=torch.bfloat16, head_dim=head_dim, spec=dataclasses.replace(spec, softcap=None)):
        return None
    return (f"flash skipped on sm{capability[0]}{capability[1]} for a reason other than an unsupported feature: "
            + "; ".join(reasons))


def overall_verdict(results: list[CaseResult], *, device_type: str) -> tuple[int, str]:
    """Exit status and verdict line of a run. 1 when any row failed (errors, a raise, a flash skip
    that :func:`flash_skip_failure` counts); on CUDA also 1 when no GPU backend (anything but
    ``reference``) ran a single case; 0 otherwise. Off CUDA (``--smoke`` on CPU) a clean run is
    reported as a smoke run of the check, never as a GPU pass."""
    ran = [r for r in results if r.skipped is None]
    failed = [r for r in results if r.failures]
    gpu_ran = sorted({r.backend for r in ran if r.backend != "reference" and not r.failures})
    if failed:
        return 1, f"verdict: FAIL ({len(failed)} of {len(results)} rows: " + ", ".join(
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
    """Plain attention in the inputs' dtype (the baseline where SDPA cannot be one: softcap, and
    rows that see no key, which give 0 here and NaN in SDPA)."""
    rep = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q, kr) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    empty_T1 = ~mask.any(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(~mask, float("-inf")).masked_fill(empty_T1, 0.0), dim=-1)
    return torch.einsum("hqk,khd->qhd", p.masked_fill(empty_T1, 0.0), vr)


def _max_err(x, ref) -> float:
    return (x.float() - ref.float()).abs().max().item() if x.numel() else 0.0  # NaN propagates


def _errors(out, grads, ref_out, ref_grads) -> dict:
    errors = {"out": _max_err(out, ref_out)}
    errors.update({key: _max_err(g, r) for key, g, r in zip(QUANTITIES[1:], grads, ref_grads)})
    return errors


def _baseline(q, k, v, dout, mask, kw, ref_out, ref_grads) -> dict:
    """Errors of a plain torch implementation in the inputs' dtype (forward and gradients): SDPA
    with the dense mask, or :func:`_eager` for softcap and for calls with rows that see no key."""
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    if kw["softcap"] is None and bool(mask.any(-1).all()):
        out = _sdpa(qg, kg, vg, mask, kw["scale"])
    else:
        out = _eager(qg, kg, vg, mask, kw["scale"], kw["softcap"])
    out.backward(dout)
    return _errors(out.detach(), (qg.grad, kg.grad, vg.grad), ref_out, ref_grads)


def _ratio(errors: dict, baseline: dict) -> float:
    """How close a call came to failing: the largest error / baseline ratio (inf when unmeasured)."""
    ratios = []
    for key in QUANTITIES:
        err, base = errors.get(key, math.nan), baseline.get(key, math.nan)
        ratios.append(0.0 if err == 0 else err / base if base and math.isfinite(base) else math.inf)
    return max((r if math.isfinite(r) else math.inf) for r in ratios)


def _describe(call: Call) -> str:
    return (f"{len(call.lengths_q)} seq, {sum(call.lengths_q)} queries x {sum(call.lengths_k)} keys, "
            f"{'causal ' if call.causal else ''}window {call.window}")


def _raised(exc: BaseException) -> str:
    """``raised <Type>: <first line>`` (the first line may be missing: a bare ``assert``)."""
    lines = str(exc).strip().splitlines()
    return f"raised {type(exc).__name__}" + (f": {lines[0][:300]}" if lines else "")


def _sync(device) -> None:
    """Wait for the device: an asynchronous CUDA fault surfaces here, charged to the call before it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def correctness(backends, L, D, device, *, capability=None, plan_len=None) -> list[CaseResult]:
    """One :class:`CaseResult` per (case, backend): the fixed cases at length ``L`` and the plan
    cases at ``plan_len`` (default ``L``). ``capability``: the CUDA device's (None off CUDA), for
    :func:`flash_skip_failure`. A backend that raises (or whose support check raises) fails its
    row; when the oracle's side of a call raises (the device was left unusable, e.g. by a CUDA
    fault) every row not yet run fails as "not run", and the check still returns every row."""
    ref = BACKENDS["reference"]
    cases = {**fixed_cases(L), **plan_cases(plan_len or L)}
    results, lost = [], None
    for name, calls in cases.items():
        spec = MaskSpec(softcap=calls[0].softcap)
        rows = {}  # backend -> (worst ratio, errors, baseline, failures)
        for bname, backend in backends.items():
            if lost is not None:
                results.append(CaseResult(name, bname, failures=(f"not run: {lost}",)))
                continue
            try:
                reasons = backend.not_supported_reasons(device=device, dtype=torch.bfloat16, head_dim=D, spec=spec)
                failure = flash_skip_failure(backend, reasons, capability=capability, device=device, head_dim=D,
                                             spec=spec) if bname == "flash" and reasons else None
            except Exception as exc:  # noqa: BLE001 - a failing row, not a crash
                results.append(CaseResult(name, bname, failures=(f"support check {_raised(exc)}",)))
                continue
            if reasons:
                results.append(CaseResult(name, bname, skipped="; ".join(reasons),
                                          failures=(failure,) if failure else ()))
            else:
                rows[bname] = (-1.0, {}, {}, [])
        for n, call in enumerate(calls):
            if lost is not None:
                break
            where = f"call {n} ({_describe(call)}): " if len(calls) > 1 else ""
            try:
                q, k, v, dout, cu_q, cu_k, mq, mk, kw = _inputs(call, D, device, torch.bfloat16, seed=n)
                f32 = [t.float() for t in (q, k, v, dout)]
                ref_out, ref_lse = ref.forward(*f32[:3], cu_q, cu_k, mq, mk, **kw)
                ref_grads = ref.backward(f32[3], *f32[:3], ref_out, ref_lse, cu_q, cu_k, mq, mk, **kw)
                mask, _ = mask_and_pairs(cu_q.cpu(), cu_k.cpu(), kw["causal"], kw["window"], device)
                baseline = _baseline(q, k, v, dout, mask, kw, ref_out, ref_grads)
                _sync(device)
            except Exception as exc:  # noqa: BLE001 - the device is unusable: the rest fails as "not run"
                lost = f"the oracle of {name} {where or ''}{_raised(exc)}; the device is unusable after an earlier fault"
                for bname in rows:
                    rows[bname][3].append(lost)
                break
            for bname in rows:
                worst, errors_w, baseline_w, failures = rows[bname]
                try:
                    out, lse = backends[bname].forward(q, k, v, cu_q, cu_k, mq, mk, **kw)
                    grads = backends[bname].backward(dout, q, k, v, out, lse, cu_q, cu_k, mq, mk, **kw)
                    _sync(device)
                    errors = _errors(out, grads, ref_out, ref_grads)
                    failures += [where + f for f in case_failures(errors, baseline)]
                except Exception as exc:  # noqa: BLE001 - recorded as a failure; the other rows still run
                    errors = {}
                    failures.append(where + _raised(exc))
                ratio = _ratio(errors, baseline)
                if ratio > worst:
                    worst, errors_w, baseline_w = ratio, errors, baseline
                rows[bname] = (worst, errors_w, baseline_w, failures)
        for bname, (_, errors, baseline, failures) in rows.items():
            label = bname
            if bname == "flash":  # which flash interface ran this case
                iface = backends[bname].interface_for(device=device, head_dim=D, softcap=spec.softcap is not None)
                label = f"flash/{iface}"
            results.append(CaseResult(name, label, errors=errors, baseline=baseline, failures=tuple(failures)))
    return results


def flash_import_failures() -> list[CaseResult]:
    """A failing row for every flash interface that is installed but does not import (a broken
    build would otherwise only make the backend fall back to the next interface, unnoticed)."""
    from cp_attention.backends.flash import aten as aten_mod, backend as flash_mod

    rows = []
    for name, iface in flash_mod.INTERFACES.items():
        reason = iface.unavailable()
        if reason is not None and reason.startswith("not importable"):
            rows.append(CaseResult("flash import", f"flash/{name}", skipped=reason,
                                   failures=(f"{iface.label} is installed but {reason}",)))
    return rows


def format_result(r: CaseResult) -> str:
    verdict = "OK" if not r.failures else "FAIL: " + "; ".join(r.failures)
    if r.skipped is not None:
        return f"{r.case:24s} {r.backend:10s} skipped: {r.skipped}" + ("" if not r.failures else "  " + verdict)
    if not r.errors:
        return f"{r.case:24s} {r.backend:10s} {verdict}"
    errs = "  ".join(f"{key} {r.errors[key]:.2e} (base {r.baseline[key]:.2e})" for key in QUANTITIES)
    return f"{r.case:24s} {r.backend:10s} {errs}  {verdict}"


def timing(backends, L, D, device, repeats) -> tuple[list[str], list[str]]:
    """Rows of the timing table, and what raised while timing (each a failure of the run)."""
    rows, failures = [], []
    cases = fixed_cases(L)
    for name in ("causal", "window", "packed+window"):
        try:
            q, k, v, dout, cu, _, mx, _, kw = _inputs(cases[name][0], D, device, torch.bfloat16)
        except Exception as exc:  # noqa: BLE001 - the device is unusable
            failures.append(name)
            rows.append(f"{name:14s} inputs {_raised(exc)}")
            continue
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
                from cp_attention.backends.flash import aten as aten_mod, backend as flash_mod

                iface = backend.interface_for(device=device, head_dim=D)
                args = flash_mod.kernel_arguments(**kw)
                entries[f"{iface} direct"] = (
                    lambda i=iface, a=args: flash_mod.INTERFACES[i].forward(q, k, v, cu, cu, mx, mx, **a), None)
        base = None
        for ename, (fwd, fwd_bwd) in entries.items():
            try:
                t_f = harness.median_time(fwd, device=device, warmup=3, repeats=repeats)
                t_fb = (harness.median_time(fwd_bwd, device=device, warmup=3, repeats=repeats)
                        if fwd_bwd is not None else float("nan"))
            except Exception as exc:  # a row saying so; the other rows still run
                failures.append(f"{name}/{ename}")
                rows.append(f"{name:14s} {ename:18s} {_raised(exc)}")
                continue
            if device.type != "cuda":  # no absolute CPU times: ratios to the first row of the case
                base = base or (t_f, t_fb)
                rows.append(f"{name:14s} {ename:18s} fwd x{t_f / base[0]:6.2f}   fwd+bwd x{t_fb / base[1]:6.2f}"
                            f"   (time relative to {next(iter(entries))})")
                continue
            rows.append(f"{name:14s} {ename:18s} fwd {t_f * 1e3:8.3f} ms {fwd_flops / t_f / 1e12:7.1f} TFLOP/s   "
                        f"fwd+bwd {t_fb * 1e3:8.3f} ms {fwd_bwd_flops / t_fb / 1e12:7.1f} TFLOP/s")
    return rows, failures


def _rank_timer(plan, q, k, v, dout, layout, backend, device, repeats):
    """Seconds of one rank's forward+backward of ``plan`` (a ring plan over ``layout``) on ``device``,
    every other rank simulated (:class:`harness.SimComm` hands it the K/V spans its plan receives)."""
    from cp_attention import layout as layout_mod
    from cp_attention.strategies.ring import ring_attention

    P, r = plan.world_size, plan.rank
    shards = [[layout_mod.shard(t, 1, P, layout, s).contiguous() for s in range(P)] for t in (q, k, v, dout)]
    comm = harness.SimComm(plan, shards[1], shards[2])
    leaves = [shards[i][r].detach().requires_grad_() for i in range(3)]
    scale = q.shape[3] ** -0.5

    def run():
        ring_attention(*leaves, None, plan, comm, backend, scale=scale, softcap=None).backward(shards[3][r])

    return harness.median_time(run, device=device, warmup=2, repeats=repeats)


def strategy_timing(device, *, smoke: bool, repeats: int) -> tuple[list[str], list[str]]:
    """The strategies side by side on this one device (a Qwen3-8B-shaped layer: H 32, K 8, D 128,
    bfloat16, L 32k, simulated world sizes 4 and 8; --smoke: tiny): per world size, mask and batch,
    every candidate's busiest rank's forward+backward compute, measured (each rank's plan run in
    turn; under head parallelism one member per head group, with its heads), next to the cost
    model's: its modeled layer time with the default constants and with the throughput calibrated
    on the ring's measured busiest rank, and the candidate auto picks under each. The exchanges
    cannot be timed on one device: they stay modeled. Returns the rows and what raised."""
    import dataclasses as dc

    from cp_attention.backends import select_backend
    from cp_attention.strategies.choice import CostModel, candidates, layer_time, rank_plans

    H, K, D, L = (4, 2, 16, 256) if smoke else (32, 8, 128, 32768)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(1, L, H, D, generator=gen).to(device, dtype) for _ in range(2))
    k, v = (torch.randn(1, L, K, D, generator=gen).to(device, dtype) for _ in range(2))
    backend = select_backend("auto", device=device, dtype=dtype, head_dim=D, spec=MaskSpec())
    rows, failures = [], []
    batches = {"single": SequenceMeta.from_inputs(1, L),
               "packed": SequenceMeta.from_inputs(1, L, cu_seqlens=_cu(_document_lengths(
                   [0.4, 0.25, 0.15, 0.1, 0.06, 0.04], L), "cpu"))}
    dims = dict(heads=H, head_dim=D, head_dim_v=D)
    for P in ((2, 4) if smoke else (4, 8)):
        for data, meta in batches.items():
            for spec in (MaskSpec(), MaskSpec(window=max(L // 32, 8))):
                label = f"P={P} {data:6s} {'full' if spec.window is None else f'window {spec.window}'}"
                try:
                    measured, plans_of = {}, {}
                    for cand in candidates(P, H):
                        plans = rank_plans(meta, spec, cand, "zigzag", kv_heads=K, itemsize=q.element_size(), **dims)
                        plans_of[cand.name] = plans
                        if cand.ulysses == 1:
                            times = [_rank_timer(p, q, k, v, dout, "zigzag", backend, device, repeats)
                                     for p in plans.values()]
                        else:  # one member per head group: its heads, the ring over the head groups' tokens
                            times = []
                            for g in range(cand.world_size // cand.ulysses):
                                plan = plans[g * cand.ulysses]
                                h, kk = plan.split.q_per_rank, plan.split.q_per_rank // plan.split.group
                                ring_layout = ("contiguous" if plan.grid.ring == 1 else
                                               plan.grid.ring_layout(L, "zigzag"))
                                times.append(_rank_timer(plan.ring, q[:, :, :h].contiguous(), k[:, :, :kk].contiguous(),
                                                         v[:, :, :kk].contiguous(), dout[:, :, :h].contiguous(),
                                                         ring_layout, backend, device, repeats))
                        measured[cand.name] = max(times)
                    default = CostModel()
                    ring_stats = max((p.stats for p in plans_of["ring"].values()), key=lambda s: s.entries_computed)
                    flops = ring_stats.entries_computed * H * 2 * 2 * D * (1 + default.backward)
                    calibrated = dc.replace(default, throughput=flops / measured["ring"])
                    modeled = {n: layer_time(default, p, **dims) for n, p in plans_of.items()}
                    tuned = {n: layer_time(calibrated, p, **dims) for n, p in plans_of.items()}
                    base = measured["ring"]
                    for name in measured:
                        timing_cell = (f"{measured[name] * 1e3:8.2f} ms" if device.type == "cuda"
                                       else f"x{measured[name] / base:5.2f} of ring")
                        rows.append(f"{label:22s} {name:9s} busiest compute {timing_cell}   modeled layer "
                                    f"{modeled[name] * 1e3:8.3f} ms (calibrated {tuned[name] * 1e3:8.3f} ms)")
                    rows.append(f"{label:22s} auto picks {min(modeled, key=modeled.get)} (default model), "
                                f"{min(tuned, key=tuned.get)} (calibrated: "
                                f"{calibrated.throughput / 1e12:.3g} TFLOP/s); "
                                f"fastest measured compute: {min(measured, key=measured.get)}")
                except Exception as exc:  # noqa: BLE001 - a row saying so; the others still run
                    failures.append(label)
                    rows.append(f"{label:22s} {_raised(exc)}")
    return rows, failures


def main(argv=None, backends=None, capability=None) -> int:
    """Run the check; ``backends`` (name -> backend) replaces the backends under test and
    ``capability`` the device's compute capability (tests run both on CPU)."""
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
    if capability is None and cuda:
        capability = tuple(torch.cuda.get_device_capability())
    L, D, repeats = (128, 16, 2) if args.smoke else (args.seq_len, args.head_dim, args.repeats)
    if backends is None:
        backends = {n: b for n, b in BACKENDS.items() if n != "reference"}
        if not cuda:  # no GPU backend can run here: exercise the check on the reference
            backends = {"reference": BACKENDS["reference"]}
    print(f"device: {torch.cuda.get_device_name() if cuda else 'cpu'}; torch {torch.__version__}; "
          f"cp_attention {cp_attention.__version__} from {os.path.dirname(os.path.abspath(cp_attention.__file__))}; "
          f"L={L}, D={D}")
    if "flash" in backends and cuda:
        from cp_attention.backends.flash import aten as aten_mod, backend as flash_mod

        name, rejected = flash_mod.pick_interface(capability=capability, head_dim=D, softcap=False)
        label = flash_mod.INTERFACES[name].label if name else "none"
        print(f"flash interface: {label}" + "".join(f"\n  passed over {r}" for r in rejected))
    print("== correctness (bfloat16 vs float32 reference on the same device; errors: max abs, "
          "base = plain torch bfloat16; plan rows: their worst call) ==")
    results = correctness(backends, min(L, 2048), D, device, capability=capability, plan_len=min(L, 8192))
    if "flash" in backends:
        results += flash_import_failures()
    print("\n".join(map(format_result, results)))
    status, line = overall_verdict(results, device_type=device.type)
    print(line, flush=True)
    print("== timing (bfloat16) ==")
    rows, failures = timing(backends, L, D, device, repeats)
    print("\n".join(rows))
    if failures:
        print(f"timing: FAIL ({len(failures)} rows raised: {', '.join(failures)})")
        status = 1
    print("== strategies (one device; other ranks simulated; exchanges modeled) ==")
    rows, failures = strategy_timing(device, smoke=args.smoke, repeats=max(2, repeats // 4))
    print("\n".join(rows))
    if failures:
        print(f"strategies: FAIL ({len(failures)} rows raised: {', '.join(failures)})")
        status = 1
    print(f"exit status {status}: " + ("correctness and timing ran clean" if status == 0 else
                                      "see the verdict and the timing lines above"))
    return status


if __name__ == "__main__":
    sys.exit(main())
