"""Mutation check: plant representative bugs in a temporary copy of the repository and assert that
the default (CI) test suite catches every one.

    python tests/mutations.py                 # every mutant; prints the table; exit 1 if one survives
    python tests/mutations.py --only sinks    # mutants whose name contains "sinks"
    python tests/mutations.py --list          # the mutants, without running anything
    python tests/mutations.py --record docs/data/mutants.json   # run, and record the outcomes there
    python tests/mutations.py --page docs/mutants.md             # render the page from the record (runs nothing)

Each mutant replaces one exact piece of source (found exactly once) and runs the test files of the
CI suite that are meant to catch it (every test of those files but the long fuzz run: :data:`MARKS`).
A mutant is caught when that run fails; the table says which test failed first. The record
(``docs/data/mutants.json``) keeps the outcome of each mutant's last run (``--record`` with ``--only``
updates those mutants alone), and ``docs/mutants.md`` is rendered from it (:func:`page`).
``tests/meta/test_mutations.py`` checks in CI that every mutant still applies to the current code, so the
list cannot silently rot; ``tests/meta/test_generated_pages.py`` that the record names exactly the
mutants of :data:`MUTANTS` and the page is current.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD, PAGE = "docs/data/mutants.json", "docs/mutants.md"  # relative to the repository root

# every test of a mutant's files but the long fuzz run: tests/conftest.py keeps a long group out unless
# the -m expression names it, so the expression names each (it selects what "not fuzz" selects)
LONG_GROUPS = ("families", "faults", "strategies", "slow")
MARKS = f"not fuzz and ({' or '.join(LONG_GROUPS)} or not ({' or '.join(LONG_GROUPS)}))"


@dataclass(frozen=True)
class Mutant:
    name: str
    area: str
    path: str           # file relative to the repository root
    old: str            # exact source text, found exactly once
    new: str
    tests: tuple[str, ...]  # test files (or node ids) of the CI suite expected to catch it


_GRPO_RUNS = "tests/integrations/test_trl_rl.py::test_cp_grpo_and_rloo_equal_one_process"
_DPO_RUNS = "tests/integrations/test_trl_rl.py::test_cp_dpo_equals_one_process"
_SCORING = "tests/integrations/test_packed_rows.py::test_packed_fused_forward_equals_the_padded_call"
_ROW_HEADS = "tests/integrations/test_training.py::test_trainer_with_row_heads_under_torchrun_equals_single_device"
_MORE = "tests/integrations/test_trl_more_trainers.py::"
_PACKED = "tests/integrations/test_packed_rows.py::"
_LATENT_CP2 = "tests/integrations/test_latent.py::test_mla_families_exact_at_cp2"
_SELECTION = "tests/multirank/test_selection.py"
_SPARSE_CP = "tests/integrations/test_index_sparse.py::test_dsa_families_match_docs_alone_eager"
_DECODE, _SHARDED_CACHE = "tests/unit/test_decode.py", "tests/unit/test_sharded_cache.py"
_ADMISSION = "tests/integrations/test_admission.py"
_GENERATE = "tests/multirank/test_generate.py"
_SPARSE_ONE = "tests/integrations/test_index_sparse.py::test_dsa_one_device_follows_the_tie_rule"
_CLASS_ADMISSION = "tests/integrations/test_class_admission.py"
_INDEXER_ADMISSION = "tests/integrations/test_index_sparse.py::test_indexers_admitted_and_planted_changes_declined"
_COMPRESSOR_ADMISSION = "tests/integrations/test_index_sparse.py::test_compressors_admitted_and_planted_changes_declined"
_ROPE_ADMISSION = "tests/integrations/test_rope.py::test_the_rope_hook_admits_by_behaviour"
_VERIFICATION = "tests/integrations/test_verification.py"
_ROUTER_DECLINED = ("tests/integrations/test_router_loss.py::"
                    "test_a_declined_router_loss_refuses_under_cp_and_leaves_eager_untouched")

MUTANTS = (
    Mutant("window reach +1 (key at distance W visible)", "masks", "cp_attention/masks.py",
           "reach = INF if self.window is None else self.window - 1",
           "reach = INF if self.window is None else self.window", ("tests/multirank/test_distributed.py",)),
    Mutant("window reach -1 (key at distance W-1 hidden)", "masks", "cp_attention/masks.py",
           "reach = INF if self.window is None else self.window - 1",
           "reach = INF if self.window is None else self.window - 2", ("tests/multirank/test_distributed.py",)),
    Mutant("chunks counted from the document's first token", "masks", "cp_attention/masks.py",
           "p0 = np.zeros_like(starts) if meta.position is None else",
           "p0 = np.zeros_like(starts) if True else", ("tests/multirank/test_chunks.py",)),
    Mutant("chunk boundary one position late", "masks", "cp_attention/masks.py",
           "first = starts + (-p0) % C",
           "first = starts + (1 - p0) % C", ("tests/multirank/test_chunks.py",)),
    Mutant("a document starts only where positions fall", "masks", "cp_attention/masks.py",
           "opens_BL[:, 1:] |= pos[:, 1:] != pos[:, :-1] + 1",
           "opens_BL[:, 1:] |= pos[:, 1:] < pos[:, :-1]", ("tests/multirank/test_distributed.py",)),
    Mutant("sinks dropped in the ring", "ring/sinks", "cp_attention/strategies/ring.py",
           "        out_THDv, lse_HT = apply_sinks(out_THDv, lse_HT, sinks)",
           "        pass", ("tests/unit/test_merge.py", "tests/multirank/test_distributed.py")),
    Mutant("merge weights swapped", "merge", "cp_attention/strategies/merge.py",
           "out_a_THD.mul_(w_a_TH1).add_(out_b_THD.to(dtype) * w_b_TH1)",
           "out_a_THD.mul_(w_b_TH1).add_(out_b_THD.to(dtype) * w_a_TH1)", ("tests/unit/test_merge.py",)),
    Mutant("dK/dV of a received span not returned to its owner", "ring", "cp_attention/strategies/ring.py",
           "            dk_BLKD[:, a:b] += g.k[:, at:at + b - a]",
           "            pass", ("tests/multirank/test_distributed.py",)),
    Mutant("halo one token long (over-sending)", "planner", "cp_attention/plan/build.py",
           "ranges = sorted({(sq.k0 % Ls, (sq.k1 - 1) % Ls + 1) for sq in seqs})",
           "ranges = sorted({(max(0, sq.k0 % Ls - 1), (sq.k1 - 1) % Ls + 1) for sq in seqs})",
           ("tests/tools/test_benchmarks.py",)),
    Mutant("halo one token short", "planner", "cp_attention/plan/build.py",
           "ranges = sorted({(sq.k0 % Ls, (sq.k1 - 1) % Ls + 1) for sq in seqs})",
           "ranges = sorted({(min(sq.k0 % Ls + 1, (sq.k1 - 1) % Ls), (sq.k1 - 1) % Ls + 1) for sq in seqs})",
           ("tests/multirank/test_distributed.py",)),
    Mutant("zigzag: rank r holds slices r and 2P-2-r", "layouts", "cp_attention/layout/layouts.py",
           "ranges = [slice_bound(seq_len, n, rank), slice_bound(seq_len, n, n - 1 - rank)]",
           "ranges = [slice_bound(seq_len, n, rank), slice_bound(seq_len, n, (n - 2 - rank) % n)]",
           ("tests/unit/test_layout.py",)),
    Mutant("gather returns shards in rank order, not token order", "layouts", "cp_attention/layout/layouts.py",
           "    pieces.sort(key=lambda item: item[0])\n", "", ("tests/unit/test_layout.py",)),
    Mutant("flash lse: +inf of rows that see no key not mapped back to -inf", "flash",
           "cp_attention/backends/flash/backend.py",
           'return torch.where(torch.isposinf(lse_HT), torch.full_like(lse_HT, float("-inf")), lse_HT)',
           "return lse_HT", ("tests/unit/test_flash_translation.py",)),
    Mutant("flash-attn 3 backward gets +inf, not -inf, for rows that see no key", "flash",
           "cp_attention/backends/flash/fa3.py",
           'empty_lse = float("-inf")  # its backward preprocess reads -inf as "no key" (log2 lse 0, all masked)',
           'empty_lse = float("inf")', ("tests/unit/test_flash_translation.py",)),
    Mutant("flash-attn 2 backward gets -inf, not +inf, for rows that see no key", "flash",
           "cp_attention/backends/flash/fa2.py",
           'empty_lse = float("inf")  # its forward writes +inf for rows that see nothing',
           'empty_lse = float("-inf")', ("tests/unit/test_flash_translation.py",)),
    Mutant("flash-attn 3 forward: window sides swapped", "flash", "cp_attention/backends/flash/fa3.py",
           "                  **window_kwargs(self._fwd_params, window_size_left, window_size_right))\n"
           "        if softcap:\n            kw[\"softcap\"] = softcap\n        out_THD, lse_HT, *_ = call_kernel(",
           "                  **window_kwargs(self._fwd_params, window_size_right, window_size_left))\n"
           "        if softcap:\n            kw[\"softcap\"] = softcap\n        out_THD, lse_HT, *_ = call_kernel(",
           ("tests/unit/test_flash_translation.py",)),
    Mutant("flash-attn 2 / PyTorch flash: adapter passes max_seqlen_k unchanged", "flash",
           "cp_attention/backends/flash/interface.py",
           "return max(max_seqlen_q, max_seqlen_k) if max_seqlen_k > 0 else max_seqlen_k",
           "return max_seqlen_k", ("tests/unit/test_flash_translation.py",)),
    Mutant("gpu_check: a forced ok = True in the verdict", "gpu_check", "benchmarks/gpu_check.py",
           "ok = math.isfinite(err) and err <= factor * base", "ok = True", ("tests/tools/test_gpu_check.py",)),
    Mutant("gradient scaling: loss normalised by all label tokens (SUM convention)", "training",
           "cp_attention/integrations/hf/batch.py",
           '{"num_items_in_batch": num_items.to(device, torch.float32) / cp.world_size}',
           '{"num_items_in_batch": num_items.to(device, torch.float32)}',
           ("tests/integrations/test_training.py::test_ddp_fsdp2_checkpointing_collator_cp2",)),
    Mutant("failures: a lost connection raises gloo's error, not blamed on its peer", "failures",
           "cp_attention/comm.py",
           "raise self._peer_died(exc.peer, what, exc.cause) from exc.cause",
           "raise exc.cause", ("tests/multirank/test_real_faults.py::test_real_fault",)),
    Mutant("failures: the agreement's all-gather as a gloo collective (exit waits for the group timeout)",
           "failures", "cp_attention/comm.py",
           '        tensor = tensor.contiguous()\n        if self.backend == "nccl":',
           '        tensor = tensor.contiguous()\n        if True:',
           ("tests/multirank/test_real_faults.py::test_real_fault",)),
    Mutant("failures: a wait queues behind one blocked by a failed group", "failures", "cp_attention/waits.py",
           "        if start:\n            try:\n                threading.Thread(",
           "        if start and self._busy == 1:\n            try:\n                threading.Thread(",
           ("tests/multirank/test_real_faults.py::test_real_fault",)),
    Mutant("checkpoint recompute uses the active context, not the batch's", "training", "cp_attention/engine/attend.py",
           "    if bound is not None:\n        cp = bound\n",
           "    if False:\n        cp = bound\n",
           ("tests/integrations/test_training.py::test_ddp_fsdp2_checkpointing_collator_cp2",)),
    Mutant("usp: a head group's tokens in member order, not global order", "strategies",
           "cp_attention/strategies/ulysses.py",
           "        runs.sort()\n", "", ("tests/multirank/test_ulysses.py::test_strategies_exact_against_the_oracle",)),
    Mutant("usp: a failure in a sub-group recorded under its rank in the sub-group", "strategies",
           "cp_attention/comm.py", "        self.parent.report_failure(where, exc)",
           "        self.parent._record(self.rank, f\"rank {self.rank} failed in {where}: {exc}\")",
           ("tests/multirank/test_failures.py::test_rank_raising_inside_attention_is_named_by_the_others",)),
    Mutant("auto: picks the most expensive candidate", "strategies", "cp_attention/strategies/choice.py",
           "if best is None or t < best[0]:", "if best is None or t > best[0]:", ("tests/unit/test_strategy.py",)),
    Mutant("cost model: the all-to-alls' backward bytes not counted", "strategies", "cp_attention/strategies/choice.py",
           "a2a += 2 * _moving(", "a2a += _moving(",
           ("tests/unit/test_strategy.py",)),
    Mutant("balanced: nested pieces do not carry their rounding to the next", "layouts", "cp_attention/layout/split.py",
           "        x += short\n", "        x += 0.0 * short\n", ("tests/unit/test_layout_scale.py",)),
    Mutant("planner: a rank's receive reach one key short", "layouts", "cp_attention/plan/build.py",
           "recv.append((np.maximum(sa, a + lo), np.minimum(sb, e + hi)))",
           "recv.append((np.maximum(sa, a + lo), np.minimum(sb, e + hi - 1)))", ("tests/unit/test_plan_peers.py",)),
    Mutant("auto pricing: the ring's K/V counted once, not forward and backward", "strategies",
           "cp_attention/strategies/pricing.py",
           "kv_s = 2 * np.maximum(_side(n_out * kv, near_dst, model), _side(n_in * kv, near_src, model))",
           "kv_s = np.maximum(_side(n_out * kv, near_dst, model), _side(n_in * kv, near_src, model))",
           ("tests/unit/test_pricing.py",)),
    Mutant("prepare: the step does not look up the prepared batch", "engine", "cp_attention/engine/context.py",
           "            if isinstance(found, PreparedDocuments):", "            if False:",
           ("tests/unit/test_prepare.py",)),
    Mutant("stream: a long document read from its start, not back from its end", "layouts",
           "cp_attention/layout/stream.py", 'dense = _Open(*free.pop_dense(), "back")',
           'dense = _Open(*free.pop_dense(), "front")', ("tests/unit/test_layout_stream.py",)),
    Mutant("stream: a small cost gap closed with a sliver of the long document", "layouts",
           "cp_attention/layout/stream.py", "if runs is None and c_rem < SLIVER * T and",
           "if runs is None and c_rem < 0 * T and", ("tests/unit/test_layout_stream.py",)),
    Mutant("stream: no cap on a rank's cost share (the last ranks take what the others left)", "layouts",
           "cp_attention/layout/stream.py", "share = min((C - done_c) / (P - r), SHARE_CAP * T)",
           "share = (C - done_c) / (P - r)", ("tests/unit/test_layout_stream.py",)),
    Mutant("stream: what no rank took is dropped", "layouts", "cp_attention/layout/stream.py",
           "    _spread(costs, left, owned, T, cap)\n", "", ("tests/unit/test_layout_stream.py",)),
    Mutant("stream: the dense end fills a rank past its token room", "layouts", "cp_attention/layout/stream.py",
           "runs, c, n = dense.take(costs, c_rem + slack, room)",
           "runs, c, n = dense.take(costs, c_rem + slack, math.inf)", ("tests/unit/test_layout_stream.py",)),
    Mutant("stream: a read-back document's cheap start never goes back among the free items", "layouts",
           "cp_attention/layout/stream.py", "if rest_c * left_n < left_c * rest_n:", "if False:",
           ("tests/unit/test_layout_stream.py",)),
    Mutant("paused collector: not enabled again after a nested pause", "engine", "cp_attention/quiet_gc.py",
           '            if _STATE["open"] == 0 and _STATE["was_enabled"]:',
           '            if _STATE["open"] == 1 and _STATE["was_enabled"]:',
           ("tests/unit/test_layout_stream.py",)),
    Mutant("ring runs of a head group: touching runs not joined", "strategies", "cp_attention/strategies/ulysses.py",
           "    new[1:] = (g[1:] != g[:-1]) | (a[1:] != b[:-1])", "    new[1:] = True",
           ("tests/unit/test_layout_stream.py",)),
    Mutant("mixers: a recurrence's state not reset at a document start", "mixers", "cp_attention/strategies/scan.py",
           "        opens = inside[geo.doc_start[p.row, p.start + 1:p.end] == inside].tolist()",
           "        opens = []", ("tests/integrations/test_mixers.py",)),
    Mutant("mixers: a convolution halo one token short", "mixers", "cp_attention/strategies/scan.py",
           "    taps = torch.where(~ok, torch.full_like(src, zero),",
           "    taps = torch.where(~ok | ((owner != r) & (torch.arange(kernel) == 0)), torch.full_like(src, zero),",
           ("tests/integrations/test_mixers.py",)),
    Mutant("mixers: a piece's incoming state from the wrong neighbour", "mixers", "cp_attention/strategies/scan.py",
           "        links, q = [], ends[(p.row, p.start)]",
           "        links, q = [], ends.get(((p.row + 1) % geo.batch, p.start), ends[(p.row, p.start)])",
           ("tests/integrations/test_mixers.py",)),
    Mutant("mixers: no agreement before a convolution's first exchange", "mixers",
           "cp_attention/integrations/hf/adapters/mixer_functions.py",
           "        agree(record, record.cp.comm, (0, x.shape[0], x.shape[1], kernel))", "",
           ("tests/integrations/test_mixers.py::test_ranks_with_different_batches_raise_together_before_an_exchange",)),
    Mutant("mixers: the incoming state not carried through a piece", "mixers",
           "cp_attention/strategies/mixer_exchange.py",
           "            passes = carries and not any(opens[a + 1:e])", "            passes = False",
           ("tests/integrations/test_mixers.py",)),
    Mutant("cpu backend: tiles batched whatever their keys' stride", "cpu", "cp_attention/backends/cpu.py",
           "and (last.n > 1 and k0 == last.k0 + last.n * last.k_step", "and (last.n > 1",
           ("tests/unit/test_cpu_backend.py",)),
    Mutant("cpu backend: a merged part overwrites the row's earlier result", "cpu", "cp_attention/backends/cpu.py",
           "out[rows].mul_(torch.exp(old - new).t()[..., None])", "out[rows].mul_(0.0)",
           ("tests/unit/test_cpu_backend.py",)),
    Mutant("cpu backend: dK/dV of overlapping spans added in one overlapping view", "cpu",
           "cp_attention/backends/cpu.py", "width = min(call.k_step, call.S - start)",
           "width = call.S - start", ("tests/unit/test_cpu_backend.py",)),
    Mutant("cpu backend: a long full part's later key slices dropped in the backward", "cpu",
           "cp_attention/backends/cpu.py", "for s0 in range(0, call.S, max_span):",
           "for s0 in range(0, min(call.S, max_span), max_span):", ("tests/unit/test_cpu_backend.py",)),
    Mutant("batch: a memoised check returned for a dead tensor's reused id", "batch", "cp_attention/engine/batch.py",
           "hit[0]() is tensor and hit[1] == version", "hit[1] == version",
           ("tests/integrations/test_training.py::test_tensor_fact_is_weak_and_versioned",
            "tests/integrations/test_training.py::test_position_check_syncs_once_per_batch_and_tensor")),
    Mutant("bidirectional spans: the later keys of a span not planned", "spans", "cp_attention/masks.py",
           "    if extra is not None and meta.spans is not None:", "    if False:",
           ("tests/integrations/test_multimodal.py",)),
    Mutant("spans: the mask function's corners all read from row 0", "spans", "cp_attention/integrations/hf/overlays.py",
           "seen = mask_function(rows, torch.zeros_like(q_idx), q_idx, kv_idx)",
           "seen = mask_function(torch.zeros_like(rows), torch.zeros_like(q_idx), q_idx, kv_idx)",
           ("tests/integrations/test_multimodal.py::test_span_shape_checked_against_the_mask_function",)),
    Mutant("length-dependent rope: each rank's own largest position", "rope", "cp_attention/integrations/hf/adapters/rope.py",
           "    largest = _largest_position(cp, position_ids)", "    largest = position_ids.amax()",
           ("tests/integrations/test_rope.py",)),
    Mutant("decoders numbering their own positions: position_ids read as documents", "positions",
           "cp_attention/integrations/hf/positions.py",
           "    if family_takes_positions(type(module).__module__):\n        return position_ids",
           "    if True:\n        return position_ids",
           ("tests/integrations/test_model_check.py::test_decoders_numbering_their_own_positions_at_world_size_1",)),
    Mutant("GRPO: each rank of the group normalises as one process (token count not scaled)", "trl",
           "cp_attention/integrations/trainers/trl.py",
           'joined["num_items_in_batch"] = joined["num_items_in_batch"] * cp.world_size',
           'joined["num_items_in_batch"] = joined["num_items_in_batch"]', (_GRPO_RUNS,)),
    Mutant("GRPO: the entropy quantile over every rank's copy of the joined batch", "trl",
           "cp_attention/integrations/trainers/trl.py",
           "        if cp is not None and cp.rank != 0:\n            values = values[:0]",
           "        if False:\n            values = values[:0]",
           (_PACKED + "test_entropy_quantile_counts_the_joined_batch_once",)),
    Mutant("GRPO/RLOO: each rank shuffles the joined batch with its own permutation", "trl",
           "cp_attention/integrations/trainers/trl.py", "torch.set_rng_state(states[0])",
           "torch.set_rng_state(self._cp_rng_restore)", (_GRPO_RUNS,)),
    Mutant("scoring: each rank's fields of its own shard only (per-rank sequence sums)", "trl",
           "cp_attention/integrations/trainers/packed_rows.py", "gathered = gather_rows(fields, index, cp.comm)[0, :N]",
           "gathered = fields.new_zeros(N, fields.shape[-1]).index_copy(0, index[index < N], "
           "fields[0, :int((index < N).sum())])", (_SCORING, _DPO_RUNS)),
    Mutant("scoring: a rank's own rows returned at the joined batch's width", "trl",
           "cp_attention/integrations/trainers/packed_rows.py", "unpack_rows(gathered, packed, mine, input_ids.shape[1])",
           "unpack_rows(gathered, packed, mine)", (_SCORING,)),
    Mutant("scoring: a label on a row's first token accepted (predicted from the row before)", "trl",
           "cp_attention/integrations/trainers/packed_rows.py",
           "opening = torch.nonzero((counts > 0) & (lab.gather(1, first[:, None])[:, 0] != -100))",
           "opening = torch.nonzero((counts < 0) & (lab.gather(1, first[:, None])[:, 0] != -100))",
           (_PACKED + "test_pack_rows_refuses_rows_it_would_change",)),
    Mutant("scoring: the router loss's value this rank's share", "trl",
           "cp_attention/integrations/trainers/packed_rows.py", "aux = _group_value(cp, out.aux_loss)", "aux = out.aux_loss",
           (_SCORING,)),
    Mutant("joins: prompts padded on the right", "trl", "cp_attention/integrations/trainers/trainer.py",
           "on_left = left or key in left_keys", "on_left = left",
           (_PACKED + "test_join_rows_equals_padding_every_row_at_once", _GRPO_RUNS)),
    Mutant("DPO join: each rank's chosen and rejected rows kept together", "trl",
           "cp_attention/integrations/trainers/trl.py", "torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)",
           "torch.cat(padded, dim=0)",
           (_PACKED + "test_join_pairs_equals_the_collator_on_every_pair", _DPO_RUNS)),
    Mutant("CPTrainer rows: a pooled head's loss not divided by the CP size Trainer multiplied in", "trl",
           "cp_attention/integrations/trainers/trainer.py", "return float(cp_size) if multiplied else 1.0",
           "return 1.0", (_ROW_HEADS + "[sequence]",)),
    Mutant("QA span positions on padded rows not refused", "heads", "cp_attention/integrations/hf/heads.py",
           'if kind == "qa" and record is not None and record.extras.get(HAS_PADDING)',
           'if kind == "qa" and record is not None and False',
           ("tests/integrations/test_heads.py::test_heads_refused_or_exact_under_cp",)),
    Mutant("reward join: each rank's chosen and rejected rows kept together", "trl",
           "cp_attention/integrations/trainers/trl.py", "        return join_pairs(parts, pad_token_id)\n",
           "        return join_row_batches(parts, pad_token_id=pad_token_id)\n",
           (_MORE + "test_cp_reward_trainer_equals_one_process",)),
    Mutant("KTO: the KL completions rotated within each rank's micro-batch", "trl",
           "cp_attention/integrations/trainers/trl.py",
           "args.per_device_train_batch_size = per_device * size", "args.per_device_train_batch_size = per_device",
           (_MORE + "test_cp_kto_trainer_equals_one_process",)),
    Mutant("KTO join: unpaired rows joined as preference pairs", "trl", "cp_attention/integrations/trainers/trl.py",
           'return join_row_batches(parts, pad_token_id=self._cp_pad_id(), what="unpaired preference batches")',
           "return join_pairs(parts, self._cp_pad_id())", (_MORE + "test_cp_kto_trainer_equals_one_process",)),
    Mutant("distillation: each rank's loss its share of the divergence, not P times it", "trl",
           "cp_attention/integrations/trainers/trl.py",
           "super()._compute_loss(unwrapped_student, shard, num_items_in_batch / cp.world_size)",
           "super()._compute_loss(unwrapped_student, shard, num_items_in_batch)",
           (_MORE + "test_cp_distillation_trainer_equals_one_process",)),
    Mutant("distillation: the hidden state scored at the completion token, not the one before it", "trl",
           "cp_attention/integrations/trainers/trl.py",
           'scored = (local.pop("cp_targets") != -100).to(inputs["completion_mask"].dtype)',
           'scored = (local.pop("cp_targets") != -100).roll(1, -1).to(inputs["completion_mask"].dtype)',
           (_MORE + "test_cp_distillation_trainer_equals_one_process",)),
    Mutant("mixers: the running forward's own batch ignored when several are alive", "trl",
           "cp_attention/integrations/hf/mixing.py",
           '        record = getattr(FORWARD, "record", None)  # the running model forward\'s own batch',
           "        record = None", (_DPO_RUNS,)),
    Mutant("an indexer's selected keys (block_indices=) dropped by the attention", "masks",
           "cp_attention/integrations/hf/attention.py", 'SELECTION_ARGUMENT = re.compile(r"(^|_)indices$")',
           'SELECTION_ARGUMENT = re.compile(r"^$")',
           ("tests/integrations/test_model_check.py::test_selected_keys_handed_to_the_attention_are_refused",)),
    Mutant("a score tensor of another shape (Inkling2's per-query sinks=) dropped by the attention", "masks",
           "cp_attention/integrations/hf/attention.py", "if name in SCORE_ARGUMENTS or (value.dim() >= 3",
           "if (value.dim() >= 3",
           ("tests/integrations/test_model_check.py::test_score_tensors_refused_by_name_whatever_their_shape",)),
    Mutant("DSA indexer: top-k over the rank's own keys (a local top-k)", "masks",
           "cp_attention/integrations/hf/adapters/indexers.py",
           "return batch, batch is not None and batch.cp.world_size > 1", "return batch, False", (_SPARSE_CP,)),
    Mutant("DSA indexer: ties at the k-th place left to torch.topk", "masks", "cp_attention/integrations/hf/selection.py",
           "if func in (torch.topk, torch.Tensor.topk):", "if False:", (_SPARSE_ONE, _SPARSE_CP)),
    Mutant("selected keys: some remote keys dropped", "masks", "cp_attention/strategies/select.py",
           "    ok_BLS = (sel_BLS >= 0) & ~beyond_BLS\n",
           "    ok_BLS = (sel_BLS >= 0) & ~beyond_BLS & ((plan.owner.to(device)[sel_BLS.clamp(0, T - 1)] == rank) "
           "| (sel_BLS % 5 > 0))\n",
           (_SELECTION,)),
    Mutant("selected keys: not intersected with causality, windows and documents", "masks",
           "cp_attention/strategies/select.py",
           "inside = (sel_BLS >= lo_BL[..., None]) & (sel_BLS <= hi_BL[..., None])", "inside = sel_BLS >= 0",
           (_SELECTION,)),
    Mutant("selected keys: a key selected twice counted twice", "masks", "cp_attention/strategies/select.py",
           "return sel_BLS.masked_fill(repeat, -1).sort(-1).values", "return sel_BLS", (_SELECTION,)),
    Mutant("selected keys: the fetched keys' gradients not returned to their owners", "masks",
           "cp_attention/strategies/select.py", "grad_RKE.index_add_(0, rows, g)",
           "grad_RKE.index_add_(0, rows, 0 * g)",
           (_SELECTION,)),
    Mutant("selected keys: the traffic counted as the keys' shards", "masks", "cp_attention/strategies/select.py",
           "kv_bytes_recv=got * row_bytes,", "kv_bytes_recv=B * (plan.seq_len - L) * row_bytes,", (_SELECTION,)),
    Mutant("cp_flash: any indices= read as global keys, not only an adapted indexer's", "masks",
           "cp_attention/integrations/hf/attention.py", 'if name == "indices" and global_selection(value):',
           'if name == "indices":',
           ("tests/integrations/test_index_sparse.py::test_a_selection_no_adapted_indexer_made_is_refused",)),
    Mutant("Qwen4 block indexer: the queries' rotary tables read from the whole row's last rows", "masks",
           "cp_attention/integrations/hf/adapters/indexers.py",
           "cos, sin = torch.cat([gather(cos), cos], dim=1), torch.cat([gather(sin), sin], dim=1)",
           "cos, sin = gather(cos), gather(sin)", (_SPARSE_CP,)),
    Mutant("Qwen4 block indexer: its selection dropped by the mask", "masks", "cp_attention/integrations/hf/selection.py",
           "return self.mask.with_selection(other.key_select)", "return self.mask", (_SPARSE_CP,)),
    Mutant("compiled in a one-rank block: the mixers traced as they are (across documents)", "compile",
           "cp_attention/integrations/hf/mixing.py", "if compiling_outside_cp() and not _traced_in_block():",
           "if compiling_outside_cp():",
           ("tests/integrations/test_hybrids.py::test_hybrid_compiled_in_a_one_rank_block_keeps_documents_apart",)),
    Mutant("selected keys: a chunk's key gradients added to the first chunk's rows", "masks",
           "cp_attention/strategies/select.py", "dpool_RKE.index_add_(0, rows_N[ctx.bounds[a]:ctx.bounds[b]],",
           "dpool_RKE.index_add_(0, rows_N[:ctx.bounds[b] - ctx.bounds[a]],",
           ("tests/multirank/test_selection.py::test_selection_runs_in_chunks_of_queries",)),
    Mutant("DSA indexer under CP: its mask rows causal over the whole row (documents and padding ignored)", "masks",
           "cp_attention/integrations/hf/adapters/indexers.py", "return visible_rows(batch.meta, causal, q_index).to(device)",
           "return visible_rows(type(batch.meta)(batch.meta.batch, batch.meta.seq_len), causal, q_index).to(device)",
           ("tests/integrations/test_index_sparse.py::test_dsa_padded_rows_cp2", _SPARSE_CP)),
    Mutant("DeepSeek-V4: compressed windows anchored at the row's first slot, not at documents", "masks",
           "cp_attention/integrations/hf/adapters/compressed.py", "for s, e in _documents(meta, b):", "for s, e in [(0, T)]:",
           (_SPARSE_CP,)),
    Mutant("DeepSeek-V4: the gathered rows' gradient not summed over the ranks", "masks",
           "cp_attention/integrations/hf/adapters/compressed.py",
           'total = cp.comm.all_reduce(grad_BT.contiguous(), "the compressed layer\'s rows (backward)")',
           "total = grad_BT", (_SPARSE_CP,)),
    Mutant("MLA: the latent taken before its normalisation's scale", "latent",
           "cp_attention/integrations/hf/adapters/latent.py",
           "latent_BLR = torch.cat([nope[:, 0], rot[:, 0].to(nope.dtype)], dim=-1)",
           "latent_BLR = torch.cat([nope[:, 0] / call.module.kv_a_layernorm.weight, rot[:, 0].to(nope.dtype)], dim=-1)",
           (_LATENT_CP2,)),
    Mutant("MLA: RoPE at each rank's local positions", "latent", "cp_attention/engine/context.py",
           'out["position_ids"] = self.shard(position_ids, layout=layout).contiguous()',
           'out["position_ids"] = torch.arange(self.shard(position_ids, layout=layout).shape[1]).expand(B, -1)'
           '.contiguous()', (_LATENT_CP2,)),
    Mutant("MLA: the latent rows' gradient not returned to their owner", "latent", "cp_attention/strategies/latent.py",
           "            d_BLR[:, a:b] += gbuf[:, at:at + b - a]", "            pass", (_LATENT_CP2,)),
    Mutant("MLA: the up-projection's weight gradient counted twice", "latent", "cp_attention/strategies/latent.py",
           "self.dparams[i] = g if self.dparams[i] is None else self.dparams[i] + g",
           "self.dparams[i] = 2 * g if self.dparams[i] is None else self.dparams[i] + 2 * g", (_LATENT_CP2,)),
    Mutant("MLA: every layer's heads moved (the latent never chosen)", "latent", "cp_attention/strategies/latent.py",
           '    if latent_dim >= heads:\n        return "heads", (f"the latent ({latent_dim} numbers a token) is no '
           'smaller than the K/V heads "\n',
           '    if True:\n        return "heads", (f"the latent ({latent_dim} numbers a token) is no '
           'smaller than the K/V heads "\n', (_LATENT_CP2,)),
    Mutant("MLA: DeepSeek-V3.2's selected keys fetched as heads while counted as latent rows", "latent",
           "cp_attention/strategies/select.py",
           "fetched_NKE = _fetch_latent(latent, send_rows, [w.numel() for w in wanted], comm, K, D + Dv)",
           "fetched_NKE = _Fetch.apply(kv_RKE, send_rows, [w.numel() for w in wanted], comm)", (_LATENT_CP2,)),
    Mutant("MLA under head parallelism: a latent row's gradient from its owner's own heads only", "latent",
           "cp_attention/strategies/ulysses.py",
           "dlatent = torch.stack([p.to(acc) for p in dlatent_parts]).sum(0)",
           "dlatent = dlatent_parts[ex.comm.rank].to(acc)",
           ("tests/integrations/test_latent.py::test_head_parallelism_gathers_the_latent_once",)),
    Mutant("MLA: a declined expansion (LoRA dropout in training) used on the latent anyway", "latent",
           "cp_attention/engine/attend.py", "    if latent.declined is not None:\n", "    if False:\n",
           ("tests/integrations/test_latent.py::test_lora_and_checkpointing_exact_at_cp2",)),
    Mutant("extra keys: their gradient dropped", "masks", "cp_attention/strategies/select.py",
           "pool_RKE = torch.cat([pool_RKE, torch.cat(extra_kv, dim=-1).reshape(B * E, K, D + Dv)])",
           "pool_RKE = torch.cat([pool_RKE, torch.cat(extra_kv, dim=-1).reshape(B * E, K, D + Dv).detach()])",
           ("tests/multirank/test_selection.py::test_extra_keys_every_rank_holds",)),
    Mutant("positions rule: a model of mixers alone refused for positions it does not read", "models",
           "cp_attention/integrations/hf/check.py",
           'if "position_ids" not in forward_args and uses_positions(model):', 'if "position_ids" not in forward_args:',
           ("tests/integrations/test_model_check.py",)),
    Mutant("positions rule: a positional module not seen", "models", "cp_attention/integrations/hf/positions.py",
           "    if positional_modules(model):\n        return True", "    if False:\n        return True",
           ("tests/integrations/test_model_check.py",)),
    Mutant("lightning attention: a piece's transition one step short", "mixers",
           "cp_attention/integrations/hf/recurrences.py",
           "torch.exp(self.log_decay.to(torch.promote_types(self.dtype, torch.float32)) * n)",
           "torch.exp(self.log_decay.to(torch.promote_types(self.dtype, torch.float32)) * (n - 1))",
           ("tests/integrations/test_class_mixers.py",)),
    Mutant("lightning attention: the blocks' decay across a block boundary dropped", "mixers",
           "cp_attention/integrations/hf/recurrences.py",
           "S = S * torch.exp(ld * b)[None, :, None, None] +", "S = S +",
           ("tests/integrations/test_class_mixers.py",)),
    Mutant("RG-LRU: a piece's transition is its last gate, not their product", "mixers",
           "cp_attention/integrations/hf/recurrences.py", 'return (a["recurrent_gate"].float() * ~a["reset"]).prod(1)',
           'return (a["recurrent_gate"].float() * ~a["reset"])[:, -1]', ("tests/integrations/test_class_mixers.py",)),
    Mutant("Zaya: a document's first delayed value zero, not the projection of zeros", "mixers",
           "cp_attention/integrations/hf/adapters/mixer_classes.py",
           "start = self.v_proj_delayed(h.new_zeros(1, 1, h.shape[-1]))[0, 0]",
           "start = self.v_proj_delayed(h.new_zeros(1, 1, h.shape[-1]))[0, 0] * 0",
           ("tests/integrations/test_class_mixers.py",)),
    Mutant("RWKV: the channel mixing's token shift within the shard", "mixers",
           "cp_attention/integrations/hf/adapters/mixer_classes.py",
           "shifted = _previous(record, hidden, record.cp.comm)", "shifted = self.time_shift(hidden)",
           ("tests/integrations/test_class_mixers.py",)),
    Mutant("RWKV: a piece's decay one step short", "mixers", "cp_attention/integrations/hf/recurrences.py",
           "torch.exp(-torch.exp(self.time_decay.double()) * n)",
           "torch.exp(-torch.exp(self.time_decay.double()) * (n - 1))",
           ("tests/integrations/test_class_mixers.py",)),
    Mutant("xLSTM: the stabiliser composed as a linear state, not max-plus", "mixers",
           "cp_attention/integrations/hf/recurrences.py", "m = torch.maximum(G + S[..., -1, 0], M) - m_F",
           "m = G + S[..., -1, 0] - m_F", ("tests/integrations/test_class_mixers.py",)),
    Mutant("lightning attention: a cache's state ignored under CP (decoding from zero)", "cache",
           "cp_attention/integrations/hf/adapters/mixer_classes.py",
           "if cache is not None and cache.get_linear_cache(self.layer_idx) is not None:", "if False:",
           ("tests/integrations/test_class_mixers.py::test_a_state_from_earlier_tokens_is_refused_under_context_"
            "parallelism",)),
    Mutant("RWKV: the WKV through the CUDA kernel's entry (its backward ignores the state)", "mixers",
           "cp_attention/integrations/hf/adapters/mixer_classes.py", "adapter = Wkv(mod.rwkv_linear_attention_cpu,",
           "adapter = Wkv(mod.rwkv_linear_attention,",
           ("tests/integrations/test_class_mixers.py::test_rwkv_runs_its_torch_path_under_context_parallelism",)),
    Mutant("RG-LRU: resets where the caller's positions are 0, not at the batch's documents", "mixers",
           "cp_attention/integrations/hf/adapters/mixer_classes.py", "x_branch = self.rg_lru(x_branch.transpose(1, 2), positions)",
           'x_branch = self.rg_lru(x_branch.transpose(1, 2), bound["position_ids"])',
           ("tests/integrations/test_class_mixers.py::test_rglru_resets_at_the_batchs_documents_whatever_positions_"
            "it_is_given",)),
    Mutant("RG-LRU: a cache's earlier state dropped under CP", "cache", "cp_attention/integrations/hf/adapters/mixer_classes.py",
           "if use_cache and live is not None and bool(live.ne(0).any()):", "if False:",
           ("tests/integrations/test_class_mixers.py::test_rglru_resets_at_the_batchs_documents_whatever_positions_"
            "it_is_given",)),
    Mutant("class mixers: a subclass overriding the adapted method counted as adapted", "models",
           "cp_attention/integrations/hf/mixing.py",
           "return isinstance(name, str) and bool(getattr(getattr(cls, name, None), CLASS_MIXER_ATTR, False))",
           "return bool(name)",
           ("tests/integrations/test_class_mixers.py::test_a_subclass_overriding_the_adapted_method_is_not_adapted",)),
    Mutant("KDA: a piece's transition from the per-head mean of its per-channel decay", "mixers",
           "cp_attention/integrations/hf/function_admission.py",
           'return self._call(a, a["value"].new_zeros(N, n, Hv, Dk), eye)[1]',
           'return self._call(dict(a, g=a["g"].mean(-1, keepdim=True).expand_as(a["g"])) if a["g"].dim() == 4 '
           'else a, a["value"].new_zeros(N, n, Hv, Dk), eye)[1]',
           ("tests/integrations/test_mixers.py",)),
    Mutant("compiled under CP: the backward op runs the forward's passes", "compile", "cp_attention/engine/layer.py",
           "passes(dout, out, lse, need_dsinks))", "passes()) + (None, None)",
           ("tests/integrations/test_compile.py::test_compiled_under_context_parallelism_is_exact",)),
    Mutant("generate: one rank's partial left out of the decode step's merge", "cache",
           "cp_attention/engine/decode.py", "for other, other_lse in parts[1:]:",
           "for other, other_lse in parts[1:-1]:", (_DECODE, _GENERATE)),
    Mutant("generate: a sliding window's first visible key read one position late (its owner dropped it)",
           "cache", "cp_attention/integrations/hf/generation.py", "start = max(start, query - self.window + 1)",
           "start = max(start, query - self.window + 2)", (_SHARDED_CACHE, _GENERATE)),
    Mutant("generate: a decoded token's K/V stored on every rank, not its owner's alone", "cache",
           "cp_attention/integrations/hf/generation.py",
           "keep = decode_owner(new, self.world_size, self.block) == self.rank",
           "keep = decode_owner(new, self.world_size, self.block) >= 0", (_SHARDED_CACHE, _GENERATE)),
    Mutant("generate: the mixers' states after the prefill not handed over (each rank keeps its own)", "cache",
           "cp_attention/integrations/hf/generation.py", "return everyone[state.last_owner] if kind",
           "return everyone[state.cp.rank] if kind", (_GENERATE,)),
    Mutant("generate: crop keeps the first rejected candidate's keys", "cache",
           "cp_attention/integrations/hf/generation.py",
           "self._keep(0, int(torch.searchsorted(self.positions, end)))",
           "self._keep(0, int(torch.searchsorted(self.positions, end, right=True)))", (_SHARDED_CACHE, _GENERATE)),
    Mutant("generate: the ranks' tokens not compared (a rank-dependent logits processor goes on)", "cache",
           "cp_attention/integrations/hf/generation.py",
           "if any(not torch.equal(other, everyone[0]) for other in everyone):", "if False:", (_GENERATE,)),
    Mutant("generate: the prompt's cached keys at the next rank's positions", "cache",
           "cp_attention/integrations/hf/generation.py",
           "positions = ranks_positions[cp.rank]",
           "positions = ranks_positions[(cp.rank + 1) % cp.world_size]",
           (_GENERATE,)),
    Mutant("generate: the decode step's backend chosen for the visible pairs only (softcap dropped)", "cache",
           "cp_attention/engine/decode.py", "head_dim=q.shape[3], spec=spec,", "head_dim=q.shape[3], spec=plan_spec,",
           (_DECODE,)),
    Mutant("generate: a decode step's plan reused for a layer whose keys lie elsewhere", "cache",
           "cp_attention/engine/decode.py", "if known is not None and torch.equal(known[0], k_pos):",
           "if known is not None:", (_DECODE,)),
    Mutant("generate: a left-padded row's chunks counted from position 0 (keys it still sees dropped)", "cache",
           "cp_attention/integrations/hf/generation.py", "for f in self.row_starts))", "for f in (0,)))",
           (_GENERATE,)),
    Mutant("generate: a convolution's state taken whole from the last token's owner (short prompts)", "cache",
           "cp_attention/integrations/hf/generation.py",
           'return everyone[state.last_owner] if kind != "conv" else _sequence_tail(state, everyone)',
           "return everyone[state.last_owner]", (_GENERATE,)),
    Mutant("generate: RecurrentGemma's RG-LRU state kept on its module not handed over", "cache",
           "cp_attention/integrations/hf/adapters/mixer_classes.py", '        hand_over(self.rg_lru, "recurrent_states", "state")\n',
           "", (_GENERATE,)),
    Mutant("generate: a layer sharing another's K/V read as the layer updated last", "cache",
           "cp_attention/integrations/hf/generation.py",
           "if cached is not None and (layer is None or layer.keys is not cached):", "if False:", (_GENERATE,)),
    Mutant("generate: the ranks' random states left as they are (different seeds sample apart)", "cache",
           "cp_attention/integrations/hf/generation.py", "    _same_random_state(cp)\n    N = int", "    N = int",
           (_GENERATE,)),
    Mutant("generate: crop keeps what the next query no longer sees (windowed caches grow)", "cache",
           "cp_attention/integrations/hf/generation.py",
           "        self._drop_before(self._visible_from(end))  # the next query is at ``end``\n", "",
           (_GENERATE,)),
    # issue 52: adapters admit foreign functions by behaviour
    Mutant("admission: a mixer function that fails its check wrapped anyway", "models",
           "cp_attention/integrations/hf/mixing.py", "            if reason is not None:\n",
           "            if False:\n", (_ADMISSION,)),
    Mutant("admission: the convolution's behaviour never compared", "models",
           "cp_attention/integrations/hf/function_admission.py", "        if not torch.allclose(got.double(), want, **_TOL):",
           "        if False:", (_ADMISSION,)),
    Mutant("admission: a recurrence's two-piece composition never compared", "models",
           "cp_attention/integrations/hf/function_admission.py",
           "    if not agrees(torch.cat([out1, out2], dim=adapter.out_dim), whole_out):",
           "    if False:", (_ADMISSION,)),
    Mutant("admission: a declined function's family not refused under CP", "models",
           "cp_attention/integrations/hf/mixing.py",
           "        for function, why in sorted(declined(module_name).items()):",
           "        for function, why in ():", (_ADMISSION,)),
    Mutant("admission: a step function bypassing the adapted functions runs under CP", "mixers",
           "cp_attention/integrations/hf/adapters/step_functions.py", "        if delegated() == before and batch_for_any() is not None:",
           "        if False:", (_ADMISSION,)),
    Mutant("admission: calls bound by the function object's signature (5.25's (*args, **kwargs))", "mixers",
           "cp_attention/integrations/hf/function_admission.py", "    bound = CONVENTIONS[name].bind(*args, **kwargs)",
           "    bound = CONVENTIONS[name].bind(*args, **kwargs) if False else __import__('inspect').signature("
           "lambda *args, **kwargs: None).bind(*args, **kwargs)", (_ADMISSION,)),
    Mutant("admission: a mixer class's path never compared with the class itself", "mixers",
           "cp_attention/integrations/hf/class_admission.py",
           "(isinstance(a, torch.Tensor) and not agrees(a, b)):", "(isinstance(a, torch.Tensor) and False):",
           (_CLASS_ADMISSION,)),
    Mutant("admission: a mixer class's recurrence from a state never composed over two pieces", "mixers",
           "cp_attention/integrations/hf/class_admission.py", "            if check.composition is not None:",
           "            if False:", (_CLASS_ADMISSION,)),
    Mutant("admission: a declined class runs under CP", "mixers",
           "cp_attention/integrations/hf/class_admission.py",
           "    if why is not None:\n        raise refuse(\"adapted_class_declined\"",
           "    if False:\n        raise refuse(\"adapted_class_declined\"", (_CLASS_ADMISSION,)),
    Mutant("admission: an indexer's rank selection never compared with eager's", "models",
           "cp_attention/integrations/hf/adapters/indexers.py", "        if not same:\n", "        if False:\n",
           (_INDEXER_ADMISSION,)),
    Mutant("admission: a compressor's conventions never checked", "models",
           "cp_attention/integrations/hf/adapters/compressed.py",
           "lambda: _compressor_reason(original, self, bound))", "lambda: None)", (_COMPRESSOR_ADMISSION,)),
    Mutant("admission: a rope computed otherwise hooked and not refused", "models",
           "cp_attention/integrations/hf/adapters/rope.py", "    _VERDICTS[module] = verdict\n    return verdict",
           "    _VERDICTS[module] = None\n    return None", (_ROPE_ADMISSION,)),
    Mutant("admission: a router loss refused without the transformers version", "heads",
           "cp_attention/refusals_training.py", "{name} (transformers {version}) cannot", "{name} cannot",
           (_ROUTER_DECLINED,)),
    # issue 53: verification at first use
    Mutant("verification: a rank whose memo says verified skips the test the others run", "models",
           "cp_attention/integrations/hf/verification.py", "        if any(int(f) for f in flags):",
           "        if not known:", (_VERIFICATION,)),
    Mutant("verification: a tolerance that lets a leak through", "models",
           "cp_attention/integrations/hf/verification.py", "TOLERANCES = types.MappingProxyType({torch.float64: 1e-6, torch.float32: 1e-3})",
           "TOLERANCES = types.MappingProxyType({torch.float64: 1.0, torch.float32: 1.0})", (_VERIFICATION,)),
    Mutant("verification: off by default", "models",
           "cp_attention/engine/context.py", "cost_model: CostModel | None = None, verify: bool = True):",
           "cost_model: CostModel | None = None, verify: bool = False):", (_VERIFICATION,)),
    Mutant("trace: token mixing found and dropped", "models",
           "cp_attention/integrations/hf/token_trace.py",
           "    if logits_a is None or logits_b is None or not _differs(logits_a, logits_b, t, tol):",
           "    if True:", (_VERIFICATION,)),
    Mutant("trace: the adapted mixers' own mixing read as the model's", "models",
           "cp_attention/integrations/hf/mixing.py",
           "                return stand_in_output(original(*args, **kwargs), (args, kwargs))",
           "                return original(*args, **kwargs)", (_VERIFICATION,)),
    Mutant("trace: the attention interface answers with real attention", "models",
           "cp_attention/integrations/hf/attention.py",
           "    if tracing():  # the model check's trace: what cp_flash refuses in the call, else it answers per token",
           "    if False:", (_VERIFICATION,)),
    Mutant("trace: fingerprints compared over every token, the changed one included", "models",
           "cp_attention/integrations/hf/token_trace.py", "        keep[t] = False\n", "", (_VERIFICATION,)),
    Mutant("trace: the adapted mixers answer zeros (the model's own code after them unread)", "models",
           "cp_attention/integrations/hf/token_trace.py", "        if per_token is None or n not in t.shape:",
           "        if True:", ("tests/integrations/test_model_check.py::test_operations_around_an_adapted_mixer_are_read",)),
    Mutant("trace: a forward cp_flash refuses passes the model check", "models",
           "cp_attention/integrations/hf/token_trace.py", '            if getattr(exc, "refusal", None) is not None:',
           "            if False:", ("tests/integrations/test_model_check.py::test_refused_families_are_found",)),
    Mutant("trace: cp_flash's refusals of a call's keywords skipped under the trace", "models",
           "cp_attention/integrations/hf/attention.py",
           "        _refuse_score_tensors(kwargs, query.shape[2], key.shape[2],\n"
           "                              attention_mask if isinstance(attention_mask, CPMask) else None)\n", "",
           ("tests/integrations/test_model_check.py::test_refused_families_are_found",)),
    Mutant("model check: generate's prefill refused for what the trace met on the plain forward", "models",
           "cp_attention/integrations/hf/check.py",
           "    if not plain:\n        findings = tuple(f for f in findings if f.what != TRACE_REFUSED)\n", "",
           ("tests/multirank/test_generate.py::test_mixer_states_and_shared_kv_generate_equal_one_device",)),
    Mutant("verification: cp_attention's own errors in the test reported as the model's", "models",
           "cp_attention/integrations/hf/verification.py", "            if _from_the_library(exc):",
           '            if getattr(exc, "refusal", None) is not None:',
           ("tests/multirank/test_collectives.py::test_models_that_differ_between_ranks_raise_on_every_rank",)),
    Mutant("verification: a test batch the model cannot run lets the model through", "models",
           "cp_attention/integrations/hf/verification.py", "        if any(int(f) for f in failures):",
           "        if False:", ("tests/integrations/test_verification.py::"
                                "test_a_model_the_test_batch_cannot_run_is_refused_with_the_way_out",)),
    Mutant("verification: packed rows compared only with each document alone", "models",
           "cp_attention/integrations/hf/verification.py", "    if row_err > tol:\n", "    if False:\n",
           (_VERIFICATION,)),
)


def _copy_repo(dest: str) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for rel in files:
        src = os.path.join(ROOT, rel)
        if not os.path.isfile(src) or rel.startswith("benchmarks/results/"):
            continue
        os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
        shutil.copy2(src, os.path.join(dest, rel))


def check_applies(m: Mutant, root: str = ROOT) -> str:
    """The mutated source of ``m.path`` (raises if ``m.old`` is not there exactly once)."""
    with open(os.path.join(root, m.path)) as f:
        source = f.read()
    count = source.count(m.old)
    if count != 1:
        raise ValueError(f"mutant {m.name!r}: its source text occurs {count} times in {m.path}, expected once")
    mutated = source.replace(m.old, m.new)
    compile(mutated, m.path, "exec")
    return mutated


def run_mutant(m: Mutant, timeout: float = 1800) -> tuple[bool, str, float]:
    """(caught, first failing test or the reason it survived, seconds)."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="cp_attention_mutant_") as tmp:
        _copy_repo(tmp)
        mutated = check_applies(m, tmp)
        with open(os.path.join(tmp, m.path), "w") as f:
            f.write(mutated)
        env = dict(os.environ, PYTHONPATH=tmp, OMP_NUM_THREADS="1")
        env.pop("CP_ATTENTION_NO_SKIPS", None)
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", MARKS, *m.tests]
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, flags=re.M)
    caught = proc.returncode != 0 and bool(failed)
    detail = failed[0] if failed else (proc.stdout.strip().splitlines() or ["no output"])[-1]
    return caught, detail, time.monotonic() - start


def read_record(path: str) -> dict:
    """The record of the mutants' last runs: {"results": [{"name", "caught", "detail", ...}]}."""
    with open(path) as f:
        return json.load(f)


def page(record: dict, data: str = RECORD, page_path: str = PAGE) -> str:
    """The mutation check's page: :data:`MUTANTS` in order, each with its outcome in ``record``."""
    last = {r["name"]: r for r in record["results"]}
    run = [last[m.name] for m in MUTANTS if last.get(m.name, {}).get("caught") is not None]
    caught = sum(bool(r["caught"]) for r in run)
    rows = ["| planted bug | area | first failing test of the default suite |", "|---|---|---|"]
    for m in MUTANTS:
        r = last.get(m.name, {})
        if r.get("caught") is None:
            outcome = f"not run yet (meant for {', '.join(m.tests)})"
        else:
            outcome = r["detail"] if r["caught"] else f"SURVIVED: {r['detail']}"
        rows.append(f"| {m.name} | {m.area} | {outcome.replace('|', '/')} |")
    not_run = len(MUTANTS) - len(run)
    text = [
        f"Generated by `python tests/mutations.py --page {page_path}` from the record `{data}`; "
        "do not edit by hand.", "",
        "# Mutation check", "",
        "`python tests/mutations.py` plants each bug below in a temporary copy of the repository and runs the test "
        "files of the default CI suite meant to catch it; it exits 1 if one survives. "
        f"`python tests/mutations.py --record {data}` runs them and records the outcomes, which this page shows. "
        "`tests/meta/test_mutations.py` keeps every planted bug's source text present in the code, so the list "
        "cannot silently rot.", "",
        f"Recorded: {caught} of {len(run)} mutants caught" + (f"; {not_run} not run yet." if not_run else "."), "",
        *rows,
    ]
    return "\n".join(text) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Plant bugs in a copy of the repository; the CI suite must catch "
                                                 "every one.")
    parser.add_argument("--only", default=None, help="run the mutants whose name contains this text")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--record", default="", help=f"record the outcomes in this JSON file (the page's: {RECORD})")
    parser.add_argument("--page", default="", help=f"run nothing: render the page ({PAGE}) from the record "
                                                   f"(--record, else {RECORD})")
    args = parser.parse_args(argv)
    mutants = [m for m in MUTANTS if args.only is None or args.only in m.name]
    if args.list:
        for m in mutants:
            print(f"{m.area:10s} {m.name}  ({m.path}; {', '.join(m.tests)})")
        return 0
    if args.page:
        data = args.record or RECORD
        text = page(read_record(os.path.join(ROOT, data)), data, args.page)
        with open(os.path.join(ROOT, args.page), "w") as f:
            f.write(text)
        return 0
    print("| mutant | area | caught by | seconds |\n|---|---|---|---:|", flush=True)
    survived, outcomes = 0, {}
    for m in mutants:
        caught, detail, seconds = run_mutant(m)
        survived += not caught
        outcomes[m.name] = dict(name=m.name, caught=caught, detail=detail, seconds=round(seconds))
        print(f"| {m.name} | {m.area} | {detail if caught else 'SURVIVED: ' + detail} | {seconds:.0f} |", flush=True)
    print(f"\n{len(mutants) - survived} of {len(mutants)} mutants caught")
    if args.record:
        path = os.path.join(ROOT, args.record)
        old = {r["name"]: r for r in read_record(path)["results"]} if os.path.exists(path) else {}
        results = [outcomes.get(m.name) or old.get(m.name) or dict(name=m.name, caught=None, detail=None)
                   for m in MUTANTS]
        with open(path, "w") as f:
            json.dump(dict(results=results), f, indent=1)
            f.write("\n")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
