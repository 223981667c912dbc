"""Multi-head latent attention under context parallelism moves each token's latent row, not its heads (issue 55).

* The MLA families of transformers (DeepSeek-V2, V3, V3.2, GLM-4-MoE-Lite, MiniCPM3, LongCat-Flash, Youtu) at
  CP = 2 and 4, zigzag, contiguous and balanced, on a packed row whose documents cross every rank and a row of
  one document: logits and every gradient (the up-projection ``kv_b_proj`` named) against each document alone
  under eager on one device; every layer moved the latent (DeepSeek-V3.2's on its selected keys' exchange).
* The bytes each rank's comm really receives in the forward equal the latent formula, tokens received x
  (kv_lora_rank + qk_rope_head_dim) x itemsize, with the tokens from the plan's count of the heads' bytes and the
  widths from the model's configuration; for DeepSeek-V3's real attention shapes (128 heads) at most 1/8 of what
  the heads take on the same batch (71x less).
* LoRA on the projections (the up-projection included), DDP, FSDP2 and gradient checkpointing, exact.
* Head parallelism ("ulysses", and "usp" at CP = 4) gathers the latent rows once for every head: exact, the
  bytes of its exchange equal the formula.
* The cost model keeps the heads where they are smaller than the latent, or where expanding costs more than the
  bytes save, and says why; an expansion that is not row-wise or not deterministic is declined (the heads move).
"""

from __future__ import annotations

import pytest
import torch

import latent_cases
from cp_attention.integrations.hf.adapters import latent as latent_adapter
from cp_attention.strategies import CostModel
from cp_attention.strategies.latent import latent_form
from cp_attention.tools.launch import run_ranks
from cp_attention.tools.sweeps.compare import grad_tol
from cp_attention.tools.sweeps.configs import build_model
from rank_pool import single_thread

pytestmark = [pytest.mark.multirank, pytest.mark.transformers]


@pytest.fixture(scope="module")
def family_refs() -> dict:
    with single_thread():
        return {f: latent_cases.ground_truth(build_model(latent_cases.family_config(f), "eager"))
                for f in latent_cases.FAMILIES}


def _expected_latent_bytes(call: dict, dims: dict, itemsize: int) -> int:
    """The latent formula for one call: the tokens the plan says this rank receives (its heads' bytes over a
    token's heads' bytes) x (kv_lora_rank + qk_rope_head_dim) x itemsize."""
    per_token_heads = dims["heads"] * (dims["qk_head_dim"] + dims["v_head_dim"]) * itemsize
    assert call["heads_recv"] % per_token_heads == 0, call
    tokens = call["heads_recv"] // per_token_heads
    return tokens * (dims["kv_lora_rank"] + dims["qk_rope_head_dim"]) * itemsize


def _check_bytes(where: str, calls: list[dict], received: int, dims: dict, itemsize: int, fails: list) -> None:
    expected = 0
    for call in calls:
        if call["form"] == "latent":
            want = _expected_latent_bytes(call, dims, itemsize)
            if call["recv"] != want:
                fails.append(f"{where}: PlanStats says {call['recv']} B received, the latent formula {want} B")
            expected += want
        else:
            expected += call["recv"]
    if received != expected:
        fails.append(f"{where}: the comm received {received} B of K/V in the forward, the formula says {expected} B")


def _check_exact(where: str, errs: dict, fails: list, named: str = "kv_b_proj") -> None:
    if not errs["logits"] <= latent_cases.TOL:
        fails.append(f"{where}: logits error {errs['logits']:.2e}")
    bound = grad_tol(errs["grad_scale"], latent_cases.TOL)
    if not errs["grads"] <= bound:
        fails.append(f"{where}: gradient error {errs['grads']:.2e} > {bound:.1e}")
    if errs.get("named_count", 1) == 0 or not 0 <= errs.get("named", 0) <= bound:
        fails.append(f"{where}: {named} gradients error {errs.get('named')} ({errs.get('named_count')} tensors)")


def _check_families(per_rank: list[list[dict]], world_size: int) -> None:
    fails = []
    for results in per_rank:
        assert len(results) == len(latent_cases.FAMILIES) * len(latent_cases.LAYOUTS)
        for r in results:
            where = f"{r['family']} {r['layout']} CP={world_size} rank={r['rank']}"
            _check_exact(where, r["errs"], fails)
            forms = {c["form"] for c in r["calls"]}
            strategies = {c["strategy"] for c in r["calls"]}
            want = {"select"} if r["family"] in latent_cases.SELECTING else {"ring"}
            if not r["calls"] or forms != {"latent"} or strategies != want:
                fails.append(f"{where}: the layers moved {forms or 'nothing'} with {strategies}, expected the latent "
                             f"with {want}")
            _check_bytes(where, r["calls"], r["received"], r["dims"], r["itemsize"], fails)
    assert not fails, "\n".join(fails[:40])


def test_mla_families_exact_at_cp2(family_refs):
    _check_families(run_ranks(2, latent_cases.run_families, family_refs, timeout=900), 2)


@pytest.mark.slow
def test_mla_families_exact_at_cp4(family_refs):
    _check_families(run_ranks(4, latent_cases.run_families, family_refs, timeout=1800), 4)


def _head_parallel_bytes(call: dict, dims: dict, ulysses: int) -> int:
    """What a rank receives in head parallelism's exchange to the heads when the latent travels: the tokens the
    call's heads exchange brings (its count of the heads' bytes: q of this rank's H / u query heads, their K/V
    heads, and the outputs back, over a token's) x (the query heads' q + kv_lora_rank + qk_rope_head_dim), in
    float32; the widths from the configuration (an MLA layer has as many K/V heads as query heads)."""
    h, D, Dv = dims["heads"] // ulysses, dims["qk_head_dim"], dims["v_head_dim"]
    per_token_heads = (h * D + h * (D + Dv) + h * Dv) * 4
    assert call["heads_recv"] % per_token_heads == 0, call
    return call["heads_recv"] // per_token_heads * (h * D + dims["kv_lora_rank"] + dims["qk_rope_head_dim"]) * 4


def _check_strategies(per_rank: list[dict], world_size: int) -> None:
    fails = []
    for rank, out in enumerate(per_rank):
        for name, r in out.items():
            where = f"{name} CP={world_size} rank={rank}"
            _check_exact(where, r["errs"], fails)
            forms = {c["form"] for c in r["calls"]}
            if name.endswith("-slow"):  # a device too slow to expand: the heads move, and the reason says so
                if forms != {"heads"} or not all("costs more than" in c["reason"] for c in r["calls"]):
                    fails.append(f"{where}: {r['calls']}")
                continue
            if forms != {"latent"}:
                fails.append(f"{where}: the layers moved {forms}")
            if name.startswith("ulysses"):
                want = sum(_head_parallel_bytes(c, r["dims"], world_size) for c in r["calls"])
                if r["received"] != want:
                    fails.append(f"{where}: the head exchange received {r['received']} B, the latent formula {want} B")
    assert not fails, "\n".join(fails)


def test_head_parallelism_gathers_the_latent_once(family_refs):
    """Under strategy="ulysses" each rank receives its head group's tokens of its query heads and their latent
    rows once (every head reads them), expands them with the layer's own expansion and keeps its heads: exact,
    and the bytes its comm received equal the formula; a cost model whose device is too slow to expand keeps the
    heads and says why; "auto" moves the latent on whichever strategy it picks."""
    strategies = [("ulysses", None, {}), ("ulysses", None, dict(throughput=1e3)), ("auto", None, {})]
    _check_strategies(run_ranks(2, latent_cases.run_strategies, family_refs["deepseek_v3"], strategies,
                                timeout=900), 2)


@pytest.mark.slow
def test_usp_moves_the_latent_at_cp4(family_refs):
    """strategy="usp" with head groups of 2 at CP = 4: the latent rows are gathered within the head group and the
    ring over the head groups moves the groups' latent rows; exact."""
    _check_strategies(run_ranks(4, latent_cases.run_strategies, family_refs["deepseek_v3"],
                                [("usp", 2, {}), ("ulysses", None, {})], timeout=1800), 4)


def test_lora_and_checkpointing_exact_at_cp2():
    """LoRA on the projections and gradient checkpointing, exact with the latent moving; LoRA dropout on the
    up-projection in training mode declines the expansion (the heads move, and PlanStats says why)."""
    pytest.importorskip("peft")
    with single_thread():
        lora_ref = latent_cases.ground_truth(latent_cases.lora_model("eager"))
        plain_ref = latent_cases.ground_truth(build_model(latent_cases.family_config("deepseek_v3"), "eager"))
    fails = []
    for rank, r in enumerate(run_ranks(2, latent_cases.run_training_stacks, lora_ref, plain_ref, timeout=900)):
        _check_exact(f"LoRA rank={rank}", r["lora"], fails, named="lora_")
        _check_exact(f"checkpointing rank={rank}", r["ckpt"], fails)
        for name in ("lora_calls", "ckpt_calls"):
            if not r[name] or {c["form"] for c in r[name]} != {"latent"}:
                fails.append(f"{name} rank={rank}: {[c['form'] for c in r[name]]}")
        # LoRA dropout in training mode: the expansion is declined, the heads move, and the reason says why
        if not r["dropout_calls"] or any(c["form"] != "heads" or "not deterministic" not in c["reason"] or
                                         c["recv"] != c["heads_recv"] for c in r["dropout_calls"]):
            fails.append(f"LoRA dropout rank={rank}: {r['dropout_calls']}")
    assert not fails, "\n".join(fails)


def test_ddp_fsdp2_checkpointing_exact_at_cp2():
    """The training stack of tests/integrations/test_training.py (DDP, FSDP2, checkpointing of the layers and of the
    whole model, backward inside and after the block) on MLA families: exact, and the latent moved."""
    import training_workers as tw

    fails = []
    for rank, results in enumerate(run_ranks(2, latent_cases.run_stacks, timeout=900)):
        assert len(results) == len(latent_cases.MLA_SETUPS)
        for name, e in results.items():
            if not (e["loss_err"] <= tw.REL_TOL and e["grad_err"] <= tw.REL_TOL):
                fails.append(f"{name} rank={rank}: loss {e['loss_err']:.1e}, gradients {e['grad_err']:.1e}")
            if e["forms"] != ["latent"]:
                fails.append(f"{name} rank={rank}: the layers moved {e['forms']}")
    assert not fails, "\n".join(fails)


def test_v3_shapes_move_the_latent_and_small_heads_stay_heads():
    """DeepSeek-V3's real attention shapes: the latent takes 576 numbers a token against the heads' 40,960, the
    comm receives that, and it is at most 1/8 of the heads' bytes on the same batch; a config whose heads take
    fewer numbers than its latent keeps the heads and says why. Both exact."""
    refs = {}
    with single_thread():
        for name, config in (("v3_shaped", latent_cases.v3_shaped_config), ("small_heads",
                                                                             latent_cases.small_heads_config)):
            refs[name] = latent_cases.ground_truth(build_model(config(), "eager"))
    fails = []
    for rank, out in enumerate(run_ranks(2, latent_cases.run_shapes, refs, timeout=900)):
        v3, small = out["v3_shaped"], out["small_heads"]
        assert v3["dims"]["heads"] == 128 and v3["dims"]["kv_lora_rank"] + v3["dims"]["qk_rope_head_dim"] == 576
        _check_exact(f"v3-shaped rank={rank}", v3["errs"], fails)
        _check_exact(f"small heads rank={rank}", small["errs"], fails)
        _check_bytes(f"v3-shaped rank={rank}", v3["calls"], v3["received"], v3["dims"], 4, fails)
        for call in v3["calls"]:
            if call["form"] != "latent" or not 0 < 8 * call["recv"] <= call["heads_recv"]:
                fails.append(f"v3-shaped rank={rank}: {call}")
        for call in small["calls"]:
            if call["form"] != "heads" or "no smaller than the K/V heads" not in call["reason"] or \
                    call["recv"] != call["heads_recv"]:
                fails.append(f"small heads rank={rank}: {call}")
        if small["received"] != sum(c["recv"] for c in small["calls"]):
            fails.append(f"small heads rank={rank}: received {small['received']} B")
    assert not fails, "\n".join(fails)


def test_the_cost_model_weighs_expansion_against_bytes():
    """The latent travels when it is smaller and its expansion is cheaper than the bytes it saves under the
    context's cost model; a slow device (or a fast link) keeps the heads, and the reason says which."""
    v3 = dict(kv_heads=128, head_dim=192, head_dim_v=128, latent_dim=576)
    form, why = latent_form(**v3, cost_model=CostModel())
    assert form == "latent" and "576 numbers a token instead of 40960" in why
    form, why = latent_form(**v3, cost_model=CostModel(throughput=1e9))
    assert form == "heads" and "costs more than" in why
    form, why = latent_form(kv_heads=1, head_dim=16, head_dim_v=8, latent_dim=40, cost_model=CostModel())
    assert form == "heads" and "no smaller" in why


class _Expanding(torch.nn.Module):
    """An up-projection of 6-number latent rows to 2 heads of keys (4) and values (3), with dropout."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.up = torch.nn.Linear(6, 2 * (4 + 3))
        self.dropout = torch.nn.Dropout(dropout)
        self.mix = 0.0


def test_expansions_that_are_not_row_wise_or_not_deterministic_are_declined():
    def expand(self, kv_nope, k_rot):
        B, _, W, _ = kv_nope.shape
        kv = self.dropout(self.up(kv_nope))[:, 0].view(B, W, 2, 7).transpose(1, 2)
        return kv[..., :4] + kv[..., :4].mean(dim=2, keepdim=True) * self.mix, kv[..., 4:]

    nope, rot = torch.randn(1, 1, 5, 6), torch.randn(1, 1, 5, 2)
    module = _Expanding()
    assert latent_adapter._expansion_reason(expand, module, nope, rot) is None
    assert latent_adapter._deterministic(expand, module, nope, rot)
    module.mix = 1.0
    assert "depend on other tokens" in latent_adapter._expansion_reason(expand, module, nope, rot)
    noisy = _Expanding(dropout=0.5).train()
    assert not latent_adapter._deterministic(expand, noisy, nope, rot)
    assert latent_adapter._deterministic(expand, noisy.eval(), nope, rot)
