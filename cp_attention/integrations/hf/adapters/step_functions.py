"""transformers 5.25's mixer step functions under context parallelism: ``causal_conv1d_forward``,
``mamba2_scan_forward`` and ``mamba_scan_forward``.

From 5.25 a hybrid family's mixer calls one step function with its cache instead of the convolution and
scan functions directly; the step function then calls them (:mod:`.mixer_functions` adapts those), unless a
hub kernel replaces it and computes the mixing itself. So under context parallelism each step function is
checked on every call: it must hand its mixing to at least one adapted function (counted in the forward's
record, :data:`..forward.FORWARD`), or it is refused (a kernel of its own would mix only this shard's tokens);
a cache holding earlier tokens is refused too. ``causal_conv1d_forward`` is admitted by its behaviour first
(:func:`..function_admission.admit`: with no cache it returns the module's ``causal_conv1d_fn`` result).
Outside a block, and in a decode step of generate, the original runs untouched. The modules whose class
calls a step function are the model's mixers (:meth:`StepFunctions.prepare`).
"""

from __future__ import annotations

from .base import Adapter
from ..generation import running_decode
from ..mixing import (FORWARD, batch_for_any, bound_call, compiled_wrapper, declined_findings, delegated, mark_calling,
                      refuse_cache, under_cp, wrap_functions)
from ..versions import transformers_version
from ....engine.context import active_context
from ....refusals import refuse

__all__ = ["ADAPTER", "FORWARDS", "adapt_module"]

CONV_FORWARDS = ("causal_conv1d_forward",)
SCAN_FORWARDS = ("mamba2_scan_forward", "mamba_scan_forward")
FORWARDS = CONV_FORWARDS + SCAN_FORWARDS


def _forward(name: str, original):
    """The wrapper of the step function ``name`` (see the module docstring)."""

    def eager(compiled, *args, **kwargs):
        if not (under_cp(compiled) and active_context() is not None and running_decode() is None):
            return original(*args, **kwargs)
        if name in CONV_FORWARDS:
            bound = bound_call(name, args, kwargs)
            cache, layer = bound["cache"], bound["layer_idx"]
            if cache is not None and getattr(cache, "get_conv_state", None) is not None and \
                    cache.get_conv_state(layer) is not None:
                refuse_cache(name)
        before, outer = delegated(), getattr(FORWARD, "compiled_step", False)
        FORWARD.compiled_step = outer or compiled  # its calls leave the graph with it
        try:
            out = original(*args, **kwargs)
        finally:
            FORWARD.compiled_step = outer
        if delegated() == before and batch_for_any() is not None:
            raise refuse("mixer_forward_bypassed", name=name, version=transformers_version())
        return out

    return compiled_wrapper(original, eager)


def adapt_module(mod) -> bool:
    """Wrap the step functions of one modeling module (idempotent); whether any is there."""
    return wrap_functions(mod, FORWARDS, _forward, site="mixer_functions")


class StepFunctions(Adapter):
    """transformers 5.25's mixer step functions (see the module docstring)."""

    name = "step_functions"
    sites = ("mixer_functions", "admission_probe")
    adapts = ("transformers 5.25's mixer step functions: causal_conv1d_forward, mamba2_scan_forward, "
              "mamba_scan_forward")
    admission = ("causal_conv1d_forward's behaviour with no cache (it returns the module's causal_conv1d_fn result); "
                 "each step checked on every call under context parallelism to hand its mixing to an adapted function")

    def adapt(self, mod) -> bool:
        return adapt_module(mod)

    def findings(self, modules):
        return declined_findings(modules, FORWARDS)

    def prepare(self, model, modules) -> None:
        mark_calling(modules, FORWARDS)


ADAPTER = StepFunctions()
