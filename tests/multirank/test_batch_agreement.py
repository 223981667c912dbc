"""The batch itself is agreed: ranks of one context-parallel group handed different batches of the same
length and documents (what a per-rank sampler does) raise the same error on every rank, in the batch's
first agreement, instead of training on a splice of two sequences; the same batch runs as before."""

from __future__ import annotations

import pytest
import torch

import cp_attention
from cp_attention.tools.launch import run_ranks
from cp_attention.tools.tiny_models import tiny_model

pytestmark = pytest.mark.transformers  # builds transformers models

L = 40


def _batch(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (1, L), generator=gen)
    pos = torch.cat([torch.arange(16), torch.arange(L - 16)])[None]  # the same two documents on every rank
    return dict(input_ids=ids, position_ids=pos, labels=ids.clone())


def _worker(rank, world_size):
    torch.manual_seed(0)
    model = tiny_model("qwen3", "cp_flash", window=8)
    found = {}
    with cp_attention.context_parallel(timeout=60) as cp:
        same = cp.shard_batch(**_batch(seed=0))
        found["same"] = float(model(**same, use_cache=False).loss)
        # every rank draws its own batch, as a DistributedSampler over all ranks would
        for name, batch in (("ids", _batch(seed=1 + rank)),
                            ("labels", {**_batch(seed=0), "labels": _batch(seed=1 + rank)["labels"]})):
            try:
                model(**cp.shard_batch(**batch), use_cache=False)
                found[name] = None
            except ValueError as exc:
                found[name] = str(exc)
    return found


def test_ranks_given_different_batches_raise_together():
    per_rank = run_ranks(2, _worker, timeout=240)
    for r in per_rank:
        assert r["same"] > 0
        for name in ("ids", "labels"):
            assert r[name] is not None and "given different batches" in r[name] and "sampler" in r[name], r
