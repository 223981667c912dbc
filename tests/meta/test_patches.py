"""Every change cp_attention makes to code it does not own goes through cp_attention.integrations.patches (issue 54):
the register of sites is the generated docs/patches.md, every site is used by the code and covered by tests that
exist, the patches made at run time are recorded, and no other module of the package replaces a function or method
of a foreign module or class.

Oracles: the source of the package (read as syntax trees, not run) and the objects transformers' modules hold
after cp_attention adapted them.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

from cp_attention.integrations import patches

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "cp_attention")
PAGE = os.path.join(ROOT, "docs", "patches.md")
PATCHES = os.path.join(PACKAGE, "integrations", "patches.py")

# setattr calls outside patches.py: onto the library's own objects (its wrapper functions' markers, its
# thread-local guard and statistics, the tools' own configs, the tensors its batch binds) ...
OWN = frozenset({"wrapper", "forward", "state.MODEL_GUARD", "engine_stats.FORWARD", "text", "t"})
# ... and the writes onto foreign instances not routed through patches yet (docs/patches.md, "Not yet recorded")
PENDING = frozenset((rel, owner) for rel, owner, _ in patches.PENDING)


def _sources():
    for folder, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                yield os.path.relpath(path, PACKAGE).replace(os.sep, "/"), open(path).read()


def foreign_writes(rel: str, text: str) -> list[str]:
    """The assignments of ``text`` (the module ``rel`` of the package) that may change a foreign object
    outside patches.py: an attribute ``forward`` assigned, a ``setattr`` onto an object neither the library's
    own nor listed as pending, an attribute of a module object (``mod.name = ...``, the package's name for a
    foreign module) assigned."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Attribute) and (target.attr == "forward" or (
                        isinstance(target.value, ast.Name) and target.value.id == "mod")):
                    found.append(f"{rel}:{node.lineno}: {ast.unparse(target)} = ...")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" and node.args:
            owner = ast.unparse(node.args[0])
            if owner not in OWN and (rel, owner) not in PENDING:
                found.append(f"{rel}:{node.lineno}: setattr({owner}, ...)")
    return found


def _site_calls(text: str) -> set[str]:
    """The site keys the module's patch / record / temporarily calls name."""
    keys = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in (
                "patch", "record", "temporarily"):
            for kw in node.keywords if node.args or node.keywords else ():
                if kw.arg == "site" and isinstance(kw.value, ast.Constant):
                    keys.add(kw.value.value)
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                keys.add(node.args[0].value)  # record("site", ...)
    return keys


def test_the_page_is_current():
    with open(PAGE) as f:
        assert f.read() == patches.page(), \
            "docs/patches.md is stale: run `python -m cp_attention patches --page docs/patches.md`"


def test_every_site_is_used_and_every_use_is_a_site():
    used = set()
    for rel, text in _sources():
        if rel != "integrations/patches.py":
            used |= _site_calls(text)
    assert used == set(patches.SITES), (sorted(used - set(patches.SITES)), sorted(set(patches.SITES) - used))


def test_every_site_names_tests_that_exist():
    for key, site in patches.SITES.items():
        assert site.tests, key
        for test in site.tests:
            path, _, name = test.partition("::")
            assert os.path.isfile(os.path.join(ROOT, path)), (key, test)
            if name:
                assert f"def {name}(" in open(os.path.join(ROOT, path)).read(), (key, test)


def test_no_foreign_write_outside_the_patch_function():
    found = [w for rel, text in _sources() if rel != "integrations/patches.py" for w in foreign_writes(rel, text)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("breach", [
    "def adapt(mod, f):\n    mod.causal_conv1d_fn = f\n",
    "def adapt(cls, f):\n    cls.forward = f\n",
    "def adapt(model, f):\n    setattr(model, 'forward', f)\n",
    "def adapt(owner, f):\n    owner.forward = f\n",
])
def test_a_planted_foreign_write_is_found(breach):
    assert foreign_writes("integrations/planted.py", breach)


def test_patches_are_recorded_at_run_time():
    """In a fresh process: importing transformers' Qwen3-Next and Mixtral modeling modules after cp_attention
    records their mixer functions, router loss and flash-name checks, each in place, with its admission."""
    code = (
        "import cp_attention, transformers, sys\n"
        "import transformers.models.qwen3_next.modeling_qwen3_next as q, transformers.models.mixtral.modeling_mixtral as m\n"
        "from cp_attention.integrations import patches\n"
        "got = {(p.site, p.target) for p in patches.applied()}\n"
        "for p in patches.applied():\n"
        "    assert p.site in patches.SITES and p.admitted and p.replacement is not None, p\n"
        "    assert p.original is not p.replacement, p\n"
        "want = {('mixer_functions', q.__name__ + '.causal_conv1d_fn'),\n"
        "        ('mixer_functions', q.__name__ + '.torch_chunk_gated_delta_rule'),\n"
        "        ('router_loss', m.__name__ + '.load_balancing_loss_func'),\n"
        "        ('attention_registration', \"transformers.AttentionInterface['cp_flash']\")}\n"
        "assert want <= got, sorted(want - got)\n"
        "assert q.causal_conv1d_fn is next(p.replacement for p in patches.applied('mixer_functions')\n"
        "                                  if p.target == q.__name__ + '.causal_conv1d_fn')\n"
        "print('ok')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
