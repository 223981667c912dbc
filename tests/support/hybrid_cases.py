"""Cases and rank workers for tests/integrations/test_hybrids.py: the hybrid families (attention mixed with short
convolutions, Mamba, Mamba-2 or gated DeltaNet layers) under ``attn_implementation="cp_flash"``.

Tiny configs of each family's own layer mix come from the family sweep's generic rules
(``cp_attention.tools.sweeps.configs.tiny_config``); the ground truth is the same weights under ``"eager"``
with each packed document run alone (transformers' own packed eager lets these mixers run across documents).
Compared: logits, and the parameter gradients of ``sum(logits * R)`` for a fixed random ``R``, with
``hf_cases``' tolerances.
"""

from __future__ import annotations

import torch

import cp_attention
from cp_attention.tools.sweeps import configs
from cp_attention.tools.sweeps import family as sweep
import hf_cases

_HYBRIDS = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "olmo_hybrid", "nemotron_h", "falcon_h1", "granitemoehybrid",
            "bamba", "zamba2", "jamba", "lfm2", "lfm2_moe")
# issue 39: KDA (Kimi Linear, Bailing), lightning attention (MiniMax), RG-LRU and its convolution
# (RecurrentGemma), Zaya's convolved attention inputs, Zamba (Mamba), RWKV, xLSTM, the pure state-space models
_MORE_MIXERS = ("kimi_linear", "bailing_hybrid", "minimax", "recurrent_gemma", "zaya", "zamba", "rwkv", "xlstm",
                "mamba", "mamba2", "falcon_mamba")


def installed(families: tuple[str, ...]) -> tuple[str, ...]:
    """The families the installed transformers has (the compatibility lane's 5.17 lacks bailing_hybrid)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return tuple(f for f in families if f in CONFIG_MAPPING_NAMES)


HYBRIDS, MORE_MIXERS = installed(_HYBRIDS), installed(_MORE_MIXERS)


# Two rows (L = 46): documents crossing every rank at world sizes 2 and 4 in every layout, one-token
# documents (at a piece's first token, inside, and at the end of a row), a row that is one document.
DOCS = ((13, 1, 22, 1, 8, 1), (46,))


def inputs(vocab: int, docs=DOCS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids (B, L), position_ids (B, L) restarting per document, R (B, L, vocab))."""
    L = sum(docs[0])
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(*configs.ID_RANGE, (len(docs), L), generator=g)
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in docs])
    R = torch.randn(len(docs), L, vocab, generator=g)
    return ids, pos, R


def tiny_config(family: str):
    """The sweep's tiny config, with LFM2's layer mix restored (the sweep's rules keep only its
    attention layers): two short-convolution layers around an attention layer."""
    cfg = configs.tiny_config(family)
    if family == "lfm2":
        cfg.num_hidden_layers, cfg.layer_types = 3, ["conv", "full_attention", "conv"]
        if hasattr(cfg, "full_attn_idxs"):
            cfg.full_attn_idxs = [1]
    return cfg


def models(family: str):
    """(eager model, cp_flash model holding the same weights), both in eval mode."""
    cfg = tiny_config(family)
    eager = configs.build_model(cfg, "eager")
    return eager, configs.build_model(cfg, "cp_flash", eager.state_dict())


def _kwargs(model) -> dict:
    return dict(use_cache=False) if sweep.forward_kwargs(model)["use_cache"] else {}


def takes_positions(model) -> bool:
    """Whether the model's forward takes ``position_ids`` (the pure state-space models, RWKV, xLSTM do not)."""
    return bool(sweep.forward_kwargs(model)["position_ids"])


def _positions(model, pos) -> dict:
    """``position_ids`` for a model whose forward takes them."""
    return dict(position_ids=pos) if takes_positions(model) else {}


def ground_truth(eager, docs=DOCS) -> dict:
    """Each document alone under eager: logits (B, L, V) and the flat gradients of sum(logits * R)."""
    ids, pos, R = inputs(eager.config.get_text_config().vocab_size, docs)
    eager.zero_grad(set_to_none=True)
    rows = []
    for b, row in enumerate(docs):
        pieces, start = [], 0
        for n in row:
            sl = slice(start, start + n)
            out = eager(input_ids=ids[b:b + 1, sl], **_positions(eager, torch.arange(n)[None]), **_kwargs(eager))
            (out.logits * R[b:b + 1, sl]).sum().backward()
            pieces.append(out.logits.detach())
            start += n
        rows.append(torch.cat(pieces, dim=1))
    return dict(logits=torch.cat(rows), grads=hf_cases.flat_grads(eager))


def compare(name: str, logits, grads, ref: dict, where: str) -> dict:
    return dict(name=name, family=name, where=where, same_weights=True,
                finite=bool(torch.isfinite(logits).all() and torch.isfinite(grads).all()),
                logit_err=float((logits - ref["logits"]).abs().max()),
                grad_err=float((grads - ref["grads"]).abs().max()), grad_scale=float(ref["grads"].abs().max()),
                worst_param="")


def run_cases(rank: int, world_size: int, families, refs: dict, layouts, docs=DOCS) -> list[dict]:
    """Rank worker: every family in each layout under cp_flash; gathered logits and gradients summed
    over ranks against ``refs[family]``. Also checks that the mixers reported their traffic."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    results = []
    for family in families:
        _, model = models(family)
        ids, pos, R = inputs(model.config.get_text_config().vocab_size, docs)
        for layout in layouts:
            where = f"world={world_size} {layout} rank={rank}"
            model.zero_grad(set_to_none=True)
            try:
                with cp_attention.context_parallel(layout=layout) as cp:
                    batch = cp.shard_batch(input_ids=ids, position_ids=pos)
                    if not _positions(model, pos):
                        batch.pop("position_ids")  # the documents reach the mixers through the batch record
                    out = model(**batch, **_kwargs(model))
                    mixers = cp_attention.forward_mixer_stats()
                    (out.logits * cp.shard(R, dim=1)).sum().backward()
                    logits = cp.gather(out.logits.detach(), dim=1)
                grads = hf_cases.flat_grads(model)
                dist.all_reduce(grads)
            except Exception as exc:  # noqa: BLE001 - reported by the test
                results.append(dict(name=family, family=family, where=where, error=f"{type(exc).__name__}: {exc}"))
                continue
            res = compare(family, logits, grads, refs[family], where)
            res["mixer_calls"] = len(mixers)
            res["mixer_bytes"] = sum(s.bytes_recv for s in mixers)
            results.append(res)
    return results


def run_compiled(rank: int, world_size: int, families, refs: dict) -> list[dict]:
    """Rank worker: each family compiled (``backend="eager"``) inside a zigzag block; the mixer calls
    leave the graph there and run across ranks."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    results = []
    for family in families:
        _, model = models(family)
        compiled = torch.compile(model, backend="eager")
        ids, pos, R = inputs(model.config.get_text_config().vocab_size)
        with cp_attention.context_parallel(layout="zigzag") as cp:
            batch = cp.shard_batch(input_ids=ids, position_ids=pos)
            if not _positions(model, pos):
                batch.pop("position_ids")
            out = compiled(**batch, **_kwargs(model))
            (out.logits * cp.shard(R, dim=1)).sum().backward()
            logits = cp.gather(out.logits.detach(), dim=1)
        grads = hf_cases.flat_grads(model)
        dist.all_reduce(grads)
        results.append(compare(family, logits, grads, refs[family], f"compiled world={world_size} rank={rank}"))
    return results
