"""Timing helpers shared by the benchmarks: every arm runs inside one process,
arms interleaved round by round, medians over rounds, and ratios of *added*
cost (arm minus the no-callback baseline) against a raw jax.debug.callback
arm and against the floor (``floor_callback``) measured in the same run,
paired per round."""

from __future__ import annotations

import gc
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Callable


def main_quick(run, devices: int) -> None:
    """A benchmark's ``__main__``: ``--quick`` (a few rounds, to check it
    runs), ``devices`` simulated CPU devices, then ``run(quick=...)``."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a few rounds, to check it runs")
    args = ap.parse_args()
    set_devices(devices)
    run(quick=args.quick)


def set_devices(n: int) -> None:
    """Must run before jax is imported."""
    if "jax" in sys.modules:
        raise RuntimeError("set_devices() must be called before importing jax")
    flags = [
        f
        for f in os.environ.get("XLA_FLAGS", "").split()
        if "force_host_platform_device_count" not in f
    ]
    flags.append(f"--xla_force_host_platform_device_count={n}")
    os.environ["XLA_FLAGS"] = " ".join(flags)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def interleaved_rounds(
    arms: dict[str, Callable[[], None]], *, rounds: int, steps: int
) -> dict[str, list[float]]:
    """Seconds per step of each arm, one entry per round. Each call of an arm
    runs `steps` steps and must wait for their completion (including host
    callbacks). Arms run interleaved, in alternating order, so entry r of
    every arm saw about the same load on the machine: ratios taken per round
    (``paired``) cancel most of a shared machine's drift."""
    for fn in arms.values():  # warm up: compile, first file writes
        fn()
    return wall_and_cpu_rounds(arms, rounds=rounds, steps=steps)[0]


def wall_and_cpu_rounds(
    arms: dict[str, Callable[[], None]], *, rounds: int, steps: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """``interleaved_rounds``' rounds without its warm-up (the caller's, who
    can then take stock of what the warm-up wrote): seconds per step of each
    arm, one entry per round, of wall time and of this process's CPU time
    (``time.process_time``, which a busy machine stretches far less)."""
    wall: dict[str, list[float]] = {k: [] for k in arms}
    cpu: dict[str, list[float]] = {k: [] for k in arms}
    for r in range(rounds):
        order = list(arms.items())
        if r % 2:
            order.reverse()  # no arm always runs after the same one
        for name, fn in order:
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            cpu[name].append((time.process_time() - c0) / steps)
            wall[name].append((time.perf_counter() - t0) / steps)
    return wall, cpu


def interleaved(
    arms: dict[str, Callable[[], None]], *, rounds: int, steps: int
) -> dict[str, float]:
    """Median seconds per step of each arm (see ``interleaved_rounds``)."""
    return medians(interleaved_rounds(arms, rounds=rounds, steps=steps))


def medians(times: dict[str, list[float]]) -> dict[str, float]:
    return {k: statistics.median(v) for k, v in times.items()}


def ratio(med: dict[str, float], arm: str, raw: str, base: str) -> float:
    added_raw = med[raw] - med[base]
    if added_raw <= 0:
        return float("nan")
    return (med[arm] - med[base]) / added_raw


def round_ratios(
    times: dict[str, list[float]], arm: str, ref: str, base: str | None = None
) -> list[float]:
    """Each round's ratio of ``arm`` to ``ref``: of their added costs over
    ``base`` when given (rounds where ``ref`` added nothing are left out),
    else of their times."""
    out = []
    for r in range(len(times[arm])):
        a, b = times[arm][r], times[ref][r]
        if base is not None:
            a, b = a - times[base][r], b - times[base][r]
        if b > 0:
            out.append(a / b)
    return out


def paired(times: dict[str, list[float]], arm: str, ref: str, base: str | None = None) -> float:
    """Median over rounds of ``round_ratios``."""
    out = round_ratios(times, arm, ref, base)
    return statistics.median(out) if out else float("nan")


def floor_callback(axis: str, *payload, when=None) -> None:
    """THE FLOOR: the least JAX allows to see a value on the host every step.
    ONE raw ``jax.debug.callback`` per host, from its first device (axis
    index 0 of a single-process pmap), inside ``lax.cond``, carrying
    ``payload``; benchmarks pass arrays of the same shapes and dtypes as the
    one callback pmaptap makes (built by broadcasting, not gathered: the
    floor has no collective). ``when``: a traced bool that must also hold
    (an ``every`` decided on device)."""
    import jax
    from jax import lax

    first = lax.axis_index(axis) == 0
    lax.cond(
        first if when is None else first & when,
        lambda: jax.debug.callback(_nothing, *payload),
        lambda: None,
    )


def _nothing(*_) -> None:
    return None


def sharded_linspace(mesh, rows: int, cols: int):
    """A float32 (rows, cols) array sharded over both axes of a 2-D mesh:
    the activation of the per-shard benchmarks."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    return jax.device_put(
        jnp.linspace(0.0, 1.0, rows * cols, dtype=jnp.float32).reshape(rows, cols),
        NamedSharding(mesh, P(*mesh.axis_names)),
    )


def activation_step(kind: str):
    """A jitted step making an activation of its input: ``"base"`` taps
    nothing, ``"raw"`` hands it to a raw ``jax.debug.callback(partitioned=
    True)`` (one call per shard, doing nothing), ``"tap"`` taps it per
    device with pmaptap (one record per shard)."""
    import jax
    import jax.numpy as jnp

    import pmaptap

    @jax.jit
    def step(v):
        y = jnp.tanh(v) * 1.0001
        if kind == "raw":
            jax.debug.callback(_nothing, y, partitioned=True)
        elif kind == "tap":
            pmaptap.tap(y, "act", dedup="per_device")
        return y

    return step


def steps_arm(fn, x, steps: int, finish: Callable[[], None]) -> Callable[[], None]:
    """One round of an arm: ``steps`` calls of ``fn(x)``, the last result
    (any pytree of arrays, or None) waited for, then ``finish()`` (a
    session's flush, whose records and bytes are then written, or
    ``jax.effects_barrier`` for raw callbacks)."""
    import jax

    def go() -> None:
        y = None
        for _ in range(steps):
            y = fn(x)
        jax.block_until_ready(y)
        finish()

    return go


def settled() -> None:
    """Python's garbage collected to the end before a timed compile: each
    arm then pays for its own trace's garbage, not for the arms' before it
    (a full collection lands on whichever trace crosses the collector's
    threshold, and moved one arm's trace by 0.1-0.4 s between rounds), and
    a program pmaptap compiles on a thread of its own after a step (the
    fingerprint's, _outputs/later.py) done: its compile is the arm's that
    started it, not the next arm's to share the cores with."""
    for t in threading.enumerate():
        if t.name == "pmaptap-compile":
            t.join()
    gc.collect()


def machine() -> str:
    import jax

    return (
        f"{platform.machine()} {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, JAX {jax.__version__}, "
        f"{jax.default_backend()} backend"
    )


def spread(xs: list[float], unit: str = "", scale: float = 1.0, digits: int = 2) -> str:
    """A figure of several rounds as the benchmarks print it: the median
    (times ``scale``, ``unit`` after it) and, of several, ``(least-most)``."""

    def f(x: float) -> str:
        return f"{x * scale:.{digits}f}"

    mid = f(statistics.median(xs)) + unit
    return mid if len(xs) < 2 else f"{mid} ({f(min(xs))}-{f(max(xs))})"


def table(rows: list[tuple], header: tuple) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*header), fmt.format(*["-" * w for w in widths])]
    out += [fmt.format(*[str(x) for x in row]) for row in rows]
    return "\n".join(out)


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


# The reading benchmarks' yardstick: orjson over every line of one file, in
# a fresh interpreter (``python -c BARE_ORJSON_LOOP FILE``), nothing checked.
BARE_ORJSON_LOOP = (
    "import sys, orjson\n"
    "n = 0\n"
    "with open(sys.argv[1], 'rb') as f:\n"
    "    for line in f:\n"
    "        orjson.loads(line)\n"
    "        n += 1\n"
    "print(n)\n"
)


def compile_bytecode() -> None:
    """Write pmaptap's bytecode caches (``__pycache__``, git-ignored), as an
    installed package has them, so that a command measured in a fresh
    process starts as a user's does: where PYTHONDONTWRITEBYTECODE is set
    (this box sets it), an editable checkout would compile every module from
    source at every start (docs/performance.md has what that cost the
    readers), which the bare loops they are compared with never pay."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", os.path.join(root, "pmaptap")],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )


def measure_process(
    cmd: list[str], *, cwd: str, env: dict | None = None, ok: tuple[int, ...] = (0,)
) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of one command in its own process; a
    RuntimeError with its stderr if it exits with a status not in ``ok``.
    Call compile_bytecode() once first."""
    wall, _, rss = measure_process_times(cmd, cwd=cwd, env=env, ok=ok)
    return wall, rss


def measure_process_times(
    cmd: list[str], *, cwd: str, env: dict | None = None, ok: tuple[int, ...] = (0,)
) -> tuple[float, float, float]:
    """measure_process's (wall seconds, CPU seconds, peak RSS MiB): the CPU
    time (user + system) of the process itself, which a busy or shared
    machine stretches far less than the wall time (time the process waited
    for a CPU is not in it)."""
    import subprocess

    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env
    )
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode() if proc.stderr else ""
    if code not in ok:
        raise RuntimeError(f"{cmd} failed ({code}): {err[-2000:]}")
    # ru_maxrss is in KiB on Linux.
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


@contextmanager
def loopback_s3(log_path: str) -> Iterator[dict[str, str]]:
    """A real S3-protocol server (moto in server mode) on a free loopback
    port for the duration: yields the environment (endpoint and test
    credentials) a client process needs; the server is stopped after. Used
    by the object-store tests and benchmarks alike."""
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if server.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError("moto server did not start") from None
                    time.sleep(0.1)
            yield {
                "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
                "AWS_ACCESS_KEY_ID": "test",
                "AWS_SECRET_ACCESS_KEY": "test",
                "AWS_DEFAULT_REGION": "us-east-1",
            }
        finally:
            server.terminate()
            try:
                server.wait(10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
