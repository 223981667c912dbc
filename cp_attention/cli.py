"""The ``cp-attention`` command: ``cp-attention demo [options]``."""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"demo": "cp_attention.demo", "probe": "cp_attention.probe"}
    if not argv or argv[0] not in commands:
        print(f"usage: cp-attention {{{','.join(commands)}}} [options]   (--help after a command for its options)")
        return 2
    import importlib

    return importlib.import_module(commands[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
