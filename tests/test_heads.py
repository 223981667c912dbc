"""Heads under context parallelism (cp_attention.integrations.heads): what a head would compute from a
rank's shard alone is refused before the forward, alike on every rank; the heads that are exact run.

Two gloo ranks, tiny random models. The refusals' ground truth is the heads' documented semantics:
a sequence classifier pools the last non-padding token of the row (one rank holds it), QA positions
index the whole sequence, a loss that is a mean over the tokens a head is given averages per rank,
``logits_to_keep`` keeps the sequence's last tokens."""

from __future__ import annotations

import torch

from cp_attention.tools.launch import run_ranks

L = 32


def _mistral(cls_name: str, **extra):
    import transformers as tf

    config = tf.MistralConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, pad_token_id=0,
                              num_labels=3, **extra)
    torch.manual_seed(0)
    return getattr(tf, cls_name)(config).to(torch.float32), config


def _modernbert_mlm(impl: str):
    import transformers as tf

    config = tf.ModernBertConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                 num_hidden_layers=2, local_attention=8, global_attn_every_n_layers=2,
                                 pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
    torch.manual_seed(0)
    return tf.ModernBertForMaskedLM._from_config(config, attn_implementation=impl).to(torch.float32)


def _bert_mlm():
    import transformers as tf

    config = tf.BertConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                           num_hidden_layers=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return tf.BertForMaskedLM._from_config(config, attn_implementation="cp_flash")


def _ids():
    return torch.randint(3, 96, (1, L), generator=torch.Generator().manual_seed(4))


def _mlm_labels(ids):
    labels = torch.full_like(ids, -100)
    labels[0, 2:6] = ids[0, 2:6]  # uneven: every masked token on rank 0's first slice
    return labels


def _outcome(fn) -> str:
    try:
        fn()
        return "ran"
    except (NotImplementedError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"


def _worker(rank: int, world_size: int):
    import cp_attention

    ids = _ids()
    out = {}

    def run(model, shard_kw: dict, **call_kw):
        model.config._attn_implementation = "cp_flash"
        with cp_attention.context_parallel() as cp:
            batch = cp.shard_batch(**shard_kw)
            return model(**batch, **call_kw)

    seq, _ = _mistral("MistralForSequenceClassification")
    out["sequence"] = _outcome(lambda: run(seq, dict(input_ids=ids)))
    qa, _ = _mistral("MistralForQuestionAnswering")
    out["qa positions"] = _outcome(lambda: run(qa, dict(input_ids=ids), start_positions=torch.tensor([3]),
                                               end_positions=torch.tensor([20])))
    out["qa logits"] = _outcome(lambda: run(qa, dict(input_ids=ids)))
    tok, _ = _mistral("MistralForTokenClassification")
    out["token labels"] = _outcome(lambda: run(tok, dict(input_ids=ids, labels=ids % 3, shift_labels=False)))
    lm, _ = _mistral("MistralForCausalLM")
    out["logits_to_keep"] = _outcome(lambda: run(lm, dict(input_ids=ids), logits_to_keep=1))
    out["causal"] = _outcome(lambda: run(lm, dict(input_ids=ids, labels=ids), use_cache=False))

    def hand_set(value):
        lm.config._attn_implementation = "cp_flash"
        with cp_attention.context_parallel() as cp:
            batch = cp.shard_batch(input_ids=ids, labels=ids)
            if value is not None:
                batch["num_items_in_batch"] = value
            return lm(**batch, use_cache=False)

    out["num_items bound"] = _outcome(lambda: hand_set(None))
    out["num_items by hand"] = _outcome(lambda: hand_set(torch.tensor(float(L - 1))))
    out["bert mlm labels"] = _outcome(lambda: run(_bert_mlm(), dict(input_ids=ids, labels=_mlm_labels(ids),
                                                                  shift_labels=False)))
    mlm = _modernbert_mlm("cp_flash")
    with cp_attention.context_parallel() as cp:
        loss = mlm(**cp.shard_batch(input_ids=ids, labels=_mlm_labels(ids), shift_labels=False)).loss
    out["modernbert mlm loss"] = float(loss.detach())
    return out


def test_heads_refused_or_exact_under_cp():
    per_rank = run_ranks(2, _worker, timeout=600)
    assert per_rank[0] == {k: v for k, v in per_rank[1].items() if k != "modernbert mlm loss"} | {
        "modernbert mlm loss": per_rank[0]["modernbert mlm loss"]}  # every refusal alike on both ranks
    r = per_rank[0]
    assert r["sequence"].startswith("NotImplementedError") and "one token of each row" in r["sequence"], r
    assert r["qa positions"].startswith("NotImplementedError") and "start_positions" in r["qa positions"], r
    assert r["qa logits"] == "ran", r  # per-token logits, no positions: each rank's own tokens
    assert r["token labels"].startswith("NotImplementedError") and "mean of its loss" in r["token labels"], r
    assert r["bert mlm labels"].startswith("NotImplementedError") and "mean of its loss" in r["bert mlm labels"], r
    assert r["logits_to_keep"].startswith("NotImplementedError") and "logits_to_keep=1" in r["logits_to_keep"], r
    assert r["causal"] == "ran" and r["num_items bound"] == "ran", r
    assert r["num_items by hand"].startswith("ValueError") and "binds 15.5" in r["num_items by hand"], r
    # ModernBERT's masked-LM loss divides by the batch's label count: mean over ranks == one device
    ids = _ids()
    ref = _modernbert_mlm("eager")(input_ids=ids, labels=_mlm_labels(ids)).loss
    got = (per_rank[0]["modernbert mlm loss"] + per_rank[1]["modernbert mlm loss"]) / 2
    assert abs(got - float(ref)) <= 1e-5 * abs(float(ref)), (got, float(ref))
