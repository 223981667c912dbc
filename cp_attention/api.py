"""The public entry point :func:`attention` (the context object is in :mod:`cp_attention.engine.context`,
the engine behind both in :mod:`cp_attention.engine`).

Legend: ``B`` batch, ``L`` local (this rank's) length, ``H`` query heads, ``K`` K/V heads,
``D`` head dim of q and k, ``Dv`` head dim of v and the output (may differ from ``D``: multi-head
latent attention), ``N`` documents.
"""

from __future__ import annotations

import dataclasses

import torch

from .engine.attend import attend
from .masks import MaskSpec

__all__ = ["attention"]


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    position_ids: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
    causal: bool = True, window: int | None = None, chunk_size: int | None = None,
    softcap: float | None = None, sinks: torch.Tensor | None = None, scale: float | None = None,
    group=None, layout=None, backend: str | None = None, mask: MaskSpec | None = None,
    strategy: str | None = None, ulysses_size: int | None = None, key_select: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over a sequence sharded across a process group, honouring every mask.

    Args:
        q: (B, L_local, H, D) this rank's queries, in layout order (see ``ContextParallel.shard``).
        k, v: (B, L_local, K, D) this rank's keys and (B, L_local, K, Dv) values; ``H`` must be a
            multiple of ``K`` (GQA/MQA); only the ``K`` un-repeated heads travel between ranks.
            v's head dim ``Dv`` may differ from q's and k's ``D`` (multi-head latent attention:
            DeepSeek-V2/V3, MiniCPM3, ...); k and v agree on everything else.
        position_ids: (B, L_local) this rank's shard of the global position ids. A document starts
            wherever the position does not increase by exactly 1 from the previous token (in
            global order); tokens attend only within their document.
        cu_seqlens: (N+1,) int32 global document boundaries, for B == 1, instead of position_ids.
        causal: decoder (True) or encoder (False) attention.
        window: sliding window; with global positions ``q`` and ``k``, the key is visible when
            ``0 <= q - k < window`` (causal) or ``|q - k| < window``. None: unlimited. For
            ``window=3``, causal::

                1 0 0 0 0
                1 1 0 0 0
                1 1 1 0 0
                0 1 1 1 0
                0 0 1 1 1

        chunk_size: query and key must lie in the same chunk of their document (Llama 4): the same
            ``position // chunk_size``, positions from ``position_ids`` (with ``cu_seqlens``,
            counted from 0 at each document's first token).
        softcap: ``softcap * tanh(scores / softcap)`` on the scaled scores (Gemma 2).
        sinks: (H,) one extra value-less logit per head (gpt-oss). Its gradient, like every
            replicated parameter's, comes from this rank's loss: reduce it over the group with the
            rest (the mean, when each rank's loss is P times its share as ``shard_batch`` makes it).
        scale: score multiplier; None means ``D ** -0.5`` (q's and k's head dim, never ``Dv``).
        group: the process group; None means the active :func:`context_parallel` group, or a
            single device when none is active.
        layout: "zigzag", "contiguous" or a :class:`~cp_attention.layout.Layout`; None means the active
            context's layout (else zigzag).
        backend: "auto" or a name in ``cp_attention.backends.BACKENDS``; None: the active
            context's backend (``context_parallel(backend=...)``), else "auto".
        mask: a :class:`~cp_attention.MaskSpec` instead of the keywords ``causal``, ``window``,
            ``chunk_size``, ``softcap`` and ``scale`` (which must then keep their defaults).
        strategy: how a multi-rank call runs: "ring", "ulysses" (all-to-all head parallelism;
            ``H`` must be a multiple of the world size), "usp" (all-to-all within head groups of
            ``ulysses_size`` ranks, the ring across them) or "auto" (the cheapest by the context's
            cost model); None: the active context's (``context_parallel(strategy=...)``, with its
            ``ulysses_size``), else "ring". Every strategy computes the same attention; they differ
            in traffic and balance (:mod:`cp_attention.strategies.choice`).
        ulysses_size: strategy "usp"'s head-group size (must divide the world size and ``H``).
        key_select: (B, L_local, k) integer, index-sparse attention (DeepSeek Sparse Attention): the
            keys each query selected, as *global* indices into its unsharded row (``-1``: an empty
            slot). A query then sees a key only when the mask lets it and the key is selected; a
            repeat counts once. Only the selected keys other ranks hold move
            (:mod:`cp_attention.strategies.select`; ``strategy`` does not apply).

    Returns:
        (B, L_local, H, Dv) in q's dtype (accumulation in float32), differentiable w.r.t. q, k, v
        and sinks. A query that sees no key returns zeros.

    Raises:
        TypeError / ValueError naming the argument, on every rank, before any K/V moves (ranks
        compare their arguments, shapes, layout and documents before every call).
        RankFailedError when another rank of the group failed (it is named) or did not answer
        within the context's ``timeout``.
    """
    keywords = dict(causal=causal, window=window, chunk_size=chunk_size, softcap=softcap, scale=scale)
    selection = key_select is not None
    local_error = None
    if mask is not None:
        if not isinstance(mask, MaskSpec):
            local_error = TypeError(f"mask must be a cp_attention.MaskSpec, got {type(mask).__name__}")
        elif keywords != dict(causal=True, window=None, chunk_size=None, softcap=None, scale=None):
            local_error = ValueError("pass the mask either as mask=MaskSpec(...) or as the keywords causal, window, "
                                     "chunk_size, softcap and scale, not both")
    if mask is not None and local_error is None and selection and not mask.selection:
        mask = dataclasses.replace(mask, selection=True)
    return attend(q, k, v, mask if mask is not None and local_error is None else dict(keywords, selection=selection),
                  position_ids=position_ids, cu_seqlens=cu_seqlens, sinks=sinks, group=group, layout=layout,
                  backend=backend, local_error=local_error, strategy=strategy, ulysses_size=ulysses_size,
                  key_select=key_select)
