"""Array values stored as bytes (issues 26, 41): a float32 activation of
2 MiB (and 32 MiB) sharded over every device of a 2-D mesh (4x2 on 8
simulated CPU devices), tapped every step under jit (``per_device``: one
record per shard, its bytes in the writer's byte file), against

- ``raw``: a raw ``jax.debug.callback(partitioned=True)`` of the same
  shards doing nothing (one call per device, no gather);
- ``raw+write``: the same raw callback, each shard's bytes appended to a
  file in the same directory (``file.write(memoryview(shard))``, unbuffered,
  no fsync) by one writer thread, as pmaptap's writer does, the arm's
  finish waiting for every write: the least a callback that stores the
  bytes can cost;

and the bytes on disk per byte of the array. Ratios are of *added* cost
over the same step without any callback, taken per round (paired): arms run
interleaved, in alternating order, each round ``steps`` steps then the
arm's finish (the tap's ``flush()``, whose bytes and lines are then on
disk; ``jax.effects_barrier()`` for the raw arms). Every step's result is
waited for (``block_until_ready``, as a loop that reads its loss does). A
raw callback that reads its argument on the CPU backend can hang
(``jax.debug.callback`` ``device_put``s its arguments to CPU device 0, and
that copy can queue behind computations dispatched ahead, which wait for
the callback: seen here within a few hundred steps, and once even with
every step waited for, in a test run of ``--quick``), hence the writer
thread; ``--pipelined`` dispatches steps ahead, as on a GPU. Each round of an arm
opens its own session (or file) before the clock starts and removes it
after, so the disk never fills.

Then one instrumented pass of the tap alone per size: where its time goes,
stage by stage (callback, aggregator, writer), and the CPU time of each
thread. Peak RSS is the process's.

Runs on whatever backend JAX picks (``--devices`` only sets the simulated
CPU device count; on one GPU the mesh is 1x1): ``--mesh RxC`` to choose.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from benchmarks.common import (  # noqa: E402
    activation_step,
    machine,
    round_ratios,
    sharded_linspace,
    table,
)

DEVICES = 8
# MiB per step -> (rows, cols) of the float32 activation.
SHAPES = {2: (1024, 512), 32: (4096, 2048)}
ARMS = ("base", "raw", "raw+write", "tap")


def mesh_shape(n: int) -> tuple[int, int]:
    """The most square (rows, cols) with rows >= cols covering ``n``
    devices: 8 -> (4, 2), 1 -> (1, 1)."""
    cols = max(c for c in range(1, int(n**0.5) + 1) if n % c == 0)
    return n // cols, cols


def _tree_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for d, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(d, f)) for f in files)
    return total


def _thread_cpu() -> dict[str, float]:
    """CPU seconds of each thread of this process (``schedstat``: ns), by
    group: the main thread, pmaptap's aggregator and writer (the raw+write
    arm's writer too), and the rest
    (XLA's compute and callback threads). Linux only; {} elsewhere."""
    import threading

    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    names = {str(t.native_id): t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        name = names.get(tid, "")
        group = (
            "main"
            if name == "MainThread"
            else "aggregator"
            if name.startswith("pmaptap-aggregate")
            else "writer"
            if name.startswith(("pmaptap-write", "raw-writer"))
            else "XLA (compute, callbacks)"
        )
        out[group] = out.get(group, 0.0) + ns / 1e9
    return out


class Arm:
    """One arm at one size: ``setup`` and ``teardown`` (untimed) around a
    timed ``run`` of ``steps`` steps and the arm's finish."""

    def __init__(
        self, kind: str, fn: Callable, x: Any, steps: int, tmp: str, pipelined: bool = False
    ) -> None:
        self.kind, self.fn, self.x, self.steps, self.tmp = kind, fn, x, steps, tmp
        self.pipelined = pipelined
        self.session: Any = None
        self.file: Any = None
        self.path = ""
        self.disk: list[float] = []  # bytes on disk per array byte, per round
        self.rounds = 0

    def setup(self) -> None:
        import pmaptap

        self.rounds += 1
        self.path = os.path.join(self.tmp, f"{self.kind.replace('+', '_')}-{self.rounds}")
        if self.kind == "tap":
            self.session = pmaptap.Session(self.path + ".jsonl", run="bench").open()
        elif self.kind == "raw+write":
            self.file = _SINK.file = open(self.path + ".bin", "ab", buffering=0)

    def run(self) -> None:
        import jax

        fn, x = self.fn, self.x
        if self.pipelined:
            y = None
            for _ in range(self.steps):
                y = fn(x)
            y.block_until_ready()
        else:
            for _ in range(self.steps):
                fn(x).block_until_ready()
        if self.session is not None:
            self.session.flush()
        else:
            jax.effects_barrier()
            if self.file is not None:
                _SINK.wait()

    def teardown(self, nbytes: int) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None
            stored = self.path + ".jsonl"
            on_disk = _tree_bytes(stored) + _tree_bytes(stored + ".bytes")
            self.disk.append(on_disk / (nbytes * self.steps))
            os.remove(stored)
            shutil.rmtree(stored + ".bytes", ignore_errors=True)
            for extra in (stored + ".lock",):
                if os.path.exists(extra):
                    os.remove(extra)
        if self.file is not None:
            self.file.close()
            self.file = _SINK.file = None
            self.disk.append(os.path.getsize(self.path + ".bin") / (nbytes * self.steps))
            os.remove(self.path + ".bin")


class _Sink:
    """Where the raw+write arm's callback writes: the open file of the
    round (a module-level holder, so the jitted step is traced once), by
    one writer thread: the callback only hands the shard over, since
    reading it there could wait for a copy queued behind the step that
    waits for the callback (see above)."""

    file: Any = None

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raw-writer")
        self.pending: list = []

    def write(self, shard: Any) -> None:
        self.pending.append(self.writer.submit(self._write, self.file, shard))

    @staticmethod
    def _write(file: Any, shard: Any) -> None:
        file.write(memoryview(shard))

    def wait(self) -> None:
        """Every write handed over so far done (its error raised)."""
        pending, self.pending = self.pending, []
        for f in pending:
            f.result()


_SINK = _Sink()


def _write_shard(shard) -> None:
    _SINK.write(shard)


def raw_write_step():
    import jax
    import jax.numpy as jnp

    @jax.jit
    def step(v):
        y = jnp.tanh(v) * 1.0001
        jax.debug.callback(_write_shard, y, partitioned=True)
        return y

    return step


def _fmt_ratios(rs: list[float]) -> str:
    if not rs:
        return "nan"
    q = statistics.quantiles(rs, n=4) if len(rs) >= 4 else [min(rs), 0, max(rs)]
    return f"{statistics.median(rs):.2f}x ({q[0]:.2f}-{q[-1]:.2f})"


def measure(mib: int, mesh, tmp: str, rounds: int, steps: int, pipelined: bool = False) -> dict:
    """Interleaved paired rounds of every arm at one size."""
    rows, cols = SHAPES[mib]
    nbytes = rows * cols * 4
    x = sharded_linspace(mesh, rows, cols)
    fns = {k: activation_step(k) for k in ("base", "raw", "tap")}
    fns["raw+write"] = raw_write_step()
    arms = {k: Arm(k, fns[k], x, steps, tmp, pipelined) for k in ARMS}
    for arm in arms.values():  # warm up: compile, first file writes
        arm.setup()
        arm.run()
        arm.teardown(nbytes)
        arm.disk.clear()
    times: dict[str, list[float]] = {k: [] for k in ARMS}
    cpu_times: dict[str, list[float]] = {k: [] for k in ARMS}  # the process's
    cpu: dict[str, dict[str, float]] = {k: {} for k in ARMS}
    for r in range(rounds):
        order = list(arms.values())
        if r % 2:
            order.reverse()
        for arm in order:
            arm.setup()
            c0 = _thread_cpu()
            p0, t0 = time.process_time(), time.perf_counter()
            arm.run()
            times[arm.kind].append((time.perf_counter() - t0) / steps)
            cpu_times[arm.kind].append((time.process_time() - p0) / steps)
            c1 = _thread_cpu()
            for g, v in c1.items():
                cpu[arm.kind][g] = cpu[arm.kind].get(g, 0.0) + (v - c0.get(g, 0.0))
            arm.teardown(nbytes)
    return {
        "mib": mib,
        "nbytes": nbytes,
        "times": times,
        "cpu_times": cpu_times,
        "cpu": {k: {g: v / (rounds * steps) for g, v in c.items()} for k, c in cpu.items()},
        "disk": statistics.median(arms["tap"].disk),
        "fns": fns,
        "x": x,
    }


def stages(res: dict, tmp: str, steps: int) -> list[tuple]:
    """One instrumented pass of the tap arm: wall time per step in each
    stage, on the thread that runs it (wrappers around pmaptap's own
    functions, so this pass is slower than the timed rounds)."""
    from benchmarks import stage_timer

    with stage_timer.timed() as spent:
        fn = activation_step("tap")  # traced and compiled under the timers
        arm = Arm("tap", fn, res["x"], steps, tmp)
        arm.setup()
        arm.run()  # compile, first writes
        arm.teardown(res["nbytes"])
        spent.clear()
        arm.setup()
        arm.run()
        arm.teardown(res["nbytes"])
    return [
        (f"m. stage at {res['mib']} MiB: {name}", f"{1e3 * s / steps:.3f}", where)
        for name, (s, where) in spent.items()
    ]


def run(
    quick: bool = False,
    mesh_arg: str | None = None,
    sizes: tuple[int, ...] = (2, 32),
    directory: str | None = None,
    pipelined: bool = False,
) -> list[tuple]:
    import resource

    import jax
    import numpy as np
    from jax.sharding import Mesh

    import pmaptap

    # Every size stored whole, as its bytes (above the default 16 MiB a
    # value is summarized on device): the arms then write the same bytes.
    pmaptap.configure(max_value_bytes=max(SHAPES[m][0] * SHAPES[m][1] * 4 for m in sizes))
    devices = jax.devices()
    shape = tuple(int(v) for v in mesh_arg.split("x")) if mesh_arg else mesh_shape(len(devices))
    mesh = Mesh(np.array(devices[: shape[0] * shape[1]]).reshape(shape), ("data", "model"))
    tmp = tempfile.mkdtemp(prefix="pmaptap-bench-arrays-", dir=directory)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rows: list[tuple] = []
    stage_rows: list[tuple] = []
    cpu_rows: list[tuple] = []
    base_ms = []
    try:
        for mib in sizes:
            if quick:
                rounds, steps = (3, 4) if mib <= 2 else (2, 1)
            else:
                rounds, steps = (15, 20) if mib <= 2 else (9, 6)
            res = measure(mib, mesh, tmp, rounds, steps, pipelined)
            base_ms.append(f"{mib} MiB {statistics.median(res['times']['base']) * 1e3:.3f} ms")
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            label = f"m. {mib} MiB sharded activation"
            for arm, ref, clock, note in (
                ("tap", "raw+write", "times", "the target: <= 1.5x"),
                ("tap", "raw+write", "cpu_times", "the same in CPU time (all threads)"),
                ("tap", "raw", "times", "the raw callback doing nothing"),
                ("raw+write", "raw", "times", "what writing the bytes adds to it"),
            ):
                t = res[clock]
                added = [
                    statistics.median(t[k]) * 1e3 - statistics.median(t["base"]) * 1e3
                    for k in (arm, ref)
                ]
                rows.append(
                    (
                        f"{label}, {arm} / {ref}{', CPU' if clock == 'cpu_times' else ''}",
                        f"{added[0]:.3f}",
                        f"{added[1]:.3f}",
                        _fmt_ratios(round_ratios(t, arm, ref, "base")),
                        note,
                    )
                )
            rows += [
                (
                    f"m. {mib} MiB bytes on disk per array byte",
                    "",
                    "",
                    f"{res['disk']:.4f}x",
                    f"{rounds} x {steps} steps: lines + .bytes files (raw+write: 1x)",
                ),
                (
                    f"m. {mib} MiB peak RSS",
                    "",
                    "",
                    f"{rss:.0f} MiB",
                    f"the process so far (at start {rss0:.0f} MiB)",
                ),
            ]
            for kind in ("raw+write", "tap"):
                for g, v in sorted(res["cpu"][kind].items()):
                    cpu_rows.append((f"m. {mib} MiB CPU, {kind}: {g}", f"{v * 1e3:.3f}"))
            stage_rows += stages(res, tmp, steps)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"jit over {len(mesh.devices.flat)} devices ({shape[0]}x{shape[1]} mesh); "
        f"no-callback step {', '.join(base_ms)}; {machine()}"
    )
    header = ("arm / reference", "arm added ms", "ref added ms", "ratio (median, IQR)", "note")
    print(table(rows, header))
    print()
    print(table(cpu_rows, ("thread CPU per step (timed rounds)", "ms")))
    print()
    print(table(stage_rows, ("tap, one instrumented pass", "ms/step", "thread")))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few rounds, to check it runs")
    ap.add_argument(
        "--devices",
        type=int,
        default=DEVICES,
        help="simulated CPU devices (the CPU backend only; default 8)",
    )
    ap.add_argument("--mesh", help="RxC (default: from the device count; 8 -> 4x2, 1 -> 1x1)")
    ap.add_argument(
        "--sizes", default="2,32", help="MiB per step, among " + ",".join(map(str, SHAPES))
    )
    ap.add_argument("--dir", help="where the files go (default: a temporary directory)")
    ap.add_argument(
        "--pipelined",
        action="store_true",
        help="dispatch a round's steps without waiting for each, as a loop that "
        "does not read its loss does",
    )
    a = ap.parse_args(argv)
    if "jax" not in sys.modules:
        # The host platform's device count; a GPU backend, if JAX finds one,
        # is still the default (nothing here forces the CPU).
        flags = [
            f
            for f in os.environ.get("XLA_FLAGS", "").split()
            if "force_host_platform_device_count" not in f
        ]
        flags.append(f"--xla_force_host_platform_device_count={a.devices}")
        os.environ["XLA_FLAGS"] = " ".join(flags)
    run(
        quick=a.quick,
        mesh_arg=a.mesh,
        sizes=tuple(int(s) for s in a.sizes.split(",")),
        directory=a.dir,
        pipelined=a.pipelined,
    )


if __name__ == "__main__":
    main()
