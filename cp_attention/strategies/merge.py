"""Pure float math shared by the ring: merging partial attention results and applying sinks.

Legend: ``T`` packed query tokens, ``H`` query heads, ``D`` head dim of the outputs (v's head dim,
which in multi-head latent attention differs from q's and k's: nothing here depends on it).
"""

from __future__ import annotations

import torch

__all__ = ["merge_partials", "merge_into_", "apply_sinks"]


def merge_partials(
    out_a_THD: torch.Tensor, lse_a_HT: torch.Tensor, out_b_THD: torch.Tensor, lse_b_HT: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two attention results over disjoint key sets into the result over their union.

    With ``lse = log(sum(exp(scores)))`` of each part::

        lse = log(exp(lse_a) + exp(lse_b))
        out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

    computed against the larger of the two log-sum-exps so nothing overflows. A row that saw no key
    in either part (both ``lse = -inf``) stays ``out = 0, lse = -inf``; no NaN is produced.
    Inputs may be any float dtype; the result is in the dtype of ``out_a``/``lse_a`` (the ring keeps
    its accumulators in float32, or float64 for float64 inputs). The inputs are not modified
    (:func:`merge_into_` is the in-place form the ring uses).

    Shapes: out (T, H, D), lse (H, T).
    """
    out_THD, lse_HT = out_a_THD.clone(), lse_a_HT.clone()
    merge_into_(out_THD, lse_HT, out_b_THD, lse_b_HT)
    return out_THD, lse_HT


def merge_into_(
    out_a_THD: torch.Tensor, lse_a_HT: torch.Tensor, out_b_THD: torch.Tensor, lse_b_HT: torch.Tensor
) -> None:
    """:func:`merge_partials` written into ``out_a``/``lse_a`` (views are fine), with one temporary
    of ``out_b``'s size instead of three. Shapes: out (T, H, D), lse (H, T)."""
    acc = lse_a_HT.dtype
    lse_b_HT = lse_b_HT.to(acc)
    m_HT = torch.maximum(lse_a_HT, lse_b_HT)
    m_HT = torch.where(torch.isneginf(m_HT), torch.zeros_like(m_HT), m_HT)
    w_a_HT = torch.exp(lse_a_HT - m_HT)
    w_b_HT = torch.exp(lse_b_HT - m_HT)
    total_HT = w_a_HT + w_b_HT
    inv_HT = torch.where(total_HT > 0, 1.0 / total_HT, torch.zeros_like(total_HT))
    lse_a_HT.copy_(m_HT + torch.log(total_HT))
    dtype = out_a_THD.dtype
    w_a_TH1 = (w_a_HT * inv_HT).t().unsqueeze(-1).to(dtype)
    w_b_TH1 = (w_b_HT * inv_HT).t().unsqueeze(-1).to(dtype)
    out_a_THD.mul_(w_a_TH1).add_(out_b_THD.to(dtype) * w_b_TH1)


def apply_sinks(
    out_THD: torch.Tensor, lse_HT: torch.Tensor, sinks_H: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add one value-less logit ``sinks[h]`` per head to the softmax of a merged result.

    ``out * sigmoid(lse - sink)`` rescales the output for the extra softmax mass and the returned
    log-sum-exp ``log(exp(lse) + exp(sink))`` includes it (that is what the backward pass needs).
    Rows that saw no key give ``out = 0``. Shapes: out (T, H, D), lse (H, T), sinks (H,).
    """
    sink_H1 = sinks_H.to(lse_HT.dtype).unsqueeze(1)
    keep_TH1 = torch.sigmoid(lse_HT - sink_H1).t().unsqueeze(-1)
    return out_THD * keep_TH1.to(out_THD.dtype), torch.logaddexp(lse_HT, sink_H1.expand_as(lse_HT))
