"""Memory: attention is O(L * (tile + window)), never O(L^2), on the engine and the cp_flash path.

Peak memory is measured in fresh child processes, never in the test process (whose allocator and
imports depend on what ran before). A child imports torch and cp_attention, draws q, k, v and dout
(1, L, 4, 64) float32, then runs causal attention with a 1024-token window, forward and backward,
on one thread (the peak does not depend on it; spinning OpenMP threads on a shared machine make
the run many times slower). glibc is told to return every freed block of 64 KiB or more to the
system, so the resident set tracks live memory. Just before the call the child records its
resident set and resets the kernel's high-water mark (after the same calls on a tiny problem, so
library code run once for the first time is not counted); after it, the high-water mark is the whole
process's peak, and its excess over the resident set before the call is the *extra* peak that
forward and backward need (short-lived buffers included: the mark rises before any page is
released).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest
import torch

import cp_attention
from rank_pool import single_thread

GIB, MIB = 1024 ** 3, 1024 ** 2
H, D, WINDOW = 4, 64, 1024

CHILD = r"""
import gc, json, sys, time
import torch
import cp_attention

def status_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

torch.set_num_threads(1)
L, window = int(sys.argv[1]), int(sys.argv[2])
gen = torch.Generator().manual_seed(0)
q, k, v, dout = (torch.randn(1, L, {H}, {D}, generator=gen) for _ in range(4))
for t in (q, k, v):
    t.requires_grad_()
# the same calls on a tiny problem first: code pages of the libraries count as resident once run
w = [torch.randn(1, 256, {H}, {D}, generator=gen, requires_grad=True) for _ in range(3)]
o = cp_attention.attention(*w, window=64)
o.backward(torch.randn_like(o))
del w, o
gc.collect()
before = status_kib("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the resident-set high-water mark
start = time.perf_counter()
out = cp_attention.attention(q, k, v, window=window)
out.backward(dout)
seconds = time.perf_counter() - start
peak = status_kib("VmHWM")
assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(q.grad).all())
print(json.dumps(dict(peak=peak * 1024, extra=(peak - before) * 1024, seconds=seconds)))
""".replace("{H}", str(H)).replace("{D}", str(D))


@functools.lru_cache(maxsize=None)
def _measure(L: int) -> dict:
    """Whole-process ``peak``, ``extra`` peak of the call (bytes) and its ``seconds`` (see the
    module docstring)."""
    if sys.platform != "linux":
        pytest.skip("the resident-set high-water mark is read from Linux's /proc")
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_=str(64 * 1024),
               MALLOC_TRIM_THRESHOLD_=str(128 * 1024))
    res = subprocess.run([sys.executable, "-c", CHILD, str(L), str(WINDOW)], capture_output=True, text=True,
                         timeout=900, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _results_bytes(L: int) -> int:
    """The call's own results: out, dq, dk and dv, (1, L, H, D) float32 each."""
    return 4 * L * H * D * 4


@pytest.mark.multirank  # starts a Python child process: out of the inner loop (tests/conftest.py)
def test_131072_tokens_window_1024_forward_backward_below_4_gib():
    """H=4, D=64, float32, causal, window 1024, one device: the whole process peaks below 4 GiB."""
    peak = _measure(131072)["peak"]
    assert peak < 4 * GIB, f"peak {peak / GIB:.2f} GiB"


@pytest.mark.multirank  # starts a Python child process: out of the inner loop (tests/conftest.py)
def test_peak_memory_grows_linearly_with_length():
    """Extra peak at 16k, 32k and 128k tokens. Its growth per added token is the same from 16k to
    32k as from 32k to 128k (within 2x; an L^2 term makes the second 3.3x the first) and below
    8 KiB, i.e. 8 (L, H, D) float32 tensors (the results alone are 4). Even an (L x L) bool buffer
    would add L bytes per token: 128 KiB at 128k."""
    lengths = (16384, 32768, 131072)
    extra = {L: _measure(L)["extra"] for L in lengths}
    slope_low = (extra[32768] - extra[16384]) / (32768 - 16384)
    slope_high = (extra[131072] - extra[32768]) / (131072 - 32768)
    msg = (f"extra peak (MiB) { {L: round(n / MIB) for L, n in extra.items()} }, growth per token "
           f"{slope_low:.0f} then {slope_high:.0f} bytes")
    assert 0 < slope_low and 0 < slope_high < 8 * H * D * 4, msg
    assert 0.5 * slope_low < slope_high < 2 * slope_low, msg


@pytest.mark.multirank  # starts a Python child process: out of the inner loop (tests/conftest.py)
def test_extra_memory_is_the_results_plus_a_small_workspace():
    """Forward + backward at world size 1 needs little beyond its own results (out, dq, dk, dv):
    no full-length accumulator copies them (the ring adopts the backend's results and merges in
    place) and the reference backend builds its masks one tile at a time. Bound: the results plus
    5% plus 16 MiB; two float32 copies of one (L, H, D) tensor would add 50%."""
    for L in (16384, 131072):
        extra, results = _measure(L)["extra"], _results_bytes(L)
        assert extra <= 1.05 * results + 16 * MIB, (
            f"L={L}: extra peak {extra / MIB:.1f} MiB for {results / MIB:.1f} MiB of results")


# ------------------------------------------------------------------------------------------------
# no (L x L) tensor anywhere: every tensor any aten op produces, forward and backward


class _LargestTensors(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the largest numel and every shape with two dimensions >= ``length`` among the outputs
    of all aten ops run under it, and how many ops ran in backward."""

    def __init__(self, length: int):
        super().__init__()
        self.length = length
        self.largest = 0
        self.square: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
                if sum(1 for n in t.shape if n >= self.length) >= 2:
                    self.square.append((str(func), tuple(t.shape)))
        return out


def _engine_largest(L: int, backend: str = "reference") -> _LargestTensors:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, L, 4, 16, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, L, 2, 16, generator=gen, requires_grad=True) for _ in range(2))
    pos = torch.cat([torch.arange(L // 3), torch.arange(L - L // 3)]).unsqueeze(0)  # two documents
    sinks = torch.zeros(4, requires_grad=True)
    with single_thread(), _LargestTensors(L) as mode:
        for kw in (dict(), dict(causal=False, window=L // 8, chunk_size=L // 4, softcap=5.0)):
            out = cp_attention.attention(q, k, v, position_ids=pos, sinks=sinks, backend=backend, **kw)
            out.sum().backward()
    return mode


def test_engine_never_builds_a_square_tensor():
    """Unlimited causal attention, and bidirectional with window, chunks and softcap, over two
    documents with sinks, forward and backward: no op output has two dimensions >= L, and the
    largest one at most doubles when L doubles (unlimited causal rows see O(L) keys per tile).
    L stays above the query rows of one reference tile (128 rows x 2 query heads per K/V head). The
    fused CPU backend ("auto" on CPU; softcap runs on the reference) builds no square tensor either."""
    small, large = _engine_largest(384), _engine_largest(768)
    assert not small.square and not large.square, (small.square + large.square)[:5]
    assert large.largest <= 2.2 * small.largest, (small.largest, large.largest)
    fused = _engine_largest(768, "auto")
    assert not fused.square, fused.square[:5]


def _model_largest(model, L: int) -> _LargestTensors:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (1, L), generator=gen)
    pos = torch.cat([torch.arange(L // 2), torch.arange(L - L // 2)]).unsqueeze(0)  # packed: two documents
    with single_thread(), _LargestTensors(L) as mode:
        model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False).loss.backward()
    return mode


@pytest.mark.transformers
def test_cp_flash_model_never_builds_a_square_tensor():
    """A tiny Qwen3 (sliding + full layer) under cp_flash, packed documents, forward and backward:
    neither transformers' mask creation (our mask function) nor the attention makes an (L x L)
    tensor, and the largest tensor grows linearly."""
    pytest.importorskip("transformers")
    from cp_attention.tools.tiny_models import tiny_model

    model = tiny_model("qwen3", "cp_flash", window=32)
    model.train()
    small, large = _model_largest(model, 512), _model_largest(model, 1024)
    assert not small.square and not large.square, (small.square + large.square)[:5]
    assert large.largest <= 2.2 * small.largest, (small.largest, large.largest)


def test_registered_mask_function_returns_linear_metadata():
    """transformers' own mask builders, with the "cp_flash" mask function registered for the name,
    return a CPMask whose tensors hold O(L) elements: 4x the length gives 4x the elements."""
    pytest.importorskip("transformers")
    import transformers.modeling_utils  # noqa: F401  loading the modeling code registers "cp_flash"
    from transformers import masking_utils

    from cp_attention.integrations.hf.masks import CPMask
    from cp_attention.tools.tiny_models import tiny_config

    config = tiny_config("qwen3", window=16)
    config._attn_implementation = "cp_flash"
    sizes = {}
    for L in (2048, 8192):
        embeds = torch.zeros(2, L, 1)
        padding = torch.ones(2, L, dtype=torch.long)
        padding[1, : L // 8] = 0
        pos = torch.cat([torch.arange(L // 2), torch.arange(L - L // 2)]).expand(2, L)
        for name in ("create_causal_mask", "create_sliding_window_causal_mask"):
            for attention_mask, position_ids in ((padding, None), (None, pos)):
                mask = getattr(masking_utils, name)(config=config, inputs_embeds=embeds, attention_mask=attention_mask,
                                                    past_key_values=None, position_ids=position_ids)
                assert isinstance(mask, CPMask), (name, type(mask))
                held = [t for t in (mask.valid, mask.opens) if t is not None]
                assert held, "the mask carries the padding or the detected documents"
                assert all(tuple(t.shape) == (2, L) for t in held), [tuple(t.shape) for t in held]
                sizes.setdefault((name, attention_mask is None), []).append(sum(t.numel() for t in held))
    for key, (small, large) in sizes.items():
        assert large == 4 * small, (key, small, large)
