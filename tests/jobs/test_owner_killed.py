"""The sharded layout when the owner of a replicated value is killed: the
value reaches the run as long as another process that held it lives to
close (_host/sinks/directory.py: Held). Real processes connected by
jax.distributed on loopback, a real SIGKILL with records still queued.

A pmean'd loss over 2 processes x 4 devices, tapped replicated for 12
steps: both processes hold every value and each step has one owner
(tapfile/source/run.py: owner) that alone writes it. Process 1's writer lingers,
so its records are still queued when it SIGKILLs itself after the last
step: every step it owns reaches its shard only if process 0 writes it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

import pmaptap
from conftest import ROOT, job_failed, prefixed, python_cmd, run_launch, subprocess_env
from pmaptap.tapfile.record import record_key
from pmaptap.tapfile.source import run as runs

STEPS = 12

_JOB = """
    import jax, jax.numpy as jnp, pmaptap, pmaptap.distributed as dist
    import os, signal, time
    dist.initialize()
    p = jax.process_index()
    s = pmaptap.Session(
        os.environ["TAP"], layout="sharded", close_timeout=float(os.environ["CLOSE_TIMEOUT"]),
        # Process 1's writer holds its records (an hour's linger): queued
        # when it is killed, as a busy writer's are.
        flush_interval=3600.0 if p == 1 else 0.02,
    ).open()
    f = jax.pmap(lambda x: pmaptap.tap(jax.lax.pmean(x, "i"), "loss", dedup="replicated"),
                 axis_name="i")
    for step in range(12):
        f(jnp.arange(4.0) + step).block_until_ready()
    print("COMPUTED", flush=True)
    if p == 1 and os.environ["HOW"] != "healthy":
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ["HOW"] == "sigterm":
        time.sleep(120)  # the launcher's SIGTERM closes the session
    s.close()
    print("CLOSED", flush=True)
    if os.environ["HOW"] == "healthy":
        # JAX's own exit: its shutdown barrier keeps process 0's coordination
        # service up until process 1 is done too (with os._exit, process 0
        # could end it while process 1 was still printing, which aborts it).
        raise SystemExit(0)
    # JAX's own exit would abort on the dead peer (its shutdown barrier).
    os._exit(0)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_processes(tap: str, how: str = "close") -> list[subprocess.CompletedProcess]:
    """The job as two plain processes (no launcher: nothing terminates
    process 0 when process 1 dies; its close waits for process 1 in vain)."""
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(_JOB)],
            env=subprocess_env(
                4,
                TAP=tap,
                HOW=how,
                CLOSE_TIMEOUT="3",
                PMAPTAP_COORDINATOR=f"127.0.0.1:{port}",
                PMAPTAP_NUM_PROCESSES="2",
                PMAPTAP_PROCESS_ID=str(p),
            ),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for p in (0, 1)
    ]
    out = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=150)
            out.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return out


def _check_every_step_once(tap: str) -> None:
    recs = [r for r in pmaptap.read(tap) if r["name"] == "loss"]
    assert sorted(r["step"] for r in recs) == list(range(STEPS)), recs
    for r in recs:
        assert r["value"] == pytest.approx(1.5 + r["step"]) and r["processes"] == [0, 1], r
    # The case is real: process 1 owned steps, and its shard got none of them.
    owned = [r["step"] for r in recs if runs.owner(record_key(r), (0, 1)) == 1]
    assert owned, "process 1 owned no step (a 1 in 4096 draw of the run id)"
    shard1 = runs.shard_path(tap, 1)
    lines = open(shard1).read().splitlines() if os.path.exists(shard1) else []
    assert not [ln for ln in lines if '"loss"' in ln], lines
    # Process 0 wrote them, each once.
    assert all(r["process"] == 0 for r in recs)

    env = subprocess_env(1)
    summary = subprocess.run(
        [sys.executable, "-m", "pmaptap", "summary", tap, "--name", "loss"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert summary.returncode == 0, summary.stderr
    row = next(ln for ln in summary.stdout.splitlines() if ln.startswith("loss"))
    assert row.split()[2] == str(STEPS), summary.stdout  # records
    assert "missing" not in row and "duplicate" not in row, row
    validate = subprocess.run(
        [sys.executable, "-m", "pmaptap", "validate", tap],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert validate.returncode == 0, validate.stdout + validate.stderr
    assert f"OK, {STEPS} records" in validate.stdout, validate.stdout


def test_values_a_killed_owner_had_queued_are_written_by_the_survivor_at_close(tmp_path):
    """Process 0's close waits for process 1 (close_timeout), sees it did
    not close, and writes the values it left to it."""
    tap = str(tmp_path / "killed.jsonl")
    p0, p1 = _two_processes(tap)
    assert p1.returncode == -signal.SIGKILL, p1.stderr
    assert "CLOSED" in p0.stdout, p0.stdout + p0.stderr
    _check_every_step_once(tap)
    assert "process(es) 1 did not close" in p0.stderr, p0.stderr
    assert "replicated value(s) that process(es) 1 own" in p0.stderr, p0.stderr


def test_a_healthy_job_writes_each_value_once_on_disk(tmp_path):
    """What the survivors keep costs a healthy job nothing on disk: every
    owner closes, so no process writes another's values."""
    tap = str(tmp_path / "healthy.jsonl")
    p0, p1 = _two_processes(tap, "healthy")
    assert "CLOSED" in p0.stdout and "CLOSED" in p1.stdout, p0.stderr + p1.stderr
    lines = [
        json.loads(ln)
        for p in (0, 1)
        for ln in open(runs.shard_path(tap, p)).read().splitlines()
        if '"loss"' in ln
    ]
    assert sorted(d["step"] for d in lines) == list(range(STEPS))
    for d in lines:
        assert d["process"] == runs.owner(record_key(d), (0, 1)), d
    assert "pmaptap" not in p0.stderr + p1.stderr


def test_a_survivor_terminated_by_the_launcher_writes_them_before_waiting(tmp_path):
    """Under the launcher, process 1's death gets process 0 a SIGTERM and,
    a grace period later, a SIGKILL: its close cannot wait for process 1
    first, so it writes what process 1 had not closed on before waiting."""
    tap = str(tmp_path / "killed.jsonl")
    t0 = time.monotonic()
    proc, _ = run_launch(
        2,
        4,
        python_cmd(_JOB),
        launcher_timeout=120,
        grace=3,
        TAP=tap,
        HOW="sigterm",
        CLOSE_TIMEOUT="60",
    )
    assert "[launch] process 1 was killed by SIGKILL" in proc.stderr, job_failed(proc)
    assert "COMPUTED" in prefixed(proc.stdout, 0), job_failed(proc)
    assert time.monotonic() - t0 < 100, job_failed(proc)
    _check_every_step_once(tap)
    # SIGTERM ended the process once its close was done (not its wait).
    assert "CLOSED" not in prefixed(proc.stdout, 0)
