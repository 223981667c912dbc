"""Memory: attention is O(L * (tile + window)), never O(L^2), on the engine and the cp_flash path.

Peak memory is measured in fresh child processes, never in the test process (whose allocator and
imports depend on what ran before). For a length L, two children run the same script:

* ``base``: imports torch and cp_attention, draws q, k, v and dout (1, L, 4, 64) float32;
* ``work``: the same, then causal attention with a 1024-token window, forward and backward.

Both use one thread (the peak does not depend on it; spinning OpenMP threads on a shared machine
make the run many times slower). Each prints its own ``ru_maxrss``: the high-water mark of its
resident memory, which the kernel raises before any page is released, so short-lived buffers count
too. ``work``'s value is the whole process's peak; ``work - base`` is the extra peak that forward
and backward need.
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

GIB = 1024 ** 3
H, D, WINDOW = 4, 64, 1024

CHILD = r"""
import json, resource, sys, time
import torch
import cp_attention

torch.set_num_threads(1)

L, window, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
gen = torch.Generator().manual_seed(0)
q, k, v, dout = (torch.randn(1, L, {H}, {D}, generator=gen) for _ in range(4))
for t in (q, k, v):
    t.requires_grad_()
start = time.perf_counter()
if mode == "work":
    out = cp_attention.attention(q, k, v, window=window)
    out.backward(dout)
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(q.grad).all())
print(json.dumps(dict(maxrss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      seconds=time.perf_counter() - start)))
""".replace("{H}", str(H)).replace("{D}", str(D))


@functools.lru_cache(maxsize=None)
def _measure(L: int, mode: str) -> dict:
    """maxrss (bytes) and seconds of one child process (see the module docstring)."""
    if sys.platform != "linux":
        pytest.skip("ru_maxrss is in KiB on Linux; other systems use other units")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-c", CHILD, str(L), str(WINDOW), mode], capture_output=True, text=True,
                         timeout=900, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _extra(L: int) -> int:
    return _measure(L, "work")["maxrss"] - _measure(L, "base")["maxrss"]


def test_131072_tokens_window_1024_forward_backward_below_4_gib():
    """H=4, D=64, float32, causal, window 1024, one device: the whole process peaks below 4 GiB."""
    work = _measure(131072, "work")
    assert work["maxrss"] < 4 * GIB, f"peak {work['maxrss'] / GIB:.2f} GiB"


def test_peak_memory_grows_linearly_with_length():
    """Extra peak at 16k, 32k and 128k tokens. Its growth per added token is the same from 16k to
    32k as from 32k to 128k (within 2x; an L^2 term makes the second 3.3x the first) and below
    16 KiB, i.e. 16 (L, H, D) float32 tensors (the gradients, output, float32 accumulators and
    saved tensors need about 8). Even an (L x L) bool buffer would add L bytes per token: 128 KiB
    at 128k."""
    lengths = (16384, 32768, 131072)
    extra = {L: _extra(L) for L in lengths}
    slope_low = (extra[32768] - extra[16384]) / (32768 - 16384)
    slope_high = (extra[131072] - extra[32768]) / (131072 - 32768)
    msg = (f"extra peak (MiB) { {L: round(n / 2 ** 20) for L, n in extra.items()} }, growth per token "
           f"{slope_low:.0f} then {slope_high:.0f} bytes")
    assert 0 < slope_low and 0 < slope_high < 16 * H * D * 4, msg
    assert 0.5 * slope_low < slope_high < 2 * slope_low, msg


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


def _engine_largest(L: int) -> _LargestTensors:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, L, 4, 16, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, L, 2, 16, generator=gen, requires_grad=True) for _ in range(2))
    pos = torch.cat([torch.arange(L // 3), torch.arange(L - L // 3)]).unsqueeze(0)  # two documents
    sinks = torch.zeros(4, requires_grad=True)
    with single_thread(), _LargestTensors(L) as mode:
        for kw in (dict(), dict(causal=False, window=L // 8, chunk_size=L // 4, softcap=5.0)):
            out = cp_attention.attention(q, k, v, position_ids=pos, sinks=sinks, **kw)
            out.sum().backward()
    return mode


def test_engine_never_builds_a_square_tensor():
    """Unlimited causal attention, and bidirectional with window, chunks and softcap, over two
    documents with sinks, forward and backward: no op output has two dimensions >= L, and the
    largest one at most doubles when L doubles (unlimited causal rows see O(L) keys per tile).
    L stays above the query rows of one reference tile (128 rows x 2 query heads per K/V head)."""
    small, large = _engine_largest(384), _engine_largest(768)
    assert not small.square and not large.square, (small.square + large.square)[:5]
    assert large.largest <= 2.2 * small.largest, (small.largest, large.largest)


def _model_largest(model, L: int) -> _LargestTensors:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (1, L), generator=gen)
    pos = torch.cat([torch.arange(L // 2), torch.arange(L - L // 2)]).unsqueeze(0)  # packed: two documents
    with single_thread(), _LargestTensors(L) as mode:
        model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False).loss.backward()
    return mode


def test_cp_flash_model_never_builds_a_square_tensor():
    """A tiny Qwen3 (sliding + full layer) under cp_flash, packed documents, forward and backward:
    neither transformers' mask creation (our mask function) nor the attention makes an (L x L)
    tensor, and the largest tensor grows linearly."""
    pytest.importorskip("transformers")
    from cp_attention.tiny_models import tiny_model

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

    from cp_attention.integrations.transformers import CPMask
    from cp_attention.tiny_models import tiny_config

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
