"""transformers' sequence mixers under context parallelism: short convolutions, Mamba, Mamba-2 and
gated DeltaNet, exact across ranks and packed documents (the engine's :mod:`cp_attention.strategies.scan`).

transformers' hybrid families call their sequence mixing through a few module-level functions of
their modeling module (each with a torch path, or a fast kernel when one is installed; checked on
transformers 5.24: a version whose modeling modules lack them leaves the mixers refused):

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
call's shape (the rule of :mod:`cp_attention.engine.batch`). Which mixers: the modules the model check
tagged (:func:`tag_mixers`): those whose class calls one of these functions.
"""

from __future__ import annotations

import functools
import inspect
from types import MappingProxyType

import torch

from . import source, state
from ..engine.batch import AMBIGUOUS, recomputed_batch
from ..engine.context import active_context
from ..engine.layer import compiling_outside_cp
from ..strategies.scan import agree, causal_conv, geometry_of, halo_plan, plan_for, scan, scan_plan
from .generation import running_decode
from ..engine.stats import note_mixer
from ..refusals import refuse
from ..torch_compat import assume_constant_result, in_backward

__all__ = ["CONVOLUTIONS", "RECURRENCES", "SHORTCUTS", "DECODING", "adapt_module", "adapted", "handled_calls",
           "tag_mixers", "MIXER_ATTR", "CLASS_MIXER_ATTR", "class_mixer", "batch_for", "compiled_wrapper",
           "refuse_cache"]

CONVOLUTIONS = ("causal_conv1d_fn",)
RECURRENCES = ("torch_chunk_gated_delta_rule", "mamba2_chunk_scan", "mamba_selective_scan",
               "chunk_kimi_delta_attention")
SHORTCUTS = ("mamba2_split_conv1d_scan_combined", "mamba_inner_fn")  # fused kernels: None sends to the unfused path
DECODING = ("causal_conv1d_update", "torch_recurrent_gated_delta_rule", "mamba2_selective_state_update",
            "mamba_selective_state_update", "recurrent_kimi_delta_attention")
MIXER_ATTR = "_cp_attention_mixer"
CLASS_MIXER_ATTR = "_cp_attention_class_mixer"  # a class whose own mixing .recurrent adapted: the method's name
# (and, on that method's wrapper, True: a subclass that overrides the method is not adapted)
_WRAPPED = "_cp_attention_mixer_function"
_DOCS_KWARGS = ("cu_seqlens", "seq_idx", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


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
        return eager(False, *args, **kwargs)

    return wrapper


def refuse_cache(name: str):
    raise refuse("mixer_cache", name=name)


# ----------------------------------------------------------------------------------------------
# convolution


def _convolution(original):
    sig = inspect.signature(original)
    names = list(sig.parameters)

    def eager(compiled, *args, **kwargs):
        bound = sig.bind(*args, **kwargs).arguments
        x = bound[names[0]]  # (B, C, Lr)
        record = batch_for(x.shape[0], x.shape[-1], compiled)
        if record is None:
            return original(*args, **kwargs)
        weight, bias = bound[names[1]], bound.get(names[2]) if len(names) > 2 else None
        if weight.dim() == 3:  # an nn.Conv1d weight (C, 1, k)
            weight = weight.squeeze(1)
        kernel = weight.shape[-1]
        agree(record, record.cp.comm, (0, x.shape[0], x.shape[1], kernel))
        plan = plan_for(record, "halo", kernel, lambda: halo_plan(geometry_of(record), kernel))
        y, stats = causal_conv(x.transpose(1, 2), weight, bias, plan, record.cp.comm)
        y = y.transpose(1, 2)
        activation = bound.get("activation")
        if activation is not None:
            from transformers.activations import ACT2FN

            y = ACT2FN[activation](y)
        note_mixer(stats)
        return y.to(x.dtype)

    return compiled_wrapper(original, eager)


# ----------------------------------------------------------------------------------------------
# recurrences: one adapter per function


def _kwargs(bound: dict, sig) -> dict:
    out = {}
    for name, value in bound.items():
        if sig.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        else:
            out[name] = value
    return {k: v for k, v in out.items() if k not in _DOCS_KWARGS}


class _GatedDelta:
    """``torch_chunk_gated_delta_rule(query, key, value, g, beta, ...)``: query/key (B, L, Hk, Dk),
    value (B, L, Hv, Dv), g/beta (B, L, Hv); state (Hv, Dk, Dv), ``S_t = e^{g_t} (I - b_t k_t k_t^T)
    S_{t-1} + b_t k_t v_t^T``, output ``S_t^T q_t``. Transition (Hv, Dk, Dk): a probe from the
    identity with zero values."""

    token_dims = {"query": 1, "key": 1, "value": 1, "g": 1, "beta": 1}
    out_dim = 1
    returns_state = True  # (output, final state or None)

    def __init__(self, original, kw: dict):
        self.original, self.kw = original, kw
        for name in ("initial_state", "output_final_state"):
            self.kw.pop(name, None)

    def args(self, kw):
        return {name: kw.pop(name) for name in self.token_dims}

    def shapes(self, a):
        Hv, Dv = a["value"].shape[2:]
        Dk = a["key"].shape[3]
        return (Hv, Dk, Dv), (Hv, Dk, Dk), torch.float32

    def _call(self, a, value, initial):
        return self.original(a["query"], a["key"], value, g=a["g"], beta=a["beta"], initial_state=initial,
                             output_final_state=True, **self.kw)

    def run(self, a):
        return self._call(a, a["value"], None)

    def transition(self, a):
        N, n, Hv = a["value"].shape[:3]
        Dk = a["key"].shape[3]
        eye = torch.eye(Dk, dtype=torch.float32, device=a["key"].device).expand(N, Hv, Dk, Dk).contiguous()
        return self._call(a, a["value"].new_zeros(N, n, Hv, Dk), eye)[1]

    def apply(self, T, S):
        return T @ S

    def correct(self, a, S):
        return self._call(a, a["value"], S.contiguous())[0]


class _Mamba2:
    """``mamba2_chunk_scan(hidden_states, dt, A, B, C, chunk_size, ...)``: hidden_states (B, L, H, P),
    dt (B, L, H), B/C (B, L, G, N); state (H, P, N), ``h_t = e^{dt_t A} h_{t-1} + dt_t x_t B_t^T``,
    output ``h_t C_t + D x_t``. Transition (H, 1, 1): the decay, a probe from ones with zero inputs."""

    token_dims = {"hidden_states": 1, "dt": 1, "B": 1, "C": 1, "z": 1}
    out_dim = 1

    def __init__(self, original, kw: dict):
        self.original, self.kw = original, kw
        for name in ("initial_states", "return_final_states"):
            self.kw.pop(name, None)

    def args(self, kw):
        out = {name: kw.pop(name) for name in ("hidden_states", "dt", "B", "C")}
        out["z"] = kw.pop("z", None)
        return out

    def shapes(self, a):
        H, P = a["hidden_states"].shape[2:]
        return (H, P, a["B"].shape[3]), (H, 1, 1), torch.float32

    def _call(self, a, x, initial, final=True, D=True):
        kw = dict(self.kw)
        if not D:
            kw["D"] = None
        if a["z"] is not None:
            kw["z"] = a["z"]
        return self.original(x, a["dt"], kw.pop("A"), a["B"], a["C"], initial_states=initial,
                             return_final_states=final, **kw)

    def run(self, a):
        return self._call(a, a["hidden_states"], None)

    def transition(self, a):
        N, _, H, P = a["hidden_states"].shape
        ones = torch.ones(N, H, P, a["B"].shape[3], dtype=torch.float32, device=a["dt"].device)
        return self._call(a, torch.zeros_like(a["hidden_states"]), ones, D=False)[1][..., :1, :1]

    def apply(self, T, S):
        return T * S

    def correct(self, a, S):
        return self._call(a, a["hidden_states"], S.contiguous(), final=False)


class _Mamba:
    """``mamba_selective_scan(hidden_states, dt, A, B, C, D, z, delta_bias, delta_softplus, ...)``:
    hidden_states/dt/z (B, D, L), A (D, N), B/C (B, N, L); state (D, N), ``h_t = e^{dt_t A} h_{t-1} +
    dt_t B_t x_t``, output ``(h_t C_t + D x_t) * silu(z_t)``. It takes no initial state: the
    transition ``e^{A sum dt}`` and the incoming state's effect are computed here, from that definition.
    Its segments run through transformers' torch reference (the function under its wrappers): the
    ``mamba_ssm`` kernel it dispatches to when installed returns a last state its backward ignores,
    and the scan differentiates through that state. The correction holds (N, D, n, N_state) float32
    values, as the torch reference itself does."""

    additive = True  # the correction adds to the zero-state outputs (no initial-state argument to re-run from)

    token_dims = {"hidden_states": 2, "dt": 2, "B": 2, "C": 2, "z": 2}
    out_dim = 2

    def __init__(self, original, kw: dict):
        self.original, self.kw = inspect.unwrap(original), kw
        self.kw.pop("return_last_state", None)

    def args(self, kw):
        out = {name: kw.pop(name) for name in ("hidden_states", "dt", "B", "C")}
        out["z"] = kw.pop("z", None)
        return out

    def shapes(self, a):
        dtype = torch.promote_types(a["hidden_states"].dtype, torch.float32)
        return tuple(self.kw["A"].shape), tuple(self.kw["A"].shape), dtype

    def run(self, a):
        return self.original(a["hidden_states"], a["dt"], B=a["B"], C=a["C"], z=a["z"], return_last_state=True,
                             **self.kw)

    def _dt(self, a):
        dt = a["dt"].float()
        bias = self.kw.get("delta_bias")
        if bias is not None:
            dt = dt + bias.to(dt.dtype)[..., None]
        if self.kw.get("delta_softplus"):
            dt = torch.nn.functional.softplus(dt)
        return dt  # (N, D, n)

    def transition(self, a):
        return torch.exp(self.kw["A"][None] * self._dt(a).sum(-1)[..., None])

    def apply(self, T, S):
        return T * S

    def correct(self, a, S):
        decay = torch.exp(self.kw["A"][None, :, None, :] * self._dt(a).cumsum(-1)[..., None])  # (N, D, n, Ns)
        h = decay * S[:, :, None, :].to(decay.dtype)
        y = (h * a["C"].transpose(1, 2)[:, None].to(h.dtype)).sum(-1)  # (N, D, n)
        if a["z"] is not None:
            y = y * torch.nn.functional.silu(a["z"])
        return y


_ADAPTERS = MappingProxyType({"torch_chunk_gated_delta_rule": _GatedDelta, "mamba2_chunk_scan": _Mamba2,
                               "mamba_selective_scan": _Mamba, "chunk_kimi_delta_attention": _GatedDelta})


def _recurrence(name: str, original):
    sig = inspect.signature(original)
    first, adapter_cls = list(sig.parameters)[0], _ADAPTERS[name]
    seq_dim = adapter_cls.token_dims[next(iter(adapter_cls.token_dims))]

    def eager(compiled, *args, **kwargs):
        bound = sig.bind(*args, **kwargs).arguments
        x = bound[first]
        record = batch_for(x.shape[0], x.shape[seq_dim], compiled)
        if record is None:
            return original(*args, **kwargs)
        kw = _kwargs(bound, sig)
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


# the parameters each adapted function must take (by name, in this order), or it is left alone: a
# function of the same name with another signature is another function, and the model check then
# refuses the mixer that calls it
_SIGNATURES = MappingProxyType({
    "causal_conv1d_fn": 2,  # (input (B, C, L), weight, [bias], activation=...)
    "torch_chunk_gated_delta_rule": ("query", "key", "value", "g", "beta", "initial_state", "output_final_state"),
    "chunk_kimi_delta_attention": ("query", "key", "value", "g", "beta", "initial_state", "output_final_state"),
    "mamba2_chunk_scan": ("hidden_states", "dt", "A", "B", "C", "chunk_size", "initial_states",
                          "return_final_states"),
    "mamba_selective_scan": ("hidden_states", "dt", "A", "B", "C", "D", "z", "delta_bias", "delta_softplus",
                             "return_last_state"),
})


def _fits(name: str, original) -> bool:
    want = _SIGNATURES.get(name)
    if want is None:
        return True
    try:
        params = list(inspect.signature(original).parameters)
    except (TypeError, ValueError):
        return False
    if isinstance(want, int):
        return len(params) >= want
    return all(p in params for p in want) and params[:5] == list(want[:5])


def adapt_module(mod) -> bool:
    """Wrap the mixer functions of one modeling module (idempotent); whether any was wrapped."""
    adapted_any = False
    for name in CONVOLUTIONS + RECURRENCES + SHORTCUTS + DECODING:
        original = getattr(mod, name, None)
        if not callable(original) or getattr(original, _WRAPPED, False):
            adapted_any = adapted_any or original is not None
            continue
        if not _fits(name, original):
            continue
        if name in CONVOLUTIONS:
            wrapper = _convolution(original)
        elif name in RECURRENCES:
            wrapper = _recurrence(name, original)
        elif name in SHORTCUTS:
            wrapper = _shortcut(original)
        else:
            wrapper = _decoding(name, original)
        setattr(wrapper, _WRAPPED, True)
        setattr(mod, name, wrapper)
        adapted_any = True
    return adapted_any


def adapted(cls: type, name: str) -> bool:
    """Whether ``name`` in the modeling module of ``cls`` is one of our wrappers."""
    import sys

    mod = sys.modules.get(cls.__module__)
    return bool(getattr(getattr(mod, name, None), _WRAPPED, False))


def handled_calls(cls: type, source: str) -> frozenset:
    """The adapted mixer functions the source of ``cls`` calls (empty: none)."""
    return frozenset(name for name in CONVOLUTIONS + RECURRENCES
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
