"""The state of one model forward under the guard of a multi-rank block, and its readers.

torch's module hooks hand a hook no object of the call it runs in, so the guard (:mod:`.guard`) keeps the
forward it runs in one thread-local record, :data:`FORWARD`: its pre-hook on the outermost cp_flash model
sets it, its post-hook (always called, also when the forward raises) clears it, and a block's exit clears it
too, so it lives exactly one forward of one thread. What it holds, and who reads it:

=================  ==========================================================  =============================
field              what                                                        read by
=================  ==========================================================  =============================
``model``          the outermost cp_flash model whose forward runs             the guard, :func:`guard_sub_model`
``ran``/``reached``  the attention modules that ran / reached cp_flash         the guard's count
``counting``       whether the count applies (a multi-rank plain forward)      the guard, :func:`guard_sub_model`
``record``         the sharded batch the forward runs on                       the mixers (:mod:`.mixing`)
``position_start``  the model's default position start                         :func:`guard_position_start`
``head``           its head's substitutions (:mod:`.heads`)                    the guard
``prefill``/``decode``  generate's prefill or decode step (:mod:`.generation`)  the guard, the attention
``mixers``         how many adapted mixer modules are running (nested)         the mixer adapters
``delegated``/``compiled_step``  a step function's calls of the adapted mixers  the mixer adapters
=================  ==========================================================  =============================

Everything else a forward computes with is bound to the tensors ``cp.shard_batch`` returned (the batch
record) or saved on the autograd context.
"""

from __future__ import annotations

import threading

import torch

from .models import inner_model

__all__ = ["FORWARD", "note_cp_flash_call", "guard_sub_model", "guard_position_start", "running_mixers"]

FORWARD = threading.local()
"""Per thread: the forward running under the guard (see the module docstring)."""


def running_mixers() -> int:
    """How many adapted mixer modules are running in this thread's forward (0: none)."""
    return getattr(FORWARD, "mixers", 0)


def note_cp_flash_call(module) -> None:
    """Called by the cp_flash attention function: ``module``'s attention reached cp_flash."""
    if torch.compiler.is_compiling():  # a compiled forward is not counted (its modules are not either)
        return
    guard = FORWARD
    if getattr(guard, "model", None) is not None:
        guard.reached.add(id(module))


def guard_sub_model(module) -> str | None:
    """Under the guard of a multi-rank block: the name of ``module`` when it is an attention layer of a
    sub-model with a configuration of its own (a vision or audio tower), whose tokens are an image's or
    a clip's, not the text sequence the block shards; None otherwise (and outside such a block)."""
    guard = FORWARD
    top = getattr(guard, "model", None)
    if top is None or not getattr(guard, "counting", False):
        return None
    top = inner_model(top)
    config = getattr(module, "config", None)
    top_config = getattr(top, "config", None)
    text = top_config.get_text_config() if hasattr(top_config, "get_text_config") else top_config
    if config is None or config is top_config or config is text or \
            getattr(config, "model_type", None) == getattr(text, "model_type", None):
        return None
    return f"{type(module).__name__} ({getattr(config, 'model_type', type(config).__name__)})"


def guard_position_start() -> int:
    """The default position start of the model whose forward is running under the guard (0: none)."""
    guard = FORWARD
    return getattr(guard, "position_start", 0) if getattr(guard, "model", None) is not None else 0
