"""Rank workers for tests/integrations/test_training.py: cp_flash models trained through the real tools (DDP,
FSDP2, gradient checkpointing, transformers' packing collator), compared with the ground truth:
the same weights under "eager" on one process, each packed document run alone.

Ground truth of one data-parallel replica's batch of documents: loss = (sum over documents of the
summed token cross-entropy) / (number of predicted tokens); its gradient. Under dp x cp the data-
parallel mean of the replicas' ground truths. Workers are module-level so spawned ranks import them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import cp_attention
from cp_attention.tools.tiny_models import tiny_config, tiny_model
from planutil import strategy_error, strategy_options

WINDOW = 6  # tokens: windows cross shard and document boundaries at these lengths
REL_TOL = 1e-5


def documents(seed: int, vocab: int = 128) -> list[torch.Tensor]:
    """Token ids of the documents of one replica's batch (2 to 31 tokens, 96 in all; the first
    documents make 48 tokens, the others 48: see :func:`rows`)."""
    g = torch.Generator().manual_seed(seed)
    groups = ([17, 31], [2, 9, 5, 23, 9])
    lengths = [group[i] for group in groups for i in torch.randperm(len(group), generator=g).tolist()]
    return [torch.randint(3, vocab, (n,), generator=g) for n in lengths]


def flattened(docs: list[torch.Tensor]) -> dict:
    """transformers' DataCollatorWithFlattening output, every optional key on."""
    from transformers import DataCollatorWithFlattening

    collate = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)
    return collate([{"input_ids": d.tolist(), "labels": d.tolist()} for d in docs])


def rows(docs: list[torch.Tensor]) -> dict:
    """Two packed rows of equal length (positions restart per document, first label -100)."""
    half = [docs[:2], docs[2:]]
    ids = [torch.cat(r) for r in half]
    assert ids[0].numel() == ids[1].numel() == 48
    pos = [torch.cat([torch.arange(d.numel()) for d in r]) for r in half]
    labels = [i.clone() for i in ids]
    for lab, p in zip(labels, pos):
        lab[p == 0] = -100
    return dict(input_ids=torch.stack(ids), position_ids=torch.stack(pos), labels=torch.stack(labels))


def models(family: str):
    if family in HYBRID_FAMILIES:  # attention mixed with convolutions / recurrences (tests/support/hybrid_cases.py)
        import hybrid_cases

        ref, cp = hybrid_cases.models(family)
        return cp.train(), ref.train()
    cfg = tiny_config(family, window=WINDOW)
    cp = tiny_model(family, "cp_flash", config=cfg).train()
    ref = tiny_model(family, "eager", config=cfg).train()
    ref.load_state_dict(cp.state_dict())
    return cp, ref


HYBRID_FAMILIES = ("qwen3_next", "nemotron_h", "jamba", "lfm2", "falcon_h1",
                   "deepseek_v32", "qwen4_exp_text",  # and the index-sparse families (sweep configs)
                   "minimax", "kimi_linear", "recurrent_gemma", "rwkv", "xlstm", "mamba",  # issue 39's mixers
                   "deepseek_v3", "minicpm3")  # multi-head latent attention (issue 55: the ring moves the latent)


def ground_truth(ref, docs_per_replica: list[list[torch.Tensor]]) -> tuple[list[float], dict]:
    """Each replica's loss and the mean over replicas of the gradients, with each document run
    alone under eager."""
    losses, grads = [], {}
    for docs in docs_per_replica:
        ref.zero_grad(set_to_none=True)
        n_items = torch.tensor(sum(d.numel() - 1 for d in docs))
        total = 0.0
        for d in docs:
            out = ref(input_ids=d[None], labels=d[None], num_items_in_batch=n_items, use_cache=False)
            out.loss.backward()
            total += float(out.loss)
        losses.append(total)
        for name, p in ref.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            grads[name] = grads.get(name, 0) + g / len(docs_per_replica)
    return losses, grads


def full_grads(model) -> dict:
    """Parameter name (without wrapper prefixes) -> full gradient (DTensor shards gathered)."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros(p.shape)
        if hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out[name.removeprefix("module.")] = g.detach().clone()
    return out


def errors(loss: float, grads: dict, ref_loss: float, ref_grads: dict) -> dict:
    """Relative errors: loss, and the worst parameter's max |g - ref| / max |ref| over all parameters."""
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    worst = max(float((grads[n] - g).abs().max()) for n, g in ref_grads.items())
    ratios = [float(grads[n].norm() / g.norm()) for n, g in ref_grads.items() if float(g.norm()) > 0]
    return dict(loss_err=abs(loss - ref_loss) / abs(ref_loss), grad_err=worst / scale,
                grad_ratio=sum(ratios) / len(ratios))


def train_step(model, batch_full: dict, cp_group, *, backward: str, layout: str = "zigzag",
               strategy: str = "ring") -> float:
    """One forward under the context, backward inside or after it; returns the CP-mean loss."""
    with cp_attention.context_parallel(cp_group, layout=layout, **strategy_options(strategy)) as cp:
        batch = cp.shard_batch(**batch_full)
        out = model(**batch, use_cache=False)
        wrong = strategy_error(strategy, cp_attention.forward_plan_stats()) if cp.world_size > 1 else None
        assert wrong is None, wrong
        if backward == "inside":
            out.loss.backward()
    if backward == "after":
        out.loss.backward()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=cp.group)
    return float(loss) / cp.world_size


class _CheckpointWholeModel(torch.nn.Module):
    """torch.utils.checkpoint around the whole model call (non-reentrant): its recompute, masks
    included, runs during backward, after the context_parallel block; gradients averaged over the
    group by hand (all_reduce of the sum, divided by the group size) after backward."""

    def __init__(self, model, group):
        super().__init__()
        self.module, self.group = model, group

    def forward(self, **batch):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(lambda **kw: self.module(**kw), use_reentrant=False, **batch)

    def average_grads(self):
        for p in self.module.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=self.group)
            p.grad /= dist.get_world_size(self.group)


def _wrap(model, how: str, group, mesh=None):
    if how == "checkpoint-whole":
        return _CheckpointWholeModel(model, group)
    if how in ("ddp", "ddp-unused"):  # "ddp-unused": parameters without a gradient (a no_grad indexer's)
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, process_group=group, find_unused_parameters=how == "ddp-unused")
    if how == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    raise ValueError(how)


# setups: (name, family, collator, wrapper, gradient checkpointing (None / reentrant / non-reentrant), backward)
CP2_SETUPS = (
    ("ddp/mistral/flatten/inside", "mistral", "flatten", "ddp", None, "inside"),
    ("ddp/mistral/rows/after", "mistral", "rows", "ddp", None, "after"),
    ("ddp/qwen3/flatten/gc-reentrant/after", "qwen3", "flatten", "ddp", True, "after"),
    ("ddp/qwen3/rows/gc-reentrant/inside", "qwen3", "rows", "ddp", True, "inside"),
    ("ddp/mistral/flatten/gc-nonreentrant/after", "mistral", "flatten", "ddp", False, "after"),
    ("ddp/gemma3/rows/gc-nonreentrant/inside", "gemma3", "rows", "ddp", False, "inside"),
    ("fsdp2/mistral/flatten/gc-nonreentrant/after", "mistral", "flatten", "fsdp2", False, "after"),
    ("checkpoint-whole/qwen3/flatten/after", "qwen3", "flatten", "checkpoint-whole", None, "after"),
    ("checkpoint-whole/llama4/flatten/after", "llama4", "flatten", "checkpoint-whole", None, "after"),
    ("checkpoint-whole/cohere2/rows/after", "cohere2", "rows", "checkpoint-whole", None, "after"),
)
HYBRID_SETUPS = (  # gated DeltaNet, Mamba-2, Mamba and short convolutions through the same stack
    ("ddp/qwen3_next/flatten/gc-nonreentrant/after", "qwen3_next", "flatten", "ddp", False, "after"),
    ("fsdp2/nemotron_h/rows/gc-reentrant/inside", "nemotron_h", "rows", "fsdp2", True, "inside"),
    ("checkpoint-whole/jamba/flatten/after", "jamba", "flatten", "checkpoint-whole", None, "after"),
    ("ddp/lfm2/rows/inside", "lfm2", "rows", "ddp", None, "inside"),
    ("fsdp2/falcon_h1/flatten/gc-nonreentrant/after", "falcon_h1", "flatten", "fsdp2", False, "after"),
)
MORE_MIXER_SETUPS = (  # issue 39: lightning attention, KDA, RG-LRU, RWKV, xLSTM, a pure Mamba
    ("ddp/minimax/rows/gc-reentrant/inside", "minimax", "rows", "ddp", True, "inside"),
    ("fsdp2/kimi_linear/flatten/gc-nonreentrant/after", "kimi_linear", "flatten", "fsdp2", False, "after"),
    ("checkpoint-whole/recurrent_gemma/rows/after", "recurrent_gemma", "rows", "checkpoint-whole", None, "after"),
    ("ddp/rwkv/flatten/after", "rwkv", "flatten", "ddp", None, "after"),
    ("ddp/xlstm/rows/gc-nonreentrant/inside", "xlstm", "rows", "ddp", False, "inside"),
    ("checkpoint-whole/mamba/flatten/after", "mamba", "flatten", "checkpoint-whole", None, "after"),
)
DPCP_SETUPS = (
    ("ddp/mistral/flatten/after", "mistral", "flatten", "ddp", None, "after"),
    ("ddp/qwen3/rows/gc-reentrant/after", "qwen3", "rows", "ddp", True, "after"),
    ("fsdp2/mistral/rows/inside", "mistral", "rows", "fsdp2", None, "inside"),
    ("fsdp2/qwen3/flatten/gc-nonreentrant/after", "qwen3", "flatten", "fsdp2", False, "after"),
)


def run_setups(rank: int, world_size: int, setups, dp: int, strategy: str = "ring") -> dict:
    """Every setup on a (dp, cp = world_size / dp) mesh: DDP / FSDP2 over all ranks (the flattened
    dp x cp group), CP over the mesh's "cp" dimension (with ``strategy``). Returns name -> errors
    on this rank."""
    from torch.distributed.device_mesh import init_device_mesh

    cp_size = world_size // dp
    mesh = init_device_mesh("cpu", (dp, cp_size), mesh_dim_names=("dp", "cp"))
    flat = mesh["dp", "cp"]._flatten("dp_cp")
    dp_rank = mesh.get_local_rank("dp")
    results = {}
    for name, family, collator, wrapper, reentrant, backward in setups:
        torch.manual_seed(0)
        model, ref = models(family)
        if reentrant is not None:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        wrapped = _wrap(model, wrapper, flat.get_group(), mesh=flat)
        replicas = [documents(seed) for seed in range(dp)]
        make = flattened if collator == "flatten" else rows
        loss = train_step(wrapped, make(replicas[dp_rank]), mesh["cp"], backward=backward, strategy=strategy)
        if isinstance(wrapped, _CheckpointWholeModel):
            wrapped.average_grads()
        ref_losses, ref_grads = ground_truth(ref, replicas)
        # the CP mean of the losses is this replica's loss; DDP/FSDP2 average the replicas' gradients
        results[name] = errors(loss, full_grads(wrapped), ref_losses[dp_rank], ref_grads)
    return results


def _doc_logits(ref, docs: list[torch.Tensor]) -> torch.Tensor:
    """(1, sum n, V) logits of the documents, each run alone under eager."""
    with torch.no_grad():
        return torch.cat([ref(input_ids=d[None], use_cache=False).logits for d in docs], dim=1)


def _outcome(fn) -> str:
    try:
        fn()
        return "ok"
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        return f"{type(exc).__name__}: {exc}"


def run_extras(rank: int, world_size: int) -> dict:
    """Stale batches, torch's context_parallel active, DeviceMesh groups (2 ranks)."""
    from torch.distributed.device_mesh import init_device_mesh

    found = {}
    model, ref = models("mistral")
    model.eval()
    docs_a, docs_b = documents(0), documents(1)
    A, B = flattened(docs_a), flattened(docs_b)  # both 96 tokens
    ref_a, ref_b = _doc_logits(ref, docs_a), _doc_logits(ref, docs_b)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    with torch.no_grad():
        # stale record: shard A, then B (prefetching), then run A's tensors, then B's
        with cp_attention.context_parallel(mesh) as cp:  # a 1-D DeviceMesh as the group
            a, b = cp.shard_batch(**A), cp.shard_batch(**B)
            found["stale_a"] = float((cp.gather(model(**a).logits) - ref_a).abs().max())
            found["stale_b"] = float((cp.gather(model(**b).logits) - ref_b).abs().max())
            found["forward_stats"] = [(layer, st.world_size, st.kv_bytes_recv)
                                      for layer, st in cp_attention.forward_plan_stats()]
            # a model whose layers get no position_ids cannot tell A from B: it must raise
            llama = tiny_model("llama4", "cp_flash", config=tiny_config("llama4", window=WINDOW))
            llama_ref = tiny_model("llama4", "eager", config=tiny_config("llama4", window=WINDOW))
            run_a = dict(input_ids=a["input_ids"], position_ids=a["position_ids"], use_cache=False)
            found["ambiguous"] = _outcome(lambda: llama(**run_a))
            del b  # B's tensors are gone: A is the only live batch again
            logits = cp.gather(llama(**run_a).logits)
            found["unambiguous"] = float((logits - _doc_logits(llama_ref, docs_a)).abs().max())
        # a 2-D mesh with the CP dimension named
        mesh2 = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "cp"))
        with cp_attention.context_parallel(mesh2, mesh_dim="cp") as cp:
            found["mesh_dim"] = float((cp.gather(model(**cp.shard_batch(**A)).logits) - ref_a).abs().max())
        found["mesh_2d_unnamed"] = _outcome(lambda: cp_attention.context_parallel(mesh2).__enter__())
        # torch's own context parallelism active: cp_flash must refuse, not attend within the shard
        from torch.distributed.tensor.experimental import context_parallel as torch_context_parallel

        ids = A["input_ids"].clone()
        with torch_context_parallel(mesh, buffers=[ids], buffer_seq_dims=[1]):
            found["torch_cp"] = _outcome(lambda: model(input_ids=ids, use_cache=False))
    return found


def run_balanced(rank: int, world_size: int) -> dict:
    """cp_flash models under context_parallel(layout="balanced") against each document alone under
    eager: logits, and DDP-averaged gradients with the loss's backward after the block."""
    from torch.nn.parallel import DistributedDataParallel

    found = {}
    for family in ("mistral", "gemma3", "llama4"):
        torch.manual_seed(0)
        model, ref = models(family)
        docs = documents(3)
        batch = flattened(docs)
        ddp = DistributedDataParallel(model)
        with cp_attention.context_parallel(layout="balanced") as cp:
            local = cp.shard_batch(**batch, model=model)
            layout = cp_attention.engine.batch.batch_of(local["input_ids"]).layout
            out = ddp(**local, use_cache=False)
            logits = cp.gather(out.logits.detach())
        out.loss.backward()
        loss = out.loss.detach().clone()
        dist.all_reduce(loss)
        ref_losses, ref_grads = ground_truth(ref, [docs])
        e = errors(float(loss) / world_size, full_grads(ddp), ref_losses[0], ref_grads)
        e["logits"] = float((logits - _doc_logits(ref, docs)).abs().max())
        e["runs"] = [len(r) for r in layout.ranges]
        found[family] = e
    return found
