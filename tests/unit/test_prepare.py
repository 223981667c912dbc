"""Planning ahead, in one process (the multi-rank steps: tests/multirank/test_prepare.py): ``cp.prefetch``'s
thread (order, each batch prepared before the loop gets it, at most ``depth`` ahead, errors at their
batch, stopping), the masks and shapes planned (what a cp_flash model's layers really receive), the
argument errors, a one-rank context's ``shard_batch`` reusing a prepared batch, and an executor (threads,
processes) computing the layout and plans at a simulated world size."""

from __future__ import annotations

import multiprocessing
import threading
import time
import types
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

import pytest
import torch

import cp_attention
from cp_attention.engine import planning
from cp_attention.engine.prepare import plan_specs, prefetch
from cp_attention.masks import MaskSpec, SequenceMeta
from cp_attention.tools.tiny_models import tiny_model


def _batches(n: int, log: list):
    for i in range(n):
        log.append(("drawn", i))
        yield dict(i=i)


def test_prefetch_yields_every_batch_in_order_each_prepared_first():
    log, lock = [], threading.Lock()

    def prepare(batch):
        time.sleep(0.01)
        with lock:
            log.append(("prepared", batch["i"], threading.current_thread() is threading.main_thread()))

    got = []
    for batch in prefetch(prepare, _batches(5, log), depth=2):
        with lock:
            assert ("prepared", batch["i"], False) in log  # prepared, and not in the loop's thread
        got.append(batch["i"])
    assert got == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("depth", [1, 3])
def test_prefetch_draws_at_most_depth_batches_ahead(depth):
    drawn, taken = [], []

    def batches():
        for i in range(8):
            drawn.append(i)
            yield dict(i=i)

    for batch in prefetch(lambda b: None, batches(), depth=depth):
        time.sleep(0.02)  # the thread has time to run ahead as far as it may
        ahead = len(drawn) - len(taken) - 1  # drawn beyond the batch the loop now holds
        assert ahead <= depth, (batch, drawn, taken)
        taken.append(batch["i"])
    assert taken == list(range(8))


def test_prefetch_raises_an_error_at_its_batch_and_stops_on_break():
    def prepare(batch):
        if batch["i"] == 2:
            raise ValueError("batch 2 is bad")

    got = []
    with pytest.raises(ValueError, match="batch 2 is bad"):
        for batch in prefetch(prepare, _batches(5, []), depth=1):
            got.append(batch["i"])
    assert got == [0, 1]

    log = []
    stream = prefetch(lambda b: None, _batches(100, log), depth=1)
    for batch in stream:
        if batch["i"] == 1:
            break
    stream.close()
    time.sleep(0.3)
    assert len(log) <= 4  # the thread stopped instead of draining the loader
    assert not any(t.name == "cp_attention-prefetch" and t.is_alive() for t in threading.enumerate())


def test_prefetch_checks_depth():
    with pytest.raises(ValueError, match="depth must be a positive int"):
        prefetch(lambda b: None, [], depth=0)


def test_plan_specs_are_distinct_planning_masks():
    specs = plan_specs([dict(window=4), MaskSpec(window=4, softcap=30.0), dict(), dict(chunk_size=8)], False)
    assert specs == (MaskSpec(window=4), MaskSpec(), MaskSpec(chunk_size=8))
    with_spans = plan_specs([dict(window=4), dict(chunk_size=8)], True)
    assert with_spans == (MaskSpec(window=4), MaskSpec(window=4, spans=True), MaskSpec(chunk_size=8))
    for bad in (None, [], MaskSpec()):
        with pytest.raises(ValueError, match="masks must be a non-empty list"):
            plan_specs(bad, False)


def test_dims_for_is_what_a_call_keys_its_plan_by():
    q, k, v = torch.zeros(1, 3, 8, 16, dtype=torch.bfloat16), *torch.zeros(2, 1, 3, 2, 16, dtype=torch.bfloat16)
    assert planning.dims_for(heads=8, kv_heads=2, head_dim=16, dtype=torch.bfloat16) == planning.dims_of(q, k, v)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        planning.dims_for(heads=6, kv_heads=4, head_dim=16)
    with pytest.raises(ValueError, match="head_dim must be a positive int"):
        planning.dims_for(heads=6, head_dim=0)
    with pytest.raises(ValueError, match="dtype must be the floating dtype"):
        planning.dims_for(heads=6, head_dim=8, dtype=torch.int64)


def test_prepare_without_masks_or_model_names_what_is_missing():
    ids = torch.zeros(1, 8, dtype=torch.int64)
    with cp_attention.context_parallel() as cp:
        with pytest.raises(ValueError, match="missing: masks, dtype"):
            cp.prepare(input_ids=ids, heads=4, head_dim=8)
        with pytest.raises(ValueError, match="needs model= .* or masks="):
            cp.prefetch([dict(input_ids=ids)])


def _one_rank_batches() -> dict:
    """Batches in each of shard_batch's conventions: position restarts, a packing collator's keys, a
    padding mask with document starts."""
    ids = torch.arange(12)[None] + 3
    restarts = dict(input_ids=ids, position_ids=torch.cat([torch.arange(5), torch.arange(7)])[None], labels=ids)
    collator = dict(input_ids=ids, labels=ids, cu_seq_lens_q=torch.tensor([0, 4, 12], dtype=torch.int32),
                    cu_seq_lens_k=torch.tensor([0, 4, 12], dtype=torch.int32), max_length_q=8, max_length_k=8)
    padded = dict(input_ids=torch.cat([ids, ids]), attention_mask=torch.tensor([[1] * 12, [1] * 9 + [0] * 3]),
                  document_starts=torch.zeros(2, 12, dtype=torch.bool).index_fill_(1, torch.tensor([6]), True))
    return dict(restarts=restarts, collator=collator, padded=padded)


@pytest.mark.parametrize("kind", ["restarts", "collator", "padded"])
def test_one_rank_shard_batch_reuses_the_prepared_documents(kind, monkeypatch):
    batch = _one_rank_batches()[kind]
    with cp_attention.context_parallel() as cp:
        plain = cp.shard_batch(**batch)
        plain_meta = cp._batch.meta
    built = []
    real = SequenceMeta.__init__

    def counted(self, *args, **kwargs):
        built.append(1)
        real(self, *args, **kwargs)

    monkeypatch.setattr(SequenceMeta, "__init__", counted)
    with cp_attention.context_parallel() as cp:
        prepared = cp.prepare(**batch, masks=[dict(window=3)], heads=2, head_dim=4, dtype=torch.float32)
        assert built and prepared.plans == 0  # one rank: the metadata only (its calls plan on one device)
        built.clear()
        local = cp.shard_batch(**{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()})
        assert not built and cp._batch.prepared
        assert cp._batch.meta.digest() == plain_meta.digest()
        stats = cp.planning_stats()
    assert (stats.batches_prepared, stats.batches_prepared_found, stats.batches_computed) == (1, 1, 0)
    assert local.keys() == plain.keys() and all(torch.equal(local[n], plain[n]) for n in plain)


@pytest.mark.transformers
@pytest.mark.parametrize("family", ["qwen3", "gemma3", "gpt_oss", "llama4", "mistral", "phi3", "modernbert"])
def test_model_masks_and_shapes_are_what_its_layers_receive(family, monkeypatch):
    """What ``cp.prepare(model=...)`` plans for (the config's attention layer masks and
    :func:`attention_shapes`) is what the model's cp_flash layers hand the engine: the masks' planning
    parts and the (H, K, D, Dv, itemsize) of their q, k and v (ModernBERT's config holds a half-window;
    its layers pass one more, and so must the config's reading)."""
    from cp_attention.integrations.hf import attention as adapter
    from cp_attention.integrations.hf.models import attention_shapes, model_masks

    model = tiny_model(family, "cp_flash", window=4, chunk=4)
    seen = set()
    real = adapter.attend_layer

    def recording(q, k, v, spec, **kw):
        seen.add((spec.for_planning(), planning.dims_of(q, k, v)))
        return real(q, k, v, spec, **kw)

    monkeypatch.setattr(adapter, "attend_layer", recording)
    ids = torch.randint(3, 100, (1, 12))
    with torch.no_grad():
        model(input_ids=ids, position_ids=torch.arange(12)[None])
    planned = {(spec, planning.dims_for(**attention_shapes(model))) for spec in plan_specs(model_masks(model)[0], False)}
    assert seen == planned


def _simulated(world_size: int, rank: int, **options):
    """A context that plans as ``rank`` of ``world_size`` without a process group: prepare and
    shard_batch run no collective, so a stand-in comm with the rank and world size is all they read."""
    cp = cp_attention.ContextParallel(None, **options)
    cp.comm = types.SimpleNamespace(rank=rank, world_size=world_size, device=torch.device("cpu"))
    return cp


def _plan_summary(plan):
    return plan.stats, repr(getattr(plan, "rounds", None))


@pytest.mark.parametrize("pool", [None, "threads", pytest.param("processes", marks=pytest.mark.multirank)])
def test_an_executor_plans_what_the_calling_thread_plans(pool):
    """At a simulated P = 8 (rank 3), balanced and auto: the layout and plans an executor computes (in
    threads, or in spawned processes: pickled both ways) are the ones built here, and ``shard_batch``
    then finds the documents and every call's plan under the keys the call computes."""
    pos = torch.cat([torch.arange(n) for n in (70, 9, 120, 41)])[None]
    batch = dict(input_ids=torch.arange(240)[None] % 50, position_ids=pos)
    masks = [dict(window=16), dict(), dict(chunk_size=32)]
    shapes = dict(heads=8, kv_heads=2, head_dim=16, dtype=torch.bfloat16)
    executor = None if pool is None else (ThreadPoolExecutor(2) if pool == "threads" else
                                          ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")))
    try:
        cp = _simulated(8, 3, layout="balanced", strategy="auto")
        prepared = cp.prepare(**batch, masks=masks, **shapes, executor=executor)
    finally:
        if executor is not None:
            executor.shutdown()
    local = cp.shard_batch(**batch)
    record = cp._batch
    assert record.prepared and record.layout is prepared.layout and cp.planning_stats().batches_prepared_found == 1
    how = planning.how_of("auto", None, cp.cost_model)
    dims = planning.dims_for(**shapes)
    meta_key = planning.batch_meta_key(record.digest, record.layout, 1, local["input_ids"].shape[1])
    for spec in prepared.masks:
        plan, crc, seq_len = cp.plans.get(planning.plan_key(meta_key, spec, how, dims))
        expected = planning.build_rank_plan(3, 8, record.layout, record.meta, spec, dims, how)
        assert (crc, seq_len) == (record.crc, 240) and _plan_summary(plan) == _plan_summary(expected)


def _collate(features: list) -> dict:
    """A packing collator: one row of the features' documents, positions restarting per document."""
    ids = torch.cat([torch.as_tensor(f) for f in features])[None]
    pos = torch.cat([torch.arange(len(f)) for f in features])[None]
    return dict(input_ids=ids, position_ids=pos, labels=ids.clone())


@pytest.mark.multirank  # the loader's worker processes
def test_prefetch_over_a_dataloader_with_workers():
    """``cp.prefetch`` wraps a torch ``DataLoader`` whose worker processes collate (simulated P = 4,
    balanced, ring): every batch reaches the loop prepared, and its ``shard_batch`` finds it."""
    features = [list(range(3, 3 + n)) for n in (17, 40, 9, 33, 25, 12, 30, 21)]
    loader = torch.utils.data.DataLoader(features, batch_size=2, collate_fn=_collate, num_workers=2)
    cp = _simulated(4, 1, layout="balanced")
    steps = 0
    for batch in cp.prefetch(loader, masks=[dict(window=8), dict()], heads=4, head_dim=8, dtype=torch.float32):
        before = cp.planning_stats().batches_prepared_found
        cp.shard_batch(**batch)
        assert cp._batch.prepared and cp.planning_stats().batches_prepared_found == before + 1
        steps += 1
    stats = cp.planning_stats()
    assert steps == 4 and (stats.batches_prepared, stats.batches_computed, stats.plans_prepared) == (4, 0, 8)
