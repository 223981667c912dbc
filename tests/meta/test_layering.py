"""The package's layering, checked statically from its source (no import of the package):

* nothing in the engine imports ``cp_attention.integrations`` or ``cp_attention.tools`` (the engine is
  every module but those two packages, the package root that composes them, ``__main__`` and the
  ``python -m`` shims of the tools), and ``integrations`` does not import ``tools``;
* no module imports another module's private (``_name``) names, or reaches them through a module
  it imported;
* torch's private APIs (``torch._...``) are used in ``torch_compat.py`` alone;
* no module is over 700 lines;
* the transformers adapter uses at most five names of the engine (the state registry aside).
"""

from __future__ import annotations

import ast
import os

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "cp_attention")
MAX_LINES = 700
NOT_ENGINE = ("integrations", "tools")
COMPOSERS = {"__init__.py", "__main__.py", "probe.py", "demo.py", "bench.py", "cli.py", "launch.py",
             "tiny_models.py"}  # the root and the shims of the tools


def _modules() -> dict[str, str]:
    """Dotted module name -> path of every module of the package."""
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
                found[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return found


MODULES = _modules()


def _package_of(module: str, path: str) -> str:
    return module if path.endswith("__init__.py") else module.rpartition(".")[0]


def _imports(module: str, path: str, tree: ast.AST):
    """(imported module, imported name or None, line) of every import of a ``cp_attention`` module;
    ``from X import y`` where ``X.y`` is a module yields that module with name None."""
    package = _package_of(module, path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "cp_attention":
                    yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "cp_attention":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                yield (sub, None, node.lineno) if sub in MODULES else (target, alias.name, node.lineno)


def _module_aliases(module: str, path: str, tree: ast.AST) -> set[str]:
    """Local names bound to a module of the package (``from . import engine``, ``import x.y as z``)."""
    names = set()
    package = _package_of(module, path)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level or isinstance(node, ast.ImportFrom) and \
                (node.module or "").startswith("cp_attention"):
            if node.level:
                base = package.split(".")
                target = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                target = node.module
            names |= {alias.asname or alias.name for alias in node.names if f"{target}.{alias.name}" in MODULES}
        elif isinstance(node, ast.Import):
            names |= {alias.asname for alias in node.names if alias.asname and alias.name in MODULES}
    return names


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_engine(module: str, path: str) -> bool:
    parts = module.split(".")
    return not (len(parts) > 1 and parts[1] in NOT_ENGINE) and os.path.basename(path) not in COMPOSERS


def layering_violations(modules: dict[str, str] = MODULES) -> list[str]:
    """Every breach of the rules of this file's docstring, as readable lines."""
    problems = []
    for module, path in sorted(modules.items()):
        with open(path) as f:
            source = f.read()
        tree = ast.parse(source, path)
        lines = source.count("\n") + (not source.endswith("\n"))
        if lines > MAX_LINES:
            problems.append(f"{module}: {lines} lines (at most {MAX_LINES}): split it by responsibility")
        for target, name, line in _imports(module, path, tree):
            layer = target.split(".")[1] if "." in target else ""
            if _is_engine(module, path) and layer in NOT_ENGINE:
                problems.append(f"{module}:{line} imports {target}: the engine never imports {layer}")
            if module.startswith("cp_attention.integrations") and layer == "tools":
                problems.append(f"{module}:{line} imports {target}: integrations never import tools")
            if name is not None and _private(name) and target != module:
                problems.append(f"{module}:{line} imports the private name {name} of {target}")
        aliases = _module_aliases(module, path, tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and _private(node.attr):
                if node.value.id in aliases:
                    problems.append(f"{module}:{node.lineno} uses the private name {node.value.id}.{node.attr}")
                if node.value.id == "torch" and not module.endswith("torch_compat"):
                    problems.append(f"{module}:{node.lineno} uses torch.{node.attr}: torch's private APIs go "
                                    f"through cp_attention/torch_compat.py")
            if isinstance(node, (ast.Import, ast.ImportFrom)) and not module.endswith("torch_compat"):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                if any(n.startswith("torch._") for n in names):
                    problems.append(f"{module}:{node.lineno} imports a private torch module: use torch_compat")
    return problems


def adapter_engine_names(path: str = MODULES["cp_attention.integrations.transformers"]) -> set[str]:
    """The engine names the transformers adapter uses: names it imports from the package outside
    ``integrations``, and the attributes it reads on engine modules it imports (the process-state
    registry aside)."""
    module = "cp_attention.integrations.transformers"
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    names, engine_modules = set(), set()
    for target, name, _ in _imports(module, path, tree):
        if target.startswith("cp_attention.integrations") or target == "cp_attention.state":
            continue
        if name is None:
            engine_modules.add(target.rpartition(".")[2])
        else:
            names.add(name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in engine_modules:
            names.add(f"{node.value.id}.{node.attr}")
    return names


def test_layering_holds():
    assert layering_violations() == []


def test_adapter_uses_at_most_five_engine_names():
    names = adapter_engine_names()
    assert len(names) <= 5, sorted(names)


@pytest.mark.parametrize("planted, expected", [
    ("from .integrations import hf_batch\n", "the engine never imports integrations"),
    ("from .tools.launch import run_ranks\n", "the engine never imports tools"),
    ("from .engine import _reused\n", "imports the private name _reused"),
    ("from . import engine\nX = engine._reused\n", "uses the private name engine._reused"),
    ("import torch\nX = torch._C\n", "torch's private APIs go through"),
    ("import torch._dynamo\n", "imports a private torch module"),
    ("X = 1\n" * (MAX_LINES + 1), "lines (at most"),
])
def test_each_rule_catches_its_breach(tmp_path, planted, expected):
    """A planted breach in an engine module is reported (the check can fail)."""
    path = tmp_path / "planted.py"
    path.write_text(planted)
    problems = layering_violations({"cp_attention.planted": str(path)})
    assert any(expected in p for p in problems), problems


def test_tools_and_integrations_may_use_the_engine(tmp_path):
    """Users of the engine import it freely; only the engine's own modules are restricted."""
    path = tmp_path / "user.py"
    path.write_text("from ..engine import attend\nfrom ..integrations.models import layer_masks\n")
    assert layering_violations({"cp_attention.tools.user": str(path)}) == []
