"""Preempted and restarted jobs end in one clean story (issue 16.3, 16.4):
the launcher's --restarts, launch/train.py's checkpoints, and the file's
attempts as every reader shows them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import pmaptap
from conftest import ROOT, job_failed, subprocess_env
from pmaptap.tapfile.analyze.summary import summarize_file
from pmaptap.tapfile.analyze.table import summary_table
from pmaptap.tapfile.analyze.validate import validate_file

TRAIN = os.path.join(ROOT, "launch", "train.py")


def _launch(processes, devices, args, *, restarts=None, timeout=300, env=None):
    cmd = [
        sys.executable,
        "-m",
        "pmaptap.launch",
        "-p",
        str(processes),
        "-d",
        str(devices),
        "--grace",
        "2",
    ]
    if restarts is not None:
        cmd += ["--restarts", str(restarts)]
    job_env = subprocess_env(1, **(env or {}))
    job_env.pop("PMAPTAP_ATTEMPT", None)
    return subprocess.run(
        cmd + ["--"] + list(args),
        env=job_env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _train_args(out, ckpt, steps, *extra):
    return [
        sys.executable,
        TRAIN,
        "--steps",
        str(steps),
        "--out",
        str(out),
        "--ckpt",
        str(ckpt),
        "--ckpt-every",
        "4",
        "--log-every",
        "100",
        "--no-summary",
        *map(str, extra),
    ]


def _one_per_key(recs, name):
    keys = [(r["step"], r.get("device")) for r in recs if r["name"] == name]
    assert len(keys) == len(set(keys)), f"{name}: a key is shown twice"
    return set(keys)


def test_killed_process_restarted_by_the_launcher_ends_in_one_story(tmp_path):
    out, ckpt, steps = tmp_path / "t.jsonl", tmp_path / "ckpt", 10
    # Process 1 is SIGKILLed before step 6; the last checkpoint is at step 4.
    proc = _launch(2, 2, _train_args(out, ckpt, steps, "--die-at", 6), restarts=1)
    assert proc.returncode == 0, job_failed(proc)
    assert "dying at step 6" in proc.stdout and "restarting the job (attempt 1" in proc.stderr
    assert "resuming from" in proc.stdout and "at step 4" in proc.stdout

    recs = pmaptap.read(out)
    devices = {r["device"] for r in recs if r["name"] == "grad_norm"}
    assert len(devices) == 4
    assert _one_per_key(recs, "grad_norm") == {(s, d) for s in range(steps) for d in devices}
    assert _one_per_key(recs, "loss") == {(s, None) for s in range(steps)}
    for r in recs:
        if r["kind"] != "meta":
            # Steps from the checkpoint on are the second attempt's.
            assert r.get("attempt", 0) == (1 if r["step"] >= 4 else 0), r
    assert len({r["run"] for r in recs}) == 1

    # The first attempt's records of the replayed steps are still in the file
    # (append-only), superseded: at least the dying process flushed 4 and 5.
    every = pmaptap.read(out, attempts="all")
    old = [r for r in every if r["attempt"] == 0 and r["kind"] != "meta" and r["step"] >= 4]
    assert {4, 5} <= {r["step"] for r in old}
    report = validate_file(out)
    assert report.ok, report.problems
    assert report.superseded == len(old)
    sums, _, _, _ = summarize_file(out)
    table = summary_table(sums)
    assert "2 attempts; restarted at step 4" in table, table
    assert all(
        s.duplicates == 0 and not s.incomplete_steps and not s.divergent_steps for s in sums
    ), table
    meta = [r for r in recs if r["name"] == "pmaptap/attempt"]
    assert [(m["attempt"], m["process_count"], m["device_count"]) for m in meta] == [(1, 2, 4)]


def test_elastic_restart_on_another_shape_supersedes_replayed_steps_whole(tmp_path):
    out, ckpt, steps = tmp_path / "t.jsonl", tmp_path / "ckpt", 8
    first = _launch(2, 4, _train_args(out, ckpt, steps, "--die-at", 6))
    # (the launcher names whichever failure it sees first: the SIGKILL, or
    # process 0 aborting in a collective whose peer vanished)
    assert first.returncode != 0 and "dying at step 6" in first.stdout, job_failed(first)
    # Started again by hand as 4 processes x 2 devices: the checkpoint
    # resumes the run (2x4 -> 4x2: the device ids of processes 0 and 1 change).
    second = _launch(4, 2, _train_args(out, ckpt, steps))
    assert second.returncode == 0, job_failed(second)
    recs = pmaptap.read(out)
    by_step: dict[int, set] = {}
    for r in recs:
        if r["name"] == "grad_norm":
            by_step.setdefault(r["step"], set()).add(r["device"])
    old_devices, new_devices = by_step[0], by_step[steps - 1]
    assert len(old_devices) == 8 and len(new_devices) == 8
    assert old_devices - new_devices  # devices the second attempt does not have
    # Steps 4 and 5 were written by the first attempt (the dying process
    # flushed them); after the restart only the second attempt's devices are
    # left for them, none of the first's that it lacks.
    assert by_step == {s: (old_devices if s < 4 else new_devices) for s in range(steps)}
    _one_per_key(recs, "grad_norm")
    assert _one_per_key(recs, "loss") == {(s, None) for s in range(steps)}
    every = pmaptap.read(out, attempts="all")
    # The dying process flushed its records of steps 4 and 5 first (process
    # 0's may or may not have reached the file before it was stopped).
    dying = {
        r["device"]
        for r in every
        if r["name"] == "grad_norm" and r["step"] == 4 and r["attempt"] == 0 and r["process"] == 1
    }
    assert len(dying) == 4 and dying - new_devices
    report = validate_file(out)
    assert report.ok and report.superseded > 8, (report.problems, report.superseded)
    sums, _, _, _ = summarize_file(out)
    assert "restarted at step 4" in summary_table(sums)
    assert not {s.name: s for s in sums}["grad_norm"].incomplete_steps


def test_launcher_restarts_a_failed_job_with_the_attempt_number(tmp_path):
    log = tmp_path / "log"
    code = (
        "import os, sys; a = os.environ['PMAPTAP_ATTEMPT']; "
        f"open({str(log)!r}, 'a').write(os.environ['PMAPTAP_PROCESS_ID'] + ':' + a + '\\n'); "
        "sys.exit(3 if a == '0' and os.environ['PMAPTAP_PROCESS_ID'] == '1' else 0)"
    )
    proc = _launch(2, 1, [sys.executable, "-c", code], restarts=2, timeout=120)
    assert proc.returncode == 0, job_failed(proc)
    lines = log.read_text().split()
    # One restart, then done (process 0 may be stopped before it writes "0:0").
    assert {"1:0", "0:1", "1:1"} <= set(lines) <= {"0:0", "0:1", "1:0", "1:1"}
    assert len(lines) == len(set(lines))
    assert proc.stderr.count("restarting the job") == 1
    # Out of restarts: the failure's exit status.
    log.unlink()
    always = code.replace("a == '0' and ", "")
    proc = _launch(2, 1, [sys.executable, "-c", always], restarts=1, timeout=120)
    assert proc.returncode == 3
    # (process 0 may be stopped before it writes: process 1 fails at once)
    assert {"1:0", "1:1"} <= set(log.read_text().split())
    assert proc.stderr.count("restarting the job") == 1
    # Without --restarts nothing is set or restarted.
    log.unlink()
    proc = _launch(
        2,
        1,
        [
            sys.executable,
            "-c",
            code.replace("os.environ['PMAPTAP_ATTEMPT']", "os.environ.get('PMAPTAP_ATTEMPT', '-')"),
        ],
    )
    assert proc.returncode == 0 and sorted(log.read_text().split()) == ["0:-", "1:-"]


def test_resume_meta_record_is_valid_json(tmp_path):
    # Guard the meta record's fields against clashing with record fields.
    path = tmp_path / "t.jsonl"
    with pmaptap.Session(path, run="m", resume=True):
        pass
    with pmaptap.Session(path, run="m", resume=True):
        pass
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(d["name"], d.get("attempt", 0)) for d in lines] == [
        ("pmaptap/attempt", 0),
        ("pmaptap/attempt", 1),
    ]
    assert validate_file(path).ok


# Issue 24.2: a job launched again on a run that failed for good. Each
# process taps a per-device value and a replicated one (value: 100 x launch
# + step, so every record says which launch wrote it). Launch 1's process 1
# fails at step 6 on every attempt, once both have flushed steps before it
# (process 0 then waits for the launcher's SIGTERM), so its --restarts run
# out; each attempt after the first, and launch 2, start from a checkpoint at
# step 4.
_RELAUNCH = """
    import os, time, jax, jax.numpy as jnp, pmaptap
    from pmaptap import distributed
    distributed.initialize()
    launch, attempt = int(os.environ["LAUNCH"]), int(os.environ["PMAPTAP_ATTEMPT"])
    die = int(os.environ.get("DIE_AT", "-1"))
    start = 0 if (launch, attempt) == (1, 0) else 4
    f = jax.pmap(
        lambda x, i: (
            pmaptap.tap(x + i, "w", step=i, dedup="per_device"),
            pmaptap.tap(x * 0 + i + 100 * launch, "loss", step=i, dedup="replicated"),
        )[0],
        axis_name="d",
        devices=jax.local_devices(),
        in_axes=(0, None),
    )
    x = jnp.arange(jax.local_device_count(), dtype=jnp.float32) + 100 * launch
    with pmaptap.Session(os.environ["TAP"], resume=True) as s:
        print("ATTEMPT", s.attempt, flush=True)
        for i in range(start, 10):
            if i == die:
                s.flush()
                # Process 1 fails once process 0 has written its steps too.
                flushed = f"{os.environ['TAP']}.{launch}.{attempt}.flushed"
                if jax.process_index() == 0:
                    open(flushed, "w").close()
                    time.sleep(120)  # until the launcher's SIGTERM
                while not os.path.exists(flushed):
                    time.sleep(0.05)
                os._exit(3)  # a hard failure: no close, no exit handlers
            f(x, jnp.int32(i))  # (JAX 0.9 takes no Python int here)
"""


def test_a_job_launched_again_on_its_run_continues_above_every_attempt(tmp_path):
    out = tmp_path / "t.jsonl"
    env = dict(TAP=str(out), PMAPTAP_RUN="fixed")
    cmd = [sys.executable, "-c", textwrap.dedent(_RELAUNCH)]
    first = _launch(2, 2, cmd, restarts=1, env=dict(env, LAUNCH="1", DIE_AT="6"))
    assert first.returncode == 3, job_failed(first)  # out of restarts
    # Launched again: the launcher numbers this attempt 0, the file's run
    # already has attempts 0 and 1; the session continues above both, and
    # every process agrees.
    second = _launch(2, 2, cmd, restarts=1, env=dict(env, LAUNCH="2"))
    assert second.returncode == 0, job_failed(second)
    assert second.stdout.count("ATTEMPT 2") == 2, second.stdout

    recs = pmaptap.read(out)
    want = {s: 100 * (2 if s >= 4 else 1) for s in range(10)}
    assert {r["step"]: r["value"] - r["step"] for r in recs if r["name"] == "loss"} == want
    assert _one_per_key(recs, "loss") == {(s, None) for s in range(10)}
    w = [r for r in recs if r["name"] == "w"]
    # Each process's devices, in order: their local index is in the value.
    local = {}
    for p in (0, 1):
        mine = sorted({r["device"] for r in w if r["process"] == p})
        assert len(mine) == 2
        local.update({d: i for i, d in enumerate(mine)})
    assert _one_per_key(recs, "w") == {(s, d) for s in range(10) for d in local}
    for r in w:
        launch = 2 if r["step"] >= 4 else 1
        assert r["value"] == local[r["device"]] + r["step"] + 100 * launch, r
        assert r.get("attempt", 0) == (2 if launch == 2 else 0), r
    report = validate_file(out)
    assert report.ok, report.problems
    # Launch 1's records of steps 4 and 5 (both its attempts) are history.
    every = pmaptap.read(out, attempts="all")
    old = [r for r in every if r["kind"] != "meta" and r["step"] >= 4 and r["attempt"] < 2]
    assert {(r["step"], r["attempt"]) for r in old} == {(s, a) for s in (4, 5) for a in (0, 1)}
    assert report.superseded == len(old)


# A restart of a script with automatic steps: each process taps the loss
# (value: 100 x attempt + step) with no step=, flushes at step 5 and fails
# there on attempt 0. RESUME=1: the session resumes and the tap passes
# step= (what the refusal asks for).
_AUTOMATIC = """
    import os, time, jax, jax.numpy as jnp, pmaptap
    from pmaptap import distributed
    distributed.initialize()
    attempt = int(os.environ["PMAPTAP_ATTEMPT"])
    resume = bool(os.environ.get("RESUME"))
    f = jax.pmap(
        lambda x, i: pmaptap.tap(
            x * 0 + i + 100 * attempt, "loss", dedup="replicated", **({"step": i} if resume else {})
        ),
        axis_name="d",
        devices=jax.local_devices(),
        in_axes=(0, None),
    )
    x = jnp.ones(jax.local_device_count())
    with pmaptap.Session(os.environ["TAP"], resume=resume) as s:
        print("OPENED", s.run, s.attempt, flush=True)
        for i in range(10):
            f(x, jnp.int32(i))
            if i == 5 and attempt == 0:
                s.flush()
                # Neither fails before both opened and wrote their steps (the
                # steps are no collective: a process slow to start was killed
                # by the launcher before it opened, under load).
                tap = os.environ["TAP"]
                open(f"{tap}.{jax.process_index()}.flushed", "w").close()
                while not all(
                    os.path.exists(f"{tap}.{p}.flushed") for p in range(jax.process_count())
                ):
                    time.sleep(0.05)
                os._exit(3)  # a hard failure: no close, no exit handlers
"""


def test_a_restart_on_a_fixed_run_without_resume_is_refused_at_open(tmp_path):
    """``launch --restarts 1`` with PMAPTAP_RUN fixed and automatic steps:
    attempt 1 wrote steps 0-9 as attempt 0 again beside attempt 0's steps
    0-5, with other values and nothing to tell them apart. Now its session
    is refused at open (SessionError naming the run, the attempt and the
    fixes) on every process, and the file keeps attempt 0's one story.
    Resuming with step= gives one story; without a fixed run id each
    attempt is a run of its own."""
    cmd = [sys.executable, "-c", textwrap.dedent(_AUTOMATIC)]
    refused = tmp_path / "refused.jsonl"
    proc = _launch(2, 2, cmd, restarts=1, env=dict(TAP=str(refused), PMAPTAP_RUN="myrun"))
    assert proc.returncode == 1, job_failed(proc)
    assert "restarting the job (attempt 1" in proc.stderr
    opened = proc.stdout.count("OPENED myrun 0")
    assert opened == 2 and "OPENED myrun 1" not in proc.stdout, proc.stdout + proc.stderr
    err = proc.stdout + proc.stderr
    assert "SessionError: pmaptap.Session: this is attempt 1 of a restarted job" in err, err
    assert "fixed run id 'myrun' (PMAPTAP_RUN)" in err and "resume=True" in err, err
    recs = pmaptap.read(refused, attempts="all")
    assert sorted((r["step"], r["value"], r["attempt"]) for r in recs) == [
        (s, float(s), 0) for s in range(6)
    ]
    assert validate_file(refused).ok

    resumed = tmp_path / "resumed.jsonl"
    proc = _launch(
        2, 2, cmd, restarts=1, env=dict(TAP=str(resumed), PMAPTAP_RUN="myrun", RESUME="1")
    )
    assert proc.returncode == 0, job_failed(proc)
    recs = [r for r in pmaptap.read(resumed) if r["name"] == "loss"]
    assert sorted((r["step"], r["value"], r.get("attempt")) for r in recs) == [
        (s, 100.0 + s, 1) for s in range(10)
    ]
    report = validate_file(resumed)
    assert report.ok and report.superseded >= 6 and not report.divergent_keys, report.problems

    fresh = tmp_path / "fresh.jsonl"
    proc = _launch(2, 2, cmd, restarts=1, env=dict(TAP=str(fresh)))
    assert proc.returncode == 0, job_failed(proc)
    by_run: dict = {}
    for r in pmaptap.read(fresh):
        by_run.setdefault(r["run"], []).append((r["step"], r["value"]))
    assert sorted(map(sorted, by_run.values())) == [
        [(s, float(s)) for s in range(6)],
        [(s, 100.0 + s) for s in range(10)],
    ]
    report = validate_file(fresh)
    assert report.ok and not report.divergent_keys, report.problems


_PLAIN = """
    import os, jax, pmaptap
    from pmaptap import distributed
    distributed.initialize()
    with pmaptap.Session(os.environ["TAP"], layout=os.environ["LAYOUT"]) as s:
        print("OPENED", s.run, flush=True)
        pmaptap.tap(jax.numpy.float32(jax.process_index()), "x", step=0, dedup="per_device")
"""


@pytest.mark.parametrize("layout", ["file", "sharded"])
def test_a_job_launched_again_on_its_fixed_run_without_resume_is_refused(tmp_path, layout):
    """The plain case of the refusal above: no restart, the same 2-process
    job launched twice with PMAPTAP_RUN=exp on one file (or its shards).
    The second appended the same steps again without a word; now every
    process of it is refused at open (process 0 reads the file's end and
    tells the others before any writes), and the file keeps one story."""
    cmd = [sys.executable, "-c", textwrap.dedent(_PLAIN)]
    path = tmp_path / "run.jsonl"
    env = dict(TAP=str(path), PMAPTAP_RUN="exp", LAYOUT=layout)
    proc = _launch(2, 2, cmd, env=env)
    assert proc.returncode == 0 and proc.stdout.count("OPENED exp") == 2, job_failed(proc)
    proc = _launch(2, 2, cmd, env=env)
    assert proc.returncode == 1 and "OPENED" not in proc.stdout, job_failed(proc)
    err = proc.stdout + proc.stderr
    assert err.count("already ends with records of run 'exp' (PMAPTAP_RUN)") == 2, err
    recs = pmaptap.read(path)
    assert sorted((r["process"], r["device"], r["value"]) for r in recs) == [
        (0, 0, 0.0),
        (1, 2048, 1.0),
    ]
    assert validate_file(path).ok
