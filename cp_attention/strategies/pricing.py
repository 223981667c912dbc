"""The modeled time of one ``strategy="auto"`` candidate, from the documents and the layout, without
building any rank's plan.

:func:`candidate_time` returns what :func:`cp_attention.strategies.choice.layer_time` returns for the
plans of every rank (:func:`~cp_attention.strategies.choice.rank_plans`), to the last bit: the model's
inputs (each rank's computed entries, each ring round's widths and peers, each all-to-all's bytes per
peer, the rounds) come from :func:`cp_attention.plan.summary.ring_summary` (every rank's ring statistics
at once) and the head split, and the model's arithmetic is the same sequence of float operations,
evaluated for all ranks at once (numpy). Its cost follows the ranks that share an attention segment,
not ``P`` plans of ``P`` rounds each.

Legend: ``P`` ranks, ``u`` ranks per head group, ``R = P / u`` ring ranks, ``G`` head groups (``R``),
``n`` ring rounds of all ring ranks together.
"""

from __future__ import annotations

import numpy as np

from ..masks import MaskSpec, SequenceMeta
from ..plan.ranks import rank_runs
from ..plan.summary import RingSummary, ring_summary
from .ulysses import Grid, head_split

__all__ = ["candidate_time"]

GRAD_ITEMSIZE = 4  # the dK/dV partial sums a ring returns (float32; build_plan's default)


def candidate_time(meta: SequenceMeta, spec: MaskSpec, cand, layout, model, *, heads: int, kv_heads: int,
                   head_dim: int, head_dim_v: int, itemsize: int) -> float:
    """The modeled forward+backward seconds of one layer under ``cand`` (a
    :class:`~cp_attention.strategies.choice.Candidate`: ``world_size`` ranks, ``ulysses`` per head group)
    with the cost model ``model``: its slowest rank's, equal to ``layer_time(model, rank_plans(...))``."""
    P, u = cand.world_size, cand.ulysses
    grid = Grid(P, u)
    R, B = grid.ring, meta.batch
    if u == 1:
        ring_layout, head_kv = layout, kv_heads
    else:
        split = head_split(heads, kv_heads, u)
        ring_layout, head_kv = ("contiguous" if R == 1 else grid.ring_runs(meta.seq_len, layout)), \
            split.q_per_rank // split.group
    summary = ring_summary(meta, spec.for_planning(), world_size=R, layout=ring_layout)
    token = head_kv * (head_dim + head_dim_v) * B  # elements of K and V of one token, all rows
    ring_s, rounds_R = _ring_seconds(summary, model, u, float(token * itemsize), float(token * GRAD_ITEMSIZE))
    rank_P = np.arange(P)
    entries_P = summary.entries[rank_P // u]
    if u > 1:  # each member of a head group computes its share of its ring rank's heads
        me_P = rank_P % u
        entries_P = entries_P * (me_P + 1) // u - entries_P * me_P // u
    compute_P = _compute_seconds(entries_P, model, heads * 2 * (head_dim + head_dim_v))
    rounds_P = rounds_R[rank_P // u] + (2 if u > 1 else 0)
    body_P = np.maximum(compute_P, ring_s) if model.overlap else compute_P + ring_s
    a2a_P = _a2a_seconds(meta, layout, model, grid, heads, kv_heads, head_dim, head_dim_v, itemsize) if u > 1 \
        else np.zeros(P)
    time_P = (a2a_P + body_P) + (2 * rounds_P).astype(np.float64) * model.latency
    return max(0.0, float(time_P.max()))


def _compute_seconds(entries_P: np.ndarray, model, flops_per_entry: int) -> np.ndarray:
    """``entries x flops_per_entry x (1 + backward) / throughput``, the integer product exact before
    its one rounding to float, as Python's ints give it."""
    if entries_P.size and int(entries_P.max()) > np.iinfo(np.int64).max // max(flops_per_entry, 1):
        product = np.array([float(int(e) * flops_per_entry) for e in entries_P.tolist()])
    else:
        product = (entries_P * flops_per_entry).astype(np.float64)
    return product * (1 + model.backward) / model.throughput


def _side(bytes_, near, model) -> np.ndarray:
    """Seconds of one direction of an exchange with one peer per element (``near``: on the rank's node)."""
    return np.where(near, bytes_ / model.bandwidth, bytes_ / model.inter_node_bandwidth)


def _ring_seconds(summary: RingSummary, model, u: int, kv: float, grad: float) -> tuple[np.ndarray, np.ndarray]:
    """Every rank's ring exchanges, forward and backward, summed round by round in offset order as
    the plan's rounds are (K/V twice, then the dK/dV going back), and every ring rank's rounds.
    Ring rank ``g``'s plan serves the ``u`` members ``g u + m`` of its head group; member ``m``'s ring
    peers are the members ``m`` of the other head groups. Returns ((P,) seconds, (R,) rounds)."""
    R = summary.world_size
    P = R * u
    g_n, off_n, in_n, out_n = summary.rounds()
    count_R = np.bincount(g_n, minlength=R)
    pos_n = np.arange(len(g_n)) - np.repeat(np.cumsum(count_R) - count_R, count_R)  # index among its rounds
    m_u = np.arange(u)
    me = (g_n[:, None] * u + m_u).ravel()  # (n u,): each round of each member
    src = (((g_n - off_n) % R)[:, None] * u + m_u).ravel()
    dst = (((g_n + off_n) % R)[:, None] * u + m_u).ravel()
    n_in, n_out = np.repeat(in_n, u).astype(np.float64), np.repeat(out_n, u).astype(np.float64)
    near_src = me // model.ranks_per_node == src // model.ranks_per_node
    near_dst = me // model.ranks_per_node == dst // model.ranks_per_node
    kv_s = 2 * np.maximum(_side(n_out * kv, near_dst, model), _side(n_in * kv, near_src, model))
    grad_s = np.maximum(_side(n_in * grad, near_src, model), _side(n_out * grad, near_dst, model))
    terms = np.zeros((P, 2 * int(count_R.max(initial=0))))
    col = np.repeat(pos_n, u) * 2
    terms[me, col], terms[me, col + 1] = kv_s, grad_s
    seconds = np.cumsum(terms, axis=1)[:, -1] if terms.shape[1] else np.zeros(P)  # in order, one add at a time
    return seconds, count_R


def _a2a_seconds(meta, layout, model, grid: Grid, heads: int, kv_heads: int, head_dim: int, head_dim_v: int,
                 itemsize: int) -> np.ndarray:
    """Every rank's two all-to-alls with its head group, forward and backward (the bytes of
    :func:`~cp_attention.strategies.ulysses.exchange_bytes`, per peer, near or far). (P,) seconds."""
    P, u, B = grid.world_size, grid.ulysses, meta.batch
    split = head_split(heads, kv_heads, u)
    h = split.q_per_rank
    size_gu = np.array(rank_runs(meta.seq_len, P, layout).sizes, dtype=np.int64).reshape(-1, u)
    per_token_u = np.array([h * head_dim + split.kv_count(j) * (head_dim + head_dim_v) for j in range(u)],
                           dtype=np.int64) * B * itemsize  # q of member j's heads, the K/V heads it uses
    out_token = B * h * head_dim_v * itemsize
    other_uu = ~np.eye(u, dtype=bool)
    # [g, me, j]: member me of head group g with member j
    sent_qkv = size_gu[:, :, None] * per_token_u[None, None, :] * other_uu
    recv_qkv = size_gu[:, None, :] * per_token_u[None, :, None] * other_uu
    sent_out = size_gu[:, None, :] * out_token * other_uu
    recv_out = size_gu[:, :, None] * out_token * other_uu
    rank_gu = np.arange(P).reshape(-1, u) // model.ranks_per_node
    near = rank_gu[:, :, None] == rank_gu[:, None, :]

    def side(bytes_gu: np.ndarray) -> np.ndarray:
        return np.maximum((bytes_gu * near).sum(-1) / model.bandwidth,
                          (bytes_gu * ~near).sum(-1) / model.inter_node_bandwidth)

    a2a = 2 * np.maximum(side(sent_qkv), side(recv_qkv))
    a2a = a2a + 2 * np.maximum(side(sent_out), side(recv_out))
    return a2a.reshape(P)
