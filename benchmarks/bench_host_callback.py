"""What program order costs ``host_callback.id_tap`` (issue 18, point 1).

``id_tap`` returns its value tied to the host callback (an int32 token XORed
into it, see pmaptap/host_callback/_linked.py), so the next step of a loop
waits for the tap. Arms, each a jitted ``scan`` whose every step taps a
4 KiB value and feeds it to the next step:
  base       no tap
  raw        jax.debug.callback(noop, y)
  untied     id_tap's callback with the tie removed (the old behaviour)
  tied       id_tap as shipped
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import interleaved, machine, main_quick, table  # noqa: E402

PAYLOAD = 1024  # float32 = 4 KiB
LOOP = 100  # scan steps per call


def run(quick: bool = False) -> list[tuple]:
    import jax
    import jax.numpy as jnp
    from jax import lax

    import pmaptap.host_callback as hcb
    from pmaptap.host_callback import _linked

    rounds, calls = (3, 2) if quick else (15, 10)
    x = jnp.linspace(0.0, 1.0, PAYLOAD, dtype=jnp.float32)

    def noop_tap(arg, transforms):
        return None

    def make(kind):
        def step(y, _):
            y = jnp.tanh(y) * 1.0001
            if kind == "raw":
                jax.debug.callback(lambda v: None, y)
            elif kind in ("tied", "untied"):
                y = hcb.id_tap(noop_tap, y)
            return y, None

        def loop(v):
            return lax.scan(step, v, None, length=LOOP)[0]

        # The tie is emitted by the primitive's lowering (_linked._xor_token).
        real_tie = _linked._xor_token
        if kind == "untied":
            _linked._xor_token = lambda value, token: value
        try:
            return jax.jit(loop).lower(x).compile()  # lowered now, with the patch
        finally:
            _linked._xor_token = real_tie

    def arm(fn):
        def go():
            y = None
            for _ in range(calls):
                y = fn(x)
            y.block_until_ready()
            hcb.barrier_wait()

        return go

    kinds = ("base", "raw", "untied", "tied")
    med = interleaved({k: arm(make(k)) for k in kinds}, rounds=rounds, steps=calls)
    per_tap = {k: (med[k] - med["base"]) / LOOP * 1e3 for k in kinds}
    rows = [
        (
            "j. id_tap (tied, program order)",
            f"{per_tap['tied']:.4f}",
            f"{per_tap['tied'] - per_tap['untied']:+.4f} ms vs untied",
        ),
        ("j. id_tap, callback without the tie", f"{per_tap['untied']:.4f}", "-"),
        ("j. raw jax.debug.callback", f"{per_tap['raw']:.4f}", "-"),
    ]
    print(
        f"jit(scan) of {LOOP} steps, {PAYLOAD * 4 // 1024} KiB tapped per step; "
        f"no-tap step {med['base'] / LOOP * 1e3:.4f} ms; {machine()}"
    )
    print(table(rows, ("arm", "added ms per tap", "cost of the tie")))
    return rows


if __name__ == "__main__":
    main_quick(run, 1)
