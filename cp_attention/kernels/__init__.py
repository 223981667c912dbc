"""Triton kernels and their launchers (no autograd). Importing this package requires triton."""

from .varlen_attention import varlen_bwd, varlen_fwd

__all__ = ["varlen_fwd", "varlen_bwd"]
