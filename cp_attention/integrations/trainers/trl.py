"""TRL's trainers under context parallelism: :class:`CPSFTTrainer`, and for post-training
:class:`CPGRPOTrainer`, :class:`CPRLOOTrainer` and :class:`CPDPOTrainer`.

Importing this module imports ``trl`` (``import cp_attention`` never does: trl stays optional). A
script changes two lines (the class and the attention implementation) and is launched with
``torchrun``::

    from cp_attention.integrations.trainers.trl import CPSFTTrainer
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="cp_flash")
    args = SFTConfig(..., padding_free=True)         # or packing=True (BFD packing is padding-free)
    trainer = CPSFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tokenizer)
    trainer.train()                                  # torchrun --nproc_per_node=N sft.py

**SFT.** A training step is :class:`~cp_attention.integrations.trainers.trainer.CPTrainerMixin`'s: the CP
group's micro-batches are joined along the sequence, sharded, and ``SFTTrainer``'s own step (its fused
LM head scores the pre-shifted ``shift_labels`` of the shard, its loss is normalised by Trainer's
``num_items_in_batch`` of the global batch) runs on this rank's shard. ``class X(CPTrainerMixin,
SFTTrainer)`` and ``class X(SFTTrainer, CPTrainerMixin)`` are the same trainer as this one. What the
configuration needs: nothing beyond CPTrainerMixin's rules (a ``cp_flash`` model,
``average_tokens_across_devices=True``, no label smoothing, no ``compute_loss_func``; a MoE router
auxiliary loss, ``router_aux_loss_coef``, is taken over the joined batch; PEFT: a ``peft_config`` of a
weight adapter, LoRA, DoRA, ...; prompt learning is refused). ``padding_free=True`` (or BFD packing,
which implies it) is the configuration to use: each micro-batch is one row of documents told apart by
``position_ids``, and nothing but tokens is sharded. A padded batch works too, but its padding is
joined into the middle of the rows and computed on, and the ranks need the same number of rows
(``dataloader_drop_last=True``). SFTConfig turns on ``bf16`` autocast by default; under autocast a
float32 model reaches cp_flash with float32 queries and keys (after RoPE) and bfloat16 values, which
cp_flash refuses: load the model in bfloat16 or set ``bf16=False``.

**GRPO, RLOO, DPO** (:class:`CPRLTrainerMixin`). The CP group trains as one process holding all its
ranks' rows would:

1. generation and rewards stay where they are: each process generates and scores its own prompts
   outside the CP block (``model.generate`` or vLLM), and TRL's rewards and advantages are computed
   over all processes as usual;
2. the group's generation batches (GRPO, RLOO: :func:`join_rows`) or preference micro-batches (DPO:
   :func:`join_pairs`) are joined into the batch one process holding their rows builds; every rank
   of the group then holds it, shuffles it with the group's first rank's permutation and runs TRL's
   own loss and metrics on it;
3. every fused LM head forward (the policy's, the reference model's, the old policy's) is routed
   through :func:`~.packed_rows.packed_fused_forward`: the rows' tokens packed as documents of one
   row, sharded, scored on this rank's shard and gathered back in TRL's padded layout (the forwards
   at generation score each rank's own rows, before the join);
4. gradients: every rank's loss is the group's and the gather's backward sums the group's gradients,
   so each rank's gradient is P times its shard's part and DDP / FSDP2's mean over the processes is
   the group's gradient (on a dp x cp mesh each group is one data-parallel process).

GRPO's token-count normaliser (dapo, cispo, vespo divide by TRL's count over the processes) is
scaled by P, the ``top_entropy_quantile`` threshold counts each group's tokens once, and DPO's
``num_tokens`` metric divides the group's copies out. Refused: vision-language models, accelerate's
own context parallelism (``parallelism_config``), ``use_transformers_continuous_batching``.

Legend: ``P`` ranks of the CP group, ``B`` rows.
"""

from __future__ import annotations

import contextlib
import weakref

import torch.distributed as dist
from types import MappingProxyType

import torch
from trl import DistillationTrainer, DPOTrainer, GRPOTrainer, KTOTrainer, RewardTrainer, RLOOTrainer, SFTTrainer

from ...engine.context import active_context, as_group, context_parallel, outside_context
from ...refusals import refuse
from ..hf.heads import head_kind
from ..hf.check import check_model
from ..hf.models import unwrap_adapters
from .packed_rows import pack_rows, packed_fused_forward, shard_packed
from ..patches import patch
from .trainer import CPTrainerMixin, MixinBeforeTrainer, check_cp_options, join_row_batches, to_cpu

__all__ = ["CPDPOTrainer", "CPDistillationTrainer", "CPGRPOTrainer", "CPKTOTrainer", "CPRLOOTrainer",
           "CPRLTrainerMixin", "CPRewardTrainer", "CPSFTTrainer", "join_pairs", "join_rows"]


class CPSFTTrainer(CPTrainerMixin, SFTTrainer):
    """TRL's :class:`trl.SFTTrainer` whose training steps run under context parallelism.

    Takes SFTTrainer's arguments and ``cp_group``, ``cp_mesh_dim``, ``cp_layout``, ``cp_timeout``,
    ``cp_strategy``, ``cp_ulysses_size``, ``cp_cost_model`` (see
    :class:`~cp_attention.integrations.trainers.trainer.CPTrainerMixin`). The model must use
    ``attn_implementation="cp_flash"``; ``padding_free=True`` is recommended (module docstring).
    """


class CPRewardTrainer(CPTrainerMixin, RewardTrainer):
    """TRL's :class:`trl.RewardTrainer` whose training steps run under context parallelism.

    Takes RewardTrainer's arguments and ``cp_group``, ``cp_mesh_dim``, ``cp_layout``, ``cp_timeout``,
    ``cp_strategy``, ``cp_ulysses_size``, ``cp_cost_model`` (see
    :class:`~cp_attention.integrations.trainers.trainer.CPTrainerMixin`); the model (a sequence
    classifier with one label) must use ``attn_implementation="cp_flash"``.

    A step joins the CP group's preference micro-batches into the batch one process holding all their
    pairs builds (:func:`join_pairs`: every rank's chosen rows, then every rank's rejected rows, and
    their ``margin``), shards every row along the sequence and runs RewardTrainer's own step on the
    shard: the reward head pools each row's last non-padding token from the gathered per-token scores
    (:mod:`~cp_attention.integrations.hf.heads`), so the rewards, the loss (``margin``,
    ``center_rewards_coefficient``) and every metric are the group's on every rank; the gather's
    backward sums the group's gradients, so DDP / FSDP2's mean over the processes is the gradient of
    one process holding the group's pairs (on a dp x cp mesh each group is one data-parallel process).
    Evaluation runs without context parallelism, each process on its own batch, as for ``CPTrainer``.
    """

    def _cp_join_rows(self, parts: list[dict], *, pad_token_id: int, left: bool) -> dict:
        return join_pairs(parts, pad_token_id)


_LEFT_PADDED = ("prompt_ids", "prompt_mask")
_PAD_VALUES = MappingProxyType({"tool_mask": 1, "importance_sampling_ratio": 1.0})  # TRL's; else 0 / the pad id


def join_rows(parts: list[dict], pad_token_id: int) -> dict:
    """The CP group's generation batches (TRL's ``_generate_and_score_completions`` outputs, in rank
    order) as the one batch a single process holding all their rows builds
    (:func:`~.trainer.join_row_batches`: prompts padded on the left, everything else on the right, as
    TRL pads them; ids with ``pad_token_id``, masks with 0, ``num_items_in_batch`` kept)."""
    return join_row_batches(parts, pad_token_id=pad_token_id, left_keys=_LEFT_PADDED, pad_values=_PAD_VALUES,
                            what="generation batches")


def join_pairs(parts: list[dict], pad_token_id: int) -> dict:
    """The CP group's preference micro-batches (TRL's ``DataCollatorForPreference``: 2B rows, the B
    chosen sequences then the B rejected ones, right-padded; optional (B,) precomputed reference
    log-probabilities), in rank order, as one micro-batch of all their pairs in the collator's
    layout: every rank's chosen rows, then every rank's rejected rows."""
    keys = [sorted(k for k, v in p.items() if v is not None) for p in parts]
    if any(k != keys[0] for k in keys):
        raise ValueError(f"the ranks of a context-parallel group got preference batches with different keys {keys}")
    joined: dict = {}
    for key in keys[0]:
        values = [p[key] for p in parts]
        if not all(isinstance(v, torch.Tensor) and v.dim() in (1, 2) for v in values):
            raise ValueError(f"cannot join the preference batches' {key!r}: only (2B, L) and (B,) tensors are joined")
        if values[0].dim() == 1:
            joined[key] = torch.cat(values)
            continue
        width = max(int(v.shape[1]) for v in values)
        fill = pad_token_id if key.endswith("_ids") else 0
        padded = [torch.cat([v, v.new_full((v.shape[0], width - v.shape[1]), fill)], dim=1) for v in values]
        halves = [v.chunk(2, dim=0) for v in padded]
        joined[key] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return joined


def _routed(original, owner, trainer_ref):
    """The fused-head forward of ``owner`` (TRL's instance ``forward``) that, inside a context, runs
    :func:`.packed_fused_forward` (rows as the trainer says) and otherwise the original."""

    def forward(*args, fused_lm_head=False, **kwargs):
        cp, trainer = active_context(), trainer_ref()
        if not fused_lm_head or cp is None or trainer is None:
            return original(*args, fused_lm_head=fused_lm_head, **kwargs)
        if len(args) > 1 or (args and "input_ids" in kwargs):
            raise TypeError("the fused forward under context parallelism takes input_ids and keywords only")
        if args:
            kwargs["input_ids"] = args[0]
        return packed_fused_forward(original, owner, cp, kwargs, rows=trainer._cp_rows, name=type(trainer).__name__)

    forward._cp_attention_routed = True
    return forward


def _fused_owners(model) -> list:
    """The modules whose instance ``forward`` TRL's ``add_fused_lm_head`` replaced (the model, or a
    PEFT model's base model)."""
    found, seen = [], set()
    for candidate in (model, unwrap_adapters(model)):
        if id(candidate) in seen:
            continue
        seen.add(id(candidate))
        fn = candidate.__dict__.get("forward")
        code = getattr(getattr(fn, "__func__", None), "__code__", None)  # TRL wraps it: its code keeps the name
        if fn is not None and (getattr(fn, "_cp_attention_routed", False)
                               or getattr(code, "co_name", "") == "_fused_forward"):
            found.append(candidate)
    return found


class CPRLTrainerMixin(metaclass=MixinBeforeTrainer):
    """Context parallelism for TRL's post-training trainers (GRPO, RLOO, DPO): the CP group's rows
    are scored and trained as one process holding all of them would (module docstring).

    Args (besides the trainer's own): ``cp_group``, ``cp_mesh_dim``, ``cp_layout``, ``cp_timeout``,
    ``cp_strategy``, ``cp_ulysses_size``, ``cp_cost_model``, as for
    :class:`~cp_attention.integrations.trainers.trainer.CPTrainerMixin`. Either base order works.
    """

    _cp_trainer_mixin = True
    _cp_rows = "shared"  # the rows a fused forward scores: "shared" (the joined batch) or "own"
    _cp_fused_head = True  # the trainer scores tokens with TRL's fused LM head (routed to the packed rows)

    def __init__(self, *args, cp_group=None, cp_mesh_dim: str | None = None, cp_layout: str = "zigzag",
                 cp_timeout: float | None = None, cp_strategy: str = "ring", cp_ulysses_size: int | None = None,
                 cp_cost_model=None, **kwargs):
        check_cp_options(cp_strategy, cp_ulysses_size, cp_cost_model)
        # stored first: DPOTrainer's __init__ already scores (precompute_ref_log_probs)
        self.cp_group, self.cp_mesh_dim, self.cp_layout, self.cp_timeout = cp_group, cp_mesh_dim, cp_layout, cp_timeout
        self.cp_strategy, self.cp_ulysses_size, self.cp_cost_model = cp_strategy, cp_ulysses_size, cp_cost_model
        self._cp_checked, self._cp_rng_restore, self._cp_tp_size = False, None, None
        super().__init__(*args, **kwargs)
        self._cp_ready()

    # ------------------------------------------------------------------ checks and routing
    def _cp_ready(self) -> None:
        """The refusals, then the fused forwards of the policy and reference model routed (once)."""
        if self._cp_checked:
            return
        name = type(self).__name__
        config = getattr(self.args, "parallelism_config", None) or getattr(self.accelerator, "parallelism_config", None)
        if config is not None and (getattr(config, "cp_enabled", False) or getattr(config, "sp_enabled", False)):
            raise refuse("rl_parallelism_config", name=name)
        if getattr(self, "_is_vlm", False):
            raise refuse("rl_multimodal", name=name)
        if getattr(self.args, "use_transformers_continuous_batching", False):
            raise refuse("rl_continuous_batching", name=name)
        models = [("policy", self.model)]
        if getattr(self, "ref_model", None) is not None:
            models.append(("reference model", self.ref_model))
        if getattr(self, "teacher_model", None) is not None:
            models.append(("teacher", self.teacher_model))
        for role, model in models:
            inner = unwrap_adapters(self.accelerator.unwrap_model(model))
            config = getattr(inner, "config", None)
            implementation = getattr(config, "_attn_implementation", None)
            if implementation != "cp_flash":
                raise refuse("trainer_not_cp_flash", name=f"{name} ({role})", implementation=implementation)
            if self.args.world_size > 1:
                check_model(inner)
            if head_kind(inner) is not None:
                raise refuse("trainer_row_head", name=name, model=type(inner).__name__)
            if not self._cp_fused_head:
                continue
            owners = _fused_owners(self.accelerator.unwrap_model(model))
            if not owners:
                raise refuse("rl_no_fused_head", name=name, role=role, model=type(inner).__name__)
            for owner in owners:
                fn = owner.__dict__["forward"]
                if not getattr(fn, "_cp_attention_routed", False):
                    patch(owner, "forward", _routed(fn, owner, weakref.ref(self)), site="trl_fused_head",
                          admitted="the CP trainer's refusals (cp_flash, the model check, a fused head)")
        self._cp_checked = True

    @contextlib.contextmanager
    def _cp_block(self):
        """The active context, or a new one with the trainer's options."""
        active = active_context()
        if active is not None:
            yield active
            return
        with context_parallel(self.cp_group, self.cp_layout, self.cp_timeout, mesh_dim=self.cp_mesh_dim,
                              strategy=self.cp_strategy, ulysses_size=self.cp_ulysses_size,
                              cost_model=self.cp_cost_model) as cp:
            yield cp

    @contextlib.contextmanager
    def _cp_rows_as(self, rows: str):
        before, self._cp_rows = self._cp_rows, rows
        try:
            yield
        finally:
            self._cp_rows = before

    def _cp_generates(self) -> bool:
        return hasattr(super(), "_generate_and_score_completions")

    def _cp_join_step(self, cp, inputs):
        """A preference trainer's micro-batch joined over the group (the generating trainers join at
        generation, :meth:`_generate_and_score_completions`)."""
        if self._cp_generates() or cp.world_size == 1:
            return inputs
        if hasattr(self, "_tp_size"):  # DPO counts every joined token once per rank: divide by the copies
            self._cp_tp_size = self._cp_tp_size or self._tp_size
            self._tp_size = self._cp_tp_size * cp.world_size
        parts = cp.comm.all_gather_object(to_cpu(inputs), "the ranks' preference batches")
        device = next(v.device for v in inputs.values() if isinstance(v, torch.Tensor))
        joined = self._cp_join([inputs if r == cp.rank else p for r, p in enumerate(parts)])
        return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in joined.items()}

    def _cp_join(self, parts: list[dict]) -> dict:
        """The group's preference micro-batches (rank order) as one process holding them batches them."""
        return join_pairs(parts, self._cp_pad_id())

    def _cp_size(self) -> int:
        """The CP group's size (1 outside a job of several processes), known before the first step."""
        if not dist.is_available() or not dist.is_initialized():
            return 1
        return dist.get_world_size(as_group(self.cp_group, self.cp_mesh_dim))

    def _cp_pad_id(self) -> int:
        tokenizer = getattr(self, "_tokenizer", None) or getattr(self, "processing_class", None)
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
        pad = getattr(tokenizer, "pad_token_id", None)
        return 0 if pad is None else int(pad)

    # ------------------------------------------------------------------ steps
    def training_step(self, model, inputs, num_items_in_batch=None):
        """The trainer's own step inside the CP block (generation and rewards outside it)."""
        self._cp_ready()
        with self._cp_block() as cp:
            return super().training_step(model, self._cp_join_step(cp, inputs), num_items_in_batch)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Evaluation as training: the group's rows joined and scored under context parallelism."""
        self._cp_ready()
        with self._cp_block() as cp:
            return super().prediction_step(model, self._cp_join_step(cp, inputs), prediction_loss_only,
                                           ignore_keys=ignore_keys)

    def compute_ref_log_probs(self, model, inputs):
        """DPO's reference log-probabilities of each rank's own pairs (precompute), under context parallelism."""
        self._cp_ready()
        with self._cp_block(), self._cp_rows_as("own"):
            return super().compute_ref_log_probs(model, inputs)

    # ------------------------------------------------------------------ generation (GRPO, RLOO)
    def _generate(self, prompts):
        with outside_context():
            return super()._generate(prompts)

    def _calculate_rewards(self, *args, **kwargs):
        with outside_context():
            return super()._calculate_rewards(*args, **kwargs)

    def _generate_and_score_completions(self, inputs):
        """Each rank's generation batch generated, scored and weighed as TRL does it (the old and
        reference log-probabilities of its own rows under context parallelism), then the group's
        batches joined into the one batch a single process holding them builds."""
        with self._cp_block() as cp:
            with self._cp_rows_as("own"):
                out = super()._generate_and_score_completions(inputs)
            if cp.world_size == 1:
                return out
            device = next(v.device for v in out.values() if isinstance(v, torch.Tensor))
            parts = cp.comm.all_gather_object(to_cpu(out), "the ranks' generation batches")
            joined = join_rows([out if r == cp.rank else p for r, p in enumerate(parts)], self._cp_pad_id())
            joined = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in joined.items()}
            if "num_items_in_batch" in joined:
                # TRL divides the generation batch's token count by the process count for the loss of one
                # process; the group is one process of P ranks
                joined["num_items_in_batch"] = joined["num_items_in_batch"] * cp.world_size
            if self.model.training:  # TRL shuffles the batch next: the same permutation on every rank
                states = cp.comm.all_gather_object(torch.get_rng_state(), "the ranks' random states")
                if cp.rank != 0:
                    self._cp_rng_restore = torch.get_rng_state()
                    torch.set_rng_state(states[0])
            return joined

    def _prepare_inputs(self, generation_batch):
        try:
            return super()._prepare_inputs(generation_batch)
        finally:
            if self._cp_rng_restore is not None:
                torch.set_rng_state(self._cp_rng_restore)
                self._cp_rng_restore = None

    def get_high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
        """GRPO's ``top_entropy_quantile`` mask: the tokens whose entropy reaches the ``threshold``
        quantile of every scored token of the processes' micro-batches; each CP group's joined
        micro-batch counts once (from its first rank), as one process's."""
        cp = active_context()
        values = entropies[mask.bool()].float()
        if cp is not None and cp.rank != 0:
            values = values[:0]
        sentinel = -1e9  # entropies are >= 0
        gathered = self.accelerator.gather(self.accelerator.pad_across_processes(values, dim=0, pad_index=sentinel))
        gathered = gathered[gathered != sentinel]
        if gathered.numel() == 0:
            return torch.zeros_like(entropies, dtype=torch.bool)
        cut = torch.quantile(gathered, threshold)
        return ((entropies * mask.float()) >= cut) & mask.bool()


class CPGRPOTrainer(CPRLTrainerMixin, GRPOTrainer):
    """TRL's :class:`trl.GRPOTrainer` with its scoring and training forwards under context parallelism
    (:class:`CPRLTrainerMixin`; module docstring)."""


class CPRLOOTrainer(CPRLTrainerMixin, RLOOTrainer):
    """TRL's :class:`trl.RLOOTrainer` with its scoring and training forwards under context parallelism
    (:class:`CPRLTrainerMixin`; module docstring)."""


class CPKTOTrainer(CPRLTrainerMixin, KTOTrainer):
    """TRL's :class:`trl.KTOTrainer` with its policy, reference and KL forwards under context parallelism
    (:class:`CPRLTrainerMixin`; module docstring).

    A step joins the CP group's unpaired micro-batches along the rows (:func:`~.trainer.join_row_batches`,
    the desirable and undesirable labels, the KL rows and precomputed reference log-probabilities with
    them) into the batch one process holding them builds; KTO's KL term, estimated from each batch's
    mismatched (prompt, completion) pairs, therefore pairs within the group's batch: the dataset's KL
    completions are rotated within batches of ``per_device_train_batch_size x`` the CP size, as one
    process holding the group's rows rotates them."""

    def _cp_join(self, parts: list[dict]) -> dict:
        return join_row_batches(parts, pad_token_id=self._cp_pad_id(), what="unpaired preference batches")

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        size = self._cp_size()
        if size == 1:
            return super()._prepare_dataset(dataset, processing_class, args, dataset_name)
        per_device = args.per_device_train_batch_size
        args.per_device_train_batch_size = per_device * size  # the KL rotation's batch: the group's
        try:
            return super()._prepare_dataset(dataset, processing_class, args, dataset_name)
        finally:
            args.per_device_train_batch_size = per_device


class CPDistillationTrainer(CPRLTrainerMixin, DistillationTrainer):
    """TRL's :class:`trl.DistillationTrainer` with the student's and the teacher's forwards under context
    parallelism (:class:`CPRLTrainerMixin`: generation outside the block, each process its own prompts;
    the group's generation batches joined).

    The divergence is TRL's own chunked one (forward KL, reverse KL or the generalised JSD, ``beta``),
    computed on this rank's shard only: the joined rows' sequences are packed as the documents of one
    row and sharded, the student's and the teacher's backbones run on the shard, and each rank projects
    its own tokens' hidden states through both LM heads in TRL's chunks, so no rank holds more than its
    shard's hidden states and one chunk's logits. Each rank's loss is P times its tokens' share of the
    divergence (TRL's normaliser: the generation batch's completion tokens), so DDP / FSDP2's mean over
    the processes is one process's gradient; the entropy metric sums the ranks' tokens. The teacher,
    like the student, must use ``attn_implementation="cp_flash"``."""

    _cp_fused_head = False
    _cp_local = None  # this rank's shard while the loss runs (the hidden states' forwards read it)

    def _compute_loss(self, unwrapped_student, inputs, num_items_in_batch):
        cp = active_context()
        if cp is None:
            return super()._compute_loss(unwrapped_student, inputs, num_items_in_batch)
        extra = sorted(k for k in inputs if k not in _DISTILLATION_KEYS)
        if extra:
            raise refuse("packed_rows_inputs", name=type(self).__name__, keys=", ".join(extra))
        prompt, completion = inputs["prompt_ids"], inputs["completion_ids"]
        loss_mask = inputs["completion_mask"] if "tool_mask" not in inputs else \
            inputs["completion_mask"] * inputs["tool_mask"]
        ids = torch.cat([prompt, completion], dim=1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        # a completion token's label is itself where the loss counts it: the hidden state before it is scored
        labels = torch.cat([torch.full_like(prompt, -100), completion.masked_fill(loss_mask == 0, -100)], dim=1)
        packed = pack_rows(ids, mask, labels, name=type(self).__name__)
        local, _ = shard_packed(cp, packed, ids.device, unwrapped_student)
        scored = (local.pop("cp_targets") != -100).to(inputs["completion_mask"].dtype)  # (1, n_r)
        if num_items_in_batch is None:  # evaluation: TRL's mean over the batch's scored tokens
            num_items_in_batch = loss_mask.sum().clamp(min=1)
        empty = prompt.new_zeros(1, 0)
        shard = {"prompt_ids": empty, "prompt_mask": empty, "completion_ids": local["input_ids"],
                 "completion_mask": scored}
        self._cp_local = local
        try:  # TRL's loss on the shard: its tokens' hidden states (below) against their scored flags
            return super()._compute_loss(unwrapped_student, shard, num_items_in_batch / cp.world_size)
        finally:
            self._cp_local = None

    def _get_last_hidden_state(self, unwrapped_model, input_ids, attention_mask, logits_to_keep, **multimodal):
        local = self._cp_local
        if local is None:
            return super()._get_last_hidden_state(unwrapped_model, input_ids, attention_mask, logits_to_keep,
                                                  **multimodal)
        backbone = unwrap_adapters(unwrapped_model).base_model
        return backbone(**local, use_cache=False).last_hidden_state  # (1, n_r, H): every token of the shard


_DISTILLATION_KEYS = frozenset({"prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "tool_mask",
                                "num_items_in_batch"})


class CPDPOTrainer(CPRLTrainerMixin, DPOTrainer):
    """TRL's :class:`trl.DPOTrainer` with its policy and reference forwards under context parallelism
    (:class:`CPRLTrainerMixin`; module docstring)."""
