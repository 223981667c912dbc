"""Every change cp_attention makes to code it does not own goes through cp_attention.integrations.patches (issue 54):
the register of sites is the generated docs/patches.md, every site is used by the code and covered by tests that
exist, and the patches made at run time are recorded (that no other module of the package assigns onto a foreign
object is a rule of tests/meta/test_layering.py).

Oracles: the source of the package (read as syntax trees, not run) and the objects transformers' modules hold
after cp_attention adapted them.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

from cp_attention.integrations import patches

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "cp_attention")
PAGE = os.path.join(ROOT, "docs", "patches.md")
PATCHES = os.path.join(PACKAGE, "integrations", "patches.py")

def _sources():
    for folder, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                yield os.path.relpath(path, PACKAGE).replace(os.sep, "/"), open(path).read()


def _site_calls(text: str) -> set[str]:
    """The site keys the module's patch / record / temporarily calls name."""
    keys = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Call):  # patch / record / temporarily, or a helper handing them its site=
            for kw in node.keywords:
                if kw.arg == "site" and isinstance(kw.value, ast.Constant):
                    keys.add(kw.value.value)
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in (
                "patch", "record", "temporarily"):
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                keys.add(node.args[0].value)  # record("site", ...)
    return keys


def test_the_page_is_current():
    from cp_attention.tools.patches import page

    with open(PAGE) as f:
        assert f.read() == page(), \
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


def test_every_adapter_states_what_it_adapts_and_how_it_admits_it():
    """Each row of the adapters' table says what it adapts and how it admits it, and changes foreign code only under
    sites of the register; the table's adapters are distinct objects named by their rows."""
    from cp_attention.integrations.hf.adapters import ADAPTERS, ROWS

    assert len({id(a) for a in ADAPTERS}) == len(ROWS)
    for row, adapter in zip(ROWS, ADAPTERS):
        assert adapter.name == row and adapter.adapts and adapter.admission, row
        assert adapter.sites and set(adapter.sites) <= set(patches.SITES), (row, adapter.sites)
