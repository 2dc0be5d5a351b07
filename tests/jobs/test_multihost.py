"""Multi-process jobs on this machine: real processes connected through
jax.distributed on loopback, started by pmaptap.launch.

Device ids on multi-process CPU: process p's k-th device has id p*2048+k, and
pmap's / the mesh's axis index runs over jax.devices(), process by process:
coordinate p*D+k. launch/train.py gives global coordinate g the data shard
make_batch(seed, step, g), so a grad_norm record tagged with device p*2048+k
must hold the gradient norm of shard p*D+k: checked against a recomputation.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

import pmaptap
from conftest import (
    ROOT,
    expected_step0_grad_norm,
    job_failed,
    pid_alive,
    prefixed,
    python_cmd,
    run_launch,
    run_python,
    start_launch,
    train_argv,
)

STEPS = 4
BATCH = 8


def run_train(
    tmp_path, processes: int, devices: int, variant: str, *extra: str
) -> tuple[list[dict], str, float]:
    out = str(tmp_path / f"{variant}-{processes}x{devices}.jsonl")
    proc, took = run_launch(
        processes,
        devices,
        train_argv(out, "--variant", variant, *extra, steps=STEPS, batch=BATCH),
        launcher_timeout=90,
    )
    assert proc.returncode == 0, job_failed(proc)
    return pmaptap.read(out), proc.stdout, took


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """The three training jobs, run once for the tests below."""
    tmp = tmp_path_factory.mktemp("train")
    return {
        ("pmap", 2, 4): run_train(tmp, 2, 4, "pmap"),
        ("shard_map", 4, 2): run_train(tmp, 4, 2, "shard_map"),
        # NFS mode end to end: Session(lock="soft") in every process.
        ("pmap", 4, 2): run_train(tmp, 4, 2, "pmap", "--lock", "soft"),
    }


JOB_IDS = [("pmap", 2, 4), ("shard_map", 4, 2), ("pmap", 4, 2)]


@pytest.mark.parametrize("job", JOB_IDS, ids=lambda j: f"{j[0]}-{j[1]}x{j[2]}")
def test_train_job_exact_records_and_tags(jobs, job):
    variant, P, D = job
    recs, stdout, took = jobs[job]
    # One run id agreed by all processes (no configuration), every record.
    runs = {r["run"] for r in recs}
    assert len(runs) == 1, runs
    by_name: dict[str, list[dict]] = {}
    for r in recs:
        by_name.setdefault(r["name"], []).append(r)
    assert sorted(by_name) == ["grad_norm", "loss", "lr", "step"]

    # Replicated taps: one record per step for the whole job.
    for name in ("loss", "lr", "step"):
        rs = by_name[name]
        assert sorted(r["step"] for r in rs) == list(range(STEPS)), name
        assert all(r["kind"] == "replicated" and not r.get("divergent") for r in rs), name
        # The copies that agreed: at least all of the writer's devices (the
        # core may also know the other hosts' copies), tags consistent.
        all_devices = {p * 2048 + k for p in range(P) for k in range(D)}
        for r in rs:
            p = r["process"]
            assert {p * 2048 + k for k in range(D)} <= set(r["devices"]) <= all_devices, r
            assert r["replicas"] == len(r["devices"]), r
            assert r["processes"] == sorted({d // 2048 for d in r["devices"]}), r
    assert [r["value"] for r in sorted(by_name["step"], key=lambda r: r["step"])] == list(
        range(STEPS)
    )
    peak = 0.05
    lr0 = [r["value"] for r in by_name["lr"] if r["step"] == 0][0]
    assert lr0 == pytest.approx(peak / max(1, STEPS // 10))

    # Per-device taps: exactly one per global device per step, tagged with
    # the device and coordinate where the data lived.
    gn = by_name["grad_norm"]
    assert len(gn) == STEPS * P * D
    want = {(p * 2048 + k, p * D + k, p) for p in range(P) for k in range(D)}
    for step in range(STEPS):
        got = [(r["device"], r["coords"]["dp"], r["process"]) for r in gn if r["step"] == step]
        assert sorted(got) == sorted(want), (step, got)
    for r in gn:
        if r["step"] == 0:
            assert r["value"] == pytest.approx(
                expected_step0_grad_norm(r["coords"]["dp"], BATCH), rel=1e-4
            ), r
    # Records came from every process (each wrote its own devices' norms).
    assert {r["process"] for r in gn} == set(range(P))

    # The run ends with process 0's summary of this run only.
    summary = prefixed(stdout, 0)
    run = runs.pop()
    assert f"run {run}: {STEPS * (P * D + 3)} records, 4 tap(s)" in "\n".join(summary)
    assert not any(
        "run " in line and "records" in line for p in range(1, P) for line in prefixed(stdout, p)
    )
    assert took < 60, f"job took {took:.1f}s"


def test_variants_and_layouts_train_identically(jobs):
    """Same global batch (8 devices) => same losses, whatever the variant and
    the processes x devices split: the data-parallel maths is right."""
    losses = {
        job: [
            r["value"]
            for r in sorted(
                (r for r in jobs[job][0] if r["name"] == "loss"), key=lambda r: r["step"]
            )
        ]
        for job in JOB_IDS
    }
    ref = losses[JOB_IDS[0]]
    assert ref[-1] < ref[0]  # it does learn
    for job in JOB_IDS[1:]:
        assert losses[job] == pytest.approx(ref, rel=1e-4), job


_DIVERGE = """
    import jax, jax.numpy as jnp, pmaptap, pmaptap.distributed as dist, os, json
    dist.initialize()
    # GMB=0: replicated taps travel as one copy plus per-device hashes
    # ("verified" layout) instead of gathered values; same records expected.
    pmaptap.configure(gather_max_bytes=int(os.environ["GMB"]))
    out = os.environ["TAP"]
    p = jax.process_index()

    def body(x, c, own):
        # Identical on the devices of one process, different across hosts:
        # a value the copies are compared for (a mapped input, so not
        # proven alike), and an in_axes=None argument (proven alike at trace
        # time: one copy per process travels). The process index arrives as
        # DATA, never as a constant baked into the program: multi-controller
        # JAX needs the same program on every process, and on JAX 0.12 the
        # collectives of programs that differ between processes never meet
        # (the job hangs, with or without pmaptap).
        pmaptap.tap(own + 0 * x, "skew", dedup="replicated")
        pmaptap.tap(c * 1.0, "skew_arg", dedup="replicated")
        pmaptap.tap(jax.lax.pmean(x, "i"), "agree", dedup="replicated")
        return x

    runs = []
    for session_no in range(2):   # two sessions: two agreed run ids
        with pmaptap.Session(out) as s:
            f = jax.pmap(body, axis_name="i", in_axes=(0, None, 0))
            n = jax.local_device_count()
            own = jnp.full(n, p, jnp.float32)
            for step in range(3):
                f(jnp.ones(n) * step, jnp.float32(p), own).block_until_ready()
        runs.append(s.run)
    print("RUNS", json.dumps(runs), flush=True)
"""


@pytest.mark.parametrize("gather_max_bytes", [1 << 20, 0], ids=["gathered", "hashed"])
def test_cross_host_divergence_keeps_every_value(tmp_path, gather_max_bytes):
    tap = str(tmp_path / "div.jsonl")
    proc, _ = run_launch(
        2, 2, python_cmd(_DIVERGE), launcher_timeout=60, TAP=tap, GMB=str(gather_max_bytes)
    )
    assert proc.returncode == 0, job_failed(proc)
    runs = [
        json.loads(line.split(" ", 1)[1])
        for p in (0, 1)
        for line in prefixed(proc.stdout, p)
        if line.startswith("RUNS ")
    ]
    assert len(runs) == 2 and runs[0] == runs[1], runs  # agreed per session
    assert runs[0][0] != runs[0][1]  # fresh per session

    recs = pmaptap.read(tap)
    for run, name in [(run, name) for run in runs[0] for name in ("skew", "skew_arg")]:
        skew = [r for r in recs if r["run"] == run and r["name"] == name]
        # Both values of every step are in the file, each with its holders.
        assert sorted((r["step"], r["value"]) for r in skew) == [
            (s, v) for s in range(3) for v in (0.0, 1.0)
        ]
        for r in skew:
            p = int(r["value"])
            assert r["divergent"] is True  # read() reconciles
            if name == "skew":  # compared: who held it
                assert r["processes"] == [p]
                assert r["devices"] == [p * 2048, p * 2048 + 1]
            # skew_arg was proven alike by the program (in_axes=None), so
            # each process's record names every device; the file's
            # cross-process comparison still flags the two values.
    for run in runs[0]:
        agree = [r for r in recs if r["run"] == run and r["name"] == "agree"]
        assert sorted(r["step"] for r in agree) == [0, 1, 2]
        assert not any(r.get("divergent") for r in agree)
    # Even without read()'s reconciliation the raw file flags the
    # disagreement: whoever wrote second (or saw both values) marked it.
    with open(tap) as f:
        raw = [json.loads(line) for line in f]
    for run, name in [(run, name) for run in runs[0] for name in ("skew", "skew_arg")]:
        for step in range(3):
            flags = [
                r.get("divergent", False)
                for r in raw
                if r["run"] == run and r["name"] == name and r["step"] == step
            ]
            assert len(flags) == 2 and any(flags), (run, name, step, flags)


_SLOW_CLOSE = """
    import jax, jax.numpy as jnp, pmaptap, pmaptap.distributed as dist
    import os, sys, time, json
    dist.initialize()
    p = jax.process_index()
    s = pmaptap.Session(os.environ["TAP"],
                        close_timeout=float(os.environ["CLOSE_TIMEOUT"])).open()
    f = jax.pmap(lambda x: pmaptap.tap(x, "x", dedup="per_device"), axis_name="i")
    f(jnp.arange(2.0)).block_until_ready()
    if p == 1:
        time.sleep(float(os.environ["SLEEP"]))
        # A computation of this process alone (a pmap would wait for p0).
        g = jax.jit(lambda x: pmaptap.tap(x, "late", dedup="per_device"))
        g(jnp.arange(2.0)).block_until_ready()
    t0 = time.monotonic()
    # pmaptap's warnings go through logging: collect them (and configure
    # nothing else, so the fallback to stderr stays out of the way too).
    import logging
    caught = []
    class Collect(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                caught.append(record.getMessage())
    logging.getLogger("pmaptap").addHandler(Collect())
    s.close()
    took = time.monotonic() - t0
    names = [r["name"] for r in pmaptap.read(os.environ["TAP"])]
    print("CLOSED", json.dumps({"took": took, "late": names.count("late"),
                                "x": names.count("x"),
                                "warnings": caught}),
          flush=True)
"""


def _closed(proc, process: int) -> dict:
    lines = [line for line in prefixed(proc.stdout, process) if line.startswith("CLOSED ")]
    assert len(lines) == 1, job_failed(proc)
    return json.loads(lines[0].split(" ", 1)[1])


def test_close_waits_for_a_slow_process(tmp_path):
    tap = str(tmp_path / "slow.jsonl")
    proc, _ = run_launch(
        2, 2, python_cmd(_SLOW_CLOSE), launcher_timeout=60, TAP=tap, SLEEP="3", CLOSE_TIMEOUT="30"
    )
    assert proc.returncode == 0, job_failed(proc)
    fast = _closed(proc, 0)
    # Process 0's close returned only once process 1's records (tapped 3 s
    # later) were in the file.
    assert fast["late"] == 1 and fast["x"] == 4, fast
    assert fast["took"] > 1.5, fast
    assert fast["warnings"] == []
    assert _closed(proc, 1)["warnings"] == []


def test_close_timeout_warns_and_names_the_missing_process(tmp_path):
    tap = str(tmp_path / "late.jsonl")
    proc, _ = run_launch(
        2, 2, python_cmd(_SLOW_CLOSE), launcher_timeout=60, TAP=tap, SLEEP="6", CLOSE_TIMEOUT="1.5"
    )
    assert proc.returncode == 0, job_failed(proc)  # no hang, no exception
    fast = _closed(proc, 0)
    assert fast["took"] < 5, fast  # bounded by the timeout
    assert fast["late"] == 0, fast  # it did not wait longer
    assert len(fast["warnings"]) == 1, fast
    assert "process(es) 1 did not close" in fast["warnings"][0]
    # The late process finds everybody arrived: no warning, file complete.
    late = _closed(proc, 1)
    assert late["warnings"] == [] and late["late"] == 1 and late["x"] == 4


_CLOSED_AT_EXIT = """
    import jax, jax.numpy as jnp, pmaptap, pmaptap.distributed as dist
    import atexit, json, os, time
    dist.initialize()

    def report():   # registered first, so it runs after the session's close
        names = [r["name"] for r in pmaptap.read(os.environ["TAP"])]
        print("AT EXIT " + json.dumps({n: names.count(n) for n in ("x", "late")}),
              flush=True)

    atexit.register(report)
    s = pmaptap.Session(os.environ["TAP"]).open()
    f = jax.pmap(lambda x: pmaptap.tap(x, "x", dedup="per_device"), axis_name="i")
    f(jnp.arange(2.0)).block_until_ready()
    if jax.process_index() == 1:
        time.sleep(2)
        jax.jit(lambda x: pmaptap.tap(x, "late"))(jnp.float32(1)).block_until_ready()
    # No close(): interpreter exit closes the session, before JAX's own
    # exit handler shuts jax.distributed down.
"""


def test_session_left_open_is_closed_at_exit_with_the_barrier(tmp_path):
    tap = str(tmp_path / "exit.jsonl")
    proc, took = run_launch(2, 2, python_cmd(_CLOSED_AT_EXIT), launcher_timeout=60, TAP=tap)
    assert proc.returncode == 0, job_failed(proc)
    for p in (0, 1):
        lines = [line for line in prefixed(proc.stdout, p) if line.startswith("AT EXIT ")]
        assert len(lines) == 1, job_failed(proc)
        # Process 0's exit waited for process 1's late record.
        assert json.loads(lines[0][8:]) == {"x": 4, "late": 1}, lines
    # No pmaptap warning (they reach stderr through logging's fallback when
    # nothing is configured, as here; each names pmaptap).
    assert "pmaptap" not in proc.stderr.replace("[launch]", ""), proc.stderr
    assert took < 30


_SHUTDOWN_FIRST = """
    import jax, jax.numpy as jnp, pmaptap, pmaptap.distributed as dist, os
    dist.initialize()
    s = pmaptap.Session(os.environ["TAP"]).open()
    jax.pmap(lambda x: pmaptap.tap(x, "x"), axis_name="i")(jnp.arange(1.0))
    jax.distributed.shutdown()
    s.close()
    print("CLOSED", flush=True)
"""


def test_close_after_jax_distributed_shutdown_warns(tmp_path):
    tap = str(tmp_path / "shut.jsonl")
    proc, _ = run_launch(2, 1, python_cmd(_SHUTDOWN_FIRST), launcher_timeout=60, TAP=tap)
    assert proc.returncode == 0, job_failed(proc)
    for p in (0, 1):
        assert "CLOSED" in prefixed(proc.stdout, p)
        assert any("shut down before session" in line for line in prefixed(proc.stderr, p)), (
            proc.stderr
        )


_STUCK_IN_CLOSE = """
    import jax, jax.numpy as jnp, pmaptap, pmaptap.distributed as dist
    import os, sys, threading, time
    dist.initialize()
    s = pmaptap.Session(os.environ["TAP"], close_timeout=60).open()
    f = jax.pmap(lambda x: pmaptap.tap(x, "x", dedup="per_device"), axis_name="i")
    f(jnp.arange(2.0)).block_until_ready()
    s.flush()                               # its records are in the file
    if jax.process_index() == 1:
        time.sleep(60)                      # never closes in time

    def report_barrier():
        # Say when the main thread waits at the close barrier: its stack
        # (module, function) holds Session.close -> close_barrier ->
        # Event.wait (the barrier itself runs on a helper thread).
        main = threading.main_thread().ident
        want = {("session.py", "close"), ("distributed.py", "close_barrier"),
                ("threading.py", "wait")}
        while True:
            frame, names = sys._current_frames().get(main), set()
            while frame is not None:
                code = frame.f_code
                names.add((os.path.basename(code.co_filename), code.co_name))
                frame = frame.f_back
            if want <= names:
                print("IN BARRIER", flush=True)
                return
            time.sleep(0.01)

    threading.Thread(target=report_barrier, daemon=True).start()
    print(f"CLOSING {os.getpid()}", flush=True)
    s.close()
    print("CLOSED", flush=True)
"""


def test_sigterm_ends_a_close_that_waits_for_peers(tmp_path):
    """close() waiting at the barrier still lets SIGTERM in (the barrier
    runs off the main thread), so a launcher or scheduler can stop a
    process whose peer died without resorting to SIGKILL."""
    tap = str(tmp_path / "stuck.jsonl")
    launcher = start_launch(2, 2, python_cmd(_STUCK_IN_CLOSE), grace=3, TAP=tap)
    try:
        pid = None
        while pid is None:
            line = launcher.stdout.readline()
            assert line, launcher.stderr.read()
            if line.startswith("[p0] CLOSING "):
                pid = int(line.split()[-1])
        # Observably waiting at the barrier (process 0 reports its own stack).
        while line.strip() != "[p0] IN BARRIER":
            line = launcher.stdout.readline()
            assert line, launcher.stderr.read()
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pid_alive(pid), "SIGTERM did not end close()"
        out, err = launcher.communicate(timeout=30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert "[launch] process 0 was killed by SIGTERM" in err, err
    assert "[p0] CLOSED" not in out
    # Its records were written before (flush, and close writes before it
    # waits for the others).
    xs = [r for r in pmaptap.read(tap) if r["name"] == "x"]
    assert sorted(r["device"] for r in xs) == [0, 1, 2048, 2049]


_DIES = """
    import jax, jax.numpy as jnp, pmaptap, pmaptap.distributed as dist
    import os, signal
    dist.initialize()
    p = jax.process_index()
    s = pmaptap.Session(os.environ["TAP"]).open()

    def body(x):
        pmaptap.tap(x, "x", dedup="per_device")
        return pmaptap.tap(jax.lax.pmean(x, "i"), "mean", dedup="replicated")

    f = jax.pmap(body, axis_name="i")
    for step in range(50):
        if step == 3:
            s.flush()                          # steps 0-2 are in the file
            print("FLUSHED", flush=True)
            if p == 1:
                if os.environ["HOW"] == "exit":
                    os._exit(3)
                os.kill(os.getpid(), signal.SIGKILL)
        f(jnp.ones(jax.local_device_count()) * step).block_until_ready()
    s.close()
"""


@pytest.mark.parametrize(
    "how,status,words",
    [("exit", 3, "exited with status 3"), ("sigkill", 128 + 9, "was killed by SIGKILL")],
)
def test_process_dying_mid_run_stops_the_job_and_keeps_the_file(tmp_path, how, status, words):
    tap = str(tmp_path / "dies.jsonl")
    proc, took = run_launch(2, 2, python_cmd(_DIES), launcher_timeout=60, grace=2, TAP=tap, HOW=how)
    assert proc.returncode == status, job_failed(proc)
    assert f"[launch] process 1 {words}" in proc.stderr
    assert took < 30, f"launcher took {took:.1f}s to give up"
    recs = pmaptap.read(tap)  # readable (torn lines skipped)
    xs = [r for r in recs if r["name"] == "x" and r["step"] < 3]
    assert sorted((r["step"], r["device"]) for r in xs) == sorted(
        (s, d) for s in range(3) for d in (0, 1, 2048, 2049)
    )
    means = [r for r in recs if r["name"] == "mean" and r["step"] < 3]
    assert sorted(r["step"] for r in means) == [0, 1, 2]


def test_lone_process_runs_train_without_distributed(tmp_path):
    """No launcher, no cluster: initialize() does nothing, the script runs."""
    out = str(tmp_path / "alone.jsonl")
    proc = run_python(
        f"""
        import sys, runpy
        sys.argv = ["train.py", "--steps", "2", "--out", {out!r}]
        runpy.run_path("launch/train.py", run_name="__main__")
    """,
        devices=2,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "mode=single processes=1 devices=2" in proc.stdout
    recs = pmaptap.read(out)
    assert sorted(r["step"] for r in recs if r["name"] == "loss") == [0, 1]
    assert len([r for r in recs if r["name"] == "grad_norm"]) == 4


@pytest.mark.parametrize("variant", ["pmap", "shard_map"])
def test_train_tap_every_records_only_those_steps(tmp_path, variant):
    # --tap-every: the four taps of a step are decided on device, together;
    # the records are exactly the chosen steps' (8 devices, one process).
    import subprocess
    import sys

    from conftest import subprocess_env

    out = str(tmp_path / "every.jsonl")

    def train_cmd(*extra):
        return subprocess.run(
            [
                sys.executable,
                "launch/train.py",
                "--variant",
                variant,
                "--steps",
                "7",
                "--hidden",
                "8",
                "--out",
                out,
                "--no-summary",
                *extra,
            ],
            env=subprocess_env(8),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )

    proc = train_cmd("--tap-every", "3")
    assert proc.returncode == 0, proc.stderr
    recs = pmaptap.read(out)
    for name, per_step in (("grad_norm", 8), ("loss", 1), ("lr", 1), ("step", 1)):
        steps = sorted(r["step"] for r in recs if r["name"] == name)
        assert steps == sorted([0, 3, 6] * per_step), (name, steps)
    bad = train_cmd("--tap-every", "0")
    assert bad.returncode == 2 and "--tap-every" in bad.stderr
