"""Testing and demo utility, not part of the stable API: tiny random models of every mask-bearing
transformers family (for the probe, examples and tests).

``tiny_config(family, window=W, chunk=C)`` gives hidden size <= 128 and 2-4 layers, with sliding
windows of ``W`` tokens (chunks of ``C`` for Llama 4) on the family's own mix of layer types.
Weights are random; nothing is downloaded.
"""

from __future__ import annotations

import copy

import torch

__all__ = ["FAMILIES", "tiny_config", "tiny_model", "is_causal_lm"]

FAMILIES = ("qwen3", "mistral", "ministral", "gemma2", "gemma3", "gpt_oss", "llama4", "cohere2", "olmo3",
            "phi3", "modernbert", "qwen2_moe", "phimoe")


def is_causal_lm(family: str) -> bool:
    return family != "modernbert"


def _alternating(n: int) -> list[str]:
    """``n`` layer types, sliding window and full attention in turn (sliding first)."""
    return (["sliding_attention", "full_attention"] * n)[:n]


def tiny_config(family: str, *, window: int = 16, chunk: int = 16, vocab: int = 128, layers: int | None = None):
    """A tiny config of ``family`` (see FAMILIES) whose masks use ``window``/``chunk`` tokens."""
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, attention_dropout=0.0,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "qwen3":
        n = layers or 2
        return tf.Qwen3Config(**common, num_hidden_layers=n, use_sliding_window=True, sliding_window=window,
                              max_window_layers=0, layer_types=_alternating(n))
    if family == "mistral":
        return tf.MistralConfig(**common, num_hidden_layers=layers or 2, sliding_window=window)
    if family == "ministral":
        n = layers or 2
        return tf.MinistralConfig(**common, num_hidden_layers=n, sliding_window=window, layer_types=_alternating(n))
    if family == "gemma2":
        n = layers or 2
        return tf.Gemma2Config(**common, num_hidden_layers=n, sliding_window=window, query_pre_attn_scalar=16,
                               attn_logit_softcapping=5.0, final_logit_softcapping=30.0,
                               layer_types=_alternating(n))
    if family == "gemma3":
        n = layers or 3
        types = ["sliding_attention"] * (n - 1) + ["full_attention"]  # the 5:1 pattern, shortened
        return tf.Gemma3TextConfig(**common, num_hidden_layers=n, sliding_window=window, query_pre_attn_scalar=16,
                                   layer_types=types)
    if family == "gpt_oss":
        n = layers or 2
        cfg = dict(common, intermediate_size=64)
        return tf.GptOssConfig(**cfg, num_hidden_layers=n, sliding_window=window, num_local_experts=4,
                               num_experts_per_tok=2, layer_types=_alternating(n))
    if family == "llama4":
        n = layers or 4
        return tf.Llama4TextConfig(**dict(common, intermediate_size_mlp=128), num_hidden_layers=n,
                                   attention_chunk_size=chunk, num_local_experts=2, num_experts_per_tok=1,
                                   interleave_moe_layer_step=1, no_rope_layers=[1, 1, 1, 0][:n] if n == 4 else None,
                                   use_qk_norm=True)
    if family == "cohere2":
        n = layers or 2
        return tf.Cohere2Config(**common, num_hidden_layers=n, sliding_window=window, layer_types=_alternating(n))
    if family == "olmo3":
        n = layers or 2
        return tf.Olmo3Config(**common, num_hidden_layers=n, sliding_window=window, layer_types=_alternating(n))
    if family == "phi3":
        cfg = {k: v for k, v in common.items() if k != "head_dim"}
        return tf.Phi3Config(**cfg, num_hidden_layers=layers or 2, sliding_window=None)
    if family == "modernbert":
        n = layers or 3
        return tf.ModernBertConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_hidden_layers=n, local_attention=2 * (window - 1), global_attn_every_n_layers=3,
                                   max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                   cls_token_id=1, sep_token_id=2, attention_dropout=0.0,
                                   embedding_dropout=0.0, mlp_dropout=0.0)
    if family == "qwen2_moe":  # the window lives only in the mask (the attention passes none)
        n = layers or 2
        return tf.Qwen2MoeConfig(**common, num_hidden_layers=n, use_sliding_window=True, sliding_window=window,
                                 max_window_layers=0, layer_types=_alternating(n), num_experts=4,
                                 num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    if family == "phimoe":  # a window on every layer, only in the mask
        cfg = {k: v for k, v in common.items() if k != "head_dim"}
        return tf.PhimoeConfig(**cfg, num_hidden_layers=layers or 2, sliding_window=window, num_local_experts=4,
                               num_experts_per_tok=2)
    raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES}")


def tiny_model(family: str, attn_implementation: str, *, seed: int = 0, config=None, **config_kw):
    """A float32 model of ``family`` with random weights drawn from ``seed`` (same weights for every
    ``attn_implementation``), in eval mode. The config is copied: transformers' from_config mutates
    the config it is given."""
    import transformers as tf

    cfg = copy.deepcopy(config if config is not None else tiny_config(family, **config_kw))
    auto = tf.AutoModelForCausalLM if is_causal_lm(family) else tf.AutoModelForMaskedLM
    torch.manual_seed(seed)
    model = auto.from_config(cfg, attn_implementation=attn_implementation, dtype=torch.float32)
    return model.eval()
