"""Rebuild the dense mask a set of plans computes, to check the planner against the mask model."""

from __future__ import annotations

import torch

from cp_attention import layout as layout_mod
from cp_attention.backends.base import row_key_intervals
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
