"""Which strategy runs a multi-rank attention call, and the cost model behind ``strategy="auto"``.

The strategies (every one computes exactly what one device computes; they differ in what moves):

* ``"ring"``: K/V move between the ranks' token shards, only the spans the mask needs (the halo of
  a window); the work per rank follows the layout.
* ``"ulysses"``: two all-to-alls over the heads around single-device attention over the whole
  sequence; bytes independent of the mask, work balanced whatever the layout. Needs ``H % P == 0``.
* ``"usp"`` with ``ulysses_size=u``: all-to-all in head groups of ``u`` consecutive ranks, the ring
  over the ``P / u`` head groups (:class:`cp_attention.strategies.ulysses.Grid`). Needs ``P % u == 0`` and
  ``H % u == 0``.
* ``"auto"``: per attention call (each distinct layer mask of a batch: the choice is cached with the
  plan), the candidate of :func:`candidates` with the lowest modeled time (:class:`CostModel`).

The model, per layer, forward plus backward, of rank ``r`` (the layer takes its slowest rank's time):

    compute_r  = entries_r x H x 2 (D + Dv) x (1 + backward) / throughput
    a2a_r      = sum over the 2 all-to-alls, forward and backward, of move_r(exchange)     (blocking)
    ring_r     = sum over the ring's rounds of move_r(K/V) twice + move_r(dK/dV back)     (overlapped)
    time_r     = a2a_r + max(compute_r, ring_r) + rounds_r x 2 x latency

    move_r(exchange) = max over sending and receiving (full duplex) of
                       max(bytes with peers on r's node / bandwidth,
                           bytes with peers on other nodes / inter_node_bandwidth)

``entries_r``: the score entries rank ``r``'s kernels compute (tiles of rows x the keys they see,
:attr:`PlanStats.entries_computed`) for one head, normalised to all ``H`` heads (under head
parallelism the rank computes its head group's tokens for ``H / u`` heads), so the layout's balance
is in it. Bytes are counted per exchange and per peer: in each all-to-all what the rank sends to and
receives from each member of its head group (replicated K/V heads included); in each ring round the
K/V it sends and receives (twice: the backward moves them again) and the float32 dK/dV partial sums
going back. Nodes: ``ranks_per_node`` consecutive ranks of the context-parallel group share one
(torchrun's placement when the group is the innermost dimension of the job; for a group that
strides across nodes, describe it with ``ranks_per_node=1``). ``auto`` is exact by construction (whatever it picks
computes the same numbers); the model only decides speed. Override it per context:
``context_parallel(strategy="auto", cost_model=CostModel(bandwidth=..., ...))``; every rank must use
the same model (the agreement checks it).
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from dataclasses import dataclass

from types import MappingProxyType
from typing import Callable, Mapping

from .. import layout as layout_mod
from ..masks import MaskSpec, SequenceMeta
from ..quiet_gc import paused_gc
from ..plan import PlanStats, RankPlan, build_plan
from ..plan.ranks import rank_runs
from .pricing import candidate_time
from .latent import head_parallel_latent_form, latent_form, latent_ring_attention, latent_stats
from .ring import ring_attention, ring_backward, ring_forward
from .ulysses import (Grid, UlyssesPlan, build_ulysses_plan, latent_exchange_bytes, ulysses_attention,
                      ulysses_backward, ulysses_forward, ulysses_latent_attention)

__all__ = ["CostModel", "Candidate", "candidates", "fixed_candidate", "price", "rank_plans", "exchange_parts", "layer_time",
           "choose", "Executor", "EXECUTORS", "executor_of"]


@dataclass(frozen=True)
class CostModel:
    """The constants of ``strategy="auto"``'s model (see the module's docstring). The defaults
    describe one node of 8 H100/H200-class GPUs on NVLink with InfiniBand between nodes:

    ``bandwidth``: bytes per second one rank moves in each direction to peers on its node;
    ``inter_node_bandwidth``: the same to peers on other nodes; ``latency``: seconds per exchange
    round (posting and synchronisation); ``throughput``: attention FLOP/s of one device, counted on
    the computed score entries (:attr:`PlanStats.entries_computed`) of the forward;
    ``backward``: the backward's work as a multiple of the forward's; ``ranks_per_node``:
    consecutive ranks of the context-parallel group that share a node; ``overlap``: the ring's
    exchanges run under its compute (False: they add to it)."""

    bandwidth: float = 150e9
    inter_node_bandwidth: float = 25e9
    latency: float = 20e-6
    throughput: float = 400e12
    backward: float = 2.5
    ranks_per_node: int = 8
    overlap: bool = True

    def __post_init__(self) -> None:
        for name in ("bandwidth", "inter_node_bandwidth", "throughput"):
            if not getattr(self, name) > 0:
                raise ValueError(f"CostModel.{name} must be positive, got {getattr(self, name)!r}")
        if not (self.latency >= 0 and self.backward >= 0 and self.ranks_per_node >= 1):
            raise ValueError(f"CostModel: latency and backward must be >= 0 and ranks_per_node >= 1, got {self}")

    @functools.cached_property
    def crc(self) -> int:
        """A checksum of the constants (the agreement header's field: every rank must use one model)."""
        return zlib.crc32(repr(dataclasses.astuple(self)).encode()) & 0x7FFFFFFF

    def same_node(self, a: int, b: int) -> bool:
        """Whether ranks ``a`` and ``b`` of the context-parallel group share a node."""
        return a // self.ranks_per_node == b // self.ranks_per_node


@dataclass(frozen=True)
class Candidate:
    """One strategy for P ranks: ``ulysses`` ranks per head group (1: the ring; P: ulysses)."""

    world_size: int
    ulysses: int

    @property
    def name(self) -> str:
        if self.ulysses == 1:
            return "ring"
        return "ulysses" if self.ulysses == self.world_size else f"usp{self.ulysses}x{self.world_size // self.ulysses}"


def candidates(world_size: int, heads: int) -> list[Candidate]:
    """The strategies valid for ``heads`` query heads over ``world_size`` ranks: the ring, then
    every head-group size ``u`` dividing both (``u = P``: ulysses), smallest first."""
    return [Candidate(world_size, u) for u in range(1, world_size + 1) if world_size % u == 0 and heads % u == 0]


def rank_plans(meta: SequenceMeta, spec: MaskSpec, cand: Candidate, layout, *, heads: int, kv_heads: int,
               head_dim: int, head_dim_v: int, itemsize: int, ranks=None) -> dict:
    """``{rank: plan}`` of ``cand`` for ``ranks`` (None: every rank); a head group shares one ring plan."""
    P = cand.world_size
    ranks = range(P) if ranks is None else ranks
    if cand.ulysses == 1:
        return {r: build_plan(meta, spec.for_planning(), world_size=P, layout=layout, rank=r, head_kv=kv_heads,
                              head_dim=head_dim, head_dim_v=head_dim_v, itemsize=itemsize) for r in ranks}
    grid = Grid(P, cand.ulysses)
    plans, rings = {}, {}
    for r in ranks:
        plans[r] = build_ulysses_plan(meta, spec, grid=grid, layout=layout, rank=r, heads=heads, kv_heads=kv_heads,
                                      head_dim=head_dim, head_dim_v=head_dim_v, itemsize=itemsize,
                                      ring=rings.get(r // cand.ulysses))
        rings[r // cand.ulysses] = plans[r].ring
    return plans


def exchange_parts(plan) -> tuple[PlanStats | None, PlanStats]:
    """(the head exchanges' stats, the ring's stats) of a plan: the exchanges' bytes are the plan's
    less its ring's."""
    if isinstance(plan, RankPlan):
        return None, plan.stats
    return plan.stats, plan.ring.stats


def _moving(model: CostModel, me: int, sends, recvs) -> float:
    """Seconds of one exchange for rank ``me``: ``sends`` / ``recvs`` are (peer, bytes); the bytes to
    (from) peers on its node share ``bandwidth``, to (from) other nodes ``inter_node_bandwidth``,
    both at once; sending and receiving at once (full duplex)."""
    def side(pairs) -> float:
        near = sum(n for peer, n in pairs if model.same_node(me, peer))
        far = sum(n for peer, n in pairs if not model.same_node(me, peer))
        return max(near / model.bandwidth, far / model.inter_node_bandwidth)

    return max(side(sends), side(recvs))


def _ring_seconds(model: CostModel, ring: RankPlan, members, me: int) -> float:
    """The ring's exchanges, forward and backward, round by round: K/V forward, K/V again and the
    dK/dV partial sums back in the backward (``members``: the ring ranks' ranks in the group)."""
    rounds = [(rnd.recv.width if rnd.recv else 0, members[rnd.recv.source] if rnd.recv else None,
               sum(b - a for a, b in rnd.send_spans) if rnd.send_spans else 0,
               members[rnd.send_to] if rnd.send_to is not None else None) for rnd in ring.rounds]
    tokens = sum(n_in + n_out for n_in, _, n_out, _ in rounds)
    if not tokens:
        return 0.0
    st = ring.stats
    kv = (st.kv_bytes_recv + st.kv_bytes_sent) / tokens  # bytes per token: K and V, then their gradients
    grad = (st.grad_bytes_recv + st.grad_bytes_sent) / tokens
    total = 0.0
    for n_in, src, n_out, dst in rounds:
        sends = [(dst, n_out)] if dst is not None else []
        recvs = [(src, n_in)] if src is not None else []
        total += 2 * _moving(model, me, [(p, n * kv) for p, n in sends], [(p, n * kv) for p, n in recvs])
        total += _moving(model, me, [(p, n * grad) for p, n in recvs], [(p, n * grad) for p, n in sends])
    return total


def layer_time(model: CostModel, plans: dict, *, heads: int, head_dim: int, head_dim_v: int) -> float:
    """The modeled forward+backward seconds of one layer: its slowest rank's (module docstring)."""
    worst = 0.0
    for r, plan in plans.items():
        compute = (plan.stats.entries_computed * heads * 2 * (head_dim + head_dim_v) * (1 + model.backward)
                   / model.throughput)
        if isinstance(plan, UlyssesPlan):
            group = plan.grid.head_group(r)
            a2a = 0.0
            for first in (0, 2):  # the exchange of q, k, v, then of outputs; the backward moves each back
                a2a += 2 * _moving(model, r, [(group[j], x[first]) for j, x in enumerate(plan.exchanges)],
                                   [(group[j], x[first + 1]) for j, x in enumerate(plan.exchanges)])
            ring, members = plan.ring, plan.grid.ring_group(r)
        else:
            a2a, ring, members = 0.0, plan, range(plan.world_size)
        moving = _ring_seconds(model, ring, members, r)
        body = max(compute, moving) if model.overlap else compute + moving
        worst = max(worst, a2a + body + 2 * plan.stats.rounds * model.latency)
    return worst


@paused_gc
def choose(meta: SequenceMeta, spec: MaskSpec, layout, rank: int, world_size: int, model: CostModel, *, heads: int,
           kv_heads: int, head_dim: int, head_dim_v: int, itemsize: int):
    """``strategy="auto"``: ``rank``'s plan of the candidate with the lowest :func:`layer_time`
    (ties: the first of :func:`candidates`), its stats carrying every candidate's modeled time
    (``predicted``). A pure function of global metadata: every rank chooses the same.

    Each candidate is priced from the documents and the layout (:func:`price`); only the chosen
    candidate's plan of ``rank`` is built."""
    dims = dict(heads=heads, head_dim=head_dim, head_dim_v=head_dim_v)
    layout = _read_once(layout, meta.seq_len, world_size)
    best, times = price(meta, spec, layout, world_size, model, kv_heads=kv_heads, itemsize=itemsize, **dims)
    plan = rank_plans(meta, spec, best, layout, kv_heads=kv_heads, itemsize=itemsize, ranks=(rank,), **dims)[rank]
    return dataclasses.replace(plan, stats=dataclasses.replace(plan.stats, predicted=times))


@paused_gc
def price(meta: SequenceMeta, spec: MaskSpec, layout, world_size: int, model: CostModel, *, heads: int,
          kv_heads: int, head_dim: int, head_dim_v: int, itemsize: int) -> tuple[Candidate, tuple]:
    """``strategy="auto"``'s choice, without a plan: the :class:`Candidate` with the lowest modeled
    time (ties: the first of :func:`candidates`) and every candidate's ``(name, seconds)``. Each
    candidate is priced from the documents and the layout (:func:`~.pricing.candidate_time`: the
    value :func:`layer_time` gives for the plans of every rank, without building them)."""
    dims = dict(heads=heads, head_dim=head_dim, head_dim_v=head_dim_v)
    layout = _read_once(layout, meta.seq_len, world_size)
    best, times = None, []
    for cand in candidates(world_size, heads):
        t = candidate_time(meta, spec, cand, layout, model, kv_heads=kv_heads, itemsize=itemsize, **dims)
        times.append((cand.name, t))
        if best is None or t < best[0]:
            best = (t, cand)
    return best[1], tuple(times)


def _read_once(layout, seq_len: int, world_size: int):
    """``layout`` as a :class:`~cp_attention.layout.Layout` holding every rank's runs, read once for
    the many reads of one choice (a named layout answers ``rank_ranges`` in O(P) per rank); the
    plans do not depend on the layout's form, only on its runs."""
    lay = layout_mod.check_layout(layout)
    if isinstance(lay, layout_mod.Layout):
        return lay
    runs = rank_runs(seq_len, world_size, lay).runs
    return layout_mod.Layout(seq_len, runs, name=str(lay)) if all(runs) else lay


def fixed_candidate(strategy: str, ulysses_size: int | None, world_size: int, heads: int) -> Candidate | None:
    """The candidate a fixed strategy names (None for "auto"); ValueError when it does not fit
    ``heads`` query heads over ``world_size`` ranks."""
    if strategy == "auto":
        return None
    if strategy == "ring":
        return Candidate(world_size, 1)
    u = world_size if strategy == "ulysses" else ulysses_size
    if u is None:
        raise ValueError(f"strategy='usp' needs ulysses_size (the ranks of each head group), one of "
                         f"{[c.ulysses for c in candidates(world_size, heads)]} for {heads} heads over "
                         f"{world_size} ranks; or use strategy='auto'")
    Grid(world_size, u)  # ulysses_size must divide the world size
    if heads % u:
        raise ValueError(
            f"strategy={strategy!r} splits the {heads} query heads over head groups of {u} ranks, but {heads} is not a "
            f"multiple of {u}; valid ulysses_size for these heads: "
            f"{[c.ulysses for c in candidates(world_size, heads)]} "
            f"(1: the ring, any head count), or strategy='auto', which picks only valid ones")
    return Candidate(world_size, u)


# ----------------------------------------------------------------------------------------------
# from a plan to what runs it


@dataclass(frozen=True)
class Executor:
    """What runs a plan of one strategy, all with the arguments ``(q, k, v, sinks, plan, comm, backend,
    *, scale, softcap)``: ``attention`` (differentiable), ``forward`` -> (out, lse) and
    ``backward(dout, q, k, v, out, lse, sinks, plan, comm, backend, *, scale, softcap, need_dsinks)``
    -> (dq, dk, dv, dsinks), the passes without autograd (the compiled multi-rank op's). For a multi-head
    latent attention layer (:mod:`.latent`): ``latent_form(plan, k, v, latent_dim, cost_model)`` -> ("latent"
    or "heads", why), the same on every rank, and ``latent(q, k, v, sinks, latent, plan, comm, backend, *,
    scale, softcap)`` -> (out, the call's PlanStats), differentiable, with the latent rows travelling."""

    attention: Callable
    forward: Callable
    backward: Callable
    latent_form: Callable
    latent: Callable


def _ring_latent_form(plan: RankPlan, k, v, latent_dim: int, cost_model) -> tuple[str, str]:
    return latent_form(kv_heads=k.shape[2], head_dim=k.shape[3], head_dim_v=v.shape[3], latent_dim=latent_dim,
                       cost_model=cost_model)


def _ring_latent(q, k, v, sinks, latent, plan: RankPlan, comm, backend, *, scale, softcap):
    counts: dict = {}
    out = latent_ring_attention(q, k, v, sinks, latent, plan, comm, backend, scale=scale, softcap=softcap,
                                counts=counts)
    return out, latent_stats(plan.stats, plan, latent.latent.shape[-1], latent.latent.element_size(),
                             counts["sent"], counts["received"])


def _ulysses_latent_form(plan: UlyssesPlan, k, v, latent_dim: int, cost_model) -> tuple[str, str]:
    u = plan.grid.ulysses  # the fewest K/V heads a member receives: every member of a head group decides alike
    return head_parallel_latent_form(
        kv_heads=k.shape[2], kv_received=min(plan.split.kv_count(j) for j in range(u)), head_dim=k.shape[3],
        head_dim_v=v.shape[3], latent_dim=latent_dim, ulysses=u, cost_model=cost_model)


def _ulysses_latent(q, k, v, sinks, latent, plan: UlyssesPlan, comm, backend, *, scale, softcap):
    counts: dict = {}
    out = ulysses_latent_attention(q, latent, sinks, plan, comm, backend, scale=scale, softcap=softcap,
                                   counts=counts)
    R, itemsize = latent.latent.shape[-1], latent.latent.element_size()
    sent, received = latent_exchange_bytes(plan.split, plan.tokens, plan.rank % plan.grid.ulysses, q.shape[0],
                                           q.shape[3], R, itemsize)
    out_sent, out_received = sum(x[2] for x in plan.exchanges), sum(x[3] for x in plan.exchanges)
    ring = plan.ring.stats
    if counts:  # "usp": the ring over the head groups moved their latent rows
        ring = latent_stats(ring, plan.ring, R, itemsize, counts["sent"], counts["received"])
    return out, dataclasses.replace(
        plan.stats, kv_bytes_recv=received + out_received + ring.kv_bytes_recv,
        kv_bytes_sent=sent + out_sent + ring.kv_bytes_sent, grad_bytes_recv=sent + out_sent + ring.grad_bytes_recv,
        grad_bytes_sent=received + out_received + ring.grad_bytes_sent, kv_form="latent",
        heads_kv_bytes_recv=plan.stats.kv_bytes_recv, heads_kv_bytes_sent=plan.stats.kv_bytes_sent)


EXECUTORS: Mapping[type, Executor] = MappingProxyType({
    RankPlan: Executor(ring_attention, ring_forward, ring_backward, _ring_latent_form, _ring_latent),  # "ring"
    UlyssesPlan: Executor(ulysses_attention, ulysses_forward, ulysses_backward,  # "ulysses", "usp"
                          _ulysses_latent_form, _ulysses_latent),
})
"""The one table from the type of a plan (what :func:`choose` / :func:`rank_plans` build) to its executor."""


def executor_of(plan) -> Executor:
    """The :class:`Executor` of ``plan``'s strategy (:data:`EXECUTORS`)."""
    try:
        return EXECUTORS[type(plan)]
    except KeyError:
        raise TypeError(f"no executor for a plan of type {type(plan).__name__}: one of "
                        f"{[t.__name__ for t in EXECUTORS]} expected") from None
