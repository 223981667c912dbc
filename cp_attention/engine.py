"""The engine: planning and running one attention call, for the bare :func:`~cp_attention.attention`
(:func:`attend`) and for model integrations (:func:`attend_layer`, the one entry they use).

A call runs in a context (:func:`resolve_call`): the batch record's, else the active
:func:`~cp_attention.context_parallel` block's or the ``group`` given, else a single device. On one
device the plan comes from :func:`cp_attention.compiled.local_plan` (the same plans, cache and
checks as the custom op ``cp_flash`` layers run); on several ranks every check that can fail on one
rank runs first, then the ranks agree (:mod:`cp_attention.agreement`) and each builds its plan,
which the ring (:mod:`cp_attention.ring`) executes.

Legend: ``B`` batch, ``L`` local (this rank's) length, ``H`` query heads, ``K`` K/V heads,
``D`` head dim of q/k, ``Dv`` head dim of v and the output (may differ from ``D``: multi-head latent
attention), ``N`` documents.
"""

from __future__ import annotations

import logging
import time
import dataclasses
import warnings
from dataclasses import dataclass

import torch

from . import compiled, context, state, stats
from . import layout as layout_mod
from .agreement import DTYPES, check_strategy, collective_error, exchange_headers, make_header, meta_crc, \
    signature
from .backends import BACKENDS, select_backend
from .batch import NO_MASK, BatchRecord, batch_of, resolve, resolve_for_mask, tensor_fact
from .comm import Comm, process_count
from .layout import global_index
from .masks import MaskSpec, SequenceMeta
from .plan import RankPlan
from .ring import ring_attention, ring_backward, ring_forward
from .strategy import CostModel, choose, fixed_candidate, rank_plans
from .ulysses import UlyssesPlan, ulysses_attention, ulysses_backward, ulysses_forward
from .torch_compat import assume_constant_result, torch_context_parallel_active

__all__ = ["attend", "attend_layer", "LayerDocs", "layer_mask_batch", "compiling_outside_cp", "check_inputs",
           "resolve_call", "Resolved", "passes", "bound_layer", "bind_traced_docs"]

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
# input checks


def check_inputs(q, k, v, position_ids, cu_seqlens, sinks, backend, same_length: bool = True) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape (B, L_local, heads, head_dim), "
                            f"got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape (B, L_local, heads, head_dim), got {tuple(t.shape)}")
        if t.dtype not in DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; supported: float16, bfloat16, float32, float64")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must have the same shape but for the head_dim (v's may differ, as in multi-head "
                         f"latent attention): they must agree on (B, L_local, K/V heads), got k {tuple(k.shape)} "
                         f"and v {tuple(v.shape)}")
    if q.shape[:2] != k.shape[:2] and (same_length or q.shape[0] != k.shape[0]):
        raise ValueError(f"q and k must agree on (B, L_local), got {tuple(q.shape[:2])} and "
                         f"{tuple(k.shape[:2])}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must have the same head_dim, got {q.shape[3]} and {k.shape[3]}")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of key/value heads "
                         f"({k.shape[2]}) for GQA/MQA")
    B, L = q.shape[:2]
    if L == 0:
        raise ValueError("q has no tokens on this rank: the sequence length must be >= the world size")
    if position_ids is not None and cu_seqlens is not None:
        raise ValueError("pass either position_ids or cu_seqlens to describe documents, not both")
    if position_ids is not None:
        if not isinstance(position_ids, torch.Tensor) or position_ids.dtype.is_floating_point or \
                position_ids.dtype == torch.bool:
            raise TypeError("position_ids must be an integer tensor of shape (B, L_local)")
        if tuple(position_ids.shape) != (B, L):
            raise ValueError(f"position_ids must have shape (B, L_local) = {(B, L)}, got "
                             f"{tuple(position_ids.shape)}")
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError("cu_seqlens must be an int32 (or int64) tensor of shape (N+1,)")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must have shape (N+1,) with N >= 1, got {tuple(cu_seqlens.shape)}")
        if B != 1:
            raise ValueError(f"cu_seqlens describes one packed row, but B = {B}; use position_ids "
                             f"(B, L_local) for batches with several rows")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or not sinks.dtype.is_floating_point:
            raise TypeError("sinks must be a float tensor of shape (heads,)")
        if tuple(sinks.shape) != (q.shape[2],):
            raise ValueError(f"sinks must have shape (heads,) = ({q.shape[2]},), got {tuple(sinks.shape)}")
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {sorted(BACKENDS)}, got {backend!r}")


# ----------------------------------------------------------------------------------------------
# one attention call


def attend(q, k, v, mask: MaskSpec | dict, *, position_ids=None, cu_seqlens=None, sinks=None, group=None,
           layout=None, backend: str | None = None, batch: BatchRecord | None = None,
           local_error: Exception | None = None, layer: int | None = None, model_crc: int = -1,
           strategy: str | None = None, ulysses_size: int | None = None, run=None) -> torch.Tensor:
    """The engine entry behind :func:`~cp_attention.attention` (same arguments and result).

    ``mask``: a MaskSpec or a dict of its keywords (checked on every rank together). ``batch``: the
    record of a :meth:`~cp_attention.ContextParallel.shard_batch` call, whose documents and context
    the call uses instead of ``position_ids`` and the active context. ``local_error``: a caller's
    check that failed on this rank, raised on every rank of the group together (before any K/V
    moves). ``layer``: the model layer index, for :func:`~cp_attention.forward_plan_stats` (a
    model's layers only). ``model_crc``: a checksum of the calling model's configuration, agreed with
    ``batch``'s first call. ``strategy``: "ring", "ulysses", "usp" (with ``ulysses_size``) or "auto"
    (None: the context's, with its ``ulysses_size`` and cost model; :mod:`cp_attention.strategy`).
    ``run(q, k, v, sinks, plan, comm, backend, spec)``: what to do with the agreed plan instead of the
    differentiable ring or head-parallel call (the compiled op's passes without autograd,
    :func:`passes`); its result is returned.

    Agreement (see :mod:`cp_attention.agreement`): a call without ``batch`` all-gathers its header
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
        check_inputs(q, k, v, position_ids, cu_seqlens, sinks, backend)
        impl = select_backend(backend, device=q.device, dtype=q.dtype, head_dim=q.shape[3], spec=spec,
                              head_dim_v=v.shape[3])
    except (TypeError, ValueError, NotImplementedError) as exc:  # NotImplementedError: a caller's local_error
        error = exc
    if comm.world_size == 1:
        if error is not None:
            raise error
        layout_mod.infer_seq_len([q.shape[1]], 1, res.layout)  # a Layout object must be for these tokens
        plan = compiled.local_plan(q.shape[0], q.shape[1], k.shape[1], spec.for_planning(),
                                   position_ids=position_ids, cu_seqlens=cu_seqlens,
                                   label=f"{res.layout} layout")
    else:
        how = (strategy, ulysses_size, cost_model if strategy == "auto" else None) if error is None else \
            ("ring", None, None)
        plan = _plan_agreed(res, q, k, v, spec, position_ids, cu_seqlens, sinks, batch, error, model_crc, how)
    stats.note_stats(plan.stats, layer, in_model=layer is not None or batch is not None)
    if run is not None:
        return run(q, k, v, sinks, plan, comm, impl, spec)
    call = ulysses_attention if isinstance(plan, UlyssesPlan) else ring_attention
    return call(q, k, v, sinks, plan, comm, impl, scale=spec.resolved_scale(q.shape[3]), softcap=spec.softcap)


def passes(dout=None, out=None, lse=None, need_dsinks: bool = False):
    """A ``run`` for :func:`attend` without autograd: the forward (``dout`` None) -> (out, lse), or
    the backward of that forward's ``out``/``lse`` -> (dq, dk, dv, dsinks), for the plan's strategy
    (the ring's passes, or the head-parallel ones of :mod:`cp_attention.ulysses`)."""
    def run(q, k, v, sinks, plan, comm, impl, spec):
        kw = dict(scale=spec.resolved_scale(q.shape[3]), softcap=spec.softcap)
        head_parallel = isinstance(plan, UlyssesPlan)
        if dout is None:
            return (ulysses_forward if head_parallel else ring_forward)(q, k, v, sinks, plan, comm, impl, **kw)
        return (ulysses_backward if head_parallel else ring_backward)(dout, q, k, v, out, lse, sinks, plan, comm,
                                                                      impl, need_dsinks=need_dsinks, **kw)
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
    """(metadata key, plan key) in the context's cache. Keys hold this rank's view only (local length,
    the documents' content); the global length is checked against the entry."""
    B, L_local = q.shape[:2]
    if batch is not None:
        meta_key = ("batch", batch.digest, layout, B, L_local)
    else:
        meta_key = ("documents", layout, B, L_local, cp.plans.digest(position_ids), cp.plans.digest(cu_seqlens))
    heads = (q.shape[2], k.shape[2], k.shape[3], v.shape[3], k.element_size())
    return meta_key, ("plan", meta_key, spec.for_planning(), how, heads)


def _build(comm: Comm, layout, meta: SequenceMeta, spec: MaskSpec, q, k, v, how=("ring", None, None)):
    """This rank's plan under ``how`` = (strategy, ulysses_size, cost model): a :class:`RankPlan`
    (the ring) or a :class:`UlyssesPlan` (head parallelism, with or without a ring across head
    groups); "auto" chooses by the cost model (:func:`cp_attention.strategy.choose`)."""
    start = time.perf_counter()
    strategy, ulysses_size, cost_model = how
    dims = dict(heads=q.shape[2], kv_heads=k.shape[2], head_dim=k.shape[3], head_dim_v=v.shape[3],
                itemsize=k.element_size())
    P = comm.world_size
    cand = fixed_candidate(strategy, ulysses_size, P, q.shape[2])
    if cand is None:
        plan = choose(meta, spec, layout, comm.rank, P, cost_model, **dims)
    else:
        plan = rank_plans(meta, spec, cand, layout, ranks=[comm.rank], **dims)[comm.rank]
    if log.isEnabledFor(logging.DEBUG):
        log.debug("plan built in %.1f ms: rank %d of %d, %s layout, %d x %d tokens, %s, strategy %s%s",
                  1e3 * (time.perf_counter() - start), comm.rank, P, layout, meta.batch, meta.seq_len,
                  spec.for_planning(), stats.strategy_label(plan.stats), stats.predicted_label(plan.stats))
    return plan


def _reused(plan):
    log.debug("plan reused from the context's cache (rank %d of %d)", plan.rank, plan.world_size)
    return plan


def _plan_agreed(res: Resolved, q, k, v, spec, position_ids, cu_seqlens, sinks, batch, error,
                 model_crc: int = -1, how=("ring", None, None)):
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
                             how[0], how[1], -1 if how[2] is None else how[2].crc)
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
    return _remember(batch, header, plan)


def _remember(batch: BatchRecord | None, header, plan: RankPlan) -> RankPlan:
    """Record that the group agreed on ``header``'s signature for ``batch`` (see BatchRecord.agreed)."""
    if batch is not None:
        batch.agreed[signature(header)] = plan
    return plan


# ----------------------------------------------------------------------------------------------
# the entry of model integrations


@dataclass(frozen=True)
class LayerDocs:
    """What a model layer knows about its tokens beyond ``position_ids`` (shapes: ``B`` rows, ``Lq``
    queries, ``T`` absolute positions covered).

    ``mask``: the model built the integration's mask for this forward (then ``batch`` is what
    :func:`layer_mask_batch` gave it). ``q_offset`` /
    ``kv_offset``: absolute position of the first query / key (a KV cache); ``kv_length``: keys the
    mask was built for. ``valid`` (B, T) bool padding mask, ``opens`` (B, Lq) bool document starts
    the model detected, ``cu_seqlens`` (N+1,) one packed row's boundaries given to the layer (one
    device only); ``collator_documents``: the layer got a packing collator's document keys;
    ``span_next`` (B, Lq) bool: the bidirectional spans the model's mask opens (query ``i`` sees
    ``i + 1``; one device, no KV cache), for layers whose spec opens spans."""

    mask: bool = False
    batch: object = None
    q_offset: int = 0
    kv_offset: int = 0
    kv_length: int | None = None
    valid: torch.Tensor | None = None
    opens: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    collator_documents: bool = False
    span_next: torch.Tensor | None = None


@assume_constant_result
def _traced_outside_cp() -> bool:
    """Whether torch.compile traces outside any context of several ranks: asked once per trace and
    not guarded (dynamo cannot guard on a contextvar), so the single-device op re-checks when it runs."""
    return not compiled.multi_rank_context_active()


def compiling_outside_cp() -> bool:
    """torch.compile is tracing a forward outside context parallelism: integrations skip what dynamo
    cannot trace (the context, the forward's bookkeeping, data-dependent branches)."""
    return torch.compiler.is_compiling() and _traced_outside_cp()


def layer_mask_batch(attention_mask, batch_size: int, q_length: int):
    """The batch a model's masks are built for (step 2 of :mod:`cp_attention.batch`'s rule): None,
    a :class:`~cp_attention.batch.BatchRecord` or :data:`~cp_attention.batch.AMBIGUOUS`. Called
    once per forward, when the model builds its masks, which also starts the forward's
    :func:`~cp_attention.forward_plan_stats`."""
    if compiling_outside_cp():
        return batch_of(attention_mask)
    return _layer_mask_batch_eager(attention_mask, batch_size, q_length)


@torch.compiler.disable
def _layer_mask_batch_eager(attention_mask, batch_size: int, q_length: int):
    stats.begin_forward()  # the model builds its masks before its layers run
    return resolve_for_mask(attention_mask, context.active_context(), batch_size, q_length)


def attend_layer(q, k, v, spec: MaskSpec, *, position_ids=None, docs: LayerDocs = LayerDocs(), sinks=None,
                 layer: int | None = None, model_crc=None, adjust_q=None) -> torch.Tensor:
    """One model attention layer: q (B, Lq, H, D), k (B, Lk, K, D), v (B, Lk, K, Dv) (GQA not repeated;
    Dv may differ from D: multi-head latent attention) -> (B, Lq, H, Dv).

    Owns what an integration must not decide: which batch the layer runs on (:func:`cp_attention.batch.resolve`),
    the checks that every rank raises together, and the strategy: the ring over the batch's group,
    or the single-device op (:func:`cp_attention.compiled.local_attention`). ``adjust_q(q, positions)``:
    a family's correction of queries computed from local positions, given the tokens' global
    positions (L,) under context parallelism. ``model_crc``: a function returning the model
    configuration's checksum, agreed with the batch's first call (called only under context
    parallelism)."""
    if torch_context_parallel_active():
        raise RuntimeError(
            "cp_flash: torch's context_parallel (accelerate's ParallelismConfig(cp_size > 1)) is active: it shards "
            "the sequence itself and cp_flash would attend within one shard. cp_flash does its own context "
            "parallelism: use cp_attention.context_parallel() + cp.shard_batch(), or CPTrainer from "
            "cp_attention.integrations.trainer, without torch's context_parallel (or use "
            "attn_implementation='sdpa' with torch's context_parallel, for plain causal masks only)")
    if compiling_outside_cp():  # traced outside context parallelism: straight to the op
        batch = batch_of(position_ids) or (docs.batch if docs.mask else None)
        if batch is None:
            return _layer_single_device(q, k, v, spec, sinks, docs, position_ids, None, layer)
    elif torch.compiler.is_compiling():  # traced inside: the multi-rank op, bound to its batch when it runs
        if adjust_q is None:
            return compiled.bound_attention(q, k, v, spec, sinks=sinks, position_ids=position_ids, docs=docs,
                                            layer=layer)
        return _bound_traced_docs(q, k, v, spec, position_ids, docs, sinks, layer, model_crc, adjust_q)
    return _bound_attention(q, k, v, spec, position_ids, docs, sinks, layer, model_crc, adjust_q)


def bind_traced_docs(docs: LayerDocs, batch_size: int, q_length: int) -> LayerDocs:
    """The documents of a layer traced inside context parallelism, at run time: its mask's batch
    (:func:`~cp_attention.batch.resolve_for_mask`, which the traced mask function could not ask) and
    its padding mask as the eager mask function gives it (``docs.valid`` holds the model's raw 2D
    ``attention_mask``, so that the record bound to it is found)."""
    if not docs.mask:
        return docs
    batch = resolve_for_mask(docs.valid, context.active_context(), batch_size, q_length)
    valid = None if docs.valid is None else docs.valid.detach().to(torch.bool)
    if valid is not None and (tensor_fact(batch, docs.valid, "no padding", valid.all)
                              if isinstance(batch, BatchRecord) else bool(valid.all())):
        valid = None
    return dataclasses.replace(docs, batch=batch, valid=valid)


@torch.compiler.disable
def _bound_traced_docs(q, k, v, spec, position_ids, docs: LayerDocs, sinks, layer, model_crc, adjust_q):
    """A layer traced inside context parallelism that the op cannot run (Llama 4's query adjustment is
    a function of the module): eager, one graph break."""
    docs = bind_traced_docs(docs, q.shape[0], q.shape[1])
    return _bound_attention(q, k, v, spec, position_ids, docs, sinks, layer, model_crc, adjust_q)


def _appended_keys_error(Lq: int, Lk: int, docs: LayerDocs) -> NotImplementedError | None:
    """The error for keys a model appended to the sequence's own inside its attention layer (None:
    there are none).

    How the engine tells a KV cache from appended keys: a layer's keys are the sequence's tokens,
    after a KV cache's when there is one (``docs.q_offset`` / ``docs.kv_offset`` > 0), and the
    cp_flash mask transformers built for the layer covers all of them: ``docs.kv_length`` keys.
    Keys beyond ``kv_length`` belong to no position of the sequence: the model concatenated them
    after the mask was built (DeepSeek-V4 appends compressed K/V entries to the keys, also with
    use_cache=False). Without a cp_flash mask nothing says which keys are the sequence's, and nothing
    is detected here."""
    if not docs.mask or docs.kv_length is None or Lk <= docs.kv_length:
        return None
    return NotImplementedError(
        f"cp_flash: the layer attends to {Lk} keys but its mask covers {docs.kv_length} ({Lq} queries): the model "
        f"appended {Lk - docs.kv_length} keys that are not tokens of the sequence (e.g. DeepSeek-V4's compressed "
        "K/V, concatenated to the keys inside its attention layer). Keys beyond the sequence's own (and its KV "
        "cache's) are not supported by cp_flash, with or without use_cache; use attn_implementation='eager' or "
        "'sdpa' for this model")


def bound_layer(q, k, v, spec, position_ids, docs: LayerDocs, sinks, layer, run):
    """:func:`attend_layer`'s call under context parallelism with ``run`` (:func:`passes`) in place of
    the differentiable call: what the compiled multi-rank op runs (model checksum not agreed: -1)."""
    return _bound_attention(q, k, v, spec, position_ids, docs, sinks, layer, None, None, run)


@torch.compiler.disable
def _bound_attention(q, k, v, spec, position_ids, docs: LayerDocs, sinks, layer, model_crc, adjust_q, run=None):
    """Eager: torch.compile breaks the graph here (the context is a contextvar; the agreement
    collectives, the planner and the ring's point-to-point calls cannot be traced). Traced inside
    context parallelism, layers reach it through the multi-rank op instead (``run``: its passes)."""
    Lq, Lk = q.shape[1], k.shape[1]
    active = context.active_context()
    batch, local_error = resolve(position_ids, active, mask_batch=docs.batch if docs.mask else NO_MASK)
    # raised with the group's other local errors: a rank whose model appended no key still meets the others
    local_error = local_error or _appended_keys_error(Lq, Lk, docs)
    multi_rank_context = active is not None and active.world_size > 1
    if batch is None and active is None and (q.requires_grad or k.requires_grad or v.requires_grad) \
            and process_count() > 1 and not state.FULL_BATCH.get():
        # exact (each process attends over its own whole sequences), but likely not what was meant
        warnings.warn(
            f"cp_flash: a training forward on {process_count()} processes without context parallelism: no "
            "cp_attention.context_parallel block is active, so this is data parallelism and no sequence is split. "
            "For context parallelism train with CPTrainer (cp_attention.integrations.trainer) or CPSFTTrainer "
            "(cp_attention.integrations.trl) instead of Trainer / SFTTrainer, or run the step inside "
            "cp_attention.context_parallel() on inputs from cp.shard_batch(...)", UserWarning, stacklevel=3)
    if batch is None and multi_rank_context:
        local_error = local_error or ValueError(
            "cp_flash under context parallelism needs the batch's global positions: shard the inputs with "
            "cp.shard_batch(input_ids=..., position_ids=..., labels=...) and pass its outputs to the model")
    if local_error is not None:  # raised on every rank of the group together, before any K/V moves
        if batch is None and multi_rank_context:
            attend(q, k, v, spec, sinks=sinks, local_error=local_error)
        elif batch is not None and batch.cp.world_size > 1:
            attend(q, k, v, spec, sinks=sinks, batch=batch, local_error=local_error,
                   model_crc=-1 if model_crc is None else model_crc())
        raise local_error
    if batch is None or batch.cp.world_size == 1:
        if run is not None:
            raise ValueError(
                "cp_flash: a model torch.compile traced inside a context of several ranks ran on a one-rank batch "
                "(or on none); run it inside the block it was compiled in, or call torch._dynamo.reset() first")
        return _layer_single_device(q, k, v, spec, sinks, docs, position_ids, batch, layer)
    model_crc = -1 if model_crc is None else model_crc()
    if Lq != Lk or docs.q_offset or docs.kv_offset:  # keys the model appended were refused above
        raise ValueError("cp_flash: a non-empty KV cache is not supported under context parallelism "
                         f"(queries {Lq} from position {docs.q_offset}, keys {Lk}); call the model with "
                         "use_cache=False")
    if docs.valid is not None and not batch.padded:
        local_error = ValueError("cp_flash: the model got a padding attention_mask that cp.shard_batch did "
                                 "not see; pass attention_mask to cp.shard_batch with the other inputs")
    if run is not None and batch.meta.spans is not None:
        local_error = local_error or NotImplementedError(
            "cp_flash: this batch has bidirectional spans (image tokens that see each other), but a model compiled "
            "with torch.compile inside context parallelism cannot tell which of its layers open them; run the model "
            "eagerly under context parallelism (or compiled on one device)")
    if spec.spans and not batch.spans_read:
        local_error = local_error or ValueError(
            "cp_flash: this layer's mask opens bidirectional spans (image tokens that see each other), but "
            "cp.shard_batch did not read them from the batch: pass model=model (and the token types the model reads, "
            "e.g. token_type_ids or mm_token_type_ids) to cp.shard_batch")
    if docs.collator_documents:
        raise ValueError("cp_flash: cu_seq_lens_* are not used under context parallelism; pass the collator's "
                         "whole batch (cu_seq_lens_* included) to cp.shard_batch, which takes the documents "
                         "from them")
    if adjust_q is not None:
        cp = batch.cp
        q = adjust_q(q, global_index(batch.seq_len, cp.world_size, batch.layout, cp.rank))
    return attend(q, k, v, spec, sinks=sinks, batch=batch, local_error=local_error, layer=layer,
                  model_crc=model_crc, run=run)


def _layer_single_device(q, k, v, spec: MaskSpec, sinks, docs: LayerDocs, position_ids, batch, layer):
    """One device: the custom op with this layer's documents as tensors (those of ``batch``, a
    shard_batch record of a one-rank context, when it describes these tokens)."""
    B, Lq = q.shape[:2]
    Lk = k.shape[1]
    appended = _appended_keys_error(Lq, Lk, docs)
    if appended is not None:
        raise appended
    if docs.mask and docs.kv_length != Lk:
        raise ValueError(f"cp_flash: the mask was built for {docs.kv_length} keys but the layer has {Lk}")
    if not docs.mask and Lq != Lk:
        raise NotImplementedError(
            f"cp_flash: {Lq} queries but {Lk} keys, and no cp_flash mask describes the keys' positions: the model "
            "builds its own keys (appends entries that are not tokens of the sequence, or bypasses the mask "
            "function), or was handed a prebuilt 4D mask / a dict of masks. cp_flash cannot place such keys; use "
            "attn_implementation=\"sdpa\" or \"eager\" for this model, and pass no prebuilt mask")
    cached = docs.q_offset != 0 or docs.kv_offset != 0 or Lq != Lk
    if batch is not None and not cached and batch.seq_len == Lq and batch.meta.batch == B:
        found = dict(position_ids=batch.meta.position, valid=None, cu_seqlens=None, opens=batch.doc_opens,
                     span_next=batch.span_next if batch.spans_read else docs.span_next)
    else:
        found = dict(position_ids=position_ids, cu_seqlens=docs.cu_seqlens, valid=docs.valid, opens=docs.opens,
                     span_next=docs.span_next)
    return compiled.local_attention(q, k, v, spec, sinks=sinks, q_offset=docs.q_offset, kv_offset=docs.kv_offset,
                                    backend=batch.cp.backend if batch is not None else None, bound=batch is not None,
                                    layer=layer, **found)
