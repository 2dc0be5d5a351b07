"""f. The example training step (launch/train.py, pmap over 8 devices) with
its four taps against the same step without them: total step-time ratio."""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "launch")):
    if p not in sys.path:
        sys.path.insert(0, p)
from benchmarks.common import interleaved, machine, set_devices, table  # noqa: E402

DEVICES = 8


def run(quick: bool = False) -> list[tuple]:
    import jax
    import numpy as np

    import pmaptap
    import train

    rounds, steps = (3, 5) if quick else (15, 40)
    tmp = tempfile.mkdtemp(prefix="pmaptap-train-")
    session = pmaptap.Session(os.path.join(tmp, "train.jsonl"), run="bench").open()
    rows = []
    for batch in ((8,) if quick else (8, 512)):
        params = jax.tree.map(lambda a: np.stack([a] * DEVICES), train.init_params(0))
        shards = [train.make_batch(0, 0, k, batch) for k in range(DEVICES)]
        x = np.stack([s[0] for s in shards])
        y = np.stack([s[1] for s in shards])
        arms = {}
        for name, taps in (("untapped", False), ("tapped", True)):
            fn = jax.pmap(train.make_body("dp", 0.05, 1000, mark_varying=False, taps=taps),
                          axis_name="dp", in_axes=(0, 0, 0, None))
            state = {"p": params, "step": 0}

            def go(fn=fn, state=state, taps=taps):
                loss = None
                for _ in range(steps):
                    state["p"], loss = fn(state["p"], x, y, np.int32(state["step"] % 1000))
                    state["step"] += 1
                loss.block_until_ready()
                if taps:
                    session.flush()
                else:
                    jax.effects_barrier()
            arms[name] = go
        med = interleaved(arms, rounds=rounds, steps=steps)
        rows.append((f"f. training step, batch {batch}/device",
                     f"{med['tapped'] * 1e3:.3f}", f"{med['untapped'] * 1e3:.3f}",
                     f"{med['tapped'] / med['untapped']:.2f}x", "<= 1.10x"))
    session.close()
    print(f"launch/train.py step, pmap over {DEVICES} devices, taps: loss, lr, step "
          f"(replicated), grad_norm (per_device) in one pmaptap.group(); {machine()}")
    print(table(rows, ("arm", "tapped ms/step", "untapped ms/step", "ratio", "target")))
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    set_devices(DEVICES)
    run(quick=a.quick)
