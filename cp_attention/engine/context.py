"""The context object: :func:`context_parallel` and :class:`ContextParallel`, a group with its
layout, backend, failure channel, plan cache and live batches.

Legend: ``B`` batch, ``L`` global length, ``L_local`` this rank's tokens.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
from typing import Callable

import torch

from .. import layout as layout_mod
from .agreement import check_strategy
from ..backends import BACKENDS
from .batch import BatchRecord, LiveRecords, bind, tokens_checksum
from ..comm import Comm
from ..masks import SequenceMeta
from ..plan.cache import PlanCache
from ..strategies.choice import CostModel
from .planning import dims_for
from .prepare import PreparedBatch, PreparedDocuments, documents_key, prefetch, prepare_documents
from .stats import PlanningCounter, PlanningStats

__all__ = ["ContextParallel", "context_parallel", "active_context", "outside_context", "full_batch_active", "as_group",
           "PLAN_CACHE_SIZE", "register_batch_convention", "register_context_guard"]

log = logging.getLogger("cp_attention.api")

PLAN_CACHE_SIZE = 32
"""Plans and document metadata a context keeps, together (least recently used first out)."""

ACTIVE_CONTEXT: contextvars.ContextVar = contextvars.ContextVar("cp_attention_ctx", default=None)
"""The innermost ``context_parallel`` block of this thread / task (a ``with`` block's scope is dynamic)."""
FULL_BATCH: contextvars.ContextVar = contextvars.ContextVar("cp_attention_full_batch", default=False)
"""True inside :func:`outside_context`: a full-batch computation every rank runs alike."""
ANNOUNCED: set = set()
"""(world size, layout, backend) already logged at INFO, once per process. Guarded by ``ANNOUNCED_LOCK``."""
ANNOUNCED_LOCK = threading.Lock()
BATCH_CONVENTIONS: dict = {}
"""name -> ``shard_batch(cp, **inputs)``: how ``cp.shard_batch`` reads a collator's batch, registered by
the integrations (:func:`register_batch_convention`) so that the engine never imports them."""
CONTEXT_GUARDS: list = []
"""Callables ``cp -> (callable run when the block exits)``: what a ``context_parallel`` block enters and
leaves (the model check of cp_flash models), registered by the integrations (:func:`register_context_guard`)."""
_REGISTRY_LOCK = threading.Lock()


def register_batch_convention(name: str, shard_batch: Callable) -> None:
    """Make ``shard_batch(cp, **inputs)`` the way ``cp.shard_batch`` reads batches of ``name`` (the first
    registration of a name wins); ``cp.prepare`` calls it with ``prepare={"masks": ..., "shapes": {...},
    "executor": ...}`` too, and it then hands the same documents to
    :meth:`ContextParallel.prepare_documents` instead of :meth:`ContextParallel.shard_documents`."""
    with _REGISTRY_LOCK:
        BATCH_CONVENTIONS.setdefault(name, shard_batch)


def register_context_guard(guard: Callable) -> None:
    """Run ``guard(cp)`` when a ``context_parallel`` block is entered, and the callable it returns when
    the block exits (once per guard)."""
    with _REGISTRY_LOCK:
        if guard not in CONTEXT_GUARDS:
            CONTEXT_GUARDS.append(guard)


def active_context() -> ContextParallel | None:
    """The innermost active :func:`context_parallel` context of this thread, or None."""
    return ACTIVE_CONTEXT.get()


def full_batch_active() -> bool:
    """Whether this thread runs inside :func:`outside_context` (a full-batch computation every rank runs alike)."""
    return FULL_BATCH.get()


@contextlib.contextmanager
def outside_context():
    """Run a block as if no :func:`context_parallel` block were active in this thread (the
    innermost context comes back after it): computations over the full batch that every rank runs
    alike, such as a vision-language model's image encoder inside ``cp.shard_batch``, attend on
    one device instead of binding to the block's sharded batch."""
    token, full = ACTIVE_CONTEXT.set(None), FULL_BATCH.set(True)
    try:
        yield
    finally:
        FULL_BATCH.reset(full)
        ACTIVE_CONTEXT.reset(token)


def as_group(group, mesh_dim: str | None = None):
    """A process group from a ProcessGroup, None (the WORLD group) or a DeviceMesh (1-D, or with the
    name of its context-parallel dimension in ``mesh_dim``)."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if mesh_dim is not None:
            if mesh_dim not in (group.mesh_dim_names or ()):
                raise ValueError(f"mesh_dim={mesh_dim!r} is not a dimension of the DeviceMesh "
                                 f"(its dimensions: {group.mesh_dim_names})")
            return group.get_group(mesh_dim)
        if group.ndim != 1:
            raise ValueError(f"context_parallel got a {group.ndim}-D DeviceMesh with dimensions "
                             f"{group.mesh_dim_names}; pass its context-parallel dimension: group=mesh['cp'] "
                             f"or context_parallel(mesh, mesh_dim='cp')")
        return group.get_group()
    if mesh_dim is not None:
        raise ValueError("mesh_dim names a dimension of a DeviceMesh; group is not a DeviceMesh")
    return group


class ContextParallel:
    """A context-parallel group: how sequences are sharded over its ranks, plus a plan cache.

    Plans depend on the batch's sequence metadata and the mask; they are cached here (keyed by the
    content of the documents, shapes, layout and mask) so every layer of one forward that shares a
    mask reuses one plan and the metadata is exchanged once.
    """

    def __init__(self, group=None, layout="zigzag", timeout: float | None = None, backend: str = "auto",
                 strategy: str = "ring", ulysses_size: int | None = None, cost_model: CostModel | None = None, *,
                 single: bool = False, verify: bool = True):
        group = as_group(group)
        if backend != "auto" and backend not in BACKENDS:
            raise ValueError(f"backend must be 'auto' or one of {sorted(BACKENDS)}, got {backend!r}")
        self.strategy = check_strategy(strategy, ulysses_size)
        if strategy == "usp" and ulysses_size is None:
            raise ValueError("context_parallel(strategy='usp') needs ulysses_size: the ranks of each head group (a "
                             "divisor of the world size and of the query heads); or use strategy='auto'")
        self.ulysses_size = ulysses_size
        self.verify = bool(verify)  # verification of a model's first use (integrations.hf.verification)
        if cost_model is not None and not isinstance(cost_model, CostModel):
            raise TypeError(f"cost_model must be a cp_attention.CostModel, got {type(cost_model).__name__}")
        self.cost_model = cost_model or CostModel()
        # a layout object, or the Balanced policy (shard_batch lays out each batch); parsed before the
        # comm opens its failure scope, so a bad layout opens none (the ranks' scope counts stay equal)
        self.layout = layout_mod.as_policy(layout)
        # single: a one-rank context on this process alone, whatever group is initialised (a check that runs
        # one rank's path of a mixer on its own, :mod:`cp_attention.integrations.hf.class_admission`)
        self.comm = Comm(single=True, timeout=timeout) if single else Comm(group, timeout=timeout, fresh_scope=True)
        self.group = group
        self.backend = backend
        key = (self.comm.world_size, self.layout.name, backend)
        with ANNOUNCED_LOCK:
            announce = key not in ANNOUNCED
            ANNOUNCED.add(key)
        if announce:
            log.info("context parallelism over %d rank(s), %s layout, backend %r (rank %d)",
                     self.comm.world_size, self.layout, backend, self.comm.rank)
        self.plans = PlanCache(PLAN_CACHE_SIZE)
        self.planning = PlanningCounter()  # where plans came from (planning_stats); prepare may run in a thread
        self.records = LiveRecords()
        self._batch: BatchRecord | None = None  # the most recent shard_batch record

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    def __repr__(self) -> str:
        return f"ContextParallel(rank={self.rank}, world_size={self.world_size}, layout={self.layout.label})"

    def current_layout(self):
        """The layout tensors are sharded with: the context's, or under ``layout="balanced"`` the one
        computed for the most recent ``shard_batch`` call."""
        if not self.layout.per_batch:
            return self.layout
        if self._batch is None:
            raise ValueError('context_parallel(layout="balanced") computes each batch\'s layout in cp.shard_batch: '
                             "call it first (or pass layout= explicitly)")
        return self._batch.layout

    def shard(self, x: torch.Tensor, dim: int = 1, layout=None) -> torch.Tensor:
        """This rank's shard of a full-length tensor along ``dim`` (differentiable); ``layout``
        None: :meth:`current_layout`."""
        return layout_mod.shard(x, dim, self.world_size, layout or self.current_layout(), self.rank)

    def current_batch(self):
        """The record of this context's only live sharded batch, None when there is none, or
        :data:`~cp_attention.engine.batch.AMBIGUOUS` when several batches returned by :meth:`shard_batch`
        are still alive (a forward must then name its batch through the tensors it got from
        :meth:`shard_batch`)."""
        return self.records.only()

    def shard_batch(self, *, shift_labels: bool = True, document_starts: torch.Tensor | None = None, model=None,
                    **inputs) -> dict[str, torch.Tensor]:
        """Shard a full batch for a transformers model; returns the dict of local tensors.

        ``inputs`` are what a data collator returns for the whole (unsharded) batch: every
        (B, L, ...) tensor (``input_ids``, ``inputs_embeds``, ``attention_mask``, ``position_ids``,
        ``labels``, ``token_type_ids``, ...) is sharded along dim 1 with this context's layout.
        The output of transformers' ``DataCollatorWithFlattening`` is taken whole: its
        ``cu_seq_lens_q``/``cu_seq_lens_k``, ``max_length_q``/``max_length_k`` and ``seq_idx``
        describe the documents of the packed row; they are checked, turned into the batch's
        documents and not passed on. Anything else (other scalars, lists, 1-D tensors) raises a
        ValueError naming the key.

        * ``position_ids`` default to ``arange(L)`` so rotary embeddings see global positions.
        * ``document_starts`` (B, L) bool: further tokens that open a document (optional).
        * Under ``context_parallel(layout="balanced")`` the batch gets its own
          :func:`~cp_attention.balanced_layout` from its documents and ``model``'s attention layers
          and size (windows, chunks, token weight; without ``model``: one causal layer).
        * The batch's documents (wherever ``position_ids`` do not increase by one, the collator's
          document boundaries, ``document_starts`` and padding in ``attention_mask``) are recorded in a
          :class:`~cp_attention.engine.batch.BatchRecord` bound to the returned tensors: every attention
          layer under ``attn_implementation="cp_flash"`` that runs on them uses these documents,
          including layers that receive no ``position_ids`` (Llama 4, ModernBERT), and including
          forwards recomputed by gradient checkpointing after this context has exited. Several
          sharded batches may be alive at once (prefetching).
        * ``labels`` are shifted by one token globally before sharding (``shift_labels``, so no
          label is lost at a shard boundary; pass ``shift_labels=False`` for masked-LM labels),
          and ``num_items_in_batch`` is added: the global count of label tokens (or the
          ``num_items_in_batch`` passed in, e.g. counted over accumulated micro-batches) divided by
          the world size. Each rank's ``out.loss`` is then ``P`` times its token-weighted share:
          the **mean** over the group of the ranks' losses is the single-device loss, and the
          mean of their gradients (what DDP, FSDP2 and ``all_reduce(AVG)`` compute) is the
          single-device gradient.

        The collator's conventions are transformers' (registered by ``cp_attention.integrations``);
        the engine's half is :meth:`shard_documents`.
        """
        convention = BATCH_CONVENTIONS.get("transformers")
        if convention is None:
            raise RuntimeError("cp.shard_batch: no batch convention is registered (import cp_attention, which "
                               "registers transformers' conventions); shard tensors with cp.shard_documents")
        return convention(self, shift_labels=shift_labels, document_starts=document_starts, model=model, **inputs)

    def prepare(self, *, document_starts: torch.Tensor | None = None, model=None, masks=None, heads: int | None = None,
                kv_heads: int | None = None, head_dim: int | None = None, head_dim_v: int | None = None,
                dtype: torch.dtype | None = None, executor=None, **inputs) -> PreparedBatch:
        """Plan a batch before its step: what ``cp.shard_batch(**inputs)`` and the step's attention calls
        would compute on the host, computed now and kept in this context by content, so that the step
        finds it and plans nothing on its critical path.

        ``inputs``, ``document_starts`` and ``model``: what the step will pass to :meth:`shard_batch`
        (the same full batch; the tensors need not be the same objects). Computed: the batch's document
        metadata and checksums; its layout (under ``layout="balanced"`` the batch's own, which
        ``shard_batch`` then uses as it is); this rank's plan of every distinct attention mask, for the
        context's strategy. The masks and shapes: those of ``model`` (a ``cp_flash`` model: its
        config's attention layer masks, query and K/V heads and head dims, its parameters' dtype), or
        ``masks`` (a list of :class:`~cp_attention.MaskSpec` or of dicts of its keywords ``causal``,
        ``window``, ``chunk_size``) for calls whose q is (B, L_local, ``heads``, ``head_dim``), k
        (B, L_local, ``kv_heads``, ``head_dim``) and v (B, L_local, ``kv_heads``, ``head_dim_v``) in
        ``dtype`` (``kv_heads`` and ``head_dim_v`` default to ``heads`` and ``head_dim``): the bare
        :func:`~cp_attention.attention` calls of the step on the batch's tensors. Given with ``model``,
        they replace what it says (``dtype=torch.bfloat16`` for a float32 model under bf16 autocast).

        ``executor``: a :mod:`concurrent.futures` executor that computes the balanced layout and the
        plans (the plans concurrently): a ``ProcessPoolExecutor`` keeps them off this process's
        interpreter lock, which the step's own Python needs; None: computed in the calling thread.

        Thread-safe and runs no collective: call it in a collate function, a background thread or
        through :meth:`prefetch` while the current step runs. The step still agrees (one small
        all-gather per batch and mask) and uses a prepared plan only when every rank holds it;
        otherwise every rank plans as without preparing. Preparing other masks, shapes or a dtype
        than the step's is never wrong, only not faster: :meth:`planning_stats` counts it
        (``prepared_misses``) and the ``cp_attention.api`` logger says which call planned at INFO.

        Kept in the context's plan cache (:data:`PLAN_CACHE_SIZE` entries, least recently used out; a
        batch takes one entry plus one per mask, twice that without ``model``): prepare a few batches
        ahead, not an epoch. A one-rank context prepares the metadata and layout only (its calls plan
        on one device). Returns a :class:`~cp_attention.engine.prepare.PreparedBatch` (what was
        computed, in how long)."""
        convention = BATCH_CONVENTIONS.get("transformers")
        if convention is None:
            raise RuntimeError("cp.prepare: no batch convention is registered (import cp_attention, which registers "
                               "transformers' conventions)")
        shapes = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, head_dim_v=head_dim_v, dtype=dtype)
        return convention(self, document_starts=document_starts, model=model,
                          prepare=dict(masks=masks, shapes={k: v for k, v in shapes.items() if v is not None},
                                       executor=executor), **inputs)

    def prepare_documents(self, rows: int, seq_len: int, *, position_ids: torch.Tensor,
                          opens: torch.Tensor | None = None, valid: torch.Tensor | None = None,
                          model_masks: Callable[[], tuple[list | None, float]] | None = None,
                          span_next: torch.Tensor | None = None, masks=None, shapes: dict,
                          documents_path: bool = True, executor=None) -> PreparedBatch:
        """The engine's half of :meth:`prepare`, what a batch convention calls instead of
        :meth:`shard_documents` with the same tensors (for a batch of ``rows`` x ``seq_len`` tokens).
        ``masks``: the calls' masks; ``shapes``: the keywords ``heads``, ``kv_heads``, ``head_dim``,
        ``head_dim_v``, ``dtype`` of :meth:`prepare` (``heads``, ``head_dim`` and ``dtype`` required).
        ``documents_path``: also plan for bare calls handed the batch's ``position_ids``;
        ``executor``: :meth:`prepare`'s (:func:`cp_attention.engine.prepare.prepare_documents`)."""
        missing = [name for name in ("heads", "head_dim", "dtype") if shapes.get(name) is None]
        if masks is None or missing:
            raise ValueError(
                "cp.prepare needs the attention calls' masks and shapes: model= (a cp_flash model, which says "
                "both), or masks=[MaskSpec(...), ...] with heads=, head_dim= and dtype= (and kv_heads=, "
                f"head_dim_v= where they differ); missing: {', '.join((['masks'] if masks is None else []) + missing)}")
        return prepare_documents(self, rows, seq_len, position_ids=position_ids, opens=opens, valid=valid,
                                 model_masks=model_masks, span_next=span_next, masks=masks,
                                 dims=dims_for(**shapes), documents_path=documents_path, executor=executor)

    def prefetch(self, batches, *, depth: int = 1, **prepare_kwargs):
        """Iterate ``batches`` (a data loader: any iterable of dicts of :meth:`shard_batch`'s keyword
        arguments) while one background thread reads the next ones and prepares them
        (:meth:`prepare` with ``prepare_kwargs``: ``model=``, or ``masks=`` and the shapes, and an
        ``executor``), at most ``depth`` batches ahead of the one the loop holds::

            for batch in cp.prefetch(loader, model=model):
                out = model(**cp.shard_batch(**batch, model=model), use_cache=False)

        The batches come out unchanged and in order, each once it is prepared. ``batches`` is iterated
        in that thread only. An exception raised reading or preparing a batch is raised when the loop
        reaches it; leaving the loop stops the thread after the batch it is working on."""
        if prepare_kwargs.get("model") is None and prepare_kwargs.get("masks") is None:
            raise ValueError("cp.prefetch needs model= (a cp_flash model) or masks= with the calls' shapes "
                             "(heads=, head_dim=, dtype=): the keywords of cp.prepare")
        return prefetch(lambda batch: self.prepare(**batch, **prepare_kwargs), batches, depth)

    def planning_stats(self) -> PlanningStats:
        """Where this context's plans and batch layouts came from: prepared ahead, reused from the cache
        or built on the step (:class:`~cp_attention.engine.stats.PlanningStats`)."""
        return self.planning.snapshot()

    def shard_documents(self, tensors: dict[str, torch.Tensor], *, position_ids: torch.Tensor,
                        opens: torch.Tensor | None = None, valid: torch.Tensor | None = None,
                        model_masks: Callable[[], tuple[list | None, float]] | None = None,
                        num_items: torch.Tensor | None = None,
                        bind_also: dict[str, torch.Tensor] | None = None,
                        positions_given: bool = True, span_next: torch.Tensor | None = None,
                        spans_read: bool = False,
                        derived: Callable[[Callable], dict] | None = None) -> dict[str, torch.Tensor]:
        """The engine's half of :meth:`shard_batch`: documents -> metadata, layout, shards, record.

        ``tensors``: full (B, L, ...) tensors to shard along dim 1; ``position_ids`` (B or 1, L)
        global positions; ``opens`` (B, L) bool further document openings; ``valid`` (B, L) bool
        padding mask. ``model_masks``: under a per-batch layout policy, returns the model's per-layer
        masks and token weight (called only then). ``num_items``: the batch's global label count,
        kept on the record. ``bind_also``: local tensors returned and bound as they are.
        ``positions_given``: False when ``position_ids`` were numbered by the caller's default rather
        than given by the user (kept on the record). ``span_next`` (B, L) bool: the batch's
        bidirectional spans (token ``i`` and ``i + 1`` in one span; :meth:`SequenceMeta.from_inputs`),
        ``spans_read``: they were read from the model's inputs (kept on the record). ``derived``:
        called with ``shard(x, dim)`` (this batch's layout) after the layout is known; returns more
        local values: tensors are returned and bound like the others (not checksummed: derived from
        the batch), anything else is kept in the record's ``extras`` only. Returns the
        local tensors (``position_ids`` included), all bound to one :class:`BatchRecord`.

        The record keeps a checksum of the full ``tensors``: the batch's first attention call compares
        it across the group (in the agreement it runs anyway), so ranks handed different batches of
        the same length (a per-rank sampler) raise together instead of training on a splice."""
        B, L = next(iter(tensors.values())).shape[:2] if tensors else position_ids.shape
        meta, layout, prepared = self._documents(B, L, position_ids, valid, opens, span_next, model_masks)
        position_ids = position_ids.expand(B, L)
        out = {name: self.shard(t, layout=layout).contiguous() for name, t in tensors.items()}
        out.update(bind_also or {})
        out["position_ids"] = self.shard(position_ids, layout=layout).contiguous()
        extras = {}
        if derived is not None:
            for name, value in derived(lambda x, dim=1: self.shard(x, dim=dim, layout=layout).contiguous()).items():
                (out if isinstance(value, torch.Tensor) else extras)[name] = value
        self._batch = bind(self, out, meta=meta, layout=layout, num_items=num_items, padded=valid is not None,
                           tokens_crc=tokens_checksum(tensors) if self.world_size > 1 else -1,
                           positions_given=positions_given, spans_read=spans_read,
                           crc=None if prepared is None else prepared.crc,
                           digest=None if prepared is None else prepared.digest)
        self._batch.extras.update(extras)
        return out

    def _documents(self, B: int, L: int, position_ids, valid, opens, span_next, model_masks):
        """A batch's ``(metadata, layout, PreparedDocuments or None)``: what :meth:`prepare` computed for
        the same documents (found by content), else computed now."""
        masks, token_weight = None, 0.0
        if self.layout.per_batch and model_masks is not None:
            masks, token_weight = model_masks()
        if self.planning.snapshot().batches_prepared:  # nothing to look for (nor digest) until prepare ran
            key = documents_key(self.plans, self.layout, B, L, position_ids, valid, opens, span_next, masks,
                                token_weight)
            found = self.plans.get(key)
            if isinstance(found, PreparedDocuments):
                self.planning.add(batches_prepared_found=1)
                return found.meta, found.layout, found
        meta = SequenceMeta.from_inputs(B, L, position_ids=position_ids.expand(B, L), valid=valid, opens=opens,
                                        span_next=span_next)
        layout = self.layout
        if layout.per_batch:  # this batch's own layout, from every document it records
            layout = layout.for_batch(meta, self.world_size, masks=[dict(m) for m in masks] if masks else None,
                                      token_weight=token_weight)
        self.planning.add(batches_computed=1)
        return meta, layout, None

    def bind_batch(self, local: dict[str, torch.Tensor], *, meta: SequenceMeta,
                   num_items: torch.Tensor | None = None, padded: bool = False, layout=None) -> BatchRecord:
        """Record a batch sharded by hand: ``local`` (this rank's tensors, ``position_ids`` among them)
        and the global ``meta`` of its documents (see :func:`cp_attention.engine.batch.bind`)."""
        layout = layout_mod.as_layout(layout) if layout is not None else self.current_layout()
        self._batch = bind(self, local, meta=meta, layout=layout, num_items=num_items, padded=padded)
        return self._batch

    def gather(self, x: torch.Tensor, dim: int = 1, layout=None) -> torch.Tensor:
        """Every rank's shard along ``dim``, reassembled in original token order, on every rank.

        Not differentiable (a collective on detached data)."""
        if self.world_size == 1:
            return x
        x = x.detach()
        dim = dim % x.dim()
        lengths = self.comm.all_gather(torch.tensor([x.shape[dim]], device=self.comm.device))
        lengths = [int(n) for n in lengths]
        longest = max(lengths)
        pad_shape = list(x.shape)
        pad_shape[dim] = longest - x.shape[dim]
        padded = torch.cat([x, x.new_zeros(pad_shape)], dim=dim).to(self.comm.device)
        parts = self.comm.all_gather(padded)
        parts = [p.narrow(dim, 0, n).to(x.device) for p, n in zip(parts, lengths)]
        return layout_mod.unshard(parts, dim, layout or self.current_layout())


@contextlib.contextmanager
def context_parallel(group=None, layout="zigzag", timeout: float | None = None, *,
                     mesh_dim: str | None = None, backend: str = "auto", strategy: str = "ring",
                     ulysses_size: int | None = None, cost_model: CostModel | None = None, verify: bool = True):
    """Make ``group`` (None: the default WORLD group) the context-parallel group of the block.

    ``group``: a ProcessGroup, a 1-D ``DeviceMesh`` (e.g. ``mesh["cp"]`` of a (dp, cp) mesh), or a
    DeviceMesh with the name of its context-parallel dimension in ``mesh_dim``. ``layout``:
    ``"zigzag"``, ``"contiguous"``, ``"balanced"`` (each batch of ``cp.shard_batch`` gets its own
    balanced layout) or a layout object (:mod:`cp_attention.layout`). ``backend``: the varlen backend
    of the block's attention calls that do not name one, ``cp_flash`` layers included ("auto", or a
    name in ``cp_attention.backends.BACKENDS``). ``strategy``: how the block's multi-rank calls run
    (those that do not name one, ``cp_flash`` layers included): ``"ring"`` (K/V moves between the
    ranks' token shards: only the halo a window or chunk needs), ``"ulysses"`` (all-to-all head
    parallelism, :mod:`cp_attention.strategies.ulysses`: every rank attends over the whole sequence for
    ``H / P`` heads; needs ``H`` divisible by ``P``), ``"usp"`` (all-to-all within head groups of
    ``ulysses_size`` consecutive ranks, the ring across the groups) or ``"auto"`` (per layer mask,
    the cheapest of these by ``cost_model``, a :class:`~cp_attention.CostModel`; None: its
    defaults). See :mod:`cp_attention.strategies.choice`. ``verify``: the first forward of each model
    (class and configuration) under ``attn_implementation="cp_flash"`` in a multi-rank block first runs a
    tiny batch under the block and on one device and refuses the model on every rank when they differ
    (:mod:`cp_attention.integrations.hf.verification`; a few tiny forwards once); False skips it.

    Inside, :func:`~cp_attention.attention` with ``group=None`` shards over this group with this layout::

        with cp_attention.context_parallel(layout="zigzag") as cp:
            q, k, v = (cp.shard(t, dim=1) for t in (q_full, k_full, v_full))
            out = cp_attention.attention(q, k, v, window=4096)
            out_full = cp.gather(out, dim=1)

    Without an initialised torch.distributed and with ``group=None`` the context has world size 1.

    Failures: every wait for the other ranks gives up after ``timeout`` seconds (None:
    ``$CP_ATTENTION_TIMEOUT`` or 300) with a :class:`~cp_attention.comm.RankFailedError`. An
    exception escaping the block (or raised inside attention) is recorded for the group, so ranks
    waiting on this one raise at once, naming it, instead of waiting for the timeout.
    """
    cp = ContextParallel(as_group(group, mesh_dim), layout, timeout, backend, strategy, ulysses_size, cost_model,
                         verify=verify)
    # the integrations' guards of the block (the model check of cp_flash models)
    leave = [guard(cp) for guard in list(CONTEXT_GUARDS)]
    token = ACTIVE_CONTEXT.set(cp)
    try:
        with cp.comm.reporting("its context_parallel block"):
            yield cp
    finally:
        ACTIVE_CONTEXT.reset(token)
        for done in reversed(leave):
            done()
