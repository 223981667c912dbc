"""The varlen contract (see ``backends/base.py``) on aten's fused CPU flash-attention kernel.

``aten::_scaled_dot_product_flash_attention_for_cpu`` is the kernel behind SDPA's ``is_causal`` path on
CPU: it returns the log-sum-exp, has a backward that takes a given ``out``/``lse`` (so a partial block
of the ring gets exact gradients from the *final* ones), reads its inputs through strides (so the
tiles below are views, never copies) and handles GQA itself. It knows two masks, none and top-left
causal, plus an optional additive ``attn_mask``. This backend cuts every sequence of a call into
*parts* that the kernel can run, FlexAttention-style:

* a sequence whose visible keys are the same for every row is one **full** part (no mask);
* a sequence whose rows see a square top-left causal triangle is one **causal** part;
* a bottom-right causal sequence with more keys than queries is a full part (the keys before the
  diagonal) and a causal part (the diagonal square), merged by log-sum-exp;
* anything else (windows, rows that see only some columns) is cut into tiles of ``TILE_Q`` rows,
  each one part over the key span its rows see: full or causal if it is, else **masked** with an
  additive mask of that tile alone.

Parts of the same shape and mask at a constant stride (the interior tiles of a window band, equal
documents side by side) run as one batched kernel call over overlapping strided views; a call holds
at most ``MAX_ROWS`` query rows, which bounds its temporaries. Rows that see no key are in no part
(``out = 0``, ``lse = -inf``). The backward walks the same parts (long full and causal ones cut into
row chunks, and long full parts into key slices, which need no merge there: :func:`backward_calls`);
dK/dV of overlapping spans are added back in chunks that do not overlap. A call's results are
released before the next call allocates its own, so the temporaries beside the accumulators are one
call's.

Supported: CPU tensors of float32 and bfloat16 (computed in float32: aten's bfloat16 kernels round
the probabilities and the gradients to bfloat16, past the contract's bound) with one head dim for q,
k and v, no softcap.
float64 (the oracle-grade path), float16 (aten rounds its probabilities to float16: twice the contract's bound), multi-head latent attention (``Dv != D``) and softcapping run on the
reference backend, which ``"auto"`` takes next.

Legend: ``n`` parts of one call, ``T`` query rows of a part, ``S`` its key span, ``H`` query heads,
``K`` K/V heads, ``D`` head dim, ``Tq``/``Tk`` packed query/key rows of the contract call.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch

from ..masks import MaskSpec, accumulation_dtype, row_key_intervals
from ..plan import PlanCache
from ..torch_compat import cpu_flash_kernels

__all__ = ["CPUFlashBackend", "TILE_Q", "MAX_ROWS", "MAX_SPAN_ROWS", "BACKWARD_SPAN", "plan_calls", "backward_calls",
           "KERNEL_CALLS"]

KERNEL_CALLS = PlanCache(256)
"""This backend's kernel calls, keyed by the documents' bounds, the mask and the tile sizes (LRU, 256
entries; thread-safe): a layer's backward, the other layers and the next step of a layout reuse them."""

TILE_Q = 64
"""Query rows per tile of a banded sequence. On CPU, short query tiles over a window's span ran
fastest (64 rows: 1.2x 128 rows and 1.7x 512 rows at window 512, L 16k, one thread)."""
MAX_ROWS = 512
"""Query rows of one batched kernel call: its out and dQ are temporaries of this many rows."""
MAX_SPAN_ROWS = 2048
"""Key rows of the spans of one batched kernel call (overlapping spans counted once each): its dK and
dV are temporaries of this many rows, of K/V heads only."""
BACKWARD_SPAN = 1024
"""Key rows of one full part in the backward (longer ones are cut into key slices): its dK and dV
temporaries, next to dQ's ``MAX_ROWS``."""

_FULL, _CAUSAL, _MASKED = "full", "causal", "masked"


class _Call(NamedTuple):
    """One kernel call: ``n`` parts of ``T`` query rows from ``q0`` (stepping ``T``) over ``S`` keys
    from ``k0`` (stepping ``k_step``, which may be smaller than ``S``: overlapping spans, or 0).
    ``merge``: its rows already hold a result of an earlier call (merge, do not overwrite).
    ``rel`` (lo, hi) relative to a part's first key, for a masked call; None otherwise."""

    q0: int
    k0: int
    n: int
    T: int
    S: int
    k_step: int
    kind: str
    merge: bool
    rel: tuple | None


def _kind(lo: np.ndarray, hi: np.ndarray) -> str:
    """How the kernel runs rows whose visible keys are ``[lo, hi)`` (non-decreasing, all non-empty)."""
    k0, k1 = int(lo[0]), int(hi[-1])
    if int(lo[-1]) == k0 and int(hi[0]) == k1:
        return _FULL
    if k1 - k0 == len(lo) and int(lo[-1]) == k0 and bool((hi - k0 == np.arange(1, len(lo) + 1)).all()):
        return _CAUSAL
    return _MASKED


def _part(lo: np.ndarray, hi: np.ndarray, q0: int) -> tuple:
    """(kind, q0, k0, T, S, rel) of rows ``q0..`` whose visible keys are ``[lo, hi)``."""
    kind, k0 = _kind(lo, hi), int(lo[0])
    rel = None if kind != _MASKED else (tuple((lo - k0).tolist()), tuple((hi - k0).tolist()))
    return kind, q0, k0, len(lo), int(hi[-1]) - k0, rel


def _sequence_parts(lo: np.ndarray, hi: np.ndarray, q0: int, tile: int) -> list[tuple]:
    """The parts of one sequence's live rows ``q0..`` (see the module docstring)."""
    T = len(lo)
    if _kind(lo, hi) != _MASKED:
        return [_part(lo, hi, q0)]
    c = int(hi[0]) - 1  # the diagonal's first key, if the rows are bottom-right causal
    if int(lo[-1]) == int(lo[0]) < c and bool((hi - c == np.arange(1, T + 1)).all()):
        return [(_FULL, q0, int(lo[0]), T, c - int(lo[0]), None), (_CAUSAL, q0, c, T, T, None)]
    return [_part(lo[a:a + tile], hi[a:a + tile], q0 + a) for a in range(0, T, tile)]


def plan_calls(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, *, causal: bool,
               window: tuple[int, int], tile: int | None = None, max_rows: int | None = None) -> tuple[_Call, ...]:
    """The kernel calls of one contract call: every live query row in exactly one call that does not
    merge, and at most one that does. Pure (CPU integers only), and cached by the documents' bounds:
    a layer's backward, the model's other layers and the next step of the same layout reuse it."""
    key = (tuple(cu_seqlens_q.detach().to("cpu", torch.int64).tolist()),
           tuple(cu_seqlens_k.detach().to("cpu", torch.int64).tolist()), bool(causal),
           (int(window[0]), int(window[1])), tile or TILE_Q, max_rows or MAX_ROWS, MAX_SPAN_ROWS)
    return KERNEL_CALLS.get_or_build(key, lambda: _plan_calls(*key))


def _plan_calls(bounds_q: tuple, bounds_k: tuple, causal: bool, window: tuple[int, int], tile: int, max_rows: int,
                max_span: int) -> tuple[_Call, ...]:
    lo_T, hi_T = (x.numpy() for x in row_key_intervals(torch.tensor(bounds_q), torch.tensor(bounds_k),
                                                          causal=causal, window=window))
    parts = []
    for a, b in zip(bounds_q[:-1], bounds_q[1:]):
        live = np.flatnonzero(hi_T[a:b] > lo_T[a:b])
        if len(live) == 0:
            continue
        x0, x1 = a + int(live[0]), a + int(live[-1]) + 1  # live rows are contiguous (a band's rows)
        parts.extend(_sequence_parts(lo_T[x0:x1], hi_T[x0:x1], x0, tile))
    calls: list[_Call] = []
    covered_to = -1  # the end of the rows the calls so far cover (parts come in row order)
    for kind, q0, k0, T, S, rel in parts:
        merge = q0 < covered_to
        last = calls[-1] if calls else None
        if (last is not None and (last.kind, last.T, last.S, last.rel, last.merge) == (kind, T, S, rel, merge)
                and q0 == last.q0 + last.n * T and (last.n + 1) * T <= max_rows
                and (last.n + 1) * S <= max_span
                and (last.n > 1 and k0 == last.k0 + last.n * last.k_step
                     or last.n == 1 and k0 >= last.k0)):
            calls[-1] = last._replace(n=last.n + 1, k_step=k0 - last.k0 if last.n == 1 else last.k_step)
        else:
            calls.append(_Call(q0, k0, 1, T, S, 0, kind, merge, rel))
        covered_to = max(covered_to, q0 + T)
    return tuple(calls)


def backward_calls(calls: list[_Call], max_rows: int | None = None, max_span: int | None = None) -> list[_Call]:
    """The backward's calls: every full or causal call of more than ``max_rows`` (``MAX_ROWS``) query
    rows cut into row chunks (a causal chunk: its diagonal square, then the keys before it, full), and
    every full part of one sequence over more than ``max_span`` (``BACKWARD_SPAN``) keys cut into key
    slices, so that dQ/dK/dV temporaries stay small next to the accumulators. The backward takes the
    final out and lse, so the pieces need no merge: their gradients add up. (A backward whose one call
    covers every row and key is not cut: its gradients become the result.)"""
    max_rows, max_span = max_rows or MAX_ROWS, max_span or BACKWARD_SPAN
    chunked = []

    def full(call: _Call) -> None:
        for s0 in range(0, call.S, max_span):
            chunked.append(call._replace(k0=call.k0 + s0, S=min(max_span, call.S - s0), merge=call.merge or s0 > 0))

    for call in calls:
        if call.n > 1 or call.kind == _MASKED or call.kind == _CAUSAL and call.T <= max_rows:
            chunked.append(call)
            continue
        for r0 in range(0, call.T, max_rows):
            T = min(max_rows, call.T - r0)
            if call.kind == _FULL:
                full(call._replace(q0=call.q0 + r0, T=T))
                continue
            chunked.append(_Call(call.q0 + r0, call.k0 + r0, 1, T, T, 0, _CAUSAL, call.merge, None))
            if r0:
                full(_Call(call.q0 + r0, call.k0, 1, T, r0, 0, _FULL, True, None))
    return chunked


def _mask(call: _Call, dtype: torch.dtype) -> torch.Tensor | None:
    """A masked call's additive (T, S) mask: 0 where visible, -inf where hidden (read only: shared by
    every call of the same tiles, e.g. a window band's interior, and by the backward)."""
    return None if call.rel is None else _mask_of(call.rel, call.S, dtype)


@functools.lru_cache(maxsize=16)
def _mask_of(rel: tuple, S: int, dtype: torch.dtype) -> torch.Tensor:
    lo, hi = (torch.tensor(x)[:, None] for x in rel)
    j = torch.arange(S)[None, :]
    return torch.zeros(len(rel[0]), S, dtype=dtype).masked_fill_((j < lo) | (j >= hi), float("-inf"))


def _rows(x: torch.Tensor, call: _Call) -> torch.Tensor:
    """A call's query rows of x (Tq, H, D) as (n, H, T, D) (a view)."""
    return x[call.q0:call.q0 + call.n * call.T].view(call.n, call.T, *x.shape[1:]).transpose(1, 2)


def _keys(x: torch.Tensor, call: _Call, start: int = 0, width: int | None = None) -> torch.Tensor:
    """A call's key spans of x (Tk, K, D) as (n, K, S, D): overlapping strided views of x itself.
    ``start``/``width``: columns ``[start, start + width)`` of every span only."""
    width = call.S - start if width is None else width
    row = x.stride(0)
    return x.as_strided((call.n, width, x.shape[1], x.shape[2]), (call.k_step * row, row, x.stride(1), 1),
                        x.storage_offset() + (call.k0 + start) * row).transpose(1, 2)


class CPUFlashBackend:
    """aten's fused CPU flash-attention kernel on parts cut from the mask (see the module docstring)."""

    name = "cpu"

    def not_supported_reasons(self, *, device, dtype, head_dim, spec: MaskSpec, head_dim_v=None) -> list[str]:
        reasons = []
        if torch.device(device).type != "cpu":
            reasons.append(f"runs on CPU tensors only, got {torch.device(device).type}")
        if dtype not in (torch.float32, torch.bfloat16):
            reasons.append(f"dtype {dtype} is not float32/bfloat16 (float64 and float16 run on the reference backend)")
        if spec.softcap is not None:
            reasons.append("the fused CPU kernel has no softcap")
        if head_dim_v is not None and head_dim_v != head_dim:
            reasons.append(f"the fused CPU kernel needs one head dim for q, k and v, got {head_dim} and {head_dim_v}")
        if cpu_flash_kernels()[0] is None:
            reasons.append(f"torch {torch.__version__} has no aten::_scaled_dot_product_flash_attention_for_cpu")
        return reasons

    def describe(self, **kw) -> str:
        return "aten's fused CPU flash attention on full, causal and masked tiles"

    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                scale, causal, window=(-1, -1), softcap=None):
        if softcap is not None:
            raise ValueError("the cpu backend has no softcap: use backend='reference'")
        kernel, _ = cpu_flash_kernels()
        dtype, acc = q.dtype, accumulation_dtype(q.dtype)
        # in float32: aten's bfloat16 kernel rounds its probabilities to bfloat16 (past the contract's bound)
        q, k, v = (x.to(acc).contiguous() for x in (q, k, v))
        Tq, H, Dv = q.shape[0], q.shape[1], v.shape[2]
        calls = plan_calls(cu_seqlens_q, cu_seqlens_k, causal=causal, window=window)
        if len(calls) == 1 and calls[0].n * calls[0].T == Tq:  # one call covers every row: adopt its result
            call = calls[0]
            o, lse = kernel(_rows(q, call), _keys(k, call), _keys(v, call), 0.0, call.kind == _CAUSAL,
                            attn_mask=_mask(call, q.dtype), scale=scale)
            return o.transpose(1, 2).reshape(Tq, H, Dv).to(dtype), lse.transpose(0, 1).reshape(H, Tq)
        out = torch.zeros(Tq, H, Dv, dtype=acc)
        lse_HT = torch.full((H, Tq), float("-inf"), dtype=acc)
        for call in calls:
            o, l_nHT = kernel(_rows(q, call), _keys(k, call), _keys(v, call), 0.0, call.kind == _CAUSAL,
                              attn_mask=_mask(call, q.dtype), scale=scale)
            rows = slice(call.q0, call.q0 + call.n * call.T)
            o_THD, l_HT = o.transpose(1, 2).reshape(-1, H, Dv), l_nHT.transpose(0, 1).reshape(H, -1)
            if not call.merge:
                out[rows], lse_HT[:, rows] = o_THD, l_HT
            else:
                old = lse_HT[:, rows]
                new = torch.logaddexp(old, l_HT)
                out[rows].mul_(torch.exp(old - new).t()[..., None]).add_(
                    o_THD.mul_(torch.exp(l_HT - new).t()[..., None]))
                lse_HT[:, rows] = new
            del o, l_nHT, o_THD, l_HT  # (freed before the next call allocates its own)
        return out.to(dtype), lse_HT

    def backward(self, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                 scale, causal, window=(-1, -1), softcap=None):
        if softcap is not None:
            raise ValueError("the cpu backend has no softcap: use backend='reference'")
        _, kernel_backward = cpu_flash_kernels()
        acc = accumulation_dtype(q.dtype)
        # in float32: aten's bfloat16 backward returns bfloat16 gradients, twice the contract's bound
        q, k, v, dout, out = (x.to(acc).contiguous() for x in (q, k, v, dout, out))
        Tq, H, D = q.shape
        calls = plan_calls(cu_seqlens_q, cu_seqlens_k, causal=causal, window=window)
        lse = lse.to(torch.float32)
        if len(calls) == 1 and calls[0].n == 1 and calls[0].T == Tq and calls[0].S == k.shape[0]:
            # one call over every row and key: its gradients are the result (no temporaries at all)
            call = calls[0]
            grads = kernel_backward(_rows(dout, call), _rows(q, call), _keys(k, call), _keys(v, call),
                                    _rows(out, call), lse[None], 0.0, call.kind == _CAUSAL,
                                    attn_mask=_mask(call, q.dtype), scale=scale)
            return tuple(g[0].transpose(0, 1).to(acc) for g in grads)
        dq = torch.zeros(Tq, H, D, dtype=acc)
        dk, dv = torch.zeros(k.shape, dtype=acc), torch.zeros(v.shape, dtype=acc)
        for call in backward_calls(calls):
            rows = slice(call.q0, call.q0 + call.n * call.T)
            lse_nHT = lse[:, rows].reshape(H, call.n, call.T).transpose(0, 1).contiguous()
            gq, gk, gv = kernel_backward(_rows(dout, call), _rows(q, call), _keys(k, call), _keys(v, call),
                                         _rows(out, call), lse_nHT, 0.0, call.kind == _CAUSAL,
                                         attn_mask=_mask(call, q.dtype), scale=scale)
            dq[rows] += gq.transpose(1, 2).reshape(-1, H, D)
            for grad, total in ((gk, dk), (gv, dv)):
                _add_spans_(total, grad.transpose(1, 2), call)
            del gq, gk, gv, grad  # (freed before the next call allocates its own)
        return dq, dk, dv


def _add_spans_(total_SKD: torch.Tensor, grad_nSKD: torch.Tensor, call: _Call) -> None:
    """Add every part's (S, K, D) gradient into the rows of ``total`` its span covers, in chunks of at
    most ``k_step`` columns so that no in-place add writes one row twice."""
    if call.n == 1 or call.k_step == 0:
        total_SKD[call.k0:call.k0 + call.S] += grad_nSKD[0] if call.n == 1 else grad_nSKD.sum(0)
        return
    for start in range(0, call.S, call.k_step):
        width = min(call.k_step, call.S - start)
        _keys(total_SKD, call, start, width).transpose(1, 2).add_(grad_nSKD[:, start:start + width])
