"""Sequence mixers computed in their own classes (cp_attention.integrations.recurrent) across ranks, against
float64 oracles, with packed documents (one-token documents, documents crossing ranks) and zigzag, contiguous
and random layouts, forward and backward:

* MiniMax's lightning attention: per head h, ``kv <- l_h kv + k^T v``, ``o = q kv`` with ``l_h =
  exp(-slope_h)`` (a sequential loop), between the layer's own per-token projections, norm and gate;
* RecurrentGemma's recurrent block (Griffin's RG-LRU after a depthwise causal convolution), written from
  the Griffin paper: ``x = conv(W_x h)``, input gate ``i = s(x W_i + b_i)``, recurrence gate ``r = s(x W_a
  + b_a)``, ``a = exp(-8 r softplus(L))``, ``h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t x_t)`` (at a
  document's first token: ``h = i x``), output ``W_o (h * gelu(W_y h))``;
* Zaya's convolved attention inputs (two stacked causal convolutions over q/k, the value's delayed half
  from the previous token): each document run alone through the family's own forward (its definition).

Also the segment function :func:`decayed_linear_attention` against the loop, in blocks shorter than the
sequence and from a given state. Outputs and the gradients of ``sum(y * R)`` (inputs, and parameters summed
over ranks) within 1e-9 in float64 (2e-6 for the RG-LRU, whose scan accumulates in float32).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

import cp_attention
from cp_attention.integrations.mixers import MIXER_ATTR
from cp_attention.integrations.recurrent import decayed_linear_attention
from cp_attention.tools.launch import run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.transformers]  # spawns gloo ranks; builds transformers modules

TOL = {"lightning": 1e-9, "zaya": 1e-9, "rglru": 2e-6}  # RG-LRU's _rnn_scan accumulates its state in float32
DOCS = ((7, 1, 12, 1, 7, 1), (29,))
L = 29
MIXERS = ("lightning", "rglru", "zaya")


def _starts(docs=DOCS) -> torch.Tensor:
    return torch.stack([torch.cat([torch.full((n,), sum(row[:i])) for i, n in enumerate(row)]) for row in docs])


def random_layout(P: int, seed: int) -> cp_attention.Layout:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, L), 3 * P - 1))
    runs = list(zip([0] + cuts, cuts + [L]))
    owners = list(range(P)) + [rng.randrange(P) for _ in range(len(runs) - P)]
    rng.shuffle(owners)
    return cp_attention.Layout(L, tuple(tuple(r for r, o in zip(runs, owners) if o == rank) for rank in range(P)))


# ----------------------------------------------------------------------------------------------
# the modules (float64, random weights) and the oracles


def _module(mixer: str):
    import transformers as tf

    torch.manual_seed(3)
    if mixer == "lightning":
        from transformers.models.minimax import modeling_minimax as m

        cfg = tf.MiniMaxConfig(hidden_size=16, num_attention_heads=2, head_dim=4, num_hidden_layers=2, block_size=4,
                               layer_types=["linear_attention", "full_attention"])
        module = m.MiniMaxLightningAttention(cfg, 0)
    elif mixer == "rglru":
        from transformers.models.recurrent_gemma import modeling_recurrent_gemma as m

        cfg = tf.RecurrentGemmaConfig(hidden_size=8, lru_width=8, num_attention_heads=2, conv1d_width=4,
                                      num_hidden_layers=1)
        module = m.RecurrentGemmaRecurrentBlock(cfg, 0)
    else:
        from transformers.models.zaya import modeling_zaya as m

        cfg = tf.ZayaConfig(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=4, cca_time0=3,
                            cca_time1=2)
        module = m.ZayaCCAProjection(cfg, 0)
    module = module.double()
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.4)
    setattr(module, MIXER_ATTR, True)  # as the model check tags a model's mixers
    return module


def _inputs(module):
    hidden = next(p for p in module.parameters() if p.dim() == 2).shape[1]
    if hasattr(module, "linear_x"):
        hidden = module.linear_x.in_features
    g = torch.Generator().manual_seed(7)
    return torch.randn(len(DOCS), L, hidden, generator=g, dtype=torch.float64)


def _out(mixer: str, module, h, pos):
    if mixer == "lightning":
        return module(hidden_states=h, position_embeddings=None, attention_mask=None)[0]
    if mixer == "rglru":
        return module(input_states=h, position_ids=pos, attention_mask=None, use_cache=False)[0]
    return torch.cat([t.flatten(2) for t in module(h, cache=None)], dim=-1)


def lightning_oracle(module, h, starts):
    B, _, _ = h.shape
    H, D = module.num_attention_heads, module.head_dim
    q, k, v = torch.split(module.act_fn(module.qkv_proj(h)).reshape(B, L, H, 3 * D), D, dim=3)
    lam = torch.exp(-module.slope_rate.reshape(H))
    out = torch.zeros(B, L, H, D, dtype=h.dtype)
    for b in range(B):
        for hh in range(H):
            kv = torch.zeros(D, D, dtype=h.dtype)
            for t in range(L):
                if int(starts[b, t]) == t:
                    kv = torch.zeros_like(kv)
                kv = lam[hh] * kv + torch.outer(k[b, t, hh], v[b, t, hh])
                out[b, t, hh] = q[b, t, hh] @ kv
    o = module.norm(out.reshape(B, L, H * D))
    return module.out_proj(torch.sigmoid(module.output_gate(h)) * o)


def rglru_oracle(module, h, starts):
    B = h.shape[0]
    lru = module.rg_lru
    W = module.lru_width
    heads, width = lru.num_attention_heads, lru.block_width
    y = module.act_fn(module.linear_y(h))
    x = module.linear_x(h)
    w, bias = module.conv_1d.weight[:, 0], module.conv_1d.bias  # (W, k)
    kernel = w.shape[1]
    xc = torch.zeros_like(x)
    for b in range(B):
        for t in range(L):
            acc = bias.clone()
            for j in range(kernel):
                src = t - (kernel - 1 - j)
                if src >= int(starts[b, t]):
                    acc = acc + w[:, j] * x[b, src]
            xc[b, t] = acc
    blocks = xc.reshape(B, L, heads, width)
    gate_i = torch.sigmoid(torch.einsum("blhi,hij->blhj", blocks, lru.input_gate_weight) + lru.input_gate_bias)
    gate_r = torch.sigmoid(torch.einsum("blhi,hij->blhj", blocks, lru.recurrent_gate_weight) + lru.recurrent_gate_bias)
    log_a = -8.0 * gate_r.reshape(B, L, W) * F.softplus(lru.recurrent_param)
    a = torch.exp(log_a)
    gated = xc * gate_i.reshape(B, L, W)
    out = torch.zeros_like(xc)
    for b in range(B):
        state = torch.zeros(W, dtype=h.dtype)
        for t in range(L):
            if int(starts[b, t]) == t:
                state = gated[b, t]
            else:
                state = a[b, t] * state + torch.sqrt(1 - a[b, t] ** 2) * gated[b, t]
            out[b, t] = state
    return module.linear_out(out * y)


def zaya_oracle(module, h, starts):
    rows = []
    for b, row in enumerate(DOCS):
        parts, a = [], 0
        for n in row:
            parts.append(_out("zaya", module, h[b:b + 1, a:a + n], None))  # outside a block: the family's code
            a += n
        rows.append(torch.cat(parts, dim=1))
    return torch.cat(rows)


ORACLES = {"lightning": lightning_oracle, "rglru": rglru_oracle, "zaya": zaya_oracle}


def _R(y):
    return torch.randn(y.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)


def _want(mixer: str):
    module = _module(mixer)
    h = _inputs(module).requires_grad_()
    y = ORACLES[mixer](module, h, _starts())
    (y * _R(y)).sum().backward()
    return y.detach(), h.grad, {n: p.grad.clone() for n, p in module.named_parameters()}


def _run(mixer: str, layout):
    import torch.distributed as dist

    module = _module(mixer)
    h_full = _inputs(module)
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCS])
    with cp_attention.context_parallel(layout=layout) as cp:
        batch = cp.shard_batch(input_ids=torch.zeros_like(pos), position_ids=pos)
        h = cp.shard(h_full, dim=1).clone().requires_grad_()
        y = _out(mixer, module, h, batch["position_ids"])
        stats = cp_attention.forward_mixer_stats()
        R = _R(torch.empty(len(DOCS), L, y.shape[-1]))
        (y * cp.shard(R, dim=1)).sum().backward()
        out = cp.gather(y.detach(), dim=1)
        dh = cp.gather(h.grad, dim=1)
    grads = {}
    for n, p in module.named_parameters():
        g = p.grad.clone()
        if cp.world_size > 1:
            dist.all_reduce(g)
        grads[n] = g
    return out, dh, grads, stats


def _errors(mixer, name, got, want) -> list[str]:
    (y, dh, grads, stats), (y_w, dh_w, g_w) = got, want
    errors = []
    for what, a, b in [("output", y, y_w), ("d hidden", dh, dh_w)] + [(f"d {n}", grads[n], g_w[n]) for n in g_w]:
        e = float((a - b).abs().max())
        if not e <= TOL[mixer] * max(1.0, float(b.abs().max())):
            errors.append(f"{mixer} {name}: {what} off by {e:.2e}")
    if not stats:
        errors.append(f"{mixer} {name}: no mixer stats reported")
    return errors


def _worker(rank: int, world_size: int, wants: dict) -> list[str]:
    torch.set_num_threads(1)
    errors = []
    for mixer in MIXERS:
        for name, layout in [("zigzag", "zigzag"), ("contiguous", "contiguous"), ("random", random_layout(world_size, 1))]:
            errors += [f"rank {rank} " + e for e in _errors(mixer, name, _run(mixer, layout), wants[mixer])]
    return errors


@pytest.fixture(scope="module")
def wants():
    return {m: _want(m) for m in MIXERS}


@pytest.mark.parametrize("world_size", [1, 3])
def test_class_mixers_match_float64_oracles(world_size, wants):
    """World size 1 (the documents kept apart within one rank) and 3 (uneven shards) in zigzag, contiguous
    and random layouts."""
    if world_size == 1:
        errors = [e for m in MIXERS for e in _errors(m, "one rank", _run(m, "contiguous"), wants[m])]
    else:
        errors = [e for r in run_ranks(world_size, _worker, wants, timeout=600) for e in r]
    assert not errors, "\n".join(errors[:30])


def test_decayed_linear_attention_in_blocks_from_a_state():
    g = torch.Generator().manual_seed(2)
    N, n, H, D, Dv = 2, 11, 3, 4, 5
    q, k = torch.randn(N, n, H, D, generator=g, dtype=torch.float64), torch.randn(N, n, H, D, generator=g,
                                                                                  dtype=torch.float64)
    v = torch.randn(N, n, H, Dv, generator=g, dtype=torch.float64)
    log_decay = -torch.rand(H, generator=g, dtype=torch.float64)
    S0 = torch.randn(N, H, D, Dv, generator=g, dtype=torch.float64)
    want, S = torch.zeros(N, n, H, Dv, dtype=torch.float64), S0.clone()
    for t in range(n):
        S = torch.exp(log_decay)[None, :, None, None] * S + torch.einsum("nhd,nhe->nhde", k[:, t], v[:, t])
        want[:, t] = torch.einsum("nhd,nhde->nhe", q[:, t], S)
    for block in (1, 3, 4, 11, 256):
        out, final = decayed_linear_attention(q, k, v, log_decay, S0, block=block)
        assert float((out - want).abs().max()) <= 1e-12 and float((final - S).abs().max()) <= 1e-12, block
