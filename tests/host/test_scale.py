"""The sharded layout (one file per process, merged by readers) and
pmaptap.Writer (records from side processes, without JAX)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import pmaptap
from conftest import (
    ROOT,
    job_failed,
    logs_warning,
    replicated_dict,
    run_launch,
    run_python,
    shard_record,
    train_argv,
    wait_for,
)
from pmaptap._host.sinks.directory import DirectorySink, _held_size
from pmaptap.tapfile.record import Record, record_key
from pmaptap.tapfile.source import run as runs

STEPS = 4


def _write(path, process, layout, values, **kw):
    with pmaptap.Writer(path, run="r", process=process, layout=layout, **kw) as w:
        for step, v in enumerate(values):
            w.write("loss", step, v)
            w.write(
                "acts",
                step,
                {"mean": np.float32(step), "hist": np.arange(3)},
                kind="per_device",
                device=process,
            )
    return w


@pytest.mark.parametrize("layout", ["file", "sharded"])
def test_writers_dedup_flag_divergence_and_read_back_the_same(tmp_path, layout):
    path = str(tmp_path / "run.jsonl")
    for p in range(3):
        vals = [np.float32(0.5 * s) for s in range(STEPS)]
        if p == 2:
            vals[3] = np.float32(9.0)  # one process disagrees at step 3
        _write(path, p, layout, vals)
    recs = pmaptap.read(path)
    loss = [r for r in recs if r["name"] == "loss"]
    # one record per agreed value, both values of the divergent step
    assert sorted((r["step"], r["value"]) for r in loss) == [
        (0, 0.0),
        (1, 0.5),
        (2, 1.0),
        (3, 1.5),
        (3, 9.0),
    ]
    assert [r.get("divergent", False) for r in loss if r["step"] == 3] == [True, True]
    assert not any(r.get("divergent") for r in loss if r["step"] < 3)
    acts = [r for r in recs if r["name"] == "acts"]
    assert sorted((r["step"], r["device"]) for r in acts) == [
        (s, p) for s in range(STEPS) for p in range(3)
    ]
    assert acts[0]["value"] == {"hist": [0, 1, 2], "mean": 0.0}
    assert acts[0]["dtype"] == {"hist": np.arange(3).dtype.name, "mean": "float32"}
    assert os.path.isdir(path + ".d") == (layout == "sharded")
    if layout == "sharded":
        assert sorted(os.listdir(path + ".d")) == ["p00000.jsonl", "p00001.jsonl", "p00002.jsonl"]
        assert not os.path.exists(path)
        # the merged stream is ordered by time
        times = [r["time"] for r in recs]
        assert times == sorted(times)


def test_sharded_run_through_every_command(tmp_path):
    path = str(tmp_path / "run.jsonl")
    for p in range(2):
        _write(path, p, "sharded", [np.float32(s) for s in range(STEPS)])
    cli = [sys.executable, "-m", "pmaptap"]

    def run(*args):
        return subprocess.run(
            cli + list(args), capture_output=True, text=True, cwd=ROOT, timeout=60
        )

    v = run("validate", path)
    assert v.returncode == 0 and f"OK, {STEPS + 2 * STEPS} records" in v.stdout, v
    # the directory itself is accepted too
    assert run("validate", path + ".d").returncode == 0
    show = run("show", path, "--name", "loss", "--json")
    assert [json.loads(line)["step"] for line in show.stdout.splitlines()] == list(range(STEPS))
    assert "loss" in run("summary", path).stdout
    tail = run("tail", path, "-n", "2", "--json")
    assert len(tail.stdout.splitlines()) == 2, tail
    csv = tmp_path / "o.csv"
    assert run("export", path, "--csv", str(csv)).returncode == 0
    assert len(csv.read_text().splitlines()) == 1 + STEPS + 2 * STEPS


def test_validate_finds_a_torn_shard_line_and_names_the_shard(tmp_path, caplog):
    path = str(tmp_path / "run.jsonl")
    _write(path, 0, "sharded", [1.0, 2.0])
    with open(runs.shard_path(path, 1), "wb") as f:
        f.write(b'{"run": "r", "name": "lo')  # killed mid-line
    with logs_warning(caplog, "p00001.jsonl line 1"):
        assert len(pmaptap.read(path)) == 4
    # The same process writing again starts on a new line: only the torn
    # line is lost.
    _write(path, 1, "sharded", [1.0, 2.0])
    with logs_warning(caplog, "1 invalid"):
        recs = pmaptap.read(path)
    assert len(recs) == 6  # replicated deduped across shards: 2 + 4


def test_owner_writes_values_every_process_verified(tmp_path):
    """A replicated record naming several processes (verified on device) is
    written by exactly one of them; a per-process one by each."""
    from pmaptap._host.sinks import DirectorySink
    from pmaptap.tapfile.record import Record, record_key

    path = str(tmp_path / "run.jsonl")
    sinks = [DirectorySink(path, process=p) for p in range(4)]

    def rec(p, step, processes):
        return Record(
            run="r",
            name="loss",
            step=step,
            kind="replicated",
            value=1.0,
            dtype="float32",
            shape=[],
            process=p,
            time=step,
            host="h",
            replicas=4,
            processes=processes,
            vhash="ab",
        )

    for p, s in enumerate(sinks):
        s.write([rec(p, step, (0, 1, 2, 3)) for step in range(40)] + [rec(p, 100, (p,))])
        s.close()
    owners = [s.lines_written - 1 for s in sinks]
    assert sum(owners) == 40 and all(o > 0 for o in owners), owners
    for step in range(40):
        key = record_key(rec(0, step, ()))
        assert runs.owner(key, (0, 1, 2, 3)) in range(4)
    recs = pmaptap.read(path)
    assert sorted(r["step"] for r in recs) == list(range(40)) + [100]


def test_writer_is_jax_free_and_checks_its_arguments(tmp_path):
    code = f"""
import sys
sys.modules["jax"] = None
import numpy as np
import pmaptap
with pmaptap.Writer({str(tmp_path / "a.jsonl")!r}, run="r", process=7,
                    processes=64) as w:
    assert w.layout == "sharded", w
    w.write("x", 0, np.ones(2, np.float16))
    w.write("x", 1, [1, 2.5])
    for bad in (dict(kind="bogus"), dict(device=3)):
        try:
            w.write("x", 2, 1.0, **bad)
        except ValueError as e:
            print("refused:", e)
    try:
        w.write("x", 2, "text")
    except TypeError as e:
        print("refused:", e)
print(len(pmaptap.read({str(tmp_path / "a.jsonl")!r})))
"""
    out = run_python(code, devices=1)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[-1] == "2"
    assert sum(line.startswith("refused: Writer.write('x')") for line in lines) == 3


@pytest.mark.parametrize("layout", ["file", "sharded"])
def test_two_process_job_exact_in_both_layouts(tmp_path, layout):
    out = str(tmp_path / "train.jsonl")
    proc, _ = run_launch(
        2,
        2,
        train_argv(out, "--layout", layout, steps=STEPS),
        launcher_timeout=90,
    )
    assert proc.returncode == 0, job_failed(proc)
    recs = pmaptap.read(out)
    for name in ("loss", "lr", "step"):
        rs = [r for r in recs if r["name"] == name]
        assert sorted(r["step"] for r in rs) == list(range(STEPS)), (name, rs)
        assert not any(r.get("divergent") for r in rs)
    gn = [r for r in recs if r["name"] == "grad_norm"]
    assert sorted((r["step"], r["device"]) for r in gn) == sorted(
        (s, p * 2048 + k) for s in range(STEPS) for p in range(2) for k in range(2)
    )
    assert os.path.isdir(out + ".d") == (layout == "sharded")
    if layout == "sharded":
        # Each process wrote only its own shard; replicated values split
        # between their owners, none written twice.
        per = [pmaptap.read(runs.shard_path(out, p)) for p in range(2)]
        assert sum(r["kind"] == "replicated" for rs in per for r in rs) == 3 * STEPS
    v = subprocess.run(
        [sys.executable, "-m", "pmaptap", "validate", out],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert v.returncode == 0, v.stdout + v.stderr


def test_tail_follow_and_merge_follow_a_live_sharded_run(tmp_path):
    """A process that starts writing after the followers started is picked
    up; replicated values come once; merge -o writes the one-file form."""
    path = str(tmp_path / "run.jsonl")
    _write(path, 0, "sharded", [np.float32(s) for s in range(STEPS)])
    cli = [sys.executable, "-m", "pmaptap"]
    merged = str(tmp_path / "merged.jsonl")
    tail = subprocess.Popen(
        cli
        + [
            "tail",
            path,
            "-f",
            "-n",
            "1",
            "--json",
            "--interval",
            "0.05",
            "--timeout",
            "60",
            "--max-records",
            str(1 + 2 * STEPS),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    follow = subprocess.Popen(
        cli + ["merge", path, "-o", merged, "-f", "--interval", "0.05", "--timeout", "60"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )

    def merged_lines() -> int:
        if not os.path.exists(merged):
            return 0
        with open(merged, "rb") as f:
            return sum(1 for line in f if line.endswith(b"\n"))

    try:
        # Both have read process 0's shard (seen in their output, not hoped
        # for after a sleep: tail printed the last record, merge -f wrote
        # every one); now two more processes appear and write (their
        # replicated values equal process 0's: not shown again).
        first = json.loads(tail.stdout.readline())
        assert (first["name"], first["process"], first["step"]) == ("acts", 0, STEPS - 1)
        wait_for(lambda: merged_lines() >= 2 * STEPS, 60, "merge -f to read process 0's shard")
        _write(path, 1, "sharded", [np.float32(s) for s in range(STEPS)])
        _write(path, 2, "sharded", [np.float32(s) for s in range(STEPS)])
        out, err = tail.communicate(timeout=90)
        got = [json.loads(line) for line in out.splitlines()]
        # After the initial record, only new records: processes 1 and 2's
        # per-device ones, and no replicated duplicate of process 0's values
        assert sorted((r["name"], r["process"]) for r in got) == sorted(
            [("acts", 1)] * STEPS + [("acts", 2)] * STEPS
        ), (got, err)
        import signal

        # merge -f has written every record (seen in its output, not hoped
        # for after a sleep) before it is stopped.
        wait_for(lambda: merged_lines() >= 4 * STEPS, 60, "merge -f to write every record")
        follow.send_signal(signal.SIGTERM)
        follow.communicate(timeout=60)
    finally:
        for p in (tail, follow):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert follow.returncode == 0
    want = pmaptap.read(path)
    assert len(want) == STEPS + 3 * STEPS
    assert sorted(map(json.dumps, pmaptap.read(merged))) == sorted(map(json.dumps, want))
    # merge without -f: the same records, in the merged (time) order
    once = str(tmp_path / "once.jsonl")
    m = subprocess.run(
        cli + ["merge", path, "-o", once], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert m.returncode == 0 and f"wrote {len(want)} records" in m.stderr, m
    assert pmaptap.read(once) == want
    # refusing to overwrite a file of the run itself
    with open(path, "w"):
        pass
    bad = subprocess.run(
        cli + ["merge", path + ".d", "-o", path],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert bad.returncode == 2 and "one of the files of run" in bad.stderr, bad


def test_auto_layout_shards_above_the_process_count(tmp_path, monkeypatch):
    import jax
    import jax.numpy as jnp

    path = str(tmp_path / "auto.jsonl")
    with pmaptap.Session(path, run="a") as s:  # 1 process: one file
        jax.jit(lambda x: pmaptap.tap(x, "x", step=0))(jnp.float32(1))
    assert s.layout == "file" and not os.path.exists(path + ".d")
    monkeypatch.setattr(runs, "SHARDED_ABOVE", 0)
    # Run "a" again: continued (resume), as reopening it plainly is refused.
    with pmaptap.Session(path, run="a", resume=True) as s:
        jax.jit(lambda x: pmaptap.tap(x, "x", step=1))(jnp.float32(2))
    assert s.layout == "sharded" and os.path.isfile(runs.shard_path(path, 0))
    # the reader merges the one file and the shard
    assert [(r["step"], r["value"]) for r in pmaptap.read(path, name="x")] == [(0, 1.0), (1, 2.0)]
    with pytest.raises(ValueError, match="layout must be one of"):
        pmaptap.Session(path, layout="many")


def test_session_and_writer_resolve_their_path_and_layout_alike(tmp_path):
    # One function (pmaptap._host.sinks.write_target) for both: the same
    # refusal of a layout, and an object-store URL always in the sharded
    # layout, gathering a batch at least OBJECT_COMMIT_INTERVAL.
    from pmaptap._host.sinks import objectstore

    path = str(tmp_path / "run.jsonl")
    for make in (
        lambda **k: pmaptap.Session(path, **k),
        lambda **k: pmaptap.Writer(path, run="r", process=0, **k),
    ):
        with pytest.raises(
            ValueError, match=r"layout must be one of \('auto', 'file', 'sharded'\)"
        ):
            make(layout="many")
    url = "memory://pmaptap-test/side/run"
    s = pmaptap.Session(url, layout="file", flush_interval=0.01)
    w = pmaptap.Writer(url, run="r", process=0, layout="file", flush_interval=0.01)
    w.close()
    interval = objectstore.OBJECT_COMMIT_INTERVAL
    assert (s.path, s.layout, s._opts["flush_interval"]) == (url, "sharded", interval)
    assert (w.path, w.layout, w.flush_interval) == (url, "sharded", interval)


@pytest.mark.parametrize("follow", [False, True])
def test_tensorboard_export_of_a_sharded_run(tmp_path, follow):
    pytest.importorskip("tensorboardX")
    path = str(tmp_path / "run.jsonl")
    for p in range(2):
        _write(path, p, "sharded", [np.float32(s) for s in range(STEPS)])
    args = [
        sys.executable,
        "-m",
        "pmaptap",
        "export",
        path,
        "--tensorboard",
        str(tmp_path / "tb"),
    ] + (["-f", "--timeout", "2", "--interval", "0.1"] if follow else [])
    out = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    # every record once: the replicated loss once per step, 2 x STEPS acts
    assert f"wrote {STEPS + 2 * STEPS} records" in out.stderr, out.stderr


def test_a_shard_removed_or_truncated_under_its_writer(tmp_path, caplog):
    from pmaptap._host.sinks import DirectorySink

    path = str(tmp_path / "run.jsonl")
    sink = DirectorySink(path, process=3)
    rec = shard_record
    sink.write([rec(0)])
    os.remove(sink.path)
    with logs_warning(caplog, "replaced or removed"):
        sink.write([rec(1)])
    with open(sink.path, "r+") as f:
        f.truncate(0)
    sink.write([rec(2)])
    sink.close()
    assert sink.replacements == 1
    # step 1 went to the recreated shard, then the truncation took it (as
    # asked); step 2 was appended at the new end, not at a stale offset
    assert [r["step"] for r in pmaptap.read(path)] == [2]
    with open(sink.path, "rb") as f:
        assert f.read().count(b"\n") == 1


def test_resume_and_forwarding_in_the_sharded_layout(tmp_path):
    """Session(resume=True) finds the run and its last attempt in the shards;
    forwarders get what the shard sink wrote."""
    import jax
    import jax.numpy as jnp

    path = str(tmp_path / "run.jsonl")
    f = jax.pmap(
        lambda x, i: pmaptap.tap(x + i, "w", step=i, dedup="per_device"),
        axis_name="d",
        devices=jax.devices()[:2],
        in_axes=(0, None),
    )
    got: list[dict] = []
    with pmaptap.Session(path, run="r", layout="sharded", forward=[got.append]):
        for i in range(4):
            f(jnp.arange(2.0), i)
    assert sorted((r["step"], r["device"]) for r in got) == [
        (i, d) for i in range(4) for d in range(2)
    ]
    with pmaptap.Session(path, layout="sharded", resume=True) as s:
        for i in range(2, 6):
            f(jnp.arange(2.0) + 100, i)
    assert (s.run, s.attempt) == ("r", 1)
    w = [r for r in pmaptap.read(path) if r["name"] == "w"]
    assert sorted((r["step"], r["device"], r.get("attempt", 0)) for r in w) == [
        (i, d, int(i >= 2)) for i in range(6) for d in range(2)
    ]


def _owned_by(process: int, steps: range) -> list[Record]:
    """Replicated records of "loss" that processes 0 and 1 verified on
    device (so one of them owns each), of the steps ``process`` owns."""
    out = []
    for step in steps:
        r = Record(**replicated_dict(step, float(step), processes=(0, 1), run="r"))
        if runs.owner(record_key(r), (0, 1)) == process:
            out.append(r)
    return out


def test_values_left_to_an_owner_are_kept_bounded_and_written_for_it(tmp_path, monkeypatch):
    """DirectorySink keeps what it leaves to another owner (Held): written
    only when asked for that owner (its close was not seen), the oldest
    let go past the bound and counted."""
    path = str(tmp_path / "run.jsonl")
    theirs = _owned_by(1, range(40))
    mine_ = _owned_by(0, range(40))
    sink = DirectorySink(path, process=0)
    sink.write(theirs[:5] + mine_[:5])
    assert sink.skipped == 5 and len(sink.held) == 5
    sink.close()
    assert sink.write_held([2]) == 0  # nothing left to process 2
    assert [r["step"] for r in pmaptap.read(path)] == [r.step for r in mine_[:5]]
    assert sink.write_held([1]) == 5  # after close: opened again, and closed
    assert sink._fd == -1
    steps = sorted(r["step"] for r in pmaptap.read(path))
    assert steps == sorted(r.step for r in theirs[:5] + mine_[:5])
    assert sink.write_held(None) == 0  # each written once

    # The bound: the oldest go first, counted for their owner.
    small = DirectorySink(str(tmp_path / "small.jsonl"), process=0)
    size = _held_size(theirs[0])
    small.held.limit = 3 * size
    small.write(theirs[:5])
    assert len(small.held) == 3 and small.held.released == {1: 2}
    assert [r.step for r in small.held.take([1])] == [r.step for r in theirs[2:5]]
    small.close()
