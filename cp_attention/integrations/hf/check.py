"""The model check: whether "cp_flash" computes a transformers model exactly under context parallelism,
decided before any rank computes.

Under context parallelism each rank holds a shard of the sequence. A model is exact only if every
operation that mixes tokens along the sequence is done by the library, which sees the whole sequence:
the attention interface (and so "cp_flash") and the adapted sequence mixers; anything else that looks
along the sequence sees its own shard only and is silently wrong. The check reads what the model does,
not what its source looks like (:func:`model_findings`):

* the trace (:mod:`.token_trace`): two tiny forwards on one device, one token changed, with the attention
  and the adapted mixers answering per token; any other operation that makes one token's output depend on
  another's is refused, naming the module, the operation and its source line (a convolution or a token
  shift, a recurrent state, attention computed outside the interface, a running sum, a pool, a roll, a
  sort, a product contracting the tokens, a gather by position, ...). A forward that cp_flash itself
  refuses (its code reads the mask as a dense tensor, it hands the attention a score bias or a selection
  of keys cp_flash cannot apply) is a finding too, with that refusal's message;

and the rules for what a forward on one device cannot show:

* a sequence mixer function that transformers changed (:mod:`.mixers`' admission by behaviour declined it):
  left unadapted, it would mix only the shard's tokens;
* a length-dependent rope (``dynamic``, ``longrope``) in a rotary module whose forward takes no
  ``position_ids``: it cannot be given the whole sequence's length (:mod:`.rope`; those that take
  them are hooked on the first forward in a block and computed from the global largest position);
* positions computed from the shard: the model's forward takes no ``position_ids`` and it uses
  positions (a positional module, or attention layers: :func:`uses_positions`), so each rank would
  number its learned or sinusoidal positions from 0 (the BART-family decoders, XGLM, ...). A model of
  sequence mixers alone (Mamba, Mamba-2, Falcon-Mamba) is not refused for it: it reads no positions,
  and its mixers take the documents from the batch record.

Handled mixers (issue 21): the module-level functions :mod:`.mixers` adapts (``causal_conv1d_fn``,
``torch_chunk_gated_delta_rule``, ``mamba2_chunk_scan``, ``mamba_selective_scan``) and the mixer classes
:mod:`.recurrent` adapts run across ranks and documents (a halo for the convolution, a scan over pieces for
the recurrence), so they are exact; the trace lets them answer per token and reads everything around them.

Vision, audio and other sub-models with a configuration of their own are not read: they do not
run over the text sequence.

In a one-rank block only one finding changes the result: a model whose forward takes no
``position_ids`` on a batch of packed documents (:func:`check_positions_one_rank`). Without a block,
``position_ids`` such a family receives through keyword arguments are not its positions: its layers
treat the row as one sequence, as its own eager does (:func:`layer_position_ids`).

Checked once per model object (:data:`cp_attention.integrations.hf.state.MODEL_CHECKS`) when a multi-rank
:func:`~cp_attention.context_parallel` block runs its first forward, on every rank alike (the
model is the same everywhere), so every rank raises the same ``NotImplementedError`` before a K/V
block moves. A second guard counts, during each forward of a cp_flash model inside such a block,
the attention modules that ran and the calls that reached cp_flash: if they differ (a layer that
chose another implementation, or a class that picks its attention by name), the forward raises on
every rank before its outputs can be used. Code traced by ``torch.compile`` is not counted (the
hooks return at once there, leaving dynamo nothing to guard on); the model check still runs, on the
compiled model's own module.
"""

from __future__ import annotations

import functools
import re
import sys

import torch

from .source import forward_args as _forward_args
from .source import uses_attention_interface
from . import state
from ..patches import record
from ...engine.batch import batch_of
from ...engine.context import active_context, register_context_guard
from ...engine.stats import begin_mixers
from ...refusals import refuse
from .heads import call_kwargs, prepare_call
from .adapters.compressed import adapted_compressor
from .adapters.indexers import adapted_indexer
from .multimodal import refuse_media
from .adapters.mixer_functions import MIXER_ATTR, declined, tag_mixers
from .versions import transformers_version
from .generation import finish_prefill, generation_call, start_decode, start_prefill
from .adapters.mixer_classes import adapted_class
from .adapters.rope import rope_findings, tag_ropes
from .verification import verify_first_use
from .token_trace import REFUSED as TRACE_REFUSED, model_trace

__all__ = ["Finding", "model_findings", "check_model", "check_positions_one_rank", "positional_modules",
           "uses_positions", "default_position_start", "unwrap_adapters", "install_guard", "note_cp_flash_call",
           "guard_sub_model",
           "family_takes_positions", "layer_position_ids"]

NAME = "cp_flash"

# a module that turns positions into a signal: by its class (learned / sinusoidal / rotary / segment
# position embeddings) or by the attribute it sits in (``embed_positions``, GPT-2's ``wpe``, ``rotary_emb``)
_POSITIONAL_CLASS = re.compile(r"Positional|PositionEmbedding|Rotary|Sinusoidal|Rope", re.I)
_POSITIONAL_ATTR = re.compile(r"^(?:embed_positions|position_embeddings?|pos_emb\w*|wpe|rotary_emb\w*|rope\w*)$")


class Finding(tuple):
    """One reason a model is refused: ``(module, what, why)``; ``module`` is the qualified name."""

    __slots__ = ()

    def __new__(cls, module: str, what: str, why: str):
        return super().__new__(cls, (module, what, why))

    module = property(lambda self: self[0])
    what = property(lambda self: self[1])
    why = property(lambda self: self[2])


def _is_model_class(cls: type) -> bool:
    return getattr(cls, "base_model_prefix", None) is not None


def _is_model(module) -> bool:
    """A transformers PreTrainedModel (its class says so: wrappers such as torch.compile's forward
    attribute lookups to the model they wrap, and are not one)."""
    return _is_model_class(type(module))


def _text_configs(model) -> tuple:
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None) if config is not None else None
    return tuple(c for c in (config, text) if c is not None)


def _modules(model):
    """``model``'s modules over the text sequence: sub-models with a configuration of their own
    (vision or audio towers) are skipped."""
    own = {id(c) for c in _text_configs(model)}

    def walk(module, prefix):
        yield prefix, module
        for name, child in module.named_children():
            config = getattr(child, "config", None)
            if config is not None and hasattr(config, "to_dict") and id(config) not in own \
                    and _is_model(child) and id(getattr(config, "text_config", None)) not in own:
                continue
            yield from walk(child, f"{prefix}.{name}" if prefix else name)

    yield from walk(model, "")


def model_findings(model) -> tuple[Finding, ...]:
    """Every reason ``model`` cannot run exactly under context parallelism (empty: it can): the rules the trace
    cannot see (a mixer function transformers changed, a rope from the shard's length, positions numbered from
    the shard), then, for a cp_flash model none of them refused, what its forward does (:mod:`.token_trace`)."""
    findings: list[Finding] = []
    seen_modules: set[str] = set()
    for name, module in _modules(model):
        where = name or type(module).__name__
        cls = type(module)
        if cls.__module__ not in seen_modules:
            seen_modules.add(cls.__module__)
            for function, why in sorted(declined(cls.__module__).items()):
                findings.append(Finding(where, "a sequence mixer function not admitted",
                                        f"transformers {transformers_version()}'s {cls.__module__}.{function} does "
                                        f"not do what cp_attention's adapter assumes ({why}), so it was left "
                                        "unadapted and would mix only this shard's tokens"))
    for where, why in rope_findings(_modules(model)):
        findings.append(Finding(where, "a rope computed from the shard's length", why))
    forward_args = _forward_args(type(model))
    if "position_ids" not in forward_args and uses_positions(model):
        findings.append(Finding(type(model).__name__, "positions computed from the shard",
                                "its forward takes no position_ids, so every rank would number its positions "
                                "from 0 instead of the tokens' places in the sequence"))
    if _cp_flash_model(model) and not findings:  # what the model does (.token_trace), unless a rule refused it
        for where, what, why in model_trace(model, list(_modules(model)),
                                            lambda m: adapted_class(type(m)) or adapted_compressor(type(m)),
                                            "position_ids" in forward_args):
            findings.append(Finding(where, what, why))
    return tuple(dict.fromkeys(findings))


def positional_modules(model) -> tuple[str, ...]:
    """The modules of ``model`` over the text sequence that turn positions into a signal (learned,
    sinusoidal, segment or rotary position embeddings), by class name or attribute name."""
    return tuple(name for name, module in _modules(model)
                 if _POSITIONAL_CLASS.search(type(module).__name__) or _POSITIONAL_ATTR.match(name.rpartition(".")[2]))


def uses_positions(model) -> bool:
    """Whether ``model`` reads its tokens' positions: it has a positional module, or an attention
    layer (whose documents and positions come from ``position_ids``; a class that computes its own
    scores may add a position bias such as ALiBi). A model of sequence mixers alone (Mamba, RWKV,
    xLSTM) uses no positions: its documents reach its mixers through the batch ``cp.shard_batch``
    recorded, so its forward needs no ``position_ids``."""
    if positional_modules(model):
        return True
    return any(uses_attention_interface(type(m)) for _, m in _modules(model)
               if not type(m).__module__.startswith("torch."))


def _family(model) -> str:
    configs = _text_configs(model)
    return next((getattr(c, "model_type", "") for c in configs if getattr(c, "model_type", "")), type(model).__name__)


def _cached_findings(model) -> tuple[Finding, ...]:
    """:func:`model_findings`, once per model object (:data:`state.MODEL_CHECKS`)."""
    with state.MODEL_LOCK:
        findings = state.MODEL_CHECKS.get(model)
    if findings is None:
        findings = model_findings(model)
        with state.MODEL_LOCK:
            state.MODEL_CHECKS[model] = findings
    return findings


def check_model(model, plain: bool = True) -> None:
    """Raise ``NotImplementedError`` naming the family, the modules and why, if ``model`` cannot run
    exactly under context parallelism (see the module docstring). Cached per model object. ``plain=False``
    (generate's prefill, which runs with a cache): a refusal the trace met on the plain forward without a cache
    is not counted (the cache path is another; cp_flash still refuses at run time what it cannot apply there)."""
    findings = _cached_findings(model)
    if not plain:
        findings = tuple(f for f in findings if f.what != TRACE_REFUSED)
    if not findings:
        return
    lines = []
    for what in dict.fromkeys(f.what for f in findings):
        group = [f for f in findings if f.what == what]
        names = ", ".join(f.module for f in group[:3]) + (f" (and {len(group) - 3} more)" if len(group) > 3 else "")
        lines.append(f"  - {what} in {names}: {group[0].why}")
    raise refuse("model_check", family=_family(model), model=type(model).__name__, findings="\n".join(lines))


def _packed(meta) -> bool:
    """Whether a row of ``meta`` holds a document of two or more tokens that does not open the row
    (padding tokens are one-token documents of their own and do not count)."""
    starts = getattr(meta, "doc_start", None)
    if starts is None or starts.shape[-1] < 3:
        return False
    opens = starts == torch.arange(starts.shape[-1])
    return bool((opens[:, 1:-1] & (starts[:, 2:] == starts[:, 1:-1])).any())


def check_positions_one_rank(model, record) -> None:
    """In a one-rank ``context_parallel`` block, the one finding that changes the result there: a
    model whose forward takes no ``position_ids`` numbers its positions over the whole row, so on
    packed documents (``record``: the batch ``cp.shard_batch`` recorded) its positions cannot restart
    per document while its attention keeps the documents apart; neither each document alone nor the
    family's own eager (which attends across them). Raises ``NotImplementedError``; nothing otherwise."""
    if "position_ids" in _forward_args(type(model)) or record is None or not hasattr(record, "meta"):
        return
    if not any(f.what == "positions computed from the shard" for f in _cached_findings(model)):
        return  # it uses no positions (mixers alone): they read the documents from the batch record
    if _packed(record.meta):
        raise refuse("packed_without_position_ids", family=_family(model), model=type(model).__name__)


@functools.lru_cache(maxsize=None)
def family_takes_positions(module_name: str) -> bool:
    """Whether a model class of the modeling module ``module_name`` (an attention class's) takes
    ``position_ids`` in its forward. False for families that number their positions themselves
    (the BART-family decoders, MusicGen): ``position_ids`` reach their attention only through
    keyword arguments, and their positions run over the whole row whatever they say."""
    mod = sys.modules.get(module_name)
    if mod is None or not module_name.startswith("transformers.models."):
        return True
    for value in vars(mod).values():
        if isinstance(value, type) and value.__module__ == module_name and _is_model_class(value) and \
                "position_ids" in _forward_args(value):
            return True
    return False


def layer_position_ids(module, position_ids, collator_documents: bool):
    """The ``position_ids`` a cp_flash layer of ``module`` reads its documents from: those it was
    handed, except, outside a context (not from ``cp.shard_batch``), in a family that numbers its
    positions itself (:func:`family_takes_positions`): there they are not its positions, and the row
    is one sequence as in the family's own eager (None). Packed documents given by a collator's
    ``cu_seq_lens`` raise NotImplementedError there: they would get the row's positions. Rows of
    M-RoPE positions ``(k, B, L)`` are None: their documents are the mask's (transformers' packed
    detection on the text positions, or the batch ``cp.shard_batch`` recorded)."""
    if isinstance(position_ids, torch.Tensor) and position_ids.dim() == 3:
        return None  # M-RoPE rows (GLM-4V, ERNIE-VL): the documents are the mask's (its text positions, the batch's)
    if family_takes_positions(type(module).__module__):
        return position_ids
    if position_ids is not None and batch_of(position_ids) is not None:
        return position_ids  # from shard_batch: the model check decides (refused when packed)
    if collator_documents:
        family = str(getattr(getattr(module, "config", None), "model_type", "") or type(module).__name__)
        raise refuse("collator_packed_without_position_ids", family=family)
    return None


def unwrap_adapters(model):
    """The transformers model inside a PEFT wrapper (``PeftModel``: its forward hands the batch to the
    base model unchanged for the weight adapters, LoRA, DoRA, IA3, ...), or ``model`` itself. Prompt
    learning (prompt, prefix and p-tuning) raises NotImplementedError naming the PEFT type: its virtual
    tokens would be prepended to each rank's shard instead of to the sequence."""
    config = getattr(model, "active_peft_config", None)
    get_base = getattr(model, "get_base_model", None)
    if config is None or not callable(get_base):
        return model
    if getattr(config, "is_prompt_learning", False):
        kind = getattr(getattr(config, "peft_type", None), "value", None) or type(config).__name__
        raise refuse("peft_prompt_learning", kind=kind, tokens=getattr(config, "num_virtual_tokens", "its"))
    return get_base()


def default_position_start(model) -> int:
    """Where ``model`` numbers its default positions: 0, or ``padding_idx + 1`` for a position
    embedding with a padding index (RoBERTa, XLM-R, CamemBERT, data2vec-text, X-MOD; the sinusoidal
    tables of Kosmos-2.5, M2M100 and XGLM), or the first of the default positions a module keeps as its
    ``position_ids`` buffer when that is not 0 (MRA's and YOSO's, from 2). Read once per model object
    (:data:`state.POSITION_STARTS`)."""
    with state.MODEL_LOCK:
        start = state.POSITION_STARTS.get(model)
    if start is None:
        start = _position_start(model)
        with state.MODEL_LOCK:
            state.POSITION_STARTS[model] = start
    return start


def _position_start(model) -> int:
    modules = list(_modules(model))
    for name, module in modules:
        padding_idx = getattr(module, "padding_idx", None)
        if "position" in name.rsplit(".", 1)[-1] and isinstance(padding_idx, int) and not isinstance(padding_idx, bool):
            return padding_idx + 1  # a learned (nn.Embedding) or sinusoidal table (Kosmos-2.5, M2M100, XGLM)
    for _, module in modules:  # the default positions themselves, as the model keeps them
        kept = getattr(module, "_buffers", {}).get("position_ids")
        if isinstance(kept, torch.Tensor) and kept.numel() and not kept.is_floating_point() and not kept.is_meta \
                and int(kept.reshape(-1)[0]):
            return int(kept.reshape(-1)[0])
    return 0


# ----------------------------------------------------------------------------------------------
# the guard of a multi-rank context_parallel block


def _cp_flash_model(module) -> bool:
    if not _is_model(module):
        return False
    return any(getattr(c, "_attn_implementation", None) == NAME for c in _text_configs(module))


def _top(module):
    """The transformers model a call of ``module`` runs: itself, or the one inside a PEFT wrapper
    (whose forward calls the model's ``forward`` directly, past its hooks)."""
    if not _is_model(module) and callable(getattr(module, "get_base_model", None)) and \
            getattr(module, "active_peft_config", None) is not None:
        return module.get_base_model()
    return module


def _before(module, args):
    if torch.compiler.is_compiling():  # traced code: nothing to count, no state for dynamo to guard on
        return None
    compiled = hasattr(module, "_orig_mod")
    module = getattr(module, "_orig_mod", module)  # torch.compile's wrapper: the model it compiles
    guard = state.MODEL_GUARD
    if getattr(module, MIXER_ATTR, False):  # a tagged mixer runs: its functions go across ranks
        guard.mixers = getattr(guard, "mixers", 0) + 1
    top = getattr(guard, "model", None)
    if top is None:
        active = active_context()
        inner = _top(module) if active is not None else module
        if active is None or not _cp_flash_model(inner):
            return None
        if not getattr(inner, "_cp_attention_mixers_tagged", False):
            modules = list(_modules(inner))
            tag_mixers(inner, modules)
            tag_ropes(modules)
            inner._cp_attention_mixers_tagged = True
        begin_mixers()  # forward_mixer_stats: this forward's
        guard.head = None
        if active.world_size <= 1:  # one rank: only the packed-positions check, no counting
            check_positions_one_rank(inner, active.current_batch())
            guard.model, guard.ran, guard.reached, guard.counting, guard.position_start = module, set(), set(), False, 0
            return None
        if inner is not module:
            unwrap_adapters(module)  # prompt learning: refused, naming its PEFT type
        gen = generation_call(inner, call_kwargs(),
                              lambda: any(uses_attention_interface(type(m)) for _, m in _modules(inner)))
        if gen is not None and compiled:
            raise refuse("generation_compiled", model=type(inner).__name__)
        if gen is not None and gen[0] == "decode":  # a decode step over the sharded cache: replicated but attention
            start_decode(gen[1], call_kwargs())
            guard.model, guard.ran, guard.reached, guard.counting, guard.decode = module, set(), set(), False, gen[1]
            guard.record, guard.position_start = None, 0
            return None
        check_model(inner, plain=gen is None)
        if gen is None:
            refuse_media(inner, call_kwargs())
        if getattr(active, "verify", True) and gen is None:  # (generate's prefill: its plain forwards are verified)
            verify_first_use(inner, active, _packed_call(args, call_kwargs()), lambda: any(
                getattr(m, MIXER_ATTR, False) or adapted_class(type(m)) or adapted_indexer(type(m)) or
                adapted_compressor(type(m)) for _, m in _modules(inner)))
            begin_mixers()
        if gen is not None:  # generate's first forward: sharded here, the cache too (finished in _after)
            guard.prefill = start_prefill(inner, call_kwargs(), gen[1], active)
        try:  # what its head does with the shard (.heads): refused, or the substitutions of this forward
            guard.head, new_args = prepare_call(inner, args, call_kwargs(), active, compiled=compiled)
        except BaseException:
            guard.prefill = None
            raise
        # the batch this forward runs on, named by its tensors: a mixer asks for it (several may be alive)
        record, start = _call_batch(new_args or args, call_kwargs()), default_position_start(inner)
        if record is not None and not getattr(record, "positions_given", True) and start:
            guard.prefill = guard.head = None  # (a model whose attention never reaches cp_flash: refused here)
            raise refuse("position_start", family=_family(inner), start=start)
        guard.model, guard.ran, guard.reached, guard.counting = module, set(), set(), True
        guard.record, guard.position_start = record, start
        return new_args
    if getattr(guard, "record", None) is None and _is_model(module):  # a wrapper's forward shards, then calls
        guard.record = _call_batch(args, call_kwargs())                   # its model (TRL's fused head)
    head = getattr(guard, "head", None)
    if head is not None and module is head.base:
        return head.base_args(args, call_kwargs())
    if getattr(getattr(module, "config", None), "_attn_implementation", None) == NAME and \
            not _is_model(module) and uses_attention_interface(type(module)):
        guard.ran.add(id(module))
    return None


def _packed_call(args: tuple, kwargs: dict | None) -> bool:
    """Whether the forward's batch (from ``cp.shard_batch``) packs documents in a row: read from its host-side
    documents once per batch (kept with the record), not once per forward."""
    record = _call_batch(args, kwargs)
    if record is None or not hasattr(record, "meta"):
        return False
    if "packed" not in record.extras:
        record.extras["packed"] = _packed(record.meta)
    return record.extras["packed"]


def _call_batch(args: tuple, kwargs: dict | None):
    """The sharded batch a module call's tensors are bound to (None: none)."""
    return batch_of(*(a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)))


def _after(module, args, output):
    if torch.compiler.is_compiling():
        return None
    module = getattr(module, "_orig_mod", module)
    guard = state.MODEL_GUARD
    if getattr(module, MIXER_ATTR, False):
        guard.mixers = max(0, getattr(guard, "mixers", 0) - 1)
    head = getattr(guard, "head", None)
    if head is not None and id(module) in head.targets:
        return head.gathered(output)  # a head module's per-token output, in sequence order on every rank
    if getattr(guard, "model", None) is not module:
        return None
    guard.model, guard.head, guard.record, guard.decode = None, None, None, None
    prefill, guard.prefill = getattr(guard, "prefill", None), None
    if prefill is not None and output is not None:  # (None: the forward raised)
        finish_prefill(prefill)
    # every attention module that ran must have reached cp_flash (some call it more than once: DiffLlama's
    # two softmaxes); a module that hands the interface another module object counts as that one
    missing, foreign = guard.ran - guard.reached, guard.reached - guard.ran
    if output is not None and len(missing) > len(foreign) and getattr(guard, "counting", True):
        raise refuse("layers_bypassed_cp_flash", ran=len(guard.ran), family=_family(module),
                     model=type(module).__name__, missing=len(missing) - len(foreign))


def note_cp_flash_call(module) -> None:
    """Called by the cp_flash attention function: ``module``'s attention reached cp_flash."""
    if torch.compiler.is_compiling():  # a compiled forward is not counted (its modules are not either)
        return
    guard = state.MODEL_GUARD
    if getattr(guard, "model", None) is not None:
        guard.reached.add(id(module))


def guard_sub_model(module) -> str | None:
    """Under the guard of a multi-rank block: the name of ``module`` when it is an attention layer of a
    sub-model with a configuration of its own (a vision or audio tower), whose tokens are an image's or
    a clip's, not the text sequence the block shards; None otherwise (and outside such a block)."""
    guard = state.MODEL_GUARD
    top = getattr(guard, "model", None)
    if top is None or not getattr(guard, "counting", False):
        return None
    top = _top(top)
    config = getattr(module, "config", None)
    top_config = getattr(top, "config", None)
    text = top_config.get_text_config() if hasattr(top_config, "get_text_config") else top_config
    if config is None or config is top_config or config is text or \
            getattr(config, "model_type", None) == getattr(text, "model_type", None):
        return None
    return f"{type(module).__name__} ({getattr(config, 'model_type', type(config).__name__)})"


def guard_position_start() -> int:
    """The default position start of the model whose forward is running under the guard (0: none)."""
    guard = state.MODEL_GUARD
    return getattr(guard, "position_start", 0) if getattr(guard, "model", None) is not None else 0


def _enter(cp):
    """A block opens: the module hooks are installed (once per process, and then kept: hooks added
    and removed per block would make torch.compile recompile for every block). They return at once
    outside a block and for every model that does not use cp_flash; in a one-rank block they only
    run :func:`check_positions_one_rank`."""
    from torch.nn.modules import module as module_mod

    with state.MODEL_LOCK:
        if not state.MODEL_GUARD_HOOKS:
            state.MODEL_GUARD_HOOKS[:] = [module_mod.register_module_forward_pre_hook(_before),
                                          module_mod.register_module_forward_hook(_after, always_call=True)]
            record("guard_hooks", "torch.nn.modules.module: global forward hooks", tuple(state.MODEL_GUARD_HOOKS),
                   admitted="the first multi-rank context_parallel block")

    def leave() -> None:
        state.MODEL_GUARD.model = state.MODEL_GUARD.head = state.MODEL_GUARD.record = None
        state.MODEL_GUARD.prefill = state.MODEL_GUARD.decode = None

    return leave


def install_guard() -> None:
    """Register the guard with the engine's multi-rank contexts (idempotent); inside an open block (a
    model loaded there first registers cp_flash) its hooks are installed at once."""
    register_context_guard(_enter)
    if active_context() is not None:
        _enter(active_context())
