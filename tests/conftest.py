"""The test suite, by kind: ``unit/`` (single process), ``multirank/`` (spawns gloo ranks),
``integrations/`` (transformers, Trainer, TRL, PEFT), ``tools/`` (command line, probe, demo, benchmarks,
sweeps), ``meta/`` (checks of the code and the suite themselves); ``support/`` holds the shared,
non-test modules, imported by bare name (``import oracle``).

Markers (registered in pyproject.toml):

* ``multirank``: the test spawns ranks (gloo processes, torchrun, a subprocess running
  torch.distributed), or another Python process (a child interpreter costs seconds: the memory
  measurements, the command line's entry points). Every test under ``multirank/`` carries it
  (:func:`pytest_collection_modifyitems`); elsewhere a module that spawns ranks declares it in
  ``pytestmark``, a single test that starts a child process in a decorator. The inner loop, single
  process: ``OMP_NUM_THREADS=1 python -m pytest -m "not multirank"`` (under 2 minutes on 2 cores).
* ``transformers``: the test builds transformers models.
* the long groups ``fuzz``, ``families``, ``faults``, ``strategies`` and ``slow`` stay out of every
  run whose ``-m`` expression does not name them (``python -m pytest -m faults`` runs the faults).
"""

import os
import re
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
SUPPORT = os.path.join(TESTS, "support")

# tests/support by bare name (import oracle, cases, ...), tests/ for tests/mutations.py; spawned ranks
# inherit sys.path, subprocesses (torchrun, python -c, scripts) find tests/support through PYTHONPATH
for _path in (TESTS, SUPPORT):
    if _path not in sys.path:
        sys.path.insert(0, _path)
if SUPPORT not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (SUPPORT, os.environ.get("PYTHONPATH", "")) if p)

# Every plan built by the suite (in this process and in spawned ranks) is checked token by token
# against the mask (cp_attention.plan.verify_plan).
os.environ.setdefault("CP_ATTENTION_VERIFY_PLANS", "1")

# Without a GPU, Triton kernels run in Triton's CPU interpreter, which must be chosen before anything
# (torch, transformers) imports triton; backend="auto" never picks the interpreter on CPU.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

# Opt-in groups: deselected unless the -m expression names them.
LONG_GROUPS = ("fuzz", "families", "faults", "strategies", "slow")
MULTIRANK_DIR = os.path.join(TESTS, "multirank")


def named_groups(markexpr: str) -> set[str]:
    """The long groups a ``-m`` expression names (``"faults or slow"``, ``"not fuzz"``, ...)."""
    return {group for group in LONG_GROUPS if re.search(rf"\b{group}\b", markexpr or "")}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark every test under tests/multirank ``multirank`` (before ``-m`` selects), then deselect the
    tests of the long groups the ``-m`` expression does not name."""
    for item in items:
        if os.path.commonpath([str(item.path), MULTIRANK_DIR]) == MULTIRANK_DIR:
            item.add_marker(pytest.mark.multirank)
    unnamed = set(LONG_GROUPS) - named_groups(config.getoption("markexpr"))
    kept, dropped = [], []
    for item in items:
        (dropped if unnamed & {m.name for m in item.iter_markers()} else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_sessionfinish(session, exitstatus):
    """With CP_ATTENTION_NO_SKIPS=1 (set by .ci/run) a skipped test fails the run: on a fresh machine
    a skip usually means a package the suite needs was not installed, and a green run would hide it."""
    if os.environ.get("CP_ATTENTION_NO_SKIPS") != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    if skipped:
        lines = [f"  {r.nodeid}: {r.longrepr[-1] if isinstance(r.longrepr, tuple) else r.longrepr}" for r in skipped]
        print(f"\nCP_ATTENTION_NO_SKIPS=1: {len(skipped)} test(s) skipped (a missing package?):\n" + "\n".join(lines))
        session.exitstatus = 1
