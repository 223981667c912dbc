"""DeepSeek-V4's compressed attention under ``cp_flash``, exact on one device and across ranks.

A compressed layer (CSA, HCA) attends over its sliding window of tokens and over compressed entries
its compressor builds from windows of ``m`` tokens (HCA: all entries that closed before the query; CSA:
overlapping windows, and its own indexer keeps the top ``k`` entries per query), in one softmax with the
layer's sink. The family code anchors the windows at the row's first slot; "each document alone"
anchors them at each document's first token.

Here the compressor runs the family's code once per document, on the whole row's hidden states
(all-gathered, differentiable), so every rank holds every entry of its rows; for this rank's queries it
records the keys they may read: their window's tokens and their visible entries (index ``T + e``). The
layer's ``cp_flash`` call then splits its keys into the token shard and the entries and hands both to
the engine's selected-keys attention (``extra_kv``).

Legend: ``B`` batch, ``S`` this rank's tokens, ``T`` the row's tokens, ``E`` entries per row.
"""

from __future__ import annotations

import contextvars
import functools
import inspect

import torch

from ....engine.batch import resolve
from ....engine.context import active_context
from ....engine.local import local_meta
from ....layout import global_index, local_lengths, unshard
from .. import source
from .. import state
from ..class_admission import first_use
from ...patches import patch
from ..selection import CanonicalTopk
from .base import Adapter

__all__ = ["ADAPTER", "COMPRESSOR_SIGNATURE", "adapt_module", "adapted_compressor", "take_selection"]

COMPRESSOR_SIGNATURE = ("hidden_states", "q_residual", "position_ids", "cache", "layer_idx")
_ADAPTED = "_cp_attention_indexer"
_CURRENT: contextvars.ContextVar = contextvars.ContextVar("cp_attention_compressed_layer", default=None)
"""(cp_flash mask, attention module) of the compressed layer whose forward is running (its compressor reads it)."""


class _GatherRows(torch.autograd.Function):
    """Every rank's (B, S, ...) rows in the row's order (B, T, ...); backward: the sum over ranks of
    the gradient of this rank's rows."""

    @staticmethod
    def forward(ctx, x_BS, batch):
        cp = batch.cp
        sizes = local_lengths(batch.seq_len, cp.world_size, batch.layout)
        padded = x_BS.new_zeros((x_BS.shape[0], max(sizes)) + tuple(x_BS.shape[2:]))
        padded[:, :x_BS.shape[1]] = x_BS
        parts = cp.comm.all_gather(padded.contiguous(), "the compressed layer's rows")
        ctx.batch = batch
        return unshard([p[:, :n] for p, n in zip(parts, sizes)], 1, batch.layout)

    @staticmethod
    def backward(ctx, grad_BT):
        batch = ctx.batch
        cp = batch.cp
        total = cp.comm.all_reduce(grad_BT.contiguous(), "the compressed layer's rows (backward)")
        mine = global_index(batch.seq_len, cp.world_size, batch.layout, cp.rank).to(grad_BT.device)
        return total[:, mine], None


def _documents(meta, b: int) -> list[tuple[int, int]]:
    T = meta.seq_len
    starts = [0] if meta.starts is None else [int(x) for x in meta.starts[b]]
    return list(zip(starts, starts[1:] + [T]))


def _compressed(original, module, hidden, q_res, layer_idx, mask, attention):
    B, S = hidden.shape[:2]
    batch, error = resolve(None, active_context(), mask_batch=mask.batch)
    if error is not None:
        raise error
    whole = batch is not None and batch.cp.world_size > 1
    if whole:
        meta = batch.meta
        q_index = global_index(batch.seq_len, batch.cp.world_size, batch.layout, batch.cp.rank)
        hidden, q_res = _GatherRows.apply(hidden, batch), _GatherRows.apply(q_res, batch)
    else:
        meta = batch.meta if batch is not None and batch.seq_len == S else \
            local_meta(B, S, S, valid=mask.valid, opens=mask.opens)[0]
        q_index = torch.arange(S)
    T = meta.seq_len
    entries, visible = [], []
    with CanonicalTopk():
        for b in range(B):
            row, vis = [], torch.zeros(S, 0, dtype=torch.bool)
            for s, e in _documents(meta, b):
                ckv, bias = original(module, hidden[b:b + 1, s:e], q_res[b:b + 1, s:e],
                                     torch.arange(e - s, device=hidden.device)[None], None, layer_idx)
                n = ckv.shape[2]
                mine = (q_index >= s) & (q_index < e)
                part = torch.zeros(S, n, dtype=torch.bool)
                if bias is not None and n:
                    part[mine] = (bias[0, 0, (q_index[mine] - s).to(bias.device)] == 0).cpu()
                row.append(ckv[0, 0])
                vis = torch.cat([vis, part], dim=1)
            entries.append(torch.cat(row) if row else hidden.new_zeros(0, module.head_dim))
            visible.append(vis)
    width = max(x.shape[0] for x in entries)
    ckv_B1ED = torch.stack([torch.nn.functional.pad(x, (0, 0, 0, width - x.shape[0])) for x in entries])[:, None]
    # this rank's queries: their window's tokens (the engine intersects them with the mask), then entries
    W = int(attention.sliding_window)
    window_SW = q_index[:, None] - torch.arange(W)[None]
    select = []
    for b in range(B):
        vis = torch.nn.functional.pad(visible[b], (0, width - visible[b].shape[1]))
        ids = torch.where(vis, T + torch.arange(width)[None], torch.full_like(vis, -1, dtype=torch.int64))
        select.append(torch.cat([window_SW.clamp(min=-1), ids], dim=1))
    state.COMPRESSED_SELECTIONS[attention] = (torch.stack(select).to(hidden.device), width)
    return ckv_B1ED, None


def take_selection(attention):
    """The selection the compressor of ``attention`` recorded for its layer's call (None: none), once."""
    return state.COMPRESSED_SELECTIONS.pop(attention, None)


def _compressor_reason(original, module, bound) -> str | None:
    """None when the compressor returns what :func:`_compressed` reads, on one synthetic document of
    ``3 m + 1`` tokens (``m``: its ``compress_rate``) with no cache: ``(entries (1, 1, n, head_dim), bias)``,
    the bias None or additive (1, 1, tokens, n) (0 where a query sees an entry, very negative elsewhere),
    every query seeing only entries whose window closed at or before it; else why not."""
    g = torch.Generator().manual_seed(0)
    hidden, q_res = bound["hidden_states"], bound["q_residual"]
    rate = max(int(getattr(module, "compress_rate", 4)), 1)
    T = 3 * rate + 1
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            x = torch.randn(1, T, hidden.shape[-1], generator=g).to(hidden)
            q = torch.randn(1, T, q_res.shape[-1], generator=g).to(q_res)
            ckv, bias = original(module, x, q, torch.arange(T, device=hidden.device)[None], None, bound["layer_idx"])
        if ckv.dim() != 4 or tuple(ckv.shape[:2]) != (1, 1) or ckv.shape[3] != module.head_dim:
            return f"its entries have shape {tuple(ckv.shape)}, not (1, 1, entries, {module.head_dim})"
        n = ckv.shape[2]
        if bias is None:
            return None
        if tuple(bias.shape) != (1, 1, T, n) or not bias.is_floating_point() or \
                not bool(((bias == 0) | (bias <= -1e4)).all()):
            return f"its bias ({tuple(bias.shape)}, {bias.dtype}) is not an additive (1, 1, {T}, {n}) mask of its entries"
        sees = bias[0, 0] == 0
        closed = (torch.arange(T, device=sees.device)[:, None] + 1) >= (torch.arange(n, device=sees.device) + 1) * rate
        if bool((sees & ~closed).any()):
            return "its bias shows a query an entry whose window had not closed"
        return None
    except Exception as exc:
        return f"checking it raised {type(exc).__name__}: {str(exc)[:200]}"


def _wrap_compressor(original):
    sig = inspect.signature(original)

    @functools.wraps(original)
    @torch.compiler.disable
    def forward(self, *args, **kwargs):
        current = _CURRENT.get()
        if current is None:
            return original(self, *args, **kwargs)
        bound = sig.bind(self, *args, **kwargs).arguments
        mask, attention = current
        first_use(type(self), "forward", lambda: _compressor_reason(original, self, bound))
        return _compressed(original, self, bound["hidden_states"], bound["q_residual"], bound["layer_idx"], mask,
                           attention)

    setattr(forward, _ADAPTED, True)
    return forward


def _wrap_attention(original):
    sig = inspect.signature(original)

    @functools.wraps(original)
    @torch.compiler.disable
    def forward(self, *args, **kwargs):
        mask = sig.bind(self, *args, **kwargs).arguments.get("attention_mask")
        if getattr(type(mask), "selecting", None) is None or getattr(self, "compressor", None) is None:
            return original(self, *args, **kwargs)
        token = _CURRENT.set((mask, self))
        try:
            return original(self, *args, **kwargs)
        finally:
            _CURRENT.reset(token)

    setattr(forward, _ADAPTED, True)
    return forward


def _params(cls):
    forward = vars(cls).get("forward")
    try:
        return tuple(inspect.signature(forward).parameters)[1:] if forward is not None else None
    except (TypeError, ValueError):
        return None


def adapted_compressor(cls: type) -> bool:
    """Whether ``cls`` is a compressor (or the attention calling it) this module adapted: it computes over the
    documents of the batch, across ranks."""
    return bool(getattr(vars(cls).get("forward"), _ADAPTED, False))


def adapt_module(mod) -> bool:
    """Adapt DeepSeek-V4's compressor classes and the attention that calls them (idempotent)."""
    found = False
    classes = [v for v in list(vars(mod).values()) if isinstance(v, type) and v.__module__ == mod.__name__]
    for cls in classes:
        if getattr(vars(cls).get("forward"), _ADAPTED, False):
            found = True
        elif cls.__name__.endswith("Compressor") and _params(cls) == COMPRESSOR_SIGNATURE and \
                "compress_rate" in source.class_source(cls):
            patch(cls, "forward", _wrap_compressor(cls.forward), site="compressors",
                  admitted="the compressor's signature and structure")
            found = True
        elif cls.__name__.endswith("Attention") and "self.compressor(" in source.class_source(cls):
            patch(cls, "forward", _wrap_attention(cls.forward), site="compressors",
                  admitted="an attention class calling its compressor")
            found = True
    return found


class Compressors(Adapter):
    """DeepSeek-V4's compressors (see the module docstring): their forwards and the attention class calling
    them adapted as each modeling module loads; a layer's call then attends over its window's tokens and the
    compressed entries its compressor recorded for it."""

    name = "compressed"
    sites = ("compressors",)
    adapts = "the forward of DeepSeek-V4's compressor classes and of the attention class calling them"
    admission = ("the compressor's signature and structure; at its first call under context parallelism its output "
                 "on a synthetic document against what the adapter reads")

    def adapt(self, mod) -> bool:
        return adapt_module(mod)

    def computes(self, module) -> bool:
        return adapted_compressor(type(module))

    def stands_in(self, module) -> bool:
        return adapted_compressor(type(module))

    def layer_call(self, call) -> None:
        if getattr(call.module, "compressor", None) is None:
            return
        recorded = take_selection(call.module)
        if recorded is None:
            return
        call.kwargs["indices"], entries = recorded  # the window's tokens, then the compressed entries
        S = call.key.shape[2] - entries
        call.extra_kv = (call.key[:, :, S:].transpose(1, 2), call.value[:, :, S:].transpose(1, 2))
        call.key, call.value = call.key[:, :, :S], call.value[:, :, :S]


ADAPTER = Compressors()
