"""Bad inputs raise a clear TypeError/ValueError naming the argument, on every rank, without hanging."""

from __future__ import annotations

import pytest
import torch

import cp_attention
from cp_attention.masks import MaskSpec, SequenceMeta
from cp_attention.tools.launch import run_ranks
from oracle import dense_attention


def _inputs(L=12, B=1, H=4, K=2, D=8, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(B, L, H, D, generator=gen, dtype=dtype), torch.randn(B, L, K, D, generator=gen, dtype=dtype),
            torch.randn(B, L, K, D, generator=gen, dtype=dtype))


def _bad_cases(L):
    """(name, function of (q, k, v) -> attention kwargs incl. tensors, error type, message fragment)."""
    cu_ok = torch.tensor([0, 5, L], dtype=torch.int32)
    return [
        ("q-3d", lambda q, k, v: dict(q=q[0], k=k, v=v), ValueError, "q must have shape"),
        ("kv-shape", lambda q, k, v: dict(q=q, k=k, v=v[:, :, :1]), ValueError, "k and v must have the same shape"),
        ("heads", lambda q, k, v: dict(q=q[:, :, :3], k=k, v=v), ValueError, "multiple of key/value heads"),
        ("head-dim", lambda q, k, v: dict(q=q[..., :4], k=k, v=v), ValueError, "same head_dim"),
        ("dtype", lambda q, k, v: dict(q=q.int(), k=k.int(), v=v.int()), TypeError, "dtype"),
        ("mixed-dtype", lambda q, k, v: dict(q=q.double(), k=k, v=v), TypeError, "share one dtype"),
        ("both-docs", lambda q, k, v: dict(q=q, k=k, v=v, position_ids=torch.zeros(1, q.shape[1], dtype=torch.long),
                                           cu_seqlens=cu_ok), ValueError, "either position_ids or cu_seqlens"),
        ("cu-order", lambda q, k, v: dict(q=q, k=k, v=v, cu_seqlens=torch.tensor([0, 7, 3, L], dtype=torch.int32)),
         ValueError, "non-decreasing"),
        ("cu-end", lambda q, k, v: dict(q=q, k=k, v=v, cu_seqlens=torch.tensor([0, 5, L + 3], dtype=torch.int32)),
         ValueError, "cu_seqlens must end"),
        ("cu-batch", lambda q, k, v: dict(q=q.expand(2, -1, -1, -1), k=k.expand(2, -1, -1, -1),
                                          v=v.expand(2, -1, -1, -1), cu_seqlens=cu_ok), ValueError, "B = 2"),
        ("window", lambda q, k, v: dict(q=q, k=k, v=v, window=0), ValueError, "window must be a positive int"),
        ("chunk", lambda q, k, v: dict(q=q, k=k, v=v, chunk_size=-4), ValueError, "chunk_size must be a positive int"),
        ("sinks", lambda q, k, v: dict(q=q, k=k, v=v, sinks=torch.zeros(3)), ValueError, "sinks must have shape"),
        ("pos-shape", lambda q, k, v: dict(q=q, k=k, v=v, position_ids=torch.zeros(1, 3, dtype=torch.long)),
         ValueError, "position_ids must have shape"),
        ("layout", lambda q, k, v: dict(q=q, k=k, v=v, layout="ring"), ValueError, "layout must be one of"),
        ("backend", lambda q, k, v: dict(q=q, k=k, v=v, backend="cudnn"), ValueError, "backend must be"),
    ]


@pytest.mark.parametrize("case", _bad_cases(12), ids=[c[0] for c in _bad_cases(12)])
def test_single_device_bad_input(case):
    _, make, exc, fragment = case
    with pytest.raises(exc, match=fragment):
        kw = make(*_inputs())
        cp_attention.attention(kw.pop("q"), kw.pop("k"), kw.pop("v"), **kw)


def _catch(fn):
    try:
        fn()
    except (TypeError, ValueError) as e:
        return (type(e).__name__, str(e))
    return None


def _bad_worker(rank, world_size):
    L = 12
    results = {}
    with cp_attention.context_parallel() as cp:
        q, k, v = (cp.shard(t) for t in _inputs(L))
        cp_attention.attention(q, k, v)  # a cached plan must not let bad inputs through
        for name, make, _, _ in _bad_cases(L):
            def call():
                kw = make(q, k, v)
                cp_attention.attention(kw.pop("q"), kw.pop("k"), kw.pop("v"), **kw)
            results[name] = _catch(call)
    # asymmetric mistakes: ranks disagree, every rank must still raise, none may hang. A cold plan
    # cache: ranks agree when plans are built; a rank that alone changes its arguments while the
    # others reuse a cached plan is not detected yet (README, "Known limits").
    with cp_attention.context_parallel() as cp:
        q, k, v = (cp.shard(t) for t in _inputs(L))
        results["disagree-window"] = _catch(lambda: cp_attention.attention(q, k, v, window=5 if rank else None))
        extra = torch.cat([q, q[:, :1]], 1) if rank == 1 else q
        extra_kv = (torch.cat([k, k[:, :1]], 1), torch.cat([v, v[:, :1]], 1)) if rank == 1 else (k, v)
        results["local-length"] = _catch(lambda: cp_attention.attention(extra, *extra_kv, layout="contiguous"))
        results["one-rank-dtype"] = _catch(lambda: cp_attention.attention(q.int() if rank == 0 else q, k, v))
        results["one-rank-window"] = _catch(lambda: cp_attention.attention(q, k, v, window=0 if rank == 0 else 16))
        # and the group still works afterwards
        out = cp_attention.attention(q, k, v, window=4)
        results["after"] = bool(torch.isfinite(out).all())
    # no group and no context inside a job: an ordinary single-device attention on full tensors
    q_full, k_full, v_full = _inputs(L)
    single = cp_attention.attention(q_full, k_full, v_full, window=4)
    ref = dense_attention(q_full.double(), k_full.double(), v_full.double(), SequenceMeta(batch=1, seq_len=L),
                          MaskSpec(window=4))
    results["single_in_job"] = (single.double() - ref).abs().max().item()
    return results


def test_bad_inputs_raise_on_every_rank_without_hanging():
    per_rank = run_ranks(2, _bad_worker, timeout=180)
    for name, _, exc, fragment in _bad_cases(12):
        for rank, res in enumerate(per_rank):
            assert res[name] is not None, f"rank {rank} accepted bad input {name}"
            assert res[name][0] == exc.__name__ and fragment in res[name][1], (rank, name, res[name])
        assert per_rank[0][name] == per_rank[1][name], f"{name}: ranks raised different errors"
    for rank, res in enumerate(per_rank):
        assert res["disagree-window"][0] == "ValueError" and "ranks disagree on window" in res["disagree-window"][1]
        assert res["local-length"][0] == "ValueError" and "do not match" in res["local-length"][1]
        assert res["after"]
        assert res["single_in_job"] < 1e-5, res["single_in_job"]
    assert per_rank[0]["one-rank-dtype"][0] == "TypeError"
    assert per_rank[1]["one-rank-dtype"] == ("TypeError", f"rank 0 rejected its inputs: {per_rank[0]['one-rank-dtype'][1]}")
    assert per_rank[0]["one-rank-window"][0] == "ValueError"
    assert per_rank[1]["one-rank-window"] == ("ValueError", f"rank 0 rejected its inputs: {per_rank[0]['one-rank-window'][1]}")
