"""The code passes ``ruff check`` with the configuration in pyproject.toml
(rules E, F, W, I, B, UP; the ignored rules are listed there with reasons)."""
from __future__ import annotations

import subprocess
import sys

from conftest import ROOT


def test_ruff_check_passes():
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache",
         "pmaptap", "tests", "benchmarks", "launch"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
