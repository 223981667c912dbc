"""The README's main job: the CPU demo spawns 2 gloo ranks and exits 0 when CP equals single device."""

from __future__ import annotations

import pytest

from cp_attention.tools import cli

pytestmark = pytest.mark.multirank  # spawns gloo ranks


def test_demo_runs_and_agrees(capsys):
    assert cli.main(["demo", "--seq-len", "384", "--window", "48"]) == 0
    out = capsys.readouterr().out
    assert "OK: CP equals single device" in out
    assert "% of a full ring" in out


def test_cli_usage_without_command(capsys):
    assert cli.main([]) == 2
    assert "usage: cp-attention" in capsys.readouterr().out
