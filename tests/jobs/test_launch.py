"""The local launcher (python -m pmaptap.launch) and pmaptap.distributed's
pure parts. The children here are plain Python (no JAX) unless a test needs
a real job, so these run in about a second each."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

import pmaptap
from conftest import job_failed, pid_alive, prefixed, python_cmd, run_launch, start_launch
from pmaptap import distributed, launch

_SHOW_ENV = """
    import json, os, sys
    keys = ["XLA_FLAGS", "JAX_PLATFORMS", "PMAPTAP_COORDINATOR",
            "PMAPTAP_COORDINATOR_BIND", "PMAPTAP_NUM_PROCESSES",
            "PMAPTAP_PROCESS_ID"]
    print("ENV " + json.dumps({k: os.environ.get(k) for k in keys}))
    print("to stderr", file=sys.stderr)
    sys.stdout.write("no newline at the end")
"""


def test_children_get_devices_env_and_prefixed_output():
    proc, _ = run_launch(
        3,
        2,
        python_cmd(_SHOW_ENV),
        launcher_timeout=30,
        XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_dump_to=/nonexistent",
    )
    assert proc.returncode == 0, job_failed(proc)
    envs = []
    for p in range(3):
        out = prefixed(proc.stdout, p)
        env_lines = [line for line in out if line.startswith("ENV ")]
        assert len(env_lines) == 1, job_failed(proc)
        envs.append(json.loads(env_lines[0][4:]))
        assert "no newline at the end" in out  # whole line, prefixed
        assert prefixed(proc.stderr, p) == ["to stderr"]
    for p, env in enumerate(envs):
        # The device count is replaced, other XLA flags kept.
        assert env["XLA_FLAGS"].split() == [
            "--xla_dump_to=/nonexistent",
            "--xla_force_host_platform_device_count=2",
        ]
        assert env["JAX_PLATFORMS"] == "cpu"
        assert env["PMAPTAP_NUM_PROCESSES"] == "3"
        assert env["PMAPTAP_PROCESS_ID"] == str(p)
    coords = {env["PMAPTAP_COORDINATOR"] for env in envs}
    assert len(coords) == 1
    host, port = coords.pop().rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0  # loopback only
    assert {env["PMAPTAP_COORDINATOR_BIND"] for env in envs} == {f"127.0.0.1:{port}"}
    # Every line on stdout came from a child (the launcher's own notes go to
    # stderr).
    assert all(line.startswith(("[p0] ", "[p1] ", "[p2] ")) for line in proc.stdout.splitlines())


_ONE_FAILS = """
    import os, signal, subprocess, sys, time
    me = int(os.environ["PMAPTAP_PROCESS_ID"])
    if me == 1:
        time.sleep(0.5)
        sys.exit(7)
    # Process 0 ignores SIGTERM and has a child of its own: both must die.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    grandchild = subprocess.Popen(["sleep", "300"])
    print(f"PIDS {os.getpid()} {grandchild.pid}", flush=True)
    time.sleep(300)
"""


def test_a_failing_child_stops_the_others_with_sigkill_after_grace():
    proc, took = run_launch(2, 1, python_cmd(_ONE_FAILS), launcher_timeout=60, grace=1, timeout=60)
    assert proc.returncode == 7, job_failed(proc)
    assert took < 15, took  # 0.5 s + 1 s grace + starts
    assert "[launch] process 1 exited with status 7; stopping process(es) 0" in proc.stderr
    assert "still running after 1s; sending SIGKILL" in proc.stderr
    pids = [line for line in prefixed(proc.stdout, 0) if line.startswith("PIDS")]
    assert pids, job_failed(proc)
    child, grandchild = map(int, pids[0].split()[1:])
    deadline = time.monotonic() + 5
    while (pid_alive(child) or pid_alive(grandchild)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(child) and not pid_alive(grandchild)


def test_timeout_stops_everything_with_status_124():
    sleeper = python_cmd("import time; print('up', flush=True); time.sleep(300)")
    proc, took = run_launch(2, 1, sleeper, launcher_timeout=1, grace=1, timeout=60)
    assert proc.returncode == launch.EXIT_TIMEOUT, job_failed(proc)
    assert "[launch] timeout after 1s" in proc.stderr
    assert took < 15, took


_WAITS = """
    import os, time
    print(f"PID {os.getpid()}", flush=True)
    try:
        time.sleep(300)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        raise SystemExit(1)
"""


@pytest.mark.parametrize("sig,status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_or_sigterm_to_the_launcher_stops_all_children(sig, status):
    launcher = start_launch(2, 1, python_cmd(_WAITS), grace=3)
    try:
        pids = []
        while len(pids) < 2:
            line = launcher.stdout.readline()
            assert line, launcher.stderr.read()
            if "PID " in line:
                pids.append(int(line.split("PID ")[1]))
        t0 = time.monotonic()
        launcher.send_signal(sig)
        out, err = launcher.communicate(timeout=20)
        took = time.monotonic() - t0
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == status, err
    assert f"received {signal.Signals(sig).name}" in err
    assert took < 5, took  # the children obeyed; no SIGKILL needed
    assert "sending SIGKILL" not in err
    if sig == signal.SIGINT:  # forwarded as Ctrl-C to each child
        assert out.count("interrupted") == 2, out
    assert not any(pid_alive(p) for p in pids)


def test_usage_errors():
    with pytest.raises(SystemExit):
        launch.parse_args(["--processes", "2", "--devices", "1"])  # no command
    with pytest.raises(SystemExit):
        launch.parse_args(["--processes", "0", "--devices", "1", "--", "true"])
    args = launch.parse_args(
        ["-p", "2", "-d", "4", "--timeout", "9", "--", "python", "x.py", "--steps", "3"]
    )
    assert (args.processes, args.devices, args.timeout) == (2, 4, 9.0)
    assert args.command == ["python", "x.py", "--steps", "3"]


def test_a_child_that_cannot_start_is_reported():
    proc, _ = run_launch(2, 1, ["/nonexistent/program"], launcher_timeout=30)
    assert proc.returncode != 0
    assert "cannot start '/nonexistent/program'" in proc.stderr


# ------------------------------------------------------- pmaptap.distributed


def test_launcher_settings_are_validated():
    assert distributed.launcher_settings({}) is None
    env = {
        "PMAPTAP_COORDINATOR": "127.0.0.1:1234",
        "PMAPTAP_NUM_PROCESSES": "2",
        "PMAPTAP_PROCESS_ID": "1",
    }
    assert distributed.launcher_settings(env) == ("127.0.0.1:1234", 2, 1, None)
    with pytest.raises(distributed.DistributedError, match="must be in"):
        distributed.launcher_settings({**env, "PMAPTAP_PROCESS_ID": "2"})
    with pytest.raises(distributed.DistributedError, match="must be integers"):
        distributed.launcher_settings({**env, "PMAPTAP_NUM_PROCESSES": "two"})


def test_cluster_detection():
    slurm = {
        "SLURM_JOB_ID": "7",
        "SLURM_NTASKS": "4",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_STEP_NODELIST": "node[1-4]",
    }
    assert distributed.detect_cluster(slurm) == ("SLURM", None)
    # One task: nobody to connect to.
    assert distributed.detect_cluster({**slurm, "SLURM_NTASKS": "1"}) is None
    assert distributed.detect_cluster({"OMPI_MCA_orte_hnp_uri": "1.0;tcp://x:1"}) == (
        "Open MPI",
        None,
    )
    # Every pod has KUBERNETES_SERVICE_HOST; a notebook pod is not a job.
    assert distributed.detect_cluster({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}) is None
    assert distributed.detect_cluster({}) is None


def test_lone_process_needs_no_coordination(monkeypatch):
    for k in (
        "PMAPTAP_COORDINATOR",
        "SLURM_JOB_ID",
        "OMPI_MCA_orte_hnp_uri",
        "TPU_WORKER_HOSTNAMES",
        "MEGASCALE_COORDINATOR_ADDRESS",
        "JOB_COMPLETION_INDEX",
        "OMPI_COMM_WORLD_SIZE",
        "PMI_SIZE",
    ):
        monkeypatch.delenv(k, raising=False)
    assert distributed.initialize() == "single"
    assert distributed.agree_run_id(lambda: "x") is None
    distributed.close_barrier("r", timeout=0.1)  # returns at once


def test_initialize_after_jax_started_says_what_to_do(monkeypatch):
    import jax

    jax.devices()  # the backend exists now
    monkeypatch.setenv("PMAPTAP_COORDINATOR", "127.0.0.1:1")
    monkeypatch.setenv("PMAPTAP_NUM_PROCESSES", "2")
    monkeypatch.setenv("PMAPTAP_PROCESS_ID", "1")
    with pytest.raises(distributed.DistributedError, match="very top"):
        distributed.initialize()


_NO_INITIALIZE = """
    import sys, jax, jax.numpy as jnp, pmaptap
    path = sys.argv[1]
    with pmaptap.Session(path):             # no pmaptap.distributed.initialize()
        for step in range(2):
            jax.jit(lambda x: pmaptap.tap(x * 2, "y"))(jnp.float32(step))
            pmaptap.tap(1.0, "eager", step=step)
    print("DONE", jax.process_count(), jax.process_index())
"""


def test_a_launched_process_that_never_initializes_is_told_once(tmp_path):
    # Both processes of a real `pmaptap launch` job skip initialize(): JAX
    # sees 1 process in each, so they wrote two runs, both "process 0",
    # with no word. Each now says so once (session open, then taps: once).
    path = str(tmp_path / "run.jsonl")
    proc, _ = run_launch(2, 2, [*python_cmd(_NO_INITIALIZE), path], launcher_timeout=120)
    assert proc.returncode == 0, job_failed(proc)
    for p in range(2):
        assert prefixed(proc.stdout, p) == ["DONE 1 0"], job_failed(proc)
        said = [line for line in prefixed(proc.stderr, p) if "initialize()" in line]
        assert len(said) == 1, job_failed(proc)
        assert f"started by `pmaptap launch` as process {p} of 2" in said[0]
        assert "Call pmaptap.distributed.initialize() first thing" in said[0]
    assert {r["process"] for r in pmaptap.read(path)} == {0}
    assert len({r["run"] for r in pmaptap.read(path)}) == 2


def test_a_lone_process_is_not_told(monkeypatch, caplog):
    # No launcher variables (this test process): nothing to say.
    monkeypatch.delenv(distributed.ENV_COORDINATOR, raising=False)
    monkeypatch.setattr(distributed, "_alone_checked", False)
    with caplog.at_level("WARNING", logger="pmaptap"):
        distributed.warn_if_launched_alone()
    assert not caplog.records


def test_free_port_is_bindable_on_loopback():
    import socket

    port = launch.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
    assert os.environ.get("PMAPTAP_COORDINATOR") is None


def _forwarded(prefix: bytes, parts) -> bytes:
    """What a launcher's forwarder makes of a child's stream written in
    ``parts``, each its own write (and read)."""
    import io

    r, w = os.pipe()
    out = io.BytesIO()
    f = launch._Forwarder(os.fdopen(r, "rb"), out, prefix, threading.Lock())
    f.start()
    for part in parts:
        os.write(w, part)
        time.sleep(0.03)
    os.close(w)
    f.join(10)
    return out.getvalue()


def test_a_gloo_chatter_line_torn_by_another_thread_leaves_no_fragment():
    """Two gloo threads write their chatter at once: one's line carries the
    other's start, its own count and newline arrive alone ("1\\n", or a bare
    "\\n"); those fragments are dropped with the chatter (before: a lone
    "[p0] 1" or "[p0] " line in the job's output, seen failing a test that
    reads it). A job's own blank lines and numbers are kept."""
    chatter = (
        b"[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : "
    )
    parts = (chatter + chatter + b"1\n", b"1\n", chatter + b"1\n", b"\n", b"7\n\nDONE\n")
    assert _forwarded(b"[p0] ", parts) == b"[p0] 7\n[p0] \n[p0] DONE\n"


def test_a_job_line_written_inside_gloo_chatter_is_forwarded():
    """gloo writes its chatter a piece at a time; a job's line printed
    meanwhile lands between two pieces, in a segment that holds the
    chatter's tail. It is forwarded, the chatter's pieces taken out (before:
    the segment was dropped whole, and the job's line with it: a test saw
    process 1's "OPENED myrun 0" missing)."""
    pieces = (
        b"[Gloo] Rank ", b"1", b" is connected to ", b"1", b" peer ranks. ",
        b"Expected number of connected peer ranks is : ", b"OPENED myrun 0\n", b"1", b"\n",
        b"[Gloo] Rank 1 is connected to 1 peer ranks. ",
        b"Expected number of connected peer ranks is : 1\n",
        b"DONE\n",
    )  # fmt: skip
    assert _forwarded(b"[p1] ", pieces) == b"[p1] OPENED myrun 0\n[p1] DONE\n"


def test_carriage_returns_are_forwarded_re_prefixed_and_gloo_chatter_dropped():
    code = (
        "import sys; sys.stderr.write('\\r[#---] 1/4\\r[####] 4/4\\n'); "
        "print('[Gloo] Rank 0 is connected to 3 peer ranks. Expected number of "
        "connected peer ranks is : 3'); print('real output')"
    )
    proc, _ = run_launch(1, 1, python_cmd(code), launcher_timeout=30)
    assert proc.returncode == 0, job_failed(proc)
    # A progress bar redrawn with "\r" stays in place on a terminal: each
    # redraw is re-prefixed (text mode shows the "\r" as a line break), and
    # the bare leading "\r" prints no lone prefix.
    assert proc.stderr.splitlines() == ["[p0] [#---] 1/4", "[p0] [####] 4/4"]
    assert "connected peer ranks" not in proc.stdout
    assert "[p0] real output" in proc.stdout
