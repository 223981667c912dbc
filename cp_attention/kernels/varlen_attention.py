"""FlashAttention-2 style Triton kernels for the varlen contract (``backends/base.py``), and their
launchers. No autograd here: ``backends/triton.py`` wraps the launchers.

Layout follows the contract: q (Tq, Hq, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv), out/dout (Tq, Hq, Dv),
lse/delta (Hq, Tq) float32 (float64 for float64 inputs); query head ``h`` reads K/V head
``h // (Hq // Hkv)`` (no repeat). v's head dim ``Dv`` may differ from q's and k's ``D`` (MLA): the
kernels carry both, each padded to its own power of two (``BLOCK_D``, ``BLOCK_DV``).
Masks are bottom-right aligned per sequence: with ``diag = Lk - Lq`` query ``i`` sees key ``j`` when::

    i + diag - left  <=  j  <=  i + diag + right        (and 0 <= j < Lk)

(``left``/``right`` unlimited are passed as a large number; causal means ``right = 0``).

Every program handles one block of rows of one sequence and one head. From the mask bounds of its
first and last row it computes the range of blocks on the other side that it can see, split into
three loops: leading partially masked blocks, fully visible blocks (no mask arithmetic), trailing
partially masked blocks. Blocks outside the range are never loaded.

Legend (tensor-name suffixes): ``M`` rows of a query block (BLOCK_M), ``N`` rows of a key block
(BLOCK_N), ``D`` head dim of q/k (padded to BLOCK_D), ``Dv`` head dim of v/out/dout (padded to
BLOCK_DV), ``T`` packed query rows, ``S`` packed key rows, ``H`` query heads, ``K`` K/V heads.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..masks import accumulation_dtype

__all__ = ["varlen_fwd", "varlen_bwd", "INTERPRET", "SUPPORTED_HEAD_DIMS"]

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)  # any head_dim <= 256 works (padded); these waste nothing


# --------------------------------------------------------------------------------------------------
# Autotune lists. The interpreter gets one small config: tuning there is meaningless and slow.
# --------------------------------------------------------------------------------------------------

def _configs(pairs):
    if INTERPRET:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=1, num_stages=1)]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in pairs]


_FWD_CONFIGS = _configs([(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (64, 32, 4, 2),
                         (32, 32, 4, 2), (16, 16, 2, 1)])
_BWD_CONFIGS = _configs([(64, 64, 4, 2), (64, 128, 8, 2), (128, 64, 8, 2), (32, 64, 4, 2), (32, 32, 4, 1),
                         (16, 16, 2, 1)])
_TUNE_KEY = ("MAXQ_BUCKET", "MAXK_BUCKET", "BLOCK_D", "BLOCK_DV", "HAS_SOFTCAP", "DOT_PREC")


def _prune(configs, named_args, **kwargs):
    """Drop configs whose blocks exceed the sequence-length buckets (keep the smallest if none fit)
    and, for large head dims, the 128x128 tiles that would spill shared memory."""
    args = {**named_args, **kwargs}
    maxq, maxk, d = args["MAXQ_BUCKET"], args["MAXK_BUCKET"], max(args.get("BLOCK_D", 64), args.get("BLOCK_DV", 0))
    kept = [c for c in configs
            if c.kwargs["BLOCK_M"] <= max(16, maxq) and c.kwargs["BLOCK_N"] <= max(16, maxk)
            and not (d >= 256 and c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] > 64 * 64)]
    return kept or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]


def _bucket(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


# --------------------------------------------------------------------------------------------------
# Shared pieces
# --------------------------------------------------------------------------------------------------

@triton.jit
def _sequence(cu_q_ptr, cu_k_ptr, b):
    """Start row (int64) and length (int32) of sequence ``b`` on the query and the key side."""
    q_start = tl.load(cu_q_ptr + b).to(tl.int64)
    Lq = (tl.load(cu_q_ptr + b + 1) - tl.load(cu_q_ptr + b)).to(tl.int32)
    k_start = tl.load(cu_k_ptr + b).to(tl.int64)
    Lk = (tl.load(cu_k_ptr + b + 1) - tl.load(cu_k_ptr + b)).to(tl.int32)
    return q_start, Lq, k_start, Lk


@triton.jit
def _block_ranges(r0, r_last, L_other, diag, left, right, BLOCK: tl.constexpr):
    """For own rows ``r0..r_last`` (inclusive, valid), the blocks of the other side they see:
    partial ``[start, p1_end)``, full ``[p1_end, p2_start)``, partial ``[p2_start, end)``."""
    lo_min = tl.minimum(tl.maximum(r0 + diag - left, 0), L_other)
    lo_max = tl.minimum(tl.maximum(r_last + diag - left, 0), L_other)
    hi_min = tl.minimum(tl.maximum(r0 + diag + right + 1, 0), L_other)
    hi_max = tl.minimum(tl.maximum(r_last + diag + right + 1, 0), L_other)
    start = (lo_min // BLOCK) * BLOCK
    end = tl.where(hi_max > lo_min, hi_max, start)
    full_lo = ((lo_max + BLOCK - 1) // BLOCK) * BLOCK
    full_hi = (hi_min // BLOCK) * BLOCK
    has_full = full_lo < full_hi
    p1_end = tl.where(has_full, full_lo, end)
    p2_start = tl.where(has_full, full_hi, end)
    return start, p1_end, p2_start, end


@triton.jit
def _softcap_scores(s, softcap, HAS_SOFTCAP: tl.constexpr):
    """s -> softcap * tanh(s / softcap) and tanh (portable: tanh(x) = 2 / (1 + exp(-2x)) - 1)."""
    if HAS_SOFTCAP:
        t = 2.0 / (1.0 + tl.exp(-2.0 * (s / softcap))) - 1.0
        return softcap * t, t
    else:
        return s, s


@triton.jit
def _visible_MN(i_M, j_N, Lq, Lk, diag, left, right):
    return ((j_N[None, :] >= i_M[:, None] + diag - left) & (j_N[None, :] <= i_M[:, None] + diag + right)
            & (j_N[None, :] < Lk) & (i_M[:, None] < Lq))


# --------------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------------

@triton.jit
def _fwd_inner(acc_MDv, l_M, m_M, q_MD, k_base, v_base, stride_kn, stride_vn, i_M, offs_d, offs_dv, Lq, Lk, diag,
               left, right, scale, softcap, n_start, n_end,
               MASKED: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr,
               HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, DOT_PREC: tl.constexpr):
    """Online softmax over key blocks ``[n_start, n_end)``; mask arithmetic only when MASKED."""
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM
    dv_ok = offs_dv < HEAD_DIM_V
    for n0 in range(n_start, n_end, BLOCK_N):
        j_N = n0 + offs_n
        n_ok = j_N[:, None] < Lk
        k_ND = tl.load(k_base + j_N[:, None] * stride_kn + offs_d[None, :], mask=n_ok & d_ok[None, :], other=0.0)
        v_NDv = tl.load(v_base + j_N[:, None] * stride_vn + offs_dv[None, :], mask=n_ok & dv_ok[None, :],
                        other=0.0)
        s_MN = tl.dot(q_MD, tl.trans(k_ND), input_precision=DOT_PREC).to(acc_MDv.dtype) * scale
        s_MN, _t = _softcap_scores(s_MN, softcap, HAS_SOFTCAP)
        if MASKED:
            s_MN = tl.where(_visible_MN(i_M, j_N, Lq, Lk, diag, left, right), s_MN, float("-inf"))
        m_new_M = tl.maximum(m_M, tl.max(s_MN, 1))
        m_safe_M = tl.where(m_new_M == float("-inf"), 0.0, m_new_M)
        p_MN = tl.exp(s_MN - m_safe_M[:, None])
        alpha_M = tl.exp(m_M - m_safe_M)
        l_M = l_M * alpha_M + tl.sum(p_MN, 1)
        acc_MDv = acc_MDv * alpha_M[:, None] + tl.dot(p_MN.to(v_NDv.dtype), v_NDv, input_precision=DOT_PREC).to(
            acc_MDv.dtype)
        m_M = m_new_M
    return acc_MDv, l_M, m_M


@triton.autotune(configs=_FWD_CONFIGS, key=list(_TUNE_KEY), prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _fwd_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, cu_q_ptr, cu_k_ptr,
                stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                stride_lh, scale, softcap, left, right, group,
                MAXQ_BUCKET, MAXK_BUCKET,
                HAS_SOFTCAP: tl.constexpr, DOT_PREC: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: query block ``program_id(0)`` of sequence ``program_id(1)``, query head ``program_id(2)``."""
    pid_m, b, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start, Lq, k_start, Lk = _sequence(cu_q_ptr, cu_k_ptr, b)
    m0 = pid_m * BLOCK_M
    if m0 < Lq:
        diag = Lk - Lq
        hk = h // group
        i_M = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        row_ok = i_M < Lq
        q_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
        out_mask = row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V)
        q_MD = tl.load(q_ptr + (q_start + i_M[:, None]) * stride_qt + h * stride_qh + offs_d[None, :],
                       mask=q_mask, other=0.0)
        k_base = k_ptr + k_start * stride_kt + hk * stride_kh
        v_base = v_ptr + k_start * stride_vt + hk * stride_vh
        acc_dtype = tl.float64 if q_MD.dtype == tl.float64 else tl.float32
        acc_MDv = tl.zeros([BLOCK_M, BLOCK_DV], dtype=acc_dtype)
        l_M = tl.zeros([BLOCK_M], dtype=acc_dtype)
        m_M = tl.full([BLOCK_M], float("-inf"), dtype=acc_dtype)
        n_start, p1_end, p2_start, n_end = _block_ranges(m0, tl.minimum(m0 + BLOCK_M, Lq) - 1, Lk, diag,
                                                         left, right, BLOCK_N)
        acc_MDv, l_M, m_M = _fwd_inner(acc_MDv, l_M, m_M, q_MD, k_base, v_base, stride_kt, stride_vt, i_M, offs_d,
                                       offs_dv, Lq, Lk, diag, left, right, scale, softcap, n_start, p1_end,
                                       True, HAS_SOFTCAP, BLOCK_N, HEAD_DIM, HEAD_DIM_V, DOT_PREC)
        acc_MDv, l_M, m_M = _fwd_inner(acc_MDv, l_M, m_M, q_MD, k_base, v_base, stride_kt, stride_vt, i_M, offs_d,
                                       offs_dv, Lq, Lk, diag, left, right, scale, softcap, p1_end, p2_start,
                                       False, HAS_SOFTCAP, BLOCK_N, HEAD_DIM, HEAD_DIM_V, DOT_PREC)
        acc_MDv, l_M, m_M = _fwd_inner(acc_MDv, l_M, m_M, q_MD, k_base, v_base, stride_kt, stride_vt, i_M, offs_d,
                                       offs_dv, Lq, Lk, diag, left, right, scale, softcap, p2_start, n_end,
                                       True, HAS_SOFTCAP, BLOCK_N, HEAD_DIM, HEAD_DIM_V, DOT_PREC)
        live_M = l_M > 0
        out_MDv = acc_MDv / tl.where(live_M, l_M, 1.0)[:, None]
        lse_M = tl.where(live_M, m_M + tl.log(tl.where(live_M, l_M, 1.0)), float("-inf"))
        tl.store(out_ptr + (q_start + i_M[:, None]) * stride_ot + h * stride_oh + offs_dv[None, :],
                 out_MDv.to(out_ptr.dtype.element_ty), mask=out_mask)
        tl.store(lse_ptr + h * stride_lh + q_start + i_M, lse_M.to(lse_ptr.dtype.element_ty), mask=row_ok)


# --------------------------------------------------------------------------------------------------
# Backward: preprocess (delta), dK/dV (loop over query blocks), dQ (loop over key blocks)
# --------------------------------------------------------------------------------------------------

@triton.jit
def _bwd_preprocess(out_ptr, do_ptr, delta_ptr, total_q, stride_ot, stride_oh, stride_dot, stride_doh,
                    stride_dh, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr):
    """delta[h, t] = sum_d dout[t, h, d] * out[t, h, d] in the compute dtype (``HEAD_DIM``: v's head dim)."""
    pid, h = tl.program_id(0), tl.program_id(1)
    t_T = (pid * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (t_T[:, None] < total_q) & (offs_d[None, :] < HEAD_DIM)
    o_TD = tl.load(out_ptr + t_T[:, None] * stride_ot + h * stride_oh + offs_d[None, :], mask=mask, other=0.0)
    do_TD = tl.load(do_ptr + t_T[:, None] * stride_dot + h * stride_doh + offs_d[None, :], mask=mask, other=0.0)
    delta_T = tl.sum(o_TD.to(delta_ptr.dtype.element_ty) * do_TD.to(delta_ptr.dtype.element_ty), 1)
    tl.store(delta_ptr + h * stride_dh + t_T, delta_T, mask=t_T < total_q)


@triton.jit
def _probs(q_MD, k_ND, lse_M, i_M, j_N, Lq, Lk, diag, left, right, scale, softcap,
           MASKED: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DOT_PREC: tl.constexpr, ACC: tl.constexpr):
    """Recompute p = exp(s - lse) (0 where masked or lse = -inf) and tanh for softcap's derivative."""
    s_MN = tl.dot(q_MD, tl.trans(k_ND), input_precision=DOT_PREC).to(ACC) * scale
    s_MN, t_MN = _softcap_scores(s_MN, softcap, HAS_SOFTCAP)
    lse_safe_M = tl.where(lse_M == float("-inf"), float("inf"), lse_M)  # exp(s - inf) = 0
    p_MN = tl.exp(s_MN - lse_safe_M[:, None])
    if MASKED:
        p_MN = tl.where(_visible_MN(i_M, j_N, Lq, Lk, diag, left, right), p_MN, 0.0)
    return p_MN, t_MN


@triton.jit
def _bwd_dkdv_inner(dk_ND, dv_NDv, k_ND, v_NDv, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot,
                    j_N, offs_d, offs_dv, Lq, Lk, diag, left, right, scale, softcap, m_start, m_end,
                    MASKED: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr,
                    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, DOT_PREC: tl.constexpr):
    offs_m = tl.arange(0, BLOCK_M)
    d_ok = offs_d < HEAD_DIM
    dv_ok = offs_dv < HEAD_DIM_V
    for m0 in range(m_start, m_end, BLOCK_M):
        i_M = m0 + offs_m
        row_ok = i_M < Lq
        q_MD = tl.load(q_base + i_M[:, None] * stride_qt + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :],
                       other=0.0)
        do_MDv = tl.load(do_base + i_M[:, None] * stride_dot + offs_dv[None, :],
                         mask=row_ok[:, None] & dv_ok[None, :], other=0.0)
        lse_M = tl.load(lse_base + i_M, mask=row_ok, other=0.0).to(dk_ND.dtype)
        delta_M = tl.load(delta_base + i_M, mask=row_ok, other=0.0).to(dk_ND.dtype)
        p_MN, t_MN = _probs(q_MD, k_ND, lse_M, i_M, j_N, Lq, Lk, diag, left, right, scale, softcap,
                            MASKED, HAS_SOFTCAP, DOT_PREC, dk_ND.dtype)
        dv_NDv += tl.dot(tl.trans(p_MN.to(do_MDv.dtype)), do_MDv, input_precision=DOT_PREC).to(dv_NDv.dtype)
        dp_MN = tl.dot(do_MDv, tl.trans(v_NDv), input_precision=DOT_PREC).to(dk_ND.dtype)
        ds_MN = p_MN * (dp_MN - delta_M[:, None])
        if HAS_SOFTCAP:
            ds_MN = ds_MN * (1.0 - t_MN * t_MN)
        ds_MN = ds_MN * scale
        dk_ND += tl.dot(tl.trans(ds_MN.to(q_MD.dtype)), q_MD, input_precision=DOT_PREC).to(dk_ND.dtype)
    return dk_ND, dv_NDv


@triton.autotune(configs=_BWD_CONFIGS, key=list(_TUNE_KEY), prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, cu_q_ptr, cu_k_ptr,
                     stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                     stride_lh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
                     scale, softcap, left, right, group, MAXQ_BUCKET, MAXK_BUCKET,
                     HAS_SOFTCAP: tl.constexpr, DOT_PREC: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: key block ``program_id(0)`` of sequence ``program_id(1)``, K/V head ``program_id(2)``;
    sums over the ``group`` query heads that share it."""
    pid_n, b, hk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start, Lq, k_start, Lk = _sequence(cu_q_ptr, cu_k_ptr, b)
    n0 = pid_n * BLOCK_N
    if n0 < Lk:
        diag = Lk - Lq
        j_N = n0 + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        k_mask = (j_N[:, None] < Lk) & (offs_d[None, :] < HEAD_DIM)
        v_mask = (j_N[:, None] < Lk) & (offs_dv[None, :] < HEAD_DIM_V)
        k_ND = tl.load(k_ptr + (k_start + j_N[:, None]) * stride_kt + hk * stride_kh + offs_d[None, :],
                       mask=k_mask, other=0.0)
        v_NDv = tl.load(v_ptr + (k_start + j_N[:, None]) * stride_vt + hk * stride_vh + offs_dv[None, :],
                        mask=v_mask, other=0.0)
        acc_dtype = tl.float64 if k_ND.dtype == tl.float64 else tl.float32
        dk_ND = tl.zeros([BLOCK_N, BLOCK_D], dtype=acc_dtype)
        dv_NDv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=acc_dtype)
        # keys see queries i with j - diag - right <= i <= j - diag + left: the same bounds, mirrored.
        m_start, p1_end, p2_start, m_end = _block_ranges(n0, tl.minimum(n0 + BLOCK_N, Lk) - 1, Lq, -diag,
                                                         right, left, BLOCK_M)
        for g in range(group):
            h = hk * group + g
            q_base = q_ptr + q_start * stride_qt + h * stride_qh
            do_base = do_ptr + q_start * stride_dot + h * stride_doh
            lse_base = lse_ptr + h * stride_lh + q_start
            delta_base = delta_ptr + h * stride_lh + q_start
            dk_ND, dv_NDv = _bwd_dkdv_inner(dk_ND, dv_NDv, k_ND, v_NDv, q_base, do_base, lse_base, delta_base,
                                            stride_qt, stride_dot, j_N, offs_d, offs_dv, Lq, Lk, diag, left, right,
                                            scale, softcap, m_start, p1_end, True, HAS_SOFTCAP, BLOCK_M, HEAD_DIM,
                                            HEAD_DIM_V, DOT_PREC)
            dk_ND, dv_NDv = _bwd_dkdv_inner(dk_ND, dv_NDv, k_ND, v_NDv, q_base, do_base, lse_base, delta_base,
                                            stride_qt, stride_dot, j_N, offs_d, offs_dv, Lq, Lk, diag, left, right,
                                            scale, softcap, p1_end, p2_start, False, HAS_SOFTCAP, BLOCK_M, HEAD_DIM,
                                            HEAD_DIM_V, DOT_PREC)
            dk_ND, dv_NDv = _bwd_dkdv_inner(dk_ND, dv_NDv, k_ND, v_NDv, q_base, do_base, lse_base, delta_base,
                                            stride_qt, stride_dot, j_N, offs_d, offs_dv, Lq, Lk, diag, left, right,
                                            scale, softcap, p2_start, m_end, True, HAS_SOFTCAP, BLOCK_M, HEAD_DIM,
                                            HEAD_DIM_V, DOT_PREC)
        tl.store(dk_ptr + (k_start + j_N[:, None]) * stride_dkt + hk * stride_dkh + offs_d[None, :],
                 dk_ND.to(dk_ptr.dtype.element_ty), mask=k_mask)
        tl.store(dv_ptr + (k_start + j_N[:, None]) * stride_dvt + hk * stride_dvh + offs_dv[None, :],
                 dv_NDv.to(dv_ptr.dtype.element_ty), mask=v_mask)


@triton.jit
def _bwd_dq_inner(dq_MD, q_MD, do_MDv, lse_M, delta_M, k_base, v_base, stride_kn, stride_vn, i_M, offs_d, offs_dv,
                  Lq, Lk, diag, left, right, scale, softcap, n_start, n_end,
                  MASKED: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, DOT_PREC: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM
    dv_ok = offs_dv < HEAD_DIM_V
    for n0 in range(n_start, n_end, BLOCK_N):
        j_N = n0 + offs_n
        n_ok = j_N[:, None] < Lk
        k_ND = tl.load(k_base + j_N[:, None] * stride_kn + offs_d[None, :], mask=n_ok & d_ok[None, :], other=0.0)
        v_NDv = tl.load(v_base + j_N[:, None] * stride_vn + offs_dv[None, :], mask=n_ok & dv_ok[None, :],
                        other=0.0)
        p_MN, t_MN = _probs(q_MD, k_ND, lse_M, i_M, j_N, Lq, Lk, diag, left, right, scale, softcap,
                            MASKED, HAS_SOFTCAP, DOT_PREC, dq_MD.dtype)
        dp_MN = tl.dot(do_MDv, tl.trans(v_NDv), input_precision=DOT_PREC).to(dq_MD.dtype)
        ds_MN = p_MN * (dp_MN - delta_M[:, None])
        if HAS_SOFTCAP:
            ds_MN = ds_MN * (1.0 - t_MN * t_MN)
        ds_MN = ds_MN * scale
        dq_MD += tl.dot(ds_MN.to(k_ND.dtype), k_ND, input_precision=DOT_PREC).to(dq_MD.dtype)
    return dq_MD


@triton.autotune(configs=_BWD_CONFIGS, key=list(_TUNE_KEY), prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _bwd_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, cu_q_ptr, cu_k_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                   stride_lh, stride_dqt, stride_dqh,
                   scale, softcap, left, right, group, MAXQ_BUCKET, MAXK_BUCKET,
                   HAS_SOFTCAP: tl.constexpr, DOT_PREC: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: query block ``program_id(0)`` of sequence ``program_id(1)``, query head ``program_id(2)``."""
    pid_m, b, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start, Lq, k_start, Lk = _sequence(cu_q_ptr, cu_k_ptr, b)
    m0 = pid_m * BLOCK_M
    if m0 < Lq:
        diag = Lk - Lq
        hk = h // group
        i_M = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        row_ok = i_M < Lq
        io_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
        q_MD = tl.load(q_ptr + (q_start + i_M[:, None]) * stride_qt + h * stride_qh + offs_d[None, :],
                       mask=io_mask, other=0.0)
        do_MDv = tl.load(do_ptr + (q_start + i_M[:, None]) * stride_dot + h * stride_doh + offs_dv[None, :],
                         mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
        acc_dtype = tl.float64 if q_MD.dtype == tl.float64 else tl.float32
        lse_M = tl.load(lse_ptr + h * stride_lh + q_start + i_M, mask=row_ok, other=0.0).to(acc_dtype)
        delta_M = tl.load(delta_ptr + h * stride_lh + q_start + i_M, mask=row_ok, other=0.0).to(acc_dtype)
        k_base = k_ptr + k_start * stride_kt + hk * stride_kh
        v_base = v_ptr + k_start * stride_vt + hk * stride_vh
        dq_MD = tl.zeros([BLOCK_M, BLOCK_D], dtype=acc_dtype)
        n_start, p1_end, p2_start, n_end = _block_ranges(m0, tl.minimum(m0 + BLOCK_M, Lq) - 1, Lk, diag,
                                                         left, right, BLOCK_N)
        dq_MD = _bwd_dq_inner(dq_MD, q_MD, do_MDv, lse_M, delta_M, k_base, v_base, stride_kt, stride_vt, i_M,
                              offs_d, offs_dv, Lq, Lk, diag, left, right, scale, softcap, n_start, p1_end,
                              True, HAS_SOFTCAP, BLOCK_N, HEAD_DIM, HEAD_DIM_V, DOT_PREC)
        dq_MD = _bwd_dq_inner(dq_MD, q_MD, do_MDv, lse_M, delta_M, k_base, v_base, stride_kt, stride_vt, i_M,
                              offs_d, offs_dv, Lq, Lk, diag, left, right, scale, softcap, p1_end, p2_start,
                              False, HAS_SOFTCAP, BLOCK_N, HEAD_DIM, HEAD_DIM_V, DOT_PREC)
        dq_MD = _bwd_dq_inner(dq_MD, q_MD, do_MDv, lse_M, delta_M, k_base, v_base, stride_kt, stride_vt, i_M,
                              offs_d, offs_dv, Lq, Lk, diag, left, right, scale, softcap, p2_start, n_end,
                              True, HAS_SOFTCAP, BLOCK_N, HEAD_DIM, HEAD_DIM_V, DOT_PREC)
        tl.store(dq_ptr + (q_start + i_M[:, None]) * stride_dqt + h * stride_dqh + offs_d[None, :],
                 dq_MD.to(dq_ptr.dtype.element_ty), mask=io_mask)


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------

def _window_bounds(causal: bool, window: tuple[int, int], max_seqlen_q: int, max_seqlen_k: int) -> tuple[int, int]:
    """(left, right) as plain non-negative ints: unlimited becomes a bound no sequence reaches."""
    unlimited = int(max_seqlen_q) + int(max_seqlen_k) + 1
    left, right = window
    if causal:
        right = 0
    return (unlimited if left < 0 else int(left)), (unlimited if right < 0 else int(right))


def _common(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, softcap):
    Hq, Hkv, D, Dv = q.shape[1], k.shape[1], q.shape[2], v.shape[2]
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of K/V heads ({Hkv})")
    left, right = _window_bounds(causal, window, max_seqlen_q, max_seqlen_k)
    return dict(
        left=left, right=right, group=Hq // Hkv, softcap=float(softcap) if softcap is not None else 1.0,
        MAXQ_BUCKET=_bucket(max_seqlen_q), MAXK_BUCKET=_bucket(max_seqlen_k),
        HAS_SOFTCAP=softcap is not None,
        # "ieee": exact fp32 products (no tf32) for float32 inputs; ignored for 16-bit inputs, and accepted
        # by every Triton backend (AMD rejects "tf32" on some targets).
        DOT_PREC="ieee",
        HEAD_DIM=D, BLOCK_D=max(16, triton.next_power_of_2(D)),
        HEAD_DIM_V=Dv, BLOCK_DV=max(16, triton.next_power_of_2(Dv)),
    ), cu_seqlens_q.shape[0] - 1


def varlen_fwd(q_THD, k_SKD, v_SKDv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
               scale: float, causal: bool, window: tuple[int, int] = (-1, -1), softcap: float | None = None):
    """Forward of the varlen contract.

    q_THD (Tq, Hq, D), k_SKD (Tk, Hkv, D), v_SKDv (Tk, Hkv, Dv), cu_seqlens_q/k (B + 1,) int32 on q's
    device -> out_THDv (Tq, Hq, Dv) in q's dtype, lse_HT (Hq, Tq) float32 (float64 for float64 inputs).
    Bottom-right aligned causal/window mask, e.g. Lq = 3, Lk = 5, causal, window (1, 0)::

        0 0 1 1 0
        0 0 0 1 1
        0 0 0 0 1
    """
    q_THD, k_SKD, v_SKDv = (t if t.stride(-1) == 1 else t.contiguous() for t in (q_THD, k_SKD, v_SKDv))
    Tq, Hq, _ = q_THD.shape
    meta, batch = _common(q_THD, k_SKD, v_SKDv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                          window, softcap)
    out_THDv = torch.zeros((Tq, Hq, v_SKDv.shape[2]), dtype=q_THD.dtype, device=q_THD.device)
    lse_HT = torch.full((Hq, Tq), float("-inf"), dtype=accumulation_dtype(q_THD.dtype), device=q_THD.device)
    if Tq == 0 or batch == 0 or max_seqlen_q == 0:
        return out_THDv, lse_HT
    grid = lambda META: (triton.cdiv(max_seqlen_q, META["BLOCK_M"]), batch, Hq)  # noqa: E731
    _fwd_kernel[grid](
        q_THD, k_SKD, v_SKDv, out_THDv, lse_HT, cu_seqlens_q, cu_seqlens_k,
        q_THD.stride(0), q_THD.stride(1), k_SKD.stride(0), k_SKD.stride(1), v_SKDv.stride(0), v_SKDv.stride(1),
        out_THDv.stride(0), out_THDv.stride(1), lse_HT.stride(0), float(scale), **meta)
    return out_THDv, lse_HT


def varlen_bwd(dout_THDv, q_THD, k_SKD, v_SKDv, out_THDv, lse_HT, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
               max_seqlen_k: int, *, scale: float, causal: bool, window: tuple[int, int] = (-1, -1),
               softcap: float | None = None):
    """Backward of the varlen contract given dout_THDv and the *final* out_THDv (Tq, Hq, Dv) and lse_HT
    (Hq, Tq) of each query row -> dq_THD (Tq, Hq, D), dk_SKD (Tk, Hkv, D), dv_SKDv (Tk, Hkv, Dv), all
    float32 (float64 for float64)."""
    dout_THDv, q_THD, k_SKD, v_SKDv, out_THDv = (t if t.stride(-1) == 1 else t.contiguous()
                                                 for t in (dout_THDv, q_THD, k_SKD, v_SKDv, out_THDv))
    Tq, Hq, _ = q_THD.shape
    acc = accumulation_dtype(q_THD.dtype)
    lse_HT = lse_HT.to(acc).contiguous()
    meta, batch = _common(q_THD, k_SKD, v_SKDv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                          window, softcap)
    dq_THD = torch.zeros(q_THD.shape, dtype=acc, device=q_THD.device)
    dk_SKD = torch.zeros(k_SKD.shape, dtype=acc, device=k_SKD.device)
    dv_SKDv = torch.zeros(v_SKDv.shape, dtype=acc, device=v_SKDv.device)
    if Tq == 0 or k_SKD.shape[0] == 0 or batch == 0 or max_seqlen_q == 0 or max_seqlen_k == 0:
        return dq_THD, dk_SKD, dv_SKDv
    delta_HT = torch.empty((Hq, Tq), dtype=acc, device=q_THD.device)
    BLOCK_T = 16 if INTERPRET else 64
    _bwd_preprocess[(triton.cdiv(Tq, BLOCK_T), Hq)](
        out_THDv, dout_THDv, delta_HT, Tq, out_THDv.stride(0), out_THDv.stride(1), dout_THDv.stride(0),
        dout_THDv.stride(1), delta_HT.stride(0), HEAD_DIM=meta["HEAD_DIM_V"], BLOCK_D=meta["BLOCK_DV"],
        BLOCK_T=BLOCK_T)
    strides = (q_THD.stride(0), q_THD.stride(1), k_SKD.stride(0), k_SKD.stride(1), v_SKDv.stride(0),
               v_SKDv.stride(1), dout_THDv.stride(0), dout_THDv.stride(1), lse_HT.stride(0))
    grid_kv = lambda META: (triton.cdiv(max_seqlen_k, META["BLOCK_N"]), batch, k_SKD.shape[1])  # noqa: E731
    _bwd_dkdv_kernel[grid_kv](
        q_THD, k_SKD, v_SKDv, dout_THDv, lse_HT, delta_HT, dk_SKD, dv_SKDv, cu_seqlens_q, cu_seqlens_k, *strides,
        dk_SKD.stride(0), dk_SKD.stride(1), dv_SKDv.stride(0), dv_SKDv.stride(1), float(scale), **meta)
    grid_q = lambda META: (triton.cdiv(max_seqlen_q, META["BLOCK_M"]), batch, Hq)  # noqa: E731
    _bwd_dq_kernel[grid_q](
        q_THD, k_SKD, v_SKDv, dout_THDv, lse_HT, delta_HT, dq_THD, cu_seqlens_q, cu_seqlens_k, *strides,
        dq_THD.stride(0), dq_THD.stride(1), float(scale), **meta)
    return dq_THD, dk_SKD, dv_SKDv
