"""Plan statistics: what the most recent attention calls did (traffic, kernel calls, work), and the
statistics of a layout without a process group (:func:`plan_stats`)."""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass

import torch

from ..masks import MaskSpec, SequenceMeta
from ..plan import PlanStats, build_plan
from ..torch_compat import in_backward

__all__ = ["last_plan_stats", "forward_plan_stats", "begin_forward", "note_stats", "plan_stats", "strategy_label",
           "predicted_label", "forward_mixer_stats", "note_mixer", "begin_mixers", "PlanningStats", "PlanningCounter"]

log = logging.getLogger("cp_attention.api")

STATS: dict = {"last": None}
"""The most recent plan statistics in this process (:func:`last_plan_stats`). Guarded by ``STATS_LOCK``."""
STATS_LOCK = threading.Lock()
FORWARD = threading.local()
"""Per thread: the plans (``.calls``) and mixer calls (``.mixers``) of the current model forward."""


def last_plan_stats() -> PlanStats | None:
    """Statistics of the plan used by the most recent attention call in this process (the bare
    :func:`~cp_attention.attention` or a ``cp_flash`` layer, at any world size)."""
    with STATS_LOCK:
        return STATS["last"]


def forward_plan_stats() -> list[tuple[int | None, PlanStats]]:
    """``(layer index, PlanStats)`` of every attention layer call of the most recent ``cp_flash``
    model forward in this thread, in call order, at any world size (recomputations by gradient
    checkpointing during backward are not counted again)."""
    return list(getattr(FORWARD, "calls", []))


def forward_mixer_stats() -> list:
    """:class:`~cp_attention.strategies.mixer_exchange.MixerStats` of every sequence-mixer call
    (convolution halos, recurrence states) of the most recent ``cp_flash`` model forward inside a
    ``context_parallel`` block in this thread, in call order (recomputations by gradient
    checkpointing are not counted again)."""
    return list(getattr(FORWARD, "mixers", []))


def note_mixer(stats) -> None:
    """Report a mixer call's traffic to :func:`forward_mixer_stats` (outside a recomputation)."""
    if not in_backward():
        if not hasattr(FORWARD, "mixers"):
            FORWARD.mixers = []
        FORWARD.mixers.append(stats)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s across ranks: received %d B (%d %s), sent %d B", stats.kind, stats.bytes_recv,
                  stats.tokens_recv, "halo tokens" if stats.kind == "convolution" else "piece states",
                  stats.bytes_sent)


def begin_mixers() -> None:
    """Start a model forward's :func:`forward_mixer_stats` (the model check, when a cp_flash model's
    forward starts inside a context)."""
    FORWARD.mixers = []


def begin_forward() -> None:
    """Mark the start of a model forward for :func:`forward_plan_stats` (the integration's mask
    function and the single-device op's first layer call it); a no-op until a layer of the previous
    forward has run."""
    if getattr(FORWARD, "layer_ran", True):
        FORWARD.calls, FORWARD.layer_ran = [], False


def note_stats(stats: PlanStats, layer: int | None = None, in_model: bool = False) -> None:
    """Report a call's plan to :func:`last_plan_stats` and, for a model layer (``in_model``) outside
    a backward recomputation, to :func:`forward_plan_stats`."""
    with STATS_LOCK:
        STATS["last"] = stats
    if in_model and not in_backward():
        if not hasattr(FORWARD, "calls"):
            FORWARD.calls = []
        FORWARD.calls.append((layer, stats))
        FORWARD.layer_ran = True
    if log.isEnabledFor(logging.DEBUG):
        log.debug("attention call%s (%s%s): %d kernel calls, %s sent %d B / received %d B in %d rounds, backward %d B",
                  "" if layer is None else f" (layer {layer})", strategy_label(stats), predicted_label(stats),
                  stats.kernel_calls, {"ring": "K/V", "ulysses": "q/k/v and outputs"}.get(
                      stats.strategy, "q/k/v, outputs and the ring's K/V"), stats.kv_bytes_sent,
                  stats.kv_bytes_recv, stats.rounds, stats.grad_bytes_sent)


def strategy_label(stats: PlanStats) -> str:
    """How the log names the strategy a plan runs."""
    return f"usp, head groups of {stats.ulysses_size}" if stats.strategy == "usp" else stats.strategy


def predicted_label(stats: PlanStats) -> str:
    """strategy="auto": every candidate's modeled forward+backward time ("" otherwise)."""
    if not stats.predicted:
        return ""
    return ", chosen by auto: modeled " + ", ".join(f"{name} {1e3 * t:.3g} ms" for name, t in stats.predicted)


def plan_stats(layout, rank: int, *, world_size: int | None = None, position_ids=None, cu_seqlens=None,
               seq_len: int | None = None, causal: bool = True, window: int | None = None,
               chunk_size: int | None = None, head_kv: int, head_dim: int, dtype=torch.bfloat16) -> PlanStats:
    """The :class:`~cp_attention.plan.PlanStats` of ``rank`` for a batch and one attention mask under
    ``layout`` (a name, with ``world_size``, or a :class:`~cp_attention.layout.Layout`), without a
    process group: traffic, rounds, kernel calls and visible pairs, from the pure planner.

    ``position_ids`` (B, L) or (L,), or ``cu_seqlens`` (N+1,), or ``seq_len`` describe the batch."""
    from ..layout.layouts import as_layout

    layout = as_layout(layout)
    meta = SequenceMeta.of_batch(position_ids=position_ids, cu_seqlens=cu_seqlens, seq_len=seq_len,
                                 caller="plan_stats")
    world_size = getattr(layout, "world_size", world_size)
    if world_size is None:
        raise ValueError("plan_stats: a layout name needs world_size")
    spec = MaskSpec(causal=causal, window=window, chunk_size=chunk_size)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return build_plan(meta, spec, world_size=world_size, layout=layout, rank=rank, head_kv=head_kv,
                      head_dim=head_dim, itemsize=itemsize).stats


@dataclass(frozen=True)
class PlanningStats:
    """Where one context's plans and batch layouts came from (:meth:`ContextParallel.planning_stats
    <cp_attention.ContextParallel.planning_stats>`): counts since the context was made. A step whose
    batch was prepared ahead (:meth:`~cp_attention.ContextParallel.prepare`) and that planned nothing
    itself adds to ``batches_prepared_found`` and ``plans_reused`` only."""

    batches_prepared: int = 0
    """``cp.prepare`` calls that finished (in any thread)."""
    plans_prepared: int = 0
    """Plans those calls built: one per distinct layer mask (and per key the calls will use)."""
    prepare_seconds: float = 0.0
    """Time those calls took, in total (off the step's critical path when run ahead)."""
    batches_prepared_found: int = 0
    """``cp.shard_batch`` calls that found their batch's documents and layout prepared (computed nothing)."""
    batches_computed: int = 0
    """``cp.shard_batch`` calls that computed the documents (and a balanced layout) on the step."""
    plans_reused: int = 0
    """Multi-rank calls whose agreement found this rank's plan cached on every rank (prepared, or built
    by an earlier call on the same documents): no planning on the step."""
    plans_built: int = 0
    """Multi-rank calls that built their plan on the step (on its critical path)."""
    prepared_misses: int = 0
    """Of ``plans_built``, those of a batch that was prepared: the masks, shapes, strategy or dtype
    prepared were not the call's (or a rank had not finished preparing). Each is also logged at INFO
    on the ``cp_attention.api`` logger, naming the call's mask and shapes."""


class PlanningCounter:
    """The thread-safe counts behind :class:`PlanningStats`, one per context (``cp.prepare`` may run in
    another thread than the step)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._counts = PlanningStats()

    def add(self, **deltas) -> None:
        """Add ``deltas`` (field name -> amount) to the counts."""
        with self._lock:
            self._counts = dataclasses.replace(
                self._counts, **{name: getattr(self._counts, name) + value for name, value in deltas.items()})

    def snapshot(self) -> PlanningStats:
        with self._lock:
            return self._counts
