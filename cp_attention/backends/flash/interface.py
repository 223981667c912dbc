"""The varlen contract on flash kernels: flash-attn 3 / 4 / 2 when installed, else PyTorch's own.

Interfaces (every version difference lives in this package, one small adapter per interface, one file each:
:mod:`.fa3`, :mod:`.fa4`, :mod:`.fa2`, :mod:`.aten`; this module holds what they share, :mod:`.backend`
the backend that picks one):

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
import sys

__all__ = ["Interface", "kernel_arguments", "fa2_max_seqlen_k", "parameters", "installed_version", "call_kernel",
           "window_kwargs", "import_optional", "head_dim_reasons"]


def kernel_arguments(*, scale: float, causal: bool, window: tuple[int, int], softcap: float | None) -> dict:
    """The contract's mask arguments in flash's common conventions: ``is_causal``,
    ``window_size_left/right`` (-1 unlimited; a causal call has right 0), ``scale``, ``softcap``
    (0.0 off). Each interface's adapter translates these further where it differs."""
    left, right = int(window[0]), int(window[1])
    if causal:
        right = 0
    return dict(is_causal=right == 0, window_size_left=left, window_size_right=right, scale=float(scale),
                softcap=0.0 if softcap is None else float(softcap))


def fa2_max_seqlen_k(max_seqlen_q: int, max_seqlen_k: int) -> int:
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


def parameters(fn) -> dict[str, inspect.Parameter]:
    """Parameters of ``fn``, seeing through ``torch.library.custom_op`` (whose own signature is
    ``(*args, **kwargs)``; flash-attn 2.7+ and 3 register their entry points that way)."""
    return dict(inspect.signature(inspect.unwrap(getattr(fn, "_init_fn", fn))).parameters)


def installed_version(module_name: str) -> str:
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


def call_kernel(iface: "Interface", fn, params: dict[str, inspect.Parameter], **kwargs):
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
            f"{iface.label}: {fn_name} of the installed {installed_version(iface.module_name)} requires "
            f"{', '.join(map(repr, missing))}, which cp_attention's {iface.name!r} adapter does not supply; "
            "the upstream signature changed: update the adapter in cp_attention/backends/flash/")
    return fn(**kwargs)


def window_kwargs(params, left: int, right: int) -> dict:
    """-1-style window sides as ``window_size_left/right`` or, in older releases, ``window_size``."""
    if "window_size_left" in params:
        return dict(window_size_left=left, window_size_right=right)
    return dict(window_size=(left, right))


def import_optional(name: str):
    """The module ``name``, or None when it (or a package above it) is not installed; any other
    import failure (a missing CUDA extension, say) propagates."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (name == exc.name or name.startswith(exc.name + ".")):
            return None
        raise


def head_dim_reasons(head_dim: int, largest: int) -> list[str]:
    if head_dim % 8 != 0 or head_dim > largest:
        return [f"head_dim {head_dim} must be a multiple of 8 and at most {largest}"]
    return []


# ----------------------------------------------------------------------------------------------
# the adapters' base


class Interface:
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
