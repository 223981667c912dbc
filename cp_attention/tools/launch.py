"""Testing and demo utility, not part of the stable API: run a function on N gloo ranks spawned as
local CPU processes (127.0.0.1 only), with a deadline.

Used by the demo, the probe and the multi-rank tests; for real jobs use torchrun.
"""

from __future__ import annotations

import os
import queue as queue_mod
import signal
import socket
import subprocess
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "leave_together", "run_ranks", "run_command"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size)
        try:
            result = fn(rank, world_size, *args)
            queue.put((rank, "ok", result))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # report, never hang the parent
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_ranks(world_size: int, fn, *args, timeout: float = 300.0) -> list:
    """Call ``fn(rank, world_size, *args)`` on every rank; return the results in rank order.

    Raises RuntimeError with the rank's traceback if a rank raised, or if the ranks did not finish
    within ``timeout`` seconds (every process is killed either way: nothing is left behind).
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, tuple] = {}
    try:
        deadline = time.monotonic() + timeout
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(f"ranks {sorted(set(range(world_size)) - set(results))} did not finish "
                                   f"within {timeout:.0f}s (hang?)")
            try:
                rank, status, payload = queue.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results]
                if dead and all(p.exitcode not in (0, None) for i, p in enumerate(procs) if i in dead):
                    raise RuntimeError(f"ranks {dead} died with exit codes "
                                       f"{[procs[r].exitcode for r in dead]}")
                continue
            results[rank] = (status, payload)
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    errors = {r: payload for r, (status, payload) in results.items() if status == "error"}
    if errors:
        raise RuntimeError("\n".join(f"rank {r}: {msg}" for r, msg in sorted(errors.items())))
    return [results[r][1] for r in range(world_size)]


def _descendants(root: int) -> list[int]:
    """The pids of every process below ``root`` (read from /proc; empty where there is none)."""
    parents: dict[int, list[int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(name))
    found, todo = [], [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def leave_together(code: int = 0) -> None:
    """The end of a torchrun script (a no-op without a process group): the ranks wait for each other (a
    barrier), then each process exits at once with ``code`` (``os._exit``, its output flushed), skipping
    the interpreter's teardown. There a DDP model's last reference to a gloo process group can be dropped
    while that group's worker thread waits for the GIL the dropping thread holds (torch's
    ``~ProcessGroupGloo`` joins the thread): a hang seen in CI after training had finished."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_command(cmd: list[str], *, timeout: float, env=None, cwd=None) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` in a session of its own: on ``timeout``
    the whole process group is killed (torchrun's workers with it, not only torchrun) before
    ``subprocess.TimeoutExpired`` is raised."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stray = _descendants(proc.pid)  # torchrun starts its workers in sessions of their own
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in stray:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
