"""The code passes ``ruff check`` (rules E, F, W, I, B, UP; the ignored rules
are listed in pyproject.toml with reasons) and is ``ruff format``-ed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT

PATHS = ["pmaptap", "tests", "benchmarks", "launch"]


@pytest.mark.parametrize(
    "command",
    [["check", "--no-cache"], ["format", "--check", "--no-cache"]],
    ids=["check", "format"],
)
def test_ruff_passes(command):
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", *command, *PATHS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
