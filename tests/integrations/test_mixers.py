"""Sequence mixers across ranks (cp_attention.strategies.scan through transformers' adapted functions) against
float64 sequential oracles written from each mixer's definition, with packed documents (one-token
documents, documents crossing ranks) and zigzag, contiguous and random layouts.

* short causal convolution (kernel k, depthwise, then SiLU): ``y_g = b + sum_j w_j x_{g-(k-1-j)}``
  over the inputs of g's own document (earlier ones are zeros);
* gated DeltaNet (transformers' ``torch_chunk_gated_delta_rule``, FLA's definition): q and k
  L2-normalised, q scaled by Dk^-1/2, ``S <- e^g S; S <- S + k (b (v - S^T k))^T; o = S^T q``;
* Kimi Delta Attention (``chunk_kimi_delta_attention``, Kimi Linear's and Bailing's): gated DeltaNet
  with a decay per key channel, ``S <- diag(e^{g}) S`` (g: (B, L, H, Dk)), the rest as above;
* Mamba-2 SSD (``mamba2_chunk_scan``): ``dt' = softplus(dt + bias)``, ``h <- e^{dt' A} h +
  dt' x B^T`` (B, C shared by the heads of a group), ``y = h C + D x``;
* Mamba's selective scan (``mamba_selective_scan``): per channel d and state n,
  ``h <- e^{A_dn dt'_d} h + dt'_d B_n x_d``, ``y = (sum_n h C_n + D x) silu(z)``;

every state restarting from zero at each document start. Forward outputs and the gradients of
``sum(y * R)`` with respect to every input and parameter (parameters summed over ranks) within
2e-5 of the oracle's (the adapted functions compute in float32).
"""

from __future__ import annotations

import importlib
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cp_attention
from cp_attention.integrations.hf.mixing import mark_mixer
from cp_attention.strategies.mixer_exchange import make_geometry
from cp_attention.strategies.scan import geometry_of, halo_plan, scan_plan
from cp_attention.tools.launch import run_ranks

pytestmark = pytest.mark.multirank  # spawns gloo ranks

TOL = 2e-5
DOCS = ((7, 1, 12, 1, 7, 1), (29,))  # L = 29: one-token documents first in a piece, inside and last


def _starts(docs) -> torch.Tensor:
    return torch.stack([torch.cat([torch.full((n,), sum(row[:i])) for i, n in enumerate(row)]) for row in docs])


# ----------------------------------------------------------------------------------------------
# the oracles: sequential loops in float64 from each definition


def conv_oracle(x, w, b, starts):
    """x (B, C, L), w (C, k), b (C,): the causal depthwise convolution per document, then SiLU."""
    B, C, L = x.shape
    k = w.shape[1]
    out = torch.zeros_like(x)
    for bi in range(B):
        for g in range(L):
            acc = b.clone()
            for j in range(k):
                src = g - (k - 1 - j)
                if src >= int(starts[bi, g]):
                    acc = acc + w[:, j] * x[bi, :, src]
            out[bi, :, g] = acc
    return F.silu(out)


def delta_oracle(q, k, v, g, beta, starts):
    """q, k (B, L, Hk, Dk), v (B, L, Hv, Dv), g, beta (B, L, Hv) -> o (B, L, Hv, Dv); g (B, L, Hv, Dk):
    a decay per key channel (KDA)."""
    B, L, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    rep = Hv // Hk
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    out = []
    for bi in range(B):
        rows = []
        for h in range(Hv):
            S = torch.zeros(Dk, Dv, dtype=v.dtype)
            col = []
            for t in range(L):
                if int(starts[bi, t]) == t:
                    S = torch.zeros(Dk, Dv, dtype=v.dtype)
                kt, qt = k[bi, t, h // rep], q[bi, t, h // rep] * Dk ** -0.5
                decay = torch.exp(g[bi, t, h])
                S = (decay[:, None] if decay.dim() else decay) * S  # row i of S: key channel i
                S = S + torch.outer(kt, beta[bi, t, h] * (v[bi, t, h] - S.T @ kt))
                col.append(S.T @ qt)
            rows.append(torch.stack(col))
        out.append(torch.stack(rows, dim=1))
    return torch.stack(out)


def mamba2_oracle(x, dt, A, Bm, Cm, D, dt_bias, starts):
    """x (B, L, H, P), dt (B, L, H), A (H,), Bm/Cm (B, L, G, N), D (H,) -> y (B, L, H, P)."""
    Bsz, L, H, P = x.shape
    G, N = Bm.shape[2:]
    dt = F.softplus(dt + dt_bias)
    out = torch.zeros_like(x)
    for bi in range(Bsz):
        for h in range(H):
            grp = h // (H // G)
            S = torch.zeros(P, N, dtype=x.dtype)
            for t in range(L):
                if int(starts[bi, t]) == t:
                    S = torch.zeros(P, N, dtype=x.dtype)
                S = torch.exp(dt[bi, t, h] * A[h]) * S + dt[bi, t, h] * torch.outer(x[bi, t, h], Bm[bi, t, grp])
                out[bi, t, h] = S @ Cm[bi, t, grp] + D[h] * x[bi, t, h]
    return out


def mamba_oracle(x, dt, A, Bm, Cm, D, z, bias, starts):
    """x, dt, z (B, Dm, L), A (Dm, N), Bm/Cm (B, N, L), D (Dm,) -> y (B, Dm, L)."""
    Bsz, Dm, L = x.shape
    dt = F.softplus(dt + bias[:, None])
    out = torch.zeros_like(x)
    for bi in range(Bsz):
        S = torch.zeros(Dm, A.shape[1], dtype=x.dtype)
        for t in range(L):
            if int(starts[bi, t]) == t:
                S = torch.zeros_like(S)
            S = torch.exp(A * dt[bi, :, t, None]) * S + dt[bi, :, t, None] * Bm[bi, None, :, t] * x[bi, :, t, None]
            out[bi, :, t] = (S * Cm[bi, None, :, t]).sum(-1) + D * x[bi, :, t]
    return out * F.silu(z)


# ----------------------------------------------------------------------------------------------
# the cases: inputs (token tensors with their token dimension; parameters), the oracle, the call


def _case(mixer: str, B: int, L: int):
    g = torch.Generator().manual_seed(len(mixer) * 7 + L)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    if mixer == "conv":
        tokens = {"x": (rnd(B, 6, L), 2)}
        params = {"w": rnd(6, 4) * 0.5, "b": rnd(6) * 0.1}
    elif mixer == "delta":
        tokens = {"q": (rnd(B, L, 2, 4), 1), "k": (rnd(B, L, 2, 4), 1), "v": (rnd(B, L, 4, 3), 1),
                  "g": (-F.softplus(rnd(B, L, 4)), 1), "beta": (torch.sigmoid(rnd(B, L, 4)), 1)}
        params = {}
    elif mixer == "kda":
        tokens = {"q": (rnd(B, L, 3, 4), 1), "k": (rnd(B, L, 3, 4), 1), "v": (rnd(B, L, 3, 5), 1),
                  "g": (-F.softplus(rnd(B, L, 3, 4)), 1), "beta": (torch.sigmoid(rnd(B, L, 3)), 1)}
        params = {}
    elif mixer == "mamba2":
        tokens = {"x": (rnd(B, L, 4, 3), 1), "dt": (rnd(B, L, 4) * 0.5, 1), "B": (rnd(B, L, 2, 3), 1),
                  "C": (rnd(B, L, 2, 3), 1)}
        params = {"A": -torch.rand(4, generator=g, dtype=torch.float64) - 0.2, "D": rnd(4), "dt_bias": rnd(4) * 0.1}
    else:
        tokens = {"x": (rnd(B, 4, L), 2), "dt": (rnd(B, 4, L) * 0.5, 2), "B": (rnd(B, 3, L), 2),
                  "C": (rnd(B, 3, L), 2), "z": (rnd(B, 4, L), 2)}
        params = {"A": -torch.rand(4, 3, generator=g, dtype=torch.float64) - 0.2, "D": rnd(4),
                  "bias": rnd(4) * 0.1}
    return tokens, params


def _function(mixer: str):
    """The adapted transformers function (its modeling module imported: cp_attention wrapped it;
    imported before any block opens, as a model's would be)."""
    module, name = {"conv": ("lfm2", "causal_conv1d_fn"), "delta": ("qwen3_next", "torch_chunk_gated_delta_rule"),
                    "mamba2": ("nemotron_h", "mamba2_chunk_scan"), "mamba": ("jamba", "mamba_selective_scan"),
                    "kda": ("kimi_linear", "chunk_kimi_delta_attention")}[mixer]
    return getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)


def _call(mixer: str, fn, t: dict, p: dict):
    if mixer == "conv":
        return fn(t["x"], p["w"], p["b"], activation="silu")
    if mixer in ("delta", "kda"):
        return fn(t["q"], t["k"], t["v"], g=t["g"], beta=t["beta"], chunk_size=4, initial_state=None,
                  output_final_state=False, use_qk_l2norm_in_kernel=True)[0]
    if mixer == "mamba2":
        return fn(t["x"], t["dt"], p["A"], t["B"], t["C"], chunk_size=4, D=p["D"], z=None, dt_bias=p["dt_bias"],
                  dt_softplus=True, dt_limit=(0.0, float("inf")))
    return fn(t["x"], t["dt"], p["A"], t["B"], t["C"], D=p["D"], z=t["z"], delta_bias=p["bias"], delta_softplus=True)


def _oracle(mixer: str, t: dict, p: dict, starts):
    if mixer == "conv":
        return conv_oracle(t["x"], p["w"], p["b"], starts)
    if mixer in ("delta", "kda"):
        return delta_oracle(t["q"], t["k"], t["v"], t["g"], t["beta"], starts)
    if mixer == "mamba2":
        return mamba2_oracle(t["x"], t["dt"], p["A"], t["B"], t["C"], p["D"], p["dt_bias"], starts)
    return mamba_oracle(t["x"], t["dt"], p["A"], t["B"], t["C"], p["D"], t["z"], p["bias"], starts)


def _want(mixer: str, docs=DOCS):
    """Oracle output and gradients (inputs and parameters) of sum(y * R)."""
    L = sum(docs[0])
    tokens, params = _case(mixer, len(docs), L)
    t = {k: v.clone().requires_grad_() for k, (v, _) in tokens.items()}
    p = {k: v.clone().requires_grad_() for k, v in params.items()}
    y = _oracle(mixer, t, p, _starts(docs))
    (y * _R(tokens)).sum().backward()
    return y.detach(), {k: v.grad for k, v in {**t, **p}.items()}


def _out_name(tokens: dict) -> str:
    return "x" if "x" in tokens else "v"  # the output has the shape of this input


def _R(tokens: dict) -> torch.Tensor:
    shape = tokens[_out_name(tokens)][0].shape
    return torch.randn(shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)


class _Mixer(nn.Module):
    """Stands for a transformers mixer module an adapter marked: its calls go across ranks."""

    def __init__(self):
        super().__init__()
        mark_mixer(self)

    def forward(self, fn):
        return fn()


def random_layout(L: int, P: int, seed: int) -> cp_attention.Layout:
    """Random runs of [0, L) dealt to P ranks (every rank at least one)."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, L), 3 * P - 1))
    runs = list(zip([0] + cuts, cuts + [L]))
    owners = list(range(P)) + [rng.randrange(P) for _ in range(len(runs) - P)]
    rng.shuffle(owners)
    return cp_attention.Layout(L, tuple(tuple(r for r, o in zip(runs, owners) if o == rank) for rank in range(P)))


def _run(mixer: str, layout, docs=DOCS):
    """On this rank (inside a process group, or alone): the gathered output and gradients."""
    import torch.distributed as dist

    L = sum(docs[0])
    tokens, params = _case(mixer, len(docs), L)
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in docs])
    with cp_attention.context_parallel(layout=layout) as cp:
        batch = cp.shard_batch(input_ids=torch.zeros_like(pos), position_ids=pos)
        t = {k: cp.shard(v, dim=d).clone().requires_grad_() for k, (v, d) in tokens.items()}
        p = {k: v.clone().requires_grad_() for k, v in params.items()}
        fn = _function(mixer)
        y = _Mixer()(lambda: _call(mixer, fn, t, p))
        mixers = cp_attention.forward_mixer_stats()
        dim = tokens[_out_name(tokens)][1]
        (y * cp.shard(_R(tokens), dim=dim)).sum().backward()
        out = cp.gather(y.detach(), dim=dim)
        grads = {k: cp.gather(v.grad, dim=tokens[k][1]) for k, v in t.items()}
        for k, v in p.items():
            g = v.grad.clone()
            if cp.world_size > 1:
                dist.all_reduce(g)
            grads[k] = g
        del batch
    return out, grads, mixers


MIXERS = ("conv", "delta", "kda", "mamba2", "mamba")
for _mixer in MIXERS:  # the modeling modules load (and are adapted) before any block, as with a model
    _function(_mixer)


def _layouts(P: int, L: int):
    return [("zigzag", "zigzag"), ("contiguous", "contiguous")] + [
        (f"random{s}", random_layout(L, P, s)) for s in (1, 2)]


def _worker(rank: int, world_size: int, wants: dict) -> list[str]:
    torch.set_num_threads(1)
    errors = []
    for mixer in MIXERS:
        y_want, g_want = wants[mixer]
        for name, layout in _layouts(world_size, sum(DOCS[0])):
            y, grads, stats = _run(mixer, layout)
            err = float((y - y_want).abs().max())
            if not err <= TOL * max(1.0, float(y_want.abs().max())):
                errors.append(f"rank {rank} {mixer} {name}: output off by {err:.2e}")
            for k, g in grads.items():
                e = float((g - g_want[k]).abs().max())
                if not e <= TOL * max(1.0, float(g_want[k].abs().max())):
                    errors.append(f"rank {rank} {mixer} {name}: d{k} off by {e:.2e}")
            if not stats:
                errors.append(f"rank {rank} {mixer} {name}: no mixer stats reported")
    return errors


@pytest.fixture(scope="module")
def wants():
    return {m: _want(m) for m in MIXERS}


@pytest.mark.parametrize("world_size", [1, 3])
def test_mixers_match_sequential_oracle(world_size, wants):
    """Every mixer at world sizes 1 (documents within one rank) and 3 (odd: uneven shards), in
    zigzag, contiguous and two random layouts, forward and backward."""
    if world_size == 1:
        for mixer in MIXERS:
            y, grads, _ = _run(mixer, "contiguous")
            y_want, g_want = wants[mixer]
            assert float((y - y_want).abs().max()) <= TOL * max(1.0, float(y_want.abs().max())), mixer
            for k, g in grads.items():
                assert float((g - g_want[k]).abs().max()) <= TOL * max(1.0, float(g_want[k].abs().max())), (mixer, k)
        return
    per_rank = run_ranks(world_size, _worker, wants, timeout=600)
    errors = [e for r in per_rank for e in r]
    assert not errors, "\n".join(errors[:30])


# ----------------------------------------------------------------------------------------------
# the plans, by hand


def test_halo_plan_moves_only_what_the_documents_need():
    """L = 12 over 3 contiguous ranks of 4, kernel 3: rank 1 needs tokens 2, 3 (from rank 0) unless a
    document starts at 4 (then nothing), or at 3 (then only token 3)."""
    index = [torch.arange(0, 4), torch.arange(4, 8), torch.arange(8, 12)]
    for docs, want in (((12,), [2, 2]), ((4, 8), [0, 2]), ((3, 9), [1, 2]), ((11, 1), [2, 2])):
        starts = _starts((docs,))
        recv = [sum(halo_plan(make_geometry(1, 12, starts, index, r), 3).recv) for r in (1, 2)]
        assert recv == want, (docs, recv)
    # the row that is one token long documents at the boundary: rank 2's first token opens one
    plan = halo_plan(make_geometry(1, 12, _starts(((8, 1, 3),)), index, 2), 3)
    assert sum(plan.recv) == 0


def test_scan_plan_chains_back_to_the_latest_document_start():
    """Zigzag over 2 ranks of L = 16: rank 0 holds [0, 4) and [12, 16), rank 1 [4, 12). One document:
    rank 1's piece continues rank 0's first; rank 0's second continues rank 1's. A document starting
    at 8 cuts the chain: rank 0's second piece needs rank 1's state only (no transition)."""
    index = [torch.cat([torch.arange(0, 4), torch.arange(12, 16)]), torch.arange(4, 12)]
    one = scan_plan(make_geometry(1, 16, _starts(((16,),)), index, 0))
    assert one.recv == (0, 1) and [s.tolist() for s in one.send] == [[], [0]]
    assert one.chains == {1: (("recv", 0, True), ("own", 0, False))}
    cut = scan_plan(make_geometry(1, 16, _starts(((8, 8),)), index, 0))
    assert cut.chains == {1: (("recv", 0, False),)} and cut.recv == (0, 1)
    assert [s.tolist() for s in cut.send] == [[], [0]]  # rank 1 still needs rank 0's first piece


def test_geometry_of_a_sharded_batch():
    with cp_attention.context_parallel() as cp:
        batch = cp.shard_batch(input_ids=torch.zeros(2, 29, dtype=torch.long),
                               position_ids=torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCS]))
        from cp_attention.engine.batch import batch_of

        geo = geometry_of(batch_of(batch["position_ids"]))
        assert torch.equal(geo.doc_start, _starts(DOCS)) and geo.local_len == 29


def _disagree_worker(rank: int, world_size: int) -> str:
    docs = DOCS if rank == 0 else ((29,), (29,))  # rank 1 was given other documents
    try:
        _run("conv", "zigzag", docs)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_ranks_with_different_batches_raise_together_before_an_exchange():
    for message in run_ranks(2, _disagree_worker, timeout=120):
        assert "disagree on a sequence mixer" in message and "cp.shard_batch" in message, message
