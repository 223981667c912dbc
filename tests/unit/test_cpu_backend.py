"""The fused CPU backend (backends/cpu.py): the varlen contract against the float64 loop oracle of
tests/unit/test_contract.py, at its own tile sizes and at tiny ones (so that every grid case is cut into
tiles, batched calls of overlapping spans, row chunks of the backward and merged parts), its plan of
kernel calls worked out by hand, and what it refuses (so that "auto" falls back to the reference)."""

from __future__ import annotations

import pytest
import torch

from cp_attention.backends import BACKENDS, select_backend
from cp_attention.backends import cpu
from cp_attention.masks import MaskSpec
from contract_cases import GRID, LOW_PRECISION_TOL, check_backend_on_case

# (TILE_Q, MAX_ROWS, MAX_SPAN_ROWS, BACKWARD_SPAN): the library's, then tiny ones that cut the grid's sequences
SETTINGS = [(cpu.TILE_Q, cpu.MAX_ROWS, cpu.MAX_SPAN_ROWS, cpu.BACKWARD_SPAN), (4, 8, 8, 5), (3, 5, 7, 3)]
CASES = [c for c in GRID if c[5] is None] + [
    # long enough for the library's own tiles: banded sequences, batched calls of overlapping spans
    ("long-window-docs", [300, 17, 201], [300, 17, 201], True, (100, 0), None, (4, 2)),
    ("long-causal-ring-block", [150], [390], True, (-1, -1), None, (4, 2)),
    # equal diagonal bands whose keys are 9 then 7 rows apart: one shape, but no common stride
    ("bands-uneven-key-steps", [3, 3, 3], [7, 9, 7], False, (0, 0), None, (2, 1)),
]
BF16 = tuple(t for t in LOW_PRECISION_TOL if t[0] == torch.bfloat16)


@pytest.fixture(params=SETTINGS, ids=lambda s: f"tile{s[0]}-rows{s[1]}-span{s[2]}-bwd{s[3]}")
def sizes(request, monkeypatch):
    tile, rows, span, backward_span = request.param
    monkeypatch.setattr(cpu, "TILE_Q", tile)
    monkeypatch.setattr(cpu, "MAX_ROWS", rows)
    monkeypatch.setattr(cpu, "MAX_SPAN_ROWS", span)
    monkeypatch.setattr(cpu, "BACKWARD_SPAN", backward_span)
    return request.param


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_cpu_backend_matches_loop_oracle(case, sizes):
    check_backend_on_case(BACKENDS["cpu"], case, dtypes=((torch.float32, 2e-5),))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_cpu_backend_bfloat16(case, sizes):
    """bfloat16 inputs: out in bfloat16, lse and gradients in float32, within the contract's bound
    (aten's own bfloat16 kernel rounds probabilities and gradients: the backend computes in float32)."""
    check_backend_on_case(BACKENDS["cpu"], case, dtypes=BF16)


def _cu(lengths):
    return torch.tensor([0] + list(lengths)).cumsum(0).to(torch.int32)


def test_plan_of_a_window_by_hand():
    """12 rows, causal, window (3, 0), tiles of 4: row i sees keys [max(0, i - 3), i].
    Rows 0-3 see [0, i]: a causal square. Rows 4-7 see keys 1..7 and rows 8-11 keys 5..11, each
    row 4 keys: the same band relative to the tile's first key, 4 keys apart: one batched call of 2."""
    cu = _cu([12])
    calls = cpu.plan_calls(cu, cu, causal=True, window=(3, 0), tile=4)
    assert [c[:8] for c in calls] == [
        (0, 0, 1, 4, 4, 0, "causal", False),
        (4, 1, 2, 4, 7, 4, "masked", False),
    ]
    assert calls[1].rel == ((0, 1, 2, 3), (4, 5, 6, 7))  # row r sees [r, r + 4) of its 7-key span


def test_plan_of_documents_and_a_ring_block_by_hand():
    """Two documents of 5 and 5 tokens: one batched causal call (equal squares, 5 rows apart). A
    bottom-right causal block of 3 queries over 7 keys: the 4 keys before the diagonal (full) and
    the diagonal square (causal), merged."""
    cu = _cu([5, 5])
    assert [c[:8] for c in cpu.plan_calls(cu, cu, causal=True, window=(-1, -1))] == [
        (0, 0, 2, 5, 5, 5, "causal", False)]
    calls = cpu.plan_calls(_cu([3]), _cu([7]), causal=True, window=(-1, -1))
    assert [c[:8] for c in calls] == [(0, 0, 1, 3, 4, 0, "full", False), (0, 4, 1, 3, 3, 0, "causal", True)]



def test_backward_chunks_by_hand():
    """A causal call of 10 rows, chunks of 4: rows 0-3 its square; rows 4-7 their square, then keys 0-3
    (full, merged); rows 8-9 their square, then keys 0-7. A full call of 10 rows: 3 row chunks."""
    causal = [cpu._Call(0, 0, 1, 10, 10, 0, "causal", False, None)]
    assert [c[:8] for c in cpu.backward_calls(causal, max_rows=4)] == [
        (0, 0, 1, 4, 4, 0, "causal", False),
        (4, 4, 1, 4, 4, 0, "causal", False), (4, 0, 1, 4, 4, 0, "full", True),
        (8, 8, 1, 2, 2, 0, "causal", False), (8, 0, 1, 2, 8, 0, "full", True),
    ]
    full = [cpu._Call(0, 0, 1, 10, 6, 0, "full", False, None)]
    assert [(c.q0, c.T, c.k0, c.S) for c in cpu.backward_calls(full, max_rows=4)] == [(0, 4, 0, 6), (4, 4, 0, 6),
                                                                                      (8, 2, 0, 6)]
    # key slices of at most 4: the full call's 6 keys as 4 + 2; the causal call's keys before a chunk too
    assert [(c.q0, c.T, c.k0, c.S) for c in cpu.backward_calls(full, max_rows=8, max_span=4)] == [
        (0, 8, 0, 4), (0, 8, 4, 2), (8, 2, 0, 4), (8, 2, 4, 2)]
    assert [(c.q0, c.k0, c.S, c.kind) for c in cpu.backward_calls(causal, max_rows=8, max_span=3)] == [
        (0, 0, 8, "causal"), (8, 8, 2, "causal"), (8, 0, 3, "full"), (8, 3, 3, "full"), (8, 6, 2, "full")]


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(dtype=torch.float64), "float64"),
    (dict(dtype=torch.float16), "float16"),
    (dict(spec=MaskSpec(softcap=5.0)), "softcap"),
    (dict(head_dim_v=8), "one head dim"),
    (dict(device=torch.device("meta")), "CPU"),
])
def test_refusals_name_the_reason(kwargs, fragment):
    args = dict(device=torch.device("cpu"), dtype=torch.float32, head_dim=16, spec=MaskSpec()) | kwargs
    reasons = BACKENDS["cpu"].not_supported_reasons(**args)
    assert any(fragment in r for r in reasons), reasons


def test_auto_on_cpu():
    """'auto' on CPU: the fused backend for float32 and bfloat16, the reference where it refuses."""
    def pick(**kw):
        args = dict(device=torch.device("cpu"), dtype=torch.float32, head_dim=16, spec=MaskSpec()) | kw
        return select_backend("auto", **args).name
    assert pick() == pick(dtype=torch.bfloat16) == "cpu"
    assert pick(dtype=torch.float64) == pick(spec=MaskSpec(softcap=2.0)) == pick(head_dim_v=8) == "reference"
