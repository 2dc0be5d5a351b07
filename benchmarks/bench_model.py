"""Per-line CPU figures of the read side for docs/multihost.md's model, in
one process (``time.process_time``, best of ``--rounds``; no interpreter
start-up): a bare orjson loop over the same lines, the merge alone, and
``summary`` / ``validate`` / ``pmaptap.read`` in this process (``--jobs 1``),
over 256 shards x 200 steps, 4,096 shards x 25 steps (bench_read_scale.py's
runs) and bench_read.py's 300,000-record file. Prints us a line and the
ratio to the bare loop."""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _bare(files: list[str]) -> int:
    import orjson

    n = 0
    for name in files:
        with open(name, "rb") as f:
            for line in f:
                orjson.loads(line)
                n += 1
    return n


def _best(fn, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        gc.collect()
        t = time.process_time()
        fn()
        best = min(best, time.process_time() - t)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="small runs: checks that it runs")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    import pmaptap
    from benchmarks.bench_read import generate as generate_file
    from benchmarks.bench_read_scale import generate
    from pmaptap.tapfile.analyze import parallel as jobs
    from pmaptap.tapfile.source import lines
    from pmaptap.tapfile.source import run as runs

    with tempfile.TemporaryDirectory() as tmp:
        cases = []
        for shards, steps in ((256, 200), (4096, 25)):
            path = os.path.join(tmp, f"s{shards}.jsonl")
            generate(path, shards, 2 if a.quick else steps)
            cases.append((f"{shards} shards", path, runs.sources(path)))
        one = os.path.join(tmp, "one.jsonl")
        generate_file(one, 20_000 if a.quick else 300_000)
        cases.append(("one file, 300,000 records", one, [one]))
        for label, path, files in cases:
            n = _bare(files)
            bare = _best(lambda: _bare(files), a.rounds)

            def merge(path=path):
                with lines.collector_paused():  # as the commands read
                    for _ in lines.iter_record_batches(path):
                        pass

            arms = {
                "decode and merge": merge,
                # What `pmaptap summary/validate --jobs 1` run: a sharded
                # run shard by shard (tapfile/analyze/shardwise.py).
                "summary": lambda path=path: jobs.summarize_file(path, None, 1),
                "validate": lambda path=path: jobs.validate_file(path, 1),
                "read": lambda path=path: pmaptap.read(path),
            }
            got = {k: _best(fn, a.rounds) for k, fn in arms.items()}
            print(
                f"model. {label}, {n} lines: bare orjson loop {bare * 1e6 / n:.2f} us a line; "
                + ", ".join(f"{k} {v * 1e6 / n:.2f} us ({v / bare:.2f}x)" for k, v in got.items())
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
