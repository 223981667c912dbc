"""Moved to :mod:`cp_attention.tools.cli`; this module keeps old imports working."""

import sys

from cp_attention.tools.cli import COMMANDS, main

__all__ = ['COMMANDS', 'main']

if __name__ == "__main__":
    sys.exit(main())
