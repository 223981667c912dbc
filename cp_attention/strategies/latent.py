"""Multi-head latent attention across ranks: the ring moves each token's latent, not its heads.

An MLA layer (DeepSeek-V2/V3, GLM-4-MoE-Lite, MiniCPM3, ...) computes every token's keys and values from
one latent row: its normalised compressed K/V (``kv_lora_rank`` numbers) and its rotated shared RoPE key
(``qk_rope_head_dim``), ``R`` numbers in all, which the layer's up-projection expands into ``K`` heads of
keys (``D``) and values (``Dv``). The ring here sends the latent rows of the spans a rank needs
(``R`` numbers a token instead of ``K * (D + Dv)``) and the receiver expands them with the layer's own
function (:attr:`LatentKV.expand`) before attending; the local block reads the keys and values the layer
computed itself.

Backward: each received span is expanded again with autograd on, its dK/dV partial sums are pulled back
through the expansion, and the latent rows' gradient travels back to their owner, who adds it to its own
latent's gradient; the expansion's weights get the receiver's part of their gradient here, the owner's part
from its own layer (so the weight gradient is the one-device gradient once summed over the ranks, as for
every other weight).

Which form a layer's ring uses is :func:`latent_form`'s choice (the bytes a token's heads take against its
latent's, and the receiver's expansion FLOPs against the bytes saved, under the context's cost model); it is
stated in the call's :class:`~cp_attention.plan.PlanStats` (``kv_form``, ``kv_form_reason``), with the bytes
the latent rows really took (counted as they are posted) and those the heads would have taken.

Legend: ``B`` batch, ``L`` local tokens, ``W`` received rows, ``R`` latent width, ``H`` query heads,
``K`` K/V heads, ``D`` head dim of q/k, ``Dv`` head dim of v.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from ..comm import Comm
from ..masks import accumulation_dtype
from ..plan import RankPlan
from .ring import GradSum, copy_spans, pack_tokens, ring_backward, ring_forward

__all__ = ["LatentKV", "latent_form", "head_parallel_latent_form", "latent_ring_attention", "latent_stats"]


@dataclass(frozen=True)
class LatentKV:
    """A multi-head latent attention layer's keys and values in the form it computes them from.

    ``latent`` (B, L, R): this rank's tokens' latent rows, the rows ``expand`` reads (for transformers'
    MLA layers the normalised compressed K/V, then the rotated shared RoPE key); ``expand``: the layer's own
    function (B, W, R) -> (k (B, W, K, D), v (B, W, K, Dv)), row-wise and deterministic, whose result for
    ``latent`` is the k and v the layer hands to the attention; ``params``: the tensors ``expand`` reads
    that need a gradient (its weights, LoRA adapters): their gradient from the rows this rank receives
    is returned to them. ``declined``: why the latent must not travel (the integration's check of
    ``expand`` failed: the heads move), or None."""

    latent: torch.Tensor
    expand: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    params: tuple[torch.Tensor, ...] = ()
    declined: str | None = None


def latent_form(*, kv_heads: int, head_dim: int, head_dim_v: int, latent_dim: int, cost_model) -> tuple[str, str]:
    """("latent" or "heads", why) for a layer whose tokens' keys and values take ``kv_heads * (head_dim +
    head_dim_v)`` numbers and whose latent takes ``latent_dim``: the latent travels when it is smaller and
    the receiver's expansion (a ``latent_dim`` x ``kv_heads * (head_dim + head_dim_v)`` matrix product per
    row, in the forward, again in the backward and its two products there) costs less time under
    ``cost_model`` than the bytes it saves (forward and backward K/V in the inputs' dtype, the gradients in
    float32). Per token, so every rank decides alike."""
    heads = kv_heads * (head_dim + head_dim_v)
    if latent_dim >= heads:
        return "heads", (f"the latent ({latent_dim} numbers a token) is no smaller than the K/V heads "
                         f"({kv_heads} x ({head_dim} + {head_dim_v}) = {heads})")
    saved = (heads - latent_dim) * (2 * 2 + 4)  # K/V twice in 16-bit at most, their gradients in float32
    flops = 2 * latent_dim * heads * 4  # the forward's expansion, its recomputation, the backward's two products
    t_saved, t_flops = saved / cost_model.bandwidth, flops / cost_model.throughput
    if t_flops >= t_saved:
        return "heads", (f"expanding a received latent ({flops} FLOPs a token, {1e9 * t_flops:.3g} ns) costs more "
                         f"than the {saved} bytes it saves ({1e9 * t_saved:.3g} ns)")
    return "latent", (f"{latent_dim} numbers a token instead of {heads} ({heads / latent_dim:.3g}x fewer); "
                      f"expanding costs {1e9 * t_flops:.3g} ns a token against {1e9 * t_saved:.3g} ns saved")


def head_parallel_latent_form(*, kv_heads: int, kv_received: int, head_dim: int, head_dim_v: int, latent_dim: int,
                              ulysses: int, cost_model) -> tuple[str, str]:
    """:func:`latent_form` for head parallelism over head groups of ``ulysses`` ranks: a rank receives every
    other member's tokens of the ``kv_received`` K/V heads its query heads use, or their latent rows once
    (every head reads them); with the latent it expands every row of the head group for all ``kv_heads`` (the
    layer's expansion makes them all) and keeps its own, so the expansion of ``ulysses / (ulysses - 1)`` rows
    (forward and the backward's two products) is weighed against the bytes one received row saves (the
    exchange and its gradient back, 16-bit at most)."""
    heads = kv_received * (head_dim + head_dim_v)
    if latent_dim >= heads:
        return "heads", (f"the latent ({latent_dim} numbers a token) is no smaller than the K/V heads a rank "
                         f"receives ({kv_received} x ({head_dim} + {head_dim_v}) = {heads})")
    saved = (heads - latent_dim) * (2 + 2)
    flops = 2 * latent_dim * kv_heads * (head_dim + head_dim_v) * 3 * ulysses / (ulysses - 1)
    t_saved, t_flops = saved / cost_model.bandwidth, flops / cost_model.throughput
    if t_flops >= t_saved:
        return "heads", (f"expanding every head of the head group's latent rows ({flops:.3g} FLOPs a received token, "
                         f"{1e9 * t_flops:.3g} ns) costs more than the {saved} bytes it saves ({1e9 * t_saved:.3g} ns)")
    return "latent", (f"{latent_dim} numbers a token instead of {heads} ({heads / latent_dim:.3g}x fewer), gathered "
                      f"once for every head; expanding costs {1e9 * t_flops:.3g} ns a received token against "
                      f"{1e9 * t_saved:.3g} ns saved")


def latent_stats(stats, plan: RankPlan, latent_dim: int, itemsize: int, sent: int, received: int):
    """``stats`` (the plan's, counted for the heads) of a call whose ring moved latent rows: the K/V bytes
    ``sent``/``received`` as counted when posted, the gradients' (float32 latent rows, the same rows back),
    and what the heads would have taken (``heads_kv_bytes_*``: the plan's own count)."""
    acc_itemsize = 8 if itemsize == 8 else 4
    rows_in = sum(r.recv.width for r in plan.rounds if r.recv is not None) * plan.batch
    rows_out = sum(b - a for r in plan.rounds if r.send_to is not None for a, b in r.send_spans) * plan.batch
    return dataclasses.replace(
        stats, kv_bytes_recv=received, kv_bytes_sent=sent, grad_bytes_recv=rows_out * latent_dim * acc_itemsize,
        grad_bytes_sent=rows_in * latent_dim * acc_itemsize, kv_form="latent",
        heads_kv_bytes_recv=stats.kv_bytes_recv, heads_kv_bytes_sent=stats.kv_bytes_sent)


class _LatentSource:
    """The ring's source (see :class:`~cp_attention.strategies.ring.HeadsSource`) of a latent layer: latent
    rows travel, the receiver expands them; backward, the latent rows' gradient travels back and the
    expansion's weight gradient of the received rows stays with the receiver (:attr:`dparams`)."""

    def __init__(self, latent: LatentKV, k, v, acc: torch.dtype | None = None):
        self.latent_BLR = latent.latent.detach()
        self.expand, self.params = latent.expand, latent.params
        self.B, self.L, self.R = self.latent_BLR.shape
        self.sent = self.received = 0
        if acc is not None:
            self.acc = acc
            self.dk = GradSum((k.shape[0] * k.shape[1],) + tuple(k.shape[2:]), acc, k.device)
            self.dv = GradSum((v.shape[0] * v.shape[1],) + tuple(v.shape[2:]), acc, v.device)
            self.dlatent = GradSum((self.B * self.L, self.R), acc, k.device)
            self.dparams: list = [None] * len(self.params)

    def message(self, spans) -> torch.Tensor:
        width = sum(b - a for a, b in spans)
        payload = self.latent_BLR.new_empty(self.B, width, self.R)
        copy_spans(payload, self.latent_BLR, spans)
        self.sent += payload.numel() * payload.element_size()
        return payload

    def empty(self, width: int) -> torch.Tensor:
        buf = self.latent_BLR.new_empty(self.B, width, self.R)
        self.received += buf.numel() * buf.element_size()
        return buf

    def open(self, buf: torch.Tensor, width: int):
        with torch.no_grad():
            k_BWKD, v_BWKDv = self.expand(buf)
        return pack_tokens(k_BWKD), pack_tokens(v_BWKDv)

    def backward_span(self, buf: torch.Tensor, width: int, run) -> torch.Tensor:
        with torch.enable_grad():
            rows = buf.detach().requires_grad_()
            k_BWKD, v_BWKDv = self.expand(rows)
        dk = GradSum((k_BWKD.shape[0] * width,) + tuple(k_BWKD.shape[2:]), self.acc, buf.device)
        dv = GradSum((v_BWKDv.shape[0] * width,) + tuple(v_BWKDv.shape[2:]), self.acc, buf.device)
        run(pack_tokens(k_BWKD.detach()), pack_tokens(v_BWKDv.detach()), dk, dv)
        wanted = [rows] + [p for p in self.params]
        grads = torch.autograd.grad(
            (k_BWKD, v_BWKDv), wanted,
            (dk.result().to(k_BWKD.dtype).view(k_BWKD.shape), dv.result().to(v_BWKDv.dtype).view(v_BWKDv.shape)),
            allow_unused=True)
        for i, g in enumerate(grads[1:]):
            if g is not None:
                self.dparams[i] = g if self.dparams[i] is None else self.dparams[i] + g
        back = grads[0] if grads[0] is not None else torch.zeros_like(rows)
        return back.to(self.acc).contiguous()

    def grad_empty(self, width: int) -> torch.Tensor:
        return torch.empty(self.B, width, self.R, dtype=self.acc, device=self.latent_BLR.device)

    def settle(self, gbuf: torch.Tensor, spans) -> None:
        d_BLR = self.dlatent.result().view(self.B, self.L, self.R)
        at = 0
        for a, b in spans:
            d_BLR[:, a:b] += gbuf[:, at:at + b - a]
            at += b - a


class _LatentRingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, latent_BLR, plan: RankPlan, comm: Comm, backend, scale, softcap, latent: LatentKV,
                counts: dict, *params):
        with comm.reporting("context-parallel attention forward"):
            source = _LatentSource(latent, k, v)
            out, lse_HT = ring_forward(q, k, v, sinks, plan, comm, backend, scale=scale, softcap=softcap,
                                       source=source)
        counts.update(sent=source.sent, received=source.received)
        ctx.save_for_backward(q, k, v, out, lse_HT, sinks, latent_BLR)
        ctx.plan, ctx.comm, ctx.backend, ctx.scale, ctx.softcap = plan, comm, backend, scale, softcap
        ctx.latent = latent
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse_HT, sinks, latent_BLR = ctx.saved_tensors
        latent = dataclasses.replace(ctx.latent, latent=latent_BLR)
        with ctx.comm.reporting("context-parallel attention backward"):
            source = _LatentSource(latent, k, v, accumulation_dtype(q.dtype))
            dq, dk, dv, dsinks = ring_backward(
                dout, q, k, v, out, lse_HT, sinks, ctx.plan, ctx.comm, ctx.backend, scale=ctx.scale,
                softcap=ctx.softcap, need_dsinks=sinks is not None and ctx.needs_input_grad[3], source=source)
        dlatent = source.dlatent.result().to(latent_BLR.dtype).view(latent_BLR.shape)
        dparams = [None if g is None else g.to(p.dtype) for g, p in zip(source.dparams, ctx.latent.params)]
        return (dq, dk, dv, dsinks, dlatent, None, None, None, None, None, None, None, *dparams)


def latent_ring_attention(q, k, v, sinks, latent: LatentKV, plan: RankPlan, comm: Comm, backend, *, scale: float,
                          softcap: float | None, counts: dict | None = None) -> torch.Tensor:
    """The ring of ``plan`` with ``latent``'s rows travelling instead of k's and v's: q (B, L, H, D), k (B, L,
    K, D) and v (B, L, K, Dv) as the layer computed them from ``latent.latent`` (B, L, R), sinks (H,) or None
    -> out (B, L, H, Dv), equal to :func:`~cp_attention.strategies.ring.ring_attention`'s. Differentiable
    w.r.t. q, k, v, sinks, ``latent.latent`` (the received rows' part) and ``latent.params`` (the received
    rows' expansion). ``counts``: filled with the latent bytes the forward ``sent`` and ``received``."""
    return _LatentRingAttention.apply(q, k, v, sinks, latent.latent, plan, comm, backend, scale, softcap, latent,
                                      {} if counts is None else counts, *latent.params)
