"""Masks a model builds itself: transformers' mask functions read as documents and bidirectional spans.

transformers hands the registered mask function (:func:`~.registry.cp_flash_mask`) a composed
``mask_function(batch, head, q, kv) -> bool``: causal or sliding, AND'd with packed documents, OR'd
with overlays a family adds itself (Gemma 3 / Gemma 4 image blocks through ``blockwise_overlay``,
PaliGemma's prefix, a text model's bidirectional switch). cp_flash never builds the (L x L) mask;
it reads what it needs in O(L):

* on one device, by *probing* the function on adjacent pairs (:func:`probe_adjacent`): a token that
  cannot see its predecessor opens a document; a token that sees its successor is inside a
  bidirectional span (the engine's :attr:`~cp_attention.masks.SequenceMeta.spans`). The span model
  (a query also sees every later key of its span) is checked on each span's corners
  (:func:`check_spans`), and an overlay that does not fit it is refused;
* under context parallelism the function a rank gets is built from its shard (local token types,
  the shard's positions), so it cannot be probed: its *structure* is read instead
  (:func:`overlay_structure`): transformers' block overlay is recognised (and whether a sliding
  window cuts it, as the engine's spans are cut), and the spans come from the
  full batch (``cp.shard_batch(..., model=model)`` computes the block ids with the family's own
  function, :func:`batch_span_next`); any other overlay on a causal layer is refused by name.

Legend: ``B`` rows, ``L`` tokens, ``n`` probed pairs.
"""

from __future__ import annotations

import functools
import inspect
import sys

import torch

from ...engine.local import multi_rank_context_active
from ...refusals import refuse

__all__ = ["mask_pairs", "probe_adjacent", "probe_whole_mask", "overlay_structure", "check_spans", "batch_span_next"]


def mask_pairs(mask_function, batch_size: int, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    """(B, n) bool: which of the n (query, key) pairs ``(q_idx[i], kv_idx[i])`` transformers' mask
    function lets each row see (one vectorised call per row, O(B * n))."""
    seen = torch.zeros(batch_size, q_idx.numel(), dtype=torch.bool)
    for b in range(batch_size):
        row = mask_function(torch.full_like(q_idx, b), torch.zeros_like(q_idx), q_idx, kv_idx)
        seen[b] = torch.as_tensor(row, dtype=torch.bool).expand(q_idx.numel())
    return seen


def _row_pairs(mask_function, rows: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    """(n,) bool: whether row ``rows[i]`` of transformers' mask function lets query ``q_idx[i]`` see key
    ``kv_idx[i]`` (one vectorised call)."""
    seen = mask_function(rows, torch.zeros_like(q_idx), q_idx, kv_idx)
    return torch.as_tensor(seen, dtype=torch.bool).expand(q_idx.numel())


def probe_adjacent(mask_function, batch_size: int, length: int, *, later: bool) -> torch.Tensor | None:
    """(B, L) bool from the ``L - 1`` adjacent pairs of a mask without a KV cache: ``later`` False,
    token ``i`` cannot see token ``i - 1`` (it opens a document; token 0 always does); ``later``
    True, token ``i`` sees token ``i + 1`` (the last column False). None when there is nothing to
    probe (no function, fewer than two tokens)."""
    if mask_function is None or length < 2:
        return None
    idx = torch.arange(1, length)
    out = torch.ones(batch_size, length, dtype=torch.bool) if not later else \
        torch.zeros(batch_size, length, dtype=torch.bool)
    if later:
        out[:, :-1] = mask_pairs(mask_function, batch_size, idx - 1, idx)
    else:
        out[:, 1:] = ~mask_pairs(mask_function, batch_size, idx, idx - 1)
    return out


def probe_whole_mask(mask_function, batch, batch_size: int, length: int):
    """``(opens, span_next)`` of a mask without a KV cache (:func:`probe_adjacent`; each None when
    it holds nothing: no document opens after token 0, no query sees a later key), or ``(None,
    None)`` under context parallelism (a multi-rank context active, or ``batch`` a multi-rank
    record): there the function was built from this rank's shard (its token types, the shard's
    positions), so probing it would read other tokens or index past the shard; the batch record
    holds the documents and the spans instead."""
    cp = getattr(batch, "cp", None)
    if multi_rank_context_active() or getattr(cp, "world_size", 1) > 1:
        return None, None
    opens = probe_adjacent(mask_function, batch_size, length, later=False)
    span_next = probe_adjacent(mask_function, batch_size, length, later=True)
    return (opens if opens is not None and bool(opens[:, 1:].any()) else None,
            span_next if span_next is not None and bool(span_next.any()) else None)


@functools.lru_cache(maxsize=1)
def _known_codes():
    """Codes of transformers' mask functions read here: the block overlay, AND, the sliding-window
    overlay; and the file of masking_utils."""
    from transformers import masking_utils as mu

    one = torch.zeros(1, 1, dtype=torch.long)
    return dict(block=mu.blockwise_overlay(one).__code__, both=mu.and_masks(mu.causal_mask_function).__code__,
                window=mu.sliding_window_overlay(1).__code__), mu.__file__


def _parts(fn) -> list:
    """The mask functions a composed one closes over (``and_masks``/``or_masks`` tuples flattened)."""
    parts = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if callable(item) and not isinstance(item, (torch.Tensor, type)):
                parts.append(item)
    return parts


def overlay_structure(mask_function) -> tuple[bool, list[str], bool, list[torch.Tensor]]:
    """Read a composed mask function: (it contains transformers' block overlay, the names of the
    functions in it that are not transformers' own mask functions: overlays cp_flash cannot read
    under context parallelism, every block overlay in it is cut by a sliding window, the block ids
    each block overlay reads: this rank's, -1 outside a block). Walks closures.

    The third answer is what a span longer than a layer's window needs: ``AND(window, OR(causal,
    block))`` (Gemma 3, Gemma 4: the window cuts the block, as the engine's spans are cut) gives True;
    ``OR(sliding causal, block)`` (the block seen whole past the window: Gemma 4-unified's sliding
    layers) gives False. A block is cut when, on its path from the root, some AND has a sibling that is
    a window (the sliding-window overlay, or an AND containing one)."""
    codes, own_file = _known_codes()
    found, foreign, cut, seen, ids = [False], [], [], set(), []

    def is_window(fn, depth: int = 0) -> bool:
        code = getattr(fn, "__code__", None)
        return depth < 16 and (code is codes["window"] or (
            code is codes["both"] and any(is_window(p, depth + 1) for p in _parts(fn))))

    def visit(fn, depth: int, windowed: bool) -> None:
        if depth > 16 or (id(fn), windowed) in seen:
            return
        seen.add((id(fn), windowed))
        code = getattr(fn, "__code__", None)
        if code is codes["block"]:
            found[0] = True
            cut.append(windowed)
            ids.extend(c.cell_contents for c in fn.__closure__ or () if isinstance(c.cell_contents, torch.Tensor))
            return
        if code is None or code.co_filename != own_file:
            foreign.append(getattr(fn, "__qualname__", type(fn).__name__))
            return
        parts = _parts(fn)
        for i, part in enumerate(parts):
            beside = code is codes["both"] and any(is_window(p) for j, p in enumerate(parts) if j != i)
            visit(part, depth + 1, windowed or beside)

    if mask_function is not None:
        visit(mask_function, 0, False)
    return found[0], foreign, bool(cut) and all(cut), ids


def check_spans(mask_function, span_next: torch.Tensor, window: int | None, family: str) -> None:
    """The span model against the mask function, on each span's corners: the first token sees the
    last (a span is a block, not a chain), and the last sees the first exactly when the layer's own
    window reaches it (the overlay adds later keys only, as transformers' ``AND(window, OR(causal,
    block))`` does). Raises NotImplementedError naming the family when the overlay is another shape."""
    nxt = span_next.to(torch.int8)
    edge = torch.diff(torch.nn.functional.pad(nxt, (1, 1)), dim=1)  # +1 at a span's start, -1 after its last link
    rows, starts = torch.nonzero(edge == 1, as_tuple=True)
    ends = torch.nonzero(edge == -1, as_tuple=True)[1]  # the last token of each span, same order
    if rows.numel() == 0:
        return
    # one vectorised call per direction over every span of every row (each pair in its own row)
    first_sees_last = _row_pairs(mask_function, rows, starts, ends)
    last_sees_first = _row_pairs(mask_function, rows, ends, starts)
    want = torch.ones_like(last_sees_first) if window is None else (ends - starts) < window
    ok = bool(first_sees_last.all()) and bool((last_sees_first == want).all())
    if not ok:
        raise refuse("span_shape", family=family or "this model")


def _block_function(model):
    """The family's own ``get_block_sequence_ids_for_mask(<token types>, ...)`` and the batch key it
    reads (its first parameter), found in the modules of the model's classes; None if none."""
    for cls in type(model).__mro__:
        module = sys.modules.get(cls.__module__)
        fn = getattr(module, "get_block_sequence_ids_for_mask", None)
        if callable(fn):
            first = next(iter(inspect.signature(fn).parameters), None)
            return (fn, first) if first else None
    return None


def batch_span_next(model, tensors: dict) -> tuple[torch.Tensor | None, bool]:
    """The bidirectional spans of a full batch as the model's mask would open them: ``(span_next
    (B, L) bool or None, read)``. ``read``: the model has a block function and the batch holds the
    token types it reads (``token_type_ids`` for Gemma 3, ``mm_token_type_ids`` for Gemma 4), whose
    block ids (the family's own function) make runs of one id >= 0 the spans. Whether a layer opens
    them is the layer's mask's business (Gemma 4's full-attention layers do not)."""
    found = None if model is None else _block_function(model)
    if found is None or found[1] not in tensors:
        return None, False
    fn, key = found
    ids = fn(tensors[key], device=torch.device("cpu")).to("cpu", torch.int64)
    span_next = torch.zeros(ids.shape, dtype=torch.bool)
    span_next[:, :-1] = (ids[:, :-1] == ids[:, 1:]) & (ids[:, :-1] >= 0)
    return span_next, True
