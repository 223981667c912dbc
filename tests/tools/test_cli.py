"""The command line (issue 12): ``cp-attention`` / ``python -m cp_attention`` lists probe, demo and bench;
every option of every command has help text; bad values exit 2 with a one-line error and no traceback;
``bench`` runs at a tiny shape, prints ratios, and its dense baseline mask follows the documented mask
semantics. Most checks call ``cli.main`` in-process; a few run the real entry points as subprocesses."""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import os
import re
import subprocess
import sys

import pytest
import torch

import cp_attention
from cp_attention.tools import bench, cli

OPTIONS = {
    "probe": {"--model", "--nproc", "--seq-len", "--window", "--layout", "--tol"},
    "demo": {"--nproc", "--seq-len", "--window", "--layout"},
    "bench": {"--mask", "--seq-len", "--heads", "--head-dim", "--dtype", "--backward", "--repeats", "--warmup",
              "--peers"},
}
TINY_BENCH = ["bench", "--seq-len", "64", "--heads", "2", "--head-dim", "16", "--repeats", "1", "--warmup", "0",
              "--peers", "sdpa_dense,sdpa_causal"]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=120)


def _option_help(text: str) -> dict[str, str]:
    """``--option`` -> its help text, from argparse's help output (text on the option's line or, when
    the option and its metavar are long, on the next, indented line)."""
    lines = text.splitlines()
    helps = {}
    for i, line in enumerate(lines):
        m = re.match(r"^  (?:-\w, )?(--[\w-]+)(?: \S+)?(?:\s{2,}(\S.*))?$", line)
        if m is None:
            continue
        follow = lines[i + 1] if i + 1 < len(lines) else ""
        below = follow.strip() if re.match(r"^ {8,}\S", follow) else ""
        helps[m.group(1)] = (m.group(2) or below).strip()
    return helps


def _assert_usage_error(rc: int, err: str, fragment: str) -> None:
    assert rc == 2, err
    assert "Traceback" not in err, err
    error_lines = [line for line in err.splitlines() if "error:" in line]
    assert len(error_lines) == 1 and err.rstrip().splitlines()[-1] == error_lines[0], err
    assert fragment in error_lines[0], err


def test_help_lists_the_three_commands(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("probe", "demo", "bench"):
        line = next((x for x in out.splitlines() if x.split()[:1] == [name]), "")
        assert len(line.split()) > 3, (name, out)  # the command and its one-line description
    assert cli.main(["-h"]) == 0


def test_no_arguments_prints_help_and_exits_2(capsys):
    assert cli.main([]) == 2
    out = capsys.readouterr().out
    assert out.startswith("usage: cp-attention") and "bench" in out


@pytest.mark.multirank  # starts a Python child process: out of the inner loop (tests/conftest.py)
def test_python_dash_m_entry_points():
    top = _run("-m", "cp_attention", "--help")
    assert top.returncode == 0 and all(f"    {c} " in top.stdout for c in OPTIONS), top.stdout + top.stderr
    bare = _run("-m", "cp_attention", "probe", "--seq-len", "1")  # the README's entry point still parses its options
    _assert_usage_error(bare.returncode, bare.stderr, "--seq-len")
    assert bare.stdout == ""


@pytest.mark.parametrize("command", sorted(OPTIONS))
def test_every_option_has_help_text(command, capsys):
    assert cli.main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: cp-attention {command}"), out
    helps = _option_help(out)
    assert set(helps) == OPTIONS[command] | {"--help"}, out
    assert all(helps.values()), {o: h for o, h in helps.items() if not h}


BAD_VALUES = [
    (["probe", "--nproc", "0"], "--nproc"),
    (["probe", "--seq-len", "1"], "--seq-len"),
    (["probe", "--nproc", "4", "--seq-len", "6"], "--seq-len"),  # 2 tokens per rank at least
    (["probe", "--seq-len", "100000"], "--seq-len"),
    (["probe", "--window", "1"], "--window"),
    (["probe", "--tol", "0"], "--tol"),
    (["probe", "--model", "gpt5"], "--model"),
    (["probe", "--layout", "ring"], "--layout"),
    (["demo", "--nproc", "-1"], "--nproc"),
    (["demo", "--nproc", "4", "--seq-len", "3"], "--seq-len"),
    (["demo", "--window", "0"], "--window"),
    (["demo", "--layout", "ring"], "--layout"),
    (["bench", "--mask", "sliding:4"], "--mask"),
    (["bench", "--mask", "window:0"], "--mask"),
    (["bench", "--mask", "documents:9", "--seq-len", "8"], "documents:9"),
    (["bench", "--seq-len", "0"], "--seq-len"),
    (["bench", "--heads", "0"], "--heads"),
    (["bench", "--head-dim", "0"], "--head-dim"),
    (["bench", "--repeats", "0"], "--repeats"),
    (["bench", "--warmup", "-1"], "--warmup"),
    (["bench", "--dtype", "int8"], "--dtype"),
    (["nonsense"], "nonsense"),
]


@pytest.mark.parametrize("argv, fragment", BAD_VALUES, ids=[" ".join(argv) for argv, _ in BAD_VALUES])
def test_bad_values_exit_2_with_one_line(argv, fragment, capsys):
    rc = cli.main(argv)
    captured = capsys.readouterr()
    _assert_usage_error(rc, captured.err, fragment)
    assert captured.out == ""


def _speedups(out: str) -> dict[str, dict[str, float]]:
    """{pass: {peer label: speedup}} from the bench's table lines."""
    found = {}
    for line in out.splitlines():
        cells = line.split(" | ")
        head = re.match(r"^(forward(?:\+backward)?)\s+cp_attention\s+\d+\.\d+ ms$", cells[0])
        if head:
            found[head.group(1)] = {m.group(1): float(m.group(2)) for m in (
                re.match(r"^(.+) \d+\.\d+ ms: speedup (\d+\.\d+)x$", c) for c in cells[1:])}
    return found


@pytest.mark.parametrize("mask", ["causal", "window:8", "documents:3"])
def test_bench_prints_speedups_and_agrees_with_sdpa(mask, capsys):
    assert cli.main([*TINY_BENCH, "--mask", mask, "--backward"]) == 0
    out = capsys.readouterr().out
    assert "speedup = the peer's time / cp_attention's time" in out, out
    speedups = _speedups(out)
    peers = {"SDPA dense mask", "SDPA is_causal"} if mask == "causal" else {"SDPA dense mask"}
    assert set(speedups) == {"forward", "forward+backward"}, out
    # a speedup is printed for every peer; its value is a timing, which no CI test asserts on (a loaded machine
    # prints 0.00x)
    assert all(set(row) == peers and all(x >= 0 for x in row.values()) for row in speedups.values()), out
    if mask != "causal":
        assert "not run: SDPA is_causal" in out, out
    diff = float(re.search(r"max \|cp_attention - SDPA\| on the output: (\S+)", out).group(1))
    assert diff < 1e-5, out  # the dense baseline mask is the same mask


@pytest.mark.slow  # 28 s: compiles flex attention
def test_bench_times_compiled_flex_forward_only_on_cpu(capsys):
    """The flex peer: compiled before the timing, forward only on CPU (FlexAttention has no CPU backward)."""
    assert cli.main([*TINY_BENCH[:-1], "flex", "--mask", "window:8", "--backward"]) == 0
    out = capsys.readouterr().out
    speedups = _speedups(out)
    assert set(speedups["forward"]) == {"compiled Flex"} and speedups["forward+backward"] == {}, out


@pytest.mark.multirank  # starts a Python child process: out of the inner loop (tests/conftest.py)
def test_bench_subprocess():
    res = _run("-m", "cp_attention", *TINY_BENCH)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stdout + res.stderr
    assert set(_speedups(res.stdout)) == {"forward"}, res.stdout


@pytest.mark.parametrize("kind, value", [("causal", None), ("window", 3), ("documents", 3), ("chunked", 4)])
def test_bench_dense_mask_follows_the_documented_semantics(kind, value):
    L = 11
    docs = [0] * 4 + [1] * 4 + [2] * 3 if kind == "documents" else [0] * L  # 3 documents: lengths 4, 4, 3
    pos = [i - docs.index(docs[i]) for i in range(L)]
    expected = torch.tensor([[docs[q] == docs[k] and 0 <= q - k
                              and (kind != "window" or abs(q - k) < value)
                              and (kind != "chunked" or pos[q] // value == pos[k] // value)
                              for k in range(L)] for q in range(L)])
    assert torch.equal(bench.dense_mask(kind, value, L), expected)


def test_packaging_single_version_and_py_typed():
    assert importlib.metadata.version("cp_attention") == cp_attention.__version__ == "0.1.0"
    assert importlib.resources.files("cp_attention").joinpath("py.typed").is_file()
    assert any(r.split(";")[0].strip().startswith("numpy") for r in importlib.metadata.requires("cp_attention"))
