"""What every benchmark shares: ``cp-attention bench``, the scripts of ``benchmarks/`` (through
``benchmarks/harness.py``, which adds their own helpers) and ``benchmarks/gpu_check.py``.

* Timing: :func:`time_once` (CUDA events, synchronised, on a GPU; wall clock on a CPU),
  :func:`median_time` (warm-up, then the median of N calls) and :func:`measure` (several
  implementations side by side, repeats interleaved so a noisy machine slows each alike).
* The dense-mask oracle: every query sees one contiguous run of keys ``[first, last)`` (its
  attention segment cut by the window band, :func:`key_intervals`; or the varlen contract's
  ``cp_attention.backends.base.row_key_intervals``), from which :func:`interval_mask` builds the
  dense boolean mask the baselines take (what ``cp_attention.masks.dense_mask`` gives, built on the
  target device from (L, L) booleans only) and :func:`interval_pairs` counts the visible pairs.
* :func:`pair_flops` / :func:`flops`: attention FLOPs that count only the visible pairs.
* :class:`MaskCase`: a named mask with its metadata, position ids, dense mask and the keyword
  arguments of ``cp_attention.attention``.
* :func:`pick_device`, :data:`DTYPES` / :func:`dtype_of`, :func:`synchronize`.

Legend: ``B`` batch rows, ``L`` global length, ``T`` query tokens, ``S`` key tokens.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable

import torch

from cp_attention.comm import Comm
from cp_attention.masks import MaskSpec, SequenceMeta, segment_bounds
from cp_attention.plan import RankPlan

__all__ = [
    "DTYPES", "dtype_of", "pick_device", "synchronize",
    "Timing", "time_once", "median_time", "measure",
    "key_intervals", "interval_mask", "interval_pairs", "dense_mask", "visible_pairs", "pair_flops", "flops",
    "MaskCase", "SimComm",
]

DTYPES = MappingProxyType({"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16})


# ----------------------------------------------------------------------------------------------
# devices and dtypes


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype named ``name`` (a key of :data:`DTYPES`); ValueError naming the valid ones."""
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def pick_device(name: str = "auto") -> torch.device:
    """``"auto"``: CUDA when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing to wait for on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------------------------
# timing


@dataclass(frozen=True)
class Timing:
    """Seconds per call: median, min, max over ``times`` (the measured repeats)."""

    median: float
    min: float
    max: float
    times: tuple[float, ...]

    def as_dict(self) -> dict:
        return dict(median_s=self.median, min_s=self.min, max_s=self.max, repeats=len(self.times),
                    times_s=list(self.times))


def time_once(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call of ``fn``: CUDA events around it, then a synchronisation, on a GPU; the
    wall clock on a CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median_time(fn: Callable[[], object], *, device: torch.device, warmup: int, repeats: int) -> float:
    """Median seconds of ``repeats`` timed calls (:func:`time_once`) after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    return statistics.median(time_once(fn, device) for _ in range(repeats))


def measure(fns: dict[str, Callable[[], object]], *, device: torch.device, warmup: int = 2, repeats: int = 5,
            min_repeats: int = 2, max_seconds: float = 120.0, slow_s: float = 2.0) -> dict[str, Timing]:
    """Time several implementations of one workload side by side.

    Warm-up: ``warmup`` calls each (one only when a call takes longer than ``slow_s``). Then up to
    ``repeats`` rounds, each calling every implementation once (in rotating order), stopping early
    once ``min_repeats`` rounds are done and ``max_seconds`` have passed.
    """
    names = list(fns)
    for name in names:
        for _ in range(max(warmup, 0)):
            if time_once(fns[name], device) > slow_s:
                break
    times: dict[str, list[float]] = {n: [] for n in names}
    started = time.perf_counter()
    for rnd in range(repeats):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        for name in order:
            times[name].append(time_once(fns[name], device))
        if rnd + 1 >= min_repeats and time.perf_counter() - started > max_seconds:
            break
    return {n: Timing(median=statistics.median(t), min=min(t), max=max(t), times=tuple(t)) for n, t in times.items()}


# ----------------------------------------------------------------------------------------------
# the dense-mask oracle and FLOPs


def key_intervals(meta: SequenceMeta, spec: MaskSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(first, last), (B, L) int64 each: query q of row b sees exactly the keys ``first <= k < last``
    (its attention segment, documents cut into chunks, intersected with the window band; empty
    when ``last <= first``)."""
    start_BL, end_BL = segment_bounds(meta, spec)
    lo, hi = spec.band()
    q_L = torch.arange(meta.seq_len)
    first_BL = torch.maximum(start_BL, q_L + int(max(lo, -meta.seq_len)))
    last_BL = torch.minimum(end_BL, q_L + int(min(hi, meta.seq_len)) + 1)
    return first_BL, last_BL


def interval_mask(first: torch.Tensor, last: torch.Tensor, num_keys: int,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """The dense boolean mask ``(..., num_keys)`` on ``device`` of per-query key intervals
    ``first <= k < last`` (both of any shape ``(...)``): True where the query sees the key."""
    k_S = torch.arange(num_keys, device=device)
    return (k_S >= first.to(device)[..., None]) & (k_S < last.to(device)[..., None])


def interval_pairs(first: torch.Tensor, last: torch.Tensor) -> int:
    """Number of visible (query, key) pairs of per-query key intervals ``first <= k < last``."""
    return int((last - first).clamp(min=0).sum())


def dense_mask(meta: SequenceMeta, spec: MaskSpec, device: torch.device | str = "cpu") -> torch.Tensor:
    """(B, L, L) bool on ``device``, True where query q sees key k: ``cp_attention.masks.dense_mask``
    built from :func:`key_intervals` with (L, L) booleans only (the dense baselines' input)."""
    return interval_mask(*key_intervals(meta, spec), meta.seq_len, device)


def visible_pairs(meta: SequenceMeta, spec: MaskSpec) -> int:
    """Number of (query, key) pairs the mask keeps, over all rows; O(B * L), no dense mask."""
    return interval_pairs(*key_intervals(meta, spec))


def pair_flops(pairs: int, *, heads: int, head_dim: int, backward: bool) -> float:
    """Floating-point operations of attention over ``pairs`` visible (query, key) pairs per head:
    the forward does two matrix products per pair (4 * pairs * D per head), the backward five
    (2.5x the forward); ``backward``: forward + backward."""
    forward = 4.0 * pairs * head_dim * heads
    return forward * (3.5 if backward else 1.0)


def flops(meta: SequenceMeta, spec: MaskSpec, *, heads: int, head_dim: int, backward: bool) -> float:
    """:func:`pair_flops` of the pairs the mask keeps (:func:`visible_pairs`)."""
    return pair_flops(visible_pairs(meta, spec), heads=heads, head_dim=head_dim, backward=backward)


@dataclass(kw_only=True, frozen=True)
class MaskCase:
    """A named mask over one row of ``L`` tokens: a :class:`MaskSpec` plus, for packed documents,
    the document lengths."""

    name: str
    """Label in tables and plots, e.g. ``"window:1024"``."""
    spec: MaskSpec
    """Causal flag, window and chunk size."""
    documents: tuple[int, ...] | None = None
    """Lengths of the packed documents (summing to ``L``); None: one document."""

    @property
    def kind(self) -> str:
        return self.name.split(":")[0]

    def position_ids(self, seq_len: int) -> torch.Tensor | None:
        """(1, L) int64 positions restarting at 0 in every document, or None for one document."""
        if self.documents is None:
            return None
        self._check(seq_len)
        return torch.cat([torch.arange(n) for n in self.documents]).unsqueeze(0)

    def meta(self, seq_len: int) -> SequenceMeta:
        """Global metadata of one row of ``seq_len`` tokens."""
        pos = self.position_ids(seq_len)
        return SequenceMeta.from_inputs(1, seq_len, position_ids=pos)

    def dense(self, seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """(L, L) bool mask on ``device``, True where query q sees key k (:func:`dense_mask`)."""
        return dense_mask(self.meta(seq_len), self.spec, device)[0]

    def attention_kwargs(self, seq_len: int) -> dict:
        """Keyword arguments of ``cp_attention.attention`` for this mask at world size 1."""
        return dict(causal=self.spec.causal, window=self.spec.window, chunk_size=self.spec.chunk_size,
                    position_ids=self.position_ids(seq_len))

    def _check(self, seq_len: int) -> None:
        if self.documents is not None and sum(self.documents) != seq_len:
            raise ValueError(f"mask {self.name!r}: documents sum to {sum(self.documents)}, not L = {seq_len}")


# ----------------------------------------------------------------------------------------------
# one process standing in for every rank


class SimComm(Comm):
    """Stands in for the process group when one process runs every rank's plan in turn (a single
    GPU simulating world size P). A receive of K/V copies the spans the plan names out of the
    sender's shard, as the network would deliver them; dK/dV partial sums coming back are received
    as zeros and sent ones are dropped (their cost is traffic, counted from the plan). The rank's
    compute is therefore exactly what it would do in a real job. Everything else is a
    single-process :class:`~cp_attention.comm.Comm`.

    ``k_shards``/``v_shards``: every rank's (B, S_r, K, D) shard, in rank order.
    """

    def __init__(self, plan: RankPlan, k_shards: list[torch.Tensor], v_shards: list[torch.Tensor]):
        super().__init__(single=True)
        self.rank, self.world_size = plan.rank, plan.world_size
        self._rounds = {r.offset: r for r in plan.schedule()}
        self._k, self._v = k_shards, v_shards
        self._sim_ops: list = []

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        pass

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        self._sim_ops.append((tensor, src, tag))

    def commit(self, *args, **kwargs):
        ops, self._sim_ops = self._sim_ops, []
        for buf, src, tag in ops:
            if tag >= self.world_size:  # dK/dV partial sums of my spans
                buf.zero_()
                continue
            at = 0
            for a, b in self._rounds[tag].recv.spans:
                buf[0, :, at:at + b - a].copy_(self._k[src][:, a:b])
                buf[1, :, at:at + b - a].copy_(self._v[src][:, a:b])
                at += b - a
        return super().commit(*args, **kwargs)  # nothing queued there: a completed exchange
