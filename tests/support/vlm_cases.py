"""Tiny vision-language models with images, for the multimodal tests (built from config classes, random
weights; no hub access). Each case: a model builder, one batch as a processor would give it (input_ids
with the image placeholder tokens, the image tensors, the token types the family reads) and a fixed
random ``R`` (the loss is ``sum(logits * R)``). The ground truth is the family's own eager attention on
one device on the full batch (:func:`reference`); tolerances are ``hf_cases``'.
"""

from __future__ import annotations

import torch

VOCAB = 160


def _gemma3():
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, sliding_window=3, max_position_embeddings=512,
                layer_types=["sliding_attention", "full_attention"])  # a window shorter than its image blocks
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=16,
                  patch_size=4)
    return Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                                       image_token_index=150, boi_token_index=151,
                                                       eoi_token_index=152))


def _gemma4():
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, global_head_dim=16, sliding_window=8, max_position_embeddings=512,
                layer_types=["sliding_attention", "full_attention"], use_bidirectional_attention="vision",
                hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=2, position_embedding_size=64)
    return Gemma4ForConditionalGeneration(Gemma4Config(
        text_config=text, vision_config=vision, audio_config=None, image_token_id=150, boi_token_id=151,
        eoi_token_id=152, video_token_id=153, audio_token_id=154, boa_token_id=155, eoa_token_index=156))


def _qwen_vision(**extra):
    return dict(hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
                temporal_patch_size=2, out_hidden_size=64, **extra)


def _qwen2_5_vl():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0})
    vision = _qwen_vision(depth=1, fullatt_block_indexes=[0], window_size=8)
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=150, video_token_id=151, vision_start_token_id=152,
        bos_token_id=1, eos_token_id=2))


def _qwen3_vl():
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0,
                                 "mrope_interleaved": True})
    vision = _qwen_vision(depth=2, num_position_embeddings=16, deepstack_visual_indexes=[0, 1])
    return Qwen3VLForConditionalGeneration(Qwen3VLConfig(
        text_config=text, vision_config=vision, image_token_id=150, video_token_id=151, vision_start_token_id=152,
        vision_end_token_id=153))


def _llava():
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    text = dict(model_type="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=16, patch_size=4, projection_dim=32)
    return LlavaForConditionalGeneration(LlavaConfig(text_config=text, vision_config=vision, image_token_id=150,
                                                     vision_feature_layer=-1))


BUILDERS = {"gemma3": _gemma3, "gemma4": _gemma4, "qwen2_5_vl": _qwen2_5_vl, "qwen3_vl": _qwen3_vl, "llava": _llava}


def model(family: str, impl: str):
    """The family's tiny model (the same weights for every ``impl``), float32, in training mode."""
    torch.manual_seed(0)
    m = BUILDERS[family]().float()
    m.set_attn_implementation(impl)
    return m.train()


def batch(family: str) -> tuple[dict, torch.Tensor]:
    """(the processor-style full batch, R). Two images per row, one of them where a zigzag or
    contiguous shard boundary cuts it at world size 2 and 4 (L = 40: shards of 20, 10 or 5 tokens)."""
    g = torch.Generator().manual_seed(3)
    L = 48 if family == "llava" else 40
    ids = torch.randint(3, 96, (1, L), generator=g)
    R = torch.randn(1, L, VOCAB, generator=g)
    if family == "llava":  # one image of 16 patch tokens
        ids[0, 5:21] = 150
        return dict(input_ids=ids, pixel_values=torch.randn(1, 3, 16, 16, generator=g)), R
    if family in ("qwen2_5_vl", "qwen3_vl"):
        for start in (8, 20):
            ids[0, start] = 152
            ids[0, start + 1:start + 5] = 150  # a 4 x 4 patch grid merged 2 x 2: 4 tokens
            if family == "qwen3_vl":
                ids[0, start + 5] = 153
        out = dict(input_ids=ids, pixel_values=torch.randn(32, 96, generator=g),
                   image_grid_thw=torch.tensor([[1, 4, 4], [1, 4, 4]]))
        if family == "qwen3_vl":
            out["mm_token_type_ids"] = (ids == 150).long()
        return out, R
    ids[0, 9:13] = 150
    ids[0, 18:22] = 150  # cut by the boundary at 20
    if family == "gemma3":
        return dict(input_ids=ids, pixel_values=torch.randn(2, 3, 16, 16, generator=g),
                    token_type_ids=(ids == 150).long()), R
    xy = torch.stack(torch.meshgrid(torch.arange(4), torch.arange(4), indexing="xy"), -1).reshape(16, 2)
    return dict(input_ids=ids, pixel_values=torch.randn(2, 16, 48, generator=g),
                image_position_ids=xy[None].expand(2, 16, 2).clone(), mm_token_type_ids=(ids == 150).long()), R


def flat_grads(m) -> torch.Tensor:
    return torch.cat([p.grad.flatten() if p.grad is not None else torch.zeros(p.numel()) for p in m.parameters()])


def run_one_device(family: str, impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, parameter gradients of sum(logits * R)) of the full batch on one device, no context."""
    m = model(family, impl)
    full, R = batch(family)
    out = m(**full, use_cache=False)
    (out.logits * R).sum().backward()
    return out.logits.detach(), flat_grads(m)


def reference(family: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The ground truth: the family's eager attention on one device."""
    return run_one_device(family, "eager")
