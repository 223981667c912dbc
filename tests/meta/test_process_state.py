"""The table of process state (docs/architecture.md) lists every module-level mutable object of the
package, next to its owner, and nothing else: found statically from the source, so a new global
without a row (or a row whose global is gone) fails here.

Mutable: a dict, list or set display, a call of a mutable constructor (``dict()``, ``threading.local()``,
a ``ContextVar``, a weak dictionary, a ``PlanCache``, a lock, ...), and a function memoised by
``functools.lru_cache`` / ``functools.cache`` (its cache is process state). Constant tables are made
immutable instead (``types.MappingProxyType``, tuples), so they need no row. A lock needs no row of its
own: it must be named in the "guarded by" column of a row of its module.
"""

from __future__ import annotations

import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
while not os.path.exists(os.path.join(ROOT, "pyproject.toml")):
    ROOT = os.path.dirname(ROOT)
PACKAGE = os.path.join(ROOT, "cp_attention")
PAGE = os.path.join(ROOT, "docs", "architecture.md")
MARK = "<!-- process-state -->"
MUTABLE_CALLS = {"dict", "list", "set", "OrderedDict", "defaultdict", "deque", "local", "ContextVar",
                 "WeakIdKeyDictionary", "WeakKeyDictionary", "WeakValueDictionary", "WeakSet", "PlanCache",
                 "Lock", "RLock", "Condition", "Semaphore", "Event"}
LOCKS = {"Lock", "RLock", "Condition", "Semaphore"}
CACHES = ("lru_cache", "cache")


def _call_name(node: ast.AST) -> str | None:
    return ast.unparse(node.func).rpartition(".")[2] if isinstance(node, ast.Call) else None


def module_state(source: str) -> tuple[set[str], set[str]]:
    """(mutable objects, locks) bound at the top level of a module's source (functions memoised by
    a cache decorator appear as ``name()``)."""
    objects, locks = set(), set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in node.decorator_list:
                target = d.func if isinstance(d, ast.Call) else d
                if ast.unparse(target).rpartition(".")[2] in CACHES:
                    objects.add(f"{node.name}()")
            continue
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        names = [t.id for t in targets if isinstance(t, ast.Name) and t.id != "__all__"]
        kind = _call_name(value)
        if kind in LOCKS:
            locks.update(names)
        elif isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or \
                kind in MUTABLE_CALLS:
            objects.update(names)
    return objects, locks


def package_state(package: str = PACKAGE) -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
    """(module path, object) of every mutable object and of every lock of the package."""
    objects, locks = set(), set()
    for folder, _, files in os.walk(package):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, os.path.dirname(package)).replace(os.sep, "/")
                with open(path) as f:
                    found, found_locks = module_state(f.read())
                objects |= {(rel, o) for o in found}
                locks |= {(rel, lock) for lock in found_locks}
    return objects, locks


def table_rows(text: str) -> list[dict]:
    """The rows of the table between the two marker lines: object, module, why, guarded, lifetime."""
    parts = text.split(MARK)
    assert len(parts) == 3, f"docs/architecture.md must hold the process-state table between two {MARK} lines"
    rows = []
    for line in parts[1].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or cells[0] in ("object", "") or set(cells[0]) <= set("-: "):
            continue
        obj, module = (re.sub(r"`", "", c) for c in cells[:2])
        rows.append(dict(object=obj, module=module, why=cells[2], guarded=cells[3], lifetime=cells[4]))
    return rows


def state_problems(rows: list[dict], objects: set, locks: set) -> list[str]:
    listed = {(r["module"], r["object"]) for r in rows}
    problems = [f"{m}: {o} is module-level mutable state without a row in docs/architecture.md's process-state "
                f"table (or make it immutable: MappingProxyType, a tuple)" for m, o in sorted(objects - listed)]
    problems += [f"docs/architecture.md lists {o} in {m}, which holds no such mutable object"
                 for m, o in sorted(listed - objects)]
    for m, lock in sorted(locks):
        if not any(r["module"] == m and lock in r["guarded"] for r in rows):
            problems.append(f"{m}: the lock {lock} guards no row of the process-state table (name it in 'guarded by')")
    problems += [f"{r['module']}: {r['object']}: the row must say why, what guards it and its lifetime"
                 for r in rows if not (r["why"] and r["guarded"] and r["lifetime"])]
    return problems


def test_every_global_has_its_row():
    with open(PAGE) as f:
        rows = table_rows(f.read())
    assert state_problems(rows, *package_state()) == []


@pytest.mark.parametrize("source, expected", [
    ("X = {}\n", "X is module-level mutable state without a row"),
    ("import threading\nX = threading.local()\n", "X is module-level mutable state without a row"),
    ("import functools\n@functools.lru_cache(maxsize=None)\ndef f():\n    pass\n", "f() is module-level mutable"),
    ("import threading\nL = threading.Lock()\n", "the lock L guards no row"),
])
def test_a_planted_global_without_a_row_fails(source, expected):
    objects, locks = module_state(source)
    problems = state_problems([], {("cp_attention/x.py", o) for o in objects}, {("cp_attention/x.py", x) for x in locks})
    assert any(expected in p for p in problems), problems


def test_constants_and_stale_rows():
    """Immutable tables need no row; a row whose object is gone is reported."""
    assert module_state("import types\nT = types.MappingProxyType({'a': 1})\nK = ('a', 'b')\n") == (set(), set())
    row = dict(object="GONE", module="cp_attention/x.py", why="w", guarded="g", lifetime="l")
    assert any("holds no such mutable object" in p for p in state_problems([row], set(), set()))
