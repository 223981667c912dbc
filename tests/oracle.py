"""The dense float64 oracle: attention over the unsharded sequence with an explicit (L x L) mask."""

from __future__ import annotations

import torch

from cp_attention.masks import MaskSpec, SequenceMeta, dense_mask


def dense_attention(q, k, v, meta: SequenceMeta, spec: MaskSpec, sinks=None):
    """q (B, L, H, D), k/v (B, L, K, D) global tensors -> out (B, L, H, D), in q's dtype.

    Differentiable through plain autograd; a query that sees nothing (and has no sink) returns 0.
    """
    B, L, H, D = q.shape
    G = H // k.shape[2]
    k_rep, v_rep = k.repeat_interleave(G, dim=2), v.repeat_interleave(G, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k_rep) * spec.resolved_scale(D)
    if spec.softcap is not None:
        scores = spec.softcap * torch.tanh(scores / spec.softcap)
    mask = dense_mask(meta, spec).to(q.device)[:, None]
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink_col = sinks.to(scores.dtype).view(1, H, 1, 1).expand(B, H, L, 1)
        scores = torch.cat([scores, sink_col], dim=-1)
    m = scores.amax(-1, keepdim=True)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m).detach()
    p = torch.exp(scores - m)
    denom = p.sum(-1, keepdim=True)
    p = p / torch.where(denom > 0, denom, torch.ones_like(denom))
    if sinks is not None:
        p = p[..., :L]
    return torch.einsum("bhqk,bkhd->bqhd", p, v_rep)
