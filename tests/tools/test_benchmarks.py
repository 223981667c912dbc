"""The benchmark scripts run end to end in their tiny --smoke mode, their JSON says what it must, the
plots are drawn from it, and the traffic claims of the README hold at the plan level.

Expected pair counts, FLOPs, halos and attention outputs come from the independent oracle
(``oracle.py``: the documented mask and layout definitions, no cp_attention code); the library and
the harness are only what is measured.

The smoke runs happen once per module (in this process; bench_cp spawns gloo ranks, the memory
measurements a fresh process), then every test reads their JSON.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

BENCH_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "benchmarks")
sys.path.insert(0, os.path.abspath(BENCH_DIR))

import harness  # noqa: E402

import cp_attention  # noqa: E402
from cp_attention import layout as layout_mod  # noqa: E402
from cp_attention.backends import BACKENDS  # noqa: E402
from cp_attention.comm import Comm  # noqa: E402
from cp_attention.masks import MaskSpec  # noqa: E402
from cp_attention.plan import build_plan  # noqa: E402
from cp_attention.strategies.ring import ring_attention  # noqa: E402
from oracle import needed_halo_tokens, oracle_attention, oracle_mask, rank_tokens  # noqa: E402

pytestmark = [pytest.mark.multirank, pytest.mark.transformers]  # spawns gloo ranks; builds transformers models


def _oracle_mask(name: str, L: int, documents=None, window=None) -> torch.Tensor:
    """(1, L, L) oracle mask of a harness mask name (``causal``, ``window:W``, ``chunked:C``,
    ``documents[:N]`` with the drawn ``documents`` lengths, positions restarting at 0 in each),
    optionally with a window on top."""
    kind, _, arg = name.partition(":")
    pos = None if documents is None else torch.tensor([[p for n in documents for p in range(n)]])
    return oracle_mask(1, L, position_ids=pos, causal=True,
                       window=int(arg) if kind == "window" else window,
                       chunk_size=int(arg) if kind == "chunked" else None)


def _flops(pairs: int, *, heads: int, head_dim: int, backward: bool) -> float:
    """Two matrix products per visible pair and head (2 * 2 * D flops) forward; backward five more
    products' worth of work on top (2.5x the forward)."""
    forward = 2 * 2 * head_dim * pairs * heads
    return forward + (2.5 * forward if backward else 0.0)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """Run the three benchmark scripts in --smoke mode into one folder; return it."""
    out = str(tmp_path_factory.mktemp("bench"))
    threads = torch.get_num_threads()
    try:
        for name in ("bench_attention", "bench_cp", "bench_model"):
            assert importlib.import_module(name).main(["--smoke", "--out", out]) == 0
    finally:
        torch.set_num_threads(threads)  # the scripts run single-threaded
    return out


def _rows(path):
    payload = harness.load_results(path)
    return payload, [r for r in payload["results"] if not r.get("summary") and not r.get("traffic")]


def test_attention_smoke(smoke):
    payload, rows = _rows(os.path.join(smoke, "attention.json"))
    assert payload["machine"]["device"] == "cpu" and payload["config"]["backend"] == "reference"
    cases = {(r["mask"], r["seq_len"], r["pass"]) for r in rows}
    assert len(cases) == 2 * 2 * 2  # masks x lengths x passes
    for case in cases:
        impls = {r["impl"]: r for r in rows if (r["mask"], r["seq_len"], r["pass"]) == case}
        assert set(impls) == {"cp_flash", "sdpa_dense", "eager_dense"}  # sdpa_causal only for "causal"
        for r in impls.values():
            t = r["time"]
            assert 0 < t["min_s"] <= t["median_s"] <= t["max_s"]
            case_mask = harness.parse_mask(r["mask"], r["seq_len"])
            pairs = int(_oracle_mask(r["mask"], r["seq_len"], case_mask.documents).sum())
            assert r["visible_pairs"] == pairs
            assert r["flops"] == _flops(pairs, heads=2, head_dim=16, backward=r["pass"] == "fwd_bwd")
            if r["pass"] == "fwd_bwd":  # tiny runs may fit in pages already resident: >= 0
                assert isinstance(r["peak_bytes"], int) and r["peak_bytes"] >= 0
        assert impls["sdpa_dense"]["mask_bytes"] == case[1] ** 2 and impls["cp_flash"]["mask_bytes"] == 0
        if case[2] == "fwd":  # cp_flash computes what SDPA computes with the dense mask
            assert impls["cp_flash"]["max_abs_diff_vs_sdpa_dense"] < 1e-5
    assert max(r["peak_bytes"] for r in rows if r["pass"] == "fwd_bwd") > 0
    summary = [r for r in payload["results"] if r.get("summary")]
    assert {s["baseline"] for s in summary} == {"sdpa_dense", "eager_dense"}
    assert all(s["speedup"] > 0 and ("memory_fraction" not in s or s["pass"] == "fwd_bwd") for s in summary)


def test_cp_smoke(smoke):
    payload, rows = _rows(os.path.join(smoke, "cp.json"))
    by = {(r["mask"], r["world_size"], r["approach"]): r for r in rows}
    masks = payload["config"]["masks"]
    assert set(by) == {(m, 1, "ours") for m in masks} | {(m, 2, a) for m in masks
                                                          for a in ("ours", "full_ring", "all_gather")}
    for (mask, P, approach), r in by.items():
        assert r["mode"] == ("local" if P == 1 else "spawn")
        assert len(r["compute_s_per_rank"]) == P and all(c > 0 for c in r["compute_s_per_rank"])
        assert r["max_abs_diff_vs_ours"] < 1e-5  # every approach computes the same attention
        if P == 2 and approach == "ours":  # exactly the halo of the oracle mask
            cfg = payload["config"]
            case = harness.parse_mask(mask, cfg["seq_len"])
            needed = needed_halo_tokens(_oracle_mask(mask, cfg["seq_len"], case.documents), P, cfg["layout"])
            token = 2 * cfg["kv_heads"] * cfg["head_dim"] * getattr(torch, cfg["dtype"]).itemsize
            assert r["kv_bytes_recv_per_rank"] == [n * token for n in needed], mask
        if P == 2:
            ours, ring = by[(mask, 2, "ours")], by[(mask, 2, "full_ring")]
            assert max(ours["kv_bytes_sent_per_rank"]) < max(ring["kv_bytes_sent_per_rank"])
            assert all(a <= b for a, b in zip(ours["kv_bytes_recv_per_rank"], r["kv_bytes_recv_per_rank"]))
    traffic = [r for r in payload["results"] if r.get("traffic")]
    assert {t["layout"] for t in traffic} == {"zigzag", "contiguous"}
    assert all(t["ours_recv_max"] <= t["allgather_recv_max"] for t in traffic)


def test_model_smoke(smoke):
    payload, rows = _rows(os.path.join(smoke, "model.json"))
    assert {r["impl"] for r in rows} == {"cp_flash", "sdpa", "eager"}
    losses = [r["first_loss"] for r in rows]
    assert max(losses) - min(losses) < 1e-4 * max(losses)  # same weights, data and masks
    assert all(r["tokens_per_s"] > 0 and r["peak_bytes"] >= 0 for r in rows) and max(r["peak_bytes"] for r in rows) > 0


def test_plots_from_smoke_json(smoke):
    written = importlib.import_module("plot").main([smoke])
    names = {os.path.basename(p) for p in written}
    assert names == {"attention_time.png", "cp_traffic.png", "cp_speedup.png", "model_speedup.png"}
    for path in written:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        assert os.path.getsize(path) > 5000


# ----------------------------------------------------------------------------------------------
# plan-level claims (no timing)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_window_quarter_shard_sends_at_most_a_third(layout):
    """World size 4, W = S/4: our plan sends at most 1/3 of a full ring's and of an all-gather's
    K/V bytes, on every rank, and receives at most 1/3 too."""
    L, P = 4096, 4
    S, W = L // P, L // P // 4
    token = 2 * 2 * 64 * 2  # K and V, 2 heads of 64, 2 bytes
    case = harness.parse_mask(f"window:{W}", L)
    rows = harness.traffic(case.meta(L), case.spec, world_size=P, layout=layout, head_kv=2, head_dim=64, itemsize=2)
    needed = needed_halo_tokens(_oracle_mask(f"window:{W}", L), P, layout)
    # the halo is the W-1 tokens before each of the rank's slices that another rank holds
    starts = [rank_tokens(L, P, layout, r) for r in range(P)]
    assert needed == [sum(W - 1 for i, t in enumerate(idx) if t > 0 and (i == 0 or idx[i - 1] != t - 1))
                      for idx in starts]
    assert sum(r["ours_sent"] for r in rows) > 0
    for r in rows:
        assert r["ours_sent"] <= r["ring_sent"] / 3 and r["ours_sent"] <= r["allgather_sent"] / 3
        assert r["ours_recv"] <= r["ring_recv"] / 3 and r["ours_recv"] <= r["allgather_recv"] / 3
        assert r["ring_recv"] == r["allgather_recv"] == (L - S) * token
        assert r["ours_recv"] == needed[r["rank"]] * token  # exactly the halo, not one token more
        assert r["halo_needed_recv"] == needed[r["rank"]] * token  # the harness' own count agrees
    assert sum(r["ours_sent"] for r in rows) == sum(r["ours_recv"] for r in rows)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("mask", ["documents", "documents+window"])
def test_documents_no_longer_than_a_shard_send_only_their_halo(layout, mask):
    """Documents of at most S tokens: every rank receives exactly the K/V its queries see."""
    L, P = 4096, 4
    token = 2 * 2 * 64 * 2
    case = harness.parse_mask(f"documents:{L // P}", L, seed=3)
    assert max(case.documents) <= L // P and len(case.documents) > P
    window = 300 if mask == "documents+window" else None
    spec = MaskSpec(window=window)
    rows = harness.traffic(case.meta(L), spec, world_size=P, layout=layout, head_kv=2, head_dim=64, itemsize=2)
    needed = needed_halo_tokens(_oracle_mask("documents", L, case.documents, window=window), P, layout)
    assert sum(r["ours_sent"] for r in rows) == sum(r["ours_recv"] for r in rows)
    for r in rows:
        assert r["ours_recv"] == needed[r["rank"]] * token < r["ring_recv"]
        assert r["halo_needed_recv"] == needed[r["rank"]] * token


def test_halo_and_pairs_match_the_oracle_mask():
    """The harness' pair count, dense baseline mask, FLOPs and needed halo against the oracle."""
    L, P = 96, 3
    for name in ("causal", "window:7", "chunked:20", "documents:40"):
        case = harness.parse_mask(name, L, seed=1)
        meta = case.meta(L)
        dense = _oracle_mask(name, L, case.documents)
        assert harness.visible_pairs(meta, case.spec) == int(dense.sum())
        assert torch.equal(case.dense(L), dense[0])
        for backward in (False, True):
            assert harness.flops(meta, case.spec, heads=3, head_dim=8, backward=backward) == _flops(
                int(dense.sum()), heads=3, head_dim=8, backward=backward)
        for layout in ("zigzag", "contiguous"):
            assert harness.needed_halo_tokens(meta, case.spec, world_size=P, layout=layout) == needed_halo_tokens(
                dense, P, layout), (name, layout)


def test_document_lengths_are_a_realistic_mix():
    lengths = harness.document_lengths(65536, seed=0)
    assert sum(lengths) == 65536 and min(lengths) >= 1 and max(lengths) <= 65536
    assert 30 < len(lengths) < 200 and max(lengths) > 4 * min(lengths)
    short = harness.document_lengths(8192, seed=0)
    assert sum(short) == 8192 and short[:-1] == lengths[:len(short) - 1]  # one mix, cut to length


# ----------------------------------------------------------------------------------------------
# the execution helpers compute the right attention


class _CountingSimComm(harness.SimComm):
    """SimComm that adds up the K/V bytes the ring actually sends and receives (tags below the
    world size; dK/dV partial sums travel under higher tags)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.kv_sent = self.kv_recv = 0

    def send(self, tensor, dst, tag=0):
        if tag < self.world_size:
            self.kv_sent += tensor.numel() * tensor.element_size()
        super().send(tensor, dst, tag)

    def recv(self, tensor, src, tag=0):
        if tag < self.world_size:
            self.kv_recv += tensor.numel() * tensor.element_size()
        super().recv(tensor, src, tag)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_simulated_ranks_and_baseline_plans_match_one_device(layout):
    """Every rank of a world of 3 run in turn with SimComm, for our plan, the full ring and the
    all-gather, gives that rank's shard of the oracle's output and q gradient; our plan's ring
    moves exactly the K/V halo the oracle mask needs (counted on the wire), the full ring every
    other shard."""
    L, P, H, K, D = 150, 3, 4, 2, 8
    token = 2 * K * D * 8  # K and V of one token in float64
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, L, H, D, generator=gen, dtype=torch.float64)
    k = torch.randn(1, L, K, D, generator=gen, dtype=torch.float64)
    v = torch.randn(1, L, K, D, generator=gen, dtype=torch.float64)
    case = harness.parse_mask("documents:60", L, seed=2)
    spec = MaskSpec(window=23)
    meta = case.meta(L)
    mask = _oracle_mask("documents", L, case.documents, window=23)
    q_ref = q.clone().requires_grad_()
    full = oracle_attention(q_ref, k, v, mask)
    full.sum().backward()
    tokens = [rank_tokens(L, P, layout, r) for r in range(P)]
    needed = needed_halo_tokens(mask, P, layout)
    assert 0 < sum(needed) < 2 * L
    halo_sets = [set(torch.nonzero(mask[0, tokens[r]].any(0)).flatten().tolist()) - set(tokens[r])
                 for r in range(P)]
    ks = [layout_mod.shard(k, 1, P, layout, r) for r in range(P)]
    vs = [layout_mod.shard(v, 1, P, layout, r) for r in range(P)]
    ref = BACKENDS["reference"]
    for r in range(P):
        q_r = layout_mod.shard(q, 1, P, layout, r)
        want, want_dq = full.detach()[:, tokens[r]], q_ref.grad[:, tokens[r]]
        ours = build_plan(meta, spec, world_size=P, layout=layout, rank=r, head_kv=K, head_dim=D, itemsize=8)
        ring = harness.full_ring_plan(meta, spec, world_size=P, layout=layout, rank=r, head_kv=K, head_dim=D,
                                      itemsize=8)
        assert ring.stats.kv_bytes_recv == ring.stats.ring_kv_bytes_recv == (L - len(tokens[r])) * token
        grads = []
        for plan in (ours, ring):
            qq = q_r.clone().requires_grad_()
            comm = _CountingSimComm(plan, ks, vs)
            out = ring_attention(qq, ks[r], vs[r], None, plan, comm, ref, scale=D ** -0.5, softcap=None)
            torch.testing.assert_close(out, want, atol=1e-10, rtol=0)
            if plan is ours:  # exactly the halo, not one token more, in both directions
                assert comm.kv_recv == ours.stats.kv_bytes_recv == needed[r] * token, (layout, r)
                sent = sum(len(halo_sets[d] & set(tokens[r])) for d in range(P) if d != r)
                assert comm.kv_sent == ours.stats.kv_bytes_sent == sent * token, (layout, r)
            else:
                assert comm.kv_recv == (L - len(tokens[r])) * token
            out.sum().backward()
            torch.testing.assert_close(qq.grad, want_dq, atol=1e-10, rtol=0)
            grads.append(qq.grad)
        qq = q_r.clone().requires_grad_()
        gathered = harness.all_gather_plan(meta, spec, world_size=P, layout=layout, rank=r)
        out = ring_attention(qq, k, v, None, gathered, Comm(single=True), ref, scale=D ** -0.5, softcap=None)
        torch.testing.assert_close(out, want, atol=1e-10, rtol=0)
        out.sum().backward()
        torch.testing.assert_close(grads[1], grads[0], atol=1e-10, rtol=0)
        torch.testing.assert_close(qq.grad, grads[0], atol=1e-10, rtol=0)


def test_timed_backend_counts_kernel_time():
    timed = harness.TimedBackend(BACKENDS["reference"], torch.device("cpu"))
    q = torch.randn(300, 2, 16)
    cu = torch.tensor([0, 300], dtype=torch.int32)
    timed.forward(q, q, q, cu, cu, 300, 300, scale=0.25, causal=True)
    first = timed.seconds()
    assert first > 0
    timed.reset()
    assert timed.seconds() == 0


# ----------------------------------------------------------------------------------------------
# bench_cp.py --layouts: zigzag, contiguous and balanced layouts on packed batches


@pytest.fixture(scope="module")
def layouts_smoke(tmp_path_factory):
    """``bench_cp.py --layouts --smoke`` (plan level at P = 4 and 8, real gloo ranks at P = 2) into its
    own folder; return it."""
    out = str(tmp_path_factory.mktemp("layouts"))
    threads = torch.get_num_threads()
    try:
        assert importlib.import_module("bench_cp").main(["--layouts", "--smoke", "--out", out]) == 0
    finally:
        torch.set_num_threads(threads)
    return out


def test_layouts_smoke_numbers_follow_their_definitions(layouts_smoke):
    """Every plan-level number of the --layouts run from its definition: each rank's tokens (the
    layout definition; balanced_layout's own answer for balanced), its visible pairs per layer and
    its K/V halo from the oracle mask of the drawn documents, work = pairs summed over the layers +
    token weight x tokens, busiest / mean, token spread, K/V against a full ring, the predicted
    speedup, the worst case over batches; the real ranks' ratios and outputs."""
    payload = harness.load_results(os.path.join(layouts_smoke, "cp_layouts.json"))
    cfg, results = payload["config"], payload["results"]
    L, token = cfg["seq_len"], 2 * 8 * 128 * 2  # K and V of one token: 8 K/V heads of 128, bfloat16
    documents = {(b["seq_len"], b["seed"]): b["document_lengths"] for b in results if b["kind"] == "batch"}
    assert max(len(documents[(L, seed)]) for seed in cfg["seeds"]) >= 3  # packed batches
    plans = [r for r in results if r["kind"] == "plan"]
    combos = {(P, mix, tw, seed, name) for P in cfg["world_sizes"] for mix in cfg["mixes"]
              for tw in cfg["token_weights"] for seed in cfg["seeds"] for name in ("zigzag", "contiguous", "balanced")}
    assert {(r["world_size"], r["mix"], r["token_weight"], r["seed"], r["layout"]) for r in plans} == combos
    masks = {}
    for r in plans:
        P, tw, layers = r["world_size"], r["token_weight"], cfg["mixes"][r["mix"]]
        lengths = documents[(L, r["seed"])]
        assert sum(lengths) == L
        pos = torch.tensor([[p for n in lengths for p in range(n)]])
        if r["layout"] == "balanced":
            layout = cp_attention.balanced_layout(P, position_ids=pos, masks=layers, token_weight=tw)
            tokens = [layout.indices(q).tolist() for q in range(P)]
        else:
            tokens = [rank_tokens(L, P, r["layout"], q) for q in range(P)]
        assert r["tokens_per_rank"] == [len(t) for t in tokens]
        entries, kv = [0] * P, [0] * P
        for layer in layers:
            label = f"window:{layer['window']}" if layer.get("window") else "causal"
            key = (r["seed"], label)
            if key not in masks:
                masks[key] = oracle_mask(1, L, position_ids=pos, window=layer.get("window"))[0]
            mask = masks[key]
            pairs = [int(mask[t].sum()) for t in tokens]
            assert r["entries_visible_by_layer"][label] == pairs, (r["layout"], P, label)
            assert sum(r["entries_visible_by_layer"][label]) == int(mask.sum())  # every visible pair, once
            for q, t in enumerate(tokens):
                entries[q] += pairs[q]
                seen = mask[t].any(0)
                seen[t] = False
                kv[q] += int(seen.sum()) * token  # exactly the halo the rank's queries see
        assert r["entries_visible_per_rank"] == entries
        assert r["kv_bytes_recv_per_rank"] == kv, (r["layout"], P)
        work = [e + tw * len(t) for e, t in zip(entries, tokens)]
        assert r["work_per_rank"] == pytest.approx(work) and r["busiest_work"] == pytest.approx(max(work))
        assert r["busiest_over_mean"] == pytest.approx(max(work) * P / sum(work)) and r["busiest_over_mean"] >= 1
        assert r["token_spread"] == pytest.approx(max(len(t) for t in tokens) / (L / P)) and r["token_spread"] >= 1
        if r["layout"] != "balanced":
            assert r["token_spread"] <= 1 + (2 if r["layout"] == "zigzag" else 1) * P / L
        # a full ring delivers every other rank's tokens, every layer: (L - L/P) tokens with equal shards
        assert all(k <= (L - len(t)) * token * len(layers) for k, t in zip(kv, tokens))
        assert r["kv_vs_full_ring"] == pytest.approx(max(kv) / ((L - L / P) * token * len(layers)))
        assert r["kv_vs_full_ring"] <= 1 or r["layout"] == "balanced"  # fewer tokens than L / P: more to receive
        assert r["planning_ms"] >= r["layout_ms"] >= 0 and min(r["plan_ms_per_rank"]) > 0
        assert r["kernel_calls_max"] == max(r["kernel_calls_per_rank"]) >= len(layers)
        zz = next(z for z in plans if z["layout"] == "zigzag" and
                  all(z[k] == r[k] for k in ("world_size", "mix", "token_weight", "seed")))
        assert r["predicted_speedup_over_zigzag"] == pytest.approx(zz["busiest_work"] / max(work))
    for s in (s for s in results if s["kind"] == "plan_summary"):  # the worst batch of each line
        mine = [r for r in plans if all(r[k] == s[k] for k in ("world_size", "mix", "token_weight", "layout"))]
        assert len(mine) == len(cfg["seeds"])
        for key in ("busiest_over_mean", "token_spread", "kv_vs_full_ring", "planning_ms", "kernel_calls_max"):
            assert s[key] == max(r[key] for r in mine)
        assert s["predicted_speedup_over_zigzag"] == min(r["predicted_speedup_over_zigzag"] for r in mine)
    ranks = [r for r in results if r["kind"] == "ranks"]
    assert {(r["world_size"], r["mix"], r["layout"]) for r in ranks} == {
        (P, mix, name) for P in cfg["ranks"]["world_sizes"] for mix in cfg["mixes"]
        for name in ("zigzag", "contiguous", "balanced")}
    for r in ranks:
        zz = next(z for z in ranks if (z["world_size"], z["mix"], z["layout"]) == (r["world_size"], r["mix"], "zigzag"))
        assert len(r["compute_s_per_rank"]) == r["world_size"] and min(r["compute_s_per_rank"]) > 0
        assert r["compute_speedup_over_zigzag"] == pytest.approx(zz["compute_s_max"] / max(r["compute_s_per_rank"]))
        assert r["wall_speedup_over_zigzag"] == pytest.approx(zz["wall_s_max"] / max(r["wall_s_per_rank"]))
        assert r["predicted_speedup_over_zigzag"] == pytest.approx(
            max(zz["entries_visible_per_rank"]) / max(r["entries_visible_per_rank"]))
        assert sum(r["tokens_per_rank"]) == cfg["ranks"]["seq_len"] and r["busiest_over_mean"] >= 1
        assert r["max_abs_diff_vs_zigzag"] < 1e-5  # every layout computes the same attention
        assert all(s >= c >= 1 for c, s in zip(r["kernel_calls_per_rank"], r["varlen_sequences_per_rank"]))


def test_layouts_plot(layouts_smoke):
    written = importlib.import_module("plot").main([layouts_smoke])
    assert [os.path.basename(p) for p in written] == ["cp_layouts.png"]
    with open(written[0], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(written[0]) > 5000


def test_planning_benchmark_smoke(tmp_path):
    import json

    bench_planning = importlib.import_module("bench_planning")
    assert bench_planning.main(["--smoke", "--out", str(tmp_path)]) == 0
    records = json.load(open(tmp_path / "planning.json"))["records"]
    assert {(r["mask"], r["layout"]) for r in records} == {(m, lay) for m in bench_planning.MASKS
                                                            for lay in ("zigzag", "balanced")}
    for r in records:
        assert r["total_ms"] >= r["plan_ms"] > 0 and r["ratio_to_first_length"] > 0
        assert (r["layout_ms"] > 0) == (r["layout"] == "balanced") or r["layout_ms"] < 1
    pos = bench_planning.packed_positions(4096, 50, seed=0)
    assert pos.shape == (1, 4096) and int((pos == 0).sum()) == 50  # 50 documents fill the row


def test_planning_scale_smoke(tmp_path):
    """``bench_planning.py --scale --smoke``: every mix at every world size, the parts timed, the
    growth exponents fitted (a known power law gives its power), the JSON and the plot written."""
    import json

    bench_planning = importlib.import_module("bench_planning")
    assert abs(bench_planning.exponent([64, 128, 256], [3.0, 12.0, 48.0]) - 2.0) < 1e-9
    assert bench_planning.exponent([64], [1.0]) is None
    assert bench_planning.main(["--scale", "--smoke", "--out", str(tmp_path)]) == 0
    payload = json.load(open(tmp_path / "planning_scale.json"))
    records = payload["records"]
    assert {(r["mix"], r["P"]) for r in records} == {(m, P) for m in bench_planning.MIXES for P in (4, 128)}
    for r in records:
        assert r["layout_plan_ms"] >= r["plan_ms"] > 0 and r["layout_ms"] > 0 and r["auto_ms_per_mask"] > 0
        assert r["auto_step_ms"] >= r["layout_ms"] + r["auto_ms_per_mask"] and r["auto_plan_ms_per_mask"] > 0
    assert {g["mix"] for g in payload["growth"]} == set(bench_planning.MIXES)
    assert (tmp_path / "planning_scale.png").stat().st_size > 0


def test_stream_benchmark_smoke(tmp_path):
    """``bench_stream.py --smoke``: both partitions of every mix on the same batch, the stream within
    the goals (busiest cost within 5% of the mean, no rank above 1.25 x L / P tokens; the search
    misses them on this small batch), the JSON written."""
    import json

    bench_stream = importlib.import_module("bench_stream")
    assert bench_stream.main(["--smoke", "--out", str(tmp_path)]) == 0
    records = json.load(open(tmp_path / "stream.json"))["records"]
    mixes = importlib.import_module("bench_planning").MIXES
    assert {(r["mix"], r["partition"]) for r in records} == {(m, p) for m in mixes for p in ("search", "stream")}
    for r in records:
        assert r["busiest_over_mean"] >= 1.0 and r["recv_busiest"] >= r["recv_mean"] >= 0 and r["layout_ms"] > 0
        if r["partition"] == "stream":
            assert r["busiest_over_mean"] <= 1.05 and r["max_tokens_over_mean"] <= 1.25


# ----------------------------------------------------------------------------------------------
# bench_strategies.py: ring, ulysses, usp and auto per layer


@pytest.mark.slow  # about 16 s; the strategies' exactness: tests/multirank/test_ulysses.py
def test_strategies_smoke(tmp_path):
    """``bench_strategies.py --smoke``: each configuration's step time per strategy is the sum over
    its layers of that strategy's modeled layer time; auto's pick per mask is the engine's choice and
    the cheapest candidate of that mask (auto never above the cheapest by more than 2%: here
    exactly it); the real ranks ran what they were asked, with outputs equal to the ring's."""
    bench_strategies = importlib.import_module("bench_strategies")
    threads = torch.get_num_threads()
    try:
        assert bench_strategies.main(["--smoke", "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    results = harness.load_results(os.path.join(tmp_path, "strategies.json"))["results"]
    layers = [r for r in results if r["kind"] == "layer"]
    summaries = [r for r in results if r["kind"] == "summary"]
    assert len(summaries) == len(bench_strategies.MODELS) * 2 * 2  # models x data x world sizes (4, 8)
    for s in summaries:
        rows = [r for r in layers if all(r[k] == s[k] for k in ("model", "seq_len", "world_size", "data"))]
        for name, step in s["step_s"].items():
            assert step == pytest.approx(sum(r["layers"] * r["modeled_s"] for r in rows if r["strategy"] == name))
        auto = 0.0
        for mask, pick in s["auto_picks"].items():
            per = {r["strategy"]: r for r in rows if r["mask"] == mask}
            assert per[pick]["modeled_s"] <= 1.02 * min(r["modeled_s"] for r in per.values()), (s, mask)
            assert pick == min(per, key=lambda n: per[n]["modeled_s"])
            auto += per[pick]["layers"] * per[pick]["modeled_s"]
        assert s["auto_s"] == pytest.approx(auto) and s["auto_over_cheapest_per_layer"] <= 1.02
        assert s["auto_s"] <= min(s["step_s"].values()) * (1 + 1e-12)
        assert s["auto_over_ring"] == pytest.approx(auto / s["step_s"]["ring"])
    ranks = [r for r in results if r["kind"] == "ranks"]
    assert {r["strategy"] for r in ranks} == {"ring", "ulysses", "auto"}  # P = 2
    for r in ranks:
        assert r["max_abs_diff_vs_ring"] < 1e-4, r
        if r["strategy"] != "auto":
            assert set(r["picks"]) == {r["strategy"]} and len(r["picks"]) == 4, r
        assert r["measured_over_ring"] > 0 and r["predicted_over_ring"] > 0 and r["compute_over_ring"] > 0
        assert r["compute_s_max"] <= r["wall_s_max"] and r["layout"] in ("zigzag", "contiguous")
        if r["strategy"] == "ring":
            assert r["predicted_compute_over_ring"] == 1.0 == r["compute_over_ring"]
    # contiguous shards of one causal document: the ring's last rank does 3/4 of the pairs at P = 2,
    # head parallelism half: the model's compute ratio follows from that (tiles round it up a little)
    uly = next(r for r in ranks if r["layout"] == "contiguous" and r["strategy"] == "ulysses")
    assert 0.6 < uly["predicted_compute_over_ring"] < 0.9, uly
    written = importlib.import_module("plot").plot_strategies(harness.load_results(
        os.path.join(tmp_path, "strategies.json")), os.path.join(tmp_path, "strategies.png"))
    assert os.path.getsize(written) > 5000


@pytest.mark.slow  # 8 s
def test_hybrids_smoke(tmp_path):
    """``bench_hybrids.py --smoke``: a hybrid model on 2 gloo ranks equals itself on one rank, its
    mixers moved halos and states (bytes > 0, far below what head parallelism would move), and the
    step-time ratios were measured."""
    bench_hybrids = importlib.import_module("bench_hybrids")
    threads = torch.get_num_threads()
    try:
        assert bench_hybrids.main(["--smoke", "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    rows = harness.load_results(os.path.join(tmp_path, "hybrids.json"))["results"]
    assert [(r["model"], r["world_size"]) for r in rows] == [("qwen3_next", 2)]
    r = rows[0]
    assert r["max_abs_diff_vs_one_rank"] < 1e-4
    assert r["conv_layers"] > 0 and r["recurrence_layers"] > 0
    assert 0 < r["conv_bytes_per_layer"] and 0 < r["state_bytes_per_layer"] < r["head_parallel_bytes_per_layer"]
    assert r["wall_over_one_rank"] > 0 and r["cpu_over_one_rank"] > 0
