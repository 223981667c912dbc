"""The one harness behind every benchmark script: :mod:`cp_attention.tools.harness` (shared with
``cp-attention bench`` and ``gpu_check.py``) and the helpers of the scripts here.

What it provides:

* From :mod:`cp_attention.tools.harness`: :class:`MaskCase`, a named mask (causal, sliding
  window, packed documents, chunked) with its global metadata, position ids, dense mask (for the
  baselines) and :func:`flops`, which counts only the (query, key) pairs the mask keeps;
  :func:`measure`: warm-up, then repeats interleaved across implementations (so a noisy, shared
  machine slows every contender alike), median / min / max per implementation; CUDA events on a
  GPU, wall clock on a CPU; :func:`pick_device`, :func:`dtype_of`.
* :func:`parse_mask` (the masks' names on the command line) and :func:`document_lengths` (a
  realistic mix of packed document lengths).
* :func:`peak_memory`: extra memory one call needs beyond its inputs. GPU: the allocator's peak
  (``torch.cuda.max_memory_allocated``). CPU: the resident-set high-water mark of a fresh
  subprocess (glibc told to return every freed block of 64 KiB or more to the system, so resident
  memory tracks live memory): warm up on a tiny problem, build the inputs, read the resident set,
  reset the high-water mark (``/proc/self/clear_refs``), run once, read it again.
* Traffic: per-rank K/V bytes of our plan (:class:`cp_attention.PlanStats`), of a full ring and of an
  all-gather of K/V, and the exact halo the mask needs (:func:`traffic`).
* Execution helpers shared by the context-parallel benchmarks: :func:`full_ring_plan` and
  :func:`all_gather_plan` (the baselines as plans run by the same ring and kernels),
  :class:`TimedBackend` (time spent in kernel calls), :class:`SimComm` (every rank of a world in
  one process, for a single GPU), :func:`rank_device`, :func:`timed_backend`,
  :func:`attention_inputs`, :func:`ring_step` (forward+backward of one rank's plan) and
  :func:`timed_step`.
* :func:`write_results` / :func:`load_results` / :func:`latest_results`: one JSON file per
  benchmark run; :func:`add_run_arguments` / :func:`add_shape_arguments`: the command-line options
  every script shares.

Legend: ``B`` batch rows, ``L`` global length, ``S`` a rank's local length, ``H`` query heads,
``K`` K/V heads, ``D`` head dim, ``P`` world size.
"""

from __future__ import annotations

import argparse
import gc
import glob
import importlib.util
import json
import math
import multiprocessing as mp
import os
import platform
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from cp_attention import layout as layout_mod
from cp_attention.backends import select_backend
from cp_attention.comm import Comm
from cp_attention.masks import MaskSpec, SequenceMeta
from cp_attention.plan import PlanStats, RankPlan, Round, Step, build_local_plan, build_plan
from cp_attention.strategies.ring import ring_attention
from cp_attention.tools.harness import (MaskCase, SimComm, Timing, dtype_of, flops, key_intervals, measure,
                                        pick_device, synchronize, visible_pairs)

__all__ = [
    "MaskCase", "parse_mask", "document_lengths", "flops", "visible_pairs",
    "Timing", "measure", "peak_memory", "Workload",
    "traffic", "needed_halo_tokens", "full_ring_plan", "all_gather_plan", "TimedBackend", "SimComm",
    "rank_device", "timed_backend", "attention_inputs", "ring_step", "timed_step",
    "machine_info", "memory_budget", "write_results", "finish_run", "load_results", "latest_results", "pick_device",
    "dtype_of",
    "add_run_arguments", "add_shape_arguments",
]

SCHEMA = 1
MIB = 1 << 20


# ----------------------------------------------------------------------------------------------
# masks


def document_lengths(seq_len: int, *, seed: int = 0, median: int = 768, max_len: int | None = None) -> list[int]:
    """A realistic mix of packed document lengths filling ``seq_len`` tokens: log-normal lengths
    (median ``median`` tokens, a long tail) clipped to ``[32, max_len or seq_len]``, the last one
    cut to fit. The same seed gives the same prefix of documents for every ``seq_len``."""
    gen = torch.Generator().manual_seed(seed)
    cap = max_len or seq_len
    lengths: list[int] = []
    while sum(lengths) < seq_len:
        draw = math.exp(math.log(median) + float(torch.randn((), generator=gen)))
        lengths.append(int(min(cap, max(32, round(draw)))))
    lengths[-1] -= sum(lengths) - seq_len
    if lengths[-1] <= 0:
        lengths.pop()
    return lengths


def parse_mask(name: str, seq_len: int, *, seed: int = 0, max_document: int | None = None) -> MaskCase:
    """``"causal"``, ``"window:W"``, ``"chunked:C"``, ``"documents"`` (a realistic length mix) or
    ``"documents:N"`` (documents of at most N tokens) -> :class:`MaskCase` for ``seq_len`` tokens."""
    kind, _, arg = name.partition(":")
    if kind == "causal" and not arg:
        return MaskCase(name=name, spec=MaskSpec())
    if kind == "window" and arg.isdigit():
        return MaskCase(name=name, spec=MaskSpec(window=int(arg)))
    if kind == "chunked" and arg.isdigit():
        return MaskCase(name=name, spec=MaskSpec(chunk_size=int(arg)))
    if kind == "documents" and (not arg or arg.isdigit()):
        cap = int(arg) if arg else max_document
        median = 768 if cap is None else min(768, max(32, cap // 2))
        return MaskCase(name=name, spec=MaskSpec(),
                        documents=tuple(document_lengths(seq_len, seed=seed, median=median, max_len=cap)))
    raise ValueError(f"unknown mask {name!r}; valid: 'causal', 'window:W', 'chunked:C', 'documents', 'documents:N'")


# ----------------------------------------------------------------------------------------------
# machine


def machine_info(device: torch.device, note: str | None = None) -> dict:
    """What ran the benchmark: device, torch version, threads, and a free-text ``note`` (e.g. the
    machine's description, which cannot be read reliably from inside a VM)."""
    info = dict(device=device.type, torch=torch.__version__, python=platform.python_version(),
                cpu_count=os.cpu_count(), torch_threads=torch.get_num_threads(), note=note)
    if device.type == "cuda":
        info.update(gpu=torch.cuda.get_device_name(device), gpu_count=torch.cuda.device_count(),
                    gpu_memory_gib=round(torch.cuda.get_device_properties(device).total_memory / (1 << 30), 1))
    return info


def memory_budget(device: torch.device) -> int:
    """Bytes a benchmark may plan to use: 80% of the free GPU memory, or 60% of the available RAM."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(0.8 * free)
    with open("/proc/meminfo") as f:
        return int(0.6 * next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable")))


# ----------------------------------------------------------------------------------------------
# peak memory


@dataclass(frozen=True)
class Workload:
    """A benchmark workload that a fresh process can rebuild: ``factory(**kwargs)`` in the script
    ``path`` builds the inputs and returns a zero-argument callable that runs the workload once."""

    path: str
    factory: str
    kwargs: dict

    def build(self) -> Callable[[], object]:
        return getattr(_load_script(self.path), self.factory)(**self.kwargs)


_SCRIPTS: dict[str, object] = {}


def _load_script(path: str):
    path = os.path.abspath(path)
    if path not in _SCRIPTS:
        name = "_bench_" + os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _SCRIPTS[path] = module
    return _SCRIPTS[path]


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _memory_child(jobs: list[tuple[Workload, Workload | None]], threads: int, conn) -> None:
    try:
        torch.set_num_threads(threads)
        peaks = []
        for workload, warm in jobs:
            if warm is not None:  # load kernels and libraries on a tiny problem first
                warm.build()()
            run = workload.build()
            gc.collect()
            base = _status_kib("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset the resident-set high-water mark
            run()
            peaks.append((_status_kib("VmHWM") - base) * 1024)
            del run
            gc.collect()
        conn.send(("ok", peaks))
    except BaseException as exc:  # report, never hang the parent
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


def peak_memory(workloads: list[Workload], *, device: torch.device, warm: list[Workload | None] | None = None,
                threads: int = 1, timeout: float = 3600.0) -> list[int]:
    """Bytes one run of each workload needs beyond its inputs (see the module docstring for how).

    On CUDA each workload runs in this process (built, run once to warm up, then measured). On CPU
    the workloads run one after another in one fresh subprocess with ``threads`` torch threads;
    each is preceded by one run of its ``warm`` workload (a tiny problem of the same kind), its
    inputs are built, and only the run itself is measured.
    """
    warm = warm or [None] * len(workloads)
    if device.type == "cuda":
        peaks = []
        for workload in workloads:
            run = workload.build()
            run()
            synchronize(device)
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            run()
            synchronize(device)
            peaks.append(int(torch.cuda.max_memory_allocated(device) - base))
            del run
            gc.collect()
            torch.cuda.empty_cache()
        return peaks
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    saved = {k: os.environ.get(k) for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "OMP_NUM_THREADS")}
    os.environ.update(MALLOC_MMAP_THRESHOLD_=str(64 * 1024), MALLOC_TRIM_THRESHOLD_=str(128 * 1024),
                      OMP_NUM_THREADS=str(threads))
    try:
        proc = ctx.Process(target=_memory_child, args=(list(zip(workloads, warm)), threads, child), daemon=True)
        proc.start()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    child.close()
    try:
        if not parent.poll(timeout):
            raise RuntimeError(f"memory measurement took over {timeout:.0f}s")
        status, payload = parent.recv()
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if status != "ok":
        raise RuntimeError(f"memory measurement failed: {payload}")
    return [int(p) for p in payload]


# ----------------------------------------------------------------------------------------------
# traffic


def _token_bytes(batch: int, head_kv: int, head_dim: int, itemsize: int) -> int:
    return 2 * batch * head_kv * head_dim * itemsize  # K and V


def needed_halo_tokens(meta: SequenceMeta, spec: MaskSpec, *, world_size: int, layout: str) -> list[int]:
    """Per rank: how many other ranks' tokens its queries see at all (the least any plan must
    receive), counted per batch row and summed; computed from the mask model, not the planner."""
    first_BL, last_BL = key_intervals(meta, spec)
    L = meta.seq_len
    needed = []
    for r in range(world_size):
        q_idx = layout_mod.global_index(L, world_size, layout, r)
        first, last = first_BL[:, q_idx], last_BL[:, q_idx]
        total = 0
        for b in range(meta.batch):
            keep = last[b] > first[b]
            cover = torch.zeros(L + 1, dtype=torch.int64)
            cover.index_add_(0, first[b][keep], torch.ones(int(keep.sum()), dtype=torch.int64))
            cover.index_add_(0, last[b][keep], -torch.ones(int(keep.sum()), dtype=torch.int64))
            seen = torch.cumsum(cover, 0)[:L] > 0
            seen[q_idx] = False  # own tokens travel nowhere
            total += int(seen.sum())
        needed.append(total)
    return needed


def traffic(meta: SequenceMeta, spec: MaskSpec, *, world_size: int, layout: str, head_kv: int, head_dim: int,
            itemsize: int) -> list[dict]:
    """Forward K/V bytes per rank for our plan, a full ring and an all-gather, plus the halo the
    mask needs. A full ring delivers every other shard to every rank and forwards as much; an
    all-gather receives the same P-1 shards per rank (and, in a ring all-gather, sends as many)."""
    P, L = world_size, meta.seq_len
    sizes = layout_mod.local_lengths(L, P, layout)
    token = _token_bytes(meta.batch, head_kv, head_dim, itemsize)
    needed = needed_halo_tokens(meta, spec, world_size=P, layout=layout)
    rows = []
    for r in range(P):
        st = build_plan(meta, spec, world_size=P, layout=layout, rank=r, head_kv=head_kv, head_dim=head_dim,
                        itemsize=itemsize).stats
        others = (L - sizes[r]) * token
        rows.append(dict(
            rank=r, local_len=sizes[r], ours_sent=st.kv_bytes_sent, ours_recv=st.kv_bytes_recv, ours_rounds=st.rounds,
            ours_peers_recv=list(st.peers_recv), ring_sent=(P - 1) * sizes[r] * token, ring_recv=st.ring_kv_bytes_recv,
            ring_rounds=P - 1, allgather_sent=(P - 1) * sizes[r] * token, allgather_recv=others, allgather_rounds=1,
            halo_needed_recv=needed[r] * token, kernel_calls=st.kernel_calls,
            entries_computed=st.entries_computed, entries_visible=st.entries_visible))
        assert rows[-1]["ring_recv"] == others
    return rows


# ----------------------------------------------------------------------------------------------
# baselines as plans: the same ring and kernels, different traffic


def full_ring_plan(meta: SequenceMeta, spec: MaskSpec, *, world_size: int, layout: str, rank: int,
                   head_kv: int, head_dim: int, itemsize: int) -> RankPlan:
    """A plan that visits every shard, as ring attention does: in round ``t`` the rank receives the
    whole shard of rank ``rank - t`` (straight from its owner) and sends its whole shard to
    ``rank + t``; the kernel calls are exactly the visible pairs (nothing extra is computed), so
    the baseline differs from our plan only in what travels and how many rounds it takes."""
    P, L, B = world_size, meta.seq_len, meta.batch
    idx = [layout_mod.global_index(L, P, layout, r) for r in range(P)]
    own = build_plan(meta, spec, world_size=P, layout=layout, rank=rank, head_kv=head_kv, head_dim=head_dim,
                     itemsize=itemsize)
    token = _token_bytes(B, head_kv, head_dim, itemsize)
    rounds = []
    calls = []
    for t in range(1, P):
        src = (rank - t) % P
        lp = build_local_plan(meta, spec, q_idx=idx[rank], k_idx=idx[src])
        step_calls = lp.local.calls if lp.local is not None else ()
        calls.extend(step_calls)
        rounds.append(Round(offset=t, recv=Step(source=src, spans=((0, idx[src].numel()),), calls=step_calls),
                            send_to=(rank + t) % P, send_spans=((0, idx[rank].numel()),)))
    local_calls = own.local.calls if own.local is not None else ()
    all_calls = list(local_calls) + calls
    recv_tokens = L - idx[rank].numel()
    stats = PlanStats(
        rank=rank, world_size=P, kernel_calls=len(all_calls), rounds=P - 1,
        peers_recv=tuple((rank - t) % P for t in range(1, P)), peers_send=tuple((rank + t) % P for t in range(1, P)),
        kv_bytes_recv=recv_tokens * token, kv_bytes_sent=(P - 1) * idx[rank].numel() * token,
        grad_bytes_recv=(P - 1) * idx[rank].numel() * token * 4 // itemsize,
        grad_bytes_sent=recv_tokens * token * 4 // itemsize,
        ring_kv_bytes_recv=recv_tokens * token,
        entries_computed=sum(c.entries_computed for c in all_calls),
        entries_visible=sum(c.entries_visible for c in all_calls))
    return RankPlan(rank=rank, world_size=P, batch=B, local_len=idx[rank].numel(), local=own.local,
                    rounds=tuple(rounds), stats=stats)


def all_gather_plan(meta: SequenceMeta, spec: MaskSpec, *, world_size: int, layout: str, rank: int) -> RankPlan:
    """The single-device plan of ``rank``'s queries against every key in global order: what a rank
    computes after an all-gather of K/V (Llama-3-style context parallelism, PyTorch's
    FlexAttention CP). Run it with ``Comm(single=True)`` on the gathered (B, L, K, D) K/V."""
    q_idx = layout_mod.global_index(meta.seq_len, world_size, layout, rank)
    return build_local_plan(meta, spec, q_idx=q_idx, k_idx=torch.arange(meta.seq_len))


# ----------------------------------------------------------------------------------------------
# execution helpers


class TimedBackend:
    """Wraps a varlen backend and adds up the time of its kernel calls: CUDA events on a GPU
    (summed by :meth:`seconds`, which synchronises), else the calling thread's CPU time, which a
    shared, busy machine does not inflate by preempting the rank."""

    def __init__(self, inner, device: torch.device):
        self.inner = inner
        self.name = inner.name
        self.device = device
        self._cpu = 0.0
        self._events: list = []

    def not_supported_reasons(self, **kw) -> list[str]:
        return self.inner.not_supported_reasons(**kw)

    def reset(self) -> None:
        self._cpu, self._events = 0.0, []

    def seconds(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return sum(a.elapsed_time(b) for a, b in self._events) / 1e3
        return self._cpu

    def _timed(self, fn, *args, **kw):
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = fn(*args, **kw)
            end.record()
            self._events.append((start, end))
            return result
        t0 = time.thread_time()
        result = fn(*args, **kw)
        self._cpu += time.thread_time() - t0
        return result

    def forward(self, *args, **kw):
        return self._timed(self.inner.forward, *args, **kw)

    def backward(self, *args, **kw):
        return self._timed(self.inner.backward, *args, **kw)


def rank_device(rank: int, cfg: dict) -> tuple[torch.device, Comm]:
    """A spawned rank's device and comm: its own GPU and an NCCL group when ``cfg["device"]`` is
    ``"cuda"``, else the CPU (``cfg["threads"]`` torch threads) and the gloo WORLD."""
    if cfg["device"] == "cuda":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank), Comm(dist.new_group(backend="nccl"))
    torch.set_num_threads(cfg["threads"])
    return torch.device("cpu"), Comm(None)


def timed_backend(cfg: dict, device: torch.device, dtype: torch.dtype) -> TimedBackend:
    """The backend ``cfg["backend"]`` names (``"auto"``: the first that fits) for ``cfg["head_dim"]``
    in ``dtype`` on ``device``, wrapped in a :class:`TimedBackend`."""
    inner = select_backend(cfg["backend"], device=device, dtype=dtype, head_dim=cfg["head_dim"], spec=MaskSpec())
    return TimedBackend(inner, device)


def attention_inputs(cfg: dict, device: torch.device) -> list[torch.Tensor]:
    """Full (1, L, H, D) q, (1, L, K, D) k and v, (1, L, H, D) dout of ``cfg`` (``seq_len``,
    ``heads``, ``kv_heads``, ``head_dim``, ``dtype``) drawn from ``cfg["seed"]``: the same on every rank."""
    gen = torch.Generator().manual_seed(cfg["seed"])
    L, H, K, D = cfg["seq_len"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    dt = dtype_of(cfg["dtype"])
    shapes = ((1, L, H, D), (1, L, K, D), (1, L, K, D), (1, L, H, D))
    return [torch.randn(*s, generator=gen).to(device, dt) for s in shapes]


def ring_step(plan: RankPlan, shards: list[torch.Tensor], comm: Comm, backend, scale: float,
              gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Forward+backward of one rank's ``plan`` through the ring on its (q, k, v, dout) ``shards``;
    ``gather`` (optional) turns the rank's K/V into what the plan reads (the all-gather baseline).
    Returns the output, detached."""
    q, k, v, dout = shards
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    if gather is not None:
        k, v = gather(k), gather(v)
    out = ring_attention(q, k, v, None, plan, comm, backend, scale=scale, softcap=None)
    out.backward(dout)
    return out.detach()


def timed_step(timed: TimedBackend, run: Callable[[], object], *, before: Callable[[], object],
               sync: Callable[[], object]) -> tuple[object, float, float]:
    """One measured run: ``before()`` (a barrier, a synchronisation), then ``run()`` until ``sync()``
    returns; (its result, seconds inside ``timed``'s kernel calls, wall seconds)."""
    timed.reset()
    before()
    t0 = time.perf_counter()
    out = run()
    sync()
    elapsed = time.perf_counter() - t0
    return out, timed.seconds(), elapsed


# ----------------------------------------------------------------------------------------------
# results files


def write_results(path: str, *, benchmark: str, machine: dict, config: dict, results: list[dict]) -> str:
    """Write one benchmark run as JSON (creating the folder); returns ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    payload = dict(schema=SCHEMA, benchmark=benchmark, created=time.strftime("%Y-%m-%dT%H:%M:%S"),
                   argv=[os.path.basename(sys.argv[0])] + sys.argv[1:], machine=machine, config=config,
                   results=results)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, sort_keys=False)
        f.write("\n")
    return path


def finish_run(args, benchmark: str, device: torch.device, config: dict, results: list[dict], tables: list[str],
               started: float) -> str:
    """Write a script's run to ``{args.out}/{benchmark}[_{args.tag}].json`` and print its tables;
    returns the path."""
    name = benchmark + (f"_{args.tag}" if args.tag else "") + ".json"
    path = write_results(os.path.join(args.out, name), benchmark=benchmark, machine=machine_info(device, args.note),
                         config=config, results=results)
    print(f"\nwrote {path} ({time.perf_counter() - started:.0f}s)\n")
    print("\n".join(tables))
    return path


def load_results(path: str) -> dict:
    with open(path) as f:
        payload = json.load(f)
    if payload.get("schema") != SCHEMA:
        raise ValueError(f"{path}: unknown results schema {payload.get('schema')!r}")
    return payload


def latest_results(folder: str, prefix: str) -> dict | None:
    """The last (by name) ``PREFIX*.json`` results of ``folder`` written by the benchmark ``prefix``
    (another benchmark's file that shares the prefix, ``cp_layouts.json`` for ``cp``, is skipped),
    or None when there is none."""
    for path in sorted(glob.glob(os.path.join(folder, f"{prefix}*.json")), reverse=True):
        payload = load_results(path)
        if payload.get("benchmark", prefix) == prefix:
            return payload
    return None


# ----------------------------------------------------------------------------------------------
# command line


def add_run_arguments(parser: argparse.ArgumentParser, *, warmup: int, repeats: int, smoke: str,
                      threads: str = "torch threads on CPU") -> None:
    """How a script runs and where it writes: --smoke, --device, --warmup, --repeats, --threads,
    --out, --tag, --note."""
    parser.add_argument("--smoke", action="store_true", help=f"{smoke}, 1 repeat (CI)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--threads", type=int, default=1, help=threads)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--tag", default="", help="results file suffix: NAME_TAG.json")
    parser.add_argument("--note", default=None, help="machine description stored with the results")


def add_shape_arguments(parser: argparse.ArgumentParser, *, masks: bool = True) -> None:
    """The attention problem: --masks (unless ``masks`` is False), --heads, --kv-heads, --head-dim,
    --dtype, --backend."""
    if masks:
        parser.add_argument("--masks", nargs="+", help="causal, window:W, documents, documents:N, chunked:C")
    parser.add_argument("--heads", type=int)
    parser.add_argument("--kv-heads", type=int)
    parser.add_argument("--head-dim", type=int)
    parser.add_argument("--dtype")
    parser.add_argument("--backend", default=None, help="cp_flash backend (default: reference on CPU, auto on GPU)")
