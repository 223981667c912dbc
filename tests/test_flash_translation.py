"""The flash backend's argument translation, checked on CPU: the kernels are replaced by stand-ins
that run the reference backend with exactly the arguments the flash kernel would receive (and
flash's conventions: lse = +inf for rows that see nothing)."""

from __future__ import annotations

import pytest
import torch

from cp_attention.backends import flash as flash_mod
from cp_attention.backends.reference import ReferenceBackend
from test_contract import GRID, check_backend_on_case

REF = ReferenceBackend()


def _as_kernel_sees(lse):
    return torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)


def fake_aten_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale,
                      window_size_left, window_size_right):
    assert dropout_p == 0.0 and not return_debug_mask and cu_q.dtype == torch.int32
    out, lse = REF.forward(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, causal=is_causal,
                           window=(window_size_left, window_size_right))
    return out, _as_kernel_sees(lse), None, None, None


def fake_aten_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, rng, unused, *,
                       scale, window_size_left, window_size_right):
    assert not torch.isneginf(lse).any(), "flash expects +inf, not -inf, for rows that see nothing"
    lse = torch.where(torch.isposinf(lse), torch.full_like(lse, float("-inf")), lse)
    dq, dk, dv = REF.backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale=scale, causal=is_causal,
                              window=(window_size_left, window_size_right))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@pytest.fixture
def aten_stand_ins(monkeypatch):
    monkeypatch.setattr(flash_mod, "_aten_flash_forward", fake_aten_forward)
    monkeypatch.setattr(flash_mod, "_aten_flash_backward", fake_aten_backward)


@pytest.mark.parametrize("case", [c for c in GRID if c[5] is None], ids=[c[0] for c in GRID if c[5] is None])
def test_flash_translation_matches_loop_oracle(case, aten_stand_ins):
    check_backend_on_case(flash_mod.FlashBackend(use_flash_attn=False), case, dtypes=((torch.float32, 2e-5),))


def test_kernel_arguments():
    assert flash_mod.kernel_arguments(scale=0.5, causal=True, window=(-1, -1), softcap=None) == dict(
        is_causal=True, window_size_left=-1, window_size_right=0, scale=0.5, softcap=0.0)
    assert flash_mod.kernel_arguments(scale=1.0, causal=False, window=(0, -1), softcap=2.0) == dict(
        is_causal=False, window_size_left=0, window_size_right=-1, scale=1.0, softcap=2.0)
    # an off-diagonal halo block: window (W-2, 0) bottom-right is causal with a left window
    assert flash_mod.kernel_arguments(scale=1.0, causal=False, window=(7, 0), softcap=None)["is_causal"]


def test_flash_attn_signature_adapter():
    def new_style(q, *, window_size_left, window_size_right, softcap, alibi_slopes):
        return (window_size_left, window_size_right, softcap)

    def old_style(q, *, window_size, alibi_slopes):
        return window_size

    assert flash_mod._call_flash_attn(new_style, 1, window_size_left=3, window_size_right=0, softcap=0.0,
                                      alibi_slopes=None) == (3, 0, 0.0)
    assert flash_mod._call_flash_attn(old_style, 1, window_size_left=3, window_size_right=0, softcap=0.0,
                                      alibi_slopes=None) == (3, 0)
    with pytest.raises(ValueError, match="no softcap"):
        flash_mod._call_flash_attn(old_style, 1, window_size_left=3, window_size_right=0, softcap=2.0,
                                   alibi_slopes=None)


def test_flash_declares_what_it_cannot_run():
    from cp_attention.masks import MaskSpec

    reasons = flash_mod.FlashBackend(use_flash_attn=False).not_supported_reasons(
        device=torch.device("cpu"), dtype=torch.float32, head_dim=12, spec=MaskSpec(softcap=2.0))
    text = " | ".join(reasons)
    assert "CUDA" in text and "float16/bfloat16" in text and "multiple of 8" in text and "softcap" in text


def test_dispatch_names_every_rejected_backend():
    from cp_attention.backends import select_backend
    from cp_attention.masks import MaskSpec

    assert select_backend("auto", device=torch.device("cpu"), dtype=torch.float32, head_dim=16,
                          spec=MaskSpec()).name == "reference"
    with pytest.raises(ValueError, match="no attention backend supports these inputs: flash: flash kernels need CUDA"):
        select_backend("flash", device=torch.device("cpu"), dtype=torch.float32, head_dim=16, spec=MaskSpec())
