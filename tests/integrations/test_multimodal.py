"""Masks and inputs a vision-language model builds itself, under cp_flash (issue 33).

* The engine's bidirectional spans (``MaskSpec.spans``): every plan verified token by token, and the
  single-device op against a dense float64 oracle written from the documented semantics (a query
  sees what causal, window and documents allow, plus the later keys of its span).
* Gemma 3 and Gemma 4 with images at world size 1 (no context): the image blocks transformers'
  mask opens are probed and kept; against the family's own eager (logits and gradients).
* Under context parallelism (2 and 4 gloo ranks): ``cp.shard_batch(**processor_output, model=model)``
  runs the model's front-end on the full batch and shards the text decoder's inputs: Gemma 3, Gemma 4
  (image blocks, per-layer inputs), Qwen2.5-VL (M-RoPE positions), Qwen3-VL (M-RoPE and deepstack
  features), LLaVA, against one-device eager; a vision tower run inside the block is refused.
Each rule is checked by planting its bug: the test of a rule also shows the result is wrong without it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cp_attention
from cp_attention.engine import local as compiled
from cp_attention.masks import MaskSpec, SequenceMeta, dense_mask
from cp_attention.plan import build_plan
from cp_attention.tools.launch import run_ranks

import vlm_cases
from hf_cases import TOL, grad_tol

pytestmark = [pytest.mark.multirank, pytest.mark.transformers]  # spawns gloo ranks; builds transformers models


# ----------------------------------------------------------------------------------------------
# the engine


def _meta(rng, B: int, L: int) -> tuple[SequenceMeta, torch.Tensor, torch.Tensor]:
    pos = []
    for _ in range(B):
        p: list[int] = []
        while len(p) < L:
            p += list(range(int(rng.integers(1, L))))
        pos.append(p[:L])
    pos = torch.tensor(pos)
    span_next = torch.from_numpy(rng.random((B, L)) < 0.7)
    return SequenceMeta.from_inputs(B, L, position_ids=pos, span_next=span_next), pos, span_next


def _oracle(q, k, v, mask_BLL):
    """Dense attention from the mask, in q's dtype; a query that sees nothing returns 0."""
    D = q.shape[-1]
    s = torch.einsum("bqhd,bkd->bhqk", q, k[:, :, 0]) * D ** -0.5
    p = torch.softmax(s.masked_fill(~mask_BLL[:, None], float("-inf")), -1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkd->bqhd", p, v[:, :, 0])


def test_span_semantics_by_hand():
    """Tokens 2..4 form a span in a causal row of 6 (window 2): each sees the later tokens of its span."""
    meta = SequenceMeta.from_inputs(1, 6, span_next=torch.tensor([[False, False, True, True, False, False]]))
    assert [(s.tolist(), e.tolist()) for s, e in meta.spans] == [([2], [5])]
    got = dense_mask(meta, MaskSpec(window=2, spans=True))[0].int().tolist()
    assert got == [[1, 0, 0, 0, 0, 0],
                   [1, 1, 0, 0, 0, 0],
                   [0, 1, 1, 1, 1, 0],
                   [0, 0, 1, 1, 1, 0],
                   [0, 0, 0, 1, 1, 0],   # the window still bounds earlier keys of the span
                   [0, 0, 0, 0, 1, 1]]
    assert dense_mask(meta, MaskSpec(window=2))[0, 2, 4].item() is False  # the layer's flag decides
    cut = SequenceMeta.from_inputs(1, 6, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]),
                                   span_next=torch.tensor([[False, False, True, True, False, False]]))
    assert [(s.tolist(), e.tolist()) for s, e in cut.spans] == [([3], [5])]  # no span across a document start


def test_span_plans_verified_and_exact():
    """Random packed rows with spans: every rank's plan (P = 1..4, zigzag and contiguous, causal,
    windowed and bidirectional-windowed) verified pair by pair against the mask, and the single-device
    op's output and gradients equal the dense float64 oracle."""
    rng = np.random.default_rng(0)
    for trial in range(12):
        L, B = int(rng.integers(12, 60)), int(rng.integers(1, 3))
        meta, pos, span_next = _meta(rng, B, L)
        for causal, window in [(True, None), (True, 3), (False, 4)]:
            spec = MaskSpec(causal=causal, window=window, spans=True)
            for P in (1, 2, 3, 4):
                for layout in ("zigzag", "contiguous"):
                    for r in range(P):
                        build_plan(meta, spec, world_size=P, layout=layout, rank=r, head_kv=1, head_dim=1, itemsize=1,
                                   verify=True)
            q = torch.randn(B, L, 2, 4, dtype=torch.float64, requires_grad=True)
            k, v = (torch.randn(B, L, 1, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
            out = compiled.local_attention(q, k, v, spec, position_ids=pos, span_next=span_next, backend="reference")
            ref = _oracle(q, k, v, dense_mask(meta, spec))
            torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
            g = torch.randn_like(out)
            for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
                torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


def test_span_term_is_planned(monkeypatch):
    """Planted: without the span term the plans miss visible pairs (verification fails)."""
    rng = np.random.default_rng(1)
    meta, _, _ = _meta(rng, 1, 40)
    monkeypatch.setattr(MaskSpec, "span_band", lambda self: None)
    with pytest.raises(AssertionError, match="plan verification"):
        for r in range(2):
            build_plan(meta, MaskSpec(spans=True), world_size=2, layout="zigzag", rank=r, head_kv=1, head_dim=1,
                       itemsize=1, verify=True)


# ----------------------------------------------------------------------------------------------
# one device


def test_span_shape_checked_against_the_mask_function():
    """check_spans reads a span's corners from the mask function, row by row: a block overlay passes
    (under a window too), a chain (each token sees only the next), a block in the wrong row, or a
    window the overlay ignores are refused."""
    from cp_attention.integrations.hf.overlays import check_spans

    spans = {0: [(2, 5)], 1: [(1, 3), (6, 7)]}  # row -> (first, last) tokens of its spans
    span_next = torch.zeros(2, 9, dtype=torch.bool)
    for b, pairs in spans.items():
        for s, e in pairs:
            span_next[b, s:e] = True

    def function(shape="block", window=None, rows=spans):
        def mask(b, h, q, k):
            out = []
            for bi, qi, ki in zip(b.tolist(), q.tolist(), k.tolist()):
                seen = ki <= qi
                for s, e in rows.get(bi, []):
                    if s <= qi <= e and s <= ki <= e and (shape == "block" or ki <= qi + 1):
                        seen = True
                if window is not None and qi - ki >= window:
                    seen = False
                out.append(seen)
            return torch.tensor(out)
        return mask

    check_spans(function(), span_next, None, "t")
    check_spans(function(window=3), span_next, 3, "t")
    for bad, window in ((function("chain"), None), (function(rows={0: spans[1], 1: spans[0]}), None),
                        (function(), 3)):
        with pytest.raises(NotImplementedError, match="opens later keys"):
            check_spans(bad, span_next, window, "t")


def _assert_exact(got, ref, where: str):
    (logits, grads), (ref_logits, ref_grads) = got, ref
    err = (logits - ref_logits).abs().max().item()
    gerr = (grads - ref_grads).abs().max().item()
    assert err <= TOL and gerr <= grad_tol(ref_grads.abs().max().item()), (where, err, gerr)
    return err, gerr


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_image_blocks_at_world_size_1(family, monkeypatch):
    """Gemma 3 / Gemma 4 with two images: cp_flash without a context equals the family's eager (its
    image tokens see each other inside the causal row). Planted: the span dropped, it does not."""
    ref = vlm_cases.reference(family)
    _assert_exact(vlm_cases.run_one_device(family, "cp_flash"), ref, f"{family}, world size 1")
    monkeypatch.setattr(MaskSpec, "span_band", lambda self: None)
    monkeypatch.setenv("CP_ATTENTION_VERIFY_PLANS", "0")  # (verification would catch it as well)
    compiled.LOCAL_PLANS.clear()  # plans are cached by content: the planted run must plan anew
    logits, _ = vlm_cases.run_one_device(family, "cp_flash")
    compiled.LOCAL_PLANS.clear()
    assert (logits - ref[0]).abs().max().item() > 1e-3


# ----------------------------------------------------------------------------------------------
# context parallelism


def _cp_worker(rank, world_size, families, layout, plant):
    import torch.distributed as dist

    torch.set_num_threads(1)
    if plant == "no-deepstack":  # the decoder gets only what the shard computes
        from cp_attention.integrations.hf import multimodal
        multimodal.NOT_INJECTED = multimodal.NOT_INJECTED | {"deepstack_visual_embeds", "visual_pos_masks"}
    results = {}
    for family in families:
        m = vlm_cases.model(family, "cp_flash")
        full, R = vlm_cases.batch(family)
        with cp_attention.context_parallel(layout=layout) as cp:
            local = cp.shard_batch(**full, model=m)
            assert "input_ids" not in local and "inputs_embeds" in local
            out = m(**local, use_cache=False)
            (out.logits * cp.shard(R, dim=1)).sum().backward()
            logits = cp.gather(out.logits.detach(), dim=1)
        grads = vlm_cases.flat_grads(m)
        dist.all_reduce(grads)  # each rank's gradient is its tokens' share: the sum is the model's
        results[family] = (logits.numpy(), grads.numpy())  # numpy: torch tensors travel by shared files
    if plant is None:  # the images handed to the model itself inside the block: its tower is refused
        m = vlm_cases.model("llava", "cp_flash")
        full, _ = vlm_cases.batch("llava")
        with cp_attention.context_parallel(layout=layout) as cp:
            local = cp.shard_batch(input_ids=full["input_ids"])
            try:
                m(**local, pixel_values=full["pixel_values"], use_cache=False)
                results["tower"] = "ran"
            except ValueError as exc:  # (media_handed_to_the_model: before the tower's own refusal)
                results["tower"] = str(exc)
        # Gemma 3's token types sharded without model=: its image blocks were not read, every rank refuses
        m = vlm_cases.model("gemma3", "cp_flash")
        full, _ = vlm_cases.batch("gemma3")
        text = {k: v for k, v in full.items() if not k.startswith("pixel")}
        with cp_attention.context_parallel(layout=layout) as cp:
            local = cp.shard_batch(**text)
            try:
                m(**local, use_cache=False)
                results["unread"] = "ran"
            except ValueError as exc:
                results["unread"] = str(exc)
    return results


FAMILIES = ("gemma3", "gemma4", "qwen2_5_vl", "qwen3_vl", "llava")


@pytest.mark.parametrize("world_size, layout, families", [
    (2, "zigzag", FAMILIES),
    pytest.param(4, "contiguous", ("gemma3", "gemma4"), marks=pytest.mark.slow),  # P = 4: with the slow suite
])
def test_vision_language_models_under_cp(world_size, layout, families):
    """Images through cp.shard_batch(..., model=model): logits and gradients equal one-device eager."""
    refs = {f: vlm_cases.reference(f) for f in families}
    per_rank = run_ranks(world_size, _cp_worker, families, layout, None, timeout=600)
    for rank, results in enumerate(per_rank):
        for family in families:
            got = tuple(torch.from_numpy(x) for x in results[family])
            _assert_exact(got, refs[family], f"{family}, CP = {world_size} {layout}, rank {rank}")
        assert "pixel_values" in results["tower"] and "cp.shard_batch(**processor_output, model=model)" in \
            results["tower"], results["tower"]
        assert "did not read them" in results["unread"] and "model=" in results["unread"], results["unread"]


def test_deepstack_features_reach_the_shards():
    """Planted: Qwen3-VL's deepstack features not handed to the sharded decoder: the logits differ."""
    ref = vlm_cases.reference("qwen3_vl")
    results = run_ranks(2, _cp_worker, ("qwen3_vl",), "zigzag", "no-deepstack", timeout=600)[0]
    assert (torch.from_numpy(results["qwen3_vl"][0]) - ref[0]).abs().max().item() > 1e-3


def test_processor_output_without_the_model_says_how():
    """A processor's output handed to shard_batch without model=: a ValueError naming the inputs and the fix."""
    full, _ = vlm_cases.batch("qwen2_5_vl")
    with cp_attention.context_parallel() as cp:
        with pytest.raises(ValueError, match=r"image_grid_thw, pixel_values are a multimodal.*model=model"):
            cp.shard_batch(**full)


def test_window_overlays_and_spans_past_the_window_are_refused():
    """One device: a mask showing keys at the window's distance (an overlay OR-ed over the window) is
    refused, a plain sliding window passes. Under CP: an image block longer than the window is refused
    (its composition with the window is not read from a shard), one that fits passes."""
    from types import SimpleNamespace

    from cp_attention.integrations.hf.masks import CPMask, _refuse_spans_past_window

    def sliding(window, overlay=False):
        return lambda b, h, q, k: (k <= q) & ((q - k < window) | overlay)

    for overlay in (False, True):
        info = CPMask(2, 12, 12, 0, 0, None, None, mask_function=sliding(4, overlay))
        if overlay:
            with pytest.raises(NotImplementedError, match="4 or more positions back"):
                info.check_window(4)
        else:
            info.check_window(4)
    meta = SequenceMeta.from_inputs(1, 12, span_next=torch.tensor([[False, True, True, True, False] + [False] * 7]))
    batch = SimpleNamespace(meta=meta)  # one span of 4 tokens (1..4)
    _refuse_spans_past_window(batch, 4, "t")
    with pytest.raises(NotImplementedError, match="span .* of 4 tokens is longer than a sliding window of 3"):
        _refuse_spans_past_window(batch, 3, "t")


@pytest.mark.parametrize("padded", [False, True])
def test_window_cut_read_from_the_mask_structure(monkeypatch, padded):
    """Under CP the block overlay's composition with a sliding window is read from the function's
    structure: transformers' own compositions (Gemma 3's AND(window, OR(causal, block)), Gemma
    4-unified's OR(sliding causal, block), a full layer's OR(causal, block)), each with a block of 4
    longer than a window of 3, against the function's own answer (does the block's last token see its
    first?), computed on the whole sequence as one device sees it."""
    from transformers import Gemma3TextConfig
    from transformers import masking_utils as mu

    from cp_attention.integrations.hf.overlays import overlay_structure

    got = []
    monkeypatch.setitem(mu.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, "capture",
                        lambda **kw: got.append(kw["mask_function"]))
    config = Gemma3TextConfig(sliding_window=3, num_hidden_layers=1)
    config._attn_implementation = "capture"
    blocks = torch.full((1, 12), -1)
    blocks[0, 5:9] = 0  # one block of 4 tokens
    import inspect

    cache = "cache" if "cache" in inspect.signature(mu.create_causal_mask).parameters else "past_key_values"  # 5.17
    common = dict(config=config, inputs_embeds=torch.zeros(1, 12, 8), **{cache: None},
                  attention_mask=torch.ones(1, 12, dtype=torch.bool) if padded else None,
                  position_ids=torch.arange(12)[None])
    mu.create_causal_mask(**common, or_mask_function=mu.blockwise_overlay(blocks),
                          and_mask_function=mu.sliding_window_overlay(3))
    mu.create_sliding_window_causal_mask(**common, block_sequence_ids=blocks)
    mu.create_causal_mask(**common, block_sequence_ids=blocks)
    assert len(got) == 3
    zero = torch.tensor(0)
    for fn, name in zip(got, ("Gemma 3 sliding", "Gemma 4-unified sliding", "full")):
        found, foreign, windowed, ids = overlay_structure(fn)
        assert found and not foreign and all(t is blocks for t in ids) and ids, name
        assert bool(fn(zero, zero, torch.tensor(5), torch.tensor(8))), name  # a block: its first sees its last
        sees_first = bool(fn(zero, zero, torch.tensor(8), torch.tensor(5)))
        assert windowed == (not sees_first), name


def test_block_overlay_without_blocks_on_a_rank_opens_nothing():
    """Under CP, a batch sharded without model= (no spans read) whose layer mask ORs a block overlay
    with ids of -1 on this rank's tokens (Gemma 4-unified on text) opens no span there; a rank whose
    ids hold a block still reports one (the engine then refuses the batch: spans not read)."""
    from types import SimpleNamespace

    from transformers import masking_utils as mu

    from cp_attention.integrations.hf.masks import CPMask

    batch = SimpleNamespace(cp=SimpleNamespace(world_size=2), spans_read=False, meta=SimpleNamespace(spans=None))
    for has_block in (False, True):
        ids = torch.full((1, 10), -1)
        if has_block:
            ids[0, 2:5] = 0
        fn = mu.or_masks(mu.sliding_window_causal_mask_function(4), mu.blockwise_overlay(ids))
        info = CPMask(1, 10, 10, 0, 0, None, None, batch=batch, mask_function=fn)
        assert info.opens_spans(4) is has_block


def _media_worker(rank, world_size, family):
    model = vlm_cases.model(family, "cp_flash").eval()
    full, _ = vlm_cases.batch(family)
    media = {k: v for k, v in full.items() if k != "input_ids"}
    with cp_attention.context_parallel(timeout=120) as cp:
        batch = cp.shard_batch(input_ids=full["input_ids"])  # the text only; the images handed to the model
        try:
            model(**batch, **media)
        except ValueError as exc:
            return str(exc)
    return None


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3"])
def test_images_handed_to_the_model_past_shard_batch_say_what_to_do(family):
    """transformers' own "Image features and image tokens do not match" (or a silent merge at the wrong tokens)
    becomes an error that says to pass the processor's output through cp.shard_batch(..., model=model)."""
    for message in run_ranks(2, _media_worker, family, timeout=300):
        assert message and "pixel_values" in message and "cp.shard_batch(**processor_output, model=model)" in message, \
            message
