"""The planner: a pure function from every rank's token metadata and one mask to each rank's plan.

For every (query rank ``r``, key/value rank ``s``) pair the planner decides: nothing to do, or the
kernel calls (normally one) that compute exactly the visible (query, key) pairs between ``r``'s
queries and the span of ``s``'s keys that ``s`` has to send. Each call carries flash-attn varlen
arguments: ``cu_seqlens_q/k``, max lengths, ``causal`` and ``window=(left, right)`` with bottom-right
alignment (see ``backends/base.py``).

How: for each query row the planner computes, in ``s``'s local key order, the interval of keys it
sees (same attention segment, inside the band of the mask). Rows of one segment form one varlen
sequence when a single bottom-right ``(left, right)`` reproduces all their intervals (checked, not
assumed); otherwise the segment is split at the places where global positions jump (zigzag slices),
which always fits, and in the last resort into single rows. Sequences that admit a common
``(left, right)`` and do not overlap share a kernel call. Every call is verified against the true
intervals, so a plan can only be slow, never wrong.

Legend: ``B`` batch rows, ``L`` global length, ``R`` packed query rows of a pair (``b * L_r + i``),
``G`` groups (candidate sequences).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from . import layout as layout_mod
from .masks import MaskSpec, SequenceMeta, segment_bounds

__all__ = ["KernelCall", "Step", "Round", "PlanStats", "RankPlan", "build_plan", "build_local_plan"]

WORK_TILE = 128  # query rows per tile when counting computed score entries


@dataclass(frozen=True, eq=False)
class KernelCall:
    """One varlen kernel call: query rows ``[q_start, q_end)`` of this rank's packed queries
    (row ``b``, token ``i`` is ``b * L_local + i``) against rows ``[k_start, k_end)`` of the step's
    packed K/V buffer. ``cu_seqlens_q/k`` (int32, CPU) are relative to those starts."""

    q_start: int
    q_end: int
    k_start: int
    k_end: int
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool
    window: tuple[int, int]
    entries_computed: int
    entries_visible: int
    _device_cache: dict = field(default_factory=dict, repr=False, compare=False)

    def cu_seqlens_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``cu_seqlens_q/k`` on ``device``, copied once per plan and device."""
        key = str(device)
        if key not in self._device_cache:
            self._device_cache[key] = (self.cu_seqlens_q.to(device, non_blocking=True),
                                       self.cu_seqlens_k.to(device, non_blocking=True))
        return self._device_cache[key]


@dataclass(frozen=True, eq=False)
class Step:
    """Attention of this rank's queries against ``source``'s K/V tokens ``spans``: disjoint
    ascending local ``[start, end)`` ranges of ``source``. The step's K/V buffer holds, for every batch
    row, those tokens concatenated: (B, width, H_kv, D) with ``width`` the summed span lengths."""

    source: int
    spans: tuple[tuple[int, int], ...]
    calls: tuple[KernelCall, ...]

    @property
    def width(self) -> int:
        return sum(b - a for a, b in self.spans)


@dataclass(frozen=True, eq=False)
class Round:
    """Exchange round ``offset``: receive from ``(rank - offset) % P`` and/or send to
    ``(rank + offset) % P`` the local K/V tokens ``send_spans`` (None: nothing that way)."""

    offset: int
    recv: Step | None
    send_to: int | None
    send_spans: tuple[tuple[int, int], ...] | None


@dataclass(frozen=True)
class PlanStats:
    """What one rank's plan will do in one forward (the backward moves the same K/V again, and
    returns dK/dV partial sums of the received spans in float32)."""

    rank: int
    world_size: int
    kernel_calls: int
    rounds: int
    peers_recv: tuple[int, ...]
    peers_send: tuple[int, ...]
    kv_bytes_recv: int
    kv_bytes_sent: int
    grad_bytes_recv: int
    grad_bytes_sent: int
    ring_kv_bytes_recv: int
    """What a full ring (every other rank's whole shard) would deliver to this rank."""
    entries_computed: int
    """Scores a tiled kernel computes: for every tile of ``WORK_TILE`` query rows of a varlen
    sequence, rows x the span of keys those rows see (what the reference backend computes; a
    flash kernel's 2-D blocks compute slightly more on diagonals)."""
    entries_visible: int
    """(query, key) pairs the kernels keep; equals the pairs the mask keeps (verified)."""


@dataclass(frozen=True, eq=False)
class RankPlan:
    rank: int
    world_size: int
    batch: int
    local_len: int
    local: Step | None
    rounds: tuple[Round, ...]
    stats: PlanStats

    def steps(self) -> list[Step]:
        return ([self.local] if self.local is not None else []) + [r.recv for r in self.rounds if r.recv]

    def schedule(self) -> list[Round]:
        """One round per offset 1..P-1, empty ones included. Every rank walks this same sequence,
        so the messages between any two ranks are posted in the same order on both sides (NCCL
        matches point-to-point messages by order, not by tag)."""
        by_offset = {r.offset: r for r in self.rounds}
        return [by_offset.get(t, Round(offset=t, recv=None, send_to=None, send_spans=None))
                for t in range(1, self.world_size)]


# ----------------------------------------------------------------------------------------------
# per-row visible key intervals


@dataclass(frozen=True)
class _Tokens:
    """Per-rank token metadata derived from the global metadata."""

    idx: list[torch.Tensor]  # per rank (L_r,) global index
    seg_start: torch.Tensor  # (B, L) global
    seg_end: torch.Tensor


def _intervals(q_idx: torch.Tensor, k_idx: torch.Tensor, seg_start: torch.Tensor, seg_end: torch.Tensor,
               spec: MaskSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """For each packed query row (``b * Lq + i``), the packed key rows (``b * Lk + j``) it sees.

    ``q_idx``/``k_idx``: increasing global positions of the query and key tokens; ``seg_start``/
    ``seg_end`` (B, T): attention segment of every global position. Returns (R,), (R,)."""
    L = seg_start.shape[1]
    lo, hi = spec.band()
    lo_i, hi_i = int(max(lo, -L)), int(min(hi, L))
    seg_s_BR, seg_e_BR = seg_start[:, q_idx], seg_end[:, q_idx]
    low_BR = torch.maximum(seg_s_BR, q_idx + lo_i)
    up_BR = torch.minimum(seg_e_BR, q_idx + hi_i + 1)
    B, Ls = seg_s_BR.shape[0], k_idx.numel()
    tlo_BR = torch.searchsorted(k_idx, low_BR.contiguous())
    thi_BR = torch.maximum(torch.searchsorted(k_idx, up_BR.contiguous()), tlo_BR)
    base_B1 = (torch.arange(B) * Ls).unsqueeze(1)
    return (tlo_BR + base_B1).reshape(-1), (thi_BR + base_B1).reshape(-1)


# ----------------------------------------------------------------------------------------------
# fitting rows into bottom-right varlen sequences


@dataclass
class _Seq:
    q0: int
    q1: int
    k0: int
    k1: int
    left: int | None  # exact value, or None when free (any value >= left_min, or unlimited)
    right: int | None
    left_min: int
    right_min: int
    visible: int
    work: int


class _Fit(NamedTuple):
    """Per group of rows, (G,) tensors: can the group run as one bottom-right varlen sequence, and
    with which arguments."""

    first_G: torch.Tensor       # first query row of the group
    last_G: torch.Tensor        # last query row
    k0_G: torch.Tensor          # key range [k0, k1) of the whole group
    k1_G: torch.Tensor
    left_G: torch.Tensor        # the window's left reach, if pinned by a row (else -1)
    right_G: torch.Tensor       # the window's right reach, if pinned (else -1)
    left_free_G: torch.Tensor   # no row pins the left side: any left >= Lk - 1 works
    right_free_G: torch.Tensor  # no row pins the right side
    ok_G: torch.Tensor          # the group is exactly one sequence with these arguments
    work_G: torch.Tensor        # score entries a tiled kernel computes for it


def _fit(rows_X, lo_X, hi_X, gid_X) -> _Fit:
    """Try to express each group of rows (ascending, live) as one bottom-right varlen sequence."""
    G = int(gid_X[-1]) + 1
    big = torch.iinfo(torch.int64).max
    f_G = torch.full((G,), big).scatter_reduce(0, gid_X, rows_X, "amin")
    l_G = torch.full((G,), -1).scatter_reduce(0, gid_X, rows_X, "amax")
    n_G = torch.zeros(G, dtype=torch.int64).scatter_add(0, gid_X, torch.ones_like(rows_X))
    contiguous_G = (l_G - f_G + 1) == n_G
    # monotone intervals inside a group: K0 from the first row, K1 from the last
    k0_G = torch.full((G,), big).scatter_reduce(0, gid_X, lo_X, "amin")
    k1_G = torch.full((G,), -1).scatter_reduce(0, gid_X, hi_X, "amax")
    lq_G, lk_G = n_G, k1_G - k0_G
    off_G = lk_G - lq_G
    i_X = rows_X - f_G[gid_X]
    off_X, lk_X = off_G[gid_X], lk_G[gid_X]
    rlo_X, rhi_X = lo_X - k0_G[gid_X], hi_X - k0_G[gid_X]

    def pinned(value_X, active_X):
        vmin = torch.full((G,), big).scatter_reduce(0, gid_X[active_X], value_X[active_X], "amin")
        vmax = torch.full((G,), -big).scatter_reduce(0, gid_X[active_X], value_X[active_X], "amax")
        has = torch.zeros(G, dtype=torch.bool).index_fill(0, gid_X[active_X], True)
        return torch.where(has, vmin, torch.full_like(vmin, -1)), (~has) | (vmin == vmax), ~has

    left_G, left_ok_G, left_free_G = pinned(i_X + off_X - rlo_X, rlo_X > 0)
    right_G, right_ok_G, right_free_G = pinned(rhi_X - 1 - i_X - off_X, rhi_X < lk_X)
    left_X, right_X = left_G[gid_X], right_G[gid_X]
    k_lo_X = torch.where(left_X >= 0, (i_X + off_X - left_X).clamp(min=0), torch.zeros_like(i_X))
    k_hi_X = torch.where(right_X >= 0, torch.minimum(lk_X, i_X + off_X + right_X + 1), lk_X)
    row_ok_X = (k_lo_X == rlo_X) & (k_hi_X == rhi_X)
    rows_ok_G = torch.ones(G, dtype=torch.bool).scatter_reduce(0, gid_X, row_ok_X, "amin")
    ok_G = contiguous_G & left_ok_G & right_ok_G & rows_ok_G & (left_free_G | (left_G >= 0)) & \
        (right_free_G | (right_G >= 0))
    # work of a tiled kernel: per tile of WORK_TILE rows, rows x (last row's end - first row's start)
    tiles_G = (n_G + WORK_TILE - 1) // WORK_TILE
    first_tile_G = torch.cumsum(tiles_G, 0) - tiles_G
    start_G = torch.cumsum(n_G, 0) - n_G  # rank of each row among its group's live rows
    tile_X = first_tile_G[gid_X] + (torch.arange(rows_X.numel()) - start_G[gid_X]) // WORK_TILE
    n_tiles = int(tiles_G.sum())
    t_lo = torch.full((n_tiles,), big).scatter_reduce(0, tile_X, lo_X, "amin")
    t_hi = torch.full((n_tiles,), -1).scatter_reduce(0, tile_X, hi_X, "amax")
    t_rows = torch.zeros(n_tiles, dtype=torch.int64).scatter_add(0, tile_X, torch.ones_like(tile_X))
    tile_gid = torch.repeat_interleave(torch.arange(G), tiles_G)
    work_G = torch.zeros(G, dtype=torch.int64).scatter_add(0, tile_gid, t_rows * (t_hi - t_lo))
    return _Fit(first_G=f_G, last_G=l_G, k0_G=k0_G, k1_G=k1_G, left_G=left_G, right_G=right_G,
                left_free_G=left_free_G, right_free_G=right_free_G, ok_G=ok_G, work_G=work_G)


def _runs(positions_X: torch.Tensor) -> torch.Tensor:
    """Run id per element: a new run wherever positions do not increase by exactly one."""
    brk = torch.ones_like(positions_X, dtype=torch.bool)
    if positions_X.numel() > 1:
        brk[1:] = positions_X[1:] != positions_X[:-1] + 1
    return torch.cumsum(brk.to(torch.int64), 0) - 1


def _collect(out: list[_Seq], fit: _Fit, lo_X, hi_X, gid_X) -> torch.Tensor:
    """Append fitted groups to ``out``; return the mask of rows whose group failed."""
    vis_G = torch.zeros_like(fit.first_G).scatter_add(0, gid_X, hi_X - lo_X)
    for g in torch.nonzero(fit.ok_G).flatten().tolist():
        first, last, k0, k1 = (int(t[g]) for t in (fit.first_G, fit.last_G, fit.k0_G, fit.k1_G))
        out.append(_Seq(
            q0=first, q1=last + 1, k0=k0, k1=k1,
            left=None if bool(fit.left_free_G[g]) else int(fit.left_G[g]),
            right=None if bool(fit.right_free_G[g]) else int(fit.right_G[g]),
            left_min=k1 - k0 - 1, right_min=last - first, visible=int(vis_G[g]), work=int(fit.work_G[g])))
    return ~fit.ok_G[gid_X]


def _pair_sequences(tok: _Tokens, spec: MaskSpec, r: int, s: int) -> list[_Seq]:
    """All varlen sequences of pair (query rank r, key rank s), packed coordinates."""
    return _sequences(tok.idx[r], tok.idx[s], tok.seg_start, tok.seg_end, spec)


def _sequences(q_idx, k_idx, seg_start, seg_end, spec: MaskSpec) -> list[_Seq]:
    """Varlen sequences computing exactly the visible pairs between query tokens at global
    positions ``q_idx`` and key tokens at ``k_idx`` (both increasing), for every batch row."""
    lo_R, hi_R = _intervals(q_idx, k_idx, seg_start, seg_end, spec)
    live_R = hi_R > lo_R
    if not bool(live_R.any()):
        return []
    Lr, Ls = q_idx.numel(), k_idx.numel()
    rows_X = torch.nonzero(live_R).flatten()
    lo_X, hi_X = lo_R[rows_X], hi_R[rows_X]
    b_X = rows_X // Lr
    seg_X = seg_start[b_X, q_idx[rows_X % Lr]]
    # 1) one sequence per (row, segment): the natural grouping
    new_X = torch.ones_like(rows_X, dtype=torch.bool)
    new_X[1:] = (seg_X[1:] != seg_X[:-1]) | (b_X[1:] != b_X[:-1])
    gid_X = torch.cumsum(new_X.to(torch.int64), 0) - 1
    seqs: list[_Seq] = []
    failed_X = _collect(seqs, _fit(rows_X, lo_X, hi_X, gid_X), lo_X, hi_X, gid_X)
    if bool(failed_X.any()):
        # 2) split failed groups where global positions jump (zigzag slices), query and key side
        rows_F, lo_F, hi_F, gid_F = rows_X[failed_X], lo_X[failed_X], hi_X[failed_X], gid_X[failed_X]
        qpos_F = q_idx[rows_F % Lr]
        for ka, kb in _run_bounds(k_idx):
            base_F = (rows_F // Lr) * Ls
            clo_F = torch.maximum(lo_F, base_F + ka)
            chi_F = torch.minimum(hi_F, base_F + kb)
            keep_F = chi_F > clo_F
            rows_P, lo_P, hi_P = rows_F[keep_F], clo_F[keep_F], chi_F[keep_F]
            if rows_P.numel() == 0:
                continue
            g_P, pos_P = gid_F[keep_F], qpos_F[keep_F]
            new_P = torch.ones_like(rows_P, dtype=torch.bool)
            new_P[1:] = (g_P[1:] != g_P[:-1]) | (rows_P[1:] != rows_P[:-1] + 1) | (pos_P[1:] != pos_P[:-1] + 1)
            gid_P = torch.cumsum(new_P.to(torch.int64), 0) - 1
            still_P = _collect(seqs, _fit(rows_P, lo_P, hi_P, gid_P), lo_P, hi_P, gid_P)
            # 3) last resort: one sequence per row (always exact: a row sees one interval)
            for row, lo, hi in zip(rows_P[still_P].tolist(), lo_P[still_P].tolist(), hi_P[still_P].tolist()):
                seqs.append(_Seq(q0=row, q1=row + 1, k0=lo, k1=hi, left=None, right=None,
                                 left_min=hi - lo - 1, right_min=0, visible=hi - lo, work=hi - lo))
    seqs.sort(key=lambda x: (x.q0, x.k0))
    return seqs


def _run_bounds(idx: torch.Tensor) -> list[tuple[int, int]]:
    """Local ``[start, end)`` runs of globally consecutive tokens."""
    if idx.numel() == 0:
        return []
    run = _runs(idx)
    ends = torch.nonzero(torch.diff(run, append=run[-1:] + 1)).flatten() + 1
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), ends[:-1]])
    return list(zip(starts.tolist(), ends.tolist()))


# ----------------------------------------------------------------------------------------------
# grouping sequences into kernel calls


def _merge_side(cur: int | None, cur_min: int, val: int | None, val_min: int):
    """Combine one window side of a call with a sequence's; None if incompatible."""
    if cur is None and val is None:
        return (None, max(cur_min, val_min))
    if cur is None:
        return (val, 0) if val >= cur_min else None
    if val is None:
        return (cur, 0) if cur >= val_min else None
    return (cur, 0) if cur == val else None


def _calls(seqs: list[_Seq], k_shift) -> list[KernelCall]:
    """Group sequences into as few kernel calls as their windows allow; ``k_shift(k)`` converts a
    packed key row of the pair into the step buffer's row."""

    def k_end(k: int) -> int:  # exclusive ends may sit on the next batch row's first index
        return k_shift(k - 1) + 1

    groups: list[dict] = []
    for sq in seqs:
        for grp in groups:
            if sq.q0 < grp["q_end"] or k_shift(sq.k0) < grp["k_end"]:
                continue
            left = _merge_side(grp["left"], grp["left_min"], sq.left, sq.left_min)
            right = _merge_side(grp["right"], grp["right_min"], sq.right, sq.right_min)
            if left is None or right is None:
                continue
            grp["left"], grp["left_min"] = left
            grp["right"], grp["right_min"] = right
            grp["seqs"].append(sq)
            grp["q_end"], grp["k_end"] = sq.q1, k_end(sq.k1)
            break
        else:
            groups.append(dict(left=sq.left, left_min=sq.left_min, right=sq.right, right_min=sq.right_min,
                               seqs=[sq], q_end=sq.q1, k_end=k_end(sq.k1)))
    calls = []
    for grp in groups:
        seq_list = grp["seqs"]
        q_start, k_start = seq_list[0].q0, k_shift(seq_list[0].k0)
        lens_q, lens_k = [], []
        q_at, k_at = q_start, k_start
        for sq in seq_list:
            k0, k1 = k_shift(sq.k0), k_end(sq.k1)
            if sq.q0 > q_at:  # query rows of this range that see nothing in this call
                lens_q.append(sq.q0 - q_at)
                lens_k.append(0)
            if k0 > k_at:  # keys no query of this call uses
                lens_q.append(0)
                lens_k.append(k0 - k_at)
            lens_q.append(sq.q1 - sq.q0)
            lens_k.append(k1 - k0)
            q_at, k_at = sq.q1, k1
        left = -1 if grp["left"] is None else grp["left"]
        right = -1 if grp["right"] is None else grp["right"]
        cu_q = torch.tensor([0] + lens_q, dtype=torch.int64).cumsum(0).to(torch.int32)
        cu_k = torch.tensor([0] + lens_k, dtype=torch.int64).cumsum(0).to(torch.int32)
        calls.append(KernelCall(
            q_start=q_start, q_end=q_at, k_start=k_start, k_end=k_at, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
            max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), causal=right == 0,
            window=(left, right),
            entries_computed=sum(sq.work for sq in seq_list),
            entries_visible=sum(sq.visible for sq in seq_list)))
    return calls


# ----------------------------------------------------------------------------------------------
# the plan of one rank


def _tokens(meta: SequenceMeta, spec: MaskSpec, world_size: int, layout) -> _Tokens:
    seg_start, seg_end = segment_bounds(meta, spec)
    idx = [layout_mod.global_index(meta.seq_len, world_size, layout, r) for r in range(world_size)]
    return _Tokens(idx=idx, seg_start=seg_start, seg_end=seg_end)


def _spans(seqs: list[_Seq], Ls: int) -> tuple[tuple[int, int], ...]:
    """Local token ranges of the key rank needed by these sequences: the union over batch rows of
    their key ranges, merged (so each sequence's keys lie inside one range)."""
    ranges = sorted({(sq.k0 % Ls, (sq.k1 - 1) % Ls + 1) for sq in seqs})
    merged = [list(ranges[0])]
    for a, b in ranges[1:]:
        if a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return tuple((a, b) for a, b in merged)


def build_plan(
    meta: SequenceMeta, spec: MaskSpec, *, world_size: int, layout: str | layout_mod.Layout, rank: int,
    head_kv: int, head_dim: int, itemsize: int, grad_itemsize: int = 4,
) -> RankPlan:
    """The plan of ``rank``: a pure function of global metadata, identical wherever it is computed.

    Args:
        meta: global document metadata (B rows of L tokens).
        spec: the mask.
        world_size, layout: how the sequence is sharded (``layout.rank_ranges``).
        rank: whose plan to build (any rank can build any rank's plan, e.g. for statistics).
        head_kv, head_dim, itemsize: K/V heads, head dim and element size, for the byte counts.
        grad_itemsize: element size of the dK/dV partial sums returned in the backward pass.
    """
    layout_mod.check_layout(layout)
    B, P = meta.batch, world_size
    tok = _tokens(meta, spec, P, layout)
    sizes = [t.numel() for t in tok.idx]
    token_bytes = 2 * head_kv * head_dim * itemsize * B  # K and V, every batch row
    grad_token_bytes = 2 * head_kv * head_dim * grad_itemsize * B

    def step(r: int, s: int) -> Step | None:
        seqs = _pair_sequences(tok, spec, r, s)
        if not seqs:
            return None
        Ls = sizes[s]
        spans = ((0, Ls),) if r == s else _spans(seqs, Ls)
        width = sum(b - a for a, b in spans)
        starts = [a for a, _ in spans]
        before = [0]
        for a, b in spans:
            before.append(before[-1] + b - a)

        def k_shift(k: int) -> int:
            b, j = divmod(k, Ls)
            piece = bisect.bisect_right(starts, j) - 1
            return b * width + before[piece] + (j - starts[piece])

        return Step(source=s, spans=spans, calls=tuple(_calls(seqs, k_shift)))

    local = step(rank, rank)
    rounds = []
    for t in range(1, P):
        src, dst = (rank - t) % P, (rank + t) % P
        recv = step(rank, src)
        out = step(dst, rank)
        if recv is None and out is None:
            continue
        rounds.append(Round(offset=t, recv=recv, send_to=dst if out else None,
                            send_spans=out.spans if out else None))
    return _rank_plan(rank, P, B, sizes, local, tuple(rounds), token_bytes, grad_token_bytes)


def _rank_plan(rank, P, B, sizes, local, rounds, token_bytes, grad_token_bytes) -> RankPlan:
    steps = ([local] if local else []) + [r.recv for r in rounds if r.recv]
    calls = [c for st in steps for c in st.calls]
    recv_tokens = sum(r.recv.width for r in rounds if r.recv)
    sent_tokens = sum(b - a for r in rounds if r.send_spans for a, b in r.send_spans)
    stats = PlanStats(
        rank=rank, world_size=P, kernel_calls=len(calls),
        rounds=len(rounds),
        peers_recv=tuple(r.recv.source for r in rounds if r.recv),
        peers_send=tuple(r.send_to for r in rounds if r.send_to is not None),
        kv_bytes_recv=recv_tokens * token_bytes, kv_bytes_sent=sent_tokens * token_bytes,
        grad_bytes_recv=sent_tokens * grad_token_bytes, grad_bytes_sent=recv_tokens * grad_token_bytes,
        ring_kv_bytes_recv=(sum(sizes) - sizes[rank]) * token_bytes,
        entries_computed=sum(c.entries_computed for c in calls),
        entries_visible=sum(c.entries_visible for c in calls))
    return RankPlan(rank=rank, world_size=P, batch=B, local_len=sizes[rank], local=local,
                    rounds=rounds, stats=stats)


def build_local_plan(
    meta: SequenceMeta, spec: MaskSpec, *, q_idx: torch.Tensor, k_idx: torch.Tensor,
) -> RankPlan:
    """A single-device plan for queries and keys at arbitrary increasing positions, e.g. the new
    tokens of a generation step (``q_idx``, (Lq,)) against the keys of a KV cache (``k_idx``,
    (Lk,), possibly a sliding window of it). ``meta`` covers every position up to
    ``max(q_idx[-1], k_idx[-1])``. Traffic statistics are zero."""
    seg_start, seg_end = segment_bounds(meta, spec)
    seqs = _sequences(q_idx, k_idx, seg_start, seg_end, spec)
    local = Step(source=0, spans=((0, k_idx.numel()),), calls=tuple(_calls(seqs, lambda k: k))) if seqs else None
    return _rank_plan(0, 1, meta.batch, [q_idx.numel()], local, (), 0, 0)
