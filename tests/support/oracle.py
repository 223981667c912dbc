"""The independent dense float64 oracle: attention over the unsharded sequence with an explicit
(L x L) mask, written from the documented semantics alone (README "Use").

This file imports nothing from ``cp_attention``: an off-by-one in the library's mask model, layout
or traffic accounting cannot leak into the expected values. A case is described by plain inputs:

* documents: ``position_ids`` (B, L) and/or global ``cu_seqlens`` (N+1,) (one row); a document
  starts at token 0, wherever ``position_ids`` does not increase by exactly 1 from the previous
  token, and at every ``cu_seqlens`` boundary;
* positions (for chunks): the ``position_ids``; without them, counted from 0 at each document's
  first token;
* flags: ``causal``, ``window`` W, ``chunk_size`` C. Key ``k`` is visible from query ``q`` when
  both lie in the same document, have the same ``position // C``, and ``0 <= q - k`` (causal),
  ``0 <= q - k < W`` (causal window) or ``|q - k| < W`` (bidirectional window);
* scores: ``scale`` (default ``D ** -0.5``) times ``q . k``, then ``c * tanh(s / c)`` with softcap
  ``c``; sinks: one value-less logit per head, out = softmax over [scores, sink] applied to the
  values only; GQA by repeating each K/V head ``H // K`` times.

Layouts (for expected shards and halos), also from their definition: the sequence is cut into
``n`` consecutive slices whose sizes differ by at most one, the first ``L % n`` one token longer;
``contiguous``: ``n = P``, rank r holds slice r; ``zigzag``: ``n = 2P``, rank r holds slices r
and ``2P-1-r``, in increasing global order.

Legend: ``B`` batch rows, ``L`` global length, ``H``/``K`` query/KV heads, ``D`` head dim.
"""

from __future__ import annotations

import torch

__all__ = ["document_ids", "chunk_positions", "oracle_mask", "oracle_attention", "rank_tokens",
           "halo_keys", "needed_halo_tokens", "dense_attention"]


def _opens(B: int, L: int, position_ids=None, cu_seqlens=None) -> torch.Tensor:
    """(B, L) bool: True where a token opens a document."""
    opens = torch.zeros(B, L, dtype=torch.bool)
    opens[:, 0] = True
    if position_ids is not None:
        pos = torch.as_tensor(position_ids, dtype=torch.int64).reshape(-1, L).expand(B, L)
        opens[:, 1:] |= pos[:, 1:] != pos[:, :-1] + 1
    if cu_seqlens is not None:
        for boundary in torch.as_tensor(cu_seqlens).tolist():
            if 0 <= boundary < L:
                opens[:, boundary] = True
    return opens


def document_ids(B: int, L: int, *, position_ids=None, cu_seqlens=None) -> torch.Tensor:
    """(B, L) int64: the number of the document each token lies in, counted from 0 in each row."""
    return torch.cumsum(_opens(B, L, position_ids, cu_seqlens).long(), dim=1) - 1


def chunk_positions(B: int, L: int, *, position_ids=None, cu_seqlens=None) -> torch.Tensor:
    """(B, L) int64: the position that places chunk boundaries: ``position_ids`` when given, else the
    offset of each token from its document's first token."""
    if position_ids is not None:
        return torch.as_tensor(position_ids, dtype=torch.int64).reshape(-1, L).expand(B, L).clone()
    opens = _opens(B, L, None, cu_seqlens)
    pos = torch.zeros(B, L, dtype=torch.int64)
    for i in range(1, L):
        pos[:, i] = torch.where(opens[:, i], torch.zeros_like(pos[:, i]), pos[:, i - 1] + 1)
    return pos


def _mask_from(doc_BL: torch.Tensor, pos_BL: torch.Tensor, *, causal: bool, window, chunk_size) -> torch.Tensor:
    L = doc_BL.shape[1]
    qi = torch.arange(L).view(L, 1)
    ki = torch.arange(L).view(1, L)
    dist_LL = qi - ki  # q - k
    visible = doc_BL[:, :, None] == doc_BL[:, None, :]
    if chunk_size is not None:
        chunk_BL = torch.div(pos_BL, chunk_size, rounding_mode="floor")
        visible = visible & (chunk_BL[:, :, None] == chunk_BL[:, None, :])
    if causal:
        band = dist_LL >= 0
        if window is not None:
            band = band & (dist_LL < window)
    else:
        band = torch.ones(L, L, dtype=torch.bool)
        if window is not None:
            band = dist_LL.abs() < window
    return visible & band[None]


def oracle_mask(B: int, L: int, *, position_ids=None, cu_seqlens=None, causal: bool = True, window=None,
                chunk_size=None) -> torch.Tensor:
    """(B, L, L) bool, ``[b, q, k]`` True where query q sees key k (module docstring)."""
    doc = document_ids(B, L, position_ids=position_ids, cu_seqlens=cu_seqlens)
    pos = chunk_positions(B, L, position_ids=position_ids, cu_seqlens=cu_seqlens)
    return _mask_from(doc, pos, causal=causal, window=window, chunk_size=chunk_size)


def oracle_attention(q, k, v, mask, *, scale=None, softcap=None, sinks=None):
    """Dense attention in q's dtype: q (B, L, H, D), k/v (B, L, K, D), mask (B, L, L) bool, sinks (H,)
    -> (B, L, H, D). Differentiable through plain autograd; a row that sees no key and has no sink
    gives zeros."""
    B, L, H, D = q.shape
    G = H // k.shape[2]
    k, v = k.repeat_interleave(G, dim=2), v.repeat_interleave(G, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * (D ** -0.5 if scale is None else scale)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask.to(q.device)[:, None], float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.to(s.dtype).view(1, H, 1, 1).expand(B, H, s.shape[2], 1)], dim=-1)
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    denom = p.sum(-1, keepdim=True)
    p = p / torch.where(denom > 0, denom, torch.ones_like(denom))
    if sinks is not None:
        p = p[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def rank_tokens(L: int, world_size: int, layout: str, rank: int) -> list[int]:
    """Global indices of ``rank``'s tokens, increasing (module docstring)."""
    n = {"contiguous": world_size, "zigzag": 2 * world_size}[layout]
    sizes = [L // n + (1 if i < L % n else 0) for i in range(n)]
    starts = [sum(sizes[:i]) for i in range(n)]
    mine = [rank] if layout == "contiguous" else [rank, 2 * world_size - 1 - rank]
    return [t for s in mine for t in range(starts[s], starts[s] + sizes[s])]


def halo_keys(mask, world_size: int, layout: str, rank: int) -> torch.Tensor:
    """(B, L) bool: the keys of other ranks that some query of ``rank`` sees, per batch row, from a
    (B, L, L) oracle mask."""
    own = torch.tensor(rank_tokens(mask.shape[-1], world_size, layout, rank), dtype=torch.int64)
    seen = mask[:, own, :].any(dim=1)
    seen[:, own] = False
    return seen


def needed_halo_tokens(mask, world_size: int, layout: str) -> list[int]:
    """Per rank: how many other ranks' tokens its queries see, counted per batch row and summed over
    rows (the least K/V a rank must receive), from a (B, L, L) oracle mask."""
    return [int(halo_keys(mask, world_size, layout, r).sum()) for r in range(world_size)]


def dense_attention(q, k, v, meta, spec, sinks=None):
    """Legacy entry for callers that still describe a case with the library's ``SequenceMeta`` and
    ``MaskSpec`` objects (not imported here): only their plain fields are read (``batch``,
    ``seq_len``, ``doc_start`` (B, L) index of each token's document start or None, ``position``
    or None; ``causal``, ``window``, ``chunk_size``, ``softcap``, ``scale``) and the mask is built
    by this module. New tests: :func:`oracle_mask` + :func:`oracle_attention` with plain inputs."""
    B, L = meta.batch, meta.seq_len
    idx = torch.arange(L)
    opens = torch.zeros(B, L, dtype=torch.bool)
    opens[:, 0] = True
    if meta.doc_start is not None:
        opens |= torch.as_tensor(meta.doc_start).reshape(-1, L).expand(B, L) == idx
    doc = torch.cumsum(opens.long(), dim=1) - 1
    if meta.position is not None:
        pos = torch.as_tensor(meta.position, dtype=torch.int64).reshape(-1, L).expand(B, L)
    else:
        first = torch.cummax(torch.where(opens, idx, torch.zeros_like(idx)), dim=1).values
        pos = idx - first
    mask = _mask_from(doc, pos, causal=spec.causal, window=spec.window, chunk_size=spec.chunk_size)
    return oracle_attention(q, k, v, mask, scale=spec.scale, softcap=spec.softcap, sinks=sinks)
