"""The vision-language sweep: every image-text-to-text family of the installed transformers under cp_flash
(``python -m cp_attention.tools.sweeps.vlm``), a text batch and a batch with one image, each at world
size 1 (the cp_flash model called plainly) and at CP = 2 (``cp.shard_batch(**inputs, model=model)`` on
two gloo ranks), against the family's own eager attention on one device.

The verdict per family and slot (:func:`problems`): ``exact`` or ``refused`` (a NotImplementedError
naming why); ``unbuildable`` only for the families (or family/kind) of :data:`UNBUILDABLE`; anything
else (wrong numbers, another exception, a timeout) fails. The recorded outcomes live in
docs/data/vlms.json (rendered as docs/supported_vlms.md), rerun by ``python -m cp_attention.tools.sweeps.vlm
--jobs 2 --json docs/data/vlms.json --page docs/supported_vlms.md``; the default run reruns a small subset
and checks it equals its records, ``python -m pytest -m families`` reruns every family (about 30 minutes
on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cp_attention.tools.sweeps import vlm, vlm_configs as vs
from sweep_support import sweep_env

pytestmark = [pytest.mark.multirank, pytest.mark.transformers]  # spawns gloo ranks; builds transformers models

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECORD = os.path.join(ROOT, "docs", "data", "vlms.json")  # the last full sweep's outcomes

_NEEDS_IMAGES = "its forward needs the image in every call: there is no text-only forward"
UNBUILDABLE = {  # family, or family/kind -> why no tiny model or batch of it can be built (the sweep records the error)
    "diffusion_gemma": "a block-diffusion model: its forward draws noise (eager is not deterministic) and takes no "
                       "pixel_values",
    "fast_vlm": "needs the timm package for its vision tower",
    "gemma3n": "needs the timm package for its vision tower",
    "perception_lm": "needs the timm package for its vision tower",
    "inkling_mm_model": "needs the scipy package",
    "instructblipvideo": "text: needs the clip in every call; image: its default config leaves video_token_index "
                         "None and the model reports no placeholder count",
    "llama4": "transformers' forward reads image_outputs off its text model's output, which has none: every forward "
              "raises AttributeError (the image batch fails first, on the projector widths)",
    "pi0": "a robot-action model: its forward needs state, noise and a timestep",
    "blip/text": _NEEDS_IMAGES, "blip-2/text": _NEEDS_IMAGES, "idefics/text": _NEEDS_IMAGES,
    "instructblip/text": _NEEDS_IMAGES, "kosmos-2/text": _NEEDS_IMAGES, "pix2struct/text": _NEEDS_IMAGES,
    "pp_formulanet/text": _NEEDS_IMAGES, "vision-encoder-decoder/text": _NEEDS_IMAGES,
    "evolla/image": "a protein-text model: its forward takes no image",
    "mistral4/image": "a text-only model: its forward takes no image",
    "inkling2/image": "its pixels (rows per merge block, with patch grids and indices) have no recipe yet",
    "inkling2_loop/image": "its pixels (rows per merge block, with patch grids and indices) have no recipe yet",
    "molmo2/image": "its crops, pooling indices and grids have no recipe yet",
}

# one image-text family per kind of path (a CLIP tower with a projector, Qwen-style patches with M-RoPE
# positions and Gemma 3's image blocks run in tests/integrations/test_multimodal.py): M-RoPE rows handed to the
# layers as position_ids (GLM-4V-MoE), a sinusoidal position table numbered from padding_idx + 1 (Kosmos-2.5),
# and a family refused at both world sizes
FAST = ("glm4v_moe", "kosmos-2.5", "paligemma")


def _allowed_unbuildable(family: str, slot: str) -> bool:
    return family in UNBUILDABLE or f"{family}/{slot.split('/')[0]}" in UNBUILDABLE


def problems(record: dict) -> list[str]:
    """What is wrong with one family's sweep record (empty: every slot exact, refused, or a listed
    unbuildable)."""
    family, out = record["family"], []
    missing = [slot for slot in vs.SLOTS if slot not in record["outcomes"]]
    if missing:
        out.append(f"{family}: no outcome for {', '.join(missing)}")
    for slot, rec in sorted(record["outcomes"].items()):
        outcome = rec.get("outcome")
        if outcome in ("exact", "refused"):
            continue
        if outcome == "unbuildable" and _allowed_unbuildable(family, slot):
            continue
        detail = rec.get("message") or {k: rec.get(k) for k in ("logit_err", "grad_err", "grad_rel", "worst_param")}
        out.append(f"{family} {slot}: {outcome}: {str(detail)[:300]}")
    return out


def _sweep(families, tmp_path, timeout: float) -> list[dict]:
    path = tmp_path / "vlm_sweep.json"
    cmd = [sys.executable, "-m", "cp_attention.tools.sweeps.vlm", "--families", ",".join(families), "--json",
           str(path), "--jobs", "2", "--timeout", str(timeout)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=sweep_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(path.read_text())["results"]


def _table() -> dict[str, dict[str, str]]:
    """{family: {slot: outcome}} of the recorded sweep (docs/data/vlms.json, the page's record)."""
    with open(RECORD) as f:
        results = json.load(f)["results"]
    return {r["family"]: {slot: rec["outcome"] for slot, rec in r["outcomes"].items()} for r in results}


def _differences(results: list[dict]) -> list[str]:
    table = _table()
    out = []
    for r in results:
        got = {slot: rec["outcome"] for slot, rec in r["outcomes"].items()}
        if got != table.get(r["family"]):
            out.append(f"{r['family']}: ran {got}, docs/data/vlms.json says {table.get(r['family'])}")
    return out


@pytest.mark.slow  # about 50 s: the sweep tool end to end (the VLM paths themselves: test_multimodal.py)
def test_fast_subset_matches_the_table(tmp_path):
    """A few families rerun: every outcome exact or refused, and equal to their rows of the table."""
    results = _sweep(FAST, tmp_path, timeout=150)
    assert [r["family"] for r in results] == list(FAST)
    bad = [p for r in results for p in problems(r)]
    bad += [f"{r['family']} {slot}: {rec['outcome']}" for r in results for slot, rec in r["outcomes"].items()
            if rec["outcome"] not in ("exact", "refused")]
    assert not bad, "\n".join(bad)
    diff = _differences(results)
    assert not diff, "\n".join(diff)
    assert {rec["outcome"] for rec in results[-1]["outcomes"].values()} == {"refused"}


def test_table_lists_every_installed_family():
    """The recorded table has one row per entry of MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, no more, each with
    four known outcomes; every listed unbuildable is unbuildable there (the list cannot go stale)."""
    table = _table()
    assert sorted(table) == sorted(vs.families()), (sorted(set(table) ^ set(vs.families())))
    outcomes = {"exact", "refused", "wrong", "crash", "unbuildable", "timeout"}
    for family, row in table.items():
        assert set(row) == set(vs.SLOTS) and set(row.values()) <= outcomes, (family, row)
    for key in UNBUILDABLE:
        family, _, kind = key.partition("/")
        slots = [s for s in vs.SLOTS if not kind or s.startswith(kind + "/")]
        assert all(table[family][s] == "unbuildable" for s in slots), (key, table[family])


def test_verdict_rejects_what_it_must():
    """The verdict itself: wrong numbers, crashes, timeouts, missing slots and unlisted unbuildables fail."""
    exact, refused = {"outcome": "exact"}, {"outcome": "refused", "message": "cp_flash: ..."}

    def rec(family, **slots):
        outcomes = {slot: exact for slot in vs.SLOTS}
        outcomes.update({k.replace("_", "/"): v for k, v in slots.items()})
        return {"family": family, "outcomes": outcomes}

    assert not problems(rec("a"))
    assert not problems(rec("a", image_2=refused, text_2=refused))
    assert problems(rec("a", image_2={"outcome": "wrong", "logit_err": 0.5, "grad_rel": 0.1}))
    assert problems(rec("a", text_1={"outcome": "crash", "message": "RuntimeError: expand"}))
    assert problems(rec("a", image_1={"outcome": "timeout"}))
    assert problems(rec("zz", text_1={"outcome": "unbuildable"}))
    assert not problems(rec("gemma3n", **{s.replace("/", "_"): {"outcome": "unbuildable"} for s in vs.SLOTS}))
    partial = rec("a")
    del partial["outcomes"]["image/2"]
    assert problems(partial)


@pytest.mark.families
def test_every_family_exact_or_refused_as_tabled(tmp_path):
    """Every family rerun: the verdict holds and the outcomes equal docs/data/vlms.json."""
    results = _sweep(vs.families(), tmp_path, timeout=vlm.FAMILY_TIMEOUT)
    assert len(results) == len(vs.families())
    bad = [p for r in results for p in problems(r)] + _differences(results)
    assert not bad, f"{len(bad)} problems:\n" + "\n".join(bad)
