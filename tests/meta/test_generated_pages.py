"""The generated pages are current: each equals what its generator renders from its committed record,
so a page edited by hand, or a record updated without its page, fails here.

* docs/supported_models.md, docs/supported_heads.md, docs/supported_vlms.md: rendered by the sweeps'
  ``--from RECORD --page PAGE`` (``cp_attention.tools.sweeps.tables.PAGES``) from docs/data/*.json;
* docs/mutants.md: rendered by ``python tests/mutations.py --page docs/mutants.md`` from
  docs/data/mutants.json, whose records name exactly the mutants of ``tests/mutations.py``, in order.

Each check is also shown to fail on a planted stale row or record (in a copy of docs/).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

import mutations
from cp_attention.tools.sweeps import tables

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _read(root: str, path: str) -> str | None:
    try:
        with open(os.path.join(root, path)) as f:
            return f.read()
    except FileNotFoundError:
        return None


def stale_pages(root: str = ROOT) -> list[str]:
    """Every generated page under ``root`` that differs from what its generator renders, with the command
    that regenerates it."""
    problems = []
    pages = {name: (page, data, lambda data, page, name=name: tables.render(name, root))
             for name, (page, data, _) in tables.PAGES.items()}
    pages["mutants"] = (mutations.PAGE, mutations.RECORD, lambda data, page: mutations.page(
        mutations.read_record(os.path.join(root, data)), data, page))
    for name, (page, data, render) in pages.items():
        want, have = render(data, page), _read(root, page)
        if have != want:
            command = want.splitlines()[0].split("`")[1]
            problems.append(f"{page} is {'missing' if have is None else 'stale'}: it is not what `{command}` "
                            f"renders from {data}; run that command (after a rerun: its record) instead of editing it")
    return problems


def mutants_record_problems(root: str = ROOT) -> list[str]:
    """How the mutants' record differs from tests/mutations.py's MUTANTS (names, order, duplicates)."""
    names = [r["name"] for r in mutations.read_record(os.path.join(root, mutations.RECORD))["results"]]
    want = [m.name for m in mutations.MUTANTS]
    problems = [f"recorded but not a mutant: {n!r}" for n in names if n not in want]
    problems += [f"a mutant without a record: {n!r}" for n in want if n not in names]
    problems += [f"recorded {names.count(n)} times: {n!r}" for n in sorted(set(names)) if names.count(n) > 1]
    if not problems and names != want:
        problems.append("the records are not in the order of MUTANTS")
    return problems


def test_every_generated_page_is_current():
    assert stale_pages() == []


def test_the_mutants_record_names_exactly_the_current_mutants():
    assert mutants_record_problems() == []


def _copy_docs(tmp_path) -> str:
    shutil.copytree(os.path.join(ROOT, "docs"), tmp_path / "docs")
    return str(tmp_path)


def _edit_json(path: str, change) -> None:
    with open(path) as f:
        record = json.load(f)
    change(record)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)


@pytest.mark.parametrize("page", [page for page, _, _ in tables.PAGES.values()] + [mutations.PAGE])
def test_a_typed_row_makes_its_page_stale(tmp_path, page):
    root = _copy_docs(tmp_path)
    path = os.path.join(root, page)
    with open(path) as f:
        lines = f.read().splitlines(keepends=True)
    header = next(i for i, line in enumerate(lines) if line.startswith("|---"))
    lines[header + 1] = lines[header + 1].rstrip("\n").removesuffix(" |") + " (typed) |\n"  # the first row
    with open(path, "w") as f:
        f.writelines(lines)
    problems = stale_pages(root)
    assert len(problems) == 1 and problems[0].startswith(f"{page} is stale"), problems


@pytest.mark.parametrize("name", sorted(tables.PAGES) + ["mutants"])
def test_a_record_changed_without_its_page_makes_the_page_stale(tmp_path, name):
    root = _copy_docs(tmp_path)
    page, data = (mutations.PAGE, mutations.RECORD) if name == "mutants" else tables.PAGES[name][:2]

    def change(record):
        if name == "versions":  # {"releases": {release: {family: outcomes}}}
            results = next(iter(record["releases"].values()))
            family = next(iter(results))
            results[family] = {slot: {"outcome": "crash", "message": "planted"} for slot in ("1", "2")}
            return
        first = record["results"][0]
        if name == "mutants":
            first["detail"] = "tests/unit/test_nothing.py::test_nothing"
        elif name == "heads":
            first["outcome"] = "wrong" if first["outcome"] != "wrong" else "exact"
            first.update(loss_err=1.0, grad_rel=1.0)
        else:
            first["outcomes"] = {slot: {"outcome": "crash", "message": "planted"} for slot in first["outcomes"]}

    _edit_json(os.path.join(root, data), change)
    assert [p.split(" is ")[0] for p in stale_pages(root)] == [page]


def test_the_versions_record_holds_tested_releases_and_the_support_tables_one():
    """docs/data/versions.json holds the family sweep of every tested transformers release and no other, nothing
    wrong or crashing on any, and its release of the support tables is docs/data/families.json's."""
    from cp_attention.integrations.hf.versions import TESTED_VERSIONS
    from cp_attention.tools.sweeps.versions import compact

    record = tables.read_record(os.path.join(ROOT, tables.PAGES["versions"][1]))
    families = tables.read_record(os.path.join(ROOT, tables.PAGES["families"][1]))
    assert set(record["releases"]) == set(TESTED_VERSIONS)
    bad = [(v, f, ws, o["outcome"]) for v, res in record["releases"].items() for f, cells in res.items()
           for ws, o in cells.items() if isinstance(o, dict) and o["outcome"] in ("wrong", "crash", "timeout")]
    assert not bad, bad
    assert record["releases"][families["transformers"]] == compact(families)


def test_a_missing_page_is_reported(tmp_path):
    root = _copy_docs(tmp_path)
    os.remove(os.path.join(root, tables.PAGES["vlms"][0]))
    problems = stale_pages(root)
    assert len(problems) == 1 and problems[0].startswith("docs/supported_vlms.md is missing"), problems


@pytest.mark.parametrize("change, expected", [
    (lambda results: results.pop(), "a mutant without a record"),
    (lambda results: results.append(dict(name="a bug nobody planted", caught=True, detail="x")), "not a mutant"),
    (lambda results: results.append(dict(results[0])), "recorded 2 times"),
    (lambda results: results.reverse(), "not in the order"),
])
def test_the_mutants_record_check_fails_on_a_stale_record(tmp_path, change, expected):
    root = _copy_docs(tmp_path)
    _edit_json(os.path.join(root, mutations.RECORD), lambda record: change(record["results"]))
    problems = mutants_record_problems(root)
    assert any(expected in p for p in problems), problems
