"""Attention over a KV cache sharded by sequence: the decode step of generation under context parallelism.

After a prefill under context parallelism every rank keeps the K/V of its own tokens (at global positions
``k_pos``, increasing, not contiguous in general). A decode step's queries (the new tokens, the same on every
rank) meet every rank's cached keys they may see:

1. each rank attends its queries over its own keys, with the mask's visibility on global positions
   (causal, window, chunk, padding), no sinks: a partial output and its log-sum-exp
   (:func:`partial_over_cache`); a rank that holds no visible key gives ``out = 0``, ``lse = -inf``;
2. one all-gather of ``[out | lse]`` and a merge in rank order, so every rank gets the same bits
   (:func:`merge_ranks`);
3. the sinks once, after the merge.

Exact: the softmax over the union of the ranks' keys is the log-sum-exp merge of the per-rank softmaxes.

Legend: ``B`` rows, ``Lq`` new tokens, ``Lk`` this rank's cached keys, ``H`` query heads, ``K`` K/V heads,
``D``/``Dv`` head dims, ``T`` positions of the whole sequence so far.
"""

from __future__ import annotations

import torch

from ..backends import select_backend
from ..comm import Comm
from ..masks import MaskSpec, SequenceMeta
from ..plan import build_local_plan
from ..strategies.merge import apply_sinks, merge_into_
from ..strategies.ring import ring_forward

__all__ = ["partial_over_cache", "merge_ranks", "attend_sharded_cache"]


def partial_over_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: MaskSpec, *, q_pos: torch.Tensor,
                       k_pos: torch.Tensor, valid: torch.Tensor | None = None, backend: str = "auto",
                       plans: dict | None = None):
    """This rank's part of a decode step, before any merge and without sinks.

    q (B, Lq, H, D) at global positions ``q_pos`` (Lq,); k (B, Lk, K, D), v (B, Lk, K, Dv) this rank's
    cached keys at ``k_pos`` (Lk,) (increasing); ``valid`` (B, >= T) bool: the padding mask over global
    positions (None: no padding). Returns (out (B, Lq, H, Dv) float32 (float64 for float64 inputs),
    lse (H, B * Lq) in the same dtype; ``-inf`` where no key is visible). ``plans``: a dict kept for one
    decode step, so that its layers of the same mask over the same positions plan once.
    """
    B, Lq = q.shape[:2]
    q_pos, k_pos = q_pos.to("cpu", torch.long), k_pos.to("cpu", torch.long)
    plan_spec = spec.for_planning()
    impl = select_backend(backend, device=q.device, dtype=q.dtype, head_dim=q.shape[3], spec=spec,
                          head_dim_v=v.shape[3])  # the whole mask: softcap rules some backends out
    key = (plan_spec, B, tuple(q_pos.tolist()), k_pos.numel(), id(valid))
    known = (plans or {}).get(key)
    if known is not None and torch.equal(known[0], k_pos):
        plan = known[1]
    else:
        plan = _plan(B, plan_spec, q_pos, k_pos, valid)
        if plans is not None:
            plans[key] = (k_pos, plan)
    # the cache in its own dtype (no upcast copy of it per layer and step); the partial kept in float32
    out, lse = ring_forward(q, k, v, None, plan, Comm(single=True), impl, scale=spec.resolved_scale(q.shape[3]),
                            softcap=spec.softcap, out_dtype=torch.promote_types(q.dtype, torch.float32))
    return out, lse


def _plan(B: int, plan_spec: MaskSpec, q_pos: torch.Tensor, k_pos: torch.Tensor, valid: torch.Tensor | None):
    """The local plan of queries at ``q_pos`` over keys at ``k_pos`` (global positions), the padding ``valid``."""
    Lq = q_pos.numel()
    T = int(max(int(q_pos.max()) if Lq else -1, int(k_pos.max()) if k_pos.numel() else -1)) + 1
    valid_BT = None
    if valid is not None:
        valid_BT = torch.zeros(B, T, dtype=torch.bool)
        n = min(T, valid.shape[1])
        valid_BT[:, :n] = valid[:, :n].to("cpu", torch.bool)
    meta = SequenceMeta.from_inputs(B, T, valid=valid_BT)
    return build_local_plan(meta, plan_spec, q_idx=q_pos, k_idx=k_pos)


def merge_ranks(parts: list[tuple[torch.Tensor, torch.Tensor]], sinks: torch.Tensor | None = None):
    """Every rank's :func:`partial_over_cache` result, in rank order -> (out (B, Lq, H, Dv), lse (H, B * Lq)),
    the softmax over all their keys, with the sinks (H,) applied once."""
    out, lse = parts[0]
    B, Lq, H, Dv = out.shape
    out_THD, lse_HT = out.reshape(B * Lq, H, Dv).clone(), lse.clone()
    for other, other_lse in parts[1:]:
        merge_into_(out_THD, lse_HT, other.reshape(B * Lq, H, Dv), other_lse)
    if sinks is not None:
        out_THD, lse_HT = apply_sinks(out_THD, lse_HT, sinks)
    return out_THD.reshape(B, Lq, H, Dv), lse_HT


def attend_sharded_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: MaskSpec, comm: Comm, *,
                         q_pos: torch.Tensor, k_pos: torch.Tensor, valid: torch.Tensor | None = None,
                         sinks: torch.Tensor | None = None, backend: str = "auto", plans: dict | None = None
                         ) -> torch.Tensor:
    """A decode step's attention over the KV cache sharded across ``comm``'s ranks (module docstring): the
    same queries on every rank, each rank's own keys. One all-gather of ``B * Lq * H * (Dv + 1)`` values.
    Returns (B, Lq, H, Dv) in q's dtype, the same on every rank. No autograd (generation). ``plans``: as
    :func:`partial_over_cache`'s."""
    with torch.no_grad():
        out, lse = partial_over_cache(q, k, v, spec, q_pos=q_pos, k_pos=k_pos, valid=valid, backend=backend,
                                      plans=plans)
        B, Lq, H, Dv = out.shape
        packed = torch.cat([out.reshape(B * Lq, H, Dv), lse.t().unsqueeze(-1)], dim=-1)
        everyone = comm.all_gather(packed, "the decode step's partial attention")
        parts = [(p[..., :Dv].reshape(B, Lq, H, Dv), p[..., Dv].t().contiguous()) for p in everyone]
        merged, _ = merge_ranks(parts, sinks)
    return merged.to(q.dtype)
