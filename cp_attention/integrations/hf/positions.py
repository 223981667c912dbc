"""Positions under context parallelism: which positions a model and its layers read, where a model numbers
its default positions, and whether a batch packs documents.

A rank holds a shard of the sequence; positions must be the tokens' places in the whole row (or in their
document), never the shard's. These helpers tell the model check (:mod:`.check`), the guard (:mod:`.guard`)
and cp_flash's attention (:mod:`.attention`) which positions a model reads and where it numbers them.
"""

from __future__ import annotations

import functools
import re
import sys

import torch

from . import state
from .models import is_model_class, text_modules
from .source import forward_args as _forward_args
from .source import uses_attention_interface
from ...engine.batch import batch_of
from ...refusals import refuse

__all__ = ["positional_modules", "uses_positions", "family_takes_positions", "layer_position_ids",
           "default_position_start", "packed_documents"]


# a module that turns positions into a signal: by its class (learned / sinusoidal / rotary / segment
# position embeddings) or by the attribute it sits in (``embed_positions``, GPT-2's ``wpe``, ``rotary_emb``)
_POSITIONAL_CLASS = re.compile(r"Positional|PositionEmbedding|Rotary|Sinusoidal|Rope", re.I)
_POSITIONAL_ATTR = re.compile(r"^(?:embed_positions|position_embeddings?|pos_emb\w*|wpe|rotary_emb\w*|rope\w*)$")


def positional_modules(model) -> tuple[str, ...]:
    """The modules of ``model`` over the text sequence that turn positions into a signal (learned,
    sinusoidal, segment or rotary position embeddings), by class name or attribute name."""
    return tuple(name for name, module in text_modules(model)
                 if _POSITIONAL_CLASS.search(type(module).__name__) or _POSITIONAL_ATTR.match(name.rpartition(".")[2]))


def uses_positions(model) -> bool:
    """Whether ``model`` reads its tokens' positions: it has a positional module, or an attention
    layer (whose documents and positions come from ``position_ids``; a class that computes its own
    scores may add a position bias such as ALiBi). A model of sequence mixers alone (Mamba, RWKV,
    xLSTM) uses no positions: its documents reach its mixers through the batch ``cp.shard_batch``
    recorded, so its forward needs no ``position_ids``."""
    if positional_modules(model):
        return True
    return any(uses_attention_interface(type(m)) for _, m in text_modules(model)
               if not type(m).__module__.startswith("torch."))


def packed_documents(meta) -> bool:
    """Whether a row of ``meta`` holds a document of two or more tokens that does not open the row
    (padding tokens are one-token documents of their own and do not count)."""
    starts = getattr(meta, "doc_start", None)
    if starts is None or starts.shape[-1] < 3:
        return False
    opens = starts == torch.arange(starts.shape[-1])
    return bool((opens[:, 1:-1] & (starts[:, 2:] == starts[:, 1:-1])).any())


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
        if isinstance(value, type) and value.__module__ == module_name and is_model_class(value) and \
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


def default_position_start(model) -> int:
    """Where ``model`` numbers its default positions: 0, or ``padding_idx + 1`` for a position
    embedding with a padding index (RoBERTa, XLM-R, CamemBERT, data2vec-text, X-MOD; the sinusoidal
    tables of Kosmos-2.5, M2M100 and XGLM), or the first of the default positions a module keeps as its
    ``position_ids`` buffer when that is not 0 (MRA's and YOSO's, from 2). Read once per model object
    (:data:`state.POSITION_STARTS`)."""
    return state.per_model(state.POSITION_STARTS, model, _position_start)


def _position_start(model) -> int:
    modules = list(text_modules(model))
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
