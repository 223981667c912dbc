"""The sections of the benchmarks page about scaling out: strategies, hybrid models, layouts and
planning time (see ``report.py``). Every figure in them is computed from the JSON files."""

from __future__ import annotations

import math

from report_tables import (bullet, code, image, k_tokens, layouts_goal_table, layouts_table, load, para,
                           planning_table, span, strategy_model_tables, strategy_rank_table)


def strategies_section(folder: str, page_dir: str) -> list[str]:
    payload = load(folder, "strategies.json")
    if payload is None:
        return []
    results, cfg = payload["results"], payload["config"]
    summary = [r for r in results if r["kind"] == "summary"]
    grid = cfg["grid"]
    models = cfg["models"]

    def describe(name, m):
        masks = ", ".join(f"{n} {'window-' + str(mask['window']) if mask.get('window') else 'full'}"
                          for mask, n in m["masks"])
        return f"**{name}** ({masks} layers, H {m['heads']}, K {m['kv_heads']}, D {m['head_dim']})"

    out = ["## Strategies: what auto picks", ""]
    out += code("python benchmarks/bench_strategies.py --repeats 5 --out benchmarks/results/cpu")
    out += para(f"`bench_strategies.py`, `strategies.json`. Every rank's plan of every candidate for "
                f"{len(models)} layer mixes (attention layers only; sinks change neither the plans nor the traffic): "
                + ", ".join(describe(n, m) for n, m in models.items())
                + f"; {'bfloat16' if cfg['itemsize'] == 2 else 'float32'}, {cfg['layout']} layout, one document or a "
                "packed realistic mix (log-normal lengths, median 1000 tokens), L = "
                f"{k_tokens(min(grid['seq_lens']))} to {k_tokens(max(grid['seq_lens']))}, P = {min(grid['world_sizes'])} to "
                f"{max(grid['world_sizes'])} ({cfg['cost_model']['ranks_per_node']} ranks per node), under the default "
                "cost model. Each cell: auto's pick per layer mask (`usp8x4`: head groups of 8, rings of 4), then "
                "the modeled attention step time (forward + backward, every layer) of auto against using the ring "
                "for every layer and ulysses for every layer (below 1: auto is faster).")
    out += strategy_model_tables(results) + [""]
    if summary:
        best = [s["auto_over_best_uniform"] for s in summary]
        per_layer = max(s["auto_over_cheapest_per_layer"] for s in summary)
        plan_s = max(s["auto_planning_s"] for s in summary)
        out += para(f"Over all {len(summary)} configurations the layer plan auto builds (as every rank builds it) "
                    f"has the cheapest candidate's modeled time (worst ratio {per_layer:.3f}; a consistency check of "
                    f"the choice against the model, which auto minimises by construction), and auto's step is "
                    f"{span(best)} times the best single strategy's (mixing strategies across layers beats any one "
                    "of them where the ratio is below 1). Auto's planning, one mask, up to "
                    f"{max(grid['world_sizes'])} ranks and {k_tokens(max(grid['seq_lens']))} tokens: at most "
                    f"{plan_s:.2f} s (one CPU thread, once per batch and mask).")
    out += image(folder, page_dir, "strategies.png", "strategies over P")
    ranks = [r for r in results if r["kind"] == "ranks"]
    if ranks:
        rc = cfg["ranks"]
        mix = ", ".join(f"{n} {'window-' + str(m['window']) if m.get('window') else 'full'}" for m, n in rc["mix"])
        out += ["", "### Real ranks", ""]
        out += para(f"`--rank-world-sizes {' '.join(map(str, grid['rank_world_sizes']))}`, gloo on CPU, one thread "
                    f"per rank (more ranks than cores share them): forward + backward of {mix} layers, L = "
                    f"{rc['seq_len']}, H {rc['heads']}, K {rc['kv_heads']}, D {rc['head_dim']}, {rc['dtype']}, every "
                    f"strategy interleaved in one run ({rc['repeats']} repeats, medians, the slowest rank), the cost "
                    "model's constants calibrated on the same ranks (one rank's attention throughput, point-to-point "
                    "latency and bandwidth); \"busiest compute\" is the time inside kernel calls (the rank's thread "
                    "CPU time); \"layers ran\" lists each layer's strategy in order.")
        out += strategy_rank_table(results) + [""]
        diff = max(r["max_abs_diff_vs_ring"] for r in ranks)
        text = f"Every strategy returns the ring's output to {diff:.0e}."
        uly = {(r["world_size"]): r for r in ranks if (r["data"], r["layout"], r["strategy"]) ==
               ("single", "contiguous", "ulysses")}
        if uly:
            text += (" Contiguous shards of one causal document leave the ring's last rank most of the pairs; for "
                     "ulysses there the model's busiest-compute ratio and the measured one are "
                     + ", ".join(f"{r['predicted_compute_over_ring']:.2f} and {r['compute_over_ring']:.2f} at P = {P}"
                                 for P, r in sorted(uly.items()))
                     + "; the wall-time ratios, modeled and measured, are "
                     + ", ".join(f"{r['predicted_over_ring']:.2f} and {r['measured_over_ring']:.2f} at P = {P}"
                                 for P, r in sorted(uly.items()))
                     + ". Where they part, the all-to-all's synchronisation points (each rank waiting on all others, "
                     "ranks sharing cores) cost more than the latency and bandwidth the model charges, while the "
                     "ring's waits hide under its compute.")
        text += (" The model is written for GPUs (one process per device, NCCL); its CPU calibration here tests the "
                 "bookkeeping and the compute balance, not GPU speed. The timed comparison for a GPU is part 3 of "
                 "`benchmarks/gpu_check.py`, and `bench_strategies.py` runs real NCCL ranks on a machine with several "
                 "GPUs.")
        out += para(text)
    return out


def hybrids_section(folder: str) -> list[str]:
    payload = load(folder, "hybrids.json")
    if payload is None:
        return []
    import bench_hybrids

    results = payload["results"]
    out = ["## Hybrid models: traffic and step time", ""]
    out += code("python benchmarks/bench_hybrids.py --out benchmarks/results/cpu")
    out += para("`bench_hybrids.py`, `hybrids.json`. Real gloo ranks on CPU, one thread per rank; tiny configs of "
                "each family's own layer mix (the family sweep's rules), one packed row of "
                f"{span([r['documents'] for r in results], 0)} documents, {payload['config']['layout']} layout, "
                "forward + backward. Bytes: what the busiest rank received per mixer layer in the forward (the "
                "backward returns as many); the head-parallel column is what an all-to-all of the mixer's inputs "
                "and outputs would move (modeled, not run). Step ratios: the slowest rank against the same model on "
                "one rank, medians; when ranks outnumber cores the wall ratio includes waiting for a core and the "
                "CPU ratio (each rank's own thread time) is the one to read.")
    out += bench_hybrids.tables(results) + [""]
    state = [(r["head_parallel_bytes_per_layer"] / r["state_bytes_per_layer"], r) for r in results
             if r["state_bytes_per_layer"]]
    if state:
        lo, hi = min(state, key=lambda x: x[0]), max(state, key=lambda x: x[0])
        out += bullet(f"The scan moves {lo[0]:.0f}-{hi[0]:.0f}x fewer bytes per recurrence layer than head "
                      f"parallelism would ({lo[0]:.0f}x for {lo[1]['model']} at L = {lo[1]['seq_len']} over "
                      f"{lo[1]['world_size']} ranks, {hi[0]:.0f}x for {hi[1]['model']} at L = {hi[1]['seq_len']} over "
                      f"{hi[1]['world_size']}): its bytes do not grow with L (the halo is k-1 tokens per piece, the "
                      "states are per piece), so the ratio grows with L; the logits equal the one-rank run's (at "
                      f"most {max(r['max_abs_diff_vs_one_rank'] for r in results):.1e} apart).")
    for P in sorted({r["world_size"] for r in results}):
        cpu = [r["cpu_over_one_rank"] for r in results if r["world_size"] == P]
        out += bullet(f"Each rank's own work at P = {P} is {span(cpu)} of one rank's (ideal {1 / P:.2g}).")
    out += bullet("With hidden size 64 the per-call costs that do not shrink with the shard (Python, the mixers' "
                  "planning, the correction run of each piece's first segment, the probe runs for the transitions) "
                  "are a large share. Jamba's work falls below the ideal because transformers' torch reference of "
                  "Mamba's selective scan (no `mamba_ssm` here) has a backward that grows faster than linearly in "
                  "the segment length, so shorter shards are more than proportionally cheaper; Jamba runs only at "
                  f"L <= {payload['config']['max_len'].get('jamba', '-')} for that reason.")
    out += _more_mixers(folder)
    return out + ["", "No absolute times: CPU ratios only.", ""]


def _more_mixers(folder: str) -> list[str]:
    """The mixers of issue 39 (``hybrids_issue39.json``): the same measurement, its own run."""
    payload = load(folder, "hybrids_issue39.json")
    if payload is None:
        return []
    import bench_hybrids

    results = payload["results"]
    out = ["", "### The mixers of issue 39 (KDA, lightning attention, RG-LRU, Zaya, RWKV, xLSTM, a pure Mamba-2)", ""]
    out += code("python benchmarks/" + " ".join(payload["argv"]))
    out += para("`hybrids_issue39.json`: the same measurement as above; where a mixer has no convolution (lightning "
                "attention, RWKV, xLSTM) the head-parallel column models its input and output at the hidden size.")
    out += bench_hybrids.tables(results) + [""]
    share = [(100.0 * (r["conv_bytes_per_layer"] + r["state_bytes_per_layer"]) / r["head_parallel_bytes_per_layer"],
              r) for r in results if r["head_parallel_bytes_per_layer"]]
    lo, hi = min(share, key=lambda x: x[0]), max(share, key=lambda x: x[0])
    out += bullet(f"Per layer the halos and states are {lo[0]:.2f}-{hi[0]:.1f} % of what head parallelism would move "
                  f"(the most: {hi[1]['model']} at P = {hi[1]['world_size']}), and do not grow with L; the logits "
                  f"equal the one-rank run's (at most {max(r['max_abs_diff_vs_one_rank'] for r in results):.1e} "
                  "apart: xLSTM's float32 states scale with e^m, its stabiliser).")
    for P in sorted({r["world_size"] for r in results}):
        cpu = [r["cpu_over_one_rank"] for r in results if r["world_size"] == P]
        out += bullet(f"Each rank's own work at P = {P} is {span(cpu)} of one rank's (ideal {1 / P:.2g}).")
    kimi = [r for r in results if r["model"] == "kimi_linear"]
    if kimi:
        out += bullet(f"Kimi Linear is the costliest ({span([r['cpu_over_one_rank'] for r in kimi])} of one rank's "
                      "work): each KDA piece that passes a state gets its Dk x Dk transition from a probe run of "
                      "transformers' chunked torch path (a second pass, with Dk value columns), and that path pads "
                      "every segment to its 64-token chunk, so a short segment costs a whole chunk. With FLA's kernel "
                      "the same calls go to `chunk_kda`; not measured here.")
    return out


def generate_section(folder: str) -> list[str]:
    """``bench_generate.py`` (``generate.json``): ``model.generate`` under context parallelism against one device."""
    payload = load(folder, "generate.json")
    if payload is None:
        return []
    import bench_generate

    results, cfg, machine = payload["results"], payload["config"], payload["machine"]
    r0 = results[0]
    new, sizes = r0["new_tokens"], ", ".join(str(r["world_size"]) for r in results)
    others = sorted({w for r in results for w in r["decode_gathers_by_what"] if w != bench_generate.ATTENTION_GATHER})
    out = ["## Generation with a sharded KV cache", ""]
    out += code("python benchmarks/" + " ".join(payload["argv"]))
    out += para(f"`bench_generate.py`, `generate.json`. `model.generate` inside `context_parallel(layout="
                f"\"{cfg['layout']}\")` on P = {sizes} gloo ranks on CPU ({cfg['threads']} thread per rank, "
                f"{machine['cpu_count']} shared cores), against the same model and code path on one process "
                f"(interleaved in the same run): the training-step benchmark's CPU Qwen3 ({r0['layers']} "
                f"full-attention layers, hidden {r0['hidden']}, H {r0['heads']}, K {r0['kv_heads']}, "
                f"D {r0['head_dim']}, {r0['dtype']}, random weights), one row of L = {r0['seq_len']} prompt tokens, "
                f"{new} greedy tokens. "
                "The prefill runs on each rank's shard of the prompt and leaves each rank's cache the K/V of its own "
                "tokens; a decode step runs the model on the new token on every rank, each rank's attention over "
                "its own keys, merged with one all-gather per attention layer.")
    out += para(f"Columns. Prefill: from the `generate` call to the first step's logits; decode: per token over "
                f"the {new - 1} decode forwards (a logits processor reads the clocks after each forward). Wall and "
                f"CPU: the slowest rank over one device, taken in each of {cfg['repeats']} rounds (one device, then "
                "each P, fresh processes, one untimed generate first) and the median reported; with more ranks than "
                "cores the wall time includes waiting for a core (and, in a decode step, for every rank to reach "
                "each all-gather), the CPU time (each rank's own thread) does not. KV bytes: the K/V the fullest "
                "rank's cache holds at the end over one device's cache (the ideal 1/P in parentheses). All-gathers "
                "per token: every all-gather a rank issues per decoded token (in parentheses those of the attention "
                f"layers; the rest, as the library labels them: {', '.join(f'“{w}”' for w in others) or 'none'}). "
                "Received: the bytes one rank receives per decoded token through them (it sends as many). Same "
                f"tokens, max logit diff: every rank's {new} tokens and step logits against one device's, every "
                "round.")
    out += bench_generate.tables(results) + [""]
    cache_mib = r0["kv_bytes_one_device"] / (1 << 20)
    att = [r["decode_gathers_by_what"][bench_generate.ATTENTION_GATHER] for r in results]
    per_layer = [b / n / (r["world_size"] - 1) for (n, b), r in zip(att, results)]
    fullest = ", ".join(f"{r['kv_over_one_device']:.3f} (P = {r['world_size']})" for r in results)
    out += bullet(f"The fullest rank's cache holds {fullest} of one device's K/V (decoded tokens go to the ranks in "
                  "blocks dealt in turn, so a rank holds at most one block more than 1/P). A decode step's attention "
                  f"receives {span(per_layer, 0)} B per layer from each other rank (the new token's partial output and "
                  "log-sum-exp: H x (D + 1) float32 values), "
                  f"{span([r['bytes_recv_per_token'] / 1024 for r in results])} KiB per token in all, where one "
                  f"device caches {cache_mib:.1f} MiB of K/V: the bytes per token do not grow with the prompt.")
    if all("tokens_equal_eager" in r for r in results):
        same = all(r["tokens_equal_eager"] and r["one_device_tokens_equal_eager"] for r in results)
        diff = max(max(r["max_logit_diff_vs_eager"], r["one_device_logit_diff_vs_eager"]) for r in results)
        out += bullet(f"Against eager attention on one process (one untimed run): "
                      f"{'the same' if same else '**not** the same'} tokens on every rank and on one device, step "
                      f"logits at most {diff:.1e} apart.")
    out += bullet("The prefill's work per rank: " + ", ".join(
        f"{r['prefill_cpu_over_one_device']:.2f} of one device's at P = {r['world_size']} (ideal "
        f"{1 / r['world_size']:.2g})" for r in results) + ". With more ranks than cores, read the CPU columns.")
    if "decode_cpu_short_prompt_one_device_s" in r0:
        short = r0["decode_cpu_short_prompt_one_device_s"] / r0["decode_cpu_one_device_s"]
        out += bullet(f"A decode step shards only the attention over the cached keys. On one device a decode step "
                      f"with a {cfg['short_prompt']}-token prompt costs {short:.2f} of one at L = {r0['seq_len']} "
                      "(CPU time): mostly embeddings, projections, MLPs, the head and generate's per-step work, "
                      "which every rank runs whole. Splitting the rest and adding nothing would give "
                      + ", ".join(f"{r['decode_cpu_if_only_attention_split']:.2f} at P = {r['world_size']}"
                                  for r in results)
                      + "; measured: " + ", ".join(f"{r['decode_cpu_over_one_device']:.2f}" for r in results)
                      + ". The difference is what the sharded step adds (the all-gathers, the merge, each rank's "
                      "partial attention set up per layer). At decode the split saves each rank's cache memory; "
                      "its time per token, wall, is " + ", ".join(f"{r['decode_wall_over_one_device']:.2f}"
                                                                  for r in results)
                      + " of one device's here (gloo round trips between processes sharing the cores).")
    return out + ["", "No absolute times: CPU ratios only.", ""]


def layouts_section(folder: str, page_dir: str) -> list[str]:
    goals = load(folder, "layouts.json")
    plans = load(folder, "cp_layouts.json")
    out = []
    if goals:
        bad = goals["c2_infeasible"]
        out += ["## Balanced layouts: the goals, from the plans", ""]
        out += code("python benchmarks/bench_layouts.py --out benchmarks/results/cpu")
        out += para("`bench_layouts.py`, `layouts.json`: worst case over the drawn rows of each line (lognormal "
                    "document lengths, median 1000 tokens, sigma 1.2), traffic measured for the mix's full (or "
                    "window) layer, bfloat16, 8 K/V heads of 128. \"Full ring\" is (P - 1) / P of the row; the floor "
                    "is a lower bound on \"balanced / full ring\" for any layout meeting the balance and token goals "
                    "(the rank holding a long document's last token receives all of it but the 1.25 x L / P tokens "
                    "it may hold). The predicted speedup is the step-time model \"the step waits for the busiest "
                    "rank\": zigzag's busiest cost over balanced's. Layout ms is CPU time. `test_layouts.py` asserts "
                    "the balance, token and traffic goals on drawn batches.")
        out += layouts_goal_table(goals) + [""]
        out += layouts_table(goals) + [""]
        if bad:
            by_L = {}
            for b in bad:
                by_L.setdefault(b["batch"][0], []).append(b)
            zig = {}
            for rec in goals["records"]:
                for seed, run in enumerate(rec["runs"]):
                    if "kv_recv_busiest" in run["zigzag"]:
                        zig[(rec["L"], rec["P"], rec["mix"], rec["token_weight"], seed)] = (
                            run["zigzag"]["kv_recv_busiest"] / run["zigzag"]["ring_kv_recv"])
            parts = []
            for L, bs in sorted(by_L.items()):
                P = bs[0]["batch"][1]
                z = [zig[tuple(b["batch"])] for b in bs if tuple(b["batch"]) in zig]
                parts.append(f"{len(bs)} at L = {L}, P = {P} (floor {min(b['floor'] for b in bs):.3f}, balanced "
                             f"{span([b['balanced'] for b in bs], 3)}" + (f", zigzag {span(z, 3)})" if z else ")"))
            within = max(b["balanced"] / b["floor"] - 1 for b in bad)
            out += para(f"The half-ring goal conflicts with the other two on {len(bad)} of the drawn batches, each "
                        "with one document too long for any rank to hold within the token cap: "
                        + "; ".join(parts) + ". There no layout meeting the balance and token goals can receive less "
                        f"than the floor; balanced is within {100 * within:.1f}% of it.")
    if plans:
        summary = [r for r in plans["results"] if r["kind"] == "plan_summary"]
        out += ["## Layouts: plans and real ranks", ""]
        out += code("python benchmarks/bench_cp_layouts.py --out benchmarks/results/cpu                 "
                    "# L = 131072, P = 4-32; real ranks 2, 4",
                    "python benchmarks/bench_cp_layouts.py --seq-len 262144 --rank-world-sizes --tag 256k "
                    "--out benchmarks/results/cpu")
        out += para("`bench_cp_layouts.py`, `cp_layouts*.json`. Per layout, from every rank's plans (`plan_stats` for "
                    "each layer mask, weighted by its layer count; no process group), worst case over "
                    f"{len(plans['config']['seeds'])} drawn rows. Work: visible pairs over the layers plus token weight "
                    "x tokens. K/V: what the busiest rank receives over all layers, as a fraction of a full ring over "
                    "equal shards ((L - L/P) tokens per layer). Planning: CPU time of one thread for the layout plus "
                    "the slowest rank's plans (every distinct mask). Kernel calls: per forward, busiest rank.")
        import bench_cp_layouts

        tables = bench_cp_layouts.layouts_tables(plans["results"])
        split = tables.index("") if "" in tables else len(tables)
        out += tables[:split] + [""]
        if summary:
            P = max(s["world_size"] for s in summary)
            bal = [s for s in summary if s["layout"] == "balanced" and s["world_size"] == P]
            out += para(f"At {k_tokens(plans['config']['seq_len'])} over {P} ranks balance reaches "
                        f"{max(s['busiest_over_mean'] for s in bal):.3f} with up to "
                        f"{max(s['token_spread'] for s in bal):.2f} x L / P tokens.")
        big = load(folder, "cp_layouts_256k.json")
        if big:
            out += para(f"The same from the plans at L = {big['config']['seq_len']} (`cp_layouts_256k.json`):")
            out += bench_cp_layouts.layouts_tables(big["results"]) + [""]
        ranks = [r for r in plans["results"] if r["kind"] == "ranks"]
        if ranks:
            rc = plans["config"].get("ranks", {})
            out += ["### Real ranks", ""]
            out += para(f"P = {', '.join(map(str, sorted({r['world_size'] for r in ranks})))}, gloo processes on CPU, "
                        f"reference backend, L = {ranks[0]['seq_len']} (one drawn row), H = {rc.get('heads', '-')}, "
                        f"K = {rc.get('kv_heads', '-')}, D = {rc.get('head_dim', '-')}, {rc.get('dtype', 'float32')}; "
                        "forward+backward of every layer of the mix; the three layouts interleaved in one run. Figures "
                        "are the slowest rank's time inside kernel calls (thread CPU time) and its wall time, as ratios "
                        "to zigzag measured side by side:")
            out += tables[split + 1:] + [""]
            bal = {(r["world_size"], r["mix"]): r for r in ranks if r["layout"] == "balanced"}
            zig = {(r["world_size"], r["mix"]): r for r in ranks if r["layout"] == "zigzag"}
            parts = [f"{mix} at P = {P}: {r['compute_speedup_over_zigzag']:.2f}x measured, "
                     f"{r['predicted_speedup_over_zigzag']:.2f}x predicted (zigzag's busiest / mean "
                     f"{zig[(P, mix)]['busiest_over_mean']:.2f})" for (P, mix), r in bal.items()]
            out += para("Balanced over zigzag, compute of the slowest rank: " + "; ".join(parts) + ". Wall time runs "
                        "more ranks than cores: read the compute column. Outputs equal zigzag's to "
                        f"{max(r['max_abs_diff_vs_zigzag'] for r in ranks):.1e}.")
        out += image(folder, page_dir, "cp_layouts.png", "layouts")
        out.append("")
    return out


def planning_section(folder: str) -> list[str]:
    payload = load(folder, "planning.json")
    if payload is None:
        return []
    records = payload["records"]
    first, last = min(r["L"] for r in records), max(r["L"] for r in records)
    cu = [r for r in records if r["source"] == "cu_seqlens"]
    pos = [r for r in records if r["source"] == "position_ids"]
    r0 = records[0]
    out = ["## Planning time", ""]
    out += code("OMP_NUM_THREADS=1 python benchmarks/bench_planning.py --out benchmarks/results/cpu")
    out += para(f"`bench_planning.py`, `planning.json`: per step, what `cp.shard_batch` and the first layer compute: "
                "the document metadata (from the collator's `cu_seqlens` or from `position_ids`), the balanced "
                f"layout of those documents (zigzag: none) and one rank's plan; P = {r0['P']}, {r0['docs']} documents "
                f"(lognormal lengths scaled to the row) at {k_tokens(first)} and {k_tokens(last)} tokens, median of "
                "the runs on one thread, and the total again with torch using every core.")
    out += planning_table(payload) + [""]
    text = ""
    if cu:
        text += (f"From `cu_seqlens`, layout + one rank's plan at {k_tokens(last)} tokens takes "
                 f"{span([r['layout_plan_ratio_to_first_length'] for r in cu if r['L'] == last], 1)}x its time at "
                 f"{k_tokens(first)} (goal: at most 2x) and at most {max(r['layout_plan_ms'] for r in cu):.1f} ms at either "
                 "length. Nothing in the layout or the plan is per token: a token range's attention cost is a closed "
                 "form per piece between segment edges and window kinks (exact integers; bisections by the "
                 "quadratic's root plus exact comparisons), a long document's costs are a per-document view, the "
                 "traffic terms are step functions over segment edges, and the plan counts its computed entries in "
                 "closed form.")
    if pos:
        text += (" From `position_ids` the metadata itself still reads every token once (O(L): "
                 f"{span([r['meta_ms'] for r in pos if r['L'] == first], 1)} ms at {k_tokens(first)}, "
                 f"{span([r['meta_ms'] for r in pos if r['L'] == last], 1)} ms at {k_tokens(last)}); with it the totals are "
                 f"{span([r['ratio_to_first_length'] for r in pos if r['L'] == last], 1)}x.")
    if text:
        out += para(text.strip())
    return out


def planning_scale_section(folder: str, page_dir: str) -> list[str]:
    """``bench_planning.py --scale``: planning from 8 to 1024 ranks, one rank's view."""
    payload = load(folder, "planning_scale.json")
    if payload is None:
        return []
    done = [r for r in payload["records"] if not r.get("skipped")]
    skipped = [r for r in payload["records"] if r.get("skipped")]
    out = ["### At hundreds of ranks", ""]
    out += code("OMP_NUM_THREADS=1 python benchmarks/bench_planning.py --scale --budget 120 --out benchmarks/results/cpu")
    out += para("`bench_planning.py --scale`, `planning_scale.json`: one rank's view on one thread, from `cu_seqlens`: "
                "the balanced layout of the batch's documents for the layer mix, this rank's plan of each distinct "
                "mask (the ring's), and per distinct mask `strategy=\"auto\"`'s choice (every candidate priced) "
                "and the chosen candidate's plan of this rank (H 64 / K 8 / D 128, float16 K/V); lognormal "
                "documents filling the row; above 64 ranks the layout is the stream partition. The worst over the "
                "mixes per (L, documents, P), in ms; the last column is a whole step's planning under auto "
                "(layout, then every distinct mask's choice and plan):")
    lines = ["| L | documents | P | layout + plans ms (worst mix) | auto's choice ms per mask | auto's plan ms per mask "
             "| step under auto ms |", "|---:|---:|---:|---:|---:|---:|---:|"]
    keys = sorted({(r["L"], r["docs"], r["P"]) for r in done})
    for L, docs, P in keys:
        mine = [r for r in done if (r["L"], r["docs"], r["P"]) == (L, docs, P)]
        worst = max(mine, key=lambda r: r["layout_plan_ms"])
        step = max(mine, key=lambda r: r.get("auto_step_ms", 0.0))
        lines.append(f"| {k_tokens(L)} | {docs} | {P} | {worst['layout_plan_ms']:.0f} ({worst['mix']}) | "
                     f"{max(r['auto_ms_per_mask'] for r in mine):.0f} | "
                     f"{max(r.get('auto_plan_ms_per_mask', float('nan')) for r in mine):.0f} | "
                     f"{step.get('auto_step_ms', float('nan')):.0f} ({step['mix']}) |")
    out += lines + [""]
    growth = [g for g in payload["growth"] if g.get("layout_plan") is not None]
    if growth:
        out += para(f"Growth exponents in P from 64 to the largest P measured (log-log slope; P log P from 64 to "
                    f"1024 is 1.18): layout + plans {span([g['layout_plan'] for g in growth], 2)}, auto "
                    f"{span([g['auto'] for g in growth if g.get('auto') is not None], 2)}.")
    if skipped:
        out += para(f"{len(skipped)} configurations were skipped: a smaller P of theirs took over the script's budget.")
    out += image(folder, page_dir, "planning_scale.png", "planning at scale")
    return out + [""] + stream_section(folder)


def stream_section(folder: str) -> list[str]:
    """``bench_stream.py``: the search and the stream partitions on the same batches."""
    payload = load(folder, "stream.json")
    if payload is None:
        return []
    records = payload["records"]
    out = ["#### The stream partition against the search", ""]
    out += code("OMP_NUM_THREADS=1 python benchmarks/bench_stream.py --out benchmarks/results/cpu")
    out += para(f"`bench_stream.py`, `stream.json`: above 64 ranks the balanced layout is the stream partition; "
                f"here both partitions run on the same batches ({payload['seeds']} per row, 1M tokens, the mixes "
                "above). Worst over the mixes and seeds: the busiest rank's cost over the mean and the most tokens "
                "on a rank over L / P (cap 1.25); the K/V tokens the busiest receiver receives (the layer that "
                "reaches furthest) and the mean over the ranks, as the stream's over the search's (the worst mix "
                "and the geometric mean over the mixes); layout ms (worst mix).")
    lines = ["| documents | P | busiest / mean: search | stream | max tokens / (L/P): search | stream | busiest K/V "
             "recv: stream / search (worst; mean over mixes) | mean K/V recv: stream / search (worst; mean) | "
             "layout ms: search | stream |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for docs, P in sorted({(r["docs"], r["P"]) for r in records}):
        mine = {(r["mix"], r["partition"]): r for r in records if (r["docs"], r["P"]) == (docs, P)}
        mixes = sorted({m for m, _ in mine})

        def worst(part: str, key: str) -> float:
            return max(mine[(m, part)][key] for m in mixes)

        def ratio(key: str) -> str:
            rs = [mine[(m, "stream")][key] / max(mine[(m, "search")][key], 1e-9) for m in mixes]
            geo = math.exp(sum(math.log(max(x, 1e-9)) for x in rs) / len(rs))
            return f"{max(rs):.2f}; {geo:.2f}"
        lines.append(f"| {docs} | {P} | {worst('search', 'busiest_over_mean'):.3f} | "
                     f"{worst('stream', 'busiest_over_mean'):.3f} | {worst('search', 'max_tokens_over_mean'):.2f} | "
                     f"{worst('stream', 'max_tokens_over_mean'):.2f} | {ratio('recv_busiest')} | {ratio('recv_mean')} | "
                     f"{worst('search', 'layout_ms'):.0f} | {worst('stream', 'layout_ms'):.0f} |")
    return out + lines + [""]


def mla_section(folder: str) -> list[str]:
    """Multi-head latent attention: what the ring moves when the latent travels (bench_mla.py)."""
    payload = load(folder, "mla.json")
    if payload is None:
        return []
    import bench_mla

    results = payload["results"]
    modeled = [r for r in results if r["kind"] == "modeled"]
    measured = [r for r in results if r["kind"] == "measured"]
    out = ["## Multi-head latent attention: the latent moves", ""]
    out += code("python benchmarks/bench_mla.py --out benchmarks/results/cpu")
    out += para("`bench_mla.py`, `mla.json`. The first table is DeepSeek-V3's real attention shapes, read from "
                "transformers' `DeepseekV3Config()`, on one causal row in bfloat16, zigzag layout: the busiest rank's "
                "forward K/V bytes from the planner when the heads move, and the same rank's tokens times the latent "
                "width when the latent moves (the backward moves as many again, and returns their gradients). The "
                "second is measured on real gloo ranks (one thread each) with reduced-width models, each run twice on "
                "the same packed batch: the default cost model (the latent moves) and one whose device is too slow "
                "to expand (the heads move); bytes are what the busiest rank's comm received in the forward, counted "
                "as the receives were posted.")
    out += bench_mla.tables(results) + [""]
    if modeled:
        ratios = sorted({round(r["ratio"], 1) for r in modeled})
        out += bullet(f"DeepSeek-V3's layers move {span(ratios, 1, 'x')} fewer K/V bytes with the latent "
                      f"({modeled[0]['latent_dim']} numbers a token against {modeled[0]['heads']} x "
                      f"({modeled[0]['head_dim']} + {modeled[0]['head_dim_v']})); the cost model picks "
                      f"{modeled[0]['form']}: {modeled[0]['reason']}.")
    if measured:
        out += bullet(f"Measured, the bytes fall by {span([r['ratio'] for r in measured], 1, 'x')} (each model's "
                      "heads-to-latent ratio of widths), and the two runs' logits are at most "
                      f"{max(r['max_abs_diff'] for r in measured):.1e} apart. The step-time ratio on CPU "
                      f"({span([r['wall_latent_over_heads'] for r in measured])}) weighs localhost gloo bytes against "
                      "CPU matrix products, not a GPU's link against its FLOPs: read the bytes.")
    return out + ["", "No absolute times: CPU ratios only.", ""]


def trainer_memory_section(folder: str) -> list[str]:
    """A distillation step's peak memory per rank against one process (bench_trainer_memory.py)."""
    payload = load(folder, "trainer_memory.json")
    if payload is None:
        return []
    import bench_trainer_memory

    results = payload["results"]
    grid = payload["config"]["grid"]
    out = ["## Trainer memory: a distillation step", ""]
    out += code("python benchmarks/bench_trainer_memory.py --out benchmarks/results/cpu")
    out += para("`bench_trainer_memory.py`, `trainer_memory.json`. TRL's DistillationTrainer on one process against "
                "CPDistillationTrainer on P ranks (torchrun, gloo), cp_flash in both, so only the sharding differs; a "
                f"student and a teacher of one gpt-oss shape (hidden {grid['hidden']}, {grid['layers']} layers, "
                "gradient checkpointing), two prompts with one long completion each from a fixed stub. Measured: the "
                "second step's peak resident memory above the resident memory at its start (the high-water mark "
                "reset there; large buffers returned to the system when freed), on the busiest rank: what the step "
                "allocates, logits included; weights, optimizer state and libraries excluded.")
    out += bench_trainer_memory.tables(results) + [""]
    for vocab in sorted({r["vocab"] for r in results}):
        one = next((r for r in results if r["vocab"] == vocab and r["world_size"] == 1), None)
        two = next((r for r in results if r["vocab"] == vocab and r["world_size"] == 2), None)
        if one and two:
            out += bullet(f"Vocabulary {vocab}: the busiest of 2 ranks peaks at {two['peak_mib'] / one['peak_mib']:.2f}x "
                          f"one process ({two['peak_mib']:.0f} against {one['peak_mib']:.0f} MiB).")
    out += bullet("What does not shrink: TRL projects the hidden states in tiles of up to 4096 tokens by 32768 "
                  "vocabulary ids, so a rank holding 4096 tokens or more allocates the same tiles as one process; with a "
                  "larger vocabulary those fixed tiles are a larger part of the step at the lengths a CPU can run "
                  "(8192 ids above), and a smaller part at real model widths and lengths, where the activations of the "
                  "sequence dominate. No run holds the whole sequence's logits (last column).")
    return out + ["", "No absolute times: memory only.", ""]
