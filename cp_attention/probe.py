"""Moved to :mod:`cp_attention.tools.probe`; this module keeps ``python -m cp_attention.probe`` working."""

import sys

from cp_attention.tools.probe import (BREAK_MASK_ENV, CHANGED, TOLERANCE, CaseResult, format_table, main,
                                      run_probe)

__all__ = ["CaseResult", "run_probe", "format_table", "main", "BREAK_MASK_ENV", "TOLERANCE", "CHANGED"]

if __name__ == "__main__":
    sys.exit(main())
