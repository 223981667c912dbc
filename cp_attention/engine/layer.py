"""The layer entry of model integrations (:func:`attend_layer`, the one entry they use) and the
multi-rank custom op of a layer that ``torch.compile`` traced inside context parallelism
(:func:`bound_attention`).

A layer's call decides what an integration must not: which batch it runs on
(:func:`cp_attention.engine.batch.resolve`), the checks every rank raises together, and where it runs:
:func:`~cp_attention.engine.attend.attend` over the batch's group, or the single-device op
(:func:`~cp_attention.engine.local.local_attention`).

Legend: ``B`` batch, ``Lq``/``Lk`` query/key tokens of this rank, ``H`` query heads, ``K`` K/V heads,
``D`` head dim of q/k, ``Dv`` head dim of v and the output, ``T`` absolute positions covered.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import torch

from ..comm import process_count
from ..layout import global_index
from ..masks import MaskSpec, accumulation_dtype
from ..refusals import refuse
from ..torch_compat import assume_constant_result, in_backward, torch_context_parallel_active
from . import context, stats
from .attend import attend, passes
from .batch import NO_MASK, BatchRecord, batch_of, resolve, resolve_for_mask, tensor_fact
from .local import local_attention, local_selected_attention, multi_rank_context_active, pair_autograd

__all__ = ["LayerDocs", "attend_layer", "layer_mask_batch", "compiling_outside_cp", "bind_traced_docs", "bound_layer",
           "bound_attention"]


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
    return not multi_rank_context_active()


def compiling_outside_cp() -> bool:
    """torch.compile is tracing a forward outside context parallelism: integrations skip what dynamo
    cannot trace (the context, the forward's bookkeeping, data-dependent branches)."""
    return torch.compiler.is_compiling() and _traced_outside_cp()


def layer_mask_batch(attention_mask, batch_size: int, q_length: int):
    """The batch a model's masks are built for (step 2 of :mod:`cp_attention.engine.batch`'s rule): None,
    a :class:`~cp_attention.engine.batch.BatchRecord` or :data:`~cp_attention.engine.batch.AMBIGUOUS`. Called
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
                 layer: int | None = None, model_crc=None, adjust_q=None, key_select=None,
                 extra_kv=None, latent=None) -> torch.Tensor:
    """One model attention layer: q (B, Lq, H, D), k (B, Lk, K, D), v (B, Lk, K, Dv) (GQA not repeated;
    Dv may differ from D: multi-head latent attention) -> (B, Lq, H, Dv).

    Owns what an integration must not decide: which batch the layer runs on (:func:`cp_attention.engine.batch.resolve`),
    the checks that every rank raises together, and the strategy: the ring over the batch's group,
    or the single-device op (:func:`cp_attention.engine.local.local_attention`). ``adjust_q(q, positions)``:
    a family's correction of queries computed from local positions, given the tokens' global
    positions (L,) under context parallelism. ``model_crc``: a function returning the model
    configuration's checksum, agreed with the batch's first call (called only under context
    parallelism). ``key_select`` (B, Lq, k) integer: the global keys each query selected, for a
    ``spec`` with ``selection`` (index-sparse attention; run eagerly, also under torch.compile). ``latent``: a
    :class:`~cp_attention.strategies.latent.LatentKV` whose expansion k and v are (multi-head latent
    attention): under context parallelism, run eagerly, the ring (or the selected keys' exchange) may move it
    instead of the heads."""
    if torch_context_parallel_active():
        raise refuse("torch_context_parallel")
    if spec.selection:  # eager: a graph break under torch.compile
        return _bound_attention(q, k, v, spec, position_ids, docs, sinks, layer, model_crc, adjust_q,
                                key_select=key_select, extra_kv=extra_kv, latent=latent)
    if compiling_outside_cp():  # traced outside context parallelism: straight to the op
        batch = batch_of(position_ids) or (docs.batch if docs.mask else None)
        if batch is None:
            return _layer_single_device(q, k, v, spec, sinks, docs, position_ids, None, layer)
    elif torch.compiler.is_compiling():  # traced inside: the multi-rank op, bound to its batch when it runs
        if adjust_q is None:
            return bound_attention(q, k, v, spec, sinks=sinks, position_ids=position_ids, docs=docs,
                                            layer=layer)
        return _bound_traced_docs(q, k, v, spec, position_ids, docs, sinks, layer, model_crc, adjust_q)
    return _bound_attention(q, k, v, spec, position_ids, docs, sinks, layer, model_crc, adjust_q, latent=latent)


def bind_traced_docs(docs: LayerDocs, batch_size: int, q_length: int) -> LayerDocs:
    """The documents of a layer traced inside context parallelism, at run time: its mask's batch
    (:func:`~cp_attention.engine.batch.resolve_for_mask`, which the traced mask function could not ask) and
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
    return refuse("appended_keys", keys=Lk, covered=docs.kv_length, queries=Lq, appended=Lk - docs.kv_length)


def bound_layer(q, k, v, spec, position_ids, docs: LayerDocs, sinks, layer, run):
    """:func:`attend_layer`'s call under context parallelism with ``run`` (:func:`passes`) in place of
    the differentiable call: what the compiled multi-rank op runs (model checksum not agreed: -1)."""
    return _bound_attention(q, k, v, spec, position_ids, docs, sinks, layer, None, None, run)


@torch.compiler.disable
def _bound_attention(q, k, v, spec, position_ids, docs: LayerDocs, sinks, layer, model_crc, adjust_q, run=None,
                     key_select=None, extra_kv=None, latent=None):
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
            and process_count() > 1 and not context.full_batch_active():
        # exact (each process attends over its own whole sequences), but likely not what was meant
        warnings.warn(
            f"cp_flash: a training forward on {process_count()} processes without context parallelism: no "
            "cp_attention.context_parallel block is active, so this is data parallelism and no sequence is split. "
            "For context parallelism train with CPTrainer (cp_attention.integrations.trainers.trainer) or CPSFTTrainer "
            "(cp_attention.integrations.trainers.trl) instead of Trainer / SFTTrainer, or run the step inside "
            "cp_attention.context_parallel() on inputs from cp.shard_batch(...)", UserWarning, stacklevel=3)
    if batch is None and multi_rank_context:
        local_error = local_error or refuse("unsharded_inputs")
    if local_error is not None:  # raised on every rank of the group together, before any K/V moves
        if batch is None and multi_rank_context:
            attend(q, k, v, spec, sinks=sinks, local_error=local_error, key_select=key_select)
        elif batch is not None and batch.cp.world_size > 1:
            attend(q, k, v, spec, sinks=sinks, batch=batch, local_error=local_error,
                   model_crc=-1 if model_crc is None else model_crc(), key_select=key_select)
        raise local_error
    if batch is None or batch.cp.world_size == 1:
        if run is not None:
            raise refuse("compiled_cp_on_one_rank")
        return _layer_single_device(q, k, v, spec, sinks, docs, position_ids, batch, layer, key_select, extra_kv)
    model_crc = -1 if model_crc is None else model_crc()
    if Lq != Lk or docs.q_offset or docs.kv_offset:  # keys the model appended were refused above
        raise refuse("kv_cache_under_cp", queries=Lq, offset=docs.q_offset, keys=Lk)
    if docs.valid is not None and not batch.padded:
        local_error = refuse("padding_mask_not_sharded")
    if run is not None and batch.meta.spans is not None:
        local_error = local_error or refuse("spans_compiled_in_cp")
    if spec.spans and not batch.spans_read:
        local_error = local_error or refuse("spans_not_read")
    if docs.collator_documents:
        raise refuse("collator_documents_under_cp")
    if adjust_q is not None:
        cp = batch.cp
        q = adjust_q(q, global_index(batch.seq_len, cp.world_size, batch.layout, cp.rank))
    if latent is not None and latent.latent.shape[:2] != k.shape[:2]:
        latent = None  # not the rows of these keys: the heads move
    return attend(q, k, v, spec, sinks=sinks, batch=batch, local_error=local_error, layer=layer,
                  model_crc=model_crc, run=run, key_select=key_select, extra_kv=extra_kv, latent=latent)


def _layer_single_device(q, k, v, spec: MaskSpec, sinks, docs: LayerDocs, position_ids, batch, layer,
                         key_select=None, extra_kv=None):
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
        raise refuse("unplaced_keys", queries=Lq, keys=Lk)
    cached = docs.q_offset != 0 or docs.kv_offset != 0 or Lq != Lk
    if batch is not None and not cached and batch.seq_len == Lq and batch.meta.batch == B:
        found = dict(position_ids=batch.meta.position, valid=None, cu_seqlens=None, opens=batch.doc_opens,
                     span_next=batch.span_next if batch.spans_read else docs.span_next)
    else:
        found = dict(position_ids=position_ids, cu_seqlens=docs.cu_seqlens, valid=docs.valid, opens=docs.opens,
                     span_next=docs.span_next)
    if spec.selection:
        found.pop("span_next")
        backend = batch.cp.backend if batch is not None else None
        return local_selected_attention(q, k, v, spec, key_select, sinks=sinks, q_offset=docs.q_offset,
                                        kv_offset=docs.kv_offset, backend=backend, bound=batch is not None,
                                        layer=layer, extra_kv=extra_kv, **found)
    return local_attention(q, k, v, spec, sinks=sinks, q_offset=docs.q_offset, kv_offset=docs.kv_offset,
                                    backend=batch.cp.backend if batch is not None else None, bound=batch is not None,
                                    layer=layer, **found)


# ----------------------------------------------------------------------------------------------
# the multi-rank op: a layer traced inside context parallelism


def _bound_call(q, k, v, sinks, position_ids, attention_mask, q_offset, kv_offset, kv_length, has_mask, causal,
                spans, window, chunk_size, softcap, scale, layer, run):
    """Both passes of the multi-rank op: the layer's documents bound to its batch now (at run time),
    then the engine's call under context parallelism (checks every rank raises together, agreement,
    the plan from the context's cache, the strategy) with ``run`` in place of autograd."""
    spec = MaskSpec(causal=causal, window=window, chunk_size=chunk_size, softcap=softcap, scale=scale, spans=spans)
    docs = LayerDocs(mask=has_mask, q_offset=q_offset, kv_offset=kv_offset,
                     kv_length=None if kv_length < 0 else kv_length, valid=attention_mask)
    docs = bind_traced_docs(docs, q.shape[0], q.shape[1])
    return bound_layer(q, k, v, spec, position_ids, docs, sinks, None if layer < 0 else layer, run)


@torch.library.custom_op("cp_attention::bound_attention", mutates_args=())
def _bound_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
                        position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, q_offset: int,
                        kv_offset: int, kv_length: int, has_mask: bool, causal: bool, spans: bool,
                        window: int | None, chunk_size: int | None, softcap: float | None, scale: float | None,
                        layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, L, H, D), k (B, L, K, D), v (B, L, K, Dv) of this rank -> out (B, L, H, Dv), lse (H, B * L)
    float32 (float64 for float64 inputs)."""
    if layer == 0 and not in_backward():
        stats.begin_forward()
    out, lse = _bound_call(q, k, v, sinks, position_ids, attention_mask, q_offset, kv_offset, kv_length, has_mask,
                           causal, spans, window, chunk_size, softcap, scale, layer, passes())
    return out.contiguous(), lse.contiguous()


@_bound_attention_op.register_fake
def _(q, k, v, sinks, position_ids, attention_mask, q_offset, kv_offset, kv_length, has_mask, causal, spans, window,
      chunk_size, softcap, scale, layer):
    B, L, H, _ = q.shape
    return q.new_empty((B, L, H, v.shape[3])), q.new_empty((H, B * L), dtype=accumulation_dtype(q.dtype))


@torch.library.custom_op("cp_attention::bound_attention_backward", mutates_args=())
def _bound_attention_backward(
        dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
        sinks: torch.Tensor | None, position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
        q_offset: int, kv_offset: int, kv_length: int, has_mask: bool, causal: bool, spans: bool,
        window: int | None, chunk_size: int | None, softcap: float | None, scale: float | None, layer: int,
        need_dsinks: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> dq (B, L, H, D), dk (B, L, K, D), dv (B, L, K, Dv), dsinks (H,) (empty when not needed). The
    plan is the forward's (the batch's agreed signature: no collective before the exchanges)."""
    dq, dk, dv, dsinks = _bound_call(q, k, v, sinks, position_ids, attention_mask, q_offset, kv_offset, kv_length,
                                     has_mask, causal, spans, window, chunk_size, softcap, scale, layer,
                                     passes(dout, out, lse, need_dsinks))
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), dsinks if dsinks is not None else q.new_empty(0)


@_bound_attention_backward.register_fake
def _(dout, q, k, v, out, lse, sinks, position_ids, attention_mask, q_offset, kv_offset, kv_length, has_mask, causal,
      spans, window, chunk_size, softcap, scale, layer, need_dsinks):
    dsinks = sinks.new_empty(sinks.shape) if sinks is not None and need_dsinks else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


# documents: position_ids, attention_mask; static: q_offset ... layer
pair_autograd(_bound_attention_op, torch.ops.cp_attention.bound_attention_backward, slice(4, 6), slice(6, 17), 17)


def bound_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: MaskSpec, *,
                    sinks: torch.Tensor | None = None, position_ids: torch.Tensor | None = None, docs=None,
                    layer: int | None = None) -> torch.Tensor:
    """A model layer's attention under context parallelism as one custom op that ``torch.compile``
    keeps opaque: q (B, L, H, D), k (B, L, K, D), v (B, L, K, Dv) of this rank, sinks (H,) or None ->
    (B, L, H, Dv), differentiable w.r.t. q, k, v and sinks.

    Everything dynamo cannot trace happens inside, when the op runs: the batch the layer's tensors
    are bound to (``position_ids`` or, through ``docs.valid``, the model's raw ``attention_mask``: the
    tensors ``cp.shard_batch`` returned), the checks every rank raises together, the agreement, the
    plan (from the context's cache: a new packing of the same length runs the same graph) and the
    strategy's exchanges. The backward runs the same plan's backward (``ring_backward``, or the
    head-parallel one). ``docs``: the layer's :class:`LayerDocs` as traced."""
    kv_length = -1 if docs is None or docs.kv_length is None else int(docs.kv_length)
    out, _ = torch.ops.cp_attention.bound_attention(
        q, k, v, sinks, position_ids, None if docs is None else docs.valid, 0 if docs is None else int(docs.q_offset),
        0 if docs is None else int(docs.kv_offset), kv_length, bool(docs is not None and docs.mask), bool(spec.causal),
        bool(spec.spans), spec.window, spec.chunk_size, None if spec.softcap is None else float(spec.softcap),
        None if spec.scale is None else float(spec.scale), -1 if layer is None else int(layer))
    return out
