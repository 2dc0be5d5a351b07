"""pmaptap.read(path, name=, step=, run=, device=, process=): filtering while
parsing; and the progress bar of long reads on a terminal."""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys

import pytest

import pmaptap
from conftest import ROOT, subprocess_env
from pmaptap.tapfile.source import lines


def _records() -> list[dict]:
    recs = []
    for run in ("r1", "r2"):
        for step in range(10):
            for d in range(4):
                recs.append(
                    {
                        "run": run,
                        "name": "g",
                        "step": step,
                        "kind": "per_device",
                        "value": [step, d],
                        "dtype": "float32",
                        "shape": [2],
                        "process": d // 2,
                        "time": 1.0,
                        "host": "h",
                        "device": d,
                        "coords": {"dp": d},
                    }
                )
            for p in (0, 1):
                # step 7: the two processes disagree (divergent in the file)
                vh = f"{step}{p if step == 7 else ''}"
                recs.append(
                    {
                        "run": run,
                        "name": "loss",
                        "step": step,
                        "kind": "replicated",
                        "value": step / 2,
                        "dtype": "float32",
                        "shape": [],
                        "process": p,
                        "time": 1.0,
                        "host": "h",
                        "replicas": 2,
                        "devices": [2 * p, 2 * p + 1],
                        "processes": [p],
                        "vhash": vh,
                    }
                )
    return recs


@pytest.fixture
def path(tmp_path) -> str:
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in _records()))
    return str(p)


def _keys(recs):
    return [(r["run"], r["name"], r["step"], r.get("device"), r["process"]) for r in recs]


@pytest.mark.parametrize(
    "kwargs, keep",
    [
        (dict(name="loss"), lambda r: r["name"] == "loss"),
        (dict(name=["g", "loss"], run="r2"), lambda r: r["run"] == "r2"),
        (dict(step=3), lambda r: r["step"] == 3),
        (dict(step="2:5"), lambda r: 2 <= r["step"] <= 5),
        (dict(step=(None, 2)), lambda r: r["step"] <= 2),
        (dict(step=(8, None)), lambda r: r["step"] >= 8),
        (dict(step=range(4, 6)), lambda r: r["step"] in (4, 5)),
        # A replicated record stands for every device holding its value.
        (dict(device=3), lambda r: r.get("device") == 3 or 3 in r.get("devices", ())),
        (
            dict(process=1, name="g", step=0),
            lambda r: r["process"] == 1 and r["name"] == "g" and r["step"] == 0,
        ),
    ],
)
def test_filters_match_filtering_everything_afterwards(path, kwargs, keep):
    everything = pmaptap.read(path)
    got = pmaptap.read(path, **kwargs)
    assert got and _keys(got) == _keys([r for r in everything if keep(r)])
    assert got == [r for r in everything if keep(r)]  # values, flags too


def test_divergence_is_judged_on_the_copies_filtered_out(path):
    (mine,) = pmaptap.read(path, name="loss", step=7, process=0, run="r1")
    assert mine["divergent"] is True  # process 1 wrote another value
    (other,) = pmaptap.read(path, name="loss", step=6, process=0, run="r1")
    assert "divergent" not in other


def test_filtered_read_as_frame(path):
    pytest.importorskip("pandas")
    df = pmaptap.read(path, name="g", device=2, as_frame=True)
    assert len(df) == 20 and set(df["device"]) == {2}


@pytest.mark.parametrize(
    "kwargs, err, match",
    [
        (dict(step=(5, 2)), ValueError, "empty"),
        (dict(step="5:2"), ValueError, "empty"),
        (dict(step="x"), ValueError, "A:B"),
        (dict(step=range(0, 10, 2)), ValueError, "step 1"),
        (dict(step=True), TypeError, "step must be"),
        (dict(step=1.5), TypeError, "step must be"),
        (dict(name=[]), TypeError, "name must be"),
        (dict(name=3), TypeError, "name must be"),
        (dict(device="1"), TypeError, "device must be an int"),
        (dict(run=1), TypeError, "run must be a str"),
    ],
)
def test_bad_filter_arguments_say_what_is_accepted(path, kwargs, err, match):
    with pytest.raises(err, match=match):
        pmaptap.read(path, **kwargs)


def test_long_read_draws_a_progress_bar_when_forced(tmp_path, monkeypatch, capsys):
    p = tmp_path / "big.jsonl"
    line = json.dumps(_records()[0]) + "\n"
    p.write_text(line * (3 * (1 << 20) // len(line)))  # ~3 MiB
    monkeypatch.setattr(lines, "PROGRESS_DELAY_S", 0.0)
    monkeypatch.setattr(lines, "_PROGRESS_EVERY", 64)
    monkeypatch.setenv("PMAPTAP_PROGRESS", "1")
    assert len(pmaptap.read(p, step=0)) > 1000
    err = capsys.readouterr().err
    assert "\rreading big.jsonl: [" in err and "MiB/s" in err
    assert re.search(r"\[#{30}\] 3/3 100%  [\d.]+ MiB/s *\n$", err), err
    monkeypatch.delenv("PMAPTAP_PROGRESS")
    pmaptap.read(p, step=0)  # stderr is no terminal here
    assert capsys.readouterr().err == ""


def test_progress_bar_on_a_real_terminal_only_after_the_delay(tmp_path):
    p = tmp_path / "big.jsonl"
    line = json.dumps(_records()[0]) + "\n"
    p.write_text(line * (2 * (1 << 20) // len(line)))
    code = (
        f"import sys; from pmaptap.tapfile.source import lines\n"
        f"lines.PROGRESS_DELAY_S = float(sys.argv[1]); lines._PROGRESS_EVERY = 64\n"
        f"from pmaptap.cli import main\n"
        f"sys.exit(main(['summary', {str(p)!r}]))"
    )

    def run_on_a_tty(delay: str) -> str:
        leader, follower = pty.openpty()
        env = subprocess_env(1)
        env.pop("PMAPTAP_PROGRESS", None)
        proc = subprocess.run(
            [sys.executable, "-c", code, delay],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=follower,
            timeout=120,
        )
        os.close(follower)
        chunks = []
        try:
            while True:
                chunk = os.read(leader, 65536)
                if not chunk:
                    break
                chunks.append(chunk)
        except OSError:  # EIO once the terminal has no writer
            pass
        os.close(leader)
        assert proc.returncode == 0
        return b"".join(chunks).decode()

    assert "reading big.jsonl: [" in run_on_a_tty("0")
    assert "reading" not in run_on_a_tty("1000")  # a short read: no bar
