"""torch.compile of "cp_flash" models (issue #14 part 5).

At world size 1 a cp_flash layer is one opaque custom op (``cp_attention::local_attention``) whose
plan is built inside from the ``position_ids`` and masks it receives: a 2-layer model compiles to one
graph with no break, a new document layout of the same length runs the same graph, and compiled
outputs and gradients equal eager cp_flash and the documents run alone through transformers' eager
attention. Under context parallelism (2 gloo ranks) a layer is the multi-rank op
(``cp_attention::bound_attention``), which binds its batch, agrees, plans and exchanges when it runs:
the compiled model has no graph break at the attention, is exact there too and does not recompile per
batch, under the ring and under head parallelism.

Compiles use the "eager" and "aot_eager" backends (fast on CPU); references are float32.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo as dynamo
from torch._dynamo.testing import CompileCounterWithBackend

import cp_attention
from cp_attention.engine import context
from cp_attention.tools.launch import run_ranks
from cp_attention.tools.tiny_models import tiny_config, tiny_model
from hf_cases import compare, failures, flat_grads, ground_truth, inputs

pytestmark = [pytest.mark.multirank, pytest.mark.transformers]  # spawns gloo ranks; builds transformers models

TOL = 1e-5  # logits, absolute; gradients: 1e-5 of the largest reference gradient (hf_cases.grad_tol)
L = 48
# document lengths per row: three packings of the same (2, 48) batch
LAYOUTS = ([[20, 28], [11, 30, 7]], [[48], [24, 24]], [[5, 17, 26], [40, 8]])


def _case(family: str, docs, seed: int = 0) -> dict:
    return dict(name=f"{family}/{docs}", family=family, window=5, L=L, B=len(docs), docs=docs, packed=True, seed=seed)


def _model(family: str, attn_implementation: str):
    """2 layers, sliding window 5 (chunks of 5 for Llama 4), same random weights for every implementation."""
    cfg = tiny_config(family, window=5, chunk=5, layers=2)
    return tiny_model(family, attn_implementation, seed=0, config=cfg)


def _op_calls(graphs) -> int:
    return sum(1 for gm in graphs for node in gm.graph.nodes
               if node.op == "call_function" and "cp_attention.local_attention" in str(node.target))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    dynamo.reset()
    yield
    dynamo.reset()


def test_two_layer_forward_is_one_graph_without_breaks():
    """Before: 46 graphs (breaks at the context lookup, the planner, the backends' .item() calls, ...)."""
    model = _model("qwen3", "cp_flash")
    ids, pos, _ = inputs(_case("qwen3", LAYOUTS[0]), model.config.vocab_size)
    explained = dynamo.explain(model)(input_ids=ids, position_ids=pos, use_cache=False)
    in_layers = [b for b in explained.break_reasons
                 if any("cp_attention" in f.filename or "/models/" in f.filename for f in b.user_stack)]
    assert not in_layers, [b.reason.splitlines()[0] for b in in_layers]
    assert explained.graph_count <= 3, [b.reason.splitlines()[0] for b in explained.break_reasons]
    assert _op_calls(explained.graphs) == 2  # both layers' attention is the op, inside the graph(s)
    # the op reports its plans: one per layer, for the latest forward only
    compiled_model = torch.compile(model, backend="eager")
    for _ in range(2):
        compiled_model(input_ids=ids, position_ids=pos, use_cache=False)
        assert [layer for layer, _ in cp_attention.forward_plan_stats()] == [0, 1]
    assert cp_attention.last_plan_stats().kernel_calls >= 1


def test_new_document_layout_does_not_recompile():
    """Three packings of the same shape: one compiled frame, and each batch gets its own documents."""
    model, eager = _model("qwen3", "cp_flash"), _model("qwen3", "eager")
    counter = CompileCounterWithBackend("aot_eager")
    compiled_model = torch.compile(model, backend=counter)
    for seed, docs in enumerate(LAYOUTS):
        case = _case("qwen3", docs, seed)
        ref = ground_truth(case, eager)
        ids, pos, R = inputs(case, model.config.vocab_size)
        model.zero_grad(set_to_none=True)
        out = compiled_model(input_ids=ids, position_ids=pos, use_cache=False)
        (out.logits * R).sum().backward()
        assert not failures([compare(case, model, out.logits.detach(), flat_grads(model), ref, "compiled")], TOL)
        assert counter.frame_count == 1, f"recompiled for documents {docs}"


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss", "llama4"])
def test_compiled_forward_backward_is_exact(family):
    """qwen3: sliding + full layers; gpt_oss: sinks (their gradient); llama4: chunked layers, whose
    documents come from the mask (its layers get no position_ids). Against the documents run alone
    through transformers' eager attention, and against eager cp_flash."""
    case = _case(family, LAYOUTS[2], seed=7)
    ref = ground_truth(case, _model(family, "eager"))
    model = _model(family, "cp_flash")
    ids, pos, R = inputs(case, model.config.vocab_size)
    model.zero_grad(set_to_none=True)
    out_eager = model(input_ids=ids, position_ids=pos, use_cache=False)
    (out_eager.logits * R).sum().backward()
    grads_eager = flat_grads(model)

    model.zero_grad(set_to_none=True)
    counter = CompileCounterWithBackend("aot_eager")
    out = torch.compile(model, backend=counter)(input_ids=ids, position_ids=pos, use_cache=False)
    (out.logits * R).sum().backward()
    grads = flat_grads(model)
    assert counter.frame_count == 1
    assert not failures([compare(case, model, out.logits.detach(), grads, ref, "compiled")], TOL)
    assert float((out.logits - out_eager.logits).detach().abs().max()) <= 1e-6
    assert float((grads - grads_eager).abs().max()) <= 1e-6 * max(1.0, float(grads_eager.abs().max()))


def test_op_checks_the_context_when_it_runs(monkeypatch):
    """dynamo cannot guard on the context (a contextvar): a graph traced outside context parallelism
    that runs inside a context of several ranks on tensors shard_batch did not return raises, as eager
    cp_flash does, instead of attending within the shard."""
    model = _model("qwen3", "cp_flash")
    ids, pos, _ = inputs(_case("qwen3", LAYOUTS[0]), model.config.vocab_size)
    compiled_model = torch.compile(model, backend="eager")
    compiled_model(input_ids=ids, position_ids=pos, use_cache=False)

    class TwoRanks:
        world_size, backend = 2, "auto"

    monkeypatch.setattr(context, "active_context", lambda: TwoRanks())
    with pytest.raises(ValueError, match="shard_batch"):
        compiled_model(input_ids=ids, position_ids=pos, use_cache=False)


def test_op_registration():
    """Schema, fake (meta) implementation and autograd registration of the op (torch.library.opcheck)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 12, 4, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 12, 2, 8, generator=g, requires_grad=True) for _ in range(2))
    sinks = torch.randn(4, generator=g, requires_grad=True)
    pos = torch.cat([torch.arange(5), torch.arange(7)]).expand(2, 12)
    spans = torch.zeros(2, 12, dtype=torch.bool)
    spans[:, 1:3] = True  # tokens 1..3 see each other (a bidirectional span)
    args = (q, k, v, sinks, pos, None, None, None, spans, 0, 0, True, True, 4, None, None, 0.3, "reference", -1, True)
    torch.library.opcheck(torch.ops.cp_attention.local_attention.default, args)


# ----------------------------------------------------------------------------------------------
# context parallelism: 2 gloo ranks


def _cp_worker(rank: int, world_size: int, cases: list[dict], refs: list[dict], strategy: str):
    """Compile once, run every case (forward + backward) under context_parallel; returns per case the
    compare() result and the number of graphs compiled so far, the graph break reasons and the
    multi-rank op calls in the graphs."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    torch.set_num_threads(1)
    dynamo.reset()
    counters.clear()
    model = _model(cases[0]["family"], "cp_flash")
    counter = CompileCounterWithBackend("aot_eager")
    compiled_model = torch.compile(model, backend=counter)
    results = []
    for case, ref in zip(cases, refs):
        ids, pos, R = inputs(case, model.config.vocab_size)
        model.zero_grad(set_to_none=True)
        with cp_attention.context_parallel(strategy=strategy) as cp:
            batch = cp.shard_batch(input_ids=ids, position_ids=pos)
            out = compiled_model(**batch, use_cache=False)
            (out.logits * cp.shard(R, dim=1)).sum().backward()
            logits = cp.gather(out.logits.detach(), dim=1)
        grads = flat_grads(model)
        dist.all_reduce(grads)
        results.append((compare(case, model, logits, grads, ref, f"compiled, world size 2, rank {rank}"),
                        counter.frame_count))
    ops = sum(1 for gm in counter.graphs for node in gm.graph.nodes
              if node.op == "call_function" and "cp_attention.bound_attention" in str(node.target))
    return results, sorted(counters["graph_break"]), ops


@pytest.mark.parametrize("strategy", ["ring", pytest.param("ulysses", marks=pytest.mark.strategies)])
def test_compiled_under_context_parallelism_is_exact(strategy):
    """Two batches with different documents on 2 ranks: exact against the documents alone through
    transformers' eager attention, at most 3 graphs for 2 layers (before the multi-rank op: 13, a
    break at every mask and every layer), both layers' attention the op inside the graphs, no graph
    break at cp_attention's functions, and no recompilation for the second packing."""
    cases = [_case("qwen3", docs, seed) for seed, docs in enumerate(LAYOUTS[:2])]
    eager = _model("qwen3", "eager")
    refs = [ground_truth(case, eager) for case in cases]
    per_rank = run_ranks(2, _cp_worker, cases, refs, strategy, timeout=600)
    for results, reasons, ops in per_rank:
        assert not failures([r for r, _ in results], TOL)
        graphs = [n for _, n in results]
        assert graphs[0] == graphs[-1], f"recompiled for a new batch under context parallelism: {graphs} graphs"
        assert graphs[0] <= 3, (graphs, reasons)
        assert ops == 2, f"{ops} multi-rank op calls in the graphs, expected one per layer"
        assert not any("cp_attention" in r or "_bound" in r for r in reasons), reasons
