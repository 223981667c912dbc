"""Cases and rank workers for tests/integrations/test_latent.py: multi-head latent attention under cp_flash,
whose ring moves each token's latent row instead of its heads (issue 55).

The ground truth is every document of a batch run alone under ``eager`` on one device (the families' own
attention, nothing of cp_attention's). Under context parallelism each rank counts the bytes its ring really
receives in every layer's forward (the comm's receives, as they are posted) and reports the call's
PlanStats; the test computes what the latent takes from the model's configuration and the plan's token
count, not from the code under test.

Workers are module-level functions so spawned ranks can import them (``tests/support`` is on sys.path).
"""

from __future__ import annotations

import copy

import torch

import cp_attention
from cp_attention.tools.sweeps.compare import flat_grads, param_spans
from cp_attention.tools.sweeps.configs import build_model, tiny_config

FAMILIES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "glm4_moe_lite", "minicpm3", "longcat_flash", "youtu")
SELECTING = ("deepseek_v32",)
"""Families whose attention layers select keys per query (DeepSeek Sparse Attention): their calls run the
engine's selected-keys strategy, whose exchange moves the selected keys' latent rows (an all-to-all)."""
LAYOUTS = ("zigzag", "contiguous", "balanced")
DOCS = ([17, 30, 17], [64])
"""Documents per row: a packed row whose middle document crosses every rank at world size 4, and a row of one
document (L = 64: zigzag slices of 8 at world size 4)."""
TOL = 1e-5


def inputs(vocab: int, seed: int = 0):
    """(input_ids (B, L), position_ids (B, L) restarting per document, R (B, L, vocab))."""
    g = torch.Generator().manual_seed(seed)
    L = sum(DOCS[0])
    ids = torch.randint(3, min(vocab, 60), (len(DOCS), L), generator=g)
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCS])
    return ids, pos, torch.randn(len(DOCS), L, vocab, generator=g)


def family_config(family: str):
    return tiny_config(family)


def ground_truth(model) -> dict:
    """Each document alone under eager: logits (B, L, V) and the flat gradients of sum(logits * R); a sparse
    attention indexer keeps the earlier key among equal scores (cp_flash's rule: tests/support/sparse_cases.py)."""
    import sparse_cases

    ids, _, R = inputs(model.config.vocab_size)
    model.zero_grad(set_to_none=True)
    with sparse_cases.earliest_of_ties(model):
        rows = _documents_alone(model, ids, R)
    return dict(logits=torch.cat(rows), grads=flat_grads(model), state=copy.deepcopy(model.state_dict()))


def _documents_alone(model, ids, R) -> list:
    rows = []
    for b, row in enumerate(DOCS):
        pieces, start = [], 0
        for n in row:
            sl = slice(start, start + n)
            out = model(input_ids=ids[b:b + 1, sl], position_ids=torch.arange(n)[None], use_cache=False)
            (out.logits * R[b:b + 1, sl]).sum().backward()
            pieces.append(out.logits.detach())
            start += n
        rows.append(torch.cat(pieces, dim=1))
    return rows


SELECTED_ROWS = "the selected keys' exchange"
"""What the selected-keys strategy names its K/V rows' all-to-all (its indices and gradients travel under other names)."""
HEADS_EXCHANGE = "an all-to-all of q, k, v (head parallelism)"
"""What head parallelism names its exchange of q and K/V (or latent rows) to the heads."""


def _counting(comm, world_size: int, received: list):
    """Count the bytes of every K/V receive the forward's exchanges post: the ring's (tags below the world size)
    and the selected keys' rows (their all-to-all). Returns the originals (recv, all_to_all)."""
    recv, all_to_all = comm.recv, comm.all_to_all

    def counting_recv(tensor, src, tag=0):
        if tag < world_size:
            received.append(tensor.numel() * tensor.element_size())
        recv(tensor, src, tag)

    def counting_all_to_all(sends, recvs, what, *args, **kwargs):
        if what in (SELECTED_ROWS, HEADS_EXCHANGE):
            received.append(sum(t.numel() * t.element_size() for t in recvs if t is not None))
        return all_to_all(sends, recvs, what, *args, **kwargs)

    comm.recv, comm.all_to_all = counting_recv, counting_all_to_all
    return recv, all_to_all


def run_model(model, layout: str, world_size: int, *, checkpointing: bool = False, strategy: str = "ring",
              **options) -> dict:
    """One forward and backward of the batch under context parallelism: gathered logits, gradients summed
    over the ranks, each layer call's PlanStats and the K/V bytes this rank's comm received in the forward."""
    import torch.distributed as dist

    ids, pos, R = inputs(model.config.vocab_size)
    model.zero_grad(set_to_none=True)
    received: list = []
    with cp_attention.context_parallel(layout=layout, strategy=strategy, **options) as cp:
        originals = _counting(cp.comm, world_size, received)
        batch = cp.shard_batch(input_ids=ids, position_ids=pos)
        if checkpointing:
            model.train()
        out = model(**batch, use_cache=False)
        calls = [s for _, s in cp_attention.forward_plan_stats()]
        forward_received = sum(received)
        cp.comm.recv, cp.comm.all_to_all = originals
        (out.logits * cp.shard(R, dim=1)).sum().backward()
        logits = cp.gather(out.logits.detach(), dim=1)
    model.eval()
    grads = flat_grads(model)
    dist.all_reduce(grads)
    return dict(logits=logits, grads=grads, calls=calls, received=forward_received)


def errors(model, run: dict, ref: dict, only: str | None = None) -> dict:
    """Max abs errors of logits and gradients (all parameters, and those whose name contains ``only``)."""
    diff = (run["grads"] - ref["grads"]).abs()
    out = dict(logits=float((run["logits"] - ref["logits"]).abs().max()), grads=float(diff.max()),
               grad_scale=float(ref["grads"].abs().max()))
    if only is not None:
        spans = [(a, b) for name, a, b in param_spans(model) if only in name]
        out["named"] = max((float(diff[a:b].max()) for a, b in spans), default=-1.0)
        out["named_count"] = len(spans)
    return out


def call_summary(calls) -> list[dict]:
    """What each layer call of a forward moved, as the test checks it."""
    return [dict(form=s.kv_form, strategy=s.strategy, recv=s.kv_bytes_recv, heads_recv=s.heads_kv_bytes_recv,
                 reason=s.kv_form_reason) for s in calls]


def run_families(rank: int, world_size: int, refs: dict, layouts=LAYOUTS) -> list[dict]:
    """Rank worker: every family in every layout, against its ground truth."""
    results = []
    for family in refs:
        model = build_model(family_config(family), "cp_flash", state_dict=refs[family]["state"])
        attn = _first_attention(model)
        for layout in layouts:
            run = run_model(model, layout, world_size)
            results.append(dict(family=family, layout=layout, rank=rank, errs=errors(model, run, refs[family],
                                                                                    "kv_b_proj"),
                                calls=call_summary(run["calls"]), received=run["received"],
                                dims=_dims(attn), itemsize=4))
    return results


def _first_attention(model):
    for module in model.modules():
        if hasattr(type(module), "expand_kv"):
            return module
    raise AssertionError("no multi-head latent attention module")


def _dims(attn) -> dict:
    return dict(heads=attn.num_heads, qk_head_dim=attn.qk_head_dim, v_head_dim=attn.v_head_dim,
                kv_lora_rank=attn.kv_lora_rank, qk_rope_head_dim=attn.qk_rope_head_dim)


# --------------------------------------------------------------------------------------------------
# LoRA on the projections, gradient checkpointing


LORA_TARGETS = ["kv_b_proj", "q_proj", "kv_a_proj_with_mqa", "o_proj"]


def lora_model(impl: str, state: dict | None = None, dropout: float = 0.0):
    """A tiny DeepSeek-V3 with LoRA adapters on its attention projections (the up-projection included), both
    adapter matrices random (a zero B, PEFT's default, would hide what the adapters and their dropout do)."""
    from peft import LoraConfig, get_peft_model

    model = build_model(family_config("deepseek_v3"), impl)
    torch.manual_seed(7)
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=LORA_TARGETS,
                                            init_lora_weights=False))
    if state is not None:
        peft.load_state_dict(state)
    return peft.eval()


def run_training_stacks(rank: int, world_size: int, lora_ref: dict, plain_ref: dict) -> dict:
    """Rank worker: LoRA on the projections, and gradient checkpointing, each against its ground truth."""
    peft = lora_model("cp_flash", lora_ref["state"])
    lora = run_model(peft, "zigzag", world_size)
    model = build_model(family_config("deepseek_v3"), "cp_flash", state_dict=plain_ref["state"])
    model.gradient_checkpointing_enable()
    ckpt = run_model(model, "zigzag", world_size, checkpointing=True)
    # LoRA dropout on the up-projection in training mode: the receiver could not repeat the expansion
    noisy = lora_model("cp_flash", dropout=0.5).train()
    ids, pos, _ = inputs(noisy.config.vocab_size)
    with cp_attention.context_parallel() as cp:
        noisy(**cp.shard_batch(input_ids=ids, position_ids=pos), use_cache=False)
        dropout_calls = call_summary([s for _, s in cp_attention.forward_plan_stats()])
    return dict(lora=errors(peft, lora, lora_ref, "lora_"), lora_calls=call_summary(lora["calls"]),
                ckpt=errors(model, ckpt, plain_ref, "kv_b_proj"), ckpt_calls=call_summary(ckpt["calls"]),
                dropout_calls=dropout_calls)


# --------------------------------------------------------------------------------------------------
# DeepSeek-V3's real attention shapes; a config whose heads are smaller than its latent


def dense_v3_config(*, layers: int, hidden: int, heads: int, kv_lora_rank: int, nope: int, rope: int, v: int):
    """A DeepSeek-V3 config whose every layer is dense (the attention is what is tested), with these attention
    shapes: ``heads`` heads of q/k head dim ``nope + rope`` and v head dim ``v``, a latent of ``kv_lora_rank``."""
    import transformers as tf

    return tf.DeepseekV3Config(vocab_size=64, hidden_size=hidden, intermediate_size=64, moe_intermediate_size=16,
                               num_hidden_layers=layers, first_k_dense_replace=layers, num_attention_heads=heads,
                               num_key_value_heads=heads, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                               n_group=1, topk_group=1, kv_lora_rank=kv_lora_rank, q_lora_rank=None,
                               qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v, max_position_embeddings=256,
                               attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def v3_shaped_config():
    """One DeepSeek-V3 layer with the real attention shapes (128 heads, q/k head dim 128 + 64, v head dim 128,
    kv_lora_rank 512), a narrow model around it."""
    return dense_v3_config(layers=1, hidden=64, heads=128, kv_lora_rank=512, nope=128, rope=64, v=128)


def small_heads_config():
    """A DeepSeek-V3 whose one head's keys and values (8 + 8 and 8 numbers) are smaller than its latent (32 + 8)."""
    return dense_v3_config(layers=1, hidden=32, heads=1, kv_lora_rank=32, nope=8, rope=8, v=8)


def run_shapes(rank: int, world_size: int, refs: dict) -> dict:
    """Rank worker: each named config of ``refs`` (its state and ground truth) under context parallelism."""
    configs = dict(v3_shaped=v3_shaped_config, small_heads=small_heads_config)
    out = {}
    for name, ref in refs.items():
        model = build_model(configs[name](), "cp_flash", state_dict=ref["state"])
        run = run_model(model, "zigzag", world_size)
        out[name] = dict(errs=errors(model, run, ref, "kv_b_proj"), calls=call_summary(run["calls"]),
                         received=run["received"], dims=_dims(_first_attention(model)))
    return out


# --------------------------------------------------------------------------------------------------
# DDP, FSDP2 and checkpointing (tests/support/training_workers.py's stack and ground truth)


MLA_SETUPS = (
    ("ddp/deepseek_v3/flatten/gc-reentrant/inside", "deepseek_v3", "flatten", "ddp", True, "inside"),
    ("fsdp2/deepseek_v3/rows/gc-nonreentrant/after", "deepseek_v3", "rows", "fsdp2", False, "after"),
    ("checkpoint-whole/minicpm3/flatten/after", "minicpm3", "flatten", "checkpoint-whole", None, "after"),
)


def run_stacks(rank: int, world_size: int) -> dict:
    """Rank worker: each setup of :data:`MLA_SETUPS` through training_workers' stack: its errors and the forms
    its layers moved (the forward's calls, and the last call, which for a model checkpointed whole is its
    recomputation during backward)."""
    import training_workers as tw

    out = {}
    for setup in MLA_SETUPS:
        errs = tw.run_setups(rank, world_size, (setup,), 1)[setup[0]]
        forms = {s.kv_form for _, s in cp_attention.forward_plan_stats()} | {cp_attention.last_plan_stats().kv_form}
        out[setup[0]] = dict(errs, forms=sorted(forms))
    return out


def run_strategies(rank: int, world_size: int, ref: dict, strategies) -> dict:
    """Rank worker: DeepSeek-V3 under each of ``strategies`` ((strategy, ulysses_size, cost model keywords)):
    errors, what each layer moved and the bytes this rank's comm received in the forward."""
    from cp_attention.strategies import CostModel

    model = build_model(family_config("deepseek_v3"), "cp_flash", state_dict=ref["state"])
    out = {}
    for strategy, size, cost in strategies:
        options = dict(ulysses_size=size, cost_model=CostModel(**cost))
        run = run_model(model, "zigzag", world_size, strategy=strategy, **options)
        out[f"{strategy}{size or ''}{'-slow' if cost else ''}"] = dict(
            errs=errors(model, run, ref, "kv_b_proj"), calls=call_summary(run["calls"]), received=run["received"],
            dims=_dims(_first_attention(model)))
    return out
