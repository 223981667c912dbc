"""How a sweep compares a model under cp_flash with its ground truth, and the outcome records it keeps.

The compared quantities are logits and the flat parameter gradients of ``sum(logits * R)`` for a
fixed random ``R`` (:func:`flat_grads`, in ``named_parameters`` order); :func:`diffs` measures them
against the ground truth, :func:`within` applies the tolerances (:data:`TOL` on logits,
:func:`grad_tol` on gradients) and :func:`classify` turns a comparison or an exception into an
outcome record (``exact``, ``wrong``, ``refused``: a NotImplementedError, ``crash``).
"""

from __future__ import annotations

import contextlib
import re

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["TOL", "GRAD_REL_TOL", "grad_tol", "flat_grads", "param_spans", "diffs", "within", "error_record",
           "classify", "compare_or_error", "jsonable", "indexer_ties_to_earliest"]

TOL = 1e-4
# Gradients reach |g| ~ 500 in the tiny models (a loss summing ~20k logits times N(0, 1)), where float32
# rounding alone differs by ~1e-6 relative between any two summation orders: the gradient bound is 1e-4
# absolute or 1e-5 of the largest reference gradient, whichever is larger.
GRAD_REL_TOL = 1e-5


def grad_tol(grad_scale: float, tol: float = TOL) -> float:
    """The gradient bound for reference gradients of largest magnitude ``grad_scale``."""
    return max(tol, GRAD_REL_TOL * grad_scale)


def flat_grads(model) -> torch.Tensor:
    """All parameter gradients, flattened in named_parameters order (None counts as zeros)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for _, p in model.named_parameters()])


def param_spans(model) -> list[tuple[str, int, int]]:
    """(name, start, end) of each parameter in :func:`flat_grads`."""
    spans, at = [], 0
    for name, p in model.named_parameters():
        spans.append((name, at, at + p.numel()))
        at += p.numel()
    return spans


def diffs(logits, grads, ref_logits, ref_grads, spans=None) -> dict:
    """Max abs errors, the gradient scale and (with spans) the worst parameter."""
    if logits.shape != ref_logits.shape or grads.shape != ref_grads.shape:
        return dict(finite=False, logit_err=float("inf"), grad_err=float("inf"), grad_scale=0.0,
                    note=f"shapes {tuple(logits.shape)} vs {tuple(ref_logits.shape)}")
    gdiff = (grads - ref_grads).abs()
    res = dict(finite=bool(torch.isfinite(logits).all() and torch.isfinite(grads).all()),
               logit_err=float((logits - ref_logits).abs().max()), grad_err=float(gdiff.max()),
               grad_scale=float(ref_grads.abs().max()))
    res["grad_rel"] = res["grad_err"] / res["grad_scale"] if res["grad_scale"] > 0 else res["grad_err"]
    if spans:
        worst = max(spans, key=lambda s: float(gdiff[s[1]:s[2]].max()) if s[2] > s[1] else -1.0)
        res["worst_param"] = worst[0]
    return res


def within(d: dict) -> bool:
    """A :func:`diffs` dict within the tolerances (finite, logits within TOL, gradients within grad_tol)."""
    return (d["finite"] and d["logit_err"] <= TOL
            and d["grad_err"] <= grad_tol(d["grad_scale"]))


def error_record(exc: BaseException) -> dict:
    """{error_type, message (its first line), reasons (the model check's findings)} of an exception."""
    msg = str(exc).strip().splitlines()
    # the model check's findings, one "  - <what> in <modules>: <why>" line each
    reasons = [m.group(1) for m in (re.match(r"\s*- (.+?) in \S", line) for line in msg[1:]) if m]
    return dict(error_type=type(exc).__name__, message=msg[0][:300] if msg else "", reasons=reasons)


def classify(result: dict | None = None, exc: BaseException | None = None) -> dict:
    """One outcome record from a diffs() dict or an exception."""
    if exc is not None:
        outcome = "refused" if isinstance(exc, NotImplementedError) else "crash"
        return dict(outcome=outcome, **error_record(exc))
    return dict(outcome="exact" if within(result) else "wrong", **result)


def compare_or_error(fn, ref_logits, ref_grads, spans) -> dict:
    """The outcome record of ``fn() -> (logits, grads)`` against the reference (or of what it raised)."""
    try:
        logits, grads = fn()
    except Exception as exc:  # noqa: BLE001 - the outcome
        return classify(exc=exc)
    return classify(diffs(logits, grads, ref_logits, ref_grads, spans))


def jsonable(obj):
    """``obj`` with every key a string and every value JSON can hold (NaN and infinities as strings)."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items() if k != "exc"}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, float) and obj != obj:
        return "nan"
    if isinstance(obj, float) and obj in (float("inf"), float("-inf")):
        return str(obj)
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)



class _EarliestOfTies(TorchFunctionMode):
    """``topk`` along a dimension keeps, among equal values, the lower index (a stable sort)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in (torch.topk, torch.Tensor.topk):
            return func(*args, **kwargs)
        names = ("input", "k", "dim", "largest", "sorted")
        given = dict(zip(names, args), **kwargs)
        dim = given.get("dim", -1)
        values, order = torch.sort(given["input"], dim=dim, descending=given.get("largest", True), stable=True)
        return torch.return_types.topk((values.narrow(dim, 0, given["k"]), order.narrow(dim, 0, given["k"])))


def _call(fn, *args) -> None:
    """Call ``fn`` for its effect: a module hook that returns something replaces the args or the output."""
    fn(*args)


@contextlib.contextmanager
def indexer_ties_to_earliest(model):
    """The ground truth of index-sparse families (DeepSeek Sparse Attention): inside the model's
    indexer modules (classes named ``*Indexer``), a top-k keeps the earliest key among equal scores,
    the rule cp_flash documents. Eager's ``torch.topk`` leaves the order of ties unspecified, and
    after a ReLU many index scores are exactly 0, so without one rule a document alone and the same
    document in a packed row can select different keys. Written here from the rule, independently of
    the library's implementation."""
    handles = []
    for module in model.modules():
        if type(module).__name__.endswith("Indexer"):
            mode = _EarliestOfTies()
            handles.append(module.register_forward_pre_hook(lambda *_, m=mode: _call(m.__enter__)))
            handles.append(module.register_forward_hook(lambda *_, m=mode: _call(m.__exit__, None, None, None)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
