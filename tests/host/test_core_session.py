"""Session lifecycle: open/close, paths, exit paths, console fallback."""

from __future__ import annotations

import json
import os
import signal
import stat

import jax
import jax.numpy as jnp
import pytest

import pmaptap
from conftest import run_python, start_python, wait_for


def test_second_open_names_the_open_session(tap_path, tmp_path):
    with pmaptap.Session(tap_path, run="first"):
        with pytest.raises(pmaptap.SessionError, match=r"run='first'"):
            pmaptap.Session(tmp_path / "other.jsonl").open()
    # closed: a new one opens fine
    with pmaptap.Session(tmp_path / "other.jsonl"):
        assert pmaptap.active_session() is not None
    assert pmaptap.active_session() is None


def test_file_is_appended_never_truncated(tap_path):
    os.makedirs(os.path.dirname(tap_path))
    with open(tap_path, "w") as f:
        f.write('{"keep": "me"}\n')
    with pmaptap.Session(tap_path, run="a"):
        jax.jit(lambda v: pmaptap.tap(v, "x"))(jnp.float32(1))
    with open(tap_path) as f:
        lines = f.read().splitlines()
    assert lines[0] == '{"keep": "me"}' and len(lines) == 2


def test_parents_created_and_path_problems_raise_at_open(tmp_path):
    deep = tmp_path / "a" / "b" / "c.jsonl"
    with pmaptap.Session(deep):
        pass
    assert deep.exists()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(pmaptap.TapError, match="parent component is a file"):
        pmaptap.Session(blocker / "t.jsonl").open()
    with pytest.raises(pmaptap.TapError, match="is a directory"):
        pmaptap.Session(tmp_path).open()
    if os.geteuid() != 0:  # root ignores directory permissions
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
        with pytest.raises(pmaptap.TapError, match="not writable"):
            pmaptap.Session(ro / "t.jsonl").open()
    assert pmaptap.active_session() is None


def test_flush_after_close_and_close_twice(tap_path):
    s = pmaptap.Session(tap_path).open()
    s.close()
    s.close()
    with pytest.raises(pmaptap.SessionError, match="open it first"):
        s.flush()


def test_no_session_prints_readable_lines_to_stderr():
    proc = run_python(
        """
        import jax, jax.numpy as jnp, pmaptap
        f = jax.pmap(lambda v: pmaptap.tap(v * 0.25, "loss", step=3, dedup="per_device"),
                     axis_name="dp")
        f(jnp.arange(4.0))
        jax.pmap(lambda v: pmaptap.tap(jax.lax.pmean(v, "i"), "avg"), axis_name="i")(jnp.ones(4))
        pmaptap.flush()
    """,
        devices=4,
    )
    lines = sorted(l for l in proc.stderr.splitlines() if l.startswith("[pmaptap]"))
    assert "[pmaptap] loss step=3 process=0 device=2 dp=2: 0.5" in lines
    assert "[pmaptap] avg step=0 process=0 replicas=4: 1.0" in lines


def test_no_session_output_is_not_lost_at_exit_without_flush():
    proc = run_python(
        """
        import jax, jax.numpy as jnp, pmaptap
        f = jax.jit(lambda v: pmaptap.tap(v, "late"))
        for i in range(5):
            f(jnp.float32(i))
    """,
        devices=1,
    )
    lines = [l for l in proc.stderr.splitlines() if l.startswith("[pmaptap] late")]
    assert lines == [f"[pmaptap] late step={i} process=0 replicas=1: {float(i)}" for i in range(5)]


_WRITER = """
    import os, sys, time, jax, jax.numpy as jnp, pmaptap
    s = pmaptap.Session(os.environ["TAP"], run="exit")
    s.open()
    f = jax.pmap(lambda v: pmaptap.tap(v, "x", dedup="per_device"))
    for i in range(20):
        f(jnp.arange(8.0) + i)
    MODE = os.environ["MODE"]
    if MODE == "exception":
        with s:
            raise RuntimeError("boom")
    elif MODE == "atexit":
        pass                      # interpreter exit with the session open
    elif MODE == "unhandled":
        raise RuntimeError("unhandled")
    elif MODE == "sigterm":
        print("ready", flush=True)
        while True:
            f(jnp.arange(8.0))
            time.sleep(0.01)
"""


@pytest.mark.parametrize("mode", ["exception", "atexit", "unhandled"])
def test_everything_dispatched_is_written_on_exit_paths(tmp_path, mode):
    tap = str(tmp_path / "t.jsonl")
    proc = run_python(_WRITER, check=False, TAP=tap, MODE=mode)
    assert proc.returncode == (0 if mode == "atexit" else 1), proc.stderr
    recs = pmaptap.read(tap)
    assert len(recs) == 160, proc.stderr
    assert sorted({r["step"] for r in recs}) == list(range(20))


def _highest_step_written(path: str) -> int:
    """The highest step among the whole lines of a file being written (-1
    if none yet)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return -1
    steps = [-1]
    for line in data.split(b"\n")[:-1]:  # the last piece may be half a line
        try:
            steps.append(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return max(steps)


def test_sigterm_writes_everything_then_dies_by_the_signal(tmp_path):
    tap = str(tmp_path / "t.jsonl")
    p = start_python(_WRITER, TAP=tap, MODE="sigterm")
    try:
        assert p.stdout.readline().strip() == "ready"
        # The signal comes while the loop taps: its records (steps 20 on)
        # are reaching the file.
        wait_for(lambda: _highest_step_written(tap) >= 20, 120, "the loop's records in the file")
        p.send_signal(signal.SIGTERM)
        p.wait(60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == -signal.SIGTERM
    recs = pmaptap.read(tap)
    steps = {}
    for r in recs:
        steps.setdefault(r["step"], set()).add(r["device"])
    # every step that reached the file is complete: nothing dispatched was lost
    assert len(steps) >= 20
    assert all(devs == set(range(8)) for devs in steps.values())


def test_sigterm_during_close_lets_the_drain_finish_then_dies(tmp_path):
    tap = str(tmp_path / "t.jsonl")
    release = str(tmp_path / "release")
    holder = start_python(
        """
        import os, time, filelock
        lock = filelock.FileLock(os.environ["TAP"] + ".lock"); lock.acquire()
        print("locked", flush=True)
        while not os.path.exists(os.environ["RELEASE"]):
            time.sleep(0.01)
        lock.release()
    """,
        TAP=tap,
        RELEASE=release,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        child = start_python(
            """
            import os, sys, threading, time, jax, jax.numpy as jnp, pmaptap
            s = pmaptap.Session(os.environ["TAP"], run="t", lock_timeout=0.1).open()
            f = jax.jit(lambda v: pmaptap.tap(v, "x"))
            for i in range(30):
                f(jnp.float32(i))

            def draining():
                # The main thread's stack (module, function; co_qualname is
                # 3.11+): Session.close -> Pipeline.close, the drain.
                frame = sys._current_frames().get(threading.main_thread().ident)
                names = set()
                while frame is not None:
                    code = frame.f_code
                    names.add((os.path.basename(code.co_filename), code.co_name))
                    frame = frame.f_back
                return {("session.py", "close"), ("pipeline.py", "close")} <= names

            def report():
                while not draining():
                    time.sleep(0.01)
                print("draining", flush=True)
                while not s._sigterm_pending:  # the handler ran and deferred
                    time.sleep(0.01)
                if draining():
                    print("deferred, still draining", flush=True)

            threading.Thread(target=report, daemon=True).start()
            print("closing", flush=True)
            s.close()                      # blocked on the lock: drain in progress
            print("not reached", flush=True)
        """,
            TAP=tap,
        )
        try:
            assert child.stdout.readline().strip() == "closing"
            # Observably inside close(), waiting for the lock (not just about
            # to call it: SIGTERM before close() would take another path).
            assert child.stdout.readline().strip() == "draining", child.stderr.read()
            child.send_signal(signal.SIGTERM)
            assert child.stdout.readline().strip() == "deferred, still draining"
            assert child.poll() is None, "SIGTERM must not abandon the drain"
            open(release, "w").close()
            child.wait(60)
        finally:
            if child.poll() is None:
                child.kill()
        assert child.returncode == -signal.SIGTERM, child.stderr.read()
        assert "not reached" not in child.stdout.read()
    finally:
        if holder.poll() is None:
            holder.kill()
    assert [r["step"] for r in pmaptap.read(tap)] == list(range(30))
