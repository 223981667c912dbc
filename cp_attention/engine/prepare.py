"""Planning a batch before its step (:meth:`ContextParallel.prepare <cp_attention.ContextParallel.prepare>`):
the batch's documents, its layout and this rank's plan for every attention mask its step will use,
computed ahead (in a background thread of the process that steps: :func:`prefetch`) and put in the
context's plan cache under the keys the step computes from the content of what it is handed.

What runs ahead is local and pure: metadata, the (balanced) layout, this rank's plans
(:mod:`cp_attention.engine.planning`; the last two optionally in an executor's worker processes, out
of this process's interpreter lock). Nothing here runs a collective, so it may run in any thread
while the step's collectives run in the main one. The step still runs its agreement (one header
all-gather per batch and call signature): a plan is used only when every rank holds it cached for the
same documents, so a rank that prepared something else, or has not finished, makes every rank plan
as without preparation, never use a wrong plan.

The lookup by content: ``cp.shard_batch`` finds a prepared batch under :func:`documents_key` (digests of
the document tensors it derives from the batch, the layout policy, and under ``layout="balanced"`` the
model's masks and token weight), and then reuses its metadata, its checksums and its layout object
(the layout a plan is keyed by). Each attention call finds its plan under
:func:`~cp_attention.engine.planning.plan_key`.

Legend: ``B`` rows, ``L`` global length, ``L_local`` this rank's tokens.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch

from .. import layout as layout_mod
from ..masks import MaskSpec, SequenceMeta
from . import planning
from .agreement import meta_crc

__all__ = ["PreparedBatch", "PreparedDocuments", "documents_key", "plan_specs", "prepare_documents", "prefetch"]

log = logging.getLogger("cp_attention.api")


@dataclass(frozen=True)
class PreparedBatch:
    """What :meth:`ContextParallel.prepare <cp_attention.ContextParallel.prepare>` computed for one batch
    (for inspection; the step finds it by content, nothing needs to be passed on)."""

    rows: int
    """``B``, the batch's rows."""
    seq_len: int
    """``L``, the batch's global length."""
    layout: object
    """The layout the batch will be sharded with (under ``layout="balanced"``: its own, computed here)."""
    masks: tuple
    """The distinct layer masks planned (:class:`~cp_attention.MaskSpec`, their planning part)."""
    dims: tuple
    """``(H, K, D, Dv, itemsize)``: the call shapes planned for."""
    strategy: str
    """The context's strategy the plans were built for."""
    plans: int
    """Plans built (one per mask; 0 on one rank, whose calls plan on one device)."""
    seconds: float
    """How long preparing took."""


@dataclass(frozen=True, eq=False)
class PreparedDocuments:
    """The cache entry ``cp.shard_batch`` reuses: a batch's metadata, its layout and checksums."""

    meta: SequenceMeta
    layout: object
    crc: int
    digest: bytes


def documents_key(cache, policy, B: int, L: int, position_ids: torch.Tensor, valid, opens, span_next,
                  masks, token_weight: float) -> tuple:
    """The key of a batch's prepared documents: ``cache``'s digests (:meth:`PlanCache.digest
    <cp_attention.plan.PlanCache.digest>`) of ``position_ids`` (B or 1, L), ``valid`` and ``opens``
    (B, L) bool and ``span_next`` (B, L) bool (each or None), the context's layout ``policy``, and under
    a per-batch policy the model's ``masks`` (dicts) and ``token_weight`` its layout is computed from."""
    if policy.per_batch:
        layers = None if masks is None else tuple(tuple(sorted(dict(m).items())) for m in masks)
        model = (layers, float(token_weight))
    else:
        model = None
    return ("prepared", policy, B, L, cache.digest(position_ids), cache.digest(valid), cache.digest(opens),
            cache.digest(span_next), model)


def plan_specs(masks, has_spans: bool) -> tuple[MaskSpec, ...]:
    """The distinct planning masks of ``masks`` (MaskSpecs or their keyword dicts), in order; with
    ``has_spans`` (the batch has bidirectional spans) each causal unchunked mask also with ``spans=True``
    (whether a layer opens them is decided by its mask when it runs). ValueError naming the problem."""
    if masks is None or isinstance(masks, (MaskSpec, dict)) or not len(masks):
        raise ValueError("cp.prepare: masks must be a non-empty list of the attention calls' masks (MaskSpec or "
                         f"its keywords: causal, window, chunk_size), got {masks!r}")
    found: list[MaskSpec] = []
    for m in masks:
        spec = (m if isinstance(m, MaskSpec) else MaskSpec(**dict(m))).for_planning()
        variants = [spec]
        if has_spans and spec.causal and spec.chunk_size is None and not spec.spans:
            variants.append(MaskSpec(causal=True, window=spec.window, spans=True))
        for variant in variants:
            if variant not in found:
                found.append(variant)
    return tuple(found)


def prepare_documents(cp, B: int, L: int, *, position_ids: torch.Tensor, opens=None, valid=None,
                      model_masks: Callable[[], tuple[list | None, float]] | None = None,
                      span_next=None, masks, dims: tuple, documents_path: bool, executor=None) -> PreparedBatch:
    """The engine's half of ``cp.prepare`` for the context ``cp`` (the arguments of
    :meth:`~cp_attention.ContextParallel.shard_documents` for a batch of ``B`` rows of ``L`` tokens, the
    same tensors): the batch's metadata and layout, put in ``cp.plans`` under :func:`documents_key`,
    then this rank's plan for each of :func:`plan_specs` under the key a call bound to the batch
    computes and, with ``documents_path``, also under the key of a bare call handed the batch's local
    ``position_ids`` (when they alone describe the documents). ``dims``:
    :data:`~cp_attention.engine.planning.Dims`. ``executor``: a :mod:`concurrent.futures` executor that
    computes the balanced layout and the plans (pure functions of picklable arguments; the plans
    concurrently); None: here. Runs no collective."""
    start = time.perf_counter()
    policy = cp.layout
    layer_masks, token_weight = (model_masks() if model_masks is not None else (None, 0.0)) if policy.per_batch \
        else (None, 0.0)
    key = documents_key(cp.plans, policy, B, L, position_ids, valid, opens, span_next, layer_masks, token_weight)
    expanded = position_ids.expand(B, L)
    meta = SequenceMeta.from_inputs(B, L, position_ids=expanded, valid=valid, opens=opens, span_next=span_next)
    layout = policy
    if policy.per_batch:
        layout = _run(executor, [(policy.for_batch, (meta, cp.world_size),
                                  dict(masks=[dict(m) for m in layer_masks] if layer_masks else None,
                                       token_weight=token_weight))])[0]
    crc, digest = meta_crc(meta), meta.digest()
    specs = plan_specs(masks, meta.spans is not None)
    how = planning.how_of(cp.strategy, cp.ulysses_size if cp.strategy == "usp" else None, cp.cost_model)
    plans = []
    if cp.world_size > 1:
        L_local = layout_mod.local_lengths(L, cp.world_size, layout)[cp.rank]
        meta_keys = [planning.batch_meta_key(digest, layout, B, L_local)]
        if documents_path and valid is None and opens is None and span_next is None:
            local = layout_mod.shard(expanded, 1, cp.world_size, layout, cp.rank).contiguous()
            meta_keys.append(planning.documents_meta_key(layout, B, L_local, cp.plans.digest(local), None))
            cp.plans.put(meta_keys[-1], (meta, crc, L))
        plans = _run(executor, [(planning.build_rank_plan, (cp.rank, cp.world_size, layout, meta, spec, dims, how), {})
                                for spec in specs])
        for spec, plan in zip(specs, plans):
            for meta_key in meta_keys:
                cp.plans.put(planning.plan_key(meta_key, spec, how, dims), (plan, crc, L))
    # last: a step that finds the documents finds the plans too (unless the cache evicted them)
    cp.plans.put(key, PreparedDocuments(meta=meta, layout=layout, crc=crc, digest=digest))
    seconds = time.perf_counter() - start
    cp.planning.add(batches_prepared=1, plans_prepared=len(plans), prepare_seconds=seconds)
    log.debug("batch prepared in %.1f ms: %d x %d tokens, %s layout, %d plan(s) (rank %d of %d)", 1e3 * seconds,
              B, L, layout, len(plans), cp.rank, cp.world_size)
    return PreparedBatch(rows=B, seq_len=L, layout=layout, masks=specs, dims=tuple(dims), strategy=cp.strategy,
                         plans=len(plans), seconds=seconds)


def _run(executor, jobs: list) -> list:
    """``fn(*args, **kwargs)`` of each job ``(fn, args, kwargs)``, here in order, or all submitted to
    ``executor`` at once and collected in order."""
    if executor is None:
        return [fn(*args, **kwargs) for fn, args, kwargs in jobs]
    futures = [executor.submit(fn, *args, **kwargs) for fn, args, kwargs in jobs]
    return [f.result() for f in futures]


_DONE = object()


def prefetch(prepare: Callable[[dict], object], batches: Iterable[dict], depth: int = 1) -> Iterator[dict]:
    """Iterate ``batches`` (each a dict of keyword arguments for ``cp.shard_batch``) while one background
    thread draws the next ones from it and runs ``prepare(batch)`` on each, at most ``depth`` batches
    ahead of the one the caller holds. Yields each batch unchanged, in order, once it is prepared. An
    exception raised drawing or preparing a batch is raised here, when the caller reaches that batch.
    Leaving the loop early (break, an exception) stops the thread after the batch it is working on."""
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"prefetch: depth must be a positive int (batches prepared ahead), got {depth!r}")
    return _prefetched(prepare, batches, depth)


def _prefetched(prepare, batches, depth: int) -> Iterator[dict]:
    ready: queue.Queue = queue.Queue()  # bounded by the slots: at most ``depth`` batches drawn and not taken
    slots = threading.Semaphore(depth)
    stop = threading.Event()

    def work() -> None:
        try:
            drawn = iter(batches)
            while True:
                while not slots.acquire(timeout=0.1):
                    if stop.is_set():
                        return
                if stop.is_set():
                    return
                batch = next(drawn, _DONE)
                if batch is _DONE:
                    ready.put((_DONE, None))
                    return
                prepare(batch)
                ready.put((batch, None))
        except BaseException as exc:  # raised in the caller's thread, at this batch
            ready.put((None, exc))

    thread = threading.Thread(target=work, name="cp_attention-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            batch, error = ready.get()
            if error is not None:
                raise error
            if batch is _DONE:
                return
            slots.release()  # the loop holds this batch: the thread may draw the next one
            yield batch
    finally:
        stop.set()
