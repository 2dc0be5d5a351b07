"""Array values stored as bytes (issue 26): a 2 MiB float32 activation tapped
every step under jit on a 4x2 mesh (8 shards of 256 KiB, per_device
records), against a raw ``jax.debug.callback(partitioned=True)`` carrying
the same shards; and the bytes the tap puts on disk per byte of the array.

The tap's arm includes writing its records and bytes: each round ends with
``flush()`` (the raw arm with ``effects_barrier()``). Ratios are of added
cost over the same step without any callback, paired per round.
"""

from __future__ import annotations

import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from benchmarks.common import (  # noqa: E402
    activation_step,
    interleaved_rounds,
    machine,
    main_quick,
    medians,
    paired,
    sharded_linspace,
    steps_arm,
    table,
)

DEVICES = 8
ROWS, COLS = 1024, 512  # float32: 2 MiB, shards of 256x256 (256 KiB) on 4x2


def _disk_bytes(path: str) -> int:
    total = os.path.getsize(path)
    blobs = path + ".bytes"
    if os.path.isdir(blobs):
        total += sum(os.path.getsize(os.path.join(blobs, n)) for n in os.listdir(blobs))
    return total


def _plain_write_ms(path: str, nbytes: int, n: int) -> float:
    import statistics
    import time

    data = os.urandom(nbytes)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        times = []
        for _ in range(n):
            t = time.perf_counter()
            os.write(fd, data)
            times.append(time.perf_counter() - t)
    finally:
        os.close(fd)
        os.remove(path)
    return statistics.median(times) * 1e3


def run(quick: bool = False) -> list[tuple]:
    import jax
    import numpy as np
    from jax.sharding import Mesh

    import pmaptap

    rounds, steps = (3, 4) if quick else (15, 20)
    tmp = tempfile.mkdtemp(prefix="pmaptap-bench-arrays-")
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    x = sharded_linspace(mesh, ROWS, COLS)

    path = os.path.join(tmp, "bench.jsonl")
    session = pmaptap.Session(path, run="bench").open()

    times = interleaved_rounds(
        {
            k: steps_arm(
                activation_step(k), x, steps, session.flush if k == "tap" else jax.effects_barrier
            )
            for k in ("base", "raw", "tap")
        },
        rounds=rounds,
        steps=steps,
    )
    session.close()
    med = medians(times)

    # Bytes on disk per byte of the array: a fresh run of this tap alone.
    disk_path = os.path.join(tmp, "disk.jsonl")
    n = 4 if quick else 20
    fn = activation_step("tap")
    with pmaptap.Session(disk_path, run="disk"):
        for _ in range(n):
            fn(x)
    on_disk = _disk_bytes(disk_path) / (n * ROWS * COLS * 4)

    # The disk's own price of those bytes: one plain os.write of the array's
    # size per step to a file beside the tap file (on a disk whose writeback
    # throttles, this alone can exceed the raw callback's whole cost).
    write_ms = _plain_write_ms(os.path.join(tmp, "plain.bin"), ROWS * COLS * 4, n * 5)

    rows = [
        (
            "m. 2 MiB sharded activation, stored as bytes",
            "raw partitioned callback",
            f"{med['tap'] * 1e3:.3f}",
            f"{med['raw'] * 1e3:.3f}",
            f"{paired(times, 'tap', 'raw', 'base'):.2f}x",
            "8 shards of 256 KiB, per_device; added cost, paired rounds",
        ),
        (
            "m. the disk alone: os.write of 2 MiB",
            "",
            f"{write_ms:.3f}",
            "",
            "",
            "median per step, same directory: what storing the bytes costs at least",
        ),
        (
            "m. bytes on disk per array byte",
            "the raw array",
            "",
            "",
            f"{on_disk:.3f}x",
            f"{n} steps: lines + .bytes files",
        ),
    ]
    print(
        f"jit over {DEVICES} devices (4x2 mesh); no-callback step "
        f"{med['base'] * 1e3:.3f} ms; {machine()}"
    )
    print(table(rows, ("arm", "against", "arm ms/step", "raw ms/step", "ratio", "note")))
    return rows


if __name__ == "__main__":
    main_quick(run, DEVICES)
