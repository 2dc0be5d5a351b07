"""pmaptap's own messages go through logging ("pmaptap", "pmaptap.console"):
visible with nothing configured, and only where the application sends them
once it configures logging (basicConfig, absl)."""

from __future__ import annotations

import logging
import time

import filelock
import jax
import jax.numpy as jnp

import pmaptap
from conftest import logs_warning, run_python
from pmaptap._host.pipeline import loops

_BAD_FILE_AND_CONSOLE = """
    import os, jax, jax.numpy as jnp, pmaptap
    {setup}
    path = os.environ["TAP"]
    with open(path, "w") as f:
        f.write("not json\\n")
    pmaptap.read(path)                               # a warning
    jax.jit(lambda v: pmaptap.tap(v, "free", step=3))(jnp.float32(1.5))
    pmaptap.flush()                                  # a console record
"""


def test_console_records_and_warnings_reach_caplog(tmp_path, caplog):
    path = tmp_path / "bad.jsonl"
    path.write_text("not json\n")
    with caplog.at_level(logging.INFO, logger="pmaptap"):
        pmaptap.read(path)
        jax.jit(lambda v: pmaptap.tap(v, "free", step=3))(jnp.float32(1.5))
        pmaptap.flush()
    got = [
        (r.name, r.levelname, r.getMessage())
        for r in caplog.records
        if r.name.startswith("pmaptap")
    ]
    assert ("pmaptap.console", "INFO", "[pmaptap] free step=3 process=0 replicas=1: 1.5") in got
    assert [m for n, lvl, m in got if lvl == "WARNING"][0].startswith(
        f"pmaptap.read({str(path)!r}) skipped 1 invalid line(s): line 1:"
    )


def test_nothing_configured_prints_each_message_once_on_stderr(tmp_path):
    proc = run_python(
        _BAD_FILE_AND_CONSOLE.format(setup=""), devices=1, TAP=str(tmp_path / "t.jsonl")
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines.count("[pmaptap] free step=3 process=0 replicas=1: 1.5") == 1
    warned = [l for l in lines if "skipped 1 invalid line(s)" in l]
    assert len(warned) == 1 and warned[0].startswith("pmaptap.read("), lines


def test_configured_logging_gets_the_messages_and_the_fallback_stays_quiet(tmp_path):
    setup = 'import logging; logging.basicConfig(format="LOG %(name)s %(levelname)s %(message)s")'
    proc = run_python(
        _BAD_FILE_AND_CONSOLE.format(setup=setup), devices=1, TAP=str(tmp_path / "t.jsonl")
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    # Console records are INFO on pmaptap.console, shown although the root
    # logger stays at WARNING; each message once, in the application's format.
    assert (
        lines.count("LOG pmaptap.console INFO [pmaptap] free step=3 process=0 replicas=1: 1.5") == 1
    )
    warned = [l for l in lines if "skipped 1 invalid" in l]
    assert len(warned) == 1 and warned[0].startswith("LOG pmaptap WARNING "), lines
    assert not [l for l in lines if l.startswith("[pmaptap]")], lines


def test_absl_logging_picks_the_messages_up(tmp_path):
    # What absl.app.run() does before main().
    setup = "from absl import logging as absl_logging; absl_logging.use_absl_handler()"
    proc = run_python(
        _BAD_FILE_AND_CONSOLE.format(setup=setup), devices=1, TAP=str(tmp_path / "t.jsonl")
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    warned = [l for l in lines if "skipped 1 invalid" in l]
    # absl's format: "W<mmdd> <time> <thread> <file>:<line>] message", once.
    assert len(warned) == 1 and warned[0].startswith("W") and "] pmaptap.read(" in warned[0], lines
    console = [l for l in lines if "free step=3" in l]
    assert len(console) == 1 and console[0].startswith("I"), lines


def test_a_long_lock_wait_is_logged_and_so_is_its_end(tap_path, caplog, monkeypatch):
    monkeypatch.setattr(loops, "LOCK_WAIT_WARN_S", 0.3)
    with caplog.at_level(logging.WARNING, logger="pmaptap"):
        with pmaptap.Session(tap_path, run="t", lock_timeout=0.05) as s:
            lock = filelock.FileLock(tap_path + ".lock")
            lock.acquire()
            try:
                jax.jit(lambda v: pmaptap.tap(v, "x"))(jnp.float32(1))
                deadline = time.monotonic() + 20
                while "waiting" not in caplog.text and time.monotonic() < deadline:
                    time.sleep(0.05)
            finally:
                lock.release()
            s.flush()
    msgs = [r.getMessage() for r in caplog.records if r.name == "pmaptap"]
    waits = [m for m in msgs if m.startswith("pmaptap: waiting")]
    assert len(waits) == 1 and tap_path in waits[0], msgs
    assert any(m.startswith("pmaptap: got the lock") for m in msgs), msgs
    assert [r["name"] for r in pmaptap.read(tap_path)] == ["x"]


def test_drop_warning_is_logged_once_per_report(tap_path, caplog):
    with logs_warning(caplog, r"dropped \d+ tap event", count=1):
        with pmaptap.Session(tap_path, overflow="drop_newest", max_pending=3, lock_timeout=0.05):
            lock = filelock.FileLock(tap_path + ".lock")
            lock.acquire()
            try:
                f = jax.jit(lambda v: pmaptap.tap(v, "x"))
                for i in range(20):
                    f(jnp.float32(i))
                jax.effects_barrier()
                time.sleep(0.3)
            finally:
                lock.release()
