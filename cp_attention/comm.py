"""All torch.distributed calls of the library go through :class:`Comm`.

Point-to-point traffic is queued with :meth:`Comm.send` / :meth:`Comm.recv`, posted together by
:meth:`Comm.commit` (asynchronously) and completed by :meth:`Pending.wait`, so the ring can post the
next exchange before it computes the current block.

Failure handling. A rank that fails inside context-parallel attention (or inside a
:func:`~cp_attention.context_parallel` block) records the failure in the process group's store
(:meth:`Comm.report_failure`). Every blocking wait here is bounded by ``Comm.timeout`` seconds and
names the failing rank when it gives up:

* collectives are posted asynchronously and polled; the store is checked while polling, so a
  recorded failure is noticed within about 0.1 s;
* point-to-point waits on CPU (gloo) cannot be polled (a timed-out gloo wait closes the
  connection): one waiter thread per process blocks on them while the calling thread watches the
  store and the deadline; a peer process that exits closes its connections and ends the wait;
* point-to-point waits on CUDA (NCCL) only order the streams and never block the CPU; a stalled
  exchange is caught by the next attention call's (polled) agreement exchange.

Failures are recorded per scope: one per :func:`~cp_attention.context_parallel` block (see
``fresh_scope``). After a real failure the group's ring may be out of step: every later call in
that block raises :class:`RankFailedError` (create a new process group, or restart the job, to
continue). Errors that every rank raises together are not failures and are never recorded.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import os
import queue
import threading
import time
import zlib

import torch
import torch.distributed as dist

from . import state

__all__ = ["Comm", "Pending", "RankFailedError", "DEFAULT_TIMEOUT", "process_count"]

DEFAULT_TIMEOUT = 300.0
"""Seconds a rank waits for its peers before it gives up (well under the process groups' own
default of 10-30 minutes). Override per context (``context_parallel(timeout=...)``) or with the
``CP_ATTENTION_TIMEOUT`` environment variable."""

_POLL_STORE_EVERY = 0.1  # seconds between store checks while polling a collective


class RankFailedError(RuntimeError):
    """Another rank of the context-parallel group failed, or stopped responding.

    ``rank`` is the failing rank's index in the group, or None when no rank reported a failure
    (a peer that hung or died without reporting)."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


def process_count() -> int:
    """The processes of torch.distributed's default group; 1 when it is not initialized."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def resolve_timeout(timeout: float | None) -> float:
    """``timeout`` if given, else ``$CP_ATTENTION_TIMEOUT``, else :data:`DEFAULT_TIMEOUT` (seconds)."""
    if timeout is None:
        env = os.environ.get("CP_ATTENTION_TIMEOUT")
        try:
            timeout = float(env) if env else DEFAULT_TIMEOUT
        except ValueError:
            raise ValueError(f"CP_ATTENTION_TIMEOUT must be a number of seconds, got {env!r}") from None
    if not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


class Pending:
    """In-flight point-to-point operations; keeps their tensors alive until :meth:`wait`."""

    def __init__(self, comm: Comm | None, works: list, tensors: list[torch.Tensor], what: str = ""):
        self._comm = comm
        self._works = works
        self._tensors = tensors
        self._what = what

    def wait(self) -> None:
        """Complete the operations; raises :class:`RankFailedError` when a peer failed or timed out."""
        works, self._works = self._works, []
        if works:
            self._comm._wait_p2p(works, self._what)
        self._tensors = []


class Comm:
    """The process group of one context-parallel job: rank, size, collectives and p2p.

    ``group=None`` means the default (WORLD) group when torch.distributed is initialised, and a
    single-process "group" of size 1 otherwise; ``single=True`` is always that size-1 group.
    ``timeout``: seconds any wait for the peers may take (see :func:`resolve_timeout`).
    ``fresh_scope``: failures are recorded under a new scope of the group (one per
    :func:`~cp_attention.context_parallel` block, counted alike on every rank), so a failure of an
    earlier block does not fail a later one; False shares the group's current scope.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, single: bool = False,
                 timeout: float | None = None, fresh_scope: bool = False):
        self.group = group
        self.timeout = resolve_timeout(timeout)
        self.distributed = not single and dist.is_available() and dist.is_initialized()
        if group is not None and single:
            raise ValueError("Comm(group, single=True): a single-device comm takes no group")
        if group is not None and not self.distributed:
            raise ValueError("a process group was given but torch.distributed is not initialised; call "
                             "torch.distributed.init_process_group first or pass group=None")
        if self.distributed:
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
            self.backend = dist.get_backend(group)
        else:
            self.rank, self.world_size, self.backend = 0, 1, None
        self._ops: list[tuple[str, torch.Tensor, int, int]] = []
        self._store = None
        self._failed_key = ""
        if self.distributed and self.world_size > 1:
            self._store = _default_store()
            members = ",".join(str(self._global(r)) for r in range(self.world_size))
            self._failed_key = f"cp_attention/failed/{zlib.crc32(members.encode()):08x}/{_scope(members, fresh_scope)}"

    def __repr__(self) -> str:
        return f"Comm(rank={self.rank}, world_size={self.world_size}, backend={self.backend})"

    def _global(self, rank: int) -> int:
        if self.group is None or self.group is dist.group.WORLD:
            return rank
        return dist.get_global_rank(self.group, rank)

    @property
    def device(self) -> torch.device:
        """Where collective buffers live: the current CUDA device for NCCL, else CPU."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # -- failures ----------------------------------------------------------------------------------

    def report_failure(self, where: str, exc: BaseException) -> None:
        """Record in the group's store that this rank failed (never raises).

        Peers waiting on this rank then raise :class:`RankFailedError` naming it instead of
        waiting for their timeout. Failures that every rank raised together (invalid arguments
        found by the agreement exchange) and failures reported by peers are not recorded."""
        if self._store is None or isinstance(exc, RankFailedError) or getattr(exc, "cp_collective", False):
            return
        message = f"rank {self.rank} failed in {where}: {type(exc).__name__}: {exc}"[:2000]
        try:
            self._store.set(f"{self._failed_key}/{self.rank}", message)
            self._store.add(self._failed_key, 1)
        except Exception:  # the store is gone too: the peers fall back to their timeout
            pass

    def failure(self) -> RankFailedError | None:
        """The error describing a failure some rank recorded, or None (one store lookup)."""
        if self._store is None:
            return None
        try:
            if not self._store.check([self._failed_key]):
                return None
            for rank in range(self.world_size):
                key = f"{self._failed_key}/{rank}"
                if self._store.check([key]):
                    message = self._store.get(key).decode(errors="replace")
                    return RankFailedError(f"cp_attention: {message} (context-parallel rank {self.rank} "
                                           f"stops too)", rank)
        except Exception:
            return None
        return None

    def raise_if_failed(self) -> None:
        """Raise :class:`RankFailedError` if any rank of the group recorded a failure."""
        error = self.failure()
        if error is not None:
            raise error

    def _gave_up(self, what: str, cause: BaseException | None = None) -> RankFailedError:
        error = self.failure()
        if error is None and cause is not None:  # a peer that exits may record its failure a moment later
            time.sleep(min(1.0, self.timeout))
            error = self.failure()
        if error is not None:
            return error
        if cause is None:
            return RankFailedError(f"cp_attention: rank {self.rank} waited {self.timeout:g} s for {what}; no "
                                   f"rank reported a failure (one hung or died?); raise the limit with "
                                   f"context_parallel(timeout=...) or CP_ATTENTION_TIMEOUT if your ranks "
                                   f"legitimately drift apart that far")
        return RankFailedError(f"cp_attention: rank {self.rank} lost a peer while waiting for {what} "
                               f"({type(cause).__name__}: {cause}); that rank probably died")

    def _wait_p2p(self, works: list, what: str) -> None:
        if self.backend == "nccl":  # stream-ordered: does not block the CPU
            for work in works:
                work.wait()
            return
        # gloo waits cannot be polled (a timed-out wait closes the connection): one waiter thread
        # blocks on them, with the timeout as its deadline, while this thread watches the store
        done = _Waiter.shared().submit(works, datetime.timedelta(seconds=self.timeout))
        start = time.monotonic()
        while True:
            try:
                done.result(timeout=_POLL_STORE_EVERY)
                return
            except concurrent.futures.TimeoutError:
                self.raise_if_failed()
                if time.monotonic() - start >= self.timeout:
                    raise self._gave_up(what) from None
            except RuntimeError as exc:
                timed_out = time.monotonic() - start >= self.timeout
                raise self._gave_up(what, None if timed_out else exc) from exc

    def _await(self, work, what: str) -> None:
        """Poll an asynchronous collective until done, checking the store for failures."""
        start = time.monotonic()
        last_check, pause = start, 1e-5
        while not work.is_completed():
            now = time.monotonic()
            if now - last_check >= _POLL_STORE_EVERY:
                last_check = now
                self.raise_if_failed()
            if now - start >= self.timeout:
                raise self._gave_up(what)
            time.sleep(pause)
            pause = min(pause * 2, 0.005)
        try:
            work.wait()
        except RuntimeError as exc:
            raise self._gave_up(what, exc) from exc

    # -- collectives -----------------------------------------------------------------------------

    def all_gather(self, tensor: torch.Tensor, what: str = "an all-gather") -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape everywhere), in rank order, on ``tensor``'s device."""
        if self.world_size == 1:
            return [tensor]
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._await(dist.all_gather(out, tensor.contiguous(), group=self.group, async_op=True), what)
        return out

    def all_reduce(self, tensor: torch.Tensor, what: str = "an all-reduce") -> torch.Tensor:
        """Sum ``tensor`` over the group, in place; returns it."""
        if self.world_size > 1:
            self._await(dist.all_reduce(tensor, group=self.group, async_op=True), what)
        return tensor

    def all_gather_object(self, obj) -> list:
        """Every rank's picklable ``obj``, in rank order (blocking; used after a polled exchange
        has shown that every rank is here)."""
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    # -- point to point --------------------------------------------------------------------------

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Queue sending ``tensor`` (contiguous) to group rank ``dst``."""
        self._ops.append(("send", tensor, dst, tag))

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        """Queue receiving into ``tensor`` (contiguous) from group rank ``src``."""
        self._ops.append(("recv", tensor, src, tag))

    def commit(self, what: str = "a K/V exchange") -> Pending:
        """Post every queued operation asynchronously."""
        ops, self._ops = self._ops, []
        if not ops:
            return Pending(self, [], [])
        if self.backend == "nccl":
            p2p = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, self._global(peer),
                              group=self.group, tag=tag) for kind, t, peer, tag in ops]
            works = dist.batch_isend_irecv(p2p)
        else:
            works = [(dist.isend if kind == "send" else dist.irecv)(t, self._global(peer), group=self.group,
                                                                    tag=tag)
                     for kind, t, peer, tag in ops]
        peers = ", ".join(str(p) for p in sorted({peer for _, _, peer, _ in ops}))
        return Pending(self, works, [t for _, t, _, _ in ops], f"{what} with rank(s) {peers}")


def _scope(members: str, fresh: bool) -> int:
    """The failure scope of a group (by its global ranks): a per-process counter of the contexts
    opened on it, the same on every rank because every rank opens them in the same order. Guarded
    by a lock (contexts may be opened from several threads)."""
    with state.FAILURE_SCOPES_LOCK:
        scopes = state.FAILURE_SCOPES
        if fresh:
            scopes[members] = scopes.get(members, 0) + 1
        return scopes.get(members, 0)


class _Waiter:
    """A daemon thread that completes gloo works one batch at a time (a daemon, so a wait left
    blocked by a failed peer never delays the process's exit). One per process."""

    _instance: _Waiter | None = None
    _lock = threading.Lock()

    @classmethod
    def shared(cls) -> _Waiter:
        with cls._lock:  # a forked child does not inherit the parent's thread: start its own
            if cls._instance is None or cls._instance._pid != os.getpid():
                cls._instance = cls()
            return cls._instance

    def __init__(self):
        self._pid = os.getpid()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="cp_attention_wait", daemon=True).start()

    def submit(self, works: list, timeout: datetime.timedelta) -> concurrent.futures.Future:
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((works, timeout, done))
        return done

    def _run(self) -> None:
        while True:
            works, timeout, done = self._jobs.get()
            try:
                for work in works:
                    work.wait(timeout=timeout)
            except BaseException as exc:  # handed to the waiting thread
                done.set_exception(exc)
            else:
                done.set_result(None)


def _default_store():
    """The default process group's key-value store, or None (private torch API, checked here only)."""
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return getter() if getter is not None else None
    except Exception:
        return None
