"""The refusals of heads, losses and the trainers: part of the catalogue of :mod:`cp_attention.refusals`
(which builds them into :data:`~cp_attention.refusals.REFUSALS`; see it for the fields), kept apart to
keep each module short. Each entry is the keyword arguments of one :class:`~cp_attention.refusals.Refusal`.

A ground-layer module: it imports nothing from the package.
"""

from __future__ import annotations

TRAINING = (
    # -------------------------------------------------------------------------------------------- heads
    dict(key="head_outputs_in_trainer", exception=NotImplementedError, area="heads",
       what="a head whose outputs are gathered (logits_to_keep, pooled / span / token-mean) in a CP trainer",
       why="the outputs are gathered from rows of one sequence; the trainers join micro-batches along it",
       fix="run it through cp.shard_batch and the model, or without a CP trainer",
       message="cp_flash: {name} with {what} under context parallelism gathers its outputs over the group from "
               "rows of one sequence, but the CP trainers join the ranks' micro-batches along the sequence: run "
               "it through cp.shard_batch and the model, or without a CP trainer"),
    dict(key="sequence_pooling", exception=NotImplementedError, area="heads",
       what="a sequence classifier pooling one token other than through gathered per-token scores",
       why="every rank but the one holding that token would pool a token of its own shard",
       fix="run this sequence classifier without context_parallel",
       message="cp_flash: {name} pools one token of each row (its first token, a [CLS] pooler in its base model, "
               "...) other than through per-token scores pooled at the last non-padding token, which cp_attention "
               "gathers; under context parallelism every rank but the one holding that token would pool a token of "
               "its own shard. Run this sequence classifier without context_parallel"),
    dict(key="qa_span_positions", exception=NotImplementedError, area="heads",
       what="start_positions/end_positions for a QA head whose span logits cannot be gathered",
       why="they index the whole sequence; each rank holds a shard",
       fix="compute the span loss from the gathered logits, or run without context_parallel",
       message="cp_flash: {name} reads start_positions/end_positions as indices into the sequence, but each rank "
               "holds a shard of it and its span logits are not per-token outputs of a qa_outputs module that "
               "cp_attention can gather. Compute the span loss from the gathered logits, or run without "
               "context_parallel"),
    dict(key="qa_span_padding", exception=NotImplementedError, area="heads",
       what="start_positions/end_positions of a QA head on rows with padding (an attention_mask with zeros)",
       why="the span loss is a softmax over every position, padding included, and what attention computes at a "
           "padding position is each implementation's own (eager attends to the row, cp_flash to the token alone)",
       fix="rows without padding (windows of one length), or the loss over the gathered logits with padding masked",
       message="cp_flash: {name}'s span loss is a softmax over every position of the row, padding included, and "
               "the batch has padding: the logits at padding positions are each attention implementation's own "
               "(eager attends to the row's tokens, cp_flash to the padding token alone), so the loss would not be "
               "one device's. Use rows without padding (windows of one length), or compute the span loss from the "
               "gathered start/end logits with the padding masked"),
    dict(key="token_mean_loss", exception=NotImplementedError, area="heads",
       what="labels for a head whose loss is a mean over the tokens it is given",
       why="the ranks' means are not the batch's",
       fix="no labels: the loss from the logits (sum / the batch's label count), or no context_parallel",
       message="cp_flash: {name} takes the mean of its loss over the tokens it is given, which under context "
               "parallelism are this rank's: the ranks' means are not the batch's. Call it without labels and "
               "compute the loss from the logits (sum over the shard / the batch's label count), or run without "
               "context_parallel"),
    dict(key="z_loss_uneven", exception=NotImplementedError, area="heads",
       what="a z-loss (z_loss_coefficient) on a layout that gives the ranks different token counts",
       why="each rank's mean equals the batch's only when every rank holds as many tokens",
       fix="a sequence length the layout splits evenly, or z_loss_coefficient=0",
       message="cp_flash: {name} adds z_loss_coefficient times the mean over its tokens of logsumexp(logits)^2, "
               "which under context parallelism is each rank's mean: it equals the batch's only when every rank "
               "holds as many tokens, and this layout gives them {lengths}. Use a sequence length the layout "
               "splits evenly, or set z_loss_coefficient=0"),
    dict(key="logits_to_keep_with_labels", exception=NotImplementedError, area="heads",
       what="logits_to_keep together with labels",
       why="the kept logits no longer line up with the labels",
       fix="logits_to_keep=0 with labels",
       message="cp_flash: {model} was called with logits_to_keep={keep!r} and labels: the kept logits no longer "
               "line up with the labels. Pass logits_to_keep=0 with labels"),
    dict(key="logits_to_keep_without_ids", exception=NotImplementedError, area="heads",
       what="logits_to_keep without input_ids or inputs_embeds of the shard",
       why="nothing places the kept positions on the ranks",
       fix="pass input_ids or inputs_embeds",
       message="cp_flash: logits_to_keep={keep!r} under context parallelism needs input_ids or inputs_embeds of "
               "the shard to place the kept positions"),
    dict(key="logits_to_keep_no_output_embeddings", exception=NotImplementedError, area="heads",
       what="logits_to_keep on a model without an output embeddings module",
       why="there are no logits to gather from the ranks",
       fix="logits_to_keep=0",
       message="cp_flash: {model} has no output embeddings module whose logits logits_to_keep={keep!r} could "
               "gather; pass logits_to_keep=0"),
    dict(key="num_items_mismatch", exception=ValueError, area="heads",
       what="a num_items_in_batch handed to the model other than the one cp.shard_batch bound",
       why="each rank's loss is P times its share of the batch's label count",
       fix="pass num_items_in_batch to cp.shard_batch and hand the model the value it returns",
       message="cp_flash: num_items_in_batch={value:g} was handed to the model, but the batch cp.shard_batch "
               "returned binds {want:g} (its {items:g} label tokens / {ranks} ranks: each rank's loss is P times "
               "its share). To count over accumulated micro-batches, pass num_items_in_batch to cp.shard_batch, "
               "and hand the model the value it returns"),
    dict(key="router_loss_unknown", exception=NotImplementedError, area="heads",
       what="a MoE router loss function that is not the Switch-Transformer balance cp_attention reduces",
       why="it cannot be taken over the whole batch from the ranks' shards",
       fix="output_router_logits=False (TRL: router_aux_loss_coef=0.0), or no context_parallel",
       message="cp_flash: the MoE router loss {name} (transformers {version}) cannot be computed under context "
               "parallelism: {reason}. Turn "
               "it off (output_router_logits=False; TRL: router_aux_loss_coef=0.0) or run without context_parallel"),
    dict(key="router_logits_not_per_token", exception=NotImplementedError, area="heads",
       what="router logits that are not one row per token of the rank's shard",
       why="the router loss cannot be taken over the batch",
       fix="output_router_logits=False, or no context_parallel",
       message="cp_flash: {name} got router logits of {shapes}, not one row per token of this rank's shard "
               "({tokens}); the router loss cannot be taken over the batch"),
    # ------------------------------------------------------------------------------------------ trainer
    dict(key="trainer_local_loss", exception=ValueError, area="trainer",
       what="label smoothing or compute_loss_func in CPTrainer",
       why="they see only each rank's local logits and labels",
       fix="label_smoothing_factor=0 and no compute_loss_func",
       message="{name} computes the loss inside the model on each rank's shard; label smoothing and "
               "compute_loss_func see only local logits and labels: set label_smoothing_factor=0 and drop "
               "compute_loss_func"),
    dict(key="trainer_local_token_average", exception=ValueError, area="trainer",
       what="average_tokens_across_devices=False in CPTrainer",
       why="each process's loss would be normalised by its own tokens, not the global batch's",
       fix="average_tokens_across_devices=True",
       message="{name} needs average_tokens_across_devices=True: each rank's loss must be normalised by the label "
               "tokens of the whole global batch"),
    dict(key="trainer_not_cp_flash", exception=ValueError, area="trainer",
       what="CPTrainer on a model loaded without attn_implementation='cp_flash'",
       why="only cp_flash attends across the ranks' shards",
       fix="load the model with attn_implementation='cp_flash'",
       message="{name} trains models loaded with attn_implementation='cp_flash', this one uses {implementation!r}"),
    dict(key="trainer_row_head", exception=ValueError, area="trainer",
       what="a CP post-training trainer (GRPO, RLOO, DPO, KTO) on a model whose head reads one output per row",
       why="these trainers score every token with the causal LM head; a pooled or span head has none",
       fix="CPTrainer (sequence classification, QA) or CPRewardTrainer (reward models)",
       message="{name} scores every token with a causal language-model head, but {model} reads one output per "
               "row (a pooled token or a span): train it with CPTrainer, or CPRewardTrainer for a reward model"),
    dict(key="trainer_z_loss", exception=ValueError, area="trainer",
       what="CPTrainer on a model with a z-loss (z_loss_coefficient > 0)",
       why="a mean over each rank's tokens, which Trainer's loss scaling multiplies by the processes",
       fix="z_loss_coefficient=0, or cp.shard_batch and the model's forward",
       message="{name}: {model} adds a z-loss (z_loss_coefficient) that is a mean over each rank's tokens; "
               "Trainer's loss scaling would multiply it by the number of processes. Set z_loss_coefficient=0, or "
               "train it through cp.shard_batch and the model's forward"),
    dict(key="trainer_router_loss", exception=ValueError, area="trainer",
       what="a MoE router auxiliary loss in a CP trainer that overrides compute_loss",
       why="how it weighs the auxiliary loss across processes is unknown",
       fix="output_router_logits=False, or Trainer / TRL's SFTTrainer without a new compute_loss",
       message="{name} overrides compute_loss, so how it weighs the MoE router auxiliary loss across processes is "
               "unknown and cp_attention cannot take it over the batch exactly: set the config's "
               "output_router_logits=False, or subclass Trainer or TRL's SFTTrainer without changing compute_loss"),
    dict(key="rl_parallelism_config", exception=ValueError, area="trainer",
       what="accelerate's own context or sequence parallelism (parallelism_config) in a CP post-training trainer",
       why="the batch would be sharded twice: by accelerate's torch CP and by cp_attention",
       fix="drop parallelism_config's cp_size/sp_size; the trainer's cp_group sets the CP ranks",
       message="{name} shards the sequences itself (cp_group); the configuration's parallelism_config also asks "
               "accelerate for context or sequence parallelism, which would shard them again: drop its "
               "cp_size / sp_size"),
    dict(key="rl_multimodal", exception=NotImplementedError, area="trainer",
       what="a vision-language model in a CP post-training trainer (GRPO, RLOO)",
       why="the image inputs travel with each rank's rows, which are packed and sharded as text only",
       fix="train the vision-language model without the CP trainer, or its text model alone",
       message="{name} packs and shards the rows' tokens only; a vision-language model's image inputs are not "
               "packed with them. Train it without {name}, or its text model alone"),
    dict(key="rl_continuous_batching", exception=NotImplementedError, area="trainer",
       what="use_transformers_continuous_batching in a CP post-training trainer",
       why="paged generation through cp_flash is not tested",
       fix="use_transformers_continuous_batching=False (plain generate) or vLLM",
       message="{name}: use_transformers_continuous_batching runs paged generation, which cp_flash is not tested "
               "with; set it to False (generation then uses model.generate on each process) or use vLLM"),
    dict(key="rl_no_fused_head", exception=NotImplementedError, area="trainer",
       what="a CP post-training trainer whose TRL did not install its fused LM head",
       why="the trainer scores sequences through the fused head's forward, which is where CP enters",
       fix="TRL 1.16 (the version tested), whose GRPO, RLOO and DPO trainers install add_fused_lm_head",
       message="{name}: the {role} ({model}) has no fused LM head forward (TRL's add_fused_lm_head); this TRL "
               "version scores differently and cp_attention cannot route its forwards. Use TRL 1.16"),
    dict(key="packed_rows_not_contiguous", exception=NotImplementedError, area="trainer",
       what="a scored row whose attended tokens are not one span, or a label outside it or on its first token",
       why="each row is packed as one document of its attended tokens; a hole would join tokens it does not "
           "attend across, and such a label predicts a token the row does not attend",
       fix="left- and right-padded rows only (TRL's own layout), labels -100 on padding and on the first token",
       message="{name}: rows {holes} attend to tokens that are not one contiguous span, rows {stray} have labels "
               "on unattended columns and rows {opening} on their first attended token; under context "
               "parallelism each row is packed as one document of its attended tokens. Pad rows on the left "
               "and right only, with -100 labels there and on each row's first token"),
    dict(key="packed_rows_inputs", exception=NotImplementedError, area="trainer",
       what="a fused log-probability forward under CP with inputs other than the tokens (images, token types)",
       why="only the rows' tokens, positions and labels are packed and sharded",
       fix="a text-only model and batch",
       message="{name}: the fused forward got {keys}; under context parallelism only input_ids, attention_mask, "
               "labels and position_ids are packed and sharded. Train a text-only model and batch"),
    dict(key="packed_rows_router_loss_own", exception=NotImplementedError, area="trainer",
       what="a MoE router auxiliary loss of each rank's own rows under CP (not a joined batch)",
       why="the group's router loss is one number over all the rows; a rank's own rows have no exact share of it",
       fix="request router logits only on the joined batch (the trainers do)",
       message="{name}: router logits were requested on each rank's own rows; the router loss under context "
               "parallelism is the group's, over the joined batch. Request them on the joined batch only"),
    dict(key="trainer_uneven_rows", exception=ValueError, area="trainer",
       what="CP group ranks' micro-batches with different numbers of rows",
       why="they are joined row by row along the sequence",
       fix="dataloader_drop_last=True, or DataCollatorWithFlattening (always 1 row)",
       message="CPTrainer: the ranks of a context-parallel group got micro-batches of {rows} rows; they are joined "
               "row by row, so they need the same number of rows: set dataloader_drop_last=True, or pack with "
               "DataCollatorWithFlattening (always 1 row)"),
)
"""The "heads" and "trainer" areas' refusals, as :class:`~cp_attention.refusals.Refusal` keyword arguments."""
