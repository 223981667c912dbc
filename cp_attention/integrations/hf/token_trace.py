"""The model check's trace: which operations of a model mix tokens along the sequence outside the calls the
library runs across ranks, read from what a tiny forward does (not from what its source looks like).

Under context parallelism a model is exact only if every operation that makes one token's output depend on
another token is computed by the library, which sees the whole sequence: the attention interface (cp_flash)
and the adapted sequence mixers. :func:`trace_findings` runs the model's forward twice on one device, on a
row of ``n`` tokens and on the same row with one token changed, with

* the attention interface answering per token (each query's output from its own query, key and value: a
  stand-in for the attention, which the engine computes across ranks),
* the adapted mixers (the wrapped mixer functions, the adapted mixer classes) answering per token too (their
  mixing is the library's: each token's output from its own input, :func:`stand_in_output`, so what the
  model does with their outputs is traced as well),

and records every torch operation in between (a ``TorchFunctionMode``): a per-token fingerprint of each
input and output (the token dimension: the one of size ``n``, an ``n`` no configuration size equals). A model
with nothing else mixing tokens changes its outputs at the changed token only. Where another token's output
changes, the trace names the first operation whose inputs agree everywhere but at the changed token and whose
output does not, with its source line, and the module that ran it (the innermost module whose input agrees
and output does not): a running sum, a shift by slicing or padding, a roll, a pool, a convolution, a sort or
top-k along the tokens, a product contracting the tokens, a gather or scatter by position, attention computed
outside the interface. Found on every rank alike (the same forward on the same weights).

What the trace cannot see, and stays with the model check's other rules: the adapted mixers' own code (it
answers per token for them), a rope whose frequencies depend on the sequence's length (a row of ``n`` tokens
never reaches the threshold), positions a model numbers itself from the shard, score biases handed to the
interface (refused where cp_flash receives them). Only models under ``attn_implementation="cp_flash"`` are
traced (the stand-in answers for cp_flash); the trace adds two forwards of ``n`` tokens, once per model class,
configuration and dtype (three off the CPU: the first repeated, so that a kernel whose bits do not repeat sets
the tolerance, ten times its noise, instead of reading as mixing).
"""

from __future__ import annotations

import contextlib
import linecache
import logging
import os
import threading
import zlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from ...engine.context import outside_context
from ...torch_compat import caller_locations
from . import state
from ..patches import patch
from .models import config_crc

__all__ = ["MIXING", "REFUSED", "model_trace", "trace_findings", "kept_module_state", "tracing", "stand_in_attention", "owned", "stand_in_output"]

log = logging.getLogger("cp_attention.integrations")
_STATE = threading.local()  # .on: a trace runs in this thread; .owned: depth inside owned calls
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
_DISTRIBUTED = os.sep + os.path.join("torch", "distributed") + os.sep
_LENGTHS = (23, 29, 31, 37, 41, 43, 47, 53, 59, 61)
MIXING = "token mixing outside the calls run across ranks"
REFUSED = "a forward cp_flash refuses"


def tracing() -> bool:
    """Whether a trace of this module runs in this thread (outside the owned calls)."""
    return getattr(_STATE, "on", False)


@contextlib.contextmanager
def owned():
    """The library's own call runs: its operations are not the model's."""
    _STATE.owned = getattr(_STATE, "owned", 0) + 1
    try:
        yield
    finally:
        _STATE.owned -= 1


@contextlib.contextmanager
def kept_module_state(model):
    """The tensors (and None) a model's modules hold as plain attributes, outside their parameters and buffers
    (RecurrentGemma keeps its recurrent and convolution states there), as they were after the block: a
    probe's forwards leave no state behind."""
    saved = [(m, {k: v for k, v in vars(m).items() if not k.startswith("_") and (v is None or isinstance(
        v, torch.Tensor))}) for m in model.modules()]
    try:
        yield
    finally:
        for module, attrs in saved:
            for name, value in attrs.items():
                patch(module, name, value, site="probe_state", admitted="token_trace.kept_module_state (restoring)")


def stand_in_output(out, inputs):
    """An adapted mixer's output under a trace, of the same structure: its mixing is the library's, so each
    token's output is a function of that token's input alone (the per-token sum of its first input with a
    token dimension, broadcast over the output's other dimensions); outputs without a token dimension (final
    states) are zeros. So the model's own code after the mixer is traced as well: a running sum of the
    mixer's output is found."""
    n = getattr(_STATE, "n", None)
    first = next((t for t in _tensors(inputs) if t.is_floating_point() and n in t.shape), None) if n else None
    per_token = None
    if first is not None:
        d = list(first.shape).index(n)
        per_token = torch.tanh(first.detach().movedim(d, 0).reshape(n, -1).float().mean(1))

    def stand_in(t):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            return t
        if per_token is None or n not in t.shape:
            return torch.zeros_like(t)
        d = list(t.shape).index(n)
        shape = [1] * t.dim()
        shape[d] = n
        return (torch.zeros_like(t) + per_token.to(t.device).reshape(shape)).to(t.dtype)

    return tree_map(stand_in, out)


def stand_in_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Per token, from its own query, key and value: query (B, H, L, D), key/value (B, H_kv, L, D) ->
    (B, L, H, D_v), the shape the attention interface returns."""
    B, H, L, _ = query.shape
    if key.shape[2] != L or value.shape[2] != L:  # keys beyond the queries' own (compressed entries): query alone
        return query.mean(-1, keepdim=True).expand(B, H, L, value.shape[-1]).transpose(1, 2).contiguous()
    groups = H // max(1, value.shape[1])
    v = value.repeat_interleave(groups, dim=1) if groups > 1 else value
    k = key.repeat_interleave(groups, dim=1) if groups > 1 else key
    out = v + query.mean(-1, keepdim=True) + k.mean(-1, keepdim=True)
    return out.transpose(1, 2).contiguous()


def _tensors(obj, depth: int = 0):
    """The tensors in ``obj`` and its tuples, lists and dicts (three levels; not inside other objects)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 3 and isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _tensors(item, depth + 1)
    elif depth < 3 and isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item, depth + 1)


def _fingerprint(t: torch.Tensor, n: int):
    """(token dim or None, float64 per-token sums (n, 2) or whole sums (2,)); None for a tensor that holds no
    plain local data (a DTensor, FSDP2's unallocated storage, a meta tensor)."""
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter) or t.is_meta or \
            (t.numel() and t.untyped_storage().nbytes() == 0):
        return None
    x = t.detach()
    if not (x.is_floating_point() or x.is_complex()):
        x = x.to(torch.float64)
    x = x.to(torch.float64) if not x.is_complex() else x.abs().to(torch.float64)
    dim = next((d for d, size in enumerate(x.shape) if size == n), None)
    if dim is None:
        return None, torch.stack([x.sum(), (x * x).sum()]) if x.numel() else torch.zeros(2, dtype=torch.float64)
    moved = x.movedim(dim, 0).reshape(n, -1)
    return dim, torch.stack([moved.sum(1), (moved * moved).sum(1)], 1)


def _differs(a, b, t: int | None, tol: float = 1e-7) -> bool:
    """Whether two fingerprints differ by more than ``tol`` of their scale (outside token ``t`` where they have a
    token dimension)."""
    (da, fa), (db, fb) = a, b
    if da != db or fa.shape != fb.shape:
        return True
    if da is not None and t is not None:
        keep = torch.ones(fa.shape[0], dtype=torch.bool)
        keep[t] = False
        fa, fb = fa[keep], fb[keep]
    scale = max(float(fa.abs().max()) if fa.numel() else 0.0, float(fb.abs().max()) if fb.numel() else 0.0, 1e-30)
    return bool(((fa - fb).abs() > tol * scale).any())


def _caller() -> tuple[str, int, str]:
    """The first frame outside torch and this package: the model code that called the operation."""
    for filename, line, name in caller_locations():
        path = os.path.abspath(filename)
        if not path.startswith(_TORCH) and not path.startswith(_PACKAGE):
            return path, line, name
    return "", 0, ""


class _Ops(TorchFunctionMode):
    """Every torch operation outside the owned calls: (name, caller, input and output fingerprints)."""

    def __init__(self, n: int, weights: set[int]):
        super().__init__()
        self.n = n
        self.weights = weights  # ids of the model's parameters and buffers: the same in both runs, not fingerprinted
        self.ops: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(_STATE, "owned", 0) or _DISTRIBUTED in next(caller_locations())[0]:
            return func(*args, **kwargs)  # the library's own calls; torch.distributed's (FSDP2's storage, DTensor)
        inputs = [f for f in (_fingerprint(a, self.n) for a in _tensors((args, kwargs)) if id(a) not in self.weights)
                  if f is not None]
        out = func(*args, **kwargs)
        outputs = [f for f in (_fingerprint(o, self.n) for o in _tensors(out)) if f is not None]
        if outputs:
            name = getattr(func, "__name__", str(func))
            self.ops.append((name, _caller(), inputs, outputs))
        return out


def _length(config) -> int:
    sizes = set()
    for cfg in {id(c): c for c in (config, getattr(config, "text_config", None)) if c is not None}.values():
        for value in vars(cfg).values():
            for v in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(v, int) and not isinstance(v, bool):
                    sizes.add(v)
    return next((n for n in _LENGTHS if n not in sizes), _LENGTHS[-1])


def _run(model, modules, ids, n: int, takes_positions: bool):
    """One traced forward: (ops, module records {name: (first op index, last op index, input fp, output fp)},
    logits fingerprint)."""
    mode = _Ops(n, {id(t) for t in (*model.parameters(), *model.buffers())})
    records: dict = {}
    handles = []

    def hooks_for(name, adapted):
        def before(module, args, kwargs):
            if name not in records:
                with owned():  # the hook's own operations are not the model's
                    first = next((a for a in _tensors((args, kwargs)) if a.is_floating_point()), None)
                    records[name] = [len(mode.ops), None, _fingerprint(first, n) if first is not None else None,
                                     None]
            if adapted:
                _STATE.owned = getattr(_STATE, "owned", 0) + 1

        def after(module, args, output):
            if adapted:
                _STATE.owned -= 1
            rec = records.get(name)
            with owned():
                if rec is not None and rec[1] is None:
                    first = next((o for o in _tensors(output) if o.is_floating_point()), None)
                    rec[1] = len(mode.ops)
                    rec[3] = _fingerprint(first, n) if first is not None else None
                return stand_in_output(output, (args,)) if adapted else None
        return before, after

    for name, module, adapted in modules:
        before, after = hooks_for(name, adapted)
        handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(module.register_forward_hook(after))
    kwargs = dict(input_ids=ids)
    if takes_positions:
        kwargs["position_ids"] = torch.arange(n, device=ids.device)[None]
    _STATE.on, _STATE.n = True, n
    try:
        with mode, torch.no_grad(), outside_context():
            try:
                out = model(**kwargs, use_cache=False)
            except TypeError:
                out = model(**kwargs)
    finally:
        _STATE.on, _STATE.owned, _STATE.n = False, 0, None
        for handle in handles:
            handle.remove()
    logits = getattr(out, "logits", None) if not isinstance(out, torch.Tensor) else out
    return mode.ops, records, _fingerprint(logits, n) if logits is not None else None


def _describe(op) -> str:
    name, (path, line, function), _, _ = op
    text = linecache.getline(path, line).strip() if path else ""
    where = f"{os.path.basename(path)}:{line}" if path else "an unknown line"
    return f"{name} at {where} (in {function}): {text}" if text else f"{name} at {where} (in {function})"


def trace_findings(model, modules, is_adapted, takes_positions: bool) -> list[tuple[str, str]]:
    """``[(module, why)]``: the token mixing of ``model`` (a cp_flash model in eval, the caller's state kept)
    outside the calls run across ranks (see the module docstring); ``modules``: its (name, module) pairs over
    the text sequence; ``is_adapted(module)``: a mixer whose mixing is the library's. Empty: none found."""
    config = model.config
    n = _length(config)
    vocab = int(getattr(getattr(config, "text_config", None) or config, "vocab_size", None) or 32)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    gen = torch.Generator().manual_seed(4321)
    ids = torch.randint(min(3, vocab - 1), max(4, min(vocab, 1000)), (1, n), generator=gen).to(device)
    t = n // 2
    changed = ids.clone()
    changed[0, t] = (ids[0, t] + 1) % max(4, min(vocab, 1000))
    listed = [(name or "(model)", module, bool(is_adapted(module))) for name, module in modules]
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with kept_module_state(model):
            ops_a, rec_a, logits_a = _run(model, listed, ids, n, takes_positions)
            ops_b, rec_b, logits_b = _run(model, listed, changed, n, takes_positions)
            tol = 1e-7
            if device.type != "cpu" and logits_a is not None:  # kernels that need not repeat their bits (atomics)
                _, _, again = _run(model, listed, ids, n, takes_positions)
                noise = max(float((again[1] - logits_a[1]).abs().max()) / max(float(logits_a[1].abs().max()), 1e-30),
                            0)
                tol = max(tol, 10 * noise)
    finally:
        for module, mode in modes:
            module.training = mode
    if logits_a is None or logits_b is None or not _differs(logits_a, logits_b, t, tol):
        return []
    # the innermost module whose output changes off the changed token while its input does not
    culprit = None
    for name, (start, end, fin, fout) in sorted(rec_a.items(), key=lambda kv: (kv[1][1] or 0)):
        other = rec_b.get(name)
        if other is None or fout is None or other[3] is None or end is None:
            continue
        agrees_in = fin is None or other[2] is None or not _differs(fin, other[2], t, tol)
        if _differs(fout, other[3], t, tol) and agrees_in:
            culprit = (name,)
            break
    found = None
    window_a = ops_a[rec_a[culprit[0]][0]:rec_a[culprit[0]][1]] if culprit else ops_a
    window_b = ops_b[rec_b[culprit[0]][0]:rec_b[culprit[0]][1]] if culprit else ops_b
    if len(window_a) == len(window_b):  # the same operations ran (a data-dependent path may not)
        for a, b in zip(window_a, window_b):
            if a[0] != b[0] or len(a[2]) != len(b[2]) or len(a[3]) != len(b[3]):
                continue
            clean = all(not _differs(x, y, t, tol) for x, y in zip(a[2], b[2]))
            if clean and any(_differs(x, y, t, tol) for x, y in zip(a[3], b[3])):
                found = a
                break
    where = culprit[0] if culprit else type(model).__name__
    op = f"; the first operation doing it: {_describe(found)}" if found else ""
    return [(where, "changing one token changes other tokens' outputs on one device with the attention and "
                    f"the adapted mixers answering per token: it mixes tokens along the sequence itself{op}")]


def model_trace(model, modules, is_adapted, takes_positions: bool) -> list[tuple[str, str, str]]:
    """``[(module, what, why)]``: :func:`trace_findings` (``what``: :data:`MIXING`), once per model class,
    configuration, dtype and module tree (names and classes: a module replaced by another class is traced
    again; :data:`state.TRACED`). A forward that cp_flash refuses (its code reads the mask as
    a dense tensor, ...) is a finding (``what``: :data:`REFUSED`, ``why``: the refusal); one the trace cannot run
    for another reason finds nothing (logged at DEBUG; verification at first use then runs the model)."""
    tree = zlib.crc32(repr([(name, type(m).__module__, type(m).__qualname__) for name, m in modules]).encode())
    key = (type(model), config_crc(model), next((str(p.dtype) for p in model.parameters()), ""), tree)
    with state.MODEL_LOCK:
        found = state.TRACED.get(key)
    if found is None:
        try:
            found = [(where, MIXING, why) for where, why in trace_findings(model, modules, is_adapted, takes_positions)]
        except Exception as exc:  # noqa: BLE001 - reported at DEBUG; verification at first use runs the model
            if getattr(exc, "refusal", None) is not None:  # cp_flash refuses what its forward does (a dense mask)
                found = [(type(model).__name__, REFUSED, str(exc))]
            else:
                log.debug("the model check's trace of %s could not run: %s", type(model).__name__, exc)
                found = []
        with state.MODEL_LOCK:
            state.TRACED[key] = found
    return found
