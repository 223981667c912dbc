"""Index-sparse attention families under cp_flash (issue 38): DeepSeek Sparse Attention's lightning
indexer (deepseek_v32, glm_moe_dsa with its shared layers, hy_v4 with sinks and shared layers, axk2,
dots3_note_text with sliding-window layers beside the indexed ones) and Qwen4's block indexer
(qwen4_exp_text: blocks of keys, beside gated DeltaNet layers), exact on one device and under context
parallelism.

* every family at CP = 2 (and 4, ``-m slow``) in zigzag, contiguous and balanced layouts, two packed
  rows with documents crossing every rank and one-token documents: logits and parameter gradients
  against each document run alone under eager, and every indexer layer's selection (the keys each
  query keeps) equal to one device's, with ties at the k-th place broken toward the earlier key
  (sparse_cases' own implementation of the documented rule);
* one device: cp_flash equals the same oracle, and differs from eager's unspecified tie order (so the
  rule is what makes them agree, not chance);
* the selected keys' traffic: the layers move fewer K/V bytes than a ring would.
"""

from __future__ import annotations

import pytest
import torch

import cp_attention
import hf_cases
import hybrid_cases
import sparse_cases as sc
from rank_pool import single_thread
from cp_attention.integrations.hf import check as model_check
from cp_attention.integrations.hf import state
from cp_attention.tools.launch import run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.transformers]

LAYOUTS = ("zigzag", "contiguous", "balanced")


@pytest.fixture(scope="module")
def refs() -> dict:
    with single_thread():
        return {family: sc.ground_truth(hybrid_cases.models(family)[0]) for family in sc.SPARSE + sc.COMPRESSED}


def _check(results: list[dict], expected: int) -> None:
    assert len(results) == expected
    fails = hf_cases.failures(results)
    fails += [f"{r['where']} {r['name']}: a selection differs from one device's"
              for r in results if "error" not in r and not r["selections_equal"]]
    assert not fails, f"{len(fails)} failures:\n" + "\n".join(fails[:40])
    for r in results:
        assert r["select_layers"] > 0, r
        assert r["kv_bytes_recv"] < r["ring_kv_bytes"], r


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_dsa_families_match_docs_alone_eager(world_size, refs):
    families = sc.SPARSE + sc.COMPRESSED
    per_rank = run_ranks(world_size, sc.run_cases, families, {f: refs[f] for f in families}, LAYOUTS, timeout=900)
    _check([r for rank in per_rank for r in rank], world_size * len(families) * len(LAYOUTS))


def test_dsa_one_device_follows_the_tie_rule(refs):
    """cp_flash on one device (packed rows, no context) equals the oracle; eager's own topk on the same
    documents does not (ties at the k-th place are common), so the rule is what makes them agree."""
    eager, model = hybrid_cases.models("deepseek_v32")
    ids, pos, R = hybrid_cases.inputs(model.config.get_text_config().vocab_size, sc.DOCS)
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, position_ids=pos, use_cache=False)
    (out.logits * R).sum().backward()
    res = hybrid_cases.compare("deepseek_v32", out.logits.detach(), hf_cases.flat_grads(model),
                               refs["deepseek_v32"], "one device")
    assert not hf_cases.failures([res])
    plain = hybrid_cases.ground_truth(eager, sc.DOCS)  # torch.topk's own order of ties
    assert float((plain["logits"] - refs["deepseek_v32"]["logits"]).abs().max()) > 1e-3


def _indexer_class(model):
    return type(next(m for m in model.modules() if type(m).__name__.endswith("Indexer")))


def test_an_indexer_cp_flash_does_not_adapt_is_refused(monkeypatch):
    """Only adapted indexers may run: with the family's own forward back in place, the model check
    reports the indexer (its traced forward reads the cp_flash mask's rows, which cp_flash refuses: it would
    score within its shard) and on one device its use of the mask's rows raises instead of selecting from a
    wrong mask."""
    _, model = hybrid_cases.models("deepseek_v32")
    cls = _indexer_class(model)
    assert model_check.model_findings(model) == ()
    monkeypatch.setattr(cls, "forward", cls.forward.__wrapped__)
    state.TRACED.clear()  # (the trace is memoised per class and configuration; the class changed under it)
    found = [f for f in model_check.model_findings(model) if f.what == "a forward cp_flash refuses"]
    assert found and "deepseek_v32's modeling code uses the attention mask" in found[0].why, found
    ids = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(0))
    with pytest.raises(NotImplementedError, match=r"deepseek_v32's modeling code uses the attention mask"):
        model(input_ids=ids, use_cache=False)


def test_a_selection_no_adapted_indexer_made_is_refused(monkeypatch):
    """cp_flash reads ``indices=`` only when an adapted indexer returned it (global key indices): a
    copy of it, as some other code would hand over, is refused by name."""
    _, model = hybrid_cases.models("deepseek_v32")
    cls = _indexer_class(model)
    adapted = cls.forward
    monkeypatch.setattr(cls, "forward", lambda self, *args, **kwargs: adapted(self, *args, **kwargs).clone())
    ids = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(0))
    with pytest.raises(NotImplementedError, match=r"hands its attention 'indices'"):
        model(input_ids=ids, use_cache=False)
    with cp_attention.context_parallel() as cp:
        with pytest.raises(NotImplementedError, match=r"'indices'"):
            model(**cp.shard_batch(input_ids=ids), use_cache=False)


@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_dsa_compiled(world_size, refs):
    """torch.compile'd in a block of one rank or two: the indexer and the selected-keys attention leave
    the graph, exact."""
    family = "deepseek_v32"
    if world_size == 1:
        results = [sc.run_compiled(0, 1, family, refs[family])]
    else:
        results = run_ranks(2, sc.run_compiled, family, refs[family], timeout=900)
    fails = hf_cases.failures(results)
    assert not fails, "\n".join(fails)


@pytest.mark.slow
def test_dsa_training_stack_cp2():
    """FSDP2 with reentrant checkpointing and the backward after the block (DeepSeek-V3.2), DDP with
    non-reentrant checkpointing inside it (Qwen4), the flattening collator's batch: the loss and the
    gradients equal one process's on each document alone."""
    import training_workers as tw

    per_rank = run_ranks(2, sc.run_training, timeout=900)
    for rank, per_setup in enumerate(per_rank):
        assert set(per_setup) == {s[0] for s in sc.TRAINING_SETUPS}
        for name, e in per_setup.items():
            assert e["loss_err"] <= tw.REL_TOL, f"rank {rank} {name}: loss relative error {e['loss_err']:.2e}"
            assert e["grad_err"] <= tw.REL_TOL, f"rank {rank} {name}: gradient error {e['grad_err']:.2e}"


def test_dsa_padded_rows_cp2():
    """Left and right padding: the indexer's rows and the selected keys leave the padding out, as eager
    does (logits of the real tokens against eager on the padded batch, with the tie rule)."""
    eager, _ = hybrid_cases.models("deepseek_v32")
    ids, mask = sc.padded_inputs()
    with torch.no_grad(), single_thread(), sc.earliest_of_ties(eager):
        ref = eager(input_ids=ids, attention_mask=mask, use_cache=False).logits
    out = run_ranks(2, sc.run_padded, "deepseek_v32", timeout=600)[0]
    assert float((out - ref)[mask.bool()].abs().max()) <= 1e-5


# ----------------------------------------------------------------------------------------------
# admitted by behaviour (issue 52): at an indexer class's first call under cp_flash, what a rank's part
# selects with the adapter's inputs is checked against eager's selection on one device


def _planted_forward(cls, plant: str):
    """The family's own indexer forward with one change: ``"inverted bool"`` reads a boolean mask as True
    where hidden (the other common convention); ``"own keys"`` scores its own tokens' keys only (whatever
    ``cache.update_indexer`` returns)."""
    import functools

    from cp_attention.integrations.hf.adapters import indexers

    own = cls.forward.__wrapped__

    class OwnKeys:
        def update_indexer(self, k, layer_idx):
            return k

    @functools.wraps(own)
    def planted(self, *args, **kwargs):
        bound = indexers.inspect.signature(own).bind(self, *args, **kwargs)
        mask = bound.arguments.get("attention_mask")
        if plant == "inverted bool" and isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
            bound.arguments["attention_mask"] = ~mask
        if plant == "own keys":
            name = indexers._cache_name(bound)
            bound.arguments[name] = OwnKeys()
        return own(*bound.args, **bound.kwargs)

    return planted


@pytest.mark.parametrize("family", ["deepseek_v32", "qwen4_exp_text"])
def test_indexers_admitted_and_planted_changes_declined(family, monkeypatch):
    """Each indexer form (a token-level DSA indexer, Qwen4's block indexer) passes its check at its first
    call under cp_flash; with a planted change its family is refused there, naming the transformers version
    and the class, and eager runs the planted forward untouched (bit-identical to calling it directly)."""
    from cp_attention.integrations.hf.adapters import indexers
    from cp_attention.integrations.hf import state
    from cp_attention.integrations.hf.versions import transformers_version

    eager, model = hybrid_cases.models(family)
    cls = _indexer_class(model)
    applies = (lambda m: isinstance(m, indexers.MaskRows)) if family != "qwen4_exp_text" else \
        (lambda m: isinstance(m, indexers.SelectingMask))
    run = indexers._token_selection if family != "qwen4_exp_text" else indexers._block_selection
    ids = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(0))
    key = (cls.__module__, f"{cls.__qualname__}.forward")
    monkeypatch.setitem(state.INTEGRATIONS, "classes", {})
    monkeypatch.setitem(state.INTEGRATIONS, "declined", {})
    with torch.no_grad(), cp_attention.context_parallel() as cp:
        model(**cp.shard_batch(input_ids=ids), use_cache=False)
    assert state.INTEGRATIONS["classes"] == {key: None}, state.INTEGRATIONS["classes"]
    for plant in ("inverted bool", "own keys"):
        planted = _planted_forward(cls, plant)
        monkeypatch.setattr(cls, "forward", indexers._adapted(planted, applies, run))
        state.INTEGRATIONS["classes"].clear()
        with torch.no_grad(), cp_attention.context_parallel() as cp:
            with pytest.raises(NotImplementedError) as raised:
                model(**cp.shard_batch(input_ids=ids), use_cache=False)
        message = str(raised.value)
        assert f"transformers {transformers_version()}" in message and f"{key[0]}.{key[1]}" in message, message
        assert "does not do what" in message and state.INTEGRATIONS["classes"][key] is not None, (plant, message)
        with torch.no_grad():  # eager: the planted forward itself
            wrapped = eager(input_ids=ids, use_cache=False).logits
            monkeypatch.setattr(cls, "forward", planted)
            bare = eager(input_ids=ids, use_cache=False).logits
        assert torch.equal(wrapped, bare), plant


def test_compressors_admitted_and_planted_changes_declined(monkeypatch):
    """DeepSeek-V4's compressors (CSA, HCA) return what the adapter reads (entries (1, 1, n, head_dim), an
    additive bias hiding the entries of windows not yet closed); planted, a soft bias (-1 where eager would
    hide: the adapter would drop entries eager only penalises) and entries along another dimension are
    declined at the first call under cp_flash, naming the version and the class; eager runs the planted
    forward untouched."""
    import functools

    from cp_attention.integrations.hf.adapters import compressed
    from cp_attention.integrations.hf import state
    from cp_attention.integrations.hf.versions import transformers_version

    eager, model = hybrid_cases.models("deepseek_v4")
    ids = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(0))
    monkeypatch.setitem(state.INTEGRATIONS, "classes", {})
    monkeypatch.setitem(state.INTEGRATIONS, "declined", {})
    with torch.no_grad(), cp_attention.context_parallel() as cp:
        model(**cp.shard_batch(input_ids=ids), use_cache=False)
    classes = {type(m) for m in model.modules() if type(m).__name__.endswith("Compressor")}
    assert {k[1] for k in state.INTEGRATIONS["classes"]} == {f"{c.__qualname__}.forward" for c in classes}
    assert all(why is None for why in state.INTEGRATIONS["classes"].values())
    cls = next(c for c in classes if c.__name__.startswith("DeepseekV4HCA"))
    own = cls.forward.__wrapped__

    def plant(kind):
        @functools.wraps(own)
        def planted(self, *args, **kwargs):
            ckv, bias = own(self, *args, **kwargs)
            if kind == "soft bias" and bias is not None:
                bias = torch.where(bias == 0, bias, torch.full_like(bias, -1.0))
            if kind == "entries along dim 1":
                ckv = ckv.transpose(1, 2)
            return ckv, bias
        return planted

    for kind in ("soft bias", "entries along dim 1"):
        planted = plant(kind)
        monkeypatch.setattr(cls, "forward", compressed._wrap_compressor(planted))
        state.INTEGRATIONS["classes"].clear()
        with torch.no_grad(), cp_attention.context_parallel() as cp:
            with pytest.raises(NotImplementedError) as raised:
                model(**cp.shard_batch(input_ids=ids), use_cache=False)
        message = str(raised.value)
        assert f"transformers {transformers_version()}" in message and f"{cls.__qualname__}.forward" in message, \
            message
        if kind == "soft bias":
            with torch.no_grad():  # eager: the planted forward itself
                wrapped = eager(input_ids=ids, use_cache=False).logits
                monkeypatch.setattr(cls, "forward", planted)
                bare = eager(input_ids=ids, use_cache=False).logits
            assert torch.equal(wrapped, bare)
