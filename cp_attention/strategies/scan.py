"""Sequence mixers other than attention under context parallelism: short causal convolutions and
linear recurrences (Mamba's selective scan, Mamba-2's SSD, gated DeltaNet), exact with packed
documents, any layout and B >= 1.

Each rank holds, in every row, the global tokens of its layout (``global_index``). They fall into
*pieces*: maximal runs of consecutive global positions (one per rank for contiguous shards, two for
zigzag, several for a balanced layout). A document start cuts a piece into *segments*.

**Convolution** (depthwise, kernel k, causal): token g reads the inputs at g-k+1 .. g of its own
document; inputs before its document's first token count as zeros, as at the start of a sequence::

    g:        ...  s-2  s-1 | s  s+1  s+2 ...        (| a document starts at s, k = 3)
    token s+1 reads          s  s+1                  (s-1 is another document's: zero)
    token s+2 reads          s  s+1  s+2

The inputs a piece needs from before its first token (at most k-1 per piece and row, fewer where a
document starts) are its *halo*. Every rank computes every rank's halo from the layout and the
documents (no metadata moves); one all-to-all moves them (:class:`~.mixer_exchange.HaloPlan`).

**Linear recurrence** ``h_t = A_t h_{t-1} + b_t(x_t)``, ``y_t = f_t(h_t) + d_t(x_t)``, linear in
``(h_{t-1}, x)`` for fixed ``A_t, f_t`` (so the effect of an incoming state adds to the outputs);
``h`` restarts from zero at every document start. The scan over pieces (:class:`~.mixer_exchange.ScanPlan`):

1. every segment runs from a zero state through the mixer's own function (segments of equal length
   stacked as one batch): its outputs and, for each piece's last segment, the final state ``F_p``;
2. a piece without a document start carries an incoming state through: its transition ``T_p``
   (``h_out = T_p h_in + F_p``), from the mixer (a probe run) or a closed form;
3. one all-to-all moves to each rank the ``(F_q, T_q)`` of the pieces before its own in global
   order, back to the latest document start (only those);
4. each piece's incoming state is composed in global order: ``S_p = F_q + T_q S_q`` over that
   chain (``q``: the piece ending where ``p`` starts), zero where a document starts at ``p``;
5. the tokens of a piece before its first document start are computed again from ``S_p``: the
   mixer run again on that segment from ``S_p`` (its initial-state argument), or, for a function
   without one, the effect of ``S_p`` added in closed form (linearity).

Gradients flow back through the same exchanges, reversed (:func:`~.mixer_exchange.exchange`). The mixer-specific
parts (how to run a segment, a transition, a correction) are an adapter's
(:class:`RecurrenceAdapter`); the integrations adapt transformers' functions.

Legend: ``B`` rows, ``L`` global length, ``Lr`` this rank's tokens per row, ``C`` channels,
``k`` kernel, ``N`` stacked segments, ``n`` a segment's length.
"""

from __future__ import annotations

import threading
import weakref
from typing import Protocol

import torch

from .. import layout as layout_mod
from .mixer_exchange import (Geometry, HaloPlan, MixerStats, Piece, ScanPlan, exchange, foreign_needs, make_geometry,
                             pieces_of, tie)

__all__ = ["geometry_of", "plan_for", "agree", "halo_plan", "causal_conv", "token_windows", "scan_plan",
           "RecurrenceAdapter", "scan"]

_CACHE_LOCK = threading.Lock()
_GEOMETRIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # batch record -> {key: plan}


def _cached(record, key, build):
    with _CACHE_LOCK:
        plans = _GEOMETRIES.get(record)
        if plans is None:
            plans = _GEOMETRIES[record] = {}
        if key in plans:
            return plans[key]
    value = build()
    with _CACHE_LOCK:
        return plans.setdefault(key, value)


def geometry_of(record) -> Geometry:
    """The :class:`~.mixer_exchange.Geometry` of a sharded batch (the record ``cp.shard_batch`` bound to its
    tensors), computed once per batch."""
    def build():
        cp, meta = record.cp, record.meta
        P, L = cp.world_size, record.seq_len
        index = [layout_mod.global_index(L, P, record.layout, r) for r in range(P)]
        return make_geometry(meta.batch, L, meta.doc_start, index, cp.rank)
    return _cached(record, "geometry", build)


def plan_for(record, what: str, arg, build):
    """A plan of ``record``'s batch (``what``, ``arg``: e.g. a halo's kernel), built once per batch."""
    return _cached(record, (what, arg), build)


def agree(record, comm, signature: tuple[int, ...]) -> None:
    """Before a mixer's first exchange on a batch: the ranks compare their batch (documents, tokens,
    layout) and what the mixer computes (``signature``: its kind and the shapes that are not
    per-rank), once per batch and signature (one all-gather of a few ints); a difference raises
    ValueError on every rank together instead of a mismatched exchange."""
    if comm is None or comm.world_size == 1:
        return
    key = ("mixer",) + tuple(signature)
    if key in record.agreed:
        return
    mine = torch.tensor([record.crc, record.tokens_crc, layout_mod.layout_code(record.layout), *signature],
                        dtype=torch.int64)
    everyone = comm.all_gather(mine, "the agreement exchange of a sequence mixer")
    if any(not torch.equal(t.cpu(), mine) for t in everyone):  # every rank sees the same list: all raise
        rows = "; ".join(f"rank {r}: {t.tolist()}" for r, t in enumerate(everyone))
        raise ValueError("cp_flash: the ranks disagree on a sequence mixer's batch or shapes ([documents crc, "
                         f"tokens crc, layout, mixer kind, shapes...] {rows}): every rank must run the same model "
                         "on the tensors of one cp.shard_batch call")
    record.agreed[key] = True


# ----------------------------------------------------------------------------------------------
# convolution


def halo_plan(geo: Geometry, kernel: int) -> HaloPlan:
    """The :class:`~.mixer_exchange.HaloPlan` of ``geo``'s rank for a kernel of ``kernel`` tokens."""
    B, L, P, r = geo.batch, geo.seq_len, geo.world_size, geo.rank
    Lr = geo.local_len
    src, ok, mine = foreign_needs(geo, r, kernel)
    recv = tuple(int(((mine // (B * L)) == o).sum()) for o in range(P))
    send = []
    for s in range(P):
        if s == r:
            send.append(torch.zeros(0, dtype=torch.long))
            continue
        _, _, keys = foreign_needs(geo, s, kernel)
        keys = keys[(keys // (B * L)) == r]  # in the (b, src) order rank s expects them
        b, g = (keys % (B * L)) // L, keys % L
        send.append(b * Lr + geo.local[g])
    rows = torch.arange(B)[:, None, None].expand_as(src)
    owner = geo.owner[src]
    key = owner * B * L + rows * L + src
    at_recv = B * Lr + torch.searchsorted(mine, key.reshape(-1)).reshape(key.shape)
    at_local = rows * Lr + geo.local[src]
    zero = B * Lr + mine.numel()
    taps = torch.where(~ok, torch.full_like(src, zero), torch.where(owner == r, at_local, at_recv))
    return HaloPlan(kernel=kernel, send=tuple(send), recv=recv, taps=taps.reshape(B * Lr, kernel).T.contiguous())


def causal_conv(x_BLC: torch.Tensor, weight_Ck: torch.Tensor, bias_C: torch.Tensor | None, plan: HaloPlan,
                comm) -> tuple[torch.Tensor, MixerStats]:
    """The causal depthwise convolution of this rank's tokens, documents apart (module docstring).

    x_BLC (B, Lr, C) this rank's inputs; weight_Ck (C, k): ``weight[:, j]`` multiplies the input at
    g - (k-1-j) (``nn.Conv1d``'s layout with ``padding=k-1``, its output cut to the first Lr);
    bias_C (C,) or None. Returns ((B, Lr, C) in the dtype of ``weight``, stats).
    """
    B, Lr, C = x_BLC.shape
    flat = x_BLC.reshape(B * Lr, C).to(weight_Ck.dtype)
    got = exchange(flat, comm, plan.send, plan.recv, "a convolution halo exchange")
    acc = torch.promote_types(weight_Ck.dtype, torch.float32)  # taps summed in float32 at least, rounded once
    ext = torch.cat([flat, got, flat.new_zeros(1, C)]).to(acc)
    taps = plan.taps.to(x_BLC.device)
    y = None
    for j in range(plan.kernel):
        term = ext.index_select(0, taps[j]) * weight_Ck[:, j].to(acc)
        y = term if y is None else y + term
    if bias_C is not None:
        y = y + bias_C.to(acc)
    y = y.to(weight_Ck.dtype)
    size = flat.element_size() * C
    stats = MixerStats(kind="convolution", rank=getattr(comm, "rank", 0), world_size=getattr(comm, "world_size", 1),
                       tokens_recv=sum(plan.recv), bytes_recv=sum(plan.recv) * size,
                       bytes_sent=sum(int(s.numel()) for s in plan.send) * size)
    return y.reshape(B, Lr, C), stats


def token_windows(x_BLC: torch.Tensor, plan: HaloPlan, comm) -> tuple[torch.Tensor, MixerStats]:
    """Each token's window of the ``plan.kernel`` inputs ending at it, inside its document.

    x_BLC (B, Lr, C) this rank's inputs. Returns ((B, Lr, k, C), stats): ``[:, :, j]`` holds the input
    at g - (k-1-j), zero before the token's document starts (as a causal convolution padded with
    zeros reads it). For a stack of causal convolutions of receptive field k (Zaya's), run on each
    window as a sequence of k with no padding.
    """
    B, Lr, C = x_BLC.shape
    flat = x_BLC.reshape(B * Lr, C)
    got = exchange(flat, comm, plan.send, plan.recv, "a convolution halo exchange")
    ext = torch.cat([flat, got, flat.new_zeros(1, C)])
    windows = ext.index_select(0, plan.taps.to(x_BLC.device).T.reshape(-1)).reshape(B, Lr, plan.kernel, C)
    size = flat.element_size() * C
    stats = MixerStats(kind="convolution", rank=getattr(comm, "rank", 0), world_size=getattr(comm, "world_size", 1),
                       tokens_recv=sum(plan.recv), bytes_recv=sum(plan.recv) * size,
                       bytes_sent=sum(int(s.numel()) for s in plan.send) * size)
    return windows, stats


# ----------------------------------------------------------------------------------------------
# linear recurrences


class RecurrenceAdapter(Protocol):
    """How the scan runs one mixer. ``args`` maps names to stacked segments: every name of
    ``token_dims`` is a per-token tensor (N, ..., n at dim ``token_dims[name]``, ...)."""

    token_dims: dict
    out_dim: int  # the output's token dimension

    def shapes(self, args: dict) -> tuple[tuple, tuple, torch.dtype]:
        """(state shape, transition shape, their dtype) of one row, from the full per-token ``args``."""

    def run(self, args: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """From a zero state: (outputs (N, ..., n, ...), final states (N, *state))."""

    def transition(self, args: dict) -> torch.Tensor:
        """The map from an incoming state to the final state, (N, *transition)."""

    def apply(self, T: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
        """``T`` (n, *transition) applied to states ``S`` (n, *state)."""

    def correct(self, args: dict, S: torch.Tensor) -> torch.Tensor:
        """The segments' outputs when they start from ``S`` (N, *state) instead of zero; with
        ``additive = True`` on the adapter, the change of the outputs instead (added to them)."""


def scan_plan(geo: Geometry) -> ScanPlan:
    """The :class:`~.mixer_exchange.ScanPlan` of ``geo``'s rank."""
    P, r, Lr = geo.world_size, geo.rank, geo.local_len
    every = [pieces_of(geo, s) for s in range(P)]
    mine = every[r]
    ends = {(p.row, p.end): p for pieces in every for p in pieces}

    def tokens(p: Piece) -> list[int]:  # flat indices b * Lr + t of a piece of mine
        return (p.row * Lr + geo.local[p.start:p.end]).tolist()

    # segments of my pieces: cut at document starts
    segments = []  # (piece slot, first?, last?, tokens)
    for p in mine:
        toks = tokens(p)
        inside = torch.arange(p.start + 1, p.end)
        opens = inside[geo.doc_start[p.row, p.start + 1:p.end] == inside].tolist()
        bounds = [p.start] + opens + [p.end]
        for i, (a, e) in enumerate(zip(bounds[:-1], bounds[1:])):
            segments.append((p.slot, i == 0, i == len(bounds) - 2, toks[a - p.start:e - p.start]))
    by_len: dict[int, list] = {}
    for seg in segments:
        by_len.setdefault(len(seg[3]), []).append(seg)
    groups, tails, flat_order = [], {}, []
    for gi, (n, segs) in enumerate(sorted(by_len.items())):
        groups.append((n, torch.tensor([t for seg in segs for t in seg[3]], dtype=torch.long)))
        for row, seg in enumerate(segs):
            flat_order.extend(seg[3])
            if seg[2]:
                tails[seg[0]] = (gi, row)
    order = torch.empty(len(flat_order), dtype=torch.long)
    order[torch.tensor(flat_order, dtype=torch.long)] = torch.arange(len(flat_order))

    def per_length(pieces_and_tokens):
        stacked: dict[int, list] = {}
        for slot, toks in pieces_and_tokens:
            stacked.setdefault(len(toks), []).append((slot, toks))
        return tuple((n, torch.tensor([t for _, toks in items for t in toks], dtype=torch.long),
                      torch.tensor([slot for slot, _ in items], dtype=torch.long))
                     for n, items in sorted(stacked.items()))

    passing = per_length([(p.slot, tokens(p)) for p in mine if p.passes])
    heads = per_length([(seg[0], seg[3]) for seg in segments if seg[1] and mine[seg[0]].carries])

    def chain(p: Piece) -> list[Piece]:
        links, q = [], ends[(p.row, p.start)]
        while True:
            links.append(q)
            if not q.passes:
                return links
            q = ends[(q.row, q.start)]

    need = {s: set() for s in range(P)}  # rank s's pieces this rank needs
    chains_raw = {p.slot: chain(p) for p in mine if p.carries}
    for links in chains_raw.values():
        for q in links:
            if q.owner != r:
                need[q.owner].add(q.slot)
    recv_rows, recv = {}, []
    for s in range(P):
        slots = sorted(need[s])
        for slot in slots:
            recv_rows[(s, slot)] = len(recv_rows)
        recv.append(len(slots))
    chains = {slot: tuple(("own", q.slot, q.passes) if q.owner == r else ("recv", recv_rows[(q.owner, q.slot)],
                                                                          q.passes) for q in links)
              for slot, links in chains_raw.items()}
    send = []
    for s in range(P):  # what rank s needs of mine: the same walk, done for s's pieces
        wanted = {q.slot for p in every[s] if s != r and p.carries for q in chain(p) if q.owner == r}
        send.append(torch.tensor(sorted(wanted), dtype=torch.long))
    last = []
    for b in range(geo.batch):
        row = [p for p in mine if p.row == b]
        if row:
            p = max(row, key=lambda q: q.end)
            last.append((p.slot, p.passes))
    return ScanPlan(groups=tuple(groups), order=order, tails=tuple(tails[p.slot] for p in mine),
                    passing=passing, heads=heads, chains=chains, send=tuple(send), recv=tuple(recv),
                    pieces=len(mine), last=tuple(last))


def _take(args: dict, dims: dict, flat: torch.Tensor, n: int, B: int, Lr: int) -> dict:
    """``args``' per-token tensors (B, ..., Lr at their dim, ...) stacked as segments of ``n``."""
    out = dict(args)
    for name, d in dims.items():
        x = args[name]
        if x is None:
            continue
        xm = x.movedim(d, 1)
        rest = xm.shape[2:]
        seg = xm.reshape(B * Lr, *rest).index_select(0, flat.to(x.device)).reshape(-1, n, *rest)
        out[name] = seg.movedim(1, d)
    return out


def scan(adapter: RecurrenceAdapter, args: dict, plan: ScanPlan, comm, B: int, Lr: int, *, final: bool = False):
    """Run a linear recurrence over this rank's tokens, exact across ranks and documents.

    ``args``: the mixer's per-token tensors (B, ..., Lr at ``adapter.token_dims[name]``, ...) and
    any others (passed through). Returns (outputs (B, ..., Lr at ``adapter.out_dim``, ...), stats),
    and with ``final`` (B, *state) too: the state after this rank's last token in global order (what
    a cache filled under context parallelism keeps: each rank its own part). Every rank of ``comm``
    calls it for the same layer (one exchange each, possibly empty).
    """
    dims, od = adapter.token_dims, adapter.out_dim
    state_shape, trans_shape, dtype = adapter.shapes(args)
    Fw, Tw = _numel(state_shape), _numel(trans_shape)
    outs, finals = [], []
    for n, flat in plan.groups:
        out, end = adapter.run(_take(args, dims, flat, n, B, Lr))
        out = out.movedim(od, 1)
        outs.append(out.reshape(-1, *out.shape[2:]))
        finals.append(end)
    out_flat = torch.cat(outs).index_select(0, plan.order.to(outs[0].device))  # (B*Lr, ...)
    rest = out_flat.shape[1:]
    device = out_flat.device
    F_own = (torch.stack([finals[g][row] for g, row in plan.tails]).to(dtype) if plan.tails
             else out_flat.new_zeros((0, *state_shape), dtype=dtype))
    T_own = F_own.new_zeros((plan.pieces, *trans_shape))
    for n, flat, which in plan.passing:
        T_own = T_own.index_copy(0, which.to(device), adapter.transition(_take(args, dims, flat, n, B, Lr)).to(dtype))
    rows = torch.cat([F_own.reshape(plan.pieces, Fw), T_own.reshape(plan.pieces, Tw)], dim=1)
    rows = tie(rows, out_flat)  # the exchange's backward comes before its inputs' on every rank
    got = exchange(rows, comm, plan.send, plan.recv, "a recurrence state exchange")
    S_in = {}
    if plan.heads or final:
        table = {"own": rows, "recv": got}
        for slot, links in plan.chains.items():
            S = None
            for source, row, passes in reversed(links):  # the furthest (a document start) first
                line = table[source][row]
                F = line[:Fw].reshape(state_shape)
                S = F if S is None else adapter.apply(line[Fw:].reshape(trans_shape)[None], S[None])[0] + F
            S_in[slot] = S
        for n, flat, which in plan.heads:
            S = torch.stack([S_in[int(s)] for s in which])
            corr = adapter.correct(_take(args, dims, flat, n, B, Lr), S).movedim(od, 1)
            corr = corr.reshape(-1, *rest).to(out_flat.dtype)
            if getattr(adapter, "additive", False):
                out_flat = out_flat.index_add(0, flat.to(device), corr)
            else:  # the segment run again from its incoming state: its outputs replace the zero-state ones
                out_flat = out_flat.index_copy(0, flat.to(device), corr)
    out = tie(out_flat, got).reshape(B, Lr, *rest).movedim(1, od)  # ... and it runs on every rank
    last = None
    if final:
        states = []
        for slot, passes in plan.last:
            S = F_own[slot]
            if passes:
                S = S + adapter.apply(T_own[slot][None], S_in[slot][None])[0]
            states.append(S)
        last = torch.stack(states)
    size = rows.element_size() * (Fw + Tw)
    stats = MixerStats(kind="recurrence", rank=getattr(comm, "rank", 0), world_size=getattr(comm, "world_size", 1),
                       tokens_recv=sum(plan.recv), bytes_recv=sum(plan.recv) * size,
                       bytes_sent=sum(int(s.numel()) for s in plan.send) * size, pieces=plan.pieces,
                       segment_runs=len(plan.groups) + len(plan.passing) + len(plan.heads))
    return (out, stats, last) if final else (out, stats)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
