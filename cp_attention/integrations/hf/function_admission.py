"""What :mod:`.adapters.mixer_functions` assumes of transformers' mixer functions, and the check that admits a function by
its behaviour before anything wraps it.

Each adapted function has a calling convention (:data:`CONVENTIONS`: the arguments the adapter reads,
by position and name, whatever signature the function object shows: transformers 5.25 turned these
functions into hub-kernel modules whose signature is ``(*args, **kwargs)``) and a behaviour the
adapter relies on. :func:`admit` runs the function on small synthetic inputs (a private random
generator, and the process's random state restored after: modeling modules load while a model is
initialised) and compares:

==================================  ===========================================================================
function                            what must hold (float32 inputs, float64 oracle)
==================================  ===========================================================================
``causal_conv1d_fn``                ``y_t = act(b + sum_j w_j x_{t-k+1+j})``, zeros before the first token, for
                                    no activation and for ``"silu"`` (the oracle is written here, in float64)
``causal_conv1d_forward``           with no cache, it returns what the module's ``causal_conv1d_fn`` returns for
                                    the convolution's weight (it computes nothing else: the halo is that call's)
the four recurrences                the whole sequence from a random state equals the adapter's composition of
                                    two pieces (first piece from the state, second from zero, its transition and
                                    its correction): what the scan over ranks computes, checked against the
                                    function's own one-call result, outputs and final state
==================================  ===========================================================================

A function that fails is not wrapped (:mod:`.adapters.mixer_functions` records why); the model check then refuses the
families that call it under context parallelism, naming the transformers version and the function.

The recurrence adapters: one class per function, with the methods the engine's scan
(:class:`cp_attention.strategies.scan.RecurrenceAdapter`) calls.
"""

from __future__ import annotations

import inspect
import logging
from types import MappingProxyType

import torch

from ..patches import temporarily

__all__ = ["FORMS", "CONVENTIONS", "GatedDelta", "Mamba2", "Mamba", "admit", "bind", "call_kwargs",
           "agrees", "composition_reason"]

_DOCS_KWARGS = ("cu_seqlens", "seq_idx", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


# the conventions, as parameter lists (never called)
def _convolution(x, weight, bias=None, activation=None, **kwargs): ...
def _convolution_forward(conv1d, hidden_states, cache, layer_idx, activation=None, **kwargs): ...
def _delta_rule(query, key, value, g, beta, **kwargs): ...
def _mamba2_scan(hidden_states, dt, A, B, C, chunk_size, **kwargs): ...
def _selective_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                    return_last_state=False, **kwargs): ...


CONVENTIONS = MappingProxyType({
    "causal_conv1d_fn": inspect.signature(_convolution),
    "causal_conv1d_forward": inspect.signature(_convolution_forward),
    "torch_chunk_gated_delta_rule": inspect.signature(_delta_rule),
    "chunk_kimi_delta_attention": inspect.signature(_delta_rule),
    "mamba2_chunk_scan": inspect.signature(_mamba2_scan),
    "mamba_selective_scan": inspect.signature(_selective_scan),
})
"""The arguments each adapter reads: the call sites' convention (positions and names), not the function
object's signature. A call that does not bind to it is refused under context parallelism."""


def bind(name: str, args: tuple, kwargs: dict) -> dict:
    """The arguments of a call of ``name`` by its convention (TypeError when the call does not fit)."""
    bound = CONVENTIONS[name].bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def call_kwargs(name: str, bound: dict) -> dict:
    """The bound arguments with ``**kwargs`` flattened, less the document arguments (the engine's)."""
    sig, out = CONVENTIONS[name], {}
    for key, value in bound.items():
        if sig.parameters[key].kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        else:
            out[key] = value
    return {k: v for k, v in out.items() if k not in _DOCS_KWARGS}


class GatedDelta:
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


class Mamba2:
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


class Mamba:
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


FORMS = MappingProxyType({"torch_chunk_gated_delta_rule": GatedDelta, "mamba2_chunk_scan": Mamba2,
                              "mamba_selective_scan": Mamba, "chunk_kimi_delta_attention": GatedDelta})


# ----------------------------------------------------------------------------------------------
# admission: the behaviour each adapter relies on, checked on synthetic inputs

_L, _CUT = 9, 5  # synthetic tokens, and where the recurrences' check cuts them into two pieces
_TOL = MappingProxyType({"rtol": 1e-4, "atol": 1e-5})


def _conv_oracle(x, weight, bias, activation) -> torch.Tensor:
    """float64 causal depthwise convolution from its definition: ``y_t = b + sum_j w_j x_{t-k+1+j}``."""
    x, w = x.double(), weight.double()
    k, L = w.shape[-1], x.shape[-1]
    y = torch.zeros_like(x) if bias is None else bias.double()[None, :, None].expand_as(x).clone()
    for j in range(k):
        shift = k - 1 - j  # the tap j reads the token ``shift`` places earlier
        y[..., shift:] += w[:, j, None] * x[..., :L - shift]
    return y * torch.sigmoid(y) if activation == "silu" else y


def _synthetic(name: str, g: torch.Generator) -> tuple[dict, dict]:
    """(per-token arguments, other arguments) of one small call of ``name`` (batch 2, :data:`_L` tokens)."""
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    if name in ("torch_chunk_gated_delta_rule", "chunk_kimi_delta_attention"):
        H, Dk, Dv = 2, 4, 3
        decay = (2, _L, H, Dk) if name == "chunk_kimi_delta_attention" else (2, _L, H)
        return dict(query=r(2, _L, H, Dk), key=torch.nn.functional.normalize(r(2, _L, H, Dk), dim=-1),
                    value=r(2, _L, H, Dv), g=-torch.rand(*decay, generator=g), beta=torch.rand(2, _L, H, generator=g)
                    ), {}
    if name == "mamba2_chunk_scan":
        H, P, N = 2, 3, 4
        return dict(hidden_states=r(2, _L, H, P), dt=torch.rand(2, _L, H, generator=g), B=r(2, _L, 1, N),
                    C=r(2, _L, 1, N), z=None), dict(A=-torch.rand(H, generator=g) - 0.5, chunk_size=4, D=r(H),
                                                    dt_bias=r(H), dt_softplus=True)
    if name == "mamba_selective_scan":
        D, N = 3, 4
        return dict(hidden_states=r(2, D, _L), dt=r(2, D, _L), B=r(2, N, _L), C=r(2, N, _L), z=r(2, D, _L)), \
            dict(A=-torch.rand(D, N, generator=g) - 0.5, D=r(D), delta_bias=r(D), delta_softplus=True)
    raise KeyError(name)


def _piece(token_args: dict, dims: dict, lo: int, hi: int) -> dict:
    return {k: None if v is None else v.narrow(dims[k], lo, hi - lo) for k, v in token_args.items()}


def _from_state(adapter, a: dict, S):
    """(outputs, final state) of the adapter's piece ``a`` started from state ``S`` (None: zero), composed
    as the scan over ranks composes it."""
    out, end = adapter.run(a)
    if S is None:
        return out, end
    fix = adapter.correct(a, S)
    out = out + fix if getattr(adapter, "additive", False) else fix
    return out, adapter.apply(adapter.transition(a), S) + end


def agrees(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal within the inputs' dtype: relative to the largest value (float32: 1e-4; half types: 5e-2)."""
    if got.shape != want.shape:
        return False
    tol = 1e-4 if want.dtype in (torch.float32, torch.float64) else 5e-2
    scale = max(float(want.double().abs().max()), 1e-6) if want.numel() else 1.0
    return bool(((got.double() - want.double()).abs() <= tol * scale + 1e-5).all())


def composition_reason(adapter, token_args: dict, cut: int, S0=None) -> str | None:
    """None when ``adapter`` (a :class:`~cp_attention.strategies.scan.RecurrenceAdapter` over a foreign
    recurrence) run over two pieces of ``token_args`` (cut at token ``cut``; the second piece started from
    the first's final state) gives the outputs and final state of one call over the whole, both from
    ``S0`` (None: zero); else what differs. This is what the scan over ranks relies on."""
    dims = adapter.token_dims
    length = next(v.shape[dims[k]] for k, v in token_args.items() if v is not None)
    whole_out, whole_end = _from_state(adapter, token_args, S0)
    out1, end1 = _from_state(adapter, _piece(token_args, dims, 0, cut), S0)
    out2, end2 = _from_state(adapter, _piece(token_args, dims, cut, length), end1)
    if not agrees(torch.cat([out1, out2], dim=adapter.out_dim), whole_out):
        return "its outputs over two pieces, the second started from the first's final state, differ from one call"
    if not agrees(end2, whole_end):
        return "its final state over two pieces differs from one call's"
    return None


def _recurrence_reason(name: str, original) -> str | None:
    """None when the adapter's two-piece composition of ``original`` from a random state equals its one
    call, else why not."""
    g = torch.Generator().manual_seed(0)
    token_args, other = _synthetic(name, g)
    adapter = FORMS[name](original, dict(other))
    S0 = torch.randn(2, *adapter.shapes(token_args)[0], generator=g)
    return composition_reason(adapter, token_args, _CUT, S0)


def _convolution_reason(original) -> str | None:
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 3, _L, generator=g), torch.randn(3, 4, generator=g), torch.randn(3, generator=g)
    for bias, activation in ((b, None), (None, "silu")):
        got = original(x, w, bias, activation=activation)
        want = _conv_oracle(x, w, bias, activation)
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            return f"it returns {type(got).__name__} {tuple(getattr(got, 'shape', ()))} for input (2, 3, {_L})"
        if not torch.allclose(got.double(), want, **_TOL):
            return (f"it is not the causal depthwise convolution (bias {'yes' if bias is not None else 'no'}, "
                    f"activation {activation}): max error {float((got.double() - want).abs().max()):.3g}")
    return None


def _forward_reason(original, mod) -> str | None:
    """``causal_conv1d_forward`` with no cache must hand the convolution to the module's own
    ``causal_conv1d_fn`` (which :mod:`.adapters.mixer_functions` adapts) and return its result unchanged."""
    inner = getattr(mod, "causal_conv1d_fn", None)
    if inner is None:
        return "its modeling module has no causal_conv1d_fn to hand the convolution to"
    g = torch.Generator().manual_seed(0)
    conv = torch.nn.Conv1d(3, 3, 4, groups=3, padding=3, device="meta").to_empty(device="cpu")
    with torch.no_grad():
        conv.weight.copy_(torch.randn(3, 1, 4, generator=g))
        conv.bias.copy_(torch.randn(3, generator=g))
    x = torch.randn(2, 3, _L, generator=g)
    seen = []

    def spy(*args, **kwargs):
        y = inner(*args, **kwargs)
        seen.append(y)
        return y

    with temporarily(mod, "causal_conv1d_fn", spy, site="admission_probe", admitted="mixer_adapters.admit"), \
            torch.no_grad():
        got = original(conv, x, None, 0, activation="silu")
    if len(seen) != 1:
        return f"with no cache it called the module's causal_conv1d_fn {len(seen)} times (one expected)"
    want = _conv_oracle(x, conv.weight.detach().squeeze(1), conv.bias.detach(), "silu")
    if got is not seen[0] or not torch.allclose(got.double(), want, **_TOL):
        return "with no cache it does not return the module's causal_conv1d_fn result for the convolution's weight"
    return None


def admit(name: str, original, mod) -> str | None:
    """None when ``original`` (the function ``name`` of the modeling module ``mod``) does what its
    adapter assumes, else why not (see the module docstring). Runs in a few milliseconds on the CPU,
    without gradients' bookkeeping, with transformers' warnings held back (a fallback notice such as
    "falling back to its reference PyTorch implementation" is the function's, not the check's)."""
    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:  # the process's random state as it was (a module is often imported while a model is initialised)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            if name == "causal_conv1d_fn":
                return _convolution_reason(original)
            if name == "causal_conv1d_forward":
                return _forward_reason(original, mod)
            return _recurrence_reason(name, original)
    except Exception as exc:  # a call that does not fit the convention
        return f"a call by the adapter's convention raised {type(exc).__name__}: {str(exc)[:200]}"
    finally:
        quiet.setLevel(level)
