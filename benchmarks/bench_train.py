"""f. The example training step (launch/train.py, pmap over 8 devices) with
its four taps (loss, lr, step replicated; grad_norm per device; one
pmaptap.group()) against the same step without them: total step-time ratio.

Rows: the demo's default step (a tiny MLP, a short step), the same recording every
10th step (``--tap-every 10``: an untapped compilation runs the other steps;
and ``every=10`` decided on device instead), wider models (``--hidden 1024`` and 2048 at
batch 1024 per device: longer steps), and the floor JAX imposes on
each step: ONE raw ``jax.debug.callback`` from one device, inside lax.cond,
carrying the same payload as pmaptap's one callback (coordinates, the four
steps, the eight copies of each value). The tapped step is restated against
the floor: step time over the floor's, and added cost (over the untapped
step) over the floor's, both paired per round."""

from __future__ import annotations

import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "launch")):
    if p not in sys.path:
        sys.path.insert(0, p)
from benchmarks.common import (  # noqa: E402
    floor_callback,
    interleaved_rounds,
    machine,
    main_quick,
    medians,
    paired,
    table,
)

DEVICES = 8


def run(quick: bool = False) -> list[tuple]:
    import jax
    import jax.numpy as jnp
    import model as demo
    import numpy as np
    from jax import lax

    import pmaptap

    rounds, steps = (3, 5) if quick else (15, 40)
    tmp = tempfile.mkdtemp(prefix="pmaptap-train-")
    session = pmaptap.Session(os.path.join(tmp, "train.jsonl"), run="bench").open()

    def floor_body(params, x, y, step):
        # The least JAX allows to see these values every step: one callback,
        # from one device, with the arrays pmaptap's grouped callback carries
        # (built by broadcasting: the floor has no collective).
        vals = []
        out = demo.make_step(
            "dp", 0.05, 1000, mark_varying=False, tap=lambda v, *a, **k: vals.append(v)
        )(params, x, y, step)
        stacked = [jnp.broadcast_to(v, (DEVICES,) + jnp.shape(v)) for v in vals]
        floor_callback("dp", lax.axis_index("dp")[None], *([step] * len(vals)), *stacked)
        return out

    # (label, hidden, batch/device, every, where every is decided, floor row)
    configs = [
        ("demo step (hidden 32, batch 8/device)", 32, 8, 1, "", True),
        ("demo step, --tap-every 10 (untapped steps between)", 32, 8, 10, "host", False),
        ("demo step, every=10 decided on device", 32, 8, 10, "device", False),
    ]
    if not quick:
        configs += [
            ("--hidden 1024, batch 1024/device", 1024, 1024, 1, "", True),
            ("--hidden 2048, batch 1024/device", 2048, 1024, 1, "", True),
        ]
    rows = []
    for label, hidden, batch, every, where, with_floor in configs:
        # Fewer steps per round for the slow step: about 1 s per arm-round.
        n_steps = steps if hidden < 2048 else max(1, steps // 4)
        params = jax.tree.map(lambda a: np.stack([a] * DEVICES), demo.init_params(0, hidden))
        shards = [demo.make_batch(0, 0, k, batch) for k in range(DEVICES)]
        x = np.stack([s[0] for s in shards])
        y = np.stack([s[1] for s in shards])

        def pmapped(body):
            return jax.pmap(body, axis_name="dp", in_axes=(0, 0, 0, None))

        plain = pmapped(demo.make_body("dp", 0.05, 1000, mark_varying=False, taps=False))
        if where == "host":
            # launch/train.py --tap-every: a tapped and an untapped compilation
            loud, quiet = map(
                pmapped,
                demo.tapped_and_quiet(demo.make_body("dp", 0.05, 1000, mark_varying=False), every),
            )
            tapped = lambda s, loud=loud, quiet=quiet: loud if s % every == 0 else quiet
        else:
            fn = pmapped(demo.make_body("dp", 0.05, 1000, mark_varying=False, every=every))
            tapped = lambda s, fn=fn: fn
        pick = {"untapped": lambda s: plain, "tapped": tapped}
        if with_floor:
            floor = pmapped(floor_body)
            pick["floor"] = lambda s: floor
        arms = {}
        for name, choose in pick.items():
            state = {"p": params, "step": 0}

            def go(choose=choose, state=state, is_tapped=name == "tapped", n_steps=n_steps):
                loss = None
                for _ in range(n_steps):
                    s = state["step"] % 1000
                    state["p"], loss = choose(s)(state["p"], x, y, np.int32(s))
                    state["step"] += 1
                loss.block_until_ready()
                if is_tapped:
                    session.flush()
                else:
                    jax.effects_barrier()

            arms[name] = go
        times = interleaved_rounds(arms, rounds=rounds, steps=n_steps)
        med = medians(times)
        to_floor = "-"
        if with_floor:
            to_floor = (
                f"{paired(times, 'tapped', 'floor'):.2f}x step, "
                f"{paired(times, 'tapped', 'floor', 'untapped'):.2f}x added"
            )
        rows.append(
            (
                f"f. {label}",
                f"{med['tapped'] * 1e3:.3f}",
                f"{med['untapped'] * 1e3:.3f}",
                f"{paired(times, 'tapped', 'untapped'):.2f}x",
                to_floor,
                "<= 1.10x",
            )
        )
        if with_floor:
            rows.append(
                (
                    "   floor: 1 raw callback from 1 device, same step",
                    f"{med['floor'] * 1e3:.3f}",
                    f"{med['untapped'] * 1e3:.3f}",
                    f"{paired(times, 'floor', 'untapped'):.2f}x",
                    "1",
                    "(JAX's minimum)",
                )
            )
    session.close()
    print(
        f"launch/train.py step, pmap over {DEVICES} devices, taps: loss, lr, step "
        f"(replicated), grad_norm (per_device) in one pmaptap.group(); {machine()}"
    )
    print(
        "ratios paired per round; to floor: the tapped step over the floor step, and "
        "its added cost over the floor's (both over the untapped step)"
    )
    print(
        table(
            rows,
            (
                "arm",
                "tapped ms/step",
                "untapped ms/step",
                "ratio to untapped",
                "ratio to floor",
                "target",
            ),
        )
    )
    return rows


if __name__ == "__main__":
    main_quick(run, DEVICES)
