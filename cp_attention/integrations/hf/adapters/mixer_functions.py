"""transformers' sequence mixers under context parallelism: short convolutions, Mamba, Mamba-2 and
gated DeltaNet, exact across ranks and packed documents (the engine's :mod:`cp_attention.strategies.scan`).

transformers' hybrid families call their sequence mixing through a few module-level functions of
their modeling module (each with a torch path, or a fast kernel when one is installed; on transformers
5.25 each is a hub-kernel module). Each is admitted by its behaviour before it is wrapped
(:func:`.mixer_adapters.admit`): one that does not do what its adapter assumes is left as it is and
the families calling it are refused under context parallelism, as are those of a version whose
modeling modules lack these functions:

======================================  ==========================================  ======================
function                                families                                    here
======================================  ==========================================  ======================
``causal_conv1d_fn``                    all of them (LFM2's ShortConv is only it)   halo convolution
``causal_conv1d_forward``,             transformers 5.25: a mixer's step with its      checked to call the
``mamba2_scan_forward``,                cache, calling the functions here (a hub        adapted functions
``mamba_scan_forward``                  kernel can replace it)
``torch_chunk_gated_delta_rule``        Qwen3.5, Qwen3-Next, OLMo-hybrid            scan over pieces
``mamba2_chunk_scan``                   Nemotron-H, Falcon-H1, Granite-4.0-H,       scan over pieces
                                        Bamba, Zamba2
``mamba_selective_scan``                Jamba                                       scan over pieces
``mamba2_split_conv1d_scan_combined``   (a fused kernel's shortcut)                 declined: unfused path
``causal_conv1d_update``, ...           decoding with a cache                       refused under CP
======================================  ==========================================  ======================

When such a modeling module loads, each of these names is replaced by a wrapper (:func:`adapt_module`)
that calls the original unchanged unless a mixer of a ``cp_flash`` model runs inside a
``context_parallel`` block (or is recomputed by checkpointing after it): then the call runs on the
block's sharded batch through the engine, with the original function computing every segment (the
recurrences' ``initial_state`` arguments carry the incoming states). Which batch: the active
context's only live one, or, recomputed after the block, the only live multi-rank batch of the
call's shape (the rule of :mod:`cp_attention.engine.batch`). Which mixers: the modules the model check
tagged (:func:`tag_mixers`): those whose class calls one of these functions.
"""

from __future__ import annotations

import functools

import torch

from ..token_trace import owned, stand_in_output, tracing
from .. import source
from .. import state
from ....engine.batch import AMBIGUOUS, recomputed_batch
from ....engine.context import active_context
from ....engine.layer import compiling_outside_cp
from ....strategies.scan import agree, causal_conv, geometry_of, halo_plan, plan_for, scan, scan_plan
from ..generation import running_decode
from ..function_admission import ADAPTERS, CONVENTIONS, admit, bind, call_kwargs
from ...patches import patch
from ..versions import transformers_version
from ....engine.stats import note_mixer
from ....refusals import refuse
from ....torch_compat import assume_constant_result, in_backward

__all__ = ["CONVOLUTIONS", "CONV_FORWARDS", "SCAN_FORWARDS", "FORWARDS", "RECURRENCES", "SHORTCUTS", "DECODING",
           "adapt_module", "adapted", "handled_calls", "tag_mixers", "MIXER_ATTR", "CLASS_MIXER_ATTR", "class_mixer", "batch_for", "compiled_wrapper",
           "refuse_cache", "declined"]

CONVOLUTIONS = ("causal_conv1d_fn",)
# transformers 5.25: a mixer's step with its cache, calling the functions above (each replaceable by a hub kernel)
CONV_FORWARDS = ("causal_conv1d_forward",)
SCAN_FORWARDS = ("mamba2_scan_forward", "mamba_scan_forward")
FORWARDS = CONV_FORWARDS + SCAN_FORWARDS
RECURRENCES = ("torch_chunk_gated_delta_rule", "mamba2_chunk_scan", "mamba_selective_scan",
               "chunk_kimi_delta_attention")
SHORTCUTS = ("mamba2_split_conv1d_scan_combined", "mamba_inner_fn")  # fused kernels: None sends to the unfused path
DECODING = ("causal_conv1d_update", "torch_recurrent_gated_delta_rule", "mamba2_selective_state_update",
            "mamba_selective_state_update", "recurrent_kimi_delta_attention")
MIXER_ATTR = "_cp_attention_mixer"
CLASS_MIXER_ATTR = "_cp_attention_class_mixer"  # a class whose own mixing .recurrent adapted: the method's name
# (and, on that method's wrapper, True: a subclass that overrides the method is not adapted)
_WRAPPED = "_cp_attention_mixer_function"


def batch_for(batch_size: int, length: int, compiled: bool = False):
    """The sharded batch a mixer call runs on, or None when it is not under context parallelism.
    ``compiled``: called from a graph torch.compile traced inside a multi-rank block (the module
    hooks that mark a running mixer do not run in compiled code): any call there of this shape."""
    if not compiled and not getattr(state.MODEL_GUARD, "mixers", 0):
        return None
    if running_decode() is not None:
        return None  # a decode step of generation: the mixers run replicated, from the prefill's last state
    active = active_context()
    if active is not None:
        record = getattr(state.MODEL_GUARD, "record", None)  # the running model forward's own batch
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
    record = getattr(state.MODEL_GUARD, "record", None)
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


# ----------------------------------------------------------------------------------------------
# convolution


def _under_cp(compiled: bool) -> bool:
    """Whether a mixer call may run across ranks (cheap: read before the call's arguments are bound)."""
    return compiled or bool(getattr(state.MODEL_GUARD, "mixers", 0))


def _compiled(compiled: bool) -> bool:
    """``compiled``, or called by a mixer's step function that left a compiled graph (:func:`_forward`)."""
    return compiled or bool(getattr(state.MODEL_GUARD, "compiled_step", False))


def _bound(name: str, args: tuple, kwargs: dict) -> dict:
    try:
        return bind(name, args, kwargs)
    except TypeError as exc:
        raise refuse("mixer_call_unknown", name=name, version=transformers_version(), why=str(exc)) from None


def _convolution(original):
    def eager(compiled, *args, **kwargs):
        compiled = _compiled(compiled)
        if not _under_cp(compiled):
            return original(*args, **kwargs)
        bound = _bound("causal_conv1d_fn", args, kwargs)
        x = bound["x"]  # (B, C, Lr)
        record = batch_for(x.shape[0], x.shape[-1], compiled)
        if record is None:
            return original(*args, **kwargs)
        weight, bias = bound["weight"], bound["bias"]
        if weight.dim() == 3:  # an nn.Conv1d weight (C, 1, k)
            weight = weight.squeeze(1)
        kernel = weight.shape[-1]
        _note_delegated()
        agree(record, record.cp.comm, (0, x.shape[0], x.shape[1], kernel))
        plan = plan_for(record, "halo", kernel, lambda: halo_plan(geometry_of(record), kernel))
        y, stats = causal_conv(x.transpose(1, 2), weight, bias, plan, record.cp.comm)
        y = y.transpose(1, 2)
        activation = bound["activation"]
        if activation is not None:
            from transformers.activations import ACT2FN

            y = ACT2FN[activation](y)
        note_mixer(stats)
        return y.to(x.dtype)

    return compiled_wrapper(original, eager)


# ----------------------------------------------------------------------------------------------
# recurrences: the adapters of .mixer_adapters through the engine's scan


def _recurrence(name: str, original):
    adapter_cls = ADAPTERS[name]
    first = next(iter(CONVENTIONS[name].parameters))
    seq_dim = adapter_cls.token_dims[first]

    def eager(compiled, *args, **kwargs):
        compiled = _compiled(compiled)
        if not _under_cp(compiled):
            return original(*args, **kwargs)
        bound = _bound(name, args, kwargs)
        x = bound[first]
        record = batch_for(x.shape[0], x.shape[seq_dim], compiled)
        if record is None:
            return original(*args, **kwargs)
        _note_delegated()
        kw = call_kwargs(name, bound)
        if kw.get("initial_state") is not None or kw.get("initial_states") is not None:
            refuse_cache(name)
        final = bool(kw.get("output_final_state") or kw.get("return_final_states") or kw.get("return_last_state"))
        adapter = adapter_cls(original, kw)
        token_args = adapter.args(kw)
        state_shape, trans_shape, _ = adapter.shapes(token_args)
        agree(record, record.cp.comm, (1 + RECURRENCES.index(name), x.shape[0], *state_shape, *trans_shape, final))
        plan = plan_for(record, "scan", None, lambda: scan_plan(geometry_of(record)))
        out, stats, *last = scan(adapter, token_args, plan, record.cp.comm, x.shape[0], x.shape[seq_dim],
                                 final=final)
        note_mixer(stats)
        if getattr(adapter, "returns_state", False):
            return out, (last[0] if final else None)
        return (out, last[0]) if final else out

    return compiled_wrapper(original, eager)


def _delegated() -> int:
    return getattr(state.MODEL_GUARD, "delegated", 0)


def _note_delegated() -> None:
    state.MODEL_GUARD.delegated = _delegated() + 1


def _forward(name: str, original):
    """A mixer's step function (transformers 5.25: ``causal_conv1d_forward``, ``mamba2_scan_forward``,
    ``mamba_scan_forward``, each replaceable by a hub kernel): under context parallelism it must
    compute its mixing through this module's adapted functions, which is checked on every call (a
    kernel that computes it itself is refused: it would mix only this shard's tokens); a cache
    holding earlier tokens is refused. Outside, the original runs untouched."""

    def eager(compiled, *args, **kwargs):
        if not (_under_cp(compiled) and active_context() is not None and running_decode() is None):
            return original(*args, **kwargs)
        if name in CONV_FORWARDS:
            bound = _bound(name, args, kwargs)
            cache, layer = bound["cache"], bound["layer_idx"]
            if cache is not None and getattr(cache, "get_conv_state", None) is not None and \
                    cache.get_conv_state(layer) is not None:
                refuse_cache(name)
        before, outer = _delegated(), getattr(state.MODEL_GUARD, "compiled_step", False)
        state.MODEL_GUARD.compiled_step = outer or compiled  # its calls leave the graph with it
        try:
            out = original(*args, **kwargs)
        finally:
            state.MODEL_GUARD.compiled_step = outer
        if _delegated() == before and batch_for_any() is not None:
            raise refuse("mixer_forward_bypassed", name=name, version=transformers_version())
        return out

    return compiled_wrapper(original, eager)


def _shortcut(original):
    def eager(compiled, *args, **kwargs):
        if (compiled or getattr(state.MODEL_GUARD, "mixers", 0)) and \
                (active_context() is not None or in_backward()):
            return None  # a fused kernel over the whole sequence: the mixer takes its unfused path
        return original(*args, **kwargs)

    return compiled_wrapper(original, eager)


def _decoding(name: str, original):
    def eager(compiled, *args, **kwargs):
        if (compiled or getattr(state.MODEL_GUARD, "mixers", 0)) and active_context() is not None and \
                running_decode() is None:
            refuse_cache(name)
        return original(*args, **kwargs)

    return compiled_wrapper(original, eager)


def adapt_module(mod) -> bool:
    """Wrap the mixer functions of one modeling module (idempotent); whether any was wrapped. A
    function :func:`.mixer_adapters.admit` declines is left as it is, and why is recorded
    (:func:`declined`): the model check refuses the families that call it."""
    adapted_any = False
    for name in CONVOLUTIONS + FORWARDS + RECURRENCES + SHORTCUTS + DECODING:
        original = getattr(mod, name, None)
        if not callable(original) or getattr(original, _WRAPPED, False):
            adapted_any = adapted_any or original is not None
            continue
        admitted = "none when wrapped: refused per call where it cannot compute"
        if name in CONVENTIONS:
            reason, admitted = admit(name, original, mod), "mixer_adapters.admit (behaviour on synthetic inputs)"
            if reason is not None:
                with state.INTEGRATIONS_LOCK:
                    state.INTEGRATIONS["declined"][(mod.__name__, name)] = reason
                continue
        if name in CONVOLUTIONS:
            wrapper = _convolution(original)
        elif name in FORWARDS:
            wrapper = _forward(name, original)
        elif name in RECURRENCES:
            wrapper = _recurrence(name, original)
        elif name in SHORTCUTS:
            wrapper = _shortcut(original)
        else:
            wrapper = _decoding(name, original)
        setattr(wrapper, _WRAPPED, True)
        patch(mod, name, wrapper, site="mixer_functions", admitted=admitted)
        adapted_any = True
    return adapted_any


def declined(module_name: str) -> dict:
    """The mixer functions of the modeling module ``module_name`` that failed their admission check:
    {function name: why}."""
    with state.INTEGRATIONS_LOCK:
        return {name: why for (mod, name), why in state.INTEGRATIONS["declined"].items() if mod == module_name}


def adapted(cls: type, name: str) -> bool:
    """Whether ``name`` in the modeling module of ``cls`` is one of our wrappers."""
    import sys

    mod = sys.modules.get(cls.__module__)
    return bool(getattr(getattr(mod, name, None), _WRAPPED, False))


def handled_calls(cls: type, source: str) -> frozenset:
    """The adapted mixer functions the source of ``cls`` calls (empty: none)."""
    return frozenset(name for name in CONVOLUTIONS + FORWARDS + RECURRENCES
                     if f"{name}(" in source and adapted(cls, name))


def class_mixer(cls: type) -> bool:
    """Whether ``cls`` computes its sequence mixing in a method :mod:`.recurrent` adapted, still the
    adapted one (a subclass overriding it is not)."""
    name = getattr(cls, CLASS_MIXER_ATTR, None)
    return isinstance(name, str) and bool(getattr(getattr(cls, name, None), CLASS_MIXER_ATTR, False))


def tag_mixers(model, modules) -> None:
    """Mark the mixer modules of ``model`` (``modules``: (name, module) pairs) whose calls of the
    adapted functions run under context parallelism (see the module docstring)."""
    for _, module in modules:
        cls = type(module)
        if cls.__module__.startswith("transformers.models.") and getattr(module, MIXER_ATTR, None) is None:
            setattr(module, MIXER_ATTR, class_mixer(cls) or bool(handled_calls(cls, source.class_source(cls))))
