"""A persistent group of gloo ranks (local CPU processes) that runs one task after another.

``cp_attention.tools.launch.run_ranks`` spawns a fresh group per call; every rank then imports torch,
which costs seconds per rank. The fuzz tests evaluate many small batches (and hypothesis re-runs
shrunk batches while minimising a failure), so they keep one group per world size alive instead:

    pool = RankPool(3)
    per_rank = pool.run(fn, *args, timeout=300)   # fn(rank, world_size, *args) on every rank
    pool.close()

World size 1 runs in the calling process (no process group, one intra-op thread). A task that raises, hangs past its
timeout or kills a rank raises RuntimeError here with every rank's traceback; the group is then
closed (its ring may be out of step) and the next :meth:`run` starts a fresh one.
"""

from __future__ import annotations

import contextlib
import os
import queue as queue_mod
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cp_attention.tools.launch import free_port

__all__ = ["RankPool", "single_thread"]


@contextlib.contextmanager
def single_thread():
    """Run the block with one intra-op thread, like every spawned rank (restored afterwards).

    Small tensors gain nothing from more threads, and on a shared machine OpenMP threads that spin
    while another process holds a core make tiny ops many times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _serve(rank: int, world_size: int, port: int, tasks, results) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    except BaseException as exc:  # report, never hang the parent
        results.put((-1, rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        return
    try:
        while True:
            item = tasks.get()
            if item is None:
                break
            task_id, fn, args = item
            try:
                results.put((task_id, rank, "ok", fn(rank, world_size, *args)))
            except BaseException as exc:
                results.put((task_id, rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        dist.destroy_process_group()
    # every result was collected before the parent sent the stop: skip the interpreter's teardown
    # (seconds per rank with torch loaded)
    os._exit(0)


class RankPool:
    """``world_size`` ranks that stay alive between tasks (see the module docstring)."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._procs: list = []
        self._tasks: list = []
        self._results = None
        self._next_id = 0
        self.started = 0  # how many groups were spawned (restarts after a failed task included)

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = free_port()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [ctx.Process(target=_serve, args=(r, self.world_size, port, self._tasks[r], self._results),
                                   daemon=True) for r in range(self.world_size)]
        for p in self._procs:
            p.start()
        self.started += 1

    def run(self, fn, *args, timeout: float = 300.0) -> list:
        """``fn(rank, world_size, *args)`` on every rank; the results in rank order."""
        if self.world_size == 1:
            with single_thread():
                return [fn(0, 1, *args)]
        if not self._procs:
            self._start()
        task_id = self._next_id
        self._next_id += 1
        for q in self._tasks:
            q.put((task_id, fn, args))
        got: dict[int, tuple[str, object]] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(got) < self.world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(range(self.world_size)) - set(got))
                    raise RuntimeError(f"ranks {missing} did not finish the task within {timeout:.0f}s (hang?)")
                try:
                    tid, rank, status, payload = self._results.get(timeout=min(remaining, 1.0))
                except queue_mod.Empty:
                    dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in got]
                    if dead:
                        raise RuntimeError(f"ranks {dead} died with exit codes "
                                           f"{[self._procs[r].exitcode for r in dead]}") from None
                    continue
                if tid in (task_id, -1):
                    got[rank] = (status, payload)
        except BaseException:
            self.close()
            raise
        errors = {r: payload for r, (status, payload) in got.items() if status == "error"}
        if errors:
            self.close()
            raise RuntimeError("\n".join(f"rank {r}: {msg}" for r, msg in sorted(errors.items())))
        return [got[r][1] for r in range(self.world_size)]

    def close(self) -> None:
        """Stop the ranks (politely, then by force); a later :meth:`run` starts a fresh group."""
        for q in self._tasks:
            try:
                q.put(None)
            except Exception:
                pass
        for p in self._procs:
            p.join(timeout=5)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join()
        self._procs, self._tasks, self._results = [], [], None
