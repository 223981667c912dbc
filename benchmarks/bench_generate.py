"""Generation under context parallelism on real ranks: ``model.generate`` with the prompt sharded over the
ranks and each rank's KV cache holding its own tokens, against the same model on one device.

    python benchmarks/bench_generate.py --out benchmarks/results/cpu   # L 8192, 32 new tokens; gloo ranks 2, 4
    python benchmarks/bench_generate.py --smoke --out bench_out        # tiny

Writes ``generate.json``. The model: the training-step benchmark's CPU Qwen3 (``bench_model.model_config``:
every layer full causal attention, GQA), random weights, float32, ``attn_implementation="cp_flash"``. One
row of ``L`` random prompt tokens (attention mask all ones), ``NEW`` greedy tokens (``do_sample=False``,
``output_logits=True``). Every rank runs ``model.generate`` inside ``context_parallel(layout="zigzag")``:
the prefill runs on the rank's zigzag shard of the prompt, the rank's cache keeps the K/V of its own tokens
(decoded tokens in blocks dealt to the ranks in turn), and each decode step's attention merges the ranks'
partial results with one all-gather per attention layer.

One device is the same model and code path on one process (``context_parallel()`` of one rank, as
``bench_hybrids.py`` measures). The runs are interleaved in rounds (``--repeats``): one device, then each
world size's ranks (fresh processes), every run after ``--warmup`` untimed generate calls; each ratio is
taken within a round and the median over the rounds reported, so a busy shared machine slows both sides of
a ratio alike. Tokens and step logits of every rank in every round are compared with one device's, and, as
a reference, with the same weights under ``attn_implementation="eager"`` on one process (one untimed run).

How prefill and decode are timed apart: one timed ``generate`` call per run, with a logits processor that
reads the clocks (wall time and the thread's CPU time) each time generate hands it a step's logits, i.e.
right after each forward. Prefill = from the call to the first reading (generate's setup, the sharding,
the prefill forward); decode per token = from the first reading to the last over the ``NEW - 1`` decode
forwards (the first new token comes from the prefill's logits), each with generate's per-step work.
Ratios: the slowest rank of a run over one device's run of the same round, medians over the rounds. On a
machine with fewer cores than ranks the wall time includes waiting for a core; the CPU time (each rank's
own thread) does not.

What of a decode step does not shrink with the shard: the same one-device decode per token, CPU time, with a
prompt of ``short_prompt`` tokens (attention over few keys). If only the attention over the prompt were split
and nothing added, a rank's decode work would be ``(short + (long - short) / P) / long`` of one device's
(``decode_cpu_if_only_attention_split``); the measured ratio's excess over it is the sharded step's own cost
(the all-gathers, the merge, the per-rank planning of the partial attention).

Also per rank: the K/V bytes its cache holds at the end (``ShardedCacheLayer.local_bytes``, against the
one-device cache's keys and values), the all-gathers per decoded token (``cp.comm.all_gather`` wrapped,
every call after the prefill's logits) and the bytes one rank receives per decoded token through them
(``P - 1`` peers' tensors per call; it sends as many). CPU: ratios only, no absolute times claimed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_model  # noqa: E402
import harness  # noqa: E402

from cp_attention.tools.launch import run_ranks  # noqa: E402

GRID = dict(seq_len=8192, short_prompt=512, new_tokens=32, world_sizes=(2, 4), size="cpu")
SMOKE = dict(seq_len=256, short_prompt=32, new_tokens=4, world_sizes=(2,), size="smoke")
ATTENTION_GATHER = "the decode step's partial attention"  # the label of attend_sharded_cache's all-gather


def _model(cfg: dict, impl: str):
    from cp_attention.tools.tiny_models import tiny_model

    return tiny_model("qwen3", impl, config=bench_model.model_config("qwen3", cfg["size"]))


def _prompt(cfg: dict, vocab: int):
    ids = torch.randint(3, vocab - 1, (1, cfg["seq_len"]), generator=torch.Generator().manual_seed(1))
    return ids, torch.ones_like(ids)


def _clock():
    from transformers import LogitsProcessor

    class Clock(LogitsProcessor):
        """Reads the wall clock and the thread's CPU clock each time generate hands it a step's logits."""

        def __init__(self):
            self.ticks = []

        def __call__(self, input_ids, scores):
            self.ticks.append((time.perf_counter(), time.thread_time()))
            return scores

    return Clock()


def _generate(model, ids, mask, new: int, clock):
    from transformers import LogitsProcessorList

    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
                              output_logits=True, return_dict_in_generate=True,
                              logits_processor=LogitsProcessorList([clock]))


def _kv_bytes(cache) -> int:
    """Bytes of the K/V a cache holds: a sharded layer's ``local_bytes``, else its keys and values."""
    total = 0
    for layer in cache.layers:
        if callable(getattr(layer, "local_bytes", None)):
            total += layer.local_bytes()
            continue
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def _by_what(calls: list, after: bool) -> dict:
    """{what: [all-gathers, bytes of this rank's tensors]} of the calls before (``after`` False) or after the
    prefill's logits."""
    out = {}
    for what, nbytes, later in calls:
        if later == after:
            count = out.setdefault(what, [0, 0])
            count[0], count[1] = count[0] + 1, count[1] + nbytes
    return out


def _rank_main(rank: int, world_size: int, cfg: dict) -> dict:
    import cp_attention

    torch.set_num_threads(cfg["threads"])
    model = _model(cfg, "cp_flash")
    ids, mask = _prompt(cfg, model.config.vocab_size)
    new = cfg["new_tokens"]
    prefill_wall, prefill_cpu, decode_wall, decode_cpu = [], [], [], []
    first = None
    with cp_attention.context_parallel(layout="zigzag") as cp:
        calls = []  # (what, bytes of this rank's tensor, after the prefill's logits)
        gather = cp.comm.all_gather

        def counted(t, what="an all-gather"):
            calls.append((what, t.numel() * t.element_size(), bool(clock.ticks)))
            return gather(t, what)

        cp.comm.all_gather = counted
        try:
            for i in range(cfg["warmup"] + cfg["repeats"]):
                if world_size > 1:
                    torch.distributed.barrier()
                calls.clear()
                clock = _clock()
                t0, c0 = time.perf_counter(), time.thread_time()
                out = _generate(model, ids, mask, new, clock)
                (w1, c1), (wn, cn) = clock.ticks[0], clock.ticks[-1]
                if i >= cfg["warmup"]:
                    prefill_wall.append(w1 - t0)
                    prefill_cpu.append(c1 - c0)
                    decode_wall.append((wn - w1) / (new - 1))
                    decode_cpu.append((cn - c1) / (new - 1))
                if first is None:  # by value (a tensor would travel as a shared-memory handle the rank may outlive)
                    first = dict(tokens=out.sequences[:, ids.shape[1]:].tolist(),
                                 logits=torch.stack(out.logits).numpy(), kv_bytes=_kv_bytes(out.cache),
                                 prefill_gathers=_by_what(calls, False), decode_gathers=_by_what(calls, True),
                                 decode_forwards=len(clock.ticks) - 1)
                del out
        finally:
            cp.comm.all_gather = gather
    return dict(first, prefill_wall=prefill_wall, prefill_cpu=prefill_cpu, decode_wall=decode_wall,
                decode_cpu=decode_cpu)


def _one_device(cfg: dict) -> dict:
    threads = torch.get_num_threads()
    try:
        return _rank_main(0, 1, cfg)
    finally:
        torch.set_num_threads(threads)


def _eager(cfg: dict) -> dict:
    """The same weights under eager attention, one process, one untimed run: the reference tokens and logits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg["threads"])
    try:
        model = _model(cfg, "eager")
        ids, mask = _prompt(cfg, model.config.vocab_size)
        out = _generate(model, ids, mask, cfg["new_tokens"], _clock())
        return dict(tokens=out.sequences[:, ids.shape[1]:].tolist(), logits=torch.stack(out.logits).numpy())
    finally:
        torch.set_num_threads(threads)


def _total(by_what: dict, i: int) -> int:
    return sum(v[i] for v in by_what.values())


def _diff(a, b) -> float:
    return float(abs(a - b).max())


TIMES = ("prefill_wall", "prefill_cpu", "decode_wall", "decode_cpu")


def measure(cfg: dict, world_sizes, timeout: float) -> list[dict]:
    """``cfg["repeats"]`` rounds, each: one device (the long prompt, then the short one), then every world size;
    each run in a fresh model (and processes) with ``cfg["warmup"]`` untimed generate calls first. A ratio is
    taken within a round and the median over the rounds reported (a busy machine slows a round's runs alike)."""
    model = _model(cfg, "cp_flash")
    config = model.config
    attention_layers = sum(1 for m in model.modules() if type(m).__name__.endswith("Attention"))
    del model
    eager = _eager(cfg) if cfg["eager_check"] else None
    once = dict(cfg, repeats=1)
    bases, shorts, ranks = [], [], {P: [] for P in world_sizes}
    for i in range(cfg["repeats"]):
        bases.append(_one_device(once))
        shorts.append(_one_device(dict(once, seq_len=cfg["short_prompt"]))["decode_cpu"][0])
        for P in world_sizes:
            ranks[P].append(run_ranks(P, _rank_main, once, timeout=timeout))
        print(f"round {i + 1} of {cfg['repeats']} done", flush=True)
    base = bases[0]  # tokens, logits, cache bytes: the first round's
    med = {key: statistics.median(b[key][0] for b in bases) for key in TIMES}
    short = statistics.median(shorts)
    tokens = cfg["new_tokens"] - 1  # decode forwards
    rows = []
    for P in world_sizes:
        worst = [{key: max(r[key][0] for r in per_rank) for key in TIMES} for per_rank in ranks[P]]  # per round
        per_rank = ranks[P][0]
        row = dict(kind="generate", model="qwen3", seq_len=cfg["seq_len"], new_tokens=cfg["new_tokens"],
                   world_size=P, layers=config.num_hidden_layers, attention_layers=attention_layers,
                   hidden=config.hidden_size, heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
                   head_dim=config.head_dim, dtype="float32", rounds=cfg["repeats"],
                   **{f"{key}_s_max": statistics.median(w[key] for w in worst) for key in TIMES},
                   **{f"{key}_one_device_s": med[key] for key in TIMES},
                   **{f"{key}_over_one_device": statistics.median(w[key] / b[key][0] for w, b in zip(worst, bases))
                      for key in TIMES},
                   decode_cpu_short_prompt_one_device_s=short,
                   decode_cpu_if_only_attention_split=(short + (med["decode_cpu"] - short) / P) / med["decode_cpu"],
                   kv_bytes_per_rank=[r["kv_bytes"] for r in per_rank], kv_bytes_one_device=base["kv_bytes"],
                   kv_over_one_device=max(r["kv_bytes"] for r in per_rank) / base["kv_bytes"],
                   decode_forwards=[r["decode_forwards"] for r in per_rank],
                   prefill_all_gathers=max(_total(r["prefill_gathers"], 0) for r in per_rank),
                   prefill_gather_bytes_recv=max(_total(r["prefill_gathers"], 1) for r in per_rank) * (P - 1),
                   all_gathers_per_token=max(_total(r["decode_gathers"], 0) for r in per_rank) / tokens,
                   attention_gathers_per_token=max(r["decode_gathers"].get(ATTENTION_GATHER, [0])[0]
                                                   for r in per_rank) / tokens,
                   bytes_recv_per_token=max(_total(r["decode_gathers"], 1) for r in per_rank) * (P - 1) / tokens,
                   decode_gathers_by_what={what: [n / tokens, b * (P - 1) / tokens]  # rank 0's: per token,
                                           for what, (n, b) in per_rank[0]["decode_gathers"].items()},  # received
                   tokens_equal_one_device=all(r["tokens"] == b["tokens"] for per_rank, b in zip(ranks[P], bases)
                                               for r in per_rank),
                   max_logit_diff_vs_one_device=max(_diff(r["logits"], b["logits"])
                                                    for per_rank, b in zip(ranks[P], bases) for r in per_rank))
        if eager is not None:
            row.update(tokens_equal_eager=all(r["tokens"] == eager["tokens"] for rs in ranks[P] for r in rs),
                       max_logit_diff_vs_eager=max(_diff(r["logits"], eager["logits"]) for rs in ranks[P] for r in rs),
                       one_device_tokens_equal_eager=all(b["tokens"] == eager["tokens"] for b in bases),
                       one_device_logit_diff_vs_eager=max(_diff(b["logits"], eager["logits"]) for b in bases))
        rows.append(row)
    return rows


def _bytes(n: float) -> str:
    return f"{n / 1024:.2f} KiB" if n >= 1024 else f"{n:.0f} B"


def tables(results: list[dict]) -> list[str]:
    lines = ["| model | L | new tokens | P | prefill wall / one device | prefill CPU / one device | decode wall per "
             "token / one device | decode CPU per token / one device | KV bytes per rank / one device (1/P) | "
             "all-gathers per token | received per token per rank | same tokens | max logit diff |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in results:
        same = "yes" if r["tokens_equal_one_device"] else "**no**"
        lines.append(f"| {r['model']} ({r['layers']} layers, H {r['heads']}, K {r['kv_heads']}, D {r['head_dim']}) | "
                     f"{r['seq_len']} | {r['new_tokens']} | {r['world_size']} | "
                     f"{r['prefill_wall_over_one_device']:.2f} | "
                     f"{r['prefill_cpu_over_one_device']:.2f} | {r['decode_wall_over_one_device']:.2f} | "
                     f"{r['decode_cpu_over_one_device']:.2f} | {r['kv_over_one_device']:.3f} "
                     f"({1 / r['world_size']:.3f}) | {r['all_gathers_per_token']:g} "
                     f"({r['attention_gathers_per_token']:g} attention) | "
                     f"{_bytes(r['bytes_recv_per_token'])} | {same} | {r['max_logit_diff_vs_one_device']:.1e} |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_run_arguments(parser, warmup=1, repeats=3, smoke="a tiny model and prompt",
                              threads="torch threads per rank")
    parser.add_argument("--seq-len", type=int, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, help="greedy tokens generated (at least 2)")
    parser.add_argument("--world-sizes", type=int, nargs="+")
    parser.add_argument("--short-prompt", type=int, help="prompt tokens of the one-device decode reference")
    parser.add_argument("--no-eager-check", action="store_true", help="skip the untimed eager reference run")
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    grid = SMOKE if args.smoke else GRID
    cfg = dict(size=grid["size"], seq_len=args.seq_len or grid["seq_len"],
               short_prompt=args.short_prompt or grid["short_prompt"], new_tokens=args.new_tokens or grid["new_tokens"],
               threads=args.threads,
               warmup=0 if args.smoke else args.warmup, repeats=1 if args.smoke else args.repeats,
               eager_check=not args.no_eager_check)
    if cfg["new_tokens"] < 2:
        parser.error("--new-tokens must be at least 2 (one prefill token, then decode steps)")
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    results = measure(cfg, args.world_sizes or grid["world_sizes"], args.timeout)
    config = dict(cfg, grid=grid, layout="zigzag", model_size=bench_model.SIZES[cfg["size"]],
                  one_device="context_parallel() of one process, cp_flash (the same code path)",
                  timing="a logits processor reads the clocks after each forward: prefill = call to first "
                         "reading, decode per token = first to last reading / (new_tokens - 1)",
                  load_average=[load_before, os.getloadavg()[0]])  # the machine's 1-minute load, before and after
    harness.finish_run(args, "generate", torch.device("cpu"), config, results, tables(results), started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
