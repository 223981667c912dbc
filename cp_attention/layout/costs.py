"""The cost and traffic models of balanced layouts (pure, closed form; see :mod:`.balanced`).

A rank's cost is the (query, key) pairs its queries see, summed over the model's attention layers and
the batch rows, plus ``token_weight`` per token and row. A token's cost is linear in its index between
segment edges and window kinks, so the cost of any token range is a quadratic per document piece
(:class:`Costs`) and nothing is read per token. :class:`Traffic` counts the K/V tokens a rank holding
some runs receives, as the planner would.

Legend: ``N`` segments, ``E`` events of a piecewise linear function, ``L`` tokens per row.
"""

from __future__ import annotations

import bisect
import math

import numpy as np
import torch

from ..masks import MaskSpec, SequenceMeta, segment_runs
from .layouts import merge_ranges

__all__ = ["Costs", "CostWindow", "Traffic", "token_costs", "layer_specs", "documents", "document_arrays", "settle"]


def _spec(mask: dict | MaskSpec) -> MaskSpec:
    if isinstance(mask, MaskSpec):
        return mask
    unknown = set(mask) - {"causal", "window", "chunk_size"}
    if unknown:
        raise ValueError(f"masks: each layer is a dict of attention()'s causal/window/chunk_size, got {sorted(unknown)}")
    return MaskSpec(**mask)


def layer_specs(masks) -> list[tuple[int, MaskSpec]]:
    """The distinct layer masks, each ``(count, spec)``: how many layers use it."""
    masks = [{}] if masks is None else list(masks)
    if not masks:
        raise ValueError("masks: give at least one layer (default: one plain causal layer)")
    counts: dict[MaskSpec, int] = {}
    for mask in masks:
        spec = _spec(mask).for_planning()  # softcap and scale change no visible pair
        counts[spec] = counts.get(spec, 0) + 1
    return [(count, spec) for spec, count in counts.items()]


def _events(s: np.ndarray, e: np.ndarray, spec: MaskSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The visible keys of a query of segment ``[s, e)`` under ``spec``, for segments ``s``, ``e``
    (N,) int64, as a piecewise linear function of the query's index: events ``(at, jump, slope)``,
    each (E,) int64, where the function's value jumps by ``jump`` and its slope changes by ``slope``.

    With ``R = window - 1`` (no window: no kink) and ``n = e - s``, query ``q`` sees

    * causal: ``min(q - s, R) + 1`` keys: 1 at ``s``, one more per token until ``s + R``;
    * bidirectional, no window: ``n`` keys;
    * bidirectional: ``min(q - s, R)`` keys before it (0 at ``s``, one more per token until ``s + R``)
      and ``min(e - q, R + 1)`` from it on (falling by one per token from ``e - R - 1``, to 0 at ``e``).

    Each part ends at ``e`` with a jump back to 0 and the slope it had removed."""
    n, one, zero = e - s, np.ones_like(s), np.zeros_like(s)
    if spec.window is None and not spec.causal:
        return np.concatenate((s, e)), np.concatenate((n, -n)), np.concatenate((zero, zero))
    R = n if spec.window is None else np.minimum(n, spec.window - 1)  # the rise's length (n: no kink)
    rises = R < n
    at = [s, (s + R)[rises], e]
    jump = [one if spec.causal else zero, zero[rises], -R - 1 if spec.causal else -R]
    slope = [one, -one[rises], -(~rises).astype(np.int64)]
    if not spec.causal:
        fall = e - spec.window  # = e - R - 1: from here on the keys at and after q fall by one per token
        flat = fall > s
        at += [s, fall[flat]]
        jump += [np.minimum(n, spec.window), zero[flat]]
        slope += [-(~flat).astype(np.int64), -one[flat]]
        slope[2] = slope[2] + 1  # the falling part ends at e, at 0, with slope -1
    return np.concatenate(at), np.concatenate(jump), np.concatenate(slope)


class Costs(dict):
    """The cost of every prefix of the row: ``costs[i]`` (a float) is the cost of tokens ``[0, i)``,
    ``0 <= i <= L`` (``len(costs) == L + 1``), in closed form, without an array per token.

    A token's cost as a query (its visible keys summed over the layers and rows, plus ``token_weight``
    x B) is linear in its index between *knots* (the segments' edges in every row and layer, and
    where a window stops widening or starts narrowing: :func:`_events`), so between knots a prefix's
    cost is quadratic: with ``u`` the last knot at or before ``i`` and ``n = i - u``, ``[0, i)`` holds
    ``pairs(u) + n value(u) + slope(u) n (n - 1) / 2`` visible pairs (exact integers) and costs that
    plus ``token_weight x B x i``: the floats a running sum of the per-token costs gives wherever that
    sum is exact (integer token weights), else the exact cost rounded once (a running sum drifts).
    :meth:`left` answers ``bisect``'s question over the whole row from the quadratic's root, settled
    by a few exact comparisons. O(knots) to build. A dict of the prefixes
    read so far, the knots from the start: a read is a lookup (the partition reads documents' edges
    again and again), else a bisection over the knots. :meth:`window` gives one document's view.
    """

    def __init__(self, meta: SequenceMeta, layers: list[tuple[int, MaskSpec]], token_weight: float):
        super().__init__()
        L = meta.seq_len
        at, jump, slope = [np.array([L])], [np.zeros(1, dtype=np.int64)], [np.zeros(1, dtype=np.int64)]  # the end
        for count, spec in layers:
            for starts, ends in segment_runs(meta, spec.chunk_size):
                a, j, s = _events(starts, ends, spec)
                at.append(a)
                jump.append(count * j)
                slope.append(count * s)
        knots, which = np.unique(np.concatenate(at), return_inverse=True)
        jump_K, slope_K = np.zeros(len(knots), dtype=np.int64), np.zeros(len(knots), dtype=np.int64)
        np.add.at(jump_K, which, np.concatenate(jump))
        np.add.at(slope_K, which, np.concatenate(slope))
        slope_K = np.cumsum(slope_K)  # the slope from each knot to the next
        n_K = np.diff(knots)
        value_K = np.cumsum(jump_K + np.concatenate(([0], slope_K[:-1] * n_K)))  # a query's keys at the knot
        pairs_K = np.concatenate(([0], np.cumsum(n_K * value_K[:-1] + slope_K[:-1] * (n_K * (n_K - 1) // 2))))
        self.L, self.weight = L, float(token_weight) * meta.batch
        self.arrays = (knots, pairs_K, value_K, slope_K)
        self.knots, self.pairs, self.value, self.slope = (x.tolist() for x in self.arrays)
        self.at_knots = (pairs_K + self.weight * knots).tolist()  # costs at the knots, increasing
        self.update(zip(self.knots, self.at_knots))  # the documents' edges, read first

    def __missing__(self, i: int) -> float:
        k = bisect.bisect_right(self.knots, i) - 1
        n = i - self.knots[k]
        c = self[i] = self.pairs[k] + n * self.value[k] + self.slope[k] * (n * (n - 1) // 2) + self.weight * i
        return c

    def __len__(self) -> int:
        return self.L + 1

    def window(self, a: int, b: int) -> CostWindow:
        """The costs of the prefixes of the row's tokens ``[a, b)``: ``cs[i] = costs[a + i] - costs[a]``."""
        return CostWindow(self, a, b)

    def prefix(self, idx: np.ndarray) -> np.ndarray:
        """``costs[i]`` for every ``i`` of ``idx`` (int64 numpy), float64 of its shape."""
        knots, pairs, value, slope = self.arrays
        k = np.searchsorted(knots, idx, side="right") - 1
        n = idx - knots[k]
        return pairs[k] + n * value[k] + slope[k] * (n * (n - 1) // 2) + self.weight * idx

    def left(self, v: float) -> int:
        """``bisect.bisect_left(costs, v)``: the first ``i`` with ``costs[i] >= v``, else ``L + 1``."""
        return settle(lambda i: self[i] >= v, self._guess(v), 0, self.L + 1)

    def right(self, v: float) -> int:
        """``bisect.bisect_right(costs, v)``: the first ``i`` with ``costs[i] > v``, else ``L + 1``."""
        return settle(lambda i: self[i] > v, self._guess(v), 0, self.L + 1)

    def _guess(self, v: float) -> int:
        """About the first ``i`` with ``costs[i] >= v``: the root of the quadratic of its knots' run."""
        k = bisect.bisect_left(self.at_knots, v)
        if k == 0 or k == len(self.knots):
            return 0 if k == 0 else self.L + 1
        k -= 1
        u, w, slope = self.knots[k], self.weight, self.slope[k]
        # a n^2 + b n + c: the cost of [u, u + n) less v - costs[u] (> 0), rising through 0 at the answer
        a, b, c = slope / 2, self.value[k] - slope / 2 + w, self.at_knots[k] - v
        root = b + math.sqrt(max(b * b - 4 * a * c, 0.0))
        n = math.ceil(-2 * c / root) if root > 0 else 1
        return min(max(n, 1), self.knots[k + 1] - u) + u


class CostWindow(dict):
    """One document's prefix costs (:meth:`Costs.window`): ``cs[i] = costs[a + i] - costs[a]`` for
    ``0 <= i <= b - a`` (``len(cs) == b - a + 1``), a dict filled on first read like :class:`Costs`
    (the splits of a document read it thousands of times, mostly the same prefixes again);
    ``left``/``right`` are ``bisect``'s on it."""

    def __init__(self, costs: Costs, a: int, b: int):
        super().__init__()
        self.costs, self.a, self.base, self.size = costs, a, costs[a], b - a + 1

    def __missing__(self, i: int) -> float:
        c = self[i] = self.costs[self.a + i] - self.base
        return c

    def __len__(self) -> int:
        return self.size

    def left(self, v: float, lo: int = 0, hi: int | None = None) -> int:
        """``bisect.bisect_left(cs, v, lo, hi)``: searched outwards from the row's closed-form root
        (:meth:`Costs._guess`), settled by exact comparisons of these prefixes."""
        return settle(lambda i: self[i] >= v, self.costs._guess(v + self.base) - self.a, lo,
                       self.size if hi is None else hi)

    def right(self, v: float, lo: int = 0, hi: int | None = None) -> int:
        """``bisect.bisect_right(cs, v, lo, hi)`` (as :meth:`left`)."""
        return settle(lambda i: self[i] > v, self.costs._guess(v + self.base) - self.a, lo,
                       self.size if hi is None else hi)


def settle(pred, guess: int, lo: int, hi: int) -> int:
    """The first ``i`` in ``[lo, hi)`` where ``pred`` (false, then true) holds, else ``hi``: what
    ``bisect`` finds, searched outwards from ``guess`` (two calls of ``pred`` when it is right)."""
    i = min(max(guess, lo), hi)
    step = 1
    if i == hi or pred(i):  # the answer is at or below i: step down, doubling
        good, bad = i, None
        while bad is None:
            j = good - step
            if j < lo:
                bad = lo - 1
            elif pred(j):
                good, step = j, 2 * step
            else:
                bad = j
    else:  # above i: step up, doubling
        good, bad = None, i
        while good is None:
            j = bad + step
            if j >= hi:
                good = hi
            elif pred(j):
                good = j
            else:
                bad, step = j, 2 * step
    while good - bad > 1:
        mid = (good + bad) // 2
        if pred(mid):
            good = mid
        else:
            bad = mid
    return good


def token_costs(meta: SequenceMeta, masks=None, token_weight: float = 0.0) -> torch.Tensor:
    """(L,) float64 cost of each token index as a query: visible keys summed over ``masks`` (one
    entry per attention layer; default one plain causal layer) and the B rows, plus
    ``token_weight`` x B (the differences of :class:`Costs`)."""
    costs = Costs(meta, layer_specs(masks), token_weight)
    return torch.from_numpy(np.diff(costs.prefix(np.arange(meta.seq_len + 1))))


def documents(meta: SequenceMeta) -> list[tuple[int, int]]:
    """Items: the index ranges between the union of every row's document boundaries."""
    return list(zip(*(x.tolist() for x in document_arrays(meta))))


def document_arrays(meta: SequenceMeta) -> tuple[np.ndarray, np.ndarray]:
    """:func:`documents` as arrays: starts and ends, each (D,) int64."""
    if meta.starts is None:
        return np.zeros(1, dtype=np.int64), np.full(1, meta.seq_len, dtype=np.int64)
    starts = np.unique(np.concatenate(meta.starts)).astype(np.int64)
    return starts, np.append(starts[1:], meta.seq_len)


def _union_segments(meta: SequenceMeta, chunk_size: int | None) -> tuple[list[int], list[int], list[int]]:
    """The attention segments of every row as step functions of the token index over the union of
    their starts ``knots``: from ``knots[k]`` to the next, the first token of a segment holding the
    token in some row is ``lo[k]`` (the least over the rows) and the end of one ``hi[k]`` (the greatest)."""
    rows = segment_runs(meta, chunk_size)
    knots = np.unique(np.concatenate([starts for starts, _ in rows]))
    at = [np.searchsorted(starts, knots, side="right") - 1 for starts, _ in rows]
    lo = np.min([starts[k] for (starts, _), k in zip(rows, at)], axis=0)
    hi = np.max([ends[k] for (_, ends), k in zip(rows, at)], axis=0)
    return knots.tolist(), lo.tolist(), hi.tolist()


class Traffic:
    """K/V tokens a rank holding ``runs`` receives: every key its queries see that it does not hold,
    the planner's count (one row's worth; a union over the rows). :meth:`recv` gives
    ``(heaviest layer, all layers)``: the layer whose keys reach furthest (a full layer if there is
    one) is what a rank waits for, windowed layers' halos are bounded by their windows; the total
    breaks ties."""

    def __init__(self, meta: SequenceMeta, layers: list[tuple[int, MaskSpec]]):
        segments: dict[int | None, tuple] = {}
        self.layers = []
        for count, spec in layers:
            if spec.chunk_size not in segments:
                segments[spec.chunk_size] = _union_segments(meta, spec.chunk_size)
            knots, lo, hi = segments[spec.chunk_size]
            reach = meta.seq_len if spec.window is None else spec.window - 1
            self.layers.append((count, reach, knots, lo, None if spec.causal else hi))
        self.layers.sort(key=lambda layer: (-layer[1], layer[4] is None))  # the heaviest first

    def recv(self, runs) -> tuple[int, int]:
        out = []
        for count, reach, knots, lo, hi in self.layers:
            need = []
            for p, q in runs:
                s = max(lo[bisect.bisect_right(knots, p) - 1], p - reach)
                if s < p:
                    need.append((s, p))
                if hi is not None:
                    e = min(hi[bisect.bisect_right(knots, q - 1) - 1], q + reach)
                    if e > q:
                        need.append((q, e))
            n = 0
            for a, b in merge_ranges(need):
                n += b - a - sum(max(0, min(b, q) - max(a, p)) for p, q in runs)
            out.append((n, count))
        return out[0][0], sum(n * count for n, count in out)
