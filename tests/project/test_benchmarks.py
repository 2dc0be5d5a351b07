"""Quick mode of every benchmark, so they cannot rot. Asserts that they run
and report every arm, never how fast (the machines are noisy)."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import ROOT, subprocess_env


def test_all_benchmarks_run_in_quick_mode():
    env = subprocess_env()
    env.pop("XLA_FLAGS")  # each suite sets its own device count
    proc = subprocess.run(
        [sys.executable, "benchmarks/run_all.py", "--quick"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for label in (
        "a. per_device tap",
        "b. replicated tap (verified)",
        "b. replicated tap (verify off)",
        "c. 4 taps in one step",
        "c. 4 taps, auto_group=False",
        "c. 4 taps in pmaptap.group()",
        "d. every=100, traced step",
        "d. every=100, ~5 ms step",
        "f. demo step",
        "f. demo step, --tap-every 10",
        "every=10 decided on device",
        "floor: 1 raw callback from 1 device",
        "e. writer, 1 process",
        "e. writer, 8 processes, one file",
        "h. RSS",
        "added ms per step",
        "i. per-shard tap under jit",
        "i. 16 per-shard taps in a step",
        "i. flax_train.py step, tapped",
        "i. --variant jit step, tapped",
        "m. 2 MiB sharded activation, tap / raw+write ",
        "m. 2 MiB sharded activation, tap / raw+write, CPU",
        "m. 2 MiB sharded activation, tap / raw ",
        "m. 2 MiB sharded activation, raw+write / raw",
        "m. 2 MiB bytes on disk per array byte",
        "m. 32 MiB sharded activation, tap / raw+write ",
        "m. 32 MiB bytes on disk per array byte",
        "m. 32 MiB peak RSS",
        "m. 2 MiB CPU, tap: writer",
        "m. stage at 2 MiB: writer: bytes",
        "m. stage at 32 MiB: callback: the whole host call",
        "j. id_tap (tied, program order)",
        "j. id_tap, callback without the tie",
        "pmaptap summary",
        "u. guide step, jax.jit / raw",
        "u. guide step, pmaptap.jit / raw",
        "pmaptap show --name loss",
        "summary: ",
        "summary --jobs 1: ",
        "validate --jobs 1: ",
        "pmaptap/tapfile/: ",
        "p. 4096 shards",
        "model. 256 shards",
        "model. one file, 300,000 records",
        "m. sharded: decode only (the decoder's floor)",
        "m. one file: decode only (the decoder's floor)",
        "m. ratios to the bare loop over the same files (wall time)",
        "m. ratios to the bare loop over the same files (CPU time",
        "n. 4096 shards: every reader ran",
        "o. object store read ratio",
        "s. summary: the output of every --jobs identical",
        "f. fixed cost of --jobs N: ",
        "cores; output identical",
        "f. summary --jobs 2 ",
        "bench_outputs on ",
        "tap (outputs)",
        "output floor",
        "sharded activation's statistics (8 devices): tap (outputs) / per-shard statistics",
        "s. validate: the output of every --jobs identical",
        "summary --jobs 2 ",
        "o. the client's start alone",
        "o. a stdlib client, nothing parsed",
        "l. file",
        "l. sharded",
        "l. sharded: rate at",
        "q. pmap: fingerprint / floor",
        "q. pmap: fingerprint / floor_b",
        "q. jit: fingerprint / floor",
        "q. detection:",
        "v. compile jax.jit + fingerprint / untapped",
        "v. compile pmaptap.jit + fingerprint / untapped",
        "v. hash alone, leaf by leaf",
        "v. hash alone, fingerprint64_many",
        "v. hash on the host / floor",
        "v. skipped jax.jit fingerprint / untapped",
        "v. skipped jax.jit raw callback / untapped",
        "v. skipped pmaptap.jit fingerprint / untapped",
        "v. skipped pmaptap.jit tap / untapped",
    ):
        assert label in out, f"missing {label!r} in:\n{out}"
    assert "x" in out.split("a. per_device tap", 1)[1].splitlines()[0]  # a ratio printed
    # Every tap arm prints its ratio to the floor (one raw callback from one
    # device, same payload) beside its ratio to raw callbacks (issue 17).
    assert "ratio to floor" in out and "floor ms/step" in out

    def ratios(label: str) -> list[str]:
        line = next(ln for ln in out.splitlines() if ln.startswith(label))
        return re.findall(r"(-?\d+\.\d+|nan)x", line)

    for label in (
        "a. per_device tap ",
        "a. per_device, transport only",
        "b. replicated tap (verified)",
        "b. replicated, transport only",
        "b. replicated tap (verify off)",
        "c. 4 taps in one step",
        "c. 4 taps, auto_group=False",
        "c. 4 taps in pmaptap.group()",
    ):
        assert len(ratios(label)) >= 2, f"{label!r}: no ratio to raw and to floor"
    # bench_outputs.py stats: each shard's statistics against returning them by hand.
    # (the first line of the letter t.: bench_outputs.py runs after bench_fpcost, v.)
    assert ratios("t. "), "t.: no ratio to the per-shard floor"
    for mib in (2, 32):  # bench_arrays.py: both ratios, as numbers
        for ref in ("raw+write", "raw"):
            assert ratios(f"m. {mib} MiB sharded activation, tap / {ref} "), (mib, ref)
    for label in ("d. every=100, traced step", "d. every=100, ~5 ms step"):
        line = next(ln for ln in out.splitlines() if ln.startswith(label))
        assert ratios(label) or "vanishes" in line, line
    assert "to raw / to floor" in out  # g. both ratios per device count
    for n in ("1", "2", "4"):
        line = next(
            ln for ln in out.split("added ms per step", 1)[1].splitlines() if ln.startswith(n + " ")
        )
        assert len(re.findall(r"(-?\d+\.\d+|nan)x", line)) == 4, line
    demo = next(ln for ln in out.splitlines() if ln.startswith("f. demo step (hidden 32"))
    # f. restated against the floor
    assert re.search(r"\d+\.\d+x step, (-?\d+\.\d+|nan)x added", demo), demo
    # k. (bench_floor.py): the pieces of a scalar tap, each against the floor.
    for label in (
        "k. floor, pmaptap's primitive",
        "k.   + all_gather (replicated value)",
        "k.   replicated tap, transport only",
        "k.   replicated tap, prove_replicated=False",
        "k.   per_device tap ",
        "k.   16 scalar taps (automatic grouping)",
        "k.   16 scalar taps, auto_group=False",
    ):
        assert len(ratios(label)) == 2, f"{label!r}: no wall and CPU ratio to the floor"
    # bench_read.py: both ratios against the bare orjson loop, as numbers.
    # bench_many_writers.py: every run read back exact and validate-clean.
    assert "exact+valid" in out and "NO:" not in out
    # q. (bench_fingerprint.py): both ratios to the floor, bytes to the host
    # and file growth per step as numbers; every injected fault named, no
    # clean step flagged.
    for label in ("q. pmap: fingerprint / floor ", "q. jit: fingerprint / floor "):
        assert len(ratios(label)) == 2, label
    # r.: per dtype on one device (a 64-bit one under x64), the call under
    # jax.jit and under pmaptap.jit and the bare hash with a raw callback
    # against the floor, and the hash against the float32 sums, as numbers.
    for dtype in ("float32", "bfloat16", "float16", "int8", "complex128"):
        assert len(ratios(f"r. {dtype}: fingerprint / floor")) == 4, dtype
    # v. (bench_fpcost.py): compile and skipped-step ratios as numbers.
    for label in ("v. compile jax.jit + fingerprint", "v. skipped pmaptap.jit fingerprint"):
        assert ratios(label), label
    # u. (bench_guide.py): the guide's step, both transports to raw and floor.
    for label in ("u. guide step, jax.jit / raw", "u. guide step, pmaptap.jit / raw"):
        assert len(ratios(label)) == 2, label
    # w. (bench_transformer.py): the real model's step, to by hand, raw and
    # floor, and its compile to the untapped compile; records checked.
    for label in ("w. pmaptap.jit ", "w. pmaptap.jit host step ", "w. jax.jit "):
        assert len(ratios(label)) == 4, label
    assert len(ratios("w. compile pmaptap.jit ")) == 1  # --compile-rounds
    # ... with lift's two passes timed: "first / second" seconds last.
    row = next(ln for ln in out.splitlines() if ln.startswith("w. compile pmaptap.jit "))
    first, second = (float(x) for x in row.split()[-3::2])
    assert first > 0 and second > 0, row
    # --first-trace: a fresh process an arm, the collector's full
    # collections counted, with and without lift holding it off.
    for arm in ("pmaptap.jit ", "pmaptap.jit collector on "):
        line = next(ln for ln in out.splitlines() if ln.startswith(f"w. first trace {arm}"))
        assert len(ratios(f"w. first trace {arm}")) == 1 and line.rstrip().endswith(" s"), line
    assert "records checked against the returned values" in out
    assert "w. device profile: " in out  # --profile's trace read back (no device plane on CPU)
    # --profile's host pass: each arm's calls timed, pmaptap's threads and flush in parts.
    host = next(ln for ln in out.splitlines() if ln.startswith("w. host profile: pmaptap.jit: "))
    assert re.search(r"call \d+ us a step, step number in flight at \d+/\d+ calls", host), host
    thread = r"output thread \d+ us CPU a step \(\d+ us wall\); flush: steps delivered \d+ us"
    assert re.search(thread, host), host
    assert "w. host profile: a fresh jnp.int32(s)" in out
    detection = next(ln for ln in out.splitlines() if ln.startswith("q. detection:"))
    named, trials = re.search(r"(\d+)/(\d+) single-bit faults", detection).groups()
    assert named == trials and " 0 false positive" in detection, detection
    ratio = out.split("\nsummary: ", 1)[1]
    assert float(ratio.split("x", 1)[0]) > 0 and "wall" in ratio.split("\n", 1)[0]
    assert "summary peak RSS" in out
