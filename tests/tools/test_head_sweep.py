"""The head sweep (``python -m cp_attention.tools.sweeps.heads``; its recorded outcomes:
docs/supported_heads.md): every task head of transformers' sequence-classification,
token-classification, question-answering and masked-LM mappings under CP = 2 is exact (loss and
gradients, mean over ranks, against one-device eager) or refused before its forward; never wrong.

The default run covers a head or two per kind (exact, or refused by the rule of their kind);
``python -m pytest -m families tests/tools/test_head_sweep.py`` runs every entry (about 360, 40 minutes)."""

from __future__ import annotations

import pytest

from cp_attention.tools.sweeps import heads as hs

pytestmark = [pytest.mark.multirank, pytest.mark.transformers]  # spawns gloo ranks; builds transformers models

FAST = [("masked", "modernbert", "ModernBertForMaskedLM"), ("token", "llama", "LlamaForTokenClassification"),
        ("qa", "bert", "BertForQuestionAnswering"), ("sequence", "qwen2", "Qwen2ForSequenceClassification"),
        ("masked", "roberta", "RobertaForMaskedLM"), ("sequence", "distilbert", "DistilBertForSequenceClassification")]
EXPECTED = {"modernbert": ("exact", ""), "llama": ("exact", ""),
            "bert": ("exact", ""), "qwen2": ("exact", ""), "roberta": ("refused", "mean of its loss"),
            "distilbert": ("refused", "[CLS] pooler")}


def test_fast_heads_exact_or_refused_by_their_rule():
    results = hs.run_entries(FAST)
    for rec in results:
        outcome, words = EXPECTED[rec["family"]]
        assert rec["outcome"] == outcome and words in rec.get("message", ""), rec


@pytest.mark.families
def test_every_head_exact_or_refused():
    results = hs.run_entries(hs.entries())
    bad = [r for r in results if r["outcome"] in ("wrong", "crash")]
    assert not bad, "\n".join(f"{r['kind']} {r['family']}: {r['outcome']} {r.get('message', '')}" for r in bad)
