"""``python -m cp_attention``: the ``cp-attention`` command (see :mod:`cp_attention.tools.cli`)."""

import sys

from cp_attention.tools.cli import main

sys.exit(main(prog="python -m cp_attention"))
