"""Sequence mixers computed inside their own classes, under context parallelism: MiniMax's lightning
attention, RecurrentGemma's RG-LRU and its convolution, Zaya's convolved attention inputs, RWKV's time and
channel mixing, xLSTM's mLSTM.

:mod:`.mixer_functions` adapts the module-level functions most hybrid families call. These families compute
their mixing in their classes instead, so the class is adapted when its modeling module loads,
found by its structure (the methods and attributes its code reads), never by the family's name.
The adapted forward (or method) calls the original unchanged, except for a tagged mixer of a
``cp_flash`` model inside a ``context_parallel`` block (the rule of :func:`.mixer_functions.batch_for`):

=====================================  ==================================================  ===================
class                                  sequence mixing                                     here
=====================================  ==================================================  ===================
``*LightningAttention`` (MiniMax)      ``kv_t = l kv_{t-1} + k_t^T v_t``, ``o_t = q_t kv_t``  scan over pieces
                                       per head (``l = exp(-slope)``), in blocks
``*Rglru._rnn_scan`` (RecurrentGemma)  ``h_t = a_t h_{t-1} + x_t`` per channel, reset at   scan over pieces
                                       position 0; its ``recurrent_states`` argument
``*RecurrentBlock`` (RecurrentGemma)   a depthwise ``nn.Conv1d`` padded by k-1             halo convolution
``*CCAProjection`` (Zaya)              two stacked convolutions over q/k (receptive        token windows
                                       field k0 + k1 - 1), the value's delayed half (the
                                       previous token's projection)                        a one-token halo
RWKV's time mixing (``forward(hidden,  a token shift, then ``wkv`` over the document's      a one-token halo,
state)`` calling                       earlier tokens (a ratio of two decayed sums)        scan over pieces
``rwkv_linear_attention``)
RWKV's channel mixing                  a token shift                                       a one-token halo
``*Backend`` (xLSTM's mLSTM)           ``C_t = f_t C_{t-1} + i_t k_t v_t^T`` with a max-   scan over pieces
                                       plus stabiliser the output reads
=====================================  ==================================================  ===================

The lightning attention's segments run through :func:`decayed_linear_attention`, written here from
the recurrence above (the family's forward has no function to call with an initial state); the
RG-LRU's through the family's own ``_rnn_scan``, RWKV's through its ``rwkv_linear_attention``, xLSTM's
through its backend's any-length path; each adapter's docstring says how its state composes. A decoding
step under context parallelism (a cache that holds a state) raises, as for the other mixers; a prefill into
an empty cache keeps each rank's own part.
"""

from __future__ import annotations

import inspect
import sys
from types import MappingProxyType

import torch

from .. import source
from ....engine.stats import note_mixer
from ....strategies.scan import agree, causal_conv, geometry_of, halo_plan, plan_for, scan, scan_plan, token_windows
from ..class_admission import admitted
from ...patches import patch
from ..generation import hand_over
from .base import Adapter
from ..recurrences import Lightning, MLstm, Rglru, Wkv
from ..mixing import (CLASS_MIXER_ATTR, batch_for, class_mixer, compiled_wrapper, declined_findings, mark_calling,
                      refuse_cache)

__all__ = ["ADAPTER", "adapt_module", "adapted_class"]

# the agreement's mixer kinds (after .mixers' 1-4)
_KINDS = MappingProxyType({"lightning": 11, "rglru": 12, "zaya": 13, "rwkv": 14, "shift": 15, "mlstm": 16})


def _under_cp(tokens: str, dim: int = 1, recurrence: type | None = None):
    """Make ``body(self, bound, record, original)`` the adapted form of a class's method ``original``: the
    wrapper calls ``original`` unchanged unless the call runs under context parallelism (the rule of
    :func:`.mixer_functions.batch_for`, on the batch and length of argument ``tokens``, its dim ``dim``); then,
    once the class passed its check (:func:`..class_admission.admitted`; ``recurrence``: the class of
    the scan adapter ``body`` builds on the family's recurrence, checked too), ``body`` runs with the call's
    arguments by name (defaults applied; ``past_key_values`` read as ``cache``) and the sharded batch
    ``record``."""
    def factory(body):
        def adapt(original):
            sig = inspect.signature(original)

            def arguments(self, args, kwargs):
                if "past_key_values" in kwargs and "past_key_values" not in sig.parameters:
                    kwargs = dict(kwargs)
                    kwargs["cache"] = kwargs.pop("past_key_values")
                call = sig.bind(self, *args, **kwargs)
                call.apply_defaults()
                named = dict(call.arguments)
                if "cache" not in named and "past_key_values" in named:  # transformers 5.17's name
                    named["cache"] = named.pop("past_key_values")
                return named

            def eager(compiled, self, *args, **kwargs):
                named = arguments(self, args, kwargs)
                x = named[tokens]
                record = batch_for(x.shape[0], x.shape[dim], compiled)
                if record is None:
                    return original(self, *args, **kwargs)
                admitted(self, body.__name__, original.__name__, original, body,
                         lambda check_args: arguments(self, (), check_args), tokens, dim, x, recurrence)
                return body(self, named, record, original)

            return compiled_wrapper(original, eager)
        return adapt
    return factory


@_under_cp("hidden_states")
def _lightning_forward(self, bound, record, original):
    mod = sys.modules[original.__module__]
    h = bound["hidden_states"]
    B, L = h.shape[:2]
    cache = bound.get("cache")
    if cache is not None and cache.get_linear_cache(self.layer_idx) is not None:
        refuse_cache(type(self).__name__)
    H, D = self.num_attention_heads, self.head_dim
    qkv = mod.apply_mask_to_padding_states(self.act_fn(self.qkv_proj(h)), bound.get("attention_mask"))
    q, k, v = torch.split(qkv.reshape(B, L, H, 3 * D), D, dim=3)
    adapter = Lightning(-self.slope_rate.reshape(H), v.dtype, self.block_size)
    comm = record.cp.comm
    agree(record, comm, (_KINDS["lightning"], B, H, D, cache is not None))
    plan = plan_for(record, "scan", None, lambda: scan_plan(geometry_of(record)))
    out, stats, last = scan(adapter, {"q": q, "k": k, "v": v}, plan, comm, B, L, final=True)
    note_mixer(stats)
    out = self.norm(out.reshape(B, L, H * D))
    out = self.out_proj(torch.sigmoid(self.output_gate(h)) * out)
    if cache is not None:
        cache.set_linear_cache(self.layer_idx, last.to(v.dtype))
    return out, last


@_under_cp("hidden_states", recurrence=Rglru)
def _rnn_scan(self, bound, record, original):
    x = bound["hidden_states"]
    initial = bound.get("recurrent_states")
    if initial is not None and bool(initial.ne(0).any()):
        refuse_cache(type(self).__name__)  # a decoding step: the state of earlier tokens
    comm, (B, L, W) = record.cp.comm, x.shape
    agree(record, comm, (_KINDS["rglru"], B, W))
    plan = plan_for(record, "scan", None, lambda: scan_plan(geometry_of(record)))
    reset = bound["reset"].expand(B, L, 1)
    out, stats, last = scan(Rglru(self, original), {"hidden_states": x, "recurrent_gate": bound["recurrent_gate"],
                                                     "reset": reset}, plan, comm, B, L, final=True)
    note_mixer(stats)
    return out, last


def _positions_in_documents(record) -> torch.Tensor:
    """(B, Lr) long: each of this rank's tokens' place in its document (0 at a document start); once per
    batch."""
    def build():
        geo = geometry_of(record)
        g = geo.index[record.cp.rank]
        return g[None, :] - geo.doc_start[:, g]
    return plan_for(record, "positions in documents", None, build)


def _last_tokens(record, n: int) -> torch.Tensor:
    """The local places of this rank's ``n`` last tokens in global order, in that order."""
    return plan_for(record, "global order", None, lambda: geometry_of(record).index[record.cp.rank].argsort())[-n:]


def _halo_conv(record, x_BCL, conv):
    """``conv`` (a depthwise ``nn.Conv1d``, padded by k-1 and cut to the first L) on this rank's
    tokens (B, C, L) across ranks and documents."""
    kernel = conv.kernel_size[0]
    agree(record, record.cp.comm, (0, x_BCL.shape[0], x_BCL.shape[1], kernel))
    plan = plan_for(record, "halo", kernel, lambda: halo_plan(geometry_of(record), kernel))
    y, stats = causal_conv(x_BCL.transpose(1, 2), conv.weight.squeeze(1), conv.bias, plan, record.cp.comm)
    note_mixer(stats)
    return y.transpose(1, 2).to(x_BCL.dtype)


@_under_cp("input_states")
def _recurrent_block_forward(self, bound, record, original):
    x = bound["input_states"]
    use_cache = bound["use_cache"]
    live = self.rg_lru.recurrent_states
    if use_cache and live is not None and bool(live.ne(0).any()):
        refuse_cache(type(self).__name__)  # a cache carrying earlier tokens' state (decoding, a continued prefill)
    y_branch = self.act_fn(self.linear_y(x))
    x_branch = self.linear_x(x).transpose(1, 2)
    k = self.conv1d_width
    if use_cache:  # a prefill's cache: this rank's own part (its last k - 1 inputs in global order); generate's
        tail = x_branch[..., _last_tokens(record, k - 1).to(x.device)]  # makes them the sequence's
        self.conv1d_state = torch.nn.functional.pad(tail, (k - 1 - tail.shape[-1], 0))
        hand_over(self, "conv1d_state", "conv")
        hand_over(self.rg_lru, "recurrent_states", "state")
    else:
        self.conv1d_state = None
    self.rg_lru.recurrent_states = None
    x_branch = _halo_conv(record, x_branch, self.conv_1d)
    # the RG-LRU resets where a position is 0 (and scales its input there by 1): the places in the
    # batch's documents, which the scan cuts at, whatever positions the caller numbered
    positions = _positions_in_documents(record).to(bound["position_ids"])
    x_branch = self.rg_lru(x_branch.transpose(1, 2), positions)
    if not use_cache:
        self.rg_lru.recurrent_states = None
    return self.linear_out(x_branch * y_branch), None


@_under_cp("hidden_states")
def _cca_forward(self, bound, record, original):
    mod = sys.modules[original.__module__]
    h = bound["hidden_states"]
    B, L = h.shape[:2]
    cache = bound.get("cache")
    if cache is not None and (not hasattr(cache, "get_conv_state") or  # 5.17's cache: no state API to fill
                              cache.get_conv_state(self.layer_idx, state_idx=0) is not None or
                              cache.get_recurrent_state(self.layer_idx, state_idx=0) is not None):
        refuse_cache(type(self).__name__)  # decoding: the states of earlier tokens
    conv_mask = bound.get("conv_mask")
    if conv_mask is not None:
        h = h * conv_mask[:, :, None].to(h.dtype)
    shape = (B, L, -1, self.head_dim)
    queries, keys = self.q_proj(h), self.k_proj(h)
    q_res = queries.view(*shape)
    k_res = mod.repeat_kv(keys.view(*shape).transpose(1, 2), self.num_key_value_groups).transpose(1, 2)
    q_res = (q_res + k_res) * 0.5
    k_res = q_res.view(B, L, -1, self.num_key_value_groups, self.head_dim).mean(dim=-2)
    # the stacked convolutions: each token's window of K + 1 inputs (zeros before its document)
    qk = torch.cat([queries, keys], dim=-1)
    K = self.conv_kernel_size
    comm = record.cp.comm
    agree(record, comm, (_KINDS["zaya"], B, qk.shape[-1], K))
    plan = plan_for(record, "halo", K + 1, lambda: halo_plan(geometry_of(record), K + 1))
    windows, stats = token_windows(qk, plan, comm)  # (B, L, K + 1, C)
    note_mixer(stats)
    conv = windows.reshape(B * L, K + 1, -1).transpose(1, 2)
    qk = self.conv_qk_grouped(self.conv_qk_depthwise(conv)).reshape(B, L, -1)
    n_q = q_res.shape[-2] * q_res.shape[-1]
    query = qk[..., :n_q].reshape(*shape) + q_res
    key = qk[..., n_q:].reshape(*shape) + k_res
    # the value's delayed half: the previous token's projection, the projection of zeros at a document start
    delayed = self.v_proj_delayed(h)
    start = self.v_proj_delayed(h.new_zeros(1, 1, h.shape[-1]))[0, 0]
    first = (_positions_in_documents(record) == 0).to(h.device)[..., None]  # (B, L, 1)
    shifted = torch.where(first, start, _previous(record, delayed, comm))
    value = torch.cat([self.v_proj_current(h), shifted], dim=-1).view(*shape)
    if cache is not None:  # a prefill's cache: this rank's own part, after its last token in global order
        hand_over(None, "", "whole", self.layer_idx)  # its convolution state is the window's, gathered whole
        last = int(_last_tokens(record, 1))
        cache.update_conv_state(windows[:, last, 1:].transpose(1, 2), self.layer_idx)
        cache.update_recurrent_state(delayed[:, last, :], self.layer_idx)
    return query, key, value


def _previous(record, x, comm):
    """Each token's previous token's ``x`` (B, L, C) inside its document, zero at a document start: the
    time shift (``nn.ZeroPad2d((0, 0, 1, -1))``) across ranks and documents."""
    plan = plan_for(record, "halo", 2, lambda: halo_plan(geometry_of(record), 2))
    windows, stats = token_windows(x, plan, comm)
    note_mixer(stats)
    return windows[:, :, 0]


def _empty_state(self, state, slots) -> bool:
    """Whether RWKV's ``state`` (a list of (B, C, layers) tensors, or None) holds nothing yet for this
    layer (the model's fresh one: zeros, ``-1e30`` for the stabiliser): a prefill, filled with this
    rank's own part; a state with something in it continues a sequence (decoding): refused."""
    if state is None:
        return False
    fresh = all(bool((state[i][:, :, self.layer_id] == 0).all()) for i in slots if i < 4)
    if 4 in slots:
        fresh = fresh and bool((state[4][:, :, self.layer_id] <= -1e29).all())
    if not fresh:
        refuse_cache(type(self).__name__)
    return True


def _last_token(record, x):
    """``x`` (B, L, C) at this rank's last token in global order (each row)."""
    return x[:, int(_last_tokens(record, 1))]


@_under_cp("hidden", recurrence=Wkv)
def _wkv_forward(self, bound, record, original):
    mod = sys.modules[original.__module__]
    hidden = bound["hidden"]
    B, L, _ = hidden.shape
    state = bound.get("state")
    fill = _empty_state(self, state, (1, 2, 3, 4))
    comm = record.cp.comm
    agree(record, comm, (_KINDS["rwkv"], B, hidden.shape[-1], self.attention_hidden_size, fill))
    shifted = _previous(record, hidden, comm)
    key = self.key(hidden * self.time_mix_key + shifted * (1 - self.time_mix_key))
    value = self.value(hidden * self.time_mix_value + shifted * (1 - self.time_mix_value))
    receptance = torch.sigmoid(self.receptance(hidden * self.time_mix_receptance +
                                               shifted * (1 - self.time_mix_receptance)))
    plan = plan_for(record, "scan", None, lambda: scan_plan(geometry_of(record)))
    # transformers' torch path: differentiable through its state (the CUDA kernel's backward is not)
    adapter = Wkv(mod.rwkv_linear_attention_cpu, self.time_decay, self.time_first)
    rwkv, stats, *last = scan(adapter, {"key": key, "value": value}, plan, comm, B, L, final=fill)
    note_mixer(stats)
    if fill:  # a prefill's cache: this rank's own part (its last token's shift, the state after it)
        with torch.no_grad():
            top = torch.log(last[0][:, 1].clamp_min(torch.finfo(torch.float64).tiny))
            state[1][:, :, self.layer_id] = _last_token(record, hidden)
            state[2][:, :, self.layer_id] = last[0][:, 0] * torch.exp(-top)
            state[3][:, :, self.layer_id] = last[0][:, 1] * torch.exp(-top)
            state[4][:, :, self.layer_id] = top
    return self.output(receptance * rwkv), state


@_under_cp("hidden")
def _shift_forward(self, bound, record, original):
    hidden = bound["hidden"]
    state = bound.get("state")
    fill = _empty_state(self, state, (0,))
    agree(record, record.cp.comm, (_KINDS["shift"], hidden.shape[0], hidden.shape[-1], fill))
    shifted = _previous(record, hidden, record.cp.comm)
    key = torch.square(torch.relu(self.key(hidden * self.time_mix_key + shifted * (1 - self.time_mix_key))))
    receptance = torch.sigmoid(self.receptance(hidden * self.time_mix_receptance +
                                               shifted * (1 - self.time_mix_receptance)))
    if fill:
        with torch.no_grad():
            state[0][:, :, self.layer_id] = _last_token(record, hidden)
    return receptance * self.value(key), state


@_under_cp("query", dim=2, recurrence=MLstm)
def _mlstm_forward(self, bound, record, original):
    q = bound["query"]
    B, NH, L, _ = q.shape
    initial = [bound.get(name) for name in ("c_initial", "n_initial", "m_initial")]
    if any(t is not None and bool(t.ne(0).any()) for t in initial):
        refuse_cache(type(self).__name__)  # a state from earlier tokens (decoding, or chunked inference)
    comm = record.cp.comm
    agree(record, comm, (_KINDS["mlstm"], B, NH, q.shape[-1], bound["value"].shape[-1]))
    plan = plan_for(record, "scan", None, lambda: scan_plan(geometry_of(record)))
    token_args = {name: bound[name] for name in MLstm.token_dims}
    h, stats, last = scan(MLstm(self), token_args, plan, comm, B, L, final=True)
    note_mixer(stats)
    state = MLstm.unpack(last, torch.float32)
    want_state = bound.get("return_last_states")
    mode = bound.get("mode") or self.config.mode
    if want_state is None:
        want_state = self.config.return_last_states if "train" in mode else True
    return (h, state) if want_state else h


def _has(cls: type, *names: str) -> bool:
    code = source.class_source(cls)
    return all(name in code for name in names)


def _params(fn) -> tuple:
    try:
        return tuple(inspect.signature(fn).parameters)[1:]
    except (TypeError, ValueError):
        return ()


def _match(cls: type):
    """(attribute, wrapper factory) for an adaptable class, or None."""
    forward = vars(cls).get("forward")
    if cls.__name__.endswith("LightningAttention") and forward is not None and \
            _params(forward)[:3] == ("hidden_states", "position_embeddings", "attention_mask") and \
            _has(cls, "self.qkv_proj(", "self.output_gate(", "self.slope_rate", "get_linear_cache"):
        return "forward", _lightning_forward
    scan_method = vars(cls).get("_rnn_scan")
    if scan_method is not None and _params(scan_method)[:4] == ("hidden_states", "recurrent_gate", "reset",
                                                                "recurrent_states"):
        return "_rnn_scan", _rnn_scan
    if cls.__name__.endswith("RecurrentBlock") and forward is not None and \
            _params(forward)[:3] == ("input_states", "position_ids", "attention_mask") and \
            _has(cls, "self.conv_1d(", "self.rg_lru(", "self.linear_y(", "self.linear_out("):
        return "forward", _recurrent_block_forward
    if cls.__name__.endswith("CCAProjection") and forward is not None and \
            _params(forward)[:3] in (("hidden_states", "cache", "conv_mask"),
                                     ("hidden_states", "past_key_values", "conv_mask")) and \
            _has(cls, "self.conv_qk_depthwise(", "self.conv_qk_grouped(", "self.v_proj_delayed(", "[:, :-1]"):
        return "forward", _cca_forward
    if forward is not None and _params(forward)[:8] == ("query", "key", "value", "igate", "fgate", "c_initial",
                                                        "n_initial", "m_initial") and _has(cls, "self._inference_fn"):
        return "forward", _mlstm_forward  # xLSTM's mLSTM backend
    if forward is not None and _params(forward)[:2] == ("hidden", "state") and \
            _has(cls, "self.time_shift", "self.time_mix_key", "self.time_mix_receptance"):
        if _has(cls, "rwkv_linear_attention(", "self.time_decay", "self.time_first", "extract_key_value") and \
                callable(getattr(sys.modules[cls.__module__], "rwkv_linear_attention_cpu", None)):
            return "forward", _wkv_forward  # RWKV's time mixing: a token shift and the WKV recurrence
        if _has(cls, "torch.square(torch.relu(self.key(") and "rwkv_linear_attention(" not in source.class_source(cls):
            return "forward", _shift_forward  # RWKV's channel mixing: a token shift
    return None


def adapt_module(mod) -> bool:
    """Adapt the mixer classes of one modeling module (idempotent); whether any is adapted."""
    found = False
    for cls in [v for v in list(vars(mod).values()) if isinstance(v, type) and v.__module__ == mod.__name__]:
        match = _match(cls)
        if match is None:
            continue
        name, factory = match
        if not getattr(vars(cls)[name], CLASS_MIXER_ATTR, False):
            wrapper = factory(vars(cls)[name])
            setattr(wrapper, CLASS_MIXER_ATTR, True)
            patch(cls, name, wrapper, site="mixer_classes", admitted="recurrent._match (signature and structure)")
            patch(cls, CLASS_MIXER_ATTR, name, site="mixer_classes",  # tagged as a mixer (.mixers.class_mixer)
                  admitted="recurrent._match (signature and structure)")
        found = True
    return found


def adapted_class(cls: type) -> bool:
    """Whether ``cls`` (or a class it derives from) is a mixer class :func:`adapt_module` adapted: its
    sequence mixing runs across ranks; its submodules are its own."""
    return class_mixer(cls)


class MixerClasses(Adapter):
    """The mixer classes whose own methods compute their recurrence or token shift (see the module docstring):
    the method wrapped as each modeling module loads, checked at its first call under context parallelism."""

    name = "mixer_classes"
    sites = ("mixer_classes", "probe_state")
    adapts = ("a mixer class's method computing its recurrence or token shift: MiniMax's lightning attention, "
              "RecurrentGemma's recurrent block, Zaya's projection, xLSTM's mLSTM, RWKV's time and channel mixing")
    admission = ("the class's signature and structure when its module loads; at the first call under context "
                 "parallelism its own method against the adapter's computation on one document (class_admission)")

    def adapt(self, mod) -> bool:
        return adapt_module(mod)

    def findings(self, modules):
        return declined_findings(modules, lambda name: "." in name)  # a class's method its check declined

    def prepare(self, model, modules) -> None:
        mark_calling(modules, ())

    def computes(self, module) -> bool:
        return adapted_class(type(module))

    def stands_in(self, module) -> bool:
        return adapted_class(type(module))


ADAPTER = MixerClasses()
