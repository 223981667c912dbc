"""A sweep over every causal-LM family of the installed transformers under attn_implementation="cp_flash".

For each entry of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: a tiny config built generically from the
family's config class (:func:`~.configs.tiny_config`: the defaults, shrunk by rules over attribute
names, with a small override table), the same weights under ``"eager"`` and ``"cp_flash"``, and one
packed row of documents (:data:`DOCS`, ``position_ids`` restarting per document). The ground truth is
eager with each document run alone (logits, and parameter gradients of ``sum(logits * R)`` for a fixed
random ``R``), or the family's own sdpa where its eager disagrees with it on one document (recorded as
``oracle``); the tolerances are :mod:`.compare`'s.

Outcomes per family and world size (:func:`run_family`):

* ``exact``: logits max abs error <= TOL, gradients within ``compare.grad_tol``;
* ``refused``: a NotImplementedError (its message recorded);
* ``wrong``: ran, numbers off (max errors recorded);
* ``crash``: any other exception (type and first line);
* ``unbuildable``: the tiny config, the eager model or its docs-alone forward failed.

World size 1 runs through ``context_parallel()`` + ``cp.shard_batch`` in the family's process; world
size 2 on two gloo ranks (``run_ranks``). Two more world-size-1 comparisons separate the library from
the family: ``ws1_plain`` (cp_flash without a context, model(ids, position_ids=pos)) against the ground
truth, ``ws1_vs_packed_eager`` (the same call) against the family's own eager on the same packed row,
and ``eager_isolates`` (the family's packed eager against the ground truth: False means its own eager
lets documents see each other).

CLI: ``python -m cp_attention.tools.sweeps.family --families a,b --world 1,2 --json out.json [--md out.md]
[--page docs/supported_models.md]``; each family runs in its own subprocess with a timeout, at most
``--jobs`` (<= 2) at a time. ``--from RECORD --page PAGE`` renders the support page from a recorded
``--json`` output without running anything.
"""

from __future__ import annotations

import argparse
import inspect
import io
import json
import os
import sys
import time
import traceback

import torch

from . import runner
from .compare import (TOL, classify, compare_or_error, diffs, error_record, flat_grads, indexer_ties_to_earliest,
                      jsonable, param_spans, within)
from .configs import ID_RANGE, build_model, families, layer_count, layer_kinds, text_config, tiny_config
from .tables import family_page, summary_markdown

__all__ = ["DOCS", "OUTCOMES", "forward_kwargs", "make_inputs", "ground_truth", "run_packed", "run_context",
           "run_family", "main"]

DOCS = (13, 22, 9)  # one packed row, L = 44 (zigzag at world size 2: 4 slices of 11)
FAMILY_TIMEOUT = 120.0
OUTCOMES = ("exact", "refused", "wrong", "crash", "unbuildable", "timeout")
MODULE = "cp_attention.tools.sweeps.family"  # how the CLI runs a family in a process of its own


def forward_kwargs(model) -> dict:
    """Which of position_ids / use_cache the model's forward names."""
    params = inspect.signature(model.forward).parameters
    return dict(position_ids="position_ids" in params, use_cache="use_cache" in params)


def make_inputs(docs=DOCS) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids (1, L), position_ids (1, L) restarting at 0 per document)."""
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(*ID_RANGE, (1, sum(docs)), generator=g)
    pos = torch.cat([torch.arange(n) for n in docs]).unsqueeze(0)
    return ids, pos


def _call(model, fkw: dict, ids, pos):
    kwargs = {}
    if fkw["use_cache"]:
        kwargs["use_cache"] = False
    if fkw["position_ids"] and pos is not None:
        kwargs["position_ids"] = pos
    out = model(input_ids=ids, **kwargs)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits


def _R(shape, seed: int = 4321) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def ground_truth(model, fkw: dict, ids, pos, docs=DOCS) -> dict:
    """Each document run alone under eager: logits (1, L, V), flat gradients of sum(logits * R), R."""
    model.zero_grad(set_to_none=True)
    pieces, start, R = [], 0, None
    for n in docs:
        sl = slice(start, start + n)
        logits = _call(model, fkw, ids[:, sl], torch.arange(n).unsqueeze(0))
        if R is None:
            R = _R((1, sum(docs), logits.shape[-1]))
        (logits * R[:, sl]).sum().backward()
        pieces.append(logits.detach())
        start += n
    return dict(logits=torch.cat(pieces, dim=1), grads=flat_grads(model), R=R)


def run_packed(model, fkw: dict, ids, pos, R) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed row in one call, no context: (logits, flat gradients)."""
    model.zero_grad(set_to_none=True)
    logits = _call(model, fkw, ids, pos)
    (logits * R).sum().backward()
    return logits.detach(), flat_grads(model)


def run_context(model, fkw: dict, ids, pos, R) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed row through context_parallel() + cp.shard_batch on the current group (world size 1
    without torch.distributed): gathered logits and this rank's gradients."""
    import cp_attention

    model.zero_grad(set_to_none=True)
    with cp_attention.context_parallel() as cp:
        batch = cp.shard_batch(input_ids=ids, position_ids=pos)
        kwargs = {}
        if fkw["use_cache"]:
            kwargs["use_cache"] = False
        if not fkw["position_ids"]:
            batch.pop("position_ids", None)
        out = model(**batch, **kwargs)
        logits = out.logits if hasattr(out, "logits") else out[0]
        (logits * cp.shard(R, dim=1)).sum().backward()
        logits = cp.gather(logits.detach(), dim=1)
    return logits, flat_grads(model)


def _rank_worker(rank: int, world_size: int, family: str, state_dict: dict, ids, pos, R):
    """A CP rank: the cp_flash model with the eager weights, the packed row through context_parallel
    + shard_batch; returns (outcome of an exception or None, logits, summed gradients) on rank 0."""
    import torch.distributed as dist

    import cp_attention  # noqa: F401 - registers cp_flash

    torch.set_num_threads(1)
    try:
        model = build_model(tiny_config(family), "cp_flash", state_dict)
        logits, grads = run_context(model, forward_kwargs(model), ids, pos, R)
        dist.all_reduce(grads)
    except Exception as exc:  # noqa: BLE001 - reported per rank
        return dict(refused=isinstance(exc, NotImplementedError), **error_record(exc))
    if rank:
        return dict(ok=True)
    # bytes, not tensors: a tensor put on the queue lives in shared memory the exiting rank may unlink
    buf = io.BytesIO()
    torch.save(dict(logits=logits, grads=grads), buf)
    return dict(payload=buf.getvalue())


def _pick_rank_error(per_rank: list[dict]) -> dict | None:
    errors = [r for r in per_rank if "error_type" in r]
    if not errors:
        return None
    primary = [r for r in errors if r["error_type"] != "RankFailedError"] or errors
    e = primary[0]
    outcome = "refused" if e["refused"] else "crash"
    return dict(outcome=outcome, error_type=e["error_type"], message=e["message"], reasons=e.get("reasons", []))


def _oracle(config, eager, fkw: dict, ids) -> tuple:
    """(the model whose documents-alone run is the ground truth, its record): the family's eager, unless its
    eager disagrees with the family's own sdpa on one document beyond :data:`~.compare.TOL` (transformers
    5.17's moshi: its eager logits of a document's first tokens change with the row's length); then sdpa,
    recorded as ``{"impl": "sdpa", "eager_vs_sdpa": max error}``."""
    n = DOCS[0]
    try:
        sdpa = build_model(config, "sdpa", eager.state_dict())
        with torch.no_grad():
            one = torch.arange(n).unsqueeze(0)
            err = float((_call(eager, fkw, ids[:, :n], one) - _call(sdpa, fkw, ids[:, :n], one)).abs().max())
    except Exception:  # noqa: BLE001 - no sdpa for this family: eager is the truth
        return eager, {"impl": "eager"}
    if err <= TOL:
        return eager, {"impl": "eager"}
    return sdpa, {"impl": "sdpa", "eager_vs_sdpa": err}


def run_family(family: str, world_sizes=(1, 2), *, rank_timeout: float = 90.0) -> dict:
    """The sweep of one family in this process (world size 2 spawns two gloo ranks). Returns
    {family, outcomes: {"1": ..., "2": ...}, ws1_plain, ws1_vs_packed_eager, eager_isolates, info, seconds}."""
    import cp_attention  # noqa: F401 - registers cp_flash
    from cp_attention.tools.launch import run_ranks

    torch.set_num_threads(1)
    t0 = time.monotonic()
    res: dict = dict(family=family, outcomes={}, info={})

    def unbuildable(stage: str, exc: BaseException) -> dict:
        rec = dict(outcome="unbuildable", stage=stage, **error_record(exc))
        res["outcomes"] = {str(ws): rec for ws in world_sizes}
        res["seconds"] = round(time.monotonic() - t0, 1)
        return res

    try:
        config = tiny_config(family)
    except Exception as exc:  # noqa: BLE001
        return unbuildable("config", exc)
    try:
        eager = build_model(config, "eager")
        fkw = forward_kwargs(eager)
        ids, pos = make_inputs()
        truth, res["oracle"] = _oracle(config, eager, fkw, ids)
        with indexer_ties_to_earliest(truth):
            ref = ground_truth(truth, fkw, ids, pos)
    except Exception as exc:  # noqa: BLE001
        return unbuildable("eager docs-alone", exc)
    state_dict = {k: v.detach().clone() for k, v in eager.state_dict().items()}
    spans = param_spans(eager)
    res["info"] = dict(model_class=type(eager).__name__, accepts_position_ids=fkw["position_ids"],
                       params=sum(p.numel() for p in eager.parameters()),
                       layers=layer_count(text_config(config).to_dict())[1],
                       layer_kinds=layer_kinds(text_config(config)))
    R = ref["R"]
    try:
        with indexer_ties_to_earliest(eager):
            packed_logits, packed_grads = run_packed(eager, fkw, ids, pos, R)
        iso = diffs(packed_logits, packed_grads, ref["logits"], ref["grads"], spans)
        res["eager_isolates"] = dict(isolates=within(iso), **iso)
    except Exception as exc:  # noqa: BLE001
        packed_logits = None
        res["eager_isolates"] = dict(isolates=None, **error_record(exc))
    try:
        cp_model = build_model(config, "cp_flash", state_dict)
    except Exception as exc:  # noqa: BLE001
        rec = classify(exc=exc)
        rec["stage"] = "cp_flash model build"
        res["outcomes"] = {str(ws): rec for ws in world_sizes}
        res["seconds"] = round(time.monotonic() - t0, 1)
        return res
    if 1 in world_sizes:
        res["outcomes"]["1"] = compare_or_error(lambda: run_context(cp_model, fkw, ids, pos, R),
                                                ref["logits"], ref["grads"], spans)
        res["ws1_plain"] = compare_or_error(lambda: run_packed(cp_model, fkw, ids, pos, R),
                                            ref["logits"], ref["grads"], spans)
        if packed_logits is not None:
            res["ws1_vs_packed_eager"] = compare_or_error(lambda: run_packed(cp_model, fkw, ids, pos, R),
                                                          packed_logits, packed_grads, spans)
    for ws in world_sizes:
        if ws == 1:
            continue
        try:
            per_rank = run_ranks(ws, _rank_worker, family, state_dict, ids, pos, R, timeout=rank_timeout)
        except Exception as exc:  # noqa: BLE001 - a rank died or hung
            text = str(exc)
            rec = dict(outcome="timeout" if "did not finish" in text else "crash", error_type=type(exc).__name__,
                       message=text.strip().splitlines()[0][:300])
        else:
            rec = _pick_rank_error(per_rank)
            if rec is None:
                got = torch.load(io.BytesIO(per_rank[0]["payload"]))
                rec = classify(diffs(got["logits"], got["grads"], ref["logits"], ref["grads"], spans))
        res["outcomes"][str(ws)] = rec
    res["seconds"] = round(time.monotonic() - t0, 1)
    return res


# --------------------------------------------------------------------------------------------------
# CLI: one subprocess per family
# --------------------------------------------------------------------------------------------------

def run_one_subprocess(family: str, world: str, timeout: float) -> dict:
    """:func:`run_family` in a process of its own (:func:`.runner.run_isolated`); a timeout or a
    process that died is the family's outcome at every world size."""
    result, failure, seconds = runner.run_isolated(MODULE, ["--one", family, "--world", world], timeout)
    if result is not None:
        return result
    return dict(family=family, outcomes={w: failure for w in world.split(",")}, seconds=seconds)


def record(results: list[dict]) -> dict:
    """The JSON record of a sweep: what ``--json`` writes and ``--from`` reads."""
    import transformers

    return dict(transformers=transformers.__version__, docs=list(DOCS), results=results)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    p.add_argument("--families", default="", help="comma-separated (default: all of MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)")
    p.add_argument("--world", default="1,2", help="world sizes, comma-separated (1 and/or 2)")
    p.add_argument("--json", default="", help="write the results here")
    p.add_argument("--md", default="", help="write the summary table here")
    p.add_argument("--page", default="", help="write the support page here (docs/supported_models.md)")
    p.add_argument("--from", dest="source", default="",
                   help="run nothing: take the results from this record (a --json output) for --md and --page")
    p.add_argument("--jobs", type=int, default=2, help="families at a time (at most 2)")
    p.add_argument("--timeout", type=float, default=FAMILY_TIMEOUT, help="seconds per family")
    p.add_argument("--resume", action="store_true",
                   help="keep the families already in --json (but those that timed out), run the rest")
    p.add_argument("--one", default="", help=argparse.SUPPRESS)  # internal: run one family in this process
    args = p.parse_args(argv)
    if args.page and not (args.json or args.source):
        p.error("--page needs the record it is rendered from: --json (a run) or --from")
    world = tuple(int(w) for w in args.world.split(","))
    if args.one:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        try:
            res = run_family(args.one, world)
        except Exception as exc:  # noqa: BLE001 - recorded, never lost
            rec = dict(outcome="crash", **error_record(exc), traceback=traceback.format_exc()[-2000:])
            res = dict(family=args.one, outcomes={str(w): rec for w in world})
        with open(args.json, "w") as f:
            json.dump(jsonable(res), f, indent=1)
        return 0
    if args.source:
        with open(args.source) as f:
            _write(args, json.load(f), data=args.source)
        return 0
    names = [f for f in args.families.split(",") if f] or families()
    results: dict = {}
    if args.resume and args.json and os.path.exists(args.json):
        with open(args.json) as f:
            results = {r["family"]: r for r in json.load(f)["results"] if r["family"] in names
                       and all(rec["outcome"] != "timeout" for rec in r["outcomes"].values())}
    todo = [n for n in names if n not in results]
    t0 = time.monotonic()

    def done(name, r):
        results[name] = r
        outs = " ".join(f"ws{k}={v['outcome']}" for k, v in r["outcomes"].items())
        print(f"[{len(results)}/{len(names)} {time.monotonic() - t0:.0f}s] {name}: {outs} ({r.get('seconds', '?')}s)",
              flush=True)
        if args.json:  # written as it goes: a partial sweep is still a result
            _write(args, record([results[n] for n in names if n in results]))

    runner.run_all(todo, lambda name: run_one_subprocess(name, ",".join(map(str, world)), args.timeout), args.jobs,
                   done)
    _write(args, record([results[n] for n in names]))
    return 0


def _write(args, rec: dict, data: str = "") -> None:
    if args.json and not args.source:
        runner.write_atomic(args.json, json.dumps(rec, indent=1))
    if args.md:
        runner.write_atomic(args.md, summary_markdown(rec["results"], rec["docs"]))
    if args.page:
        runner.write_atomic(args.page, family_page(rec, data or args.json, args.page))


if __name__ == "__main__":
    sys.exit(main())
