"""TRL's ``SFTTrainer`` under context parallelism: :class:`CPSFTTrainer`.

Importing this module imports ``trl`` (``import cp_attention`` never does: trl stays optional). An
SFT script changes two lines (the class and the attention implementation) and is launched with
``torchrun``::

    from cp_attention.integrations.trl import CPSFTTrainer
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="cp_flash")
    args = SFTConfig(..., padding_free=True)         # or packing=True (BFD packing is padding-free)
    trainer = CPSFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tokenizer)
    trainer.train()                                  # torchrun --nproc_per_node=N sft.py

A training step is :class:`~cp_attention.integrations.trainer.CPTrainerMixin`'s: the CP group's
micro-batches are joined along the sequence, sharded, and ``SFTTrainer``'s own step (its fused LM
head scores the pre-shifted ``shift_labels`` of the shard, its loss is normalised by Trainer's
``num_items_in_batch`` of the global batch) runs on this rank's shard. ``class X(CPTrainerMixin,
SFTTrainer)`` and ``class X(SFTTrainer, CPTrainerMixin)`` are the same trainer as this one.

What the configuration needs: nothing beyond CPTrainerMixin's rules (a ``cp_flash`` model,
``average_tokens_across_devices=True``, no label smoothing, no ``compute_loss_func``; a MoE router
auxiliary loss, ``router_aux_loss_coef``, is taken over the joined batch; PEFT: a ``peft_config`` of a
weight adapter, LoRA, DoRA, ...; prompt learning is refused). ``padding_free=True`` (or BFD packing, which
implies it) is the configuration to use: each micro-batch is one row of documents told apart by
``position_ids``, and nothing but tokens is sharded. A padded batch works too, but its padding is
joined into the middle of the rows and computed on, and the ranks need the same number of rows
(``dataloader_drop_last=True``). SFTConfig turns on ``bf16`` autocast by default; under autocast a
float32 model reaches cp_flash with float32 queries and keys (after RoPE) and bfloat16 values,
which cp_flash refuses: load the model in bfloat16 or set ``bf16=False``.
"""

from __future__ import annotations

from trl import SFTTrainer

from .trainer import CPTrainerMixin

__all__ = ["CPSFTTrainer"]


class CPSFTTrainer(CPTrainerMixin, SFTTrainer):
    """TRL's :class:`trl.SFTTrainer` whose training steps run under context parallelism.

    Takes SFTTrainer's arguments and ``cp_group``, ``cp_mesh_dim``, ``cp_layout``, ``cp_timeout``,
    ``cp_strategy``, ``cp_ulysses_size``, ``cp_cost_model`` (see
    :class:`~cp_attention.integrations.trainer.CPTrainerMixin`). The model must use
    ``attn_implementation="cp_flash"``; ``padding_free=True`` is recommended (module docstring).
    """
