"""The documentation is checked like code: README.md and every page of docs/.

* Every relative link (and its ``#anchor``, GitHub's heading slugs or an explicit ``<a id>``) resolves to
  an existing file or heading. The pages other tools generate (:data:`GENERATED_ELSEWHERE`) are linked
  like any page and must exist.
* Every documented signature matches the code. The convention: a fenced block whose info string is
  ``python signature``, its first line ``# dotted.name`` of a public object, then one ``def`` whose
  parameters (names, order, kinds, defaults; annotations are not compared) are the object's
  ``inspect.signature``. A class documents its constructor as ``def ClassName(...)``; a method keeps
  ``self``. Any other code block that shows a ``def`` fails: a signature shown is a signature checked.
* docs/benchmarks.md is what ``python benchmarks/report.py benchmarks/results/cpu --page
  docs/benchmarks.md`` renders from the JSON files.

Paths are taken from the repository root (the folder holding pyproject.toml), wherever this file sits.
"""

from __future__ import annotations

import ast
import difflib
import glob
import importlib
import importlib.util
import inspect
import os
import re
import sys

import pytest


def _repository_root() -> str:
    folder = os.path.dirname(os.path.abspath(__file__))
    while not os.path.exists(os.path.join(folder, "pyproject.toml")):
        parent = os.path.dirname(folder)
        if parent == folder:
            raise RuntimeError("no pyproject.toml above " + __file__)
        folder = parent
    return folder


ROOT = _repository_root()
PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
# written by the support sweeps and the mutation check, not by hand: linked from the docs, expected to exist
GENERATED_ELSEWHERE = {"docs/supported_models.md", "docs/supported_heads.md", "docs/supported_vlms.md",
                       "docs/mutants.md"}
# the public functions whose signatures the docs must show
REQUIRED_SIGNATURES = {"cp_attention.attention", "cp_attention.context_parallel",
                       "cp_attention.ContextParallel.shard_batch", "cp_attention.integrations.trainers.trainer.CPTrainer"}
BENCHMARKS_PAGE, BENCHMARKS_FOLDER = "docs/benchmarks.md", "benchmarks/results/cpu"

FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*(.*)$")
LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
EXPLICIT_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"", re.IGNORECASE)


def _read(rel: str) -> str:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def _split(text: str) -> tuple[list[tuple[int, str]], list[tuple[int, str, list[str]]]]:
    """(line number, prose line) outside fenced blocks, and (line number, info string, lines) of each
    fenced block."""
    prose, blocks, fence, info, body, start = [], [], None, "", [], 0
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if fence is None:
            if match:
                fence, info, body, start = match.group(1), match.group(2).strip(), [], number
            else:
                prose.append((number, line))
        elif match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence) and not match.group(2):
            blocks.append((start, info, body))
            fence = None
        else:
            body.append(line)
    assert fence is None, f"a fenced block opened at line {start} is never closed"
    return prose, blocks


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text without markup, lower case, punctuation dropped (but
    ``-`` and ``_``), spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(rel: str) -> set[str]:
    prose, _ = _split(_read(rel))
    found, seen = set(), {}
    for _, line in prose:
        found.update(EXPLICIT_ANCHOR.findall(line))
        match = HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(rel: str):
    """(line number, target) of every relative link of a page, outside code."""
    prose, _ = _split(_read(rel))
    for number, line in prose:
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, mailto:, ...
                yield number, target


def link_problems(rel: str) -> list[str]:
    problems = []
    for number, target in links(rel):
        path, _, anchor = target.partition("#")
        resolved = rel if not path else os.path.normpath(os.path.join(os.path.dirname(rel), path))
        where = f"{rel}:{number}: {target}"
        if not os.path.exists(os.path.join(ROOT, resolved)):
            expected = " (generated by another tool, expected after the merge)" if resolved in GENERATED_ELSEWHERE else ""
            problems.append(f"{where}: no file {resolved}{expected}")
        elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
            problems.append(f"{where}: no heading #{anchor} in {resolved}")
    return problems


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_resolve(page):
    problems = link_problems(page)
    assert not problems, "\n".join(problems)


def test_generated_pages_exist():
    """The pages the sweeps and the mutation check write are part of the docs (README links them)."""
    missing = sorted(p for p in GENERATED_ELSEWHERE if not os.path.exists(os.path.join(ROOT, p)))
    assert not missing, f"generated pages missing: {missing}"


# ----------------------------------------------------------------------------------------------
# documented signatures


def signature_blocks():
    """(page, line, dotted name, the def's ast) of every ``python signature`` block."""
    found = []
    for page in PAGES:
        _, blocks = _split(_read(page))
        for line, info, body in blocks:
            if info.split() != ["python", "signature"]:
                continue
            header = next((b.strip() for b in body if b.strip()), "")
            assert header.startswith("# "), f"{page}:{line}: a signature block starts with '# dotted.name'"
            tree = ast.parse("\n".join(body))
            defs = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
            assert len(defs) == 1 and len(tree.body) == 1, f"{page}:{line}: one def per signature block"
            found.append((page, line, header[2:].strip(), defs[0]))
    return found


def resolve(dotted: str):
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def documented_parameters(node: ast.FunctionDef) -> list[tuple]:
    """(name, kind, default) of a documented def; defaults are evaluated (``torch`` may be named)."""
    import torch

    def value(expr):
        return eval(compile(ast.Expression(expr), "<signature>", "eval"), {"torch": torch})

    a, empty = node.args, inspect.Parameter.empty
    positional = a.posonlyargs + a.args
    defaults = [empty] * (len(positional) - len(a.defaults)) + [value(d) for d in a.defaults]
    params = [(p.arg, inspect.Parameter.POSITIONAL_ONLY if i < len(a.posonlyargs)
               else inspect.Parameter.POSITIONAL_OR_KEYWORD, d) for i, (p, d) in enumerate(zip(positional, defaults))]
    if a.vararg:
        params.append((a.vararg.arg, inspect.Parameter.VAR_POSITIONAL, empty))
    params += [(p.arg, inspect.Parameter.KEYWORD_ONLY, empty if d is None else value(d))
               for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        params.append((a.kwarg.arg, inspect.Parameter.VAR_KEYWORD, empty))
    return params


def actual_parameters(obj) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(obj).parameters.values()]


def signature_problems(page, line, dotted, node) -> list[str]:
    where = f"{page}:{line}: {dotted}"
    try:
        obj = resolve(dotted)
    except (ImportError, AttributeError) as exc:
        return [f"{where}: not found ({exc})"]
    if inspect.isclass(obj) and node.name != dotted.rsplit(".", 1)[-1]:
        return [f"{where}: a class is documented as def {dotted.rsplit('.', 1)[-1]}(...), not def {node.name}"]
    if not inspect.isclass(obj) and node.name != obj.__name__:
        return [f"{where}: documented as def {node.name}, the code's name is {obj.__name__}"]
    doc, code = documented_parameters(node), actual_parameters(obj)
    problems = []
    if [(n, k) for n, k, _ in doc] != [(n, k) for n, k, _ in code]:
        problems.append(f"{where}: parameters (name, kind) documented {[(n, k.name) for n, k, _ in doc]}, "
                        f"code {[(n, k.name) for n, k, _ in code]}")
    for (name, _, d), (_, _, c) in zip(doc, code):
        if inspect.Parameter.empty in (d, c):
            same = d is c
        else:  # 150e9 documents 150000000000.0; True does not document 1
            same = (type(d) is type(c) or {type(d), type(c)} <= {int, float}) and d == c
        if not same:
            problems.append(f"{where}: default of {name}: documented {d!r}, code {c!r}")
    return problems


def test_documented_signatures_match_the_code():
    blocks = signature_blocks()
    problems = [p for block in blocks for p in signature_problems(*block)]
    missing = REQUIRED_SIGNATURES - {dotted for _, _, dotted, _ in blocks}
    if missing:
        problems.append(f"no ```python signature block for {sorted(missing)}")
    assert not problems, "\n".join(problems)


def test_every_def_shown_is_a_checked_signature():
    shown = []
    for page in PAGES:
        _, blocks = _split(_read(page))
        for line, info, body in blocks:
            if info.split() != ["python", "signature"] and any(re.match(r"\s*(async\s+)?def\s+\w+\s*\(", b) for b in body):
                shown.append(f"{page}:{line}")
    assert not shown, f"a def in a code block that is not a ```python signature block: {shown}"


# ----------------------------------------------------------------------------------------------
# the generated benchmarks page


def _report():
    path = os.path.join(ROOT, "benchmarks", "report.py")
    spec = importlib.util.spec_from_file_location("cp_attention_docs_report", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.dirname(path))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(os.path.dirname(path))
    return module


def test_benchmarks_page_is_what_report_renders():
    rendered = _report().render_page(os.path.join(ROOT, BENCHMARKS_FOLDER), os.path.join(ROOT, BENCHMARKS_PAGE))
    current = _read(BENCHMARKS_PAGE)
    diff = list(difflib.unified_diff(current.splitlines(), rendered.splitlines(), BENCHMARKS_PAGE, "rendered",
                                     lineterm="", n=1))
    assert not diff, ("docs/benchmarks.md is stale: rerun python benchmarks/report.py benchmarks/results/cpu "
                      "--page docs/benchmarks.md\n" + "\n".join(diff[:40]))
