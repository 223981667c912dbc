"""Cases and rank workers for tests/integrations/test_index_sparse.py: the DeepSeek Sparse Attention families
(a lightning indexer picks each query's top-k keys) and Qwen4's block indexer under ``attn_implementation="cp_flash"``.

Tiny configs come from the family sweep's rules (``index_topk=8``: fewer than most queries see, so the
selection binds). The ground truth is the same weights under ``"eager"`` with each packed document run
alone, with one rule for ties at the k-th place written here from cp_flash's documented semantics:
among equal index scores the earlier key is kept (:func:`earliest_of_ties`; eager's ``torch.topk``
leaves the order of ties unspecified, and after the indexer's ReLU many scores are exactly 0).

Compared: logits and parameter gradients of ``sum(logits * R)`` (``hf_cases``' tolerances), and every
indexer layer's selection: the keys each query keeps (its top-k that it may see), as global indices.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

import cp_attention
from cp_attention.integrations.hf import check as model_check
import hf_cases
import hybrid_cases

SPARSE = ("deepseek_v32", "glm_moe_dsa", "hy_v4", "axk2", "dots3_note_text", "qwen4_exp_text")
COMPRESSED = ("deepseek_v4",)  # its indexer selects compressed entries, not tokens: logits and gradients compared

# Two rows (L = 46): documents crossing every rank at world sizes 2 and 4 in every layout, one-token
# documents, and a row that is one document (most queries see more than k = 8 keys).
DOCS = ((13, 1, 22, 1, 8, 1), (46,))


class _Earliest(TorchFunctionMode):
    """``topk``: each row ordered by hand by (score descending, index ascending), the first k kept."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in (torch.topk, torch.Tensor.topk):
            return func(*args, **kwargs)
        given = dict(zip(("input", "k", "dim", "largest", "sorted"), args), **kwargs)
        x, k, dim = given["input"], given["k"], given.get("dim", -1) % given["input"].dim()
        if x.numel() == 0 or k == 0:  # nothing to order
            return func(*args, **kwargs)
        rows = x.movedim(dim, -1)
        picks = [sorted(range(len(row)), key=lambda j, row=row: (-row[j], j))[:k]
                 for row in rows.reshape(-1, rows.shape[-1]).tolist()]
        ind = torch.tensor(picks, dtype=torch.int64).reshape(*rows.shape[:-1], k).movedim(-1, dim)
        return torch.return_types.topk((torch.gather(x, dim, ind), ind))


def as_indices(output, width: int) -> torch.Tensor:
    """An indexer's output as (B, S, width) int64 selected key indices padded with -1: DSA's indices,
    Qwen4's (B, 1, S, T) boolean mask under eager, or cp_flash's selection object (``.key_select``)."""
    if hasattr(output, "key_select"):
        output = output.key_select
    output = output.detach()
    if output.dtype == torch.bool:
        rows = output[:, 0]
        T = rows.shape[-1]
        output = torch.where(rows, torch.arange(T), T).sort(-1).values
        output = output.masked_fill(output == T, -1)
    output = output.long()
    if output.shape[-1] < width:
        output = torch.nn.functional.pad(output, (0, width - output.shape[-1]), value=-1)
    return output


@contextlib.contextmanager
def earliest_of_ties(model, record: list | None = None):
    """Inside ``model``'s indexer modules, top-k keeps the earlier key among equal scores; every
    indexer output is appended to ``record`` (when given), in call order."""
    handles = []
    for module in model.modules():
        if type(module).__name__.endswith("Indexer"):
            mode = _Earliest()

            def enter(*_, m=mode):
                m.__enter__()

            def leave(_module, _args, output, m=mode):
                m.__exit__(None, None, None)
                if record is not None:
                    record.append(as_indices(output, 0))

            handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def recording(model, record: list):
    """Append every indexer output of ``model`` to ``record`` (cp_flash's own tie rule applies)."""
    def leave(_module, _args, output):
        record.append(output)

    handles = [m.register_forward_hook(leave) for m in model.modules() if type(m).__name__.endswith("Indexer")]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def kept(indices_BLk: torch.Tensor, doc_start_BL: torch.Tensor) -> list:
    """Per row and query, the sorted global keys of its selection that it may see (its document, not later)."""
    L = indices_BLk.shape[1]
    q = torch.arange(L)[None, :, None]
    ok = (indices_BLk >= doc_start_BL[..., None]) & (indices_BLk <= q)
    return [[sorted(set(row[ok_row].tolist())) for row, ok_row in zip(rows, oks)] for rows, oks in zip(indices_BLk, ok)]


def doc_starts(docs=DOCS) -> torch.Tensor:
    """(B, L) the global index of each token's document's first token."""
    rows = []
    for row in docs:
        starts, at = [], 0
        for n in row:
            starts += [at] * n
            at += n
        rows.append(starts)
    return torch.tensor(rows)


def ground_truth(eager, docs=DOCS) -> dict:
    """Each document alone under eager with the tie rule: logits, flat gradients, and per indexer
    layer the kept keys of every query (global indices)."""
    ids, pos, R = hybrid_cases.inputs(eager.config.get_text_config().vocab_size, docs)
    eager.zero_grad(set_to_none=True)
    rows, selections = [], []
    for b, row in enumerate(docs):
        pieces, start, per_doc = [], 0, []
        for n in row:
            sl = slice(start, start + n)
            record: list = []
            entries = type(eager).__name__.startswith("DeepseekV4")  # it selects entries, not tokens: not compared
            with earliest_of_ties(eager, None if entries else record):
                out = eager(input_ids=ids[b:b + 1, sl], position_ids=torch.arange(n)[None], use_cache=False)
            (out.logits * R[b:b + 1, sl]).sum().backward()
            pieces.append(out.logits.detach())
            per_doc.append([idx.long() + start for idx in record])  # document-local -> global
            start += n
        rows.append(torch.cat(pieces, dim=1))
        # per layer: this row's queries' selections, padded to one width with -1
        layers = []
        for layer in range(len(per_doc[0])):
            width = max(d[layer].shape[-1] for d in per_doc)
            parts = [torch.nn.functional.pad(d[layer], (0, width - d[layer].shape[-1]), value=-1) for d in per_doc]
            layers.append(torch.cat(parts, dim=1))
        selections.append(layers)
    starts = doc_starts(docs)
    kept_sel = [[kept(selections[b][layer], starts[b:b + 1])[0] for b in range(len(docs))]
                for layer in range(len(selections[0]))]
    return dict(logits=torch.cat(rows), grads=hf_cases.flat_grads(eager), kept=kept_sel)


def run_cases(rank: int, world_size: int, families, refs: dict, layouts, docs=DOCS) -> list[dict]:
    """Rank worker: every family in each layout under cp_flash; gathered logits, gradients summed over
    ranks and every indexer layer's gathered selection against ``refs[family]``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    results = []
    starts = doc_starts(docs)
    for family in families:
        _, model = hybrid_cases.models(family)
        ids, pos, R = hybrid_cases.inputs(model.config.get_text_config().vocab_size, docs)
        for layout in layouts:
            where = f"world={world_size} {layout} rank={rank}"
            model.zero_grad(set_to_none=True)
            record: list = []
            try:
                # the hooks record this forward's selections: not those of the model check's trace (run first,
                # here) or of the first-use verification (off)
                model_check.check_model(model)
                with cp_attention.context_parallel(layout=layout, verify=False) as cp:
                    batch = cp.shard_batch(input_ids=ids, position_ids=pos)
                    with recording(model, record):
                        out = model(**batch, use_cache=False)
                    stats = [s for _, s in cp_attention.forward_plan_stats() if s.strategy == "select"]
                    (out.logits * cp.shard(R, dim=1)).sum().backward()
                    logits = cp.gather(out.logits.detach(), dim=1)
                    selections = [] if family in COMPRESSED else \
                        [cp.gather(as_indices(idx, ids.shape[1]), dim=1) for idx in record]
                grads = hf_cases.flat_grads(model)
                dist.all_reduce(grads)
            except Exception as exc:  # noqa: BLE001 - reported by the test
                results.append(dict(name=family, family=family, where=where, error=f"{type(exc).__name__}: {exc}"))
                continue
            res = hybrid_cases.compare(family, logits, grads, refs[family], where)
            got = [[kept(sel[b:b + 1], starts[b:b + 1])[0] for b in range(len(docs))] for sel in selections]
            res["selections_equal"] = family in COMPRESSED or got == refs[family]["kept"]
            res["select_layers"] = len(stats)
            res["kv_bytes_recv"] = sum(s.kv_bytes_recv for s in stats)
            res["ring_kv_bytes"] = sum(s.ring_kv_bytes_recv for s in stats)
            results.append(res)
    return results


def run_compiled(rank: int, world_size: int, family: str, ref: dict) -> dict:
    """Rank worker: ``family`` compiled (``backend="eager"``) inside a zigzag block: the indexers and the
    selected-keys attention leave the graph and run across ranks."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    _, model = hybrid_cases.models(family)
    compiled = torch.compile(model, backend="eager")
    ids, pos, R = hybrid_cases.inputs(model.config.get_text_config().vocab_size, DOCS)
    with cp_attention.context_parallel(layout="zigzag") as cp:
        out = compiled(**cp.shard_batch(input_ids=ids, position_ids=pos), use_cache=False)
        (out.logits * cp.shard(R, dim=1)).sum().backward()
        logits = cp.gather(out.logits.detach(), dim=1)
    grads = hf_cases.flat_grads(model)
    if world_size > 1:
        dist.all_reduce(grads)
    return hybrid_cases.compare(family, logits, grads, ref, f"compiled world={world_size} rank={rank}")


# (name, family, batch form, wrapper, gradient checkpointing (reentrant), backward). DDP needs
# find_unused_parameters=True for these families, on one device as under CP: their indexers' parameters
# get no gradient (DSA's runs under no_grad; a top-k's indices carry none), and DDP without it leaves
# the buckets holding them unreduced (the gradients come out 1.3-1.5x off, silently)
TRAINING_SETUPS = (
    ("fsdp2/deepseek_v32/rows/gc-reentrant/after", "deepseek_v32", "rows", "fsdp2", True, "after"),
    ("ddp/qwen4_exp_text/flatten/gc-nonreentrant/inside", "qwen4_exp_text", "flatten", "ddp-unused", False,
     "inside"),
)


def run_training(rank: int, world_size: int, setups=TRAINING_SETUPS) -> dict:
    """Rank worker: the training stack's setups (training_workers.run_setups) for index-sparse families,
    against each document alone under eager with the tie rule."""
    import training_workers as tw

    plain = tw.ground_truth

    def tied(ref, replicas):
        with earliest_of_ties(ref):
            return plain(ref, replicas)

    tw.ground_truth = tied
    try:
        return tw.run_setups(rank, world_size, setups, 1)
    finally:
        tw.ground_truth = plain


def padded_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids (2, 32), attention_mask (2, 32)): row 0 left-padded by 7, row 1 right-padded by 3."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 96, (2, 32), generator=g)
    mask = torch.ones(2, 32, dtype=torch.long)
    mask[0, :7] = 0
    mask[1, 29:] = 0
    return ids, mask


def run_padded(rank: int, world_size: int, family: str) -> torch.Tensor:
    """Rank worker: the padded batch's logits under cp_flash in a block (gathered)."""
    torch.set_num_threads(1)
    _, model = hybrid_cases.models(family)
    ids, mask = padded_inputs()
    with torch.no_grad(), cp_attention.context_parallel() as cp:
        out = model(**cp.shard_batch(input_ids=ids, attention_mask=mask), use_cache=False).logits
        return cp.gather(out, dim=1)
