"""Reading a large tap file (issues 15.4, 27.4): ``pmaptap summary``,
``validate``, ``show`` (the whole file, and ``--name N --step A:``) and
``pmaptap.read(..., as_frame=True)`` against a bare orjson loop over the same
lines, time and peak RSS, each command in its own process (interpreter
start-up included on both sides).

The file is generated without JAX: per step a replicated loss and lr and a
per-device grad norm for 8 devices (300,000 records, ~70 MB; --quick: 20,000).
Targets: summary within 2x the bare loop (CPU time, issue 39) and validate
within 5x (reported), each also with ``--jobs 1`` (one process);
peak RSS of summary under 300 MiB, of show, validate and read(as_frame=True)
at most 200 MiB: those are checked, and the run fails if one is over.
Reported: the median and range of the per-round ratios (command / bare loop,
run back to back in each round, so both meet the same machine load).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from benchmarks.common import (  # noqa: E402
    BARE_ORJSON_LOOP,
    compile_bytecode,
    measure_process_times,
    spread,
    table,
)

DEVICES = 8
_BARE = BARE_ORJSON_LOOP
_FRAME = "import sys, pmaptap\ndf = pmaptap.read(sys.argv[1], as_frame=True)\nprint(len(df))\n"
# Peak RSS limits (MiB), checked on every run (issue 27.4: show and validate
# held the whole file; docs/performance.md, "Every reader streams").
RSS_LIMITS = {
    "pmaptap summary": 300,
    "pmaptap validate": 200,
    "pmaptap show": 200,
    "pmaptap show --json": 200,
    "read(as_frame=True)": 200,
}
# Time targets (x the bare loop), reported only: a loaded machine moves them.
TIME_TARGETS = {
    "pmaptap summary": 2,
    "pmaptap summary --jobs 1": 2,
    "pmaptap validate": 5,
    "pmaptap validate --jobs 1": 5,
}


def generate(path: str, records: int) -> int:
    """A tap file like a training job's; returns its size in bytes."""
    import orjson

    steps = records // (2 + DEVICES)
    devices = list(range(DEVICES))
    t = 1.8e9
    with open(path, "wb") as f:
        for s in range(steps):
            lines = []
            loss = "NaN" if s % 9973 == 7 else 1.0 / (s + 1)
            for name, value in (("loss", loss), ("lr", 0.01 * 0.999**s)):
                lines.append(
                    {
                        "run": "bench",
                        "name": name,
                        "step": s,
                        "kind": "replicated",
                        "value": value,
                        "dtype": "float32",
                        "shape": [],
                        "process": 0,
                        "time": t + s * 0.1,
                        "host": "node-0",
                        "replicas": DEVICES,
                        "devices": devices,
                        "processes": [0],
                        "vhash": f"{s:016x}",
                    }
                )
            for d in devices:
                lines.append(
                    {
                        "run": "bench",
                        "name": "grad_norm",
                        "step": s,
                        "kind": "per_device",
                        "value": 0.5 + d + s * 1e-4,
                        "dtype": "float32",
                        "shape": [],
                        "process": d // 4,
                        "time": t + s * 0.1,
                        "host": f"node-{d // 4}",
                        "device": d,
                        "coords": {"dp": d},
                    }
                )
            f.write(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    return os.path.getsize(path)


def measure(cmd: list[str]) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds, peak RSS MiB) of one command in its own
    process (its workers' CPU and memory included)."""
    return measure_process_times(cmd, cwd=ROOT)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--quick", action="store_true", help="20,000 records, one round: checks that it runs"
    )
    ap.add_argument("--records", type=int)
    ap.add_argument("--rounds", type=int)
    a = ap.parse_args(argv)
    records = a.records or (20_000 if a.quick else 300_000)
    rounds = a.rounds or (1 if a.quick else 7)
    compile_bytecode()  # readers start as an installed package's do
    py = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "big.jsonl")
        size = generate(path, records)
        last = records // (2 + DEVICES) - 10
        arms = {
            "bare orjson loop": [py, "-c", _BARE, path],
            "pmaptap summary": [py, "-m", "pmaptap", "summary", path],
            "pmaptap summary --jobs 1": [py, "-m", "pmaptap", "summary", path, "-j1"],
            "pmaptap validate": [py, "-m", "pmaptap", "validate", path],
            "pmaptap validate --jobs 1": [py, "-m", "pmaptap", "validate", path, "-j1"],
            "pmaptap show": [py, "-m", "pmaptap", "show", path],
            "pmaptap show --json": [py, "-m", "pmaptap", "show", path, "--json"],
            "read(as_frame=True)": [py, "-c", _FRAME, path],
            "pmaptap show --name loss --step A:": [
                py,
                "-m",
                "pmaptap",
                "show",
                path,
                "--name",
                "loss",
                "--step",
                f"{last}:",
            ],
        }
        walls: dict[str, list[float]] = {name: [] for name in arms}
        cpus: dict[str, list[float]] = {name: [] for name in arms}
        rss: dict[str, float] = {}
        # Each command over the bare loop, paired per round: wall and CPU.
        paired: dict[str, list[float]] = {name: [] for name in TIME_TARGETS}
        paired_cpu: dict[str, list[float]] = {name: [] for name in TIME_TARGETS}
        for _ in range(rounds):
            for name, cmd in arms.items():
                wall, cpu, peak = measure(cmd)
                walls[name].append(wall)
                cpus[name].append(cpu)
                rss[name] = max(peak, rss.get(name, 0.0))
            for name, rs in paired.items():
                rs.append(walls[name][-1] / walls["bare orjson loop"][-1])
                paired_cpu[name].append(cpus[name][-1] / cpus["bare orjson loop"][-1])
    print(
        f"{records} records, {size / 1e6:.1f} MB; median (range) of {rounds} round(s), "
        "each command in a fresh process, interpreter start-up included"
    )
    bare = statistics.median(walls["bare orjson loop"])
    rows = []
    for name, ts in walls.items():
        t = statistics.median(ts)
        rows.append(
            (
                name,
                spread(ts, " s"),
                f"{t / bare:.2f}x",
                f"{rss[name]:.0f} MiB",
            )
        )
    print(table(rows, ("command", "time", "vs bare loop", "peak RSS")))
    for name, target in TIME_TARGETS.items():
        w, c = paired[name], paired_cpu[name]
        print(
            f"{name[8:]}: {spread(c, 'x')} the bare loop's CPU time, wall "
            f"{spread(w, 'x')}, median of {rounds} paired rounds; target <= "
            f"{target}x"
        )
    peak = rss["pmaptap summary"]
    print(
        f"summary peak RSS {peak:.0f} MiB, {peak / rss['bare orjson loop']:.1f}x the bare "
        f"loop's {rss['bare orjson loop']:.0f} MiB (target < 300 MiB)"
    )
    over = []
    for name, limit in RSS_LIMITS.items():
        ok = rss[name] <= limit
        print(f"peak RSS {name}: {rss[name]:.0f} MiB (limit {limit} MiB) {'ok' if ok else 'OVER'}")
        if not ok:
            over.append(name)
    if over:
        print(f"FAILED: peak RSS over the limit: {', '.join(over)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
