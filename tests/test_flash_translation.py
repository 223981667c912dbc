"""The flash backend's argument translation, checked on CPU.

Each interface's kernels are replaced by stand-ins with the upstream signatures (flash-attn 3:
``hopper/flash_attn_interface.py``; flash-attn 4: ``flash_attn/cute/interface.py``; flash-attn 2:
``flash_attn/flash_attn_interface.py``; PyTorch: the aten schemas, which the stand-ins are checked
against). A stand-in checks what it receives as upstream does (float16/bfloat16 inputs of one dtype,
float32 raises; int32 ``cu_seqlens``; lse layout (H, T) float32; dq/dk/dv buffers in the input
dtype) and runs the reference backend in float32 under that kernel's own conventions (how it reads
its mask arguments, which lse it writes and expects for rows that see no key), returning out and
gradients in the input dtype and lse in float32 as the kernels do. The backend must then match the
float64 loop oracle over the contract grid in float16 and bfloat16.

How a kernel reads its window is part of its conventions: each stand-in rewrites the window sides it
receives exactly as its source does before the mask is built (:func:`fa2_kernel_window`,
:func:`fa3_kernel_window`, :func:`_fa4_window`) and hands the reference the band that results, so an
adapter whose arguments a real kernel would read differently fails here too (the window read against
``max_seqlen_k`` by flash-attn 2 and PyTorch's copy of it: grid cases with more queries than keys and
:func:`test_real_plan_calls_through_flash_translation`).
"""

from __future__ import annotations

import inspect
import sys
import types
from typing import Optional

import pytest
import torch

from cp_attention.backends.flash import aten as aten_mod, backend as flash_mod, fa3 as fa3_mod, fa4 as fa4_mod
from cp_attention.backends.flash import interface as iface_mod
from cp_attention.backends.reference import ReferenceBackend
from cp_attention.masks import MaskSpec
from test_contract import GRID, LOW_PRECISION_TOL, _cu, check_backend_on_case

REF = ReferenceBackend()
NO_SOFTCAP = [c for c in GRID if c[5] is None]
VARIANT_CASES = [c for c in GRID if c[0] in ("window-left-only", "varlen-window", "lq>lk-window", "everything")]
Tensor = torch.Tensor


def _ids(cases):
    return [c[0] for c in cases]


LOW_PRECISION = (torch.float16, torch.bfloat16)


def _check_dtypes(*tensors, assertion=False):
    """Upstream's dtype checks: the C++ kernels (flash-attn 2 and 3, PyTorch's) ``TORCH_CHECK``
    (a RuntimeError) "FlashAttention only support fp16 and bf16 data type" and "... must have the
    same dtype"; flash-attn 4's Python interface asserts "inputs must be float16 or bfloat16"."""
    error = AssertionError if assertion else RuntimeError
    dtype = tensors[0].dtype
    if dtype not in LOW_PRECISION:
        raise error("inputs must be float16 or bfloat16" if assertion
                    else "FlashAttention only support fp16 and bf16 data type")
    if any(t.dtype != dtype for t in tensors):
        raise error("inputs must have the same dtype")


def _check_inputs(q, k, v, cu_q, cu_k, max_q, max_k):
    """What every flash kernel requires of its packed inputs."""
    assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.is_contiguous() and cu_k.is_contiguous()
    assert type(max_q) is int and type(max_k) is int
    assert all(t.dim() == 3 and t.is_contiguous() for t in (q, k, v))
    assert q.shape[0] == int(cu_q[-1]) and k.shape[0] == int(cu_k[-1]) == v.shape[0]
    assert max_q >= int(cu_q.diff().max()) and max_k >= int(cu_k.diff().max())


def _check_lse(lse, q):
    assert lse.dtype == torch.float32 and lse.shape == (q.shape[1], q.shape[0]) and lse.is_contiguous()


def _with_empty_rows(lse, value):
    """The reference writes -inf for rows that see no key; some kernels write ``value``."""
    return torch.where(torch.isneginf(lse), torch.full_like(lse, value), lse)


def _ref_forward(q, k, v, cu_q, cu_k, max_q, max_k, **mask):
    """The reference in float32 -> out in the input dtype, lse (H, T) float32, as the kernels return."""
    out, lse = REF.forward(q.float(), k.float(), v.float(), cu_q, cu_k, max_q, max_k, **mask)
    return out.to(q.dtype), lse


def _ref_grads(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, **mask):
    """The reference backward in float32 -> dq, dk, dv in the input dtype, as the kernels write them."""
    grads = REF.backward(dout.float(), q.float(), k.float(), v.float(), out.float(), lse, cu_q, cu_k, max_q, max_k,
                         **mask)
    return [g.to(t.dtype) for g, t in zip(grads, (q, k, v))]


def _check_grad_buffers(q, k, v, dq, dk, dv):
    """flash-attn 2 and 3 fill preallocated buffers: "dq must have the same dtype as q", ..."""
    for buf, t, name in zip((dq, dk, dv), (q, k, v), ("dq", "dk", "dv")):
        if buf.dtype != t.dtype or buf.shape != t.shape:
            raise RuntimeError(f"{name} must have the same dtype and shape as {name[1:]}")


# ----------------------------------------------------------------------------------------------
# how each kernel reads its window (before it builds its mask), from its source


def fa2_kernel_window(is_causal, left, right, max_seqlen_q, max_seqlen_k, *, forward=True):
    """FlashAttention-2's reading of ``(is_causal, left, right)`` (flash-attn 2's
    ``csrc/flash_attn/flash_api.cpp`` and PyTorch's copy, ``aten/src/ATen/native/transformers/cuda/
    flash_attn/flash_api.cpp``): ``mha_varlen_fwd`` drops causal for one query and sets right = 0 for
    causal (``mha_varlen_bwd`` only the latter), then turns a side ``>= max_seqlen_k`` into -1;
    ``set_params_fprop`` marks the call causal when left < 0 and right == 0 and replaces an unlimited
    side next to a finite one by ``max_seqlen_k``. Returns the band the kernel applies to every
    sequence (bottom-right, per sequence's own lengths), as the contract's window of a non-causal
    call (-1 unlimited; causal: (-1, 0))."""
    if forward and max_seqlen_q == 1:
        is_causal = False
    if is_causal:
        right = 0
    if left >= max_seqlen_k:
        left = -1
    if right >= max_seqlen_k:
        right = -1
    if left < 0 and right == 0:
        return (-1, 0)
    if left < 0 and right >= 0:
        left = max_seqlen_k
    if left >= 0 and right < 0:
        right = max_seqlen_k
    return (left, right)


def fa3_kernel_window(is_causal, left, right, max_seqlen_q, max_seqlen_k, *, forward=True):
    """flash-attn 3's reading (``hopper/flash_api.cpp``): ``mha_fwd`` / ``mha_bwd`` turn a left
    side ``>= max_seqlen_k - 1`` and a right side ``>= max_seqlen_q - 1`` into -1, (forward: drop
    causal for one query when both sides are unlimited), set right = 0 for causal and mark the call
    causal when left < 0 and right == 0; then an unlimited left side becomes ``max_seqlen_k - 1``
    and an unlimited right side ``max_seqlen_q - 1`` next to a finite one (``set_params_fprop`` in
    the releases this follows; later ones fill both sides unconditionally in ``mha_fwd`` /
    ``mha_bwd``, which gives the same band). Returns the band as :func:`fa2_kernel_window` does."""
    if left >= max_seqlen_k - 1:
        left = -1
    if right >= max_seqlen_q - 1:
        right = -1
    if forward and max_seqlen_q == 1 and left == -1 and right == -1:
        is_causal = False
    if is_causal:
        right = 0
    if left < 0 and right == 0:
        return (-1, 0)
    if left < 0 and right >= 0:
        left = max_seqlen_k - 1
    if left >= 0 and right < 0:
        right = max_seqlen_q - 1
    return (left, right)


# ----------------------------------------------------------------------------------------------
# flash-attn 3: hopper/flash_attn_interface.py (custom ops; backward fills dq/dk/dv, note `sequed_q`)


@torch.library.custom_op("cp_attention_test::fa3_forward", mutates_args=())
def fa3_forward(
    q: Tensor, k: Tensor, v: Tensor, k_new: Optional[Tensor] = None, v_new: Optional[Tensor] = None,
    qv: Optional[Tensor] = None, out_: Optional[Tensor] = None, cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None, cu_seqlens_k_new: Optional[Tensor] = None,
    seqused_q: Optional[Tensor] = None, seqused_k: Optional[Tensor] = None, max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None, page_table: Optional[Tensor] = None, kv_batch_idx: Optional[Tensor] = None,
    leftpad_k: Optional[Tensor] = None, rotary_cos: Optional[Tensor] = None, rotary_sin: Optional[Tensor] = None,
    seqlens_rotary: Optional[Tensor] = None, q_descale: Optional[Tensor] = None, k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None, softmax_scale: Optional[float] = None, causal: bool = False,
    window_size_left: int = -1, window_size_right: int = -1, attention_chunk: int = 0, softcap: float = 0.0,
    rotary_interleaved: bool = True, scheduler_metadata: Optional[Tensor] = None, num_splits: int = 1,
    pack_gqa: Optional[bool] = None, sm_margin: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _check_dtypes(q, k, v)  # its float8 path (no backward) is not used
    _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    assert seqused_q is None and page_table is None and attention_chunk == 0 and softmax_scale is not None
    # FA3: its window reading (fa3_kernel_window); softcap 0.0 is off; rows without keys get -inf
    window = fa3_kernel_window(causal, window_size_left, window_size_right, max_seqlen_q, max_seqlen_k)
    out, lse = _ref_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=softmax_scale,
                            causal=False, window=window, softcap=softcap or None)
    return out, lse, q.new_empty(0), q.new_empty(0)


@torch.library.custom_op("cp_attention_test::fa3_backward", mutates_args=("dq", "dk", "dv"))
def fa3_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor,
    cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None, sequed_q: Optional[Tensor] = None,
    sequed_k: Optional[Tensor] = None, max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
    dq: Optional[Tensor] = None, dk: Optional[Tensor] = None, dv: Optional[Tensor] = None,
    softmax_scale: Optional[float] = None, is_causal: bool = False, window_size_left: int = -1,
    window_size_right: int = -1, softcap: float = 0.0, deterministic: bool = False, sm_margin: int = 0,
) -> Tensor:
    _check_dtypes(q, k, v, out, dout)
    _check_grad_buffers(q, k, v, dq, dk, dv)
    _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    _check_lse(softmax_lse, q)
    # its preprocess turns lse = -inf into log2-lse 0 on rows whose scores are all masked: p = 0;
    # its forward never writes +inf, so a backward given +inf was handed another kernel's convention
    assert not torch.isposinf(softmax_lse).any(), "flash-attn 3 writes -inf, not +inf, for rows that see nothing"
    window = fa3_kernel_window(is_causal, window_size_left, window_size_right, max_seqlen_q, max_seqlen_k,
                               forward=False)
    grads = _ref_grads(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       scale=softmax_scale, causal=False, window=window, softcap=softcap or None)
    for buf, g in zip((dq, dk, dv), grads):
        buf.copy_(g)
    return softmax_lse.new_empty(softmax_lse.shape)


FA3 = {"flash_attn_interface": dict(_flash_attn_forward=fa3_forward, _flash_attn_backward=fa3_backward)}


def fa3_window_tuple_forward(q, k, v, k_new, v_new, qv, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q,
                             seqused_k, max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos,
                             rotary_sin, seqlens_rotary, q_descale, k_descale, v_descale, softmax_scale, causal,
                             window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                             scheduler_metadata=None, num_splits=1, pack_gqa=None, sm_margin=0):
    """An earlier 3.0 beta: one ``window_size`` tuple, plain functions, optional tensors declared
    without defaults (the adapter passes None for those it knows)."""
    assert all(t is None for t in (k_new, v_new, qv, out, cu_seqlens_k_new, seqused_q, seqused_k, page_table,
                                   kv_batch_idx, leftpad_k, rotary_cos, rotary_sin, seqlens_rotary, q_descale,
                                   k_descale, v_descale))
    return fa3_forward(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                       max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
                       window_size_left=window_size[0], window_size_right=window_size[1], softcap=softcap)


def fa3_window_tuple_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, sequed_q, sequed_k,
                              max_seqlen_q, max_seqlen_k, dq, dk, dv, softmax_scale, causal, window_size=(-1, -1),
                              softcap=0.0, deterministic=False, sm_margin=0):
    """The same beta's backward: ``causal`` (not ``is_causal``), ``window_size`` tuple."""
    assert sequed_q is None and sequed_k is None
    return fa3_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                        max_seqlen_k=max_seqlen_k, dq=dq, dk=dk, dv=dv, softmax_scale=softmax_scale,
                        is_causal=causal, window_size_left=window_size[0], window_size_right=window_size[1],
                        softcap=softcap)


FA3_WINDOW_TUPLE = {"flash_attn_interface": dict(_flash_attn_forward=fa3_window_tuple_forward,
                                                 _flash_attn_backward=fa3_window_tuple_backward)}


# ----------------------------------------------------------------------------------------------
# flash-attn 4: flash_attn/cute/interface.py (plain functions; window sides None = unlimited)


def _fa4_window(causal, left, right):
    """FA4's reading of its mask arguments: causal sets right = 0; two sides summing below 0 turn the
    window off; None is unlimited. A negative side that survives is used literally (the kernel
    would shift the band by it), which the reference cannot express: refuse it."""
    if causal:
        right = 0
    if left is not None and right is not None and left + right < 0:
        left = right = None
    assert (left is None or left >= 0) and (right is None or right >= 0), f"literal negative window {left, right}"
    return (-1 if left is None else left, -1 if right is None else right)


def fa4_fwd(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
            max_seqlen_q=None, max_seqlen_k=None, min_seqlen_k=None, page_table=None, softmax_scale=None,
            causal=False, softcap=None, window_size_left=None, window_size_right=None, learnable_sink=None,
            tile_mn=None, mma_pv_is_rs=None, intra_wg_overlap=None, num_threads=384, num_splits=1, pack_gqa=None,
            _arch=None, score_mod=None, mask_mod=None, block_sparse_tensors=None, return_lse=False, out=None,
            lse=None, aux_tensors=None, aux_scalars=None, q_descale=None, k_descale=None, v_descale=None,
            gather_kv_indices=None):
    _check_dtypes(q, k, v, assertion=True)
    _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    assert qv is None and page_table is None and score_mod is None and mask_mod is None and softcap in (None, 0.0)
    out_, lse_ = _ref_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=softmax_scale,
                              causal=False, window=_fa4_window(causal, window_size_left, window_size_right))
    requires_grad = any(t.requires_grad for t in (q, k, v))
    return out_, (lse_ if return_lse or requires_grad else None), None, None


def fa4_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0, window_size_left=None,
            window_size_right=None, m_block_size=64, n_block_size=128, num_threads=256, pack_gqa=False,
            num_stages_Q=2, num_stages_dO=2, SdP_swapAB=False, dKV_swapAB=False, dQ_swapAB=False, AtomLayoutMSdP=2,
            AtomLayoutNdKV=2, AtomLayoutMdQ=2, V_in_regs=False, cu_seqlens_q=None, cu_seqlens_k=None,
            seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, deterministic=False, dq=None,
            dk=None, dv=None, score_mod=None, score_mod_bwd=None, mask_mod=None, aux_tensors=None, aux_scalars=None,
            block_sparse_tensors=None, dlse=None):
    _check_dtypes(q, k, v, out, dout, assertion=True)
    _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    _check_lse(lse, q)
    assert not torch.isposinf(lse).any(), "flash-attn 4 writes -inf, not +inf, for rows that see nothing"
    assert softcap == 0.0, "varlen + score_mod not supported in bwd yet"
    return tuple(_ref_grads(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            scale=softmax_scale, causal=False,
                            window=_fa4_window(causal, window_size_left, window_size_right)))


def fa4_fwd_two_outputs(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                        max_seqlen_q=None, max_seqlen_k=None, page_table=None, softmax_scale=None, causal=False,
                        softcap=None, window_size_left=None, window_size_right=None, learnable_sink=None,
                        m_block_size=128, n_block_size=128, num_threads=384, num_splits=1, pack_gqa=None,
                        _arch=None, score_mod=None, mask_mod=None, block_sparse_tensors=None, cu_total_m_blocks=None,
                        cu_total_n_blocks=None, return_lse=False, out=None, lse=None, aux_tensors=None):
    """A late-2025 release: no ``qv`` before ``cu_seqlens_q``; returns (out, lse)."""
    return fa4_fwd(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                   max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
                   window_size_left=window_size_left, window_size_right=window_size_right,
                   return_lse=return_lse)[:2]


def _fa4_modules(fwd, bwd):
    return {"flash_attn": {}, "flash_attn.cute": {},
            "flash_attn.cute.interface": dict(_flash_attn_fwd=fwd, _flash_attn_bwd=bwd)}


FA4 = _fa4_modules(fa4_fwd, fa4_bwd)
FA4_TWO_OUTPUTS = _fa4_modules(fa4_fwd_two_outputs, fa4_bwd)


# ----------------------------------------------------------------------------------------------
# flash-attn 2: flash_attn/flash_attn_interface.py (2.7+: custom ops, window_size_left/right)


@torch.library.custom_op("cp_attention_test::fa2_varlen_forward", mutates_args=("q", "k", "v"))
def fa2_varlen_forward(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
    max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int = -1,
    window_size_right: int = -1, softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
    return_softmax: bool = False, block_table: Optional[Tensor] = None, leftpad_k: Optional[Tensor] = None,
    seqused_k: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _check_dtypes(q, k, v)
    _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    assert dropout_p == 0.0 and alibi_slopes is None and not return_softmax
    window = fa2_kernel_window(causal, window_size_left, window_size_right, max_seqlen_q, max_seqlen_k)
    out, lse = _ref_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=softmax_scale,
                            causal=False, window=window, softcap=softcap or None)
    return out, _with_empty_rows(lse, float("inf")), q.new_empty(0), torch.zeros(2, dtype=torch.int64)


@torch.library.custom_op("cp_attention_test::fa2_varlen_backward", mutates_args=("dq", "dk", "dv"))
def fa2_varlen_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor, dq: Optional[Tensor],
    dk: Optional[Tensor], dv: Optional[Tensor], cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
    max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int,
    window_size_right: int, softcap: float, alibi_slopes: Optional[Tensor], deterministic: bool,
    rng_state: Optional[Tensor] = None,
) -> Tensor:
    _check_dtypes(q, k, v, out, dout)
    _check_grad_buffers(q, k, v, dq, dk, dv)
    _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    _check_lse(softmax_lse, q)
    assert not torch.isneginf(softmax_lse).any(), "flash-attn 2 writes +inf, not -inf, for rows that see nothing"
    lse = torch.where(torch.isposinf(softmax_lse), float("-inf"), softmax_lse)
    window = fa2_kernel_window(causal, window_size_left, window_size_right, max_seqlen_q, max_seqlen_k,
                               forward=False)
    grads = _ref_grads(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       scale=softmax_scale, causal=False, window=window, softcap=softcap or None)
    for buf, g in zip((dq, dk, dv), grads):
        buf.copy_(g)
    return softmax_lse.new_empty(softmax_lse.shape)


FA2 = {"flash_attn": {}, "flash_attn.flash_attn_interface": dict(
    _flash_attn_varlen_forward=fa2_varlen_forward, _flash_attn_varlen_backward=fa2_varlen_backward)}


def fa2_6_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                         causal, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, return_softmax=False,
                         block_table=None, leftpad_k=None, seqused_k=None):
    """2.6: a ``window_size`` tuple; returns (out, q, k, v, out_padded, lse, S_dmask, rng_state)."""
    out, lse, s_dmask, rng = fa2_varlen_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
        window_size[0], window_size[1], softcap)
    return out, q, k, v, out, lse, s_dmask, rng


def fa2_6_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                          max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                          deterministic, rng_state=None):
    return fa2_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k, dropout_p, softmax_scale, causal, window_size[0], window_size[1],
                               softcap, alibi_slopes, deterministic)


FA2_6 = {"flash_attn": {}, "flash_attn.flash_attn_interface": dict(
    _flash_attn_varlen_forward=fa2_6_varlen_forward, _flash_attn_varlen_backward=fa2_6_varlen_backward)}


# ----------------------------------------------------------------------------------------------
# PyTorch's aten._flash_attention_forward/_backward


def fake_aten_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask,
                      *, scale=None, window_size_left=None, window_size_right=None, seqused_k=None,
                      alibi_slopes=None, block_table=None, num_splits=None):
    """The schema of ``aten::_flash_attention_forward`` (names, order, keyword-only part, defaults
    and five returns are checked against it below)."""
    _check_dtypes(query, key, value)
    assert dropout_p == 0.0 and not return_debug_mask and scale is not None
    assert seqused_k is None and alibi_slopes is None and block_table is None and num_splits is None
    _check_inputs(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k)
    window = fa2_kernel_window(is_causal, window_size_left, window_size_right, max_q, max_k)  # FA2 inside
    out, lse = _ref_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, scale=scale, causal=False,
                            window=window)
    rng_state = torch.zeros(2, dtype=torch.int64)
    return out, _with_empty_rows(lse, float("inf")), rng_state, query.new_empty(()), query.new_empty(0)


def fake_aten_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                       is_causal, rng_state, unused, *, scale=None, window_size_left=None, window_size_right=None):
    """The schema of ``aten::_flash_attention_backward``; returns (dq, dk, dv) in the input dtype."""
    _check_dtypes(query, key, value, out, grad_out)
    _check_lse(logsumexp, query)
    assert dropout_p == 0.0 and scale is not None
    assert not torch.isneginf(logsumexp).any(), "flash expects +inf, not -inf, for rows that see nothing"
    lse = torch.where(torch.isposinf(logsumexp), float("-inf"), logsumexp)
    _check_inputs(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k)
    window = fa2_kernel_window(is_causal, window_size_left, window_size_right, max_q, max_k, forward=False)
    return tuple(_ref_grads(grad_out, query, key, value, out, lse, cum_seq_q, cum_seq_k, max_q, max_k, scale=scale,
                            causal=False, window=window))


# ----------------------------------------------------------------------------------------------
# installing stand-ins


ALL_MODULES = ("flash_attn_interface", "flash_attn_3", "flash_attn_3.flash_attn_interface", "flash_attn",
               "flash_attn.cute", "flash_attn.cute.interface", "flash_attn.flash_attn_interface")


@pytest.fixture
def install(monkeypatch):
    """``install(*module_sets)``: exactly these stand-in modules are importable (every other flash
    package is hidden) and the interface adapters start fresh."""

    def _install(*module_sets):
        for name in ALL_MODULES:
            monkeypatch.setitem(sys.modules, name, None)
        for modules in module_sets:
            for name, attrs in modules.items():
                mod = sys.modules.get(name) or types.ModuleType(name)
                mod.__dict__.update(attrs)
                monkeypatch.setitem(sys.modules, name, mod)
                if "." in name:
                    parent, child = name.rsplit(".", 1)
                    setattr(sys.modules[parent], child, mod)
        monkeypatch.setattr(aten_mod, "aten_flash_forward", fake_aten_forward)
        monkeypatch.setattr(aten_mod, "aten_flash_backward", fake_aten_backward)
        monkeypatch.setattr(flash_mod, "INTERFACES", flash_mod.new_interfaces())

    return _install


# ----------------------------------------------------------------------------------------------
# forward + backward of every interface against the loop oracle


def _check(interface, case):
    """The stand-ins round out and dq/dk/dv to the input dtype, as the kernels do."""
    check_backend_on_case(flash_mod.FlashBackend(interface), case, dtypes=LOW_PRECISION_TOL)


@pytest.mark.parametrize("case", GRID, ids=_ids(GRID))
def test_fa3_translation_matches_loop_oracle(case, install):
    install(FA3)
    _check("fa3", case)


@pytest.mark.parametrize("case", NO_SOFTCAP, ids=_ids(NO_SOFTCAP))
def test_fa4_translation_matches_loop_oracle(case, install):
    install(FA4)
    _check("fa4", case)


@pytest.mark.parametrize("case", GRID, ids=_ids(GRID))
def test_fa2_translation_matches_loop_oracle(case, install):
    install(FA2)
    _check("fa2", case)


@pytest.mark.parametrize("case", NO_SOFTCAP, ids=_ids(NO_SOFTCAP))
def test_aten_translation_matches_loop_oracle(case, install):
    install()
    _check("aten", case)


RELEASES = {"fa3-window-tuple": (FA3_WINDOW_TUPLE, "fa3"), "fa4-two-outputs": (FA4_TWO_OUTPUTS, "fa4"),
            "fa2-2.6": (FA2_6, "fa2")}
EARLIER = [pytest.param(release, case, id=f"{release}-{case[0]}") for release in RELEASES for case in VARIANT_CASES
           if not (release.startswith("fa4") and case[5] is not None)]  # flash-attn 4: no softcap


@pytest.mark.parametrize("release, case", EARLIER)
def test_earlier_signatures(release, case, install):
    modules, interface = RELEASES[release]
    install(modules)
    _check(interface, case)


# ----------------------------------------------------------------------------------------------
# translation units, declared support, selection


def test_kernel_arguments():
    assert flash_mod.kernel_arguments(scale=0.5, causal=True, window=(-1, -1), softcap=None) == dict(
        is_causal=True, window_size_left=-1, window_size_right=0, scale=0.5, softcap=0.0)
    assert flash_mod.kernel_arguments(scale=1.0, causal=False, window=(0, -1), softcap=2.0) == dict(
        is_causal=False, window_size_left=0, window_size_right=-1, scale=1.0, softcap=2.0)
    # an off-diagonal halo block: window (W-2, 0) bottom-right is causal with a left window
    assert flash_mod.kernel_arguments(scale=1.0, causal=False, window=(7, 0), softcap=None)["is_causal"]


def test_fa4_mask_arguments():
    mask = fa4_mod.FlashAttn4._mask
    assert mask(True, -1, 0) == dict(causal=True, window_size_left=None, window_size_right=None)
    assert mask(True, 7, 0) == dict(causal=False, window_size_left=7, window_size_right=0)
    assert mask(False, 0, -1) == dict(causal=False, window_size_left=0, window_size_right=None)
    assert mask(False, -1, -1) == dict(causal=False, window_size_left=None, window_size_right=None)


def test_parameters_see_through_custom_ops():
    params = iface_mod.parameters(fa2_varlen_forward)
    assert list(params)[:4] == ["q", "k", "v", "cu_seqlens_q"] and "window_size_left" in params
    with pytest.raises(TypeError, match="takes no"):
        iface_mod.call_kernel(flash_mod.INTERFACES["fa4"], fa4_fwd, iface_mod.parameters(fa4_fwd), q=None,
                        window_size=(1, 0))


def fa3_forward_new_required(q, k, v, sink_scale, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                             max_seqlen_k=None, softmax_scale=None, causal=False, window_size_left=-1,
                             window_size_right=-1, softcap=0.0):
    """A hypothetical release whose forward gained a required parameter the adapter cannot know."""
    raise AssertionError("must not be called with a guessed sink_scale")


def fa4_bwd_new_required(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
                         window_size_left=None, window_size_right=None, cu_seqlens_q=None, cu_seqlens_k=None,
                         max_seqlen_q=None, max_seqlen_k=None, *, dlse_scale):
    raise AssertionError("must not be called with a guessed dlse_scale")


@pytest.mark.parametrize("interface", ["fa3", "fa4"])
def test_unknown_required_parameter_raises(interface, install):
    """A required parameter the adapter does not supply (and does not know as optional) is an upstream
    signature change: raise, naming the interface, the parameter and the installed version."""
    if interface == "fa3":
        install({"flash_attn_interface": dict(_flash_attn_forward=fa3_forward_new_required,
                                              _flash_attn_backward=fa3_backward, __version__="3.9.1")})
        name, version = "sink_scale", "flash_attn_interface 3.9.1"
    else:
        modules = _fa4_modules(fa4_fwd, fa4_bwd_new_required)
        modules["flash_attn.cute"] = dict(__version__="4.0.7")
        install(modules)
        name, version = "dlse_scale", "flash_attn.cute 4.0.7"
    backend = flash_mod.FlashBackend(interface)
    q = torch.randn(6, 2, 16, dtype=torch.bfloat16)
    cu = _cu([6])
    kw = dict(scale=0.25, causal=True)
    with pytest.raises(TypeError) as info:
        out, lse = backend.forward(q, q, q, cu, cu, 6, 6, **kw)
        backend.backward(q, q, q, q, out, lse, cu, cu, 6, 6, **kw)
    message = str(info.value)
    assert flash_mod.INTERFACES[interface].label in message and repr(name) in message and version in message


def test_optional_parameters_without_default_get_none(install):
    """flash-attn 3.0 betas declare optional tensors without defaults: those (and only those) the adapter
    knows get None; the release's own stand-in asserts they are None."""
    params = iface_mod.parameters(fa3_window_tuple_forward)
    required = {n for n, p in params.items() if p.default is inspect.Parameter.empty}
    assert {"k_new", "seqused_q", "q_descale"} <= required <= fa3_mod.FlashAttn3.none_params | {
        "q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal"}
    install(FA3_WINDOW_TUPLE)
    _check("fa3", GRID[0])


# ----------------------------------------------------------------------------------------------
# what the stand-ins accept: dtypes as upstream, and PyTorch's real schemas


@pytest.mark.parametrize("interface, modules", [("fa3", FA3), ("fa4", FA4), ("fa2", FA2), ("aten", {})],
                         ids=["fa3", "fa4", "fa2", "aten"])
def test_stand_ins_reject_float32_like_upstream(interface, modules, install):
    install(modules)
    backend = flash_mod.FlashBackend(interface)
    cu = _cu([5, 3])
    kw = dict(scale=0.25, causal=True)
    q32 = torch.randn(8, 2, 16)
    with pytest.raises((RuntimeError, AssertionError), match="fp16 and bf16|float16 or bfloat16"):
        backend.forward(q32, q32, q32, cu, cu, 5, 5, **kw)
    q = q32.to(torch.bfloat16)
    out, lse = backend.forward(q, q, q, cu, cu, 5, 5, **kw)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    with pytest.raises((RuntimeError, AssertionError), match="fp16 and bf16|float16 or bfloat16"):
        backend.backward(out.float(), q32, q32, q32, out.float(), lse, cu, cu, 5, 5, **kw)
    with pytest.raises((RuntimeError, AssertionError), match="same dtype"):
        backend.forward(q, q.half(), q, cu, cu, 5, 5, **kw)
    grads = backend.backward(out, q, q, q, out, lse, cu, cu, 5, 5, **kw)
    assert all(g.dtype == torch.float32 for g in grads), "the contract's gradients are float32"


@pytest.mark.parametrize("stand_in, op", [(fake_aten_forward, "_flash_attention_forward"),
                                          (fake_aten_backward, "_flash_attention_backward")],
                         ids=["forward", "backward"])
def test_aten_stand_ins_bind_to_the_real_schema(stand_in, op):
    """Same argument names in the same order, the same keyword-only part and defaults, and as many
    returns as ``torch.ops.aten.<op>`` declares (its schema is readable without CUDA)."""
    schema = getattr(torch.ops.aten, op).default._schema
    params = list(inspect.signature(stand_in).parameters.values())
    assert [p.name for p in params] == [a.name for a in schema.arguments]
    assert [p.kind is inspect.Parameter.KEYWORD_ONLY for p in params] == [a.kwarg_only for a in schema.arguments]
    assert [p.default is not inspect.Parameter.empty for p in params] == [
        a.has_default_value() for a in schema.arguments]
    assert all(p.default is None for p in params if p.default is not inspect.Parameter.empty)

    q = torch.randn(8, 2, 16, dtype=torch.bfloat16)
    cu = _cu([5, 3])
    mask = dict(scale=0.25, window_size_left=-1, window_size_right=0)
    result = fake_aten_forward(q, q, q, cu, cu, 5, 5, 0.0, True, False, **mask)
    if op == "_flash_attention_backward":
        result = fake_aten_backward(q, q, q, q, result[0], result[1], cu, cu, 5, 5, 0.0, True, result[2],
                                    result[3], **mask)
    assert len(result) == len(schema.returns) and all(isinstance(t, torch.Tensor) for t in result)


def test_aten_adapter_calls_bind_to_the_real_ops():
    """The adapter's own calls, against PyTorch's real ops on meta tensors (their meta kernels run
    without CUDA): argument binding, return arity, dtypes and shapes."""
    iface = aten_mod.AtenFlash()
    assert iface.unavailable() is None
    q = torch.empty(10, 4, 16, dtype=torch.bfloat16, device="meta")
    k = torch.empty(10, 2, 16, dtype=torch.bfloat16, device="meta")
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    mask = flash_mod.kernel_arguments(scale=0.25, causal=True, window=(3, 0), softcap=None)
    out, lse = iface.forward(q, k, k, cu, cu, 6, 6, **mask)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (4, 10) and lse.dtype == torch.float32
    dq, dk, dv = iface.backward(q, q, k, k, out, lse, cu, cu, 6, 6, **mask)
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape and dq.dtype == q.dtype


def test_releases_without_varlen_backward_are_not_used(install):
    def old_fa3_forward(q, k, v, softmax_scale, causal, q_descale=None, k_descale=None, v_descale=None,
                        window_size=(-1, -1), sink_token_length=0, softcap=0.0, num_splits=1, pack_gqa=None):
        raise AssertionError("must not be called")

    def old_fa4_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0, m_block_size=64):
        raise AssertionError("must not be called")

    install({"flash_attn_interface": dict(_flash_attn_forward=old_fa3_forward, _flash_attn_backward=fa3_backward)},
            _fa4_modules(fa4_fwd, old_fa4_bwd))
    assert "cu_seqlens_q" in flash_mod.INTERFACES["fa3"].unavailable()
    assert "cu_seqlens_q" in flash_mod.INTERFACES["fa4"].unavailable()
    assert flash_mod.INTERFACES["fa2"].unavailable() == "not installed"
    name, rejected = flash_mod.pick_interface(capability=(9, 0), head_dim=64, softcap=False)
    assert name == "aten" and len(rejected) == 3


def test_broken_install_is_reported_not_hidden(install, tmp_path, monkeypatch):
    install()
    (tmp_path / "flash_attn_interface.py").write_text("import flash_attn_3_missing_extension\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn_interface")
    reason = flash_mod.INTERFACES["fa3"].unavailable()
    assert reason.startswith("not importable") and "flash_attn_3_missing_extension" in reason


def test_preference_and_declared_support(install):
    install(FA3, FA4, FA2)

    def pick(capability, head_dim=128, softcap=False):
        return flash_mod.pick_interface(capability=capability, head_dim=head_dim, softcap=softcap)

    assert pick((9, 0))[0] == "fa3"
    assert pick((9, 0), softcap=True)[0] == "fa3"
    assert pick((10, 0))[0] == "fa4"
    assert pick((10, 0), softcap=True) == ("fa2", [
        "flash-attn 3 (flash_attn_interface): needs a Hopper GPU (sm90), got sm100",
        "flash-attn 4 (flash_attn.cute.interface): no softcap in its varlen backward"])
    assert pick((10, 0), head_dim=192)[0] == "fa2"  # fa4: at most 128 here
    assert pick((12, 0))[0] == "fa2"
    assert pick((8, 0))[0] == "fa2"
    name, rejected = pick((9, 0), head_dim=264)
    assert name is None and len(rejected) == 4 and all("at most" in r or "sm90" in r for r in rejected)
    name, rejected = pick((7, 5))
    assert name is None and all("sm" in r for r in rejected)

    install(FA4)
    assert pick((9, 0)) == ("aten", [
        "flash-attn 3 (flash_attn_interface): not installed",
        "flash-attn 4 (flash_attn.cute.interface): used on Blackwell (sm100/sm110) only, got sm90",
        "flash-attn 2 (flash_attn.flash_attn_interface): not installed"])


def test_backend_picks_per_device_capability(install, monkeypatch):
    install(FA3, FA2)
    monkeypatch.setattr(flash_mod, "_capability", lambda device: (9, 0))
    backend = flash_mod.FlashBackend()
    cuda = torch.device("cuda")
    assert backend.interface_for(device=cuda, head_dim=64) == "fa3"
    assert backend.not_supported_reasons(device=cuda, dtype=torch.bfloat16, head_dim=64, spec=MaskSpec()) == []
    monkeypatch.setattr(flash_mod, "_capability", lambda device: (8, 6))
    assert backend.interface_for(device=cuda, head_dim=64, softcap=True) == "fa2"
    reasons = backend.not_supported_reasons(device=cuda, dtype=torch.bfloat16, head_dim=12, spec=MaskSpec())
    assert len(reasons) == 4 and "flash-attn 2 (flash_attn.flash_attn_interface): head_dim 12" in reasons[2]


def test_flash_declares_what_it_cannot_run(install):
    install()
    reasons = flash_mod.FlashBackend("aten").not_supported_reasons(
        device=torch.device("cpu"), dtype=torch.float32, head_dim=12, spec=MaskSpec(softcap=2.0))
    text = " | ".join(reasons)
    assert "CUDA" in text and "float16/bfloat16" in text and "multiple of 8" in text and "softcap" in text
    with pytest.raises(ValueError, match="interface must be None or one of"):
        flash_mod.FlashBackend("fa5")


def test_dispatch_names_every_rejected_backend():
    from cp_attention.backends import select_backend

    assert select_backend("auto", device=torch.device("cpu"), dtype=torch.float32, head_dim=16,
                          spec=MaskSpec()).name == "cpu"
    assert select_backend("auto", device=torch.device("cpu"), dtype=torch.float64, head_dim=16,
                          spec=MaskSpec()).name == "reference"
    with pytest.raises(ValueError, match="no attention backend supports these inputs: flash: flash kernels need CUDA"):
        select_backend("flash", device=torch.device("cpu"), dtype=torch.float32, head_dim=16, spec=MaskSpec())


def test_kernel_ops_have_fake_implementations():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k = torch.empty(10, 4, 64, dtype=torch.bfloat16), torch.empty(7, 2, 64, dtype=torch.bfloat16)
        cu = torch.zeros(3, dtype=torch.int32)
        out, lse = flash_mod.flash_varlen_fwd(q, k, k, cu, cu, 5, 4, 0.125, True, -1, 0, 0.0, "fa4")
        dq, dk, dv = flash_mod.flash_varlen_bwd(q, q, k, k, out, lse, cu, cu, 5, 4, 0.125, True, -1, 0, 0.0, "fa3")
    assert out.shape == q.shape and lse.shape == (4, 10) and lse.dtype == torch.float32
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape


# ----------------------------------------------------------------------------------------------
# every kernel call of real windowed plans, through each interface's translation


PLAN_L, PLAN_WINDOW = 8192, 4096
PLAN_DOCUMENTS = {"one document": None, "packed 6 documents": [116, 649, 5131, 987, 621, 688],
                  "packed 3 documents": [1955, 4627, 1610]}


def real_plan_calls():
    """The distinct kernel calls (``cu_seqlens``, causal, window) of every rank's plan for a causal
    layer with window 4096 over L = 8192 tokens: zigzag and contiguous, P = 2 and 4, one document
    and packed documents, each with where it first occurs."""
    from cp_attention.masks import SequenceMeta
    from cp_attention.plan import build_plan

    calls = {}
    for docs_name, docs in PLAN_DOCUMENTS.items():
        cu = None if docs is None else torch.tensor([0] + docs).cumsum(0)
        meta = SequenceMeta.from_inputs(1, PLAN_L, cu_seqlens=cu)
        for layout in ("zigzag", "contiguous"):
            for P in (2, 4):
                for rank in range(P):
                    plan = build_plan(meta, MaskSpec(window=PLAN_WINDOW), world_size=P, layout=layout, rank=rank,
                                      head_kv=1, head_dim=8, itemsize=2)
                    for step in plan.steps():
                        for c in step.calls:
                            key = (tuple(c.cu_seqlens_q.tolist()), tuple(c.cu_seqlens_k.tolist()), c.causal,
                                   c.window)
                            where = f"{layout} P={P} {docs_name}: rank {rank} x K/V of rank {step.source}"
                            calls.setdefault(key, (c, where))
    return list(calls.values())


@pytest.mark.parametrize("interface, modules", [("fa2", FA2), ("aten", {}), ("fa3", FA3), ("fa4", FA4)],
                         ids=["fa2", "aten", "fa3", "fa4"])
def test_real_plan_calls_through_flash_translation(interface, modules, install):
    """Each call runs forward and backward through the flash backend (the stand-in applying the
    kernel's own reading of its window) and through the reference backend with the contract's
    arguments, on the same float16 inputs; any key a kernel would lose or add shows in out, lse or a
    gradient. The calls include those with more queries than ``max_seqlen_k + 1`` and an unlimited
    right side (zigzag, window 4096: a rank's two pieces against the other's halo), which
    FlashAttention-2 reads wrongly unless ``max_seqlen_k`` covers the queries."""
    install(modules)
    backend = flash_mod.FlashBackend(interface)
    calls = real_plan_calls()
    assert len(calls) >= 30 and any(c.max_seqlen_q > c.max_seqlen_k + 1 and c.window[1] < 0 for c, _ in calls)
    wrong = []
    for n, (c, where) in enumerate(calls):
        gen = torch.Generator().manual_seed(n)
        Tq, Tk = int(c.cu_seqlens_q[-1]), int(c.cu_seqlens_k[-1])
        q, dout = (torch.randn(Tq, 2, 8, generator=gen).half() for _ in range(2))
        k, v = (torch.randn(Tk, 1, 8, generator=gen).half() for _ in range(2))
        kw = dict(scale=8 ** -0.5, causal=c.causal, window=c.window)
        args = (c.cu_seqlens_q, c.cu_seqlens_k, c.max_seqlen_q, c.max_seqlen_k)
        out, lse = backend.forward(q, k, v, *args, **kw)
        grads = backend.backward(dout, q, k, v, out, lse, *args, **kw)
        ref_out, ref_lse = REF.forward(q.float(), k.float(), v.float(), *args, **kw)
        ref_grads = REF.backward(dout.float(), q.float(), k.float(), v.float(), ref_out, ref_lse, *args, **kw)
        seen = ~torch.isneginf(ref_lse)
        ok = (torch.equal(torch.isneginf(lse), ~seen) and torch.allclose(lse[seen], ref_lse[seen], atol=1e-3)
              and torch.allclose(out.float(), ref_out, atol=4e-3)
              and all(torch.allclose(g, rg, atol=4e-3) for g, rg in zip(grads, ref_grads)))
        if not ok:
            lost = int((out.float() - ref_out).abs().amax(dim=(1, 2)).gt(4e-3).sum())
            wrong.append(f"{where} (queries {c.max_seqlen_q}, keys {c.max_seqlen_k}, window {c.window}: "
                         f"{lost} rows off)")
    assert not wrong, f"{len(wrong)} of {len(calls)} real plan calls wrong through {interface}: " + "; ".join(wrong)
