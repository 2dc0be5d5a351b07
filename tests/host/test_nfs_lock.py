"""Session(path, lock="soft"): the mode for NFS and other shared filesystems
where flock may not exclude across hosts. Real processes on a local disk:
these check the protocol (marker lock, fresh descriptor and size per batch,
independence from flock), not NFS itself. The multi-process training job
with --lock soft is in test_multihost.py."""

from __future__ import annotations

import json
import os
import threading
import time

import jax
import jax.numpy as jnp
import pytest

import pmaptap
from conftest import APPENDER, run_python, run_released, start_python


def test_soft_lock_many_processes_append_exactly(tmp_path):
    tap, go = str(tmp_path / "t.jsonl"), str(tmp_path / "go")
    run_released(APPENDER, 3, timeout=120, TAP=tap, GO=go, LOCK="soft", N="300")
    with open(tap, "rb") as f:
        raw = f.read()
    lines = raw.split(b"\n")
    assert lines[-1] == b"" and len(lines) - 1 == 900
    recs = [json.loads(line) for line in lines[:-1]]  # no torn/overlapped line
    for w in range(3):
        steps = sorted(r["step"] for r in recs if r["name"] == f"w{w}")
        assert steps == list(range(300))
    assert not os.path.exists(tap + ".softlock")  # released, not leaked


def test_soft_lock_waits_for_the_marker_and_not_for_flock(tmp_path):
    tap = str(tmp_path / "t.jsonl")
    # Another process holds both the soft marker and the flock; it lets the
    # marker go first, when the test says (not after a fixed time: a compile
    # slowed by a loaded machine outlasted it, so the marker was gone before
    # the test looked). Soft mode must wait exactly for the marker.
    holder = start_python(
        """
        import filelock, os, sys
        tap = os.environ["TAP"]
        hard = filelock.FileLock(tap + ".lock"); hard.acquire()
        soft = filelock.SoftFileLock(tap + ".softlock"); soft.acquire()
        print("locked", flush=True)
        sys.stdin.readline(); soft.release()
        print("soft released", flush=True)
        sys.stdin.readline()               # keeps the flock; killed below
    """,
        stdin=True,
        TAP=tap,
    )
    released: list[float] = []

    def release_marker() -> None:
        time.sleep(0.5)  # flush() below is waiting by now
        released.append(time.monotonic())
        holder.stdin.write("\n")
        holder.stdin.flush()

    try:
        assert holder.stdout.readline().strip() == "locked", holder.stderr.read()
        with pmaptap.Session(tap, run="soft", lock="soft", lock_timeout=0.2, flush_timeout=30) as s:
            jax.jit(lambda v: pmaptap.tap(v, "x"))(jnp.float32(1))
            jax.effects_barrier()
            time.sleep(0.3)  # the writer tries (and fails) to take the marker
            assert os.path.getsize(tap) == 0  # marker still held
            releaser = threading.Thread(target=release_marker)
            releaser.start()
            s.flush()  # waits for the marker
            flushed = time.monotonic()
            releaser.join()
            assert holder.stdout.readline().strip() == "soft released"
        # Written while the flock was still held: soft mode ignores flock.
        assert holder.poll() is None
        assert released and flushed > released[0], "flush() did not wait for the marker"
        assert [r["name"] for r in pmaptap.read(tap)] == ["x"]
    finally:
        holder.kill()
        holder.wait()


def test_soft_lock_reclaims_the_marker_of_a_dead_local_process(tmp_path):
    tap = str(tmp_path / "t.jsonl")
    dead = run_python(
        """
        import filelock, os, signal
        lock = filelock.SoftFileLock(os.environ["TAP"] + ".softlock")
        lock.acquire()                # (kept referenced: no release on GC)
        os.kill(os.getpid(), signal.SIGKILL)      # dies holding the marker
    """,
        check=False,
        TAP=tap,
    )
    assert dead.returncode == -9
    assert os.path.exists(tap + ".softlock")
    with pmaptap.Session(tap, run="soft", lock="soft", flush_timeout=20) as s:
        jax.jit(lambda v: pmaptap.tap(v, "x"))(jnp.float32(2))
        s.flush()
    assert [r["value"] for r in pmaptap.read(tap)] == [2.0]


def test_filesystem_without_flock_is_reported_with_the_fix():
    # fcntl.flock failing with ENOSYS is what Lustre without -o flock and
    # some FUSE filesystems do. pmaptap must say "use lock='soft'", not wait
    # forever on filelock's silent soft fallback.
    proc = run_python(
        """
        import errno, fcntl, os, tempfile, warnings
        def no_flock(fd, op):
            raise OSError(errno.ENOSYS, "Function not implemented")
        fcntl.flock = no_flock
        import jax, jax.numpy as jnp, pmaptap
        warnings.simplefilter("ignore")
        path = os.path.join(tempfile.mkdtemp(), "t.jsonl")
        s = pmaptap.Session(path, run="x", close_timeout=2).open()
        jax.jit(lambda v: pmaptap.tap(v, "x"))(jnp.float32(1))
        try:
            s.flush(timeout=10)
            print("NO ERROR")
        except pmaptap.TapError as e:
            print("TAPERROR", e)
        try:
            s.close()
        except pmaptap.TapError:
            pass
    """,
        devices=1,
    )
    assert "TAPERROR" in proc.stdout, proc.stdout + proc.stderr
    assert "does not support flock" in proc.stdout
    assert "lock='soft'" in proc.stdout


def test_unknown_lock_mode_is_refused():
    with pytest.raises(ValueError, match="soft"):
        pmaptap.Session("x.jsonl", lock="nfs")
