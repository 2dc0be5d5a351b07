"""The README's ten-line example runs and prints what it says."""
from __future__ import annotations

import os
import re

from conftest import ROOT, run_python


def test_readme_example_runs_as_documented(tmp_path):
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    code = text.split("## Ten lines\n\n```python\n", 1)[1].split("```", 1)[0]
    expected = re.search(r"^# (\[.*?\]):", code, re.M).group(1)
    code = code.replace('"out/run.jsonl"', repr(str(tmp_path / "run.jsonl")))
    proc = run_python(code, devices=4)
    assert proc.stdout.strip() == expected
