"""The sweeps' tables and the documentation pages rendered from their recorded results.

Each sweep writes its results as JSON (``--json``); a page is rendered from such a record alone, so
that a page is never typed and a rerun can be diffed and adopted:

* :func:`family_page`: ``docs/supported_models.md`` from ``docs/data/families.json`` (the family sweep);
* :func:`heads_page`: ``docs/supported_heads.md`` from ``docs/data/heads.json`` (the head sweep);
* :func:`vlm_page`: ``docs/supported_vlms.md`` from ``docs/data/vlms.json`` (the vision-language sweep);
* :func:`versions_page`: ``docs/supported_versions.md`` from ``docs/data/versions.json`` (the family sweep on
  every tested transformers release, :mod:`.versions`).

:data:`PAGES` lists them with the command that renders each; the test suite checks every page
equals what its renderer makes of the committed record.
"""

from __future__ import annotations

import json
import os
from types import MappingProxyType

from .compare import GRAD_REL_TOL, TOL
from .configs import FLOAT64
from .vlm_configs import SLOTS as VLM_SLOTS

__all__ = ["PAGES", "VLM_SLOTS", "counted", "reason", "ws1_as_eager", "summary_markdown", "family_table", "head_table",
           "vlm_table", "family_page", "heads_page", "vlm_page", "versions_page", "differences", "render", "read_record"]


FAMILY_NOTES = MappingProxyType({  # family -> what its row alone does not say
    "zamba": "its per-head projections (`x_proj_weight[:, None] @ ... .transpose(...)`) are a weight times an "
             "activation, not scores: the model check tells them apart (it refused Zamba at CP = 2 for them before).",
    "mamba": "Mamba, Mamba-2, Falcon-Mamba, RWKV and xLSTM take no `position_ids` and read no positions: the sweep "
             "passes them the packed row without them; their mixers take the documents from `shard_batch`'s record.",
    "hrm_text": "its configuration checks the implementation's name (its prefix-LM overlay, refused for any "
                "flash-named implementation): the configuration module is adapted as the modeling modules are.",
})


def reason(rec: dict) -> str:
    """One outcome record in a few words: its errors (exact, wrong) or its error's type and message."""
    if rec.get("outcome") in ("exact", "wrong"):
        s = f"logit {rec['logit_err']:.1e}, grad {rec['grad_err']:.1e} (rel {rec.get('grad_rel', 0):.1e})"
        if rec.get("outcome") == "wrong" and rec.get("worst_param"):
            s += f" worst {rec['worst_param']}"
        if not rec.get("finite", True):
            s += " NON-FINITE"
        return s
    return f"{rec.get('error_type', '')}: {rec.get('message', '')}".strip(": ")


def ws1_as_eager(record: dict) -> bool:
    """The family's own eager lets packed documents see each other, and cp_flash at world size 1
    (no context) equals that eager exactly."""
    return (record.get("eager_isolates") or {}).get("isolates") is False and \
        (record.get("ws1_vs_packed_eager") or {}).get("outcome") == "exact"


# --------------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------------

def summary_markdown(results: list[dict], docs) -> str:
    """The family sweep's working summary: every comparison of every family, with its errors."""
    counts: dict = {}
    for r in results:
        for ws, rec in r["outcomes"].items():
            counts.setdefault(ws, {}).setdefault(rec["outcome"], 0)
            counts[ws][rec["outcome"]] += 1
    lines = ["# cp_flash family sweep", "", f"docs {list(docs)} in one row; tolerances "
             f"(logits {TOL:g}, gradients max({TOL:g}, {GRAD_REL_TOL:g} x max|grad|))", ""]
    for ws in sorted(counts):
        lines.append(f"- world size {ws}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts[ws].items())))
    lines += ["", "| family | ws1 | ws2 | ws1 plain (no context) | eager isolates docs | cp_flash vs packed eager "
              "| reason / diffs |", "|---|---|---|---|---|---|---|"]
    for r in results:
        o = r["outcomes"]
        ws1, ws2 = o.get("1", {}), o.get("2", {})
        plain = r.get("ws1_plain", {}).get("outcome", "")
        iso = r.get("eager_isolates", {}).get("isolates", "")
        vs = r.get("ws1_vs_packed_eager", {}).get("outcome", "")
        reasons = []
        for tag, rec in (("ws1", ws1), ("ws2", ws2)):
            if rec and rec.get("outcome") != "exact":
                reasons.append(f"{tag}: {reason(rec)}")
        if not reasons and ws1:
            reasons.append(reason(ws1))
        text = "; ".join(reasons).replace("|", "/")
        lines.append(f"| {r['family']} | {ws1.get('outcome', '')} | {ws2.get('outcome', '')} | {plain} | {iso} | {vs} "
                     f"| {text} |")
    return "\n".join(lines) + "\n"


def family_table(results: list[dict]) -> str:
    """The support table: counts, then one row per family, its outcome at world size 1 and CP = 2 and
    why it is refused (the model check's findings, else the error's first line)."""
    counts: dict = {}
    rows = ["| family | world size 1 | CP = 2 | why (refusals) |", "|---|---|---|---|"]
    for r in results:
        cells, whys = [], []
        for ws in ("1", "2"):
            rec = r["outcomes"].get(ws, {})
            label = rec.get("outcome", "")
            if label == "wrong" and ws == "1" and ws1_as_eager(r):
                label = "as eager"
            counts.setdefault(ws, {}).setdefault(label, 0)
            counts[ws][label] += 1
            cells.append(label)
            if label not in ("exact", "as eager"):  # the model check's findings first, else the message
                whys.append((not rec.get("reasons"), "; ".join(rec.get("reasons") or [])
                             or str(rec.get("message") or "")[:100]))
        why = min(whys)[1] if whys else ""
        rows.append(f"| {r['family']} | {cells[0]} | {cells[1]} | {why.replace('|', '/')} |")
    summary = [f"- {'world size 1' if ws == '1' else 'CP = 2'}: " + ", ".join(
        f"{n} {label}" for label, n in sorted(counts[ws].items(), key=lambda kv: -kv[1])) for ws in sorted(counts)]
    return "\n".join(summary) + "\n\n" + "\n".join(rows) + "\n"


def counted(outcomes) -> str:
    counts: dict[str, int] = {}
    for outcome in outcomes:
        counts[outcome] = counts.get(outcome, 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))


def head_table(results: list[dict]) -> str:
    """One row per head: kind, family, class, its outcome at CP = 2 and why."""
    rows = ["| head | family | class | CP = 2 | why |", "|---|---|---|---|---|"]
    for r in results:
        why = r.get("message", "") if r["outcome"] != "wrong" else \
            f"loss {r['loss_err']:.1e}, grads {r['grad_rel']:.1e}"
        why = why.replace("|", "/").replace("\n", " ")[:160]
        rows.append(f"| {r['kind']} | {r['family']} | {r['cls']} | {r['outcome']} | {why} |")
    return "\n".join(rows) + "\n"


def vlm_table(results: list[dict]) -> str:
    """One row per family: its four outcomes (:data:`VLM_SLOTS`) and their distinct reasons."""
    def why(rec: dict) -> str:
        if rec.get("outcome") in ("exact", "wrong"):
            return reason(rec)
        return ("; ".join(rec.get("reasons") or []) or f"{rec.get('error_type', '')}: {rec.get('message', '')}")[:160]

    rows = ["| family | text ws1 | text CP=2 | image ws1 | image CP=2 | why (refused, unbuildable, wrong, crash) |",
            "|---|---|---|---|---|---|"]
    for r in results:
        cells, whys = [r["outcomes"].get(slot, {}).get("outcome", "") for slot in VLM_SLOTS], {}
        for slot, label in zip(VLM_SLOTS, cells):
            if label != "exact":
                whys.setdefault(why(r["outcomes"].get(slot, {})).strip(": "), slot)
        text = " / ".join(f"{slot}: {why}" for why, slot in whys.items()).replace("|", "/").replace("\n", " ")
        rows.append(f"| {r['family']} | " + " | ".join(cells) + f" | {text} |")
    return "\n".join(rows) + "\n"


# --------------------------------------------------------------------------------------------------
# Pages
# --------------------------------------------------------------------------------------------------

def _generated(module: str, data: str, page: str) -> str:
    return (f"Generated by `python -m {module} --from {data} --page {page}` from the record `{data}`; "
            f"do not edit by hand.")


def family_page(record: dict, data: str = "docs/data/families.json", page: str = "docs/supported_models.md") -> str:
    """The support page of every causal-LM family from a family sweep's JSON record."""
    results, docs = record["results"], record["docs"]
    module = "cp_attention.tools.sweeps.family"
    float64 = "; ".join(f"{family}, in float64: {why}" for family, why in sorted(FLOAT64.items()))
    notes = [f"- {family}: {note}" for family, note in FAMILY_NOTES.items()
             if any(r["family"] == family for r in results)]
    text = [
        _generated(module, data, page), "",
        f"# Supported models: every causal-LM family of transformers {record['transformers']}", "",
        f"The family sweep (`python -m {module}`) builds a tiny config of each entry of "
        "`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` generically from its config class (its own layer mix), runs one packed "
        f"row of {len(docs)} documents (lengths {', '.join(map(str, docs))}) under `cp_flash` at world size 1 and at "
        "CP = 2 (zigzag, two gloo ranks), and compares logits and gradients with eager running each document alone.",
        "",
        f"- exact: logits within {TOL:g}, gradients within max({TOL:g}, {GRAD_REL_TOL:g} x max|grad|);",
        "- refused: the model check (or a guard) raised NotImplementedError before anything ran; the reasons are "
        "its findings (or the error that refused the family);",
        "- as eager: the family's own eager lets packed documents see each other (its mixers or positions ignore "
        "document boundaries), and cp_flash at world size 1 equals that eager exactly;",
        "- unbuildable: no tiny model of the family can be built generically;",
        "- anything else (wrong numbers, a crash, a timeout) fails the full sweep's test "
        "(`python -m pytest -m families`, about 50 minutes on 2 cores; the default test run covers one family per "
        "cause of refusal).", "",
        f"Every family is compared in float32 but {float64}.", "",
        *(["Notes:", "", *notes, ""] if notes else []),
        f"A rerun writes the record and this page: `python -m {module} --json {data} --page {page}`.", "",
        family_table(results).rstrip("\n"),
    ]
    return "\n".join(text) + "\n"


def heads_page(record: dict, data: str = "docs/data/heads.json", page: str = "docs/supported_heads.md") -> str:
    """The support page of every task head from a head sweep's JSON record."""
    results = record["results"]
    module = "cp_attention.tools.sweeps.heads"
    text = [
        _generated(module, data, page), "",
        f"# Task heads under CP (transformers {record['transformers']}: {len(results)} heads: "
        + counted(r["outcome"] for r in results) + ")", "",
        "Every entry of transformers' sequence-classification, token-classification, question-answering and "
        "masked-LM mappings, as a tiny model. Ground truth: eager on one process, the full row; CP = 2: two gloo "
        "ranks, zigzag, `cp.shard_batch`, mean over ranks of the loss and gradients. exact: equal; refused: a "
        "NotImplementedError before the forward, naming why; unbuildable: no tiny model or eager loss of the "
        "family.", "",
        f"A rerun writes the record and this page: `python -m {module} --json {data} --page {page}` "
        "(about 40 minutes on 2 cores).", "",
        head_table(results).rstrip("\n"),
    ]
    return "\n".join(text) + "\n"


def vlm_page(record: dict, data: str = "docs/data/vlms.json", page: str = "docs/supported_vlms.md") -> str:
    """The support page of every image-text-to-text family from a vision-language sweep's JSON record."""
    results = record["results"]
    module = "cp_attention.tools.sweeps.vlm"
    outcomes = [r["outcomes"].get(slot, {}).get("outcome", "") for r in results for slot in VLM_SLOTS]
    text = [
        _generated(module, data, page), "",
        f"# cp_flash over image-text-to-text families (transformers {record['transformers']}: {len(results)} "
        f"families, {len(outcomes)} outcomes: " + counted(outcomes) + ")", "",
        "Per family a tiny model, a text batch and a batch with one image. Ground truth: eager on one device, full "
        "batch; ws1: the cp_flash model called plainly; CP=2: two gloo ranks, zigzag, "
        f"`cp.shard_batch(**inputs, model=model)`; logits within {TOL:g}, gradients within max({TOL:g}, "
        f"{GRAD_REL_TOL:g} x max|grad|).", "",
        f"A rerun writes the record and this page: `python -m {module} --jobs 2 --json {data} --page {page}` "
        "(about 30 minutes on 2 cores).", "",
        vlm_table(results).rstrip("\n"),
    ]
    return "\n".join(text) + "\n"


VERSIONS_MODULE = "cp_attention.tools.sweeps.versions"
VERSION_NOTES = MappingProxyType({  # family -> why its outcome differs between releases, where its reasons do not say
    "qwen4_exp": "5.17's Qwen4 block indexer fails its admission check (its code ANDs a float tensor where 5.24 "
                 "reads a boolean one), and its attention reads the layer's mask as a dense tensor "
                 "(`.is_floating_point`), which cp_flash hands O(L) metadata: refused there, naming the version.",
    "moshi": "5.17's eager moshi disagrees with its own sdpa on one document (0.44: the logits of a document's first "
             "tokens change with the row's length); the sweep's truth there is sdpa (recorded as its oracle), which "
             "cp_flash equals.",
})


def _cell(outcomes: dict | None) -> str:
    if outcomes is None:
        return "(not in this release)"
    cell = " / ".join(outcomes.get(ws, {}).get("outcome", "-") for ws in ("1", "2"))
    return cell + (f" (vs {outcomes['truth']})" if outcomes.get("truth") else "")


def _why(outcomes: dict | None) -> str:
    if outcomes is None:
        return ""
    parts = []
    for ws in ("1", "2"):
        rec = outcomes.get(ws, {})
        text = "; ".join(rec.get("reasons", [])) or rec.get("message", "")
        if text and text not in parts:
            parts.append(text)
    return " | ".join(parts).replace("|", "/") if parts else ""


def differences(record: dict) -> list[tuple[str, dict]]:
    """(family, {release: outcomes or None}) for every family whose outcomes differ between the releases."""
    releases = record["releases"]
    families = sorted({f for res in releases.values() for f in res})
    out = []
    for family in families:
        cells = {v: releases[v].get(family) for v in releases}
        if len({_cell(c) for c in cells.values()}) > 1:
            out.append((family, cells))
    return out


def versions_page(record: dict, data: str = "docs/data/versions.json",
                  page: str = "docs/supported_versions.md") -> str:
    """The page comparing the family sweep on every tested release (see the module docstring)."""
    releases = record["releases"]
    text = [
        f"Generated by `python -m {VERSIONS_MODULE} --from {data} --page {page}` from the record `{data}`; do not edit "
        "by hand.", "",
        "# The family sweep on every tested transformers release", "",
        "The family sweep ([supported_models.md](supported_models.md): a tiny model of every causal-LM family, "
        "one packed row under `cp_flash` at world size 1 and CP = 2 against eager on each document alone) on "
        "each release the suite runs. \"exact / refused\" reads world size 1 / CP = 2. Nothing may be wrong or "
        "crash on any release; what differs is listed below with the reason each release gives.", "",
        "| release | families | world size 1 | CP = 2 |", "|---|---|---|---|",
    ]
    from ...integrations.hf.versions import TESTED_VERSIONS

    missing = [v for v in TESTED_VERSIONS if v not in releases]
    for version, results in releases.items():
        ws1 = counted(o.get("1", {}).get("outcome", "") for o in results.values())
        ws2 = counted(o.get("2", {}).get("outcome", "") for o in results.values())
        text.append(f"| {version} | {len(results)} | {ws1} | {ws2} |")
    if missing:
        text += ["", f"Not recorded yet: {', '.join(missing)} (tested in CI's compatibility lane; its full sweep is to "
                 "be added with the command below)."]
    diffs = differences(record)
    text += ["", f"## What differs ({len(diffs)} families)", "",
             "| family | " + " | ".join(releases) + " | why |", "|---|" + "---|" * len(releases) + "---|"]
    for family, cells in diffs:
        why = VERSION_NOTES.get(family) or " ".join(f"{v}: {_why(c)}" for v, c in cells.items() if _why(c))
        text.append(f"| {family} | " + " | ".join(_cell(c) for c in cells.values()) + f" | {why} |")
    text += ["", "A release's record is added with "
             f"`python -m cp_attention.tools.sweeps.family --world 1,2 --json SWEEP.json` under that release, then "
             f"`python -m {VERSIONS_MODULE} --add SWEEP.json --record {data} --page {page}`."]
    return "\n".join(text) + "\n"


# name -> (page, record, renderer): paths relative to the repository root
PAGES = MappingProxyType({
    "families": ("docs/supported_models.md", "docs/data/families.json", family_page),
    "heads": ("docs/supported_heads.md", "docs/data/heads.json", heads_page),
    "vlms": ("docs/supported_vlms.md", "docs/data/vlms.json", vlm_page),
    "versions": ("docs/supported_versions.md", "docs/data/versions.json", versions_page),
})


def read_record(path: str) -> dict:
    """A sweep's JSON record."""
    with open(path) as f:
        return json.load(f)


def render(name: str, root: str = ".") -> str:
    """The page :data:`PAGES` names ``name``, rendered from its record under ``root``."""
    page, data, renderer = PAGES[name]
    return renderer(read_record(os.path.join(root, data)), data, page)
