"""Moved to :mod:`cp_attention.tools.launch`; this module keeps old imports working."""

from cp_attention.tools.launch import free_port, run_ranks

__all__ = ['free_port', 'run_ranks']
