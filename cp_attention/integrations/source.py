"""Reading model code: the source a family's classes are made of, for the checks that detect from
structure (the model check, the heads' losses, the mixers' tags) rather than from a list of names.
"""

from __future__ import annotations

import functools
import inspect

__all__ = ["class_source"]


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
