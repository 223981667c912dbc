"""What a user can see and choose: the ``cp_attention`` logger, per-forward plan statistics of a
``cp_flash`` model, the backend of a context, ``attention(mask=MaskSpec)``, and the Triton
interpreter's refusal of bfloat16."""

from __future__ import annotations

import logging

import pytest
import torch

import cp_attention
from cp_attention.backends import select_backend
from cp_attention.tools.tiny_models import tiny_model


def _qkv(L=24, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, L, h, 8, generator=g, dtype=dtype) for h in (4, 2, 2)]


def test_logger_names_backend_plan_and_traffic(caplog):
    q, k, v = _qkv()
    with caplog.at_level(logging.DEBUG, logger="cp_attention"):
        with cp_attention.context_parallel(layout="contiguous", backend="reference"):
            cp_attention.attention(q, k, v, window=5)
            cp_attention.attention(q, k, v, window=5)
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("cp_attention")]
    assert any("backend 'reference'" in m for m in messages), messages
    assert any(m.startswith("plan built in") and "contiguous" in m for m in messages), messages
    assert any(m.startswith("plan reused") for m in messages), messages
    assert any("kernel calls" in m and "K/V sent" in m for m in messages), messages
    infos = [r for r in caplog.records if r.levelno == logging.INFO and r.name.startswith("cp_attention")]
    assert all("context parallelism over 1 rank(s), contiguous layout" in r.getMessage() for r in infos)


@pytest.mark.transformers
def test_forward_plan_stats_of_a_cp_flash_model_at_world_size_1():
    model = tiny_model("qwen3", "cp_flash", window=6, layers=3).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(3, 128, (1, 20))
    for _ in range(2):  # a second forward starts a new record; recomputation in backward adds nothing
        model(ids, labels=ids, use_cache=False).loss.backward()
        stats = cp_attention.forward_plan_stats()
        assert [layer for layer, _ in stats] == [0, 1, 2]
        assert all(s.world_size == 1 and s.entries_visible > 0 for _, s in stats)
        assert cp_attention.last_plan_stats() is stats[-1][1]
    # layer 0 is a 6-token sliding window: fewer visible pairs than the full layer 1
    assert stats[0][1].entries_visible < stats[1][1].entries_visible


@pytest.mark.transformers
def test_context_backend_reaches_cp_flash_layers(caplog):
    model = tiny_model("mistral", "cp_flash", window=6)
    ids = torch.randint(3, 128, (1, 12))
    with torch.no_grad(), caplog.at_level(logging.DEBUG, logger="cp_attention"):
        with cp_attention.context_parallel(backend="triton") as cp:  # Triton's interpreter (tests/conftest.py)
            got = model(**cp.shard_batch(input_ids=ids)).logits
    assert any("backend 'triton'" in r.getMessage() for r in caplog.records)
    want = tiny_model("mistral", "eager", window=6)(ids).logits
    assert (got - want).abs().max() < 1e-4
    with pytest.raises(ValueError, match="backend must be"):
        cp_attention.context_parallel(backend="nope").__enter__()


def test_attention_accepts_a_maskspec():
    q, k, v = _qkv(dtype=torch.float64)
    spec = cp_attention.MaskSpec(causal=True, window=5, chunk_size=8, softcap=3.0)
    a = cp_attention.attention(q, k, v, mask=spec)
    b = cp_attention.attention(q, k, v, window=5, chunk_size=8, softcap=3.0)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="either as mask="):
        cp_attention.attention(q, k, v, mask=spec, window=5)
    with pytest.raises(TypeError, match="MaskSpec"):
        cp_attention.attention(q, k, v, mask={"window": 5})


def test_triton_interpreter_refuses_bfloat16():
    with pytest.raises(ValueError, match="bfloat16 is wrong under Triton's CPU interpreter"):
        select_backend("triton", device=torch.device("cpu"), dtype=torch.bfloat16, head_dim=16,
                       spec=cp_attention.MaskSpec())


def test_flash_backend_names_its_interface_in_the_logs(caplog):
    from cp_attention.backends.flash import FlashBackend

    backend = FlashBackend()  # a fresh instance: its interface choice is logged when first made
    with caplog.at_level(logging.DEBUG, logger="cp_attention"):
        text = backend.describe(device=torch.device("cpu"), dtype=torch.float16, head_dim=64,
                                spec=cp_attention.MaskSpec())
    assert text.startswith("flash via ") or text == "flash (no interface fits)"
    assert any(r.getMessage().startswith("flash interface for capability") for r in caplog.records)
