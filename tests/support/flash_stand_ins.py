"""Stand-in flash kernels with the upstream signatures, for checking the flash backend's argument
translation on CPU (tests/unit/test_flash_translation.py, tests/integrations/test_mla.py,
tests/tools/test_gpu_check.py).

Each interface's kernels (flash-attn 3: ``hopper/flash_attn_interface.py``; flash-attn 4:
``flash_attn/cute/interface.py``; flash-attn 2: ``flash_attn/flash_attn_interface.py``; PyTorch: the
aten schemas) are replaced by stand-ins that check what they receive as upstream does (float16/bfloat16
inputs of one dtype, float32 raises; int32 ``cu_seqlens``; lse layout (H, T) float32; dq/dk/dv buffers
in the input dtype) and run the reference backend in float32 under that kernel's own conventions (how
it reads its mask arguments, which lse it writes and expects for rows that see no key), returning out
and gradients in the input dtype and lse in float32 as the kernels do. The ``install`` fixture makes
exactly the chosen stand-in modules importable.
"""

from __future__ import annotations

import sys
import types
from typing import Optional

import pytest
import torch

from cp_attention.backends.flash import aten as aten_mod, backend as flash_mod
from cp_attention.backends.reference import ReferenceBackend

REF = ReferenceBackend()
Tensor = torch.Tensor


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


def fa4_modules(fwd, bwd):
    return {"flash_attn": {}, "flash_attn.cute": {},
            "flash_attn.cute.interface": dict(_flash_attn_fwd=fwd, _flash_attn_bwd=bwd)}


FA4 = fa4_modules(fa4_fwd, fa4_bwd)
FA4_TWO_OUTPUTS = fa4_modules(fa4_fwd_two_outputs, fa4_bwd)


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
