"""Document isolation: what happens inside one packed document never reaches another.

For every mask kind (causal, bidirectional, windows, chunks, softcap, sinks, GQA/MQA) with
documents given by ``position_ids`` (two rows) and by ``cu_seqlens``, one victim document gets new
values, NaN or +-Inf in its q, k, v and in the upstream gradient of its rows. Every other token's
output and q/k/v gradients must stay bit-identical (``torch.equal``) and finite, at world sizes 1,
2 and 4 with both layouts (reference backend) and at world sizes 1 and 2 on the Triton kernels
(CPU interpreter, tiny shapes). The sinks' gradient sums over every row, so it is not compared.
The cases and the worker live in ``reliability_workers.py`` (shared with the determinism tests).

Padding: under ``attn_implementation="cp_flash"`` each padding token of a 2D padding mask is a
one-token document; changing the padded tokens' ids or making their embeddings NaN must leave the
real tokens' logits and input gradients bit-identical and finite.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from rank_pool import single_thread
from reliability_workers import VARIANTS, group_report

TRITON = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                            reason="Triton on CPU needs TRITON_INTERPRET=1 set before triton is imported")


def _problems(per_rank: tuple, variant: str) -> list[str]:
    found = []
    for rank, by_layout in enumerate(per_rank):
        for layout, reports in by_layout.items():
            for rep in reports:
                found += [f"{layout} rank {rank} {rep['name']}: {p}" for p in rep["isolation"][variant]]
    return found


def _assert_isolated(per_rank: tuple, variant: str) -> None:
    problems = _problems(per_rank, variant)
    assert not problems, f"{len(problems)} leaks of the victim document ({variant}):\n" + "\n".join(problems[:30])
    if variant == "changed":  # the perturbation reached the victim's own results (the check is not vacuous)
        for layout in per_rank[0]:
            for i, rep in enumerate(per_rank[0][layout]):
                assert sum(r[layout][i]["victim_changed"] for r in per_rank) > 0, (layout, rep["name"])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("world_size", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_victim_document_leaves_others_bit_identical(world_size: int, variant: str):
    _assert_isolated(group_report(world_size, "reference"), variant)


@TRITON
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("world_size", [1, 2])
def test_victim_document_leaves_others_bit_identical_triton(world_size: int, variant: str):
    pytest.importorskip("triton")
    _assert_isolated(group_report(world_size, "triton"), variant)


# ------------------------------------------------------------------------------------------------
# padding tokens under the transformers integration (world size 1)


def _padded_run(model, embeds_BLE: torch.Tensor, mask_BL: torch.Tensor, weight_BLV: torch.Tensor):
    """Logits and the gradient of sum(weight * logits over real tokens) w.r.t. the input embeddings."""
    embeds = embeds_BLE.detach().clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    with single_thread():
        logits = model(inputs_embeds=embeds, attention_mask=mask_BL, use_cache=False).logits
        real = mask_BL.bool()
        (logits[real] * weight_BLV[real]).sum().backward()
    return logits.detach(), embeds.grad


@functools.lru_cache(maxsize=None)
def _padded_batch(family: str):
    """A tiny cp_flash model, a left- and a right-padded row, fixed loss weights, and the baseline."""
    from cp_attention.tools.tiny_models import tiny_model

    model = tiny_model(family, "cp_flash", window=6)
    gen = torch.Generator().manual_seed(5)
    B, L = 2, 24
    ids = torch.randint(3, 128, (B, L), generator=gen)
    mask = torch.ones(B, L, dtype=torch.long)
    mask[0, :5] = 0    # left padding
    mask[1, 17:] = 0   # right padding
    ids[~mask.bool()] = 0
    weight = torch.randn(B, L, model.config.vocab_size, generator=gen)
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)
    logits, grad = _padded_run(model, embeds, mask, weight)
    return model, ids, mask, weight, embeds, logits, grad


@pytest.mark.transformers
@pytest.mark.parametrize("variant", ["changed pad ids", "NaN pad embeddings"])
@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_padding_tokens_leave_real_tokens_bit_identical(family: str, variant: str):
    """Qwen3 (a sliding and a full layer) and Gemma 2 (softcap), world size 1, a left- and a
    right-padded row: new ids or NaN embeddings at the padded positions leave the real tokens'
    logits and embedding gradients bit-identical and finite."""
    pytest.importorskip("transformers")
    model, ids, mask, weight, base_embeds, base_logits, base_grad = _padded_batch(family)
    real, pad = mask.bool(), ~mask.bool()
    assert torch.isfinite(base_logits[real]).all() and torch.isfinite(base_grad[real]).all()
    if variant == "changed pad ids":
        other_ids = ids.clone()
        other_ids[pad] = torch.randint(3, 128, (int(pad.sum()),), generator=torch.Generator().manual_seed(6))
        with torch.no_grad():
            embeds = model.get_input_embeddings()(other_ids)
    else:
        embeds = base_embeds.clone()
        embeds[pad] = float("nan")
    logits, grad = _padded_run(model, embeds, mask, weight)
    assert not torch.equal(base_logits[pad], logits[pad])  # the padded positions themselves did change
    problems = [f"real-token {name} differ in {int((a[real] != b[real]).sum())} values "
                f"({int((~torch.isfinite(b[real])).sum())} not finite)"
                for name, a, b in (("logits", base_logits, logits), ("embedding grad", base_grad, grad))
                if not torch.equal(a[real], b[real])]
    assert not problems, f"{variant}: " + "; ".join(problems)
