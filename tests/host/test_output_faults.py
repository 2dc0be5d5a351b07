"""The host side of pmaptap.jit / pmaptap.pmap never loses records without
saying so and never hangs (issue 57, items 3, 5, 9, 10): taps with no
session are printed at exit and the process exits cleanly; a full disk
(real ``RLIMIT_FSIZE``) or a lock another process holds (real filelock)
makes ``flush()`` raise within its timeout and the process end, SIGTERM
included; a ``Writer`` with ``flush_timeout=0`` and a busy lock raises.

Every scenario runs in a real subprocess with a timeout: the code before
these fixes hung in most of them, which the timeout turns into a failure.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import time

import pytest

import pmaptap
from conftest import run_python, start_python

# ====================================================== no session (item 3)
# A sharded-jit step tapping a sum (one record a step) and an array sharded
# over the 8 devices (one record a shard), called twice, no session: the
# script ends at once, its steps' taps still on their way to the host.
_NO_SESSION = """
    import jax, jax.numpy as jnp, pmaptap
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((8,), ("d",))
    x = jax.device_put(jnp.arange(16.0).reshape(8, 2), NamedSharding(mesh, P("d")))

    @pmaptap.jit
    def step(x):
        pmaptap.tap(x.sum(), "total")
        pmaptap.tap(x, "x")
        return x + 1

    x = step(x)
    x = step(x)
"""


def _run(code: str, timeout: float) -> subprocess.CompletedProcess:
    try:
        return run_python(code, check=False, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the process did not end within {timeout} s") from None


def test_taps_without_a_session_are_printed_and_every_exit_is_clean() -> None:
    # Before: nothing was printed (no exit handler waited for the steps'
    # taps) and about 1 run in 6 aborted at exit with "FATAL: exception not
    # rethrown" (the drain thread still reading arrays while XLA shut down).
    runs = 12
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        procs = list(pool.map(lambda _: _run(_NO_SESSION, 120), range(runs)))
    expected = {f"[pmaptap] total step={s} process=0 replicas=8" for s in (0, 1)} | {
        f"[pmaptap] x step={s} process=0 device={d} d={d}" for s in (0, 1) for d in range(8)
    }
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-3000:]
        printed = {
            line.split(" index=")[0].split(":")[0]
            for line in proc.stderr.splitlines()
            if line.startswith("[pmaptap] ")
        }
        assert printed == expected, proc.stderr[-3000:]
        assert "total step=1 process=0 replicas=8: 136.0" in proc.stderr


# ====================================================== a full disk, a held lock (item 9)
# A session whose queue holds 4 items, 30 steps of pmaptap.jit, then
# flush(), while the file takes nothing: RLIMIT_FSIZE as a full disk
# (FSIZE set; SIGXFSZ ignored: its default kills), or a lock another process
# holds (the test's). Before: the drain thread blocked for ever feeding the
# full queue, and flush() (and the exit's close) waited for it unbounded.
_STUCK = """
    import os, resource, signal, sys, time
    import jax, jax.numpy as jnp, pmaptap
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    @pmaptap.jit
    def step(x):
        pmaptap.tap(x.sum(), "total", step=x[0].astype(int))
        return x + 1

    x = jax.block_until_ready(step(jnp.zeros(4)))   # compiled; its step 0 on stderr
    s = pmaptap.Session(os.environ["TAP"], run="stuck", max_pending=4, lock_timeout=0.1,
                        overflow=os.environ.get("OVERFLOW", "drop_oldest"),
                        flush_timeout=float(os.environ["FLUSH"]),
                        close_timeout=float(os.environ["CLOSE"]))
    s.open()
    if "FSIZE" in os.environ:
        fsize = int(os.environ["FSIZE"])
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, resource.RLIM_INFINITY))
    for i in range(30):
        x = step(x)
    jax.block_until_ready(x)
    t0 = time.monotonic()
    try:
        s.flush()
        print("flush returned", flush=True)
    except pmaptap.TapError as e:
        print(f"flush raised after {time.monotonic() - t0:.1f}s: {e}", flush=True)
    print("end of script", flush=True)
"""
_FULL_DISK = dict(FSIZE="600", FLUSH="3")


def _ended(p: subprocess.Popen, what: str) -> tuple[str, str]:
    """The child's (stdout, stderr), asserted to have ended with exit 0."""
    try:
        out, err = p.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise AssertionError(f"flush() or the exit hung on {what}") from None
    assert p.returncode == 0, err[-3000:]
    return out, err


def _flush_raised(out: str, within: float) -> str:
    """The child's flush error, asserted to have come within ``within`` s."""
    (raised,) = [line for line in out.splitlines() if line.startswith("flush raised")]
    assert float(raised.split()[3][:-2]) < within, raised
    assert out.splitlines()[-1] == "end of script"
    return raised


@pytest.mark.parametrize("overflow", ["drop_oldest", "block"])
def test_full_disk_under_pmaptap_jit_flush_raises_and_the_process_ends(tmp_path, overflow) -> None:
    tap = str(tmp_path / "t.jsonl")
    t0 = time.monotonic()
    p = start_python(_STUCK, TAP=tap, OVERFLOW=overflow, CLOSE="2", **_FULL_DISK)
    out, err = _ended(p, "the full disk")
    took = time.monotonic() - t0
    # Within flush_timeout (3 s), with the disk's error.
    assert "File too large" in _flush_raised(out, 3.0 + 1.5)
    # The exit's close gave up after close_timeout (2 s) and said what it
    # lost; the whole job took seconds, not for ever.
    assert "were not written before close" in err, err[-3000:]
    assert took < 60, took
    written = {r["step"] for r in pmaptap.read(tap) if r["name"] == "total"}
    printed = {
        int(line.split("step=")[1].split()[0])
        for line in err.splitlines()
        if line.startswith("[pmaptap] total ")
    }
    if overflow == "drop_oldest":
        # The drain follows the session's policy while writes fail: drops
        # counted and said, as for host callbacks.
        assert "pmaptap dropped" in err, err[-3000:]
    else:
        # "block" drops nothing: what the close could not wait for reached
        # pmaptap after it and was printed on stderr.
        assert "pmaptap dropped" not in err
        assert "had not reached the session when its close stopped" in err, err[-3000:]
        lost = int(err.split(" record(s) were not written before close")[0].split()[-1])
        assert len(written) + len(printed - {0}) + lost >= 30, (written, printed, lost)
    assert 0 in printed and 0 not in written  # the step before the session opened


def test_sigterm_during_the_exit_on_a_full_disk_ends_the_process(tmp_path) -> None:
    # Before: the exit's close waited for ever for the drain; SIGTERM's
    # handler deferred to that close, so the signal was absorbed (one run
    # needed SIGKILL after 714 s). Now the close (close_timeout left at 60 s)
    # stops retrying the failing writes at the signal, says what it lost,
    # and the process dies by SIGTERM.
    tap = str(tmp_path / "t.jsonl")
    p = start_python(_STUCK, TAP=tap, CLOSE="60", **_FULL_DISK)
    try:
        # (Line by line: the stream ends only with the process.)
        ready = concurrent.futures.ThreadPoolExecutor(1).submit(
            lambda: any(line.strip() == "end of script" for line in p.stdout)
        )
        try:
            assert ready.result(timeout=60), "the script did not end"
        except concurrent.futures.TimeoutError:
            raise AssertionError("flush() hung on the full disk") from None
        time.sleep(0.5)  # in the exit's close, retrying the writes
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        try:
            err = p.communicate(timeout=30)[1]
        except subprocess.TimeoutExpired:
            raise AssertionError("SIGTERM during the exit did not end the process") from None
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == -signal.SIGTERM, err[-3000:]
    assert took < 15, took
    assert "were not written before close" in err, err[-3000:]


# ====================================================== a lock held elsewhere (item 9)
_HOLDER = """
    import os, sys, filelock
    lock = filelock.FileLock(os.environ["TAP"] + ".lock")
    lock.acquire()
    print("locked", flush=True)
    sys.stdin.readline()             # held until the test writes a line
"""


def test_a_lock_held_by_another_process_bounds_flush_and_exit(tmp_path) -> None:
    tap = str(tmp_path / "t.jsonl")
    holder = start_python(_HOLDER, devices=1, stdin=True, TAP=tap)
    try:
        assert holder.stdout.readline().strip() == "locked", holder.stderr.read()
        out, err = _ended(start_python(_STUCK, TAP=tap, FLUSH="2", CLOSE="2"), "the held lock")
    finally:
        holder.kill()
        holder.communicate()
    assert "timed out" in _flush_raised(out, 2.0 + 1.5)
    assert "were not written before close" in err, err[-3000:]
    assert os.path.getsize(tap) == 0


# ====================================================== Writer, flush_timeout=0 (item 5)
def test_writer_with_flush_timeout_zero_and_a_busy_lock_raises_and_keeps_the_record(
    tmp_path,
) -> None:
    # Before: close() returned normally, the record still buffered and the
    # file empty (a timeout of 0 was taken for write()'s own one try).
    tap = str(tmp_path / "t.jsonl")
    holder = start_python(_HOLDER, devices=1, stdin=True, TAP=tap)
    try:
        assert holder.stdout.readline().strip() == "locked", holder.stderr.read()
        w = pmaptap.Writer(tap, run="w", process=7, flush_timeout=0, lock_timeout=0.05)
        w.write("eval", 3, 0.5)
        with pytest.raises(pmaptap.TapError, match=r"lock stayed busy.*1 records still buffered"):
            w.flush()
        with pytest.raises(pmaptap.TapError, match=r"lock stayed busy"):
            w.close()
        assert not w.closed and w.pending == 1
        assert os.path.getsize(tap) == 0
    finally:
        holder.kill()
        holder.communicate()
    w.close()  # the lock is free: written once
    assert [(r["name"], r["step"], r["value"]) for r in pmaptap.read(tap)] == [("eval", 3, 0.5)]
