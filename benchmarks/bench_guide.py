"""u. The guide's training step (docs/guide.md) on 8 simulated CPU devices:
what its taps cost a step, as a user who adopts pmaptap pays it.

The step: `jax.jit` with `NamedSharding` (data-parallel over every device),
an MLP whose hidden layers run in a `lax.scan`, optax adamw; tapped: the
loss, each layer's activation statistics (a dict of two scalars, from
inside the scan) and a parameter fingerprint every 10 steps. Arms, run
interleaved, paired per round, ms added per step over the untapped step:

- `raw`: the same values through raw `jax.debug.callback` (the loss and
  each layer's two scalars, the fingerprint left out), doing nothing on
  the host;
- `floor`: ONE raw callback per step of the loss alone;
- `jax.jit`: pmaptap's taps as host callbacks, a session writing the file;
- `pmaptap.jit`: the same taps as step outputs.
"""

from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (  # noqa: E402
    main_quick,
    paired,
    rss_mib,
    spread,
    wall_and_cpu_rounds,
)

LAYERS, WIDTH, BATCH, EVERY = 4, 256, 2048, 10
# --quick: docs/guide.md's own sizes (its numbers mean nothing; it checks
# that every arm runs).
QUICK_WIDTH, QUICK_BATCH = 64, 256


def _step_fns(width: int, batch: int):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import pmaptap

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    optimizer = optax.adamw(1e-3, weight_decay=1e-4)

    def make(arm: str):
        def forward(params, x, step):
            h = jnp.tanh(x @ params["w_in"])

            def layer(h, w):
                h = jnp.tanh(h @ w)
                stats = {"mean": jnp.mean(h), "absmax": jnp.max(jnp.abs(h))}
                if arm in ("jax.jit", "pmaptap.jit"):
                    pmaptap.tap(stats, "act", step=step)
                elif arm == "raw":
                    jax.debug.callback(lambda *_: None, stats)
                return h, None

            h, _ = jax.lax.scan(layer, h, params["hidden"])
            return (h @ params["w_out"])[:, 0]

        def train_step(params, opt_state, x, y, step):
            def loss_fn(p):
                return jnp.mean((forward(p, x, step) - y) ** 2)

            loss, grads = jax.value_and_grad(loss_fn)(params)
            if arm in ("jax.jit", "pmaptap.jit"):
                pmaptap.tap(loss, "loss", step=step)
            elif arm in ("raw", "floor"):
                jax.debug.callback(lambda *_: None, loss)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            if arm in ("jax.jit", "pmaptap.jit"):
                pmaptap.fingerprint(params, "params", step=step, every=EVERY)
            return params, opt_state, loss

        return (pmaptap.jit if arm == "pmaptap.jit" else jax.jit)(train_step)

    # The inputs made on the host (no compile) and placed where the step's
    # outputs are, the optimizer's state too: the step's second call then
    # reuses its first call's compile.
    rng = np.random.default_rng(0)
    params = jax.device_put(
        {
            "w_in": rng.standard_normal((64, width), np.float32) / 8.0,
            "hidden": rng.standard_normal((LAYERS, width, width), np.float32) / width**0.5,
            "w_out": rng.standard_normal((width, 1), np.float32) / width**0.5,
        },
        replicated,
    )
    opt_state = jax.jit(optimizer.init, out_shardings=replicated)(params)
    x = rng.standard_normal((batch, 64), np.float32)
    x, y = jax.device_put((x, np.sin(x.sum(axis=1))), sharded)
    return make, params, opt_state, x, y


def run(quick: bool = False) -> None:
    import jax
    import jax.numpy as jnp

    import pmaptap

    steps, rounds = (5, 3) if quick else (20, 15)
    make, params, opt_state, x, y = _step_fns(
        *((QUICK_WIDTH, QUICK_BATCH) if quick else (WIDTH, BATCH))
    )
    arms = ("base", "raw", "floor", "jax.jit", "pmaptap.jit")
    fns = {a: make(a) for a in arms}
    counter = {"step": 0}

    def arm(fn):
        def go():
            p, o = params, opt_state
            for _ in range(steps):
                p, o, loss = fn(p, o, x, y, jnp.int32(counter["step"]))
                counter["step"] += 1
            loss.block_until_ready()
            jax.effects_barrier()
            pmaptap.flush()

        return go

    with tempfile.TemporaryDirectory() as d:
        with pmaptap.Session(os.path.join(d, "guide.jsonl")):
            calls = {a: arm(fns[a]) for a in arms}
            for go in calls.values():  # warm up: compile
                go()
            wall, _ = wall_and_cpu_rounds(calls, rounds=rounds, steps=steps)
    base = wall["base"]
    added = {a: [(t - b) * 1e3 for t, b in zip(wall[a], base)] for a in arms[1:]}
    print(f"u. guide step on {jax.device_count()} CPU devices, untapped: {spread(base, 'ms', 1e3)}")
    for a in arms[1:]:
        print(f"u. guide step, {a}: +{spread(added[a], 'ms')} a step")
    for a in ("jax.jit", "pmaptap.jit"):
        print(
            f"u. guide step, {a} / raw: {paired(wall, a, 'raw', 'base'):.2f}x; "
            f"/ floor: {paired(wall, a, 'floor', 'base'):.2f}x"
        )
    print(f"u. guide step, peak RSS {rss_mib():.0f} MiB")


if __name__ == "__main__":
    main_quick(run, devices=8)
