"""The varlen contract on flash kernels: flash-attn 3 / 4 / 2 when installed, else PyTorch's own.

Interfaces (every version difference lives in this module, one small adapter per interface):

========  ==============================================  ======================================
name      entry points                                    conventions the adapter translates to
========  ==============================================  ======================================
``fa3``   ``flash_attn_interface._flash_attn_forward`` /  keyword call; ``window_size_left/right``
          ``_flash_attn_backward`` (Hopper package)       (-1 unlimited) or older ``window_size``
                                                          tuple; backward flag ``is_causal`` (older
                                                          ``causal``), fills preallocated dq/dk/dv;
                                                          lse (H, T), ``-inf`` for empty rows
``fa4``   ``flash_attn.cute.interface._flash_attn_fwd`` / keyword call; window sides are ``None``
          ``_flash_attn_bwd`` (CuTe DSL)                  for unlimited (a negative int is read
                                                          literally); ``return_lse=True``;
                                                          backward takes (q, k, v, out, dout, lse)
                                                          and returns (dq, dk, dv); no softcap
``fa2``   ``flash_attn.flash_attn_interface.``            ``window_size_left/right`` (2.7+) or a
          ``_flash_attn_varlen_forward/_backward``        ``window_size`` tuple; fills dq/dk/dv;
                                                          lse (H, T), ``+inf`` for empty rows;
                                                          window sides read against
                                                          ``max_seqlen_k`` (:func:`_fa2_max_seqlen_k`)
``aten``  ``torch.ops.aten._flash_attention_forward`` /   ``cum_seq_q/k``, ``window_size_left/
          ``_flash_attention_backward``                   right``; no softcap; ``+inf`` lse rows;
                                                          FA2 inside: as ``fa2`` for the window
========  ==============================================  ======================================

Preference when several are installed: ``fa3`` (Hopper, sm90), ``fa4`` (Blackwell, sm100/sm110),
``fa2`` (sm80+), ``aten`` (sm80+); the first whose declared support covers the inputs (capability,
dtype, head dim, softcap) is picked once per such combination and cached. Each adapter resolves
its entry points' signatures once, on first use.

:func:`kernel_arguments` turns the contract's mask arguments into flash's common form (pure,
tested on CPU by running the reference backend behind stand-in kernels with exactly the
arguments each interface receives). Kernels' conventions for rows that see no key are mapped back
to the contract's ``lse = -inf`` (and forward to ``+inf`` for the kernels whose backward expects it).
The kernels write dq/dk/dv in the input dtype; :meth:`FlashBackend.backward` returns them in float32
as the contract says (the ring's accumulation dtype). A kernel parameter without a default that an
adapter neither supplies nor knows as optional (``none_params``) raises a TypeError naming the
interface, the parameter and the installed version: an upstream signature change is never guessed.

A v head dim ``Dv`` different from q's and k's ``D`` (multi-head latent attention: DeepSeek-V2/V3,
MiniCPM3, ...) runs on every interface by zero padding to the common width ``P = max(D, Dv)``
(:func:`_common_width`), which is exact: zero columns of q and k add nothing to ``q . k``
(the scale is passed explicitly, never derived from the padded width), zero columns of v give zero
columns of out, which are sliced off, and in the backward zero columns of dout and out leave
``rowsum(dout * out)`` unchanged while the padded columns of dq/dk/dv are sliced off. The interfaces'
head-dim limits apply to ``P``. flash-attn 2 and PyTorch's kernels require ``Dv == D``; flash-attn 3
supports some ``(D, Dv)`` pairs natively (192/128), which would save the padding, but a single padded
path is what is tested here.

Legend: ``T`` packed query rows, ``S`` packed key rows, ``H``/``K`` query/key heads, ``D`` head dim
of q/k, ``Dv`` head dim of v/out, ``P = max(D, Dv)``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import logging
import sys

import torch

from ..masks import MaskSpec
from .base import accumulation_dtype

log = logging.getLogger(__name__)

__all__ = ["FlashBackend", "kernel_arguments", "pick_interface", "INTERFACES", "PREFERENCE"]

_DTYPES = (torch.float16, torch.bfloat16)
PREFERENCE = ("fa3", "fa4", "fa2", "aten")


def kernel_arguments(*, scale: float, causal: bool, window: tuple[int, int], softcap: float | None) -> dict:
    """The contract's mask arguments in flash's common conventions: ``is_causal``,
    ``window_size_left/right`` (-1 unlimited; a causal call has right 0), ``scale``, ``softcap``
    (0.0 off). Each interface's adapter translates these further where it differs."""
    left, right = int(window[0]), int(window[1])
    if causal:
        right = 0
    return dict(is_causal=right == 0, window_size_left=left, window_size_right=right, scale=float(scale),
                softcap=0.0 if softcap is None else float(softcap))


def _fa2_max_seqlen_k(max_seqlen_q: int, max_seqlen_k: int) -> int:
    """The ``max_seqlen_k`` to hand FlashAttention-2's varlen kernels (flash-attn 2 and PyTorch's
    bundled copy) so that they keep the contract's window for every sequence of the call.

    FA2 rewrites the window sides from ``max_seqlen_k`` before it builds its mask (``flash_api.cpp``:
    ``mha_varlen_fwd`` / ``mha_varlen_bwd``: ``if (window_size_left >= max_seqlen_k) window_size_left
    = -1`` and the same for the right side; then ``set_params_fprop``: ``if (window_size_left >= 0 &&
    window_size_right < 0) window_size_right = seqlen_k``, and the mirror rule for the left side,
    with ``seqlen_k`` that same ``max_seqlen_k``). With the mask aligned bottom-right, row ``i`` of a
    sequence of ``sq`` queries and ``sk`` keys then sees keys up to ``i + sk - sq + max_seqlen_k``:
    a sequence with more than ``max_seqlen_k + 1`` queries loses keys in its first rows (the ring
    emits such calls: L = 8192, P = 2, zigzag, window 4096 gives rank 1 a call of 4095 queries
    against 2048 keys with window (0, -1), 2046 rows of it wrong), and a finite side ``>=
    max_seqlen_k`` that still bounds such a sequence is dropped.

    Passing ``M = max(max_seqlen_q, max_seqlen_k)`` makes both rewrites exact: a side ``>= M`` bounds
    no row of any sequence (``sq, sk <= M``), and an unlimited side replaced by ``M`` reaches at least
    ``i + sk`` on the right and ``i + sk - sq - M <= 0`` on the left. FA2 reads ``max_seqlen_k``
    otherwise only for rounding, the backward's grid over key blocks (blocks past a sequence's keys
    exit at once) and the split-KV heuristics of paged / single-query calls; every loop runs over each
    sequence's own length from ``cu_seqlens_k``. A call without keys (``max_seqlen_k == 0``) keeps 0:
    the kernel's own no-key path (out 0, lse +inf) applies.

    flash-attn 3 needs no such care: it reads the left side against ``max_seqlen_k - 1`` and the right
    side against ``max_seqlen_q - 1`` (``hopper/flash_api.cpp``, ``mha_fwd`` / ``mha_bwd``, and
    ``set_params_fprop`` in earlier releases), which is exact for every sequence; flash-attn 4 (``flash_attn/cute/
    interface.py``, ``_resolve_causal_local_window``) takes unlimited sides as None and reads no
    sequence length for the window. ``tests/unit/test_flash_translation.py`` runs every interface behind
    stand-ins that apply these rules as the sources do."""
    return max(max_seqlen_q, max_seqlen_k) if max_seqlen_k > 0 else max_seqlen_k


# ----------------------------------------------------------------------------------------------
# calling a kernel's Python entry point by keyword, whatever its version's parameter order


def _parameters(fn) -> dict[str, inspect.Parameter]:
    """Parameters of ``fn``, seeing through ``torch.library.custom_op`` (whose own signature is
    ``(*args, **kwargs)``; flash-attn 2.7+ and 3 register their entry points that way)."""
    return dict(inspect.signature(inspect.unwrap(getattr(fn, "_init_fn", fn))).parameters)


def _installed_version(module_name: str) -> str:
    """``"<package> <version>"`` of the installed package that provides ``module_name`` (its own or
    an enclosing package's ``__version__``, else the distribution's metadata)."""
    parts = module_name.split(".")
    for i in range(len(parts), 0, -1):
        version = getattr(sys.modules.get(".".join(parts[:i])), "__version__", None)
        if isinstance(version, str):
            return f"{'.'.join(parts[:i])} {version}"
    try:
        for dist in importlib.metadata.packages_distributions().get(parts[0], []):
            return f"{dist} {importlib.metadata.version(dist)}"
    except Exception:  # broken metadata: the version is only for the message
        pass
    return f"{parts[0]} (version unknown)"


def _call(iface: "_Interface", fn, params: dict[str, inspect.Parameter], **kwargs):
    """``fn(**kwargs)`` for ``iface``'s adapter. Required parameters (no default) named in
    ``iface.none_params`` get None: optional tensors some releases declare without a default
    (flash-attn 3's ``k_new``, ...). Any other required parameter the adapter does not supply means
    the installed release changed its signature: raise, naming the interface, the parameter and the
    version, rather than guess. An unknown keyword is an adapter bug."""
    fn_name = getattr(getattr(fn, "_init_fn", fn), "__name__", repr(fn))  # a custom op's own function
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        unknown = sorted(set(kwargs) - set(params))
        if unknown:
            raise TypeError(f"{iface.label}: {fn_name} takes no {unknown}")
    missing = []
    for name, p in params.items():
        if (name not in kwargs and p.default is inspect.Parameter.empty
                and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)):
            if name in iface.none_params:
                kwargs[name] = None
            else:
                missing.append(name)
    if missing:
        raise TypeError(
            f"{iface.label}: {fn_name} of the installed {_installed_version(iface.module_name)} requires "
            f"{', '.join(map(repr, missing))}, which cp_attention's {iface.name!r} adapter does not supply; "
            "the upstream signature changed: update the adapter in cp_attention/backends/flash.py")
    return fn(**kwargs)


def _window_kwargs(params, left: int, right: int) -> dict:
    """-1-style window sides as ``window_size_left/right`` or, in older releases, ``window_size``."""
    if "window_size_left" in params:
        return dict(window_size_left=left, window_size_right=right)
    return dict(window_size=(left, right))


def _import(name: str):
    """The module ``name``, or None when it (or a package above it) is not installed; any other
    import failure (a missing CUDA extension, say) propagates."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (name == exc.name or name.startswith(exc.name + ".")):
            return None
        raise


def _head_dim_reasons(head_dim: int, largest: int) -> list[str]:
    if head_dim % 8 != 0 or head_dim > largest:
        return [f"head_dim {head_dim} must be a multiple of 8 and at most {largest}"]
    return []


# ----------------------------------------------------------------------------------------------
# one adapter per interface


class _Interface:
    """One kernel interface: whether it can be used here, what it supports, and its calls.

    ``forward``/``backward`` take the contract's tensors (q (T, H, D), k/v (S, K, D), int32
    ``cu_seqlens``) and :func:`kernel_arguments`; ``forward`` returns out (T, H, D) and lse (H, T)
    float32 in the kernel's own convention, ``backward`` (dq, dk, dv) in the input dtype (the
    kernels' own; :class:`FlashBackend` returns them in float32, the contract's). All four take
    float16/bfloat16 only (:class:`FlashBackend` checks that; fa3's float8 path has no backward).
    """

    name = ""
    label = ""
    module_name = ""
    """The module whose entry points the adapter calls (found by ``_resolve``)."""
    empty_lse = float("inf")
    """The lse the kernel's backward expects for rows that see no key."""
    none_params: frozenset[str] = frozenset()
    """Parameters some releases declare without a default that the adapter passes as None."""

    def __init__(self):
        self._checked = False
        self._reason: str | None = None

    def unavailable(self) -> str | None:
        """Why this interface cannot be used in this process (None: it can); checked once."""
        if not self._checked:
            try:
                self._reason = self._resolve()
            except Exception as exc:  # an installed package whose CUDA extension does not load
                self._reason = f"not importable ({type(exc).__name__}: {exc})"
            self._checked = True
        return self._reason

    def not_supported_reasons(self, *, capability: tuple[int, int] | None, head_dim: int,
                              softcap: bool) -> list[str]:
        """Why these inputs cannot run here; ``capability`` None skips the device check."""
        reason = self.unavailable()
        if reason is not None:
            return [reason]
        reasons = self._reasons(head_dim=head_dim, softcap=softcap)
        if capability is not None:
            reasons = self._capability_reasons(capability) + reasons
        return reasons

    def _resolve(self) -> str | None:
        raise NotImplementedError

    def _capability_reasons(self, capability: tuple[int, int]) -> list[str]:
        if capability < (8, 0):
            return [f"needs sm80 or newer, got sm{capability[0]}{capability[1]}"]
        return []

    def _reasons(self, *, head_dim: int, softcap: bool) -> list[str]:
        raise NotImplementedError


class _FlashAttn3(_Interface):
    """flash-attn 3 (Hopper): varlen through the unified ``_flash_attn_forward/_backward``."""

    name = "fa3"
    label = "flash-attn 3 (flash_attn_interface)"
    empty_lse = float("-inf")  # its backward preprocess reads -inf as "no key" (log2 lse 0, all masked)
    modules = ("flash_attn_interface", "flash_attn_3.flash_attn_interface")
    # 3.0 betas (plain functions) declare every optional tensor without a default
    none_params = frozenset({
        "k_new", "v_new", "qv", "out", "cu_seqlens_k_new", "seqused_q", "seqused_k", "page_table", "kv_batch_idx",
        "leftpad_k", "rotary_cos", "rotary_sin", "seqlens_rotary", "q_descale", "k_descale", "v_descale",
        "sequed_q", "sequed_k"})

    def _resolve(self):
        mod = next((m for m in map(_import, self.modules) if m is not None), None)
        if mod is None:
            return "not installed"
        self.module_name = mod.__name__
        if not (hasattr(mod, "_flash_attn_forward") and hasattr(mod, "_flash_attn_backward")):
            return "flash_attn_interface has no _flash_attn_forward/_flash_attn_backward"
        self._fwd, self._bwd = mod._flash_attn_forward, mod._flash_attn_backward
        self._fwd_params, self._bwd_params = _parameters(self._fwd), _parameters(self._bwd)
        if "cu_seqlens_q" not in self._fwd_params or "cu_seqlens_q" not in self._bwd_params:
            return "this flash_attn_interface predates varlen _flash_attn_forward/_backward(cu_seqlens_q=...)"
        self._causal_name = "is_causal" if "is_causal" in self._bwd_params else "causal"
        return None

    def _capability_reasons(self, capability):
        if capability[0] != 9:
            return [f"needs a Hopper GPU (sm90), got sm{capability[0]}{capability[1]}"]
        return []

    def _reasons(self, *, head_dim, softcap):
        reasons = _head_dim_reasons(head_dim, 256)
        if softcap and "softcap" not in self._fwd_params:
            reasons.append("this release has no softcap")
        return reasons

    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, scale, is_causal,
                window_size_left, window_size_right, softcap):
        kw = dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                  max_seqlen_k=max_seqlen_k, softmax_scale=scale, causal=is_causal,
                  **_window_kwargs(self._fwd_params, window_size_left, window_size_right))
        if softcap:
            kw["softcap"] = softcap
        out_THD, lse_HT, *_ = _call(self, self._fwd, self._fwd_params, **kw)
        return out_THD, lse_HT

    def backward(self, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, scale,
                 is_causal, window_size_left, window_size_right, softcap):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        kw = dict(dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse, cu_seqlens_q=cu_seqlens_q,
                  cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, dq=dq, dk=dk,
                  dv=dv, softmax_scale=scale, **{self._causal_name: is_causal},
                  **_window_kwargs(self._bwd_params, window_size_left, window_size_right))
        if softcap:
            kw["softcap"] = softcap
        if "deterministic" in self._bwd_params:
            kw["deterministic"] = False
        _call(self, self._bwd, self._bwd_params, **kw)
        return dq, dk, dv


class _FlashAttn4(_Interface):
    """flash-attn 4 (CuTe DSL) on Blackwell."""

    name = "fa4"
    label = "flash-attn 4 (flash_attn.cute.interface)"
    empty_lse = float("-inf")  # forward writes -inf; backward preprocess reads -inf as "no key"

    def _resolve(self):
        mod = _import("flash_attn.cute.interface")
        if mod is None:
            return "not installed"
        self.module_name = mod.__name__
        if not (hasattr(mod, "_flash_attn_fwd") and hasattr(mod, "_flash_attn_bwd")):
            return "flash_attn.cute.interface has no _flash_attn_fwd/_flash_attn_bwd"
        self._fwd, self._bwd = mod._flash_attn_fwd, mod._flash_attn_bwd
        self._fwd_params, self._bwd_params = _parameters(self._fwd), _parameters(self._bwd)
        need_fwd = {"cu_seqlens_q", "window_size_left", "return_lse"} - set(self._fwd_params)
        need_bwd = {"cu_seqlens_q", "window_size_left"} - set(self._bwd_params)
        if need_fwd or need_bwd:
            return (f"this release lacks {sorted(need_fwd)} in _flash_attn_fwd / {sorted(need_bwd)} in "
                    "_flash_attn_bwd (varlen + window backward)")
        return None

    def _capability_reasons(self, capability):
        # On sm90 several releases' backward asserts "varlen backward is not yet supported on sm90"
        # and "local not supported yet on 9.x"; Hopper uses flash-attn 3 instead.
        if capability[0] not in (10, 11):
            return [f"used on Blackwell (sm100/sm110) only, got sm{capability[0]}{capability[1]}"]
        return []

    def _reasons(self, *, head_dim, softcap):
        reasons = _head_dim_reasons(head_dim, 128)
        if softcap:
            reasons.append("no softcap in its varlen backward")
        return reasons

    @staticmethod
    def _mask(is_causal, left, right) -> dict:
        """FA4's mask arguments: an unlimited side is None (a negative int would be read literally,
        and ``left + right < 0`` turns the window off); causal only without a left window."""
        if is_causal and left < 0:
            return dict(causal=True, window_size_left=None, window_size_right=None)
        return dict(causal=False, window_size_left=None if left < 0 else left,
                    window_size_right=None if right < 0 else right)

    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, scale, is_causal,
                window_size_left, window_size_right, softcap):
        if softcap:
            raise ValueError("flash-attn 4 has no softcap in its varlen backward; use another interface")
        kw = dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, softmax_scale=scale,
                  return_lse=True, **self._mask(is_causal, window_size_left, window_size_right))
        if "max_seqlen_q" in self._fwd_params:
            kw.update(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
        result = _call(self, self._fwd, self._fwd_params, **kw)  # (out, lse) or (out, lse, p, row_max)
        out_THD, lse_HT = result[0], result[1]
        if lse_HT is None:
            raise RuntimeError("flash-attn 4 returned no lse although return_lse=True")
        return out_THD, lse_HT

    def backward(self, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, scale,
                 is_causal, window_size_left, window_size_right, softcap):
        if softcap:
            raise ValueError("flash-attn 4 has no softcap in its varlen backward; use another interface")
        kw = dict(q=q, k=k, v=v, out=out, dout=dout, lse=lse, softmax_scale=scale, cu_seqlens_q=cu_seqlens_q,
                  cu_seqlens_k=cu_seqlens_k, **self._mask(is_causal, window_size_left, window_size_right))
        if "max_seqlen_q" in self._bwd_params:
            kw.update(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
        dq, dk, dv = _call(self, self._bwd, self._bwd_params, **kw)[:3]
        return dq, dk, dv


class _FlashAttn2(_Interface):
    """flash-attn 2.x varlen functions."""

    name = "fa2"
    label = "flash-attn 2 (flash_attn.flash_attn_interface)"
    empty_lse = float("inf")  # its forward writes +inf for rows that see nothing
    # optional arguments some 2.x releases declare without a default
    none_params = frozenset({"block_table", "leftpad_k", "seqused_k", "rng_state"})

    def _resolve(self):
        mod = _import("flash_attn.flash_attn_interface")
        if mod is None:
            return "not installed"
        self.module_name = mod.__name__
        self._fwd, self._bwd = mod._flash_attn_varlen_forward, mod._flash_attn_varlen_backward
        self._fwd_params, self._bwd_params = _parameters(self._fwd), _parameters(self._bwd)
        if not {"window_size_left", "window_size"} & set(self._fwd_params):
            return "this flash-attn 2 release predates sliding windows"
        return None

    def _reasons(self, *, head_dim, softcap):
        reasons = _head_dim_reasons(head_dim, 256)
        if softcap and "softcap" not in self._fwd_params:
            reasons.append("this flash-attn 2 release has no softcap (2.6+ has)")
        return reasons

    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, scale, is_causal,
                window_size_left, window_size_right, softcap):
        max_k = _fa2_max_seqlen_k(max_seqlen_q, max_seqlen_k)  # FA2 reads window sides against it
        kw = dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                  max_seqlen_k=max_k, dropout_p=0.0, softmax_scale=scale, causal=is_causal,
                  alibi_slopes=None, return_softmax=False,
                  **_window_kwargs(self._fwd_params, window_size_left, window_size_right))
        if "softcap" in self._fwd_params:
            kw["softcap"] = softcap
        elif softcap:
            raise ValueError("this flash-attn 2 release has no softcap")
        result = _call(self, self._fwd, self._fwd_params, **kw)
        # 2.7+: (out, lse, S_dmask, rng_state); earlier: (out, q, k, v, out_padded, lse, S_dmask, rng_state)
        return (result[0], result[5]) if len(result) == 8 else (result[0], result[1])

    def backward(self, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, scale,
                 is_causal, window_size_left, window_size_right, softcap):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        max_k = _fa2_max_seqlen_k(max_seqlen_q, max_seqlen_k)  # FA2 reads window sides against it
        kw = dict(dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse, dq=dq, dk=dk, dv=dv, cu_seqlens_q=cu_seqlens_q,
                  cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_k, dropout_p=0.0,
                  softmax_scale=scale, causal=is_causal, alibi_slopes=None, deterministic=False,
                  **_window_kwargs(self._bwd_params, window_size_left, window_size_right))
        if "softcap" in self._bwd_params:
            kw["softcap"] = softcap
        _call(self, self._bwd, self._bwd_params, **kw)
        return dq, dk, dv


def _aten_flash_forward(*args, **kwargs):
    return torch.ops.aten._flash_attention_forward(*args, **kwargs)


def _aten_flash_backward(*args, **kwargs):
    return torch.ops.aten._flash_attention_backward(*args, **kwargs)


class _AtenFlash(_Interface):
    """PyTorch's built-in flash kernels (flash-attn 2 inside ATen)."""

    name = "aten"
    label = "PyTorch flash (aten._flash_attention_forward)"
    module_name = "torch"
    empty_lse = float("inf")

    def _resolve(self):
        op = getattr(torch.ops.aten, "_flash_attention_forward", None)
        if op is None:
            return "this PyTorch has no aten._flash_attention_forward"
        if "window_size_left" not in {a.name for a in op.default._schema.arguments}:
            return "this PyTorch's flash kernels predate sliding windows"
        return None

    def _reasons(self, *, head_dim, softcap):
        reasons = _head_dim_reasons(head_dim, 256)
        if softcap:
            reasons.append("no softcap (PyTorch's flash kernels have none)")
        return reasons

    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, scale, is_causal,
                window_size_left, window_size_right, softcap):
        if softcap:
            raise ValueError("PyTorch's flash kernels have no softcap")
        max_k = _fa2_max_seqlen_k(max_seqlen_q, max_seqlen_k)  # its FA2 reads window sides against it
        out, lse, *_ = _aten_flash_forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_k, 0.0, is_causal, False, scale=scale,
            window_size_left=window_size_left, window_size_right=window_size_right)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, scale,
                 is_causal, window_size_left, window_size_right, softcap):
        rng = torch.zeros(2, dtype=torch.int64, device=q.device)
        unused = torch.empty(0, device=q.device)
        max_k = _fa2_max_seqlen_k(max_seqlen_q, max_seqlen_k)  # its FA2 reads window sides against it
        dq, dk, dv = _aten_flash_backward(
            dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_k, 0.0, is_causal, rng,
            unused, scale=scale, window_size_left=window_size_left, window_size_right=window_size_right)
        return dq, dk, dv


def _ready(name: str) -> _Interface:
    """The adapter called ``name``, its entry points resolved; raises if it cannot be used here."""
    iface = INTERFACES[name]
    reason = iface.unavailable()
    if reason is not None:
        raise RuntimeError(f"{iface.label}: {reason}")
    return iface


def _new_interfaces() -> dict[str, _Interface]:
    return {cls.name: cls() for cls in (_FlashAttn3, _FlashAttn4, _FlashAttn2, _AtenFlash)}


INTERFACES: dict[str, _Interface] = _new_interfaces()


def pick_interface(*, capability: tuple[int, int] | None, head_dim: int, softcap: bool,
                   candidates=PREFERENCE) -> tuple[str | None, list[str]]:
    """The first of ``candidates`` (default :data:`PREFERENCE`) that can run these inputs, and one
    reason per interface rejected before it (``"<label>: <why>"``)."""
    rejected = []
    for name in candidates:
        iface = INTERFACES[name]
        reasons = iface.not_supported_reasons(capability=capability, head_dim=head_dim, softcap=softcap)
        if not reasons:
            return name, rejected
        rejected.append(f"{iface.label}: {', '.join(reasons)}")
    return None, rejected


# ----------------------------------------------------------------------------------------------
# the two kernels, as custom ops with fake implementations (so the ring can be traced)


@torch.library.custom_op("cp_attention::flash_varlen_fwd", mutates_args=())
def flash_varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, scale: float, is_causal: bool,
                     window_size_left: int, window_size_right: int, softcap: float,
                     interface: str) -> tuple[torch.Tensor, torch.Tensor]:
    """q (T, H, D), k/v (S, K, D) -> out (T, H, D), lse (H, T) float32 in ``interface``'s convention."""
    out_THD, lse_HT = _ready(interface).forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=scale, is_causal=is_causal,
        window_size_left=window_size_left, window_size_right=window_size_right, softcap=softcap)
    return out_THD, lse_HT


@flash_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, is_causal, window_size_left,
      window_size_right, softcap, interface):
    return q.new_empty((*q.shape[:2], v.shape[-1])), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("cp_attention::flash_varlen_bwd", mutates_args=())
def flash_varlen_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                     max_seqlen_k: int, scale: float, is_causal: bool, window_size_left: int, window_size_right: int,
                     softcap: float, interface: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq (T, H, D), dk/dv (S, K, D) in the input dtype, given the final out and lse (H, T) in
    ``interface``'s convention."""
    return _ready(interface).backward(
        dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=scale,
        is_causal=is_causal, window_size_left=window_size_left, window_size_right=window_size_right, softcap=softcap)


@flash_varlen_bwd.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, is_causal,
      window_size_left, window_size_right, softcap, interface):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _contract_lse(lse_HT: torch.Tensor) -> torch.Tensor:
    """Rows that see no key: flash-attn 2 and PyTorch write ``+inf``, 3 and 4 ``-inf``; the contract
    says ``-inf``."""
    return torch.where(torch.isposinf(lse_HT), torch.full_like(lse_HT, float("-inf")), lse_HT)


def _kernel_lse(lse_HT: torch.Tensor, empty: float) -> torch.Tensor:
    """The contract's lse (H, T) as the backward of a kernel expects it: contiguous float32, rows that
    see no key as ``empty``."""
    lse_HT = lse_HT.float()
    if empty != float("-inf"):
        lse_HT = torch.where(torch.isneginf(lse_HT), torch.full_like(lse_HT, empty), lse_HT)
    return lse_HT.contiguous()


# ----------------------------------------------------------------------------------------------
# the backend


def _capability(device: torch.device) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(device))


def _common_width(head_dim: int, head_dim_v: int | None) -> int:
    """The head dim the kernels run at: q/k's and v's, padded to the larger (module docstring)."""
    return max(head_dim, head_dim_v or head_dim)


def _pad_to(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` (..., d) zero padded to (..., width) (``x`` itself when d == width)."""
    return x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))


def _width(x: torch.Tensor, d: int) -> torch.Tensor:
    """A kernel result (..., P) cut back to its true head dim ``d`` (a new contiguous tensor)."""
    return x if x.shape[-1] == d else x[..., :d].contiguous()


class FlashBackend:
    """Flash kernels on CUDA for float16/bfloat16; see the module docstring for the interfaces.

    ``interface`` forces one of :data:`PREFERENCE`; None (default) takes the first, in that order,
    that supports the inputs on their device.
    """

    name = "flash"

    def __init__(self, interface: str | None = None):
        if interface is not None and interface not in PREFERENCE:
            raise ValueError(f"interface must be None or one of {list(PREFERENCE)}, got {interface!r}")
        self.interface = interface
        self._picks: dict[tuple, tuple[str | None, list[str]]] = {}

    def _pick(self, device, head_dim: int, softcap: bool) -> tuple[str | None, list[str]]:
        capability = _capability(device) if torch.device(device).type == "cuda" else None
        key = (capability, head_dim, softcap)
        if key not in self._picks:
            candidates = PREFERENCE if self.interface is None else (self.interface,)
            self._picks[key] = pick_interface(capability=capability, head_dim=head_dim, softcap=softcap,
                                              candidates=candidates)
            name, rejected = self._picks[key]
            log.debug("flash interface for capability %s, head_dim %d, softcap %s: %s%s", capability, head_dim,
                      softcap, INTERFACES[name].label if name else "none", f"; rejected {rejected}" if rejected else "")
        return self._picks[key]

    def describe(self, *, device, dtype, head_dim: int, spec: MaskSpec, head_dim_v: int | None = None) -> str:
        """The backend and the flash interface it runs for such inputs (for logs)."""
        name = self._pick(device, _common_width(head_dim, head_dim_v), spec.softcap is not None)[0]
        return f"flash via {INTERFACES[name].label}" if name is not None else "flash (no interface fits)"

    def interface_for(self, *, device, head_dim: int, softcap: bool = False,
                      head_dim_v: int | None = None) -> str | None:
        """The interface this backend runs for such inputs on ``device`` (None: none fits)."""
        return self._pick(device, _common_width(head_dim, head_dim_v), softcap)[0]

    def not_supported_reasons(self, *, device, dtype, head_dim, spec: MaskSpec, head_dim_v=None) -> list[str]:
        reasons = []
        if torch.device(device).type != "cuda":
            reasons.append(f"flash kernels need CUDA tensors, got {torch.device(device).type}")
        if dtype not in _DTYPES:
            reasons.append(f"flash kernels take float16/bfloat16, got {dtype}")
        if reasons and self.interface is None:
            return reasons
        name, rejected = self._pick(device, _common_width(head_dim, head_dim_v), spec.softcap is not None)
        return reasons if name is not None else reasons + rejected

    def _interface(self, q: torch.Tensor, width: int, softcap) -> str:
        name, rejected = self._pick(q.device, width, softcap is not None)
        if name is None:
            raise ValueError("no flash interface supports these inputs: " + " | ".join(rejected))
        return name

    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                scale, causal, window=(-1, -1), softcap=None):
        """q (T, H, D), k (S, K, D), v (S, K, Dv) -> out (T, H, Dv), lse (H, T) float32 (``-inf``: no
        key); run at width ``P = max(D, Dv)`` (module docstring)."""
        P = _common_width(q.shape[-1], v.shape[-1])
        iface = self._interface(q, P, softcap)
        kw = kernel_arguments(scale=scale, causal=causal, window=window, softcap=softcap)
        out_THP, lse_HT = flash_varlen_fwd(
            _pad_to(q, P).contiguous(), _pad_to(k, P).contiguous(), _pad_to(v, P).contiguous(),
            cu_seqlens_q.int().contiguous(), cu_seqlens_k.int().contiguous(), int(max_seqlen_q), int(max_seqlen_k),
            kw["scale"], kw["is_causal"], kw["window_size_left"], kw["window_size_right"], kw["softcap"], iface)
        return _width(out_THP, v.shape[-1]), _contract_lse(lse_HT)

    def backward(self, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                 scale, causal, window=(-1, -1), softcap=None):
        """dout/out (T, H, Dv), lse (H, T) final -> dq (T, H, D), dk (S, K, D), dv (S, K, Dv) in float32
        (float64 for float64 inputs) as the contract says: the ring's accumulation dtype, so it adopts
        them without a copy. The kernels write the input dtype; the upcast is exact. Run at width
        ``P = max(D, Dv)`` (module docstring)."""
        P = _common_width(q.shape[-1], v.shape[-1])
        iface = self._interface(q, P, softcap)
        kw = kernel_arguments(scale=scale, causal=causal, window=window, softcap=softcap)
        acc = accumulation_dtype(q.dtype)
        grads = flash_varlen_bwd(
            _pad_to(dout, P).contiguous(), _pad_to(q, P).contiguous(), _pad_to(k, P).contiguous(),
            _pad_to(v, P).contiguous(), _pad_to(out, P).contiguous(), _kernel_lse(lse, INTERFACES[iface].empty_lse),
            cu_seqlens_q.int().contiguous(), cu_seqlens_k.int().contiguous(), int(max_seqlen_q), int(max_seqlen_k),
            kw["scale"], kw["is_causal"], kw["window_size_left"], kw["window_size_right"], kw["softcap"], iface)
        return tuple(_width(g, x.shape[-1]).to(acc) for g, x in zip(grads, (q, k, v)))
