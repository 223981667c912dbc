"""Cases and rank workers for tests/integrations/test_transformers_families.py (issue 3, "must show" item 1).

Every family of ``cp_attention.tools.tiny_models`` runs under ``attn_implementation="cp_flash"`` and is
compared with the ground truth: the same weights under ``"eager"`` on one device with each packed
document run alone (never transformers' packed eager, which lets gpt-oss documents see each other).

The compared quantities are the logits and the parameter gradients of the loss
``sum(logits * R)`` for a fixed random ``R`` (B, L, vocab); for the ground truth the loss is the
sum over documents of ``sum(logits_doc * R_doc)``.

Workers are module-level functions so spawned ranks can import them (``tests/support`` is on sys.path).
"""

from __future__ import annotations

import torch

import cp_attention
from cp_attention.tools.sweeps.compare import TOL, flat_grads, grad_tol, param_spans
from cp_attention.tools.tiny_models import FAMILIES, is_causal_lm, tiny_config, tiny_model
from planutil import chosen, strategy_error, strategy_options

# Window (and Llama 4 chunk) sizes, in tokens. With L = 67 at world size 4 a contiguous shard holds
# 16-17 tokens and a zigzag slice 8-9: SMALL fits inside one. With L = 90 a contiguous shard holds
# 22-23 tokens and a zigzag slice 11-12: LARGE spans two contiguous shards and four zigzag slices.
SMALL, LARGE = 5, 40

# Document lengths per row (None: unpacked). Rows of a batch get different splits; boundaries fall
# inside shards, near shard edges and documents span several shards.
CASE_SHAPES = (
    dict(tag="w5-L67-B1-unpacked", window=SMALL, L=67, docs=None, B=1),
    dict(tag="w5-L67-B2-packed", window=SMALL, L=67, docs=[[30, 37], [11, 40, 16]], B=2),
    dict(tag="w40-L90-B1-packed", window=LARGE, L=90, docs=[[23, 50, 17]], B=1),
    dict(tag="w40-L90-B2-unpacked", window=LARGE, L=90, docs=None, B=2),
)

# TOL on logits; gradients within grad_tol: 1e-4 absolute or 1e-5 of the largest reference gradient,
# whichever is larger (the sweeps' tolerances, cp_attention.tools.sweeps.compare, which says why)


def family_cases(families=FAMILIES) -> list[dict]:
    """One dict per (family, case shape): name, family, window, L, B, docs (lengths per row), seed."""
    cases = []
    for fi, family in enumerate(families):
        for si, shape in enumerate(CASE_SHAPES):
            docs = shape["docs"] or [[shape["L"]]] * shape["B"]
            assert len(docs) == shape["B"] and all(sum(row) == shape["L"] for row in docs)
            cases.append(dict(name=f"{family}/{shape['tag']}", family=family, window=shape["window"],
                              L=shape["L"], B=shape["B"], docs=docs, packed=shape["docs"] is not None,
                              seed=100 * fi + si))
    return cases


def model_for(case: dict, attn_implementation: str):
    """The tiny model of the case's family with its window (chunk for Llama 4); weights from seed 0."""
    cfg = tiny_config(case["family"], window=case["window"], chunk=case["window"])
    return tiny_model(case["family"], attn_implementation, seed=0, config=cfg)


def weights_fingerprint(model) -> torch.Tensor:
    """Per-parameter float64 sums and squared sums: equal fingerprints mean the same random weights."""
    rows = [torch.stack([p.detach().double().sum(), p.detach().double().square().sum()])
            for _, p in model.named_parameters()]
    return torch.stack(rows)


def inputs(case: dict, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids (B, L), position_ids (B, L) restarting at 0 per document, R (B, L, vocab))."""
    g = torch.Generator().manual_seed(case["seed"])
    B, L = case["B"], case["L"]
    ids = torch.randint(3, vocab, (B, L), generator=g)
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in case["docs"]])
    R = torch.randn(B, L, vocab, generator=g)
    return ids, pos, R


def ground_truth(case: dict, model=None) -> dict:
    """Docs-alone eager ground truth: logits (B, L, V), flat gradients, weights fingerprint."""
    model = model if model is not None else model_for(case, "eager")
    assert model.config._attn_implementation == "eager"
    ids, pos, R = inputs(case, model.config.vocab_size)
    model.zero_grad(set_to_none=True)
    rows = []
    for b, row in enumerate(case["docs"]):
        pieces, start = [], 0
        for n in row:
            sl = slice(start, start + n)
            kwargs = dict(use_cache=False) if is_causal_lm(case["family"]) else {}
            out = model(input_ids=ids[b:b + 1, sl], position_ids=torch.arange(n).unsqueeze(0), **kwargs)
            (out.logits * R[b:b + 1, sl]).sum().backward()
            pieces.append(out.logits.detach())
            start += n
        rows.append(torch.cat(pieces, dim=1))
    return dict(logits=torch.cat(rows, dim=0), grads=flat_grads(model), fingerprint=weights_fingerprint(model))


def compare(case: dict, model, logits: torch.Tensor, grads: torch.Tensor, ref: dict, where: str) -> dict:
    """Max abs errors of logits and gradients against the ground truth, with the worst parameter."""
    res = dict(name=case["name"], family=case["family"], where=where,
               finite=bool(torch.isfinite(logits).all() and torch.isfinite(grads).all()),
               same_weights=bool(torch.equal(weights_fingerprint(model), ref["fingerprint"])),
               logit_err=float((logits - ref["logits"]).abs().max()),
               grad_err=float((grads - ref["grads"]).abs().max()),
               grad_scale=float(ref["grads"].abs().max()))
    worst, worst_err = "", -1.0
    diff = (grads - ref["grads"]).abs()
    for name, a, b in param_spans(model):
        e = float(diff[a:b].max())
        if e > worst_err:
            worst, worst_err = name, e
    res["worst_param"] = worst
    return res


def failures(results: list[dict], tol: float = TOL) -> list[str]:
    """Human-readable failures of compare() results."""
    out = []
    for r in results:
        head = f"{r['where']} {r['name']}"
        if "error" in r:
            out.append(f"{head}: raised {r['error']}")
            continue
        if not r["same_weights"]:
            out.append(f"{head}: cp_flash and eager models do not hold the same weights")
        if not r["finite"]:
            out.append(f"{head}: non-finite logits or gradients")
        if not r["logit_err"] <= tol:
            out.append(f"{head}: logits max abs error {r['logit_err']:.2e} > {tol:.0e}")
        if not r["grad_err"] <= grad_tol(r["grad_scale"], tol):
            out.append(f"{head}: gradient max abs error {r['grad_err']:.2e} > {grad_tol(r['grad_scale'], tol):.1e} "
                       f"(worst {r['worst_param']}, max |grad| {r['grad_scale']:.2e})")
    return out


def run_plain(case: dict, model, use_context: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """World size 1 in this process: plain model(...) without a context, or through
    context_parallel() + shard_batch (which works without torch.distributed)."""
    ids, pos, R = inputs(case, model.config.vocab_size)
    kwargs = dict(use_cache=False) if is_causal_lm(case["family"]) else {}
    model.zero_grad(set_to_none=True)
    if use_context:
        with cp_attention.context_parallel() as cp:
            batch = cp.shard_batch(input_ids=ids, position_ids=pos)
            out = model(**batch, **kwargs)
            (out.logits * cp.shard(R, dim=1)).sum().backward()
            logits = cp.gather(out.logits.detach(), dim=1)
    else:
        out = model(ids, position_ids=pos, **kwargs)
        (out.logits * R).sum().backward()
        logits = out.logits.detach()
    return logits, flat_grads(model)


def run_cp_cases(rank: int, world_size: int, cases: list[dict], refs: dict, layouts: tuple[str, ...],
                 strategy: str = "ring") -> list[dict]:
    """Rank worker: every case under cp_flash in each layout (and ``strategy``); gathered logits
    and gradients summed over ranks are compared with refs[case name] on every rank. Returns the
    compare() dicts."""
    import torch.distributed as dist

    results = []
    models: dict = {}
    for case in cases:
        key = (case["family"], case["window"])
        if key not in models:
            models[key] = model_for(case, "cp_flash")
        model = models[key]
        ids, pos, R = inputs(case, model.config.vocab_size)
        kwargs = dict(use_cache=False) if is_causal_lm(case["family"]) else {}
        for layout in layouts:
            where = f"world={world_size} {layout} {strategy} rank={rank}"
            model.zero_grad(set_to_none=True)
            try:  # an error every rank raises alike is reported per case; a lone one times out
                with cp_attention.context_parallel(layout=layout, **strategy_options(strategy)) as cp:
                    batch = cp.shard_batch(input_ids=ids, position_ids=pos)
                    out = model(**batch, **kwargs)
                    calls = cp_attention.forward_plan_stats()
                    (out.logits * cp.shard(R, dim=1)).sum().backward()
                    logits = cp.gather(out.logits.detach(), dim=1)
                grads = flat_grads(model)
                dist.all_reduce(grads)
            except Exception as exc:  # noqa: BLE001 - reported as a failure by the test
                results.append(dict(name=case["name"], family=case["family"], where=where,
                                    error=f"{type(exc).__name__}: {exc}"))
                continue
            results.append(compare(case, model, logits, grads, refs[case["name"]], where=where))
            wrong = strategy_error(strategy, calls) if world_size > 1 else None
            if wrong is not None or (world_size > 1 and not calls):  # every layer ran the strategy asked for
                results.append(dict(name=case["name"], family=case["family"], where=where,
                                    error=wrong or "no layer ran under context parallelism"))
            elif strategy == "auto":
                results[-1]["chosen"] = chosen(calls)
    return results
