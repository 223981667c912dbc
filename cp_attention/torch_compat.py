"""The private or version-dependent torch APIs the library uses, behind one module.

Each is wrapped in a function that says what it is for, so a torch upgrade that moves one of them is
fixed here alone. Tested on torch 2.11-2.13.
"""

from __future__ import annotations

import importlib
import sys

import torch
import torch._dynamo
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["WeakIdKeyDictionary", "caller_locations", "has_forward_pre_hook", "assume_constant_result", "in_backward", "tensor_version", "cpu_flash_kernels",
           "torch_context_parallel_active", "default_store"]

assume_constant_result = torch._dynamo.assume_constant_result
"""Decorator: dynamo calls the function once per trace and bakes its result into the graph (no guard)."""


def in_backward() -> bool:
    """Whether autograd is running a backward pass in this thread (e.g. a forward recomputed by
    activation checkpointing)."""
    return torch._C._current_graph_task_id() != -1


def tensor_version(t: torch.Tensor) -> int | None:
    """The tensor's in-place modification counter, or None for inference tensors (no counter)."""
    try:
        return t._version
    except RuntimeError:
        return None


def torch_context_parallel_active() -> bool:
    """Whether torch's own ``context_parallel`` (``torch.distributed.tensor.experimental``, what
    accelerate's CP runs) is active: it replaces ``F.scaled_dot_product_attention`` by a wrapper
    registered in its ``_replaced_functions`` (torch 2.7-2.13; older versions could instead push a
    ``DistributeFunction`` torch-function mode)."""
    import torch.nn.functional as F

    sdpa = F.scaled_dot_product_attention
    if sdpa is not torch._C._nn.scaled_dot_product_attention:
        for name in ("torch.distributed.tensor.experimental._context_parallel._attention",
                     "torch.distributed.tensor.experimental._attention"):
            try:
                replaced = getattr(importlib.import_module(name), "_replaced_functions", {})
            except ImportError:
                continue
            if sdpa in replaced:
                return True
    modes = torch.overrides._get_current_function_mode_stack()
    return any(type(m).__name__ == "DistributeFunction" for m in modes)


def cpu_flash_kernels():
    """aten's fused CPU flash-attention forward and backward (the kernels behind SDPA's ``is_causal``
    path on CPU; private ops, in every torch this library supports), or ``(None, None)``."""
    ops = torch.ops.aten
    if not hasattr(ops, "_scaled_dot_product_flash_attention_for_cpu"):
        return None, None
    return ops._scaled_dot_product_flash_attention_for_cpu, ops._scaled_dot_product_flash_attention_for_cpu_backward


def default_store():
    """The default process group's key-value store, or None (a private torch API)."""
    getter = getattr(torch.distributed.distributed_c10d, "_get_default_store", None)
    try:
        return getter() if getter is not None else None
    except Exception:
        return None


def caller_locations():
    """Where the function calling this one was called from, then each frame further out: ``(filename, line,
    function name)``, innermost first. Locations only, never a frame's values: the library's one read of the
    interpreter's stack (the model check names the line of an operation it refuses; its trace skips
    torch.distributed's own operations). Iterate it in the function that called it."""
    frame = sys._getframe(2)  # 0: this generator, 1: the function iterating it, 2: that function's caller
    while frame is not None:
        yield frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name
        frame = frame.f_back


def has_forward_pre_hook(module: torch.nn.Module, hook) -> bool:
    """Whether ``hook`` is among ``module``'s own forward pre-hooks (kept by a deep copy or a pickle of the module,
    which run no registration hook)."""
    return any(h is hook for h in module._forward_pre_hooks.values())
