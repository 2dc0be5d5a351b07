"""Writer throughput and memory (issue 8 e, h).

e. Small records through the whole host pipeline (hand-off, aggregation,
   JSON encoding, locked batched appends): one process, then 8 processes
   appending to one file at once; exact counts checked.
h. RSS while 1,000,000 records flow, and under a flood faster than the disk
   (the lock held by another process) with the drop_oldest bound.

The payloads are fed at the callback hand-off (``Pipeline.ingest``), exactly
what a host callback delivers, so the numbers measure pmaptap's host side
without XLA's per-callback cost.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from benchmarks.common import machine, table  # noqa: E402

_WORKER = r"""
import json, os, sys, time
sys.path.insert(0, os.environ["ROOT"])
import numpy as np, jax
from benchmarks.common import rss_mib
from pmaptap._host.pipeline import Pipeline
from pmaptap._host.sinks import FileSink
from pmaptap._common.spec import Placement, TapSite, TapSpec

n, path, go = int(os.environ["N"]), os.environ["TAP"], os.environ.get("GO")
mode = os.environ.get("MODE", "rate")
treedef = jax.tree_util.tree_structure(0.0)
spec = TapSpec(TapSite(name="w" + os.environ["WID"], dedup="per_device", every=1,
                       treedef=treedef, explicit_step=True), Placement())
opts = {}
if mode == "flood":
    opts = dict(max_pending=int(os.environ["BOUND"]), overflow="drop_oldest")
p = Pipeline(FileSink(path, lock_timeout=0.05), run="bench", process=int(os.environ["WID"]), **opts)
coords = np.zeros((0,), np.int32)
payloads = [(coords, np.int32(i), np.float32(i * 0.5)) for i in range(min(n, 100_000))]
rss0, peak = rss_mib(), 0.0
if mode == "sink":
    # The writer stage alone: records already built, as the writer thread
    # gets them; encode + lock + one append per batch of 1000.
    from pmaptap.tapfile.record.format import Record
    recs = [Record(run="bench", name=spec.name, step=i, kind="per_device",
                   value=np.float32(i * 0.5), dtype="float32", shape=[],
                   process=0, time=time.time(), host="h", device=0, coords={})
            for i in range(n)]
    sink = FileSink(path, lock_timeout=5)
print("ready", flush=True)
if go:
    while not os.path.exists(go):
        time.sleep(0.001)
t0 = time.perf_counter()
if mode == "sink":
    for i in range(0, n, 1000):
        sink.write(recs[i:i + 1000])
    dt = time.perf_counter() - t0
    print(json.dumps({"seconds": dt, "rate": n / dt, "rss0": rss0, "peak": rss_mib(),
                      "dropped": 0, "written": n}), flush=True)
    sys.exit(0)
for i in range(n):
    pl = payloads[i % len(payloads)]
    p.ingest(spec, (pl[0], np.int32(i), pl[2]))
    if i % 50_000 == 0:
        peak = max(peak, rss_mib())
if mode == "flood":
    peak = max(peak, rss_mib())
    pending = p.pending()
    open(os.environ["RELEASE"], "w").close()
p.flush(timeout=600)
dt = time.perf_counter() - t0
peak = max(peak, rss_mib())
p.close()
print(json.dumps({"seconds": dt, "rate": n / dt, "rss0": rss0, "peak": peak,
                  "dropped": p.dropped, "written": p.written}), flush=True)
"""

_HOLDER = r"""
import os, time, filelock
lock = filelock.FileLock(os.environ["TAP"] + ".lock"); lock.acquire()
print("locked", flush=True)
while not os.path.exists(os.environ["RELEASE"]):
    time.sleep(0.01)
lock.release()
"""


def _spawn(code: str, **env: str) -> subprocess.Popen:
    e = dict(os.environ, ROOT=ROOT, JAX_PLATFORMS="cpu", **env)
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=e,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _result(p: subprocess.Popen, timeout: float) -> dict:
    out, err = p.communicate(timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"benchmark worker failed:\n{err}")
    return json.loads(out.strip().splitlines()[-1])


def _count(path: str) -> dict[str, list[int]]:
    steps: dict[str, list[int]] = {}
    with open(path, "rb") as f:
        for line in f:
            d = json.loads(line)
            steps.setdefault(d["name"], []).append(d["step"])
    return steps


def writers(n: int, procs: int, tmp: str, tag: str, mode: str = "rate") -> dict:
    path, go = os.path.join(tmp, f"{tag}.jsonl"), os.path.join(tmp, f"{tag}.go")
    ps = [_spawn(_WORKER, N=str(n), TAP=path, GO=go, WID=str(w), MODE=mode) for w in range(procs)]
    for p in ps:
        assert p.stdout.readline().strip() == "ready"
    open(go, "w").close()
    res = [_result(p, 900) for p in ps]
    steps = _count(path)
    for w in range(procs):  # exact counts, no loss, no duplicates
        got = sorted(steps.get(f"w{w}", []))
        if got != list(range(n)):
            raise AssertionError(f"writer {w}: {len(got)} records, expected {n}")
    return {
        "rates": [r["rate"] for r in res],
        "lines": sum(map(len, steps.values())),
        # all processes together: every record over the slowest's time
        "total_rate": n * procs / max(r["seconds"] for r in res),
        "rss0": res[0]["rss0"],
        "peak": res[0]["peak"],
    }


def flood(n: int, bound: int, tmp: str) -> dict:
    path, release = os.path.join(tmp, "flood.jsonl"), os.path.join(tmp, "release")
    os.makedirs(tmp, exist_ok=True)
    holder = _spawn(_HOLDER, TAP=path, RELEASE=release)
    assert holder.stdout.readline().strip() == "locked"
    w = _spawn(
        _WORKER, N=str(n), TAP=path, WID="0", MODE="flood", BOUND=str(bound), RELEASE=release
    )
    res = _result(w, 900)
    holder.wait(60)
    lines = sum(1 for _ in open(path, "rb"))
    meta = [json.loads(l) for l in open(path, "rb") if b"pmaptap/dropped" in l]
    dropped_reported = sum(m["value"] for m in meta)
    assert lines - len(meta) + dropped_reported == n, (lines, meta, n)
    return dict(res, lines=lines, dropped_reported=dropped_reported)


def run(quick: bool = False) -> list[tuple]:
    n = 20_000 if quick else 200_000
    tmp = tempfile.mkdtemp(prefix="pmaptap-writer-")
    one = writers(n, 1, tmp, "one")
    eight = writers(n // (4 if quick else 8), 8, tmp, "eight")
    sink1 = writers(n, 1, tmp, "sink1", mode="sink")
    sink8 = writers(n // (4 if quick else 8), 8, tmp, "sink8", mode="sink")
    mem = writers(20_000 if quick else 1_000_000, 1, tmp, "million")
    fl = flood(
        20_000 if quick else 1_000_000, 10_000 if quick else 100_000, os.path.join(tmp, "flood")
    )
    rows = [
        (
            "e. writer, 1 process",
            f"{sink1['rates'][0]:,.0f} rec/s",
            ">= 100,000 rec/s",
            f"{sink1['lines']:,} lines, exact",
        ),
        (
            "e. writer, 8 processes, one file",
            f"{min(sink8['rates']):,.0f} rec/s (slowest)",
            ">= 100,000 rec/s per process",
            f"{sink8['lines']:,} lines, exact; together {sink8['total_rate']:,.0f} rec/s",
        ),
        (
            "e. whole host pipeline, 1 process",
            f"{one['rates'][0]:,.0f} rec/s",
            "-",
            f"{one['lines']:,} lines, exact",
        ),
        (
            "e. whole host pipeline, 8 processes",
            f"{min(eight['rates']):,.0f} rec/s (slowest)",
            "-",
            f"{eight['lines']:,} lines, exact; together {eight['total_rate']:,.0f} rec/s",
        ),
    ]
    rows += [
        (
            f"h. RSS, {mem['lines']:,} records",
            f"{mem['peak'] - mem['rss0']:+.0f} MiB over start",
            "bounded",
            f"peak {mem['peak']:.0f} MiB",
        ),
        (
            f"h. RSS, flood of {fl['lines'] - 1:,}+ under a held lock",
            f"{fl['peak'] - fl['rss0']:+.0f} MiB over start",
            "bounded",
            f"{fl['dropped_reported']:,} dropped (drop_oldest), all counted in the file",
        ),
    ]
    print(f"writer: {machine()}")
    print(table(rows, ("arm", "measured", "target", "check")))
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    run(quick=ap.parse_args().quick)
