"""Run every benchmark, each in its own process (the simulated device count
is fixed when JAX starts): python benchmarks/run_all.py [--quick]."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SUITES = (
    "bench_taps.py",
    "bench_floor.py",
    "bench_train.py",
    "bench_writer.py",
    "bench_scaling.py",
    "bench_sharded.py",
    "bench_arrays.py",
    "bench_host_callback.py",
    "bench_read.py",
    "bench_model.py",
    "bench_read_scale.py",
    "bench_many_writers.py",
    "bench_fingerprint.py",
    "bench_fpcost.py",
    "bench_outputs.py",
    "bench_guide.py",
    "bench_transformer.py",
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a few rounds each: checks that they run, numbers mean little",
    )
    ap.add_argument("--only", choices=SUITES, action="append")
    a = ap.parse_args(argv)
    status = 0
    for suite in a.only or SUITES:
        t0 = time.time()
        print(f"== {suite}", flush=True)
        rc = subprocess.call(
            [sys.executable, os.path.join(HERE, suite)] + (["--quick"] if a.quick else [])
        )
        print(f"   ({time.time() - t0:.0f} s)\n", flush=True)
        status = status or rc
    return status


if __name__ == "__main__":
    sys.exit(main())
