"""q. pmaptap.fingerprint (issue 40): what it detects and what it costs.

A replicated 16 MiB float32 parameter tree (4 leaves) on 8 devices, a step
that updates it (``p - lr * g``), in four arms, interleaved round by round
(paired per round):

  update          the step alone
  floor           + a float32 sum of every leaf (reads every byte once) and
                  ONE raw jax.debug.callback of the sums, from device 0
  floor_b         the floor with its sums read after an optimization
                  barrier, as the fingerprint reads the value: XLA may fuse
                  the floor's sums into the update's loop (no pass of its
                  own), which the fingerprint is kept from doing
  fingerprint     + pmaptap.fingerprint(params, step=step), with a session
                  writing its records (a flush per round)

under pmap and under jit (the tree replicated on a 4x2 mesh). Reported: the
fingerprint arm's step time over the floor arm's (wall and this process's
CPU time), the bytes that reach the host per step (per leaf per device) and
the tap file's growth per step.

``--quick`` (the test suite): a 2 MiB tree, 5 faults, 30 clean steps.

Detection: 50 faults, each a single flipped bit (random leaf, device,
element and bit position) in one device's copy, injected at one step after
a clean one; each must be named exactly: its device, process, leaf and
step, and nothing else. Then 1,000 steps without a fault: no record may
say divergent.

r. Per dtype, on ONE device (the CPU's first, or the accelerator's): one
jitted call of ``pmaptap.fingerprint`` of a 64 MiB tree (4 leaves: three
matrices and a vector) against the read-once floor, a float32 sum of a
float32 tree of the same bytes plus ONE raw ``jax.debug.callback`` of the
sums; interleaved, paired medians. The call both under ``jax.jit`` (the
fingerprints leave by a host callback) and under ``pmaptap.jit`` (as step
outputs), and the bare hash with one raw callback of it (what any
fingerprint taken by a callback costs, pmaptap's pipeline left out).
float64, int64 and complex128 under ``jax.enable_x64`` (a chip without them
says so in its row). Also the hash alone (``fingerprint64``
of each leaf, no call) against the float32 sums alone, and the time that
reading the bytes once takes at the memory bandwidth (the chip's, on a
TPU; on the CPU the float32 sum's own rate is the only figure).

s. (``--tpu``) Inside a training step: a bfloat16 MLP (128 MiB of
parameters) whose jitted step is ``value_and_grad`` and SGD, alone, with
the floor (a float32 sum of every updated parameter and one raw callback)
and with ``pmaptap.fingerprint(params, step=step)``. Plus a check on the
device that every single flipped bit of every dtype changes the
fingerprint.

``--tpu``: on the machine's accelerator (one process, its one chip): r.
and s. only (``--quick`` shrinks them); without it, on 8 simulated CPU
devices: q. and r.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile


def _steps_arm(advance, params, steps: int, finish):
    """One round of an arm: ``steps`` calls of ``advance(params, step)``,
    each on the parameters the last returned (the arm's own, from
    ``params``; its steps counted from 0), the last waited for, then
    ``finish()`` (the session's flush for the fingerprint arm,
    ``jax.effects_barrier`` for the floors' raw callbacks)."""
    import jax

    step = 0

    def go() -> None:
        nonlocal params, step
        for _ in range(steps):
            params = advance(params, step)
            step += 1
        jax.block_until_ready(params)
        finish()

    return go


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import (  # noqa: E402
    floor_callback,
    interleaved_rounds,
    machine,
    main_quick,
    paired,
    steps_arm,
    table,
    wall_and_cpu_rounds,
)

DEVICES = 8
# The tree: 16 MiB of float32 in four leaves of different shapes.
SHAPES = {"emb": (512, 2048), "w1": (1024, 1024), "w2": (2048, 512), "b": (1024 * 1024,)}
LEAVES = sorted(SHAPES)  # the order jax.tree flattens a dict in


def _flip(x, index, bit):
    import jax.numpy as jnp
    from jax import lax

    flat = lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
    flat = flat.at[index].set(flat[index] ^ (jnp.uint32(1) << bit.astype(jnp.uint32)))
    return lax.bitcast_convert_type(flat, x.dtype).reshape(x.shape)


def _ms(times, arm: str, digits: int = 3) -> str:
    """The arm's median milliseconds a step."""
    return f"{statistics.median(times[arm]) * 1e3:.{digits}f}"


def _nothing(*_) -> None:
    """The raw callbacks' host side: nothing (the floors measure the call)."""


def run(quick: bool = False) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import pmaptap
    from pmaptap._host import routing

    rounds, steps = (3, 2) if quick else (21, 10)
    trials, clean_steps = (5, 30) if quick else (50, 1000)
    shapes = SHAPES if not quick else {k: (s[0] // 8, *s[1:]) for k, s in SHAPES.items()}
    out_dir = tempfile.mkdtemp(prefix="pmaptap-fp-")
    path = os.path.join(out_dir, "fp.jsonl")
    session = pmaptap.Session(path, run="bench").open()
    rng = np.random.default_rng(0)
    tree = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    nbytes = sum(a.nbytes for a in tree.values())
    lr = np.float32(1e-3)

    def update(p, g):
        return jax.tree.map(lambda a, b: a - lr * b, p, g)

    # ---------------------------------------------------------- pmap arms
    rep = {k: np.broadcast_to(a, (DEVICES, *a.shape)) for k, a in tree.items()}
    grads = jax.pmap(lambda t: jax.tree.map(lambda a: a * 0.5, t))(rep)

    # ---------------------------------------------------------- jit arms
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    everywhere = NamedSharding(mesh, P())
    jtree = jax.device_put(tree, everywhere)
    jgrads = jax.device_put(jax.tree.map(lambda a: a * 0.5, tree), everywhere)

    # ---------------------------------------------------------- the steps
    def step_fn(variant: str, kind: str):
        """The step of one arm, under pmap (axis "i") or jit."""

        def body(p, g, step):
            p = update(p, g)
            if kind in ("floor", "floor_b"):
                leaves = jax.tree.leaves(p)
                if kind == "floor_b":
                    leaves = lax.optimization_barrier(leaves)
                sums = [jnp.sum(v) for v in leaves]
                if variant == "pmap":
                    floor_callback("i", *sums)  # from device 0 alone
                else:
                    jax.debug.callback(_nothing, *sums)  # one call for the program
            elif kind == "fingerprint":
                pmaptap.fingerprint(p, f"params_{variant}", step=step)
            return p

        if variant == "pmap":
            return jax.pmap(body, axis_name="i", in_axes=(0, 0, None), donate_argnums=0)
        return jax.jit(body, donate_argnums=0)

    def arm(variant: str, kind: str):
        fn = step_fn(variant, kind)
        params = jax.tree.map(jnp.copy, rep if variant == "pmap" else jtree)
        g = grads if variant == "pmap" else jgrads
        finish = session.flush if kind == "fingerprint" else jax.effects_barrier
        return _steps_arm(lambda p, s: fn(p, g, s), params, steps, finish)

    # Bytes handed to the host by fingerprint callbacks (their arrays).
    real_deliver = routing.deliver
    handed = {"bytes": 0, "calls": 0}

    def counting(spec, arrays):
        if getattr(spec, "name", "").startswith("params_"):
            handed["bytes"] += sum(np.asarray(a).nbytes for a in arrays)
            handed["calls"] += 1
        real_deliver(spec, arrays)

    import pmaptap._trace.fingerprint as fp_mod
    import pmaptap._trace.fingerprint_jit as fpj_mod

    fp_mod.deliver = fpj_mod.deliver = counting

    rows = []
    for variant in ("pmap", "jit"):
        arms = {k: arm(variant, k) for k in ("update", "floor", "floor_b", "fingerprint")}
        for fn in arms.values():
            fn()  # compile, first writes
        size0, calls0, bytes0 = os.path.getsize(path), handed["calls"], handed["bytes"]
        wall, cpu = wall_and_cpu_rounds(arms, rounds=rounds, steps=steps)
        fp_steps = rounds * steps
        growth = (os.path.getsize(path) - size0) / fp_steps
        per_leaf_device = (handed["bytes"] - bytes0) / (
            (handed["calls"] - calls0) * len(shapes) * DEVICES
        )

        for ref in ("floor", "floor_b"):
            rows.append(
                (
                    f"q. {variant}: fingerprint / {ref}",
                    f"{paired(wall, 'fingerprint', ref):.2f}x",
                    f"{paired(cpu, 'fingerprint', ref):.2f}x",
                    f"{_ms(wall, 'update', 1)} / {_ms(wall, ref, 1)} / "
                    f"{_ms(wall, 'fingerprint', 1)}",
                    f"{per_leaf_device:.1f}",
                    f"{growth:.0f}",
                )
            )
    print(
        f"q. pmaptap.fingerprint, {DEVICES} devices, a {nbytes / 2**20:.0f} MiB tree; {machine()}"
    )
    print(
        table(
            rows,
            (
                "arm",
                "wall ratio",
                "CPU ratio",
                "ms/step update / floor / fingerprint (wall)",
                "B to host /leaf/device",
                "B file /step",
            ),
        )
    )

    # ---------------------------------------------------------- detection
    def detect_body(p, step, fault):
        # fault: (device, leaf, element, bit, step) of the one flipped bit.
        here = (lax.axis_index("i") == fault[0]) & (step == fault[4])
        p = {
            k: jnp.where(here & (fault[1] == j), _flip(v, fault[2], fault[3]), v)
            for j, (k, v) in enumerate(sorted(p.items()))
        }
        pmaptap.fingerprint(p, "detect", step=step)
        return p

    detect = jax.pmap(detect_body, axis_name="i", in_axes=(0, None, None))
    faults = []  # (device, leaf, element, bit) of each trial
    for t in range(trials):
        device, leaf = int(rng.integers(DEVICES)), int(rng.integers(len(LEAVES)))
        element = int(rng.integers(int(np.prod(shapes[LEAVES[leaf]]))))
        bit = int(rng.integers(32))
        faults.append((device, LEAVES[leaf], element, bit))
        fault = jnp.asarray([device, leaf, element, bit, 2 * t + 1], jnp.int32)
        p = rep
        for s in (2 * t, 2 * t + 1):  # a clean step, then the fault
            p = detect(p, s, fault)
        jax.block_until_ready(p)
        jax.effects_barrier()  # the step's callback has run (as flush() waits)
    session.flush()
    by_step: dict[int, list[dict]] = {}
    for r in pmaptap.read(path):
        if r["name"] == "detect":
            by_step.setdefault(r["step"], []).append(r)
    exact = 0
    wrong: list[str] = []
    for t, (device, leaf, element, bit) in enumerate(faults):
        clean, hit = by_step.get(2 * t, []), by_step.get(2 * t + 1, [])
        odd = [r for r in hit if r.get("divergent") and r["replicas"] == 1]
        if (
            len(clean) == 1
            and not clean[0].get("divergent")
            and len(hit) == 2  # the other seven, and the odd one
            and len(odd) == 1
            and odd[0]["devices"] == [device]
            and odd[0]["processes"] == [0]
            and odd[0]["leaf"] == leaf
        ):
            exact += 1
        else:
            wrong.append(f"trial {t} (device {device} {leaf}[{element}] bit {bit}): {hit}")
    p = rep
    no_fault = jnp.asarray([-1, -1, 0, 0, -1], jnp.int32)
    base = 2 * trials
    for s in range(clean_steps):
        # Waited for each step: 1,000 steps dispatched ahead, each with a
        # collective and a host callback, ended in an XLA:CPU rendezvous
        # timeout on this loaded box (pmaptap.tap of a 1 MiB replicated
        # value does the same; noted in docs/performance.md).
        p = jax.block_until_ready(detect(p, base + s, no_fault))
    session.close()
    false = [
        r
        for r in pmaptap.read(path)
        if r["name"] == "detect" and r["step"] >= base and r.get("divergent")
    ]
    seen = sum(1 for r in pmaptap.read(path) if r["name"] == "detect" and r["step"] >= base)
    print(
        f"q. detection: {exact}/{trials} single-bit faults named exactly (device, "
        f"process, leaf, step); {len(false)} false positive(s) in {seen} clean "
        f"steps (of {clean_steps})"
    )
    for w in wrong[:5]:
        print("   ", w[:300])


# ------------------------------------------------------------- r. and s.

# Bytes of each dtype's tree (r.), and the leaves' columns (the fourth a
# vector).
TREE_MIB = 64
COLUMNS = (2048, 1024, 512, None)
DTYPES = ("float32", "bfloat16", "float16", "int8", "uint8", "bool", "complex64")
# 64-bit dtypes exist on a device only with jax_enable_x64 (turned on for
# their rows alone).
WIDE = ("float64", "int64", "complex128")


def _tree(dtype, mib: float, rng) -> list:
    """Four leaves of ``mib / 4`` MiB each of ``dtype``."""
    import jax.numpy as jnp
    import numpy as np

    dt = jnp.dtype(dtype)
    each = int(mib * 2**20) // 4 // dt.itemsize
    leaves = []
    for cols in COLUMNS:
        shape = (each,) if cols is None else (each // cols, cols)
        n = int(np.prod(shape))
        if dt == jnp.bool_:
            a = rng.integers(0, 2, n).astype(bool)
        elif jnp.issubdtype(dt, jnp.integer):
            a = rng.integers(-100 if jnp.issubdtype(dt, jnp.signedinteger) else 0, 100, n)
        elif jnp.issubdtype(dt, jnp.complexfloating):
            a = rng.standard_normal(n) + 1j * rng.standard_normal(n)
        else:
            a = rng.standard_normal(n)
        leaves.append(jnp.asarray(np.asarray(a).astype(dt).reshape(shape)))
    return leaves


def run_dtypes(session, quick: bool, bandwidth: float | None) -> None:
    """r.: one device, one call a tree, per dtype."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import pmaptap
    from pmaptap._trace.fphash import fingerprint64

    mib = 4 if quick else TREE_MIB
    rounds, calls = (3, 2) if quick else (15, 10)
    dtypes = (DTYPES[:4] + WIDE[-1:]) if quick else DTYPES + WIDE
    rng = np.random.default_rng(1)
    device = jax.devices()[0]
    f32 = jax.device_put(_tree(jnp.float32, mib, rng), device)

    floor = jax.jit(lambda t: jax.debug.callback(_nothing, *[jnp.sum(x) for x in t]))
    sums = jax.jit(lambda t: [jnp.sum(x) for x in t])
    hashes = jax.jit(lambda t: [fingerprint64(x) for x in t])
    # The hash and one raw callback of it: what any fingerprint taken by a
    # callback costs, pmaptap's pipeline left out.
    hash_call = jax.jit(lambda t: jax.debug.callback(_nothing, *[fingerprint64(x) for x in t]))

    def row_of(dtype) -> tuple:
        """One dtype's row: its tree's fingerprint against the floor."""
        tree = jax.device_put(_tree(dtype, mib, rng), device)
        name = f"dtype_{dtype}"
        step = {"n": 0}

        def body(t, s, name=name):
            pmaptap.fingerprint(t, name, step=s)

        def fp_arm(fp):
            def go() -> None:
                for _ in range(calls):
                    fp(tree, step["n"])
                    step["n"] += 1
                session.flush()

            return go

        times = interleaved_rounds(
            {
                "fingerprint": fp_arm(jax.jit(body)),
                "outputs": fp_arm(pmaptap.jit(body)),
                "floor": steps_arm(floor, f32, calls, jax.effects_barrier),
                "hash": steps_arm(hashes, tree, calls, lambda: None),
                "hash_call": steps_arm(hash_call, tree, calls, jax.effects_barrier),
                "sums": steps_arm(sums, f32, calls, lambda: None),
            },
            rounds=rounds,
            steps=calls,
        )
        nbytes = sum(x.nbytes for x in tree)
        read = "" if bandwidth is None else f"{nbytes / bandwidth * 1e3:.3f}"
        rate = nbytes / statistics.median(times["sums"]) / 1e9
        return (
            f"r. {dtype}: fingerprint / floor",
            f"{paired(times, 'fingerprint', 'floor'):.2f}x",
            f"{paired(times, 'outputs', 'floor'):.2f}x",
            f"{paired(times, 'hash_call', 'floor'):.2f}x",
            f"{paired(times, 'hash', 'sums'):.2f}x",
            f"{_ms(times, 'fingerprint')} / {_ms(times, 'floor')}",
            f"{_ms(times, 'hash')} / {_ms(times, 'sums')} ({rate:.0f} GB/s)",
            read,
        )

    rows = []
    for dtype in dtypes:
        with jax.enable_x64(dtype in WIDE):
            try:
                rows.append(row_of(dtype))
            except Exception as e:  # noqa: BLE001 - a chip without 64-bit types: said in the table
                if device.platform == "cpu":
                    raise
                rows.append((f"r. {dtype}: not run", f"{type(e).__name__}: {e}"[:60], *[""] * 6))
    print(
        f"r. pmaptap.fingerprint of a {mib} MiB tree (4 leaves) on one device "
        f"({device.device_kind}); {machine()}"
    )
    print(
        table(
            rows,
            (
                "arm",
                "wall ratio",
                "pmaptap.jit / floor",
                "raw hash+callback / floor",
                "hash / float32 sums",
                "ms a call: fingerprint / floor",
                "ms: hash / float32 sums",
                "ms at the memory bandwidth",
            ),
        )
    )


def run_step(session, quick: bool) -> None:
    """s.: a bfloat16 MLP's training step, with the floor and with the
    fingerprint of its parameters."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import pmaptap

    width, layers, batch = (512, 2, 64) if quick else (4096, 4, 2048)
    rounds, steps = (3, 2) if quick else (15, 10)
    rng = np.random.default_rng(2)
    params0 = [
        jnp.asarray((rng.standard_normal((width, width)) / np.sqrt(width)).astype(jnp.bfloat16))
        for _ in range(layers)
    ]
    x = jnp.asarray(rng.standard_normal((batch, width)).astype(jnp.bfloat16))
    y = jnp.asarray(rng.standard_normal((batch, width)).astype(jnp.bfloat16))
    lr = jnp.bfloat16(1e-3)

    def loss(params):
        h = x
        for w in params:
            h = jax.nn.relu(h @ w)
        return jnp.mean((h.astype(jnp.float32) - y.astype(jnp.float32)) ** 2)

    def make(kind: str):
        @jax.jit
        def step(params, s):
            value, grads = jax.value_and_grad(loss)(params)
            params = [p - lr * g for p, g in zip(params, grads)]
            if kind == "floor":
                jax.debug.callback(_nothing, *[jnp.sum(p, dtype=jnp.float32) for p in params])
            elif kind == "fingerprint":
                pmaptap.fingerprint(params, "step_params", step=s)
            return params, value

        return step

    def arm(kind: str):
        fn = make(kind)
        finish = session.flush if kind == "fingerprint" else jax.effects_barrier
        return _steps_arm(lambda p, s: fn(p, s)[0], [jnp.copy(p) for p in params0], steps, finish)

    arms = {k: arm(k) for k in ("step", "floor", "fingerprint")}
    times = interleaved_rounds(arms, rounds=rounds, steps=steps)
    mib = sum(p.nbytes for p in params0) / 2**20
    print(
        f"s. training step: bfloat16 MLP, {mib:.0f} MiB of parameters, batch {batch}; "
        f"ms/step step / floor / fingerprint: {_ms(times, 'step')} / {_ms(times, 'floor')} / "
        f"{_ms(times, 'fingerprint')}; fingerprint / floor "
        f"{paired(times, 'fingerprint', 'floor'):.2f}x step, "
        f"{paired(times, 'fingerprint', 'floor', 'step'):.2f}x added"
    )


def check_on_device(quick: bool) -> None:
    """Every single flipped bit of every dtype changes the fingerprint
    computed on the device (the layout of that platform), equal bits give
    equal fingerprints."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pmaptap._trace.fphash import fingerprint64

    fp = jax.jit(fingerprint64)
    rng = np.random.default_rng(3)
    flips = 4 if quick else 24
    total = changed = 0
    for dtype in DTYPES:
        for leaf in _tree(dtype, 2 if quick else 16, rng):
            host = np.asarray(leaf)
            base = np.asarray(fp(leaf))
            same = np.array_equal(np.asarray(fp(jnp.asarray(host.copy()))), base)
            raw = host.reshape(-1).view(np.dtype(f"u{host.dtype.itemsize}"))
            for _ in range(flips):
                i, bit = int(rng.integers(raw.size)), int(rng.integers(8 * raw.itemsize))
                if host.dtype == np.bool_:
                    bit = 0  # a bool's one meaningful bit
                bad = raw.copy()
                bad[i] ^= bad.dtype.type(1) << bad.dtype.type(bit)
                moved = np.asarray(fp(jnp.asarray(bad.view(host.dtype).reshape(host.shape))))
                total += 1
                changed += int(same and not np.array_equal(moved, base))
    print(
        f"s. on {jax.devices()[0].device_kind}: {changed}/{total} single flipped bits "
        f"changed the fingerprint ({len(DTYPES)} dtypes, 4 leaves each)"
    )


def run_single(quick: bool, tpu: bool) -> None:
    import pmaptap

    out_dir = tempfile.mkdtemp(prefix="pmaptap-fp1-")
    session = pmaptap.Session(os.path.join(out_dir, "fp.jsonl"), run="bench1").open()
    # One TPU v5e chip reads about 819 GB/s of its memory (its data sheet).
    parts = [lambda: run_dtypes(session, quick, 819e9 if tpu else None)]
    if tpu:
        parts += [lambda: run_step(session, quick), lambda: check_on_device(quick)]
    failed = []
    for part in parts:
        # On an accelerator each part is worth its device time: one that
        # fails is reported, the others still run, the exit status says so.
        try:
            part()
        except Exception as e:  # noqa: BLE001
            failed.append(e)
            print(f"FAILED: {type(e).__name__}: {e}"[:2000])
    session.close()
    if failed:
        raise failed[0]


if __name__ == "__main__":
    if "--tpu" in sys.argv:
        # The accelerator, as it is: one process, its one chip.
        quick = "--quick" in sys.argv
        run_single(quick, tpu=True)
    else:
        main_quick(lambda quick: (run(quick), run_single(quick, tpu=False)), DEVICES)
