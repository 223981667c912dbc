"""The trainers under context parallelism: ``CPTrainer`` (transformers' ``Trainer``) and the TRL trainers
(``CPSFTTrainer``, ``CPDPOTrainer``, ``CPGRPOTrainer``, ``CPRLOOTrainer``, ``CPRewardTrainer``, ``CPKTOTrainer``,
``CPDistillationTrainer``), with the packed rows they share.

Imported on first use of a name (``from cp_attention.integrations.trainers import CPTrainer``): the TRL
trainers import TRL, which a user of ``CPTrainer`` alone need not have installed."""

from __future__ import annotations

import importlib
from types import MappingProxyType

_WHERE = MappingProxyType({
    "CPTrainer": "trainer", "CPTrainerMixin": "trainer", "CPSFTTrainer": "trl", "CPDPOTrainer": "trl",
    "CPGRPOTrainer": "trl", "CPRLOOTrainer": "trl", "CPRewardTrainer": "trl", "CPKTOTrainer": "trl",
    "CPDistillationTrainer": "trl", "CPRLTrainerMixin": "trl"})

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
