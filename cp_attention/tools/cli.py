"""The ``cp-attention`` command (also ``python -m cp_attention``): ``cp-attention {probe,demo,bench,check,patches} [options]``.

Each command is a module with ``main(argv, prog=...) -> int`` that parses its own options; this
module lists the commands and hands the rest of the command line to the chosen one.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import MappingProxyType

import cp_attention

__all__ = ["COMMANDS", "main"]

# name -> (module, one-line description)
COMMANDS = MappingProxyType({
    "probe": ("cp_attention.tools.probe", "does CP keep a tiny model's masks? (the main check)"),
    "demo": ("cp_attention.tools.demo", "attention on gloo ranks: error and K/V traffic"),
    "bench": ("cp_attention.tools.bench", "time cp_attention.attention against dense-mask SDPA"),
    "check": ("cp_attention.tools.check", "is your model exact under context parallelism? (a checkpoint or config)"),
    "patches": ("cp_attention.tools.patches", "what cp_attention changes in transformers, TRL and torch"),
})


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Context-parallel attention that honours every mask: checks and benchmarks.",
        epilog=f"'{prog} COMMAND --help' shows a command's options.")
    parser.add_argument("--version", action="version", version=f"cp_attention {cp_attention.__version__}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    for name, (_, description) in COMMANDS.items():
        commands.add_parser(name, help=description, add_help=False)  # options: the command's own parser
    return parser


def main(argv=None, *, prog: str = "cp-attention") -> int:
    """Run ``argv`` (default ``sys.argv[1:]``); returns the exit status, argparse's exits included
    (0 for ``--help``, 2 for a bad command line or no command at all)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in COMMANDS:
            module = importlib.import_module(COMMANDS[argv[0]][0])
            return module.main(argv[1:], prog=f"{prog} {argv[0]}")
        parser = _parser(prog)
        parser.parse_args(argv)  # --help / --version exit 0, an unknown command exits 2
        parser.print_help()  # no command
        return 2
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)


if __name__ == "__main__":
    sys.exit(main())
