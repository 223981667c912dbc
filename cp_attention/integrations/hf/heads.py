"""What a model's head does with the sequence after its layers, under context parallelism.

A head that reads positions or reduces over tokens by itself would see only this rank's shard. Before
a multi-rank forward, :func:`prepare_call` makes each of these exact or refuses it, alike on every rank:

* sequence classification (reward models) pools one token of each row, its last non-padding token,
  which one rank holds. Exact for the heads that pool from the per-token scores of the sequence
  (transformers' shared ``GenericForSequenceClassification`` forward and the forwards that pick the
  last non-padding token the same way): the head's forward gets the whole sequence's ``input_ids``
  (the base model still gets this rank's shard), and the per-token scores of its head modules are
  gathered over the group into sequence order, so the pooled logits and the loss are the
  single-device ones on every rank. Refused for heads that pool inside the base model ([CLS]
  poolers);
* question answering takes ``start_positions``/``end_positions`` as indices into the sequence: the
  start/end logits are gathered the same way (exact; the logits the forward returns are the whole
  sequence's, on every rank). Refused on rows with padding: the span loss is a softmax over every
  position, and a padding position's logits are each attention implementation's own;
* ``logits_to_keep=k`` (or a 1-D tensor of positions) keeps the last ``k`` tokens of the sequence:
  each rank computes the logits of the kept tokens it holds and the group gathers them (exact; with
  ``labels`` refused, as the logits no longer match them);
* token classification heads that take the mean of their cross entropy over the tokens they are
  given (not through ``self.loss_function(..., **kwargs)``, which divides a sum by the batch's
  ``num_items_in_batch``) would average per rank: their scores are gathered the same way and the
  forward gets the whole sequence's ``labels`` (exact; the logits are the whole sequence's). A
  masked-LM head's scores are the vocabulary's, too large to gather: with such a loss it is refused
  with ``labels``;
* a ``num_items_in_batch`` handed to the model that is not the one ``cp.shard_batch`` bound to the
  batch (label tokens / P) scales the loss wrongly: ValueError;
* an output z-loss (Bamba's ``z_loss_coefficient``: the mean over the tokens of
  ``logsumexp(logits)^2``) is each rank's mean, the batch's when the ranks hold as many tokens:
  refused for uneven shards (and by the CP trainers, whose loss scaling would multiply it by P).

The gathered outputs follow the loss convention of the batch: a loss computed from them is the
whole loss on every rank (the mean over ranks is the single-device loss, as for the token losses,
which are P times each rank's share), and the backward of the gather sums the group's gradients
(:class:`_GatherRows`), so the mean over ranks of the parameters' gradients is the single-device one.
The CP trainers, which join the ranks' micro-batches along the sequence, refuse these heads.

The keyword arguments of the call are read from (and, for the substitutions, written to) the frame of
``nn.Module._call_impl`` that runs the global forward pre-hook (torch's global pre-hooks take no
keyword arguments); where that frame is not found nothing is checked (a test pins it).
"""

from __future__ import annotations

import functools
import re

import torch

from ... import layout as layout_mod
from . import source
from ...engine.batch import AMBIGUOUS, batch_of
from ...refusals import refuse

__all__ = ["HAS_PADDING", "HeadCall", "LOSS_SCALE", "gather_rows", "prepare_call"]

HAS_PADDING = "has_padding"
"""Key of a batch record's ``extras``: whether the batch's ``attention_mask`` has a zero (set by
``shard_batch``)."""

LOSS_SCALE = "aux_loss_scale"
"""Key of a batch record's ``extras``: the factor ``s`` of a rank's share of an auxiliary loss (P when
absent); set by the trainers, read by the heads and the router loss."""

_NUM_ITEMS_LOSS = re.compile(r"self\.loss_function\((?:[^()]|\([^()]*\))*\*\*kwargs", re.S)
_LAST_TOKEN_POOLING = re.compile(r"last_non_pad_token|sequence_lengths")


@functools.lru_cache(maxsize=1)
def _heads() -> dict[str, frozenset]:
    from transformers.models.auto import modeling_auto as auto

    def names(mapping) -> frozenset:
        out = set()
        for value in mapping.values():
            out.update(value if isinstance(value, (tuple, list)) else (value,))
        return frozenset(out)

    return dict(sequence=names(auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES),
                qa=names(auto.MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES),
                token=names(auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES),
                masked=names(auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES),
                causal=names(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))


def head_kind(model) -> str | None:
    """"sequence" or "qa" for a model whose head returns one output per row (a pooled token, a span's
    positions) from the whole sequence; None otherwise."""
    name, heads = type(model).__name__, _heads()
    return "sequence" if name in heads["sequence"] else "qa" if name in heads["qa"] else None


def _loss_takes_num_items(cls: type) -> bool:
    """Whether ``cls.forward`` computes its loss through ``self.loss_function(..., **kwargs)`` (the
    batch's ``num_items_in_batch`` reaches the loss)."""
    return bool(_NUM_ITEMS_LOSS.search(source.class_source(cls)))


@functools.lru_cache(maxsize=None)
def _forward_source(cls: type) -> str:
    import inspect

    try:
        return inspect.getsource(inspect.unwrap(cls.forward))
    except (OSError, TypeError):
        return ""


def _pools_scores(cls: type) -> bool:
    """Whether a sequence classifier's forward pools the per-token scores of the base model's output at
    the last non-padding token of ``input_ids`` (transformers' shared forward, or one that computes
    ``last_non_pad_token`` / ``sequence_lengths`` itself), not a pooler inside the base model, and
    hands ``input_ids`` to nothing but the base model and the pooling (an encoder-decoder's forward
    also derives the decoder's inputs from them: T5Gemma)."""
    source = _forward_source(cls)
    return bool(_LAST_TOKEN_POOLING.search(source)) and "pooler" not in source and "decoder_input_ids" not in source


def _spans_scores(cls: type) -> bool:
    """Whether a QA head's forward takes its start/end logits from ``self.qa_outputs`` applied per token."""
    return "self.qa_outputs(" in _forward_source(cls)


def _given(kwargs: dict, name: str) -> bool:
    return kwargs.get(name) is not None


class _GatherRows(torch.autograd.Function):
    """Every rank's rows along dim 1, in sequence order, on every rank; backward: the group's summed
    gradient at this rank's rows (each rank's loss of the gathered rows counts whole, as a token loss
    counts P times its share)."""

    @staticmethod
    def forward(ctx, x, index, comm):
        # x (B, n_r, ...) this rank's rows; index (n_r,) int64 their sequence positions
        lengths = [int(n) for n in comm.all_gather(torch.tensor([x.shape[1]], device=comm.device),
                                                   "the head's row counts")]
        longest = max(lengths)
        pad = list(x.shape)
        pad[1] = longest - x.shape[1]
        parts = comm.all_gather(torch.cat([x.detach(), x.new_zeros(pad)], dim=1).to(comm.device), "the head's rows")
        where = comm.all_gather(torch.cat([index, index.new_full((longest - index.numel(),), -1)]).to(comm.device),
                                "the head's row positions")
        rows = torch.cat([p.narrow(1, 0, n) for p, n in zip(parts, lengths)], dim=1).to(x.device)
        order = torch.argsort(torch.cat([w[:n] for w, n in zip(where, lengths)]).to(x.device))
        ctx.comm, ctx.order, ctx.n = comm, order, x.shape[1]
        ctx.offset = sum(lengths[:comm.rank])
        return rows.index_select(1, order)

    @staticmethod
    def backward(ctx, grad):
        total = ctx.comm.all_reduce(grad.detach().contiguous().to(ctx.comm.device).clone(),
                                    "the head's gradients").to(grad.device)
        rows = torch.empty_like(total)
        rows.index_copy_(1, ctx.order, total)
        return rows.narrow(1, ctx.offset, ctx.n), None, None


def gather_rows(x: torch.Tensor, index: torch.Tensor, comm) -> torch.Tensor:
    """Every rank's rows of ``x`` (B, n_r, ...) along dim 1, ordered by their sequence positions
    ``index`` (n_r,) int64, on every rank: (B, sum n_r, ...). Differentiable: the backward sums the
    group's gradients and returns this rank's rows, so a loss of the gathered rows that every rank
    computes alike counts P times, as a token loss of ``cp.shard_batch`` counts P times its share."""
    return _GatherRows.apply(x, index.to(x.device), comm)


class HeadCall:
    """One forward of a model with a head under context parallelism: what the guard's module hooks
    substitute (bound to this forward, dropped when it returns).

    ``base``: the base model, whose call gets ``local_ids`` back where the head's forward got
    ``global_ids``; ``targets``: ids of the head modules whose per-token outputs (B, ``rows``, ...)
    are gathered over the group in sequence order (``index``: the positions of this rank's rows);
    ``select``: applied to the gathered rows (a ``logits_to_keep`` tensor's own order), or None."""

    def __init__(self, comm, index, targets, rows, base=None, local_ids=None, global_ids=None, select=None):
        self.comm, self.index, self.targets, self.rows = comm, index, targets, rows
        self.base, self.local_ids, self.global_ids, self.select = base, local_ids, global_ids, select

    def base_args(self, args: tuple, kwargs: dict | None) -> tuple | None:
        """The base model's call: the whole sequence's ids back to this rank's (kwargs in place); the
        new positional arguments, or None when they are unchanged."""
        if self.global_ids is None:
            return None
        if kwargs is not None and kwargs.get("input_ids") is self.global_ids:
            kwargs["input_ids"] = self.local_ids
        if any(a is self.global_ids for a in args):
            return tuple(self.local_ids if a is self.global_ids else a for a in args)
        return None

    def gathered(self, output):
        """A target module's output gathered in sequence order (unchanged when it is not a (B, rows, ...)
        tensor)."""
        if not isinstance(output, torch.Tensor) or output.dim() < 3 or output.shape[1] != self.rows:
            return None
        out = _GatherRows.apply(output, self.index.to(output.device), self.comm)
        return out if self.select is None else out.index_select(1, self.select.to(out.device))


def _record(args, kwargs, cp):
    record = batch_of(*args, *(v for v in kwargs.values() if isinstance(v, torch.Tensor)))
    if record is None:
        record = cp.current_batch()
    return None if record is AMBIGUOUS else record


def _positions(cp, record, local_len: int) -> tuple[torch.Tensor, int]:
    """(n_r,) the sequence positions of this rank's tokens, and the sequence's length."""
    if record is not None and record.cp is cp:
        seq_len, layout = record.seq_len, record.layout
    else:
        layout = cp.current_layout()
        lengths = [int(n) for n in cp.comm.all_gather(torch.tensor([local_len], device=cp.comm.device),
                                                      "the ranks' local lengths")]
        seq_len = layout_mod.infer_seq_len(lengths, cp.world_size, layout)
    return layout_mod.global_index(seq_len, cp.world_size, layout, cp.rank), seq_len


def _children(model, skip) -> set:
    return {id(m) for name, m in model.named_children() if m is not skip}


def prepare_call(model, args: tuple, kwargs: dict | None, cp, *, compiled: bool = False):
    """Before a multi-rank forward of ``model`` (a transformers model with a head) called with ``args``
    and ``kwargs`` (the call's own dict): raise for what its head cannot compute exactly from the
    shards (module docstring), else return ``(head, args)``: the :class:`HeadCall` of this forward
    (None when the head needs nothing) and its new positional arguments (None: unchanged). Makes the
    keyword substitutions in ``kwargs`` itself."""
    kwargs = kwargs if kwargs is not None else {}
    if not kwargs and not args:
        return None, None
    name, heads, cls = type(model).__name__, _heads(), type(model)
    record = _record(args, kwargs, cp)
    trainer = record is not None and LOSS_SCALE in record.extras
    keep, kind = kwargs.get("logits_to_keep"), head_kind(model)
    keeps = keep is not None and not (isinstance(keep, int) and keep == 0)
    if kind is None and _given(kwargs, "labels") and name in heads["token"] and name not in heads["causal"] \
            and not _loss_takes_num_items(cls) and isinstance(kwargs["labels"], torch.Tensor):
        kind = "token"  # a mean over the tokens it is given: taken over the gathered scores and labels
    if (keeps or kind) and (compiled or trainer):
        what = f"logits_to_keep={keep!r}" if keeps else \
            f"its {dict(sequence='pooled', qa='span', token='token-mean')[kind]} head"
        raise (refuse("head_outputs_compiled", name=name, what=what) if compiled
               else refuse("head_outputs_in_trainer", name=name, what=what))
    if kind == "sequence" and not _pools_scores(cls):
        raise refuse("sequence_pooling", name=name)
    if kind == "qa" and not _spans_scores(cls) and (_given(kwargs, "start_positions") or _given(kwargs, "end_positions")):
        raise refuse("qa_span_positions", name=name)
    if kind == "qa" and record is not None and record.extras.get(HAS_PADDING) \
            and (_given(kwargs, "start_positions") or _given(kwargs, "end_positions")):
        raise refuse("qa_span_padding", name=name)
    if _given(kwargs, "labels") and name not in heads["causal"] and kind != "token" and \
            (name in heads["token"] or name in heads["masked"]) and not _loss_takes_num_items(cls):
        raise refuse("token_mean_loss", name=name)
    _check_num_items(kwargs, record)
    if (getattr(model, "z_loss_coefficient", 0) or 0) > 0 and _given(kwargs, "labels") and record is not None \
            and len(set(layout_mod.local_lengths(record.seq_len, cp.world_size, record.layout))) > 1:
        raise refuse("z_loss_uneven", name=name,
                     lengths=layout_mod.local_lengths(record.seq_len, cp.world_size, record.layout))
    if keeps:
        return _keep_call(model, args, kwargs, cp, record, keep), None
    if kind is None or (kind == "qa" and not _spans_scores(cls)):
        return None, None
    ids = kwargs.get("input_ids", args[0] if args and isinstance(args[0], torch.Tensor) else None)
    embeds = kwargs.get("inputs_embeds")
    local = ids if ids is not None else embeds
    if local is None or local.dim() < 2:
        return None, None
    base = getattr(model, "base_model", None)
    index, _ = _positions(cp, record, int(local.shape[1]))
    head = HeadCall(cp.comm, index, _children(model, base), int(local.shape[1]), base=base)
    layout = record.layout if record is not None else None
    if kind == "token":  # the loss's mean over the whole batch's labels, on every rank
        kwargs["labels"] = cp.gather(kwargs["labels"], dim=1, layout=layout)
    if kind == "sequence" and ids is not None:  # the pooling reads the whole row's padding
        head.local_ids = ids
        head.global_ids = cp.gather(ids, dim=1, layout=layout)
        if kwargs.get("input_ids") is ids:
            kwargs["input_ids"] = head.global_ids
        else:
            return head, (head.global_ids,) + tuple(args[1:])
    return head, None


def _keep_call(model, args, kwargs, cp, record, keep) -> HeadCall:
    """``logits_to_keep`` of the sequence: this rank keeps the positions it holds (a 1-D index tensor
    handed to the forward in place of ``keep``); the output embeddings' logits are gathered."""
    if _given(kwargs, "labels"):
        raise refuse("logits_to_keep_with_labels", model=type(model).__name__, keep=keep)
    ids = kwargs.get("input_ids", args[0] if args and isinstance(args[0], torch.Tensor) else None)
    local = ids if ids is not None else kwargs.get("inputs_embeds")
    if local is None:
        raise refuse("logits_to_keep_without_ids", keep=keep)
    index, total = _positions(cp, record, int(local.shape[1]))
    if isinstance(keep, int):
        wanted, select = torch.arange(max(total - keep, 0), total), None
    else:
        keep = torch.as_tensor(keep).to("cpu", torch.int64).reshape(-1)
        keep = torch.where(keep < 0, keep + total, keep)
        wanted = torch.unique(keep, sorted=True)
        select = torch.searchsorted(wanted, keep)
    mine = torch.isin(index, wanted)
    local_rows = torch.nonzero(mine).reshape(-1).to(local.device)
    kwargs["logits_to_keep"] = local_rows
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if output is None:
        raise refuse("logits_to_keep_no_output_embeddings", model=type(model).__name__, keep=keep)
    return HeadCall(cp.comm, index[mine], {id(output)}, int(local_rows.numel()), select=select)


def _check_num_items(kwargs: dict, record) -> None:
    given = kwargs.get("num_items_in_batch")
    if given is None or record is None or record.num_items is None or LOSS_SCALE in record.extras:
        return  # not a shard_batch batch with labels, or a trainer's own count (CPTrainerMixin)
    want = float(record.num_items) / record.cp.world_size
    value = float(torch.as_tensor(given).detach().sum())
    if abs(value - want) > 1e-6 * max(1.0, abs(want)):
        raise refuse("num_items_mismatch", value=value, want=want, items=float(record.num_items),
                     ranks=record.cp.world_size)
