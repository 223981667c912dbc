"""The catalogue of refusals: what cp_attention cannot make exact under context parallelism, and
refuses at run time before anything is computed, with one error that names what, why and the fix.

Every such error is raised from here, by key::

    raise refuse("kv_cache_under_cp", queries=Lq, offset=docs.q_offset, keys=Lk)

A :class:`Refusal` holds the exception type and the message template (``str.format`` fields,
``{name}``, filled by the call site); :data:`REFUSALS` holds them all, by area. A new refusal is a
new entry here, then ``refuse("its_key", ...)`` where it is detected; the page ``docs/refusals.md``
is generated from this catalogue (``python -m cp_attention.tools.refusal_page docs/refusals.md``)
and a test keeps it current and checks that every key is raised somewhere and every raise site
names a key. Plain argument validation (a wrong shape, dtype or option value) is not a refusal and
stays where it is checked; so do the model check's findings (:mod:`cp_attention.integrations.model_check`
keeps its own table of rules; its verdict is the ``model_check`` refusal).

A ground-layer module: it imports nothing from the package.
"""

from __future__ import annotations

import string
import types
from dataclasses import dataclass

__all__ = ["AREAS", "DenseMaskError", "REFUSALS", "Refusal", "refuse"]


class DenseMaskError(NotImplementedError, ValueError):
    """A dense attention mask reached a cp_flash layer: not implemented (a family whose code builds
    one is refused), and a wrong argument where the caller passed it (a ValueError, as before)."""


AREAS = types.MappingProxyType({
    "context": "Context parallelism and the sharded batch",
    "cache": "KV caches and keys beyond the sequence",
    "compile": "torch.compile",
    "masks": "Masks the model builds",
    "models": "Model families",
    "multimodal": "Multimodal models",
    "heads": "Heads and losses",
    "trainer": "CPTrainer",
})
"""Area key -> section title, in the catalogue's (and the page's) order."""


@dataclass(kw_only=True, frozen=True)
class Refusal:
    """One refusal of the catalogue: what is refused, why, the fix, and the error raised."""

    key: str
    """The name call sites raise it by (``refuse(key, ...)``), unique in the catalogue."""
    exception: type[Exception]
    """The type of the error raised (kept as it was before the catalogue: tests and callers catch it)."""
    area: str
    """The section of :data:`AREAS` it belongs to."""
    what: str
    """One line: what is refused."""
    why: str
    """One line: why it cannot be made exact (or run at all) under context parallelism."""
    fix: str
    """One line: what to do instead."""
    message: str
    """The error's text, a ``str.format`` template whose ``{named}`` fields the call site passes."""

    @property
    def fields(self) -> tuple[str, ...]:
        """The names of the fields :attr:`message` needs, in order of first use."""
        names = (name for _, name, _, _ in string.Formatter().parse(self.message) if name is not None)
        return tuple(dict.fromkeys(name.split(".")[0].split("[")[0] for name in names))

    def error(self, **fields) -> Exception:
        """The exception, its message filled with ``fields`` (exactly the names of :attr:`fields`)."""
        missing = [name for name in self.fields if name not in fields]
        extra = sorted(set(fields) - set(self.fields))
        if missing or extra:
            raise TypeError(f"refuse({self.key!r}): its message names the fields {list(self.fields)}; "
                            + (f"missing {missing}" if missing else "")
                            + ("; " if missing and extra else "") + (f"not in the message {extra}" if extra else ""))
        return self.exception(self.message.format(**fields))


def refuse(key: str, /, **fields) -> Exception:
    """The error of the refusal ``key`` with its message's ``fields`` filled in, to raise at the call
    site (``raise refuse(...)``) or to hand on (the engine raises a rank's error on every rank).
    An unknown key raises KeyError, a missing or extra field TypeError."""
    try:
        refusal = REFUSALS[key]
    except KeyError:
        raise KeyError(f"refuse({key!r}): no such refusal in cp_attention.refusals.REFUSALS") from None
    return refusal.error(**fields)


def _catalogue(*refusals: Refusal) -> types.MappingProxyType:
    """Key -> Refusal, ordered by area (then as listed); keys unique, areas known."""
    table = {}
    for refusal in sorted(refusals, key=lambda r: list(AREAS).index(r.area)):
        if refusal.key in table:
            raise ValueError(f"two refusals named {refusal.key!r}")
        table[refusal.key] = refusal
    return types.MappingProxyType(table)


_R = Refusal

REFUSALS = _catalogue(
    # ------------------------------------------------------------------------------------------ context
    _R(key="torch_context_parallel", exception=RuntimeError, area="context",
       what="cp_flash inside torch's own context_parallel (accelerate's ParallelismConfig(cp_size > 1))",
       why="torch shards the sequence itself: cp_flash would attend within one shard",
       fix="cp_attention.context_parallel() + cp.shard_batch(), or CPTrainer, without torch's context_parallel",
       message="cp_flash: torch's context_parallel (accelerate's ParallelismConfig(cp_size > 1)) is active: it "
               "shards the sequence itself and cp_flash would attend within one shard. cp_flash does its own "
               "context parallelism: use cp_attention.context_parallel() + cp.shard_batch(), or CPTrainer from "
               "cp_attention.integrations.trainer, without torch's context_parallel (or use "
               "attn_implementation='sdpa' with torch's context_parallel, for plain causal masks only)"),
    _R(key="unsharded_inputs", exception=ValueError, area="context",
       what="a cp_flash layer under context parallelism on tensors cp.shard_batch did not return",
       why="without the batch's record the layer knows neither the global positions nor the documents",
       fix="shard the inputs with cp.shard_batch(...) and pass its outputs to the model",
       message="cp_flash under context parallelism needs the batch's global positions: shard the inputs with "
               "cp.shard_batch(input_ids=..., position_ids=..., labels=...) and pass its outputs to the model"),
    _R(key="padding_mask_not_sharded", exception=ValueError, area="context",
       what="a padding attention_mask the model got that cp.shard_batch did not see",
       why="the batch's documents and positions were recorded without that padding",
       fix="pass attention_mask to cp.shard_batch with the other inputs",
       message="cp_flash: the model got a padding attention_mask that cp.shard_batch did not see; pass "
               "attention_mask to cp.shard_batch with the other inputs"),
    _R(key="spans_not_read", exception=ValueError, area="context",
       what="a layer whose mask opens bidirectional spans on a batch whose spans shard_batch did not read",
       why="each rank sees only its shard's token types: the spans must be read from the whole batch",
       fix="pass model=model (and the token types it reads) to cp.shard_batch",
       message="cp_flash: this layer's mask opens bidirectional spans (image tokens that see each other), but "
               "cp.shard_batch did not read them from the batch: pass model=model (and the token types the model "
               "reads, e.g. token_type_ids or mm_token_type_ids) to cp.shard_batch"),
    _R(key="collator_documents_under_cp", exception=ValueError, area="context",
       what="a packing collator's cu_seq_lens_* handed to the model under context parallelism",
       why="they describe the whole row, not a rank's shard",
       fix="pass the collator's whole batch (cu_seq_lens_* included) to cp.shard_batch",
       message="cp_flash: cu_seq_lens_* are not used under context parallelism; pass the collator's whole batch "
               "(cu_seq_lens_* included) to cp.shard_batch, which takes the documents from them"),
    _R(key="position_start", exception=NotImplementedError, area="context",
       what="a model numbering positions from padding_idx + 1 on a batch shard_batch numbered from 0",
       why="the shards' positions would not be the model's own",
       fix="pass position_ids, or model=... to cp.shard_batch",
       message="cp_flash: {family} numbers its default positions from padding_idx + 1 = {start}, but "
               "cp.shard_batch was given no position_ids and numbered them from 0: pass position_ids (padding_idx "
               "+ 1 + each token's offset in its document), or pass model=... to cp.shard_batch so it numbers them "
               "as the model does"),
    _R(key="mixer_ambiguous_batch", exception=ValueError, area="context",
       what="a sequence mixer call while several sharded batches are alive",
       why="it cannot tell which batch's documents and layout it runs on",
       fix="run each batch's forward before sharding the next one",
       message="cp_flash: several batches returned by cp.shard_batch are alive and a sequence mixer (convolution "
               "/ state-space / linear attention) cannot tell which one it runs on; run each batch's forward "
               "before sharding the next one"),
    _R(key="mixer_tokens_not_of_batch", exception=ValueError, area="context",
       what="a sequence mixer on tokens other than the sharded batch's on this rank",
       why="its scan across ranks follows the batch's documents and layout",
       fix="pass the model the tensors of one cp.shard_batch call, and no cache",
       message="cp_flash: a sequence mixer got {batch_size} x {length} tokens but the sharded batch holds {rows} x "
               "{local} on this rank; pass the model the tensors of one cp.shard_batch call (and no cache)"),
    _R(key="router_loss_ambiguous_batch", exception=ValueError, area="context",
       what="a MoE router loss while several sharded batches are alive",
       why="it cannot tell which batch it is taken over",
       fix="run each batch's forward before sharding the next one",
       message="cp_flash: several batches returned by cp.shard_batch are alive and the MoE router loss cannot "
               "tell which one it runs on; run each batch's forward before sharding the next one"),
    # -------------------------------------------------------------------------------------------- cache
    _R(key="kv_cache_under_cp", exception=ValueError, area="cache",
       what="a forward with a non-empty KV cache under context parallelism (generation)",
       why="the ring exchanges the shards of one sequence; a cache is not sharded",
       fix="call the model with use_cache=False",
       message="cp_flash: a non-empty KV cache is not supported under context parallelism (queries {queries} "
               "from position {offset}, keys {keys}); call the model with use_cache=False"),
    _R(key="selection_with_kv_cache", exception=NotImplementedError, area="cache",
       what="selected keys (a sparse-attention indexer's top-k) with a KV cache (generation)",
       why="the selected-keys path places queries at the sequence's own positions only",
       fix='call the model with use_cache=False, or generate with attn_implementation="eager"',
       message="cp_flash: {family} selects keys per query over a KV cache ({queries} queries from position {offset}, "
               "{keys} keys), not decoded yet; use use_cache=False, or generate with attn_implementation=\"eager\"."),
    _R(key="appended_keys", exception=NotImplementedError, area="cache",
       what="keys a model appends inside its attention layer beyond the sequence's own (DeepSeek-V4)",
       why="they belong to no position of the sequence: no mask places them",
       fix="attn_implementation='eager' or 'sdpa' for this model",
       message="cp_flash: the layer attends to {keys} keys but its mask covers {covered} ({queries} queries): the "
               "model appended {appended} keys that are not tokens of the sequence (e.g. DeepSeek-V4's compressed "
               "K/V, concatenated to the keys inside its attention layer). Keys beyond the sequence's own (and its "
               "KV cache's) are not supported by cp_flash, with or without use_cache; use "
               "attn_implementation='eager' or 'sdpa' for this model"),
    _R(key="unplaced_keys", exception=NotImplementedError, area="cache",
       what="more or fewer keys than queries with no cp_flash mask describing them (one device)",
       why="the model builds its own keys or hands a prebuilt mask: nothing says where the keys lie",
       fix='attn_implementation="sdpa" or "eager", and no prebuilt mask',
       message="cp_flash: {queries} queries but {keys} keys, and no cp_flash mask describes the keys' positions: "
               "the model builds its own keys (appends entries that are not tokens of the sequence, or bypasses "
               "the mask function), or was handed a prebuilt 4D mask / a dict of masks. cp_flash cannot place "
               "such keys; use attn_implementation=\"sdpa\" or \"eager\" for this model, and pass no prebuilt mask"),
    _R(key="cu_seqlens_with_kv_cache", exception=ValueError, area="cache",
       what="a packing collator's cu_seq_lens_* with a non-empty KV cache",
       why="the boundaries describe one packed row, not a continuation",
       fix="no cache with packed documents",
       message="cp_flash: cu_seq_lens_* with a non-empty KV cache is not supported"),
    _R(key="cu_seqlens_appended_keys", exception=NotImplementedError, area="cache",
       what="cu_seq_lens_* on a layer with more (or fewer) keys than the row's tokens, no cache",
       why="keys that are not the row's tokens lie in no document",
       fix="no cu_seq_lens_* for such a model",
       message="cp_flash: cu_seq_lens_* describe one packed row of {tokens} tokens, but the layer has {keys} keys "
               "and no KV cache: keys that are not the row's own tokens (e.g. compressed K/V the model appends "
               "to the keys) are not supported with cu_seq_lens_*"),
    _R(key="packed_after_kv_cache", exception=ValueError, area="cache",
       what="packed documents (restarting position_ids) after a non-empty KV cache",
       why="which cached keys belong to which document is not known",
       fix="one document per row when continuing from a cache",
       message="cp_flash: packed documents (restarting position_ids) after a non-empty KV cache are not "
               "supported"),
    _R(key="mixer_cache", exception=NotImplementedError, area="cache",
       what="a sequence mixer continuing from a cache under context parallelism (generation)",
       why="the scan across ranks starts each document from a zero state",
       fix="use_cache=False, or generate without context_parallel",
       message="cp_flash: {name} was asked to continue from a cache under context parallelism; a non-empty cache "
               "(generation) is not supported there: run the forward with use_cache=False, or generate without "
               "context_parallel"),
    # ------------------------------------------------------------------------------------------ compile
    _R(key="unsharded_inputs_in_op", exception=ValueError, area="compile",
       what="the single-device op (a model compiled outside context_parallel) run inside a multi-rank block",
       why="a compiled graph cannot see the context (a contextvar): it would attend within the shard",
       fix="call the model inside the block on cp.shard_batch outputs (it recompiles)",
       message="cp_flash under context parallelism needs the batch's global positions: shard the inputs with "
               "cp.shard_batch(input_ids=..., position_ids=..., labels=...) and pass its outputs to the model. (A "
               "torch.compile'd model traced outside context_parallel() cannot see the context, which is a "
               "contextvar: call it inside the block on cp.shard_batch outputs, which recompiles)"),
    _R(key="compiled_cp_on_one_rank", exception=ValueError, area="compile",
       what="a model compiled inside a multi-rank block, run on a one-rank batch (or none)",
       why="its graph holds the multi-rank op, bound to a batch of several ranks",
       fix="run it inside the block it was compiled in, or torch._dynamo.reset() first",
       message="cp_flash: a model torch.compile traced inside a context of several ranks ran on a one-rank batch "
               "(or on none); run it inside the block it was compiled in, or call torch._dynamo.reset() first"),
    _R(key="spans_compiled_in_cp", exception=NotImplementedError, area="compile",
       what="a batch with bidirectional spans, in a model compiled inside context parallelism",
       why="the compiled graph cannot tell which of its layers open the spans",
       fix="run the model eagerly under context parallelism (or compiled on one device)",
       message="cp_flash: this batch has bidirectional spans (image tokens that see each other), but a model "
               "compiled with torch.compile inside context parallelism cannot tell which of its layers open them; "
               "run the model eagerly under context parallelism (or compiled on one device)"),
    _R(key="head_outputs_compiled", exception=NotImplementedError, area="compile",
       what="a head whose outputs are gathered (logits_to_keep, pooled / span / token-mean heads), compiled",
       why="the gathering runs in module hooks a compiled forward does not run",
       fix="call the model uncompiled",
       message="cp_flash: {name} with {what} under context parallelism gathers its outputs over the group in "
               "module hooks that a compiled forward does not run: call the model uncompiled"),
    # -------------------------------------------------------------------------------------------- masks
    _R(key="dense_mask", exception=DenseMaskError, area="masks",
       what="a dense attention_mask tensor reaching a cp_flash layer",
       why="cp_flash's masks come from its registered mask function; a dense one cannot be applied",
       fix='a 2D padding mask (or none) and position_ids; a family building its own: "eager" or "sdpa"',
       message="cp_flash received a dense {shape} attention_mask tensor in {family}, which it cannot apply: its "
               "masks come from the mask function registered with it. If you passed it, pass a 2D padding mask (or "
               "none) and position_ids; if the model builds it itself (BLT's byte and patch masks), cp_flash does "
               "not support this family: use attn_implementation=\"eager\" or \"sdpa\""),
    _R(key="mask_used_as_tensor", exception=NotImplementedError, area="masks",
       what="modeling code using the cp_flash mask as a dense tensor (a bias, a slice, arithmetic)",
       why="cp_flash hands its layers O(L) mask metadata, not (L x L) data",
       fix='attn_implementation="sdpa" or "eager" (without context parallelism)',
       message="cp_flash: {family}'s modeling code uses the attention mask as a dense tensor ({how}); cp_flash "
               "hands its layers O(L) mask metadata instead, which only its own attention function reads. This "
               "family is not supported by cp_flash: use attn_implementation=\"sdpa\" or \"eager\" (without "
               "context parallelism)"),
    _R(key="score_tensor_argument", exception=NotImplementedError, area="masks",
       what="a tensor the attention adds to its scores (a score bias over (query, key) pairs, per-query sinks, a "
            "dense mask)",
       why="cp_flash cannot apply it: it would be dropped",
       fix='attn_implementation="eager" (or "sdpa"), without context_parallel',
       message="cp_flash: {family} hands its attention {name!r}, a {shape} tensor its scores take (a score bias "
               "over (query, key) pairs, per-query sinks or a dense mask), which cp_flash cannot apply: it would be "
               "dropped. Use attn_implementation=\"eager\" (or \"sdpa\") for this family, without "
               "context_parallel."),
    _R(key="selection_with_spans", exception=NotImplementedError, area="masks",
       what="selected keys (a sparse-attention indexer) in a layer whose mask also opens bidirectional spans",
       why="a selection only removes pairs from a causal mask; no model combines it with spans", fix='"eager"',
       message="cp_flash: {family} selects keys per query in a layer whose mask also opens bidirectional spans "
               "(image blocks), which cp_flash does not combine; use attn_implementation=\"eager\" for such batches."),
    _R(key="selected_keys_argument", exception=NotImplementedError, area="masks",
       what="a selection of keys per query handed to the attention that no adapted indexer made",
       why="cp_flash reads only the selections of the indexers it adapts (global key indices): this one is dropped",
       fix='attn_implementation="eager" (or "sdpa"), without context_parallel',
       message="cp_flash: {family} hands its attention {name!r}, a {shape} tensor of selected keys per query that no "
               "indexer cp_flash adapts made (MiniMax-M3's key blocks, ...): it would be dropped. Use "
               "attn_implementation=\"eager\" (or \"sdpa\") for this family, without context_parallel."),
    _R(key="foreign_mask_overlay", exception=NotImplementedError, area="masks",
       what="a causal mask holding a mask function of the model's own, under context parallelism",
       why="each rank's mask is built from its shard: the overlay cannot be read and would be dropped",
       fix='run on one device (where such masks are probed), or attn_implementation="eager"',
       message="cp_flash: {family}'s causal mask contains {functions}, a mask function of the model's own that "
               "cp_flash cannot read under context parallelism (each rank's mask is built from its shard). Its "
               "overlay would be dropped; run this model on one device (cp_flash without context_parallel probes "
               "such masks), or with attn_implementation=\"eager\""),
    _R(key="overlay_past_window", exception=NotImplementedError, area="masks",
       what="a mask that shows keys past the layer's sliding window (an overlay OR-ed over it)",
       why="cp_flash would cut the mask to the window",
       fix='attn_implementation="eager" or "sdpa"',
       message="cp_flash: {family}'s mask lets a token see keys {window} or more positions back in a layer with a "
               "window of {window} (an overlay over its sliding window), which cp_flash would cut to the window. "
               "Use attn_implementation=\"eager\" or \"sdpa\" for this model"),
    _R(key="span_shape", exception=NotImplementedError, area="masks",
       what="bidirectional spans that are not blocks (a token not seeing every later token of its span)",
       why="cp_flash implements spans as blocks under the layer's window: it would compute another mask",
       fix='attn_implementation="eager" or "sdpa"',
       message="cp_flash: {family}'s mask opens later keys to some tokens in a shape cp_flash does not implement "
               "(its bidirectional spans are not blocks whose tokens see every later token of the block, under the "
               "layer's own window): it would compute another mask. Use attn_implementation=\"eager\" or \"sdpa\" "
               "for this model"),
    _R(key="span_longer_than_window", exception=NotImplementedError, area="masks",
       what="an image block longer than the sliding window, in a mask showing the whole block past it",
       why="cp_flash cuts spans to the window",
       fix='a model whose window covers its images, or attn_implementation="eager"',
       message="cp_flash: a bidirectional span (image block) of {longest} tokens is longer than a sliding window "
               "of {window} in {family}, whose mask shows the whole block past the window; cp_flash cuts spans to "
               "the window. Use a model whose window covers its images, or attn_implementation=\"eager\""),
    # ------------------------------------------------------------------------------------------- models
    _R(key="model_check", exception=NotImplementedError, area="models",
       what="a model the model check finds inexact under context parallelism (its rules: model_check.py)",
       why="it would compute something else than on one device (the error lists the modules and reasons)",
       fix='run without context_parallel, or with "eager" / "sdpa" outside a context_parallel block',
       message="cp_flash cannot run {family} ({model}) under context parallelism: it would compute something else "
               "than on one device, because it has\n{findings}\nRun this model without context_parallel (one "
               "device, or data parallelism only), or with an attention implementation of its own (\"eager\", "
               "\"sdpa\") outside a context_parallel block."),
    _R(key="layers_bypassed_cp_flash", exception=NotImplementedError, area="models",
       what="a forward in which some attention layers did not reach cp_flash",
       why="those layers attended over this rank's shard only",
       fix="run the model without context_parallel",
       message="cp_flash: {ran} attention layer(s) of {family} ({model}) ran in this forward under context "
               "parallelism but {missing} of them did not reach cp_flash: they computed their attention another "
               "way on this rank's shard only, so the outputs are not the model's. Its modeling code selects "
               "attention classes by implementation name or bypasses the attention interface for some layers; run "
               "it without context_parallel."),
    _R(key="packed_without_position_ids", exception=NotImplementedError, area="models",
       what="packed documents for a model whose forward takes no position_ids (one-rank block)",
       why="it numbers positions over the whole row instead of restarting them per document",
       fix='one document per row, or its own attention ("eager", "sdpa") outside context_parallel',
       message="cp_flash cannot run {family} ({model}) on the packed documents cp.shard_batch recorded: its "
               "forward takes no position_ids, so it numbers positions over the whole row instead of restarting "
               "them at each document. Give it one document per row, or run it with its own attention "
               "implementation (\"eager\", \"sdpa\") outside a context_parallel block."),
    _R(key="collator_packed_without_position_ids", exception=NotImplementedError, area="models",
       what="a collator's cu_seq_lens for a family that numbers its positions itself",
       why="each document would get the row's positions instead of its own",
       fix='one document per row (padding), or attn_implementation="eager"',
       message="cp_flash cannot run {family} on packed documents (cu_seq_lens): its models number positions over "
               "the whole row and take no position_ids, so each document would get the row's positions instead of "
               "its own. Give it one document per row (padding), or use attn_implementation=\"eager\""),
    _R(key="rope_output_shape", exception=NotImplementedError, area="models",
       what="a length-dependent rotary embedding whose output is not one cos/sin row per position",
       why="it cannot be given the whole sequence's length under context parallelism",
       fix="run it without context_parallel",
       message="cp_flash: the rotary embedding {module} returned a {got} output where a (..., {rows}, D) cos/sin "
               "row per position was expected; its length-dependent rope cannot be given the whole sequence's "
               "length under context parallelism. Run it without context_parallel."),
    _R(key="attention_dropout", exception=NotImplementedError, area="models",
       what="attention dropout in training",
       why="cp_flash does not implement it",
       fix="set the model's attention_dropout to 0",
       message="cp_flash does not implement attention dropout (got dropout={dropout}); set the model's "
               "attention_dropout to 0"),
    _R(key="encoder_decoder_batch", exception=NotImplementedError, area="models",
       what="an encoder-decoder model's batch (decoder_input_ids) given to shard_batch",
       why="cp_attention shards a decoder-only sequence",
       fix="run this model without context_parallel",
       message="shard_batch: an encoder-decoder model's batch (decoder_input_ids): cp_attention shards a "
               "decoder-only sequence; run this model without context_parallel"),
    _R(key="peft_prompt_learning", exception=NotImplementedError, area="models",
       what="PEFT prompt learning (prompt, prefix, p-tuning)",
       why="its virtual tokens would go in front of every rank's shard, not of the sequence",
       fix="a weight adapter (LoRA, DoRA, IA3, ...), or this adapter without context_parallel",
       message="cp_attention: PEFT {kind} adds {tokens} virtual tokens in front of the sequence (or of the keys), "
               "which under context parallelism would go in front of every rank's shard. Use a weight adapter "
               "(LoRA, DoRA, IA3, ...), or train this adapter without context_parallel"),
    # --------------------------------------------------------------------------------------- multimodal
    _R(key="media_without_model", exception=ValueError, area="multimodal",
       what="a multimodal batch (images, video, audio) given to shard_batch without model=",
       why="those inputs are not along the sequence: the model's front-end must run on the full batch",
       fix="cp.shard_batch(**processor_output, model=model)",
       message="shard_batch: {named} are a multimodal model's inputs (images, video or audio), which are not along "
               "the sequence: pass the model too, cp.shard_batch(**processor_output, model=model), so that its own "
               "front-end runs on the full batch and its text decoder's inputs are sharded"),
    _R(key="sub_model_attention", exception=NotImplementedError, area="multimodal",
       what="a sub-model's attention (a vision tower) run inside a multi-rank block",
       why="its tokens are an image's, not the sharded text sequence",
       fix="pass the images to cp.shard_batch(..., model=model), which runs the tower before sharding",
       message="cp_flash: the attention of a sub-model, {tower}, ran inside a multi-rank context_parallel block: "
               "its tokens are an image's (or a clip's), not the sharded text sequence, and binding it to the text "
               "batch would attend over the wrong tokens. Pass the images to cp.shard_batch(**processor_output, "
               "model=model) instead: it runs the vision tower on the full batch before sharding, and the model "
               "then gets inputs_embeds"),
    _R(key="decoder_without_inputs_embeds", exception=NotImplementedError, area="multimodal",
       what="a multimodal model whose text decoder gets no inputs_embeds from its front-end",
       why="its images reach the decoder another way: its inputs cannot be sharded",
       fix="run this model without context_parallel",
       message="shard_batch: {model}'s text decoder got no inputs_embeds from its multimodal front-end (its "
               "images reach the decoder another way: cross-attention, image tokens in input_ids, or an "
               "encoder-decoder), so its inputs cannot be sharded. Run this model without context_parallel"),
    _R(key="decoder_not_called", exception=NotImplementedError, area="multimodal",
       what="a multimodal model whose forward does not call its text decoder as cp_attention reads it",
       why="the decoder's inputs cannot be captured, so they cannot be sharded",
       fix="run this model without context_parallel",
       message="shard_batch: {model}'s forward did not call its text decoder ({decoder}) the way cp_attention "
               "reads it (an encoder-decoder, or a decoder called through another module); its multimodal inputs "
               "cannot be sharded. Run this model without context_parallel"),
    _R(key="decoder_positional_arguments", exception=NotImplementedError, area="multimodal",
       what="a multimodal model calling its text decoder with positional arguments",
       why="shard_batch reads only keyword arguments",
       fix="run this model without context_parallel",
       message="cp_attention: {model} calls its text decoder with positional arguments; shard_batch reads only "
               "keyword arguments"),
    _R(key="decoder_list_not_along_sequence", exception=NotImplementedError, area="multimodal",
       what="a decoder argument that is a list of tensors not ordered along the sequence's image tokens",
       why="it cannot be sharded (it would be dropped)",
       fix="run this model without context_parallel",
       message="cp_attention: the decoder argument {name!r} (a list of {shape} tensors) is not along the "
               "sequence; it cannot be sharded"),
    _R(key="decoder_tensor_not_along_sequence", exception=NotImplementedError, area="multimodal",
       what="a decoder argument tensor that is not along the sequence",
       why="shard_batch cannot shard it (it would be dropped)",
       fix="run this model without context_parallel",
       message="cp_attention: the decoder argument {name!r} of shape {shape} is not along the sequence of {length} "
               "tokens; shard_batch cannot shard it"),
    # -------------------------------------------------------------------------------------------- heads
    _R(key="head_outputs_in_trainer", exception=NotImplementedError, area="heads",
       what="a head whose outputs are gathered (logits_to_keep, pooled / span / token-mean) in a CP trainer",
       why="the outputs are gathered from rows of one sequence; the trainers join micro-batches along it",
       fix="run it through cp.shard_batch and the model, or without a CP trainer",
       message="cp_flash: {name} with {what} under context parallelism gathers its outputs over the group from "
               "rows of one sequence, but the CP trainers join the ranks' micro-batches along the sequence: run "
               "it through cp.shard_batch and the model, or without a CP trainer"),
    _R(key="sequence_pooling", exception=NotImplementedError, area="heads",
       what="a sequence classifier pooling one token other than through gathered per-token scores",
       why="every rank but the one holding that token would pool a token of its own shard",
       fix="run this sequence classifier without context_parallel",
       message="cp_flash: {name} pools one token of each row (its first token, a [CLS] pooler in its base model, "
               "...) other than through per-token scores pooled at the last non-padding token, which cp_attention "
               "gathers; under context parallelism every rank but the one holding that token would pool a token of "
               "its own shard. Run this sequence classifier without context_parallel"),
    _R(key="qa_span_positions", exception=NotImplementedError, area="heads",
       what="start_positions/end_positions for a QA head whose span logits cannot be gathered",
       why="they index the whole sequence; each rank holds a shard",
       fix="compute the span loss from the gathered logits, or run without context_parallel",
       message="cp_flash: {name} reads start_positions/end_positions as indices into the sequence, but each rank "
               "holds a shard of it and its span logits are not per-token outputs of a qa_outputs module that "
               "cp_attention can gather. Compute the span loss from the gathered logits, or run without "
               "context_parallel"),
    _R(key="token_mean_loss", exception=NotImplementedError, area="heads",
       what="labels for a head whose loss is a mean over the tokens it is given",
       why="the ranks' means are not the batch's",
       fix="no labels: the loss from the logits (sum / the batch's label count), or no context_parallel",
       message="cp_flash: {name} takes the mean of its loss over the tokens it is given, which under context "
               "parallelism are this rank's: the ranks' means are not the batch's. Call it without labels and "
               "compute the loss from the logits (sum over the shard / the batch's label count), or run without "
               "context_parallel"),
    _R(key="z_loss_uneven", exception=NotImplementedError, area="heads",
       what="a z-loss (z_loss_coefficient) on a layout that gives the ranks different token counts",
       why="each rank's mean equals the batch's only when every rank holds as many tokens",
       fix="a sequence length the layout splits evenly, or z_loss_coefficient=0",
       message="cp_flash: {name} adds z_loss_coefficient times the mean over its tokens of logsumexp(logits)^2, "
               "which under context parallelism is each rank's mean: it equals the batch's only when every rank "
               "holds as many tokens, and this layout gives them {lengths}. Use a sequence length the layout "
               "splits evenly, or set z_loss_coefficient=0"),
    _R(key="logits_to_keep_with_labels", exception=NotImplementedError, area="heads",
       what="logits_to_keep together with labels",
       why="the kept logits no longer line up with the labels",
       fix="logits_to_keep=0 with labels",
       message="cp_flash: {model} was called with logits_to_keep={keep!r} and labels: the kept logits no longer "
               "line up with the labels. Pass logits_to_keep=0 with labels"),
    _R(key="logits_to_keep_without_ids", exception=NotImplementedError, area="heads",
       what="logits_to_keep without input_ids or inputs_embeds of the shard",
       why="nothing places the kept positions on the ranks",
       fix="pass input_ids or inputs_embeds",
       message="cp_flash: logits_to_keep={keep!r} under context parallelism needs input_ids or inputs_embeds of "
               "the shard to place the kept positions"),
    _R(key="logits_to_keep_no_output_embeddings", exception=NotImplementedError, area="heads",
       what="logits_to_keep on a model without an output embeddings module",
       why="there are no logits to gather from the ranks",
       fix="logits_to_keep=0",
       message="cp_flash: {model} has no output embeddings module whose logits logits_to_keep={keep!r} could "
               "gather; pass logits_to_keep=0"),
    _R(key="num_items_mismatch", exception=ValueError, area="heads",
       what="a num_items_in_batch handed to the model other than the one cp.shard_batch bound",
       why="each rank's loss is P times its share of the batch's label count",
       fix="pass num_items_in_batch to cp.shard_batch and hand the model the value it returns",
       message="cp_flash: num_items_in_batch={value:g} was handed to the model, but the batch cp.shard_batch "
               "returned binds {want:g} (its {items:g} label tokens / {ranks} ranks: each rank's loss is P times "
               "its share). To count over accumulated micro-batches, pass num_items_in_batch to cp.shard_batch, "
               "and hand the model the value it returns"),
    _R(key="router_loss_unknown", exception=NotImplementedError, area="heads",
       what="a MoE router loss function that is not the Switch-Transformer balance cp_attention reduces",
       why="it cannot be taken over the whole batch from the ranks' shards",
       fix="output_router_logits=False (TRL: router_aux_loss_coef=0.0), or no context_parallel",
       message="cp_flash: the MoE router loss {name} cannot be computed under context parallelism: {reason}. Turn "
               "it off (output_router_logits=False; TRL: router_aux_loss_coef=0.0) or run without context_parallel"),
    _R(key="router_logits_not_per_token", exception=NotImplementedError, area="heads",
       what="router logits that are not one row per token of the rank's shard",
       why="the router loss cannot be taken over the batch",
       fix="output_router_logits=False, or no context_parallel",
       message="cp_flash: {name} got router logits of {shapes}, not one row per token of this rank's shard "
               "({tokens}); the router loss cannot be taken over the batch"),
    # ------------------------------------------------------------------------------------------ trainer
    _R(key="trainer_local_loss", exception=ValueError, area="trainer",
       what="label smoothing or compute_loss_func in CPTrainer",
       why="they see only each rank's local logits and labels",
       fix="label_smoothing_factor=0 and no compute_loss_func",
       message="{name} computes the loss inside the model on each rank's shard; label smoothing and "
               "compute_loss_func see only local logits and labels: set label_smoothing_factor=0 and drop "
               "compute_loss_func"),
    _R(key="trainer_local_token_average", exception=ValueError, area="trainer",
       what="average_tokens_across_devices=False in CPTrainer",
       why="each process's loss would be normalised by its own tokens, not the global batch's",
       fix="average_tokens_across_devices=True",
       message="{name} needs average_tokens_across_devices=True: each rank's loss must be normalised by the label "
               "tokens of the whole global batch"),
    _R(key="trainer_not_cp_flash", exception=ValueError, area="trainer",
       what="CPTrainer on a model loaded without attn_implementation='cp_flash'",
       why="only cp_flash attends across the ranks' shards",
       fix="load the model with attn_implementation='cp_flash'",
       message="{name} trains models loaded with attn_implementation='cp_flash', this one uses {implementation!r}"),
    _R(key="trainer_row_head", exception=ValueError, area="trainer",
       what="CPTrainer on a model whose head reads one output per row (a pooled token or a span)",
       why="the trainer joins the ranks' micro-batches along the sequence",
       fix="cp.shard_batch and the model's forward, or train it without CPTrainer",
       message="{name} joins the ranks' micro-batches along the sequence, but {model} reads one output per row (a "
               "pooled token or a span): run it with cp.shard_batch and the model's forward (exact under context "
               "parallelism), or train it without {name}"),
    _R(key="trainer_z_loss", exception=ValueError, area="trainer",
       what="CPTrainer on a model with a z-loss (z_loss_coefficient > 0)",
       why="a mean over each rank's tokens, which Trainer's loss scaling multiplies by the processes",
       fix="z_loss_coefficient=0, or cp.shard_batch and the model's forward",
       message="{name}: {model} adds a z-loss (z_loss_coefficient) that is a mean over each rank's tokens; "
               "Trainer's loss scaling would multiply it by the number of processes. Set z_loss_coefficient=0, or "
               "train it through cp.shard_batch and the model's forward"),
    _R(key="trainer_router_loss", exception=ValueError, area="trainer",
       what="a MoE router auxiliary loss in a CP trainer that overrides compute_loss",
       why="how it weighs the auxiliary loss across processes is unknown",
       fix="output_router_logits=False, or Trainer / TRL's SFTTrainer without a new compute_loss",
       message="{name} overrides compute_loss, so how it weighs the MoE router auxiliary loss across processes is "
               "unknown and cp_attention cannot take it over the batch exactly: set the config's "
               "output_router_logits=False, or subclass Trainer or TRL's SFTTrainer without changing compute_loss"),
    _R(key="rl_parallelism_config", exception=ValueError, area="trainer",
       what="accelerate's own context or sequence parallelism (parallelism_config) in a CP post-training trainer",
       why="the batch would be sharded twice: by accelerate's torch CP and by cp_attention",
       fix="drop parallelism_config's cp_size/sp_size; the trainer's cp_group sets the CP ranks",
       message="{name} shards the sequences itself (cp_group); the configuration's parallelism_config also asks "
               "accelerate for context or sequence parallelism, which would shard them again: drop its "
               "cp_size / sp_size"),
    _R(key="rl_multimodal", exception=NotImplementedError, area="trainer",
       what="a vision-language model in a CP post-training trainer (GRPO, RLOO)",
       why="the image inputs travel with each rank's rows, which are packed and sharded as text only",
       fix="train the vision-language model without the CP trainer, or its text model alone",
       message="{name} packs and shards the rows' tokens only; a vision-language model's image inputs are not "
               "packed with them. Train it without {name}, or its text model alone"),
    _R(key="rl_continuous_batching", exception=NotImplementedError, area="trainer",
       what="use_transformers_continuous_batching in a CP post-training trainer",
       why="paged generation through cp_flash is not tested",
       fix="use_transformers_continuous_batching=False (plain generate) or vLLM",
       message="{name}: use_transformers_continuous_batching runs paged generation, which cp_flash is not tested "
               "with; set it to False (generation then uses model.generate on each process) or use vLLM"),
    _R(key="rl_no_fused_head", exception=NotImplementedError, area="trainer",
       what="a CP post-training trainer whose TRL did not install its fused LM head",
       why="the trainer scores sequences through the fused head's forward, which is where CP enters",
       fix="TRL 1.16 (the version tested), whose GRPO, RLOO and DPO trainers install add_fused_lm_head",
       message="{name}: the {role} ({model}) has no fused LM head forward (TRL's add_fused_lm_head); this TRL "
               "version scores differently and cp_attention cannot route its forwards. Use TRL 1.16"),
    _R(key="packed_rows_not_contiguous", exception=NotImplementedError, area="trainer",
       what="a scored row whose attended tokens are not one span, or a label outside it or on its first token",
       why="each row is packed as one document of its attended tokens; a hole would join tokens it does not "
           "attend across, and such a label predicts a token the row does not attend",
       fix="left- and right-padded rows only (TRL's own layout), labels -100 on padding and on the first token",
       message="{name}: rows {holes} attend to tokens that are not one contiguous span, rows {stray} have labels "
               "on unattended columns and rows {opening} on their first attended token; under context "
               "parallelism each row is packed as one document of its attended tokens. Pad rows on the left "
               "and right only, with -100 labels there and on each row's first token"),
    _R(key="packed_rows_inputs", exception=NotImplementedError, area="trainer",
       what="a fused log-probability forward under CP with inputs other than the tokens (images, token types)",
       why="only the rows' tokens, positions and labels are packed and sharded",
       fix="a text-only model and batch",
       message="{name}: the fused forward got {keys}; under context parallelism only input_ids, attention_mask, "
               "labels and position_ids are packed and sharded. Train a text-only model and batch"),
    _R(key="packed_rows_router_loss_own", exception=NotImplementedError, area="trainer",
       what="a MoE router auxiliary loss of each rank's own rows under CP (not a joined batch)",
       why="the group's router loss is one number over all the rows; a rank's own rows have no exact share of it",
       fix="request router logits only on the joined batch (the trainers do)",
       message="{name}: router logits were requested on each rank's own rows; the router loss under context "
               "parallelism is the group's, over the joined batch. Request them on the joined batch only"),
    _R(key="trainer_uneven_rows", exception=ValueError, area="trainer",
       what="CP group ranks' micro-batches with different numbers of rows",
       why="they are joined row by row along the sequence",
       fix="dataloader_drop_last=True, or DataCollatorWithFlattening (always 1 row)",
       message="CPTrainer: the ranks of a context-parallel group got micro-batches of {rows} rows; they are joined "
               "row by row, so they need the same number of rows: set dataloader_drop_last=True, or pack with "
               "DataCollatorWithFlattening (always 1 row)"),
)
"""Every refusal, key -> :class:`Refusal`, ordered by area (:data:`AREAS`)."""
