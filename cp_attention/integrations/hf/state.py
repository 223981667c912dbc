"""The integrations' process state: their registries and per-model memos, next to the code that owns
them (the engine's own state lives in its modules: the active context in
:mod:`cp_attention.engine.context`, the statistics in :mod:`cp_attention.engine.stats`, ...; the table
of every module-level mutable object is in docs/architecture.md and checked by the tests).

Per-forward state is not here: the guard's record of the forward it runs is :data:`.forward.FORWARD`; what a
forward computes with is bound to the tensors ``cp.shard_batch`` returned, or saved on the autograd context.
"""

from __future__ import annotations

import threading

from ...torch_compat import WeakIdKeyDictionary

__all__ = ["CONFIG_CHECKSUMS", "CONFIG_LOCK", "INTEGRATIONS", "INTEGRATIONS_LOCK", "MODEL_CHECKS", "MODEL_LOCK", "POSITION_STARTS", "PREPARED",
           "INDEXER_SELECTIONS", "COMPRESSED_SELECTIONS", "LATENTS", "VERIFIED", "VERIFIED_LOCK", "TRACED", "per_model"]

CONFIG_CHECKSUMS = WeakIdKeyDictionary()
"""config -> its checksum (agreed across ranks), computed once per config object (weak: dies with the
config). Guarded by ``CONFIG_LOCK`` (:mod:`.models`)."""
CONFIG_LOCK = threading.Lock()

INTEGRATIONS: dict = {"registered": set(), "adapted_sites": [], "declined": {}, "classes": {}}
"""Which integrations registered, the transformers modules adapted for the name ``cp_flash``
(:mod:`.registry`), the foreign functions and class methods an adapter's admission check declined:
{(module name, function or ``Class.method`` name): why} (:mod:`.adapters.mixer_functions`, :mod:`.class_admission`), and
every class method checked at its first call under context parallelism: {(module, ``Class.method``): why
or None}. Guarded by ``INTEGRATIONS_LOCK``."""
INTEGRATIONS_LOCK = threading.Lock()

MODEL_CHECKS = WeakIdKeyDictionary()
"""model -> its check result (its findings, a tuple), computed once per model object (weak: dies with
the model). Guarded by ``MODEL_LOCK`` (:mod:`.check`)."""
MODEL_LOCK = threading.Lock()

POSITION_STARTS = WeakIdKeyDictionary()
"""model -> where it numbers its default positions, read once per model object (the guard asks on every
forward; the read of a kept ``position_ids`` buffer would sync with the device). Guarded by ``MODEL_LOCK``."""

PREPARED = WeakIdKeyDictionary()
"""model -> True: every adapter prepared it for context parallelism (:mod:`.guard`; weak: dies with the model).
Guarded by ``MODEL_LOCK``."""

INDEXER_SELECTIONS = WeakIdKeyDictionary()
"""selection tensor -> True: the ``indices`` an adapted sparse-attention indexer returned, global key
indices (:mod:`.adapters.indexers`); cp_flash reads only these (weak: dies with the tensor)."""

COMPRESSED_SELECTIONS = WeakIdKeyDictionary()
"""attention module -> (key_select, entries): what a compressed layer's compressor recorded for the layer's
cp_flash call, taken by that call (:mod:`.adapters.compressed`; weak: dies with the module)."""

LATENTS = WeakIdKeyDictionary()
"""multi-head latent attention module -> what its adapted ``expand_kv`` computed last in a cp_flash forward (its
latent rows and the keys and values it returned), taken by the layer's cp_flash call (:mod:`.adapters.latent`;
weak: dies with the module)."""

VERIFIED: dict = {}
"""(model class, config checksum, dtype, packed, world size) -> None (verified) or the refusal
(its key and fields): verification at first use (:mod:`.verification`). Guarded by ``VERIFIED_LOCK``."""
VERIFIED_LOCK = threading.Lock()


def per_model(table, model, compute):
    """``table[model]`` (``table``: one of the per-model memos above), computed by ``compute(model)`` the first time,
    outside the lock (a computation may run a model's forward)."""
    with MODEL_LOCK:
        value = table.get(model)
    if value is None:
        value = compute(model)
        with MODEL_LOCK:
            table[model] = value
    return value


TRACED: dict = {}
"""(model class, config checksum, dtype, module tree checksum) -> the model check's trace findings
(:mod:`.token_trace`), once per class, configuration and module tree. Guarded by ``MODEL_LOCK``."""
