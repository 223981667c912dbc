"""transformers' sequence mixers under context parallelism: short convolutions, Mamba, Mamba-2 and
gated DeltaNet, exact across ranks and packed documents (the engine's :mod:`cp_attention.strategies.scan`).

transformers' hybrid families call their sequence mixing through a few module-level functions of
their modeling module (each with a torch path, or a fast kernel when one is installed; on transformers
5.25 each is a hub-kernel module). Each is admitted by its behaviour before it is wrapped
(:func:`..function_admission.admit`): one that does not do what its adapter assumes is left as it is and
the families calling it are refused under context parallelism, as are those of a version whose
modeling modules lack these functions:

======================================  ==========================================  ======================
function                                families                                    here
======================================  ==========================================  ======================
``causal_conv1d_fn``                    all of them (LFM2's ShortConv is only it)   halo convolution
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
call's shape (the rule of :mod:`cp_attention.engine.batch`). Which mixers: the modules marked before a model's
first forward under context parallelism (:meth:`MixerFunctions.prepare`, :func:`..mixing.mark_calling`): those
whose class calls one of these functions. transformers 5.25's step functions that call them are
:mod:`.step_functions`'.
"""

from __future__ import annotations

from .base import Adapter
from ..function_admission import FORMS, CONVENTIONS, call_kwargs
from ..mixing import (FORWARD, batch_for, bound_call, compiled_call, compiled_wrapper, declined_findings, is_mixer,
                      mark_calling, note_delegated, refuse_cache, under_cp, wrap_functions)
from ..generation import running_decode
from ....engine.context import active_context
from ....engine.stats import note_mixer
from ....strategies.scan import agree, causal_conv, geometry_of, halo_plan, plan_for, scan, scan_plan
from ....torch_compat import in_backward

__all__ = ["ADAPTER", "CONVOLUTIONS", "RECURRENCES", "SHORTCUTS", "DECODING", "adapt_module"]

CONVOLUTIONS = ("causal_conv1d_fn",)
RECURRENCES = ("torch_chunk_gated_delta_rule", "mamba2_chunk_scan", "mamba_selective_scan",
               "chunk_kimi_delta_attention")
SHORTCUTS = ("mamba2_split_conv1d_scan_combined", "mamba_inner_fn")  # fused kernels: None sends to the unfused path
DECODING = ("causal_conv1d_update", "torch_recurrent_gated_delta_rule", "mamba2_selective_state_update",
            "mamba_selective_state_update", "recurrent_kimi_delta_attention")


# ----------------------------------------------------------------------------------------------
# convolution


def _convolution(original):
    def eager(compiled, *args, **kwargs):
        compiled = compiled_call(compiled)
        if not under_cp(compiled):
            return original(*args, **kwargs)
        bound = bound_call("causal_conv1d_fn", args, kwargs)
        x = bound["x"]  # (B, C, Lr)
        record = batch_for(x.shape[0], x.shape[-1], compiled)
        if record is None:
            return original(*args, **kwargs)
        weight, bias = bound["weight"], bound["bias"]
        if weight.dim() == 3:  # an nn.Conv1d weight (C, 1, k)
            weight = weight.squeeze(1)
        kernel = weight.shape[-1]
        note_delegated()
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
    adapter_cls = FORMS[name]
    first = next(iter(CONVENTIONS[name].parameters))
    seq_dim = adapter_cls.token_dims[first]

    def eager(compiled, *args, **kwargs):
        compiled = compiled_call(compiled)
        if not under_cp(compiled):
            return original(*args, **kwargs)
        bound = bound_call(name, args, kwargs)
        x = bound[first]
        record = batch_for(x.shape[0], x.shape[seq_dim], compiled)
        if record is None:
            return original(*args, **kwargs)
        note_delegated()
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


def _shortcut(original):
    def eager(compiled, *args, **kwargs):
        if (compiled or getattr(FORWARD, "mixers", 0)) and \
                (active_context() is not None or in_backward()):
            return None  # a fused kernel over the whole sequence: the mixer takes its unfused path
        return original(*args, **kwargs)

    return compiled_wrapper(original, eager)


def _decoding(name: str, original):
    def eager(compiled, *args, **kwargs):
        if (compiled or getattr(FORWARD, "mixers", 0)) and active_context() is not None and \
                running_decode() is None:
            refuse_cache(name)
        return original(*args, **kwargs)

    return compiled_wrapper(original, eager)


def _wrapper(name: str, original):
    if name in CONVOLUTIONS:
        return _convolution(original)
    if name in RECURRENCES:
        return _recurrence(name, original)
    if name in SHORTCUTS:
        return _shortcut(original)
    return _decoding(name, original)


def adapt_module(mod) -> bool:
    """Wrap the mixer functions of one modeling module (idempotent); whether any was wrapped. A
    function :func:`..function_admission.admit` declines is left as it is, and why is recorded
    (:func:`..mixing.declined`): the model check refuses the families that call it."""
    return wrap_functions(mod, CONVOLUTIONS + RECURRENCES + SHORTCUTS + DECODING, _wrapper, site="mixer_functions")


class MixerFunctions(Adapter):
    """The module-level mixer functions (see the module docstring): wrapped as each modeling module loads,
    their declined ones refused by the model check, the modules calling them marked as mixers."""

    name = "mixer_functions"
    sites = ("mixer_functions",)
    adapts = ("a modeling module's sequence-mixer functions: causal_conv1d_fn, the gated delta rule, the Mamba and "
              "Mamba-2 scans (a halo convolution, a scan over pieces); their fused shortcuts and decoding forms")
    admission = ("the function's behaviour on synthetic inputs against a float64 oracle, before it is wrapped "
                 "(function_admission.admit); the shortcuts and decoding forms refuse per call what they cannot "
                 "compute")

    def adapt(self, mod) -> bool:
        return adapt_module(mod)

    def findings(self, modules):
        return declined_findings(modules, CONVOLUTIONS + RECURRENCES)

    def prepare(self, model, modules) -> None:
        mark_calling(modules, CONVOLUTIONS + RECURRENCES)

    def computes(self, module) -> bool:
        return is_mixer(module)


ADAPTER = MixerFunctions()
