"""The recurrences of the mixer classes (:mod:`.adapters.mixer_classes`) in the form the engine's scan runs
across ranks (:mod:`cp_attention.strategies.scan`): MiniMax's lightning attention and its segment function
:func:`decayed_linear_attention`, RecurrentGemma's RG-LRU, RWKV's WKV and xLSTM's mLSTM. Each states a
segment's computation from an incoming state, its state's shape and how two segments' transitions compose;
:mod:`.class_admission` checks a class's own method against them at its first call.
"""

from __future__ import annotations

import torch

__all__ = ["decayed_linear_attention", "Lightning", "Rglru", "Wkv", "MLstm"]


def decayed_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
                             initial: torch.Tensor | None = None, block: int = 256):
    """Linear attention with a per-head decay, from a state: ``kv_t = l kv_{t-1} + k_t^T v_t`` and
    ``o_t = q_t kv_t`` (``kv_{-1}``: ``initial``, zero when None), computed in blocks of ``block``.

    q/k (N, n, H, D), v (N, n, H, Dv), log_decay (H,) (``log l <= 0``), initial (N, H, D, Dv).
    Returns (o (N, n, H, Dv) in v's dtype, the final state (N, H, D, Dv) float32 at least).
    """
    N, n, H, D = q.shape
    dtype, acc = v.dtype, torch.promote_types(v.dtype, torch.float32)
    q, k, v = q.to(acc), k.to(acc), v.to(acc)
    ld = log_decay.to(acc).reshape(H)
    S = q.new_zeros(N, H, D, v.shape[-1]) if initial is None else initial.to(acc)
    outs = []
    for a in range(0, n, block):
        qb, kb, vb = q[:, a:a + block], k[:, a:a + block], v[:, a:a + block]
        b = qb.shape[1]
        i = torch.arange(b, device=q.device, dtype=acc)
        diff = i[:, None] - i[None, :]  # query i, key j: l^(i-j) for j <= i
        decay = torch.where(diff >= 0, torch.exp(ld[:, None, None] * diff.clamp(min=0)), diff.new_zeros(()))
        scores = torch.einsum("nihd,njhd->nhij", qb, kb) * decay
        intra = torch.einsum("nhij,njhe->nihe", scores, vb)
        inter = torch.einsum("nihd,nhde->nihe", qb * torch.exp(ld[None, None, :, None] * (i[None, :, None, None] + 1)),
                             S)
        outs.append(intra + inter)
        kd = kb * torch.exp(ld[None, None, :, None] * (b - 1 - i)[None, :, None, None])
        S = S * torch.exp(ld * b)[None, :, None, None] + torch.einsum("njhd,njhe->nhde", kd, vb)
    return torch.cat(outs, 1).to(dtype), S


class Decay:
    """An adapter whose transition scales the state elementwise (broadcast)."""

    def apply(self, T, S):
        return T * S


class Lightning(Decay):
    """The scan's adapter for :func:`decayed_linear_attention`: state (H, D, Dv), transition (H, 1, 1)
    ``l^n`` (closed form)."""

    token_dims = {"q": 1, "k": 1, "v": 1}
    out_dim = 1

    def __init__(self, log_decay, dtype, block):
        self.log_decay, self.dtype, self.block = log_decay, dtype, block

    def shapes(self, a):
        H, D = a["q"].shape[2:]
        return (H, D, a["v"].shape[3]), (H, 1, 1), torch.promote_types(self.dtype, torch.float32)

    def run(self, a):
        out, S = decayed_linear_attention(a["q"], a["k"], a["v"], self.log_decay, block=self.block)
        return out.to(self.dtype), S

    def transition(self, a):
        n = a["q"].shape[1]
        T = torch.exp(self.log_decay.to(torch.promote_types(self.dtype, torch.float32)) * n).reshape(1, -1, 1, 1)
        return T.expand(a["q"].shape[0], -1, 1, 1)

    def correct(self, a, S):
        return decayed_linear_attention(a["q"], a["k"], a["v"], self.log_decay, S, self.block)[0].to(self.dtype)


class Rglru(Decay):
    """The scan's adapter for RG-LRU's ``_rnn_scan(hidden_states, recurrent_gate, reset,
    recurrent_states)``: (N, n, W) inputs, gates and (N, n, 1) resets; state (W,) float32; transition
    (W,): the product of ``a_t`` over the piece (closed form; ``a_t`` is zero at a reset)."""

    token_dims = {"hidden_states": 1, "recurrent_gate": 1, "reset": 1}
    out_dim = 1

    def __init__(self, module, original):
        self.module, self.original = module, original

    def shapes(self, a):
        return (a["hidden_states"].shape[-1],), (a["hidden_states"].shape[-1],), torch.float32

    def _call(self, a, S):
        return self.original(self.module, hidden_states=a["hidden_states"], recurrent_gate=a["recurrent_gate"],
                             reset=a["reset"], recurrent_states=S)

    def run(self, a):
        return self._call(a, None)

    def transition(self, a):
        return (a["recurrent_gate"].float() * ~a["reset"]).prod(1)

    def correct(self, a, S):
        return self._call(a, S)[0]


class Wkv(Decay):
    """The scan's adapter for RWKV's ``rwkv_linear_attention(time_decay, time_first, key, value, state,
    return_state)``: key/value (N, n, C). The family keeps ``(num, den, max)``, ``num * e^max`` and ``den *
    e^max`` being the linear state ``a_t = w a_{t-1} + e^{k_t} v_t``, ``b_t = w b_{t-1} + e^{k_t}`` (``w =
    exp(-exp(time_decay))``); the scan composes that linear state (2, C) in float64 (``e^max`` overflows
    float32 long before float64), transition (1, C) ``w^n``; an incoming state goes back to the family's
    form with ``max = log b``. The output ``(a_{t-1} + e^{u+k_t} v_t) / (b_{t-1} + e^{u+k_t})`` does not
    depend on the stabiliser."""

    token_dims = {"key": 1, "value": 1}
    out_dim = 1

    def __init__(self, fn, time_decay, time_first):
        self.fn, self.time_decay, self.time_first = fn, time_decay, time_first

    def shapes(self, a):
        C = a["key"].shape[-1]
        return (2, C), (1, C), torch.float64

    def run(self, a):
        out, (num, den, top) = self.fn(self.time_decay, self.time_first, a["key"], a["value"], state=None,
                                       return_state=True)
        scale = torch.exp(top.double())
        return out, torch.stack([num.double() * scale, den.double() * scale], 1)

    def transition(self, a):
        N, n, C = a["key"].shape
        return torch.exp(-torch.exp(self.time_decay.double()) * n).expand(N, 1, C)

    def correct(self, a, S):
        top = torch.log(S[:, 1].clamp_min(torch.finfo(torch.float64).tiny))
        state = [S[:, 0] * torch.exp(-top), S[:, 1] * torch.exp(-top), top]
        return self.fn(self.time_decay, self.time_first, a["key"], a["value"], state=state)[0]


class MLstm:
    """The scan's adapter for xLSTM's mLSTM backend (``forward(query, key, value, igate, fgate, c_initial,
    n_initial, m_initial, ...)``; q/k/v (N, NH, n, D), gates (N, NH, n)), its segments through the
    backend's own any-length path (``_inference_fn``). The family keeps ``(C, n, m)``: ``C e^m`` and ``n
    e^m`` are the linear state ``C_t = f_t C_{t-1} + i_t k_t v_t^T`` (``f = sigmoid``, ``i = exp`` of the
    preactivations), and ``m_t = max(log f_t + m_{t-1}, i_t)`` (from 0) is a max-plus recurrence the
    output reads (its ``exp(-m)`` floor and ``eps``). The scan carries ``[C e^m | n e^m]`` (NH, Dk, Dv + 1)
    and ``m`` in one float64 state (NH, Dk + 1, Dv + 1); the transition (NH, 3) holds the piece's ``G =
    sum log f``, ``M = max_t(i_t + sum_{s>t} log f_s)`` and its own final ``m_F = max(G, M)``, so that
    ``apply`` + the piece's final state give ``e^G S`` for the linear part and ``max(G + m_S, M)`` for
    ``m``."""

    token_dims = {"query": 2, "key": 2, "value": 2, "igate": 2, "fgate": 2}
    out_dim = 2

    def __init__(self, backend):
        self.backend = backend

    def shapes(self, a):
        NH, _, Dk = a["key"].shape[1:]
        return (NH, Dk + 1, a["value"].shape[-1] + 1), (NH, 3), torch.float64

    def _call(self, a, initial):
        c, n, m = initial if initial is not None else (None, None, None)
        h, (c, n, m) = self.backend._inference_fn(query=a["query"], key=a["key"], value=a["value"], igate=a["igate"],
                                                  fgate=a["fgate"], c_initial=c, n_initial=n, m_initial=m)
        return h, (c, n, m)

    @staticmethod
    def pack(c, n, m):
        """(C, n, m) of the family (N, NH, Dk, Dv), (N, NH, Dk), (N, NH, 1) -> the scan's state."""
        scale = torch.exp(m.double())[..., None]
        top = torch.cat([c.double() * scale, n.double()[..., None] * scale], -1)
        bottom = torch.nn.functional.pad(m.double()[..., None], (0, top.shape[-1] - 1))
        return torch.cat([top, bottom], -2)

    @staticmethod
    def unpack(S, dtype):
        m = S[..., -1, :1]
        scale = torch.exp(-m)[..., None]
        return ((S[..., :-1, :-1] * scale).to(dtype), (S[..., :-1, -1] * scale[..., 0]).to(dtype), m.to(dtype))

    def run(self, a):
        h, state = self._call(a, None)
        return h, self.pack(*state)

    def transition(self, a):
        logf = torch.nn.functional.logsigmoid(a["fgate"].double())  # (N, NH, n)
        G = logf.sum(-1)
        M = (a["igate"].double() + G[..., None] - logf.cumsum(-1)).max(-1).values
        return torch.stack([G, M, torch.maximum(G, M)], -1)

    def apply(self, T, S):
        G, M, m_F = T.unbind(-1)
        linear = torch.exp(G)[..., None, None] * S[..., :-1, :]
        m = torch.maximum(G + S[..., -1, 0], M) - m_F
        bottom = torch.nn.functional.pad(m[..., None, None], (0, S.shape[-1] - 1))
        return torch.cat([linear, bottom], -2)

    def correct(self, a, S):
        return self._call(a, self.unpack(S, torch.float32))[0]
