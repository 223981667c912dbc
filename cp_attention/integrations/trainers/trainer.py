"""transformers ``Trainer`` under context parallelism: :class:`CPTrainer`.

An ordinary Trainer script changes two lines (the class and the attention implementation) and is
launched with ``torchrun``; every rank of a context-parallel group then trains on one shard of each
sequence::

    from cp_attention.integrations.trainers.trainer import CPTrainer
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="cp_flash")
    trainer = CPTrainer(model=model, args=args, train_dataset=ds,
                        data_collator=DataCollatorWithFlattening())     # or any padding collator
    trainer.train()                                  # torchrun --nproc_per_node=N train.py

What one training step does, on every rank:

1. The data loader hands each rank its own micro-batch, as in plain data-parallel training (so the
   global batch is still ``per_device_train_batch_size x world size`` and no hyperparameter
   changes). The ranks of a CP group all-gather their micro-batches and join them along the
   sequence: each row of the joined batch is the ranks' rows one after the other, each kept a
   document of its own (no token attends across, no label is predicted across).
2. :meth:`~cp_attention.ContextParallel.shard_batch` shards the joined batch; the model runs on
   this rank's shard with the documents of the whole batch, and backward runs inside the context.
3. Trainer's own loss scaling is kept: ``num_items_in_batch`` counts the label tokens of every
   rank's micro-batch once, each rank's loss is its tokens' sum divided by it times the number of
   processes, and DDP / FSDP2 average the gradients over all processes: the result is the gradient
   of the single-device loss of the global batch. The logged loss is that single-device loss.

The same steps for any Trainer subclass (TRL's ``SFTTrainer``: see :mod:`.trl`): mix in
:class:`CPTrainerMixin`, before or after the Trainer class in the bases.

Legend: ``B`` rows, ``L_r`` the sequence length of rank ``r``'s micro-batch.
"""

from __future__ import annotations

import torch
from transformers import Trainer

from ...engine.agreement import check_strategy
from ...engine.context import context_parallel
from ...strategies.choice import CostModel
from ...engine.batch import batch_of
from ...refusals import refuse
from ..hf.batch import DOCUMENT_KEYS
from ..hf.heads import LOSS_SCALE
from ..hf.heads import head_kind
from ..hf.check import check_model
from ..hf.models import unwrap_adapters

__all__ = ["CPTrainer", "CPTrainerMixin", "MixinBeforeTrainer", "ROW_TARGETS", "check_cp_options", "join_micro_batches",
           "join_row_batches", "to_cpu"]


def _segments(part: dict, B: int, L: int) -> torch.Tensor:
    """(B, L) int64 document ids of one micro-batch from its collator keys (``seq_idx``, or
    ``cu_seq_lens_q`` for one packed row); zeros where it has none."""
    if part.get("seq_idx") is not None:
        return torch.as_tensor(part["seq_idx"]).to("cpu", torch.int64).expand(B, L)
    cu = part.get("cu_seq_lens_q", part.get("cu_seq_lens_k"))
    if cu is not None:
        if B != 1:
            raise ValueError(f"CPTrainer: cu_seq_lens_* describe one packed row, but the micro-batch has {B} rows")
        cu = torch.as_tensor(cu).to("cpu", torch.int64)
        return (torch.searchsorted(cu[1:].contiguous(), torch.arange(L), right=True)).unsqueeze(0)
    return torch.zeros(B, L, dtype=torch.int64)


def join_micro_batches(parts: list[dict]) -> tuple[dict, torch.Tensor]:
    """Join the micro-batches of a CP group's ranks (in rank order) along the sequence dimension.

    Every part must hold the same keys and the same number of rows ``B``; (B, L_r, ...) tensors are
    concatenated along dim 1 and ``position_ids`` default to ``arange(L_r)`` per part. Returns the
    joined tensors (on the first part's device) and (B, sum L_r) bool document starts: every part
    boundary, and the boundaries given by a packing collator's ``seq_idx`` / ``cu_seq_lens_*``
    (which are not passed on). The first label of every part after the first is set to -100 (and
    the matching ``shift_labels`` entry), so no token predicts the next part's first token;
    Trainer's ``num_items_in_batch`` does not count those labels either.
    """
    keys = [sorted(k for k, v in p.items() if v is not None) for p in parts]
    if any(k != keys[0] for k in keys):
        raise ValueError(f"CPTrainer: the ranks of a context-parallel group got micro-batches with different keys "
                         f"{keys}; use one collator on every rank")
    ref = "input_ids" if "input_ids" in parts[0] else next(k for k, v in parts[0].items()
                                                           if isinstance(v, torch.Tensor) and v.dim() >= 2)
    rows = [int(p[ref].shape[0]) for p in parts]
    if len(set(rows)) != 1:
        raise refuse("trainer_uneven_rows", rows=rows)
    B = rows[0]
    device = parts[0][ref].device
    lengths = [int(p[ref].shape[1]) for p in parts]
    joined: dict = {}
    for name in keys[0]:
        if name in DOCUMENT_KEYS:
            continue
        values = [p[name] for p in parts]
        if not all(isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] == n for v, n in zip(values, lengths)):
            raise ValueError(f"CPTrainer: micro-batch key {name!r} is not a (B, L, ...) tensor; CPTrainer joins and "
                             f"shards (B, L, ...) tensors and the document keys of packing collators only")
        joined[name] = torch.cat([v.to(device).expand(B, *v.shape[1:]) for v in values], dim=1)
    if "position_ids" not in joined:
        joined["position_ids"] = torch.cat([torch.arange(n, device=device).expand(B, n) for n in lengths], dim=1)
    opens = []
    for p, n in zip(parts, lengths):
        seg = _segments(p, B, n)
        part_opens = torch.ones(B, n, dtype=torch.bool)
        part_opens[:, 1:] = seg[:, 1:] != seg[:, :-1]
        opens.append(part_opens)
    at = 0  # torch.cat made new tensors: the labels can be edited in place
    for n in lengths[:-1]:
        at += n
        if "labels" in joined:
            joined["labels"][:, at] = -100
        if "shift_labels" in joined:
            joined["shift_labels"][:, at - 1] = -100
    return joined, torch.cat(opens, dim=1)


def check_cp_options(cp_strategy: str, cp_ulysses_size: int | None, cp_cost_model) -> None:
    """Validate a CP trainer's strategy options before the Trainer is built (ValueError / TypeError)."""
    check_strategy(cp_strategy, cp_ulysses_size)
    if cp_strategy == "usp" and cp_ulysses_size is None:
        raise ValueError("cp_strategy='usp' needs cp_ulysses_size (the ranks of each head group)")
    if cp_cost_model is not None and not isinstance(cp_cost_model, CostModel):
        raise TypeError(f"cp_cost_model must be a cp_attention.CostModel, got {type(cp_cost_model).__name__}")


class MixinBeforeTrainer(type):
    """Metaclass of :class:`CPTrainerMixin`: in any subclass the mixin comes right before the first
    Trainer class of the method resolution order, whatever the order of the bases.

    ``class X(SFTTrainer, CPTrainerMixin)`` would otherwise resolve ``__init__`` and
    ``training_step`` to ``SFTTrainer``'s (which never call on to the mixin): the CP options would be
    rejected and the steps would run without context parallelism. With this metaclass its MRO is
    that of ``class X(CPTrainerMixin, SFTTrainer)``: ``X, CPTrainerMixin, SFTTrainer, ..., Trainer``.
    """

    def mro(cls):
        order = super().mro()
        at = next((i for i, c in enumerate(order) if c.__dict__.get("_cp_trainer_mixin")), 0)
        if at == 0:  # the mixin itself, or no mixin
            return order
        mixin = order[at]
        first = next((i for i, c in enumerate(order[1:at], 1)
                      if issubclass(c, Trainer) and not issubclass(c, mixin)), None)
        if first is not None:
            order.insert(first, order.pop(at))
        return order


class CPTrainerMixin(metaclass=MixinBeforeTrainer):
    """Context parallelism for any :class:`transformers.Trainer` subclass (TRL's ``SFTTrainer``, ...):
    ``class MyTrainer(CPTrainerMixin, SomeTrainer)``; the other base order works the same (the
    mixin is moved before the Trainer class in the MRO, see :class:`MixinBeforeTrainer`).

    Args (besides the Trainer's own):
        cp_group: the context-parallel group: None (every process: CP size = world size), a
            ProcessGroup, a 1-D DeviceMesh (``mesh["cp"]``) or a DeviceMesh with ``cp_mesh_dim``.
            Processes outside it (other data-parallel replicas) train on other data, as usual.
        cp_mesh_dim: the name of the CP dimension when ``cp_group`` is a multi-dimensional mesh.
        cp_layout: "zigzag" (default), "contiguous" or "balanced" (each batch gets a layout that
            balances the model's cost over the ranks, see :func:`cp_attention.balanced_layout`).
        cp_timeout: seconds a rank waits for its peers (see :func:`~cp_attention.context_parallel`).
        cp_strategy: "ring" (default), "ulysses" (all-to-all head parallelism; the model's query
            heads must be a multiple of the CP size), "usp" (with ``cp_ulysses_size``) or "auto"
            (per layer mask, the cheapest by ``cp_cost_model``, a :class:`~cp_attention.CostModel`),
            see :func:`~cp_attention.context_parallel` and :mod:`cp_attention.strategies.choice`.
        cp_ulysses_size: the head-group size of ``cp_strategy="usp"`` (divides the CP size and the
            model's query heads).
        cp_cost_model: a :class:`~cp_attention.CostModel` for ``cp_strategy="auto"`` (None: its defaults).

    The model must use ``attn_implementation="cp_flash"``. Gradient checkpointing
    (``gradient_checkpointing=True``, reentrant or not), gradient accumulation and DDP/FSDP2 as set
    up by Trainer work unchanged. Refused, because the loss would not be the single-device loss:
    label smoothing and ``compute_loss_func`` (they compute the loss outside the model from local
    labels); ``average_tokens_across_devices=False`` (Trainer would then normalise each process's
    loss by its own tokens, not the global batch's). A MoE router auxiliary loss is taken over the
    joined batch (:mod:`..hf.adapters.router_loss`), weighed as Trainer's or SFTTrainer's ``compute_loss`` weighs it
    (another ``compute_loss`` with the auxiliary loss on is refused). Evaluation and prediction run
    without context parallelism, on each process's own batch.
    """

    _cp_trainer_mixin = True

    def __init__(self, *args, cp_group=None, cp_mesh_dim: str | None = None, cp_layout: str = "zigzag",
                 cp_timeout: float | None = None, cp_strategy: str = "ring", cp_ulysses_size: int | None = None,
                 cp_cost_model=None, **kwargs):
        check_cp_options(cp_strategy, cp_ulysses_size, cp_cost_model)
        super().__init__(*args, **kwargs)
        name = type(self).__name__
        if self.label_smoother is not None or self.compute_loss_func is not None:
            raise refuse("trainer_local_loss", name=name)
        if not self.args.average_tokens_across_devices:
            raise refuse("trainer_local_token_average", name=name)
        config = getattr(self.accelerator.unwrap_model(self.model), "config", None)
        implementation = getattr(config, "_attn_implementation", None)
        if implementation != "cp_flash":
            raise refuse("trainer_not_cp_flash", name=name, implementation=implementation)
        inner = unwrap_adapters(self.accelerator.unwrap_model(self.model))
        if self.args.world_size > 1:  # the model check, at construction rather than at the first step
            check_model(inner)
        self._cp_head = head_kind(inner)  # "sequence" / "qa": the group's rows stay rows (join_row_batches)
        if (getattr(inner, "z_loss_coefficient", 0) or 0) > 0:
            raise refuse("trainer_z_loss", name=name, model=type(inner).__name__)
        self._cp_aux_loss_scale = _aux_loss_scale(self)
        if self._cp_aux_loss_scale is _UNKNOWN and _router_aux_loss(config) and self._cp_head is None:
            raise refuse("trainer_router_loss", name=name)
        self.cp_group, self.cp_mesh_dim, self.cp_layout, self.cp_timeout = cp_group, cp_mesh_dim, cp_layout, cp_timeout
        self.cp_strategy, self.cp_ulysses_size, self.cp_cost_model = cp_strategy, cp_ulysses_size, cp_cost_model

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Join the CP group's micro-batches, shard them, then the Trainer's own step on this shard."""
        with context_parallel(self.cp_group, self.cp_layout, self.cp_timeout, mesh_dim=self.cp_mesh_dim,
                              strategy=self.cp_strategy, ulysses_size=self.cp_ulysses_size,
                              cost_model=self.cp_cost_model) as cp:
            parts = [inputs] if cp.world_size == 1 else cp.comm.all_gather_object(to_cpu(inputs))
            if self._cp_head is not None:
                return self._cp_row_step(cp, model, inputs, parts, num_items_in_batch)
            joined, starts = join_micro_batches([inputs if r == cp.rank else p for r, p in enumerate(parts)])
            local = cp.shard_batch(**joined, document_starts=starts, model=self.accelerator.unwrap_model(model))
            if self._cp_aux_loss_scale is not None and self._cp_aux_loss_scale is not _UNKNOWN:
                batch_of(*local.values()).extras[LOSS_SCALE] = self._cp_aux_loss_scale
            if num_items_in_batch is not None:  # Trainer's count over every rank's micro-batch
                local.pop("num_items_in_batch", None)
            return super().training_step(model, local, num_items_in_batch)

    def _cp_row_step(self, cp, model, inputs, parts, num_items_in_batch):
        """A pooled or span head's step (``self._cp_head``): the group's micro-batches joined along the
        rows (:func:`join_row_batches`), every row sharded along the sequence, the per-row targets
        (``labels``, ``start_positions``, ``end_positions``) handed to the head whole."""
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        unwrapped = self.accelerator.unwrap_model(model)
        pad = getattr(getattr(unwrap_adapters(unwrapped), "config", None), "pad_token_id", None)
        joined = self._cp_join_rows([inputs if r == cp.rank else p for r, p in enumerate(parts)],
                                    pad_token_id=0 if pad is None else int(pad),
                                    left=getattr(tokenizer, "padding_side", "right") == "left")
        device = next(v.device for v in inputs.values() if isinstance(v, torch.Tensor))
        per_row = {k: joined.pop(k).to(device) for k in ROW_TARGETS if k in joined}
        local = cp.shard_batch(**{k: v.to(device) for k, v in joined.items()}, model=unwrapped)
        local.pop("num_items_in_batch", None)
        self._cp_row_scale = _row_loss_scale(self, num_items_in_batch, cp.world_size)
        try:
            return super().training_step(model, {**local, **per_row}, num_items_in_batch)
        finally:
            self._cp_row_scale = None

    def _cp_join_rows(self, parts: list[dict], *, pad_token_id: int, left: bool) -> dict:
        """The group's micro-batches of rows (rank order) as one process holding them would batch them."""
        return join_row_batches(parts, pad_token_id=pad_token_id, left=left)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The trainer's own loss; for a pooled or span head divided by the CP size where Trainer multiplied
        it by the processes (:func:`_row_loss_scale`)."""
        result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                      num_items_in_batch=num_items_in_batch)
        scale = getattr(self, "_cp_row_scale", None)
        if scale is None:
            return result
        if return_outputs:
            return result[0] / scale, result[1]
        return result / scale


ROW_TARGETS = ("labels", "start_positions", "end_positions", "margin")
"""The per-row targets of a pooled (sequence classification, a reward model's ``margin``) or span
(question answering) head: handed to the head's loss whole, never sharded."""


def _row_loss_scale(trainer, num_items_in_batch, cp_size: int) -> float:
    """What a pooled or span head's loss is divided by on a rank: the CP size where Trainer's
    ``compute_loss`` multiplies the model's loss by the number of processes (a model that takes loss
    keywords, a ``num_items_in_batch``, ``average_tokens_across_devices``), 1 otherwise. Every rank
    of the group computes the group's whole loss (the heads gather the pooled scores) and the gather's
    backward sums the group's gradients, so DDP's mean over the group's ranks is then the gradient of
    one process holding the group's rows."""
    multiplied = (trainer.args.average_tokens_across_devices and num_items_in_batch is not None
                  and (trainer.model_accepts_loss_kwargs or trainer.compute_loss_func is not None))
    return float(cp_size) if multiplied else 1.0


def join_row_batches(parts: list[dict], *, pad_token_id: int, left: bool = False,
                     left_keys: tuple = (), pad_values: dict | None = None, what: str = "micro-batches") -> dict:
    """The CP group's batches of rows (in rank order) as the one batch a single process holding all
    their rows builds: (B_r, ...) tensors concatenated along the rows, (B_r, T_r, ...) ones padded to
    the widest first (on the left where ``left`` or the key is in ``left_keys``, else on the right;
    ``*_ids`` with ``pad_token_id``, the keys of ``pad_values`` with theirs, the rest with 0), 0-d
    tensors (the same on every rank) and None kept."""
    keys = [sorted(p) for p in parts]
    if any(k != keys[0] for k in keys):
        raise ValueError(f"the ranks of a context-parallel group got {what} with different keys {keys}; use one "
                         f"collator on every rank")
    joined: dict = {}
    for key in keys[0]:
        values = [p[key] for p in parts]
        first = values[0]
        if first is None:
            joined[key] = None
        elif not isinstance(first, torch.Tensor):
            raise ValueError(f"cannot join the {what}' {key!r} ({type(first).__name__}): only tensors are joined "
                             f"along the rows")
        elif first.dim() == 0:
            if any(not torch.equal(v.cpu(), first.cpu()) for v in values):
                raise ValueError(f"the ranks' {what} disagree on {key!r}: {[float(v) for v in values]}")
            joined[key] = first
        else:
            device = first.device
            width = max(int(v.shape[1]) for v in values) if first.dim() >= 2 else None
            fill = pad_token_id if key.endswith("_ids") else (pad_values or {}).get(key, 0)
            on_left = left or key in left_keys
            padded = []
            for v in values:
                v = v.to(device)
                if width is not None and v.shape[1] < width:
                    shape = list(v.shape)
                    shape[1] = width - v.shape[1]
                    pad = v.new_full(shape, fill)
                    v = torch.cat([pad, v] if on_left else [v, pad], dim=1)
                padded.append(v)
            joined[key] = torch.cat(padded, dim=0)
    return joined


class CPTrainer(CPTrainerMixin, Trainer):
    """A :class:`transformers.Trainer` whose training steps run under context parallelism: the
    arguments and rules of :class:`CPTrainerMixin` (``cp_group``, ``cp_mesh_dim``, ``cp_layout``,
    ``cp_timeout``, ``cp_strategy``, ``cp_ulysses_size``, ``cp_cost_model``; a ``cp_flash`` model)."""


_UNKNOWN = object()


def _aux_loss_scale(trainer):
    """The factor ``s`` of a rank's share of the MoE router loss (:mod:`..hf.adapters.router_loss`) that makes ``trainer``'s
    loss the single-device one: 1 where the model's loss, auxiliary loss included, is multiplied by the
    process count (Trainer's ``compute_loss``); None (the batch's default, the CP size) where the trainer
    adds the auxiliary loss to the scaled token loss itself, unscaled (TRL's ``SFTTrainer``); ``_UNKNOWN``
    for any other ``compute_loss``."""
    owner = next(c for c in type(trainer).__mro__
                 if "compute_loss" in c.__dict__ and not c.__dict__.get("_cp_trainer_mixin"))  # past our own
    if owner is Trainer:
        return 1.0
    if owner.__name__ == "SFTTrainer" and owner.__module__.startswith("trl."):
        return None
    return _UNKNOWN


def _router_aux_loss(config) -> bool:
    """Whether the model's training loss includes a MoE router auxiliary loss: transformers' MoE
    models add it when their config has ``output_router_logits`` and a non-zero
    ``router_aux_loss_coef`` (TRL's trainers set both from their own ``router_aux_loss_coef``)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text, "output_router_logits", False)) and bool(getattr(text, "router_aux_loss_coef", 0.0))


def to_cpu(inputs: dict) -> dict:
    """``inputs`` with its tensors detached and on the CPU (for an object all-gather)."""
    return {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
