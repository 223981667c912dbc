"""``cp-attention patches``: what cp_attention changes in transformers, TRL and torch (docs/patches.md).

Prints the register of sites (:data:`cp_attention.integrations.patches.SITES`), or writes it to ``--page``; with
``--applied MODULE ...``, imports those modules (transformers modeling modules) and prints the patches made in
this process, with their admission checks.
"""

from __future__ import annotations

import argparse
import importlib

__all__ = ["main", "page"]


def page() -> str:
    """docs/patches.md: the register of sites, then the adapters (the table of
    :mod:`cp_attention.integrations.hf.adapters`): what each adapts, how it admits it, its sites and what it adds
    to the model check, the guard's preparation and a layer call."""
    from cp_attention.integrations import patches
    from cp_attention.integrations.hf.adapters import ADAPTERS, ROWS
    from cp_attention.integrations.hf.adapters.base import Adapter

    def adds(adapter) -> str:
        parts = [what for method, what in (("findings", "model check rules"), ("prepare", "marks or hooks a model"),
                                           ("computes", "verified at first use"), ("stands_in", "stands in under the trace"),
                                           ("layer_call", "amends a layer call"))
                 if getattr(type(adapter), method) is not getattr(Adapter, method)]
        return ", ".join(parts) or "-"

    lines = ["", "## The adapters", "",
             "One file each in `cp_attention/integrations/hf/adapters/`, one row each in its table (`ROWS`), in the "
             "order the registry adapts a modeling module; the registry, the model check, the guard and cp_flash's "
             "attention function read them through the table only (docs/architecture.md#the-integrations-wing).", "",
             "| adapter | what it adapts | how it admits it | sites | what it adds |", "|---|---|---|---|---|"]
    for row, adapter in zip(ROWS, ADAPTERS):
        sites = ", ".join(f"`{s}`" for s in adapter.sites)
        lines.append(f"| `{row}` | {adapter.adapts} | {adapter.admission} | {sites} | {adds(adapter)} |")
    return patches.page() + "\n".join(lines) + "\n"


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
            f.write(page())
    else:
        print(page(), end="")
    return 0
