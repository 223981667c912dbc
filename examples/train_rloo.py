"""A TRL RLOO script whose training step runs under context parallelism, with two changed lines.

    torchrun --nproc_per_node=2 examples/train_rloo.py --out /tmp/cp          # CPRLOOTrainer, cp_flash, CP = 2
    python examples/train_rloo.py --single --out /tmp/single                  # plain RLOOTrainer, eager, 1 process

The script is ``train_grpo.py --trainer rloo`` (its docstring: the data, the fixed completions, the
options and the outputs). RLOO's step differs from GRPO's in what it computes, not in what context
parallelism does: each process generates its own completions, the CP group's sequences are joined
and packed, and the old, reference and policy forwards run on this rank's shard. The lines that
differ from a plain RLOO script are the ones marked ``# CP`` in train_grpo.py (``CPRLOOTrainer``,
``attn_implementation="cp_flash"``).
"""

from __future__ import annotations

import sys

import train_grpo


def main(argv=None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    train_grpo.main(["--trainer", "rloo", *args])


if __name__ == "__main__":
    main()
