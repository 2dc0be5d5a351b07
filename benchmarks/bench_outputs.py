"""Taps as step outputs (pmaptap.jit) against taps as host callbacks.

Three workloads of a training step, each with these arms, interleaved,
paired medians of ms added per step over the untapped step (steps
dispatched ahead, the round waiting for the last step and a flush):

- ``untapped``: the step alone;
- ``tap (callback)``: ``jax.jit`` with ``pmaptap.tap`` (the callback transport);
- ``raw debug.callback``: ``jax.jit`` with ``jax.debug.callback`` of the same
  values, doing nothing with them;
- ``tap (outputs)``: ``pmaptap.jit``, the same taps;
- ``output floor``: the same values returned from the step,
  ``copy_to_host_async`` at dispatch, read two steps later (array workload:
  and written by a writer thread) - what moving them off the device costs.

Workloads: ``scalars`` (a bf16 MLP's value_and_grad + SGD, loss and gradient
norm tapped), ``scan`` (the same MLP's layers in a ``lax.scan``, one scalar
tap per layer), ``array`` (one activation stored as bytes every step),
``stats`` (an activation above ``max_value_bytes``, 32 MiB, its
statistics tapped: each shard's computed on its device under both
transports; the floor returns the same per-shard statistics by hand, a
``shard_map`` of ``device_statistics`` over the activation's sharding, one
float32[8] row per device; one device: the whole value's).

On a TPU chip: ``python benchmarks/bench_outputs.py`` (one device). On CPU
(the suite's quick mode, and the CPU table): 8 simulated devices, the batch
sharded over them.
"""

from __future__ import annotations

import os
import queue
import sys
import tempfile
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import interleaved_rounds, machine, paired, rss_mib, table  # noqa: E402


def run(
    quick: bool = False,
    tpu: bool = False,
    workloads: tuple = ("scalars", "scan", "array", "stats"),
) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import pmaptap
    from pmaptap._trace.stats import device_statistics

    # The array workload stores the activation as bytes, whatever its size
    # (above max_value_bytes a tap would write its statistics instead); the
    # stats workload sets a bound below it.
    pmaptap.configure(max_value_bytes=None)
    ndev = len(jax.devices())
    width = 64 if quick else (2048 if tpu else 128)
    layers = 4 if quick else 16
    batch = 64 if quick else (1024 if tpu else 128)
    act_mib = 1 if quick else (32 if tpu else 2)
    stats_mib = 1 if quick else 32
    steps = 4 if quick else 40
    rounds = 2 if quick else 9
    dtype = jnp.bfloat16 if tpu else jnp.float32
    mesh = jax.make_mesh((ndev,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    shard = NamedSharding(mesh, P("data")) if ndev > 1 else None

    # Made on the host: no compile.
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((layers, width, width)) / width**0.5, dtype)
    x = jnp.asarray(rng.standard_normal((batch, width)), dtype)
    if shard is not None:
        x = jax.device_put(x, shard)
        # Where the step's output puts it: the step's second call reuses
        # the first's compile.
        w = jax.device_put(w, NamedSharding(mesh, P()))

    def shape_of(mib: int) -> tuple[int, int]:
        elems = mib * 2**20 // np.dtype(dtype).itemsize
        return (batch, max(1, elems // batch))

    def shard_statistics(a):
        """The floor of the stats workload: each device's statistics of
        its own shard, by hand."""
        if shard is None:
            return device_statistics(a)
        return jax.shard_map(
            lambda b: device_statistics(b)[None], mesh=mesh, in_specs=P("data"), out_specs=P("data")
        )(a)

    def mlp(w, x, tap_layer):
        def layer(h, wl):
            h = jnp.tanh(h @ wl)
            tap_layer(jnp.mean(h.astype(jnp.float32)))
            return h, None

        h, _ = lax.scan(layer, x, w)
        return jnp.mean(h.astype(jnp.float32) ** 2)

    def make(workload: str, how: str, suffix: str = ""):
        """The python step ``(w, x) -> (w, extra outputs to read)``; its taps'
        names end in ``suffix`` (each transport its own names: one name's
        automatic steps counted by both in a session would be said)."""

        def layer_tap(v):
            if workload != "scan":
                return
            if how == "tap":
                pmaptap.tap(v, "layer" + suffix)
            elif how == "raw":
                jax.debug.callback(lambda *_: None, v)

        def step(w, x):
            loss, g = jax.value_and_grad(lambda w: mlp(w, x, layer_tap))(w)
            w = w - 0.01 * g.astype(w.dtype)
            gnorm = jnp.sqrt(jnp.sum(g.astype(jnp.float32) ** 2))
            outs = ()
            if workload == "scalars":
                if how == "tap":
                    pmaptap.tap(loss, "loss" + suffix)
                    pmaptap.tap(gnorm, "gnorm" + suffix)
                elif how == "raw":
                    jax.debug.callback(lambda *_: None, loss, gnorm)
                elif how == "floor":
                    outs = (loss, gnorm)
            if workload in ("array", "stats"):
                mib = stats_mib if workload == "stats" else act_mib
                a = jnp.broadcast_to(jnp.tanh(x[:, :1]).astype(dtype), shape_of(mib)) + jnp.asarray(
                    loss, dtype
                )
            if workload == "stats":
                if how == "tap":
                    pmaptap.tap(a, "act" + suffix, dedup="per_device")
                elif how == "raw":
                    jax.debug.callback(lambda *_: None, device_statistics(a))
                elif how == "floor":
                    outs = (shard_statistics(a),)
            if workload == "array":
                if how == "tap":
                    pmaptap.tap(a, "act" + suffix, dedup="per_device")
                elif how == "raw":
                    jax.debug.callback(_write_raw, a)
                elif how == "floor":
                    outs = (a,)
            return w, outs

        if workload == "scan" and how == "floor":

            def step_scan(w, x):
                def inner(w):
                    def layer(h, wl):
                        h = jnp.tanh(h @ wl)
                        return h, jnp.mean(h.astype(jnp.float32))

                    h, ys = lax.scan(layer, x, w)
                    return jnp.mean(h.astype(jnp.float32) ** 2), ys

                (_, ys), g = jax.value_and_grad(inner, has_aux=True)(w)
                return w - 0.01 * g.astype(w.dtype), (ys,)

            return step_scan
        return step

    writes: queue.Queue = queue.Queue()
    raw_path = os.path.join(tempfile.mkdtemp(), "raw.bin")

    def _writer() -> None:
        with open(raw_path, "ab") as f:
            while True:
                item = writes.get()
                if item is None:
                    return
                if isinstance(item, threading.Event):
                    item.set()
                    continue
                f.write(np.asarray(item).tobytes())

    threading.Thread(target=_writer, daemon=True).start()

    global _write_raw

    def _write_raw(a) -> None:
        writes.put(np.asarray(a))

    def writes_done() -> None:
        ev = threading.Event()
        writes.put(ev)
        ev.wait()

    tmp = tempfile.mkdtemp()
    session = pmaptap.Session(os.path.join(tmp, "bench.jsonl"), run="bench").open()

    def arm(workload: str, how: str):
        if how == "out":
            fn = pmaptap.jit(make(workload, "tap", "_out"), donate_argnums=0)
        else:
            fn = jax.jit(make(workload, how), donate_argnums=0)
        state = {"w": w + 0}

        def go() -> None:
            pending = []
            for i in range(steps):
                state["w"], outs = fn(state["w"], x)
                if not tpu and i % 4 == 3:
                    # XLA:CPU aborts a loop of many multi-device steps
                    # dispatched ahead (a rendezvous timeout, with or without
                    # taps): every arm waits on every 4th step there.
                    state["w"].block_until_ready()
                if how == "floor":
                    for o in outs:
                        o.copy_to_host_async()
                    pending.append(outs)
                    if len(pending) > 2:
                        for o in pending.pop(0):
                            got = np.asarray(o)
                            if workload == "array":
                                writes.put(got)
            state["w"].block_until_ready()
            for outs in pending:
                for o in outs:
                    got = np.asarray(o)
                    if workload == "array":
                        writes.put(got)
            if how in ("tap", "out"):
                session.flush()
            elif how == "raw":
                jax.effects_barrier()
            if workload == "array" and how in ("raw", "floor"):
                writes_done()

        return go

    rows = []
    for workload in workloads:
        # Traced in the first round: the bound as the workload wants it.
        pmaptap.configure(max_value_bytes=(stats_mib << 20) // 4 if workload == "stats" else None)
        arms = {how: arm(workload, how) for how in ("base", "tap", "raw", "out", "floor")}
        times = interleaved_rounds(arms, rounds=rounds, steps=steps)
        base_ms = sorted(times["base"])[len(times["base"]) // 2] * 1e3

        def added(how: str) -> float:
            d = sorted(a - b for a, b in zip(times[how], times["base"]))
            return d[len(d) // 2] * 1e3

        if workload == "stats":
            # Per round, the outputs' added cost over the floor's: the range.
            per = sorted(
                (o - b) / (f - b)
                for o, f, b in zip(times["out"], times["floor"], times["base"])
                if f > b
            )
            spread = (
                f" (rounds {per[0]:.2f}-{per[-1]:.2f})" if per else " (the floor added nothing)"
            )
            stats_line = (
                f"t. {stats_mib} MiB sharded activation's statistics ({ndev} devices): "
                f"tap (outputs) / per-shard statistics returned by hand "
                f"{paired(times, 'out', 'floor', 'base'):.2f}x{spread}, tap (callback) / by hand "
                f"{paired(times, 'tap', 'floor', 'base'):.2f}x"
            )
        rows.append(
            (
                workload,
                f"{base_ms:.2f}",
                f"{added('tap'):+.3f}",
                f"{added('raw'):+.3f}",
                f"{added('out'):+.3f}",
                f"{added('floor'):+.3f}",
                f"{paired(times, 'out', 'floor', 'base'):.2f}x",
                f"{paired(times, 'out', 'tap', 'base'):.2f}x",
            )
        )
    session.close()
    writes.put(None)
    print(f"bench_outputs on {machine()}: {ndev} device(s), {steps} steps x {rounds} rounds")
    print(
        table(
            rows,
            (
                "workload",
                "untapped ms",
                "tap (callback)",
                "raw debug.callback",
                "tap (outputs)",
                "output floor",
                "outputs/floor",
                "outputs/callback",
            ),
        )
    )
    if "stats" in workloads:
        print(stats_line)
    print(f"peak RSS {rss_mib():.0f} MiB")


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tpu", action="store_true", help="one accelerator chip: bf16, bigger sizes")
    ap.add_argument(
        "--workloads",
        default="scalars,scan,array,stats",
        help="of scalars, scan, array, stats, comma-separated",
    )
    a = ap.parse_args()
    if not a.tpu:
        from benchmarks.common import set_devices

        set_devices(8)
    run(quick=a.quick, tpu=a.tpu, workloads=tuple(a.workloads.split(",")))
