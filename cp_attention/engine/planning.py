"""One rank's plan and its keys in a context's plan cache: what an attention call looks up and builds
(:mod:`cp_attention.engine.attend`) and what preparing a batch ahead builds for it
(:mod:`cp_attention.engine.prepare`), defined once so that the two always meet on the same key.

A key holds this rank's view only: the documents by content (the 128-bit digest of a batch's
metadata, or digests of the document tensors a call was handed), the layout, the rows and this
rank's length, the planning part of the mask, the strategy and the shapes (:data:`Dims`). Nothing in
this module runs a collective: a plan is a pure function of the global metadata, the mask, the
layout, the rank and the world size.

Legend: ``B`` rows, ``L_local`` this rank's tokens, ``H`` query heads, ``K`` K/V heads, ``D`` head
dim of q/k, ``Dv`` head dim of v.
"""

from __future__ import annotations

import logging
import time

import torch

from ..masks import MaskSpec, SequenceMeta
from ..plan.select import build_select_plan
from ..quiet_gc import paused_gc
from ..strategies import CostModel, choose, fixed_candidate, rank_plans
from . import stats

__all__ = ["Dims", "dims_of", "dims_for", "how_of", "batch_meta_key", "documents_meta_key", "plan_key",
           "build_rank_plan"]

log = logging.getLogger("cp_attention.api")

Dims = tuple
"""``(H, K, D, Dv, itemsize)``: the shapes a plan depends on (query heads, K/V heads, head dim of q
and k, head dim of v, bytes per element of k)."""


def dims_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Dims:
    """The :data:`Dims` of a call: q (B, L_local, H, D), k (B, L_local, K, D), v (B, L_local, K, Dv)."""
    return (q.shape[2], k.shape[2], k.shape[3], v.shape[3], k.element_size())


def dims_for(*, heads: int, kv_heads: int | None = None, head_dim: int, head_dim_v: int | None = None,
             dtype: torch.dtype = torch.bfloat16) -> Dims:
    """The :data:`Dims` of calls with these shapes and q/k/v in ``dtype`` (``kv_heads`` None: ``heads``;
    ``head_dim_v`` None: ``head_dim``). ValueError naming the argument if one is not a positive int or
    ``heads`` is not a multiple of ``kv_heads``."""
    kv_heads = heads if kv_heads is None else kv_heads
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    for name, value in (("heads", heads), ("kv_heads", kv_heads), ("head_dim", head_dim), ("head_dim_v", head_dim_v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int (the attention calls' shape), got {value!r}")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads}), as attention requires")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be the floating dtype q, k and v have in the attention calls, got {dtype!r}")
    return (heads, kv_heads, head_dim, head_dim_v, torch.empty(0, dtype=dtype).element_size())


def how_of(strategy: str, ulysses_size: int | None, cost_model: CostModel | None) -> tuple:
    """``(strategy, ulysses_size, cost model)``: how a call runs, as its plan is keyed and built (the
    cost model only for ``"auto"``, the only strategy it changes)."""
    return (strategy, ulysses_size, cost_model if strategy == "auto" else None)


def batch_meta_key(digest: bytes, layout, B: int, L_local: int) -> tuple:
    """The key of a ``cp.shard_batch`` batch's documents (``digest``: :meth:`SequenceMeta.digest`)."""
    return ("batch", digest, layout, B, L_local)


def documents_meta_key(layout, B: int, L_local: int, positions_digest, cu_seqlens_digest) -> tuple:
    """The key of the documents of a call not bound to a batch: digests (:meth:`PlanCache.digest
    <cp_attention.plan.PlanCache.digest>`) of this rank's ``position_ids`` and of the global ``cu_seqlens``."""
    return ("documents", layout, B, L_local, positions_digest, cu_seqlens_digest)


def plan_key(meta_key: tuple, spec: MaskSpec, how: tuple, dims: Dims) -> tuple:
    """The key of this rank's plan for the documents of ``meta_key``, one mask, strategy and shapes."""
    return ("plan", meta_key, spec.for_planning(), how, dims)


@paused_gc
def build_rank_plan(rank: int, world_size: int, layout, meta: SequenceMeta, spec: MaskSpec, dims: Dims,
                    how=("ring", None, None)):
    """Rank ``rank``'s plan under ``how`` = (strategy, ulysses_size, cost model): a
    :class:`~cp_attention.plan.RankPlan` (the ring) or a :class:`~cp_attention.strategies.ulysses.UlyssesPlan`
    (head parallelism, with or without a ring across head groups); "auto" chooses by the cost model
    (:func:`cp_attention.strategies.choice.choose`). Pure: no process group is needed."""
    start = time.perf_counter()
    if spec.selection:  # which keys move is decided by the selection when the layer runs
        return build_select_plan(meta, spec, layout, rank, world_size)
    strategy, ulysses_size, cost_model = how
    heads, kv_heads, head_dim, head_dim_v, itemsize = dims
    shapes = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, head_dim_v=head_dim_v, itemsize=itemsize)
    cand = fixed_candidate(strategy, ulysses_size, world_size, heads)
    if cand is None:
        plan = choose(meta, spec, layout, rank, world_size, cost_model, **shapes)
    else:
        plan = rank_plans(meta, spec, cand, layout, ranks=[rank], **shapes)[rank]
    if log.isEnabledFor(logging.DEBUG):
        log.debug("plan built in %.1f ms: rank %d of %d, %s layout, %d x %d tokens, %s, strategy %s%s",
                  1e3 * (time.perf_counter() - start), rank, world_size, layout, meta.batch, meta.seq_len,
                  spec.for_planning(), stats.strategy_label(plan.stats), stats.predicted_label(plan.stats))
    return plan
