"""transformers integration: ``attn_implementation="cp_flash"``.

Importing :mod:`cp_attention` registers the name as soon as transformers' ``modeling_utils`` is
imported (lazily, so ``import cp_attention`` stays cheap). Registration installs:

* an attention function that turns ``(module, query, key, value, attention_mask, **kwargs)`` into one
  :class:`~cp_attention.masks.MaskSpec` per layer (causal or bidirectional from ``module.is_causal``,
  ``sliding_window``, chunked layers from ``config.layer_types``, ``softcap``, sinks ``s_aux``,
  ``scaling``) and runs the engine: under an active :func:`~cp_attention.context_parallel` group
  of several ranks with the documents recorded by ``cp.shard_batch``; otherwise on one device;
* a mask function that returns a small :class:`CPMask` (offsets, the 2D padding mask, document
  starts transformers detected) instead of an (L x L) mask;
* the adaptations transformers needs because the name contains "flash" (it would otherwise look
  for a flash-attn package or hub kernel, swap gpt-oss to a hub kernel, refuse chunked masks...).
  They replace ``is_flash_attention_requested`` in the modules listed in :data:`FLASH_NAME_SITES`
  by a wrapper that answers False for "cp_flash" only, for transformers >= 5.17 and < 6;
Nothing else of transformers is changed: losses, other attention implementations and models that
do not use "cp_flash" behave exactly as without ``import cp_attention``.

Which batch a layer attends over: the :class:`~cp_attention.api.BatchRecord` of the
``cp.shard_batch`` call that returned the tensors of the forward. The layer finds it on the
``position_ids`` it receives, else on the :class:`CPMask` (bound when the model built its masks, from
the padding mask or the context's only live batch). A forward recomputed by gradient checkpointing
gets the same ``CPMask`` and ``position_ids`` again, so it runs on the same batch and group even after
the ``context_parallel`` block has exited.

``torch.compile``. On one device a layer is the custom op of :mod:`cp_attention.compiled`, which gets
the documents as tensors and builds its plan inside: traced outside context parallelism, the mask
function and the layers contain nothing dynamo cannot trace (no data-dependent branch, no context
lookup), so a model compiles without a graph break and a new document layout does not recompile.
Whether a context is active is asked once per trace (dynamo cannot guard on a contextvar) and checked
again by the op when it runs. Under context parallelism :func:`_bound_mask` and :func:`_bound_attention`
run eagerly (``torch.compiler.disable``): one graph break per mask and per layer.

Legend: ``B`` batch, ``L``/``Lq`` query tokens, ``Lk`` key tokens, ``H`` heads, ``D`` head dim.
"""

from __future__ import annotations

import importlib
import json
import weakref
import zlib
from dataclasses import dataclass, field

import torch
import torch._dynamo

from .. import api, compiled
from ..layout import global_index
from ..masks import MaskSpec

__all__ = ["NAME", "CPMask", "cp_flash_attention", "cp_flash_mask", "register", "FLASH_NAME_SITES",
           "adapted_sites"]

NAME = "cp_flash"
MIN_VERSION, MAX_VERSION = (5, 17), (6, 0)

# Modules whose by-name import of is_flash_attention_requested treats any name containing "flash"
# as flash-attn, and what goes wrong for "cp_flash" there (transformers 5.17-5.23):
FLASH_NAME_SITES = {
    "transformers.modeling_utils": "model init imports a flash package or hub kernel for the name and "
                                   "raises; gpt-oss swaps the name for a hub kernel",
    "transformers.masking_utils": "the chunked mask builder raises beyond one chunk (Llama 4)",
    "transformers.generation.utils": "generate keeps the all-ones padding mask with a static cache and "
                                     "turns off fullgraph compilation",
    "transformers.generation.continuous_batching.continuous_api": "continuous batching would run "
                                                                  "without masks",
    "transformers.generation.continuous_batching.initialization": "continuous batching setup",
    "transformers.generation.continuous_batching.cache": "continuous batching cache layout",
}
_ADAPTED: list[str] = []


def adapted_sites() -> list[str]:
    """The modules whose flash-name check was adapted for "cp_flash" (for tests and diagnostics)."""
    return list(_ADAPTED)


def _version() -> tuple[int, int]:
    import transformers

    major, minor = transformers.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


# ----------------------------------------------------------------------------------------------
# the mask function: O(L) metadata instead of an (L x L) mask


@dataclass(eq=False)
class CPMask:
    """What "cp_flash" layers receive as ``attention_mask``: sizes, offsets and O(L) metadata.

    ``q_offset``/``kv_offset``: absolute position of the first query / key (non-zero after a KV
    cache; a sliding-window cache keeps only the last keys). ``valid`` (B, T) bool: the 2D padding
    mask over absolute positions, or None. ``opens`` (B, Lq) bool: document starts transformers
    itself detected in packed ``position_ids`` (no KV cache only), or None. ``plans`` caches the
    single-device plan of each mask for the layers of one forward.
    """

    batch_size: int
    q_length: int
    kv_length: int
    q_offset: int
    kv_offset: int
    valid: torch.Tensor | None
    opens: torch.Tensor | None
    batch: object = field(default=None, repr=False)
    plans: dict = field(default_factory=dict, repr=False)

    # generate() with a static cache prepares the masks in advance; models that build one mask (no
    # ``layer_types``: Mistral, Phi-3) hand it back to ``create_*_mask``, whose argument check reads
    # ``.ndim`` and only treats ``ndim == 2`` as a padding mask: a CPMask stands for a prepared mask.
    ndim = 4

    def contiguous(self) -> CPMask:
        """transformers' generation calls ``.contiguous()`` on prepared masks: nothing to do."""
        return self


def _hf_document_starts(mask_function, batch_size: int, length: int, *, prune: bool = True) -> torch.Tensor | None:
    """Document starts in transformers' own mask: a token opens one where it cannot see its
    predecessor (probed on the ``length - 1`` adjacent pairs, O(L)). Chunk starts and window-1 masks
    also register, which is harmless: the MaskSpec applies the same cuts again. ``prune``: None when
    no token but the first opens a document (a data-dependent branch, skipped under torch.compile)."""
    if mask_function is None or length < 2:
        return None
    q_idx = torch.arange(1, length)
    opens = torch.zeros(batch_size, length, dtype=torch.bool)
    opens[:, 0] = True
    for b in range(batch_size):
        seen = mask_function(torch.full_like(q_idx, b), torch.zeros_like(q_idx), q_idx, q_idx - 1)
        seen = torch.as_tensor(seen, dtype=torch.bool).expand(length - 1)
        opens[b, 1:] = ~seen
    return opens if not prune or bool(opens[:, 1:].any()) else None


@torch._dynamo.assume_constant_result
def _traced_outside_cp() -> bool:
    """Whether torch.compile traces outside any context of several ranks: asked once per trace and
    not guarded (dynamo cannot guard on a contextvar), so the single-device op re-checks when it runs."""
    return not compiled.multi_rank_context_active()


def _compiled_single_device() -> bool:
    """torch.compile is tracing a forward outside context parallelism: the mask function and the layers
    skip what dynamo cannot trace (the context, the forward's bookkeeping, data-dependent branches)."""
    return torch.compiler.is_compiling() and _traced_outside_cp()


def cp_flash_mask(*, batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                  mask_function=None, attention_mask: torch.Tensor | None = None, **kwargs) -> CPMask:
    """The mask function registered for "cp_flash": returns a :class:`CPMask`, never (L x L) data."""
    if isinstance(attention_mask, CPMask):  # prepared by generate for this forward: keep its padding
        attention_mask = attention_mask.valid
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"cp_flash expects a 2D (B, L) padding mask; got a {attention_mask.dim()}D attention_mask")
    if not _compiled_single_device():
        return _bound_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask)
    # traced by torch.compile outside context parallelism: no data-dependent branch, no bookkeeping (the
    # single-device op notes the forward's plans itself)
    opens = None
    if q_offset == 0 and kv_offset == 0 and q_length == kv_length:
        opens = _hf_document_starts(mask_function, batch_size, q_length, prune=False)
    return CPMask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=int(q_offset),
                  kv_offset=int(kv_offset), valid=None if attention_mask is None else attention_mask.detach().bool(),
                  opens=opens, batch=api.batch_of(attention_mask))


@torch.compiler.disable
def _bound_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask) -> CPMask:
    """The mask of a forward that may run under context parallelism; eager (torch.compile breaks the
    graph here: the active context is a contextvar and the forward's bookkeeping thread-local)."""
    valid = None
    if attention_mask is not None:
        valid = attention_mask.detach().to(torch.bool)
        if bool(valid.all()):
            valid = None
    opens = None
    if q_offset == 0 and kv_offset == 0 and q_length == kv_length:
        opens = _hf_document_starts(mask_function, batch_size, q_length)
    api.begin_forward()  # the model builds its masks before its layers run
    batch = api.batch_of(attention_mask)
    if batch is None and api.active_context() is not None:
        batch = api.active_context().current_batch()
    elif batch is None and torch._C._current_graph_task_id() != -1:  # recomputed during backward
        batch = api.recomputed_batch(batch_size, q_length)
    return CPMask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=int(q_offset),
                  kv_offset=int(kv_offset), valid=valid, opens=opens, batch=batch)


# ----------------------------------------------------------------------------------------------
# the attention function


def layer_mask_spec(module, *, sliding_window=None, softcap=None, scaling=None, is_causal=None) -> MaskSpec:
    """The MaskSpec of one transformers attention layer."""
    config = getattr(module, "config", None)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    chunk = None
    layer_types = getattr(config, "layer_types", None)
    layer_idx = getattr(module, "layer_idx", None)
    if layer_types is not None and layer_idx is not None and layer_types[layer_idx] == "chunked_attention":
        chunk = int(config.attention_chunk_size)
    window = int(sliding_window) if sliding_window is not None else None
    return MaskSpec(causal=bool(causal), window=window, chunk_size=chunk,
                    softcap=float(softcap) if softcap is not None else None,
                    scale=float(scaling) if scaling is not None else None)


def _llama4_temperature(positions: torch.Tensor, module) -> torch.Tensor:
    """Llama 4's NoPE attention temperature for absolute positions (its own formula)."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0


def _fix_llama4_temperature(q_BLHD: torch.Tensor, module, batch: api.BatchRecord) -> torch.Tensor:
    """Llama 4 scales NoPE-layer queries by a temperature of ``arange(local length)``; on a shard the
    true positions are global. Rescale by temperature(global) / temperature(local) (1 wherever the
    temperature does not change, i.e. below ``floor_scale``)."""
    if not (getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True)):
        return q_BLHD
    L = q_BLHD.shape[1]
    local = torch.arange(L)
    cp = batch.cp
    glob = global_index(batch.seq_len, cp.world_size, batch.layout, cp.rank)
    ratio = _llama4_temperature(glob, module) / _llama4_temperature(local, module)
    if bool((ratio == 1).all()):
        return q_BLHD
    return (q_BLHD * ratio.to(q_BLHD.device, torch.float32).view(1, L, 1, 1)).to(q_BLHD.dtype)


def _single_device(module, q, k, v, spec: MaskSpec, s_aux, info: CPMask | None, batch, kwargs):
    """One device: the custom op :func:`cp_attention.compiled.local_attention` with this layer's
    documents as tensors (those of ``batch``, a shard_batch record of a one-rank context, when it
    describes these tokens)."""
    B, Lq = q.shape[:2]
    Lk = k.shape[1]
    q_off = info.q_offset if info is not None else 0
    kv_off = info.kv_offset if info is not None else 0
    if info is not None and info.kv_length != Lk:
        raise ValueError(f"cp_flash: the mask was built for {info.kv_length} keys but the layer has {Lk}")
    if info is None and Lq != Lk:
        raise ValueError("cp_flash: queries and keys differ in length (a KV cache?) but no cp_flash mask "
                         "describes their positions; do not pass a prebuilt 4D mask or a dict of masks")
    cached = q_off != 0 or kv_off != 0 or Lq != Lk
    if batch is not None and not cached and batch.seq_len == Lq and batch.meta.batch == B:
        starts = batch.meta.doc_start
        docs = dict(position_ids=batch.meta.position, valid=None, cu_seqlens=None,
                    opens=None if starts is None else starts == torch.arange(Lq))
    else:
        docs = dict(position_ids=kwargs.get("position_ids"), cu_seqlens=kwargs.get("cu_seq_lens_q"),
                    valid=info.valid if info is not None else None, opens=info.opens if info is not None else None)
    return compiled.local_attention(q, k, v, spec, sinks=s_aux, q_offset=q_off, kv_offset=kv_off,
                                    backend=batch.cp.backend if batch is not None else None, bound=batch is not None,
                                    layer=getattr(module, "layer_idx", None), **docs)


def torch_context_parallel_active() -> bool:
    """Whether torch's own ``context_parallel`` (``torch.distributed.tensor.experimental``, what
    accelerate's CP runs) is active: it replaces ``F.scaled_dot_product_attention`` by a wrapper
    registered in its ``_replaced_functions`` (torch 2.7-2.13; older versions could instead push a
    ``DistributeFunction`` torch-function mode)."""
    import torch.nn.functional as F

    sdpa = F.scaled_dot_product_attention
    if sdpa is not torch._C._nn.scaled_dot_product_attention:
        for name in ("torch.distributed.tensor.experimental._context_parallel._attention",
                     "torch.distributed.tensor.experimental._attention"):
            try:
                replaced = getattr(importlib.import_module(name), "_replaced_functions", {})
            except ImportError:
                continue
            if sdpa in replaced:
                return True
    modes = torch.overrides._get_current_function_mode_stack()
    return any(type(m).__name__ == "DistributeFunction" for m in modes)


def _bound_batch(info: CPMask | None, position_ids) -> tuple[api.BatchRecord | None, Exception | None]:
    """The sharded batch a layer call runs on, and an error if it cannot be told: the record on its
    ``position_ids`` (exact), else the one its mask was bound to, else the active context's only
    live batch (no cp_flash mask, e.g. a prebuilt dict of masks)."""
    batch = api.batch_of(position_ids)
    if batch is not None:
        return batch, None
    if info is not None:
        batch = info.batch
    elif api.active_context() is not None:
        batch = api.active_context().current_batch()
    if batch is api.AMBIGUOUS:
        return None, ValueError(
            "cp_flash: several batches returned by cp.shard_batch are alive and this forward does not say "
            "which one it runs on (this model does not hand position_ids to its attention layers); run each "
            "batch's forward before sharding the next one, or delete the other batches' tensors first")
    mine = None if batch is None else batch.local_position_ids
    if isinstance(position_ids, torch.Tensor) and mine is not None and position_ids.shape[-1] == mine.shape[-1]:
        # other lengths (a KV cache, another batch) are refused by the length checks that follow. The
        # comparison syncs with the device: once per forward (the layers share the mask), not per layer
        memo = info.plans if info is not None else {}
        key = ("positions match", id(position_ids), position_ids._version)
        if key not in memo:
            memo[key] = bool((position_ids.to(mine.device) == mine).all())
        if not memo[key]:
            return batch, ValueError(
                "cp_flash: the model got position_ids that cp.shard_batch did not return for this batch; pass "
                "the position_ids (and every other tensor) of one cp.shard_batch call to the model")
    return batch, None


def cp_flash_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                       dropout: float = 0.0, scaling: float | None = None, sliding_window: int | None = None,
                       softcap: float | None = None, s_aux: torch.Tensor | None = None, **kwargs):
    """The attention function registered for "cp_flash".

    query (B, H, Lq, D), key/value (B, H_kv, Lk, D) (GQA not repeated) -> ((B, Lq, H, D), None).
    """
    if dropout and getattr(module, "training", False):
        raise NotImplementedError(f"cp_flash does not implement attention dropout (got dropout={dropout}); "
                                  "set the model's attention_dropout to 0")
    if isinstance(attention_mask, torch.Tensor):
        raise ValueError("cp_flash received a dense attention_mask tensor: its masks come from the mask "
                         "function registered with it; pass a 2D padding mask (or none) and position_ids")
    if torch_context_parallel_active():
        raise RuntimeError(
            "cp_flash: torch's context_parallel (accelerate's ParallelismConfig(cp_size > 1)) is active: it shards "
            "the sequence itself and cp_flash would attend within one shard. cp_flash does its own context "
            "parallelism: use cp_attention.context_parallel() + cp.shard_batch(), or CPTrainer from "
            "cp_attention.integrations.trainer, without torch's context_parallel (or use "
            "attn_implementation='sdpa' with torch's context_parallel, for plain causal masks only)")
    info = attention_mask if isinstance(attention_mask, CPMask) else None
    spec = layer_mask_spec(module, sliding_window=sliding_window, softcap=softcap, scaling=scaling,
                           is_causal=kwargs.get("is_causal"))
    q = query.transpose(1, 2)
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)
    if _compiled_single_device():  # traced outside context parallelism: straight to the op
        batch = api.batch_of(kwargs.get("position_ids")) or (info.batch if info is not None else None)
        if batch is None:
            return _single_device(module, q, k, v, spec, s_aux, info, None, kwargs), None
    return _bound_attention(module, q, k, v, spec, s_aux, info, kwargs), None


_CONFIG_CRC: dict[int, tuple] = {}  # id(config) -> (weak reference, checksum)
_VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version")


def config_crc(module) -> int:
    """A 31-bit checksum of the configuration of ``module``'s model (every field but its path and
    transformers version), agreed by the ranks on a batch's first call: two ranks whose models
    differ (a window, the layer types) then raise together instead of one of them waiting for an
    agreement the others skip. -1 when the module has no config. Computed once per config object."""
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return -1
    entry = _CONFIG_CRC.get(id(config))
    if entry is not None and entry[0]() is config:
        return entry[1]
    fields = {key: value for key, value in config.to_dict().items() if key not in _VOLATILE_CONFIG_KEYS}
    crc = zlib.crc32(json.dumps(fields, sort_keys=True, default=str).encode()) & 0x7FFFFFFF
    _CONFIG_CRC[id(config)] = (weakref.ref(config), crc)
    return crc


@torch.compiler.disable
def _bound_attention(module, q, k, v, spec: MaskSpec, s_aux, info: CPMask | None, kwargs) -> torch.Tensor:
    """A layer that may run under context parallelism: the batch it is bound to, the checks every rank
    raises together, then the ring (several ranks) or the single-device op. Eager: torch.compile breaks
    the graph here (the context is a contextvar; the agreement collectives, the planner and the ring's
    point-to-point calls cannot be traced)."""
    B, Lq = q.shape[:2]
    Lk = k.shape[1]
    batch, local_error = _bound_batch(info, kwargs.get("position_ids"))
    active = api.active_context()
    if batch is None and active is not None and active.world_size > 1:
        local_error = local_error or ValueError(
            "cp_flash under context parallelism needs the batch's global positions: shard the inputs with "
            "cp.shard_batch(input_ids=..., position_ids=..., labels=...) and pass its outputs to the model")
    if local_error is not None:  # raised on every rank of the group together, before any K/V moves
        if batch is None and active is not None and active.world_size > 1:
            api.attend(q, k, v, spec, sinks=s_aux, local_error=local_error)
        elif batch is not None and batch.cp.world_size > 1:
            api.attend(q, k, v, spec, sinks=s_aux, batch=batch, local_error=local_error,
                       model_crc=config_crc(module))
        raise local_error
    if batch is not None and batch.cp.world_size > 1:
        if Lq != Lk or (info is not None and (info.q_offset or info.kv_offset)):
            raise ValueError("cp_flash: a non-empty KV cache is not supported under context parallelism "
                             f"(queries {Lq}, keys {Lk}); call the model with use_cache=False")
        if info is not None and info.valid is not None and not batch.padded:
            local_error = ValueError("cp_flash: the model got a padding attention_mask that cp.shard_batch did "
                                     "not see; pass attention_mask to cp.shard_batch with the other inputs")
        if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
            raise ValueError("cp_flash: cu_seq_lens_* are not used under context parallelism; pass the collator's "
                             "whole batch (cu_seq_lens_* included) to cp.shard_batch, which takes the documents "
                             "from them")
        q = _fix_llama4_temperature(q, module, batch)
        out = api.attend(q, k, v, spec, sinks=s_aux, batch=batch, local_error=local_error,
                         layer=getattr(module, "layer_idx", None), model_crc=config_crc(module))
        return out
    return _single_device(module, q, k, v, spec, s_aux, info, batch, kwargs)


# ----------------------------------------------------------------------------------------------
# registration


def _adapt_flash_name_check(module_name: str) -> bool:
    try:
        mod = importlib.import_module(module_name)
    except ImportError:
        return False
    original = getattr(mod, "is_flash_attention_requested", None)
    if original is None:
        return False
    if getattr(original, "_cp_attention_wrapped", False):
        return True

    def is_flash_attention_requested(config=None, requested_attention_implementation=None, version=None, **kw):
        name = config._attn_implementation if config is not None else requested_attention_implementation
        if name == NAME:
            return False
        return original(config=config, requested_attention_implementation=requested_attention_implementation,
                        version=version, **kw)

    is_flash_attention_requested._cp_attention_wrapped = True
    is_flash_attention_requested.__wrapped__ = original
    mod.is_flash_attention_requested = is_flash_attention_requested
    return True


_REGISTERED = [False]


def register() -> None:
    """Register "cp_flash" with transformers (idempotent). Called automatically once transformers'
    modeling code is imported after ``import cp_attention``."""
    if _REGISTERED[0]:
        return
    version = _version()
    if not (MIN_VERSION <= version < MAX_VERSION):
        raise ImportError(f"cp_attention's transformers integration supports transformers >= "
                          f"{'.'.join(map(str, MIN_VERSION))} and < {'.'.join(map(str, MAX_VERSION))}, found "
                          f"{'.'.join(map(str, version))}")
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(NAME, cp_flash_attention)
    AttentionMaskInterface.register(NAME, cp_flash_mask)
    for site in FLASH_NAME_SITES:
        if _adapt_flash_name_check(site) and site not in _ADAPTED:
            _ADAPTED.append(site)
    _REGISTERED[0] = True
