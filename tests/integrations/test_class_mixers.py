"""Sequence mixers computed in their own classes (cp_attention.integrations.hf.adapters.mixer_classes) across ranks, against
float64 oracles, with packed documents (one-token documents, documents crossing ranks) and zigzag, contiguous
and random layouts, forward and backward:

* MiniMax's lightning attention: per head h, ``kv <- l_h kv + k^T v``, ``o = q kv`` with ``l_h =
  exp(-slope_h)`` (a sequential loop), between the layer's own per-token projections, norm and gate;
* RecurrentGemma's recurrent block (Griffin's RG-LRU after a depthwise causal convolution), written from
  the Griffin paper: ``x = conv(W_x h)``, input gate ``i = s(x W_i + b_i)``, recurrence gate ``r = s(x W_a
  + b_a)``, ``a = exp(-8 r softplus(L))``, ``h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t x_t)`` (at a
  document's first token: ``h = i x``), output ``W_o (h * gelu(W_y h))``;
* Zaya's convolved attention inputs (two stacked causal convolutions over q/k, the value's delayed half
  from the previous token): each document run alone through the family's own forward (its definition);
* RWKV-4's time mixing (the token shift and the WKV sums written out, unstabilised) and channel mixing;
* xLSTM's mLSTM backend: the stabilised mLSTM recurrence of the xLSTM paper, stabiliser included (the
  output reads it through its ``exp(-m)`` floor).

Also the segment function :func:`decayed_linear_attention` against the loop, in blocks shorter than the
sequence and from a given state. Outputs and the gradients of ``sum(y * R)`` (inputs, and parameters summed
over ranks) within 1e-9 in float64 (2e-6 relative for the RG-LRU and RWKV, 1e-5 for xLSTM, whose functions
keep their states in float32).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

import cp_attention
from cp_attention.integrations.hf.mixing import mark_mixer
from cp_attention.integrations.hf.recurrences import decayed_linear_attention
from cp_attention.tools.launch import run_ranks
from plan_cases import random_layout

pytestmark = [pytest.mark.multirank, pytest.mark.transformers]  # spawns gloo ranks; builds transformers modules

# RG-LRU's _rnn_scan, RWKV's WKV and xLSTM's backend keep their states in float32
# (xLSTM's at a stabiliser near 9: states up to e^9 in float32)
TOL = {"lightning": 1e-9, "zaya": 1e-9, "shift": 1e-9, "rglru": 2e-6, "rwkv": 2e-6, "mlstm": 1e-5}
DOCS = ((7, 1, 12, 1, 7, 1), (29,))
L = 29
MIXERS = ("lightning", "rglru", "zaya", "rwkv", "shift", "mlstm")


def _starts(docs=DOCS) -> torch.Tensor:
    return torch.stack([torch.cat([torch.full((n,), sum(row[:i])) for i, n in enumerate(row)]) for row in docs])


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
    elif mixer == "zaya":
        from transformers.models.zaya import modeling_zaya as m

        cfg = tf.ZayaConfig(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=4, cca_time0=3,
                            cca_time1=2, attention_bias=True)  # biases: a document's first delayed value is one
        module = m.ZayaCCAProjection(cfg, 0)
    elif mixer in ("rwkv", "shift"):
        from transformers.models.rwkv import modeling_rwkv as m

        cfg = tf.RwkvConfig(hidden_size=8, attention_hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                            context_length=64)
        module = (m.RwkvSelfAttention if mixer == "rwkv" else m.RwkvFeedForward)(cfg, 0)
    else:
        from transformers.models.xlstm import modeling_xlstm as m

        cfg = tf.xLSTMConfig(hidden_size=16, num_heads=2, chunk_size=4, num_blocks=1)
        module = m.xLSTMBackend(cfg)
    module = module.double()
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.4)
            if name.startswith("time_mix"):
                p.copy_(torch.rand(p.shape, generator=g, dtype=p.dtype))
    mark_mixer(module)  # as the adapters mark a model's mixers
    return module


def _inputs(mixer: str, module) -> dict:
    """name -> (B, L, ...) inputs with their token dimension."""
    g = torch.Generator().manual_seed(7)
    B = len(DOCS)
    if mixer == "mlstm":
        rnd = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
        # input gates mostly low with spikes, forget gates near 1: the stabiliser m stays high across pieces,
        # so the output's eps e^m term (a few 1e-3 here) depends on carrying m in max-plus
        spikes = (torch.arange(L) % 5 == 2).to(torch.float64) * 9.0
        return {"query": (rnd(B, 2, L, 4), 2), "key": (rnd(B, 2, L, 4), 2), "value": (rnd(B, 2, L, 3), 2),
                "igate": (rnd(B, 2, L) - 2 + spikes, 2), "fgate": (rnd(B, 2, L) * 0.5 + 3, 2)}
    hidden = next(p for p in module.parameters() if p.dim() == 2).shape[1]
    if hasattr(module, "linear_x"):
        hidden = module.linear_x.in_features
    if mixer in ("rwkv", "shift"):
        hidden = module.time_mix_key.shape[-1]
    return {"h": (torch.randn(B, L, hidden, generator=g, dtype=torch.float64), 1)}


def _out(mixer: str, module, t: dict, pos):
    if mixer == "lightning":
        return module(hidden_states=t["h"], position_embeddings=None, attention_mask=None)[0]
    if mixer == "rglru":
        return module(input_states=t["h"], position_ids=pos, attention_mask=None, use_cache=False)[0]
    if mixer in ("rwkv", "shift"):
        return module(t["h"])[0]
    if mixer == "mlstm":
        return module(**t, return_last_states=False, mode="inference").transpose(1, 2)  # (B, L, NH, Dv)
    return torch.cat([x.flatten(2) for x in module(t["h"], cache=None)], dim=-1)


def lightning_oracle(module, t, starts):
    h = t["h"]
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


def rglru_oracle(module, t, starts):
    h = t["h"]
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


def zaya_oracle(module, t, starts):
    h = t["h"]
    rows = []
    for b, row in enumerate(DOCS):
        parts, a = [], 0
        for n in row:
            parts.append(_out("zaya", module, {"h": h[b:b + 1, a:a + n]}, None))  # outside a block: the family's code
            a += n
        rows.append(torch.cat(parts, dim=1))
    return torch.cat(rows)


def _shifted(h, starts):
    """The previous token's h inside its document, zero at a document start."""
    prev = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)
    first = starts == torch.arange(h.shape[1])
    return torch.where(first[..., None], torch.zeros_like(prev), prev)


def rwkv_oracle(module, t, starts):
    """RWKV-4's time mixing: ``wkv_t = (sum_{s<t} e^{-(t-1-s) w + k_s} v_s + e^{u + k_t} v_t) / (sum_{s<t}
    e^{-(t-1-s) w + k_s} + e^{u + k_t})`` over the document's earlier tokens, ``w = exp(time_decay)``."""
    h = t["h"]
    sh = _shifted(h, starts)
    mix = lambda mu: h * mu + sh * (1 - mu)  # noqa: E731
    k, v = module.key(mix(module.time_mix_key)), module.value(mix(module.time_mix_value))
    r = torch.sigmoid(module.receptance(mix(module.time_mix_receptance)))
    w, u = torch.exp(module.time_decay), module.time_first
    wkv = torch.zeros_like(v)
    for b in range(h.shape[0]):
        for tt in range(L):
            num, den = torch.exp(u + k[b, tt]) * v[b, tt], torch.exp(u + k[b, tt])
            for s_ in range(int(starts[b, tt]), tt):
                e = torch.exp(-(tt - 1 - s_) * w + k[b, s_])
                num, den = num + e * v[b, s_], den + e
            wkv[b, tt] = num / den
    return module.output(r * wkv)


def shift_oracle(module, t, starts):
    """RWKV's channel mixing: ``sigmoid(W_r x_r) * W_v relu(W_k x_k)^2`` with ``x = h mu + h_{t-1} (1 - mu)``."""
    h = t["h"]
    sh = _shifted(h, starts)
    key = torch.relu(module.key(h * module.time_mix_key + sh * (1 - module.time_mix_key))) ** 2
    r = torch.sigmoid(module.receptance(h * module.time_mix_receptance + sh * (1 - module.time_mix_receptance)))
    return r * module.value(key)


def mlstm_oracle(module, t, starts, eps=1e-6):
    """The stabilised mLSTM (xLSTM, Beck et al. 2024): ``m_t = max(log f_t + m_{t-1}, i_t)`` from ``m = 0``,
    ``C_t = e^{log f_t + m_{t-1} - m_t} C_{t-1} + e^{i_t - m_t} k_t v_t^T``, ``n_t`` likewise with ``k_t``,
    ``h_t = q~ C_t / (max(|q~ n_t|, e^{-m_t}) + eps)``, ``q~ = q / sqrt(Dk)``; per head, reset per document."""
    q, k, v, ig, fg = (t[n] for n in ("query", "key", "value", "igate", "fgate"))
    B, NH, _, Dk = q.shape
    out = torch.zeros(B, L, NH, v.shape[-1], dtype=q.dtype)
    logf = F.logsigmoid(fg)
    for b in range(B):
        for hh in range(NH):
            for tt in range(L):
                if int(starts[b, tt]) == tt:
                    C, n = torch.zeros(Dk, v.shape[-1], dtype=q.dtype), torch.zeros(Dk, dtype=q.dtype)
                    m = q.new_zeros(())
                m_new = torch.maximum(logf[b, hh, tt] + m, ig[b, hh, tt])
                fa, ia = torch.exp(logf[b, hh, tt] + m - m_new), torch.exp(ig[b, hh, tt] - m_new)
                C = fa * C + ia * torch.outer(k[b, hh, tt], v[b, hh, tt])
                n, m = fa * n + ia * k[b, hh, tt], m_new
                qs = q[b, hh, tt] * Dk ** -0.5
                out[b, tt, hh] = (qs @ C) / (torch.maximum((qs @ n).abs(), torch.exp(-m)) + eps)
    return out


ORACLES = {"lightning": lightning_oracle, "rglru": rglru_oracle, "zaya": zaya_oracle, "rwkv": rwkv_oracle,
           "shift": shift_oracle, "mlstm": mlstm_oracle}


def _R(y):
    return torch.randn(y.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)


def _want(mixer: str):
    module = _module(mixer)
    t = {n: x.clone().requires_grad_() for n, (x, _) in _inputs(mixer, module).items()}
    y = ORACLES[mixer](module, t, _starts())
    (y * _R(y)).sum().backward()
    grads = {f"d {n}": x.grad for n, x in t.items()}
    grads.update({f"d {n}": p.grad.clone() for n, p in module.named_parameters()})
    return y.detach(), grads


def _run(mixer: str, layout):
    import torch.distributed as dist

    module = _module(mixer)
    inputs = _inputs(mixer, module)
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCS])
    with cp_attention.context_parallel(layout=layout) as cp:
        batch = cp.shard_batch(input_ids=torch.zeros_like(pos), position_ids=pos)
        t = {n: cp.shard(x, dim=d).clone().requires_grad_() for n, (x, d) in inputs.items()}
        y = _out(mixer, module, t, batch["position_ids"])
        stats = cp_attention.forward_mixer_stats()
        R = _R(torch.empty(len(DOCS), L, *y.shape[2:]))
        (y * cp.shard(R, dim=1)).sum().backward()
        out = cp.gather(y.detach(), dim=1)
        grads = {f"d {n}": cp.gather(x.grad, dim=inputs[n][1]) for n, x in t.items()}
    for n, p in module.named_parameters():
        g = p.grad.clone()
        if cp.world_size > 1:
            dist.all_reduce(g)
        grads[f"d {n}"] = g
    return out, grads, stats


def _errors(mixer, name, got, want) -> list[str]:
    (y, grads, stats), (y_w, g_w) = got, want
    errors = []
    for what, a, b in [("output", y, y_w)] + [(n, grads[n], g_w[n]) for n in g_w]:
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
        layouts = [("zigzag", "zigzag"), ("contiguous", "contiguous")] + [
            (f"random{seed}", random_layout(random.Random(seed), L, world_size)) for seed in (1, 2, 3)]
        for name, layout in layouts:
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


def test_a_state_from_earlier_tokens_is_refused_under_context_parallelism():
    """Decoding (a cache holding a state) under context parallelism raises: the scan starts each document
    from zero; each mixer checks its own form of state (MiniMax's linear cache, RWKV's state list, xLSTM's
    initial states)."""

    class LinearCache:
        def get_linear_cache(self, layer_idx):
            return torch.zeros(len(DOCS), 2, 4, 4, dtype=torch.float64)

    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCS])
    lightning, rwkv, mlstm = _module("lightning"), _module("rwkv"), _module("mlstm")
    with cp_attention.context_parallel() as cp:
        batch = cp.shard_batch(input_ids=torch.zeros_like(pos), position_ids=pos)  # alive: the mixers' batch
        h = cp.shard(_inputs("lightning", lightning)["h"][0], dim=1)
        with pytest.raises(NotImplementedError, match="continue from a cache"):
            lightning(hidden_states=h, position_embeddings=None, attention_mask=None, cache=LinearCache())
        hr = cp.shard(_inputs("rwkv", rwkv)["h"][0], dim=1)
        state = [torch.ones(len(DOCS), hr.shape[-1], 1, dtype=torch.float64) for _ in range(5)]
        with pytest.raises(NotImplementedError, match="continue from a cache"):
            rwkv(hr, state=state)
        t = {n: cp.shard(x, dim=d) for n, (x, d) in _inputs("mlstm", mlstm).items()}
        with pytest.raises(NotImplementedError, match="continue from a cache"):
            mlstm(**t, c_initial=torch.ones(len(DOCS), 2, 4, 3, dtype=torch.float64))
        del batch


def test_rwkv_runs_its_torch_path_under_context_parallelism(monkeypatch, wants):
    """RWKV's WKV goes through transformers' torch path, differentiable through its state: the CUDA kernel
    ``rwkv_linear_attention`` dispatches to has a backward that ignores the state (a piece's gradient
    would not reach the pieces before it). Made to raise here: the CP path must not call it."""
    from transformers.models.rwkv import modeling_rwkv

    def kernel(*args, **kwargs):
        raise AssertionError("the CUDA kernel's entry was called under context parallelism")

    monkeypatch.setattr(modeling_rwkv, "rwkv_linear_attention", kernel)
    assert not _errors("rwkv", "one rank", _run("rwkv", "contiguous"), wants["rwkv"])


def test_rglru_resets_at_the_batchs_documents_whatever_positions_it_is_given(wants):
    """RecurrentGemma's RG-LRU resets (and scales its input by 1) where a position is 0: under context
    parallelism the places in the batch's documents, the scan's cuts, even when the caller's positions run
    along the whole row; and a cache carrying an earlier state is refused, not dropped."""
    module = _module("rglru")
    h_full = _inputs("rglru", module)["h"][0]
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCS])
    with cp_attention.context_parallel() as cp:
        batch = cp.shard_batch(input_ids=torch.zeros_like(pos), position_ids=pos)
        along_row = torch.arange(L).expand(len(DOCS), L)  # not restarting at the documents
        y = module(input_states=h_full, position_ids=along_row, attention_mask=None, use_cache=False)[0]
        module.rg_lru.recurrent_states = torch.ones(len(DOCS), module.lru_width, dtype=torch.float32)
        with pytest.raises(NotImplementedError, match="continue from a cache"):
            module(input_states=h_full, position_ids=pos, attention_mask=None, use_cache=True)
        del batch
    y_want = wants["rglru"][0]
    assert float((y - y_want).abs().max()) <= TOL["rglru"] * max(1.0, float(y_want.abs().max()))


def test_a_subclass_overriding_the_adapted_method_is_not_adapted():
    """The model check skips an adapted class's insides and its mixers are tagged: a subclass that replaces
    the adapted method computes something of its own and is neither."""
    from cp_attention.integrations.hf.adapters.mixer_classes import adapted_class
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention
    from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaRglru

    class Own(MiniMaxLightningAttention):
        def forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
            return hidden_states, None

    class Inherits(RecurrentGemmaRglru):
        pass

    assert adapted_class(MiniMaxLightningAttention) and adapted_class(RecurrentGemmaRglru)
    assert adapted_class(Inherits) and not adapted_class(Own)
