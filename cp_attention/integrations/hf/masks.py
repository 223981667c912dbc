"""cp_flash's mask function: what "cp_flash" layers receive as ``attention_mask``, O(L) metadata instead of an
(L x L) mask (:class:`CPMask`), and the checks a mask's own structure needs (its window, its bidirectional
spans, a key selection it carries).

Legend: ``B`` batch, ``L``/``Lq`` query tokens, ``Lk`` key tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields

import torch

from .generation import running_decode
from .overlays import check_spans, mask_pairs, overlay_structure, probe_adjacent, probe_whole_mask
from .selection import MaskRows, SelectingMask
from ...engine.layer import compiling_outside_cp, layer_mask_batch
from ...refusals import refuse

__all__ = ["CPMask", "cp_flash_mask"]


_UNPROBED = object()  # CPMask.sees_no_later_key not computed yet


@dataclass(eq=False)
class CPMask:
    """What "cp_flash" layers receive as ``attention_mask``: sizes, offsets and O(L) metadata.

    ``q_offset``/``kv_offset``: absolute position of the first query / key (non-zero after a KV
    cache; a sliding-window cache keeps only the last keys). ``valid`` (B, T) bool: the 2D padding
    mask over absolute positions, or None. ``opens`` (B, Lq) bool: document starts transformers
    itself detected in packed ``position_ids`` (no KV cache only), or None. ``local_size``: the
    window (or chunk) transformers' sliding-window (chunked) mask builder applies, None for a full
    mask: a layer whose module passes no ``sliding_window`` (Qwen2-MoE, PhiMoE: the window lives
    only in the mask) takes its window from here. ``mask_function``: transformers' own mask function, probed by
    :meth:`sees_no_later_key` for layers that declare themselves bidirectional. ``span_next`` (B, Lq)
    bool: one device, no KV cache: query ``i`` sees key ``i + 1`` (the bidirectional spans of
    :mod:`.overlays`), or None when no query sees a later key. ``key_select`` (B, Lq, k): one layer's
    copy of the mask carrying the global keys its block indexer selected (:meth:`with_selection`), or None.
    """

    batch_size: int
    q_length: int
    kv_length: int
    q_offset: int
    kv_offset: int
    valid: torch.Tensor | None
    opens: torch.Tensor | None
    batch: object = field(default=None, repr=False)
    local_size: int | None = None
    family: str = ""
    mask_function: object = field(default=None, repr=False)
    span_next: torch.Tensor | None = field(default=None, repr=False)
    key_select: torch.Tensor | None = field(default=None, repr=False)
    _no_later_key: object = field(default=_UNPROBED, repr=False)
    _checked: dict = field(default_factory=dict, repr=False)

    def opens_spans(self, window: int | None) -> bool:
        """Whether a causal layer with this mask (and its own ``window``) opens bidirectional spans
        (:mod:`.overlays`). One device: the probed ``span_next`` holds some, checked against the span
        model once per window (an overlay of another shape raises NotImplementedError). Under context
        parallelism, where the function is the shard's: it contains transformers' block overlay (the
        batch's spans, which ``cp.shard_batch(..., model=model)`` reads, then apply); any other
        overlay raises NotImplementedError naming it, on every rank (the function has the same shape
        on each)."""
        if torch.compiler.is_compiling():
            # traced on one device: the probe is a tensor (no data-dependent branch); a layer opening no
            # span plans as without spans, and the span model's check runs eagerly only. Traced inside
            # context parallelism the function cannot be read: the multi-rank op refuses batches with spans
            return self.span_next is not None if compiling_outside_cp() else False
        if window in self._checked:
            return self._checked[window]
        if self.span_next is not None:
            check_spans(self.mask_function, self.span_next, window, self.family)
            opens = True
        elif getattr(getattr(self.batch, "cp", None), "world_size", 1) > 1:
            opens, foreign, windowed, ids = overlay_structure(self.mask_function)
            if opens and not getattr(self.batch, "spans_read", True) and not any(bool((t >= 0).any()) for t in ids):
                # shard_batch read no spans (no model=) and this rank's tokens hold no block (Gemma 4-unified
                # hands its overlay ids of -1 on text): nothing opens here. A rank whose tokens hold one
                # refuses the batch (the engine's local error), and every rank with it
                opens = False
            if opens and window is not None and not windowed:
                _refuse_spans_past_window(self.batch, window, self.family)
            if foreign:
                raise refuse("foreign_mask_overlay", family=self.family or "this model",
                             functions=", ".join(sorted(set(foreign))))
        else:
            opens = False
        self._checked[window] = opens
        return opens

    def check_window(self, window: int) -> None:
        """One device: transformers' mask function hides every key ``window`` or more positions before
        its query, as the layer's window does (probed on those pairs, O(B * L), once per window). A
        mask that shows some (an overlay OR-ed over the window: unlimited_ocr's prefill keys) raises
        NotImplementedError instead of being cut to the window. Under context parallelism the shard's
        function is read by its structure instead (:meth:`opens_spans`); traced by torch.compile the
        probe does not run (it would break the graph): such a model is refused when run eagerly."""
        if torch.compiler.is_compiling():
            return
        key = ("window", window)
        if key in self._checked or self.mask_function is None or \
                getattr(getattr(self.batch, "cp", None), "world_size", 1) > 1:
            return
        self._checked[key] = True
        first = max(self.kv_offset + window - self.q_offset, 0)
        if first >= self.q_length:  # no query has a key `window` or more positions back
            return
        q = torch.arange(first, self.q_length) + self.q_offset
        if q.numel() and bool(mask_pairs(self.mask_function, self.batch_size, q, q - window).any()):
            raise refuse("overlay_past_window", family=self.family or "this model", window=window)

    @torch.compiler.disable
    def sees_no_later_key(self) -> bool | None:
        """Whether transformers' mask function lets no query see the key right after it, in any row:
        a causal mask (probed on the (query, next key) pairs, O(B * L), once per mask; eager under
        torch.compile). None when there is nothing to probe. A layer whose module says it is
        bidirectional (``is_causal = False``: BigBird-Pegasus's decoder, which leaves the flag at its
        default) but is handed a causal mask attends causally under eager, which follows the mask."""
        if self._no_later_key is _UNPROBED:
            self._no_later_key = _probe_no_later_key(self.mask_function, self.batch_size, self.q_length,
                                                     self.q_offset, self.kv_offset + self.kv_length)
        return self._no_later_key

    # generate() with a static cache prepares the masks in advance; models that build one mask (no
    # ``layer_types``: Mistral, Phi-3) hand it back to ``create_*_mask``, whose argument check reads
    # ``.ndim`` and only treats ``ndim == 2`` as a padding mask: a CPMask stands for a prepared mask.
    ndim = 4

    def contiguous(self) -> CPMask:
        """transformers' generation calls ``.contiguous()`` on prepared masks: nothing to do."""
        return self

    # Any other use is model code treating the mask as a dense tensor (adding it to scores as a bias,
    # slicing it, reading its dtype): a CPMask must never stand in for one silently.
    def _misused(self, how: str):
        family = self.family or "this model"
        raise refuse("mask_used_as_tensor", family=family, how=how)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        flat = [a for a in (*args, *(kwargs or {}).values())]
        flat += [b for a in flat if isinstance(a, (list, tuple)) for b in a]
        mask = next((a for a in flat if isinstance(a, CPMask)), None)
        (mask or CPMask(0, 0, 0, 0, 0, None, None))._misused(f"torch.{getattr(func, '__name__', func)}")

    def __getattr__(self, name):
        if name.startswith("__") or name in _CPMASK_FIELDS:
            raise AttributeError(name)
        self._misused(f".{name}")

    def selecting(self) -> SelectingMask:
        """This mask as an attention whose block indexer is adapted hands it around (:mod:`.adapters.indexers`)."""
        return SelectingMask(self)

    def with_selection(self, key_select: torch.Tensor) -> CPMask:
        """This mask for one layer, with the keys its block indexer selected (B, Lq, k) global indices."""
        return dataclasses.replace(self, key_select=key_select)

    def __getitem__(self, index):
        if _is_rows_index(index):  # a DSA layer hands its indexer the mask's rows: read by the adapted indexers
            return MaskRows(self)
        self._misused("indexing")

    def _arith(self, other):
        self._misused("arithmetic")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __and__ = __rand__ = __or__ = __ror__ = _arith
    __lt__ = __le__ = __gt__ = __ge__ = __invert__ = __neg__ = _arith


_CPMASK_FIELDS = frozenset(f.name for f in fields(CPMask))  # looked up before __init__ (copy): AttributeError


def _is_rows_index(index) -> bool:
    """``[:, 0]`` or ``[:, 0, :, :]``: the (B, S, T) rows of a (B, 1, S, T) mask."""
    if not isinstance(index, tuple) or len(index) not in (2, 4) or index[1] != 0 or isinstance(index[1], bool):
        return False
    return all(isinstance(i, slice) and i == slice(None) for i in index[:1] + index[2:])


def _probe_no_later_key(mask_function, batch_size: int, q_length: int, q_offset: int, kv_end: int) -> bool | None:
    """For :meth:`CPMask.sees_no_later_key`: no query sees the key after it (probed on every row)."""
    if mask_function is None:
        return None
    q_idx = torch.arange(q_offset, q_offset + q_length)
    q_idx = q_idx[q_idx + 1 < kv_end]
    if q_idx.numel() == 0:
        return None
    return not bool(mask_pairs(mask_function, batch_size, q_idx, q_idx + 1).any())


def cp_flash_mask(*, batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                  mask_function=None, attention_mask: torch.Tensor | None = None, local_size: int | None = None,
                  **kwargs) -> CPMask:
    """The mask function registered for "cp_flash": returns a :class:`CPMask`, never (L x L) data."""
    decoding = running_decode()
    if decoding is not None:  # a decode step over a sharded cache: its attention reads the cache's positions
        if isinstance(attention_mask, torch.Tensor):  # and this padding mask
            decoding.valid = attention_mask.detach().to(torch.bool)
        return None
    if isinstance(attention_mask, CPMask):  # prepared by generate for this forward: keep its padding
        attention_mask = attention_mask.valid
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"cp_flash expects a 2D (B, L) padding mask; got a {attention_mask.dim()}D attention_mask")
    family = str(getattr(kwargs.get("config"), "model_type", "") or "")
    if not torch.compiler.is_compiling():
        info = _bound_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask)
        info.local_size = None if local_size is None else int(local_size)
        info.family = family
        return info
    if not compiling_outside_cp():
        # traced inside context parallelism: the layers' op binds the batch when it runs, from the raw
        # padding mask (the tensor shard_batch returned) kept in ``valid``
        return CPMask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=int(q_offset),
                      kv_offset=int(kv_offset), valid=attention_mask, opens=None, batch=None,
                      local_size=None if local_size is None else int(local_size), family=family,
                      mask_function=mask_function)
    # traced by torch.compile outside context parallelism: no data-dependent branch, no bookkeeping (the
    # single-device op notes the forward's plans itself)
    opens = span_next = None
    if q_offset == 0 and kv_offset == 0 and q_length == kv_length:
        opens = probe_adjacent(mask_function, batch_size, q_length, later=False)
        span_next = probe_adjacent(mask_function, batch_size, q_length, later=True)
    return CPMask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=int(q_offset),
                  kv_offset=int(kv_offset), valid=None if attention_mask is None else attention_mask.detach().bool(),
                  opens=opens, batch=layer_mask_batch(attention_mask, batch_size, q_length),
                  local_size=None if local_size is None else int(local_size), family=family,
                  mask_function=mask_function, span_next=span_next)


@torch.compiler.disable
def _bound_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask) -> CPMask:
    """The mask of a forward that may run under context parallelism; eager (torch.compile breaks the
    graph here: the active context is a contextvar and the forward's bookkeeping thread-local)."""
    valid = None
    if attention_mask is not None:
        valid = attention_mask.detach().to(torch.bool)
        if bool(valid.all()):
            valid = None
    batch = layer_mask_batch(attention_mask, batch_size, q_length)  # also starts the forward's statistics
    opens, span_next = (None, None) if q_offset or kv_offset or q_length != kv_length else \
        probe_whole_mask(mask_function, batch, batch_size, q_length)
    return CPMask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=int(q_offset),
                  kv_offset=int(kv_offset), valid=valid, opens=opens, batch=batch, mask_function=mask_function,
                  span_next=span_next)


def _refuse_spans_past_window(batch, window: int, family: str) -> None:
    """Under context parallelism, a layer whose mask ORs the block overlay over its sliding window
    (:func:`~.overlays.overlay_structure`: a block seen whole, however far its first key lies behind a
    query): a bidirectional span of the batch longer than the window is refused (the engine cuts
    spans to the window); shorter ones are the same mask either way."""
    meta = getattr(batch, "meta", None)
    longest = max((int((e - s).max()) for s, e in (getattr(meta, "spans", None) or ()) if len(s)), default=0)
    if longest > window:  # (spans end exclusively) its last token is `window` or more past its first
        raise refuse("span_longer_than_window", longest=longest, window=window, family=family or "this model")
