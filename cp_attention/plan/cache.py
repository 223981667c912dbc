"""The plan cache: one thread-safe LRU of plans (and document metadata), keyed by what they depend on.

Keys are built by the callers from the mask, shapes and layout and from *digests* of the document
tensors (:meth:`PlanCache.digest`: a hash of their content, remembered per tensor object and version,
weakly, so the layers of one forward, which share their ``position_ids``, copy and hash them once). A
stale plan cannot be reused for other documents. The single-device op keeps one process-wide cache
(:data:`cp_attention.engine.local.LOCAL_PLANS`); each multi-rank context keeps its own.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Callable

import torch

from ..torch_compat import WeakIdKeyDictionary, tensor_version

__all__ = ["PlanCache"]


class PlanCache:
    """At most ``size`` entries, least recently used first out. Thread-safe."""

    def __init__(self, size: int):
        self.size = size
        self._lock = threading.Lock()
        self._entries: OrderedDict = OrderedDict()
        self._digests = WeakIdKeyDictionary()  # tensor -> (version, digest)

    def digest(self, t: torch.Tensor | None):
        """A content digest of ``t`` (None for None): equal for equal dtype, shape and values."""
        if t is None:
            return None
        version = tensor_version(t)
        if version is not None:
            with self._lock:
                memo = self._digests.get(t)
            if memo is not None and memo[0] == version:
                return memo[1]
        cpu = t.detach().to("cpu").contiguous()
        h = hashlib.blake2b(digest_size=16)
        h.update(repr((str(cpu.dtype), tuple(cpu.shape))).encode())
        h.update(cpu.numpy().tobytes())
        digest = h.digest()
        if version is not None:
            with self._lock:
                self._digests[t] = (version, digest)
        return digest

    def get(self, key):
        """The entry under ``key`` (marked most recently used), or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def put(self, key, entry):
        """Insert ``entry`` (evicting the least recently used beyond ``size``); returns it."""
        with self._lock:
            self._entries[key] = entry
            self._entries.move_to_end(key)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
        return entry

    def get_or_build(self, key, build: Callable[[], object]):
        """The entry under ``key``, built (outside the lock) and inserted on a miss."""
        entry = self.get(key)
        return entry if entry is not None else self.put(key, build())

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
