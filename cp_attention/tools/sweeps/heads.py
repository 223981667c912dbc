"""A sweep over the task heads of the installed transformers under context parallelism.

Per head kind (sequence classification, token classification, question answering, masked LM) and
family of transformers' auto mapping: a tiny model (the shrinking rules of :mod:`.configs` on the config class's
defaults, ``num_labels=3``), one row of 40 tokens with the head's labels (uneven: the token and
masked-LM labels all fall in the first quarter of the row, most of it on rank 0; the sequence row padded
so that its last real token is rank 1's; the QA span from rank 0 to rank 1), and its loss and
gradients on two gloo ranks (``cp.shard_batch``, zigzag, cp_flash) against eager on one process (both
in eval mode, so that no forward draws random numbers; gradients flow all the same):
the mean over ranks of the loss and of the gradients must equal it (``exact``), or the forward is
refused with NotImplementedError (``refused``); anything else is ``wrong`` or ``crash``; a family
whose tiny model or eager forward cannot be built (or whose shrunk config still has over 50M
parameters) is ``unbuildable``.

CLI: ``python -m cp_attention.tools.sweeps.heads --kinds sequence,token --families bert,llama --json out.json
--page docs/supported_heads.md``; ``--from RECORD --page PAGE`` renders the support page from a recorded
``--json`` output without running anything.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import traceback
from types import MappingProxyType

import torch

from cp_attention.tools.launch import run_ranks

from . import runner
from .compare import indexer_ties_to_earliest
from .configs import OVERRIDES, drop_derived, shrink
from .tables import heads_page

__all__ = ["KINDS", "entries", "tiny_config", "run_entries", "main"]

KINDS = MappingProxyType({"sequence": "SEQUENCE_CLASSIFICATION", "token": "TOKEN_CLASSIFICATION", "qa": "QUESTION_ANSWERING",
         "masked": "MASKED_LM"})
L, LABELS, TOL = 40, 3, 2e-5
MAX_PARAMS = 50_000_000  # a larger "tiny" model is unbuildable here (the sweep's process would run out of memory)


def entries(kinds=tuple(KINDS)) -> list[tuple[str, str, str]]:
    """(kind, family, class name) of every entry of the kinds' auto mappings."""
    from transformers.models.auto import modeling_auto as auto

    out = []
    for kind in kinds:
        for family, name in getattr(auto, f"MODEL_FOR_{KINDS[kind]}_MAPPING_NAMES").items():
            out.append((kind, family, name if isinstance(name, str) else name[0]))
    return out


def tiny_config(family: str, kind: str = "token"):
    """The config class's defaults shrunk by :mod:`.configs`' rules, ``num_labels=3`` (2 for QA: start
    and end), pad id 0."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[family]
    kwargs = drop_derived(cls, shrink(cls().to_dict()))
    if family in OVERRIDES:
        OVERRIDES[family][1](kwargs)
    config = cls(**kwargs)
    config.num_labels = 2 if kind == "qa" else LABELS
    for c in {id(c): c for c in (config, config.get_text_config())}.values():
        if getattr(c, "pad_token_id", None) is None:
            c.pad_token_id = 0
    return config


def _size(name: str, config) -> int:
    """Parameters of the model, counted on the meta device (nothing allocated)."""
    import transformers as tf

    with torch.device("meta"):
        model = getattr(tf, name)._from_config(copy.deepcopy(config))
    return sum(p.numel() for p in model.parameters())


def build(name: str, config, impl: str, state_dict=None):
    import transformers as tf

    torch.manual_seed(0)
    model = getattr(tf, name)._from_config(copy.deepcopy(config), attn_implementation=impl, dtype=torch.float32)
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model.eval()  # no sampling in the forward (PhiMoE's router draws Gumbel noise in training)


def batch(kind: str) -> tuple[dict, dict]:
    """(tensors to shard, arguments handed to the model as they are)."""
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(3, 96, (1, L), generator=g)
    if kind == "sequence":  # padded on the right: the pooled token (24) is rank 1's under zigzag
        ids[0, 25:] = 0
        return dict(input_ids=ids), dict(labels=torch.tensor([1]))
    if kind == "qa":  # the start on rank 0, the end on rank 1
        return dict(input_ids=ids), dict(start_positions=torch.tensor([3]), end_positions=torch.tensor([22]))
    labels = torch.full_like(ids, -100)
    labels[0, 1:9] = (ids[0, 1:9] % LABELS) if kind == "token" else ids[0, 1:9]
    return dict(input_ids=ids, labels=labels), {}


def _grads(model) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in model.parameters() if p.requires_grad])


def _one(kind: str, name: str, config, state_dict) -> dict:
    import cp_attention

    model = build(name, config, "cp_flash", state_dict)
    shard, extra = batch(kind)
    try:
        with cp_attention.context_parallel() as cp:
            out = model(**cp.shard_batch(**shard, shift_labels=False), **extra)
        out.loss.backward()
    except NotImplementedError as exc:
        return dict(outcome="refused", message=str(exc)[:300])
    except Exception as exc:  # noqa: BLE001 - recorded
        return dict(outcome="crash", message=f"{type(exc).__name__}: {str(exc)[:300]}")
    return dict(outcome="ran", loss=float(out.loss.detach()), grads=_grads(model).numpy())


def _worker(rank: int, world_size: int, jobs: list) -> list[dict]:
    return [_one(*job) for job in jobs]


def _reference(kind: str, family: str, name: str):
    """(config, eager model after backward, its loss) or the unbuildable record."""
    try:
        config = tiny_config(family, kind)
        size = _size(name, config)
        if size > MAX_PARAMS:  # the shrinking rules missed its sub-configs (T5Gemma: billions)
            raise ValueError(f"the tiny model still has {size / 1e6:.0f}M parameters")
        eager = build(name, config, "eager")
        shard, extra = batch(kind)
        with indexer_ties_to_earliest(eager):  # index-sparse families: cp_flash's rule for ties at the k-th place
            out = eager(**shard, **extra)
        out.loss.backward()
    except Exception as exc:  # noqa: BLE001 - no tiny model or eager loss of this family
        return dict(kind=kind, family=family, cls=name, outcome="unbuildable",
                    message=f"{type(exc).__name__}: {str(exc)[:200]}")
    return config, eager, float(out.loss.detach())


def _verdict(rec: dict, per_rank: list[dict], eager, ref: float) -> dict:
    outcomes = {r["outcome"] for r in per_rank}
    if outcomes != {"ran"}:
        first = next(r for r in per_rank if r["outcome"] != "ran")
        same = len(outcomes) == 1
        return dict(rec, outcome=first["outcome"] if same else "crash",
                    message=first.get("message", "") if same else f"ranks differ: {sorted(outcomes)}")
    loss = sum(r["loss"] for r in per_rank) / 2
    grads = sum(torch.from_numpy(r["grads"]) for r in per_rank) / 2
    ref_grads = _grads(eager)
    loss_err = abs(loss - ref) / max(abs(ref), 1e-12)
    grad_rel = float((grads - ref_grads).abs().max()) / max(float(ref_grads.abs().max()), 1e-12)
    exact = loss_err <= TOL and grad_rel <= 10 * TOL
    return dict(rec, outcome="exact" if exact else "wrong", loss_err=loss_err, grad_rel=grad_rel)


def run_entries(todo: list[tuple[str, str, str]], timeout: float = 300.0) -> list[dict]:
    """The outcomes of entries (module docstring), their CP runs in one pair of ranks; when that pair
    fails (a rank died or hung), each entry again in a pair of its own."""
    results, jobs = [None] * len(todo), []
    for i, (kind, family, name) in enumerate(todo):
        ref = _reference(kind, family, name)
        if isinstance(ref, dict):
            results[i] = ref
        else:
            jobs.append((i, ref))
    try:
        per_rank = run_ranks(2, _worker, [(todo[i][0], todo[i][2], ref[0], ref[1].state_dict()) for i, ref in jobs],
                             timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - a rank died or hung: one pair per entry
        if len(jobs) == 1:
            i = jobs[0][0]
            results[i] = dict(kind=todo[i][0], family=todo[i][1], cls=todo[i][2], outcome="crash",
                              message=f"{type(exc).__name__}: {str(exc)[:300]}")
            return results
        for i, _ in jobs:
            results[i] = run_entries([todo[i]], timeout)[0]
        return results
    for k, (i, (config, eager, loss)) in enumerate(jobs):
        rec = dict(kind=todo[i][0], family=todo[i][1], cls=todo[i][2])
        results[i] = _verdict(rec, [per_rank[0][k], per_rank[1][k]], eager, loss)
    return results



def record(results: list[dict]) -> dict:
    """The JSON record of a sweep: what ``--json`` writes and ``--from`` reads."""
    import transformers

    return dict(transformers=transformers.__version__, results=results)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cp_attention.tools.sweeps.heads", description=__doc__.splitlines()[0])
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--families", default="", help="comma-separated (default: every family of the kinds)")
    p.add_argument("--json", default="", help="write the results here (as they come)")
    p.add_argument("--page", default="", help="write the support page here (docs/supported_heads.md)")
    p.add_argument("--from", dest="source", default="",
                   help="run nothing: take the results from this record (a --json output) for --page")
    p.add_argument("--chunk", type=int, default=12, help="entries per pair of ranks")
    args = p.parse_args(argv)
    if args.page and not (args.json or args.source):
        p.error("--page needs the record it is rendered from: --json (a run) or --from")
    if args.source:
        with open(args.source) as f:
            rec = json.load(f)
        if args.page:
            runner.write_atomic(args.page, heads_page(rec, args.source, args.page))
        return 0
    wanted = {f for f in args.families.split(",") if f}
    todo = [e for e in entries(tuple(args.kinds.split(","))) if not wanted or e[1] in wanted]
    results, t0 = [], time.monotonic()
    for start in range(0, len(todo), args.chunk):
        chunk = todo[start:start + args.chunk]
        try:
            got = run_entries(chunk)
        except Exception as exc:  # noqa: BLE001 - recorded, never lost
            got = [dict(kind=k, family=f, cls=n, outcome="crash", message=f"{type(exc).__name__}: {exc}"[:300],
                        traceback=traceback.format_exc()[-1000:]) for k, f, n in chunk]
        results.extend(got)
        for rec in got:
            print(f"[{len(results)}/{len(todo)} {time.monotonic() - t0:.0f}s] {rec['kind']} {rec['family']}: "
                  f"{rec['outcome']}", flush=True)
        if args.json:
            runner.write_atomic(args.json, json.dumps(record(results), indent=1, default=str))
        if args.page:
            runner.write_atomic(args.page, heads_page(record(results), args.json, args.page))
    return 0


if __name__ == "__main__":
    sys.exit(main())
