"""Multi-head latent attention under context parallelism: the K/V bytes a rank receives when the ring moves each
token's latent row instead of its expanded heads.

    python benchmarks/bench_mla.py --out benchmarks/results/cpu   # the grid below; gloo ranks 2, 4
    python benchmarks/bench_mla.py --smoke --out bench_out        # tiny

Writes ``mla.json`` with two parts:

* ``modeled``: DeepSeek-V3's real attention shapes, read from transformers' ``DeepseekV3Config()`` (heads,
  q/k and v head dims, ``kv_lora_rank``, ``qk_rope_head_dim``), one causal row of L tokens in bfloat16, zigzag
  layout, P ranks: the busiest rank's forward K/V bytes from the planner for the heads, and for the latent the
  same rank's received tokens x (kv_lora_rank + qk_rope_head_dim) x 2; the cost model's choice and reason.
* ``measured``: reduced-width models on real gloo ranks (one thread each), one packed row of realistic documents,
  forward + backward inside ``context_parallel``, each run twice on the same batch: with the default cost model
  (the latent moves) and with one whose device is too slow to expand (the heads move). Per run, the bytes the
  busiest rank's comm received in the forward (counted as the receives were posted) and the slowest rank's step
  time; the logits of the two runs compared. On CPU the step times are ratios only; a GPU's link and FLOP rates
  differ, so read the bytes.
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
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "support"))

import harness  # noqa: E402

from cp_attention.tools.launch import run_ranks  # noqa: E402

GRID = dict(modeled_seq_lens=(32768, 131072), modeled_world_sizes=(2, 4, 8, 16),
            models=("v3_shaped", "deepseek_v3", "minicpm3", "longcat_flash"), seq_len=512, world_sizes=(2, 4))
SMOKE = dict(modeled_seq_lens=(4096,), modeled_world_sizes=(2,), models=("deepseek_v3",), seq_len=64,
             world_sizes=(2,))


def v3_dims() -> dict:
    """DeepSeek-V3's attention shapes, from transformers' config defaults."""
    import transformers as tf

    c = tf.DeepseekV3Config()
    return dict(heads=c.num_attention_heads, head_dim=c.qk_nope_head_dim + c.qk_rope_head_dim, head_dim_v=c.v_head_dim,
                latent_dim=c.kv_lora_rank + c.qk_rope_head_dim)


def modeled(seq_lens, world_sizes) -> list[dict]:
    from cp_attention.masks import MaskSpec, SequenceMeta
    from cp_attention.plan import build_plan
    from cp_attention.strategies import CostModel
    from cp_attention.strategies.latent import latent_form

    d = v3_dims()
    per_token = d["heads"] * (d["head_dim"] + d["head_dim_v"]) * 2
    form, why = latent_form(kv_heads=d["heads"], head_dim=d["head_dim"], head_dim_v=d["head_dim_v"],
                            latent_dim=d["latent_dim"], cost_model=CostModel())
    rows = []
    for L in seq_lens:
        meta = SequenceMeta.from_inputs(1, L)
        for P in world_sizes:
            heads = max(build_plan(meta, MaskSpec(), world_size=P, layout="zigzag", rank=r, head_kv=d["heads"],
                                   head_dim=d["head_dim"], head_dim_v=d["head_dim_v"], itemsize=2).stats.kv_bytes_recv
                        for r in range(P))
            latent = heads // per_token * d["latent_dim"] * 2
            rows.append(dict(kind="modeled", seq_len=L, world_size=P, heads_bytes=heads, latent_bytes=latent,
                             ratio=heads / latent, form=form, reason=why, **d))
    return rows


def _model(name: str):
    import latent_cases

    from cp_attention.tools.sweeps.configs import build_model, tiny_config

    config = latent_cases.v3_shaped_config() if name == "v3_shaped" else tiny_config(name)
    return build_model(config, "cp_flash").train()


def _inputs(L: int, vocab: int):
    docs = harness.document_lengths(L, seed=1, median=max(8, L // 4))
    ids = torch.randint(3, min(vocab, 60), (1, L), generator=torch.Generator().manual_seed(3))
    return ids, torch.cat([torch.arange(n) for n in docs])[None], docs


def _rank_main(rank: int, world_size: int, cfg: dict) -> dict:
    import cp_attention
    from cp_attention.strategies import CostModel

    torch.set_num_threads(cfg["threads"])
    model = _model(cfg["model"])
    ids, pos, _ = _inputs(cfg["seq_len"], model.config.vocab_size)
    out = {}
    for form, cost in (("latent", CostModel()), ("heads", CostModel(throughput=1e3))):
        walls, received, logits, forms = [], 0, None, set()
        for i in range(cfg["warmup"] + cfg["repeats"]):
            torch.distributed.barrier()
            counted = []
            t0 = time.perf_counter()
            with cp_attention.context_parallel(layout="zigzag", cost_model=cost) as cp:
                recv = cp.comm.recv

                def counting(tensor, src, tag=0, recv=recv, counted=counted):
                    if tag < world_size:
                        counted.append(tensor.numel() * tensor.element_size())
                    recv(tensor, src, tag)

                cp.comm.recv = counting
                res = model(**cp.shard_batch(input_ids=ids, position_ids=pos), use_cache=False)
                cp.comm.recv = recv
                forms = {s.kv_form for _, s in cp_attention.forward_plan_stats()}
                received = sum(counted)
                res.logits.float().sum().backward()
                if i == 0:
                    logits = cp.gather(res.logits.detach(), dim=1).numpy()
            torch.distributed.barrier()
            if i >= cfg["warmup"]:
                walls.append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
        out[form] = dict(wall_s=walls, received=received, logits=logits, forms=sorted(forms))
    return out


def measure(name: str, L: int, world_sizes, args) -> list[dict]:
    cfg = dict(model=name, seq_len=L, threads=args.threads, warmup=max(1, args.warmup),  # first use: verification
               repeats=1 if args.smoke else args.repeats)
    model = _model(name)
    attn = next(m for m in model.modules() if hasattr(type(m), "expand_kv"))
    _, _, docs = _inputs(L, model.config.vocab_size)
    rows = []
    for P in world_sizes:
        per_rank = run_ranks(P, _rank_main, cfg, timeout=args.timeout)
        runs = {form: dict(bytes=max(r[form]["received"] for r in per_rank),
                           wall=max(statistics.median(r[form]["wall_s"]) for r in per_rank),
                           forms=sorted({f for r in per_rank for f in r[form]["forms"]})) for form in ("latent", "heads")}
        rows.append(dict(kind="measured", model=name, seq_len=L, world_size=P, documents=len(docs),
                         heads=attn.num_heads, head_dim=attn.qk_head_dim, head_dim_v=attn.v_head_dim,
                         latent_dim=attn.kv_lora_rank + attn.qk_rope_head_dim,
                         latent_bytes=runs["latent"]["bytes"], heads_bytes=runs["heads"]["bytes"],
                         ratio=runs["heads"]["bytes"] / max(runs["latent"]["bytes"], 1),
                         forms=dict(latent=runs["latent"]["forms"], heads=runs["heads"]["forms"]),
                         wall_latent_over_heads=runs["latent"]["wall"] / runs["heads"]["wall"],
                         max_abs_diff=float(abs(per_rank[0]["latent"]["logits"] - per_rank[0]["heads"]["logits"]).max())))
    return rows


def tables(results: list[dict]) -> list[str]:
    lines = ["| DeepSeek-V3 shapes | L | P | heads: K/V B received (busiest rank) | latent: B received | heads / latent | "
             "cost model |", "|---|---:|---:|---:|---:|---:|---|"]
    for r in (r for r in results if r["kind"] == "modeled"):
        lines.append(f"| {r['heads']} heads x ({r['head_dim']} + {r['head_dim_v']}), latent {r['latent_dim']} | "
                     f"{r['seq_len']} | {r['world_size']} | {r['heads_bytes']} | {r['latent_bytes']} | "
                     f"{r['ratio']:.1f}x | {r['form']} |")
    lines += ["", "| model (reduced width) | heads x (D + Dv) / latent | L | P | heads run: B received | latent run: "
              "B received | heads / latent | step wall latent / heads | logits apart |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in (r for r in results if r["kind"] == "measured"):
        lines.append(f"| {r['model']} | {r['heads']} x ({r['head_dim']} + {r['head_dim_v']}) / {r['latent_dim']} | "
                     f"{r['seq_len']} | {r['world_size']} | {r['heads_bytes']} | {r['latent_bytes']} | "
                     f"{r['ratio']:.1f}x | {r['wall_latent_over_heads']:.2f} | {r['max_abs_diff']:.1e} |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_run_arguments(parser, warmup=1, repeats=3, smoke="one tiny model", threads="torch threads per rank")
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args(argv)
    grid = SMOKE if args.smoke else GRID
    started = time.perf_counter()
    results = modeled(grid["modeled_seq_lens"], grid["modeled_world_sizes"])
    for name in grid["models"]:
        results += measure(name, grid["seq_len"], grid["world_sizes"], args)
        print(f"{name} done ({time.perf_counter() - started:.0f}s)", flush=True)
    config = dict(grid=grid, layout="zigzag", threads=args.threads, dtype_modeled="bfloat16", dtype_measured="float32",
                  documents="harness.document_lengths(L, median=L/4), one packed row")
    harness.finish_run(args, "mla", torch.device("cpu"), config, results, tables(results), started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
