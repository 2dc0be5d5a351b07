"""Per-shard taps of sharded values under plain jit (issue 13), 8 devices on a
4x2 mesh: one tap of a sharded activation against a payload-equal raw
``jax.debug.callback(partitioned=True)`` (one call per shard, no gather
either); 16 per-shard taps in one step against ONE raw partitioned callback
carrying the 16 arrays (issue 26: they share one call per device); the
step of launch/flax_train.py (Flax NNX, data x tensor parallel) tapped,
untapped and with raw partitioned callbacks at the same places; and the
step of ``launch/train.py --variant jit`` with its taps
against the same step untapped.
"""

from __future__ import annotations

import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "launch")):
    if p not in sys.path:
        sys.path.insert(0, p)
from benchmarks.common import (  # noqa: E402
    activation_step,
    interleaved,
    machine,
    main_quick,
    ratio,
    sharded_linspace,
    steps_arm,
    table,
)

DEVICES = 8
ROWS, COLS = 64, 128  # float32 activation: 4 KiB per shard on 4x2
TAPS = 16  # per-shard taps in one step, against one raw callback carrying all
SMALL_ROWS, SMALL_COLS = 8, 16  # each: 2x8 floats per shard on 4x2


def run(quick: bool = False) -> list[tuple]:
    import jax
    import jax.numpy as jnp
    import model as demo
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import pmaptap

    rounds, steps = (3, 5) if quick else (15, 40)
    tmp = tempfile.mkdtemp(prefix="pmaptap-bench-")
    session = pmaptap.Session(os.path.join(tmp, "bench.jsonl"), run="bench").open()
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    x = sharded_linspace(mesh, ROWS, COLS)

    def noop(*_):
        return None

    def finish(flush):
        return session.flush if flush else jax.effects_barrier

    tap_med = interleaved(
        {
            k: steps_arm(activation_step(k), x, steps, finish(k == "tap"))
            for k in ("base", "raw", "tap")
        },
        rounds=rounds,
        steps=steps,
    )

    # 16 per-shard taps in one step against ONE raw partitioned callback
    # carrying the same 16 arrays (issue 26: the taps of a step share one
    # partitioned callback per device; before, one per tap).
    xs16 = sharded_linspace(mesh, SMALL_ROWS, SMALL_COLS)

    def make16(kind):
        @jax.jit
        def step(v):
            ys = [jnp.tanh(v * (k + 1)) for k in range(TAPS)]
            if kind == "raw16":
                jax.debug.callback(noop, *ys, partitioned=True)
            elif kind == "tap16":
                for k, y in enumerate(ys):
                    pmaptap.tap(y, f"t{k}", dedup="per_device")
            return sum(ys)

        return step

    many_med = interleaved(
        {
            k: steps_arm(make16(k), xs16, steps, finish(k == "tap16"))
            for k in ("base16", "raw16", "tap16")
        },
        rounds=rounds,
        steps=steps,
    )

    # The --variant jit training step: 1-D "data" mesh, params replicated.
    dmesh = Mesh(np.array(jax.devices()), ("data",))
    rep, shd = NamedSharding(dmesh, P()), NamedSharding(dmesh, P("data"))
    params = jax.device_put(demo.init_params(0), rep)
    xs, ys = zip(*(demo.make_batch(0, 0, k, 8) for k in range(DEVICES)))
    bx = jax.device_put(np.concatenate(xs), shd)
    by = jax.device_put(np.concatenate(ys), shd)
    fns = {
        name: jax.jit(demo.make_jit_step(0.05, 1000, DEVICES, taps=name == "tapped"))
        for name in ("untapped", "tapped")
    }

    def train_arm(name):
        def go():
            p, loss = params, None
            for i in range(steps):
                p, loss = fns[name](p, bx, by, jnp.int32(i))
            loss.block_until_ready()
            if name == "tapped":
                session.flush()

        return go

    train_med = interleaved({k: train_arm(k) for k in fns}, rounds=rounds, steps=steps)

    # launch/flax_train.py's step (Flax NNX, data x tensor parallel on the
    # 4x2 mesh): tapped (its 6 taps), with raw partitioned callbacks at the
    # same places, and untapped.
    import flax_train

    flax_arms = {}
    for taps in ("none", "raw", "pmaptap"):
        fargs = flax_train.parse_args(["--taps", taps, "--params-every", "1000000"])
        model, opt = flax_train.create(fargs, mesh)
        fstep = flax_train.make_train_step(fargs)
        fx, ft = flax_train.batch(fargs, 0, mesh)

        def flax_arm(fstep=fstep, model=model, opt=opt, fx=fx, ft=ft, taps=taps):
            def go():
                loss = None
                with jax.set_mesh(mesh):
                    for i in range(steps):
                        loss = fstep(model, opt, fx, ft, jnp.int32(i))
                loss.block_until_ready()
                if taps == "pmaptap":
                    session.flush()
                else:
                    jax.effects_barrier()

            return go

        flax_arms[taps] = flax_arm()
    flax_med = interleaved(flax_arms, rounds=rounds, steps=steps)
    session.close()

    t = tap_med
    rows = [
        (
            "i. per-shard tap under jit",
            "raw partitioned callback",
            f"{t['tap'] * 1e3:.3f}",
            f"{t['raw'] * 1e3:.3f}",
            f"{ratio(t, 'tap', 'raw', 'base'):.2f}x",
            f"8 shards of {ROWS // 4}x{COLS // 2} f32, per_device records",
        ),
        (
            f"i. {TAPS} per-shard taps in a step",
            f"1 raw partitioned callback, {TAPS} arrays",
            f"{many_med['tap16'] * 1e3:.3f}",
            f"{many_med['raw16'] * 1e3:.3f}",
            f"{ratio(many_med, 'tap16', 'raw16', 'base16'):.2f}x",
            f"8 shards of {SMALL_ROWS // 4}x{SMALL_COLS // 2} f32 each, per_device "
            f"(target <= 1.3x; base {many_med['base16'] * 1e3:.3f} ms)",
        ),
        (
            "i. --variant jit step, tapped",
            "same step untapped",
            f"{train_med['tapped'] * 1e3:.3f}",
            f"{train_med['untapped'] * 1e3:.3f}",
            f"{train_med['tapped'] / train_med['untapped']:.2f}x step time",
            "loss + 8 grad norms + 8 activation shards",
        ),
        (
            "i. flax_train.py step, tapped",
            "same step untapped",
            f"{flax_med['pmaptap'] * 1e3:.3f}",
            f"{flax_med['none'] * 1e3:.3f}",
            f"{flax_med['pmaptap'] / flax_med['none']:.2f}x step time",
            "h, y, loss, grad_norm: 1 call/device; dh (backward): 1/device",
        ),
        (
            "i. flax_train.py step, tapped",
            "same step, raw partitioned callbacks",
            f"{flax_med['pmaptap'] * 1e3:.3f}",
            f"{flax_med['raw'] * 1e3:.3f}",
            f"{ratio(flax_med, 'pmaptap', 'raw', 'none'):.2f}x",
            "raw: jax.debug.callback(partitioned=True) of h, y, (loss, norm)",
        ),
    ]
    print(
        f"jit over {DEVICES} devices (4x2 mesh); no-callback step "
        f"{t['base'] * 1e3:.3f} ms; {machine()}"
    )
    print(table(rows, ("arm", "against", "arm ms/step", "raw ms/step", "ratio", "note")))
    return rows


if __name__ == "__main__":
    main_quick(run, DEVICES)
