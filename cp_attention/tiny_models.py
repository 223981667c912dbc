"""Moved to :mod:`cp_attention.tools.tiny_models`; this module keeps old imports working."""

from cp_attention.tools.tiny_models import FAMILIES, is_causal_lm, tiny_config, tiny_model

__all__ = ['FAMILIES', 'is_causal_lm', 'tiny_config', 'tiny_model']
