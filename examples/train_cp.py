"""Train a tiny model under context parallelism and check every step against one device.

Each step packs random documents of varying length into rows of ``--seq-len`` tokens
(``position_ids`` restart at 0 at every document; the first token of a document gets label -100,
so nothing is predicted across a document boundary), shards the batch with ``cp.shard_batch`` and
runs forward and backward under ``attn_implementation="cp_flash"`` with the model wrapped in
``DistributedDataParallel`` over the CP ranks: each rank's ``out.loss`` is P times its share of the
loss, so DDP's gradient mean is the single-device gradient and the mean of the ranks' losses is the
single-device loss (backward runs after the ``context_parallel`` block, as most training loops do).

Rank 0 also trains an identical copy of the model on one device, with an identical optimizer:
the same weights under ``attn_implementation="eager"``, each document run alone (the ground
truth; the packed loss is the sum over documents divided by the number of label tokens). Every
step prints the CP loss next to the single-device loss; exits 1 if any step's relative difference
exceeds ``--rtol`` (default 1e-5).

    python examples/train_cp.py [--model qwen3] [--nproc 2] [--steps 5]     # spawns gloo ranks on CPU
    torchrun --nproc-per-node 2 examples/train_cp.py [options]              # NCCL when CUDA is available
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import cp_attention
from cp_attention.tools.launch import run_ranks
from cp_attention.tools.tiny_models import FAMILIES, is_causal_lm, tiny_model

CAUSAL_FAMILIES = tuple(f for f in FAMILIES if is_causal_lm(f))


def packed_batch(step: int, args, vocab: int):
    """(input_ids, position_ids, labels) of shape (B, L) and the document lengths of every row."""
    gen = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(3, vocab, (args.batch, args.seq_len), generator=gen)
    rows = []
    for _ in range(args.batch):
        lengths, left = [], args.seq_len
        while left > 0:
            n = int(torch.randint(args.min_doc, args.max_doc + 1, (1,), generator=gen))
            n = left if left - n < args.min_doc else n  # no document shorter than min_doc
            lengths.append(n)
            left -= n
        rows.append(lengths)
    position_ids = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in rows])
    labels = ids.clone()
    labels[position_ids == 0] = -100  # the first token of a document is predicted by nobody
    return ids, position_ids, labels, rows


def _all_grads(model) -> list[torch.Tensor]:
    """Every parameter's gradient, zeros where backward left none (so all ranks and the reference
    reduce and step the same parameters)."""
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return [p.grad for p in model.parameters()]


def _reference_step(model, optimizer, ids, labels, rows, device) -> float:
    """One single-device step: each document alone, loss = sum over documents / label tokens."""
    num_items = torch.tensor(sum(n - 1 for lengths in rows for n in lengths), device=device)
    total = 0.0
    for b, lengths in enumerate(rows):
        start = 0
        for n in lengths:
            doc = slice(start, start + n)
            out = model(input_ids=ids[b:b + 1, doc], position_ids=torch.arange(n, device=device).unsqueeze(0),
                        labels=labels[b:b + 1, doc], num_items_in_batch=num_items, use_cache=False)
            out.loss.backward()
            total += out.loss.item()
            start += n
    _all_grads(model)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def _rank_main(rank, world_size, args, device="cpu"):
    torch.set_num_threads(1)
    device = torch.device(device)
    model = tiny_model(args.model, "cp_flash", seed=args.seed).to(device).train()
    if rank == 0:
        reference = tiny_model(args.model, "eager", seed=args.seed).to(device).train()
        reference.load_state_dict(model.state_dict())
    model = DistributedDataParallel(model)  # gradients averaged over the CP ranks
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if rank == 0:
        ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=args.lr)
    records = []
    for step in range(args.steps):
        ids, position_ids, labels, rows = packed_batch(step, args, model.module.config.vocab_size)
        ids, position_ids, labels = ids.to(device), position_ids.to(device), labels.to(device)
        with cp_attention.context_parallel(layout=args.layout) as cp:
            batch = cp.shard_batch(input_ids=ids, position_ids=position_ids, labels=labels)
            out = model(**batch, use_cache=False)
        out.loss.backward()  # DDP averages the gradients over the ranks: the single-device gradient
        loss = out.loss.detach().clone()
        dist.all_reduce(loss)  # the mean of the ranks' losses is the single-device loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            ref_loss = _reference_step(reference, ref_optimizer, ids, labels, rows, device)
            records.append(dict(step=step + 1, docs=sum(len(r) for r in rows), cp=loss.item() / world_size,
                                single=ref_loss))
    if rank != 0:
        return None
    param_diff = max((p - q).abs().max().item() for p, q in zip(model.module.parameters(), reference.parameters()))
    return dict(records=records, param_diff=param_diff)


def report(result, args, world_size) -> int:
    print(f"train_cp: tiny random {args.model}, {world_size} CP ranks, {args.layout} layout, {args.steps} AdamW "
          f"steps (lr {args.lr}), batch {args.batch} x {args.seq_len} tokens of packed documents "
          f"({args.min_doc}-{args.max_doc} tokens)")
    print("single device: the same weights under 'eager', each document alone, identical AdamW")
    worst = 0.0
    for r in result["records"]:
        rel = abs(r["cp"] - r["single"]) / max(abs(r["single"]), 1e-12)
        worst = max(worst, rel)
        print(f"step {r['step']}: {r['docs']:2d} documents  CP loss {r['cp']:.8f}  single-device loss "
              f"{r['single']:.8f}  relative difference {rel:.1e}")
    print(f"max |parameter CP - single device| after {args.steps} steps: {result['param_diff']:.1e}")
    ok = worst <= args.rtol
    print(f"OK: CP loss equals the single-device loss at every step (max relative difference {worst:.1e})" if ok
          else f"FAIL: relative difference {worst:.1e} > {args.rtol:g}")
    return 0 if ok else 1


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3", choices=CAUSAL_FAMILIES, help="model family (default qwen3)")
    parser.add_argument("--nproc", type=int, default=2, help="gloo ranks to spawn (ignored under torchrun)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=2, help="packed rows per step")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--min-doc", type=int, default=16, help="shortest document (tokens)")
    parser.add_argument("--max-doc", type=int, default=200, help="longest document (tokens)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--layout", default="zigzag", choices=cp_attention.layout.LAYOUTS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rtol", type=float, default=1e-5)
    args = parser.parse_args(argv)
    if not 2 <= args.min_doc <= args.max_doc:
        parser.error("need 2 <= --min-doc <= --max-doc")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: NCCL on GPUs, else gloo
        cuda = torch.cuda.is_available()
        dist.init_process_group("nccl" if cuda else "gloo")
        device = "cpu"
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            device = f"cuda:{torch.cuda.current_device()}"
        try:
            result = _rank_main(dist.get_rank(), dist.get_world_size(), args, device)
            world_size = dist.get_world_size()
        finally:
            dist.destroy_process_group()
        return 0 if result is None else report(result, args, world_size)
    result = run_ranks(args.nproc, _rank_main, args, timeout=600)[0]
    return report(result, args, args.nproc)


if __name__ == "__main__":
    sys.exit(main())
