"""l. Many writer processes on one run: the one-file layout against the
sharded one (issue 14).

N JAX-free processes (``pmaptap.Writer``; JAX made unimportable in them),
released together, each write STEPS steps of 1 replicated record (the same
value everywhere) and 1 per-device record, flushing every FLUSH steps, as
fast as they can. Printed per N and layout: job-wide records/s, bytes of
other processes' output read back per process, p99 and max lag (a record's
write() to the end of the flush that wrote it), lock attempts that timed
out, and whether the run read back is exact (STEPS replicated + N x STEPS
per-device records, ``validate`` clean). Then the rate at the largest N
against the rate at 32 (or the smallest N in quick mode).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from benchmarks.common import table  # noqa: E402

_WORKER = r"""
import json, os, sys, time
sys.modules["jax"] = None          # side processes: no JAX
sys.path.insert(0, os.environ["ROOT"])
import numpy as np
import pmaptap

wid, n = int(os.environ["WID"]), int(os.environ["NPROC"])
steps, every = int(os.environ["STEPS"]), int(os.environ["FLUSH"])
w = pmaptap.Writer(os.environ["TAP"], run="bench", process=wid, processes=n,
                   layout=os.environ["LAYOUT"], flush_interval=1e9,
                   max_buffer=1 << 30, flush_timeout=None)
os.write(int(os.environ["READY_FD"]), b"r")
os.read(int(os.environ["GO_FD"]), 1)      # EOF when the parent releases all
t0 = time.time()
lags, pending = [], []
for step in range(steps):
    t = time.perf_counter()
    w.write("loss", step, np.float32(step * 0.5))
    w.write("act", step, np.float32(wid + step), kind="per_device", device=wid)
    pending += (t, t)
    if (step + 1) % every == 0 or step == steps - 1:
        w.flush()
        done = time.perf_counter()
        lags += [done - x for x in pending]
        pending = []
t1 = time.time()
w.close()
lags.sort()
print(json.dumps(dict(t0=t0, t1=t1, p99=lags[int(0.99 * (len(lags) - 1))],
                      max=lags[-1], read=w.bytes_read, busy=w.lock_busy,
                      written=w.written)))
"""


def run_one(n: int, layout: str, steps: int, every: int) -> dict:
    from pmaptap.tapfile.analyze.validate import validate_file

    tmp = tempfile.mkdtemp(prefix="pmaptap-many-")
    path = os.path.join(tmp, "run.jsonl")
    r, wfd = os.pipe()
    ready_r, ready_w = os.pipe()
    env = dict(
        os.environ,
        ROOT=ROOT,
        TAP=path,
        NPROC=str(n),
        STEPS=str(steps),
        FLUSH=str(every),
        LAYOUT=layout,
        GO_FD=str(r),
        READY_FD=str(ready_w),
    )
    procs = []
    try:
        for i in range(n):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", _WORKER],
                    env=dict(env, WID=str(i)),
                    pass_fds=(r, ready_w),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        os.close(r)
        os.close(ready_w)
        got = 0
        while got < n:  # all imported and waiting
            b = os.read(ready_r, n - got)
            if not b:
                raise RuntimeError("a writer exited before it was ready")
            got += len(b)
        os.close(wfd)  # release: EOF everywhere
        wfd = -1
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=1800)
            if p.returncode != 0:
                raise RuntimeError(f"writer failed ({p.returncode}): {err[-2000:]}")
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        if wfd >= 0:
            os.close(wfd)
        os.close(ready_r)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    import pmaptap

    recs = pmaptap.read(path)
    rep = sum(r["kind"] == "replicated" for r in recs)
    per = sum(r["kind"] == "per_device" for r in recs)
    report = validate_file(path)
    exact = rep == steps and per == n * steps and report.ok
    size = sum(os.path.getsize(f) for f in _files(path))
    start = min(o["t0"] for o in outs)
    took = max(o["t1"] for o in outs) - start
    return dict(
        n=n,
        layout=layout,
        rate=2 * n * steps / took,
        took=took,
        read=sum(o["read"] for o in outs) / n,
        size=size,
        p99=max(o["p99"] for o in outs),
        max=max(o["max"] for o in outs),
        busy=sum(o["busy"] for o in outs),
        exact=exact,
        counts=f"{rep}/{steps} rep, {per}/{n * steps} per_device",
    )


def model(quick: bool) -> None:
    """The per-step file cost model (docs/performance.md), its inputs
    measured here in one process: in the one-file layout a process's batch
    under the lock costs c0 + c1 x (N - 1) (index the other processes'
    lines appended since its last batch, then write its own), and the lock
    serializes the N processes: N x (c0 + c1 x (N - 1)) of serial file work
    per step. In the sharded layout a batch costs s0 and nothing is serial."""
    import statistics

    from pmaptap._host.sinks import DirectorySink, FileSink
    from pmaptap.tapfile.record.format import Record

    tmp = tempfile.mkdtemp(prefix="pmaptap-model-")
    reps = 200 if quick else 2000

    def batch(p: int, step: int) -> list[Record]:
        t = time.time()
        return [
            Record(
                run="m",
                name="loss",
                step=step,
                kind="replicated",
                value=0.5,
                dtype="float32",
                shape=[],
                process=p,
                time=t,
                host="h",
                replicas=1,
                processes=(p,),
                vhash=f"{step:016x}",
            ),
            Record(
                run="m",
                name="act",
                step=step,
                kind="per_device",
                value=float(p),
                dtype="float32",
                shape=[],
                process=p,
                time=t,
                host="h",
                device=p,
                coords={},
            ),
        ]

    def per_batch(others: int) -> float:
        path = os.path.join(tmp, f"f{others}.jsonl")
        sink = FileSink(path, process=0)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        times = []
        for step in range(reps):
            # what the other processes appended since our last batch
            lines = b"".join(r.encode() for q in range(1, others + 1) for r in batch(q, step))
            os.write(fd, lines)
            t0 = time.perf_counter()
            sink.write(batch(0, step))
            times.append(time.perf_counter() - t0)
        os.close(fd)
        sink.close()
        return statistics.median(times)

    lo, hi = 0, (15 if quick else 63)
    t_lo, t_hi = per_batch(lo), per_batch(hi)
    c1 = (t_hi - t_lo) / (hi - lo)
    c0 = t_lo
    sink = DirectorySink(os.path.join(tmp, "s.jsonl"), process=0)
    times = []
    for step in range(reps):
        t0 = time.perf_counter()
        sink.write(batch(0, step))
        times.append(time.perf_counter() - t0)
    sink.close()
    s0 = statistics.median(times)
    print(
        f"model inputs (median of {reps} batches of 1 replicated + 1 per-device "
        f"record): one file c0 = {c0 * 1e6:.0f} us, c1 = {c1 * 1e6:.2f} us per other "
        f"process; sharded s0 = {s0 * 1e6:.0f} us"
    )
    pair = sum(len(r.encode()) for r in batch(0, 0))  # bytes per process-step
    rows = []
    for n in (8, 32, 256, 1024, 4096):
        serial = n * (c0 + c1 * (n - 1))
        rows.append(
            (
                f"model N={n}",
                f"{serial * 1e3:.1f} ms",
                f"{n * (n - 1) * pair / 2**20:.1f} MiB",
                f"{s0 * 1e3:.3f} ms",
                "0",
            )
        )
    print(
        table(
            rows,
            (
                "model",
                "one file: serial per step",
                "read back / step, job",
                "sharded: per process per step",
                "sharded: serial",
            ),
        )
    )


COLUMNS = (
    "layout",
    "N",
    "records/s",
    "s",
    "read back/proc",
    "run size",
    "p99 lag ms",
    "max lag ms",
    "lock timeouts",
    "exact+valid",
)


def _files(path: str) -> list[str]:
    from pmaptap.tapfile.source import run as runs

    return runs.sources(path) or [path]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--n", type=int, action="append", help="process counts")
    ap.add_argument(
        "--file-max",
        type=int,
        default=128,
        help="largest N run in the one-file layout: at 256 its lock "
        "collapses and the run takes many minutes, the whole "
        "machine busy polling the lock (docs/performance.md)",
    )
    ap.add_argument("--layout", choices=("file", "sharded"), action="append")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--flush", type=int, default=5, help="flush every N steps")
    ap.add_argument(
        "--model-only", action="store_true", help="only measure the cost model's inputs"
    )
    a = ap.parse_args(argv)
    model(a.quick)
    if a.model_only:
        return 0
    ns = a.n or ([2, 4] if a.quick else [8, 32, 128, 256])
    steps = a.steps or (20 if a.quick else 200)
    layouts = a.layout or ["file", "sharded"]
    print(
        f"l. {steps} steps x (1 replicated + 1 per_device) per writer process, "
        f"flush every {a.flush} steps; {os.cpu_count()} cores"
    )
    rows, rates = [], {}
    for layout in layouts:
        for n in ns:
            if layout == "file" and n > a.file_max:
                continue
            m = run_one(n, layout, steps, a.flush)
            rates[layout, n] = m["rate"]
            rows.append(
                (
                    f"l. {layout}",
                    n,
                    f"{m['rate']:.0f}",
                    f"{m['took']:.1f}",
                    f"{m['read'] / 1024:.0f} KiB",
                    f"{m['size'] / 1024:.0f} KiB",
                    f"{m['p99'] * 1e3:.0f}",
                    f"{m['max'] * 1e3:.0f}",
                    m["busy"],
                    "yes" if m["exact"] else "NO: " + m["counts"],
                )
            )
            print(table(rows[-1:], COLUMNS), flush=True)
    print()
    print(table(rows, COLUMNS))
    base = 32 if 32 in ns else ns[0]
    for layout in layouts:
        top = max(n for lay, n in rates if lay == layout)
        print(
            f"l. {layout}: rate at {top} / rate at {base} = "
            f"{rates[layout, top] / rates[layout, base]:.2f}"
        )
    return 0 if all(r[-1] == "yes" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
