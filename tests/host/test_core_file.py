"""The shared file: locking, many writers, torn-tail repair, stuck locks,
write errors reported at flush."""

from __future__ import annotations

import json
import os
import time

import filelock
import jax
import jax.numpy as jnp
import pytest

import pmaptap
from conftest import APPENDER, ROOT, logs_warning, run_python, run_released, start_python


def test_four_processes_append_1500_records_each(tmp_path):
    tap, go = str(tmp_path / "t.jsonl"), str(tmp_path / "go")
    run_released(APPENDER, 4, timeout=240, TAP=tap, GO=go, LOCK="flock", N="1500")
    with open(tap, "rb") as f:
        raw = f.read()
    assert raw.endswith(b"\n")
    lines = raw.split(b"\n")[:-1]
    assert len(lines) == 6000
    recs = [json.loads(l) for l in lines]  # every line whole and valid
    for w in range(4):
        steps = sorted(r["step"] for r in recs if r["name"] == f"w{w}")
        assert steps == list(range(1500))
        vals = {r["step"]: r["value"] for r in recs if r["name"] == f"w{w}"}
        assert all(vals[s] == [s + 0.0, s + 1.0, s + 2.0, s + 3.0] for s in (0, 777, 1499))


def test_torn_tail_is_repaired_by_the_next_writer(tap_path, tmp_path, caplog):
    os.makedirs(os.path.dirname(tap_path))
    with open(tap_path, "w") as f:
        f.write('{"run": "old", "name": "x", "st')  # killed mid-line
    with pmaptap.Session(tap_path, run="new"):
        jax.jit(lambda v: pmaptap.tap(v, "after"))(jnp.float32(2))
    with open(tap_path) as f:
        lines = f.read().split("\n")
    assert lines[0] == '{"run": "old", "name": "x", "st'
    assert json.loads(lines[1])["name"] == "after"
    with logs_warning(caplog, "line 1"):
        recs = pmaptap.read(tap_path)
    assert [r["name"] for r in recs] == ["after"]


def test_stuck_lock_does_not_stall_taps_and_records_follow(tap_path):
    # The holder lets go when the test says (or after HOLD seconds, so taps
    # that stalled behind the lock fail the loop's bound instead of hanging),
    # not after a fixed time: a loaded machine's compile plus loop outlasted
    # that, and the file was written before the test looked.
    holder = start_python(
        """
        import os, select, sys, filelock
        lock = filelock.FileLock(os.environ["TAP"] + ".lock")
        lock.acquire()
        print("locked", flush=True)
        select.select([sys.stdin], [], [], float(os.environ["HOLD"]))
        lock.release()
    """,
        stdin=True,
        TAP=tap_path,
        HOLD="60",
    )
    try:
        os.makedirs(os.path.dirname(tap_path), exist_ok=True)
        assert holder.stdout.readline().strip() == "locked"
        with pmaptap.Session(tap_path, lock_timeout=0.2, flush_timeout=30) as s:
            f = jax.jit(lambda v: pmaptap.tap(v, "x") + 1)
            f(jnp.float32(0)).block_until_ready()
            t0 = time.monotonic()
            for i in range(200):
                f(jnp.float32(i)).block_until_ready()
            loop = time.monotonic() - t0
            assert loop < 3.0, f"taps stalled behind the lock ({loop:.1f}s)"
            assert os.path.getsize(tap_path) == 0  # still locked out
            holder.stdin.write("\n")
            holder.stdin.flush()
            s.flush()  # waits for the holder
        assert holder.wait(30) == 0
    finally:
        if holder.poll() is None:
            holder.kill()
    recs = pmaptap.read(tap_path)
    assert [r["step"] for r in recs] == list(range(201))


def test_write_errors_surface_at_flush_as_taperror(tmp_path):
    # RLIMIT_FSIZE makes writes past 4 KiB fail with EFBIG (SIGXFSZ ignored),
    # like a full disk: training must go on and the error surface at flush.
    proc = run_python(
        """
        import os, resource, signal, warnings, jax, jax.numpy as jnp, pmaptap
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        s = pmaptap.Session(os.environ["TAP"], run="full", close_timeout=1).open()
        f = jax.jit(lambda v: pmaptap.tap(v, "big") * 2)
        out = [float(f(jnp.ones(64) * i)[0]) for i in range(50)]
        assert out == [2.0 * i for i in range(50)], out      # training unaffected
        warnings.simplefilter("ignore")
        try:
            s.flush(timeout=5)
        except pmaptap.TapError as e:
            print("TAPERROR", e.path, "|", e)
        try:
            s.close()
        except pmaptap.TapError as e:
            print("CLOSEERROR", e, flush=True)
        os._exit(0)   # XLA's own exit handlers trip over RLIMIT_FSIZE
    """,
        devices=1,
        TAP=str(tmp_path / "t.jsonl"),
    )
    assert "TAPERROR" in proc.stdout and "File too large" in proc.stdout
    assert "CLOSEERROR" in proc.stdout and "not written" in proc.stdout
    assert str(tmp_path / "t.jsonl") in proc.stdout
    # A failed write is cut back: the file holds only whole, valid lines.
    with open(tmp_path / "t.jsonl", "rb") as f:
        raw = f.read()
    assert raw.endswith(b"\n") and 0 < len(raw) <= 4096
    assert all(json.loads(line) for line in raw.splitlines())


def test_overflow_drop_newest_counts_and_reports_drops(tap_path, caplog):
    with logs_warning(caplog, "dropped"):
        with pmaptap.Session(
            tap_path, overflow="drop_newest", max_pending=5, lock_timeout=0.05
        ) as s:
            lock = filelock.FileLock(tap_path + ".lock")
            lock.acquire()
            try:
                f = jax.jit(lambda v: pmaptap.tap(v, "x"))
                for i in range(40):
                    f(jnp.float32(i))
                jax.effects_barrier()
                time.sleep(0.3)
            finally:
                lock.release()
            s.flush()
    recs = pmaptap.read(tap_path)
    data = [r for r in recs if r["name"] == "x"]
    meta = [r for r in recs if r["name"] == "pmaptap/dropped"]
    assert len(meta) == 1 and meta[0]["kind"] == "meta"
    assert len(data) + meta[0]["dropped_total"] == 40
    assert [r["step"] for r in data] == list(range(len(data)))  # the oldest kept


def test_overflow_drops_are_warned_and_recorded_not_raised(tap_path, caplog):
    # Dropping is the overflow policy doing what it was chosen for (the
    # default, drop_oldest, keeps training from blocking), not a failure:
    # close() returns, the drops are a warning and a pmaptap/dropped record,
    # and docs/api.md's errors table says so (it promised a TapError).
    s = pmaptap.Session(tap_path, max_pending=5, lock_timeout=0.05).open()
    with logs_warning(caplog, "dropped"):
        lock = filelock.FileLock(tap_path + ".lock")
        lock.acquire()
        try:
            f = jax.jit(lambda v: pmaptap.tap(v, "x"))
            for i in range(40):
                f(jnp.float32(i))
            jax.effects_barrier()
            time.sleep(0.3)
        finally:
            lock.release()
        s.close()  # no TapError
    recs = pmaptap.read(tap_path)
    (meta,) = [r for r in recs if r["name"] == "pmaptap/dropped"]
    assert meta["policy"] == "drop_oldest" and meta["dropped_total"] > 0
    assert len([r for r in recs if r["name"] == "x"]) + meta["dropped_total"] == 40
    api = open(os.path.join(ROOT, "docs", "api.md"), encoding="utf-8").read()
    (row,) = [ln for ln in api.splitlines() if ln.startswith("| `TapError` |")]
    assert "dropped" not in row
    assert "overflow policy's drops are not an error" in api


@pytest.mark.parametrize("lock", ["flock", "soft"])
def test_batches_larger_than_one_writev_and_short_writes_stay_whole(tmp_path, monkeypatch, lock):
    # One batch is one writev(2) of its lines: more lines than one call
    # takes (1024), and a kernel that writes only part of what it is given,
    # must still leave every line whole, in order, exactly once.
    from pmaptap._host.sinks import FileSink
    from pmaptap.tapfile.record.format import Record

    calls = []

    def short(real):
        def call(fd, buffers, *offset):
            calls.append(len(buffers))
            data = b"".join(buffers)[:777]  # at most 777 bytes a call
            return real(fd, [data], *offset)

        return call

    monkeypatch.setattr(os, "writev", short(os.writev))
    monkeypatch.setattr(os, "pwritev", short(os.pwritev))
    path = str(tmp_path / "w.jsonl")
    sink = FileSink(path, lock=lock, process=0)
    recs = [
        Record(
            run="r",
            name="n",
            step=i,
            kind="meta",
            value=list(range(i % 7)),
            dtype="int64",
            shape=[i % 7],
            process=0,
            time=0.0,
            host="h",
        )
        for i in range(2500)
    ]
    sink.write(recs)
    sink.write(recs[:3])
    sink.close()
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    assert lines[-1] == b""
    steps = [json.loads(line)["step"] for line in lines[:-1]]
    assert steps == list(range(2500)) + [0, 1, 2]
    # one writev per batch, never more buffers than the kernel takes
    assert len(calls) == 2 and calls[0] <= 1024 and calls[1] == 3


@pytest.mark.parametrize("closed", ["by close()", "at exit"])
def test_the_file_lock_is_released_with_the_session_not_at_interpreter_teardown(tmp_path, closed):
    # filelock 4.0.x's finalizer, run at interpreter teardown, reads module
    # globals already cleared and prints "Exception ignored in ... __del__"
    # after every run whose session lived in a global. The sink drops its
    # lock object when it closes, so no lock is finalized that late.
    path = tmp_path / "t.jsonl"
    proc = run_python(
        f"""
        import os, sys
        import filelock
        import jax.numpy as jnp
        import pmaptap

        def spy(self, _fin=sys.is_finalizing, _write=os.write, _orig=filelock.FileLock.__del__):
            if _fin():
                _write(2, b"LOCK FINALIZED AT TEARDOWN\\n")
            _orig(self)

        filelock.FileLock.__del__ = spy
        session = pmaptap.Session({str(path)!r}).open()

        @pmaptap.jit
        def f(x, s):
            pmaptap.tap(x.sum(), "x", step=s)
            return x * 2

        f(jnp.ones(3), 0)
        if {closed == "by close()"}:
            session.close()
        """,
        devices=1,
    )
    assert "LOCK FINALIZED AT TEARDOWN" not in proc.stderr, proc.stderr
    assert "Exception ignored" not in proc.stderr, proc.stderr
    assert [(r["name"], r["value"]) for r in pmaptap.read(str(path))] == [("x", 3.0)]
