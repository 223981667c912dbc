"""Single-device attention as one opaque ``torch.library`` custom op, for ``torch.compile``.

``cp_attention::local_attention`` is what a ``cp_flash`` layer runs at world size 1 (eager or
compiled). Its plan is data, not a constant of the graph: the op receives the tensors that describe
the documents (``position_ids``, the 2D padding mask, document openings, ``cu_seqlens``) and the mask
as plain ints, floats and bools, and builds the plan inside (:func:`~cp_attention.plan.build_local_plan`).
So ``torch.compile`` traces a layer without a graph break, and a new document layout of the same
shape runs the same compiled graph. The fake (meta) implementation only allocates the outputs;
``register_autograd`` pairs the op with ``cp_attention::local_attention_backward``, which rebuilds the
same plan from the same tensors (a cache hit) and runs the ring's backward.

Plan cache. Plans are memoised in one process-wide LRU cache (:data:`LOCAL_PLANS`,
a :class:`~cp_attention.plan.PlanCache`) keyed by the mask, the shapes and a digest of the *content* of the document
tensors: a stale plan cannot be reused for other documents. Digests are remembered per tensor
object and version (weakly: the memo dies with the tensor), so the layers of one forward, which
share their ``position_ids`` and masks, move them to the CPU and hash them once.

What dynamo cannot see. ``context_parallel`` is a contextvar, which dynamo can neither trace nor guard
on. A graph traced outside context parallelism therefore calls this op whatever context is active
when it runs; the op checks at run time and raises if a context of several ranks is active (eager
``cp_flash`` raises the same error for tensors that ``cp.shard_batch`` did not return). The backend
of a one-rank context is read when the graph is traced; the backward always uses the forward's.

Legend: ``B`` batch, ``Lq``/``Lk`` query/key tokens, ``T`` positions covered (``max(q_offset + Lq,
kv_offset + Lk)``), ``H`` query heads, ``K`` K/V heads, ``D`` head dim of q/k, ``Dv`` head dim of v and
the output (may differ from ``D``: multi-head latent attention).
"""

from __future__ import annotations

import logging
import time

import torch

from ..backends import select_backend
from ..comm import Comm
from ..masks import MaskSpec, SequenceMeta, accumulation_dtype
from ..plan import PlanCache, RankPlan, build_local_plan
from ..plan.select import SelectPlan, build_select_plan
from ..refusals import refuse
from ..strategies.ring import ring_backward, ring_forward
from ..strategies.select import select_attention, selected_call_spec
from ..torch_compat import assume_constant_result, in_backward
from . import context, stats
from .checks import check_inputs

__all__ = ["local_attention", "local_selected_attention", "local_meta", "local_plan", "multi_rank_context_active",
           "pair_autograd", "LOCAL_PLANS"]

log = logging.getLogger("cp_attention.api")

LOCAL_PLANS = PlanCache(32)
"""The single-device plans by content (LRU, 32 entries; thread-safe): the op's and the bare
``attention()``'s on one device."""


def local_meta(B: int, Lq: int, Lk: int, *, q_offset: int = 0, kv_offset: int = 0,
               position_ids: torch.Tensor | None = None, valid: torch.Tensor | None = None,
               opens: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
               span_next: torch.Tensor | None = None):
    """Documents and positions of a single-device call: ``(meta, q_idx (Lq,), k_idx (Lk,))``.

    ``q_offset``/``kv_offset``: absolute position of the first query / key (non-zero after a KV
    cache). ``position_ids`` (B or 1, Lq): a document opens wherever they do not increase by one, and
    they place chunk boundaries (ignored after a KV cache, where restarts are refused). ``valid``
    (B, >= 1) bool: the padding mask over absolute positions (positions past it are invisible).
    ``opens`` (B, Lq) bool: further document openings. ``cu_seqlens`` (N+1,): document boundaries of
    one packed row (B == 1, no KV cache). ``span_next`` (B, Lq) bool: query ``i`` and ``i + 1`` lie in
    one bidirectional span (:meth:`SequenceMeta.from_inputs`)."""
    cached = q_offset != 0 or kv_offset != 0 or Lq != Lk
    T = max(q_offset + Lq, kv_offset + Lk)
    if position_ids is not None and tuple(position_ids.shape[-1:]) != (Lq,):
        position_ids = None
    positions = None
    if not cached:
        positions = position_ids
        if cu_seqlens is not None and B != 1:
            raise ValueError("cp_flash: cu_seq_lens_q describes one packed row, but the batch has "
                             f"{B} rows; pass position_ids instead")
    else:
        if cu_seqlens is not None and (q_offset != 0 or kv_offset != 0):
            raise refuse("cu_seqlens_with_kv_cache")
        if cu_seqlens is not None:  # no cache, yet more (or fewer) keys than the packed row's tokens
            raise refuse("cu_seqlens_appended_keys", tokens=Lq, keys=Lk)
        if position_ids is not None and Lq > 1:
            restarts = (position_ids[..., 1:] != position_ids[..., :-1] + 1).cpu()
            if valid is not None:  # padding restarts positions, not documents
                ok = torch.zeros(B, Lq, dtype=torch.bool)
                seen = valid[:, q_offset:q_offset + Lq].cpu()
                ok[:, :seen.shape[1]] = seen
                restarts = restarts & ok[:, 1:] & ok[:, :-1]
            if bool(restarts.any()):
                raise refuse("packed_after_kv_cache")
    valid_BT = None
    if valid is not None:
        valid_BT = torch.zeros(B, T, dtype=torch.bool)  # positions past the 2D mask are invisible
        n = min(T, valid.shape[1])
        valid_BT[:, :n] = valid[:, :n].cpu()
    if opens is not None:
        opens = opens.cpu().expand(B, Lq)
        if T > Lq:
            opens = torch.cat([opens, torch.zeros(B, T - Lq, dtype=torch.bool)], 1)
    if span_next is not None:
        span_BT = torch.zeros(B, T, dtype=torch.bool)
        span_BT[:, q_offset:q_offset + Lq] = span_next.cpu().expand(B, Lq)
        span_next = span_BT
    meta = SequenceMeta.from_inputs(B, T, position_ids=positions, valid=valid_BT, opens=opens,
                                    cu_seqlens=None if cached else cu_seqlens, span_next=span_next)
    return meta, torch.arange(q_offset, q_offset + Lq), torch.arange(kv_offset, kv_offset + Lk)


# ----------------------------------------------------------------------------------------------
# the plan of a single-device call


def local_plan(B: int, Lq: int, Lk: int, spec: MaskSpec, *, q_offset: int = 0, kv_offset: int = 0,
               position_ids=None, valid=None, opens=None, cu_seqlens=None, span_next=None,
               label: str = "single device") -> RankPlan | SelectPlan:
    """The single-device plan of ``spec`` (its planning part) over the documents the tensors describe
    (see :func:`local_meta`), from the process-wide cache keyed by their *content*
    (:data:`LOCAL_PLANS`): what the op and the bare ``attention()`` on one device
    both run. ``label``: how the log names the call."""
    spec = spec.for_planning()
    cache = LOCAL_PLANS
    key = (spec, B, Lq, Lk, q_offset, kv_offset,
           *(cache.digest(t) for t in (position_ids, valid, opens, cu_seqlens, span_next)))
    plan = cache.get(key)
    if plan is not None:
        log.debug("plan reused from the cache (rank 0 of 1, %s)", label)
        return plan
    start = time.perf_counter()
    if spec.selection and (q_offset or kv_offset or Lq != Lk):
        raise refuse("selection_with_kv_cache", family="this model", queries=Lq, offset=q_offset, keys=Lk)
    meta, q_idx, k_idx = local_meta(B, Lq, Lk, q_offset=q_offset, kv_offset=kv_offset, position_ids=position_ids,
                                    valid=valid, opens=opens, cu_seqlens=cu_seqlens, span_next=span_next)
    if spec.selection:  # a SelectPlan: which keys each query reads comes with the call
        plan = cache.put(key, build_select_plan(meta, spec, None, 0, 1))
    else:
        plan = cache.put(key, build_local_plan(meta, spec, q_idx=q_idx, k_idx=k_idx))
    if log.isEnabledFor(logging.DEBUG):
        log.debug("plan built in %.1f ms: rank 0 of 1, %s, %d x %d tokens, %s", 1e3 * (time.perf_counter() - start),
                  label, B, Lq, spec)
    return plan


def multi_rank_context_active() -> bool:
    """Whether a :func:`~cp_attention.context_parallel` context of several ranks is active in this thread."""
    active = context.active_context()
    return active is not None and active.world_size > 1


@assume_constant_result
def _context_backend() -> str:
    """The active context's backend, else "auto" (under torch.compile: the one active when traced)."""
    active = context.active_context()
    return active.backend if active is not None else "auto"


def _check_context() -> None:
    """A call not bound to a shard_batch record refuses to run inside a context of several ranks
    (eager cp_flash raises the same error before it calls the op)."""
    if multi_rank_context_active():
        raise refuse("unsharded_inputs_in_op")


def _resolve(q, v, backend: str, window, chunk_size, softcap, causal, spans):
    """The backend object and the plan's MaskSpec."""
    spec = MaskSpec(causal=causal, window=window, chunk_size=chunk_size, softcap=softcap, spans=spans)
    impl = select_backend(backend, device=q.device, dtype=q.dtype, head_dim=q.shape[3], spec=spec,
                          head_dim_v=v.shape[3])
    return impl, spec.for_planning()


def _note(plan: RankPlan, layer: int) -> None:
    """Report the plan to :func:`~cp_attention.last_plan_stats` / ``forward_plan_stats`` (the first
    layer of a model, index 0, starts a new forward unless it is a recomputation in backward)."""
    if layer == 0 and not in_backward():
        stats.begin_forward()
    stats.note_stats(plan.stats, None if layer < 0 else layer, in_model=True)


# ----------------------------------------------------------------------------------------------
# the ops


@torch.library.custom_op("cp_attention::local_attention", mutates_args=())
def _local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
                     position_ids: torch.Tensor | None, valid: torch.Tensor | None, opens: torch.Tensor | None,
                     cu_seqlens: torch.Tensor | None, span_next: torch.Tensor | None, q_offset: int, kv_offset: int,
                     causal: bool, spans: bool, window: int | None, chunk_size: int | None, softcap: float | None,
                     scale: float, backend: str, layer: int, check_context: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, Lq, H, D), k (B, Lk, K, D), v (B, Lk, K, Dv) -> out (B, Lq, H, Dv), lse (H, B * Lq)
    float32 (float64 for float64 inputs)."""
    if check_context:
        _check_context()
    impl, plan_spec = _resolve(q, v, backend, window, chunk_size, softcap, causal, spans)
    B, Lq = q.shape[:2]
    plan = local_plan(B, Lq, k.shape[1], plan_spec, q_offset=q_offset, kv_offset=kv_offset, position_ids=position_ids,
                      valid=valid, opens=opens, cu_seqlens=cu_seqlens, span_next=span_next, label="the op")
    _note(plan, layer)
    out, lse = ring_forward(q, k, v, sinks, plan, Comm(single=True), impl, scale=scale, softcap=softcap)
    return out.contiguous(), lse.contiguous()  # the strides the fake implementation promises


@_local_attention.register_fake
def _(q, k, v, sinks, position_ids, valid, opens, cu_seqlens, span_next, q_offset, kv_offset, causal, spans, window,
      chunk_size, softcap, scale, backend, layer, check_context):
    B, Lq, H, _ = q.shape
    return q.new_empty((B, Lq, H, v.shape[3])), q.new_empty((H, B * Lq), dtype=accumulation_dtype(q.dtype))


@torch.library.custom_op("cp_attention::local_attention_backward", mutates_args=())
def _local_attention_backward(
        dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        lse: torch.Tensor, sinks: torch.Tensor | None, position_ids: torch.Tensor | None,
        valid: torch.Tensor | None, opens: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
        span_next: torch.Tensor | None, q_offset: int, kv_offset: int, causal: bool, spans: bool, window: int | None,
        chunk_size: int | None, softcap: float | None, scale: float, backend: str,
        need_dsinks: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> dq (B, Lq, H, D), dk (B, Lk, K, D), dv (B, Lk, K, Dv), dsinks (H,) (empty when not needed)."""
    impl, plan_spec = _resolve(q, v, backend, window, chunk_size, softcap, causal, spans)
    B, Lq = q.shape[:2]
    plan = local_plan(B, Lq, k.shape[1], plan_spec, q_offset=q_offset, kv_offset=kv_offset, position_ids=position_ids,
                      valid=valid, opens=opens, cu_seqlens=cu_seqlens, span_next=span_next, label="the op")
    dq, dk, dv, dsinks = ring_backward(dout, q, k, v, out, lse, sinks, plan, Comm(single=True), impl, scale=scale,
                                       softcap=softcap, need_dsinks=need_dsinks)
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), dsinks if dsinks is not None else q.new_empty(0)


@_local_attention_backward.register_fake
def _(dout, q, k, v, out, lse, sinks, position_ids, valid, opens, cu_seqlens, span_next, q_offset, kv_offset, causal,
      spans, window, chunk_size, softcap, scale, backend, need_dsinks):
    dsinks = sinks.new_empty(sinks.shape) if sinks is not None and need_dsinks else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


def pair_autograd(op, backward_op, docs: slice, static: slice, count: int) -> None:
    """Register ``backward_op`` as ``op``'s autograd: q, k, v, out, lse, sinks and the document tensors
    ``inputs[docs]`` saved, the plain arguments ``inputs[static]`` passed on (``count``: the op's inputs)."""
    def setup_context(ctx, inputs, output):
        q, k, v, sinks = inputs[:4]
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, sinks, *inputs[docs])
        ctx.static = inputs[static]
        ctx.mark_non_differentiable(lse)

    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sinks, *documents = ctx.saved_tensors
        need_dsinks = sinks is not None and ctx.needs_input_grad[3]
        dq, dk, dv, dsinks = backward_op(dout, q, k, v, out, lse, sinks, *documents, *ctx.static, need_dsinks)
        return (dq, dk, dv, dsinks if need_dsinks else None) + (None,) * (count - 4)

    op.register_autograd(backward, setup_context=setup_context)


# documents: position_ids, valid, opens, cu_seqlens, span_next; static: q_offset ... backend
pair_autograd(_local_attention, torch.ops.cp_attention.local_attention_backward, slice(4, 9), slice(9, 18), 20)


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: MaskSpec, *,
                    sinks: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                    valid: torch.Tensor | None = None, opens: torch.Tensor | None = None,
                    cu_seqlens: torch.Tensor | None = None, span_next: torch.Tensor | None = None,
                    q_offset: int = 0, kv_offset: int = 0, backend: str | None = None, bound: bool = False,
                    layer: int | None = None) -> torch.Tensor:
    """Single-device attention over the documents the tensors describe (see :func:`local_meta`), as
    one custom op that ``torch.compile`` keeps opaque.

    q (B, Lq, H, D), k (B, Lk, K, D), v (B, Lk, K, Dv) (GQA not repeated; Dv may differ from D), sinks
    (H,) or None -> (B, Lq, H, Dv),
    differentiable w.r.t. q, k, v and sinks. Queries sit at absolute positions ``q_offset + i``, keys at
    ``kv_offset + j``; causal and window act on those positions (transformers' meaning). ``backend``
    None: the active context's, else "auto" (under torch.compile: the context active when traced); the
    backward uses the forward's. ``bound``: the documents are those of a ``shard_batch`` record; unless
    bound, the op raises when it runs inside a context of several ranks. ``layer``: the model layer
    index, for :func:`~cp_attention.forward_plan_stats` (index 0 starts a new forward).
    """
    check_inputs(q, k, v, sinks=sinks, same_length=False)
    out, _ = torch.ops.cp_attention.local_attention(
        q, k, v, sinks, position_ids, valid, opens, cu_seqlens, span_next, int(q_offset), int(kv_offset),
        bool(spec.causal), bool(spec.spans), spec.window, spec.chunk_size, None if spec.softcap is None else float(spec.softcap),
        spec.resolved_scale(q.shape[3]), backend or _context_backend(), -1 if layer is None else int(layer),
        not bound)
    return out


@torch.compiler.disable
def local_selected_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: MaskSpec,
                             key_select: torch.Tensor, *, sinks: torch.Tensor | None = None,
                             position_ids: torch.Tensor | None = None, valid: torch.Tensor | None = None,
                             opens: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                             q_offset: int = 0, kv_offset: int = 0, backend: str | None = None, bound: bool = False,
                             layer: int | None = None, extra_kv=None) -> torch.Tensor:
    """:func:`local_attention` of a layer whose keys are selected per query (``spec.selection``;
    ``key_select`` (B, Lq, k) integer global key indices, ``-1``: none): the same documents, run
    eagerly by :func:`cp_attention.strategies.select.select_attention` (torch.compile breaks the graph
    here). No KV cache (refused)."""
    check_inputs(q, k, v, sinks=sinks, same_length=False, key_select=key_select, selection=spec.selection)
    if not bound:
        _check_context()
    impl = select_backend(backend or _context_backend(), device=q.device, dtype=q.dtype, head_dim=q.shape[3],
                          spec=selected_call_spec(spec), head_dim_v=v.shape[3])
    B, Lq = q.shape[:2]
    plan = local_plan(B, Lq, k.shape[1], spec, q_offset=q_offset, kv_offset=kv_offset, position_ids=position_ids,
                      valid=valid, opens=opens, cu_seqlens=cu_seqlens, label="a selected-keys layer")
    out, call_stats = select_attention(q, k, v, key_select, sinks, plan, Comm(single=True), impl,
                                       scale=spec.resolved_scale(q.shape[3]), softcap=spec.softcap,
                                       extra_kv=extra_kv)
    if layer == 0 and not in_backward():
        stats.begin_forward()
    stats.note_stats(call_stats, layer, in_model=layer is not None)
    return out
