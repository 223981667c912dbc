"""The cyclic garbage collector paused over host planning.

Planning a batch (a balanced layout, a rank's plan, strategy="auto"'s prices) allocates tens of
thousands of small objects, none of them in reference cycles. Those allocations trigger the
collector's full passes, which walk the whole heap of a training process: 100-150 ms each with
torch loaded, several times the planning itself (measured: a 35 ms layout at 128 ranks took 185 ms
on every third call). Paused, the objects are freed by reference counting as always and the
collector runs at its next trigger after the pause. Nested and threaded uses (``cp.prefetch``
plans in a background thread) count: the collector is enabled again when the last pause ends,
and only if it was enabled when the first began.
"""

from __future__ import annotations

import functools
import gc
import threading

__all__ = ["paused_gc"]

_LOCK = threading.Lock()
_STATE = {"open": 0, "was_enabled": False}  # pauses open (every thread), the collector's state before the first


class _Paused:
    def __enter__(self) -> None:
        with _LOCK:
            if _STATE["open"] == 0:
                _STATE["was_enabled"] = gc.isenabled()
                gc.disable()
            _STATE["open"] += 1

    def __exit__(self, *exc) -> None:
        with _LOCK:
            _STATE["open"] -= 1
            if _STATE["open"] == 0 and _STATE["was_enabled"]:
                gc.enable()

    def __call__(self, fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with self:
                return fn(*args, **kwargs)
        return wrapped


paused_gc = _Paused()
"""A context manager and a decorator: the collector paused while the body runs."""
