"""Rank workers for tests/multirank/test_prepare_ranks.py: steps whose batch was planned ahead (``cp.prepare``,
``cp.prefetch``, a background thread) against the same steps unprepared, in a fresh context each (so
that nothing is cached from an earlier step), counting every planning function the step calls.

Two kinds of step: a tiny transformers model under ``attn_implementation="cp_flash"`` (logits gathered,
gradients summed over the ranks, compared with docs-alone eager on one device: ``hf_cases``), and the
bare ``cp_attention.attention`` on the tensors ``cp.shard_batch`` returned (float64, compared with the
dense float64 oracle). Workers are module-level functions so spawned ranks can import them.

Legend: ``B`` rows, ``L`` global length, ``H``/``K`` query/KV heads, ``D`` head dim.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

import cp_attention
from cp_attention.engine import agreement, batch as batch_mod, planning
from cp_attention.layout import balanced as balanced_mod
from cp_attention.masks import SequenceMeta
from cp_attention.tools.sweeps.compare import flat_grads
from cp_attention.tools.tiny_models import tiny_model
from hf_cases import compare, inputs
from oracle import oracle_attention, oracle_mask
from planutil import strategy_options

WINDOW = 5
# one packed row, documents across the shards; the others are further batches of the same length
DOCS = ([[23, 30, 14]], [[40, 27]], [[9, 9, 49]])
L = 67
MASKS = (dict(causal=True, window=WINDOW), dict(causal=True))  # the bare calls' masks
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
MISS_LOG = "a prepared batch planned on its step"

# the planning functions a step must not call when its batch was prepared: (owner, attribute)
PLANNERS = {
    "build_rank_plan": (planning, "build_rank_plan"),
    "choose": (planning, "choose"),
    "rank_plans": (planning, "rank_plans"),
    "balanced_layout_of": (balanced_mod, "balanced_layout_of"),
    "meta_crc (record)": (batch_mod, "meta_crc"),
    "meta_crc (agreement)": (agreement, "meta_crc"),
    "SequenceMeta.__init__": (SequenceMeta, "__init__"),
    "SequenceMeta.digest": (SequenceMeta, "digest"),
}


@contextlib.contextmanager
def counting():
    """Count the calls of :data:`PLANNERS` that the thread entering the block makes inside it (the
    step's critical path; a thread preparing meanwhile is not counted), then restore them."""
    counts: Counter = Counter()
    saved = []
    me = threading.get_ident()
    for name, (owner, attr) in PLANNERS.items():
        original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)

        def counted(*args, _name=name, _original=original, **kwargs):
            if threading.get_ident() == me:
                counts[_name] += 1
            return _original(*args, **kwargs)

        saved.append((owner, attr, original))
        setattr(owner, attr, counted)
    try:
        yield counts
    finally:
        for owner, attr, original in saved:
            setattr(owner, attr, original)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def log_lines():
    """The messages of the ``cp_attention.api`` logger at INFO and above inside the block."""
    logger, handler = logging.getLogger("cp_attention.api"), _Lines()
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def case(i: int = 0) -> dict:
    """The hf_cases case of batch ``i`` (qwen3, window 5, one packed row of :data:`DOCS` [i])."""
    return dict(name=f"qwen3/prepared-{i}", family="qwen3", window=WINDOW, L=L, B=1, docs=DOCS[i], packed=True,
                seed=40 + i)


def model():
    return tiny_model("qwen3", "cp_flash", window=WINDOW)


def model_batch(i: int, vocab: int) -> tuple[dict, torch.Tensor]:
    """Batch ``i`` as ``shard_batch`` takes it, and the loss weights R (B, L, vocab)."""
    ids, pos, R = inputs(case(i), vocab)
    return dict(input_ids=ids, position_ids=pos), R


def model_step(cp, net, batch: dict, R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One training step: gathered logits (B, L, vocab) and the gradients summed over the ranks."""
    net.zero_grad(set_to_none=True)
    local = cp.shard_batch(**batch, model=net)
    out = net(**local, use_cache=False)
    (out.logits * cp.shard(R, dim=1)).sum().backward()
    logits = cp.gather(out.logits.detach(), dim=1)
    grads = flat_grads(net)
    dist.all_reduce(grads)
    return logits, grads


def _unprepared(net, batch, R, layout, strategy):
    with cp_attention.context_parallel(layout=layout, timeout=120, **strategy_options(strategy)) as cp:
        with counting() as counts:
            logits, grads = model_step(cp, net, batch, R)
        return logits, grads, counts, cp.planning_stats()


def model_steps(rank: int, world_size: int, layouts, strategies, refs: dict) -> list[dict]:
    """Per (layout, strategy): the step unprepared, then prepared ahead in a fresh context; the planning
    calls of each, their planning statistics, whether they are equal, and the prepared step's errors
    against the one-device reference ``refs[case name]``."""
    net = model()
    batch, R = model_batch(0, net.config.vocab_size)
    results = []
    for layout in layouts:
        for strategy in strategies:
            logits0, grads0, counts0, stats0 = _unprepared(net, batch, R, layout, strategy)
            with cp_attention.context_parallel(layout=layout, timeout=120, **strategy_options(strategy)) as cp:
                prepared = cp.prepare(**batch, model=net)
                with counting() as counts:
                    logits, grads = model_step(cp, net, batch, R)
                stats = cp.planning_stats()
            where = f"{layout} {strategy} rank={rank}"
            results.append(dict(where=where, counts=dict(counts), unprepared_counts=dict(counts0), stats=stats,
                                unprepared_stats=stats0, plans=prepared.plans,
                                equal=torch.equal(logits, logits0) and torch.equal(grads, grads0),
                                compared=compare(case(0), net, logits, grads, refs[case(0)["name"]], where)))
    return results


# ----------------------------------------------------------------------------------------------
# the bare API


def bare_inputs(i: int = 0):
    """Batch ``i`` for the bare calls: ``shard_batch`` keywords, q (B, L, H, D), k, v (B, L, K, D) and
    one loss weight per mask, all float64."""
    g = torch.Generator().manual_seed(70 + i)
    pos = torch.cat([torch.arange(n) for n in DOCS[i][0]])[None]
    ids = torch.randint(3, 100, (1, L), generator=g)
    q = torch.randn(1, L, HEADS, HEAD_DIM, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, L, KV_HEADS, HEAD_DIM, generator=g, dtype=torch.float64) for _ in range(2))
    weights = [torch.randn(1, L, HEADS, HEAD_DIM, generator=g, dtype=torch.float64) for _ in MASKS]
    return dict(input_ids=ids, position_ids=pos), q, k, v, weights


def bare_step(cp, batch, q, k, v, weights):
    """``attention`` per mask of :data:`MASKS` on the batch's shards: gathered outputs and gradients."""
    local = cp.shard_batch(**batch)
    ql, kl, vl = (cp.shard(t, dim=1).detach().requires_grad_() for t in (q, k, v))
    outs, loss = [], 0
    for mask, w in zip(MASKS, weights):
        out = cp_attention.attention(ql, kl, vl, position_ids=local["position_ids"], **mask)
        outs.append(cp.gather(out.detach(), dim=1))
        loss = loss + (out * cp.shard(w, dim=1)).sum()
    loss.backward()
    return outs + [cp.gather(t.grad, dim=1) for t in (ql, kl, vl)]


def bare_reference(batch, q, k, v, weights):
    """The dense float64 oracle: outputs per mask and dq, dk, dv of the same loss."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    outs, loss = [], 0
    for mask, w in zip(MASKS, weights):
        out = oracle_attention(q, k, v, oracle_mask(1, L, position_ids=batch["position_ids"], **mask))
        outs.append(out.detach())
        loss = loss + (out * w).sum()
    loss.backward()
    return outs + [q.grad, k.grad, v.grad]


def bare_steps(rank: int, world_size: int, layouts, strategies) -> list[dict]:
    """Per (layout, strategy): the bare step unprepared and prepared ahead (masks and shapes given),
    their planning calls and statistics, equality, and the prepared step's error against the oracle."""
    batch, q, k, v, weights = bare_inputs(0)
    reference = bare_reference(batch, q, k, v, weights)
    results = []
    for layout in layouts:
        for strategy in strategies:
            options = dict(layout=layout, timeout=120, **strategy_options(strategy))
            with cp_attention.context_parallel(**options) as cp:
                with counting() as counts0:
                    plain = bare_step(cp, batch, q, k, v, weights)
            with cp_attention.context_parallel(**options) as cp:
                cp.prepare(**batch, masks=list(MASKS), heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                           dtype=torch.float64)
                with counting() as counts:
                    found = bare_step(cp, batch, q, k, v, weights)
                stats = cp.planning_stats()
            results.append(dict(where=f"{layout} {strategy} rank={rank}", counts=dict(counts),
                                unprepared_counts=dict(counts0), stats=stats,
                                equal=all(torch.equal(a, b) for a, b in zip(found, plain)),
                                error=max(float((a - b).abs().max()) for a, b in zip(found, reference))))
    return results


# ----------------------------------------------------------------------------------------------
# in a background thread


def threaded_steps(rank: int, world_size: int, layout: str, strategy: str) -> dict:
    """Steps over three batches whose next batch is prepared in a background thread while the current
    step runs: through ``cp.prefetch`` (a generator standing for the data loader; the layout and plans
    computed by an executor), and by a plain
    ``threading.Thread`` started from inside the step's forward. Each step's planning calls, whether
    its results equal the unprepared step's, the planning statistics, and when the thread prepared."""
    net = model()
    batches = [model_batch(i, net.config.vocab_size) for i in range(len(DOCS))]
    plain = [_unprepared(net, b, R, layout, strategy)[:2] for b, R in batches]
    found: dict = dict(prefetch=[], thread=[])
    options = dict(layout=layout, timeout=120, **strategy_options(strategy))
    with cp_attention.context_parallel(**options) as cp, ThreadPoolExecutor(2) as pool:
        weights = {id(b): R for b, R in batches}
        for i, batch in enumerate(cp.prefetch((b for b, _ in batches), model=net, executor=pool)):
            with counting() as counts:
                logits, grads = model_step(cp, net, batch, weights[id(batch)])
            found["prefetch"].append(dict(counts=dict(counts), equal=torch.equal(logits, plain[i][0])
                                          and torch.equal(grads, plain[i][1])))
        found["prefetch_stats"] = cp.planning_stats()
    with cp_attention.context_parallel(**options) as cp:
        for i in range(len(batches) - 1):
            inside, when = threading.Event(), {}

            def ahead(nxt=batches[i + 1][0]):
                inside.wait(60)
                when["start"] = time.perf_counter()
                cp.prepare(**nxt, model=net)
                when["end"] = time.perf_counter()

            hook = net.model.layers[0].register_forward_pre_hook(lambda *_: inside.set())
            worker = threading.Thread(target=ahead)
            worker.start()
            with counting() as counts:  # step i (step 0 unprepared) while the thread prepares step i + 1
                logits, grads = model_step(cp, net, *batches[i])
            step_end = time.perf_counter()
            hook.remove()
            worker.join(60)
            found["thread"].append(dict(counts=dict(counts), equal=torch.equal(logits, plain[i][0])
                                        and torch.equal(grads, plain[i][1]),
                                        overlapped=when["start"] < step_end))
        with counting() as counts:
            logits, grads = model_step(cp, net, *batches[-1])
        found["thread"].append(dict(counts=dict(counts), equal=torch.equal(logits, plain[-1][0])
                                    and torch.equal(grads, plain[-1][1])))
        found["thread_stats"] = cp.planning_stats()
    return found


# ----------------------------------------------------------------------------------------------
# prepared for something else than the step


def mismatched_steps(rank: int, world_size: int) -> list[dict]:
    """Batches prepared with other masks, another dtype, other shapes, or (balanced) without the model
    the step passes: each step's statistics, its log lines, and whether it equals the unprepared step."""
    net = model()
    batch, R = model_batch(0, net.config.vocab_size)
    variants = (("zigzag", "other masks", dict(model=net, masks=[dict(window=3)])),
                ("zigzag", "other dtype", dict(model=net, dtype=torch.bfloat16)),
                ("zigzag", "other heads", dict(masks=[dict(window=WINDOW), dict()], heads=8, kv_heads=2,
                                               head_dim=16, dtype=torch.float32)),
                ("balanced", "no model", dict(masks=[dict(window=WINDOW), dict()], heads=4, kv_heads=2,
                                              head_dim=16, dtype=torch.float32)))
    results = []
    for layout, what, prepare_kwargs in variants:
        logits0, grads0, _, _ = _unprepared(net, batch, R, layout, "ring")
        with cp_attention.context_parallel(layout=layout, timeout=120) as cp:
            cp.prepare(**batch, **prepare_kwargs)
            with log_lines() as lines:
                logits, grads = model_step(cp, net, batch, R)
            stats = cp.planning_stats()
        results.append(dict(what=what, stats=stats, misses_logged=sum(MISS_LOG in line for line in lines),
                            equal=torch.equal(logits, logits0) and torch.equal(grads, grads0)))
    return results
