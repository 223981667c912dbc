"""Every change cp_attention makes to code it does not own goes through :func:`patch` (or, for what foreign code
offers a registration or hook API for, :func:`record`), which records it: the target, the original, the
replacement, the site that made it and the admission check that passed first. :func:`applied` reads the record
at run time; ``docs/patches.md`` is generated from :data:`SITES` (``python -m cp_attention patches --page
docs/patches.md``) and checked current by ``tests/meta/test_patches.py``, which also checks that every
site is used by the code and covered by its tests, and that no other module of the package assigns a function or
method onto a foreign module or class.

A site is one kind of change (the adapted mixer functions of a modeling module, the registration of the
attention function, ...); a patch is one change made at run time (``causal_conv1d_fn`` of one modeling module).
Nothing here is undone: a patch lasts the process, as the adaptation it makes; :func:`temporarily` is the one
form that restores, for an admission check's own probe.
"""

from __future__ import annotations

import contextlib
import threading
import types
from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["Site", "Patch", "SITES", "patch", "record", "temporarily", "applied", "page"]


@dataclass(frozen=True)
class Site:
    """One kind of change to foreign code: what it changes, why, what must pass first, its covering tests."""

    target: str
    kind: str
    reason: str
    admission: str
    tests: tuple[str, ...]


@dataclass(frozen=True)
class Patch:
    """One change made at run time: ``target`` (a dotted name), ``original`` (None: there was none) and
    ``replacement`` (for a hook or registration: what was registered), made by ``site`` after ``admitted``."""

    site: str
    target: str
    original: object
    replacement: object
    admitted: str


SITES = MappingProxyType({
    "import_hooks": Site(
        target="sys.meta_path: a finder that adapts each transformers.models.*.modeling_* / configuration_* module "
               "as it loads, and a one-shot finder that registers cp_flash after transformers.modeling_utils loads",
        kind="import hook",
        reason="a family's functions and class tables must be adapted before any of its models is built",
        admission="the module's name (transformers.models.*.modeling_* / configuration_*); the loader is the "
                  "finder's own, wrapped",
        tests=("tests/integrations/test_import_safety.py",)),
    "attention_registration": Site(
        target="transformers.AttentionInterface and AttentionMaskInterface: the entries \"cp_flash\"",
        kind="registration",
        reason="attn_implementation=\"cp_flash\" selects cp_flash_attention and its mask function",
        admission="integrations.hf.versions.check_version (the transformers releases the suite runs)",
        tests=("tests/integrations/test_transformers.py",)),
    "flash_name_check": Site(
        target="is_flash_attention_requested of transformers' modules that choose a class or a path by the "
               "implementation's name (modeling_utils, masking_utils, generation, modeling modules)",
        kind="function",
        reason="a name check that reads \"flash\" in \"cp_flash\" would pick a FlashAttention-2 class or path",
        admission="integrations.hf.versions.check_version; the wrapper answers False for cp_flash only and calls the "
                  "original for every other name",
        tests=("tests/integrations/test_model_check.py::test_name_selected_classes_never_pick_flash_attention_2",
               "tests/integrations/test_model_check.py::test_every_name_selecting_modeling_module_is_adapted")),
    "class_tables": Site(
        target="module-level {implementation: attention class} tables of modeling modules (Falcon, GPT-Neo, GIT, "
               "...): the entry \"cp_flash\", their eager class",
        kind="table entry",
        reason="a family that picks its attention class by name needs one for cp_flash; the model check then "
               "reads whether that class reaches cp_flash",
        admission="integrations.hf.registry._is_class_table (a dict of implementation names to nn.Module classes)",
        tests=("tests/integrations/test_model_check.py::test_every_name_selecting_modeling_module_is_adapted",)),
    "mixer_functions": Site(
        target="a hybrid modeling module's sequence-mixer functions (causal_conv1d_fn, the gated delta rule, the "
               "Mamba scans, their step and decoding forms)",
        kind="function",
        reason="under context parallelism the convolution needs the previous shard's tokens and the recurrence "
               "the state of every earlier token: the wrapper computes both across ranks and documents",
        admission="integrations.hf.function_admission.admit (the function's behaviour on synthetic inputs against a "
                  "float64 oracle) for the functions with a calling convention; the step and decoding forms refuse "
                  "per call what they cannot compute",
        tests=("tests/integrations/test_admission.py", "tests/integrations/test_hybrids.py")),
    "mixer_classes": Site(
        target="a mixer class's method: MiniMax's lightning attention, RecurrentGemma's recurrent block and "
               "RG-LRU scan, Zaya's projection, xLSTM's mLSTM backend, RWKV's time and channel mixing",
        kind="method",
        reason="their recurrences and token shifts run across ranks through the adapter's scan over pieces",
        admission="integrations.hf.adapters.mixer_classes._match (signature and structure) when the module loads; "
                  "integrations.hf.class_admission at the first call under context parallelism (refused if it fails)",
        tests=("tests/integrations/test_class_admission.py", "tests/integrations/test_class_mixers.py")),
    "indexers": Site(
        target="the forward of DeepSeek Sparse Attention's token indexers, Qwen4's block indexer and the attention "
               "class that calls it",
        kind="method",
        reason="an indexer scores every earlier key of the whole row, not the shard's",
        admission="integrations.hf.adapters.indexers._fits / _fits_blocks (signature and structure); the instance's selection "
                  "against eager's at its first call under context parallelism",
        tests=("tests/integrations/test_index_sparse.py",)),
    "compressors": Site(
        target="the forward of DeepSeek-V4's compressor classes and of the attention class that calls them",
        kind="method",
        reason="compressed entries are computed per document over the whole row",
        admission="the compressor's signature and structure; integrations.hf.adapters.compressed._compressor_reason at its "
                  "first call under context parallelism",
        tests=("tests/integrations/test_index_sparse.py",)),
    "latent_kv": Site(
        target="the expand_kv method of multi-head latent attention classes (DeepSeek-V2/V3/V3.2, GLM-4-MoE-Lite, "
               "MiniCPM3, LongCat-Flash, Youtu, ...)",
        kind="method",
        reason="under context parallelism the ring moves a token's latent row instead of its expanded heads, and "
               "the receiver expands it with the layer's own method",
        admission="integrations.hf.adapters.latent._expansion_reason at the class's first call in a cp_flash forward "
                  "(row-wise, the shapes the attention receives); at every call, deterministic on two rows and the "
                  "attention's keys and values the very tensors it returned (else the heads move)",
        tests=("tests/integrations/test_latent.py",)),
    "router_loss": Site(
        target="load_balancing_loss_func of MoE modeling modules",
        kind="function",
        reason="the router's auxiliary loss averages over the batch's tokens, which under context parallelism "
               "are spread over the ranks",
        admission="integrations.hf.adapters.router_loss._fits (the function's behaviour, memoised) at each call under context "
                  "parallelism; outside a block the original runs",
        tests=("tests/integrations/test_router_loss.py",)),
    "guard_hooks": Site(
        target="torch.nn.modules.module: a global forward pre-hook and forward hook, and a global module registration "
               "hook",
        kind="hook",
        reason="the guard of a multi-rank block: the count of attention layers that reached cp_flash and of the "
               "running mixers, a head's gathered outputs, the end of a forward; the registration hook gives each "
               "transformers model built from then on its call hook (call_hooks)",
        admission="the forward hooks: installed by the first multi-rank context_parallel block, they return at once "
                  "for every other module; the registration hook: installed when cp_flash registers with "
                  "transformers, it returns at once for every module that is not and holds no transformers model",
        tests=("tests/integrations/test_model_check.py",)),
    "call_hooks": Site(
        target="a transformers model instance, and a module holding one (PEFT's, torch.compile's, DDP's wrappers): a "
               "forward pre-hook with the call's keyword arguments",
        kind="hook",
        reason="the outermost cp_flash forward of a block starts with its call's keyword arguments: generate's "
               "cache, the media inputs, a head's labels and logits_to_keep, the base model's ids substituted",
        admission="the instance is a transformers model (its class has base_model_prefix) or registers one as a "
                  "child; the hook returns at once outside a block and for a model that does not use cp_flash",
        tests=("tests/integrations/test_model_check.py::test_the_call_hook_reads_the_calls_keyword_arguments",
               "tests/integrations/test_heads.py")),
    "rope_hooks": Site(
        target="a length-dependent rotary module instance: a forward pre-hook and forward hook",
        kind="hook",
        reason="each rank's rotary must read the whole sequence's largest position, not its shard's",
        admission="integrations.hf.adapters.rope.rope_reason (a copy computes a rank's rows as the whole row's)",
        tests=("tests/integrations/test_rope.py",)),
    "decoder_injection": Site(
        target="a vision-language model's text decoder instance: a forward pre-hook",
        kind="hook",
        reason="the text decoder receives the sharded inputs its multimodal front-end computed on the full batch",
        admission="integrations.hf.multimodal's refusals (a decoder without inputs_embeds is refused first)",
        tests=("tests/integrations/test_multimodal.py",)),
    "trl_fused_head": Site(
        target="the forward TRL's add_fused_lm_head put on a model instance (or its PEFT base model)",
        kind="method",
        reason="TRL's fused head computes per-token log-probabilities from the hidden states; under the CP "
               "trainers it runs on each rank's shard and the rows are gathered",
        admission="integrations.trainers.trl: the trainer's refusals (cp_flash, the model check, a fused head to route)",
        tests=("tests/integrations/test_trl_rl.py",)),
    "admission_probe": Site(
        target="causal_conv1d_fn of a modeling module, for the duration of an admission check's probe",
        kind="function (restored)",
        reason="the check observes which convolution a step function calls",
        admission="part of integrations.hf.function_admission.admit; restored in a finally",
        tests=("tests/integrations/test_admission.py",)),
    "state_handover": Site(
        target="a state attribute of a mixer instance (RecurrentGemma's recurrent block) after generate's prefill",
        kind="instance state",
        reason="the decode steps run the mixers replicated from the sequence's state, which the prefill left sharded "
               "on each rank",
        admission="the mixer computes in a class the mixer_classes adapter admitted, and hands its state over "
                  "(generation.hand_over)",
        tests=("tests/multirank/test_generate.py",)),
    "probe_state": Site(
        target="attributes of a model's modules, for the duration of a check's own forwards: the states a mixer "
               "or module holds, an indexer's top-k",
        kind="instance state (restored)",
        reason="an admission check or the model check's trace runs the instance's own code on inputs of its own, "
               "and must leave it as it was",
        admission="part of class_admission.class_reason, indexers._indexer_reason and token_trace.kept_module_state; "
                  "restored in a finally",
        tests=("tests/integrations/test_class_admission.py", "tests/integrations/test_index_sparse.py",
               "tests/integrations/test_model_check.py")),
})
"""Every kind of change to foreign code, by key (docs/patches.md)."""

_LOCK = threading.Lock()
_APPLIED: list = []  # the Patch records, in the order made (process state: docs/architecture.md)
_SEEN: set = set()  # (site, target) of the changes to instances recorded (once each), guarded by _LOCK


def _name(owner, name: str) -> str:
    if isinstance(owner, types.ModuleType):
        return f"{owner.__name__}.{name}"
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}.{name}"
    return f"{type(owner).__module__}.{type(owner).__qualname__} (an instance).{name}"


def patch(owner, name: str, replacement, *, site: str, admitted: str):
    """``setattr(owner, name, replacement)`` (``owner``: a module, a class or an instance cp_attention does not
    own), recorded under ``site`` (a key of :data:`SITES`) with the admission check that passed (``admitted``).
    Returns the original (None: there was none)."""
    if site not in SITES:
        raise KeyError(f"patch: no site {site!r} in cp_attention.integrations.patches.SITES")
    original = vars(owner).get(name) if isinstance(owner, type) else getattr(owner, name, None)
    setattr(owner, name, replacement)
    if isinstance(owner, (type, types.ModuleType)):
        entry = Patch(site, _name(owner, name), original, replacement, admitted)
    else:  # an instance's state: recorded once per class and attribute, without holding the values
        entry = Patch(site, _name(owner, name), None, f"a {type(replacement).__name__}", admitted)
    with _LOCK:
        if isinstance(owner, (type, types.ModuleType)) or (site, entry.target) not in _SEEN:
            _SEEN.add((site, entry.target))
            _APPLIED.append(entry)
    return original


def record(site: str, target: str, replacement, *, admitted: str, original=None, instance: bool = False) -> None:
    """Record a change made through the foreign code's own API (a registration, a hook, an import finder, a
    table entry), which :func:`patch` cannot make. ``instance``: a change made to each instance of a kind
    (``target`` names the kind), recorded once."""
    if site not in SITES:
        raise KeyError(f"record: no site {site!r} in cp_attention.integrations.patches.SITES")
    with _LOCK:
        if instance:  # one per kind of instance: its hooks, not each object's
            if (site, target) in _SEEN:
                return
            _SEEN.add((site, target))
        _APPLIED.append(Patch(site, target, original, replacement, admitted))


@contextlib.contextmanager
def temporarily(owner, name: str, replacement, *, site: str, admitted: str):
    """:func:`patch` for the duration of the block, then the original back (recorded once)."""
    original = patch(owner, name, replacement, site=site, admitted=admitted)
    try:
        yield original
    finally:
        setattr(owner, name, original)


def applied(site: str | None = None) -> tuple[Patch, ...]:
    """The patches made in this process (of ``site`` only, when given), in order."""
    with _LOCK:
        return tuple(p for p in _APPLIED if site is None or p.site == site)


def page() -> str:
    """docs/patches.md, from :data:`SITES`."""
    lines = ["# What cp_attention changes in other libraries", "",
             "<!-- generated by `python -m cp_attention patches --page docs/patches.md` from "
             "cp_attention/integrations/patches.py; tests/meta/test_patches.py checks it is current -->", "",
             "cp_attention changes code it does not own only through `cp_attention.integrations.patches.patch` "
             "(an assignment) or `record` (a registration, hook or finder made through the foreign code's own "
             "API), and each change is recorded: `cp_attention.integrations.patches.applied()` lists, at run time, "
             "the target, the original, the replacement, the site and the admission check that passed. A change "
             "made to each instance of a kind (a hook on a model, a state of a mixer) is recorded once per class "
             "and attribute, without holding the values. `tests/meta/test_layering.py` checks that no other module "
             "of the package assigns onto a foreign module, class or instance, and that none reads an interpreter "
             "frame (a call's keyword arguments come through torch's forward pre-hooks). The sites:", "",
             "| site | kind | what it changes | why | admitted by | covering tests |", "|---|---|---|---|---|---|"]
    for key, s in SITES.items():
        tests = "<br>".join(f"`{t}`" for t in s.tests)
        lines.append(f"| `{key}` | {s.kind} | {s.target} | {s.reason} | {s.admission} | {tests} |")
    return "\n".join(lines) + "\n"
