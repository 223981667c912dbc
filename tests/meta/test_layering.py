"""The package's floor plan, checked statically from its source (no import of the package), with no
exemption:

* every module belongs to a layer, and imports only modules of its own layer or of layers below
  (no upward import): the ground (``masks``, ``torch_compat``, ``waits``, ``refusals``, ``quiet_gc``) < ``comm`` <
  ``layout``, ``kernels`` < ``plan`` < ``backends`` < ``strategies`` < ``engine`` < ``integrations`` <
  the public root (``cp_attention``, ``api``) < ``tools`` < ``__main__``;
* no import cycle, lazy (function-level) imports included: a package's ``__init__`` may import its
  modules, its modules import their siblings, never the package above them;
* no module imports another module's private (``_name``) names, or reaches them through a module
  it imported;
* torch's private APIs (``torch._...``) are used in ``torch_compat.py`` alone;
* no module is over 600 lines;
* no shim: a module other than a package's ``__init__`` holds more than imports;
* cp_flash's attention function and mask (``integrations/hf/attention.py``, ``masks.py``) use at most five
  names of the engine (names they import from outside ``integrations``, and attributes they read on engine
  modules they imported; the catalogue of refusals, ``cp_attention.refusals``, through which every layer
  raises, is not the engine's);
* no frame introspection: nothing reads a frame's values (``f_locals``, ``f_globals``, ``f_builtins``) anywhere,
  and the stack is walked (``sys._getframe``, ``inspect.currentframe`` / ``stack`` / ``trace``, ``f_back``, a
  traceback's ``tb_frame``) only by ``torch_compat.caller_locations``, which yields locations (file, line,
  function), never values: a call's arguments come through torch's hooks.

The integrations wing (:data:`WING_FLOORS`) has floors of its own, from the register of patches up to the
trainers: a module imports only modules of its floor or below; the adapters (``integrations/hf/adapters/``,
one file each) never import each other nor the table; the registry, the model check, the guard and the
attention function import the table and the adapter interface (``adapters/base.py``), never an adapter;
the table's rows are exactly the adapter files, each defining ``ADAPTER``; and nothing outside
``integrations/patches.py`` assigns onto a foreign module, class or instance (:func:`foreign_writes`).
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.abspath(__file__))
while not os.path.exists(os.path.join(ROOT, "pyproject.toml")):
    ROOT = os.path.dirname(ROOT)
PACKAGE = os.path.join(ROOT, "cp_attention")
MAX_LINES = 600
LAYERS = (
    ("masks", "torch_compat", "waits", "refusals", "refusals_models", "refusals_training", "quiet_gc"),
    ("comm",),
    ("layout", "kernels"),
    ("plan",),
    ("backends",),
    ("strategies",),
    ("engine",),
    ("integrations",),
    ("", "api"),  # the public root: cp_attention/__init__.py and api.py
    ("tools",),
    ("__main__",),
)
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}


def _modules(package: str = PACKAGE) -> dict[str, str]:
    """Dotted module name -> path of every module of the package."""
    found = {}
    for folder, _, files in os.walk(package):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, os.path.dirname(package))[:-3].replace(os.sep, ".")
                found[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return found


MODULES = _modules()


def _package_of(module: str, path: str) -> str:
    return module if path.endswith("__init__.py") else module.rpartition(".")[0]


def _imports(module: str, path: str, tree: ast.AST, modules: dict[str, str]):
    """(imported module, imported name or None, line) of every import of a ``cp_attention`` module,
    at any depth (lazy imports included); ``from X import y`` where ``X.y`` is a module yields that
    module with name None."""
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
                yield (sub, None, node.lineno) if sub in modules else (target, alias.name, node.lineno)


def _module_aliases(module: str, path: str, tree: ast.AST, modules: dict[str, str]) -> set[str]:
    """Local names bound to a module of the package (``from . import engine``, ``import x.y as z``)."""
    names = set()
    package = _package_of(module, path)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("cp_attention")):
            if node.level:
                base = package.split(".")
                target = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                target = node.module
            names |= {alias.asname or alias.name for alias in node.names if f"{target}.{alias.name}" in modules}
        elif isinstance(node, ast.Import):
            names |= {alias.asname for alias in node.names if alias.asname and alias.name in modules}
    return names


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def layer_of(module: str) -> int | None:
    """The layer index of a module (its first name below ``cp_attention``); None: not in the plan."""
    parts = module.split(".")
    return LAYER_OF.get(parts[1] if len(parts) > 1 else "")


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing itself)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in edges.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def _is_shim(path: str, tree: ast.Module) -> bool:
    """A module (not a package's ``__init__``) holding nothing but its docstring, imports and ``__all__``."""
    if path.endswith("__init__.py"):
        return False
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            continue
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["__all__"]:
            continue
        return False
    return True


def layering_violations(modules: dict[str, str] = MODULES) -> list[str]:
    """Every breach of the rules of this file's docstring, as readable lines."""
    problems, edges = [], {}
    for module, path in sorted(modules.items()):
        with open(path) as f:
            source = f.read()
        tree = ast.parse(source, path)
        lines = source.count("\n") + (not source.endswith("\n"))
        if lines > MAX_LINES:
            problems.append(f"{module}: {lines} lines (at most {MAX_LINES}): split it by responsibility")
        if _is_shim(path, tree):
            problems.append(f"{module}: a shim (it only imports): import the module it re-exports instead")
        mine = layer_of(module)
        if mine is None:
            problems.append(f"{module}: in no layer of the floor plan (tests/test_layering.py LAYERS)")
        for target, name, line in _imports(module, path, tree, modules):
            edges.setdefault(module, set()).add(target)
            theirs = layer_of(target)
            if mine is not None and theirs is not None and theirs > mine:
                problems.append(f"{module}:{line} imports {target}: an upward import (layer "
                                f"{'/'.join(LAYERS[theirs]) or 'root'} is above {'/'.join(LAYERS[mine]) or 'root'})")
            if name is not None and _private(name) and target != module:
                problems.append(f"{module}:{line} imports the private name {name} of {target}")
        aliases = _module_aliases(module, path, tree, modules)
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
            frame = _frame_introspection(node, module)
            if frame:
                problems.append(f"{module}:{node.lineno} reads a frame ({frame}): take a call's arguments through "
                                "torch's hooks, a location through torch_compat.caller_locations")
    for cycle in _cycles(edges):
        problems.append(f"an import cycle: {' -> '.join(cycle)} (lazy imports count)")
    return problems + wing_violations(modules)


_FRAME_VALUES = frozenset({"f_locals", "f_globals", "f_builtins"})
_FRAME_WALK = frozenset({"f_back", "tb_frame", "sys._getframe", "inspect.currentframe", "inspect.stack", "inspect.trace",
                         "inspect.getouterframes", "inspect.getinnerframes"})


def _frame_introspection(node: ast.AST, module: str = "") -> str | None:
    """What ``node`` (of ``module``) reads of an interpreter frame, or None: a frame's values anywhere; a walk of
    the stack outside ``cp_attention.torch_compat``."""
    if isinstance(node, ast.Attribute):
        name = node.attr if node.attr in _FRAME_VALUES | _FRAME_WALK else ast.unparse(node)
        if name in _FRAME_VALUES or (name in _FRAME_WALK and module != "cp_attention.torch_compat"):
            return name
    return None


# ----------------------------------------------------------------------------------------------
# the integrations wing

WING = "cp_attention.integrations"
WING_FLOORS = (
    ("patches",),  # the register of every change to foreign code
    ("hf", "hf.versions", "hf.state", "hf.source", "hf.models", "hf.overlays", "hf.selection", "hf.forward",
     "hf.function_admission", "hf.recurrences"),  # what the rest stands on: versions, state, model helpers
    ("hf.token_trace", "hf.generation", "hf.positions", "hf.multimodal", "hf.heads", "hf.class_admission",
     "hf.mixing"),  # the machinery the adapters and the rooms share
    ("hf.adapters.base",),  # the adapter interface
    ("hf.adapters.*",),  # the adapters, one file each
    ("hf.adapters",),  # their table
    ("hf.check", "hf.verification", "hf.masks", "hf.attention", "hf.guard", "hf.registry", "hf.batch"),  # the rooms
    ("trainers", "trainers.*"),  # Trainer, TRL, packed rows
    ("",),  # integrations/__init__.py: install()
)
ADAPTERS_PACKAGE = f"{WING}.hf.adapters"
READERS_OF_THE_TABLE = tuple(f"{WING}.hf.{name}" for name in ("registry", "check", "guard", "attention"))


def wing_floor(module: str) -> int | None:
    """The floor of a module of the wing (None: not in the plan)."""
    rel = module[len(WING) + 1:] if module != WING else ""
    for i, names in enumerate(WING_FLOORS):
        for name in names:
            if rel == name or (name.endswith(".*") and rel.startswith(name[:-1]) and rel.count(".") == name.count(".")):
                return i
    return None


def _adapter(module: str) -> bool:
    """An adapter module: a file of ``hf/adapters/`` other than the interface."""
    return module.startswith(ADAPTERS_PACKAGE + ".") and module != f"{ADAPTERS_PACKAGE}.base"


def _table_rows(path: str) -> list[str] | None:
    """The strings of the ``ROWS`` tuple of the adapters' table (None: no such tuple)."""
    for node in ast.parse(open(path).read()).body:
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["ROWS"] and \
                isinstance(node.value, ast.Tuple):
            return [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
    return None


def wing_violations(modules: dict[str, str]) -> list[str]:
    """Every breach of the wing's rules (this file's docstring), as readable lines."""
    problems = []
    for module, path in sorted(modules.items()):
        if not (module == WING or module.startswith(WING + ".")):
            continue
        source = open(path).read()
        tree = ast.parse(source, path)
        mine = wing_floor(module)
        if mine is None:
            problems.append(f"{module}: on no floor of the integrations wing (tests/meta/test_layering.py WING_FLOORS)")
        for target, _, line in _imports(module, path, tree, modules):
            if not target.startswith(WING + "."):
                continue
            theirs = wing_floor(target)
            if mine is not None and theirs is not None and theirs > mine:
                problems.append(f"{module}:{line} imports {target}: an upward import in the integrations wing")
            if _adapter(module) and (_adapter(target) or target == ADAPTERS_PACKAGE) and target != module:
                problems.append(f"{module}:{line} imports {target}: an adapter imports no other adapter nor the table "
                                "(share code through the floors below)")
            if module in READERS_OF_THE_TABLE and _adapter(target):
                problems.append(f"{module}:{line} imports the adapter {target}: read the adapters through the table")
        if _adapter(module) and not module.endswith(".__init__") and \
                not any(isinstance(n, ast.Assign) and [ast.unparse(t) for t in n.targets] == ["ADAPTER"] for n in tree.body):
            problems.append(f"{module}: an adapter file without a module-level ADAPTER")
    table = modules.get(ADAPTERS_PACKAGE)
    if table is not None:
        rows = _table_rows(table)
        files = {m.rpartition(".")[2] for m in modules if _adapter(m)}
        if rows is None or sorted(rows) != sorted(files) or len(set(rows)) != len(rows):
            problems.append(f"{ADAPTERS_PACKAGE}: the table's rows {rows} are not the adapter files {sorted(files)}")
    for module, path in sorted(modules.items()):
        if module.startswith("cp_attention.") and module != f"{WING}.patches":
            rel = os.path.relpath(path, PACKAGE).replace(os.sep, "/") if path.startswith(PACKAGE) else module
            problems += foreign_writes(rel, open(path).read())
    return problems


# setattr calls outside patches.py: onto the library's own objects (its wrapper functions' markers, its
# thread-local forward record and statistics, the tools' own configs, the tensors its batch binds) ...
OWN_WRITES = frozenset({"wrapper", "forward", "FORWARD", "engine_stats.FORWARD", "text", "t"})


def foreign_writes(rel: str, text: str, pending: frozenset = frozenset()) -> list[str]:
    """The assignments of ``text`` (the module ``rel`` of the package) that may change a foreign object
    outside patches.py: an attribute ``forward`` assigned, a ``setattr`` onto an object neither the library's
    own nor listed in ``pending`` ((module, object) pairs), an attribute of a module object (``mod.name = ...``,
    the package's name for a foreign module) assigned, a write into another object's ``__dict__``."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Attribute) and (target.attr == "forward" or (
                        isinstance(target.value, ast.Name) and target.value.id == "mod")):
                    found.append(f"{rel}:{node.lineno}: {ast.unparse(target)} = ...")
                if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Attribute) and \
                        target.value.attr == "__dict__" and ast.unparse(target.value.value) != "self":
                    found.append(f"{rel}:{node.lineno}: {ast.unparse(target)} = ...")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" and node.args:
            owner = ast.unparse(node.args[0])
            if owner not in OWN_WRITES and (rel, owner) not in pending:
                found.append(f"{rel}:{node.lineno}: setattr({owner}, ...)")
    return found


ENGINE_ENTRY = ("cp_attention.integrations.hf.attention", "cp_attention.integrations.hf.masks")


def adapter_engine_names(modules: tuple[str, ...] = ENGINE_ENTRY) -> set[str]:
    """The engine names cp_flash's attention function and mask use: names they import from the package outside
    ``integrations``, and the attributes they read on engine modules they import."""
    names = set()
    for module in modules:
        path = MODULES[module]
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        engine_modules = set()
        for target, name, _ in _imports(module, path, tree, MODULES):
            if target.startswith("cp_attention.integrations") or target == "cp_attention.refusals":
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


def test_the_engine_entry_uses_at_most_five_engine_names():
    names = adapter_engine_names()
    assert len(names) <= 5, sorted(names)


def _plant(tmp_path, files: dict[str, str]) -> dict[str, str]:
    """Write ``files`` (module name -> source) under tmp_path; returns module -> path."""
    found = {}
    for module, source in files.items():
        path = tmp_path / (module.replace(".", "_") + ".py")
        path.write_text(source)
        found[module] = str(path)
    return found


@pytest.mark.parametrize("module, planted, expected", [
    ("cp_attention.engine.x", "from ..integrations import hf_batch\n", "an upward import"),
    ("cp_attention.engine.x", "def f():\n    from ..tools.launch import run_ranks\n", "an upward import"),
    ("cp_attention.plan.x", "from ..backends.base import VarlenBackend\n", "an upward import"),
    ("cp_attention.masks", "from .comm import Comm\n", "an upward import"),
    ("cp_attention.engine.x", "from .attend import _reused\n", "imports the private name _reused"),
    ("cp_attention.engine.x", "import torch\nX = torch._C\n", "torch's private APIs go through"),
    ("cp_attention.engine.x", "import torch._dynamo\n", "imports a private torch module"),
    ("cp_attention.engine.x", "X = 1\n" * (MAX_LINES + 1), "lines (at most"),
    ("cp_attention.probe", "from cp_attention.tools.probe import main\n", "a shim"),
    ("cp_attention.nowhere", "X = 1\n", "in no layer"),
])
def test_each_rule_catches_its_breach(tmp_path, module, planted, expected):
    """A planted breach is reported (the check can fail)."""
    problems = layering_violations(_plant(tmp_path, {module: planted}))
    assert any(expected in p for p in problems), problems


def test_a_private_name_through_a_module_is_caught(tmp_path):
    planted = _plant(tmp_path, {"cp_attention.engine.x": "from . import attend\nX = attend._reused\n",
                                "cp_attention.engine.attend": "def _reused():\n    pass\n"})
    assert any("uses the private name attend._reused" in p for p in layering_violations(planted))


def test_a_lazy_cycle_is_caught(tmp_path):
    """Two modules importing each other, one of them inside a function, are a cycle."""
    planted = _plant(tmp_path, {"cp_attention.engine.a": "from .b import f\n",
                                "cp_attention.engine.b": "def f():\n    from .a import g\n"})
    assert any("an import cycle" in p and "engine.a" in p for p in layering_violations(planted))


def test_users_of_the_engine_import_it_freely(tmp_path):
    """Tools and integrations import the engine (downward); only upward imports are refused."""
    planted = _plant(tmp_path, {"cp_attention.tools.user": "from ..engine import attend\nimport cp_attention\nX = 1\n",
                                "cp_attention.integrations.hf.attention": "from ...engine.layer import attend_layer\nX = 1\n"})
    assert layering_violations(planted) == []


_WING_PLANTS = [
    ({"cp_attention.integrations.hf.models": "from .guard import install_guard\nX = 1\n",
      "cp_attention.integrations.hf.guard": "X = 1\n"}, "an upward import in the integrations wing"),
    ({"cp_attention.integrations.hf.adapters.rope": "from .indexers import Y\nADAPTER = 1\n",
      "cp_attention.integrations.hf.adapters.indexers": "Y = 1\nADAPTER = 1\n"}, "an adapter imports no other adapter"),
    ({"cp_attention.integrations.hf.adapters.rope": "from . import ADAPTERS\nADAPTER = 1\n",
      "cp_attention.integrations.hf.adapters": "ROWS = ('rope',)\nADAPTERS = ()\n"}, "an adapter imports no other adapter"),
    ({"cp_attention.integrations.hf.guard": "from .adapters.rope import tag_ropes\nX = 1\n",
      "cp_attention.integrations.hf.adapters.rope": "ADAPTER = 1\n"}, "read the adapters through the table"),
    ({"cp_attention.integrations.hf.attention": "from .adapters import rope\nX = 1\n",
      "cp_attention.integrations.hf.adapters.rope": "ADAPTER = 1\n"}, "read the adapters through the table"),
    ({"cp_attention.integrations.hf.adapters": "ROWS = ('rope',)\nX = 1\n",
      "cp_attention.integrations.hf.adapters.rope": "ADAPTER = 1\n",
      "cp_attention.integrations.hf.adapters.extra": "ADAPTER = 1\n"}, "are not the adapter files"),
    ({"cp_attention.integrations.hf.adapters.rope": "X = 1\n"}, "without a module-level ADAPTER"),
    ({"cp_attention.integrations.hf.nowhere": "X = 1\n"}, "on no floor of the integrations wing"),
    ({"cp_attention.integrations.hf.heads": "import sys\ndef f():\n    return sys._getframe(2).f_locals\n"},
     "reads a frame"),
    ({"cp_attention.engine.x": "import inspect\nF = inspect.currentframe\n"}, "reads a frame"),
    ({"cp_attention.torch_compat": "import sys\ndef f():\n    return sys._getframe(1).f_locals\n"}, "reads a frame (f_locals)"),
    ({"cp_attention.integrations.hf.check": "def f(tb):\n    return tb.tb_frame\n"}, "reads a frame"),
    ({"cp_attention.integrations.hf.mixing": "def adapt(mod, f):\n    mod.causal_conv1d_fn = f\n"}, "mod.causal_conv1d_fn = ..."),
    ({"cp_attention.integrations.hf.guard": "def tag(model):\n    setattr(model, '_tagged', True)\n"}, "setattr(model"),
    ({"cp_attention.integrations.hf.guard": "def tag(cls, f):\n    cls.forward = f\n"}, "cls.forward = ..."),
    ({"cp_attention.integrations.hf.adapters.rope": "def v(m):\n    m.__dict__['_v'] = 1\nADAPTER = 1\n"},
     "m.__dict__['_v'] = ..."),
]


@pytest.mark.parametrize("files, expected", _WING_PLANTS, ids=[p[1] for p in _WING_PLANTS])
def test_each_wing_rule_catches_its_breach(tmp_path, files, expected):
    """A planted breach of each of the wing's rules (and of the frame rule) is reported."""
    problems = layering_violations(_plant(tmp_path, files))
    assert any(expected in p for p in problems), problems


def test_the_wing_has_the_table_of_its_files():
    """The real wing: each adapter one file with its row, read by the registry, check, guard and attention through
    the table only (the rules hold: test_layering_holds); and the table lists more than one adapter."""
    rows = _table_rows(MODULES[ADAPTERS_PACKAGE])
    assert rows and len(rows) >= 6 and all(f"{ADAPTERS_PACKAGE}.{r}" in MODULES for r in rows)
