"""Losses a model reduces over its tokens outside attention, exact under context parallelism.

The MoE router's load-balancing loss (Switch Transformer's auxiliary loss; ``load_balancing_loss_func``
of transformers' MoE modeling modules, added to the language-model loss when ``output_router_logits``
is on) is a product of two means over every token of the batch and every MoE layer, padding excluded::

    aux = E * sum_e (T_e / S) * (R_e / S)

``S`` the number of (token, layer) rows, ``T_e`` how many of the rows' top-k choices picked expert
``e``, ``R_e`` the sum of the rows' router probabilities of ``e``. A rank that took the means over its
shard alone would compute another number (the per-rank means' product is not the batch's). Under
context parallelism the module's function is replaced by :func:`adapt_module`'s wrapper, which
sums ``S``, ``T``, ``R`` over the group (one all-reduce of ``2E + 1`` numbers, forward only) and
returns this rank's term, linear in its own differentiable ``R_r``::

    aux_r = s * E * sum_e (T_e / S) * (R_r,e / S)          (sum over ranks of aux_r / s == aux)

``s`` follows the loss convention of the batch: ``P`` for a batch of ``cp.shard_batch`` (each
rank's loss is P times its share, so the mean over ranks of the loss and of the gradients is the
single-device one), 1 under :class:`~cp_attention.integrations.trainers.trainer.CPTrainerMixin`, where
Trainer multiplies each process's loss by the process count itself. ``T`` is a count (no gradient),
as in the original.

The wrapper runs the formula only after checking it against the module's own function, on
synthetic router logits with and without padding, once per function, expert count and top-k (the
same answer on every rank): a family whose function computes something else (another signature,
another formula) raises NotImplementedError under context parallelism, naming it. Outside context
parallelism the original runs unchanged.

Legend: ``E`` experts, ``k`` experts per token, ``P`` ranks, ``N`` rows (tokens x MoE layers).
"""

from __future__ import annotations

import functools
import inspect

import torch

from ....engine.batch import AMBIGUOUS, batch_of, live_records
from ....engine.context import active_context
from ....refusals import refuse
from ...patches import patch
from ..heads import LOSS_SCALE
from ..versions import transformers_version
from .base import Adapter

__all__ = ["ADAPTER", "LOSS_FUNCTIONS", "adapt_module", "router_balance_parts"]

LOSS_FUNCTIONS = ("load_balancing_loss_func",)
_WRAPPED = "_cp_attention_loss_function"
_PARAMS = ("gate_logits", "num_experts", "top_k", "attention_mask")
_FITS: dict = {}  # (function, E, k) -> None (fits) or the reason it does not


def router_balance_parts(gate_logits, num_experts: int, top_k: int, valid: torch.Tensor | None):
    """``(S, T, R)`` of one rank's router logits: ``gate_logits`` a tuple of (N_l, E) per MoE layer
    (rows in (B, L) order), ``valid`` (B, L) padding mask or None. ``S`` () float32 rows counted
    (padding excluded), ``T`` (E,) float32 top-k choices per expert, ``R`` (E,) float32 router
    probabilities per expert (differentiable)."""
    device = gate_logits[0].device
    S = torch.zeros((), dtype=torch.float32, device=device)
    T = torch.zeros(num_experts, dtype=torch.float32, device=device)
    R = torch.zeros(num_experts, dtype=torch.float32, device=device)
    weight = None if valid is None else valid.reshape(-1).to(device, torch.float32)
    for layer in gate_logits:
        probs = torch.softmax(layer.to(device).reshape(-1, layer.shape[-1]), dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices
        w = torch.ones(probs.shape[0], dtype=torch.float32, device=device) if weight is None else weight
        if w.shape[0] != probs.shape[0]:
            raise ValueError(f"router logits of {probs.shape[0]} rows but a padding mask of {w.shape[0]} tokens")
        T = T + torch.zeros_like(T).scatter_add_(0, chosen.reshape(-1), w.repeat_interleave(top_k))
        R = R + (probs.float() * w[:, None]).sum(dim=0)
        S = S + w.sum()
    return S, T, R


def _balance(S, T, R, num_experts: int) -> torch.Tensor:
    return (T / S * (R / S)).sum() * num_experts


def _fits(original, num_experts: int, top_k: int) -> str | None:
    """None when :func:`router_balance_parts` computes ``original`` (probed on synthetic logits: two
    layers, B = 2, L = 5, with and without padding), else why not. Memoised."""
    key = (original, num_experts, top_k)
    if key in _FITS:
        return _FITS[key]
    reason = None
    try:
        params = list(inspect.signature(original).parameters)
    except (TypeError, ValueError):
        params = []
    if params != list(_PARAMS):
        reason = f"its signature ({', '.join(params)}) is not ({', '.join(_PARAMS)})"
    else:
        g = torch.Generator().manual_seed(0)
        logits = tuple(torch.randn(10, num_experts, generator=g, dtype=torch.float64) for _ in range(2))
        valid = torch.ones(2, 5, dtype=torch.bool)
        valid[1, 3:] = False
        for mask in (None, valid):
            want = torch.as_tensor(original(logits, num_experts, top_k, mask), dtype=torch.float64)
            got = _balance(*router_balance_parts(logits, num_experts, top_k, mask), num_experts).double()
            if not torch.allclose(got, want, rtol=1e-5, atol=1e-7):
                reason = (f"it computes {float(want):.6g} where the Switch-Transformer balance of the same router "
                          f"logits is {float(got):.6g} ({'with' if mask is not None else 'without'} padding)")
                break
    _FITS[key] = reason
    return reason


def _record_for(attention_mask, rows: int):
    """The multi-rank batch a router loss call runs on: the record of its padding mask, the active
    context's only live batch, or the only live multi-rank batch whose local tokens divide ``rows``
    (a forward run after its block); None outside context parallelism."""
    record = batch_of(attention_mask)
    if record is None:
        active = active_context()
        if active is not None:
            record = active.records.only()
        else:
            found = live_records(lambda rec: rows % (rec.meta.batch * rec.local_position_ids.shape[-1]) == 0)
            record = None if not found else found[0] if len(found) == 1 else AMBIGUOUS
    if record is AMBIGUOUS:
        raise refuse("router_loss_ambiguous_batch")
    if record is None or record.cp.world_size <= 1:
        return None
    return record


def _router_loss(original):
    name = f"{original.__module__}.{original.__qualname__}"

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if torch.compiler.is_compiling():
            return original(*args, **kwargs)
        try:
            bound = inspect.signature(original).bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        gate_logits, mask = a.get("gate_logits"), a.get("attention_mask")
        if not isinstance(gate_logits, tuple) or not gate_logits:
            return original(*args, **kwargs)
        rows = sum(g.reshape(-1, g.shape[-1]).shape[0] for g in gate_logits)
        record = _record_for(mask, rows)
        if record is None:
            return original(*args, **kwargs)
        reason = _fits(original, a["num_experts"], a["top_k"])
        if reason is not None:
            raise refuse("router_loss_unknown", name=name, reason=reason, version=transformers_version())
        tokens = record.meta.batch * record.local_position_ids.shape[-1]
        if any(g.reshape(-1, g.shape[-1]).shape[0] != tokens for g in gate_logits):
            raise refuse("router_logits_not_per_token", name=name, shapes=[tuple(g.shape) for g in gate_logits],
                         tokens=tokens)
        S, T, R = router_balance_parts(gate_logits, a["num_experts"], a["top_k"], mask)
        total = torch.cat([S.detach()[None], T, R.detach()])
        record.cp.comm.all_reduce(total, "the MoE router loss's sums")
        E = a["num_experts"]
        scale = float(record.extras.get(LOSS_SCALE, record.cp.world_size))
        return _balance(total[0], total[1:E + 1], R, E) * scale

    setattr(wrapper, _WRAPPED, True)
    return wrapper


def adapt_module(mod) -> bool:
    """Wrap the router loss functions of one modeling module (idempotent); whether any is there."""
    found = False
    for fname in LOSS_FUNCTIONS:
        original = getattr(mod, fname, None)
        if not callable(original):
            continue
        found = True
        if not getattr(original, _WRAPPED, False):
            patch(mod, fname, _router_loss(original), site="router_loss",
                  admitted="none when wrapped: losses._fits at each call under context parallelism")
    return found


class RouterLoss(Adapter):
    """The MoE router's auxiliary loss (see the module docstring): wrapped as each modeling module loads, checked
    at each call under context parallelism."""

    name = "router_loss"
    sites = ("router_loss",)
    adapts = "load_balancing_loss_func of MoE modeling modules"
    admission = "the function's behaviour against the exact rewrite (memoised), at each call under context parallelism"

    def adapt(self, mod) -> bool:
        return adapt_module(mod)


ADAPTER = RouterLoss()
