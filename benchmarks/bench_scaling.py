"""g. Added cost per step of a replicated and a per_device tap at 1..32
simulated devices (one subprocess per device count: XLA fixes the count at
start-up), against a raw jax.debug.callback per device in the same run."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from benchmarks.common import interleaved, set_devices, table  # noqa: E402


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

    med = interleaved({k: make(k) for k in ("base", "raw", "replicated", "per_device")},
                      rounds=rounds, steps=steps)
    s.close()
    return {k: (v - med["base"]) * 1e3 for k, v in med.items()}


def run(quick: bool = False) -> list[tuple]:
    counts = (1, 2, 4) if quick else (1, 2, 4, 8, 16, 32)
    rows = []
    for n in counts:
        out = subprocess.run([sys.executable, __file__, "--child", str(n)]
                             + (["--quick"] if quick else []),
                             capture_output=True, text=True, timeout=900)
        if out.returncode != 0:
            raise RuntimeError(out.stderr)
        m = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append((n, f"{m['raw']:.3f}", f"{m['replicated']:.3f}", f"{m['per_device']:.3f}",
                     f"{m['replicated'] / m['raw']:.2f}x" if m["raw"] > 0 else "-",
                     f"{m['per_device'] / m['raw']:.2f}x" if m["raw"] > 0 else "-"))
    print("g. added ms per step (scalar taps, pmap); ratios against the raw per-device callback")
    print(table(rows, ("devices", "raw callback", "replicated tap", "per_device tap",
                       "replicated ratio", "per_device ratio")))
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
