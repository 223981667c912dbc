"""The one input check of attention calls (:func:`check_inputs`): every error names the argument, what
was expected and what was given, and is raised before anything is computed (on several ranks, by
every rank together: :mod:`cp_attention.engine.attend` gathers the local errors first).

Legend: ``B`` batch, ``L`` this rank's tokens, ``H`` query heads, ``K`` K/V heads, ``D`` head dim of
q/k, ``Dv`` of v, ``N`` documents.
"""

from __future__ import annotations

import torch

from ..backends import BACKENDS
from .agreement import DTYPES

__all__ = ["check_inputs"]


def check_inputs(q, k, v, *, position_ids=None, cu_seqlens=None, sinks=None, backend: str = "auto",
                 same_length: bool = True, key_select=None, selection: bool = False) -> None:
    """The one check of an attention call's inputs (the bare :func:`~cp_attention.attention`, the engine's
    calls and the single-device op): q (B, L, H, D), k (B, L, K, D), v (B, L, K, Dv) of one dtype and
    device, ``H`` a multiple of ``K``, position_ids (B, L) integer, cu_seqlens (N+1,) int32/int64 of one
    packed row, sinks (H,) float, a known backend, ``key_select`` (B, L, S) integer when the mask's
    ``selection`` is set and None otherwise. ``same_length``: q and k hold the same tokens (a
    shard of the sequence); False for the single-device op, whose keys may differ from its queries (a
    KV cache). Raises TypeError or ValueError naming the argument and the shape expected."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape (B, L_local, heads, head_dim), "
                            f"got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape (B, L_local, heads, head_dim), got {tuple(t.shape)}")
        if t.dtype not in DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; supported: float16, bfloat16, float32, float64")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must have the same shape but for the head_dim (v's may differ, as in multi-head "
                         f"latent attention): they must agree on (B, L_local, K/V heads), got k {tuple(k.shape)} "
                         f"and v {tuple(v.shape)}")
    if q.shape[:2] != k.shape[:2] and (same_length or q.shape[0] != k.shape[0]):
        raise ValueError(f"q and k must agree on (B, L_local), got {tuple(q.shape[:2])} and "
                         f"{tuple(k.shape[:2])}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must have the same head_dim, got {q.shape[3]} and {k.shape[3]}")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of key/value heads "
                         f"({k.shape[2]}) for GQA/MQA")
    B, L = q.shape[:2]
    if L == 0 and same_length:
        raise ValueError("q has no tokens on this rank: the sequence length must be >= the world size")
    if position_ids is not None and cu_seqlens is not None:
        raise ValueError("pass either position_ids or cu_seqlens to describe documents, not both")
    if position_ids is not None:
        if not isinstance(position_ids, torch.Tensor) or position_ids.dtype.is_floating_point or \
                position_ids.dtype == torch.bool:
            raise TypeError("position_ids must be an integer tensor of shape (B, L_local)")
        if tuple(position_ids.shape) != (B, L):
            raise ValueError(f"position_ids must have shape (B, L_local) = {(B, L)}, got "
                             f"{tuple(position_ids.shape)}")
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError("cu_seqlens must be an int32 (or int64) tensor of shape (N+1,)")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must have shape (N+1,) with N >= 1, got {tuple(cu_seqlens.shape)}")
        if B != 1:
            raise ValueError(f"cu_seqlens describes one packed row, but B = {B}; use position_ids "
                             f"(B, L_local) for batches with several rows")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or not sinks.dtype.is_floating_point:
            raise TypeError("sinks must be a float tensor of shape (heads,)")
        if tuple(sinks.shape) != (q.shape[2],):
            raise ValueError(f"sinks must have shape (heads,) = ({q.shape[2]},), got {tuple(sinks.shape)}")
    if selection and key_select is None:
        raise ValueError("the mask selects keys (MaskSpec(selection=True)) but no key_select was given: pass each "
                         "query's selected global key indices as key_select (B, L_local, k)")
    if key_select is not None:
        if not selection:
            raise ValueError("key_select was given but the mask selects no keys: use MaskSpec(selection=True)")
        if not isinstance(key_select, torch.Tensor) or key_select.dtype.is_floating_point or \
                key_select.dtype == torch.bool or key_select.is_complex():
            raise TypeError("key_select must be an integer tensor of shape (B, L_local, k): global key indices, "
                            "-1 for an empty slot")
        if key_select.dim() != 3 or tuple(key_select.shape[:2]) != (B, L):
            raise ValueError(f"key_select must have shape (B, L_local, k) = ({B}, {L}, k), got "
                             f"{tuple(key_select.shape)}")
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {sorted(BACKENDS)}, got {backend!r}")
