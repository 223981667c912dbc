"""Workers shared by the isolation and determinism tests (tests/multirank/test_isolation.py,
tests/multirank/test_determinism.py).

Spawning gloo ranks is the expensive part of a multi-rank test (every rank imports torch), so one
spawned group per (world size, backend) runs every case with every layout (zigzag, contiguous and
each case's own balanced layout) and checks both
properties:

* isolation: every case packs documents; one "victim" document gets different values, NaN or
  +-Inf in q, k, v and in the upstream gradient of its rows. Every other token (other documents
  of the row, other rows) must keep bit-identical outputs and q/k/v gradients, and stay finite.
* determinism: the same inputs run again in the same context (cached plan) and in a fresh context
  (plan built again) give bit-identical outputs and gradients, sinks' gradient included.

``group_report`` caches each group's result in this process, so the two test files share one spawn
per configuration when they run in one pytest session.

Legend: ``B`` batch rows, ``L`` global length, ``H``/``K`` query/KV heads, ``D`` head dim.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist

import cp_attention
from rank_pool import single_thread

VARIANTS = ("changed", "nan", "inf")
TENSORS = ("out", "dq", "dk", "dv")

# documents of the packed rows: row 0 has a short document, one that crosses shard edges at every
# world size used here, and two more; row 1 is split differently (boundaries elsewhere)
ROWS_90 = [[7, 30, 25, 28], [50, 40]]


def isolation_cases(backend: str, world_size: int) -> list[dict]:
    """Cases for the isolation and determinism checks: every mask kind, documents given by
    ``position_ids`` (B = 2) and by ``cu_seqlens`` (B = 1); the victim document varies. Four ranks
    get a subset (still every mask kind); Triton's interpreter one tiny case per world size."""
    if backend == "triton":  # the Triton interpreter is slow: tiny shapes, one case per world size
        if world_size > 1:
            return [dict(L=32, B=1, docs=("cu", [9, 3, 20]), heads=(2, 1), head_dim=16, name="triton-cu-bidir-window",
                         victim=(0, 1), causal=False, window=4)]
        return [dict(L=32, B=1, docs=("pos", [[5, 14, 13]]), heads=(2, 1), head_dim=16,
                     name="triton-pos-chunked-softcap-sinks", victim=(0, 1), chunk_size=6, softcap=2.0, sinks=True)]
    base = dict(L=90, B=2, docs=("pos", ROWS_90), heads=(4, 2), head_dim=16)
    cu = dict(L=90, B=1, docs=("cu", [11, 37, 2, 40]), heads=(4, 2), head_dim=16)
    # victim (row, document): one crossing shard edges, the first, the last, one in the other row
    cases = [
        dict(base, name="pos/causal-sinks", victim=(0, 1), sinks=True),
        dict(base, name="pos/bidirectional-softcap", victim=(0, 0), causal=False, softcap=2.0),
        dict(base, name="pos/window-small", victim=(0, 3), window=4),
        dict(base, name="pos/window-across-shards-softcap", victim=(1, 1), window=40, softcap=2.0),
        dict(base, name="pos/bidir-window", victim=(0, 1), causal=False, window=9),
        dict(base, name="pos/chunked", victim=(0, 2), chunk_size=8),
        dict(base, name="pos/bidir-chunked-across-shards-sinks", victim=(1, 0), causal=False, chunk_size=33,
             sinks=True),
        dict(base, name="pos/mqa-window-softcap-sinks", victim=(0, 1), heads=(4, 1), window=12, softcap=3.0,
             sinks=True),
        dict(cu, name="cu/causal-window", victim=(0, 1), window=15),
        dict(cu, name="cu/bidir-chunked-sinks", victim=(0, 2), causal=False, chunk_size=10, sinks=True),
    ]
    if world_size >= 4:  # four ranks on a small machine: a subset that still has every mask kind
        keep = ("pos/causal-sinks", "pos/bidirectional-softcap", "pos/window-across-shards-softcap", "pos/chunked",
                "pos/mqa-window-softcap-sinks", "cu/bidir-chunked-sinks")
        cases = [c for c in cases if c["name"] in keep]
    return cases


def _doc_rows(case: dict) -> list[list[int]]:
    kind, lengths = case["docs"]
    return lengths if kind == "pos" else [lengths]


def _global_inputs(case: dict, seed: int):
    """Global float32 q, k, v, dout, sinks (or None), the victim mask (B, L) and the document args."""
    B, L, (H, K), D = case["B"], case["L"], case["heads"], case["head_dim"]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, L, H, D, generator=gen)
    k = torch.randn(B, L, K, D, generator=gen)
    v = torch.randn(B, L, K, D, generator=gen)
    dout = torch.randn(B, L, H, D, generator=gen)
    sinks = torch.randn(H, generator=gen) if case.get("sinks") else None
    rows = _doc_rows(case)
    victim_BL = torch.zeros(B, L, dtype=torch.bool)
    vrow, vdoc = case["victim"]
    start = sum(rows[vrow][:vdoc])
    victim_BL[vrow, start:start + rows[vrow][vdoc]] = True
    position_ids = cu_seqlens = None
    if case["docs"][0] == "pos":
        position_ids = torch.tensor([[p for n in row for p in range(n)] for row in rows], dtype=torch.int64)
    else:
        cu_seqlens = torch.tensor([0] + rows[0], dtype=torch.int64).cumsum(0).to(torch.int32)
    return (q, k, v, dout, sinks), victim_BL, position_ids, cu_seqlens


def _variant(tensors, victim_BL: torch.Tensor, variant: str, seed: int):
    """Copies of q, k, v, dout whose victim tokens are changed, NaN or +-Inf (sinks unchanged)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for t in tensors[:4]:
        t = t.clone()
        n = int(victim_BL.sum()) * t[0, 0].numel()
        if variant == "changed":
            fill = 3.0 * torch.randn(n, generator=gen)
        elif variant == "nan":
            fill = torch.full((n,), float("nan"))
        else:
            sign = torch.randint(0, 2, (n,), generator=gen).float() * 2 - 1
            fill = sign * float("inf")
        t[victim_BL] = fill.view(-1, *t.shape[2:])
        out.append(t)
    return out + [tensors[4]]


def _run(cp, case, tensors, position_ids, cu_seqlens, backend):
    """One forward and backward on this rank's shard in context ``cp`` (``position_ids`` already
    sharded); local results, detached."""
    q, k, v, dout, sinks = tensors
    leaves = [cp.shard(t).detach().clone().requires_grad_() for t in (q, k, v)]
    sinks_in = sinks.detach().clone().requires_grad_() if sinks is not None else None
    out = cp_attention.attention(
        *leaves, position_ids=position_ids, cu_seqlens=cu_seqlens, causal=case.get("causal", True),
        window=case.get("window"), chunk_size=case.get("chunk_size"), softcap=case.get("softcap"), sinks=sinks_in,
        backend=backend)
    out.backward(cp.shard(dout))
    res = dict(out=out.detach().clone(), dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad)
    if sinks_in is not None:
        res["dsinks"] = sinks_in.grad
    return res


def _isolation(base: dict, res: dict, victim_local: torch.Tensor, finite: bool) -> tuple[list[str], int]:
    """Problems on this rank's other-document tokens, and how many victim values changed."""
    others = ~victim_local
    problems, changed = [], 0
    for name in TENSORS:
        a, b = base[name][others], res[name][others]
        if not torch.equal(a, b):
            bad = (a != b) & ~(torch.isnan(a) & torch.isnan(b))
            problems.append(f"{name}: {int(bad.sum())} of {a.numel()} other-document values differ")
        if finite and not bool(torch.isfinite(b).all()):
            problems.append(f"{name}: {int((~torch.isfinite(b)).sum())} other-document values are not finite")
        changed += int((base[name][victim_local] != res[name][victim_local]).sum())
    return problems, changed


def check_group(rank: int, world_size: int, layouts: tuple[str, ...], backend: str, cases: list[dict],
                cached_rerun: bool = True) -> dict:
    """Worker (any world size; also callable without a process group at world size 1): for every
    layout and case, run the baseline three times (twice without ``cached_rerun``) and each victim
    variant once.

    Returns ``{layout: [report per case]}``; a report holds ``determinism`` {tensor: bit-identical
    in the rerun with the cached plan and in a fresh context}, ``isolation`` {variant: problems on
    this rank}, ``victim_changed`` (victim values the "changed" variant altered on this rank: the
    perturbation is not vacuous) and, on rank 0, ``full``: the baseline gathered to global order as
    numpy arrays (for comparisons across layouts and world sizes; ``dsinks`` summed over ranks)."""
    if backend == "triton":
        os.environ["TRITON_INTERPRET"] = "1"  # CPU: Triton's interpreter (set before triton loads)
    found = {}
    for layout in layouts:
        reports = found[layout] = []
        for ci, case in enumerate(cases):
            tensors, victim_BL, position_ids, cu_seqlens = _global_inputs(case, seed=100 + ci)
            lay = _case_layout(layout, case, world_size, position_ids, cu_seqlens)
            with cp_attention.context_parallel(layout=lay) as cp:
                pos = cp.shard(position_ids) if position_ids is not None else None  # one object: plan reuse
                base = _run(cp, case, tensors, pos, cu_seqlens, backend)
                again = _run(cp, case, tensors, pos, cu_seqlens, backend) if cached_rerun else None  # cached plan
                victim_local = cp.shard(victim_BL)
                isolation, victim_changed = {}, 0
                for vi, variant in enumerate(VARIANTS):
                    res = _run(cp, case, _variant(tensors, victim_BL, variant, seed=7 + vi), pos, cu_seqlens, backend)
                    isolation[variant], changed = _isolation(base, res, victim_local, variant != "changed")
                    if variant == "changed":
                        victim_changed = changed
                full = {name: cp.gather(base[name]).numpy() for name in TENSORS}
                if "dsinks" in base:
                    dsinks = base["dsinks"].clone()
                    if world_size > 1:
                        dist.all_reduce(dsinks)
                    full["dsinks"] = dsinks.numpy()
            with cp_attention.context_parallel(layout=lay) as cp:  # a fresh context: the plan is built again
                pos = cp.shard(position_ids) if position_ids is not None else None
                fresh = _run(cp, case, tensors, pos, cu_seqlens, backend)
            reruns = [fresh] if again is None else [again, fresh]
            determinism = {name: all(torch.equal(base[name], r[name]) for r in reruns) for name in base}
            reports.append(dict(name=case["name"], determinism=determinism, isolation=isolation,
                                victim_changed=victim_changed, full=full if rank == 0 else None))
    return found


LAYOUTS = ("zigzag", "contiguous", "balanced")


def _case_layout(layout: str, case: dict, world_size: int, position_ids, cu_seqlens):
    """A layout name, or for "balanced" the case's own ``balanced_layout`` (its documents and mask;
    every row of a B = 2 batch shares it)."""
    if layout != "balanced":
        return layout
    mask = dict(causal=case.get("causal", True), window=case.get("window"), chunk_size=case.get("chunk_size"))
    return cp_attention.balanced_layout(world_size, position_ids=position_ids, cu_seqlens=cu_seqlens, masks=[mask])


@functools.lru_cache(maxsize=None)
def group_report(world_size: int, backend: str = "reference") -> tuple:
    """Every rank's :func:`check_group` result for one world size and backend, computed once per
    process: both layouts on the reference backend; on Triton's (slow) interpreter zigzag only and
    no rerun with the cached plan. World size 1 runs in this process (no process group, one
    intra-op thread like the ranks); larger ones on one spawned group of gloo ranks."""
    cases = isolation_cases(backend, world_size)
    layouts = LAYOUTS if backend == "reference" else ("zigzag",)
    cached_rerun = backend == "reference"
    if world_size == 1:
        with single_thread():
            return (check_group(0, 1, layouts, backend, cases, cached_rerun),)
    from cp_attention.tools.launch import run_ranks

    return tuple(run_ranks(world_size, check_group, layouts, backend, cases, cached_rerun, timeout=900))
