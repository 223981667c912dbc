"""The flash backend: the varlen contract on flash-attn 3 / 4 / 2 or PyTorch's own flash kernels.

* :mod:`.interface`: what the adapters share (the contract's mask arguments in flash's conventions,
  calling an entry point by keyword whatever its version), and their base class;
* :mod:`.fa3`, :mod:`.fa4`, :mod:`.fa2`, :mod:`.aten`: one adapter per interface;
* :mod:`.backend`: :class:`FlashBackend`, which picks the first interface that fits.
"""

from .backend import INTERFACES, PREFERENCE, FlashBackend, new_interfaces, pick_interface
from .interface import kernel_arguments

__all__ = ["FlashBackend", "kernel_arguments", "pick_interface", "new_interfaces", "INTERFACES", "PREFERENCE"]
