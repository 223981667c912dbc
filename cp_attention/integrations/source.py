"""Reading model code: the source a family's classes are made of, for the checks that detect from
structure (the model check, the heads' losses, the mixers' tags) rather than from a list of names.
"""

from __future__ import annotations

import functools
import inspect
import re

__all__ = ["class_source", "forward_args", "uses_attention_interface", "computes_scores", "per_token_part",
           "SHIFTED_SLICE", "INLINE_SEQUENCE"]


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


# the model check's rules over a class's source (docs/transformers.md#the-model-check)
_INTERFACE = ("ALL_ATTENTION_FUNCTIONS", "attention_interface")
_PRODUCT = re.compile(r"\b(?:matmul|einsum|bmm|baddbmm)\s*\(|[\w\)\]]\s@\s")
_TRANSPOSED = re.compile(r"\.transpose\(\s*(?:-1\s*,\s*-2|-2\s*,\s*-1|2\s*,\s*3|3\s*,\s*2)\s*\)|\.mT\b")
_FUSED = re.compile(r"scaled_dot_product_attention|flash_attn_(?:func|varlen_func|qkvpacked)")
_PARAMETER = re.compile(r"self\.(\w+)\s*=\s*(?:nn\.|torch\.nn\.)?Parameter\(")  # a class's own weights
_SELF_ATTR = re.compile(r"self\.(\w+)")
SHIFTED_SLICE = re.compile(r"\[:,\s*(?:1:|:-1)\s*\]")  # x[:, 1:], x[:, :-1]: a token shift by slicing
# sequence operations a mixer class might do itself besides the adapted functions
INLINE_SEQUENCE = re.compile(r"(?<!causal_)conv1d\(|\bcumsum\(|\btorch\.roll\(|\bsegment_sum\(|\.unfold\(|"
                              r"\bpad\(|\.flip\(")


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


@functools.lru_cache(maxsize=None)
def computes_scores(cls: type) -> bool:
    """Whether ``cls`` (not using the interface) computes attention scores itself."""
    if uses_attention_interface(cls):
        return False
    source = class_source(cls)
    if _FUSED.search(source):
        return True
    weights = set(_PARAMETER.findall(source))
    if "softmax" in source:  # a softmax over any product: scores (a learnable temperature is a weight too)
        return _PRODUCT.search(source) is not None
    product = any(not _weight_product(line, weights) for line in re.split(r"[\n;]", source) if _PRODUCT.search(line))
    return product and (_TRANSPOSED.search(source) is not None or "softmax" in source)


@functools.lru_cache(maxsize=None)
def per_token_part(cls: type) -> bool:
    """Whether ``cls``'s own code computes each token alone: no sequence operation, no loop, no
    recurrence function of its own (a gate that turns a decay parameter into per-token rates)."""
    text = class_source(cls)
    return not (INLINE_SEQUENCE.search(text) or SHIFTED_SLICE.search(text) or
                re.search(r"^\s*(?:for|while)\b|scan\(|recurren", text, re.M))


def _weight_product(line: str, weights: set) -> bool:
    """Whether a line's product has a weight as an operand (``self.x_proj_weight @ h``, Zamba's
    per-head projections): a weight times an activation is a projection, not scores; scores are a
    product of two activations."""
    return any(name in weights or name.endswith("weight") for name in _SELF_ATTR.findall(line))
