"""Rebuild the dense mask a set of plans computes, to check the planner against the mask model."""

from __future__ import annotations

import torch

from cp_attention import layout as layout_mod
from cp_attention.masks import row_key_intervals
from cp_attention.plan import build_plan


def covered_pairs(meta, spec, world_size, layout, **kw):
    """(B, L, L) int tensor: how many times each (query, key) pair is computed across all plans."""
    B, L = meta.batch, meta.seq_len
    count = torch.zeros(B, L, L, dtype=torch.int64)
    plans = []
    for r in range(world_size):
        plan = build_plan(meta, spec, world_size=world_size, layout=layout, rank=r,
                          head_kv=kw.get("head_kv", 1), head_dim=kw.get("head_dim", 1), itemsize=4)
        plans.append(plan)
        q_idx = layout_mod.global_index(L, world_size, layout, r)
        Lr = q_idx.numel()
        for st in plan.steps():
            k_idx = layout_mod.global_index(L, world_size, layout, st.source)
            width = st.width
            local = torch.cat([torch.arange(a, b) for a, b in st.spans])
            for c in st.calls:
                lo, hi = row_key_intervals(c.cu_seqlens_q, c.cu_seqlens_k, causal=c.causal, window=c.window)
                assert c.cu_seqlens_q[-1] == c.q_end - c.q_start
                assert c.cu_seqlens_k[-1] == c.k_end - c.k_start
                for p in range(lo.numel()):
                    if hi[p] <= lo[p]:
                        continue
                    row = c.q_start + p
                    bq, i = divmod(row, Lr)
                    for j in range(int(lo[p]), int(hi[p])):
                        bk, jj = divmod(c.k_start + j, width)
                        assert bk == bq, "a sequence crosses batch rows"
                        count[bq, q_idx[i], k_idx[local[jj]]] += 1
    return count, plans


# strategy="auto" in the model tests: a model where only bytes count (compute free, no latency), so
# that a model's window layers (small halo) and full layers choose differently
BYTES_ONLY = dict(latency=0.0, throughput=1e30, bandwidth=1e9, inter_node_bandwidth=1e9)


def strategy_options(strategy: str) -> dict:
    """context_parallel's keywords for a test run under ``strategy``."""
    import cp_attention

    return dict(strategy=strategy, cost_model=cp_attention.CostModel(**BYTES_ONLY) if strategy == "auto" else None)


def strategy_error(strategy: str, calls) -> str | None:
    """Whether every layer of a forward (``forward_plan_stats()``) ran ``strategy``: for "auto", the
    candidate its model rated cheapest (recorded in ``predicted``); layers of selected keys (index-sparse
    attention) run "select" whatever it is. None when so, else the error."""
    for layer, stats in calls:
        if stats.strategy == "select":  # a layer of selected keys runs its own exchange, whatever the strategy
            continue
        if strategy != "auto":
            if stats.strategy != strategy:
                return f"layer {layer} ran {stats.strategy!r}, not {strategy!r}"
            continue
        if not stats.predicted:
            return f"layer {layer} ran {stats.strategy!r} without auto's choice"
        best = min(stats.predicted, key=lambda item: item[1])[0]
        label = stats.strategy if stats.strategy != "usp" else \
            f"usp{stats.ulysses_size}x{stats.world_size // stats.ulysses_size}"
        if label != best:
            return f"layer {layer}: auto ran {label}, its model rated {best} cheapest ({stats.predicted})"
    return None


def chosen(calls) -> list[str]:
    """Each layer's strategy, in call order."""
    return [stats.strategy if stats.strategy != "usp" else f"usp{stats.ulysses_size}" for _, stats in calls]
