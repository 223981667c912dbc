"""The probe: does context parallelism keep a model's masks? Perturb token 0 and see who notices.

Spawns N gloo ranks on CPU, builds a tiny random model of one family (``tiny_models``), replaces
the token at position 0 by another token and counts the output positions whose logits change, on
one device and under context parallelism (``attn_implementation="cp_flash"``), for three cases:

* ``sliding``: every layer local (sliding window of ``--window`` tokens; chunks of ``--window``
  for Llama 4, whose local layers are chunked), one document. Qwen3, 2 layers, window 64, 512
  tokens: position 0 reaches 2 * 63 + 1 = 127 tokens, 24.8%.
* ``packed``: two packed documents (``position_ids`` restart at ``L // 2``), the family's own mix
  of layer types; only the first document may see position 0 (50.0% for Qwen3).
* ``own mix``: the family's own mix of layer types (its default tiny config), one document.

The single-device reference is the same weights under ``attn_implementation="eager"`` with each
packed document run alone (transformers' packed eager is not trusted: gpt-oss does not pass
``position_ids`` to its mask builder). The "plain causal CP" column shows what the common CP path
computes: the same ranks and global RoPE positions, but every layer's mask replaced by the plain
causal (bidirectional for encoders) mask, so windows, chunks and documents are dropped.

A position "changes" when one of its logits moves by more than ``CHANGED`` (1e-6; float32 noise
is ~1e-7). Exits 1 if, in any case, CP and single device disagree on which positions change (beyond
positions whose changes differ by at most ``CHANGED``: an influence at the noise floor may round
either way), if their logits differ by more than ``--tol``, or if a rank fails.

    python -m cp_attention probe [--model qwen3] [--nproc 2] [--seq-len 512] [--layout zigzag]
    cp-attention probe [options]

Test-only: ``CP_ATTENTION_PROBE_BREAK_MASK=1`` (or the hidden ``--break-mask``) runs the CP column
with the plain causal mask, which the probe must then report as a failure.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import torch

import cp_attention
from cp_attention.integrations.hf.models import layer_masks
from cp_attention.tools.launch import run_ranks
from cp_attention.tools.tiny_models import FAMILIES, is_causal_lm, tiny_config, tiny_model

__all__ = ["CaseResult", "run_probe", "format_table", "main", "BREAK_MASK_ENV", "TOLERANCE", "CHANGED"]

TOLERANCE = 1e-4
CHANGED = 1e-6  # a position "changes" when some logit moves by more than this (float32 noise is ~1e-7)
BREAK_MASK_ENV = "CP_ATTENTION_PROBE_BREAK_MASK"
PLAIN_CAUSAL = "cp_probe_plain_causal"  # the "plain causal CP" emulation, registered in the ranks
CASES = ("sliding", "packed", "own mix")


@dataclass(frozen=True)
class CaseResult:
    """One row of the probe's table.

    ``*_changed``: positions (of ``seq_len``) whose logits change by more than :data:`CHANGED` when
    token 0 is replaced. ``mismatched``: positions that change under CP but not on one device, or
    the reverse; ``noise_positions``: those of them whose changes differ by at most :data:`CHANGED`
    (an influence at the float32 noise floor, which another summation order may round either way;
    not a mask error). ``max_diff``: max |logit CP - logit single device| over both inputs."""

    case: str
    description: str
    seq_len: int
    single_changed: int
    cp_changed: int
    plain_changed: int
    mismatched: int
    noise_positions: int
    max_diff: float
    tolerance: float

    @property
    def single_share(self) -> float:
        return self.single_changed / self.seq_len

    @property
    def cp_share(self) -> float:
        return self.cp_changed / self.seq_len

    @property
    def plain_share(self) -> float:
        return self.plain_changed / self.seq_len

    @property
    def same_positions(self) -> bool:
        return self.mismatched == 0

    @property
    def ok(self) -> bool:
        return self.mismatched == self.noise_positions and self.max_diff <= self.tolerance

    @property
    def verdict(self) -> str:
        if self.mismatched > self.noise_positions:
            return "FAIL: positions differ"
        if self.max_diff > self.tolerance:
            return "FAIL: logits differ"
        return "OK" if self.same_positions else f"OK ({self.noise_positions} at the noise floor)"


# ----------------------------------------------------------------------------------------------
# inside a rank


def _register_plain_causal() -> None:
    """Register PLAIN_CAUSAL: "cp_flash" with each layer's window and chunk dropped (documents are
    dropped by not giving position_ids to shard_batch). Only in the probe's rank processes."""
    from transformers import AttentionInterface, AttentionMaskInterface

    from cp_attention.integrations.hf.attention import cp_flash_attention
    from cp_attention.integrations.hf.masks import cp_flash_mask

    class _NoChunk:  # the layer as cp_flash sees it, minus the layer index that selects chunking
        def __init__(self, module):
            self._module = module

        def __getattr__(self, name):
            return None if name == "layer_idx" else getattr(self._module, name)

    def plain_causal_attention(module, query, key, value, attention_mask, **kwargs):
        kwargs["sliding_window"] = None
        kwargs.pop("position_ids", None)  # the true positions (for RoPE only): documents stay dropped
        return cp_flash_attention(_NoChunk(module), query, key, value, attention_mask, **kwargs)

    def plain_causal_mask(**kwargs):
        kwargs.pop("local_size", None)  # the window a sliding mask would hand its layers: dropped too
        return cp_flash_mask(**kwargs)

    AttentionInterface.register(PLAIN_CAUSAL, plain_causal_attention)
    AttentionMaskInterface.register(PLAIN_CAUSAL, plain_causal_mask)


def _case_setup(family: str, case: str, seq_len: int, window: int):
    """(config, position_ids (1, L), document lengths) of one case."""
    cfg = tiny_config(family, window=window, chunk=window)
    docs = [seq_len]
    if case == "sliding":
        local = "chunked_attention" if family == "llama4" else "sliding_attention"
        if getattr(cfg, "layer_types", None) is not None:
            cfg.layer_types = [local] * len(cfg.layer_types)
        elif getattr(cfg, "sliding_window", None) is None:  # phi3: a window on every layer
            cfg.sliding_window = window
    elif case == "packed":
        docs = [seq_len // 2, seq_len - seq_len // 2]
    position_ids = torch.cat([torch.arange(n) for n in docs]).unsqueeze(0)
    return cfg, position_ids, docs


def _describe(family: str, case: str, window: int, docs) -> str:
    if case == "sliding":
        kind = f"chunks of {window}" if family == "llama4" else f"window {window}"
        return f"every layer local ({kind})"
    cfg = tiny_config(family, window=window, chunk=window)
    mix = "".join("S" if m.window else "C" if m.chunk_size else "F" for m in layer_masks(cfg))
    text = f"own mix {mix}"
    if case == "packed":
        text += f", documents {'+'.join(map(str, docs))}"
    return text


def _inputs(seq_len: int, vocab: int) -> torch.Tensor:
    """(2, L) token ids: a random sequence and the same with token 0 replaced."""
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(3, vocab, (1, seq_len), generator=gen).repeat(2, 1)
    ids[1, 0] = 3 + (ids[0, 0] - 3 + 1) % (vocab - 3)
    return ids


def _change(logits_2LV: torch.Tensor) -> torch.Tensor:
    """(L,) how much each position's logits move between the two inputs (max over the vocabulary)."""
    return (logits_2LV[1] - logits_2LV[0]).abs().amax(-1)


def _rank_main(rank, world_size, family, seq_len, window, layout, break_mask):
    torch.set_num_threads(1)
    _register_plain_causal()
    kw = dict(use_cache=False) if is_causal_lm(family) else {}
    rows = []
    with torch.no_grad():
        for case in CASES:
            cfg, pos, docs = _case_setup(family, case, seq_len, window)
            ours = tiny_model(family, "cp_flash", config=cfg)
            plain = tiny_model(family, PLAIN_CAUSAL, config=cfg)
            plain.load_state_dict(ours.state_dict())
            ids = _inputs(seq_len, cfg.vocab_size)
            pos2 = pos.expand(2, -1)
            with cp_attention.context_parallel(layout=layout) as cp:
                # plain causal CP: no documents recorded, windows/chunks dropped, true RoPE positions
                batch = cp.shard_batch(input_ids=ids)
                batch["position_ids"] = cp.shard(pos2).contiguous()
                plain_logits = cp.gather(plain(**batch, **kw).logits, dim=1)
                if break_mask:
                    cp_logits = plain_logits
                else:
                    batch = cp.shard_batch(input_ids=ids, position_ids=pos2)
                    cp_logits = cp.gather(ours(**batch, **kw).logits, dim=1)
            if rank != 0:
                continue
            eager = tiny_model(family, "eager", config=cfg)
            eager.load_state_dict(ours.state_dict())
            parts, start = [], 0
            for n in docs:  # each document alone: the ground truth
                doc_pos = torch.arange(n).expand(2, n)
                parts.append(eager(input_ids=ids[:, start:start + n], position_ids=doc_pos, **kw).logits)
                start += n
            single_logits = torch.cat(parts, dim=1)
            single, ours_d, plain_d = _change(single_logits), _change(cp_logits), _change(plain_logits)
            differ = (single > CHANGED) != (ours_d > CHANGED)
            rows.append(CaseResult(
                case=case, description=_describe(family, case, window, docs), seq_len=seq_len,
                single_changed=int((single > CHANGED).sum()), cp_changed=int((ours_d > CHANGED).sum()),
                plain_changed=int((plain_d > CHANGED).sum()), mismatched=int(differ.sum()),
                noise_positions=int((differ & ((single - ours_d).abs() <= CHANGED)).sum()),
                max_diff=float((cp_logits - single_logits).abs().max()), tolerance=TOLERANCE))
    return rows


# ----------------------------------------------------------------------------------------------
# the parent


def run_probe(*, model: str = "qwen3", nproc: int = 2, seq_len: int = 512, layout: str = "zigzag",
              window: int = 64, tol: float = TOLERANCE, break_mask: bool = False,
              timeout: float = 600.0) -> list[CaseResult]:
    """Run the probe on ``nproc`` spawned gloo ranks; one :class:`CaseResult` per case."""
    if model not in FAMILIES:
        raise ValueError(f"model must be one of {FAMILIES}, got {model!r}")
    cp_attention.layout.check_layout(layout)
    if nproc < 1 or seq_len < 2 * nproc or window < 2:
        raise ValueError(f"need nproc >= 1, seq_len >= 2 * nproc and window >= 2 "
                         f"(got nproc={nproc}, seq_len={seq_len}, window={window})")
    rows = run_ranks(nproc, _rank_main, model, seq_len, window, layout, break_mask, timeout=timeout)[0]
    return [CaseResult(**{**r.__dict__, "tolerance": tol}) for r in rows]


def format_table(rows: list[CaseResult]) -> str:
    head = ("case", "masks", "single device", "CP", "max |CP - single|", "plain causal CP", "verdict")
    body = [(r.case, r.description, f"{100 * r.single_share:.1f}% ({r.single_changed})",
             f"{100 * r.cp_share:.1f}% ({r.cp_changed})", f"{r.max_diff:.1e}",
             f"{100 * r.plain_share:.1f}% ({r.plain_changed})",
             r.verdict)
            for r in rows]
    widths = [max(len(x[i]) for x in (head, *body)) for i in range(len(head))]
    lines = ["  ".join(x.ljust(w) for x, w in zip(row, widths)).rstrip() for row in (head, *body)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


MAX_SEQ_LEN = 4096  # max_position_embeddings of every tiny_config


def parse_args(argv=None, *, prog: str = "python -m cp_attention probe") -> argparse.Namespace:
    """The probe's options; a bad value exits 2 with a one-line ``parser.error`` message."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3", choices=FAMILIES, metavar="FAMILY",
                        help=f"tiny random model family, one of {', '.join(FAMILIES)} (default qwen3)")
    parser.add_argument("--nproc", type=int, default=2, help="number of gloo ranks spawned on CPU (default 2)")
    parser.add_argument("--seq-len", type=int, default=512,
                        help=f"tokens per sequence, from 2 * nproc to {MAX_SEQ_LEN} (default 512)")
    parser.add_argument("--window", type=int, default=64,
                        help="sliding window / chunk size in tokens, at least 2 (default 64)")
    parser.add_argument("--layout", default="zigzag", choices=cp_attention.layout.LAYOUTS,
                        help=f"how tokens are sharded over ranks: {' or '.join(cp_attention.layout.LAYOUTS)} "
                             "(default zigzag)")
    parser.add_argument("--tol", type=float, default=TOLERANCE,
                        help=f"max |logit CP - logit single device| accepted, > 0 (default {TOLERANCE:g})")
    parser.add_argument("--break-mask", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.nproc < 1:
        parser.error(f"--nproc must be at least 1, got {args.nproc}")
    if not 2 * args.nproc <= args.seq_len <= MAX_SEQ_LEN:
        parser.error(f"--seq-len must be between 2 * nproc = {2 * args.nproc} and "
                     f"{MAX_SEQ_LEN} (the tiny models' positions), got {args.seq_len}")
    if args.window < 2:
        parser.error(f"--window must be at least 2 tokens, got {args.window}")
    if not 0 < args.tol < float("inf"):
        parser.error(f"--tol must be a positive finite number, got {args.tol}")
    return args


def main(argv=None, *, prog: str = "python -m cp_attention probe") -> int:
    args = parse_args(argv, prog=prog)
    break_mask = args.break_mask or os.environ.get(BREAK_MASK_ENV, "") not in ("", "0")
    try:
        rows = run_probe(model=args.model, nproc=args.nproc, seq_len=args.seq_len, layout=args.layout,
                         window=args.window, tol=args.tol, break_mask=break_mask)
    except RuntimeError as exc:  # a rank raised (or hung): the probe cannot vouch for CP
        print(f"FAIL: the probe's ranks did not complete ({args.model}, {args.nproc} ranks, {args.layout}):\n{exc}")
        return 1
    print(f"cp_attention probe: tiny random {args.model}, {args.nproc} gloo ranks, {args.layout} layout, "
          f"L={args.seq_len}, float32; token 0 replaced: share of positions whose logits change (> {CHANGED:g})")
    if break_mask:
        print(f"(test switch {BREAK_MASK_ENV}: the CP column runs with the plain causal mask)")
    print("single device: attn_implementation='eager', each packed document run alone; "
          "CP: attn_implementation='cp_flash'")
    print(format_table(rows))
    print("layers: S sliding window, C chunked, F full; plain causal CP: the same ranks with every mask "
          "replaced by plain causal (windows, chunks and documents dropped)")
    ok = all(r.ok for r in rows)
    print(f"OK: CP changes the single-device positions, logits within {args.tol:g}" if ok
          else "FAIL: CP and single device disagree")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
