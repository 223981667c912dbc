"""Heads under context parallelism (cp_attention.integrations.hf.heads): the heads that read positions of
the sequence are exact (their outputs, loss and gradients equal one-device eager), what a head would
compute from a rank's shard alone is refused before the forward, alike on every rank.

Two gloo ranks, tiny random models. Ground truth: eager on one process, the full rows, as the heads
document it: a sequence classifier pools the last non-padding token of each row (rows padded on the
right and on the left, the pooled tokens on different ranks), QA positions index the whole sequence,
``logits_to_keep`` keeps the sequence's last tokens (or the positions of a tensor), a loss that is a
mean over the tokens a head is given averages per rank."""

from __future__ import annotations

import pytest
import torch

from cp_attention.tools.launch import run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.transformers]  # spawns gloo ranks; builds transformers models

L = 32


def _mistral(cls_name: str, **extra):
    import transformers as tf

    config = tf.MistralConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, pad_token_id=0,
                              num_labels=3, **extra)
    torch.manual_seed(0)  # eval: no dropout (the token head's classifier_dropout would draw per rank)
    return getattr(tf, cls_name)(config).to(torch.float32).eval(), config


def _modernbert_mlm(impl: str):
    import transformers as tf

    config = tf.ModernBertConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                 num_hidden_layers=2, local_attention=8, global_attn_every_n_layers=2,
                                 pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
    torch.manual_seed(0)
    return tf.ModernBertForMaskedLM._from_config(config, attn_implementation=impl).to(torch.float32)


def _deberta_tokens():
    import transformers as tf

    config = tf.DebertaV2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                num_hidden_layers=2, max_position_embeddings=64, num_labels=3)
    torch.manual_seed(0)
    return tf.DebertaV2ForTokenClassification._from_config(config, attn_implementation="cp_flash")


def _bert(cls_name: str):
    import transformers as tf

    config = tf.BertConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                           num_hidden_layers=2, max_position_embeddings=64, num_labels=3)
    torch.manual_seed(0)
    return getattr(tf, cls_name)._from_config(config, attn_implementation="cp_flash")


def _ids():
    return torch.randint(3, 96, (1, L), generator=torch.Generator().manual_seed(4))


def _rows():
    """Two rows: right padding (the last real token, 19, is rank 1's under zigzag) and left padding
    (the last token, 31, is rank 0's)."""
    ids = torch.randint(3, 96, (2, L), generator=torch.Generator().manual_seed(5))
    ids[0, 20:] = 0
    ids[1, :5] = 0
    return ids


def _token_labels():
    labels = torch.full((2, L), -100)
    labels[0, 1:6] = torch.tensor([0, 2, 1, 1, 0])  # uneven: row 0's five labels all on rank 0 (zigzag)
    labels[1, 14:16] = torch.tensor([2, 1])
    return labels


EXACT = {  # name: (class, the call's arguments besides the sharded rows)
    "token labels": ("MistralForTokenClassification", dict(labels=_token_labels())),
    "sequence": ("MistralForSequenceClassification", dict(labels=torch.tensor([1, 2]))),
    "sequence regression": ("MistralForSequenceClassification", dict(labels=torch.tensor([[0.5, -1.0, 2.0]] * 2))),
    "qa positions": ("MistralForQuestionAnswering", dict(start_positions=torch.tensor([3, 12]),
                                                         end_positions=torch.tensor([14, 25]))),
    "logits_to_keep": ("MistralForCausalLM", dict(logits_to_keep=3, use_cache=False)),
    "logits_to_keep tensor": ("MistralForCausalLM", dict(logits_to_keep=torch.tensor([20, 3, 9, 3]), use_cache=False)),
}


def _out(out) -> tuple:
    logits = out.logits if getattr(out, "logits", None) is not None else torch.stack([out.start_logits,
                                                                                     out.end_logits])
    return logits.detach(), None if out.loss is None else out.loss.detach()


def _grads(model) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in model.parameters()])


def _exact_worker(rank: int, world_size: int, layout: str, peft: bool):
    import cp_attention

    out = {}
    for name, (cls_name, call) in EXACT.items():
        model, config = _mistral(cls_name, **(dict(problem_type="regression") if "regression" in name else {}))
        model.config._attn_implementation = "cp_flash"
        if peft:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                                                     task_type="SEQ_CLS" if "sequence" in name else None))
        per_token = {k: v for k, v in call.items() if name.startswith("token")}  # sharded with the rows
        with cp_attention.context_parallel(layout=layout) as cp:
            result = model(**cp.shard_batch(input_ids=_rows(), **per_token, shift_labels=False),
                           **{k: v for k, v in call.items() if k not in per_token})
        if result.loss is not None:
            result.loss.backward()
        out[name] = tuple(None if t is None else t.numpy() for t in _out(result) + (_grads(model),))
    return out  # numpy: tensors would go back through shared memory that dies with the rank


def _reference(name: str, peft: bool):
    cls_name, call = EXACT[name]
    model, _ = _mistral(cls_name, **(dict(problem_type="regression") if "regression" in name else {}))
    model.config._attn_implementation = "eager"
    if peft:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                                                 task_type="SEQ_CLS" if "sequence" in name else None))
    result = model(input_ids=_rows(), **call)
    if result.loss is not None:
        result.loss.backward()
    return _out(result) + (_grads(model),)



@pytest.mark.parametrize("layout,peft", [("zigzag", True), pytest.param("contiguous", False, marks=pytest.mark.slow)])
def test_position_heads_exact_under_cp(layout, peft):
    """Token classification with uneven labels (its loss a mean over its tokens), pooled sequence
    classification (with LoRA: a reward model's usual set-up), QA spans and logits_to_keep: every
    rank's outputs and loss equal one device's, the mean of the gradients too."""
    per_rank = run_ranks(2, _exact_worker, layout, peft, timeout=600)
    for name in EXACT:
        logits, loss, grads = _reference(name, peft)
        for r in range(2):
            got_logits, got_loss, _ = (None if t is None else torch.from_numpy(t) for t in per_rank[r][name])
            assert got_logits.shape == logits.shape, (name, got_logits.shape, logits.shape)
            assert torch.allclose(got_logits, logits, atol=1e-5, rtol=1e-5), (name, r, (got_logits - logits).abs().max())
            assert (got_loss is None) == (loss is None) and (loss is None or abs(float(got_loss - loss)) <= 1e-5), name
        if loss is not None:
            mean = torch.from_numpy((per_rank[0][name][2] + per_rank[1][name][2]) / 2)
            assert float((mean - grads).abs().max()) <= 1e-5 * max(1.0, float(grads.abs().max())), \
                (name, float((mean - grads).abs().max()))


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

    out["bert sequence"] = _outcome(lambda: run(_bert("BertForSequenceClassification"), dict(input_ids=ids),
                                                labels=torch.tensor([1])))
    qa, _ = _mistral("MistralForQuestionAnswering")
    out["qa logits"] = _outcome(lambda: run(qa, dict(input_ids=ids)))
    spans = dict(start_positions=torch.tensor([3]), end_positions=torch.tensor([9]))
    padding = torch.ones_like(ids)
    out["qa spans, no padding"] = _outcome(lambda: run(qa, dict(input_ids=ids, attention_mask=padding), **spans))
    out["qa spans, padding"] = _outcome(lambda: run(qa, dict(input_ids=ids, attention_mask=padding.masked_fill(
        torch.arange(L) >= L - 4, 0)), **spans))
    out["deberta token labels"] = _outcome(lambda: run(_deberta_tokens(), dict(input_ids=ids, labels=ids % 3,
                                                                              shift_labels=False)))
    lm, _ = _mistral("MistralForCausalLM")
    out["logits_to_keep labels"] = _outcome(lambda: run(lm, dict(input_ids=ids, labels=ids), logits_to_keep=1))
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
    out["bert mlm labels"] = _outcome(lambda: run(_bert("BertForMaskedLM"), dict(input_ids=ids, labels=_mlm_labels(ids),
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
    assert r["bert sequence"].startswith("NotImplementedError") and "[CLS] pooler" in r["bert sequence"], r
    assert r["qa logits"] == "ran" and r["qa spans, no padding"] == "ran", r
    # a span loss is a softmax over every position: padding positions' logits are each attention's own
    assert r["qa spans, padding"].startswith("NotImplementedError") and "padding" in r["qa spans, padding"], r
    assert r["deberta token labels"].startswith("NotImplementedError"), r
    assert r["bert mlm labels"].startswith("NotImplementedError") and "mean of its loss" in r["bert mlm labels"], r
    assert r["logits_to_keep labels"].startswith("NotImplementedError") and "line up" in r["logits_to_keep labels"], r
    assert r["causal"] == "ran" and r["num_items bound"] == "ran", r
    assert r["num_items by hand"].startswith("ValueError") and "binds 15.5" in r["num_items by hand"], r
    # ModernBERT's masked-LM loss divides by the batch's label count: mean over ranks == one device
    ids = _ids()
    ref = _modernbert_mlm("eager")(input_ids=ids, labels=_mlm_labels(ids)).loss
    got = (per_rank[0]["modernbert mlm loss"] + per_rank[1]["modernbert mlm loss"]) / 2
    assert abs(got - float(ref)) <= 1e-5 * abs(float(ref)), (got, float(ref))


def _bamba(impl: str):
    from cp_attention.tools.sweeps.configs import build_model, tiny_config

    config = tiny_config("bamba")
    config.z_loss_coefficient = 0.5
    model = build_model(config, impl).eval()
    model.config._attn_implementation = impl
    return model


def _z_worker(rank: int, world_size: int, length: int, layout: str, state_dict: dict):
    import cp_attention

    model = _bamba("cp_flash")
    model.load_state_dict(state_dict)
    ids = torch.randint(3, 64, (1, length), generator=torch.Generator().manual_seed(2))
    try:
        with cp_attention.context_parallel(layout=layout) as cp:
            loss = model(**cp.shard_batch(input_ids=ids, labels=ids), use_cache=False).loss
    except NotImplementedError as exc:
        return str(exc)
    loss.backward()
    return float(loss.detach())


def test_output_z_loss_exact_on_even_shards_refused_on_uneven():
    """Bamba's z-loss (z_loss_coefficient x the mean over the tokens of logsumexp(logits)^2): with even
    shards the mean over ranks of the loss is one device's; with uneven ones (33 tokens, contiguous)
    the forward is refused."""
    eager = _bamba("eager")
    ids = torch.randint(3, 64, (1, 32), generator=torch.Generator().manual_seed(2))
    ref = float(eager(input_ids=ids, labels=ids, use_cache=False).loss)
    even = run_ranks(2, _z_worker, 32, "zigzag", eager.state_dict(), timeout=600)
    assert abs(sum(even) / 2 - ref) <= 1e-5 * abs(ref), (even, ref)
    uneven = run_ranks(2, _z_worker, 33, "contiguous", eager.state_dict(), timeout=600)
    assert all(isinstance(u, str) and "z_loss_coefficient" in u for u in uneven), uneven
