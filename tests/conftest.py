"""Shared test helpers. Every test process sees 8 simulated CPU devices."""

from __future__ import annotations

import ast
import contextlib
import functools
import os
import subprocess
import sys
import textwrap

# Must happen before jax is imported anywhere in the test process.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def package_sources(sub: str = "") -> list[tuple[str, ast.Module]]:
    """(path from the repository root, parsed module) of every .py file of
    the pmaptap package, or of its subpackage ``sub``, in path order: what
    the tests that read the source itself walk."""
    import ast

    top = os.path.join(ROOT, "pmaptap", sub)
    paths = sorted(
        os.path.join(d, f) for d, _, files in os.walk(top) for f in files if f.endswith(".py")
    )
    return [(os.path.relpath(p, ROOT), ast.parse(open(p, encoding="utf-8").read())) for p in paths]


@pytest.fixture
def tap_path(tmp_path):
    """A fresh tap file path inside a per-test directory."""
    return str(tmp_path / "taps" / "run.jsonl")


@pytest.fixture
def session(tap_path):
    """An open session on tap_path, closed after the test."""
    import pmaptap

    s = pmaptap.Session(tap_path, run="test").open()
    yield s
    s.close()


@pytest.fixture
def spy_deliveries(monkeypatch):
    """Watch what reaches the host: ``spy_deliveries(what)`` returns a list
    that gets ``what(spec, arrays)`` for every host callback of pmaptap.tap
    (the spec's name by default; with ``extend=True`` ``what`` returns
    several items), the callback still delivered as usual."""
    from pmaptap._trace import layouts

    real = layouts.deliver

    def install(what=lambda spec, arrays: spec.name, extend=False):
        seen: list = []

        def spy(spec, arrays):
            (seen.extend if extend else seen.append)(what(spec, arrays))
            real(spec, arrays)

        # layouts.py imported deliver by name: its entry point is spied on.
        monkeypatch.setattr(layouts, "deliver", spy)
        return seen

    return install


TRANSPORTS = ("callback", "outputs")


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "callback_only(why): a test of the host-callback transport itself, or one "
        "the `transport` fixture cannot change (its steps run in a subprocess, or "
        "it has no jit/pmap step): not run again under the output transport",
    )


def pytest_generate_tests(metafunc):
    # Modules that use the `transport` fixture run every test twice: taps as
    # host callbacks (jax.jit / jax.pmap) and as step outputs (pmaptap.jit /
    # pmaptap.pmap), the same assertions on the same records.
    if "transport" in metafunc.fixturenames:
        only = metafunc.definition.get_closest_marker("callback_only")
        metafunc.parametrize("transport", TRANSPORTS[:1] if only else TRANSPORTS, indirect=True)


@pytest.fixture
def transport(request, monkeypatch):
    """Which transport the test's steps use: with "outputs", ``jax.jit`` and
    ``jax.pmap`` called in the test are ``pmaptap.jit`` / ``pmaptap.pmap``
    (functions jitted where a module is imported keep JAX's own)."""
    if request.param == "outputs":
        import jax

        import pmaptap

        monkeypatch.setattr(jax, "jit", pmaptap.jit)
        monkeypatch.setattr(jax, "pmap", pmaptap.pmap)
    return request.param


@pytest.fixture
def hcb_drained():
    """host_callback tests start and end with nothing queued and no
    unreported tap error: a test that leaves one behind fails here, not in a
    neighbour (files use it through ``pytestmark``)."""
    from pmaptap import host_callback as hcb

    hcb.barrier_wait()
    yield
    hcb.barrier_wait()


@pytest.fixture
def checks():
    """JAX's own jaxpr checker (``jax_enable_checks``) on for the test,
    restored after it."""
    import jax

    before = jax.config.jax_enable_checks
    jax.config.update("jax_enable_checks", True)
    yield
    jax.config.update("jax_enable_checks", before)


def subprocess_env(devices: int = 8, **extra: str) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def run_python(
    code: str, *, devices: int = 8, timeout: float = 120, check: bool = True, **env: str
) -> subprocess.CompletedProcess:
    """Run a dedented Python snippet in a fresh interpreter."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=subprocess_env(devices, **env),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"subprocess failed ({proc.returncode}):\n"
            f"STDOUT:\n{proc.stdout}\nSTDERR:\n{proc.stderr}"
        )
    return proc


def start_python(
    code: str, *, devices: int = 8, stdin: bool = False, **env: str
) -> subprocess.Popen:
    """Start a dedented Python snippet; caller waits/kills. ``stdin=True``
    gives it a stdin pipe (to pace it from the test)."""
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=subprocess_env(devices, **env),
        cwd=ROOT,
        stdin=subprocess.PIPE if stdin else None,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def by_key(records, *keys):
    """Index records by a tuple of fields (order-independent comparisons)."""
    return {
        tuple(
            r.get(k) if not isinstance(r.get(k), dict) else tuple(sorted(r[k].items()))
            for k in keys
        ): r
        for r in records
    }


def record_dict(**fields) -> dict:
    """A record as the JSON object of one tap-file line, for hand-written
    files: a scalar int32 ``1`` of tap "a" at step 0 (run "r", process 0,
    host "h", time 1.0; ``replicas=1`` when replicated), ``fields`` replacing
    or adding to it."""
    d = {
        "run": "r",
        "name": "a",
        "step": 0,
        "kind": fields.get("kind", "replicated"),
        "value": 1,
        "dtype": "int32",
        "shape": [],
        "process": 0,
        "time": 1.0,
        "host": "h",
    }
    if d["kind"] == "replicated":
        d["replicas"] = 1
    d.update(fields)
    return d


def shard_record(step: int, process: int = 3):
    """A per_device ``Record`` of tap "x" at ``step`` from ``process`` (value
    and time the step), as a shard writer in the tests writes it."""
    from pmaptap.tapfile.record.format import Record

    return Record(
        **record_dict(
            name="x",
            kind="per_device",
            step=step,
            value=step,
            time=step,
            process=process,
            device=process,
            coords={},
        )
    )


def per_device_dict(step: int, device, value, name: str = "g", **fields) -> dict:
    """A per_device float32 record of ``device`` on mesh axis "dp"."""
    base = dict(
        name=name,
        step=step,
        kind="per_device",
        value=value,
        dtype="float32",
        device=device,
        coords={"dp": device},
    )
    return record_dict(**{**base, **fields})


def replicated_dict(step: int, value, name: str = "loss", **fields) -> dict:
    """A replicated float32 record seen by devices 0-3, its vhash the step's."""
    base = dict(
        name=name,
        step=step,
        value=value,
        dtype="float32",
        replicas=4,
        devices=[0, 1, 2, 3],
        vhash=f"{step:x}",
    )
    return record_dict(**{**base, **fields})


# ---------------------------------------------------------------- multi-process
# Jobs started through the local launcher (python -m pmaptap.launch).


def launch_cmd(
    processes: int,
    devices: int,
    command: list[str],
    *,
    timeout: float | None = None,
    grace: float | None = None,
    restarts: int | None = None,
) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "pmaptap.launch",
        "--processes",
        str(processes),
        "--devices",
        str(devices),
    ]
    if timeout is not None:
        cmd += ["--timeout", str(timeout)]
    if grace is not None:
        cmd += ["--grace", str(grace)]
    if restarts is not None:
        cmd += ["--restarts", str(restarts)]
    return cmd + ["--"] + list(command)


def python_cmd(code: str) -> list[str]:
    """A command that runs a dedented Python snippet (for the launcher)."""
    return [sys.executable, "-c", textwrap.dedent(code)]


def demo_model():
    """launch/model.py, the demo job's model and data (launch/ is no
    package: loaded by path, once)."""
    global _DEMO_MODEL
    if _DEMO_MODEL is None:
        import importlib.util

        spec = importlib.util.spec_from_file_location(
            "pmaptap_demo_model", os.path.join(ROOT, "launch", "model.py")
        )
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _DEMO_MODEL = mod
    return _DEMO_MODEL


_DEMO_MODEL = None


def expected_step0_grad_norm(shard: int, batch: int) -> float:
    """The demo job's gradient norm of data shard ``shard`` at step 0 (initial
    params, ``batch`` examples a device): what its grad_norm tap must hold."""
    import jax

    model = demo_model()
    params = model.init_params(0)
    x, y = model.make_batch(0, 0, shard, batch)
    return float(model.grad_norm(jax.grad(model.loss_fn)(params, x, y)))


def train_argv(out: str, *extra: str, steps: int, batch: int = 4) -> list[str]:
    """The command of the demo training job (launch/train.py) writing ``out``."""
    return [
        "python",
        "launch/train.py",
        "--steps",
        str(steps),
        "--batch-per-device",
        str(batch),
        "--out",
        out,
        *extra,
    ]


def run_launch(
    processes: int,
    devices: int,
    command: list[str],
    *,
    timeout: float = 120,
    launcher_timeout: float | None = None,
    grace: float | None = None,
    restarts: int | None = None,
    **env: str,
) -> tuple[subprocess.CompletedProcess, float]:
    """Run a launcher job to completion; returns (result, seconds taken)."""
    import time

    t0 = time.monotonic()
    proc = subprocess.run(
        launch_cmd(
            processes, devices, command, timeout=launcher_timeout, grace=grace, restarts=restarts
        ),
        env=subprocess_env(1, **env),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc, time.monotonic() - t0


def start_launch(
    processes: int, devices: int, command: list[str], *, grace: float | None = None, **env: str
) -> subprocess.Popen:
    return subprocess.Popen(
        launch_cmd(processes, devices, command, grace=grace),
        env=subprocess_env(1, **env),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def job_failed(proc: subprocess.CompletedProcess) -> str:
    """Assertion message showing a launcher job's output."""
    return f"launcher exited {proc.returncode}\nSTDOUT:\n{proc.stdout}\nSTDERR:\n{proc.stderr}"


def prefixed(output: str, process: int) -> list[str]:
    """The lines a launcher forwarded from one process, prefix removed."""
    tag = f"[p{process}] "
    return [line[len(tag) :] for line in output.splitlines() if line.startswith(tag)]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is not running any more; only its parent has not reaped it.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# Bad tap arguments shared by tap and tap_grad: (kwargs, exception, message).
BAD_TAP_ARGS = [
    (dict(name=""), ValueError, "non-empty"),
    (dict(name=3), TypeError, "must be a str"),
    (dict(name="x", dedup="unique"), ValueError, "'auto', 'replicated', 'per_device'"),
    (dict(name="x", every=0), ValueError, "every must be >= 1"),
    (dict(name="x", every=1.5), TypeError, "every must be an int"),
    (dict(name="x", step=1.5), TypeError, "step must be"),
    (dict(name="x", step=-1), ValueError, "step must be >= 0"),
]


# A writer for run_released: N records of the tap "w<WID>" (values
# arange(4) + i), released by the file GO; LOCK picks the lock mode.
# Independent processes (no JAX job between them) appending to one file:
# each its own run, as a fixed run id that the file already ends with is
# refused at open (two stories of one run).
APPENDER = """
    import os, jax, jax.numpy as jnp, pmaptap
    go = os.environ["GO"]
    with pmaptap.Session(os.environ["TAP"], run="many-" + os.environ["WID"],
                         lock=os.environ["LOCK"],
                         flush_interval=0.001) as s:
        f = jax.jit(lambda v: pmaptap.tap(v, "w" + os.environ["WID"], dedup="per_device"))
        f(jnp.arange(4.0))                      # compile before the start line
        s.flush()
        print("ready", flush=True)
        while not os.path.exists(go):
            pass
        for i in range(1, int(os.environ["N"])):
            f(jnp.arange(4.0) + i)
"""


def run_released(code: str, count: int, *, timeout: float = 240, **env: str) -> list:
    """Start `count` copies of a snippet that prints "ready" and then waits
    for the file env["GO"]; release them together; wait for all to exit 0.
    Stragglers are killed. Returns the finished Popen objects."""
    procs = [start_python(code, devices=1, WID=str(w), **env) for w in range(count)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready", p.stderr.read()
        open(env["GO"], "w").close()  # release them together
        for p in procs:
            assert p.wait(timeout) == 0, p.stderr.read()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return procs


# ---------------------------------------------------------------- faults
# Helpers of the fault-injection suite (test_faults.py, test_bad_input.py).


def wandb_records(run_dir) -> list[dict]:
    """Every record of an offline W&B run (its ``run``, ``history`` rows,
    ``exit``...), read with W&B's own reader of its .wandb transaction log
    (``wandb leet inspect --json``)."""
    import glob
    import json

    (log,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", log],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def wandb_history(run_dir) -> list[dict]:
    """The history rows of an offline W&B run (``wandb_records``)."""
    return [r["history"]["item"] for r in wandb_records(run_dir) if r.get("type") == "history"]


def wait_for(condition, timeout: float, what: str, interval: float = 0.01):
    """Poll ``condition()`` until it returns something truthy (returned);
    AssertionError naming ``what`` after ``timeout`` seconds. For waiting on
    a real condition (a file grew, a process printed), never a fixed sleep."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        got = condition()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


_MOUNT_NS: list[bool] = []


def mount_namespace_available() -> bool:
    """Whether this machine lets a test mount a private tmpfs / read-only bind
    (root with CAP_SYS_ADMIN and unshare(1), as in a container run as root).
    Mounts made this way vanish with the process and never touch the host."""
    if not _MOUNT_NS:
        import shutil
        import tempfile

        ok = False
        if shutil.which("unshare") and hasattr(os, "geteuid") and os.geteuid() == 0:
            with tempfile.TemporaryDirectory() as d:
                try:
                    ok = (
                        subprocess.run(
                            [
                                "unshare",
                                "-m",
                                "--propagation",
                                "private",
                                "sh",
                                "-c",
                                f"mount -t tmpfs -o size=64k tmpfs '{d}'",
                            ],
                            capture_output=True,
                            timeout=30,
                        ).returncode
                        == 0
                    )
                except (OSError, subprocess.SubprocessError):
                    ok = False
        _MOUNT_NS.append(ok)
    return _MOUNT_NS[0]


def run_in_mount_namespace(
    setup: str, code: str, *, devices: int = 1, timeout: float = 120, **env: str
) -> subprocess.CompletedProcess:
    """Run shell ``setup`` (e.g. ``mount -t tmpfs -o size=64k tmpfs "$DIR"``)
    and then a dedented Python snippet, in a private mount namespace. The
    snippet must copy out whatever the test wants to inspect: its mounts are
    gone once it exits."""
    cmd = [
        "unshare",
        "-m",
        "--propagation",
        "private",
        "sh",
        "-c",
        setup + ' && exec "$0" -c "$1"',
        sys.executable,
        textwrap.dedent(code),
    ]
    return subprocess.run(
        cmd,
        env=subprocess_env(devices, **env),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# ---------------------------------------------------------------- logging
@contextlib.contextmanager
def logs_warning(caplog, match: str | None = None, *, count: int | None = None):
    """Assert that the block logs a WARNING (or worse) through the "pmaptap"
    logger, matching ``match`` (a regex), ``count`` times if given. pmaptap's
    own messages go through logging, not the warnings module."""
    import logging
    import re

    with caplog.at_level(logging.WARNING, logger="pmaptap"):
        start = len(caplog.records)
        yield
        msgs = [
            r.getMessage()
            for r in caplog.records[start:]
            if r.name.split(".")[0] == "pmaptap" and r.levelno >= logging.WARNING
        ]
    hits = [m for m in msgs if match is None or re.search(match, m, re.S)]
    assert hits, f"no pmaptap warning matching {match!r} was logged; got {msgs}"
    if count is not None:
        assert len(hits) == count, hits


# The pmaptap command, run as a user runs it, and its tables (test_cli.py,
# test_frame.py, test_corrupt.py, test_summary_hunt.py use them).
def cli(
    *args: str, timeout: float = 60, cwd: str | None = None, **env: str
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pmaptap", *args],
        env=subprocess_env(8, **env),
        cwd=cwd or ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def aligned_table(stdout: str) -> tuple[str, list[dict[str, str]]]:
    """Parse an aligned table: columns are the runs of text between
    positions that are blank on every line (a run without a header word,
    from a cell with a space in it, belongs to the column before)."""
    lines = stdout.splitlines()
    header, width = lines[0], max(map(len, lines))
    gap = [all(p >= len(ln) or ln[p] == " " for ln in lines) for p in range(width)]
    cols: list[list] = []
    p = 0
    while p < width:
        if gap[p]:
            p += 1
            continue
        q = p
        while q < width and not gap[q]:
            q += 1
        word = header[p:q].strip()
        if word:
            cols.append([word, p, q])
        else:
            cols[-1][2] = q
        p = q
    return header, [{n: ln[a:b].strip() for n, a, b in cols} for ln in lines[1:]]


@functools.cache
def _slow_number():
    import jax
    import jax.numpy as jnp

    @jax.jit
    def number(x, k):
        for _ in range(20):
            x = jnp.tanh(x @ x)
        return (jnp.sum(x) * 0).astype(jnp.int32) + k

    return number, jnp.eye(512) * 0.5


def computed_step_number(k: int):
    """``k`` as an int32 jax.Array that the device is still computing when
    this returns (a few ms of matrix products come first): a step number in
    flight at the call it is handed to."""
    number, big = _slow_number()
    return number(big, k)
