"""``cp-attention patches``: what cp_attention changes in transformers, TRL and torch (docs/patches.md).

Prints the register of sites (:data:`cp_attention.integrations.patches.SITES`), or writes it to ``--page``; with
``--applied MODULE ...``, imports those modules (transformers modeling modules) and prints the patches made in
this process, with their admission checks.
"""

from __future__ import annotations

import argparse
import importlib

__all__ = ["main"]


def main(argv=None, *, prog: str = "cp-attention patches") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--page", default="", help="write the register here (docs/patches.md) instead of printing it")
    parser.add_argument("--applied", nargs="*", default=None, metavar="MODULE",
                        help="import these modules and print the patches made in this process")
    args = parser.parse_args(argv)
    import cp_attention  # noqa: F401 - installs the integrations
    from cp_attention.integrations import patches

    if args.applied is not None:
        import transformers  # noqa: F401 - cp_flash registers as its modeling code loads
        import transformers.modeling_utils  # noqa: F401

        for name in args.applied:
            importlib.import_module(name)
        for p in patches.applied():
            print(f"{p.site:24s} {p.target}  (admitted: {p.admitted})")
        return 0
    if args.page:
        with open(args.page, "w") as f:
            f.write(patches.page())
    else:
        print(patches.page(), end="")
    return 0
