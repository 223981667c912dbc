"""Reading model code: the source a family's classes are made of, for the checks that detect from
structure (the heads' losses, the mixers' tags, the attention guard's count) rather than from a list of names.
"""

from __future__ import annotations

import functools
import inspect

__all__ = ["class_source", "forward_args", "uses_attention_interface"]


@functools.lru_cache(maxsize=None)
def class_source(cls: type) -> str:
    """The source of ``cls`` and of its bases that are model code (not torch's, not transformers'
    shared base classes such as ``PreTrainedModel``); "" where it cannot be read."""
    parts = []
    for klass in cls.__mro__:
        where = klass.__module__
        if klass is object or where.startswith("torch.") or (
                where.startswith("transformers.") and not where.startswith("transformers.models.")):
            continue
        try:
            parts.append(inspect.getsource(klass))
        except (OSError, TypeError):
            pass
    return "\n".join(parts)


# transformers' attention interface, named in the code of a class that dispatches through it
_INTERFACE = ("ALL_ATTENTION_FUNCTIONS", "attention_interface")


@functools.lru_cache(maxsize=None)
def forward_args(cls: type) -> frozenset:
    try:
        return frozenset(inspect.signature(cls.forward).parameters)
    except (TypeError, ValueError):
        return frozenset()


@functools.lru_cache(maxsize=None)
def uses_attention_interface(cls: type) -> bool:
    """Whether ``cls`` dispatches its attention through transformers' attention interface."""
    source = class_source(cls)
    return any(word in source for word in _INTERFACE)
