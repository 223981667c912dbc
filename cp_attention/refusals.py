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
stays where it is checked; so do the model check's findings (:mod:`cp_attention.integrations.hf.check`
keeps its own table of rules; its verdict is the ``model_check`` refusal).

A ground-layer module: it imports nothing from the package but the rest of its catalogue
(:mod:`cp_attention.refusals_models`, the model check's, the guard's and multimodal batches' refusals;
:mod:`cp_attention.refusals_training`, the heads' and trainers').
"""

from __future__ import annotations

import string
import types
from dataclasses import dataclass

from .refusals_models import MODELS
from .refusals_training import TRAINING

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
        exc = self.exception(self.message.format(**fields))
        exc.refusal = self.key  # which refusal, for tools that report it (python -m cp_attention check)
        return exc


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
               "cp_attention.integrations.trainers.trainer, without torch's context_parallel (or use "
               "attn_implementation='sdpa' with torch's context_parallel, for plain causal masks only)"),
    _R(key="unsharded_inputs", exception=ValueError, area="context",
       what="a cp_flash layer under context parallelism on tensors cp.shard_batch did not return",
       why="without the batch's record the layer knows neither the global positions nor the documents",
       fix="shard the inputs with cp.shard_batch(...) and pass its outputs to the model",
       message="cp_flash under context parallelism needs the batch's global positions: shard the inputs with "
               "cp.shard_batch(input_ids=..., position_ids=..., labels=...) and pass its outputs to the model. "
               "model.generate(use_cache=False) inside the block ends here too (without a cache every step reruns "
               "the whole sequence, unsharded): generate with its cache (use_cache=True, the default: the prompt "
               "and the KV cache are sharded over the group), or outside the block"),
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
       what="a model numbering its default positions from padding_idx + 1 (or its kept position_ids) on a batch "
            "shard_batch numbered from 0",
       why="the shards' positions would not be the model's own",
       fix="pass position_ids, or model=... to cp.shard_batch",
       message="cp_flash: {family} numbers its default positions from {start} (padding_idx + 1, or the "
               "position_ids it keeps), but cp.shard_batch was given no position_ids and numbered them from 0: pass "
               "position_ids ({start} + each token's offset in its document), or pass model=... to cp.shard_batch so "
               "it numbers them as the model does"),
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
       what="a forward with a KV cache that context parallelism did not shard",
       why="the ring exchanges the shards of one sequence; only generate's own cache is sharded (from its first "
           "forward)",
       fix="model.generate inside the block from an empty cache, or use_cache=False",
       message="cp_flash: a non-empty KV cache that context parallelism did not shard (queries {queries} from "
               "position {offset}, keys {keys}); run model.generate inside cp_attention.context_parallel() from an "
               "empty cache (its first forward shards the prompt and the cache), or call the model with "
               "use_cache=False"),
    _R(key="generation_cache", exception=NotImplementedError, area="cache",
       what="generation under context parallelism with a cache other than the dynamic one (static, offloaded, "
            "quantized)",
       why="only the dynamic cache's layers are sharded by sequence; the others hold one device's fixed slots",
       fix="the default cache (no cache_implementation, no offloading), or generate outside context_parallel",
       message="cp_flash: generation under context parallelism shards transformers' dynamic cache (the default); "
               "layer {layer} of this cache is a {kind}. Generate with the default cache (no "
               "cache_implementation=..., no offloading), or outside cp_attention.context_parallel()"),
    _R(key="generation_own_cache", exception=NotImplementedError, area="cache",
       what="generation under context parallelism of a model whose forward builds a cache of its own class "
            "(MiniMax; Mamba and Mamba-2 on transformers 5.17)",
       why="its cache is not transformers' dynamic cache: it cannot be sharded by sequence",
       fix="generate outside context_parallel",
       message="cp_flash: {model} builds a cache of its own class inside its forward, which context parallelism "
               "cannot shard by sequence; generate with it outside cp_attention.context_parallel()"),
    _R(key="generation_ranks_differ", exception=ValueError, area="cache",
       what="generation whose ranks were handed different tokens (the prompt, or a sampled token)",
       why="the ranks decode one sequence together, each holding a part of its cache",
       fix="the same prompt on every rank, and one seed on every rank before sampling",
       message="cp_flash: the ranks of the context-parallel group were handed different tokens for {what}; "
               "generation under context parallelism decodes one sequence on every rank: pass every rank the same "
               "prompt, and seed every rank the same before sampling (transformers.set_seed(seed))"),
    _R(key="generation_crop", exception=NotImplementedError, area="cache",
       what="rolling a sharded cache back past keys its window or chunk already dropped",
       why="the dropped keys are gone from every rank",
       fix="roll back only the tokens of the last step (as assisted decoding does)",
       message="cp_flash: layer {layer}'s sharded cache was asked to go back from {length} to {end} tokens, but "
               "its window or chunk already dropped the keys before position {held}, which a query at {end} sees"),
    _R(key="generation_compiled", exception=NotImplementedError, area="cache",
       what="a torch.compile'd forward with a KV cache under context parallelism",
       why="the sharded cache's bookkeeping (positions, owners, the merge over ranks) runs in Python per step",
       fix="generate with the model itself, not its compiled wrapper",
       message="cp_flash: {model} was called compiled with a KV cache under context parallelism; generation "
               "there runs uncompiled: call generate (or the forward with a cache) on the model itself"),
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
    _R(key="mixer_call_unknown", exception=NotImplementedError, area="context",
       what="a call of an adapted sequence-mixer function that does not fit the adapter's calling convention",
       why="the adapter would read the wrong arguments",
       fix="the transformers release the suite tests (see the README), or run the model without context_parallel",
       message="cp_flash: transformers {version} calls {name} in a way cp_attention's adapter does not know ({why}); "
               "under context parallelism it would read the wrong arguments. Use a transformers release "
               "cp_attention tests (see its README), or run without context_parallel"),
    _R(key="adapted_class_declined", exception=NotImplementedError, area="context",
       what="an adapted class (a mixer, an indexer) that does not compute what cp_attention's adapter assumes "
            "(its check at first use)",
       why="the adapter would compute something else than the class across ranks",
       fix="the transformers release the suite tests (see the README), or run the model without context_parallel",
       message="cp_flash: transformers {version}'s {name} does not do what cp_attention's adapter assumes ({why}); "
               "under context parallelism it would compute something else than on one device. Use a transformers "
               "release cp_attention tests (see its README), or run without context_parallel"),
    _R(key="mixer_forward_bypassed", exception=NotImplementedError, area="context",
       what="a mixer's step function that computed its mixing without the adapted functions (a hub kernel)",
       why="it would mix only this shard's tokens",
       fix="load the model without hub kernels (use_kernels=False), or run without context_parallel",
       message="cp_flash: {name} (transformers {version}) computed its sequence mixing without the functions "
               "cp_attention runs across ranks (a hub kernel replaced it?), so it would mix only this shard's "
               "tokens. Load the model with use_kernels=False, or run without context_parallel"),
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
    *(Refusal(**entry) for entry in MODELS),  # the models' and multimodal batches' (.refusals_models)
    *(Refusal(**entry) for entry in TRAINING),  # the heads' and trainers' (.refusals_training)
)
"""Every refusal, key -> :class:`Refusal`, ordered by area (:data:`AREAS`)."""
