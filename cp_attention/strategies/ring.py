"""The ring: one autograd.Function whose forward and backward walk a :class:`~cp_attention.plan.RankPlan`.

Forward: compute the local block while the first exchange is in flight; for every round, wait for
its K/V, post the next round's exchange, then compute the block and merge it into float32
accumulators by log-sum-exp. Sinks are applied after the last merge. Only local q, k, v, out and
lse are kept for backward.

Accumulators are full-length, so they are never zero-filled copies of a result: the first result
that covers an accumulator whole (the local block, at world size 1 the only one) becomes it, and
later ones are merged or added into it in place.

Backward: walk the same rounds, fetching the same remote K/V spans; dQ accumulates locally, and the
dK/dV partial sums of each received span go back to its owner, who adds them to its own.

:func:`ring_forward` and :func:`ring_backward` are the two passes without autograd (the forward also
returns the LSE), for callers with their own autograd: the single-device custom op of
:mod:`cp_attention.engine.local`.

K and V travel with their own head dims (``D`` for k, ``Dv`` for v, which differ in multi-head
latent attention): one message per exchange holds every K row of the spans, then every V row
(:func:`_kv_buffer`), and the dK/dV partial sums travel back in the same layout. What travels is a
*source* (:class:`HeadsSource`, the default); another source sends something smaller the receiver forms
K and V from (a multi-head latent attention layer's latent: :mod:`.latent`), with the same loops.

Legend: ``B`` batch, ``L`` local length, ``T = B * L`` packed local tokens, ``S`` packed rows of a
K/V buffer, ``H`` query heads, ``K`` K/V heads, ``D`` head dim of q/k, ``Dv`` head dim of v/out,
``W`` span width.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..masks import accumulation_dtype
from ..comm import Comm, Pending
from .merge import apply_sinks, merge_into_
from ..plan import RankPlan, Round, Step

__all__ = ["ring_attention", "ring_forward", "ring_backward", "HeadsSource", "GradSum", "copy_spans", "pack_tokens"]


class _KVBuffer(NamedTuple):
    """One message of K and V rows (or of their dK/dV partial sums): ``message`` is what travels, a
    contiguous block holding every K row, then every V row; ``k`` (B, W, K, D) and ``v`` (B, W, K, Dv)
    are views of it. ``message`` is shaped (2, B, W, K, D) when D == Dv, else flat."""

    message: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


def _kv_buffer(B: int, W: int, K: int, D: int, Dv: int, dtype: torch.dtype, device: torch.device,
               zero: bool = False) -> _KVBuffer:
    n_k = B * W * K * D
    flat = (torch.zeros if zero else torch.empty)(n_k + B * W * K * Dv, dtype=dtype, device=device)
    message = flat.view(2, B, W, K, D) if D == Dv else flat
    return _KVBuffer(message, flat[:n_k].view(B, W, K, D), flat[n_k:].view(B, W, K, Dv))


def copy_spans(dst_BWKD: torch.Tensor, x_BLKD: torch.Tensor, spans) -> None:
    """``x``'s spans ``[a, b)`` of rows, one after another, into ``dst``."""
    at = 0
    for a, b in spans:
        dst_BWKD[:, at:at + b - a].copy_(x_BLKD[:, a:b])
        at += b - a


class HeadsSource:
    """What a ring moves by default: the rows of k (B, Lk, K, D) and v (B, Lk, K, Dv) themselves, and
    their dK/dV partial sums back (float32). A source's interface, which :func:`ring_forward` and
    :func:`ring_backward` walk without knowing what travels:

    ``message(spans)``/``empty(width)``: my rows of ``spans`` as one contiguous message / a buffer for
    ``width`` received rows; ``open(buf)``: (k (B, W, K, D), v (B, W, K, Dv)) of a received message;
    ``backward_span(buf, run)``: the message of gradients going back to the rows' owner, where
    ``run(k, v, dk, dv)`` adds the received span's dK/dV partial sums into ``dk``/``dv`` (:class:`GradSum`);
    ``grad_empty(width)`` / ``settle(gbuf, spans)``: receive, and add, the gradients of my rows;
    ``dk``/``dv``: the sums of my rows' gradients (the local block's and the settled ones)."""

    def __init__(self, k_BLKD: torch.Tensor, v_BLKDv: torch.Tensor, acc: torch.dtype | None = None):
        self.k, self.v = k_BLKD, v_BLKDv
        self.B, self.Lk, self.K, self.D = k_BLKD.shape
        self.Dv = v_BLKDv.shape[3]
        if acc is not None:
            self.acc = acc
            self.dk = GradSum((self.B * self.Lk, self.K, self.D), acc, k_BLKD.device)
            self.dv = GradSum((self.B * self.Lk, self.K, self.Dv), acc, k_BLKD.device)

    def message(self, spans) -> torch.Tensor:
        width = sum(b - a for a, b in spans)
        payload = _kv_buffer(self.B, width, self.K, self.D, self.Dv, self.k.dtype, self.k.device)
        copy_spans(payload.k, self.k, spans)
        copy_spans(payload.v, self.v, spans)
        return payload.message

    def _view(self, message: torch.Tensor, width: int) -> _KVBuffer:
        n_k = self.B * width * self.K * self.D
        flat = message.view(-1)
        return _KVBuffer(message, flat[:n_k].view(self.B, width, self.K, self.D),
                         flat[n_k:].view(self.B, width, self.K, self.Dv))

    def empty(self, width: int) -> torch.Tensor:
        return _kv_buffer(self.B, width, self.K, self.D, self.Dv, self.k.dtype, self.k.device).message

    def open(self, buf: torch.Tensor, width: int):
        kv = self._view(buf, width)
        return pack_tokens(kv.k), pack_tokens(kv.v)

    def backward_span(self, buf: torch.Tensor, width: int, run) -> torch.Tensor:
        k_SKD, v_SKD = self.open(buf, width)
        out = _kv_buffer(self.B, width, self.K, self.D, self.Dv, self.acc, self.k.device, zero=True)
        run(k_SKD, v_SKD, GradSum.over(pack_tokens(out.k)), GradSum.over(pack_tokens(out.v)))
        return out.message

    def grad_empty(self, width: int) -> torch.Tensor:
        return _kv_buffer(self.B, width, self.K, self.D, self.Dv, self.acc, self.k.device).message

    def settle(self, gbuf: torch.Tensor, spans) -> None:
        g = self._view(gbuf, sum(b - a for a, b in spans))
        dk_BLKD = self.dk.result().view(self.B, self.Lk, self.K, self.D)
        dv_BLKDv = self.dv.result().view(self.B, self.Lk, self.K, self.Dv)
        at = 0
        for a, b in spans:
            dk_BLKD[:, a:b] += g.k[:, at:at + b - a]
            dv_BLKDv[:, a:b] += g.v[:, at:at + b - a]
            at += b - a


def _post(comm: Comm, rnd: Round, source, tag: int) -> tuple[Pending, torch.Tensor | None]:
    """Post one round's exchange of ``source``: my spans to ``send_to``, the step's spans from its source."""
    if rnd.send_to is not None:
        comm.send(source.message(rnd.send_spans), rnd.send_to, tag)
    buf = None
    if rnd.recv is not None:
        buf = source.empty(rnd.recv.width)
        comm.recv(buf, rnd.recv.source, tag)
    return comm.commit("a K/V exchange"), buf


class _Outputs:
    """The merged out (T, H, Dv) and lse (H, T) of a rank's queries, in the accumulation dtype."""

    def __init__(self, T: int, H: int, Dv: int, dtype: torch.dtype, device: torch.device):
        self.shape, self.dtype, self.device = (T, H, Dv), dtype, device
        self.out_THD: torch.Tensor | None = None
        self.lse_HT: torch.Tensor | None = None

    def merge(self, rows: slice, o_THD: torch.Tensor, l_HT: torch.Tensor) -> None:
        if self.out_THD is None and o_THD.shape == self.shape:  # covers every row: adopt it
            self.out_THD, self.lse_HT = o_THD.to(self.dtype), l_HT.to(self.dtype)
            return
        self.result()  # allocate: zeros, lse = -inf (the merge identity)
        merge_into_(self.out_THD[rows], self.lse_HT[:, rows], o_THD, l_HT)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.out_THD is None:
            self.out_THD = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
            self.lse_HT = torch.full(self.shape[1::-1], float("-inf"), dtype=self.dtype, device=self.device)
        return self.out_THD, self.lse_HT


class GradSum:
    """A sum of partial gradients over row ranges of one (S, ...) tensor in the accumulation dtype.
    The first part covering every row becomes the sum (backends return new tensors they do not
    keep), later ones are added in place."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        self.value: torch.Tensor | None = None

    @classmethod
    def over(cls, buffer: torch.Tensor) -> "GradSum":
        """A sum into an existing zero-filled ``buffer`` (a send buffer)."""
        total = cls(buffer.shape, buffer.dtype, buffer.device)
        total.value = buffer
        return total

    def add(self, rows: slice, part: torch.Tensor) -> None:
        if self.value is None and tuple(part.shape) == self.shape and part.dtype == self.dtype:
            self.value = part
            return
        self.result()[rows] += part

    def result(self) -> torch.Tensor:
        if self.value is None:
            self.value = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        return self.value


def _forward_step(step: Step, backend, q_THD, k_SKD, v_SKD, outputs: _Outputs, scale, softcap):
    for c in step.calls:
        cu_q, cu_k = c.cu_seqlens_on(q_THD.device)
        o_THD, l_HT = backend.forward(
            q_THD[c.q_start:c.q_end], k_SKD[c.k_start:c.k_end], v_SKD[c.k_start:c.k_end], cu_q, cu_k,
            c.max_seqlen_q, c.max_seqlen_k, scale=scale, causal=c.causal, window=c.window, softcap=softcap)
        outputs.merge(slice(c.q_start, c.q_end), o_THD, l_HT)


def _backward_step(step: Step, backend, dout_THD, q_THD, k_SKD, v_SKD, out_THD, lse_HT, dq: GradSum, dk: GradSum,
                   dv: GradSum, scale, softcap):
    for c in step.calls:
        cu_q, cu_k = c.cu_seqlens_on(q_THD.device)
        rows, keys = slice(c.q_start, c.q_end), slice(c.k_start, c.k_end)
        dq_part, dk_part, dv_part = backend.backward(
            dout_THD[rows], q_THD[rows], k_SKD[keys], v_SKD[keys], out_THD[rows], lse_HT[:, rows], cu_q, cu_k,
            c.max_seqlen_q, c.max_seqlen_k, scale=scale, causal=c.causal, window=c.window, softcap=softcap)
        dq.add(rows, dq_part)
        dk.add(keys, dk_part)
        dv.add(keys, dv_part)


def pack_tokens(x_BLKD: torch.Tensor) -> torch.Tensor:
    """(B, L, K, D) -> (B * L, K, D), any last dim (a view when the strides allow)."""
    B, L, K, D = x_BLKD.shape
    return x_BLKD.reshape(B * L, K, D)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, plan: RankPlan, comm: Comm, backend, scale: float, softcap):
        with comm.reporting("context-parallel attention forward"):  # peers learn who failed, and why
            return _RingAttention._forward(ctx, q, k, v, sinks, plan, comm, backend, scale, softcap)

    @staticmethod
    def backward(ctx, dout):
        with ctx.comm.reporting("context-parallel attention backward"):
            return _RingAttention._backward(ctx, dout)

    @staticmethod
    def _forward(ctx, q, k, v, sinks, plan: RankPlan, comm: Comm, backend, scale: float, softcap):
        out, lse_HT = ring_forward(q, k, v, sinks, plan, comm, backend, scale=scale, softcap=softcap)
        ctx.save_for_backward(q, k, v, out, lse_HT, sinks)
        ctx.plan, ctx.comm, ctx.backend, ctx.scale, ctx.softcap = plan, comm, backend, scale, softcap
        return out

    @staticmethod
    def _backward(ctx, dout):
        q, k, v, out, lse_HT, sinks = ctx.saved_tensors
        dq, dk, dv, dsinks = ring_backward(
            dout, q, k, v, out, lse_HT, sinks, ctx.plan, ctx.comm, ctx.backend, scale=ctx.scale,
            softcap=ctx.softcap, need_dsinks=sinks is not None and ctx.needs_input_grad[3])
        return dq, dk, dv, dsinks, None, None, None, None, None


def ring_forward(q, k, v, sinks, plan: RankPlan, comm: Comm, backend, *, scale: float,
                 softcap: float | None, out_dtype: torch.dtype | None = None,
                 source=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ring's forward without autograd: q (B, L, H, D), k (B, Lk, K, D), v (B, Lk, K, Dv) -> out
    (B, L, H, Dv) in q's dtype (``out_dtype`` when given: the accumulation dtype keeps a partial result for
    a later merge) and lse (H, B * L) in the accumulation dtype (float32; float64 for float64 inputs),
    after the sinks. :func:`ring_backward` takes both back. ``source``: what travels (None:
    :class:`HeadsSource` of k and v; the local block always reads k and v)."""
    B, L, H, _ = q.shape
    Dv = v.shape[3]
    acc = accumulation_dtype(q.dtype)
    q_THD = pack_tokens(q)
    outputs = _Outputs(B * L, H, Dv, acc, q.device)
    source = HeadsSource(k, v) if source is None else source
    rounds = plan.schedule()
    pending = _post(comm, rounds[0], source, rounds[0].offset) if rounds else None
    if plan.local is not None:
        _forward_step(plan.local, backend, q_THD, pack_tokens(k), pack_tokens(v), outputs, scale, softcap)
    for i, rnd in enumerate(rounds):
        wait, buf = pending
        wait.wait()
        if i + 1 < len(rounds):
            pending = _post(comm, rounds[i + 1], source, rounds[i + 1].offset)
        if buf is not None:
            _forward_step(rnd.recv, backend, q_THD, *source.open(buf, rnd.recv.width), outputs, scale, softcap)
    out_THDv, lse_HT = outputs.result()
    if sinks is not None:
        out_THDv, lse_HT = apply_sinks(out_THDv, lse_HT, sinks)
    return out_THDv.to(out_dtype or q.dtype).reshape(B, L, H, Dv), lse_HT


def ring_backward(dout, q, k, v, out, lse_HT, sinks, plan: RankPlan, comm: Comm, backend, *, scale: float,
                  softcap: float | None, need_dsinks: bool, source=None):
    """The ring's backward without autograd, from :func:`ring_forward`'s inputs and results ->
    (dq, dk, dv, dsinks) in the inputs' dtypes; dsinks (H,) or None unless ``need_dsinks``. ``source``:
    the forward's (None: :class:`HeadsSource` of k and v); dk and dv are its sums of k's and v's rows
    (a source that returns its rows' gradients otherwise keeps them itself)."""
    B, L, H, D = q.shape
    acc = accumulation_dtype(q.dtype)
    P = plan.world_size
    q_THD, out_THDv = pack_tokens(q), pack_tokens(out)
    dout_THDv = pack_tokens(dout.contiguous())
    dq = GradSum((B * L, H, D), acc, q.device)
    source = HeadsSource(k, v, acc) if source is None else source
    rounds = plan.schedule()
    grads_in_flight: list[tuple[Pending, torch.Tensor | None, Round]] = []

    def settle(entry):
        wait, gbuf, rnd = entry
        wait.wait()
        if gbuf is not None:  # the partial sums of my span's gradients, computed by rnd.send_to
            source.settle(gbuf, rnd.send_spans)

    pending = _post(comm, rounds[0], source, rounds[0].offset) if rounds else None
    if plan.local is not None:
        _backward_step(plan.local, backend, dout_THDv, q_THD, pack_tokens(k), pack_tokens(v), out_THDv, lse_HT,
                       dq, source.dk, source.dv, scale, softcap)
    for i, rnd in enumerate(rounds):
        wait, buf = pending
        wait.wait()
        if i + 1 < len(rounds):
            pending = _post(comm, rounds[i + 1], source, rounds[i + 1].offset)
        if grads_in_flight:
            settle(grads_in_flight.pop(0))
        if buf is not None:
            def run(k_SKD, v_SKD, dk_sum, dv_sum, step=rnd.recv):
                _backward_step(step, backend, dout_THDv, q_THD, k_SKD, v_SKD, out_THDv, lse_HT, dq, dk_sum, dv_sum,
                               scale, softcap)

            comm.send(source.backward_span(buf, rnd.recv.width, run), rnd.recv.source, P + rnd.offset)
        gbuf_in = None
        if rnd.send_to is not None:
            gbuf_in = source.grad_empty(sum(b - a for a, b in rnd.send_spans))
            comm.recv(gbuf_in, rnd.send_to, P + rnd.offset)
        grads_in_flight.append((comm.commit("a dK/dV exchange"), gbuf_in, rnd))
    for entry in grads_in_flight:
        settle(entry)
    dsinks = None
    if sinks is not None and need_dsinks:
        # d loss / d sink_h = -sum_t exp(sink_h - lse_ht) * sum_d(dout * out)_ht
        delta_HT = (dout_THDv.to(acc) * out_THDv.to(acc)).sum(-1).t()
        dsinks = -(torch.exp(sinks.to(acc)[:, None] - lse_HT) * delta_HT).sum(1).to(sinks.dtype)
    return (dq.result().to(q.dtype).reshape(B, L, H, D), source.dk.result().to(k.dtype).reshape(k.shape),
            source.dv.result().to(v.dtype).reshape(v.shape), dsinks)


def ring_attention(q, k, v, sinks, plan: RankPlan, comm: Comm, backend, *, scale: float,
                   softcap: float | None) -> torch.Tensor:
    """Run ``plan`` on this rank's shard: q (B, L, H, D), k (B, Lk, K, D), v (B, Lk, K, Dv) (Lk == L
    except for single-device plans over a KV cache; Dv may differ from D), sinks (H,) or None -> out
    (B, L, H, Dv).
    Differentiable w.r.t. q, k, v and sinks."""
    return _RingAttention.apply(q, k, v, sinks, plan, comm, backend, scale, softcap)
