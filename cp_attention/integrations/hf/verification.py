"""Verification at first use: the first time a model (its class and configuration) runs under a multi-rank
``context_parallel`` block, a tiny batch runs through the context-parallel path and through one device, on
every rank, and a difference beyond the dtype's tolerance refuses the model on every rank before the user's
forward computes anything.

The model check (:mod:`.check`) decides from what a model is made of; this decides from what it
computes, so it also catches what no rule knows: a ``trust_remote_code`` module that mixes tokens in its own
code (a running mean, a shift, a pool, a sort along the sequence), a kernel that routes around cp_flash, a
family whose one-device forward treats packed documents another way.

The test batch: ``16 * P`` tokens of ids drawn (seeded) from the vocabulary minus the configuration's special
tokens, in one row; three documents (one crossing every rank) when the user's batch packs documents, else one.
Ground truth: each document alone on one device (outside the block, the model's own attention implementation
at world size 1), the semantics the family sweep and ``python -m cp_attention check`` use. Compared: every
module's first output over the token dimension (this rank's shard of the truth's) and the logits, relative to
the largest value of that output (float64: 1e-6, float32: 1e-3, half types: 5e-2). The ranks gather their
errors (one all-gather), so the verdict, and the first differing module in execution order, are the same on
every rank; before that they agree whether to verify at all, so a rank that verified before (its memo) runs
the test with the others instead of skipping it.

Cost: at first use, one forward of ``16 * P`` tokens under the block plus one per test document on one
device, without gradients, then nothing (``state.VERIFIED``; :func:`verification_cost` in docs/usage.md
gives a measurement). Off with ``context_parallel(verify=False)``. Runs in eval mode (dropout off) and outside
``torch.compile``'s graph (the guard's hooks are eager); under DDP and FSDP2 every rank runs the same forwards.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import traceback
import types

import torch

from ...engine.context import outside_context
from ...engine import stats as engine_stats
from ...engine.batch import LiveRecords
from ...plan.cache import PlanCache
from ...refusals import refuse
from ...torch_compat import WeakIdKeyDictionary
from . import state
from .token_trace import kept_module_state
from .models import config_crc, layer_masks, text_config

__all__ = ["verify_first_use", "verification_key", "TOLERANCES", "test_batch"]

log = logging.getLogger("cp_attention.integrations")

TOLERANCES = types.MappingProxyType({torch.float64: 1e-6, torch.float32: 1e-3})
"""Relative tolerance per dtype (the rest, half types: 5e-2), of an output's largest value in the truth."""
_HALF_TOLERANCE = 5e-2

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_ACTIVE = threading.local()  # .on: a verification runs in this thread (its own forwards do not verify)


def tolerance(dtype: torch.dtype) -> float:
    return TOLERANCES.get(dtype, _HALF_TOLERANCE)


def _dtype(model) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def verification_key(model, cp, packed: bool) -> tuple:
    """What a verdict holds for: the model's class and configuration, its dtype, packed or not, and the
    block's world size (not its layout or strategy: what the test looks for, token mixing the engine does not
    see, does not depend on them; the engine's layouts and strategies have their own tests)."""
    return (type(model), config_crc(model), str(_dtype(model)), packed, cp.world_size)


def _special_ids(config) -> set[int]:
    found = set()
    for cfg in {id(c): c for c in (config, text_config(config))}.values():
        for name, value in vars(cfg).items():
            if not (name.endswith("token_id") or name.endswith("token_index") or name.endswith("token_ids")):
                continue
            for v in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(v, int) and not isinstance(v, bool):
                    found.add(v)
    return found


def test_batch(config, world_size: int, packed: bool, device) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """``(input_ids (1, T), position_ids (1, T), document lengths)`` of the test batch, ``T = 16 * P``."""
    length = 16 * world_size
    docs = [length // 2 + 3, length // 4, length - length // 2 - 3 - length // 4] if packed else [length]
    vocab = int(getattr(text_config(config), "vocab_size", None) or getattr(config, "vocab_size", None) or 32)
    allowed = torch.tensor([i for i in range(min(vocab, 4096)) if i not in _special_ids(config)] or [0])
    gen = torch.Generator().manual_seed(1234)
    ids = allowed[torch.randint(len(allowed), (1, length), generator=gen)].to(device)
    pos = torch.cat([torch.arange(n) for n in docs])[None].to(device)
    return ids, pos, docs


def _first_tensor(value) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value if value.is_floating_point() and value.dim() >= 2 else None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    return next((t for t in map(_first_tensor, items) if t is not None), None)


@contextlib.contextmanager
def _recording(model, names: dict):
    """Record every module's first call: its first floating tensor input under ``"<name> <"`` and output
    under ``name`` (at least 2-D)."""
    handles = []

    def hooks_for(name):
        def before(module, args, kwargs):
            first = _first_tensor(args) if _first_tensor(args) is not None else _first_tensor(kwargs)
            if first is not None and f"{name} <" not in names:
                names[f"{name} <"] = first.detach().clone()

        def after(module, args, output):
            first = _first_tensor(output)
            if first is not None and name not in names:
                names[name] = first.detach()
        return before, after

    for name, module in model.named_modules():
        before, after = hooks_for(name or "(model)")
        handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(module.register_forward_hook(after))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _quiet(cp, model):
    """The block's and the thread's state as they were: its plan cache, live and latest batches, planning counts,
    the statistics of the latest call and forward; the model's train/eval modes and the states its modules hold."""
    plans, records, batch, counts = cp.plans, cp.records, cp._batch, cp.planning._counts
    last = engine_stats.STATS["last"]
    forward = {k: getattr(engine_stats.FORWARD, k) for k in ("calls", "mixers", "layer_ran")
               if hasattr(engine_stats.FORWARD, k)}
    modes = [(m, m.training) for m in model.modules()]
    cp.plans, cp.records = PlanCache(8), LiveRecords()  # the user's batch is not the test's
    _ACTIVE.on = True
    try:
        model.eval()
        with torch.no_grad(), kept_module_state(model):
            yield
    finally:
        _ACTIVE.on = False
        for module, mode in modes:
            module.training = mode
        cp.plans, cp.records, cp._batch, cp.planning._counts = plans, records, batch, counts
        engine_stats.STATS["last"] = last
        for k in ("calls", "mixers", "layer_ran"):
            if k in forward:
                setattr(engine_stats.FORWARD, k, forward[k])
            elif hasattr(engine_stats.FORWARD, k):
                delattr(engine_stats.FORWARD, k)


def _call(model, **inputs):
    try:
        out = model(**inputs, use_cache=False)
    except TypeError:
        out = model(**inputs)
    return getattr(out, "logits", None) if not isinstance(out, torch.Tensor) else out


def _under_cp(model, cp, ids, pos) -> dict:
    outputs: dict = {}
    local = cp.shard_batch(input_ids=ids, position_ids=pos, model=model)
    with _recording(model, outputs):
        logits = _call(model, **local)
    if logits is not None:
        outputs["logits"] = logits.detach()
    return outputs


def _alone(model, ids, docs) -> tuple[dict, list[str]]:
    """Each document alone on one device: every module's output concatenated over the documents (only
    outputs over the documents' tokens), and the modules in the order their first outputs came."""
    pieces: list[dict] = []
    order: list[str] = []
    start = 0
    with outside_context():
        for n in docs:
            outputs: dict = {}
            with _recording(model, outputs):
                logits = _call(model, input_ids=ids[:, start:start + n],
                               position_ids=torch.arange(n, device=ids.device)[None])
            if logits is not None:
                outputs["logits"] = logits.detach()
            pieces.append({k: v for k, v in outputs.items() if v.shape[1] == n})
            if not order:
                order = list(outputs)
            start += n
    names = [k for k in order if all(k in p for p in pieces) and  # the same shape but along the tokens
             len({(p[k].shape[:1] + p[k].shape[2:], p[k].dtype) for p in pieces}) == 1]
    return {k: torch.cat([p[k] for p in pieces], dim=1) for k in names}, names


def _errors(cp, got: dict, truth: dict, names: list[str], length: int) -> torch.Tensor:
    """Per name, ``max |got - truth| / max |truth|`` over this rank's tokens (-1: not comparable here)."""
    errs = torch.full((len(names),), -1.0, dtype=torch.float64)
    for i, name in enumerate(names):
        want, have = truth[name], got.get(name)
        if have is None:
            continue
        if have.shape[1] != length:  # a shard: this rank's tokens of the truth
            want = cp.shard(want, dim=1)
        if have.shape != want.shape:
            continue
        scale = max(float(want.double().abs().max()), 1e-6)
        errs[i] = float((have.double() - want.double()).abs().max()) / scale
    return errs


def _origin(names: list[str], errs: torch.Tensor, first: int, tol: float) -> str:
    """The module where the first difference arises: the first differing output's module, or its innermost
    enclosing module whose input still agrees (the difference came from that module's own code)."""
    err = dict(zip(names, errs.tolist()))
    name = names[first].removesuffix(" <")
    while err.get(f"{name} <", -1.0) > tol and name not in ("logits", "(model)"):
        name = name.rpartition(".")[0] or "(model)"
    return name


def verify_first_use(model, cp, packed: bool, mixers=lambda: False) -> None:
    """Verify ``model`` (a transformers model under ``attn_implementation="cp_flash"``) in the multi-rank
    block ``cp`` on the first forward of its class and configuration (see the module docstring); raise the
    ``verification_differs`` refusal on every rank when its outputs under the block differ from each
    document alone on one device, ``verification_packed_rows`` when (a model without sequence mixers other
    than attention: ``mixers()`` False) its one-device forward of the packed row differs from its documents
    alone. The ranks agree once per model object and block (one all-gather); a no-op inside the
    verification's own forwards."""
    if getattr(_ACTIVE, "on", False):
        return
    key = verification_key(model, cp, packed)
    agreed = cp.__dict__.setdefault("_verified_models", WeakIdKeyDictionary())
    if packed not in agreed.get(model, ()):
        with state.VERIFIED_LOCK:
            known = key in state.VERIFIED
        # every rank verifies when any rank has not: a rank never skips the forwards the others run
        flags = cp.comm.all_gather(torch.tensor([0 if known else 1], device=cp.comm.device),
                                   "the agreement to verify a model at first use")
        if any(int(f) for f in flags):
            verdict = _verdict(model, cp, packed, mixers)
            with state.VERIFIED_LOCK:
                state.VERIFIED[key] = verdict
        agreed.setdefault(model, set()).add(packed)
    with state.VERIFIED_LOCK:
        verdict = state.VERIFIED[key]
    if verdict is None:
        return
    f = verdict[1]
    if verdict[0] == "unverifiable":
        raise refuse("verification_could_not_run", family=f["family"], model=f["model"], tokens=f["tokens"],
                     error=f["error"])
    if verdict[0] == "packed_rows":
        raise refuse("verification_packed_rows", family=f["family"], model=f["model"], tokens=f["tokens"],
                     documents=f["documents"], error=f["error"], dtype=f["dtype"], tolerance=f["tolerance"])
    raise refuse("verification_differs", family=f["family"], model=f["model"], tokens=f["tokens"], batch=f["batch"],
                 module=f["module"], error=f["error"], dtype=f["dtype"], tolerance=f["tolerance"])


def _from_the_library(exc: BaseException) -> bool:
    """Whether ``exc`` is cp_attention's (a refusal, a collective's error, or raised in the package's code)
    rather than the model's own code failing on the test batch."""
    if getattr(exc, "refusal", None) is not None or getattr(exc, "cp_collective", False):
        return True
    frames = traceback.extract_tb(exc.__traceback__)  # where it was raised: the last frame's file
    return bool(frames) and os.path.abspath(frames[-1].filename).startswith(_PACKAGE)


def _causal(model) -> bool:
    """Whether every attention layer of ``model`` is causal (a decoder: transformers' own mask keeps packed
    documents apart on one device, from restarting position_ids; a bidirectional encoder's does not, and its
    packed rows under the block follow each document alone, as its family tests assert)."""
    try:
        return all(mask.causal for mask in layer_masks(text_config(model.config)))
    except Exception:  # noqa: BLE001 - a configuration the mask reader does not know: not compared
        return False


def _verdict(model, cp, packed: bool, mixers) -> tuple[str, dict] | None:
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    ids, pos, docs = test_batch(model.config, cp.world_size, packed, device)
    with _quiet(cp, model):
        failed = None
        try:
            got = _under_cp(model, cp, ids, pos)
            truth, names = _alone(model, ids, docs)
        except Exception as exc:  # noqa: BLE001 - the model's own error: it cannot be verified
            if _from_the_library(exc):  # a refusal, ranks that disagree, a timeout: the user's to see as it is
                raise
            failed = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}" if str(exc) else type(exc).__name__
        # the ranks agree whether the test ran (the error vectors below have one length only where it did)
        failures = cp.comm.all_gather(torch.tensor([0 if failed is None else 1], device=cp.comm.device),
                                      "whether the verification's test batch ran")
        if any(int(f) for f in failures):
            family = getattr(text_config(model.config), "model_type", "") or type(model).__name__
            return "unverifiable", dict(family=family, model=type(model).__name__, tokens=ids.shape[1],
                                        error=failed or "an error on another rank")
        errs = _errors(cp, got, truth, names, ids.shape[1])
        del got
        row = None
        if packed and "logits" in truth and not mixers() and _causal(model):  # the packed row on one device
            with outside_context():
                row = _call(model, input_ids=ids, position_ids=pos)
            row = torch.tensor([float((row.double() - truth["logits"].double()).abs().max()) /
                                max(float(truth["logits"].double().abs().max()), 1e-6)], dtype=torch.float64)
        errs = torch.cat([errs, row if row is not None else torch.tensor([-1.0], dtype=torch.float64)])
    errs = torch.stack([e.to(errs.device) for e in cp.comm.all_gather(
        errs.to(cp.comm.device), "the verification's errors")]).amax(0)
    errs, row_err = errs[:-1], float(errs[-1])
    tol = tolerance(_dtype(model))
    bad = [i for i, e in enumerate(errs.tolist()) if e > tol]
    family = getattr(text_config(model.config), "model_type", "") or type(model).__name__
    log.info("verified %s (%s) under context parallelism at first use: %s", family, type(model).__name__,
             "differs" if bad or row_err > tol else
             f"largest difference {max(errs.tolist() + [0.0]):.2g} (tolerance {tol:g})")
    fields = dict(family=family, model=type(model).__name__, tokens=ids.shape[1],
                  tolerance=f"{tol:g}", dtype=str(_dtype(model)).replace("torch.", ""))
    if bad:
        return "differs", dict(
            fields, batch=f"{len(docs)} packed documents" if packed else "one document",
            module=_origin(names, errs, bad[0], tol), error=f"{float(errs[bad[0]]):.3g}")
    if row_err > tol:
        return "packed_rows", dict(fields, documents=len(docs), error=f"{row_err:.3g}")
    return None
