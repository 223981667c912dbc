"""A fused log-probability forward of a padded batch of rows under context parallelism, in the caller's layout.

TRL's trainers score sequences with a fused LM head: ``model(input_ids, attention_mask, labels,
fused_lm_head=True)`` on a padded (B, L) batch returns per-token fields of shape (B, L - 1): the
log-probability of each next token whose label is not -100, its entropy, and a few statistics, zero
elsewhere (TRL's ``add_fused_lm_head``). :func:`packed_fused_forward` computes the same fields with
the model's tokens sharded over the context-parallel group:

1. each row's attended tokens (one contiguous span: TRL's rows are ``[left padding | prompt |
   completion | right padding]``) become one document of a single packed row, numbered by their
   column (the positions the padded call gives them);
2. the packed row is sharded (:meth:`~cp_attention.ContextParallel.shard_batch`) and the fused head
   runs on this rank's shard with pre-shifted targets (the next token's label inside its document,
   -100 at a document's last token);
3. the shards' fields are gathered along the sequence (:func:`..hf.heads.gather_rows`) and put back at
   their (row, column) places.

Which rows: ``rows="shared"`` when every rank of the group holds the same batch (a CP trainer's
joined micro-batch): all of them are packed, and every rank gets them all back;
``rows="own"`` when each rank holds its own rows (before a join): the group's rows are exchanged,
packed in rank order, and each rank gets its own back.

Gradients: the gather's backward sums the group's gradients of the gathered fields and hands each
rank its shard's. With ``rows="shared"`` each rank computes the same loss of the fields, so the sum
is P times one rank's: each rank's parameter gradient is P times its shard's part, and the mean over
the group's ranks (DDP / FSDP2) is the single-device gradient of that loss. A MoE router auxiliary
loss is returned with the same convention: its value the group's (one device's), its gradient P
times this rank's share (:mod:`..hf.adapters.router_loss`).

Legend: ``B`` rows, ``L`` columns, ``N`` packed tokens (attended tokens of all rows), ``P`` ranks,
``n_r`` this rank's shard, ``k`` fields.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...engine.batch import batch_of
from ...layout import layouts as layout_mod
from ...refusals import refuse
from ..hf.heads import gather_rows
from ..hf.models import unwrap_adapters

__all__ = ["FIELDS", "PackedRows", "pack_rows", "packed_fused_forward", "shard_packed", "unpack_rows"]

FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
"""The per-token fields of TRL's fused output, in the order they are gathered."""
_DIFFERENTIABLE = ("log_probs", "entropy")
_CALL_KEYS = frozenset({"input_ids", "attention_mask", "labels", "position_ids", "use_cache", "output_router_logits",
                        "num_items_in_batch", "return_dict"})


@dataclass(frozen=True)
class PackedRows:
    """A padded (B, L) batch packed into one row of N tokens (one document per row with tokens).

    ``input_ids``, ``position_ids``, ``targets`` (the next token's label inside the document, -100
    at its last token) are (N,) int64, ``starts`` (N,) bool marks each document's first token;
    ``row`` and ``column`` (N,) int64 give each packed token's place in the padded batch."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    starts: torch.Tensor
    row: torch.Tensor
    column: torch.Tensor
    shape: tuple[int, int]


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, labels: torch.Tensor,
              position_ids: torch.Tensor | None = None, *, name: str = "the fused forward") -> PackedRows:
    """Pack a padded batch: ``input_ids``, ``attention_mask``, ``labels`` (B, L) (labels -100 where
    not scored), ``position_ids`` (B, L) or None (the column index, as the padded call numbers
    tokens). Refused (``packed_rows_not_contiguous``) when a row's attended tokens are not one
    contiguous span or a label outside it (or on its first token) is not -100: the packed
    documents would not compute what the padded call computes."""
    ids = input_ids.detach().cpu()
    B, L = ids.shape
    keep = torch.ones(B, L, dtype=torch.bool) if attention_mask is None else attention_mask.detach().cpu().bool()
    lab = labels.detach().cpu().to(torch.int64)
    counts = keep.sum(dim=1)
    first = torch.where(counts > 0, keep.to(torch.int8).argmax(dim=1), 0)
    col = torch.arange(L)
    span = (col >= first[:, None]) & (col < (first + counts)[:, None])
    holes = torch.nonzero((span != keep).any(dim=1)).flatten().tolist()
    stray = torch.nonzero(((lab != -100) & ~keep).any(dim=1)).flatten().tolist()
    opening = torch.nonzero((counts > 0) & (lab.gather(1, first[:, None])[:, 0] != -100)).flatten().tolist()
    if holes or stray or opening:
        raise refuse("packed_rows_not_contiguous", name=name, holes=holes, stray=stray, opening=opening)
    pos = col.expand(B, L) if position_ids is None else position_ids.detach().cpu().to(torch.int64).expand(B, L)
    packed_ids, packed_pos, packed_lab = ids[keep], pos[keep], lab[keep]
    row = torch.arange(B).repeat_interleave(counts)
    column = col.expand(B, L)[keep]
    N = int(counts.sum())
    offsets = torch.cumsum(counts, 0) - counts
    starts = torch.zeros(N, dtype=torch.bool)
    starts[offsets[counts > 0]] = True
    targets = torch.full((N,), -100, dtype=torch.int64)
    targets[:-1] = packed_lab[1:]
    targets[(offsets + counts - 1)[counts > 0]] = -100  # the next token opens another document
    return PackedRows(packed_ids, packed_pos, targets, starts, row, column, (B, L))


def unpack_rows(values: torch.Tensor, packed: PackedRows, rows: slice | None = None,
                width: int | None = None) -> torch.Tensor:
    """(N, k) per packed token -> (B', L' - 1, k) at each token's (row, column): the fused head's
    layout, zero where no token is (padding, the last column). ``rows``: the packed rows' slice to
    return (all by default); ``width``: their padded width L' (the batch's L by default);
    differentiable in ``values``."""
    B, L = packed.shape
    L = L if width is None else width
    lo, hi = (0, B) if rows is None else (rows.start, rows.stop)
    sel = (packed.row >= lo) & (packed.row < hi) & (packed.column < L - 1)
    out = values.new_zeros(hi - lo, L - 1, values.shape[-1])
    where = torch.nonzero(sel).flatten().to(values.device)
    return out.index_put((packed.row[sel].to(values.device) - lo, packed.column[sel].to(values.device)),
                         values.index_select(0, where))


def _own_rows(cp, input_ids, attention_mask, labels, position_ids) -> tuple[list, int]:
    """Every rank's (ids, mask, labels, positions) in rank order, and this rank's first row."""
    mine = tuple(None if t is None else t.detach().cpu() for t in (input_ids, attention_mask, labels, position_ids))
    parts = cp.comm.all_gather_object(mine, "the ranks' rows to score")
    widths = {int(p[0].shape[1]) for p in parts}
    width = max(widths)

    def padded(t, value):
        if t is None:
            return None
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value) if t.shape[1] < width else t

    joined = []
    for i in range(4):
        given = [p[i] for p in parts]
        if i == 1 and all(t is None for t in given):
            given = [torch.ones_like(p[0]) for p in parts]
        if i == 3 and all(t is None for t in given):
            given = [torch.arange(p[0].shape[1]).expand_as(p[0]) for p in parts]
        if any(t is None for t in given):
            raise ValueError("packed_fused_forward: some ranks passed attention_mask or position_ids, others not")
        joined.append(torch.cat([padded(t, (0, 0, -100, 0)[i]) for t in given], dim=0))
    return joined, sum(int(p[0].shape[0]) for p in parts[:cp.rank])


def shard_packed(cp, packed: PackedRows, device, model) -> tuple[dict, object]:
    """This rank's shard of ``packed`` (one row, sharded by :meth:`~cp_attention.ContextParallel.shard_batch`
    with ``model``): ``input_ids``, ``position_ids`` and ``cp_targets`` (1, n_r) on ``device``, and the
    batch's record. Fewer tokens than ranks get a filler document of pad tokens, scored nowhere, so
    every rank holds a token."""
    N = packed.input_ids.numel()
    tokens = {"input_ids": packed.input_ids, "position_ids": packed.position_ids, "cp_targets": packed.targets}
    starts = packed.starts
    if N < cp.world_size:
        extra = cp.world_size - N
        tokens = {k: torch.cat([v, torch.zeros(extra, dtype=torch.int64) if k != "cp_targets"
                                else torch.full((extra,), -100, dtype=torch.int64)]) for k, v in tokens.items()}
        tokens["position_ids"][N:] = torch.arange(extra)
        starts = torch.cat([starts, torch.arange(extra) == 0])
    local = cp.shard_batch(**{k: v[None].to(device) for k, v in tokens.items()}, document_starts=starts[None],
                           model=unwrap_adapters(model))
    return local, batch_of(*local.values())


def packed_fused_forward(forward, model, cp, kwargs: dict, *, rows: str = "shared", name: str = "the fused forward"):
    """``forward(**kwargs, fused_lm_head=True)`` (TRL's fused LM head of ``model``, the transformers
    model it patched) computed under the context ``cp``; returns TRL's ``FusedCausalLMOutput`` in the
    padded call's layout, (B, L - 1) per field (module docstring). ``rows``: "shared" (every rank
    holds these rows) or "own" (each rank its own rows)."""
    from trl.trainer.utils import FusedCausalLMOutput

    unknown = sorted(k for k, v in kwargs.items() if k not in _CALL_KEYS and v is not None)
    if unknown:
        raise refuse("packed_rows_inputs", name=name, keys=", ".join(unknown))
    input_ids, labels = kwargs.get("input_ids"), kwargs.get("labels")
    if input_ids is None or labels is None:
        raise ValueError(f"{name}: the fused forward under context parallelism needs input_ids and labels")
    mask, positions = kwargs.get("attention_mask"), kwargs.get("position_ids")
    aux_wanted = bool(kwargs.get("output_router_logits"))
    device = input_ids.device
    if rows == "own" and cp.world_size > 1:
        if aux_wanted:
            raise refuse("packed_rows_router_loss_own", name=name)
        (ids, mask_all, lab, pos), first_row = _own_rows(cp, input_ids, mask, labels, positions)
        mine = slice(first_row, first_row + input_ids.shape[0])
    elif rows in ("own", "shared"):
        ids, mask_all, lab, pos, mine = input_ids, mask, labels, positions, None
        if cp.world_size > 1:
            _check_shared(cp, ids, mask_all, name)
    else:
        raise ValueError(f"rows must be 'shared' or 'own', got {rows!r}")
    packed = pack_rows(ids, mask_all, lab, pos, name=name)
    N = packed.input_ids.numel()
    local, record = shard_packed(cp, packed, device, model)
    targets = local.pop("cp_targets")
    extra_kwargs = {k: v for k, v in kwargs.items()
                    if k in ("use_cache", "output_router_logits", "return_dict") and v is not None}
    out = forward(**local, **extra_kwargs, shift_labels=targets, fused_lm_head=True)
    present = [f for f in FIELDS if getattr(out, f, None) is not None]
    fields = torch.stack([getattr(out, f).to(torch.float32) for f in present], dim=-1)  # (1, n_r, k)
    index = layout_mod.global_index(record.seq_len, cp.world_size, record.layout, cp.rank)
    gathered = gather_rows(fields, index, cp.comm)[0, :N]  # (N, k) in packed order
    values = unpack_rows(gathered, packed, mine, input_ids.shape[1])
    result = {f: values[..., i].contiguous() for i, f in enumerate(present)}  # reduced like TRL's own fields
    if "is_top1" in result:
        result["is_top1"] = result["is_top1"] > 0.5
    label_mask = labels[:, 1:] != -100
    count = label_mask.sum().clamp(min=1)
    num_items = kwargs.get("num_items_in_batch")
    log_probs = result.get("log_probs")
    loss = None if log_probs is None else -log_probs.sum() / (count if num_items is None else num_items)
    aux = None
    if aux_wanted and getattr(out, "aux_loss", None) is not None:
        aux = _group_value(cp, out.aux_loss)
        coef = getattr(_text_config(model), "router_aux_loss_coef", 0.0) or 0.0
        loss = None if loss is None else loss + coef * aux
    return FusedCausalLMOutput(loss=loss, aux_loss=aux, label_mask=label_mask.to(device), **result)


def _group_value(cp, share: torch.Tensor) -> torch.Tensor:
    """A rank's share of the router loss (P times its part, :mod:`..hf.adapters.router_loss`) with the group's value
    (one device's) and the share's gradient."""
    total = cp.comm.all_reduce(share.detach().reshape(1).to(cp.comm.device, torch.float32).clone(),
                               "the router loss's value").to(share.device)[0]
    return share + (total / cp.world_size - share.detach()).to(share.dtype)


def _text_config(model):
    config = getattr(unwrap_adapters(model), "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _check_shared(cp, ids: torch.Tensor, mask: torch.Tensor | None, name: str) -> None:
    """Every rank holds the same rows (one all-gather of four numbers): a rank that scored other rows
    would silently mix batches."""
    kept = ids if mask is None else ids * mask.to(ids.dtype)
    weights = torch.arange(1, ids.shape[1] + 1, dtype=torch.float64)
    digest = torch.tensor([float(ids.shape[0]), float(ids.shape[1]), float(kept.double().sum()),
                           float((kept.detach().cpu().double() * weights).sum())], dtype=torch.float64)
    seen = cp.comm.all_gather(digest.to(cp.comm.device), "the rows' digests")
    if any(not torch.equal(s.cpu(), seen[0].cpu()) for s in seen):
        raise ValueError(f"{name}: the ranks of the context-parallel group hold different rows where they must "
                         f"hold the same batch (the CP trainer joins them first); this is a bug, please report it")
