"""Empty and bad requests get the same answer from every reading command:
a reversed range or a negative count is a usage error (exit 2) that says
why; a --name or --run the file does not have is an error listing the taps
and runs it has; a filter that matches nothing says so, with the same list."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT, subprocess_env


def _rec(run: str, name: str, step: int, **kw) -> dict:
    d = {
        "run": run,
        "name": name,
        "step": step,
        "kind": "replicated",
        "value": 1.0,
        "dtype": "float32",
        "shape": [],
        "process": 0,
        "time": 1.0,
        "host": "h",
        "replicas": 2,
        "devices": [0, 1],
    }
    d.update(kw)
    return d


@pytest.fixture(scope="module")
def taps(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("req") / "t.jsonl"
    recs = [_rec("r1", "loss", s) for s in range(4)]
    recs += [
        _rec("r2", "gnorm", s, kind="per_device", device=d, coords={"dp": d})
        for s in range(4)
        for d in range(2)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return str(path)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pmaptap", *args],
        env=subprocess_env(1),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _commands(taps: str, tmp: str) -> dict[str, list[str]]:
    return {
        "show": ["show", taps],
        "summary": ["summary", taps],
        "csv": ["export", taps, "--csv", f"{tmp}/o.csv"],
        "parquet": ["export", taps, "--parquet", f"{tmp}/o.parquet"],
        "tensorboard": ["export", taps, "--tensorboard", f"{tmp}/tb"],
        "plot": ["plot", taps, "-o", f"{tmp}/o.png"],
        "tail": ["tail", taps],
    }


@pytest.mark.parametrize("step", ["5:2", "3:-1"])
def test_reversed_step_range_is_a_usage_error(taps, tmp_path, step):
    for what, cmd in _commands(taps, str(tmp_path)).items():
        extra = ["--name", "loss"] if what == "plot" else []
        out = cli(*cmd, *extra, "--step", step)
        assert out.returncode == 2, (what, out.stderr)
        a, b = step.split(":")
        assert "range is empty" in out.stderr and f"({a} > {b})" in out.stderr, what
        assert f"write {b}:{a}" in out.stderr and out.stdout == ""


def test_negative_counts_are_usage_errors(taps):
    for cmd in (
        ["tail", taps, "-n", "-3"],
        ["show", taps, "--limit", "-1"],
        ["tail", taps, "--max-records", "-2"],
        ["validate", taps, "--limit", "-5"],
    ):
        out = cli(*cmd)
        assert out.returncode == 2, cmd
        assert "count of 0 or more" in out.stderr and out.stdout == "", cmd
    out = cli("tail", taps, "-n", "three")
    assert out.returncode == 2 and "whole number" in out.stderr
    # 0 stays allowed: "no limit" / "nothing before following".
    assert cli("tail", taps, "-n", "0").returncode == 0
    assert cli("show", taps, "--limit", "0").returncode == 0


def test_unknown_name_or_run_lists_what_the_file_has(taps, tmp_path):
    for what, cmd in _commands(taps, str(tmp_path)).items():
        if what == "tail":
            continue  # tail may wait for a name that is not written yet
        out = cli(*cmd, "--name", "nope")
        assert out.returncode == 2, (what, out.stderr)
        assert "no records named 'nope'" in out.stderr, what
        assert "gnorm, loss" in out.stderr, what
        if what != "plot":
            out = cli(*cmd, "--run", "r3")
            assert out.returncode == 2, (what, out.stderr)
            assert "no run 'r3'" in out.stderr, what
            assert "taps in this file: gnorm, loss; runs: r1, r2" in out.stderr, what


def test_empty_match_says_so_with_what_the_file_has(taps, tmp_path):
    for what in ("show", "summary", "csv", "tensorboard"):
        cmd = _commands(taps, str(tmp_path))[what]
        out = cli(*cmd, "--name", "loss", "--step", "7:9")
        assert out.returncode == 0, (what, out.stderr)
        assert "no matching records" in out.stderr, what
        assert "taps in this file: gnorm, loss; runs: r1, r2" in out.stderr, what
        if what in ("show", "summary"):
            assert out.stdout == "", what
    # A filter that matches keeps working, names from several runs included.
    out = cli("show", taps, "--name", "loss", "--name", "gnorm", "--step", "3")
    assert out.returncode == 0 and len(out.stdout.splitlines()) == 1 + 3
