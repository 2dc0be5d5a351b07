"""k. Where a scalar tap's cost above the floor goes (issue 17).

pmap over 8 devices, a scalar replicated tap (the step's pmean loss) and a
scalar per_device tap, against the floor (ONE raw jax.debug.callback from
the first device, inside lax.cond, with the tap's payload: coords, step, the
8 copies). Arms add one piece at a time, so the differences between rows
are the cost of that piece:

  floor, pmaptap's primitive   the floor's callback through pmaptap's own
                               primitive (no jax.device_put on XLA's thread)
  + all_gather                 the collective that brings the copies over
  tap, transport only          the real tap: leader cond, coords, the hand-off
                               (the host pipeline cut off at ``deliver``)
  tap                          with the host pipeline: aggregation, records,
                               JSON, the file (a flush() per round)

The replicated tap's pmean loss is proven replicated at trace time (no
collective: the leader's copy); "prove_replicated=False" compares the
copies (an all_gather of them), as every replicated tap did before.

Then 4 and 16 scalar taps in one step (half replicated, half per_device):
written apart (automatic grouping on, the default: one callback for the
step's taps), apart with ``auto_group=False`` (one gather + cond + callback
each), and in one ``pmaptap.group()``, against one floor callback carrying
all their values.

Wall time and this process's CPU time, both as added cost per step over the
no-callback step, paired per round against the floor.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import (  # noqa: E402
    floor_callback,
    machine,
    main_quick,
    paired,
    table,
    wall_and_cpu_rounds,
)

DEVICES = 8


def run(quick: bool = False) -> list[tuple]:
    import jax
    import jax.numpy as jnp
    from jax import lax

    import pmaptap
    from pmaptap._trace import layouts, untapped  # noqa: F401

    # Importing untapped registers its JAX config state, which joins JAX's
    # trace cache key. Registered only by the first traced tap, it made the
    # arms traced before it (the option arms, traced under configured())
    # trace again on their next call, with the default options: the
    # "verify off" row measured the default replicated tap until this.
    from pmaptap._trace.primitive import emit_callback

    rounds, steps = (3, 5) if quick else (31, 40)
    session = pmaptap.Session(
        os.path.join(tempfile.mkdtemp(prefix="pmaptap-floor-"), "floor.jsonl"), run="floor"
    ).open()
    x = jnp.ones((DEVICES, 256), jnp.float32)
    real_deliver, xport = layouts.deliver, {"drop": False}
    layouts.deliver = lambda spec, arrays: None if xport["drop"] else real_deliver(spec, arrays)

    def nothing(*_):
        return None

    s_dev = jnp.int32(7)  # a step counter on the device: no transfer per call

    def make(kind: str):
        if kind.startswith("tap_step"):
            # A learning rate made from a step counter passed with
            # in_axes=None, tapped with step= it (the demo's lr and step):
            # proven alike by the pmap's in_spec, so one copy, no check.
            def body_s(v, s):
                y = jnp.tanh(v)
                lr = 0.1 * (s + 1).astype(jnp.float32)
                pmaptap.tap(lr, "k_lr", step=s, dedup="replicated")
                return y

            fn_s = jax.pmap(body_s, axis_name="i", in_axes=(0, None))
            with pmaptap.configured(prove_replicated=kind == "tap_step"):
                fn_s(x, s_dev).block_until_ready()  # trace now, with the option

            def go_s():
                y = None
                for _ in range(steps):
                    y = fn_s(x, s_dev)
                y.block_until_ready()
                session.flush()

            return go_s

        def body(v):
            y = jnp.tanh(v)
            value = lax.pmean(jnp.sum(y), "i") if "rep" in kind else jnp.sum(y)
            idx = lax.axis_index("i")
            payload = (idx[None], jnp.int32(-1))
            many = int(kind.split("x")[1]) if "x" in kind else 0
            if many:
                # n scalars: even ones replicated (from the pmean), odd ones
                # per device; the floor carries every copy of each.
                loss, mine = lax.pmean(jnp.sum(y), "i"), jnp.sum(y)
                vals = [(loss if i % 2 == 0 else mine) * (1.0 + i) for i in range(many)]
                if kind.startswith("floorx"):
                    floor_callback(
                        "i",
                        idx[None],
                        *([jnp.int32(-1)] * many),
                        *[jnp.broadcast_to(v_, (DEVICES,)) for v_ in vals],
                    )
                    return y
                ctx = pmaptap.group() if kind.startswith("group") else contextlib.nullcontext()
                with ctx:
                    for i, v_ in enumerate(vals):
                        pmaptap.tap(
                            v_, f"k_{many}_{i}", dedup="replicated" if i % 2 == 0 else "per_device"
                        )
                return y
            if kind == "floor":
                floor_callback("i", *payload, jnp.broadcast_to(value, (DEVICES,)))
            elif kind == "own":
                lax.cond(
                    idx == 0,
                    lambda: emit_callback(nothing, *payload, jnp.broadcast_to(value, (DEVICES,))),
                    lambda: None,
                )
            elif kind.startswith("gather"):
                g = lax.all_gather(value, "i")
                lax.cond(idx == 0, lambda: emit_callback(nothing, *payload, g), lambda: None)
            elif kind.startswith("tap_rep"):
                pmaptap.tap(value, "k_rep", dedup="replicated")
            elif kind.startswith("tap_per"):
                pmaptap.tap(value, "k_per", dedup="per_device")
            return y

        fn = jax.pmap(body, axis_name="i")
        if kind == "tap_rep_unverified":
            with pmaptap.configured(verify_replicated=False):
                fn(x).block_until_ready()  # trace now, with the option
        if kind == "tap_rep_compared":
            with pmaptap.configured(prove_replicated=False):
                fn(x).block_until_ready()
        if kind.startswith("onex"):
            with pmaptap.configured(auto_group=False):
                fn(x).block_until_ready()
        full = kind.startswith(("tap", "group", "one")) and not kind.endswith("@transport")

        def go():
            xport["drop"] = kind.endswith("@transport")
            y = None
            for _ in range(steps):
                y = fn(x)
            y.block_until_ready()
            if full:
                session.flush()
            else:
                jax.effects_barrier()
            xport["drop"] = False

        return go

    kinds = [
        "base",
        "floor",
        "own",
        "gather_rep",
        "gather_per",
        "tap_rep@transport",
        "tap_rep",
        "tap_rep_unverified",
        "tap_rep_compared",
        "tap_step",
        "tap_step_compared",
        "tap_per@transport",
        "tap_per",
        "floorx4",
        "tapsx4",
        "onex4",
        "groupx4",
        "floorx16",
        "tapsx16",
        "onex16",
        "groupx16",
    ]
    arms = {k: make(k) for k in kinds}
    for fn in arms.values():
        fn()
    wall, cpu = wall_and_cpu_rounds(arms, rounds=rounds, steps=steps)
    session.close()

    def to_floor(t: dict[str, list[float]], k: str, floor: str = "floor") -> str:
        r = paired(t, k, floor, "base")
        return f"{r:.2f}x" if r == r else "nan"

    def added(t: dict[str, list[float]], k: str) -> str:
        return f"{(statistics.median(t[k]) - statistics.median(t['base'])) * 1e3:+.3f}"

    labels = {
        "floor": "floor (raw jax.debug.callback)",
        "own": "floor, pmaptap's primitive",
        "gather_rep": "  + all_gather (replicated value)",
        "tap_rep@transport": "  replicated tap, transport only",
        "tap_rep": "  replicated tap",
        "tap_rep_compared": "  replicated tap, prove_replicated=False",
        "tap_rep_unverified": "  replicated tap, verify off (no gather)",
        "tap_step": "  replicated tap of an in_axes=None step's lr, step= it",
        "tap_step_compared": "  the same, prove_replicated=False",
        "gather_per": "  + all_gather (per-device value)",
        "tap_per@transport": "  per_device tap, transport only",
        "tap_per": "  per_device tap",
    }
    rows = [
        (f"k. {labels[k]}", added(wall, k), to_floor(wall, k), added(cpu, k), to_floor(cpu, k))
        for k in labels
    ]
    for n in (4, 16):
        for k, label in (
            (f"floorx{n}", f"floor: 1 raw callback, {n} values"),
            (f"tapsx{n}", f"  {n} scalar taps (automatic grouping)"),
            (f"onex{n}", f"  {n} scalar taps, auto_group=False"),
            (f"groupx{n}", f"  {n} scalar taps in pmaptap.group()"),
        ):
            rows.append(
                (
                    f"k. {label}",
                    added(wall, k),
                    to_floor(wall, k, f"floorx{n}"),
                    added(cpu, k),
                    to_floor(cpu, k, f"floorx{n}"),
                )
            )
    print(
        f"k. scalar taps above the floor, pmap over {DEVICES} devices; no-callback "
        f"step {statistics.median(wall['base']) * 1e3:.3f} ms; {machine()}"
    )
    print(
        table(rows, ("arm", "added wall ms", "to floor (wall)", "added CPU ms", "to floor (CPU)"))
    )
    return rows


if __name__ == "__main__":
    main_quick(run, DEVICES)
