"""Process state: every module-level mutable object of the library, in one place.

What a forward computes with (its batch's documents, plan, group and layout) is *not* here: it is
bound to the tensors ``cp.shard_batch`` returned (:mod:`cp_attention.batch`) or saved on the autograd
context, never looked up again at backward or recompute time. What remains global, and why:

======================  ==========================================  ===========  ==========================
object                  what and why                                guarded by   lifetime
======================  ==========================================  ===========  ==========================
``ACTIVE_CONTEXT``      the innermost ``context_parallel`` block    (contextvar) the ``with`` block
                        of this thread / task: a ``with`` block's
                        scope is dynamic, so a contextvar
``FULL_BATCH``          True inside ``outside_context()``: a full-  (contextvar) the ``with`` block
                        batch computation every rank runs alike
                        (no data-parallel warning)
``STATS``               the most recent plan statistics             ``STATS_LOCK``  until the next call
                        (``last_plan_stats``: "in this process")
``FORWARD``             per thread: the plans of the current model  thread-local  until the next forward
                        forward (``forward_plan_stats``)
``LIVE_BATCHES``        weak references to every live sharded       ``LIVE_LOCK``   pruned when the batch's
                        batch: the fallback of a forward recomputed                tensors die
                        by checkpointing after its block exited, in
                        a model whose layers get no position_ids
``LOCAL_PLANS``         single-device plans by content              its own lock  LRU, 32 entries
``KERNEL_CALLS``        the cpu backend's kernel calls by the       its own lock  LRU, 256 entries
                        documents' bounds and the mask
``ANNOUNCED``           (world size, layout, backend) logged at     ``ANNOUNCED_LOCK``  the process
                        INFO once
``CONFIG_CHECKSUMS``    a model config's checksum (agreed across    ``CONFIG_LOCK``  weak: dies with the config
                        ranks), computed once per config object
``BATCH_CONVENTIONS``   how ``cp.shard_batch`` reads a collator's   (set once at import)  the process
                        batch: registered by the integrations, so
                        the engine never imports them
``INTEGRATIONS``        which integrations registered, and the      ``INTEGRATIONS_LOCK``  the process
                        transformers modules adapted for the name
``CONTEXT_GUARDS``      what a ``context_parallel``                 (set once at import)  the process
                        block enters and leaves (the model check of
                        cp_flash models): registered by the
                        integrations, each returns its exit
``MODEL_CHECKS``        a model's check result (its findings),     ``MODEL_LOCK``   weak: dies with the model
                        computed once per model object
``MODEL_GUARD``         per thread: the outermost cp_flash model   thread-local  one model forward
                        forward running under a guard, and how
                        many attention layers ran / reached cp_flash,
                        and its head's substitutions (``.heads``);
                        ``MODEL_GUARD_HOOKS``: its module hooks,
                        installed by the first multi-rank block
``FAILURE_SCOPES``      per group (its global ranks): how many      ``FAILURE_SCOPES_LOCK``  the process
                        contexts were opened on it, so a failure
                        reported in one context does not reach a
                        later one (the same count on every rank)
``EXIT_DRAIN``          whether this rank gave up on an exchange    ``EXIT_DRAIN_LOCK``  the process
                        (a failed peer): its exit then lets the
                        blocked waiter threads end first
======================  ==========================================  ===========  ==========================

Not listed: constants, and the backend objects of ``cp_attention.backends.BACKENDS`` (one per
backend, created at import), each of which remembers whether its kernels import.
"""

from __future__ import annotations

import contextvars
import threading

from .plan_cache import PlanCache
from .torch_compat import WeakIdKeyDictionary

__all__ = ["ACTIVE_CONTEXT", "FULL_BATCH", "STATS", "STATS_LOCK", "FORWARD", "LIVE_BATCHES", "LIVE_LOCK", "LOCAL_PLANS",
           "ANNOUNCED", "ANNOUNCED_LOCK", "CONFIG_CHECKSUMS", "CONFIG_LOCK", "BATCH_CONVENTIONS", "INTEGRATIONS",
           "INTEGRATIONS_LOCK", "FAILURE_SCOPES", "FAILURE_SCOPES_LOCK", "EXIT_DRAIN", "EXIT_DRAIN_LOCK",
           "CONTEXT_GUARDS", "MODEL_CHECKS", "KERNEL_CALLS",
           "MODEL_LOCK", "MODEL_GUARD", "MODEL_GUARD_HOOKS"]

ACTIVE_CONTEXT: contextvars.ContextVar = contextvars.ContextVar("cp_attention_ctx", default=None)
FULL_BATCH: contextvars.ContextVar = contextvars.ContextVar("cp_attention_full_batch", default=False)

STATS: dict = {"last": None}
STATS_LOCK = threading.Lock()

FORWARD = threading.local()

LIVE_BATCHES: list = []  # (weak references to a batch's tensors, its BatchRecord)
LIVE_LOCK = threading.Lock()

LOCAL_PLANS = PlanCache(32)
KERNEL_CALLS = PlanCache(256)
"""The cpu backend's kernel calls (``backends/cpu.py``), keyed by the documents' bounds, the mask and
the tile sizes: a layer's backward, the other layers and the next step of a layout reuse them."""

ANNOUNCED: set = set()
ANNOUNCED_LOCK = threading.Lock()

CONFIG_CHECKSUMS = WeakIdKeyDictionary()  # config -> checksum
CONFIG_LOCK = threading.Lock()

BATCH_CONVENTIONS: dict = {}  # name -> shard_batch(cp, **inputs) implementation

INTEGRATIONS: dict = {"registered": set(), "adapted_sites": []}
INTEGRATIONS_LOCK = threading.Lock()

CONTEXT_GUARDS: list = []  # callables cp -> (callable run when the block exits)

MODEL_CHECKS = WeakIdKeyDictionary()  # model -> its findings (a tuple)
MODEL_LOCK = threading.Lock()

MODEL_GUARD = threading.local()
MODEL_GUARD_HOOKS: list = []  # the guard's module hooks (guarded by MODEL_LOCK), kept once installed

FAILURE_SCOPES: dict = {}  # group members -> contexts opened on the group
FAILURE_SCOPES_LOCK = threading.Lock()

EXIT_DRAIN: list = []  # [True] once this process gave up on an exchange (the exit drain is registered)
EXIT_DRAIN_LOCK = threading.Lock()
