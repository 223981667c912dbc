"""The guard of a multi-rank context_parallel block: the module hooks that run the model check and
verification before a cp_flash model's first forward, prepare its adapted parts, and check each forward.

Two global module hooks, installed by the first block (:func:`install_guard`) and kept, return at once
outside a block and for every module of a model that does not use cp_flash. For the outermost forward of a
cp_flash model in a block they:

* before it: let every adapter prepare the model once (:meth:`.adapters.base.Adapter.prepare`: mark its
  mixers, hook its length-dependent rope); in a one-rank block, only the packed-positions check
  (:func:`.check.check_positions_one_rank`); in a multi-rank one, tell generate's prefill and decode steps
  from a plain forward (:mod:`.generation`), run the model check (:func:`.check.check_model`), refuse media
  inputs the block cannot shard (:mod:`.multimodal`), verify the model at first use (:mod:`.verification`),
  and take its head's substitutions (:mod:`.heads`); the forward's record (:data:`.forward.FORWARD`) is set;
* during it: count the attention modules that ran and the calls that reached cp_flash, and the running
  mixers;
* after it: gather a head's per-token output, finish generate's prefill, and refuse a forward in which an
  attention module that ran did not reach cp_flash (a layer that chose another implementation, or a
  class that picks its attention by name); the record is cleared.

Code traced by ``torch.compile`` is not counted (the hooks return at once there, leaving dynamo nothing to
guard on); the model check still runs, on the compiled model's own module.
"""

from __future__ import annotations

import torch

from . import state
from .adapters import ADAPTERS
from .check import check_model, check_positions_one_rank
from .forward import FORWARD
from .generation import finish_prefill, generation_call, start_decode, start_prefill
from .heads import prepare_call
from .mixing import is_mixer
from .models import cp_flash_model, family_of, inner_model, is_model, text_modules, unwrap_adapters
from .multimodal import refuse_media
from .positions import default_position_start, packed_documents
from .source import uses_attention_interface
from .verification import verify_first_use
from ..patches import record
from ...engine.batch import batch_of
from ...engine.context import active_context, register_context_guard
from ...engine.stats import begin_mixers
from ...refusals import refuse
from ...torch_compat import has_forward_pre_hook

__all__ = ["install_guard"]

_HOOKS: list = []  # the global module hooks, installed by the first multi-rank block and kept (state.MODEL_LOCK)
_WATCHING: list = []  # the module registration hook, installed by install_guard and kept (state.MODEL_LOCK)


def _before(module, args):
    """The global pre-hook: the running mixers and the attention modules that ran (no keyword arguments needed)."""
    if torch.compiler.is_compiling():  # traced code: nothing to count, no state for dynamo to guard on
        return None
    wrapper, module = module, getattr(module, "_orig_mod", module)  # torch.compile's wrapper: the model it compiles
    guard = FORWARD
    if is_mixer(module):  # a marked mixer runs: its functions go across ranks
        guard.mixers = getattr(guard, "mixers", 0) + 1
    if getattr(guard, "model", None) is None:
        if active_context() is not None and cp_flash_model(inner_model(module)) and \
                not has_forward_pre_hook(wrapper, _before_call):
            raise refuse("model_built_before_registration", model=type(module).__name__)
        return None  # (a model's forward starts in its call hook, which runs next)
    if getattr(getattr(module, "config", None), "_attn_implementation", None) == "cp_flash" and \
            not is_model(module) and uses_attention_interface(type(module)):
        guard.ran.add(id(module))
    return None


def _before_call(module, args, kwargs):
    """The call hook of a transformers model (or of a module holding one): the outermost cp_flash model forward
    of a block starts here, with the call's keyword arguments; inside one, the base model's call gets the
    head's substitutions. Returns the new ``(args, kwargs)``, or None (unchanged)."""
    if torch.compiler.is_compiling():
        return None
    compiled = hasattr(module, "_orig_mod")
    module = getattr(module, "_orig_mod", module)
    guard = FORWARD
    if getattr(guard, "model", None) is None:
        active = active_context()
        inner = inner_model(module) if active is not None else module
        if active is None or not cp_flash_model(inner):
            return None
        new_args = _start(module, inner, args, kwargs, active, compiled)
        return None if new_args is None else (new_args, kwargs)
    if getattr(guard, "record", None) is None and is_model(module):  # a wrapper's forward shards, then calls
        guard.record = _call_batch(args, kwargs)                        # its model (TRL's fused head)
    head = getattr(guard, "head", None)
    if head is not None and module is head.base:
        new_args = head.base_args(args, kwargs)
        return None if new_args is None else (new_args, kwargs)
    return None


def _on_child(module, name, child):
    """torch's global module registration hook: a transformers model (as it registers its first child), and a
    module registering one or a module holding one (PEFT's, torch.compile's, DDP's wrappers), get the call hook
    (:func:`_before_call`), once each. Nothing in code torch.compile traces (a module made in a forward)."""
    if torch.compiler.is_compiling() or not isinstance(child, torch.nn.Module) or \
            has_forward_pre_hook(module, _before_call):
        return None
    if is_model(module) or is_model(child) or has_forward_pre_hook(child, _before_call):
        module.register_forward_pre_hook(_before_call, with_kwargs=True)
        record("call_hooks", f"{type(module).__module__}.{type(module).__qualname__} (an instance): a forward pre-hook "
               "with the call's keyword arguments", _before_call, admitted="a transformers model, or a module "
               "holding one", instance=True)
    return None


def _prepare(inner) -> None:
    """Every adapter prepares ``inner`` once per model object (:data:`state.PREPARED`)."""
    with state.MODEL_LOCK:
        if state.PREPARED.get(inner, False):
            return
    modules = list(text_modules(inner))
    for adapter in ADAPTERS:
        adapter.prepare(inner, modules)
    with state.MODEL_LOCK:
        state.PREPARED[inner] = True


def _start(module, inner, args, kwargs, active, compiled):
    """The outermost forward of the cp_flash model ``inner`` (called through ``module``: itself, a PEFT or a
    torch.compile wrapper, with the keyword arguments ``kwargs``) begins in ``active``'s block: see the module
    docstring. Returns its new positional arguments (None: unchanged)."""
    guard = FORWARD
    _prepare(inner)
    begin_mixers()  # forward_mixer_stats: this forward's
    guard.head = None
    if active.world_size <= 1:  # one rank: only the packed-positions check, no counting
        check_positions_one_rank(inner, active.current_batch())
        guard.model, guard.ran, guard.reached, guard.counting, guard.position_start = module, set(), set(), False, 0
        return None
    if inner is not module:
        unwrap_adapters(module)  # prompt learning: refused, naming its PEFT type
    gen = generation_call(inner, kwargs, lambda: any(uses_attention_interface(type(m)) for _, m in text_modules(inner)))
    if gen is not None and compiled:
        raise refuse("generation_compiled", model=type(inner).__name__)
    if gen is not None and gen[0] == "decode":  # a decode step over the sharded cache: replicated but attention
        start_decode(gen[1], kwargs)
        guard.model, guard.ran, guard.reached, guard.counting, guard.decode = module, set(), set(), False, gen[1]
        guard.record, guard.position_start = None, 0
        return None
    check_model(inner, plain=gen is None)
    if gen is None:
        refuse_media(inner, kwargs)
    if getattr(active, "verify", True) and gen is None:  # (generate's prefill: its plain forwards are verified)
        verify_first_use(inner, active, _packed_call(args, kwargs), lambda: any(
            adapter.computes(m) for _, m in text_modules(inner) for adapter in ADAPTERS))
        begin_mixers()
    if gen is not None:  # generate's first forward: sharded here, the cache too (finished in _after)
        guard.prefill = start_prefill(inner, kwargs, gen[1], active)
    try:  # what its head does with the shard (.heads): refused, or the substitutions of this forward
        guard.head, new_args = prepare_call(inner, args, kwargs, active, compiled=compiled)
    except BaseException:
        guard.prefill = None
        raise
    # the batch this forward runs on, named by its tensors: a mixer asks for it (several may be alive)
    record, start = _call_batch(new_args or args, kwargs), default_position_start(inner)
    if record is not None and not getattr(record, "positions_given", True) and start:
        guard.prefill = guard.head = None  # (a model whose attention never reaches cp_flash: refused here)
        raise refuse("position_start", family=family_of(inner), start=start)
    guard.model, guard.ran, guard.reached, guard.counting = module, set(), set(), True
    guard.record, guard.position_start = record, start
    return new_args


def _packed_call(args: tuple, kwargs: dict | None) -> bool:
    """Whether the forward's batch (from ``cp.shard_batch``) packs documents in a row: read from its host-side
    documents once per batch (kept with the record), not once per forward."""
    record = _call_batch(args, kwargs)
    if record is None or not hasattr(record, "meta"):
        return False
    if "packed" not in record.extras:
        record.extras["packed"] = packed_documents(record.meta)
    return record.extras["packed"]


def _call_batch(args: tuple, kwargs: dict | None):
    """The sharded batch a module call's tensors are bound to (None: none)."""
    return batch_of(*(a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)))


def _after(module, args, output):
    if torch.compiler.is_compiling():
        return None
    module = getattr(module, "_orig_mod", module)
    guard = FORWARD
    if is_mixer(module):
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
        raise refuse("layers_bypassed_cp_flash", ran=len(guard.ran), family=family_of(module),
                     model=type(module).__name__, missing=len(missing) - len(foreign))


def _enter(cp):
    """A block opens: the module hooks are installed (once per process, and then kept: hooks added
    and removed per block would make torch.compile recompile for every block). They return at once
    outside a block and for every model that does not use cp_flash; in a one-rank block they only
    run :func:`check_positions_one_rank`."""
    from torch.nn.modules import module as module_mod

    with state.MODEL_LOCK:
        if not _HOOKS:
            _HOOKS[:] = [module_mod.register_module_forward_pre_hook(_before),
                         module_mod.register_module_forward_hook(_after, always_call=True)]
            record("guard_hooks", "torch.nn.modules.module: global forward hooks", tuple(_HOOKS),
                   admitted="the first multi-rank context_parallel block")

    def leave() -> None:
        FORWARD.model = FORWARD.head = FORWARD.record = None
        FORWARD.prefill = FORWARD.decode = None

    return leave


def install_guard() -> None:
    """Register the guard with the engine's multi-rank contexts and watch module registrations for the models
    built from now on (idempotent); inside an open block (a model loaded there first registers cp_flash) its
    hooks are installed at once."""
    from torch.nn.modules import module as module_mod

    with state.MODEL_LOCK:
        if not _WATCHING:
            _WATCHING.append(module_mod.register_module_module_registration_hook(_on_child))
            record("guard_hooks", "torch.nn.modules.module: a global module registration hook", _on_child,
                   admitted="cp_flash registered with transformers")
    register_context_guard(_enter)
    if active_context() is not None:
        _enter(active_context())
