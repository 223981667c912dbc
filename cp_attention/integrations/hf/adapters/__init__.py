"""The adapters: one file per adapted thing of transformers' modeling code, and their table.

Each file defines ``ADAPTER``, an instance of :class:`.base.Adapter`; :data:`ADAPTERS` holds them in the order
of :data:`ROWS`, the order in which the registry adapts a modeling module. The rest of the wing (the
registry, the model check, the guard, cp_flash's attention function) reads the adapters through this table
only and names none of them; ``tests/meta/test_layering.py`` checks that the table's rows are exactly the
files of this folder.
"""

from __future__ import annotations

from importlib import import_module

__all__ = ["ROWS", "ADAPTERS"]

ROWS = (
    "mixer_functions",  # module-level mixer functions: short convolutions, Mamba, Mamba-2, gated DeltaNet
    "step_functions",   # transformers 5.25's mixer step functions, checked to call the ones above
    "mixer_classes",    # mixer classes computing their own recurrence or token shift
    "router_loss",      # the MoE router's auxiliary loss
    "indexers",         # DeepSeek Sparse Attention's token indexers, Qwen4's block indexer
    "compressed",       # DeepSeek-V4's compressors
    "rope",             # length-dependent rotary modules
    "latent",           # multi-head latent attention's expansion of its latent (the ring moves the latent)
)

ADAPTERS = tuple(import_module(f".{row}", __name__).ADAPTER for row in ROWS)
