"""Bounded waits on gloo works: gloo's waits cannot be polled, so daemon threads block on them while
the calling thread watches the deadline and the failure store (:mod:`cp_attention.comm`), and a rank
that gave up lets its blocked threads end before the interpreter exits.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import datetime
import os
import queue
import threading

__all__ = ["PeerError", "Job", "Waiters", "drain_at_exit", "drain_waiters", "EXIT_DRAIN", "EXIT_DRAIN_SECONDS"]

EXIT_DRAIN_SECONDS = 2.0
"""Seconds the exit of a rank that gave up waits for its blocked waiter threads."""

EXIT_DRAIN: list = []
"""``[True]`` once this process gave up on an exchange (the exit drain is registered). Guarded by
``EXIT_DRAIN_LOCK``."""
EXIT_DRAIN_LOCK = threading.Lock()


class PeerError(Exception):
    """A waiter thread's report: the wait on a work with ``peer`` raised ``cause``."""

    def __init__(self, peer: int, cause: BaseException):
        super().__init__(peer, cause)
        self.peer, self.cause = peer, cause


class Job:
    """One batch of (work, peer) waits for a waiter thread; ``peer``: the one being waited on."""

    def __init__(self, works: list, timeout: datetime.timedelta):
        self.works, self.timeout = works, timeout
        self.peer: int | None = works[0][1] if works else None
        self.done: concurrent.futures.Future = concurrent.futures.Future()

    def run(self) -> None:
        for work, peer in self.works:
            self.peer = peer
            try:
                work.wait(timeout=self.timeout)
            except BaseException as exc:  # handed to the waiting thread, with the peer
                self.done.set_exception(PeerError(peer, exc))
                return
        self.done.set_result(None)


class Waiters:
    """Daemon threads that complete gloo works, one job (batch of works) at a time each. A job goes
    to an idle thread, or to a new one: a thread left blocked by a failed peer (until its gloo
    deadline) never delays a later job, e.g. on another group; daemons never delay the exit. One
    pool per process."""

    _instance: Waiters | None = None
    _lock = threading.Lock()

    @classmethod
    def shared(cls) -> Waiters:
        with cls._lock:  # a forked child does not inherit the parent's threads: start its own
            if cls._instance is None or cls._instance._pid != os.getpid():
                cls._instance = cls()
            return cls._instance

    def __init__(self):
        self._pid = os.getpid()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = 0
        self._busy = 0
        self._idle_lock = threading.Condition()

    def submit(self, works: list, timeout: datetime.timedelta) -> Job:
        job = Job(works, timeout)
        with self._idle_lock:
            self._busy += 1
            start = self._idle == 0
            if not start:
                self._idle -= 1
        if start:
            try:
                threading.Thread(target=self._run, name="cp_attention_wait", daemon=True).start()
            except BaseException:
                with self._idle_lock:
                    self._busy -= 1
                raise
        self._jobs.put(job)
        return job

    def _run(self) -> None:
        while True:
            self._jobs.get().run()
            with self._idle_lock:
                self._idle += 1
                self._busy -= 1
                self._idle_lock.notify_all()

    def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until no job is running; whether none is."""
        with self._idle_lock:
            return self._idle_lock.wait_for(lambda: self._busy == 0, timeout)


def drain_at_exit() -> None:
    """Register (once per process) :func:`drain_waiters` to run when the interpreter exits."""
    with EXIT_DRAIN_LOCK:
        if not EXIT_DRAIN:
            atexit.register(drain_waiters)
            EXIT_DRAIN.append(True)


def drain_waiters() -> None:
    """At exit, after a failure: give the waiter threads still blocked in a gloo wait up to
    :data:`EXIT_DRAIN_SECONDS` seconds to end. A blocked wait ends when its peer's connection closes; if
    that happened while the interpreter finalizes, the daemon thread could not re-enter Python and
    the process would abort (SIGABRT) instead of exiting normally. Survivors of one failure exit
    together, so their closing connections end each other's waits within this grace."""
    Waiters.shared().drain(EXIT_DRAIN_SECONDS)
