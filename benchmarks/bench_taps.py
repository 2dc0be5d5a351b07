"""Per-step cost of taps under pmap over 8 devices, against a payload-equal
raw jax.debug.callback (same arrays plus axis_index, one per device), and
against the floor (benchmarks/common.py ``floor_callback``: ONE raw callback
from the first device, inside lax.cond, with the same payload as pmaptap's
one callback), both measured in the same run and paired per round.

Arms (issue 8): a. per_device, b. replicated (verified and unverified),
c. four taps in one step (automatic grouping, the default; with
``auto_group=False``; in ``pmaptap.group()``), d. every=100 with a traced step (its floor fires
on the same steps), also at a ~5 ms step.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
PAYLOAD = 1024  # float32 per device = 4 KiB


def run(quick: bool = False) -> list[tuple]:
    import jax
    import jax.numpy as jnp
    from jax import lax

    import pmaptap
    from pmaptap._trace import untapped  # noqa: F401

    # untapped's JAX config state joins JAX's trace cache key when imported;
    # imported only by the first traced tap, it made the arms traced before
    # it under configured() (verify off, auto_group=False) trace again on
    # their next call with the default options (see bench_floor.py).

    rounds, steps = (3, 5) if quick else (15, 40)
    tmp = tempfile.mkdtemp(prefix="pmaptap-bench-")
    session = pmaptap.Session(os.path.join(tmp, "bench.jsonl"), run="bench").open()
    x = jnp.linspace(0.0, 1.0, DEVICES * PAYLOAD, dtype=jnp.float32).reshape(DEVICES, PAYLOAD)

    def noop(*_):
        return None

    def work(v, heavy):
        y = jnp.tanh(v) * 1.0001
        if heavy:

            def more(_, y):
                m = y.reshape(32, 32)
                return jnp.tanh(m @ m.T * 0.01).reshape(-1) + y

            y = lax.fori_loop(0, heavy, more, y)
        return y, lax.pmean(jnp.sum(y), "i")

    def make(kind, heavy=0):
        def body(v, step):
            y, loss = work(v, heavy)
            idx = lax.axis_index("i")
            if kind == "raw_per":
                jax.debug.callback(noop, y, idx)
            elif kind == "raw_rep":
                jax.debug.callback(noop, loss, idx)
            elif kind == "raw4":
                for val in (y, loss, step.astype(jnp.float32), loss * 0.1):
                    jax.debug.callback(noop, val, idx)
            elif kind.startswith("floor"):
                # The same arrays as pmaptap's one callback for the matching
                # arm: coords, step(s), every copy stacked (a constant step
                # -1 where the tap has no step argument, as the tap sends).
                coords, m1 = idx[None], jnp.int32(-1)

                def stacked(v):
                    return jnp.broadcast_to(v, (DEVICES,) + jnp.shape(v))

                if kind == "floor_per":
                    floor_callback("i", coords, m1, stacked(y))
                elif kind == "floor_rep":
                    floor_callback("i", coords, m1, stacked(loss))
                elif kind == "floor_rep_one":  # verify off: one copy
                    floor_callback("i", coords, m1, loss)
                elif kind == "floor4":
                    floor_callback(
                        "i",
                        coords,
                        m1,
                        m1,
                        m1,
                        m1,
                        stacked(y),
                        stacked(loss),
                        stacked(step),
                        stacked(loss * 0.1),
                    )
                elif kind == "floor_every":
                    floor_callback("i", coords, step, stacked(y), when=step % 100 == 0)
            elif kind == "tap_per":
                pmaptap.tap(y, "a_per", dedup="per_device")
            elif kind in ("tap_rep", "tap_rep_unverified"):
                pmaptap.tap(loss, "b_rep", dedup="replicated")
            elif kind in ("tap4", "tap4_group", "tap4_one"):
                with pmaptap.group() if kind == "tap4_group" else contextlib.nullcontext():
                    pmaptap.tap(y, "c_y", dedup="per_device")
                    pmaptap.tap(loss, "c_loss", dedup="replicated")
                    pmaptap.tap(step, "c_step", dedup="replicated")
                    pmaptap.tap(loss * 0.1, "c_lr", dedup="replicated")
            elif kind == "tap_every":
                pmaptap.tap(y, "d_every", step=step, every=100, dedup="per_device")
            return y

        fn = jax.pmap(body, axis_name="i", in_axes=(0, None))
        if kind == "tap_rep_unverified":
            with pmaptap.configured(verify_replicated=False):
                fn(x, jnp.int32(1)).block_until_ready()  # trace now, with the option
        if kind == "tap4_one":
            with pmaptap.configured(auto_group=False):
                fn(x, jnp.int32(1)).block_until_ready()  # each tap its own callback
        return fn

    counter = {"step": 0}
    # "transport only" arms: the same taps with the host pipeline cut off at
    # the callback hand-off, to separate device-side cost from JSON + file I/O.
    from pmaptap._trace import layouts

    real_deliver, xport = layouts.deliver, {"drop": False}
    layouts.deliver = lambda spec, arrays: None if xport["drop"] else real_deliver(spec, arrays)

    def arm(fn, flush, drop=False):
        def go():
            xport["drop"] = drop
            y = None
            for _ in range(steps):
                counter["step"] += 1
                y = fn(x, jnp.int32(counter["step"]))
            y.block_until_ready()
            if flush:
                session.flush()
            else:
                jax.effects_barrier()
            xport["drop"] = False

        return go

    groups = {
        "a/b/c": [
            "base",
            "raw_per",
            "raw_rep",
            "raw4",
            "floor_per",
            "floor_rep",
            "floor_rep_one",
            "floor4",
            "tap_per",
            "tap_rep",
            "tap_rep_unverified",
            "tap4",
            "tap4_one",
            "tap4_group",
            "tap_per@transport",
            "tap_rep@transport",
        ],
        "d": ["base", "floor_every", "tap_every"],
        "d@5ms": ["base", "floor_every", "tap_every"],
    }
    results = {}
    for group, kinds in groups.items():
        heavy = 0 if group != "d@5ms" else (2 if quick else 600)
        arms = {
            k: arm(
                make(k.split("@")[0], heavy),
                flush=k.startswith("tap"),
                drop=k.endswith("@transport"),
            )
            for k in kinds
        }
        results[group] = interleaved_rounds(arms, rounds=rounds, steps=steps)
    session.close()

    t = results["a/b/c"]
    ab = medians(t)

    def row(label, arm_, raw, floor, target):
        # Both ratios are of added cost (arm minus the no-callback step),
        # paired per round: r-th round of the arm against the r-th of the
        # reference (see common.paired).
        return (
            label,
            f"{ab[arm_] * 1e3:.3f}",
            f"{ab[raw] * 1e3:.3f}",
            f"{paired(t, arm_, raw, 'base'):.2f}x",
            f"{ab[floor] * 1e3:.3f}",
            f"{paired(t, arm_, floor, 'base'):.2f}x",
            target,
        )

    rows = [
        row("a. per_device tap", "tap_per", "raw_per", "floor_per", "<= 1.10x floor"),
        row(
            "a. per_device, transport only",
            "tap_per@transport",
            "raw_per",
            "floor_per",
            "(no JSON, no file)",
        ),
        row("b. replicated tap (verified)", "tap_rep", "raw_rep", "floor_rep", "<= 1.10x floor"),
        row(
            "b. replicated, transport only",
            "tap_rep@transport",
            "raw_rep",
            "floor_rep",
            "(no JSON, no file)",
        ),
        row(
            "b. replicated tap (verify off)", "tap_rep_unverified", "raw_rep", "floor_rep_one", "-"
        ),
        row(
            "c. 4 taps in one step",
            "tap4",
            "raw4",
            "floor4",
            f"cost = {paired(t, 'tap4', 'tap_per', 'base'):.2f}x one tap",
        ),
        row(
            "c. 4 taps, auto_group=False",
            "tap4_one",
            "raw4",
            "floor4",
            f"cost = {paired(t, 'tap4_one', 'tap_per', 'base'):.2f}x one tap",
        ),
        row(
            "c. 4 taps in pmaptap.group()",
            "tap4_group",
            "raw4",
            "floor4",
            f"cost = {paired(t, 'tap4_group', 'tap_per', 'base'):.2f}x one tap",
        ),
    ]
    for g, label in (("d", "d. every=100, traced step"), ("d@5ms", "d. every=100, ~5 ms step")):
        m = medians(results[g])
        added, floor = m["tap_every"] - m["base"], m["floor_every"] - m["base"]
        # Both added costs are small (tens of us); a ratio of two near-zero
        # medians swings with noise (a few % of the step on this kind of
        # machine), so where both stay under 5% of the step it is not shown.
        small = max(abs(added), abs(floor)) < 0.05 * m["base"]
        shown = (
            "vanishes (both < 5% of step)"
            if small
            else f"{paired(results[g], 'tap_every', 'floor_every', 'base'):.2f}x"
        )
        rows.append(
            (
                label,
                f"{m['tap_every'] * 1e3:.3f}",
                "-",
                "-",
                f"{m['floor_every'] * 1e3:.3f}",
                shown,
                f"<= 1.10x floor (base {m['base'] * 1e3:.2f} ms; added "
                f"{added * 1e3:+.3f} ms = {added / m['base']:+.1%} vs "
                f"{floor * 1e3:+.3f} ms = {floor / m['base']:+.1%})",
            )
        )
    base_ms = f"{ab['base'] * 1e3:.3f}"
    print(
        f"pmap over {DEVICES} devices, {PAYLOAD * 4 // 1024} KiB per device; "
        f"no-callback step {base_ms} ms; {machine()}"
    )
    print(
        "raw: a payload-equal jax.debug.callback on every device; floor: ONE raw "
        "jax.debug.callback from the first device in lax.cond, with the same "
        "payload as pmaptap's one callback. Ratios: added cost per step "
        "(minus the no-callback step), paired per round."
    )
    print(
        table(
            rows,
            (
                "arm",
                "arm ms/step",
                "raw ms/step",
                "ratio to raw",
                "floor ms/step",
                "ratio to floor",
                "target",
            ),
        )
    )
    return rows


if __name__ == "__main__":
    main_quick(run, DEVICES)
