"""One attention call (:func:`attend`): the engine entry behind the bare :func:`~cp_attention.attention`
and behind the layer entry of model integrations (:mod:`cp_attention.engine.layer`).

A call runs in a context (:func:`resolve_call`): the batch record's, else the active
:func:`~cp_attention.context_parallel` block's or the ``group`` given, else a single device. On one
device the plan comes from :func:`cp_attention.engine.local.local_plan` (the same plans, cache and
checks as the custom op ``cp_flash`` layers run); on several ranks every check that can fail on one
rank runs first (:func:`~cp_attention.engine.checks.check_inputs`), then the ranks agree
(:mod:`cp_attention.engine.agreement`) and each builds its plan, which the plan's executor
(:data:`cp_attention.strategies.EXECUTORS`: the ring, or head parallelism) runs.

Legend: ``B`` batch, ``L`` local (this rank's) length, ``H`` query heads, ``K`` K/V heads,
``D`` head dim of q/k, ``Dv`` head dim of v and the output (may differ from ``D``: multi-head latent
attention), ``N`` documents.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from .. import layout as layout_mod
from ..backends import select_backend
from ..comm import Comm
from ..masks import MaskSpec, SequenceMeta
from ..plan import RankPlan
from ..strategies import CostModel, executor_of, fixed_candidate
from ..strategies.latent import LatentKV, latent_form
from ..strategies.select import select_attention, selected_call_spec
from . import context, planning, stats
from .agreement import check_strategy, collective_error, exchange_headers, make_header, meta_crc, signature
from .batch import BatchRecord
from .checks import check_inputs
from .local import local_plan

__all__ = ["attend", "resolve_call", "Resolved", "passes"]

log = logging.getLogger("cp_attention.api")


@dataclass(frozen=True)
class Resolved:
    """The context a call runs in: the context object (None: a single device), its comm, the layout."""

    cp: context.ContextParallel | None
    comm: Comm
    layout: object


def resolve_call(group, layout, bound=None) -> Resolved:
    """The context a call runs in: ``bound`` (the context of the batch record the call uses), else
    the active context or ``group``, else a single device."""
    active = context.active_context()
    group = context.as_group(group)
    if bound is not None:
        cp = bound
    elif group is None and active is not None:
        cp = active
    elif group is not None:
        cp = active if active is not None and active.group is group else None
        if cp is None:
            cp = context.ContextParallel(group, layout if layout is not None else "zigzag")
    else:
        cp = None
    use_layout = layout_mod.as_layout(layout) if layout is not None else (
        cp.current_layout() if cp is not None else layout_mod.Zigzag())
    # no group and no active context: an ordinary single-device attention, even inside a job
    return Resolved(cp=cp, comm=cp.comm if cp is not None else Comm(single=True), layout=use_layout)


# ----------------------------------------------------------------------------------------------
# one attention call


def attend(q, k, v, mask: MaskSpec | dict, *, position_ids=None, cu_seqlens=None, sinks=None, group=None,
           layout=None, backend: str | None = None, batch: BatchRecord | None = None,
           local_error: Exception | None = None, layer: int | None = None, model_crc: int = -1,
           strategy: str | None = None, ulysses_size: int | None = None, run=None, key_select=None,
           extra_kv=None, latent: LatentKV | None = None) -> torch.Tensor:
    """The engine entry behind :func:`~cp_attention.attention` (same arguments and result).

    ``mask``: a MaskSpec or a dict of its keywords (checked on every rank together). ``batch``: the
    record of a :meth:`~cp_attention.ContextParallel.shard_batch` call, whose documents and context
    the call uses instead of ``position_ids`` and the active context. ``local_error``: a caller's
    check that failed on this rank, raised on every rank of the group together (before any K/V
    moves). ``layer``: the model layer index, for :func:`~cp_attention.forward_plan_stats` (a
    model's layers only). ``model_crc``: a checksum of the calling model's configuration, agreed with
    ``batch``'s first call. ``strategy``: "ring", "ulysses", "usp" (with ``ulysses_size``) or "auto"
    (None: the context's, with its ``ulysses_size`` and cost model; :mod:`cp_attention.strategies.choice`).
    ``run(q, k, v, sinks, plan, comm, backend, spec)``: what to do with the agreed plan instead of the
    differentiable ring or head-parallel call (the compiled op's passes without autograd,
    :func:`passes`); its result is returned. ``key_select`` (B, L, k) integer: the global key
    indices each query selected (``-1``: none), for a mask with ``selection`` (index-sparse
    attention: :mod:`cp_attention.strategies.select`, whatever ``strategy`` says). ``extra_kv``: with
    ``key_select``, (k (B, E, K, D), v (B, E, K, Dv)) keys every rank holds whole beyond the row's ``T``
    tokens, selected as ``T + e`` (their gradient on each rank is its queries' part). ``latent``: k and v
    are a multi-head latent attention layer's expansion of these latent rows: under context parallelism its
    ring may move the latent instead (:mod:`cp_attention.strategies.latent`, chosen per call by the cost
    model and stated in the call's PlanStats).

    Agreement (see :mod:`cp_attention.engine.agreement`): a call without ``batch`` all-gathers its header
    every time; with ``batch``, only the batch's first call with each signature does."""
    error: Exception | None = None
    try:  # parsed at the boundary; a bad layout is raised with the other checks, on every rank together
        layout = layout_mod.as_layout(layout) if layout is not None else None
    except ValueError as exc:
        layout, error = None, exc
    res = resolve_call(group, layout if layout is not None else (batch.layout if batch is not None else None),
                       None if batch is None else batch.cp)
    comm = res.comm
    if backend is None:
        backend = res.cp.backend if res.cp is not None else "auto"
    if strategy is None:
        strategy = res.cp.strategy if res.cp is not None else "ring"
    if ulysses_size is None and strategy == "usp" and res.cp is not None:  # the context's head-group size
        ulysses_size = res.cp.ulysses_size
    cost_model = res.cp.cost_model if res.cp is not None else CostModel()
    spec = impl = None
    try:  # every check that can fail on one rank only runs before the first collective
        if error is not None:
            raise error
        if local_error is not None:
            raise local_error
        check_strategy(strategy, ulysses_size)
        spec = mask if isinstance(mask, MaskSpec) else MaskSpec(**mask)
        check_inputs(q, k, v, position_ids=position_ids, cu_seqlens=cu_seqlens, sinks=sinks, backend=backend,
                     key_select=key_select, selection=spec.selection)
        if extra_kv is not None and not spec.selection:
            raise ValueError("extra_kv (keys beyond the row's tokens) needs key_select: a selection names them")
        if spec.selection and run is not None:
            raise ValueError("a selected-keys layer runs eagerly (the compiled multi-rank op does not take a "
                             "selection)")
        impl = select_backend(backend, device=q.device, dtype=q.dtype, head_dim=q.shape[3],
                              spec=selected_call_spec(spec) if spec.selection else spec, head_dim_v=v.shape[3])
    except (TypeError, ValueError, NotImplementedError) as exc:  # NotImplementedError: a caller's local_error
        error = exc
    if comm.world_size == 1:
        if error is not None:
            raise error
        layout_mod.infer_seq_len([q.shape[1]], 1, res.layout)  # a Layout object must be for these tokens
        plan = local_plan(q.shape[0], q.shape[1], k.shape[1], spec.for_planning(),
                                   position_ids=position_ids, cu_seqlens=cu_seqlens,
                                   label=f"{res.layout} layout")
    else:
        how = planning.how_of(strategy, ulysses_size, cost_model) if error is None else \
            ("ring", None, None)
        # whether the latent may travel is agreed with the header (a rank that declined meets the others' error)
        plan = _plan_agreed(res, q, k, v, spec, position_ids, cu_seqlens, sinks, batch, error, model_crc, how,
                            -1 if latent is None or latent.declined is not None else latent.latent.shape[-1])
    if spec.selection:
        form, why = _latent_form(latent, k, v, cost_model, None) if latent is not None and comm.world_size > 1 \
            else ("heads", None)
        out, call_stats = select_attention(q, k, v, key_select, sinks, plan, comm, impl,
                                           scale=spec.resolved_scale(q.shape[3]), softcap=spec.softcap,
                                           extra_kv=extra_kv, latent=latent if form == "latent" else None)
        if why is not None:
            heads = {} if form == "latent" else dict(heads_kv_bytes_recv=call_stats.kv_bytes_recv,
                                                     heads_kv_bytes_sent=call_stats.kv_bytes_sent)
            call_stats = dataclasses.replace(call_stats, kv_form_reason=why, **heads)
        stats.note_stats(call_stats, layer, in_model=layer is not None or batch is not None)
        return out
    in_model = layer is not None or batch is not None
    if latent is not None and comm.world_size > 1:
        return _latent_layer(q, k, v, sinks, latent, plan, comm, impl, spec, cost_model, run, layer, in_model)
    stats.note_stats(plan.stats, layer, in_model=in_model)
    if run is not None:
        return run(q, k, v, sinks, plan, comm, impl, spec)
    return executor_of(plan).attention(q, k, v, sinks, plan, comm, impl, scale=spec.resolved_scale(q.shape[3]),
                                       softcap=spec.softcap)


def _latent_form(latent: LatentKV, k, v, cost_model, ruled_out: str | None, plan=None) -> tuple[str, str]:
    """("latent" or "heads", why) for a multi-head latent attention layer's call: the heads when the
    integration declined its expansion or ``ruled_out`` says why the call cannot move latent rows, else the
    cost model's choice for the plan's strategy (its executor's ``latent_form``; the selected keys' exchange
    weighs as the ring does)."""
    if latent.declined is not None:
        return "heads", f"the layer's expansion was declined: {latent.declined}"
    if ruled_out is not None:
        return "heads", ruled_out
    if plan is None:
        return latent_form(kv_heads=k.shape[2], head_dim=k.shape[3], head_dim_v=v.shape[3],
                           latent_dim=latent.latent.shape[-1], cost_model=cost_model)
    return executor_of(plan).latent_form(plan, k, v, latent.latent.shape[-1], cost_model)


def _latent_layer(q, k, v, sinks, latent: LatentKV, plan, comm: Comm, impl, spec: MaskSpec, cost_model, run, layer,
                  in_model: bool) -> torch.Tensor:
    """A multi-head latent attention layer's call on several ranks: its latent rows travel when the call runs
    eagerly and the cost model prefers them for the plan's strategy (the ring's spans, or head parallelism's
    exchange), else the heads as every other layer; the call's PlanStats says which, why, and what each took."""
    ruled_out = None
    if run is not None:
        ruled_out = "compiled: the multi-rank op moves the heads"
    elif latent.latent.dtype != q.dtype:
        ruled_out = f"the latent ({latent.latent.dtype}) and the queries ({q.dtype}) differ in dtype"
    form, why = _latent_form(latent, k, v, cost_model, ruled_out, plan)
    executor = executor_of(plan)
    kw = dict(scale=spec.resolved_scale(q.shape[3]), softcap=spec.softcap)
    if form == "latent":
        out, call_stats = executor.latent(q, k, v, sinks, latent, plan, comm, impl, **kw)
        stats.note_stats(dataclasses.replace(call_stats, kv_form_reason=why), layer, in_model=in_model)
        return out
    stats.note_stats(dataclasses.replace(plan.stats, heads_kv_bytes_recv=plan.stats.kv_bytes_recv,
                                         heads_kv_bytes_sent=plan.stats.kv_bytes_sent, kv_form_reason=why),
                     layer, in_model=in_model)
    if run is not None:
        return run(q, k, v, sinks, plan, comm, impl, spec)
    return executor.attention(q, k, v, sinks, plan, comm, impl, **kw)


def passes(dout=None, out=None, lse=None, need_dsinks: bool = False):
    """A ``run`` for :func:`attend` without autograd: the forward (``dout`` None) -> (out, lse), or
    the backward of that forward's ``out``/``lse`` -> (dq, dk, dv, dsinks), for the plan's strategy
    (its :class:`~cp_attention.strategies.Executor`'s passes)."""
    def run(q, k, v, sinks, plan, comm, impl, spec):
        kw = dict(scale=spec.resolved_scale(q.shape[3]), softcap=spec.softcap)
        executor = executor_of(plan)
        if dout is None:
            return executor.forward(q, k, v, sinks, plan, comm, impl, **kw)
        return executor.backward(dout, q, k, v, out, lse, sinks, plan, comm, impl, need_dsinks=need_dsinks, **kw)
    return run


def _global_meta(comm: Comm, layout, seq_len: int, B: int, position_ids, cu_seqlens,
                 batch: BatchRecord | None) -> SequenceMeta:
    """The global document metadata: from ``batch``, from ``cu_seqlens``, or by all-gathering every
    rank's ``position_ids`` (a collective)."""
    if batch is not None:
        if seq_len != batch.seq_len:
            raise ValueError(f"the attention inputs hold {seq_len} tokens across ranks but the batch given to "
                             f"cp.shard_batch had {batch.seq_len}; pass the tensors shard_batch returned")
        return batch.meta
    if position_ids is None:  # cu_seqlens are global: every rank holds them whole
        return SequenceMeta.from_inputs(B, seq_len, cu_seqlens=cu_seqlens)
    sizes = layout_mod.local_lengths(seq_len, comm.world_size, layout)
    padded = torch.zeros(B, max(sizes), dtype=torch.int64, device=comm.device)
    padded[:, :position_ids.shape[1]] = position_ids.detach().to(comm.device, torch.int64)
    parts = [p[:, :n].cpu() for p, n in zip(comm.all_gather(padded, "the position_ids all-gather"), sizes)]
    return SequenceMeta.from_inputs(B, seq_len, position_ids=layout_mod.unshard(parts, 1, layout))


def _cache_keys(cp, layout, q, k, v, spec: MaskSpec, position_ids, cu_seqlens, batch, how):
    """(metadata key, plan key) in the context's cache (:mod:`cp_attention.engine.planning`). Keys hold
    this rank's view only (local length, the documents' content); the global length is checked
    against the entry."""
    B, L_local = q.shape[:2]
    if batch is not None:
        meta_key = planning.batch_meta_key(batch.digest, layout, B, L_local)
    else:
        meta_key = planning.documents_meta_key(layout, B, L_local, cp.plans.digest(position_ids),
                                               cp.plans.digest(cu_seqlens))
    return meta_key, planning.plan_key(meta_key, spec, how, planning.dims_of(q, k, v))


def _build(comm: Comm, layout, meta: SequenceMeta, spec: MaskSpec, q, k, v, how=("ring", None, None)):
    """This rank's plan under ``how`` = (strategy, ulysses_size, cost model)
    (:func:`cp_attention.engine.planning.build_rank_plan`)."""
    return planning.build_rank_plan(comm.rank, comm.world_size, layout, meta, spec, planning.dims_of(q, k, v), how)


def _reused(plan):
    log.debug("plan reused from the context's cache (rank %d of %d)", plan.rank, plan.world_size)
    return plan


def _plan_agreed(res: Resolved, q, k, v, spec, position_ids, cu_seqlens, sinks, batch, error,
                 model_crc: int = -1, how=("ring", None, None), latent_dim: int = -1):
    """Several ranks: one header all-gather before any K/V moves, then this rank's plan; with a
    ``batch`` whose group already agreed on this call's signature, that plan and no collective.

    The header carries every argument the plan depends on, and whether this rank holds the plan
    (or the document metadata) cached, for which global length and with which metadata checksum.
    A cached entry is used only when every rank has one for the same length and checksum;
    otherwise every rank rebuilds together (so a rank whose cache differs can neither hang the
    others in a collective they skip nor compute with stale documents)."""
    comm, layout, cp = res.comm, res.layout, res.cp
    header = None
    if error is None:
        meta_key, plan_key = _cache_keys(cp, layout, q, k, v, spec, position_ids, cu_seqlens, batch, how)
        plan_entry = cp.plans.get(plan_key)
        meta_entry = cp.plans.get(meta_key)
        if batch is not None:
            meta_entry = (batch.meta, batch.crc, batch.seq_len)
        known = plan_entry or meta_entry
        cached = (int(plan_entry is not None), int(meta_entry is not None),
                  -1 if known is None else known[2], -1 if known is None else known[1])
        header = make_header(q, k, spec, layout, position_ids, cu_seqlens, sinks, batch, cached, model_crc,
                             how[0], how[1], -1 if how[2] is None else how[2].crc, latent_dim)
        if batch is not None:
            agreed = batch.agreed.get(signature(header))
            if agreed is not None:
                return _reused(agreed)
    elif batch is not None and batch.agreed:
        # the others may run an agreed signature with no exchange to meet this rank in: raise here,
        # recorded for the group, so ranks waiting on this one raise RankFailedError naming it at once
        comm.report_failure("context-parallel attention", error)
        raise error
    headers = exchange_headers(comm, header, error)
    try:
        seq_len = layout_mod.infer_seq_len([h.local_len for h in headers], comm.world_size, layout)
        # the agreed strategy and head counts: every rank raises it together
        fixed_candidate(how[0], how[1], comm.world_size, q.shape[2])
    except ValueError as exc:
        raise collective_error(exc) from None

    def usable(flag: str) -> bool:
        """Every rank holds the entry, for this length and the same metadata."""
        return all(getattr(h, flag) == 1 and h.cached_seq_len == seq_len
                   and h.cached_meta_crc == headers[0].cached_meta_crc for h in headers)

    if usable("plan_cached"):
        cp.planning.add(plans_reused=1)
        return _remember(batch, header, _reused(plan_entry[0]))
    if usable("meta_cached"):
        meta, crc = meta_entry[0], meta_entry[1]
    else:
        try:
            meta = _global_meta(comm, layout, seq_len, q.shape[0], position_ids, cu_seqlens, batch)
        except ValueError as exc:  # the header made every rank's inputs equal: all raise it
            raise collective_error(exc) from None
        crc = meta_crc(meta)
        if batch is None:
            cp.plans.put(meta_key, (meta, crc, seq_len))
    plan = cp.plans.put(plan_key, (_build(comm, layout, meta, spec, q, k, v, how), crc, seq_len))[0]
    _note_built(cp, batch, spec, q, k, v, how)
    return _remember(batch, header, plan)


def _note_built(cp, batch: BatchRecord | None, spec: MaskSpec, q, k, v, how) -> None:
    """Count a plan built on the step (:meth:`~cp_attention.ContextParallel.planning_stats`); for a batch
    prepared ahead, also say at INFO which call was not prepared."""
    missed = batch is not None and batch.prepared
    cp.planning.add(plans_built=1, prepared_misses=int(missed))
    if missed:
        log.info("a prepared batch planned on its step (rank %d of %d): cp.prepare planned no %s call with shapes "
                 "(heads, kv_heads, head_dim, head_dim_v, itemsize) = %s, strategy %s, or a rank had not finished "
                 "preparing; pass the masks and shapes the step uses (model=, or masks= and dtype=)", cp.rank,
                 cp.world_size, spec.for_planning(), planning.dims_of(q, k, v), how[0])


def _remember(batch: BatchRecord | None, header, plan: RankPlan) -> RankPlan:
    """Record that the group agreed on ``header``'s signature for ``batch`` (see BatchRecord.agreed)."""
    if batch is not None:
        batch.agreed[signature(header)] = plan
    return plan
