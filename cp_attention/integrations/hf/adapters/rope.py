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

Admitted by its behaviour (:func:`rope_reason`): before a rotary module is hooked, a copy of it computes
the rows of a rank's positions (the middle half of a row, so without its largest) with the row's largest
appended, as the hook gives them, and another copy computes the whole row, as one device does; the rows
must be equal (both outputs), with the row long enough to pass the rope's own threshold (its cached or
original length) where that fits in :data:`_CHECK_TOKENS`. A rope computed otherwise (from the count of
positions, or mixing them) is not hooked and the model check refuses the model, naming the transformers
version and the class.

Legend: ``B`` rows, ``L`` tokens of this rank, ``D`` rotary dimension.
"""

from __future__ import annotations

import copy
import functools
import inspect
import re
import threading

import torch

from ....engine.context import active_context
from ....refusals import refuse
from ..versions import transformers_version
from .base import Adapter
from ....torch_compat import WeakIdKeyDictionary
from ...patches import record

__all__ = ["ADAPTER", "length_dependent", "updates_per_forward", "rope_types", "tag_ropes", "rope_findings", "rope_reason",
           "hooked"]

_READS_MAX = re.compile(r"\bmax\(\s*position_ids\b|\bposition_ids\.max\(|\bposition_ids\.amax\(")
_APPENDED = threading.local()  # per thread: a stack of the local lengths the hooks appended to
_VERDICTS = WeakIdKeyDictionary()  # rotary module -> rope_reason's verdict, once per module object
_HOOKED = WeakIdKeyDictionary()  # rotary module -> True: its hooks are registered (tag_ropes)
_CHECK_TOKENS = 1 << 15  # the longest row the admission check computes
_THRESHOLDS = ("original_max_seq_len", "max_seq_len_cached", "original_max_position_embeddings",
               "max_position_embeddings")


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
    code, fn, wrapped = _update_wrapper_code(), forward, False
    while fn is not None and not wrapped:  # the wrapper under other decorators too (5.17: torch.no_grad() outside it)
        wrapped = code is not None and getattr(fn, "__code__", None) is code
        fn = getattr(fn, "__wrapped__", None)
    inner = inspect.unwrap(forward)
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
    pairs) that cannot be given the global maximum: its forward takes no ``position_ids``, or it does not
    compute as the hook assumes (:func:`rope_reason`)."""
    found = []
    for name, module in modules:
        if not length_dependent(module):
            continue
        if not _forward_facts(type(module))[1]:
            found.append((name or type(module).__name__,
                          f"its {'/'.join(rope_types(module)) or 'rope'} frequencies depend on the sequence "
                          "length, and its forward takes no position_ids through which every rank could be "
                          "given the whole sequence's"))
        elif rope_reason(module) is not None:
            cls = type(module)
            found.append((name or cls.__name__,
                          f"transformers {transformers_version()}'s {cls.__module__}.{cls.__qualname__} does not "
                          f"compute its rows as cp_attention's rope hook assumes ({rope_reason(module)}), so "
                          "every rank would rotate with other frequencies than one device"))
    return found


def _threshold(module) -> int:
    """The longest length the rope's own code compares positions with (its attributes or config)."""
    config = getattr(module, "config", None)
    values = [getattr(module, name, None) for name in _THRESHOLDS] + \
        [getattr(config, name, None) for name in _THRESHOLDS]
    return max([int(v) for v in values if isinstance(v, (int, float)) and v > 0] or [8])


def _rows(module, position_ids: torch.Tensor, keep: int) -> list[torch.Tensor]:
    """A fresh copy of ``module``'s outputs for ``position_ids`` (1, n), their first ``keep`` rows (dim -2),
    once per layer type of a rope with several."""
    kinds = getattr(module, "rope_type", None)
    layer_types = list(kinds) if isinstance(kinds, dict) else [None]
    probe = copy.deepcopy(module)
    buffer = next(iter(probe.buffers()), None)
    device = buffer.device if buffer is not None else torch.device("cpu")
    x = torch.zeros(1, position_ids.shape[-1], 1, device=device)
    out = []
    for layer_type in layer_types:
        kwargs = {} if layer_type is None else {"layer_type": layer_type}
        got = probe(x, position_ids.to(device), **kwargs)
        out += [t[..., :keep, :] for t in (got if isinstance(got, tuple) else (got,))]
    return out


def rope_reason(module) -> str | None:
    """None when the length-dependent rotary ``module`` computes each position's rows from that position
    and the row's largest only (what the hook relies on; see the module docstring), else why not. Once
    per module object."""
    verdict = _VERDICTS.get(module, ())
    if verdict != ():
        return verdict
    T = min(max(2 * _threshold(module), 16), _CHECK_TOKENS)
    T -= T % 4
    whole = torch.arange(T)[None]
    part = torch.arange(T // 4, 3 * T // 4)[None]  # a rank's positions: not the row's largest
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            one_device = _rows(module, whole, T)
            ranks = _rows(module, torch.cat([part, whole[:, -1:]], dim=-1), part.shape[-1])
        verdict = None
        if len(one_device) != len(ranks):
            verdict = "its outputs differ in number with the positions given"
        for a, b in zip(ranks, one_device):
            b = b[..., T // 4:3 * T // 4, :]
            if a.shape != b.shape or not torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-6):
                verdict = (f"the rows of positions {T // 4}-{3 * T // 4 - 1} with position {T - 1} appended differ "
                           f"from those of the whole row of {T}")
                break
    except Exception as exc:
        verdict = f"computing its rows raised {type(exc).__name__}: {str(exc)[:200]}"
    _VERDICTS[module] = verdict
    return verdict


def tag_ropes(modules) -> None:
    """Hook the length-dependent rotary modules of ``modules`` ((name, module) pairs) so that, in a
    multi-rank block, they compute from the global largest position (once per module)."""
    for _, module in modules:
        if _HOOKED.get(module, False) or not length_dependent(module) or not _forward_facts(type(module))[1] \
                or rope_reason(module) is not None:
            continue
        module.register_forward_pre_hook(_append_largest, with_kwargs=True)
        module.register_forward_hook(_drop_appended, always_call=True)
        record("rope_hooks", f"{type(module).__module__}.{type(module).__qualname__} (an instance): forward hooks",
               (_append_largest, _drop_appended), admitted="rope.rope_reason", instance=True)
        _HOOKED[module] = True


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


def hooked(module) -> bool:
    """Whether ``module`` is a length-dependent rotary module whose hooks :func:`tag_ropes` registered."""
    return _HOOKED.get(module, False)


class Rope(Adapter):
    """Length-dependent rotary modules (see the module docstring): refused by the model check where they cannot
    be given the whole sequence's largest position, hooked before a model's first forward under context
    parallelism where they can."""

    name = "rope"
    sites = ("rope_hooks",)
    adapts = "a length-dependent rotary module instance (dynamic, longrope): hooked to read the sequence's largest position"
    admission = "a copy computes a rank's rows as the whole row's (rope_reason); refused by the model check otherwise"

    def findings(self, modules):
        for where, why in rope_findings(modules):
            yield where, "a rope computed from the shard's length", why

    def prepare(self, model, modules) -> None:
        tag_ropes(modules)


ADAPTER = Rope()
