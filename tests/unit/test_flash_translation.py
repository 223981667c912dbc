"""The flash backend's argument translation, checked on CPU.

Each interface's kernels are replaced by stand-ins (tests/support/flash_stand_ins.py) with the
upstream signatures (flash-attn 3: ``hopper/flash_attn_interface.py``; flash-attn 4:
``flash_attn/cute/interface.py``; flash-attn 2: ``flash_attn/flash_attn_interface.py``; PyTorch: the
aten schemas, which the stand-ins are checked against). A stand-in checks what it receives as
upstream does (float16/bfloat16 inputs of one dtype, float32 raises; int32 ``cu_seqlens``; lse layout
(H, T) float32; dq/dk/dv buffers in the input dtype) and runs the reference backend in float32 under
that kernel's own conventions (how it reads its mask arguments, which lse it writes and expects for
rows that see no key), returning out and gradients in the input dtype and lse in float32 as the
kernels do. The backend must then match the
float64 loop oracle over the contract grid in float16 and bfloat16.

How a kernel reads its window is part of its conventions: each stand-in rewrites the window sides it
receives exactly as its source does before the mask is built (:func:`fa2_kernel_window`,
:func:`fa3_kernel_window`, :func:`_fa4_window`) and hands the reference the band that results, so an
adapter whose arguments a real kernel would read differently fails here too (the window read against
``max_seqlen_k`` by flash-attn 2 and PyTorch's copy of it: grid cases with more queries than keys and
:func:`test_real_plan_calls_through_flash_translation`).
"""
from __future__ import annotations

import inspect
import sys

import pytest
import torch

from cp_attention.backends.flash import aten as aten_mod, backend as flash_mod, fa3 as fa3_mod, fa4 as fa4_mod
from cp_attention.backends.flash import interface as iface_mod
from cp_attention.masks import MaskSpec
from contract_cases import GRID, LOW_PRECISION_TOL, check_backend_on_case
from contract_cases import cu as _cu
from flash_stand_ins import (FA2, FA2_6, FA3, FA3_WINDOW_TUPLE, FA4, FA4_TWO_OUTPUTS, REF,  # noqa: F401 (install)
                             fa2_varlen_forward, fa3_backward, fa3_window_tuple_forward, fa4_fwd, fa4_modules,
                             fake_aten_backward, fake_aten_forward, install)

NO_SOFTCAP = [c for c in GRID if c[5] is None]
VARIANT_CASES = [c for c in GRID if c[0] in ("window-left-only", "varlen-window", "lq>lk-window", "everything")]
Tensor = torch.Tensor


def _ids(cases):
    return [c[0] for c in cases]


# ----------------------------------------------------------------------------------------------
# forward + backward of every interface against the loop oracle


def _check(interface, case):
    """The stand-ins round out and dq/dk/dv to the input dtype, as the kernels do."""
    check_backend_on_case(flash_mod.FlashBackend(interface), case, dtypes=LOW_PRECISION_TOL)


@pytest.mark.parametrize("case", GRID, ids=_ids(GRID))
def test_fa3_translation_matches_loop_oracle(case, install):
    install(FA3)
    _check("fa3", case)


@pytest.mark.parametrize("case", NO_SOFTCAP, ids=_ids(NO_SOFTCAP))
def test_fa4_translation_matches_loop_oracle(case, install):
    install(FA4)
    _check("fa4", case)


@pytest.mark.parametrize("case", GRID, ids=_ids(GRID))
def test_fa2_translation_matches_loop_oracle(case, install):
    install(FA2)
    _check("fa2", case)


@pytest.mark.parametrize("case", NO_SOFTCAP, ids=_ids(NO_SOFTCAP))
def test_aten_translation_matches_loop_oracle(case, install):
    install()
    _check("aten", case)


RELEASES = {"fa3-window-tuple": (FA3_WINDOW_TUPLE, "fa3"), "fa4-two-outputs": (FA4_TWO_OUTPUTS, "fa4"),
            "fa2-2.6": (FA2_6, "fa2")}
EARLIER = [pytest.param(release, case, id=f"{release}-{case[0]}") for release in RELEASES for case in VARIANT_CASES
           if not (release.startswith("fa4") and case[5] is not None)]  # flash-attn 4: no softcap


@pytest.mark.parametrize("release, case", EARLIER)
def test_earlier_signatures(release, case, install):
    modules, interface = RELEASES[release]
    install(modules)
    _check(interface, case)


# ----------------------------------------------------------------------------------------------
# translation units, declared support, selection


def test_kernel_arguments():
    assert flash_mod.kernel_arguments(scale=0.5, causal=True, window=(-1, -1), softcap=None) == dict(
        is_causal=True, window_size_left=-1, window_size_right=0, scale=0.5, softcap=0.0)
    assert flash_mod.kernel_arguments(scale=1.0, causal=False, window=(0, -1), softcap=2.0) == dict(
        is_causal=False, window_size_left=0, window_size_right=-1, scale=1.0, softcap=2.0)
    # an off-diagonal halo block: window (W-2, 0) bottom-right is causal with a left window
    assert flash_mod.kernel_arguments(scale=1.0, causal=False, window=(7, 0), softcap=None)["is_causal"]


def test_fa4_mask_arguments():
    mask = fa4_mod.FlashAttn4._mask
    assert mask(True, -1, 0) == dict(causal=True, window_size_left=None, window_size_right=None)
    assert mask(True, 7, 0) == dict(causal=False, window_size_left=7, window_size_right=0)
    assert mask(False, 0, -1) == dict(causal=False, window_size_left=0, window_size_right=None)
    assert mask(False, -1, -1) == dict(causal=False, window_size_left=None, window_size_right=None)


def test_parameters_see_through_custom_ops():
    params = iface_mod.parameters(fa2_varlen_forward)
    assert list(params)[:4] == ["q", "k", "v", "cu_seqlens_q"] and "window_size_left" in params
    with pytest.raises(TypeError, match="takes no"):
        iface_mod.call_kernel(flash_mod.INTERFACES["fa4"], fa4_fwd, iface_mod.parameters(fa4_fwd), q=None,
                        window_size=(1, 0))


def fa3_forward_new_required(q, k, v, sink_scale, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                             max_seqlen_k=None, softmax_scale=None, causal=False, window_size_left=-1,
                             window_size_right=-1, softcap=0.0):
    """A hypothetical release whose forward gained a required parameter the adapter cannot know."""
    raise AssertionError("must not be called with a guessed sink_scale")


def fa4_bwd_new_required(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
                         window_size_left=None, window_size_right=None, cu_seqlens_q=None, cu_seqlens_k=None,
                         max_seqlen_q=None, max_seqlen_k=None, *, dlse_scale):
    raise AssertionError("must not be called with a guessed dlse_scale")


@pytest.mark.parametrize("interface", ["fa3", "fa4"])
def test_unknown_required_parameter_raises(interface, install):
    """A required parameter the adapter does not supply (and does not know as optional) is an upstream
    signature change: raise, naming the interface, the parameter and the installed version."""
    if interface == "fa3":
        install({"flash_attn_interface": dict(_flash_attn_forward=fa3_forward_new_required,
                                              _flash_attn_backward=fa3_backward, __version__="3.9.1")})
        name, version = "sink_scale", "flash_attn_interface 3.9.1"
    else:
        modules = fa4_modules(fa4_fwd, fa4_bwd_new_required)
        modules["flash_attn.cute"] = dict(__version__="4.0.7")
        install(modules)
        name, version = "dlse_scale", "flash_attn.cute 4.0.7"
    backend = flash_mod.FlashBackend(interface)
    q = torch.randn(6, 2, 16, dtype=torch.bfloat16)
    cu = _cu([6])
    kw = dict(scale=0.25, causal=True)
    with pytest.raises(TypeError) as info:
        out, lse = backend.forward(q, q, q, cu, cu, 6, 6, **kw)
        backend.backward(q, q, q, q, out, lse, cu, cu, 6, 6, **kw)
    message = str(info.value)
    assert flash_mod.INTERFACES[interface].label in message and repr(name) in message and version in message


def test_optional_parameters_without_default_get_none(install):
    """flash-attn 3.0 betas declare optional tensors without defaults: those (and only those) the adapter
    knows get None; the release's own stand-in asserts they are None."""
    params = iface_mod.parameters(fa3_window_tuple_forward)
    required = {n for n, p in params.items() if p.default is inspect.Parameter.empty}
    assert {"k_new", "seqused_q", "q_descale"} <= required <= fa3_mod.FlashAttn3.none_params | {
        "q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal"}
    install(FA3_WINDOW_TUPLE)
    _check("fa3", GRID[0])


# ----------------------------------------------------------------------------------------------
# what the stand-ins accept: dtypes as upstream, and PyTorch's real schemas


@pytest.mark.parametrize("interface, modules", [("fa3", FA3), ("fa4", FA4), ("fa2", FA2), ("aten", {})],
                         ids=["fa3", "fa4", "fa2", "aten"])
def test_stand_ins_reject_float32_like_upstream(interface, modules, install):
    install(modules)
    backend = flash_mod.FlashBackend(interface)
    cu = _cu([5, 3])
    kw = dict(scale=0.25, causal=True)
    q32 = torch.randn(8, 2, 16)
    with pytest.raises((RuntimeError, AssertionError), match="fp16 and bf16|float16 or bfloat16"):
        backend.forward(q32, q32, q32, cu, cu, 5, 5, **kw)
    q = q32.to(torch.bfloat16)
    out, lse = backend.forward(q, q, q, cu, cu, 5, 5, **kw)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    with pytest.raises((RuntimeError, AssertionError), match="fp16 and bf16|float16 or bfloat16"):
        backend.backward(out.float(), q32, q32, q32, out.float(), lse, cu, cu, 5, 5, **kw)
    with pytest.raises((RuntimeError, AssertionError), match="same dtype"):
        backend.forward(q, q.half(), q, cu, cu, 5, 5, **kw)
    grads = backend.backward(out, q, q, q, out, lse, cu, cu, 5, 5, **kw)
    assert all(g.dtype == torch.float32 for g in grads), "the contract's gradients are float32"


@pytest.mark.parametrize("stand_in, op", [(fake_aten_forward, "_flash_attention_forward"),
                                          (fake_aten_backward, "_flash_attention_backward")],
                         ids=["forward", "backward"])
def test_aten_stand_ins_bind_to_the_real_schema(stand_in, op):
    """Same argument names in the same order, the same keyword-only part and defaults, and as many
    returns as ``torch.ops.aten.<op>`` declares (its schema is readable without CUDA)."""
    schema = getattr(torch.ops.aten, op).default._schema
    params = list(inspect.signature(stand_in).parameters.values())
    assert [p.name for p in params] == [a.name for a in schema.arguments]
    assert [p.kind is inspect.Parameter.KEYWORD_ONLY for p in params] == [a.kwarg_only for a in schema.arguments]
    assert [p.default is not inspect.Parameter.empty for p in params] == [
        a.has_default_value() for a in schema.arguments]
    assert all(p.default is None for p in params if p.default is not inspect.Parameter.empty)

    q = torch.randn(8, 2, 16, dtype=torch.bfloat16)
    cu = _cu([5, 3])
    mask = dict(scale=0.25, window_size_left=-1, window_size_right=0)
    result = fake_aten_forward(q, q, q, cu, cu, 5, 5, 0.0, True, False, **mask)
    if op == "_flash_attention_backward":
        result = fake_aten_backward(q, q, q, q, result[0], result[1], cu, cu, 5, 5, 0.0, True, result[2],
                                    result[3], **mask)
    assert len(result) == len(schema.returns) and all(isinstance(t, torch.Tensor) for t in result)


def test_aten_adapter_calls_bind_to_the_real_ops():
    """The adapter's own calls, against PyTorch's real ops on meta tensors (their meta kernels run
    without CUDA): argument binding, return arity, dtypes and shapes."""
    iface = aten_mod.AtenFlash()
    assert iface.unavailable() is None
    q = torch.empty(10, 4, 16, dtype=torch.bfloat16, device="meta")
    k = torch.empty(10, 2, 16, dtype=torch.bfloat16, device="meta")
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    mask = flash_mod.kernel_arguments(scale=0.25, causal=True, window=(3, 0), softcap=None)
    out, lse = iface.forward(q, k, k, cu, cu, 6, 6, **mask)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (4, 10) and lse.dtype == torch.float32
    dq, dk, dv = iface.backward(q, q, k, k, out, lse, cu, cu, 6, 6, **mask)
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape and dq.dtype == q.dtype


def test_releases_without_varlen_backward_are_not_used(install):
    def old_fa3_forward(q, k, v, softmax_scale, causal, q_descale=None, k_descale=None, v_descale=None,
                        window_size=(-1, -1), sink_token_length=0, softcap=0.0, num_splits=1, pack_gqa=None):
        raise AssertionError("must not be called")

    def old_fa4_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0, m_block_size=64):
        raise AssertionError("must not be called")

    install({"flash_attn_interface": dict(_flash_attn_forward=old_fa3_forward, _flash_attn_backward=fa3_backward)},
            fa4_modules(fa4_fwd, old_fa4_bwd))
    assert "cu_seqlens_q" in flash_mod.INTERFACES["fa3"].unavailable()
    assert "cu_seqlens_q" in flash_mod.INTERFACES["fa4"].unavailable()
    assert flash_mod.INTERFACES["fa2"].unavailable() == "not installed"
    name, rejected = flash_mod.pick_interface(capability=(9, 0), head_dim=64, softcap=False)
    assert name == "aten" and len(rejected) == 3


def test_broken_install_is_reported_not_hidden(install, tmp_path, monkeypatch):
    install()
    (tmp_path / "flash_attn_interface.py").write_text("import flash_attn_3_missing_extension\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn_interface")
    reason = flash_mod.INTERFACES["fa3"].unavailable()
    assert reason.startswith("not importable") and "flash_attn_3_missing_extension" in reason


def test_preference_and_declared_support(install):
    install(FA3, FA4, FA2)

    def pick(capability, head_dim=128, softcap=False):
        return flash_mod.pick_interface(capability=capability, head_dim=head_dim, softcap=softcap)

    assert pick((9, 0))[0] == "fa3"
    assert pick((9, 0), softcap=True)[0] == "fa3"
    assert pick((10, 0))[0] == "fa4"
    assert pick((10, 0), softcap=True) == ("fa2", [
        "flash-attn 3 (flash_attn_interface): needs a Hopper GPU (sm90), got sm100",
        "flash-attn 4 (flash_attn.cute.interface): no softcap in its varlen backward"])
    assert pick((10, 0), head_dim=192)[0] == "fa2"  # fa4: at most 128 here
    assert pick((12, 0))[0] == "fa2"
    assert pick((8, 0))[0] == "fa2"
    name, rejected = pick((9, 0), head_dim=264)
    assert name is None and len(rejected) == 4 and all("at most" in r or "sm90" in r for r in rejected)
    name, rejected = pick((7, 5))
    assert name is None and all("sm" in r for r in rejected)

    install(FA4)
    assert pick((9, 0)) == ("aten", [
        "flash-attn 3 (flash_attn_interface): not installed",
        "flash-attn 4 (flash_attn.cute.interface): used on Blackwell (sm100/sm110) only, got sm90",
        "flash-attn 2 (flash_attn.flash_attn_interface): not installed"])


def test_backend_picks_per_device_capability(install, monkeypatch):
    install(FA3, FA2)
    monkeypatch.setattr(flash_mod, "_capability", lambda device: (9, 0))
    backend = flash_mod.FlashBackend()
    cuda = torch.device("cuda")
    assert backend.interface_for(device=cuda, head_dim=64) == "fa3"
    assert backend.not_supported_reasons(device=cuda, dtype=torch.bfloat16, head_dim=64, spec=MaskSpec()) == []
    monkeypatch.setattr(flash_mod, "_capability", lambda device: (8, 6))
    assert backend.interface_for(device=cuda, head_dim=64, softcap=True) == "fa2"
    reasons = backend.not_supported_reasons(device=cuda, dtype=torch.bfloat16, head_dim=12, spec=MaskSpec())
    assert len(reasons) == 4 and "flash-attn 2 (flash_attn.flash_attn_interface): head_dim 12" in reasons[2]


def test_flash_declares_what_it_cannot_run(install):
    install()
    reasons = flash_mod.FlashBackend("aten").not_supported_reasons(
        device=torch.device("cpu"), dtype=torch.float32, head_dim=12, spec=MaskSpec(softcap=2.0))
    text = " | ".join(reasons)
    assert "CUDA" in text and "float16/bfloat16" in text and "multiple of 8" in text and "softcap" in text
    with pytest.raises(ValueError, match="interface must be None or one of"):
        flash_mod.FlashBackend("fa5")


def test_dispatch_names_every_rejected_backend():
    from cp_attention.backends import select_backend

    assert select_backend("auto", device=torch.device("cpu"), dtype=torch.float32, head_dim=16,
                          spec=MaskSpec()).name == "cpu"
    assert select_backend("auto", device=torch.device("cpu"), dtype=torch.float64, head_dim=16,
                          spec=MaskSpec()).name == "reference"
    with pytest.raises(ValueError, match="no attention backend supports these inputs: flash: flash kernels need CUDA"):
        select_backend("flash", device=torch.device("cpu"), dtype=torch.float32, head_dim=16, spec=MaskSpec())


def test_kernel_ops_have_fake_implementations():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k = torch.empty(10, 4, 64, dtype=torch.bfloat16), torch.empty(7, 2, 64, dtype=torch.bfloat16)
        cu = torch.zeros(3, dtype=torch.int32)
        out, lse = flash_mod.flash_varlen_fwd(q, k, k, cu, cu, 5, 4, 0.125, True, -1, 0, 0.0, "fa4")
        dq, dk, dv = flash_mod.flash_varlen_bwd(q, q, k, k, out, lse, cu, cu, 5, 4, 0.125, True, -1, 0, 0.0, "fa3")
    assert out.shape == q.shape and lse.shape == (4, 10) and lse.dtype == torch.float32
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape


# ----------------------------------------------------------------------------------------------
# every kernel call of real windowed plans, through each interface's translation


PLAN_L, PLAN_WINDOW = 8192, 4096
PLAN_DOCUMENTS = {"one document": None, "packed 6 documents": [116, 649, 5131, 987, 621, 688],
                  "packed 3 documents": [1955, 4627, 1610]}


def real_plan_calls():
    """The distinct kernel calls (``cu_seqlens``, causal, window) of every rank's plan for a causal
    layer with window 4096 over L = 8192 tokens: zigzag and contiguous, P = 2 and 4, one document
    and packed documents, each with where it first occurs."""
    from cp_attention.masks import SequenceMeta
    from cp_attention.plan import build_plan

    calls = {}
    for docs_name, docs in PLAN_DOCUMENTS.items():
        cu = None if docs is None else torch.tensor([0] + docs).cumsum(0)
        meta = SequenceMeta.from_inputs(1, PLAN_L, cu_seqlens=cu)
        for layout in ("zigzag", "contiguous"):
            for P in (2, 4):
                for rank in range(P):
                    plan = build_plan(meta, MaskSpec(window=PLAN_WINDOW), world_size=P, layout=layout, rank=rank,
                                      head_kv=1, head_dim=8, itemsize=2)
                    for step in plan.steps():
                        for c in step.calls:
                            key = (tuple(c.cu_seqlens_q.tolist()), tuple(c.cu_seqlens_k.tolist()), c.causal,
                                   c.window)
                            where = f"{layout} P={P} {docs_name}: rank {rank} x K/V of rank {step.source}"
                            calls.setdefault(key, (c, where))
    return list(calls.values())


@pytest.mark.parametrize("interface, modules", [("fa2", FA2), ("aten", {}), ("fa3", FA3), ("fa4", FA4)],
                         ids=["fa2", "aten", "fa3", "fa4"])
def test_real_plan_calls_through_flash_translation(interface, modules, install):
    """Each call runs forward and backward through the flash backend (the stand-in applying the
    kernel's own reading of its window) and through the reference backend with the contract's
    arguments, on the same float16 inputs; any key a kernel would lose or add shows in out, lse or a
    gradient. The calls include those with more queries than ``max_seqlen_k + 1`` and an unlimited
    right side (zigzag, window 4096: a rank's two pieces against the other's halo), which
    FlashAttention-2 reads wrongly unless ``max_seqlen_k`` covers the queries."""
    install(modules)
    backend = flash_mod.FlashBackend(interface)
    calls = real_plan_calls()
    assert len(calls) >= 30 and any(c.max_seqlen_q > c.max_seqlen_k + 1 and c.window[1] < 0 for c, _ in calls)
    wrong = []
    for n, (c, where) in enumerate(calls):
        gen = torch.Generator().manual_seed(n)
        Tq, Tk = int(c.cu_seqlens_q[-1]), int(c.cu_seqlens_k[-1])
        q, dout = (torch.randn(Tq, 2, 8, generator=gen).half() for _ in range(2))
        k, v = (torch.randn(Tk, 1, 8, generator=gen).half() for _ in range(2))
        kw = dict(scale=8 ** -0.5, causal=c.causal, window=c.window)
        args = (c.cu_seqlens_q, c.cu_seqlens_k, c.max_seqlen_q, c.max_seqlen_k)
        out, lse = backend.forward(q, k, v, *args, **kw)
        grads = backend.backward(dout, q, k, v, out, lse, *args, **kw)
        ref_out, ref_lse = REF.forward(q.float(), k.float(), v.float(), *args, **kw)
        ref_grads = REF.backward(dout.float(), q.float(), k.float(), v.float(), ref_out, ref_lse, *args, **kw)
        seen = ~torch.isneginf(ref_lse)
        ok = (torch.equal(torch.isneginf(lse), ~seen) and torch.allclose(lse[seen], ref_lse[seen], atol=1e-3)
              and torch.allclose(out.float(), ref_out, atol=4e-3)
              and all(torch.allclose(g, rg, atol=4e-3) for g, rg in zip(grads, ref_grads)))
        if not ok:
            lost = int((out.float() - ref_out).abs().amax(dim=(1, 2)).gt(4e-3).sum())
            wrong.append(f"{where} (queries {c.max_seqlen_q}, keys {c.max_seqlen_k}, window {c.window}: "
                         f"{lost} rows off)")
    assert not wrong, f"{len(wrong)} of {len(calls)} real plan calls wrong through {interface}: " + "; ".join(wrong)
