"""Agreement once per batch: the collectives of a cp_flash forward+backward do not grow with depth.

Every collective of the library goes through ``cp_attention.comm.Comm`` (the K/V exchange is
point-to-point; agreement, metadata and gather are ``all_gather``/``all_gather_object``/
``all_reduce``), so counting those three methods counts every collective besides the K/V exchange.
"""

from __future__ import annotations

import time

import pytest
import torch

import cp_attention
from cp_attention.comm import Comm
from cp_attention.tools.launch import run_ranks
from cp_attention.tools.tiny_models import tiny_config, tiny_model

pytestmark = pytest.mark.transformers  # builds transformers models

L = 48
COLLECTIVES = ("all_gather", "all_gather_object", "all_reduce")


def _count_collectives() -> list[int]:
    counter = [0]
    for name in COLLECTIVES:
        original = getattr(Comm, name)

        def counted(self, *args, _original=original, **kwargs):
            counter[0] += 1
            return _original(self, *args, **kwargs)

        setattr(Comm, name, counted)
    return counter


def _batch(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (1, L), generator=gen)
    pos = torch.cat([torch.arange(20), torch.arange(L - 20)])[None]  # two documents
    return dict(input_ids=ids, position_ids=pos, labels=ids.clone())


def _depth_worker(rank, world_size, strategy="ring"):
    counter = _count_collectives()
    torch.manual_seed(0)
    result = {}
    for layers in (2, 6):
        model = tiny_model("qwen3", "cp_flash", layers=layers, window=8)  # sliding + full layers
        # verify=False: the first-use verification's forwards (once per model, a fixed number) are not the batch's
        with cp_attention.context_parallel(strategy=strategy, verify=False) as cp:
            batch = cp.shard_batch(**_batch())
            counts = []
            for _ in range(2):  # the batch's first step, then a second one on the same batch
                counter[0] = 0
                model(**batch, use_cache=False).loss.backward()
                counts.append(counter[0])
            other = cp.shard_batch(**_batch(seed=1))  # a new batch agrees again
            counter[0] = 0
            model(**other, use_cache=False).loss.backward()
            counts.append(counter[0])
        result[layers] = counts
    return result


@pytest.mark.parametrize("strategy", ["ring", pytest.param("ulysses", marks=pytest.mark.strategies),
                                      pytest.param("auto", marks=pytest.mark.slow)])
def test_collectives_per_forward_backward_do_not_depend_on_depth(strategy):
    per_rank = run_ranks(2, _depth_worker, strategy, timeout=240)
    for counts in per_rank:
        # qwen3's layers alternate sliding and full attention: two signatures, one agreement each
        assert counts[2] == counts[6] == [2, 0, 2], counts


def _divergent_worker(rank, world_size):
    """After the batch's agreement, rank 1 alone hands the model position_ids that shard_batch did not
    return: rank 1 raises its own error, rank 0 (running the agreed plan, no exchange) is told."""
    model = tiny_model("qwen3", "cp_flash", layers=2, window=8)
    start = None
    try:
        with cp_attention.context_parallel(timeout=60) as cp:
            batch = cp.shard_batch(**_batch())
            model(**batch, use_cache=False).loss.backward()
            if rank == 1:
                batch = dict(batch, position_ids=batch["position_ids"] + 1)
            start = time.monotonic()
            model(**batch, use_cache=False)
        return "ok", "", 0.0
    except Exception as exc:  # noqa: BLE001 - the test inspects whatever was raised
        return type(exc).__name__, str(exc), time.monotonic() - (start or time.monotonic())


def test_a_rank_diverging_after_agreement_is_named_at_once():
    per_rank = run_ranks(2, _divergent_worker, timeout=120)
    (kind0, msg0, took0), (kind1, msg1, _) = per_rank
    assert kind1 == "ValueError" and "position_ids" in msg1, per_rank[1]
    assert kind0 == "RankFailedError" and "rank 1" in msg0 and "position_ids" in msg0, per_rank[0]
    assert took0 < 30, f"rank 0 waited {took0:.1f} s (the 60 s timeout, not the failure report)"


def _config_worker(rank, world_size):
    """Rank 1's model has a sliding window on its second layer where the others have full attention:
    the first layers agree, the second ones would not even meet (rank 1 reuses the agreed sliding
    plan); the configuration checksum of the batch's first agreement makes both ranks raise there."""
    config = tiny_config("qwen3", layers=2, window=8)
    if rank == 1:
        config.layer_types = ["sliding_attention", "sliding_attention"]
    model = tiny_model("qwen3", "cp_flash", config=config)
    start = time.monotonic()
    try:
        with cp_attention.context_parallel(timeout=60) as cp:
            model(**cp.shard_batch(**_batch()), use_cache=False)
        return "ok", "", time.monotonic() - start
    except Exception as exc:  # noqa: BLE001 - the test inspects whatever was raised
        return type(exc).__name__, str(exc), time.monotonic() - start


def test_models_that_differ_between_ranks_raise_on_every_rank():
    for kind, message, took in run_ranks(2, _config_worker, timeout=120):
        assert kind == "ValueError" and "ranks disagree on model_crc" in message, (kind, message)
        assert took < 30, took
