"""Attention cases compared against the independent float64 oracle (``oracle.py``) on N ranks, and
the worker that runs them.

A case is a plain dict: ``L``, ``B``, ``docs`` (None; ``("pos", rows)`` with document lengths per
row, positions restarting at 0 in each; or ``("cu", lengths)`` for one row with global
``cu_seqlens``) and the flags ``causal``, ``window``, ``chunk_size``, ``softcap``, ``sinks``. The
expected values come from ``oracle.py`` alone; ``cp_attention`` is only called as the engine.
"""

from __future__ import annotations

import random

import torch
import torch.distributed as dist

import cp_attention
from oracle import oracle_attention, oracle_mask, rank_tokens


def _lengths_to_positions(lengths: list[int]) -> list[int]:
    return [p for n in lengths for p in range(n)]


def _random_docs(rng: random.Random, L: int, longest: int) -> list[int]:
    out = []
    while sum(out) < L:
        out.append(min(rng.randint(1, longest), L - sum(out)))
    return out


def named_cases(world_size: int, layout: str) -> list[dict]:
    """The cases the core issue names, at odd lengths, B in {1, 2}, GQA."""
    cases = []
    for L in (97, 130):
        S = L // world_size  # tokens per rank (contiguous shard size)
        slice_len = L // (world_size * (2 if layout == "zigzag" else 1))
        n = world_size * (2 if layout == "zigzag" else 1)
        edges = [L // n * (i + 1) + min(i + 1, L % n) for i in range(n - 1)]  # slice ends (oracle.rank_tokens)
        masks = {
            "causal": dict(),
            "bidirectional": dict(causal=False),
            "window<shard": dict(window=max(1, slice_len // 3)),
            "window=shard": dict(window=max(1, S)),
            "window>shards": dict(window=max(2, int(2.5 * S))),
            "bidir-window": dict(causal=False, window=max(2, S // 2 + 3)),
            "chunked": dict(chunk_size=max(2, S // 2 + 1)),
            "chunked-long": dict(chunk_size=max(2, 2 * S - 1)),
            "softcap": dict(softcap=1.5),
            "sinks": dict(sinks=True),
            "window1": dict(window=1),
        }
        # documents: boundaries inside shards, exactly on shard edges, one spanning several shards
        cuts = sorted({S // 2, S // 2 + max(1, S // 3), min(L - 1, S // 2 + max(1, S // 3) + S)} - {0})
        docs_inside = [b - a for a, b in zip([0] + cuts, cuts + [L])]
        docs_edges = [e2 - e1 for e1, e2 in zip([0] + edges, edges + [L])]
        docs_long = [3, L - 3 - 5, 5] if world_size > 1 else [3, L - 8, 5]
        doc_sets = {"docs-inside": docs_inside, "docs-edges": docs_edges, "docs-across": docs_long}
        for B in (1, 2):
            for name, kw in masks.items():
                cases.append(dict(name=f"{name}/L{L}/B{B}", L=L, B=B, docs=None, **kw))
            for dname, lengths in doc_sets.items():
                cases.append(dict(name=f"{dname}/L{L}/B{B}", L=L, B=B, docs=("pos", [lengths] * B)))
                cases.append(dict(name=f"{dname}+window/L{L}/B{B}", L=L, B=B, docs=("pos", [lengths] * B),
                                  window=max(2, S // 2)))
                cases.append(dict(name=f"{dname}+chunked/L{L}/B{B}", L=L, B=B, docs=("pos", [lengths] * B),
                                  chunk_size=max(2, S // 2 + 1)))
            if B == 1:
                cases.append(dict(name=f"cu_seqlens/L{L}", L=L, B=1, docs=("cu", docs_inside), window=S // 2 + 1))
    # the shortest sequences: one token per rank, and one more
    for L in (world_size, world_size + 1):
        cases.append(dict(name=f"tiny-causal/L{L}", L=L, B=2, docs=None))
        cases.append(dict(name=f"tiny-window/L{L}", L=L, B=1, docs=None, window=2, sinks=True))
        cases.append(dict(name=f"tiny-docs/L{L}", L=L, B=1, docs=("pos", [[1] * L]), causal=False))
    return cases


def random_cases(world_size: int, layout: str, count: int, seed: int) -> list[dict]:
    rng = random.Random(seed * 1000 + world_size * 10 + (layout == "zigzag"))
    cases = []
    for i in range(count):
        L = rng.randint(max(world_size, 2) * 2, 140)
        B = rng.choice([1, 2])
        case = dict(name=f"random{i}", L=L, B=B, causal=rng.random() < 0.7,
                    window=rng.choice([None, None, 1, 2, rng.randint(1, L), rng.randint(1, max(1, L // world_size))]),
                    chunk_size=rng.choice([None, None, None, rng.randint(1, L)]),
                    softcap=rng.choice([None, None, 2.0]), sinks=rng.random() < 0.3)
        mode = rng.choice(["none", "pos", "pos", "cu"]) if B == 1 else rng.choice(["none", "pos"])
        if mode == "pos":
            rows = [_random_docs(rng, L, rng.choice([3, L // 3 + 1, L])) for _ in range(B)]
            case["docs"] = ("pos", rows)
        elif mode == "cu":
            case["docs"] = ("cu", _random_docs(rng, L, rng.choice([5, L // 2 + 1])))
        else:
            case["docs"] = None
        cases.append(case)
    return cases


def doc_args(case: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The global ``position_ids`` (B, L) int64 or ``cu_seqlens`` (N+1,) int32 of a case."""
    docs = case.get("docs")
    if docs is None:
        return None, None
    if docs[0] == "pos":
        return torch.tensor([_lengths_to_positions(row) for row in docs[1]], dtype=torch.int64), None
    return None, torch.tensor([0] + list(torch.tensor(docs[1]).cumsum(0).tolist()), dtype=torch.int32)


def case_mask(case: dict) -> torch.Tensor:
    """The oracle's (B, L, L) mask of a case."""
    position_ids, cu_seqlens = doc_args(case)
    return oracle_mask(case["B"], case["L"], position_ids=position_ids, cu_seqlens=cu_seqlens,
                       causal=case.get("causal", True), window=case.get("window"), chunk_size=case.get("chunk_size"))


def run_cases(rank: int, world_size: int, cases: list[dict], layout: str, dtype_name: str = "float32",
              heads: tuple[int, int] = (4, 2), head_dim: int = 16, backend: str = "auto") -> list[dict]:
    """Worker: run every case on this rank; return errors of this rank's shard against the oracle."""
    if backend == "triton":
        import os

        os.environ["TRITON_INTERPRET"] = "1"  # CPU: Triton's interpreter (set before triton loads)
    dtype = getattr(torch, dtype_name)
    H, K = heads
    results = []
    with cp_attention.context_parallel(layout=layout) as cp:
        for ci, case in enumerate(cases):
            B, L = case["B"], case["L"]
            mine = torch.tensor(rank_tokens(L, world_size, layout, rank))  # the oracle's rows of this shard
            position_ids, cu_seqlens = doc_args(case)
            mask = case_mask(case)
            flags = dict(causal=case.get("causal", True), window=case.get("window"),
                         chunk_size=case.get("chunk_size"), softcap=case.get("softcap"))
            gen = torch.Generator().manual_seed(1234 + ci)
            q = torch.randn(B, L, H, head_dim, generator=gen, dtype=torch.float64)
            k = torch.randn(B, L, K, head_dim, generator=gen, dtype=torch.float64)
            v = torch.randn(B, L, K, head_dim, generator=gen, dtype=torch.float64)
            grad = torch.randn(B, L, H, head_dim, generator=gen, dtype=torch.float64)
            sinks = torch.randn(H, generator=gen, dtype=torch.float64) if case.get("sinks") else None
            leaves = [t.requires_grad_() for t in (q, k, v)] + ([sinks.requires_grad_()] if sinks is not None else [])
            ref = oracle_attention(q, k, v, mask, softcap=flags["softcap"], sinks=sinks)
            ref_grads = torch.autograd.grad(ref, leaves, grad)

            ours_in = [cp.shard(t.detach().to(dtype)).requires_grad_() for t in (q, k, v)]
            sinks_in = sinks.detach().to(dtype).requires_grad_() if sinks is not None else None
            out = cp_attention.attention(
                *ours_in, position_ids=cp.shard(position_ids) if position_ids is not None else None,
                cu_seqlens=cu_seqlens, sinks=sinks_in, backend=backend, **flags)
            stats = cp_attention.last_plan_stats()
            out.backward(cp.shard(grad).to(dtype))
            ours = [out] + [t.grad for t in ours_in]
            refs = [ref.detach()[:, mine]] + [g[:, mine] for g in ref_grads[:3]]
            errs = {name: (a.double() - b).abs().max().item()
                    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, refs)}
            finite = all(bool(torch.isfinite(t).all()) for t in ours)
            if sinks is not None:
                dsinks = sinks_in.grad.double().clone()
                dist.all_reduce(dsinks)
                errs["dsinks"] = (dsinks - ref_grads[3]).abs().max().item()
            plain = None
            if dtype != torch.float32:
                # the same-dtype error of a plain torch implementation, on the same shard
                low = [t.detach().to(dtype).requires_grad_() for t in leaves]
                p_out = oracle_attention(*low[:3], mask, softcap=flags["softcap"],
                                         sinks=low[3] if sinks is not None else None)
                p_grads = torch.autograd.grad(p_out, low[:3], grad.to(dtype))
                plain = {name: (a[:, mine].double() - b).abs().max().item()
                         for name, a, b in zip(("out", "dq", "dk", "dv"), [p_out, *p_grads], refs)}
            results.append(dict(name=case["name"], errs=errs, plain=plain, finite=finite,
                                kernel_calls=stats.kernel_calls, kv_bytes_recv=stats.kv_bytes_recv))
    return results
