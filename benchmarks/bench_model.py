"""A training step of small real architectures under "cp_flash", "sdpa" and "eager", one device.

    python benchmarks/bench_model.py                       # CPU: L 4096; GPU: L 8192 and 32768
    python benchmarks/bench_model.py --smoke --out bench_out

Models (transformers, random weights): ``qwen3`` (every layer full causal attention, GQA) and
``gemma3`` (five sliding-window layers, then one full layer; GQA). Data: ``packed`` (one row of
packed documents, the realistic length mix of ``harness.document_lengths``, positions restarting at
every document) and ``single`` (one document). Under ``sdpa`` and ``eager``, transformers turns a
sliding window or packed documents into a dense (L, L) mask; ``cp_flash`` computes the same
attention from O(L) metadata.

One step: forward with labels, backward, AdamW step, gradients cleared. Reported per
(model, data, L, implementation): tokens/s (median step, implementations interleaved), the loss of
the first step (identical weights and data, so the implementations must agree), and the peak extra
memory of one steady-state step (``harness.peak_memory``; model, optimizer state and inputs exist
before it).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402

import cp_attention  # noqa: E402,F401  (registers attn_implementation="cp_flash")

IMPLS = ("cp_flash", "sdpa", "eager")
MODELS = ("qwen3", "gemma3")
DATA = ("packed", "single")
SIZES = {  # name: (vocab, hidden, intermediate, heads, kv_heads, head_dim, qwen3 layers, gemma3 layers, window)
    "smoke": (256, 64, 128, 2, 1, 32, 2, 3, 32),
    "cpu": (4096, 256, 768, 4, 2, 64, 4, 6, 1024),
    "gpu": (32768, 1024, 3072, 16, 8, 128, 4, 6, 1024),
}


def model_config(model: str, size: str):
    """A Qwen3- or Gemma-3-shaped config of the given size (see ``SIZES``)."""
    import transformers as tf

    vocab, hidden, inter, heads, kv, head_dim, q_layers, g_layers, window = SIZES[size]
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                  num_key_value_heads=kv, head_dim=head_dim, max_position_embeddings=131072, attention_dropout=0.0,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if model == "qwen3":
        return tf.Qwen3Config(**common, num_hidden_layers=q_layers)
    if model == "gemma3":
        types = ["sliding_attention"] * (g_layers - 1) + ["full_attention"]
        return tf.Gemma3TextConfig(**common, num_hidden_layers=g_layers, sliding_window=window,
                                   query_pre_attn_scalar=head_dim, layer_types=types)
    raise ValueError(f"model must be one of {MODELS}, got {model!r}")


def _batch(size: str, seq_len: int, data: str, device, seed: int):
    vocab = SIZES[size][0]
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (1, seq_len), generator=gen)
    if data == "packed":
        median = max(32, min(768, seq_len // 8))
        pos = torch.cat([torch.arange(n) for n in harness.document_lengths(seq_len, seed=seed, median=median)])
    elif data == "single":
        pos = torch.arange(seq_len)
    else:
        raise ValueError(f"data must be one of {DATA}, got {data!r}")
    return ids.to(device), pos.unsqueeze(0).to(device)


def make_workload(*, model, impl, size, seq_len, data, dtype, device, seed=0):
    """Build a model, its optimizer and a batch, run one step (so the optimizer state exists) and
    return a callable running one more training step; it returns the step's loss (a 0-d tensor)."""
    import transformers as tf

    device = torch.device(device)
    torch.manual_seed(seed)  # the same weights for every implementation
    net = tf.AutoModelForCausalLM.from_config(model_config(model, size), attn_implementation=impl,
                                              dtype=harness.dtype_of(dtype)).to(device)
    net.train()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-5)
    ids, pos = _batch(size, seq_len, data, device, seed)

    def step():
        loss = net(input_ids=ids, position_ids=pos, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    first = step()
    step.first_loss = float(first)
    return step


def estimated_bytes(impl: str, model: str, size: str, seq_len: int) -> int:
    """Rough activation memory of the attention probabilities eager attention keeps for backward
    (float32 softmax and its input, every layer); other implementations need far less."""
    if impl != "eager":
        return 0
    layers = SIZES[size][6] if model == "qwen3" else SIZES[size][7]
    return layers * SIZES[size][3] * seq_len * seq_len * 8


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_run_arguments(parser, warmup=1, repeats=3, smoke="tiny models")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=None, help="default: both (--smoke: gemma3)")
    parser.add_argument("--data", nargs="+", choices=DATA, default=None, help="default: both (--smoke: packed)")
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    parser.add_argument("--seq-lens", type=int, nargs="+")
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on GPU")
    parser.add_argument("--no-memory", action="store_true")
    args = parser.parse_args(argv)

    device = harness.pick_device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    size = "smoke" if args.smoke else ("gpu" if device.type == "cuda" else "cpu")
    seq_lens = args.seq_lens or ([256] if args.smoke else [8192, 32768] if device.type == "cuda" else [4096])
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    warmup, repeats = (0, 1) if args.smoke else (args.warmup, args.repeats)
    data_kinds = args.data or (["packed"] if args.smoke else list(DATA))
    models = args.models or (["gemma3"] if args.smoke else list(MODELS))
    script = os.path.abspath(__file__)
    budget = harness.memory_budget(device)
    results, memory_jobs = [], []
    for L in seq_lens:
        for model in models:
            for data in data_kinds:
                kws = {impl: dict(model=model, impl=impl, size=size, seq_len=L, data=data, dtype=dtype,
                                  device=device.type) for impl in args.impls}
                for impl in list(kws):
                    need = estimated_bytes(impl, model, size, L)
                    if need > budget:
                        results.append(dict(model=model, data=data, seq_len=L, impl=impl, dtype=dtype, size=size,
                                            skipped=f"needs about {need / 2**30:.0f} GiB, budget "
                                                    f"{budget / 2**30:.0f} GiB"))
                        print(f"{model:7s} {data:7s} L={L:6d} {impl:9s} skipped: {results[-1]['skipped']}")
                        del kws[impl]
                steps = {impl: make_workload(**kw) for impl, kw in kws.items()}
                timings = harness.measure(steps, device=device, warmup=warmup, repeats=repeats,
                                          min_repeats=1 if args.smoke else 2)
                rows = {impl: dict(model=model, data=data, seq_len=L, impl=impl, dtype=dtype, size=size,
                                   first_loss=steps[impl].first_loss, time=timings[impl].as_dict(),
                                   tokens_per_s=L / timings[impl].median) for impl in steps}
                steps.clear()
                for impl, r in rows.items():
                    print(f"{model:7s} {data:7s} L={L:6d} {impl:9s} {r['tokens_per_s']:10.1f} tokens/s  "
                          f"loss {r['first_loss']:.6f}", flush=True)
                    memory_jobs.append((r, harness.Workload(script, "make_workload", kws[impl]),
                                        harness.Workload(script, "make_workload", dict(kws[impl], seq_len=64,
                                                                                       data="single"))))
                results.extend(rows.values())
    if not args.no_memory and memory_jobs:  # one fresh process measures every step, one after another
        peaks = harness.peak_memory([w for _, w, _ in memory_jobs], device=device,
                                    warm=[w for _, _, w in memory_jobs], threads=args.threads)
        for (r, _, _), peak in zip(memory_jobs, peaks):
            r["peak_bytes"] = peak
            print(f"{r['model']:7s} {r['data']:7s} L={r['seq_len']:6d} {r['impl']:9s} peak "
                  f"{peak / harness.MIB:8.1f} MiB", flush=True)

    summary = []
    for r in results:
        if r["impl"] != "cp_flash" or "skipped" in r:
            continue
        for base in results:
            if (base["model"], base["data"], base["seq_len"]) != (r["model"], r["data"], r["seq_len"]) or \
                    base["impl"] == "cp_flash" or "skipped" in base:
                continue
            row = dict(model=r["model"], data=r["data"], seq_len=r["seq_len"], baseline=base["impl"],
                       speedup=r["tokens_per_s"] / base["tokens_per_s"],
                       loss_diff=abs(r["first_loss"] - base["first_loss"]))
            if r.get("peak_bytes") and base.get("peak_bytes"):
                row["memory_fraction"] = r["peak_bytes"] / base["peak_bytes"]
            summary.append(row)
    config = dict(models=models, data=data_kinds, impls=args.impls, seq_lens=seq_lens, dtype=dtype,
                  sizes={k: dict(zip(("vocab", "hidden", "intermediate", "heads", "kv_heads", "head_dim",
                                      "qwen3_layers", "gemma3_layers", "window"), v)) for k, v in SIZES.items()
                         if k == size},
                  warmup=warmup, repeats=repeats, threads=args.threads if device.type == "cpu" else None,
                  step="forward with labels, backward, AdamW step, zero_grad(set_to_none=True)")
    name = "model" + (f"_{args.tag}" if args.tag else "") + ".json"
    path = harness.write_results(os.path.join(args.out, name), benchmark="model",
                                 machine=harness.machine_info(device, args.note), config=config,
                                 results=results + [dict(summary=True, **s) for s in summary])
    print(f"\nwrote {path}")
    for s in summary:
        mem = f"  memory {s['memory_fraction']:.3f}x" if "memory_fraction" in s else ""
        print(f"{s['model']:7s} {s['data']:7s} L={s['seq_len']:6d} cp_flash vs {s['baseline']:6s} tokens/s "
              f"{s['speedup']:6.2f}x{mem}  |loss diff| {s['loss_diff']:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
