"""Multi-head latent attention under ``cp_flash``: the ring moves a token's latent row, not its heads.

transformers' MLA layers (DeepSeek-V2/V3/V3.2, GLM-4-MoE-Lite, MiniCPM3, LongCat-Flash, Youtu, Kimi-Linear's
MLA layers, ...) compute their keys and values in one method, ``expand_kv(kv_nope, k_rot)``: the normalised
compressed K/V (B, 1, L, kv_lora_rank) and the rotated shared RoPE key (B, 1, L, qk_rope_head_dim) in, keys
(B, H, L, D) and values (B, H, L, Dv) out, which the layer hands to the attention function. Here that method
is wrapped: in a cp_flash forward of a job of several processes it records its inputs and outputs for the
module, and the layer's cp_flash call, finding that its key and value are the very tensors the method returned,
hands the engine the latent rows (``kv_nope`` then ``k_rot``, ``kv_lora_rank + qk_rope_head_dim`` numbers a token) and the method itself as
the receiver's expansion (:class:`~cp_attention.strategies.latent.LatentKV`). Whether the ring then moves the
latent or the heads is the engine's choice (the cost model), stated in the call's PlanStats.

Admitted by behaviour: at the class's first call in a cp_flash forward (:func:`_expansion_reason`), the method
on synthetic rows must be row-wise (a token's keys and values depend on its own row only: rows expanded
together equal rows expanded apart) and return (B, H, W, D) and (B, H, W, Dv) keys and values; at every call,
it must give the same result twice on two rows (no dropout, no randomness: the receiver expands again in the
backward; checked at every call because a LoRA adapter's dropout shows only once its weights are not zero), and
the attention's key and value must be its outputs (no change between the method and the
attention). Whatever fails, the heads move as for every other layer (exact either way); a declined class is
named in the call's PlanStats (``kv_form_reason``).

Legend: ``B`` batch, ``L`` tokens of this rank, ``W`` rows, ``R`` latent width, ``H`` heads.
"""

from __future__ import annotations

import functools
import inspect
import weakref

import torch

from ....comm import process_count
from ....strategies.latent import LatentKV
from .. import state
from ...patches import patch
from .base import Adapter

__all__ = ["ADAPTER", "adapt_module", "adapted_expansion"]

_ADAPTED = "_cp_attention_latent"


class _Recorded:
    """One ``expand_kv`` call of a module in a cp_flash forward: weak references to its inputs and outputs (the
    layer's forward holds them until its attention call; a record never keeps a tensor, or its autograd graph,
    alive: a decode step's expansion of the whole cache is freed as usual)."""

    __slots__ = ("refs",)

    def __init__(self, *tensors):
        self.refs = tuple(weakref.ref(t) for t in tensors)

    def tensors(self) -> tuple | None:
        """(kv_nope, k_rot, key, value), or None when one of them is gone."""
        out = tuple(r() for r in self.refs)
        return None if any(t is None for t in out) else out


def _cp_flash(module) -> bool:
    return getattr(getattr(module, "config", None), "_attn_implementation", None) == "cp_flash"


def _wrap(original):
    @functools.wraps(original)
    def wrapper(self, kv_nope, k_rot, *args, **kwargs):
        key, value = original(self, kv_nope, k_rot, *args, **kwargs)
        if not args and not kwargs and not torch.compiler.is_compiling() and process_count() > 1 and _cp_flash(self):
            state.LATENTS[self] = _Recorded(kv_nope, k_rot, key, value)
        return key, value

    setattr(wrapper, _ADAPTED, True)  # functools.wraps keeps the original as __wrapped__
    return wrapper


def _rows(nope: torch.Tensor, rot: torch.Tensor, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic latent rows (1, 1, width, .) like a call's two parts."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, 1, width, x.shape[-1], generator=g).to(x) for x in (nope, rot))


def _expansion_reason(original, module, nope: torch.Tensor, rot: torch.Tensor) -> str | None:
    """None when ``original`` (an ``expand_kv``) is row-wise on five synthetic rows and returns keys
    (1, H, W, D) and values (1, H, W, Dv); else why not."""
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            nope, rot = _rows(nope, rot, 5, 0)
            k, v = original(module, nope, rot)
            k2, v2 = original(module, nope[:, :, :2], rot[:, :, :2])
            k3, v3 = original(module, nope[:, :, 2:], rot[:, :, 2:])
    except Exception as exc:  # noqa: BLE001 - any failure declines the class
        return f"expanding synthetic rows raised {type(exc).__name__}: {str(exc)[:200]}"
    if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3] or tuple(k.shape[:1]) + tuple(k.shape[2:3]) != (1, 5):
        return f"it returned keys {tuple(k.shape)} and values {tuple(v.shape)}, not (1, heads, 5, head_dim)"
    tol = 1e-5 if k.dtype in (torch.float32, torch.float64) else 1e-2
    for whole, parts in ((k, (k2, k3)), (v, (v2, v3))):
        if not torch.allclose(whole, torch.cat(parts, dim=2), atol=tol, rtol=tol):
            return "a token's keys or values depend on other tokens' rows (rows expanded together differ from apart)"
    return None


def _deterministic(original, module, nope, rot) -> bool:
    """The method gives the same keys and values twice on two rows (no dropout in the expansion)."""
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        nope, rot = _rows(nope, rot, 2, 1)
        first = original(module, nope, rot)
        second = original(module, nope, rot)
    return all(torch.equal(a, b) for a, b in zip(first, second))


def _reason(module, original, nope, rot) -> str | None:
    """Why ``module``'s expansion must not be used on latent rows (None: it may): the class's check, run at its
    first call and remembered for the process (``state.INTEGRATIONS["classes"]``), then this call's."""
    key = (type(module).__module__, f"{type(module).__qualname__}.expand_kv")
    with state.INTEGRATIONS_LOCK:
        known = key in state.INTEGRATIONS["classes"]
        why = state.INTEGRATIONS["classes"].get(key)
    if not known:
        why = _expansion_reason(original, module, nope, rot)
        with state.INTEGRATIONS_LOCK:
            state.INTEGRATIONS["classes"][key] = why
    if why is None and nope.dtype != rot.dtype:
        why = f"its latent's parts differ in dtype ({nope.dtype}, {rot.dtype})"
    if why is None and not _deterministic(original, module, nope, rot):
        why = "its expansion is not deterministic (dropout in training mode?): the receiver could not repeat it"
    return why


def _expansion(original, module, latent_dim: int):
    """The engine's expansion (B, W, R) -> (k (B, W, H, D), v (B, W, H, Dv)) through ``original``."""
    def expand(rows_BWR: torch.Tensor):
        k, v = original(module, rows_BWR[..., :latent_dim].unsqueeze(1), rows_BWR[..., latent_dim:].unsqueeze(1))
        return k.transpose(1, 2), v.transpose(1, 2)

    return expand


def _original(cls: type):
    """The original ``expand_kv`` of a class whose method this module adapted (None: not adapted)."""
    method = inspect.getattr_static(cls, "expand_kv", None)
    return getattr(method, "__wrapped__", None) if getattr(method, _ADAPTED, False) else None


def adapted_expansion(cls: type) -> bool:
    """Whether ``cls`` has an ``expand_kv`` this module adapted."""
    return _original(cls) is not None


def adapt_module(mod) -> bool:
    """Wrap the ``expand_kv`` of the modeling module's classes that define one (idempotent)."""
    found = False
    for cls in [v for v in list(vars(mod).values()) if isinstance(v, type) and v.__module__ == mod.__name__]:
        method = vars(cls).get("expand_kv")
        if method is None or not callable(method):
            continue
        found = True
        if not getattr(method, _ADAPTED, False):
            patch(cls, "expand_kv", _wrap(method), site="latent_kv",
                  admitted="a class defining expand_kv; its behaviour checked at its first cp_flash call")
    return found


class LatentKVAdapter(Adapter):
    """Multi-head latent attention's ``expand_kv`` (see the module docstring): a layer's cp_flash call hands the
    engine its latent rows and the method, so that the ring may move the latent instead of the heads."""

    name = "latent"
    sites = ("latent_kv",)
    adapts = "the expand_kv method of multi-head latent attention classes"
    admission = ("at the class's first cp_flash call, row-wise with the keys' and values' shapes on synthetic rows; "
                 "at every call, deterministic, and the attention's key and value the very tensors it returned")

    def adapt(self, mod) -> bool:
        return adapt_module(mod)

    def layer_call(self, call) -> None:
        if torch.compiler.is_compiling() or process_count() < 2:  # nothing recorded while tracing (the compiled
            return                                                  # op moves the heads) or in one process
        recorded = state.LATENTS.pop(call.module, None)
        recorded = None if recorded is None else recorded.tensors()
        if recorded is None or recorded[2] is not call.key or recorded[3] is not call.value:
            return
        original = _original(type(call.module))
        if original is None:
            return
        nope, rot = recorded[:2]
        if nope.dim() != 4 or rot.dim() != 4 or nope.shape[1] != 1 or rot.shape[1] != 1 or \
                nope.shape[2] != call.key.shape[2] or rot.shape[2] != call.key.shape[2]:
            return
        why = _reason(call.module, original, nope, rot)
        latent_BLR = torch.cat([nope[:, 0], rot[:, 0].to(nope.dtype)], dim=-1)
        params = tuple(p for p in call.module.parameters() if p.requires_grad)
        call.latent = LatentKV(latent_BLR, _expansion(original, call.module, nope.shape[-1]), params, declined=why)


ADAPTER = LatentKVAdapter()
