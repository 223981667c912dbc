"""What :mod:`.adapters.mixer_classes` assumes of the mixer classes it adapts, checked by their behaviour on each
class's first call under context parallelism.

A class adapter recomputes its class's forward (or method) from the instance's own layers, with the
sequence mixing done across ranks: it assumes that the class computes what it recomputes (the order of
a fused projection's parts, a gate, a decay's sign, a token shift's direction...), and, where it calls
the class's recurrence from a state, that the state continues the sequence. These classes read their
sizes and weights from a config, so the check runs on the instance, before the class's first call
under context parallelism computes anything (once per class and process, on every rank alike, in a
few milliseconds):

* the original method on a small synthetic input (one document of :data:`TOKENS` tokens from a private
  generator, in the dtype and on the device of the call), outside context parallelism, as eager runs it;
* the adapter's own path on the same input, on a one-rank context of this process alone (each rank's
  part: its halo convolutions, token shifts and scan pieces), compared output by output;
* for the adapters that call the class's own recurrence from a state (RG-LRU's ``_rnn_scan``, RWKV's
  ``rwkv_linear_attention``, xLSTM's backend), that recurrence over two pieces, the second started from
  the first's final state, against one call (:func:`.function_admission.composition_reason`): what the scan
  over ranks relies on.

A difference beyond the dtype's tolerance, or a call that raises, declines the class: its call under
context parallelism is refused (``adapted_class_declined``, naming the transformers version, the class and
the method, and why), and so is every later model using it at the model check. Outside context
parallelism the adapted method calls the original untouched, declined or not.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable

import torch

from . import state
from ..patches import patch
from .forward import FORWARD
from ...engine import stats as engine_stats
from ...engine.context import ACTIVE_CONTEXT, ContextParallel
from ...refusals import refuse
from .function_admission import agrees, composition_reason
from .versions import transformers_version

__all__ = ["Check", "CHECKS", "TOKENS", "admitted", "class_reason", "first_use"]

TOKENS, _CUT = 12, 5  # the synthetic document's tokens; where the compositions cut it
_UNCHECKED = object()


@dataclass(frozen=True)
class Check:
    """How one adapted method is checked: ``inputs(self, g, like)`` -> the method's arguments by name (a
    batch of 1, :data:`TOKENS` tokens; ``like``: the real call's token tensor, for dtype and device);
    ``compare``: how many leading outputs are the adapter's to match (the rest are caches and states
    of the family's own form); ``saved``: instance attributes the method writes (restored after);
    ``composition(recurrence, self, original, args)`` -> (a recurrence adapter, its token arguments), or
    None (``recurrence``: the adapter's class, handed over by :mod:`.adapters.mixer_classes`)."""

    inputs: Callable
    compare: int = 1
    saved: tuple[str, ...] = ()
    composition: Callable | None = None


def _rand(g, *shape, like):
    return torch.randn(*shape, generator=g).to(like)


def _lightning(self, g, like):
    return dict(hidden_states=_rand(g, 1, TOKENS, self.qkv_proj.in_features, like=like), position_embeddings=None,
                attention_mask=None)


def _rglru_args(self, g, like):
    W = self.recurrent_param.shape[0]
    reset = torch.zeros(1, TOKENS, 1, dtype=torch.bool, device=like.device)
    reset[:, 0] = True  # the document's first token
    return dict(hidden_states=_rand(g, 1, TOKENS, W, like=like), reset=reset, recurrent_states=None,
                recurrent_gate=(0.5 + 0.5 * torch.rand(1, TOKENS, W, generator=g)).to(like))


def _rglru_pieces(recurrence, self, original, args):
    return recurrence(self, original), {k: args[k] for k in ("hidden_states", "recurrent_gate", "reset")}


def _recurrent_block(self, g, like):
    return dict(input_states=_rand(g, 1, TOKENS, self.linear_y.in_features, like=like),
                position_ids=torch.arange(TOKENS, device=like.device)[None], attention_mask=None, use_cache=False)


def _cca(self, g, like):
    return dict(hidden_states=_rand(g, 1, TOKENS, self.q_proj.in_features, like=like), cache=None, conv_mask=None)


def _rwkv(self, g, like):
    return dict(hidden=_rand(g, 1, TOKENS, self.key.in_features, like=like), state=None)


def _wkv_pieces(recurrence, self, original, args):
    g = torch.Generator().manual_seed(1)
    C = self.time_decay.shape[0]
    like = args["hidden"]
    adapter = recurrence(sys.modules[original.__module__].rwkv_linear_attention_cpu, self.time_decay,
                         self.time_first)
    return adapter, {"key": _rand(g, 1, TOKENS, C, like=like), "value": _rand(g, 1, TOKENS, C, like=like)}


def _mlstm_tokens(self) -> int:
    return 2 * max(int(getattr(self.config, "chunk_size", 4)), 4)  # whole chunks, for the chunkwise kernel


def _mlstm(self, g, like):
    n = _mlstm_tokens(self)
    return dict(query=_rand(g, 1, 2, n, 4, like=like), key=_rand(g, 1, 2, n, 4, like=like) * 0.5,
                value=_rand(g, 1, 2, n, 3, like=like), igate=_rand(g, 1, 2, n, like=like),
                fgate=_rand(g, 1, 2, n, like=like) + 2.0)


def _mlstm_pieces(recurrence, self, original, args):
    return recurrence(self), {k: args[k] for k in ("query", "key", "value", "igate", "fgate")}


CHECKS = MappingProxyType({
    "_lightning_forward": Check(_lightning),
    "_rnn_scan": Check(_rglru_args, compare=2, composition=_rglru_pieces),
    "_recurrent_block_forward": Check(_recurrent_block, saved=("conv1d_state", "rg_lru.recurrent_states")),
    "_cca_forward": Check(_cca, compare=3),
    "_wkv_forward": Check(_rwkv, composition=_wkv_pieces),
    "_shift_forward": Check(_rwkv),
    "_mlstm_forward": Check(_mlstm, composition=_mlstm_pieces),
})
"""The check of each adapted method of :mod:`.adapters.mixer_classes` (by its adapter's name)."""


# ----------------------------------------------------------------------------------------------
# running one rank's path on this process alone


def _guard(**values):
    """Set the thread's model-guard fields ``values`` (restored on exit)."""
    @contextlib.contextmanager
    def scope():
        old = {k: getattr(FORWARD, k, _UNCHECKED) for k in values}
        for k, v in values.items():
            setattr(FORWARD, k, v)
        try:
            yield
        finally:
            for k, v in old.items():
                if v is _UNCHECKED:
                    delattr(FORWARD, k)
                else:
                    setattr(FORWARD, k, v)
    return scope()


@contextlib.contextmanager
def _context(cp):
    token = ACTIVE_CONTEXT.set(cp)
    try:
        yield
    finally:
        ACTIVE_CONTEXT.reset(token)


@contextlib.contextmanager
def _plain():
    """Outside context parallelism: the original runs as eager runs it (its own mixers' calls included)."""
    with _context(None), _guard(mixers=0, record=None, compiled_step=False):
        yield


@contextlib.contextmanager
def _one_rank(rows: int, length: int, device):
    """A one-rank context of this process alone and its batch (one document of ``length`` tokens per row),
    active for the mixers' calls inside (the adapter's path as one rank runs it)."""
    cp = ContextParallel(layout="contiguous", single=True)
    local = cp.shard_documents({}, position_ids=torch.arange(length, device=device)[None].expand(rows, length))
    record = cp.records.only()
    with _context(cp), _guard(mixers=1, record=record, compiled_step=False):
        yield record
    del local


def _fit(original, args: dict) -> dict:
    """The check's arguments under the method's own names (transformers 5.17 calls the cache
    ``past_key_values``)."""
    params = inspect.signature(original).parameters
    if "cache" in args and "cache" not in params and "past_key_values" in params:
        args = dict(args)
        args["past_key_values"] = args.pop("cache")
    return args


def _leading(out, n: int) -> list:
    return [out] if isinstance(out, torch.Tensor) else list(out)[:n]


def _attributes(self, names):
    for name in names:
        owner, _, attr = name.rpartition(".")
        obj = self
        for part in filter(None, owner.split(".")):
            obj = getattr(obj, part)
        yield obj, attr


def class_reason(self, adapter: str, original, body, bind: Callable, tokens: str, dim: int,
                 like: torch.Tensor, recurrence: type | None = None) -> str | None:
    """None when the adapter ``adapter`` (its path ``body``) computes what the class's ``original`` does on
    the instance ``self``, else why not (see the module docstring). ``bind(args)``: the call's arguments
    by name as the adapter reads them; ``tokens``/``dim``: the argument holding the tokens, and its token
    dimension; ``like``: the real call's tensor of tokens (the check's dtype and device); ``recurrence``:
    the class of the scan adapter the body builds (for the composition check)."""
    check = CHECKS[adapter]
    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr in _attributes(self, check.saved)]
    stats = list(getattr(engine_stats.FORWARD, "mixers", []))
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            args = check.inputs(self, torch.Generator().manual_seed(0), like)
            with _plain():
                want = _leading(original(self, **_fit(original, args)), check.compare)
            for obj, attr, value in saved:
                patch(obj, attr, value, site="probe_state", admitted="class_admission (restoring)")
            x = args[tokens]
            with _one_rank(x.shape[0], x.shape[dim], x.device) as record:
                got = _leading(body(self, bind(_fit(original, args)), record, original), check.compare)
            if len(got) != len(want):
                return f"it returns {len(want)} outputs where the adapter returns {len(got)}"
            for i, (a, b) in enumerate(zip(got, want)):
                if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor) or \
                        (isinstance(a, torch.Tensor) and not agrees(a, b)):
                    return (f"on one document its output {i} differs from what the adapter computes from its layers "
                            "(the adapter's assumptions about its computation no longer hold)")
            if check.composition is not None:
                why = composition_reason(*check.composition(recurrence, self, original, args), _CUT)
                if why is not None:
                    return why
        return None
    except Exception as exc:  # the class no longer fits what the adapter reads
        return f"checking it raised {type(exc).__name__}: {str(exc)[:200]}"
    finally:
        quiet.setLevel(level)
        for obj, attr, value in saved:
            patch(obj, attr, value, site="probe_state", admitted="class_admission (restoring)")
        engine_stats.FORWARD.mixers = stats


def first_use(cls: type, method: str, reason: Callable[[], str | None]) -> None:
    """Raise ``adapted_class_declined`` unless ``cls.method`` passed its check ``reason()`` (run at the
    class's first call under an adapter, then remembered for the process)."""
    key = (cls.__module__, f"{cls.__qualname__}.{method}")
    with state.INTEGRATIONS_LOCK:
        why = state.INTEGRATIONS["classes"].get(key, _UNCHECKED)
    if why is _UNCHECKED:
        why = reason()
        with state.INTEGRATIONS_LOCK:
            state.INTEGRATIONS["classes"][key] = why
            if why is not None:
                state.INTEGRATIONS["declined"][key] = why
    if why is not None:
        raise refuse("adapted_class_declined", version=transformers_version(), name=f"{key[0]}.{key[1]}", why=why)


def admitted(self, adapter: str, method: str, original, body, bind: Callable, tokens: str, dim: int,
             like: torch.Tensor, recurrence: type | None = None) -> None:
    """:func:`first_use` for a mixer class of :mod:`.adapters.mixer_classes` (its check: :func:`class_reason`)."""
    first_use(type(self), method,
              lambda: class_reason(self, adapter, original, body, bind, tokens, dim, like, recurrence))
