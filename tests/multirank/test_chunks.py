"""Chunked attention follows position ids (issue 13): a token's chunk is ``position // chunk_size``
within its document, as transformers defines Llama 4's chunked layers; with ``cu_seqlens`` (no
positions) positions count from 0 at each document's first token.

* The engine at world sizes 1, 2 and 4, both layouts, against the independent float64 oracle of
  tests/support/fuzz_cases.py (written from that definition): documents whose positions start at 0, at a
  multiple of the chunk size and at an offset that is not one; B = 2; causal and bidirectional;
  with windows; float64 and float32.
* A tiny Llama 4 under cp_flash with continuation rows (a document whose positions do not start at
  0) against transformers' eager on the same packed batch, at world sizes 1, 2 and 4.
* Plans: chunks aligned with shards exchange nothing, also when the positions are offset by a
  multiple of the chunk size; an offset that is not one moves the boundaries and needs K/V.
"""

from __future__ import annotations

import pytest
import torch

import cp_attention
from cp_attention.masks import MaskSpec, SequenceMeta, doc_starts_from_position_ids
from cp_attention.tools.launch import run_ranks
from cp_attention.tools.tiny_models import tiny_config, tiny_model
from fuzz_cases import check_cases, oracle_mask

TOL = {"float64": 1e-9, "float32": 1e-5}
C = 4


def _cases() -> list[dict]:
    rows = {
        "start-0": [[(0, 11), (0, 14)]],                 # documents from position 0
        "start-multiple": [[(8, 13), (12, 12)]],         # first positions 8, 12: multiples of C
        "start-offset": [[(0, 3), (5, 9), (7, 13)]],     # continuation documents at 5 and 7
        "B2-mixed": [[(0, 3), (5, 22)], [(7, 25)]],      # one packed row, one row starting at 7
    }
    cases, seed = [], 0
    for tag, docs in rows.items():
        for causal in (True, False):
            for window in (None, 5):
                for dtype in ("float64", "float32"):
                    seed += 1
                    cases.append(dict(tag=tag, layout="zigzag", B=len(docs), L=25, heads=(4, 2), head_dim=8,
                                      causal=causal, window=window, chunk_size=C, softcap=None, sinks=False,
                                      scale=None, docs=("pos", docs), dtype=dtype, seed=seed))
    return cases


def test_oracle_places_chunk_boundaries_at_position_multiples():
    """The oracle itself: a continuation document starting at position 5 with C = 4 has chunks
    {5, 6, 7} and {8, ...}: the pairs the issue names differ from chunks counted per document."""
    case = dict(B=1, L=8, causal=True, chunk_size=C, docs=("pos", [[(0, 3), (5, 5)]]))
    mask = oracle_mask(case)[0]  # positions [0, 1, 2, 5, 6, 7, 8, 9]
    assert not mask[6, 3] and not mask[6, 4] and not mask[6, 5]   # query position 8 opens a chunk
    assert mask[5, 3] and mask[5, 4] and not mask[5, 2]           # position 7 still sees 5 and 6
    assert mask[7, 6]                                             # positions 9 and 8 share a chunk


@pytest.mark.parametrize("world_size,layout", [(1, "zigzag"), (2, "zigzag"), (2, "contiguous"),
                                               (4, "zigzag"), pytest.param(4, "contiguous", marks=pytest.mark.slow)])
def test_engine_chunks_follow_positions(world_size, layout):
    failures = check_cases(world_size, [dict(c, layout=layout) for c in _cases()], TOL,
                           lambda i, c: f"{c['tag']} causal={c['causal']} window={c['window']} {c['dtype']}")
    assert not failures, "\n".join(failures[:20])


# Llama 4 with continuation rows: [0, 1, 2, 5, 6, ...] (a document continued from position 5) and,
# for B = 2, a second row whose positions start at 7. transformers' eager remaps its chunked mask to
# position_ids when it detects packing, so on these batches it puts chunks at position // C.
LLAMA_ROWS = ([[0, 1, 2] + list(range(5, 5 + 37))],
              [[0, 1, 2] + list(range(5, 5 + 37)), list(range(7, 7 + 40))])


def _llama4_worker(rank: int, world_size: int, layouts) -> list[float]:
    cfg = tiny_config("llama4", chunk=8)
    model = tiny_model("llama4", "cp_flash", config=cfg)
    eager = tiny_model("llama4", "eager", config=cfg)
    errors = []
    for rows in LLAMA_ROWS:
        pos = torch.tensor(rows)
        ids = torch.randint(3, 128, pos.shape, generator=torch.Generator().manual_seed(len(rows)))
        with torch.no_grad():
            # use_cache=False: with a cache transformers skips its packing detection
            want = eager(input_ids=ids, position_ids=pos, use_cache=False).logits
            for layout in layouts:
                with cp_attention.context_parallel(layout=layout) as cp:
                    batch = cp.shard_batch(input_ids=ids, position_ids=pos)
                    got = cp.gather(model(**batch, use_cache=False).logits)
                errors.append(float((got - want).abs().max()))
    return errors


@pytest.mark.transformers
@pytest.mark.parametrize("world_size", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_llama4_continuation_rows_match_eager(world_size):
    layouts = ("zigzag", "contiguous")
    if world_size == 1:
        per_rank = [_llama4_worker(0, 1, layouts)]
    else:
        per_rank = run_ranks(world_size, _llama4_worker, layouts, timeout=600)
    for errors in per_rank:
        assert len(errors) == 2 * len(layouts) and max(errors) <= 1e-4, errors


def _plan_bytes(first_position: int, world_size: int = 2, seq_len: int = 64, chunk: int = 32) -> int:
    pos = torch.arange(first_position, first_position + seq_len)[None]
    meta = SequenceMeta(batch=1, seq_len=seq_len, doc_start=doc_starts_from_position_ids(pos), position=pos)
    spec = MaskSpec(causal=True, chunk_size=chunk)
    return sum(cp_attention.build_plan(meta, spec, world_size=world_size, layout="contiguous", rank=r, head_kv=2,
                                       head_dim=8, itemsize=4).stats.kv_bytes_recv for r in range(world_size))


def test_chunks_aligned_with_shards_exchange_nothing():
    assert _plan_bytes(0) == 0
    assert _plan_bytes(64) == 0          # offset by a multiple of the chunk size: still aligned
    assert _plan_bytes(5) > 0            # boundaries move off the shard edge: rank 1 needs K/V
