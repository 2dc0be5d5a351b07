"""Reading streams: ``summary`` summarizes while parsing (values as written,
never decoded; records not held) and ``show``/``export`` keep only matching
records, with the same results as reading everything first: divergence is
judged on every copy of a key, even copies a --process/--device filter drops."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from read_definitions import load_matching

import pmaptap
from conftest import ROOT, logs_warning, per_device_dict, record_dict, subprocess_env
from pmaptap.tapfile.analyze.summary import summarize_file, tap_summaries
from pmaptap.tapfile.read.query import Filter


def _rep(step, value, process, vhash, **kw):
    d = record_dict(
        name="loss",
        step=step,
        value=value,
        dtype="float32",
        process=process,
        replicas=2,
        devices=[2 * process, 2 * process + 1],
        processes=[process],
        vhash=vhash,
    )
    return dict(d, **kw)


def _dev(step, device, value, name="gnorm", **kw):
    fields = {"process": device // 2, "coords": {"dp": device, "mp": 0}, **kw}
    return per_device_dict(step, device, value, name, **fields)


@pytest.fixture
def taps(tmp_path) -> str:
    recs = [
        _rep(0, 1.0, 0, "a"),
        _rep(1, "NaN", 0, "b"),
        _rep(2, 3.0, 0, "c"),
        _rep(2, 4.0, 1, "d"),  # divergent step 2
        _rep(3, 5.0, 0, "e"),
        _rep(3, 5.0, 0, "e"),  # a duplicate
        _rep(5, "Infinity", 1, "f"),
    ]  # step 4 missing
    recs += [_dev(s, d, 0.5 * d + s) for s in range(3) for d in range(4) if (s, d) != (1, 3)]
    recs.append(_dev(2, 1, 9.0, coords={"mp": 0, "dp": 1}))  # same coords, reordered
    recs += [_dev(s, 0, [1.0, "NaN"], name="act", shape=[2]) for s in range(2)]
    recs.append(
        {
            "run": "r",
            "name": "auto",
            "step": 0,
            "kind": "replicated",
            "value": 2.0,
            "dtype": "float32",
            "shape": [],
            "process": 0,
            "time": 1.0,
            "host": "h",
            "replicas": 4,
            "devices": [0, 1, 2, 3],
            "vhash": "z",
        }
    )
    recs += [_dev(1, d, float(d), name="auto") for d in range(4)]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + "garbage\n")
    return str(path)


def test_streaming_summary_equals_summary_of_read_records(taps, caplog):
    with logs_warning(caplog):
        recs = pmaptap.read(taps)
    streamed, bad, names, runs = summarize_file(taps)
    assert streamed == tap_summaries(recs)
    assert [n for n, _ in bad] == [len(recs) + 1]
    assert names == {"loss", "gnorm", "act", "auto"} and runs == {"r"}
    by = {s.name: s for s in streamed}
    loss = by["loss"]
    assert loss.divergent_steps == (2,) and loss.duplicates == 1
    assert loss.nonfinite == 2 and loss.missing == 1 and loss.last == (float("inf"),)
    assert by["gnorm"].incomplete_steps == (1,) and by["gnorm"].duplicates == 1
    assert by["act"].nonscalar == 2 and by["auto"].divergent_steps == (1,)


def test_filters_keep_divergence_of_dropped_copies(taps):
    # Only process 0's copy of step 2 matches, but process 1 disagreed.
    streamed, *_ = summarize_file(taps, Filter(names=("loss",), process=0))
    assert streamed[0].divergent_steps == (2,) and streamed[0].records == 5
    entries, *_ = load_matching(taps, Filter(names=("loss",), process=0))
    assert [e.rec.get("divergent", False) for e in entries] == [False, False, True, False, False]
    assert entries[2].raw["divergent"] is True  # for show --json too
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pmaptap",
            "show",
            taps,
            "--name",
            "loss",
            "--process",
            "0",
            "--step",
            "2",
        ],
        env=subprocess_env(1),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and "DIVERGENT" in out.stdout
    assert "skipped 1 invalid line" in out.stderr
