"""All-to-all head parallelism ("Ulysses"): each rank attends over the whole sequence for a share
of the heads.

Each rank holds ``L_r`` tokens (its layout's) of all ``H`` query and ``K`` K/V heads. One
all-to-all gives rank ``j`` every rank's tokens of its query heads ``[j h, (j+1) h)`` (``h = H /
P``) and of the K/V heads those use, reassembled in global token order for any layout; the rank
then runs single-device attention over the whole sequence with the full mask (documents,
windows, chunks, softcap and its heads' sinks: exactly what one device computes for those heads);
a second all-to-all returns each rank's tokens of every head. The backward runs the reverse
exchanges.

K/V heads (:func:`head_split`): rank ``j`` receives the distinct K/V heads its query heads use,
no more: a head whose GQA group spans two ranks' query heads (``P > K``, or ``K`` not a multiple
of ``P``) goes to both, and the gradients of its copies are summed on its owner. Locally, a
received head is repeated (a view) to as many kernel K/V heads as its query heads need, so that
each kernel K/V head serves ``gcd(H / K, H / P)`` query heads. ``H`` must be a multiple of ``P``.

Bytes rank ``r`` sends per layer, forward: ``L_r (h D + k_j (D + Dv))`` to each other rank ``j``
(``k_j`` the K/V heads ``j`` uses), then ``L_j h Dv`` back to each rank ``j`` (times ``B`` and the item size; the
backward moves the same bytes the other way): independent of the mask, and every rank computes
the same share of the work whatever the layout (:func:`ulysses_stats`).

The 2-D split (strategy "usp", :class:`Grid`): the same exchanges within head groups of ``u``
consecutive ranks (``h = H / u``), each member then holding its head group's tokens (every member's
shard, in global order: :class:`_TokenMap`) of its heads; instead of attending alone, the members
with the same index in their head groups run the ring over those tokens (the ring's layout:
:meth:`Grid.ring_layout`), moving only the K/V the mask needs, with the received K/V heads
repeated to the kernel's before the ring. ``u = P``: plain head parallelism (one head group, the
ring of one rank is single-device attention).

Legend: ``B`` batch, ``L`` global length, ``L_r`` rank r's tokens, ``H``/``K`` query/KV heads,
``h`` query heads per rank, ``D``/``Dv`` head dims, ``u`` ranks per head group.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from .. import layout as layout_mod
from ..comm import Comm, SubComm
from ..masks import accumulation_dtype
from ..plan import PlanStats, RankPlan, build_plan
from ..plan.ranks import RankRuns, rank_runs
from .latent import LatentKV, latent_ring_attention
from .ring import ring_attention, ring_backward, ring_forward

__all__ = ["Grid", "HeadSplit", "head_split", "UlyssesPlan", "build_ulysses_plan", "ulysses_attention",
           "ulysses_latent_attention", "latent_exchange_bytes", "ulysses_stats", "exchange_bytes"]


@dataclass(frozen=True)
class HeadSplit:
    """Which heads each of ``world_size`` ranks attends over: query heads ``q_range(r)``, the
    distinct K/V heads ``kv_range(r)`` those use (what the rank receives), and ``kv_slots[r]``: for
    each of the kernel's ``q_per_rank / group`` K/V heads, its K/V head (original index), so that
    local query head ``i`` uses kernel K/V head ``i // group``."""

    world_size: int
    heads: int
    kv_heads: int
    group: int
    kv_slots: tuple[tuple[int, ...], ...]

    @property
    def q_per_rank(self) -> int:
        return self.heads // self.world_size

    def q_range(self, rank: int) -> tuple[int, int]:
        h = self.q_per_rank
        return rank * h, (rank + 1) * h

    def kv_range(self, rank: int) -> tuple[int, int]:
        """The K/V heads ``[first, end)`` rank ``rank``'s query heads use (consecutive: a run of
        query heads uses a run of GQA groups)."""
        return self.kv_slots[rank][0], self.kv_slots[rank][-1] + 1

    def kv_count(self, rank: int) -> int:
        first, end = self.kv_range(rank)
        return end - first

    @property
    def kv_sent(self) -> int:
        """K/V heads sent to all ranks together (>= ``kv_heads``: a head shared by two ranks' query
        heads goes to both)."""
        return sum(self.kv_count(r) for r in range(self.world_size))

    def repeats(self, rank: int) -> tuple[int, ...] | None:
        """How many kernel K/V heads each received head fills on ``rank`` (None: one each)."""
        slots = self.kv_slots[rank]
        first, end = self.kv_range(rank)
        counts = tuple(slots.count(kv) for kv in range(first, end))
        return None if all(c == 1 for c in counts) else counts


def head_split(heads: int, kv_heads: int, world_size: int) -> HeadSplit:
    """The head split of ``heads`` query and ``kv_heads`` K/V heads over ``world_size`` ranks.

    Raises ValueError when ``heads`` is not a multiple of ``world_size``."""
    if heads % world_size:
        raise ValueError(
            f"head parallelism splits the query heads over {world_size} ranks (strategy 'ulysses': the world; "
            f"'usp': a head group), but {heads} heads are not a multiple of {world_size}; use strategy='ring' (any "
            f"head count), 'auto', or a (head-group) size that divides {heads}")
    h = heads // world_size
    gqa = heads // kv_heads
    group = math.gcd(gqa, h)  # query heads per kernel K/V head on every rank (a divisor of both)
    kv_slots = tuple(tuple((r * h + m * group) // gqa for m in range(h // group)) for r in range(world_size))
    return HeadSplit(world_size=world_size, heads=heads, kv_heads=kv_heads, group=group, kv_slots=kv_slots)


@dataclass(frozen=True)
class Grid:
    """The 2-D split of ``world_size`` ranks used by strategy "usp": ``ulysses`` consecutive ranks
    form a head group (ranks ``g u .. g u + u - 1``: consecutive, so on one node under torchrun when
    ``u`` divides the ranks per node, as USP and Transformer Engine's ``a2a+p2p`` place the
    all-to-all), and the ``ring = P / u`` ranks with the same index in their head group form a ring
    group (ranks ``i, i + u, i + 2 u, ..``). ``ulysses = P``: plain head parallelism (one head
    group, rings of one rank); ``ulysses = 1``: the ring alone."""

    world_size: int
    ulysses: int

    def __post_init__(self) -> None:
        if not 1 <= self.ulysses <= self.world_size or self.world_size % self.ulysses:
            raise ValueError(
                f"ulysses_size={self.ulysses} must divide the world size {self.world_size} (the head-parallel "
                f"sub-group size; the rest of the ranks run the ring); valid: "
                f"{[u for u in range(1, self.world_size + 1) if self.world_size % u == 0]}")

    @property
    def ring(self) -> int:
        return self.world_size // self.ulysses

    def head_group(self, rank: int) -> tuple[int, ...]:
        """The ranks ``rank`` exchanges heads with (itself included), in head-group order."""
        g = rank // self.ulysses
        return tuple(range(g * self.ulysses, (g + 1) * self.ulysses))

    def ring_group(self, rank: int) -> tuple[int, ...]:
        """The ranks ``rank`` runs the ring with (itself included), in ring order."""
        return tuple(range(rank % self.ulysses, self.world_size, self.ulysses))

    def ring_layout(self, seq_len: int, layout) -> layout_mod.Layout:
        """The ring's layout: ring rank ``g`` holds every token of head group ``g`` (in increasing
        global order)."""
        name = getattr(layout, "name", layout)  # (a Layout's repr lists every rank: long at many ranks)
        return layout_mod.Layout.of_valid(seq_len, self.ring_runs(seq_len, layout).runs,
                                          name=f"{name} in head groups of {self.ulysses}")

    def ring_runs(self, seq_len: int, layout) -> RankRuns:
        """:meth:`ring_layout`'s runs (what strategy="auto" prices a candidate from); cached per layout."""
        return _ring_runs(self, seq_len, layout)


@functools.lru_cache(maxsize=16)
def _ring_runs(grid: Grid, seq_len: int, layout) -> RankRuns:
    """:meth:`Grid.ring_runs`: the runs of each head group's ranks, sorted, the touching ones joined
    (a valid layout's runs, so their union is one: not checked again)."""
    index = rank_runs(seq_len, grid.world_size, layout)
    group = index.rank // grid.ulysses
    order = np.lexsort((index.start, group))
    g, a, b = group[order], index.start[order], index.end[order]
    new = np.ones(len(a), dtype=bool)  # a run opens unless it continues the group's previous one
    new[1:] = (g[1:] != g[:-1]) | (a[1:] != b[:-1])
    first = np.flatnonzero(new)
    last = np.append(first[1:], len(a)) - 1
    return RankRuns.of_arrays(seq_len, grid.ring, g[first], a[first], b[last])


class _TokenMap:
    """Where each member of a head group's tokens sit among the group's tokens (increasing global
    order): ``pieces`` are ``(member, offset in the member's shard, offset in the group's, count)``."""

    def __init__(self, seq_len: int, world_size: int, layout, members: tuple[int, ...]):
        runs = []
        for m, r in enumerate(members):
            at = 0
            for a, b in layout_mod.rank_ranges(seq_len, world_size, layout, r):
                runs.append((a, m, at, b - a))
                at += b - a
        runs.sort()
        self.pieces, at = [], 0
        for _, m, off, n in runs:
            self.pieces.append((m, off, at, n))
            at += n
        self.sizes = [sum(n for mm, _, _, n in self.pieces if mm == m) for m in range(len(members))]
        self.length = at

    def gather(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Every member's shard (B, L_m, ...) -> the group's tokens (B, L_g, ...)."""
        return torch.cat([parts[m].narrow(1, off, n) for m, off, _, n in self.pieces], dim=1)

    def scatter(self, x: torch.Tensor, member: int) -> torch.Tensor:
        """The group's tokens (B, L_g, ...) -> ``member``'s shard (B, L_m, ...)."""
        parts = [x.narrow(1, at, n) for m, _, at, n in self.pieces if m == member]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


@dataclass(frozen=True, eq=False)
class UlyssesPlan:
    """One rank's head-parallel call (strategy "ulysses", or "usp": a :class:`Grid`): the split of
    the heads over the rank's head group, the token map of that group, the ring plan over the ring
    group (``ring``: of the head groups' tokens; with one head group, the single-device plan of the
    whole sequence, the same on every rank), and the call's statistics."""

    rank: int
    world_size: int
    grid: Grid
    split: HeadSplit
    tokens: _TokenMap
    ring: RankPlan
    stats: PlanStats
    exchanges: tuple = ()
    """Per head-group member ``j``: the bytes this rank sends to and receives from ``j`` in the
    exchange of q, k, v, then in the exchange of outputs (:func:`exchange_bytes`)."""


def exchange_bytes(split: HeadSplit, tokens: _TokenMap, me: int, batch: int, head_dim: int, head_dim_v: int,
                   itemsize: int) -> tuple[tuple[int, int, int, int], ...]:
    """Per member ``j`` of the head group: (sent, received) in the forward's exchange of q, k, v,
    then (sent, received) in its exchange of outputs, for member ``me`` (zeros for itself; the
    backward moves each the other way)."""
    sizes, h = tokens.sizes, split.q_per_rank

    def qkv(n: int, j: int) -> int:  # n tokens of member j's query heads and the K/V heads they use
        return n * batch * (h * head_dim + split.kv_count(j) * (head_dim + head_dim_v)) * itemsize

    def out(n: int) -> int:
        return n * batch * h * head_dim_v * itemsize

    return tuple((0, 0, 0, 0) if j == me else (qkv(sizes[me], j), qkv(sizes[j], me), out(sizes[j]), out(sizes[me]))
                 for j in range(len(sizes)))


def latent_exchange_bytes(split: HeadSplit, tokens: _TokenMap, me: int, batch: int, head_dim: int, latent_dim: int,
                          itemsize: int) -> tuple[int, int]:
    """(sent, received) by member ``me`` in the forward's exchange of q and latent rows
    (:func:`ulysses_latent_attention`): each member's tokens of the query heads of ``j`` and their latent rows
    (the backward moves as many the other way)."""
    sizes, h = tokens.sizes, split.q_per_rank

    def row(n: int) -> int:
        return n * batch * (h * head_dim + latent_dim) * itemsize

    others = [j for j in range(len(sizes)) if j != me]
    return sum(row(sizes[me]) for _ in others), sum(row(sizes[j]) for j in others)


def ulysses_stats(grid: Grid, split: HeadSplit, tokens: _TokenMap, ring: RankPlan, rank: int, batch: int,
                  head_dim: int, head_dim_v: int, itemsize: int) -> PlanStats:
    """This rank's traffic (the two exchanges with its head group, then its ring's K/V; the
    backward moves the exchanges' bytes back and the ring's as the ring does) and its share of the
    work: its ring rank's entries (one set of heads) split evenly over the head group (each member
    computes ``h`` of the ``H`` heads), the shares adding up exactly."""
    u, me = grid.ulysses, rank % grid.ulysses
    others = [j for j in range(u) if j != me]
    per_peer = exchange_bytes(split, tokens, me, batch, head_dim, head_dim_v, itemsize)
    sent = sum(x[0] + x[2] for x in per_peer)
    recv = sum(x[1] + x[3] for x in per_peer)
    rs = ring.stats

    def share(total: int) -> int:
        return total * (me + 1) // u - total * me // u

    head_group, ring_group = grid.head_group(rank), grid.ring_group(rank)
    return PlanStats(
        rank=rank, world_size=grid.world_size, kernel_calls=rs.kernel_calls,
        rounds=(2 if u > 1 else 0) + rs.rounds,
        peers_recv=tuple(head_group[j] for j in others) + tuple(ring_group[p] for p in rs.peers_recv),
        peers_send=tuple(head_group[j] for j in others) + tuple(ring_group[p] for p in rs.peers_send),
        kv_bytes_recv=recv + rs.kv_bytes_recv, kv_bytes_sent=sent + rs.kv_bytes_sent,
        grad_bytes_recv=sent + rs.grad_bytes_recv, grad_bytes_sent=recv + rs.grad_bytes_sent,
        ring_kv_bytes_recv=rs.ring_kv_bytes_recv, entries_computed=share(rs.entries_computed),
        entries_visible=share(rs.entries_visible), strategy="ulysses" if grid.ring == 1 else "usp",
        ulysses_size=u)


def build_ulysses_plan(meta, spec, *, grid: Grid, layout, rank: int, heads: int, kv_heads: int, head_dim: int,
                       head_dim_v: int, itemsize: int, ring: RankPlan | None = None) -> UlyssesPlan:
    """``rank``'s head-parallel plan (a pure function of global metadata, like :func:`build_plan`):
    the head split over its head group, and the ring plan of its ring group over the head groups'
    tokens, with the kernel's K/V heads (each serving ``split.group`` query heads). ``ring``: that
    ring plan when already built for another member of the head group (it is the same for all)."""
    split = head_split(heads, kv_heads, grid.ulysses)
    tokens = _TokenMap(meta.seq_len, grid.world_size, layout, grid.head_group(rank))
    if ring is None:
        ring_layout = "contiguous" if grid.ring == 1 else grid.ring_layout(meta.seq_len, layout)
        ring = build_plan(meta, spec.for_planning(), world_size=grid.ring, layout=ring_layout,
                          rank=rank // grid.ulysses, head_kv=split.q_per_rank // split.group, head_dim=head_dim,
                          head_dim_v=head_dim_v, itemsize=itemsize)
    dims = (meta.batch, head_dim, head_dim_v, itemsize)
    return UlyssesPlan(rank=rank, world_size=grid.world_size, grid=grid, split=split, tokens=tokens, ring=ring,
                       stats=ulysses_stats(grid, split, tokens, ring, rank, *dims),
                       exchanges=exchange_bytes(split, tokens, rank % grid.ulysses, *dims))


# ----------------------------------------------------------------------------------------------
# the two exchanges


def _to_heads(comm, tokens: _TokenMap, xs: list[torch.Tensor], pick) -> list[torch.Tensor]:
    """Every head-group member's tokens of this rank's heads: ``xs`` are this rank's (B, L_r, N, D)
    tensors, ``pick(x_index, j)`` the heads (a slice) member ``j`` takes of ``xs[x_index]``; returns,
    per x, the group's tokens (B, L_g, n, D) of the heads this rank picks, in global token order."""
    P, me = comm.world_size, comm.rank
    sizes = tokens.sizes
    B = xs[0].shape[0]
    dtype, device = xs[0].dtype, xs[0].device

    def message(j: int) -> torch.Tensor:
        return torch.cat([x[:, :, pick(i, j)].reshape(-1) for i, x in enumerate(xs)])

    shapes = [(x[:, :, pick(i, me)].shape[2], x.shape[3]) for i, x in enumerate(xs)]
    per_token = sum(n * d for n, d in shapes)
    sends = [message(j) if j != me else None for j in range(P)]
    recvs = [torch.empty(B * sizes[j] * per_token, dtype=dtype, device=device) if j != me else None
             for j in range(P)]
    comm.all_to_all(sends, recvs, "an all-to-all of q, k, v (head parallelism)")
    full = []
    offsets = [0] * P
    for i, (n, d) in enumerate(shapes):
        parts = []
        for j in range(P):
            if j == me:  # this rank's own share: a view of its input, no copy
                parts.append(xs[i][:, :, pick(i, me)])
                continue
            count = B * sizes[j] * n * d
            parts.append(recvs[j][offsets[j]:offsets[j] + count].view(B, sizes[j], n, d))
            offsets[j] += count
        full.append(tokens.gather(parts))
    return full


def _to_tokens(comm, tokens: _TokenMap, xs: list[torch.Tensor], widths) -> list[list[torch.Tensor]]:
    """The reverse: ``xs`` are the group's tokens (B, L_g, n, D) of this rank's heads; ``widths(i,
    j)`` the heads member ``j`` holds of ``xs[i]``; returns, per x, the list over members ``j`` of
    this rank's tokens (B, L_me, widths(i, j), D) of member ``j``'s heads."""
    P, me = comm.world_size, comm.rank
    sizes = tokens.sizes
    B = xs[0].shape[0]

    def message(j: int) -> torch.Tensor:
        return torch.cat([tokens.scatter(x, j).reshape(-1) for x in xs])

    def count(i: int, j: int) -> int:
        return B * sizes[me] * widths(i, j) * xs[i].shape[3]

    sends = [message(j) if j != me else None for j in range(P)]
    recvs = [torch.empty(sum(count(i, j) for i in range(len(xs))), dtype=xs[0].dtype, device=xs[0].device)
             if j != me else None for j in range(P)]
    comm.all_to_all(sends, recvs, "an all-to-all of attention outputs (head parallelism)")
    out: list[list[torch.Tensor]] = [[] for _ in xs]
    for j in range(P):
        at = 0
        for i, x in enumerate(xs):
            if j == me:  # this rank's own share: a view, no copy
                out[i].append(tokens.scatter(x, me))
                continue
            out[i].append(recvs[j][at:at + count(i, j)].view(B, sizes[me], widths(i, j), x.shape[3]))
            at += count(i, j)
    return out


class _Exchange:
    """What both exchanges of one call need (bound to that call): slices only, no device tensor."""

    def __init__(self, plan: UlyssesPlan, comm):
        self.plan, self.comm = plan, comm  # comm: the rank's head group
        split = plan.split
        self.q_pick = [slice(*split.q_range(j)) for j in range(split.world_size)]
        self.kv_pick = [slice(*split.kv_range(j)) for j in range(split.world_size)]

    def width(self, i: int, j: int) -> int:
        """Heads rank ``j`` holds of q (``i == 0``) or of k and v."""
        return self.plan.split.q_per_rank if i == 0 else self.plan.split.kv_count(j)


class _ToHeads(torch.autograd.Function):
    """(q, k, v) of this rank's tokens, all heads -> its head group's tokens of this rank's heads
    (its query heads and the distinct K/V heads they use)."""

    @staticmethod
    def forward(ctx, q, k, v, ex: _Exchange):
        with ex.comm.reporting("head-parallel attention forward"):
            ctx.ex, ctx.kv_heads = ex, k.shape[2]
            return tuple(_to_heads(ex.comm, ex.plan.tokens, [q, k, v],
                                   lambda i, j: ex.q_pick[j] if i == 0 else ex.kv_pick[j]))

    @staticmethod
    def backward(ctx, dq_full, dk_full, dv_full):
        ex = ctx.ex
        with ex.comm.reporting("head-parallel attention backward"):
            return (*_grads_to_tokens(ex, ctx.kv_heads, dq_full, dk_full, dv_full), None)


def _grads_to_tokens(ex: _Exchange, kv_heads: int, dq_full, dk_full, dv_full):
    """The backward of the exchange to heads: the group's tokens' dq/dk/dv of this rank's heads ->
    this rank's tokens, all heads (dK/dV of a K/V head two ranks use add up)."""
    grads = [g.contiguous() for g in (dq_full, dk_full, dv_full)]
    dq_parts, dk_parts, dv_parts = _to_tokens(ex.comm, ex.plan.tokens, grads, ex.width)
    dq = torch.cat(dq_parts, dim=2)
    acc = accumulation_dtype(dk_full.dtype)
    B, L_me = dq.shape[:2]
    dk = torch.zeros(B, L_me, kv_heads, dk_full.shape[3], dtype=acc, device=dq.device)
    dv = torch.zeros(B, L_me, kv_heads, dv_full.shape[3], dtype=acc, device=dq.device)
    for j, (gk, gv) in enumerate(zip(dk_parts, dv_parts)):  # a head two ranks use: both parts add up
        dk[:, :, ex.kv_pick[j]] += gk.to(acc)
        dv[:, :, ex.kv_pick[j]] += gv.to(acc)
    return dq, dk.to(dk_full.dtype), dv.to(dv_full.dtype)


class _ToTokens(torch.autograd.Function):
    """The head group's tokens of this rank's heads -> this rank's tokens, all heads."""

    @staticmethod
    def forward(ctx, out_full, ex: _Exchange):
        with ex.comm.reporting("head-parallel attention forward"):
            ctx.ex = ex
            return torch.cat(_to_tokens(ex.comm, ex.plan.tokens, [out_full.contiguous()], ex.width)[0], dim=2)

    @staticmethod
    def backward(ctx, dout):
        ex = ctx.ex
        with ex.comm.reporting("head-parallel attention backward"):
            full = _to_heads(ex.comm, ex.plan.tokens, [dout.contiguous()], lambda i, j: ex.q_pick[j])
            return full[0], None


class _LatentToHeads(torch.autograd.Function):
    """q of this rank's tokens, all heads, and its latent rows (B, L_r, R) -> the head group's tokens of this
    rank's query heads, and every member's latent rows (B, L_g, R), gathered once (every head reads them);
    backward: dq back to the tokens' ranks, each row's gradient summed over the members that read it."""

    @staticmethod
    def forward(ctx, q, latent_BLR, ex: _Exchange):
        with ex.comm.reporting("head-parallel attention forward"):
            ctx.ex = ex
            q_g, latent_g = _to_heads(ex.comm, ex.plan.tokens, [q, latent_BLR.unsqueeze(2)],
                                      lambda i, j: ex.q_pick[j] if i == 0 else slice(0, 1))
            return q_g, latent_g.squeeze(2)

    @staticmethod
    def backward(ctx, dq_g, dlatent_g):
        ex = ctx.ex
        with ex.comm.reporting("head-parallel attention backward"):
            dq_parts, dlatent_parts = _to_tokens(
                ex.comm, ex.plan.tokens, [dq_g.contiguous(), dlatent_g.unsqueeze(2).contiguous()],
                lambda i, j: ex.plan.split.q_per_rank if i == 0 else 1)
            acc = accumulation_dtype(dlatent_g.dtype)
            dlatent = torch.stack([p.to(acc) for p in dlatent_parts]).sum(0)  # every member read every row
            return torch.cat(dq_parts, dim=2), dlatent.squeeze(2).to(dlatent_g.dtype), None


def ulysses_latent_attention(q, latent: LatentKV, sinks, plan: UlyssesPlan, comm: Comm, backend, *, scale: float,
                             softcap: float | None, counts: dict | None = None) -> torch.Tensor:
    """:func:`ulysses_attention` of a multi-head latent attention layer whose latent rows travel instead of its
    K/V heads: q (B, L_r, H, D) and ``latent.latent`` (B, L_r, R) of this rank's tokens, sinks (H,) or None ->
    out (B, L_r, H, Dv). One all-to-all gives each rank its head group's tokens of its query heads and every
    member's latent rows; it expands them with the layer's expansion and keeps the K/V heads its query heads
    use; under "usp" the ring over the head groups moves the groups' latent rows too
    (:func:`~cp_attention.strategies.latent.latent_ring_attention`; ``counts``: its bytes). Differentiable
    w.r.t. q, sinks, the latent rows and the expansion's parameters (the layer's own k and v are not read)."""
    grid = plan.grid
    one_group = grid.ring == 1
    heads = comm if one_group else SubComm(comm, grid.head_group(comm.rank))
    ex = _Exchange(plan, heads)
    q_g, latent_g = _LatentToHeads.apply(q, latent.latent, ex)
    mine = slice(*plan.split.kv_range(heads.rank))

    def expand_mine(rows_BWR: torch.Tensor):
        k_all, v_all = latent.expand(rows_BWR)  # copies: the other heads' keys and values are not kept
        return k_all[:, :, mine].contiguous(), v_all[:, :, mine].contiguous()

    k_g, v_g = expand_mine(latent_g)
    repeats = plan.split.repeats(heads.rank)
    lo, hi = plan.split.q_range(heads.rank)
    sinks_g = None if sinks is None else sinks[lo:hi]
    ring_comm = comm if one_group else SubComm(comm, grid.ring_group(comm.rank))
    if one_group or repeats is not None:
        out_g = ring_attention(q_g, _expand(k_g, repeats), _expand(v_g, repeats), sinks_g, plan.ring, ring_comm,
                               backend, scale=scale, softcap=softcap)
    else:
        out_g = latent_ring_attention(q_g, k_g, v_g, sinks_g, LatentKV(latent_g, expand_mine, latent.params),
                                      plan.ring, ring_comm, backend, scale=scale, softcap=softcap, counts=counts)
    return _ToTokens.apply(out_g, ex)


def _expand(x: torch.Tensor, repeats: tuple[int, ...] | None) -> torch.Tensor:
    """(B, L, n, D) -> (B, L, sum(repeats), D), head ``i`` repeated ``repeats[i]`` times (views and
    one cat: its backward sums the copies deterministically)."""
    if repeats is None:
        return x
    B, L, _, D = x.shape
    return torch.cat([x[:, :, i:i + 1].expand(B, L, c, D) for i, c in enumerate(repeats)], dim=2)


def _unexpand(g: torch.Tensor, repeats: tuple[int, ...] | None) -> torch.Tensor:
    """The backward of :func:`_expand`: (B, L, sum(repeats), D) -> (B, L, n, D), copies summed."""
    if repeats is None:
        return g
    starts = [0]
    for c in repeats:
        starts.append(starts[-1] + c)
    return torch.stack([g[:, :, a:b].sum(2) for a, b in zip(starts[:-1], starts[1:])], dim=2)


class _Run(NamedTuple):
    """What both passes of one call without autograd need: the exchange, the head group's and the
    ring group's comms, this rank's K/V head repeats and its query heads ``[lo, hi)``."""

    ex: _Exchange
    ring_comm: Comm
    repeats: tuple[int, ...] | None
    lo: int
    hi: int


def _run_of(plan: UlyssesPlan, comm: Comm) -> _Run:
    grid = plan.grid
    one_group = grid.ring == 1
    heads = comm if one_group else SubComm(comm, grid.head_group(comm.rank))
    lo, hi = plan.split.q_range(heads.rank)
    return _Run(_Exchange(plan, heads), comm if one_group else SubComm(comm, grid.ring_group(comm.rank)),
                plan.split.repeats(heads.rank), lo, hi)


def _lse_BLH1(lse_HT: torch.Tensor, B: int) -> torch.Tensor:
    """(H, B * L) -> (B, L, H, 1), the layout the exchanges move."""
    return lse_HT.t().reshape(B, -1, lse_HT.shape[0], 1).contiguous()


def ulysses_forward(q, k, v, sinks, plan: UlyssesPlan, comm: Comm, backend, *, scale: float,
                    softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ulysses_attention`'s forward without autograd -> out (B, L_r, H, Dv) and lse (H, B * L_r)
    of this rank's tokens (float32; float64 for float64 inputs), for :func:`ulysses_backward`. One
    all-to-all more than the autograd path: the lse back to the tokens' ranks."""
    run = _run_of(plan, comm)
    ex = run.ex
    q_g, k_g, v_g = _to_heads(ex.comm, plan.tokens, [q, k, v], lambda i, j: ex.q_pick[j] if i == 0 else ex.kv_pick[j])
    out_g, lse_g = ring_forward(q_g, _expand(k_g, run.repeats), _expand(v_g, run.repeats),
                                None if sinks is None else sinks[run.lo:run.hi], plan.ring, run.ring_comm, backend,
                                scale=scale, softcap=softcap)
    out = torch.cat(_to_tokens(ex.comm, plan.tokens, [out_g.contiguous()], ex.width)[0], dim=2)
    lse = torch.cat(_to_tokens(ex.comm, plan.tokens, [_lse_BLH1(lse_g, q.shape[0])], ex.width)[0], dim=2)
    return out, lse.reshape(-1, q.shape[2]).t().contiguous()


def ulysses_backward(dout, q, k, v, out, lse_HT, sinks, plan: UlyssesPlan, comm: Comm, backend, *, scale: float,
                     softcap: float | None, need_dsinks: bool):
    """:func:`ulysses_forward`'s backward -> (dq, dk, dv, dsinks) like :func:`~cp_attention.strategies.ring.ring_backward`;
    dsinks (H,) holds this rank's query heads' part (zeros elsewhere), as the autograd path gives.
    Moves q, k, v, dout, out and lse to the heads again (the forward kept none of the group's tokens)."""
    run = _run_of(plan, comm)
    ex = run.ex
    q_g, k_g, v_g = _to_heads(ex.comm, plan.tokens, [q, k, v], lambda i, j: ex.q_pick[j] if i == 0 else ex.kv_pick[j])
    dout_g, out_g = _to_heads(ex.comm, plan.tokens, [dout.contiguous(), out.contiguous()], lambda i, j: ex.q_pick[j])
    lse_g, = _to_heads(ex.comm, plan.tokens, [_lse_BLH1(lse_HT, q.shape[0])], lambda i, j: ex.q_pick[j])
    dq_g, dk_e, dv_e, dsinks_g = ring_backward(
        dout_g, q_g, _expand(k_g, run.repeats), _expand(v_g, run.repeats), out_g,
        lse_g.reshape(-1, run.hi - run.lo).t().contiguous(), None if sinks is None else sinks[run.lo:run.hi],
        plan.ring, run.ring_comm, backend, scale=scale, softcap=softcap, need_dsinks=need_dsinks)
    dq, dk, dv = _grads_to_tokens(ex, k.shape[2], dq_g, _unexpand(dk_e, run.repeats), _unexpand(dv_e, run.repeats))
    dsinks = None
    if dsinks_g is not None:
        dsinks = torch.zeros_like(sinks)
        dsinks[run.lo:run.hi] = dsinks_g
    return dq, dk, dv, dsinks


def ulysses_attention(q, k, v, sinks, plan: UlyssesPlan, comm: Comm, backend, *, scale: float,
                      softcap: float | None) -> torch.Tensor:
    """Head-parallel attention of this rank's shard (strategy "ulysses", or "usp" with the ring over
    the head groups): q (B, L_r, H, D), k (B, L_r, K, D), v (B, L_r, K, Dv), sinks (H,) or None ->
    out (B, L_r, H, Dv). Differentiable w.r.t. q, k, v and sinks."""
    grid = plan.grid
    one_group = grid.ring == 1
    heads = comm if one_group else SubComm(comm, grid.head_group(comm.rank))
    ex = _Exchange(plan, heads)
    q_g, k_g, v_g = _ToHeads.apply(q, k, v, ex)
    repeats = plan.split.repeats(heads.rank)
    lo, hi = plan.split.q_range(heads.rank)
    # one head group: the whole sequence on this rank, a plan of one rank run with the group's comm
    # (no exchange; a failure is reported to the group, so the peers waiting in an exchange name
    # this rank); several: the ring over the rank's ring group, of the head groups' tokens
    out_g = ring_attention(q_g, _expand(k_g, repeats), _expand(v_g, repeats),
                           None if sinks is None else sinks[lo:hi], plan.ring,
                           comm if one_group else SubComm(comm, grid.ring_group(comm.rank)), backend, scale=scale,
                           softcap=softcap)
    return _ToTokens.apply(out_g, ex)
