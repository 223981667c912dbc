"""``python -m cp_attention check MODEL``: does a model compute under context parallelism exactly what it
computes on one device? For a user's own model, before a long run.

MODEL is a checkpoint directory, a ``config.json`` or a transformers ``model_type``. The model is built with
the checkpoint's weights (or random ones: ``--random``, and always for a ``model_type`` or a bare config),
optionally with fewer layers (``--layers N``: the first N layers of each kind, in the model's own order) and
narrower (``--tiny``: widths shrunk as the family sweep shrinks them; random weights). One packed row of
documents (``--docs 3000,500,500``, or ``--seq-len N`` for one document) runs:

* the ground truth: each document alone on one device under ``attn_implementation="eager"``;
* ``cp_flash`` in a one-rank ``context_parallel`` block, and on ``--nproc`` gloo ranks on CPU with ``--layout``
  and ``--strategy``, through ``cp.shard_batch`` (``--device`` moves the model; a multi-GPU NCCL form is not
  built yet).
  Verification at first use is off here: the point is to show the layers.

It prints one table per world size (each decoder layer: its kind, mask, strategy, kernel calls and K/V bytes
received on the busiest rank, largest difference from the truth) and the verdict: ``exact``; ``refused``
(the reason and the fix, as the run would raise them; when the model check refused it, the table shows what it
would compute with the check off); ``wrong`` (the first differing layer). ``--json``
prints the same as data. Exit status 0 only when every world size is exact.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import os
import sys
import tempfile
import time
import types

import torch

__all__ = ["main", "load_config", "keep_layers", "check"]

TOLERANCE = types.MappingProxyType({torch.float64: 1e-6, torch.float32: 1e-4})  # of the largest value (half types: 5e-2)


def load_config(model: str, trust_remote_code: bool = False):
    """(config, checkpoint directory or None) of MODEL: a directory, a config.json or a model_type."""
    from transformers import AutoConfig

    if os.path.isdir(model):
        return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code), model
    if os.path.isfile(model):
        directory = os.path.dirname(os.path.abspath(model))
        if os.path.basename(model) == "config.json":
            return AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code), None
        raise SystemExit(f"check: {model} is a file but not a config.json; give a checkpoint directory, its "
                         "config.json or a model_type")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model not in CONFIG_MAPPING:
        raise SystemExit(f"check: {model!r} is neither a directory, a config.json nor a model_type of transformers")
    return CONFIG_MAPPING[model](), None


def keep_layers(config, n: int):
    """A copy of ``config`` with the first ``n`` layers of each kind (a layer's kind: its entry in every
    per-layer list), in the model's order; the per-layer lists cut to match."""
    from .sweeps.configs import layer_count

    text = getattr(config, "text_config", None) or config
    d = text.to_dict()
    key, total = layer_count(d)
    if not total:
        return config
    lists = {k: v for k, v in d.items() if isinstance(v, (list, tuple)) and len(v) == total and total > 1}
    kinds: dict = {}
    kept = []
    for i in range(total):
        kind = tuple(str(v[i]) for v in lists.values())
        if kinds.get(kind, 0) < n:
            kinds[kind] = kinds.get(kind, 0) + 1
            kept.append(i)
    config = copy.deepcopy(config)
    text = getattr(config, "text_config", None) or config
    for k, v in lists.items():
        setattr(text, k, type(v)(v[i] for i in kept))
    if key is not None:
        setattr(text, key, len(kept))
    return config


def _tiny(config):
    from .sweeps.configs import drop_derived, shrink

    return type(config)(**drop_derived(type(config), shrink(config.to_dict())))


def _layers(model):
    """(name, module) of the decoder layers: the longest ModuleList of the model."""
    best = ("", [])
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > len(best[1]):
            best = (name, list(module))
    return [(f"{best[0]}.{i}", m) for i, m in enumerate(best[1])]


class _Record:
    """The first output of each decoder layer in a forward."""

    def __init__(self, model):
        self.outputs: dict[int, torch.Tensor] = {}
        self.handles = []
        for i, (_, layer) in enumerate(_layers(model)):
            self.handles.append(layer.register_forward_hook(self._hook(i)))

    def _hook(self, i):
        def hook(module, args, output):
            first = output if isinstance(output, torch.Tensor) else output[0]
            self.outputs.setdefault(i, first.detach())
        return hook

    def close(self):
        for h in self.handles:
            h.remove()


def _build(spec: dict, implementation: str, state_path: str | None = None):
    import transformers

    config, directory = load_config(spec["model"], spec["trust_remote_code"])
    if spec["tiny"]:
        config = _tiny(config)
    if spec["layers"]:
        config = keep_layers(config, spec["layers"])
    dtype = getattr(torch, spec["dtype"])
    torch.manual_seed(0)
    if directory and not spec["random"] and not spec["tiny"] and state_path is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, config=config, attn_implementation=implementation, dtype=dtype,
            trust_remote_code=spec["trust_remote_code"])
    else:
        model = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation=implementation, dtype=dtype, trust_remote_code=spec["trust_remote_code"])
    if state_path is not None:
        model.load_state_dict(torch.load(state_path, weights_only=True))
    return model.eval().to(spec["device"])


def _inputs(config, docs: list[int]):
    vocab = int(getattr(getattr(config, "text_config", None) or config, "vocab_size", 0) or 32)
    ids = torch.randint(min(4, vocab - 1), vocab, (1, sum(docs)), generator=torch.Generator().manual_seed(1234))
    pos = torch.cat([torch.arange(n) for n in docs])[None]
    return ids, pos


def _truth(model, ids, docs) -> tuple[torch.Tensor, dict]:
    record = _Record(model)
    logits, layers, start = [], {}, 0
    try:
        with torch.no_grad():
            for n in docs:
                record.outputs = {}
                logits.append(model(input_ids=ids[:, start:start + n],
                                    position_ids=torch.arange(n)[None].to(ids.device), use_cache=False).logits)
                for i, out in record.outputs.items():
                    layers.setdefault(i, []).append(out)
                start += n
    finally:
        record.close()
    return torch.cat(logits, 1), {i: torch.cat(v, 1) for i, v in layers.items()}


def _cp_run(rank: int, world_size: int, spec: dict, state_path: str, docs: list[int], unchecked: bool = False) -> dict:
    """One rank of the run under the block: gathered logits and layer outputs, this rank's plan stats
    (``unchecked``: with the model check off)."""
    with _unchecked() if unchecked else contextlib.nullcontext():
        return _cp_run_checked(rank, world_size, spec, state_path, docs)


def _cp_run_checked(rank: int, world_size: int, spec: dict, state_path: str, docs: list[int]) -> dict:
    import cp_attention

    model = _build(spec, "cp_flash", state_path)
    ids, pos = _inputs(model.config, docs)
    ids, pos = ids.to(spec["device"]), pos.to(spec["device"])
    record = _Record(model)
    try:
        with torch.no_grad(), cp_attention.context_parallel(layout=spec["layout"], strategy=spec["strategy"],
                                                            verify=False) as cp:
            batch = cp.shard_batch(input_ids=ids, position_ids=pos, model=model)
            try:
                logits = cp.gather(model(**batch, use_cache=False).logits)
            except NotImplementedError as exc:
                return dict(refused=str(exc), refusal=getattr(exc, "refusal", None))
            layers = {i: cp.gather(t).cpu() for i, t in sorted(record.outputs.items())}
            stats = [(layer, dict(kernel_calls=s.kernel_calls, kv_bytes_recv=s.kv_bytes_recv, strategy=s.strategy))
                     for layer, s in cp_attention.forward_plan_stats()]
    finally:
        record.close()
    out = dict(logits=logits.cpu() if rank == 0 else None, layers=layers if rank == 0 else None, stats=stats)
    buf = io.BytesIO()  # bytes, not tensors: a tensor on the queue lives in memory the exiting rank may unlink
    torch.save(out, buf)
    return dict(payload=buf.getvalue())


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = max(float(want.double().abs().max()), 1e-6)
    return float((got.double() - want.double()).abs().max()) / scale


def check(spec: dict) -> dict:
    """Run the check described by ``spec`` (the command line's options as a dict); returns the report."""
    import cp_attention  # noqa: F401 - registers cp_flash
    from cp_attention.integrations.hf.models import layer_masks
    from cp_attention.tools.launch import run_ranks

    t0 = time.monotonic()
    eager = _build(spec, "eager")
    config = eager.config
    docs = spec["docs"]
    ids, pos = _inputs(config, docs)
    truth_logits, truth_layers = _truth(eager, ids.to(spec["device"]), docs)
    tol = TOLERANCE.get(next(eager.parameters()).dtype, 5e-2)
    try:
        masks = [_mask_label(m) for m in layer_masks(getattr(config, "text_config", None) or config)]
    except Exception:  # noqa: BLE001 - a config the mask reader does not know: the table leaves it out
        masks = []
    kinds = []
    text = (getattr(config, "text_config", None) or config).to_dict()
    for key in ("layer_types", "layers_block_type", "block_types", "mlp_layer_types"):
        if isinstance(text.get(key), list):
            kinds = [str(v) for v in text[key]]
            break
    report = dict(model=spec["model"], model_class=type(eager).__name__,
                  family=getattr(config, "model_type", ""), docs=docs, tolerance=tol,
                  params=sum(p.numel() for p in eager.parameters()), runs={})
    with tempfile.TemporaryDirectory() as tmp:
        state_path = os.path.join(tmp, "state.pt")
        torch.save(eager.state_dict(), state_path)
        del eager
        for world_size in sorted({1, spec["nproc"]}):
            def run(unchecked: bool) -> list:
                if world_size == 1:
                    return [_cp_run(0, 1, spec, state_path, docs, unchecked)]
                return run_ranks(world_size, _cp_run, spec, state_path, docs, unchecked, timeout=spec["timeout"])

            verdict = _verdict(run(False), truth_logits, truth_layers, tol, kinds, masks)
            if verdict["verdict"] == "refused" and verdict["refusal"] == "model_check" and spec.get("explain", True):
                # what it would compute: the layers with the model check off
                would = _verdict(run(True), truth_logits, truth_layers, tol, kinds, masks)
                verdict.update(layers=would.get("layers", []), unchecked=would["verdict"],
                               first_layer=would.get("first_layer"), logits_error=would.get("logits_error"))
            report["runs"][str(world_size)] = verdict
    verdicts = {r["verdict"] for r in report["runs"].values()}  # refused anywhere, else wrong anywhere, else exact
    report["verdict"] = next(v for v in ("refused", "wrong", "exact") if v in verdicts)
    report["seconds"] = round(time.monotonic() - t0, 1)
    return report


def _mask_label(mask) -> str:
    """``causal``, ``causal, window=4096``, ...: the mask's fields that differ from a plain causal mask."""
    import dataclasses

    parts = ["causal" if getattr(mask, "causal", True) else "bidirectional"]
    for field in dataclasses.fields(mask):
        value = getattr(mask, field.name)
        if field.name != "causal" and value not in (None, False, 0, field.default):
            parts.append(f"{field.name}={value}")
    return ", ".join(parts)


def _verdict(results: list[dict], truth_logits, truth_layers, tol, kinds, masks) -> dict:
    results = [torch.load(io.BytesIO(r["payload"])) if "payload" in r else r for r in results]
    refused = next((r for r in results if "refused" in r), None)
    if refused is not None:
        return dict(verdict="refused", reason=refused["refused"], refusal=refused["refusal"], layers=[])
    busiest: dict = {}
    for r in results:
        for layer, s in r["stats"]:
            row = busiest.setdefault(layer, dict(s))
            row["kernel_calls"] = max(row["kernel_calls"], s["kernel_calls"])
            row["kv_bytes_recv"] = max(row["kv_bytes_recv"], s["kv_bytes_recv"])
    rows = []
    first = None
    for i in sorted(truth_layers):
        got = results[0]["layers"].get(i)
        err = _error(got, truth_layers[i].cpu()) if got is not None and got.shape == truth_layers[i].shape else None
        stats = busiest.get(i, {})
        rows.append(dict(layer=i, kind=kinds[i] if i < len(kinds) else "", mask=masks[i] if i < len(masks) else "",
                         strategy=stats.get("strategy", "-"), kernel_calls=stats.get("kernel_calls"),
                         kv_bytes_recv=stats.get("kv_bytes_recv"), error=err))
        if first is None and err is not None and err > tol:
            first = i
    logits_err = _error(results[0]["logits"], truth_logits.cpu())
    if first is None and logits_err <= tol:
        return dict(verdict="exact", logits_error=logits_err, layers=rows)
    return dict(verdict="wrong", logits_error=logits_err, first_layer=first, layers=rows)


@contextlib.contextmanager
def _unchecked():
    """The model check off (a refused model's run, to show where it would differ)."""
    from cp_attention.integrations.hf.check import suspended

    with suspended():
        yield


def _print(report: dict) -> None:
    print(f"{report['model']} ({report['model_class']}, {report['params'] / 1e6:.1f}M parameters), documents "
          f"{report['docs']}; truth: each document alone on one device under eager; tolerance {report['tolerance']:g} "
          "of each output's largest value")
    for world_size, run in report["runs"].items():
        print(f"\nworld size {world_size}: {run['verdict']}")
        if run["verdict"] == "refused":
            print(run["reason"])
            if not run["layers"]:
                continue
            print(f"with the model check off it would be {run['unchecked']}:")
        print(f"{'layer':>5}  {'kind':<22} {'mask':<34} {'strategy':<8} {'calls':>5} {'K/V recv':>10} {'difference':>10}")
        for row in run["layers"]:
            err = "-" if row["error"] is None else f"{row['error']:.2e}"
            calls = "-" if row["kernel_calls"] is None else row["kernel_calls"]
            kv = "-" if row["kv_bytes_recv"] is None else row["kv_bytes_recv"]
            print(f"{row['layer']:>5}  {row['kind'][:22]:<22} {row['mask'][:34]:<34} {row['strategy']:<8} {calls:>5} "
                  f"{kv:>10} {err:>10}")
        if run.get("logits_error") is not None:
            print(f"logits: {run['logits_error']:.2e}")
        if run.get("first_layer") is not None:
            print(f"wrong: the first differing layer is {run['first_layer']}")
    print(f"\nverdict: {report['verdict']} ({report['seconds']} s)")


def main(argv=None, *, prog: str = "cp-attention check") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a checkpoint directory, a config.json or a transformers model_type")
    parser.add_argument("--trust-remote-code", action="store_true", help="load the checkpoint's own modeling code")
    parser.add_argument("--random", action="store_true", help="random weights instead of the checkpoint's")
    parser.add_argument("--layers", type=int, default=0, help="keep the first N layers of each kind")
    parser.add_argument("--tiny", action="store_true", help="shrink the widths (random weights; for CPU)")
    parser.add_argument("--docs", default="", help="document lengths of the packed row (default 40,24,16)")
    parser.add_argument("--seq-len", type=int, default=0, help="one document of this many tokens")
    parser.add_argument("--nproc", type=int, default=2, help="ranks of the context-parallel run (default 2)")
    parser.add_argument("--layout", default="zigzag")
    parser.add_argument("--strategy", default="ring")
    parser.add_argument("--dtype", default="float32", help="float32 (default on CPU), bfloat16, float64")
    parser.add_argument("--device", default="cpu", help="where the model runs (cpu; the ranks are gloo ranks)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds the ranks may take")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--no-explain", action="store_true",
                        help="when the model check refuses the model, do not run it again with the check off")
    args = parser.parse_args(argv)
    docs = [args.seq_len] if args.seq_len else [int(x) for x in (args.docs or "40,24,16").split(",")]
    if any(n <= 0 for n in docs):
        parser.error("--docs/--seq-len: lengths must be positive")
    spec = dict(model=args.model, trust_remote_code=args.trust_remote_code, random=args.random, layers=args.layers,
                tiny=args.tiny, docs=docs, nproc=args.nproc, layout=args.layout, strategy=args.strategy,
                dtype=args.dtype, device=args.device, timeout=args.timeout, explain=not args.no_explain)
    torch.set_num_threads(max(1, torch.get_num_threads() // max(1, args.nproc)))
    report = check(spec)
    if args.json:
        print(json.dumps(report, indent=1, default=str))
    else:
        _print(report)
    return 0 if report["verdict"] == "exact" else 1


if __name__ == "__main__":
    sys.exit(main())
