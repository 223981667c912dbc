"""The MoE router's load-balancing loss under context parallelism (cp_attention.integrations.hf.adapters.router_loss).

Ground truth: the same tiny model with eager attention on one process over the full batch, its
loss including ``router_aux_loss_coef * aux_loss`` (transformers' own ``load_balancing_loss_func``
over every token); under CP the mean over ranks of the loss and of the gradients must equal it (the
bare API's convention), on packed and on padded rows (one row padded over most of a rank's shard).
"""

from __future__ import annotations

import pytest
import torch

from cp_attention.tools.launch import run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.transformers]  # spawns gloo ranks; builds transformers models

VOCAB, L = 96, 40
COEF = 0.5  # large, so a wrong auxiliary loss shows in the gradients
TOL = 2e-5


def _config(family: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, max_position_embeddings=256, output_router_logits=True, router_aux_loss_coef=COEF,
                  pad_token_id=0)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                                 num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[])
    if family == "mixtral":
        return tf.MixtralConfig(**common, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                router_jitter_noise=0.0)
    if family == "gpt_oss":
        return tf.GptOssConfig(**common, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                               sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    if family == "olmoe":
        return tf.OlmoeConfig(**common, intermediate_size=32, num_experts=4, num_experts_per_tok=2)
    raise KeyError(family)


def _model(family: str, impl: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_config(family), attn_implementation=impl, dtype=torch.float32).train()


def _batch(padded: bool) -> dict:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, VOCAB, (2, L), generator=g)
    labels = ids.clone()
    out = dict(input_ids=ids, labels=labels)
    if padded:  # row 1: 28 of its 40 tokens padding (right-padded), most of the last rank's shard
        mask = torch.ones(2, L, dtype=torch.long)
        mask[1, 12:] = 0
        ids[1, 12:] = 0
        labels[1, 12:] = -100
        out["attention_mask"] = mask
    return out


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def _reference(family: str, padded: bool):
    model = _model(family, "eager")
    out = model(**_batch(padded), use_cache=False)
    out.loss.backward()
    return float(out.loss.detach()), float(out.aux_loss.detach()), _grads(model)


def _worker(rank: int, world_size: int, cases, layout: str, planted: bool):
    import cp_attention
    from cp_attention.integrations.hf.adapters import router_loss as losses

    results = {}
    for family, padded in cases:
        model = _model(family, "cp_flash")
        if planted:  # the bug: each rank's router loss over its own shard (the original function)
            mod = __import__(type(model).__module__, fromlist=["x"])
            fn = mod.load_balancing_loss_func
            mod.load_balancing_loss_func = getattr(fn, "__wrapped__", fn)
        with cp_attention.context_parallel(layout=layout) as cp:
            out = model(**cp.shard_batch(**_batch(padded)), use_cache=False)
        out.loss.backward()
        if planted:
            losses.adapt_module(mod)
        results[(family, padded)] = (float(out.loss.detach()), float(out.aux_loss.detach()), _grads(model).numpy())
    return results


FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "olmoe")


def _check(per_rank, refs, what: str) -> None:
    for case, (ref_loss, ref_aux, ref_grads) in refs.items():
        loss = sum(r[case][0] for r in per_rank) / len(per_rank)
        aux = sum(r[case][1] for r in per_rank) / len(per_rank)
        grads = sum(torch.from_numpy(r[case][2]) for r in per_rank) / len(per_rank)
        assert abs(aux - ref_aux) <= TOL * abs(ref_aux), (case, what, aux, ref_aux)
        assert abs(loss - ref_loss) <= TOL * abs(ref_loss), (case, what, loss, ref_loss)
        scale = float(ref_grads.abs().max())
        assert float((grads - ref_grads).abs().max()) <= TOL * scale, (case, what)


@pytest.mark.parametrize("world_size, layout", [(2, "zigzag"), pytest.param(4, "contiguous", marks=pytest.mark.slow)])
def test_router_loss_exact_under_cp(world_size, layout):
    """qwen3_moe, mixtral, gpt_oss, olmoe with output_router_logits: mean over ranks of the loss,
    the auxiliary loss and the gradients equal one-device eager; packed rows and a padded row."""
    cases = [(f, False) for f in FAMILIES] + [("qwen3_moe", True), ("mixtral", True)]
    refs = {case: _reference(*case) for case in cases}
    per_rank = run_ranks(world_size, _worker, cases, layout, False, timeout=600)
    _check(per_rank, refs, f"CP = {world_size} {layout}")


def test_router_loss_per_shard_is_caught():
    """Planted: every rank takes the router loss over its own shard (the unwrapped function)."""
    case = ("qwen3_moe", True)
    ref = _reference(*case)
    per_rank = run_ranks(2, _worker, [case], "zigzag", True, timeout=600)
    aux = sum(r[case][1] for r in per_rank) / 2
    assert abs(aux - ref[1]) > 1e-3 * abs(ref[1]), (aux, ref[1])


def test_router_loss_functions_checked_against_the_family():
    """The formula is checked against each family's own function before it replaces it: every
    modeling module's function of the standard signature that transformers ships is either
    Switch-Transformer's balance (then equal on synthetic logits) or refused with its reason; a
    function computing another number is refused."""
    import importlib
    import pkgutil

    import transformers.models as tm

    from cp_attention.integrations.hf.adapters import router_loss as losses

    fitted, refused = [], []
    for info in pkgutil.iter_modules(tm.__path__):
        try:
            mod = importlib.import_module(f"transformers.models.{info.name}.modeling_{info.name}")
        except Exception:  # noqa: BLE001 - families whose optional dependencies are missing
            continue
        fn = getattr(mod, "load_balancing_loss_func", None)
        if fn is None:
            continue
        original = getattr(fn, "__wrapped__", fn)
        reason = losses._fits(original, 6, 2)
        (fitted if reason is None else refused).append((info.name, reason))
    names = {n for n, _ in fitted}
    assert {"qwen3_moe", "mixtral", "gpt_oss", "olmoe", "qwen2_moe", "phimoe", "jamba"} <= names, fitted
    assert len(fitted) >= 25, (fitted, refused)
    for name, reason in refused:  # another signature or another number, said
        assert "signature" in reason or "Switch-Transformer" in reason, (name, reason)

    def squared(gate_logits, num_experts=None, top_k=2, attention_mask=None):
        original = importlib.import_module("transformers.models.mixtral.modeling_mixtral").load_balancing_loss_func
        return getattr(original, "__wrapped__", original)(gate_logits, num_experts, top_k, attention_mask) ** 2

    assert "Switch-Transformer" in losses._fits(squared, 6, 2)


def _squared_balance():
    """A stand-in of mixtral's router loss computing another number: the square of the balance."""
    import importlib

    mod = importlib.import_module("transformers.models.mixtral.modeling_mixtral")
    own = getattr(mod.load_balancing_loss_func, "__wrapped__", mod.load_balancing_loss_func)

    def squared(gate_logits, num_experts=None, top_k=2, attention_mask=None):
        return own(gate_logits, num_experts, top_k, attention_mask) ** 2

    squared.__name__ = squared.__qualname__ = "load_balancing_loss_func"  # as a release would ship it
    squared.__module__ = mod.__name__
    return mod, squared


def _declined_worker(rank: int, world_size: int):
    import cp_attention
    from cp_attention.integrations.hf.adapters import router_loss as losses
    from cp_attention.integrations.hf.versions import transformers_version

    mod, squared = _squared_balance()
    mod.load_balancing_loss_func = losses._router_loss(squared)
    model = _model("mixtral", "cp_flash")
    try:
        with cp_attention.context_parallel() as cp:
            model(**cp.shard_batch(**_batch(False)), use_cache=False)
    except NotImplementedError as exc:
        return str(exc), transformers_version()
    return None, transformers_version()


def test_a_declined_router_loss_refuses_under_cp_and_leaves_eager_untouched(monkeypatch):
    """A family's router loss computing another number (planted: the square of the balance) is refused
    under context parallelism, naming the transformers version and the function; outside the block the
    wrapper returns the planted function's own value, bit for bit."""
    from cp_attention.integrations.hf.adapters import router_loss as losses

    mod, squared = _squared_balance()
    monkeypatch.setattr(mod, "load_balancing_loss_func", losses._router_loss(squared))
    model = _model("mixtral", "cp_flash")
    batch = _batch(False)
    with torch.no_grad():
        wrapped = model(**batch, use_cache=False)
        monkeypatch.setattr(mod, "load_balancing_loss_func", squared)
        bare = model(**batch, use_cache=False)
    assert torch.equal(wrapped.aux_loss, bare.aux_loss) and torch.equal(wrapped.loss, bare.loss)
    for message, version in run_ranks(2, _declined_worker, timeout=300):
        assert message is not None, "the planted router loss ran under context parallelism"
        assert f"transformers {version}" in message and "load_balancing_loss_func" in message, message


def _moe_families() -> list[str]:
    """The causal-LM families whose text config has ``output_router_logits`` (a router auxiliary loss)."""
    import family_sweep as fs

    out = []
    for family in fs.families():
        try:
            config = fs.tiny_config(family)
        except Exception:  # noqa: BLE001 - unbuildable families (tests/tools/test_family_sweep.py lists them)
            continue
        text = config.get_text_config()
        if hasattr(text, "output_router_logits"):
            out.append(family)
    return out


def _sweep_config(family: str):
    import family_sweep as fs

    config = fs.tiny_config(family)
    text = config.get_text_config()
    text.output_router_logits, text.router_aux_loss_coef = True, COEF
    if hasattr(text, "router_jitter_noise"):
        text.router_jitter_noise = 0.0
    return config


def _sweep_loss(model, batch: dict):
    return model(**batch, use_cache=False).loss


def _sweep_worker(rank: int, world_size: int, family: str, state_dict: dict, layout: str):
    import family_sweep as fs

    import cp_attention

    model = fs.build_model(_sweep_config(family), "cp_flash", state_dict).train()
    try:
        with cp_attention.context_parallel(layout=layout) as cp:
            loss = _sweep_loss(model, cp.shard_batch(**_batch(False)))
        loss.backward()
    except NotImplementedError as exc:
        return ("refused", str(exc)[:200])
    return ("ran", float(loss.detach()), _grads(model).numpy())


@pytest.mark.families
@pytest.mark.parametrize("world_size, layout", [(2, "zigzag"), (4, "contiguous")])
def test_every_moe_family_router_loss_exact_or_refused(world_size, layout):
    """Every causal-LM family with a router auxiliary loss (family_sweep's tiny model, the loss weighted
    0.5): at CP = 2 (zigzag) and 4 (contiguous) the mean over ranks of the loss and gradients equals
    one-device eager, or the family is refused (NotImplementedError, alike on every rank)."""
    import family_sweep as fs

    bad, outcomes = [], {}
    for family in _moe_families():
        eager = fs.build_model(_sweep_config(family), "eager").train()
        out = eager(**_batch(False), use_cache=False)
        if getattr(out, "aux_loss", None) is None:  # the family computes no router loss (DeepSeek-V3, ...)
            outcomes[family] = "no router loss"
            continue
        ref = out.loss
        ref.backward()
        per_rank = run_ranks(world_size, _sweep_worker, family, eager.state_dict(), layout, timeout=300)
        kinds = {r[0] for r in per_rank}
        if kinds == {"refused"}:
            outcomes[family] = "refused"
            continue
        if kinds != {"ran"}:
            bad.append(f"{family}: ranks disagree {kinds}")
            continue
        loss = sum(r[1] for r in per_rank) / world_size
        grads = sum(torch.from_numpy(r[2]) for r in per_rank) / world_size
        ref_grads = _grads(eager)
        ok = abs(loss - float(ref)) <= TOL * abs(float(ref)) and \
            float((grads - ref_grads).abs().max()) <= 1e-4 * float(ref_grads.abs().max())
        outcomes[family] = "exact" if ok else "wrong"
        if not ok:
            bad.append(f"{family}: loss {loss} vs {float(ref)}")
    print(f"CP = {world_size}", outcomes)
    assert sum(v == "exact" for v in outcomes.values()) >= 20, outcomes
    assert not bad, bad
