"""The refusals of the model check, the guard and multimodal batches: part of the catalogue of
:mod:`cp_attention.refusals` (which builds them into :data:`~cp_attention.refusals.REFUSALS`; see it for the
fields), kept apart to keep each module short. Each entry is the keyword arguments of one
:class:`~cp_attention.refusals.Refusal`.

A ground-layer module: it imports nothing from the package.
"""

from __future__ import annotations

MODELS = (
    # ------------------------------------------------------------------------------------------- models
    dict(key="model_check", exception=NotImplementedError, area="models",
       what="a model the model check finds inexact under context parallelism (its rules: integrations/hf/check.py)",
       why="it would compute something else than on one device (the error lists the modules and reasons)",
       fix='run without context_parallel, or with "eager" / "sdpa" outside a context_parallel block',
       message="cp_flash cannot run {family} ({model}) under context parallelism: it would compute something else "
               "than on one device, because it has\n{findings}\nRun this model without context_parallel (one "
               "device, or data parallelism only), or with an attention implementation of its own (\"eager\", "
               "\"sdpa\") outside a context_parallel block."),
    dict(key="verification_differs", exception=NotImplementedError, area="models",
       what="a model whose outputs under context parallelism differ from one device on the first-use test batch",
       why="something in it mixes tokens outside the calls cp_attention runs across ranks (its own code, a kernel, "
           "packed documents read another way)",
       fix="run it without context_parallel; python -m cp_attention check shows the layers",
       message="cp_flash cannot run {family} ({model}) under context parallelism: verified at first use on a test "
               "batch of {tokens} tokens ({batch}), its outputs under the block differ from each document alone "
               "on one device, first at module {module} (difference {error} of that output's largest value; "
               "tolerance for {dtype}: {tolerance}). Something in the model mixes tokens along the sequence "
               "outside the calls cp_attention runs across ranks (its attention interface and adapted mixers): "
               "its own code (a running sum or mean, a shift, roll, pad, pool, convolution or sort along the "
               "tokens), a kernel that replaces an attention or mixer class, or positions read another way. Run "
               "this model without context_parallel (one device, or data parallelism only); `python -m "
               "cp_attention check` on its checkpoint prints every layer. context_parallel(verify=False) skips "
               "this test (and its guarantee)."),
    dict(key="verification_could_not_run", exception=NotImplementedError, area="models",
       what="a model whose forward fails on the first-use test batch (plain input_ids and position_ids)",
       why="without that comparison nothing shows that the model computes under context parallelism what it "
           "computes on one device",
       fix="context_parallel(verify=False) after checking the model another way (python -m cp_attention check)",
       message="cp_flash cannot verify {family} ({model}) under context parallelism: its forward on the first-use "
               "test batch ({tokens} tokens of input_ids with position_ids, nothing else) raised {error}. The test "
               "compares the model under the block with each document alone on one device; a model that needs "
               "other inputs (bounding boxes, images, ...) cannot take it. Check it another way (`python -m "
               "cp_attention check` on its checkpoint, or your own comparison with one device), then pass "
               "context_parallel(verify=False), which skips this test and its guarantee."),
    dict(key="verification_packed_rows", exception=NotImplementedError, area="models",
       what="packed documents in a row that the model, on one device, does not keep apart",
       why="under context parallelism each document attends alone, as the batch's position_ids say; on one device "
           "this model lets them attend to each other, so the two would differ",
       fix="one document per row (padding instead of packing), or run without context_parallel",
       message="cp_flash cannot run {family} ({model}) under context parallelism on packed rows: verified at first "
               "use on a test row of {tokens} tokens packing {documents} documents (position_ids restarting at "
               "each), its forward on one device differs from each document alone (difference {error} of the "
               "logits' largest value; tolerance for {dtype}: {tolerance}): on one device this model lets packed "
               "documents attend to each other (it does not read restarting position_ids as documents), while "
               "under the block cp_flash keeps them apart. Give each document its own row (pad instead of "
               "packing), or run this model without context_parallel."),
    dict(key="model_built_before_registration", exception=NotImplementedError, area="models",
       what="a cp_flash model built before cp_attention registered cp_flash",
       why="the guard reads a model's calls through a hook it gives each transformers model as it is built",
       fix="import cp_attention before building the model",
       message="cp_flash: {model} was built before cp_attention registered cp_flash, so its calls under context "
               "parallelism cannot be checked; import cp_attention before building the model (before "
               "from_pretrained / from_config), then build it again."),
    dict(key="layers_bypassed_cp_flash", exception=NotImplementedError, area="models",
       what="a forward in which some attention layers did not reach cp_flash",
       why="those layers attended over this rank's shard only",
       fix="run the model without context_parallel",
       message="cp_flash: {ran} attention layer(s) of {family} ({model}) ran in this forward under context "
               "parallelism but {missing} of them did not reach cp_flash: they computed their attention another "
               "way on this rank's shard only, so the outputs are not the model's. Its modeling code selects "
               "attention classes by implementation name or bypasses the attention interface for some layers; run "
               "it without context_parallel."),
    dict(key="packed_without_position_ids", exception=NotImplementedError, area="models",
       what="packed documents for a model whose forward takes no position_ids (one-rank block)",
       why="it numbers positions over the whole row instead of restarting them per document",
       fix='one document per row, or its own attention ("eager", "sdpa") outside context_parallel',
       message="cp_flash cannot run {family} ({model}) on the packed documents cp.shard_batch recorded: its "
               "forward takes no position_ids, so it numbers positions over the whole row instead of restarting "
               "them at each document. Give it one document per row, or run it with its own attention "
               "implementation (\"eager\", \"sdpa\") outside a context_parallel block."),
    dict(key="collator_packed_without_position_ids", exception=NotImplementedError, area="models",
       what="a collator's cu_seq_lens for a family that numbers its positions itself",
       why="each document would get the row's positions instead of its own",
       fix='one document per row (padding), or attn_implementation="eager"',
       message="cp_flash cannot run {family} on packed documents (cu_seq_lens): its models number positions over "
               "the whole row and take no position_ids, so each document would get the row's positions instead of "
               "its own. Give it one document per row (padding), or use attn_implementation=\"eager\""),
    dict(key="rope_output_shape", exception=NotImplementedError, area="models",
       what="a length-dependent rotary embedding whose output is not one cos/sin row per position",
       why="it cannot be given the whole sequence's length under context parallelism",
       fix="run it without context_parallel",
       message="cp_flash: the rotary embedding {module} returned a {got} output where a (..., {rows}, D) cos/sin "
               "row per position was expected; its length-dependent rope cannot be given the whole sequence's "
               "length under context parallelism. Run it without context_parallel."),
    dict(key="attention_dropout", exception=NotImplementedError, area="models",
       what="attention dropout in training",
       why="cp_flash does not implement it",
       fix="set the model's attention_dropout to 0",
       message="cp_flash does not implement attention dropout (got dropout={dropout}); set the model's "
               "attention_dropout to 0"),
    dict(key="encoder_decoder_batch", exception=NotImplementedError, area="models",
       what="an encoder-decoder model's batch (decoder_input_ids) given to shard_batch",
       why="cp_attention shards a decoder-only sequence",
       fix="run this model without context_parallel",
       message="shard_batch: an encoder-decoder model's batch (decoder_input_ids): cp_attention shards a "
               "decoder-only sequence; run this model without context_parallel"),
    dict(key="peft_prompt_learning", exception=NotImplementedError, area="models",
       what="PEFT prompt learning (prompt, prefix, p-tuning)",
       why="its virtual tokens would go in front of every rank's shard, not of the sequence",
       fix="a weight adapter (LoRA, DoRA, IA3, ...), or this adapter without context_parallel",
       message="cp_attention: PEFT {kind} adds {tokens} virtual tokens in front of the sequence (or of the keys), "
               "which under context parallelism would go in front of every rank's shard. Use a weight adapter "
               "(LoRA, DoRA, IA3, ...), or train this adapter without context_parallel"),
    # --------------------------------------------------------------------------------------- multimodal
    dict(key="media_without_model", exception=ValueError, area="multimodal",
       what="a multimodal batch (images, video, audio) given to shard_batch without model=",
       why="those inputs are not along the sequence: the model's front-end must run on the full batch",
       fix="cp.shard_batch(**processor_output, model=model)",
       message="shard_batch: {named} are a multimodal model's inputs (images, video or audio), which are not along "
               "the sequence: pass the model too, cp.shard_batch(**processor_output, model=model), so that its own "
               "front-end runs on the full batch and its text decoder's inputs are sharded"),
    dict(key="media_handed_to_the_model", exception=ValueError, area="multimodal",
       what="images (video, audio) handed to a model directly while its text is sharded",
       why="the model would merge whole images' features into shards that hold only part of their tokens",
       fix="cp.shard_batch(**processor_output, model=model), then model(**batch)",
       message="cp_flash: {named} handed to {model} directly while its text comes sharded from cp.shard_batch: each "
               "rank holds only part of the image tokens, so the model cannot merge the images' features into its "
               "shard (transformers then raises \"Image features and image tokens do not match\", or merges them "
               "at the wrong tokens). Pass the processor's whole output through cp.shard_batch(**processor_output, "
               "model=model): the model's front-end runs on the full batch on every rank and its text decoder gets "
               "this rank's shard; then call model(**batch) without the images"),
    dict(key="sub_model_attention", exception=NotImplementedError, area="multimodal",
       what="a sub-model's attention (a vision tower) run inside a multi-rank block",
       why="its tokens are an image's, not the sharded text sequence",
       fix="pass the images to cp.shard_batch(..., model=model), which runs the tower before sharding",
       message="cp_flash: the attention of a sub-model, {tower}, ran inside a multi-rank context_parallel block: "
               "its tokens are an image's (or a clip's), not the sharded text sequence, and binding it to the text "
               "batch would attend over the wrong tokens. Pass the images to cp.shard_batch(**processor_output, "
               "model=model) instead: it runs the vision tower on the full batch before sharding, and the model "
               "then gets inputs_embeds"),
    dict(key="decoder_without_inputs_embeds", exception=NotImplementedError, area="multimodal",
       what="a multimodal model whose text decoder gets no inputs_embeds from its front-end",
       why="its images reach the decoder another way: its inputs cannot be sharded",
       fix="run this model without context_parallel",
       message="shard_batch: {model}'s text decoder got no inputs_embeds from its multimodal front-end (its "
               "images reach the decoder another way: cross-attention, image tokens in input_ids, or an "
               "encoder-decoder), so its inputs cannot be sharded. Run this model without context_parallel"),
    dict(key="decoder_not_called", exception=NotImplementedError, area="multimodal",
       what="a multimodal model whose forward does not call its text decoder as cp_attention reads it",
       why="the decoder's inputs cannot be captured, so they cannot be sharded",
       fix="run this model without context_parallel",
       message="shard_batch: {model}'s forward did not call its text decoder ({decoder}) the way cp_attention "
               "reads it (an encoder-decoder, or a decoder called through another module); its multimodal inputs "
               "cannot be sharded. Run this model without context_parallel"),
    dict(key="decoder_positional_arguments", exception=NotImplementedError, area="multimodal",
       what="a multimodal model calling its text decoder with positional arguments",
       why="shard_batch reads only keyword arguments",
       fix="run this model without context_parallel",
       message="cp_attention: {model} calls its text decoder with positional arguments; shard_batch reads only "
               "keyword arguments"),
    dict(key="decoder_list_not_along_sequence", exception=NotImplementedError, area="multimodal",
       what="a decoder argument that is a list of tensors not ordered along the sequence's image tokens",
       why="it cannot be sharded (it would be dropped)",
       fix="run this model without context_parallel",
       message="cp_attention: the decoder argument {name!r} (a list of {shape} tensors) is not along the "
               "sequence; it cannot be sharded"),
    dict(key="decoder_tensor_not_along_sequence", exception=NotImplementedError, area="multimodal",
       what="a decoder argument tensor that is not along the sequence",
       why="shard_batch cannot shard it (it would be dropped)",
       fix="run this model without context_parallel",
       message="cp_attention: the decoder argument {name!r} of shape {shape} is not along the sequence of {length} "
               "tokens; shard_batch cannot shard it"),
)
