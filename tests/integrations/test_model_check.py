"""The model check (issue 19): a model that cp_flash cannot run exactly under context parallelism is
refused on every rank, naming the family, the module and why, before a K/V block moves; a forward in
which an attention layer did not reach cp_flash raises on every rank; a CPMask never stands in for a
dense mask silently; name-selected attention classes never pick a FlashAttention-2 class for cp_flash;
RoBERTa-style default positions; ranks of a sampler loop given different batches raise together.

Oracles: the documented semantics of each operation (a convolution, a recurrent state... reads other
tokens, a pointwise one does not), and for the exact cases each document run alone under eager.
"""

from __future__ import annotations

import copy
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cp_attention
from cp_attention.integrations.hf import check as model_check
from cp_attention.integrations.hf import models, positions
from cp_attention.integrations.hf.masks import CPMask
from cp_attention.integrations.hf.registry import is_modeling_module
from cp_attention.tools.launch import run_ranks

from cp_attention.tools.sweeps import family as sweep
from cp_attention.tools.sweeps.configs import build_model, tiny_config

pytestmark = [pytest.mark.multirank, pytest.mark.transformers]  # spawns gloo ranks; builds transformers models

warnings.filterwarnings("ignore", category=FutureWarning)


@pytest.fixture(autouse=True)
def fresh_traces():
    """Each test's models traced afresh (the trace is memoised per class, configuration, dtype and module
    tree, and the planted modules below share their class)."""
    from cp_attention.integrations.hf import state

    state.TRACED.clear()
    yield
    state.TRACED.clear()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _model(family: str, implementation: str = "eager", seed: int = 0):
    torch.manual_seed(seed)
    return build_model(tiny_config(family), implementation)


MIXING, REFUSED_FORWARD = "token mixing outside the calls run across ranks", "a forward cp_flash refuses"
REFUSED = {  # family -> what the check must report (from each family's documented structure)
    "openai-gpt": {MIXING},  # attention computed in its own class, outside the interface
    "xlnet": {MIXING},  # relative attention of its own
    "bloom": {REFUSED_FORWARD},  # adds its ALiBi to the mask as a dense tensor
    "inkling_text": {REFUSED_FORWARD},  # hands its attention a (query, key) position bias
    "bart": {"positions computed from the shard"},
    "minimax_m3_vl_text": {REFUSED_FORWARD},  # its key-block indexer's selection is not adapted
}
EXACT = ("llama", "mistral", "qwen2_moe", "gemma3_text", "gpt2", "deepseek_v3", "roberta", "gpt_oss", "llama4_text",
         "phimoe", "gpt_neox",
         "qwen3_next", "lfm2_moe", "jamba", "nemotron_h",  # hybrids: their mixers run across ranks (issue 21)
         "deepseek_v32", "hy_v4", "deepseek_v4",  # index-sparse: adapted indexers and compressors (issue 38)
         # issue 39: pure state-space models (no positions read), KDA, mixers computed in their classes, Zamba
         "mamba", "mamba2", "falcon_mamba", "kimi_linear", "bailing_hybrid", "minimax", "recurrent_gemma", "zaya",
         "zamba", "rwkv", "xlstm")


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_refused_families_are_found(family):
    model = _model(family, "cp_flash")
    found = {f.what for f in model_check.model_findings(model)}
    assert REFUSED[family] <= found, found
    with pytest.raises(NotImplementedError) as info:
        model_check.check_model(model)
    message = str(info.value)
    assert family in message and type(model).__name__ in message and "context_parallel" in message
    assert all(what in message for what in REFUSED[family])


@pytest.mark.parametrize("family", EXACT)
def test_exact_families_have_no_findings(family):
    assert model_check.model_findings(_model(family, "cp_flash")) == ()


class _Plant(nn.Module):
    """A module the library has never seen: ``inner`` (a layer's MLP or mixer) and then ``op`` on its output
    (B, L, D), added to it."""

    def __init__(self, inner, op):
        super().__init__()
        self.inner, self.op = inner, op

    def forward(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        y = out[0] if isinstance(out, tuple) else out
        y = y + self.op(y)
        return (y, *out[1:]) if isinstance(out, tuple) else y


class _Conv(nn.Module):  # a depthwise convolution along the tokens (kernel ``k``)
    def __init__(self, width: int, k: int):
        super().__init__()
        self.conv = nn.Conv1d(width, width, kernel_size=k, groups=width, padding=k // 2)

    def forward(self, y):
        return self.conv(y.transpose(1, 2)).transpose(1, 2)[:, :y.shape[1]]


def _loop(y):  # a recurrent state carried in a loop of the model's own
    state, out = torch.zeros_like(y[:, 0]), []
    for i in range(y.shape[1]):
        state = 0.5 * state + y[:, i]
        out.append(state)
    return torch.stack(out, 1)


_WEIGHT = torch.randn(8, 8, generator=torch.Generator().manual_seed(0)) / 8
PLANTS = {  # name -> (op on (B, L, D), mixes tokens, the operation the finding names)
    "convolution": (lambda width: _Conv(width, 3), True, "conv1d"),
    "pointwise convolution": (lambda width: _Conv(width, 1), False, None),
    "token shift (padding module)": (lambda width: nn.ZeroPad2d((0, 0, 1, -1)), True, None),
    "running sum": (lambda width: lambda y: y.cumsum(1), True, "cumsum"),
    "recurrent state in a loop": (lambda width: _loop, True, None),
    "attention of its own": (lambda width: lambda y: torch.softmax(y @ y.transpose(-1, -2), -1) @ y, True, "matmul"),
    # Zamba's per-head projections: a weight times an activation, transposed and back: per token
    "weight product, transposed": (lambda width: lambda y: (_WEIGHT[:, :1] @ y[..., :1].transpose(-1, -2))
                                   .transpose(-1, -2).expand_as(y), False, None),
    "per-token gate": (lambda width: lambda y: -torch.exp(y.mean(-1, keepdim=True)) * F.softplus(y), False, None),
}


@pytest.mark.parametrize("name", sorted(PLANTS))
def test_planted_operations_are_found_by_what_they_do(name):
    """Each kind of operation, planted after an exact family's MLP (llama): the trace finds those that mix
    tokens, naming the module (and the operation where it is one torch call), and passes those that do not."""
    make, mixes, op = PLANTS[name]
    model = _model("llama", "cp_flash")
    layer = model.model.layers[0]
    layer.mlp = _Plant(layer.mlp, make(model.config.hidden_size))
    found = model_check.model_findings(model)
    assert bool(found) == mixes, found
    if mixes:
        assert len(found) == 1 and found[0].module.startswith("model.layers.0.mlp") and found[0].what == MIXING, found
        assert op is None or f"operation doing it: {op} at test_model_check.py" in found[0].why, found[0].why


def test_mobilebert_trigram_input_is_a_token_shift():
    """A token shift written inline: MobileBERT's trigram input (its embeddings read each token's neighbours
    through a shifted slice); without it the family is exact."""
    import transformers as tf

    def findings(trigram: bool):
        config = tf.MobileBertConfig(vocab_size=64, hidden_size=32, embedding_size=16, intermediate_size=32,
                                     num_hidden_layers=1, num_attention_heads=4, intra_bottleneck_size=32,
                                     true_hidden_size=32, trigram_input=trigram)
        return model_check.model_findings(tf.MobileBertForMaskedLM._from_config(config, attn_implementation="cp_flash"))

    found = findings(True)
    assert [(f.module, f.what) for f in found] == [("mobilebert.embeddings", MIXING)], found
    assert "modeling_mobilebert.py" in found[0].why and "inputs_embeds[:, 1:]" in found[0].why
    assert findings(False) == ()


@pytest.mark.parametrize("op, mixes", [
    (lambda y: y.cumsum(1) * 0.1, True),  # a running sum of the mixer's output, in the model's own code
    (lambda y: torch.cat([torch.zeros_like(y[:, :1]), y[:, :-1]], 1), True),  # a token shift by slicing
    (lambda y: -torch.exp(y.mean(-1, keepdim=True)) * F.softplus(y), False),  # KDA-like gate: per token
])
def test_operations_around_an_adapted_mixer_are_read(op, mixes):
    """A hybrid's gated-DeltaNet mixer (its convolution and recurrence through the adapted functions, which
    the trace lets answer per token) with an operation of the model's own on its output: found when it mixes
    tokens (the adapted functions' outputs are per token, not zeros, so what follows them is read)."""
    model = _model("qwen3_next", "cp_flash")
    layer = next(layer for layer in model.model.layers if hasattr(layer, "linear_attn"))
    layer.linear_attn = _Plant(layer.linear_attn, op)
    found = model_check.model_findings(model)
    assert bool(found) == mixes, found
    assert not mixes or found[0].module.endswith("linear_attn"), found


def test_positions_rule_refuses_only_models_that_use_positions():
    """A model of mixers alone whose forward takes no position_ids (Mamba) is not refused for positions; with
    a positional module planted (a learned position embedding), it is, and so is a packed one-rank batch."""
    model = _model("mamba")
    assert "position_ids" not in positions._forward_args(type(model))
    assert not positions.uses_positions(model) and model_check.model_findings(model) == ()
    model.backbone.embed_positions = nn.Embedding(64, model.config.hidden_size)
    assert positions.positional_modules(model) == ("backbone.embed_positions",)
    assert "positions computed from the shard" in {f.what for f in model_check.model_findings(model)}
    ids, pos = sweep.make_inputs()
    with cp_attention.context_parallel() as cp:
        record = cp.shard_batch(input_ids=ids, position_ids=pos)
        with pytest.raises(NotImplementedError, match="takes no position_ids"):
            model_check.check_positions_one_rank(model, cp.current_batch())
        del record
    # an attention layer reads positions too: the BART-family decoders stay refused
    assert positions.uses_positions(_model("bart"))


# ----------------------------------------------------------------------------------------------
# multi-rank: refused together before K/V moves; the second guard


def _count_layer_calls():
    from cp_attention.integrations.hf import attention as adapter

    calls = []
    original = adapter.attend_layer

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    adapter.attend_layer = counting
    return calls


def _refused_worker(rank, world_size, family):
    calls = _count_layer_calls()
    model = _model(family, "cp_flash")
    ids, pos = sweep.make_inputs()
    with cp_attention.context_parallel(timeout=60) as cp:
        batch = cp.shard_batch(input_ids=ids, position_ids=pos)
        if "position_ids" not in sweep.forward_kwargs(model) or not sweep.forward_kwargs(model)["position_ids"]:
            batch.pop("position_ids")
        try:
            model(**batch)
            return None, len(calls)
        except NotImplementedError as exc:
            return str(exc), len(calls)


@pytest.mark.parametrize("family", ["openai-gpt", "bart"])
def test_refused_on_every_rank_before_any_layer_runs(family):
    for message, layer_calls in run_ranks(2, _refused_worker, family, timeout=240):
        assert message is not None and family in message and "context parallelism" in message, message
        assert layer_calls == 0  # no attention layer ran: no K/V block moved


def _bypass_worker(rank, world_size, bypass: bool, twice: bool = False):
    model = _model("llama", "cp_flash")
    if bypass:  # one layer computes its attention itself (as a name-selected class would)
        attn = model.model.layers[1].self_attn
        attn.forward = lambda hidden_states, **kw: (hidden_states * 0.5, None)
    if twice:  # one layer calls the interface twice (DiffLlama's differential attention does)
        attn0 = model.model.layers[0].self_attn
        original = attn0.forward

        def forward_twice(*args, **kw):
            original(*args, **kw)
            return original(*args, **kw)

        attn0.forward = forward_twice
    ids, pos = sweep.make_inputs()
    with cp_attention.context_parallel(timeout=60) as cp:
        batch = cp.shard_batch(input_ids=ids, position_ids=pos)
        try:
            logits = model(**batch, use_cache=False).logits  # no cache: a layer called twice appends no keys
            return float(logits.sum())
        except NotImplementedError as exc:
            return str(exc)


@pytest.mark.parametrize("twice", [False, True], ids=["once", "another-layer-twice"])
def test_a_layer_that_does_not_reach_cp_flash_raises_on_every_rank(twice):
    """Counted per module: a bypassing layer is found also when another layer calls cp_flash twice
    (so that the number of calls matches the number of layers)."""
    for out in run_ranks(2, _bypass_worker, True, twice, timeout=240):
        found = re.search(r"(\d+) attention layer\(s\) of llama .* but (\d+) of them did not reach cp_flash",
                          str(out))
        assert found and int(found[1]) >= 2 and int(found[2]) == 1, out
    for out in run_ranks(2, _bypass_worker, False, twice, timeout=240):
        assert isinstance(out, float), out  # every layer reached cp_flash, one of them twice: no refusal


# ----------------------------------------------------------------------------------------------
# CPMask, name-selected classes, positions, autocast


def test_cpmask_is_never_a_silent_tensor():
    mask = CPMask(batch_size=1, q_length=4, kv_length=4, q_offset=0, kv_offset=0, valid=None, opens=None,
                  family="bloom")
    assert mask.ndim == 4 and mask.contiguous() is mask and mask.q_length == 4
    uses = (lambda: torch.zeros(4) + mask, lambda: mask + 1, lambda: 1.0 + mask, lambda: 2 * mask, lambda: mask[..., :2], lambda: mask.size(),
            lambda: mask.to(torch.float32), lambda: mask.dtype, lambda: torch.where(mask, 1.0, 0.0),
            lambda: torch.cat([mask]))
    for use in uses:
        with pytest.raises(NotImplementedError, match="bloom's modeling code uses the attention mask as a dense"):
            use()
    assert not hasattr(mask, "__array__")  # protocols stay plain AttributeErrors


def _name_selected_modules() -> list[str]:
    """Every transformers modeling module that selects attention by implementation name: a by-name
    import of is_flash_attention_requested, or a table of classes keyed by "eager"."""
    import transformers

    root = Path(transformers.__file__).parent / "models"
    found = []
    for path in sorted(root.glob("*/modeling_*.py")):
        text = path.read_text()
        if "is_flash_attention_requested" in text or ('"eager":' in text and "_CLASSES" in text):
            found.append(f"transformers.models.{path.parent.name}.{path.stem}")
    return found


def test_every_name_selecting_modeling_module_is_adapted():
    import importlib

    from cp_attention.integrations.hf.registry import adapted_sites

    modules = _name_selected_modules()
    assert len(modules) > 20
    for name in modules:
        assert is_modeling_module(name)
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - an optional dependency of that model (timm, ...)
            continue
    adapted = set(adapted_sites())
    missed = [name for name in modules if name in sys.modules and name not in adapted
              and hasattr(sys.modules[name], "is_flash_attention_requested")]
    assert not missed


@pytest.mark.parametrize("family", ["falcon", "gpt_neo", "git"])
def test_name_selected_classes_never_pick_flash_attention_2(family):
    model = _model(family, "cp_flash")
    classes = {type(m).__name__ for m in model.modules()}
    assert not any("Flash" in name for name in classes), classes
    ids, pos = sweep.make_inputs()
    try:  # on one device: the family's own attention class, or a clear refusal
        model(input_ids=ids)
    except NotImplementedError as exc:
        assert family in str(exc)


def _default_positions_model(family: str, implementation: str):
    """RoBERTa (positions from padding_idx + 1, through its attention interface) or MRA's token classifier
    (from 2, its ``position_ids`` buffer; its attention, which never reaches cp_flash, is zeros on CPU)."""
    if family == "roberta":
        return _model("roberta", implementation)
    from cp_attention.tools.sweeps import heads as head_sweep

    return head_sweep.build("MraForTokenClassification", head_sweep.tiny_config("mra", "token"), implementation)


def _default_positions_worker(rank, world_size, family: str, with_model: bool):
    model = _default_positions_model(family, "cp_flash")
    ids, _ = sweep.make_inputs()
    starts = torch.zeros_like(ids, dtype=torch.bool)
    offsets = torch.tensor(sweep.DOCS).cumsum(0)[:-1]
    starts[0, offsets] = True
    with cp_attention.context_parallel(timeout=60) as cp:
        batch = cp.shard_batch(input_ids=ids, document_starts=starts, model=model if with_model else None)
        try:
            return cp.gather(model(**batch).logits.detach(), dim=1).tolist()
        except NotImplementedError as exc:
            return str(exc)


@pytest.mark.parametrize("family", ["roberta", "mra"])
def test_default_positions(family):
    """A model numbering its default positions from 2 (RoBERTa's padding_idx + 1; MRA's kept position_ids,
    whose attention never reaches cp_flash): with model= shard_batch numbers them as the model does (each
    document alone with its own default positions), without it the forward is refused on every rank."""
    eager = _default_positions_model(family, "eager")
    ids, _ = sweep.make_inputs()
    start, pieces = 0, []
    for n in sweep.DOCS:  # each document alone, with the model's own default positions
        pieces.append(eager(input_ids=ids[:, start:start + n]).logits.detach())
        start += n
    truth = torch.cat(pieces, dim=1)
    for out in run_ranks(2, _default_positions_worker, family, True, timeout=240):
        assert (torch.tensor(out) - truth).abs().max() < 1e-4
    for out in run_ranks(2, _default_positions_worker, family, False, timeout=240):
        assert isinstance(out, str) and "numbers its default positions from" in out and "position_ids" in out, out


def test_mixed_dtypes_under_autocast():
    """A float32 model under bfloat16 autocast hands cp_flash float32 q/k (RoPE upcasts) and bfloat16
    v: computed in the autocast dtype, as sdpa does."""
    ids, _ = sweep.make_inputs()
    out = {}
    for implementation in ("sdpa", "cp_flash"):
        model = _model("llama", implementation)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out[implementation] = model(input_ids=ids).logits.float()  # one document
    assert (out["sdpa"] - out["cp_flash"]).abs().max() < 2e-2


# ----------------------------------------------------------------------------------------------
# ranks of a sampler loop (what accelerator.prepare(dataloader) builds) given different batches


def _sampler_worker(rank, world_size):
    from torch.utils.data import DataLoader, DistributedSampler

    torch.manual_seed(0)
    model = _model("llama", "cp_flash")
    data = [torch.randint(3, 100, (44,), generator=torch.Generator().manual_seed(i)) for i in range(8)]
    loader = DataLoader(data, batch_size=1, sampler=DistributedSampler(data, num_replicas=world_size, rank=rank,
                                                                        shuffle=False))
    with cp_attention.context_parallel(timeout=60) as cp:
        for ids in loader:
            try:
                model(**cp.shard_batch(input_ids=ids, labels=ids.clone()))
                return None
            except ValueError as exc:
                return str(exc)


def test_a_sampler_loop_handing_ranks_different_batches_raises_on_every_rank():
    for message in run_ranks(2, _sampler_worker, timeout=240):
        assert message is not None and "given different batches" in message and "sampler" in message, message


# ----------------------------------------------------------------------------------------------
# world size 1: cp_flash computes what the family's own eager computes, or refuses


def _logits(model, ids, pos=None):
    kwargs = {"position_ids": pos} if pos is not None else {}
    out = model(input_ids=ids, use_cache=False, **kwargs)
    return out.logits


def test_a_layer_declared_bidirectional_follows_its_causal_mask():
    """BigBird-Pegasus's decoder leaves its attention's ``is_causal`` at the default False and hands
    it a causal mask, which eager follows: cp_flash (which reads bidirectional layers from that
    flag, ModernBERT's) must follow the mask too."""
    eager = _model("bigbird_pegasus")
    cp_model = build_model(tiny_config("bigbird_pegasus"), "cp_flash", eager.state_dict())
    assert not any(getattr(m, "is_causal", True) for m in cp_model.modules() if hasattr(m, "is_causal"))
    ids = torch.randint(3, 96, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        err = float((_logits(cp_model, ids) - _logits(eager, ids)).abs().max())
    assert err <= 1e-5, err


def test_score_tensors_handed_to_the_attention_are_refused():
    """Inkling hands its attention a relative-position ``position_bias`` (a tensor over (query, key)
    pairs) through the interface's keywords: the model check's trace finds it (cp_flash's refusal of the
    call, raised in the traced forward), and at world size 1 (no check there) the cp_flash layer raises
    instead of dropping it."""
    findings = model_check.model_findings(_model("inkling_text", "cp_flash"))
    assert any(f.what == REFUSED_FORWARD and "'position_bias'" in f.why and "score bias" in f.why for f in findings)
    model = _model("inkling_text", "cp_flash")
    ids = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(0))
    with pytest.raises(NotImplementedError, match="'position_bias'.*score bias"):
        _logits(model, ids)


def test_score_tensors_refused_by_name_whatever_their_shape():
    """Inkling2 hands its attention per-query sinks as ``sinks`` (B, H, Lq, 1): not a (query, key)
    shape, and not cp_flash's own per-head ``s_aux``, so only the name tells it is added to the
    scores; the layer raises instead of dropping it (the same call also hands ``position_bias`` today)."""
    from cp_attention.integrations.hf.attention import cp_flash_attention

    layer = nn.Linear(2, 2)
    q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 1, 5, 8)
    for name, shape in (("sinks", (1, 2, 5, 1)), ("position_bias", (1, 2, 1, 1)), ("alibi", (2, 5))):
        with pytest.raises(NotImplementedError, match=f"'{name}'.*its scores take"):
            cp_flash_attention(layer, q, k, k, None, **{name: torch.zeros(shape)})


def test_selected_keys_handed_to_the_attention_are_refused():
    """MiniMax-M3's sparse layers hand their attention the blocks of keys their indexer chose
    (``block_indices``); cp_flash does not read a selection yet, so on one device and in a one-rank
    block the layer raises instead of attending to every causal key (it returned logits 0.4 off
    eager's before)."""
    from cp_attention.tools.sweeps import configs

    cfg = configs.tiny_config("minimax_m3_vl_text")
    cfg.num_hidden_layers, cfg.layer_types = 3, ["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"]
    cfg.index_block_size, cfg.index_topk_blocks, cfg.index_local_blocks, cfg.index_n_heads = 4, 2, 1, 2
    model = configs.build_model(cfg, "cp_flash")
    ids = torch.randint(3, 96, (1, 32), generator=torch.Generator().manual_seed(0))
    with pytest.raises(NotImplementedError, match="'block_indices'.*selected keys per query"):
        _logits(model, ids)
    with cp_attention.context_parallel() as cp:
        local = cp.shard_batch(input_ids=ids, model=model)
        with pytest.raises(NotImplementedError, match="'block_indices'"):
            model(**local)


@pytest.mark.parametrize("family", ["bigbird_pegasus", "moss_transcribe_diarize"])
def test_one_rank_packed_documents_without_position_ids_are_refused(family):
    """A model whose forward takes no position_ids cannot restart positions at the documents
    cp.shard_batch recorded: a one-rank block refuses a packed batch before any layer runs, and runs
    a batch of one document per row (padding included) as the family's own eager does."""
    eager = _model(family)
    cp_model = build_model(tiny_config(family), "cp_flash", eager.state_dict())
    calls = []
    for m in cp_model.modules():
        if positions.uses_attention_interface(type(m)) and not models.is_model(m):
            m.register_forward_pre_hook(lambda *a: calls.append(1))
    ids, pos = sweep.make_inputs()
    with cp_attention.context_parallel() as cp:
        batch = cp.shard_batch(input_ids=ids, position_ids=pos)
        batch.pop("position_ids")
        with pytest.raises(NotImplementedError, match="packed documents.*takes no position_ids"):
            cp_model(**batch, use_cache=False)
    assert not calls, "refused before any attention layer ran"
    mask = torch.ones_like(ids)
    mask[:, -5:] = 0  # right padding: one-token documents of their own, not packing
    with cp_attention.context_parallel() as cp, torch.no_grad():
        batch = cp.shard_batch(input_ids=ids, attention_mask=mask)
        batch.pop("position_ids")
        got = cp_model(**batch, use_cache=False).logits
        want = eager(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert float((got - want)[:, :-5].abs().max()) <= 1e-5


NUMBER_OWN_POSITIONS = ("bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart", "musicgen",
                        "musicgen_melody", "pegasus", "plbart")


@pytest.mark.parametrize("family", NUMBER_OWN_POSITIONS)
def test_decoders_numbering_their_own_positions_at_world_size_1(family, monkeypatch):
    """Decoders whose models take no position_ids but accept them through keyword arguments: without
    a context, packed position_ids handed to them are not their positions (they number the whole row),
    so cp_flash runs the row as their own eager does (logits and gradients against eager given the same
    call); a collator's cu_seq_lens (documents with the row's positions) are refused. Planted: the
    position_ids read as documents, the result differs from the family's eager."""
    from hf_cases import flat_grads, grad_tol

    eager = _model(family)
    cp_model = build_model(tiny_config(family), "cp_flash", eager.state_dict())
    assert not positions.family_takes_positions(type(cp_model).__module__)
    ids, pos = sweep.make_inputs()
    R = torch.randn(*ids.shape, cp_model.config.get_text_config().vocab_size,
                    generator=torch.Generator().manual_seed(5))

    def run(model):
        model.zero_grad(set_to_none=True)
        logits = _logits(model, ids, pos)
        (logits * R[..., :logits.shape[-1]]).sum().backward()
        return logits.detach(), flat_grads(model)

    (want, want_g), (got, got_g) = run(eager), run(cp_model)
    assert float((got - want).abs().max()) <= 1e-4
    assert float((got_g - want_g).abs().max()) <= grad_tol(float(want_g.abs().max()))
    cu = torch.tensor([0, *torch.tensor(sweep.DOCS).cumsum(0).tolist()], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="number positions over the whole row"):
        cp_model(input_ids=ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(sweep.DOCS),
                 max_length_k=max(sweep.DOCS), use_cache=False)
    monkeypatch.setattr(positions, "family_takes_positions", lambda name: True)
    with torch.no_grad():
        planted = _logits(cp_model, ids, pos)
    assert float((planted - want).abs().max()) > 1e-3


def test_families_taking_positions_keep_them():
    assert positions.family_takes_positions("transformers.models.llama.modeling_llama")
    assert positions.family_takes_positions("transformers.models.gpt2.modeling_gpt2")


def test_m_rope_rows_and_sinusoidal_position_starts():
    """M-RoPE rows handed to a layer as position_ids (GLM-4V, ERNIE-VL) carry no documents (the mask's
    do); a sinusoidal position table with a padding index (Kosmos-2.5) numbers from padding_idx + 1."""
    layer = nn.Linear(2, 2)
    assert positions.layer_position_ids(layer, torch.zeros(3, 1, 5, dtype=torch.long), False) is None
    two_d = torch.arange(5)[None]
    assert positions.layer_position_ids(layer, two_d, False) is two_d

    class Sinusoidal(nn.Module):
        padding_idx = 1

    model = nn.Module()
    model.embed_positions = Sinusoidal()
    assert positions.default_position_start(model) == 2


# ----------------------------------------------------------------------------------------------
# the call hook: a forward's keyword arguments through torch's forward pre-hooks


class _PeftLike(nn.Module):
    """Holds a model as PEFT's PeftModel does: its forward calls the model's ``forward`` directly, past the
    model's own hooks, so only this wrapper's call carries the keyword arguments."""

    def __init__(self, model):
        super().__init__()
        self.base = model
        self.active_peft_config = type("Config", (), {"is_prompt_learning": False})()

    def get_base_model(self):
        return self.base

    def forward(self, **kwargs):
        return self.base.forward(**kwargs)


def test_the_call_hook_reads_the_calls_keyword_arguments(monkeypatch):
    """Every transformers model built after ``import cp_attention`` (and every module holding one: a PEFT-like
    wrapper, torch.compile's) gets the call hook, through which the outermost forward of a block starts with its
    call's own keyword arguments (the dict the forward then runs with); a model built before cp_flash was
    registered is refused in a block, naming the fix, and runs untouched outside one."""
    from cp_attention.integrations.hf import guard

    model = build_model(tiny_config("llama"), "cp_flash")
    seen = []

    def spy(module, inner, args, kwargs, active, compiled):
        seen.append((module, inner, dict(kwargs), compiled))
        kwargs["labels"] = None  # a substitution: the forward runs with it
        return None

    monkeypatch.setattr(guard, "_start", spy)
    ids = torch.randint(0, model.config.vocab_size, (1, 8))
    wrapped, compiled = _PeftLike(model), torch.compile(model)
    hooked = [m for m in (model, model.model, wrapped, compiled, copy.deepcopy(wrapped))
              if any(h is guard._before_call for h in m._forward_pre_hooks.values())]
    assert len(hooked) == 5
    with cp_attention.context_parallel():
        out = model(input_ids=ids, labels=ids)
        wrapped(input_ids=ids, labels=ids)
    assert out.loss is None  # the forward ran with the hook's substitution
    starts = [(s[0], s[1]) for s in seen if s[0] is not model.model]  # (the spy starts no forward: inner calls ask too)
    assert starts == [(model, model), (wrapped, model)], starts
    assert all(torch.equal(s[2]["labels"], ids) and torch.equal(s[2]["input_ids"], ids) for s in seen
               if s[0] is not model.model)
    monkeypatch.undo()

    handle = guard._WATCHING.pop()
    handle.remove()
    try:
        early = build_model(tiny_config("llama"), "cp_flash")  # as if built before cp_attention registered cp_flash
    finally:
        guard.install_guard()
    assert not early._forward_pre_hooks and len(guard._WATCHING) == 1
    want = early(input_ids=ids).logits
    with cp_attention.context_parallel(), pytest.raises(NotImplementedError, match=r"built before cp_attention"):
        early(input_ids=ids)
    assert torch.equal(early(input_ids=ids).logits, want)
