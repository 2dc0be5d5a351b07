"""Hostile and corrupt tap files: a line pmaptap did not write, a file
truncated or replaced under a running job. No writer stops, no reader dies,
the good lines survive. (The property-based fuzzing of the same parser is in
test_fuzz_tapfile.py.)"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import filelock
import pytest

import pmaptap
from conftest import ROOT, job_failed, logs_warning, prefixed, python_cmd, start_launch, wait_for
from pmaptap.tapfile.record import parse
from pmaptap.tapfile.record.format import Record

DEEP = 100_000


def deep_line(step: int = 1) -> bytes:
    """A line shaped like a replicated record (so the writers' dedup parses
    it) whose value nests 100,000 levels: json.loads dies on it with
    RecursionError."""
    head = json.dumps(
        {
            "run": "intruder",
            "name": "loss",
            "step": step,
            "kind": "replicated",
            "dtype": "float32",
            "shape": [],
            "process": 9,
            "time": 1.0,
            "host": "x",
            "replicas": 1,
            "vhash": "ffff",
        },
        separators=(",", ":"),
    )
    return (head[:-1] + ',"value":' + "[" * DEEP + "]" * DEEP + "}\n").encode()


# ------------------------------------------------------------ the parser


@pytest.mark.parametrize("backend", ["orjson", "json"])
def test_parser_limits_are_reported_never_raised(backend, monkeypatch):
    from pmaptap.tapfile.record import format as fmt

    if backend == "json":
        monkeypatch.setattr(fmt, "ORJSON", None)
    good = (
        Record(
            run="r",
            name="loss",
            step=1,
            kind="replicated",
            value=0.5,
            dtype="float32",
            shape=[],
            process=0,
            time=1.0,
            host="h",
            replicas=1,
            vhash="ab",
        )
        .encode()
        .rstrip(b"\n")
    )
    assert parse.parse_line(good)[1] is None
    d, why = parse.parse_line(deep_line().rstrip(b"\n"))
    assert d is None and why == f"nested deeper than {parse.MAX_DEPTH} levels (not parsed)"
    nest = lambda n: good.replace(b'"value":0.5', b'"value":' + b"[" * n + b"]" * n)
    assert parse.parse_line(nest(parse.MAX_DEPTH - 1))[1] is None  # + the record
    assert "nested deeper" in parse.parse_line(nest(parse.MAX_DEPTH))[1]
    # Brackets inside strings are text, not nesting.
    assert parse.parse_line(good.replace(b'"host":"h"', b'"host":"' + b"[" * 500 + b'"'))[1] is None
    monkeypatch.setattr(parse, "MAX_LINE_BYTES", len(good) - 1)
    assert parse.parse_line(good)[1].startswith("line too long")
    monkeypatch.setattr(parse, "MAX_LINE_BYTES", 64 << 20)
    for bad, why in [
        (b'"step":1', b'"step":1e400'),
        (b'"step":1', b'"step":' + b"7" * 5000),
        (b'"host":"h"', b'"host":"\\ud800"'),
        (b'"host":"h"', b'"host":"\xff"'),
        (b'"host":"h"', b'"host":"\x00"'),
        (b'"step":1', b'"step":NaN'),
    ]:
        d, problem = parse.parse_line(good.replace(bad, why))
        assert d is None and problem.startswith("not valid JSON"), (why, problem)
    # Integers past 64 bits read as floats (as orjson does), so not a step.
    assert (
        parse.parse_line(good.replace(b'"step":1', b'"step":' + b"1" * 25))[1]
        == "not a pmaptap record: step must be an integer"
    )
    for field, value in [
        ("pass", [1]),
        ("vhash", {}),
        ("process", [0]),
        ("devices", 3),
        ("processes", [[0]]),
    ]:
        d = json.loads(good)
        d[field] = value
        problem = parse.parse_line(json.dumps(d).encode())[1]
        assert problem.startswith("not a pmaptap record") and field in problem


def test_writer_refuses_a_record_readers_would_skip(tmp_path, monkeypatch):
    """Readers' limits hold for writers too: a too-deep value becomes a
    pmaptap/unencodable record naming the problem, never an unreadable line."""
    from pmaptap._host.sinks import FileSink

    path = str(tmp_path / "w.jsonl")
    sink = FileSink(path, process=0)
    value = 0.0
    for _ in range(parse.MAX_DEPTH):
        value = [value]
    base = dict(
        run="r",
        kind="per_device",
        dtype="float32",
        shape=[],
        process=0,
        time=1.0,
        host="h",
        device=0,
        coords={},
    )
    sink.write(
        [
            Record(name="deep", step=0, value=value, **base),
            Record(name="ok", step=0, value=1.0, **base),
        ]
    )
    sink.close()
    recs = pmaptap.read(path)
    assert [r["name"] for r in recs] == ["pmaptap/unencodable", "ok"]
    assert "deeper than" in recs[0]["error"] and len(sink.rejected) == 1


# ------------------------------------------------------------ readers


def test_readers_skip_a_deep_line_and_validate_names_it(tmp_path, caplog):
    from conftest import cli

    path = str(tmp_path / "deep.jsonl")
    good = [
        Record(
            run="r",
            name="loss",
            step=s,
            kind="replicated",
            value=s / 2,
            dtype="float32",
            shape=[],
            process=0,
            time=1.0,
            host="h",
            replicas=2,
            devices=(0, 1),
            vhash=f"{s:04x}",
        ).encode()
        for s in range(4)
    ]
    with open(path, "wb") as f:
        f.write(b"".join(good[:2]) + deep_line() + b"".join(good[2:]))
    with logs_warning(caplog, r"skipped 1 invalid line\(s\): line 3: nested deeper"):
        recs = pmaptap.read(path)
    assert [r["step"] for r in recs] == [0, 1, 2, 3]
    for args in (
        ["show"],
        ["summary"],
        ["export", "--csv", "-"],
        ["tail", "-n", "2"],
        ["plot", "--name", "loss", "-o", str(tmp_path / "p.png")],
    ):
        out = cli(args[0], path, *args[1:])
        assert out.returncode == 0, (args, out.stderr)
        assert "Traceback" not in out.stderr + out.stdout, args
        if args[0] in ("show", "summary", "export"):
            assert "skipped 1 invalid line(s) (first: line 3: nested deeper" in out.stderr
    assert "4 records" in cli("summary", path).stdout
    out = cli("validate", path)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert f"{path}:3: nested deeper than {parse.MAX_DEPTH} levels" in out.stdout


def test_sink_notices_truncation_even_after_the_file_regrew(tmp_path, caplog):
    """Two writers (processes 0 and 1) on one file; it is truncated, writer 1
    writes more than writer 0 had seen: writer 0 still notices (the bytes
    before its offset changed), re-reads, and the dedup stays exact."""
    from pmaptap._host.sinks import FileSink

    path = str(tmp_path / "t.jsonl")
    a, b = FileSink(path, process=0), FileSink(path, process=1)

    def loss(step, p):
        return Record(
            run="r",
            name="loss",
            step=step,
            kind="replicated",
            value=1.0,
            dtype="float32",
            shape=[],
            process=p,
            time=1.0,
            host="h",
            replicas=1,
            vhash="aa",
        )

    a.write([loss(0, 0)])
    b.write([loss(0, 1)])  # deduplicated against a's
    open(path, "w").close()  # : > t.jsonl
    with logs_warning(caplog, "was truncated"):
        b.write([loss(s, 1) for s in range(1, 6)])  # below b's offset
    assert os.path.getsize(path) > a._seen  # regrown past a's offset
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pmaptap"):
        a.write([loss(s, 0) for s in range(1, 7)])  # 1-5 are b's: skipped
        a.write([loss(7, 0)])
    # One warning, once, however many writes follow.
    assert [r.getMessage().count("was truncated") for r in caplog.records] == [1]
    # b noticed first (the file was below its offset), a by the bytes.
    assert a.truncations == 1 and b.truncations == 1
    assert [r["step"] for r in pmaptap.read(path)] == [1, 2, 3, 4, 5, 6, 7]
    a.close()
    b.close()


# ------------------------------------------------------------ real jobs

_JOB = """
    import os, time, jax, jax.numpy as jnp, pmaptap, pmaptap.distributed as dist
    dist.initialize()
    p = jax.process_index()
    d = os.environ["DIR"]

    def wait(name):
        deadline = time.monotonic() + 90
        while not os.path.exists(os.path.join(d, name)):
            assert time.monotonic() < deadline, "no " + name
            time.sleep(0.01)

    def body(x):
        pmaptap.tap(jax.lax.pmean(x, "i"), "loss", dedup="replicated")
        pmaptap.tap(x, "x", dedup="per_device")
        return x

    with pmaptap.Session(os.environ["TAP"], flush_interval=0.01) as s:
        f = jax.pmap(body, axis_name="i")
        n = jax.local_device_count()

        def run(steps):
            for step in steps:
                f(jnp.arange(n, dtype=jnp.float32) + 10 * step + 100 * p
                  ).block_until_ready()
        run(range(3))
        s.flush()
        open(os.path.join(d, f"phase1-{p}"), "w").close()
        wait("go1")
        run(range(3, 6))        # queued while the test holds the lock
        open(os.path.join(d, f"phase2-{p}"), "w").close()
        wait("go2")
        s.flush()
    print("DONE", flush=True)
"""


def _steps(recs, name):
    return sorted(r["step"] for r in recs if r["name"] == name)


def _job(tmp_path, between1, between2):
    tap = str(tmp_path / "run.jsonl")
    launcher = start_launch(2, 2, python_cmd(_JOB), TAP=tap, DIR=str(tmp_path))
    try:
        for phase, action in (("phase1", between1), ("phase2", between2)):
            wait_for(
                lambda: (
                    all(os.path.exists(tmp_path / f"{phase}-{p}") for p in (0, 1))
                    or launcher.poll() is not None
                ),
                120,
                f"both processes at {phase}",
            )
            assert launcher.poll() is None, launcher.communicate()
            action(tap)
            open(tmp_path / ("go1" if phase == "phase1" else "go2"), "w").close()
        out, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    return tap, launcher, out, err


def test_deep_line_appended_mid_job_costs_nothing(tmp_path, caplog):
    offset = {}

    def append_deep(tap):
        offset["at"] = os.path.getsize(tap)
        with open(tap, "ab") as f:  # like echo >>: no lock
            f.write(deep_line())

    tap, launcher, out, err = _job(tmp_path, append_deep, lambda tap: None)
    proc = type("P", (), {"returncode": launcher.returncode, "stdout": out, "stderr": err})
    assert launcher.returncode == 0, job_failed(proc)
    assert "Traceback" not in err and "RecursionError" not in err
    with logs_warning(caplog, "skipped 1 invalid line"):
        recs = [r for r in pmaptap.read(tap) if r["run"] != "intruder"]
    assert _steps(recs, "loss") == list(range(6))  # once each
    assert _steps(recs, "x") == sorted(list(range(6)) * 4)  # 4 devices
    for p in (0, 1):
        assert prefixed(out, p) == ["DONE"], job_failed(proc)
        text = "\n".join(prefixed(err, p))
        assert text.count("holds a line that is not a pmaptap record") == 1, text
        assert f"at byte offset {offset['at']} (nested deeper" in text


@pytest.mark.parametrize("how", ["truncate", "replace", "remove"])
def test_file_truncated_or_replaced_under_a_running_job(tmp_path, how):
    lock = {}

    def hold_lock(tap):
        lock["l"] = filelock.FileLock(tap + ".lock")
        lock["l"].acquire()

    def change_file_and_release(tap):
        time.sleep(0.3)  # the writers try (and fail) to take the lock
        if how == "truncate":
            open(tap, "w").close()  # : > run.jsonl
        else:
            os.rename(tap, tap + ".old")
            if how == "replace":
                open(tap, "w").close()
        lock["l"].release()

    tap, launcher, out, err = _job(tmp_path, hold_lock, change_file_and_release)
    proc = type("P", (), {"returncode": launcher.returncode, "stdout": out, "stderr": err})
    assert launcher.returncode == 0, job_failed(proc)
    assert "Traceback" not in err
    # Everything still queued when the file changed is in the file at the
    # path: steps 3-5, the replicated loss once each, x on all 4 devices.
    recs = pmaptap.read(tap)
    assert _steps(recs, "loss") == [3, 4, 5], recs
    assert _steps(recs, "x") == sorted([3, 4, 5] * 4)
    if how != "truncate":
        old = pmaptap.read(tap + ".old")
        assert _steps(old, "loss") == [0, 1, 2]
        assert _steps(old, "x") == sorted([0, 1, 2] * 4)
    word = "was truncated" if how == "truncate" else "was replaced"
    for p in (0, 1):
        text = "\n".join(prefixed(err, p))
        assert text.count(word) == 1, text


def test_torn_shard_tail_under_a_running_session_costs_only_that_line(tmp_path, caplog):
    """Sharded layout: the session's own shard stops ending in a newline
    while it runs (another program's bytes without one; a truncation in the
    middle of a line). The next batch starts on a new line: every record the
    session wrote after it is read back, only the torn line is lost."""
    import jax
    import jax.numpy as jnp

    from pmaptap.tapfile.source import run as runs

    tap = str(tmp_path / "run.jsonl")
    f = jax.jit(lambda x, i: pmaptap.tap(x, "y", step=i, dedup="replicated"))
    with pmaptap.Session(tap, run="r", layout="sharded", flush_interval=0.01) as s:
        shard = runs.shard_path(tap, 0)

        def steps(lo, hi):
            for i in range(lo, hi):
                f(jnp.float32(i), i).block_until_ready()
            s.flush()

        steps(0, 3)
        with open(shard, "ab") as out:  # like printf >> shard: no newline
            out.write(b'{"run": "intruder", "na')
        steps(3, 6)
        size = os.path.getsize(shard)
        last = open(shard, "rb").read().rstrip(b"\n").rfind(b"\n") + 1
        os.truncate(shard, (last + size) // 2)  # step 5's line cut in half
        steps(6, 9)
    with logs_warning(caplog, "skipped 2 invalid line"):
        recs = pmaptap.read(tap)
    assert [r["step"] for r in recs] == [0, 1, 2, 3, 4, 6, 7, 8]
    v = subprocess.run(
        [sys.executable, "-m", "pmaptap", "validate", tap],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert v.returncode == 1 and v.stdout.count("p00000.jsonl line") == 2, v.stdout
