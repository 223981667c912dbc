"""Moved to :mod:`cp_attention.tools.demo`; this module keeps ``python -m cp_attention.demo`` working."""

import sys

from cp_attention.tools.demo import TOLERANCE, main, parse_args

__all__ = ["TOLERANCE", "parse_args", "main"]

if __name__ == "__main__":
    sys.exit(main())
