"""g. Added cost per step of a replicated and a per_device tap at 1..32
simulated devices (one subprocess per device count: XLA fixes the count at
start-up), against a raw jax.debug.callback per device and against the floor
(ONE raw callback from the first device with the same payload as the tap's
one callback: the copies stacked) in the same run, paired per round."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from benchmarks.common import (  # noqa: E402
    floor_callback,
    interleaved_rounds,
    medians,
    paired,
    set_devices,
    table,
)


def measure(n: int, quick: bool) -> dict:
    import tempfile

    import jax
    import jax.numpy as jnp
    from jax import lax

    import pmaptap

    rounds, steps = (3, 5) if quick else (11, 30)
    s = pmaptap.Session(os.path.join(tempfile.mkdtemp(), "s.jsonl"), run="scale").open()
    x = jnp.ones((n, 256), jnp.float32)

    def make(kind):
        def body(v):
            y = jnp.tanh(v)
            loss = lax.pmean(jnp.sum(y), "i")
            if kind == "raw":
                jax.debug.callback(lambda *a: None, loss, lax.axis_index("i"))
            elif kind == "floor":
                # Both taps send coords, the step (-1) and n stacked scalars.
                floor_callback(
                    "i", lax.axis_index("i")[None], jnp.int32(-1), jnp.broadcast_to(loss, (n,))
                )
            elif kind == "replicated":
                pmaptap.tap(loss, "rep", dedup="replicated")
            elif kind == "per_device":
                pmaptap.tap(jnp.sum(y), "per", dedup="per_device")
            return y

        f = jax.pmap(body, axis_name="i")

        def go():
            y = None
            for _ in range(steps):
                y = f(x)
            y.block_until_ready()
            if kind in ("replicated", "per_device"):
                s.flush()
            else:
                jax.effects_barrier()

        return go

    kinds = ("base", "raw", "floor", "replicated", "per_device")
    times = interleaved_rounds({k: make(k) for k in kinds}, rounds=rounds, steps=steps)
    s.close()
    med = medians(times)
    out = {k: (v - med["base"]) * 1e3 for k, v in med.items()}
    for k in ("replicated", "per_device"):
        out[f"{k}/raw"] = paired(times, k, "raw", "base")
        out[f"{k}/floor"] = paired(times, k, "floor", "base")
    return out


def run(quick: bool = False) -> list[tuple]:
    counts = (1, 2, 4) if quick else (1, 2, 4, 8, 16, 32)
    rows = []
    for n in counts:
        out = subprocess.run(
            [sys.executable, __file__, "--child", str(n)] + (["--quick"] if quick else []),
            capture_output=True,
            text=True,
            timeout=900,
        )
        if out.returncode != 0:
            raise RuntimeError(out.stderr)
        m = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(
            (
                n,
                f"{m['raw']:.3f}",
                f"{m['floor']:.3f}",
                f"{m['replicated']:.3f}",
                f"{m['per_device']:.3f}",
                f"{m['replicated/raw']:.2f}x / {m['replicated/floor']:.2f}x",
                f"{m['per_device/raw']:.2f}x / {m['per_device/floor']:.2f}x",
            )
        )
    print(
        "g. added ms per step (scalar taps, pmap); ratios (paired per round) against "
        "the raw per-device callback / against the floor (1 raw callback from 1 device)"
    )
    print(
        table(
            rows,
            (
                "devices",
                "raw callback",
                "floor",
                "replicated tap",
                "per_device tap",
                "replicated: to raw / to floor",
                "per_device: to raw / to floor",
            ),
        )
    )
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--child", type=int, default=0)
    a = ap.parse_args()
    if a.child:
        set_devices(a.child)
        print(json.dumps(measure(a.child, a.quick)))
    else:
        run(quick=a.quick)
