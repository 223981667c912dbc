"""The mixer classes :mod:`cp_attention.integrations.hf.adapters.mixer_classes` adapts are admitted by their behaviour
(issue 52; :mod:`cp_attention.integrations.hf.class_admission`): at a class's first call under context
parallelism, the original method on a synthetic document is compared with the adapter's path on one rank,
and, where the adapter calls the class's recurrence from a state, that recurrence over two pieces with
one call.

* every adapted class of the installed transformers passes (float64 and float32 instances);
* each class, with one planted change of what it computes (a fused projection's parts in another order,
  a decay's rate, a convolution's taps reversed, a token shift of two, a recurrence that drops its
  incoming state), is declined at its first call under context parallelism, refused naming the
  transformers version, the class and the method; outside the block the planted method runs untouched;
* a declined class is refused by the model check of a later model using it.
"""

from __future__ import annotations

import contextlib
import functools
import sys

import pytest
import torch

import cp_attention
from cp_attention.integrations.hf.adapters import mixer_classes as recurrent
from cp_attention.integrations.hf import forward, state
from cp_attention.integrations.hf.versions import transformers_version
from test_class_mixers import DOCS, L, MIXERS, _inputs, _module

pytestmark = pytest.mark.transformers

ADAPTER = {"lightning": "_lightning_forward", "rglru": "_recurrent_block_forward", "zaya": "_cca_forward",
           "rwkv": "_wkv_forward", "shift": "_shift_forward", "mlstm": "_mlstm_forward"}


def _call(mixer: str, fn, module, t: dict, pos):
    """The adapted method ``fn`` (unbound) called as the family calls it; its first output."""
    if mixer == "lightning":
        return fn(module, hidden_states=t["h"], position_embeddings=None, attention_mask=None)[0]
    if mixer == "rglru":
        return fn(module, input_states=t["h"], position_ids=pos, attention_mask=None, use_cache=False)[0]
    if mixer in ("rwkv", "shift"):
        return fn(module, t["h"])[0]
    if mixer == "mlstm":
        out = fn(module, **t, return_last_states=False, mode="inference")
        return out[0] if isinstance(out, tuple) else out  # its inference mode returns its states too
    return fn(module, t["h"], None)[0]  # no cache (named past_key_values by transformers 5.17)


@contextlib.contextmanager
def _fresh_verdicts(monkeypatch):
    """Forget which classes were checked (each test checks its own stand-ins)."""
    monkeypatch.setitem(state.INTEGRATIONS, "classes", {})
    monkeypatch.setitem(state.INTEGRATIONS, "declined", {})
    yield


def _under_cp(mixer: str, fn, module, dtype=torch.float64):
    """``fn`` (an adapted method) called on the test's documents (in ``dtype``) inside a one-rank
    context_parallel block, as a tagged mixer of a cp_flash model."""
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCS])
    t = {n: x.to(dtype) for n, (x, _) in _inputs(mixer, module).items()}
    with cp_attention.context_parallel() as cp:
        batch = cp.shard_batch(input_ids=torch.zeros_like(pos), position_ids=pos)  # alive: the mixers' batch
        forward.FORWARD.mixers = 1
        try:
            return _call(mixer, fn, module, t, pos)
        finally:
            forward.FORWARD.mixers = 0
            del batch


def _original(cls: type, name: str):
    return getattr(cls, name).__wrapped__


# bfloat16 too (the tolerance is the dtype's), except xLSTM's backend, whose own kernels reject bfloat16 inputs
# under this config (its states are float32)
DTYPES = [(m, d) for m in MIXERS for d in (torch.float64, torch.float32, torch.bfloat16)
          if not (m == "mlstm" and d == torch.bfloat16)]


@pytest.mark.parametrize("mixer, dtype", DTYPES, ids=[f"{m}-{str(d)[6:]}" for m, d in DTYPES])
def test_every_adapted_class_is_admitted(mixer, dtype, monkeypatch):
    module = _module(mixer).to(dtype)
    with _fresh_verdicts(monkeypatch):
        _under_cp(mixer, type(module).forward, module, dtype)
        verdicts = dict(state.INTEGRATIONS["classes"])
    assert verdicts and all(why is None for why in verdicts.values()), verdicts


# ----------------------------------------------------------------------------------------------
# planted changes: each a stand-in of the family's method computing something else


@contextlib.contextmanager
def _swapped(obj, attr: str, value):
    old = getattr(obj, attr)
    setattr(obj, attr, value)
    try:
        yield
    finally:
        setattr(obj, attr, old)


def _during(original, change):
    """The stand-in: ``original`` run with ``change(self)`` (a context manager) in force."""
    @functools.wraps(original)
    def planted(self, *args, **kwargs):
        with change(self):
            return original(self, *args, **kwargs)
    return planted


def _qk_order_swapped(self):  # the fused projection's per-head parts in the order (k, q, v)
    H, D = self.num_attention_heads, self.head_dim
    w = self.qkv_proj.weight
    permuted = w.detach().view(H, 3, D, -1)[:, [1, 0, 2]].reshape_as(w)
    return _swapped(self.qkv_proj, "weight", torch.nn.Parameter(permuted))


def _decay_doubled(self):  # exp(-2 slope) per token
    return _swapped(self, "slope_rate", self.slope_rate * 2)


def _taps_reversed(conv_name):
    def change(self):
        conv = getattr(self, conv_name)
        return _swapped(conv, "weight", torch.nn.Parameter(conv.weight.detach().flip(-1)))
    return change


def _shift_of_two(self):
    return _swapped(self, "time_shift", torch.nn.ZeroPad2d((0, 0, 2, -2)))


def _drops_state(fn):
    @functools.wraps(fn)
    def planted(*args, **kwargs):
        for name in ("state", "recurrent_states", "c_initial", "n_initial", "m_initial"):
            if name in kwargs:
                kwargs[name] = None
        return fn(*args, **kwargs)
    return planted


def _rnn_scan_drops_state(self):  # the RG-LRU's scan ignores the state it is given
    cls = type(self.rg_lru)
    planted = _drops_state(_original(cls, "_rnn_scan"))
    return _swapped(cls, "_rnn_scan", recurrent._rnn_scan(planted))


def _wkv_drops_state(self):
    mod = sys.modules[type(self).__module__]
    return _swapped(mod, "rwkv_linear_attention_cpu", _drops_state(mod.rwkv_linear_attention_cpu))


def _mlstm_drops_state(self):
    return _swapped(self, "_inference_fn", _drops_state(self._inference_fn))


PLANTS = [
    ("lightning", "q/k order swapped", _qk_order_swapped, False),
    ("lightning", "decay doubled", _decay_doubled, False),
    ("rglru", "convolution taps reversed", _taps_reversed("conv_1d"), False),
    ("rglru", "recurrence drops its state", _rnn_scan_drops_state, True),
    ("zaya", "convolution taps reversed", _taps_reversed("conv_qk_depthwise"), False),
    ("rwkv", "token shift of two", _shift_of_two, False),
    ("rwkv", "recurrence drops its state", _wkv_drops_state, True),
    ("shift", "token shift of two", _shift_of_two, False),
    ("mlstm", "recurrence drops its state", _mlstm_drops_state, True),
]


@pytest.mark.parametrize("mixer, what, change, everywhere", PLANTS, ids=[f"{p[0]}: {p[1]}" for p in PLANTS])
def test_a_planted_change_is_declined_and_refused_under_cp_and_untouched_outside(mixer, what, change, everywhere,
                                                                                  monkeypatch):
    """``everywhere``: the change is to what the adapter calls too (a recurrence from a state): it is in
    force for the whole call, and the two-piece composition is what declines it."""
    module = _module(mixer)
    cls = type(module)
    original = _original(cls, "forward")
    planted = _during(original, change)
    wrapper = getattr(recurrent, ADAPTER[mixer])(planted)
    t = {n: x for n, (x, _) in _inputs(mixer, module).items()}
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCS])
    want = _call(mixer, planted, module, t, pos)
    assert torch.equal(_call(mixer, wrapper, module, t, pos), want)  # outside the block: the stand-in itself
    scope = change(module) if everywhere else contextlib.nullcontext()
    with _fresh_verdicts(monkeypatch), scope:
        with pytest.raises(NotImplementedError) as raised:
            _under_cp(mixer, wrapper, module)
        declined = dict(state.INTEGRATIONS["declined"])
    message = str(raised.value)
    assert f"transformers {transformers_version()}" in message and "does not do what" in message, message
    key = next(k for k in declined if k[1].startswith(cls.__qualname__) or everywhere)
    assert f"{key[0]}.{key[1]}" in message, message
    # unplanted, the same path runs
    with _fresh_verdicts(monkeypatch):
        _under_cp(mixer, getattr(recurrent, ADAPTER[mixer])(original), module)


def test_a_declined_class_refuses_later_models_at_the_model_check(monkeypatch):
    import transformers as tf

    from cp_attention.integrations.hf.check import model_findings

    cfg = tf.MiniMaxConfig(hidden_size=16, num_attention_heads=2, head_dim=4, num_hidden_layers=2, block_size=4,
                           layer_types=["linear_attention", "full_attention"], num_local_experts=2,
                           num_experts_per_tok=1, intermediate_size=8, vocab_size=32)
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="cp_flash")
    assert not [f for f in model_findings(model) if "not admitted" in f.what]
    key = ("transformers.models.minimax.modeling_minimax", "MiniMaxLightningAttention.forward")
    with _fresh_verdicts(monkeypatch):
        state.INTEGRATIONS["declined"][key] = "a planted reason"
        found = [f for f in model_findings(tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="cp_flash"))
                 if "not admitted" in f.what]
    assert found and "MiniMaxLightningAttention.forward" in found[0].why and "a planted reason" in found[0].why
    assert f"transformers {transformers_version()}" in found[0].why
