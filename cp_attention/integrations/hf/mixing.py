"""What the mixer adapters share: which modules are a model's mixers, which sharded batch a mixer call runs
on, and the entry of every wrapped mixer function or method (eager, under torch.compile, under the model
check's trace).

A mixer module is one whose sequence mixing an adapter computes across ranks (a class calling an adapted
mixer function, or a class whose own method was adapted). The adapters mark a model's mixers before its
first forward under context parallelism (:func:`mark_mixer`, kept in :data:`MIXERS`, a weak map: nothing is
written onto the model); the guard counts the running ones in the forward's record
(:data:`.forward.FORWARD`), and a wrapped function runs across ranks only inside one.
"""

from __future__ import annotations

import functools
import sys

import torch

from . import source, state
from .function_admission import CONVENTIONS, admit, bind
from .versions import transformers_version
from ..patches import patch
from .forward import FORWARD
from .generation import running_decode
from .token_trace import owned, stand_in_output, tracing
from ...engine.batch import AMBIGUOUS, recomputed_batch
from ...engine.context import active_context
from ...engine.layer import compiling_outside_cp
from ...refusals import refuse
from ...torch_compat import WeakIdKeyDictionary, assume_constant_result, in_backward

__all__ = ["MIXERS", "mark_mixer", "is_mixer", "CLASS_MIXER_ATTR", "batch_for", "batch_for_any", "compiled_wrapper",
           "refuse_cache", "WRAPPED", "mark_calling", "bound_call", "wrap_functions", "declined", "declined_findings", "under_cp", "compiled_call", "delegated", "note_delegated", "class_mixer"]

MIXERS = WeakIdKeyDictionary()
"""module -> whether its sequence mixing runs across ranks (:func:`mark_mixer`; weak: dies with the module)."""


def mark_mixer(module, mixes: bool = True) -> None:
    """Mark ``module`` as a mixer (``mixes``) or as checked and not one; a module marked once keeps its mark."""
    if module not in MIXERS:
        MIXERS[module] = bool(mixes)


def is_mixer(module) -> bool:
    """Whether ``module`` is a marked mixer (see the module docstring). Asked by the guard on every module call: no
    weak reference is made while no model has marked mixers."""
    return bool(MIXERS) and MIXERS.get(module, False)


WRAPPED = "_cp_attention_mixer_function"  # on a mixer function's wrapper
CLASS_MIXER_ATTR = "_cp_attention_class_mixer"  # a class whose own mixing .recurrent adapted: the method's name


def batch_for(batch_size: int, length: int, compiled: bool = False):
    """The sharded batch a mixer call runs on, or None when it is not under context parallelism.
    ``compiled``: called from a graph torch.compile traced inside a multi-rank block (the module
    hooks that mark a running mixer do not run in compiled code): any call there of this shape."""
    if not compiled and not getattr(FORWARD, "mixers", 0):
        return None
    if running_decode() is not None:
        return None  # a decode step of generation: the mixers run replicated, from the prefill's last state
    active = active_context()
    if active is not None:
        record = getattr(FORWARD, "record", None)  # the running model forward's own batch
        if record is None or record is AMBIGUOUS or record.cp is not active:
            record = active.records.only()
    elif in_backward():
        record = recomputed_batch(batch_size, length)
    else:
        return None
    if record is AMBIGUOUS:
        raise refuse("mixer_ambiguous_batch")
    if record is None:
        return None
    local = record.local_position_ids.shape[-1]
    if record.meta.batch != batch_size or local != length:
        raise refuse("mixer_tokens_not_of_batch", batch_size=batch_size, length=length, rows=record.meta.batch,
                     local=local)
    return record


def batch_for_any():
    """The record a mixer of the running forward would run on (any shape), or None."""
    if running_decode() is not None:
        return None
    active = active_context()
    if active is None:
        return None
    record = getattr(FORWARD, "record", None)
    if record is None or record is AMBIGUOUS or record.cp is not active:
        record = active.records.only()
    return None if record is AMBIGUOUS else record


@assume_constant_result
def _traced_in_block() -> bool:
    """torch.compile traces inside a context_parallel block, one-rank ones included (asked once per
    trace): a one-rank block's mixers read its batch's documents, so they leave the graph there too."""
    return active_context() is not None


def compiled_wrapper(original, eager):
    """The wrapper's entry: ``eager(compiled, *args, **kwargs)`` decides; under torch.compile, traced
    outside every block the original is traced as it is (a graph replayed inside a multi-rank block is
    stopped by the attention op, which checks the context when it runs), traced inside one (a one-rank
    block included) the call leaves the graph and decides when it runs (the context is a contextvar
    dynamo cannot guard on)."""
    leave = torch.compiler.disable(functools.partial(eager, True))

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if torch.compiler.is_compiling():
            if compiling_outside_cp() and not _traced_in_block():
                return original(*args, **kwargs)
            return leave(*args, **kwargs)
        if tracing():  # the model check's trace: this mixing is the library's (.token_trace)
            with owned():
                return stand_in_output(original(*args, **kwargs), (args, kwargs))
        return eager(False, *args, **kwargs)

    return wrapper


def refuse_cache(name: str):
    raise refuse("mixer_cache", name=name)


def under_cp(compiled: bool) -> bool:
    """Whether a mixer call may run across ranks (cheap: read before the call's arguments are bound)."""
    return compiled or bool(getattr(FORWARD, "mixers", 0))


def compiled_call(compiled: bool) -> bool:
    """``compiled``, or called by a mixer's step function that left a compiled graph (:func:`_forward`)."""
    return compiled or bool(getattr(FORWARD, "compiled_step", False))


def delegated() -> int:
    return getattr(FORWARD, "delegated", 0)


def note_delegated() -> None:
    FORWARD.delegated = delegated() + 1


def class_mixer(cls: type) -> bool:
    """Whether ``cls`` computes its sequence mixing in a method :mod:`.adapters.mixer_classes` adapted, still the
    adapted one (a subclass overriding it is not)."""
    name = getattr(cls, CLASS_MIXER_ATTR, None)
    return isinstance(name, str) and bool(getattr(getattr(cls, name, None), CLASS_MIXER_ATTR, False))


def wrapped_in_module(cls: type, name: str) -> bool:
    """Whether ``name`` in the modeling module of ``cls`` is a mixer adapter's wrapper."""
    mod = sys.modules.get(cls.__module__)
    return bool(getattr(getattr(mod, name, None), WRAPPED, False))


def mark_calling(modules, names: tuple[str, ...]) -> None:
    """Mark as mixers the transformers modules of ``modules`` ((name, module) pairs) whose class calls one of
    the wrapped functions ``names`` of its modeling module (or computes its mixing in an adapted method)."""
    for _, module in modules:
        cls = type(module)
        if not cls.__module__.startswith("transformers.models.") or module in MIXERS:
            continue
        text = source.class_source(cls)
        if class_mixer(cls) or any(f"{name}(" in text and wrapped_in_module(cls, name) for name in names):
            MIXERS[module] = True


def bound_call(name: str, args: tuple, kwargs: dict) -> dict:
    """The arguments of a call of the mixer function ``name`` by its calling convention (refused if it does not
    bind: a convention transformers changed)."""
    try:
        return bind(name, args, kwargs)
    except TypeError as exc:
        raise refuse("mixer_call_unknown", name=name, version=transformers_version(), why=str(exc)) from None


def wrap_functions(mod, names: tuple[str, ...], make_wrapper, *, site: str) -> bool:
    """Wrap the functions ``names`` of the modeling module ``mod`` (idempotent) by ``make_wrapper(name,
    original)``, under ``site``; whether any is there. A function with a calling convention is admitted by its
    behaviour first (:func:`.function_admission.admit`); one declined is left as it is, and why is recorded
    (:func:`declined`)."""
    found = False
    for name in names:
        original = getattr(mod, name, None)
        if not callable(original) or getattr(original, WRAPPED, False):
            found = found or original is not None
            continue
        admitted = "none when wrapped: refused per call where it cannot compute"
        if name in CONVENTIONS:
            reason, admitted = admit(name, original, mod), "function_admission.admit (behaviour on synthetic inputs)"
            if reason is not None:
                with state.INTEGRATIONS_LOCK:
                    state.INTEGRATIONS["declined"][(mod.__name__, name)] = reason
                continue
        wrapper = make_wrapper(name, original)
        setattr(wrapper, WRAPPED, True)
        patch(mod, name, wrapper, site=site, admitted=admitted)
        found = True
    return found


def declined(module_name: str) -> dict:
    """The mixer functions of the modeling module ``module_name`` that failed their admission check:
    {function name: why}."""
    with state.INTEGRATIONS_LOCK:
        return {name: why for (mod, name), why in state.INTEGRATIONS["declined"].items() if mod == module_name}


def declined_findings(modules, names):
    """The model check's findings for what was declined in the modeling modules of ``modules`` ((name, module)
    pairs) among ``names`` (mixer functions' names, or a predicate on a declined name: ``Class.method``):
    ``(where, what, why)``, once per modeling module and name."""
    accepts = names if callable(names) else names.__contains__
    seen = set()
    for where, module in modules:
        module_name = type(module).__module__
        if module_name in seen:
            continue
        seen.add(module_name)
        for function, why in sorted(declined(module_name).items()):
            if accepts(function):
                yield (where or type(module).__name__, "a sequence mixer function not admitted",
                       f"transformers {transformers_version()}'s {module_name}.{function} does not do what "
                       f"cp_attention's adapter assumes ({why}), so it was left unadapted and would mix only this "
                       "shard's tokens")
