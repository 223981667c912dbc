"""How a sweep runs its families: each in a process of its own, under a timeout, two at a time.

A family's tiny model can hang, exhaust memory or kill its interpreter (a C++ assert, a rank that
dies), so the family and vision-language sweeps run each family as ``python -m <sweep module> --one
FAMILY ... --json TMP`` in a process group of its own (:func:`run_isolated`), which is killed whole
(its gloo ranks with it) when it ends or times out; :func:`run_all` runs the families at most two
at a time and hands each result to one callback under one lock, so that partial results can be
written as they come (:func:`write_atomic`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import cp_attention

__all__ = ["run_isolated", "run_all", "write_atomic"]

# the package this process imports, first on the child's path: the child runs the same code
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(cp_attention.__file__)))


def run_isolated(module: str, args: list[str], timeout: float) -> tuple[dict | None, dict | None, float]:
    """Run ``python -m module *args --json TMP`` in a process group of its own and read TMP back.

    Returns ``(result, None, seconds)``, or ``(None, failure, seconds)`` where ``failure`` is the
    outcome record of a child that timed out (``outcome="timeout"``) or wrote no result
    (``outcome="crash"``, its exit status and the last lines of its output). The whole process group
    is killed at the end either way, so nothing the child started is left behind."""
    fd, path = tempfile.mkstemp(prefix="sweep_", suffix=".json")
    os.close(fd)
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error",
               PYTHONPATH=os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH", "")) if p))
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", module, *args, "--json", path], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out = proc.communicate(timeout=timeout)[0]
        with open(path) as f:
            return json.load(f), None, round(time.monotonic() - t0, 1)
    except subprocess.TimeoutExpired:
        return None, dict(outcome="timeout", message=f"no result within {timeout:.0f}s"), round(timeout, 1)
    except (OSError, ValueError):
        tail = out.decode(errors="replace").strip().splitlines()[-3:]
        failure = dict(outcome="crash", error_type=f"process exit {proc.returncode}", message=" | ".join(tail)[:300])
        return None, failure, round(time.monotonic() - t0, 1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the family's process group: itself and its ranks
        proc.communicate()
        with contextlib.suppress(OSError):
            os.unlink(path)


def run_all(names: list[str], run_one, jobs: int, done) -> None:
    """``run_one(name)`` for every name, at most ``jobs`` (1 or 2) at a time; ``done(name, result)``
    for each result as it comes, under one lock."""
    lock = threading.Lock()

    def one(name):
        result = run_one(name)
        with lock:
            done(name, result)

    with ThreadPoolExecutor(max_workers=max(1, min(2, jobs))) as pool:
        list(pool.map(one, names))


def write_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file: a reader never sees half of it."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)
