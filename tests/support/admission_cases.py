"""Stand-ins for transformers' mixer functions, written from their definitions (float64 loops), each with a knob
that plants one change of convention or behaviour; and the rank worker of a family whose function was declined
(tests/integrations/test_admission.py)."""

from __future__ import annotations

import importlib
import math

import torch
import torch.nn.functional as F

import cp_attention
from cp_attention.integrations.hf.registry import adapt_modeling_module
from cp_attention.integrations.hf import state



def conv_fn(plant=None):
    """``causal_conv1d_fn(x (B, C, L), weight (C, k), bias, activation)``."""
    def f(x, weight, bias=None, activation=None, **kwargs):
        if plant == "swapped":  # (weight, x): another convention
            x, weight = weight, x
        k = weight.shape[-1]
        pad = (k - 1, 0) if plant != "centred" else ((k - 1) // 2, k - 1 - (k - 1) // 2)
        xp = F.pad(x.double(), pad)
        y = sum(weight.double()[:, j, None] * xp[..., j:j + x.shape[-1]] for j in range(k))
        if bias is not None:
            y = y + bias.double()[None, :, None]
        if activation == "silu" and plant != "no_activation":
            y = y * torch.sigmoid(y)
        y = y.to(x.dtype)
        return (y, None) if plant == "tuple" else y
    return f


def delta_rule(plant=None, per_channel=False):
    """``torch_chunk_gated_delta_rule(query, key, value, g, beta, initial_state=, output_final_state=)``: ``S_t =
    e^{g_t} (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T``, output ``S_t^T q_t / sqrt(Dk)``."""
    def f(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False, **kwargs):
        B, L, H, Dk = key.shape
        Dv = value.shape[-1]
        S = torch.zeros(B, H, Dk, Dv, dtype=torch.float64) if initial_state is None or plant == "ignores_state" \
            else initial_state.double().clone()
        out = torch.zeros(B, L, H, Dv, dtype=torch.float64)
        for t in range(L):
            q, k, v, b = query[:, t].double(), key[:, t].double(), value[:, t].double(), beta[:, t].double()
            decay = g[:, t].double().exp()
            decay = decay[..., :, None] if per_channel else decay[..., None, None]  # (B, H, Dk|1, 1)
            S = decay * S
            kS = torch.einsum("bhk,bhkv->bhv", k, S)
            S = S + torch.einsum("bhk,bhv->bhkv", k, b[..., None] * (v - kS))
            out[:, t] = torch.einsum("bhk,bhkv->bhv", q / math.sqrt(Dk), S)
        if plant == "shifted_output":  # outputs one token late: not causal at a piece's first token
            out = torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], dim=1)
        return out.to(value.dtype), (S.float() if output_final_state else None)
    return f


def mamba2_scan(plant=None):
    """``mamba2_chunk_scan(x (B, L, H, P), dt (B, L, H), A (H), B/C (B, L, G, N), chunk_size, D, dt_bias,
    initial_states, dt_softplus, ..., return_final_states, z)``: ``h_t = e^{dt_t A} h_{t-1} + dt_t x_t B_t^T``,
    output ``h_t C_t + D x_t``."""
    def f(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None, dt_softplus=False,
          dt_limit=(0.0, float("inf")), return_final_states=False, z=None, **kwargs):
        N_, L, H, P = hidden_states.shape
        d = dt.double() + (dt_bias.double() if dt_bias is not None else 0)
        d = F.softplus(d) if dt_softplus else d
        h = torch.zeros(N_, H, P, B.shape[-1], dtype=torch.float64) if initial_states is None or \
            plant == "ignores_state" else initial_states.double().clone()
        out = torch.zeros(N_, L, H, P, dtype=torch.float64)
        for t in range(L):
            Bt = B[:, t].double().repeat_interleave(H // B.shape[2], dim=1)  # (N, H, N_state)
            Ct = C[:, t].double().repeat_interleave(H // C.shape[2], dim=1)
            x = hidden_states[:, t].double()
            decay = torch.exp(d[:, t] * A.double())[..., None, None]
            h = decay * h + (d[:, t, :, None] * x)[..., None] * Bt[:, :, None, :]
            out[:, t] = torch.einsum("nhpk,nhk->nhp", h, Ct) + (D.double()[:, None] * x if D is not None else 0)
        out = out.to(hidden_states.dtype)
        return (out, h.float()) if return_final_states else out
    return f


def selective_scan(plant=None):
    """``mamba_selective_scan(x (B, D, L), dt, A (D, N), B/C (B, N, L), D, z, delta_bias, delta_softplus,
    return_last_state)``: ``h_t = e^{dt_t A} h_{t-1} + dt_t B_t x_t``, output ``(h_t C_t + D x_t) silu(z_t)``."""
    def f(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
          return_last_state=False, **kwargs):
        d = dt.double() + (delta_bias.double()[:, None] if delta_bias is not None else 0)
        if delta_softplus and plant != "no_softplus":
            d = F.softplus(d)
        Bn, Dm, L = hidden_states.shape
        h = torch.zeros(Bn, Dm, A.shape[1], dtype=torch.float64)
        ys = []
        for t in range(L):
            h = torch.exp(d[:, :, t, None] * A.double()) * h + \
                (d[:, :, t] * hidden_states[:, :, t].double())[..., None] * B[:, None, :, t].double()
            y = (h * C[:, None, :, t].double()).sum(-1)
            ys.append(y)
        y = torch.stack(ys, dim=-1)
        if D is not None:
            y = y + D.double()[:, None] * hidden_states.double()
        if z is not None:
            y = y * F.silu(z.double())
        y = y.to(hidden_states.dtype)
        return (y, h) if return_last_state else y
    return f



def planted_family(family: str, name: str, plant) -> object:
    """Re-adapt ``family``'s modeling module with ``name`` replaced by a planted stand-in; returns it."""
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    setattr(mod, name, plant)
    adapt_modeling_module(mod)
    assert getattr(mod, name) is plant  # declined: nothing wraps it, eager calls it as it is
    return mod


def declined_family_worker(rank, world_size, family, name):
    import transformers

    from cp_attention.tools.sweeps import configs

    planted_family(family, name, delta_rule("ignores_state"))
    assert (f"transformers.models.{family}.modeling_{family}", name) in state.INTEGRATIONS["declined"]
    cfg = configs.tiny_config(family)
    model = configs.build_model(cfg, "cp_flash")
    ids = torch.randint(*configs.ID_RANGE, (1, 16), generator=torch.Generator().manual_seed(0))
    with cp_attention.context_parallel() as cp:
        batch = cp.shard_batch(input_ids=ids, position_ids=torch.arange(16)[None])
        try:
            model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
        except NotImplementedError as exc:
            return str(exc), transformers.__version__
    return None, transformers.__version__
