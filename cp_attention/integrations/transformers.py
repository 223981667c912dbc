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

Legend: ``B`` batch, ``L``/``Lq`` query tokens, ``Lk`` key tokens, ``H`` heads, ``D`` head dim.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import torch

from .. import api
from ..layout import global_index
from ..masks import MaskSpec, SequenceMeta, doc_starts
from ..plan import build_local_plan

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


def _hf_document_starts(mask_function, batch_size: int, length: int) -> torch.Tensor | None:
    """Document starts in transformers' own mask: a token opens one where it cannot see its
    predecessor (probed on the ``length - 1`` adjacent pairs, O(L)). Chunk starts and window-1 masks
    also register, which is harmless: the MaskSpec applies the same cuts again."""
    if mask_function is None or length < 2:
        return None
    q_idx = torch.arange(1, length)
    opens = torch.zeros(batch_size, length, dtype=torch.bool)
    opens[:, 0] = True
    for b in range(batch_size):
        seen = mask_function(torch.full_like(q_idx, b), torch.zeros_like(q_idx), q_idx, q_idx - 1)
        seen = torch.as_tensor(seen, dtype=torch.bool).expand(length - 1)
        opens[b, 1:] = ~seen
    return opens if bool(opens[:, 1:].any()) else None


def cp_flash_mask(*, batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                  mask_function=None, attention_mask: torch.Tensor | None = None, **kwargs) -> CPMask:
    """The mask function registered for "cp_flash": returns a :class:`CPMask`, never (L x L) data."""
    if isinstance(attention_mask, CPMask):  # prepared by generate for this forward: keep its padding
        attention_mask = attention_mask.valid
    valid = None
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError("cp_flash expects a 2D (B, L) padding mask; got a "
                             f"{attention_mask.dim()}D attention_mask")
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


def _local_meta(info: CPMask | None, batch: api.BatchRecord | None, B: int, Lq: int, Lk: int, kwargs):
    """Documents and positions of a single-device call: (meta, q_idx, k_idx)."""
    q_off = info.q_offset if info is not None else 0
    kv_off = info.kv_offset if info is not None else 0
    if info is not None and info.kv_length != Lk:
        raise ValueError(f"cp_flash: the mask was built for {info.kv_length} keys but the layer has {Lk}")
    if info is None and Lq != Lk:
        raise ValueError("cp_flash: queries and keys differ in length (a KV cache?) but no cp_flash mask "
                         "describes their positions; do not pass a prebuilt 4D mask or a dict of masks")
    cached = q_off != 0 or kv_off != 0 or Lq != Lk
    T = max(q_off + Lq, kv_off + Lk)
    position_ids = opens = valid = None
    if batch is not None and not cached and batch.seq_len == Lq and batch.meta.batch == B:
        meta = SequenceMeta(batch=B, seq_len=Lq, doc_start=batch.meta.doc_start, position=batch.meta.position)
        return meta, torch.arange(Lq), torch.arange(Lk)
    cu = kwargs.get("cu_seq_lens_q")
    if not cached:
        position_ids = kwargs.get("position_ids")
        if position_ids is not None and tuple(position_ids.shape[-1:]) != (Lq,):
            position_ids = None
        if cu is not None:
            if B != 1:
                raise ValueError("cp_flash: cu_seq_lens_q describes one packed row, but the batch has "
                                 f"{B} rows; pass position_ids instead")
            opens = torch.zeros(1, Lq, dtype=torch.bool)
            opens[0, cu.detach().cpu().long()[:-1].clamp(max=Lq - 1)] = True
    else:
        if cu is not None:
            raise ValueError("cp_flash: cu_seq_lens_* with a non-empty KV cache is not supported")
        pos = kwargs.get("position_ids")
        restarts = None
        if pos is not None and pos.shape[-1] > 1:
            restarts = (pos[..., 1:] != pos[..., :-1] + 1).cpu()
            if info is not None and info.valid is not None:  # padding restarts positions, not documents
                ok = torch.zeros(B, Lq, dtype=torch.bool)
                seen = info.valid[:, q_off:q_off + Lq].cpu()
                ok[:, :seen.shape[1]] = seen
                restarts = restarts & ok[:, 1:] & ok[:, :-1]
        if restarts is not None and bool(restarts.any()):
            raise ValueError("cp_flash: packed documents (restarting position_ids) after a non-empty KV cache "
                             "are not supported")
    if info is not None:
        if info.opens is not None:
            opens = info.opens if opens is None else (opens | info.opens)
        if info.valid is not None:
            valid = torch.zeros(B, T, dtype=torch.bool)  # positions past the 2D mask are invisible
            n = min(T, info.valid.shape[1])
            valid[:, :n] = info.valid[:, :n].cpu()
    if opens is not None and T > Lq:
        opens = torch.cat([opens, torch.zeros(B, T - Lq, dtype=torch.bool)], 1)
    if position_ids is not None and T > Lq:
        position_ids = None
    meta = SequenceMeta(batch=B, seq_len=T, doc_start=doc_starts(
        B, T, position_ids=position_ids, valid=valid, opens=opens),
        position=None if position_ids is None else position_ids.detach().to("cpu", torch.int64).expand(B, T))
    return meta, torch.arange(q_off, q_off + Lq), torch.arange(kv_off, kv_off + Lk)


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
            api.attend(q, k, v, spec, sinks=s_aux, batch=batch, local_error=local_error)
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
                         layer=getattr(module, "layer_idx", None))
        return out, None
    plan_spec = MaskSpec(causal=spec.causal, window=spec.window, chunk_size=spec.chunk_size)
    key_ = (plan_spec, B, Lq, Lk, batch is not None)
    plans = info.plans if info is not None else {}
    if key_ not in plans:  # once per mask and forward: the layers sharing this CPMask reuse the plan
        meta, q_idx, k_idx = _local_meta(info, batch, B, Lq, Lk, kwargs)
        plans[key_] = build_local_plan(meta, plan_spec, q_idx=q_idx, k_idx=k_idx)
    backend = batch.cp.backend if batch is not None else None
    out = api.attend_local(q, k, v, plans[key_], spec, sinks=s_aux, backend=backend,
                           layer=getattr(module, "layer_idx", None))
    return out, None


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
