"""A sweep over every image-text-to-text family of the installed transformers under cp_flash.

Per family: a tiny model (:func:`~.vlm_configs.tiny_config`), a ``text`` batch and an ``image`` batch
with ONE image (:func:`make_batch`), against eager on one device (logits, gradients of
``sum(logits * R)``, the tolerances of :mod:`.compare`): the cp_flash model called plainly (world size
1), and on two gloo ranks through ``cp.shard_batch(**inputs, model=model)`` (CP = 2, zigzag).
Outcomes: exact, refused (NotImplementedError), wrong, crash, unbuildable, timeout.

CLI: ``python -m cp_attention.tools.sweeps.vlm --families a,b --json out.json --page docs/supported_vlms.md``
(each family in its own subprocess with a timeout, ``--jobs`` <= 2 at a time); ``--from RECORD --page
PAGE`` renders the support page from a recorded ``--json`` output without running anything.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import sys
import time
import traceback
from collections.abc import Mapping
from types import MappingProxyType

import torch
import torch.distributed as dist

import cp_attention  # registers cp_flash
from cp_attention.tools.launch import run_ranks

from . import configs, runner
from .compare import (TOL, classify, compare_or_error, diffs, error_record, flat_grads, grad_tol, indexer_ties_to_earliest,
                      jsonable, param_spans)
from .tables import vlm_page
from .vlm_configs import IMAGE_KEYS, KINDS, SIDE, SLOTS, WORLDS, build_model, config_ids, families, tiny_config

__all__ = ["families", "tiny_config", "build_model", "make_batch", "run_family", "main"]

TEXT_B, TEXT_L = 2, 40  # the text batch (zigzag at CP = 2: 4 slices of 10)
IMAGE_TEXT = 24  # text tokens around the image in the image batch (then rounded up to a multiple of 8)
FAMILY_TIMEOUT, RANK_TIMEOUT = 300.0, 180.0
MODULE = "cp_attention.tools.sweeps.vlm"  # how the CLI runs a family in a process of its own


def _accepts(model, name: str) -> bool:
    return name in inspect.signature(model.forward).parameters


def call(model, inputs: dict) -> torch.Tensor:
    """``model(**inputs)`` (with use_cache=False where the forward names it): the logits."""
    out = model(**inputs, **(dict(use_cache=False) if _accepts(model, "use_cache") else {}))
    return out.logits if hasattr(out, "logits") else out[0]


START_KEYS = ("vision_start_token_id", "image_start_token_id", "boi_token_id", "boi_token_index", "image_bos_token_id")
END_KEYS = ("vision_end_token_id", "image_end_token_id", "eoi_token_id", "eoi_token_index")
# families placing an image's features at the True entries of a (B, L) mask, not at token ids
POSITION_MASKS = MappingProxyType({"kosmos-2": "image_embeds_position_mask", "kosmos-2.5": "image_embeds_position_mask"})
TOKEN_TYPE_IMAGE = frozenset({"gemma3", "shieldgemma2"})  # token_type_ids mark the image tokens (Gemma 3's image blocks)


def _vision(config):
    """The image encoder's config: vision_config or vq_config (an encoder-decoder's encoder's), else the config."""
    encoder = getattr(config, "encoder", None)
    found = [getattr(o, n) for o in (config, encoder) for n in ("vision_config", "vq_config")
             if getattr(o, n, None) is not None]
    return found[0] if found else encoder if getattr(encoder, "image_size", None) is not None else config


def _dims(config) -> tuple[int, int, int]:
    """(channels, temporal patch, patch size) of the vision config."""
    v = _vision(config)
    t = getattr(v, "temporal_patch_size", None) or getattr(v, "patch_temporal", None) or 1
    return getattr(v, "in_channels", None) or getattr(v, "num_channels", None) or 3, t, v.patch_size


def qwen_pixels(config, g: torch.Generator) -> dict:
    """Qwen-style image inputs: (SIDE*SIDE, C*T*P*P) flattened patches and image_grid_thw [[1, SIDE, SIDE]]."""
    c, t, p = _dims(config)
    return dict(pixel_values=torch.randn(SIDE * SIDE, c * t * p * p, generator=g),
                image_grid_thw=torch.tensor([[1, SIDE, SIDE]]))


def plain_pixels(config, g: torch.Generator) -> dict:
    """(1, C, H, W) pixel_values at the vision config's image_size (else SIDE patches)."""
    v = _vision(config)
    p = getattr(v, "patch_size", None)
    size = getattr(v, "image_size", None) or getattr(config, "image_size", None) or getattr(v, "resolution", None) \
        or (p if isinstance(p, int) else 14) * SIDE
    h, w = (size, size) if isinstance(size, int) else tuple(size)
    return dict(pixel_values=torch.randn(1, getattr(v, "num_channels", None) or 3, h, w, generator=g))


def image_features_fn(model):
    """The model's ``get_image_features`` (or its inner model's), None when it has none."""
    return next((f for f in (getattr(o, "get_image_features", None) for o in (model, getattr(model, "model", None)))
                 if f is not None), None)


def image_inputs(family: str, model, g: torch.Generator) -> dict:
    """One image as a processor gives it: :data:`RECIPES`, else Qwen-style patches or a (1, C, H, W) image
    (with ``image_sizes`` where get_image_features takes them); ValueError for inputs the forward lacks."""
    if family in RECIPES:
        inputs = RECIPES[family][1](model.config, g)
    else:
        inputs = (qwen_pixels if _accepts(model, "image_grid_thw") else plain_pixels)(model.config, g)
        fn = image_features_fn(model)
        if fn is not None and "image_sizes" in inspect.signature(fn).parameters and inputs["pixel_values"].dim() == 4:
            inputs["image_sizes"] = torch.tensor([list(inputs["pixel_values"].shape[-2:])])
    missing = [name for name in inputs if not _accepts(model, name)]
    if missing:
        raise ValueError(f"the forward takes no {', '.join(missing)}: no image input of this shape")
    return inputs


def count_features(out) -> int:
    """The vectors a get_image_features result holds (its pooler_output, else last_hidden_state)."""
    if not isinstance(out, (tuple, list, torch.Tensor)):
        out = out.pooler_output if getattr(out, "pooler_output", None) is not None else out.last_hidden_state
    if isinstance(out, torch.Tensor):
        return out.numel() // out.shape[-1]
    if isinstance(out, (list, tuple)):
        return sum(count_features(x) for x in out)
    raise TypeError(f"get_image_features returned {type(out).__name__}")


def image_token_count(model, image: dict, probe) -> int:
    """One image's placeholders: rows of the model's ``get_image_features``, else what ``probe(1)`` reports."""
    fn = image_features_fn(model)
    try:
        with torch.no_grad():
            return count_features(fn(**{k: v for k, v in image.items() if k in inspect.signature(fn).parameters}))
    except Exception:  # noqa: BLE001 - no get_image_features, or it needs more: then the mismatch message
        pass
    try:
        with torch.no_grad():
            probe(1)
        return 1
    except Exception as exc:  # noqa: BLE001
        m = re.search(r"tokens:? (\d+), features:? (\d+)", str(exc))
        if not m:
            raise
        return int(m.group(2))


def _type_ids(family: str, model, ids: torch.Tensor, image_id: int | None) -> dict:
    marks = (ids == image_id).long() if image_id is not None else torch.zeros_like(ids)
    out = dict(mm_token_type_ids=marks) if _accepts(model, "mm_token_type_ids") else {}
    if family in TOKEN_TYPE_IMAGE and _accepts(model, "token_type_ids"):
        out["token_type_ids"] = marks
    return out


def _text_ids(g: torch.Generator, shape, avoid: set[int]) -> torch.Tensor:
    """Random ids in the text range of :mod:`.configs`, none of them an id the config names."""
    allowed = torch.tensor([i for i in range(*configs.ID_RANGE) if i not in avoid])
    return allowed[torch.randint(len(allowed), shape, generator=g)]


def image_batch(family: str, model, g: torch.Generator) -> dict:
    """One row with one image: placeholders (or a :data:`POSITION_MASKS` mask) across the first zigzag boundary
    at CP = 2, between the start and end tokens; without an image token id, the image beside a row of text."""
    config = model.config
    start_id, image_id, end_id = (next((v for v in (getattr(config, k, None) for k in keys) if isinstance(v, int)
                                        and not isinstance(v, bool)), None) for keys in (START_KEYS, IMAGE_KEYS,
                                                                                          END_KEYS))
    image, avoid = image_inputs(family, model, g), config_ids(config.to_dict())

    def row(n: int, mark: bool = True) -> dict:
        L = -(-(n + IMAGE_TEXT) // 8) * 8
        ids = _text_ids(torch.Generator().manual_seed(7), (1, L), avoid)
        at = max(2, L // 4 - n // 2)
        if family in POSITION_MASKS:
            mask = torch.zeros_like(ids, dtype=torch.bool)
            mask[0, at:at + n] = True
            return dict(input_ids=ids, **image, **{POSITION_MASKS[family]: mask})
        if mark:
            ids[0, at:at + n] = image_id
            ids[0, at - 1] = ids[0, at - 1] if start_id is None else start_id
            ids[0, at + n] = ids[0, at + n] if end_id is None else end_id
        return dict(input_ids=ids, **image, **_type_ids(family, model, ids, image_id if mark else None))

    if family in POSITION_MASKS:
        return row(config.latent_query_num)
    return row(image_token_count(model, image, lambda k: call(model, row(k)))) if image_id is not None else \
        row(8, mark=False)


def make_batch(family: str, kind: str, model) -> dict:
    """The batch of ``kind``: two rows of text, or :func:`image_batch`; then :data:`BATCH_FIXES`."""
    g = torch.Generator().manual_seed(1234)
    if kind == "text":
        ids = _text_ids(g, (TEXT_B, TEXT_L), config_ids(model.config.to_dict()))
        batch = dict(input_ids=ids, **_type_ids(family, model, ids, None))
    else:
        batch = image_batch(family, model, g)
    return BATCH_FIXES[family][1](batch) if family in BATCH_FIXES else batch


def _decoder_ids(rename: bool = False):
    """A fix giving an encoder-decoder the row as its decoder's ids too (``rename``: instead of input_ids)."""
    return lambda b: dict(b, decoder_input_ids=(b.pop("input_ids") if rename else b["input_ids"]).clone())


BATCH_FIXES: Mapping[str, tuple[str, object]] = MappingProxyType({  # {family: (reason, function(batch) -> batch)}
    "idefics": ("its cross-attention reads which images each token sees", lambda b: dict(
        b, image_attention_mask=torch.ones(*b["input_ids"].shape, 1, dtype=torch.long)) if "pixel_values" in b else b),
    "pix2struct": ("an encoder-decoder over image patches: the text is its decoder's ids", _decoder_ids(True)),
    "pp_formulanet": ("an encoder-decoder: the row is its decoder's ids too", _decoder_ids()),
    "t5gemma2": ("an encoder-decoder: the row is its decoder's ids too", _decoder_ids()),
    "udop": ("an encoder-decoder over a layout: every token's bounding box, the row as the decoder's ids too",
             lambda b: dict(_decoder_ids()(b), bbox=torch.zeros(*b["input_ids"].shape, 4))),
    "vision-encoder-decoder": ("an encoder-decoder over the image: the text is its decoder's ids", _decoder_ids(True)),
})


def _rows(config, g, lead=(1,), width=None) -> torch.Tensor:
    """SIDE x SIDE flattened patches (lead..., SIDE*SIDE, C*P*P or ``width``)."""
    return torch.randn(*lead, SIDE * SIDE, width or _dims(config)[0] * _dims(config)[2] ** 2, generator=g)


def _square(v) -> int:
    """The side of a square image for the vision config ``v`` (its image_size, else SIDE patches)."""
    return v.image_size if isinstance(getattr(v, "image_size", None), int) else v.patch_size * SIDE


def _gemma4(config, g, pool: int = 1) -> dict:
    """Gemma 4's patches (1, N, C*(P*pool)^2), pooled ``pool`` x ``pool`` by the processor, with positions."""
    side, p = SIDE // pool, config.vision_config.patch_size * pool
    return dict(pixel_values=torch.randn(1, side * side, 3 * p * p, generator=g),
                image_position_ids=torch.cartesian_prod(*[torch.arange(side)] * 2).flip(-1)[None])


def _tiles(c, g, mask_shape=None) -> dict:
    """One image as one tile (1, 1, C, H, W), with its pixel mask (or a mask of ``mask_shape``)."""
    s = _square(c.vision_config)
    return dict(pixel_values=torch.randn(1, 1, 3, s, s, generator=g),
                pixel_attention_mask=torch.ones(*(mask_shape or (1, 1, s, s)), dtype=torch.bool))


_TILES = ("its processor splits an image into tiles: (1, tiles, C, H, W) with a pixel mask", _tiles)
_ANYRES = ("any-resolution: a base view plus tiles (1, 1 + tiles, C, H, W), and image_sizes", lambda c, g: dict(
    pixel_values=torch.randn(1, 2, 3, *[_square(c.vision_config)] * 2, generator=g),
    image_sizes=torch.tensor([[_square(c.vision_config)] * 2])))
_FLAT = ("flattened patches (1, N, 2 + C*P*P): row and column (from 1), then the pixels", lambda c, g: dict(
    flattened_patches=torch.cat([torch.cartesian_prod(*[torch.arange(SIDE)] * 2)[None] + 1.0,
                                 _rows(c, g, width=c.vision_config.patch_embed_hidden_size)], -1)))
_MINICPM = ("the image as one strip of patches (1, C, P, N*P), with its grid target_sizes", lambda c, g: dict(
    pixel_values=torch.randn(1, 3, c.vision_config.patch_size, SIDE * SIDE * c.vision_config.patch_size, generator=g),
    target_sizes=torch.tensor([[SIDE, SIDE]])))
_QWEN_4D = ("patches as (N, C, P, P) images, with image_grid_thw", lambda c, g: dict(
    pixel_values=torch.randn(SIDE * SIDE, _dims(c)[0], *[c.vision_config.patch_size] * 2, generator=g),
    image_grid_thw=torch.tensor([[1, SIDE, SIDE]])))
_QFORMER = ("an image (a clip of 4 frames) and the instruction's ids for its Q-Former", lambda c, g: dict(
    pixel_values=plain_pixels(c, g)["pixel_values"] if c.model_type == "instructblip" else
    plain_pixels(c, g)["pixel_values"].unsqueeze(1).expand(1, 4, -1, -1, -1).clone(),
    qformer_input_ids=torch.randint(3, 60, (1, 8), generator=g)))
RECIPES: Mapping[str, tuple[str, object]] = MappingProxyType({  # {family: (reason, function(config, g) -> image inputs)}
    "deepseek_vl_hybrid": ("a low- and a high-resolution view of the image", lambda c, g: dict(
        plain_pixels(c, g), high_res_pixel_values=torch.randn(1, 3, *[_square(c.high_res_vision_config)] * 2,
                                                             generator=g))),
    "fuyu": ("patches (1, N, C*P*P)", lambda c, g: dict(pixel_values=_rows(c, g))),
    "gemma4": ("patches (1, N, C*P*P) with their (x, y) positions", _gemma4),
    "gemma4_unified": ("pooled patches (1, N, C*(P*k)^2) with their (x, y) positions",
                       lambda c, g: _gemma4(c, g, c.vision_config.pooling_kernel_size)),
    "granite_docling": ("tiles (1, tiles, C, H, W) with a tile mask (1, tiles)", lambda c, g: _tiles(c, g, (1, 1))),
    "idefics": ("(1, images, C, H, W)", lambda c, g: dict(pixel_values=plain_pixels(c, g)["pixel_values"][None])),
    "idefics2": _TILES, "idefics3": _TILES, "smolvlm": _TILES,
    "instructblip": _QFORMER, "instructblipvideo": _QFORMER,
    "kimi_k25": _QWEN_4D, "paddleocr_vl": _QWEN_4D,
    "kosmos-2.5": _FLAT, "pix2struct": _FLAT,
    "lfm2_vl": ("SigLIP2 patches (1, N, C*P*P) with spatial_shapes and a patch mask", lambda c, g: dict(
        pixel_values=_rows(c, g), spatial_shapes=torch.tensor([[SIDE, SIDE]]),
        pixel_attention_mask=torch.ones(1, SIDE * SIDE, dtype=torch.bool))),
    "llava_next": _ANYRES, "llava_next_video": _ANYRES, "llava_onevision": _ANYRES, "granite4_vision": _ANYRES,
    "minicpm_ocr": _MINICPM, "minicpmv4_6": _MINICPM, "minicpmv4_7": _MINICPM,
    "mllama": ("tiles (1, images, max tiles, C, H, W) with aspect-ratio ids and mask", lambda c, g: dict(
        pixel_values=torch.randn(1, 1, c.vision_config.max_num_tiles, 3, *[_square(c.vision_config)] * 2, generator=g),
        aspect_ratio_ids=torch.tensor([[1]]),
        aspect_ratio_mask=(torch.arange(c.vision_config.max_num_tiles) == 0).long().view(1, 1, -1))),
    "nemotron_h_omni": ("patches (N, C*P*P) with their grid image_grid_hw", lambda c, g: dict(
        pixel_values=_rows(c, g, lead=()), image_grid_hw=torch.tensor([[SIDE, SIDE]]))),
    "video_llama_3": ("Qwen-style patches with image_grid_thw and image_merge_sizes", lambda c, g: dict(
        qwen_pixels(c, g), image_merge_sizes=torch.tensor([2]))),
})


# ---- runs ----

NOISY_FACTOR = 5.0
NOISY: Mapping[str, str] = MappingProxyType({  # {family: why}: float32 rounding beyond the gradient bound of compare (NOISY_FACTOR x it)
    "muse_spark": "float32 rounding: on the image batch sdpa differs from eager by 4.0e-5 of the gradient's scale "
                  "(layer 0's q_proj), cp_flash at world size 1 by the same 4.0e-5 (float64 cannot run its grouped "
                  "matmul to say more)",
    "gemma4": "float32 rounding: on the image batch one-device eager in float32 differs from eager in float64 by "
              "1.5e-5 of the embedding gradient's scale (sdpa from eager by 6.4e-6), cp_flash at CP = 2 by 1.1e-5",
})


def noisy(family: str, rec: dict) -> dict:
    """An outcome record, "wrong" made "exact" for a family of :data:`NOISY` within its gradient bound."""
    if rec["outcome"] == "wrong" and family in NOISY and rec["finite"] and rec["logit_err"] <= TOL and \
            rec["grad_err"] <= NOISY_FACTOR * grad_tol(rec["grad_scale"]):
        rec["outcome"] = "exact"
    return rec


def run_plain(model, inputs: dict, R: torch.Tensor | None = None):
    """The batch on one device, no context: (logits, flat gradients of sum(logits * R), R, drawn if None)."""
    model.zero_grad(set_to_none=True)
    logits = call(model, inputs)
    R = torch.randn(*logits.shape, generator=torch.Generator().manual_seed(4321)) if R is None else R
    (logits * R).sum().backward()
    return logits.detach(), flat_grads(model), R


def _rank_worker(rank: int, world_size: int, family: str, state_dict: dict, cases: dict):
    """A CP rank, per kind of ``cases`` ({kind: (inputs, R)}): {kind: numpy (gathered logits, gradients summed
    over the ranks) on rank 0, or an error record}, from the cp_flash model with the eager weights."""
    model, out = build_model(family, tiny_config(family), "cp_flash", state_dict), {}
    for kind, (inputs, R) in cases.items():
        model.zero_grad(set_to_none=True)
        try:
            with cp_attention.context_parallel(layout="zigzag") as cp:
                local = cp.shard_batch(**inputs, model=model)
                result = model(**local, use_cache=False)
                logits = result.logits if hasattr(result, "logits") else result[0]
                (logits * cp.shard(R, dim=1)).sum().backward()
                logits = cp.gather(logits.detach(), dim=1)
            grads = flat_grads(model)
            dist.all_reduce(grads)
            out[kind] = (logits.numpy(), grads.numpy()) if rank == 0 else "ok"
        except Exception as exc:  # noqa: BLE001 - the outcome
            out[kind] = dict(outcome="refused" if isinstance(exc, NotImplementedError) else "crash",
                             **error_record(exc))
    return out


def run_cp(family: str, state_dict: dict, cases: dict, refs: dict, spans) -> dict:
    """{kind: outcome record} of CP = 2: two gloo ranks (:func:`_rank_worker`), every kind of ``cases``."""
    try:
        per_rank = run_ranks(2, _rank_worker, family, state_dict, cases, timeout=RANK_TIMEOUT)
    except Exception as exc:  # noqa: BLE001 - a rank died or hung
        text, body = str(exc).strip(), re.search(r"rank \d+: (\w+): (.*)", str(exc))
        return {kind: dict(outcome="timeout" if "did not finish" in text else "crash",
                           error_type=body.group(1) if body else type(exc).__name__,
                           message=(body.group(2) if body else text.split("\n")[0])[:300]) for kind in cases}
    errors = {kind: next((r[kind] for r in per_rank if isinstance(r[kind], dict)), None) for kind in cases}
    return {kind: errors[kind] or noisy(family, classify(diffs(*map(torch.from_numpy, per_rank[0][kind]),
                                                                     refs[kind]["logits"], refs[kind]["grads"], spans)))
            for kind in cases}


def run_family(family: str) -> dict:
    """One family here: {family, outcomes: {slot: record}, seconds}; eager must repeat itself exactly."""
    torch.set_num_threads(1)
    t0, res, cases, refs = time.monotonic(), dict(family=family, outcomes={}), {}, {}

    def unbuildable(slots, stage: str, exc: BaseException) -> None:
        res["outcomes"].update({slot: dict(outcome="unbuildable", stage=stage, **error_record(exc)) for slot in slots})

    try:
        config = tiny_config(family)
        eager = build_model(family, config, "eager")
    except Exception as exc:  # noqa: BLE001
        unbuildable(SLOTS, "tiny model", exc)
    for kind in KINDS if not res["outcomes"] else ():
        stage = f"{kind} batch"
        try:
            inputs = make_batch(family, kind, eager)
            stage = f"eager on the {kind} batch"
            with indexer_ties_to_earliest(eager):  # index-sparse families: cp_flash's rule for ties at the k-th place
                logits, grads, R = run_plain(eager, inputs)
                again = run_plain(eager, inputs, R)[0]
            if not torch.equal(logits, again):
                raise RuntimeError("eager gives different logits on the same batch (not deterministic)")
            cases[kind], refs[kind] = (inputs, R), dict(logits=logits, grads=grads)
        except Exception as exc:  # noqa: BLE001
            unbuildable([f"{kind}/{ws}" for ws in WORLDS], stage, exc)
    if cases:
        state_dict = {k: v.detach().clone() for k, v in eager.state_dict().items()}
        spans = param_spans(eager)
        try:
            cp_model = build_model(family, config, "cp_flash", state_dict)
        except Exception as exc:  # noqa: BLE001
            res["outcomes"].update({f"{k}/{ws}": dict(classify(exc=exc), stage="cp_flash model build")
                                    for k in cases for ws in WORLDS})
            cases = {}
        for kind, (inputs, R) in cases.items():
            res["outcomes"][f"{kind}/1"] = noisy(family, compare_or_error(
                lambda: run_plain(cp_model, inputs, R)[:2], refs[kind]["logits"], refs[kind]["grads"], spans))
        if cases:
            res["outcomes"].update({f"{k}/2": r for k, r in run_cp(family, state_dict, cases, refs, spans).items()})
    return dict(res, seconds=round(time.monotonic() - t0, 1))


# ---- the CLI (one subprocess per family) ----

def run_subprocess(family: str, timeout: float) -> dict:
    """:func:`run_family` in a process of its own (:func:`.runner.run_isolated`); a timeout or a
    process that died is the family's outcome in every slot."""
    result, failure, seconds = runner.run_isolated(MODULE, ["--one", family], timeout)
    if result is not None:
        return result
    return dict(family=family, outcomes={slot: failure for slot in SLOTS}, seconds=seconds)


def record(results: list[dict]) -> dict:
    """The JSON record of a sweep: what ``--json`` writes and ``--from`` reads."""
    import transformers

    return dict(transformers=transformers.__version__, results=results)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    p.add_argument("--families", default="", help="comma-separated (default: every image-text-to-text family)")
    p.add_argument("--json", default="", help="write the results here (as they come)")
    p.add_argument("--page", default="",
                   help="write the support page here (docs/supported_vlms.md; as the results come)")
    p.add_argument("--from", dest="source", default="",
                   help="run nothing: take the results from this record (a --json output) for --page")
    p.add_argument("--jobs", type=int, default=2, help="families at a time (at most 2)")
    p.add_argument("--timeout", type=float, default=FAMILY_TIMEOUT, help="seconds per family")
    p.add_argument("--one", default="", help=argparse.SUPPRESS)  # internal: one family in this process
    args = p.parse_args(argv)
    if args.page and not (args.json or args.source):
        p.error("--page needs the record it is rendered from: --json (a run) or --from")
    if args.one:
        try:
            res = run_family(args.one)
        except Exception as exc:  # noqa: BLE001 - recorded, never lost
            rec = dict(outcome="crash", **error_record(exc), traceback=traceback.format_exc()[-2000:])
            res = dict(family=args.one, outcomes={slot: rec for slot in SLOTS})
        with open(args.json, "w") as f:
            json.dump(jsonable(res), f, indent=1)
        return 0
    if args.source:
        with open(args.source) as f:
            rec = json.load(f)
        if args.page:
            runner.write_atomic(args.page, vlm_page(rec, args.source, args.page))
        return 0
    names = [f for f in args.families.split(",") if f] or families()
    results: dict = {}
    t0 = time.monotonic()

    def done(name, r):
        results[name] = r
        outs = " ".join(f"{slot}={rec['outcome']}" for slot, rec in r["outcomes"].items())
        print(f"[{len(results)}/{len(names)} {time.monotonic() - t0:.0f}s] {name}: {outs} ({r.get('seconds')}s)",
              flush=True)
        ordered = record([results[n] for n in names if n in results])
        if args.json:
            runner.write_atomic(args.json, json.dumps(ordered, indent=1))
        if args.page:
            runner.write_atomic(args.page, vlm_page(ordered, args.json, args.page))

    runner.run_all(names, lambda name: run_subprocess(name, args.timeout), args.jobs, done)
    return 0


if __name__ == "__main__":
    sys.exit(main())
