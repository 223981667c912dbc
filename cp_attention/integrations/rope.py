"""RoPE whose frequencies depend on the sequence length, under context parallelism.

Some rotary embeddings choose their frequencies from the positions they are given: transformers'
``dynamic_rope_update`` makes a ``"dynamic"`` rope (NTK scaling, and any registered type named
``*dynamic*``) recompute its frequencies once ``max(position_ids) + 1`` passes the cached length, and
a ``"longrope"`` rope (Phi-3, Phi-3.5, Phi-4-mini) switch from its short to its long factors once it
passes ``original_max_position_embeddings``; Phi-MoE's rotary picks its attention scale the same way.
On one device the maximum is the whole batch's. Under context parallelism each rank would read its
own shard's maximum (a zigzag shard of a 64-token row reads 48 on one rank, 64 on the other) and
rotate its queries and keys with other frequencies than one device does: silently wrong, and only in
the long-context runs context parallelism is for.

Here every rank computes from the global maximum: a hook on such a rotary module appends one
position, the batch's largest, to the positions it is called with, and drops that position's row
from its outputs (:func:`tag_ropes`). The module sees the maximum one device sees and computes
everything else position by position, so its cos/sin rows (and its cached state: a dynamic rope's
``max_seq_len_cached``) are exactly one device's. The largest position is the one
:meth:`~cp_attention.ContextParallel.shard_batch` recorded from the full batch (the text decoder's
M-RoPE rows for a vision-language model), else the group's maximum of the shards' positions (one
small all-gather).

Which rotary modules (:func:`length_dependent`): those whose forward transformers' rope-update wrapper
wraps and whose rope type that wrapper updates per forward (:func:`updates_per_forward`, the rule of
transformers' wrapper; ``tests/integrations/test_rope.py`` checks it against every type of the rope registry by
computing each one), and those whose own forward reads ``max(position_ids)``. A rotary module with
such a rope whose forward takes no ``position_ids`` cannot be given the maximum and is refused by
the model check (:func:`rope_findings`).

Legend: ``B`` rows, ``L`` tokens of this rank, ``D`` rotary dimension.
"""

from __future__ import annotations

import functools
import inspect
import re
import threading

import torch

from ..engine.context import active_context
from ..refusals import refuse

__all__ = ["length_dependent", "updates_per_forward", "rope_types", "tag_ropes", "rope_findings", "ROPE_ATTR"]

ROPE_ATTR = "_cp_attention_rope"
_READS_MAX = re.compile(r"\bmax\(\s*position_ids\b|\bposition_ids\.max\(|\bposition_ids\.amax\(")
_APPENDED = threading.local()  # per thread: a stack of the local lengths the hooks appended to


@functools.lru_cache(maxsize=1)
def _update_wrapper_code():
    """The code object of transformers' rope-update wrapper (one code object for every decorated
    forward), or None when transformers has none."""
    try:
        from transformers.modeling_rope_utils import dynamic_rope_update
    except ImportError:
        return None
    return dynamic_rope_update(lambda self, x, position_ids, layer_type=None: None).__code__


def updates_per_forward(rope_type: str) -> bool:
    """Whether transformers' rope-update wrapper recomputes a rope of ``rope_type`` from the
    positions of each forward (their maximum): ``"dynamic"`` types and ``"longrope"``."""
    return "dynamic" in rope_type or rope_type == "longrope"


def rope_types(module) -> tuple[str, ...]:
    """The rope type(s) of a rotary module: its ``rope_type`` (one per layer type when a dict)."""
    kind = getattr(module, "rope_type", None)
    if isinstance(kind, dict):
        return tuple(str(v) for v in kind.values())
    return () if kind is None else (str(kind),)


@functools.lru_cache(maxsize=None)
def _forward_facts(cls: type) -> tuple[bool, bool, bool]:
    """(wrapped by the rope-update wrapper, takes ``position_ids``, its own forward reads their maximum)."""
    forward = getattr(cls, "forward", None)
    if forward is None:
        return False, False, False
    wrapped = getattr(forward, "__code__", None) is not None and forward.__code__ is _update_wrapper_code()
    inner = getattr(forward, "__wrapped__", forward)
    try:
        takes = "position_ids" in inspect.signature(inner).parameters
        source = inspect.getsource(inner)
    except (TypeError, ValueError, OSError):
        return wrapped, False, False
    return wrapped, takes, _READS_MAX.search(source) is not None


def length_dependent(module) -> bool:
    """Whether ``module`` is a rotary embedding whose output depends on the largest position it is
    given (see the module docstring)."""
    wrapped, _, reads_max = _forward_facts(type(module))
    return reads_max or (wrapped and any(updates_per_forward(t) for t in rope_types(module)))


def rope_findings(modules) -> list[tuple[str, str]]:
    """``(module name, why)`` for each length-dependent rotary module of ``modules`` ((name, module)
    pairs) that cannot be given the global maximum: its forward takes no ``position_ids``."""
    found = []
    for name, module in modules:
        if length_dependent(module) and not _forward_facts(type(module))[1]:
            found.append((name or type(module).__name__,
                          f"its {'/'.join(rope_types(module)) or 'rope'} frequencies depend on the sequence "
                          "length, and its forward takes no position_ids through which every rank could be "
                          "given the whole sequence's"))
    return found


def tag_ropes(modules) -> None:
    """Hook the length-dependent rotary modules of ``modules`` ((name, module) pairs) so that, in a
    multi-rank block, they compute from the global largest position (once per module)."""
    for _, module in modules:
        if getattr(module, ROPE_ATTR, False) or not length_dependent(module) or not _forward_facts(type(module))[1]:
            continue
        module.register_forward_pre_hook(_append_largest, with_kwargs=True)
        module.register_forward_hook(_drop_appended, always_call=True)
        setattr(module, ROPE_ATTR, True)


def _largest_position(cp, position_ids: torch.Tensor) -> torch.Tensor:
    """The batch's largest position, as a 0-d tensor of ``position_ids``' dtype and device: the one
    ``shard_batch`` recorded, else the maximum over the group's shards."""
    record = cp.current_batch()
    extras = getattr(record, "extras", None)
    if isinstance(extras, dict) and extras.get("position_max") is not None:
        return torch.tensor(extras["position_max"], dtype=position_ids.dtype, device=position_ids.device)
    local = position_ids.detach().amax().reshape(1).to(cp.comm.device, torch.int64)
    everyone = cp.comm.all_gather(local, "the largest position of a length-dependent rope")
    largest = torch.stack(everyone).amax()
    if isinstance(extras, dict):
        extras["position_max"] = int(largest)
    return largest.to(position_ids.device, position_ids.dtype)


def _append_largest(module, args, kwargs):
    cp = active_context()
    stack = getattr(_APPENDED, "stack", None)
    if stack is None:
        stack = _APPENDED.stack = []
    in_args = len(args) > 1
    position_ids = args[1] if in_args else kwargs.get("position_ids")
    if cp is None or cp.world_size <= 1 or not isinstance(position_ids, torch.Tensor):
        stack.append(None)
        return None
    largest = _largest_position(cp, position_ids)
    extended = torch.cat([position_ids, largest.expand(*position_ids.shape[:-1], 1)], dim=-1)
    stack.append(position_ids.shape[-1])
    if in_args:
        return (args[0], extended, *args[2:]), kwargs
    return args, {**kwargs, "position_ids": extended}


def _drop_appended(module, args, output):
    stack = getattr(_APPENDED, "stack", None)
    length = stack.pop() if stack else None
    if length is None or output is None:
        return None

    def drop(t):
        if not isinstance(t, torch.Tensor) or t.dim() < 2 or t.shape[-2] != length + 1:
            raise refuse("rope_output_shape", module=type(module).__name__,
                         got=tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__, rows=length + 1)
        return t[..., :length, :]

    return tuple(drop(t) for t in output) if isinstance(output, tuple) else drop(output)
