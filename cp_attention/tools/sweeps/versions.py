"""The family sweep on every tested transformers release, side by side: what differs, and why.

The family sweep (:mod:`.family`) runs on one installed transformers. Its ``--json`` output on each tested
release (``cp_attention.integrations.hf.versions.TESTED_VERSIONS``) is added to one record,
``docs/data/versions.json`` (each family's outcome at world size 1 and CP = 2, with the refusal's reasons or
message), and ``docs/supported_versions.md`` is rendered from it: the counts per release, and every family
whose outcomes differ between releases with the reason each release gives.

CLI::

    python -m cp_attention.tools.sweeps.versions --add SWEEP.json --record docs/data/versions.json
    python -m cp_attention.tools.sweeps.versions --from docs/data/versions.json --page docs/supported_versions.md
"""

from __future__ import annotations

import argparse
import json
import os

from .tables import versions_page, ws1_as_eager

__all__ = ["compact", "add", "main"]

MODULE = "cp_attention.tools.sweeps.versions"


def _key(version: str) -> tuple[int, ...]:
    return tuple(int("".join(c for c in part if c.isdigit()) or 0) for part in version.split(".")[:3])


def compact(sweep: dict) -> dict:
    """{family: {"1": outcome record, "2": ...}} of a family sweep's ``--json`` output: the outcome ("as eager" at
    world size 1 where the support table says so), and the reasons (a model check's findings) or the first 120
    characters of the message; ``"truth": "sdpa"`` where the sweep's truth was the family's sdpa (its eager
    disagreed with it on one document)."""
    out = {}
    for r in sweep["results"]:
        outcomes = {}
        for ws, rec in sorted(r.get("outcomes", {}).items()):
            slim = {"outcome": rec.get("outcome", "")}
            if ws == "1" and slim["outcome"] == "wrong" and ws1_as_eager(r):  # the family's own eager, exactly
                slim = {"outcome": "as eager"}
            if rec.get("reasons"):
                slim["reasons"] = list(rec["reasons"])
            elif rec.get("outcome") not in ("exact", None) and rec.get("message"):
                slim["message"] = rec["message"][:120]
            outcomes[ws] = slim
        if not outcomes and r.get("outcome"):  # unbuildable: one outcome for the family
            outcomes = {"1": {"outcome": r["outcome"]}, "2": {"outcome": r["outcome"]}}
        if (r.get("oracle") or {}).get("impl") == "sdpa":  # the family's eager disagreed with its own sdpa
            outcomes["truth"] = "sdpa"
        out[r["family"]] = outcomes
    return out


def add(record: dict, sweep: dict) -> dict:
    """``record`` with the sweep's release (``sweep["transformers"]``) replaced by its compact results."""
    releases = dict(record.get("releases", {}))
    releases[sweep["transformers"]] = compact(sweep)
    return {"releases": {v: releases[v] for v in sorted(releases, key=_key)}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    p.add_argument("--add", default="", help="a family sweep's --json output to add to the record")
    p.add_argument("--record", default="docs/data/versions.json", help="the record to update (with --add)")
    p.add_argument("--from", dest="source", default="", help="render from this record")
    p.add_argument("--page", default="", help="write the page here")
    args = p.parse_args(argv)
    path = args.source or args.record
    record = {"releases": {}}
    if os.path.exists(path):
        with open(path) as f:
            record = json.load(f)
    if args.add:
        with open(args.add) as f:
            record = add(record, json.load(f))
        with open(args.record, "w") as f:
            json.dump(record, f, indent=1, sort_keys=True)
            f.write("\n")
    if args.page:
        with open(args.page, "w") as f:
            f.write(versions_page(record, path, args.page))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
