"""What the sequence mixers' exchanges are made of (:mod:`.scan` plans and runs them): the geometry of
a sharded batch, which global tokens every rank holds and where each token's document starts
(:class:`Geometry`); the differentiable row exchange that moves a halo or a piece's state between
ranks (:func:`exchange`, reversed in the backward); the *pieces* a rank's tokens fall into, maximal
runs of consecutive global positions (one per rank for contiguous shards, two for zigzag, several
for a balanced layout; :func:`pieces_of`), and the tokens a convolution's taps read on other ranks
(:func:`foreign_needs`); the records a plan (:class:`HaloPlan`, :class:`ScanPlan`) and a mixer call
(:class:`MixerStats`) are kept in.

Legend: ``B`` rows, ``L`` global length, ``Lr`` this rank's tokens per row, ``k`` kernel, ``N``
stacked segments, ``n`` a segment's length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Geometry", "make_geometry", "exchange", "tie", "MixerStats", "HaloPlan", "foreign_needs", "Piece",
           "ScanPlan", "pieces_of"]


@dataclass(frozen=True, eq=False)
class Geometry:
    """Which global tokens every rank holds and where each token's document starts, for one batch."""

    world_size: int
    rank: int
    batch: int
    seq_len: int
    index: tuple[torch.Tensor, ...]
    """(L_r,) long per rank: the global positions of rank r's tokens, in its local order."""
    doc_start: torch.Tensor
    """(B, L) long: the global position where each token's document starts (padding tokens are
    one-token documents)."""
    owner: torch.Tensor
    """(L,) long: the rank holding each global position."""
    local: torch.Tensor
    """(L,) long: its place among that rank's tokens."""

    @property
    def local_len(self) -> int:
        return int(self.index[self.rank].numel())


def make_geometry(batch: int, seq_len: int, doc_start: torch.Tensor | None, index: list[torch.Tensor],
                  rank: int) -> Geometry:
    """A :class:`Geometry` from every rank's global positions (``index``) and ``doc_start`` (B, L)
    (None: one document per row)."""
    if doc_start is None:
        doc_start = torch.zeros(batch, seq_len, dtype=torch.long)
    doc_start = doc_start.to("cpu", torch.long).expand(batch, seq_len)
    index = tuple(i.to("cpu", torch.long) for i in index)
    owner = torch.full((seq_len,), -1, dtype=torch.long)
    local = torch.zeros(seq_len, dtype=torch.long)
    for r, idx in enumerate(index):
        owner[idx] = r
        local[idx] = torch.arange(idx.numel())
    if bool((owner < 0).any()):
        raise ValueError("the layout leaves global positions on no rank")
    return Geometry(world_size=len(index), rank=rank, batch=batch, seq_len=seq_len, index=index,
                    doc_start=doc_start, owner=owner, local=local)


# ----------------------------------------------------------------------------------------------
# the exchange


class _Exchange(torch.autograd.Function):
    """Send rows of ``rows`` to peers and receive theirs: ``send[j]`` are the row indices peer j
    gets, ``recv[j]`` how many rows come from it. Returns the received rows, peers in rank order.
    Backward sends the received rows' gradients back and sums them into the sent rows'."""

    @staticmethod
    def forward(ctx, rows, comm, send, recv, what):
        sends = [rows.index_select(0, idx) for idx in send]
        recvs = [rows.new_empty((n, *rows.shape[1:])) for n in recv]
        comm.all_to_all(sends, recvs, what)
        ctx.comm, ctx.send, ctx.recv, ctx.what, ctx.shape = comm, send, recv, what, rows.shape
        return torch.cat(recvs) if recvs else rows.new_empty((0, *rows.shape[1:]))

    @staticmethod
    def backward(ctx, grad):
        grads = [g.contiguous() for g in grad.split(list(ctx.recv))]
        back = [grad.new_empty((idx.numel(), *grad.shape[1:])) for idx in ctx.send]
        ctx.comm.all_to_all(grads, back, ctx.what + " (backward)")
        out = grad.new_zeros(ctx.shape)
        for idx, part in zip(ctx.send, back):
            if idx.numel():
                out.index_add_(0, idx.to(out.device), part)
        return out, None, None, None, None


class _Tie(torch.autograd.Function):
    """``a`` unchanged, with ``b`` in its graph (``b``'s gradient: zeros). Ties an exchange into the
    graph on every rank alike, so every rank runs the exchanges' backwards in the same order even
    where its own tokens do not use what arrived."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.b_shape, ctx.b_dtype = b.shape, b.dtype
        return a.view_as(a)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.new_zeros(ctx.b_shape, dtype=ctx.b_dtype)


def tie(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a``, whose backward also reaches ``b`` (with a zero gradient); see :class:`_Tie`."""
    if not (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)):
        return a
    return _Tie.apply(a, b)


def exchange(rows: torch.Tensor, comm, send: tuple[torch.Tensor, ...], recv: tuple[int, ...], what: str):
    """Differentiable row exchange (see :class:`_Exchange`); nothing moves on one rank."""
    if comm is None or comm.world_size == 1:
        return rows.new_empty((0, *rows.shape[1:]))
    send = tuple(s.to(rows.device) for s in send)
    return _Exchange.apply(rows, comm, send, recv, what)


@dataclass(frozen=True)
class MixerStats:
    """What one mixer call moved on this rank (forward; the backward moves the same bytes back)."""

    kind: str  # "convolution" or "recurrence"
    rank: int
    world_size: int
    tokens_recv: int  # halo tokens (convolution) or piece states (recurrence) received
    bytes_recv: int
    bytes_sent: int
    pieces: int = 0  # this rank's pieces (recurrence)
    segment_runs: int = 0  # calls of the mixer's function (recurrence: stacked segments per length)


# ----------------------------------------------------------------------------------------------
# convolution


@dataclass(frozen=True, eq=False)
class HaloPlan:
    """One rank's halo exchange and gather for a causal depthwise convolution of kernel ``kernel``."""

    kernel: int
    send: tuple[torch.Tensor, ...]
    """Per peer: flat indices ``b * Lr + t`` of this rank's tokens the peer needs."""
    recv: tuple[int, ...]
    """Per peer: how many tokens this rank receives from it."""
    taps: torch.Tensor
    """(k, B * Lr) long: for tap j (the input at g - (k-1-j)), the row of
    ``cat(x (B*Lr), received, one zero row)`` token g reads."""


def foreign_needs(geo: Geometry, s: int, kernel: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``s``'s taps: sources (B, L_s, k) global positions, whether each is read (inside the
    document), and the sorted unique keys ``owner * B * L + b * L + src`` of those on other ranks."""
    G = geo.index[s]
    B, L = geo.batch, geo.seq_len
    offsets = torch.arange(kernel - 1, -1, -1)  # tap j reads g - (k-1-j)
    src = G[None, :, None] - offsets[None, None, :]  # (1, L_s, k)
    starts = geo.doc_start[:, G]  # (B, L_s)
    ok = src >= starts[:, :, None]  # (B, L_s, k)
    src = src.expand(B, -1, -1).clamp(min=0)
    rows = torch.arange(B)[:, None, None].expand_as(src)
    owner = geo.owner[src]
    foreign = ok & (owner != s)
    keys = (owner * B * L + rows * L + src)[foreign]
    return src, ok, torch.unique(keys)


# ----------------------------------------------------------------------------------------------
# linear recurrences


@dataclass(frozen=True, eq=False)
class Piece:
    """A maximal run of consecutive global positions that one rank holds, in one row."""

    owner: int
    slot: int  # its index among the owner's pieces
    row: int
    start: int  # global [start, end)
    end: int
    carries: bool  # its first token continues a document begun before it
    passes: bool  # ... and no document starts inside: its incoming state reaches its end


@dataclass(frozen=True, eq=False)
class ScanPlan:
    """One rank's scan over pieces for one batch (see :mod:`.scan`'s docstring)."""

    groups: tuple[tuple[int, torch.Tensor], ...]
    """Segments stacked per length: (length n, flat token indices (N * n,) ``b * Lr + t``)."""
    order: torch.Tensor
    """(B * Lr,) long: where each token's output is in the groups' concatenated outputs."""
    tails: tuple[tuple[int, int], ...]
    """Per own piece (slot order): (group, stacked row) of its last segment."""
    passing: tuple[tuple[int, torch.Tensor, torch.Tensor], ...]
    """Own passing pieces stacked per length: (n, flat token indices, their slots)."""
    heads: tuple[tuple[int, torch.Tensor, torch.Tensor], ...]
    """Own carrying pieces' first segments per length: (n, flat token indices, their slots)."""
    chains: dict
    """Own carrying slot -> the pieces whose states compose its incoming state, nearest first:
    ((source, row, passes), ...); source "own" (row: slot) or "recv" (row: received row)."""
    send: tuple[torch.Tensor, ...]
    recv: tuple[int, ...]
    pieces: int
    last: tuple[tuple[int, bool], ...] = ()
    """Per row: (slot, passes) of this rank's last piece in global order (the state a cache keeps)."""


def pieces_of(geo: Geometry, s: int) -> list[Piece]:
    """Rank ``s``'s pieces, row by row (a piece's ``slot``: its index in this list)."""
    G = geo.index[s]
    out = []
    if G.numel() == 0:
        return out
    cut = torch.ones(G.numel(), dtype=torch.bool)
    cut[1:] = G[1:] != G[:-1] + 1
    starts = torch.nonzero(cut).flatten().tolist() + [G.numel()]
    for b in range(geo.batch):
        opens = (geo.doc_start[b, G] == G).tolist()
        for a, e in zip(starts[:-1], starts[1:]):
            carries = not opens[a]
            passes = carries and not any(opens[a + 1:e])
            out.append(Piece(owner=s, slot=len(out), row=b, start=int(G[a]), end=int(G[e - 1]) + 1,
                             carries=carries, passes=passes))
    return out
