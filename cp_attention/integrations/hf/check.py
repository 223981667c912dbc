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

* a sequence mixer function that transformers changed (:mod:`.adapters.mixer_functions`' admission by behaviour declined it):
  left unadapted, it would mix only the shard's tokens;
* a length-dependent rope (``dynamic``, ``longrope``) in a rotary module whose forward takes no
  ``position_ids``: it cannot be given the whole sequence's length (:mod:`.adapters.rope`; those that take
  them are hooked on the first forward in a block and computed from the global largest position);
* positions computed from the shard: the model's forward takes no ``position_ids`` and it uses
  positions (a positional module, or attention layers: :func:`uses_positions`), so each rank would
  number its learned or sinusoidal positions from 0 (the BART-family decoders, XGLM, ...). A model of
  sequence mixers alone (Mamba, Mamba-2, Falcon-Mamba) is not refused for it: it reads no positions,
  and its mixers take the documents from the batch record.

Handled mixers (issue 21): the module-level functions :mod:`.adapters.mixer_functions` adapts (``causal_conv1d_fn``,
``torch_chunk_gated_delta_rule``, ``mamba2_chunk_scan``, ``mamba_selective_scan``) and the mixer classes
:mod:`.adapters.mixer_classes` adapts run across ranks and documents (a halo for the convolution, a scan over pieces for
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

import contextlib
import threading

from .adapters import ADAPTERS
from .models import cp_flash_model, family_of, text_modules
from .positions import packed_documents, uses_positions
from .source import forward_args as _forward_args
from .token_trace import REFUSED as TRACE_REFUSED, model_trace
from . import state
from ...refusals import refuse

__all__ = ["Finding", "model_findings", "check_model", "check_positions_one_rank", "suspended"]

_SUSPENDED = threading.local()  # .on: the model check is off in this thread (suspended())


class Finding(tuple):
    """One reason a model is refused: ``(module, what, why)``; ``module`` is the qualified name."""

    __slots__ = ()

    def __new__(cls, module: str, what: str, why: str):
        return super().__new__(cls, (module, what, why))

    module = property(lambda self: self[0])
    what = property(lambda self: self[1])
    why = property(lambda self: self[2])


def model_findings(model) -> tuple[Finding, ...]:
    """Every reason ``model`` cannot run exactly under context parallelism (empty: it can): the rules the trace
    cannot see (a mixer function transformers changed, a rope from the shard's length, positions numbered from
    the shard), then, for a cp_flash model none of them refused, what its forward does (:mod:`.token_trace`)."""
    findings: list[Finding] = []
    modules = list(text_modules(model))
    for adapter in ADAPTERS:  # the adapters' rules (a mixer function transformers changed, a rope ...)
        findings += [Finding(where, what, why) for where, what, why in adapter.findings(modules)]
    forward_args = _forward_args(type(model))
    if "position_ids" not in forward_args and uses_positions(model):
        findings.append(Finding(type(model).__name__, "positions computed from the shard",
                                "its forward takes no position_ids, so every rank would number its positions "
                                "from 0 instead of the tokens' places in the sequence"))
    if cp_flash_model(model) and not findings:  # what the model does (.token_trace), unless a rule refused it
        for where, what, why in model_trace(model, modules, lambda m: any(a.stands_in(m) for a in ADAPTERS),
                                            "position_ids" in forward_args):
            findings.append(Finding(where, what, why))
    return tuple(dict.fromkeys(findings))


def _cached_findings(model) -> tuple[Finding, ...]:
    """:func:`model_findings`, once per model object (:data:`state.MODEL_CHECKS`)."""
    return state.per_model(state.MODEL_CHECKS, model, model_findings)


def check_model(model, plain: bool = True) -> None:
    """Raise ``NotImplementedError`` naming the family, the modules and why, if ``model`` cannot run
    exactly under context parallelism (see the module docstring). Cached per model object. ``plain=False``
    (generate's prefill, which runs with a cache): a refusal the trace met on the plain forward without a cache
    is not counted (the cache path is another; cp_flash still refuses at run time what it cannot apply there)."""
    if getattr(_SUSPENDED, "on", False):
        return
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
    raise refuse("model_check", family=family_of(model), model=type(model).__name__, findings="\n".join(lines))


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
    if packed_documents(record.meta):
        raise refuse("packed_without_position_ids", family=family_of(model), model=type(model).__name__)


@contextlib.contextmanager
def suspended():
    """The model check off in this thread for the block (``python -m cp_attention check`` runs a refused model under
    context parallelism to show where it would differ); everything else of the guard runs."""
    outer = getattr(_SUSPENDED, "on", False)
    _SUSPENDED.on = True
    try:
        yield
    finally:
        _SUSPENDED.on = outer
