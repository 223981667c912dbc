"""Moved to :mod:`cp_attention.tools.bench`; this module keeps ``python -m cp_attention.bench`` working."""

import sys

from cp_attention.tools.bench import dense_mask, main, mask_case, parse_args

__all__ = ["mask_case", "dense_mask", "parse_args", "main"]

if __name__ == "__main__":
    sys.exit(main())
