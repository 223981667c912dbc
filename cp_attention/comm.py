"""All torch.distributed calls of the library go through :class:`Comm`.

Point-to-point traffic is queued with :meth:`Comm.send` / :meth:`Comm.recv`, posted together by
:meth:`Comm.commit` (asynchronously) and completed by :meth:`Pending.wait`, so the ring can post the
next exchange before it computes the current block.

Failure handling. A rank that fails inside context-parallel attention (or inside a
:func:`~cp_attention.context_parallel` block) records the failure in the process group's store
(:meth:`Comm.report_failure`). Every blocking wait here is bounded by ``Comm.timeout`` seconds and
raises :class:`RankFailedError` naming the rank that failed:

* on CPU (gloo) every exchange is point-to-point, the agreement's all-gather included, so every
  transport error belongs to one peer: a peer process that dies closes its connections, and the
  rank that sees the closed connection (when it posts or waits) records that peer's death in the
  store before it raises; the others read it there within about 0.1 s. No gloo collective runs on
  gloo's worker threads, so a hung peer never blocks ``destroy_process_group`` or the process's
  exit;
* gloo waits cannot be polled (a timed-out gloo wait closes the connection): waiter threads block
  on them (one per batch of works; one stuck on a failed group never delays another group) while
  the calling thread watches the store and the deadline. A wait that lasts longer than a second
  publishes which peer it waits on, so at the timeout the ranks follow these "waits on" links to
  the rank that waits on nobody, and name it as the hung one;
* collectives on CUDA (NCCL) are posted asynchronously and polled; point-to-point waits on CUDA
  only order the streams and never block the CPU: a stalled exchange is caught by the next
  attention call's (polled) agreement exchange. NCCL communicators are not aborted here.

Failures are recorded per scope: one per :func:`~cp_attention.context_parallel` block and group
(see ``fresh_scope``). After a real failure the group's exchanges are out of step: every later call
in that block raises :class:`RankFailedError` (restart the job, or continue on a new process group
without the failed rank). Errors that every rank raises together are not failures and are never
recorded; nor is a transport error, which is about a peer, not about the rank that sees it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import os
import pickle
import threading
import time
import zlib

import torch
import torch.distributed as dist

from .torch_compat import default_store
from .waits import PeerError, Waiters, drain_at_exit

__all__ = ["Comm", "SubComm", "Pending", "RankFailedError", "DEFAULT_TIMEOUT", "process_count", "is_transport_error"]

DEFAULT_TIMEOUT = 300.0
"""Seconds a rank waits for its peers before it gives up (well under the process groups' own
default of 10-30 minutes). Override per context (``context_parallel(timeout=...)``) or with the
``CP_ATTENTION_TIMEOUT`` environment variable."""

_POLL_STORE_EVERY = 0.1  # seconds between store checks while polling a collective
_PUBLISH_WAIT_AFTER = 1.0  # seconds a wait lasts before it publishes the peer it waits on
_GLOO_WAIT_GRACE = 30.0  # a waiter thread's gloo deadline is the comm's plus this: the calling
#                          thread gives up (and records why) before gloo closes any connection
_COLLECTIVE_TAG = 1 << 24  # point-to-point tag of the collectives on gloo (the ring's are < 2 P)
_ALL_TO_ALL_TAG = (1 << 24) + 1  # ... and of the all-to-all exchanges (head parallelism)
_TRANSPORT_ERRORS = ("gloo/transport", "caused pair closure")  # gloo's errors of a connection

FAILURE_SCOPES: dict = {}
"""Per group (its global ranks): how many contexts were opened on it, so a failure reported in one
context does not reach a later one (the same count on every rank). Guarded by ``FAILURE_SCOPES_LOCK``."""
FAILURE_SCOPES_LOCK = threading.Lock()


class RankFailedError(RuntimeError):
    """Another rank of the context-parallel group failed, died, or stopped responding.

    ``rank`` is the failed rank's index in the group: the rank that reported a failure, the peer
    whose connection closed, or the rank found hung at the timeout (the end of the chain of ranks
    waiting on each other); None when no single rank could be named."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


def is_transport_error(exc: BaseException) -> bool:
    """Whether ``exc`` is gloo's error of a connection to a peer (closed, reset, timed out): about a
    peer, never recorded as this rank's own failure."""
    return isinstance(exc, RuntimeError) and any(words in str(exc) for words in _TRANSPORT_ERRORS)


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
        self._works = works  # (work, peer) pairs
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
        self._error: RankFailedError | None = None  # set when this rank gives up on the group
        self._store = None
        self._failed_key = ""
        if self.distributed and self.world_size > 1:
            self._store = default_store()
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
        waiting for their timeout. Not recorded: failures that every rank raised together (invalid
        arguments found by the agreement exchange), failures learnt from peers, and transport
        errors (a peer's connection closed: that peer failed, not this rank)."""
        if (isinstance(exc, RankFailedError) or getattr(exc, "cp_collective", False)
                or is_transport_error(exc)):
            return
        self._record(self.rank, f"rank {self.rank} failed in {where}: {type(exc).__name__}: {exc}")

    @contextlib.contextmanager
    def reporting(self, where: str):
        """The one failure wrapper: an exception escaping the block is recorded for the group
        (:meth:`report_failure`, naming ``where``) and re-raised, so peers waiting on this rank learn
        who failed, and why, at once."""
        try:
            yield
        except BaseException as exc:
            self.report_failure(where, exc)
            raise

    def _record(self, rank: int, message: str) -> None:
        """Record ``rank``'s failure (never raises). The first record of the group's scope is the one
        every rank names (``{key}/first``); a rank's own first record is kept with it."""
        if self._store is None:
            return
        try:  # the record, then which one came first, then the counter that says "look"
            self._store.compare_set(f"{self._failed_key}/{rank}", "", message[:2000])
            self._store.compare_set(f"{self._failed_key}/first", "", str(rank))
            self._store.add(self._failed_key, 1)
        except Exception:  # the store is gone too: the peers fall back to their own evidence
            pass

    def failure(self) -> RankFailedError | None:
        """The error describing the first failure some rank recorded, or None (one store lookup
        when there is none)."""
        if self._store is None:
            return None
        try:
            if not self._store.check([self._failed_key]):
                return None
            rank = int(self._store.get(f"{self._failed_key}/first"))
            message = self._store.get(f"{self._failed_key}/{rank}").decode(errors="replace")
        except Exception:
            return None
        return RankFailedError(
            f"cp_attention: {message}. Context-parallel rank {self.rank} stops too: the group's exchanges are out of "
            f"step. Restart the job (torchrun --max-restarts), or continue on a new process group without rank "
            f"{rank}", rank)

    def raise_if_failed(self) -> None:
        """Raise :class:`RankFailedError` if any rank of the group recorded a failure."""
        error = self.failure()
        if error is not None:
            raise self._failed(error)

    def _failed(self, error: RankFailedError) -> RankFailedError:
        """This rank gives up on the group: later exchanges of this comm raise ``error`` without
        posting anything, and the waiter threads it leaves blocked are drained at exit."""
        self._error = error
        drain_at_exit()
        return error

    def _peer_died(self, peer: int, what: str, cause: BaseException) -> RankFailedError:
        """gloo's transport error on the connection to ``peer``: a failure recorded already (a rank
        that raised, or a death another rank saw first) explains it; otherwise ``peer`` died.
        Recorded before this rank raises, so the ranks waiting on this one name the same rank."""
        error = self.failure()
        if error is None:
            cause_text = str(cause).strip().splitlines()[0][:300] if str(cause).strip() else ""
            message = (f"rank {peer} died or lost its connection (rank {self.rank} saw it close while waiting for "
                       f"{what}: {type(cause).__name__}: {cause_text})")
            self._record(peer, message)
            error = self.failure() or RankFailedError(f"cp_attention: {message}; restart the job", peer)
        return self._failed(error)

    def _hung(self, peer: int | None, what: str) -> RankFailedError:
        """The deadline passed while waiting on ``peer`` (None: unknown). Follow the published
        "waits on" links from ``peer`` to the rank that waits on nobody: that one hung."""
        error = self.failure()
        if error is not None:
            return self._failed(error)
        chain, cycle = self._follow_waits(peer) if peer is not None else ([], False)
        limit = (f"raise the limit with context_parallel(timeout=...) or CP_ATTENTION_TIMEOUT if your ranks "
                 f"legitimately drift apart that far")
        error = self.failure()  # a rank that timed out a moment earlier may have found the culprit
        if error is not None:
            return self._failed(error)
        if not chain or cycle:
            waits = "" if not chain else f" (ranks {', '.join(map(str, [self.rank, *chain]))} wait on each other)"
            return self._failed(RankFailedError(
                f"cp_attention: rank {self.rank} waited {self.timeout:g} s for {what}{waits}; no rank reported a "
                f"failure (one hung or died?); {limit}"))
        culprit = chain[-1]
        via = "".join(f", which waits on rank {r}" for r in chain[1:])
        message = (f"rank {culprit} did not respond for {self.timeout:g} s (rank {self.rank} waited for {what} on "
                   f"rank {chain[0]}{via}): it hung, or is stuck outside attention; {limit}")
        self._record(culprit, message)
        return self._failed(self.failure() or RankFailedError(f"cp_attention: {message}", culprit))

    def _waits_key(self, rank: int) -> str:
        return f"{self._failed_key}/waits/{rank}"

    def _publish_wait(self, peer: int | None) -> None:
        """Publish (None: withdraw) the peer this rank waits on (never raises)."""
        if self._store is None:
            return
        try:
            if peer is None:
                self._store.delete_key(self._waits_key(self.rank))
            else:
                self._store.set(self._waits_key(self.rank), str(peer))
        except Exception:
            pass

    def _follow_waits(self, peer: int) -> tuple[list[int], bool]:
        """``([peer, the rank peer waits on, ...], cycle)``: the links up to a rank that published
        none; ``cycle``: they lead back into the chain or to this rank (ranks waiting on each other,
        with no rank to name)."""
        chain = [peer]
        try:
            while self._store is not None and self._store.check([self._waits_key(chain[-1])]):
                nxt = int(self._store.get(self._waits_key(chain[-1])))
                if nxt in chain or nxt == self.rank:
                    return chain, True
                if not 0 <= nxt < self.world_size:
                    break
                chain.append(nxt)
        except Exception:
            pass
        return chain, False

    def _wait_p2p(self, works: list, what: str) -> None:
        if self.backend == "nccl":  # stream-ordered: does not block the CPU
            try:
                for work, _ in works:
                    work.wait()
            except RuntimeError as exc:
                raise self._nccl_failed(what, exc) from exc
            return
        # gloo waits cannot be polled: a waiter thread blocks on them while this thread watches the
        # store and the deadline (the waiter's own gloo deadline is later, so that this rank records
        # why it gives up before gloo closes any connection)
        job = Waiters.shared().submit(works, datetime.timedelta(seconds=self.timeout + _GLOO_WAIT_GRACE))
        start = time.monotonic()
        published = None
        try:
            while True:
                try:
                    job.done.result(timeout=_POLL_STORE_EVERY)
                except concurrent.futures.TimeoutError:
                    self.raise_if_failed()
                    waited = time.monotonic() - start
                    if waited >= min(_PUBLISH_WAIT_AFTER, self.timeout / 4) and job.peer != published:
                        published = job.peer
                        self._publish_wait(published)
                    if waited >= self.timeout:
                        raise self._hung(job.peer, what) from None
                except PeerError as exc:
                    if not is_transport_error(exc.cause):  # a local error of this rank (recorded as its own)
                        raise exc.cause from None
                    if time.monotonic() - start >= self.timeout:
                        raise self._hung(exc.peer, what) from exc.cause
                    raise self._peer_died(exc.peer, what, exc.cause) from exc.cause
                else:
                    if published is not None:  # a link stays published when this rank gives up
                        self._publish_wait(None)
                    return
        finally:
            if not job.done.done():  # left blocked (an error, an interrupt): drained at exit
                drain_at_exit()

    def _nccl_failed(self, what: str, exc: BaseException) -> RankFailedError:
        """An error of an NCCL exchange: the failure a rank recorded, else an unnamed one (NCCL's
        errors do not say which peer failed). Never recorded as this rank's own failure."""
        return self._failed(self.failure() or RankFailedError(
            f"cp_attention: rank {self.rank} lost a peer while waiting for {what} ({type(exc).__name__}: {exc}); "
            f"restart the job"))

    def _await(self, work, what: str) -> None:
        """Poll an asynchronous (NCCL) collective until done, checking the store for failures."""
        start = time.monotonic()
        last_check, pause = start, 1e-5
        while not work.is_completed():
            now = time.monotonic()
            if now - last_check >= _POLL_STORE_EVERY:
                last_check = now
                self.raise_if_failed()
            if now - start >= self.timeout:
                raise self._hung(None, what)
            time.sleep(pause)
            pause = min(pause * 2, 0.005)
        try:
            work.wait()
        except RuntimeError as exc:
            raise self._nccl_failed(what, exc) from exc

    # -- collectives -----------------------------------------------------------------------------

    def all_gather(self, tensor: torch.Tensor, what: str = "an all-gather") -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape everywhere), in rank order, on ``tensor``'s device.

        On gloo: point-to-point with every peer (see the module's docstring: attributable, never
        blocking the exit); on NCCL: ``all_gather``, polled."""
        if self.world_size == 1:
            return [tensor]
        tensor = tensor.contiguous()
        if self.backend == "nccl":
            out = [torch.empty_like(tensor) for _ in range(self.world_size)]
            try:
                work = dist.all_gather(out, tensor, group=self.group, async_op=True)
            except RuntimeError as exc:
                raise self._nccl_failed(what, exc) from exc
            self._await(work, what)
            return out
        out = [tensor.clone() if r == self.rank else torch.empty_like(tensor) for r in range(self.world_size)]
        ops = []
        for step in range(1, self.world_size):  # peers in ring order: no rank is everyone's first
            to, frm = (self.rank + step) % self.world_size, (self.rank - step) % self.world_size
            ops += [("send", tensor, to, _COLLECTIVE_TAG), ("recv", out[frm], frm, _COLLECTIVE_TAG)]
        self._post(ops, what).wait()
        return out

    def all_reduce(self, tensor: torch.Tensor, what: str = "an all-reduce") -> torch.Tensor:
        """Sum ``tensor`` over the group (in rank order: the same bits on every rank), in place; returns it."""
        if self.world_size > 1:
            parts = self.all_gather(tensor, what)
            total = parts[0].clone()
            for part in parts[1:]:
                total += part
            tensor.copy_(total)
        return tensor

    def all_to_all(self, sends: list[torch.Tensor], recvs: list[torch.Tensor], what: str = "an all-to-all") -> None:
        """Send ``sends[j]`` to every other rank j and receive ``recvs[j]`` from it (contiguous
        tensors; this rank's own entries are not touched; empty ones are not sent), then wait. Point-to-point with every peer
        on both backends: one message per pair, posted together in ring order, so that a failed
        peer is named (see the module's docstring)."""
        if self.world_size == 1:
            return
        ops = []
        for step in range(1, self.world_size):
            to, frm = (self.rank + step) % self.world_size, (self.rank - step) % self.world_size
            if sends[to].numel():  # an empty message is skipped on both sides (both know its size)
                ops.append(("send", sends[to], to, _ALL_TO_ALL_TAG))
            if recvs[frm].numel():
                ops.append(("recv", recvs[frm], frm, _ALL_TO_ALL_TAG))
        self._post(ops, what).wait()

    def all_gather_object(self, obj, what: str = "an object all-gather") -> list:
        """Every rank's picklable ``obj``, in rank order (two :meth:`all_gather`: sizes, then bytes)."""
        if self.world_size == 1:
            return [obj]
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = [int(n) for n in self.all_gather(torch.tensor([data.numel()], device=self.device), what)]
        padded = torch.zeros(max(sizes), dtype=torch.uint8, device=self.device)
        padded[:data.numel()] = data.to(self.device)
        parts = self.all_gather(padded, what)
        return [obj if r == self.rank else pickle.loads(parts[r][:n].cpu().numpy().tobytes())
                for r, n in enumerate(sizes)]

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
        return self._post(ops, what)

    def _post(self, ops: list, what: str) -> Pending:
        if self._error is not None:  # this rank gave up on the group: nothing more is posted
            raise self._error
        if not ops:
            return Pending(self, [], [])
        peers = ", ".join(str(p) for p in sorted({peer for _, _, peer, _ in ops}))
        what = f"{what} with rank(s) {peers}"
        if self.backend == "nccl":
            p2p = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, self._global(peer),
                              group=self.group, tag=tag) for kind, t, peer, tag in ops]
            try:
                works = [(work, None) for work in dist.batch_isend_irecv(p2p)]
            except RuntimeError as exc:
                raise self._nccl_failed(what, exc) from exc
        else:
            works = []
            for kind, t, peer, tag in ops:
                try:  # posting on a connection that closed (a dead peer) raises at once
                    works.append(((dist.isend if kind == "send" else dist.irecv)(
                        t, self._global(peer), group=self.group, tag=tag), peer))
                except RuntimeError as exc:
                    if not is_transport_error(exc):
                        raise
                    raise self._peer_died(peer, what, exc) from exc
        return Pending(self, works, [t for _, t, _, _ in ops], what)


class SubComm:
    """A sub-group of a :class:`Comm`'s ranks (``members``, parent ranks in sub-group order) for
    the exchanges of a 2-D split (strategy "usp"): ``rank`` / ``world_size`` are the sub-group's, and
    every message is posted by the parent on its own process group (no new process group is made:
    distinct sub-groups of a split share no pair of ranks, so their messages never meet). Failures
    are recorded and named with the parent's ranks."""

    def __init__(self, parent: Comm, members: tuple[int, ...]):
        if parent.rank not in members:
            raise ValueError(f"SubComm: rank {parent.rank} is not one of the members {members}")
        self.parent, self.members = parent, tuple(members)
        self.rank, self.world_size = self.members.index(parent.rank), len(self.members)
        self.backend, self.timeout = parent.backend, parent.timeout
        self._ops: list[tuple[str, torch.Tensor, int, int]] = []

    def __repr__(self) -> str:
        return f"SubComm(rank={self.rank}, members={self.members}, of {self.parent!r})"

    @property
    def device(self) -> torch.device:
        return self.parent.device

    def report_failure(self, where: str, exc: BaseException) -> None:
        self.parent.report_failure(where, exc)

    def raise_if_failed(self) -> None:
        self.parent.raise_if_failed()

    def _post(self, ops: list, what: str) -> Pending:
        return self.parent._post([(kind, t, self.members[peer], tag) for kind, t, peer, tag in ops], what)

    send, recv, commit, all_to_all, reporting = Comm.send, Comm.recv, Comm.commit, Comm.all_to_all, Comm.reporting


def _scope(members: str, fresh: bool) -> int:
    """The failure scope of a group (by its global ranks): a per-process counter of the contexts
    opened on it, the same on every rank because every rank opens them in the same order. Guarded
    by a lock (contexts may be opened from several threads)."""
    with FAILURE_SCOPES_LOCK:
        scopes = FAILURE_SCOPES
        if fresh:
            scopes[members] = scopes.get(members, 0) + 1
        return scopes.get(members, 0)
