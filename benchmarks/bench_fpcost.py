"""v. What a fingerprint of a model's parameters adds to a step (issue 59,
items 2 and 3): compile time, and the cost of a step where it is skipped.

One CPU device; a transformer-like parameter tree (embedding, positions,
per block two layer norms, attention q/k/v/o with biases, an MLP with
biases: 14 leaves a block, mixed sizes) and its training step
(``value_and_grad`` + SGD).

Compile (``v. compile``): ``.lower(...).compile()`` of the step and its
first (due) step, which under ``pmaptap.jit`` compiles the hash of the
step's outputs, a program of its own; fresh function objects every round
(nothing cached), arms interleaved:
untapped ``jax.jit``; ``jax.jit`` with ``pmaptap.fingerprint(params,
step=s, every=10)``; ``pmaptap.jit`` with the same; ``pmaptap.jit`` with
``step=s + 0`` (a step number computed in the step: the device decides
the due steps); ``pmaptap.jit`` without it (the wrapper's own share); for
two models, 6 blocks (22 MiB) and 3 (13 MiB, below ``later.MIN_BYTES``:
its hash leaves the step only where the host decides). Paired medians of the
per-round ratio to the untapped arm, with their range. Also the hash
alone, counted in the optimized HLO: the fingerprints of every leaf taken
one by one (``fingerprint64`` each, the former program) against
``fingerprint64_many`` (what ``pmaptap.fingerprint`` now compiles):
instructions, reductions, compile seconds.

Skipped steps (``v. skipped``): a 53-leaf tree updated by the step, the
fingerprint due every 1,000 steps and the steps run 1..20 (never due);
arms interleaved, paired medians of step time over the untapped step:
``jax.jit`` with the fingerprint; ``jax.jit`` with a raw
``jax.debug.callback`` in a ``lax.cond`` that is never taken (the control:
what any host callback in a step costs under jax.jit); ``pmaptap.jit``
with the fingerprint (hashed after the step by a program of its own, its
step number read from the call: a step not due dispatches no hash);
``pmaptap.jit`` with a scalar ``pmaptap.tap`` at the same ``every`` (the
control: what any output a step may send costs); ``pmaptap.jit`` with the
fingerprint of ``step=s + 0`` (computed in the step: the device decides
which steps are due, and the hash of this tree, below
``later.MIN_BYTES``, stays in the step, in a ``cond``).

The hash when due (``v. hash``): ``fingerprint64_many`` of the compile
benchmark's parameters as compiled (on a TPU, leaves of one shape hashed by
one vmap), with that grouping off, against a read-once floor (a float sum
of every leaf), and on a CPU device the host's NumPy hash of the same
arrays (what ``pmaptap.jit`` does there), paired per round.

``--quick`` (the test suite): one small block, one round of compiles, two
of the rest. ``--tpu``: on the device's own backend (no simulated CPU
devices).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (  # noqa: E402
    interleaved_rounds,
    machine,
    main_quick,
    paired,
    round_ratios,
    settled,
    spread,
    table,
)


def _model(blocks: int, width: int, vocab: int, seq: int):
    """(params, loss(params, tokens), tokens) of a small transformer."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)

    def w(*shape):
        return jnp.asarray(rng.standard_normal(shape) * 0.02, jnp.float32)

    def norm():
        return {"scale": jnp.ones(width), "bias": jnp.zeros(width)}

    params = {"emb": w(vocab, width), "pos": w(seq, width), "final": norm()}
    for b in range(blocks):
        params[f"block{b}"] = {
            "ln1": norm(),
            "ln2": norm(),
            "attn": {k: w(width, width) for k in "qkvo"}
            | {"bq": jnp.zeros(width), "bo": jnp.zeros(width)},
            "mlp": {
                "w1": w(width, 4 * width),
                "b1": jnp.zeros(4 * width),
                "w2": w(4 * width, width),
                "b2": jnp.zeros(width),
            },
        }

    def layer_norm(p, h):
        m = h.mean(-1, keepdims=True)
        v = ((h - m) ** 2).mean(-1, keepdims=True)
        return (h - m) / jnp.sqrt(v + 1e-6) * p["scale"] + p["bias"]

    def loss(p, x):
        h = p["emb"][x] + p["pos"]
        for b in range(blocks):
            q = p[f"block{b}"]
            a = layer_norm(q["ln1"], h)
            att = jax.nn.softmax(
                (a @ q["attn"]["q"] + q["attn"]["bq"]) @ (a @ q["attn"]["k"]).swapaxes(-1, -2),
                -1,
            )
            h = h + (att @ (a @ q["attn"]["v"])) @ q["attn"]["o"] + q["attn"]["bo"]
            a = layer_norm(q["ln2"], h)
            mlp = q["mlp"]
            h = h + jax.nn.gelu(a @ mlp["w1"] + mlp["b1"]) @ mlp["w2"] + mlp["b2"]
        logits = layer_norm(p["final"], h) @ p["emb"].T
        return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    tokens = jnp.asarray(rng.integers(0, vocab, (8, seq)))
    return params, loss, tokens


def _compile_rounds(blocks: int, width: int, rounds: int) -> list:
    """The compile table of one model (see the module docstring); its
    parameters' leaves."""
    import jax
    import jax.numpy as jnp

    import pmaptap

    params, loss, tokens = _model(blocks, width, vocab=16 * width, seq=64)
    leaves = jax.tree.leaves(params)

    def step_of(kind: str):
        def step(p, x, s):
            value, g = jax.value_and_grad(loss)(p, x)
            p = jax.tree.map(lambda a, b: a - 1e-3 * b, p, g)
            if kind == "pmaptap.jit, step computed":
                pmaptap.fingerprint(p, "params", step=s + 0, every=10)
            elif kind not in ("untapped", "pmaptap.jit untapped"):
                pmaptap.fingerprint(p, "params", step=s, every=10)
            return p, value

        return step

    wrap = {
        "untapped": jax.jit,
        "jax.jit": jax.jit,
        "pmaptap.jit": pmaptap.jit,
        # Its due steps decided on the device, not from the call's argument.
        "pmaptap.jit, step computed": pmaptap.jit,
        "pmaptap.jit untapped": pmaptap.jit,  # the wrapper's own share
    }
    times: dict[str, list[float]] = {k: [] for k in wrap}
    for r in range(rounds):
        order = list(wrap.items())
        for kind, w in order[::-1] if r % 2 else order:
            fn = w(step_of(kind))  # a new function: nothing cached
            settled()
            t0 = time.perf_counter()
            # Compile and first step (due): pmaptap.jit compiles the hash
            # of the step's outputs, a program of its own, at that step.
            jax.block_until_ready(
                fn.lower(params, tokens, jnp.int32(0)).compile()(params, tokens, jnp.int32(0))
            )
            times[kind].append(time.perf_counter() - t0)
    n = len(leaves)
    mib = sum(x.nbytes for x in leaves) / 2**20
    print(
        f"v. compile: {blocks} blocks, {n} leaves, {mib:.1f} MiB of float32 parameters; "
        f"{rounds} rounds; {machine()}"
    )
    rows = [
        (
            f"v. compile {kind}{'' if 'untapped' in kind else ' + fingerprint'} / untapped",
            f"{paired(times, kind, 'untapped'):.3f}x",
            spread(round_ratios(times, kind, "untapped"), "x", digits=3),
            spread(times[kind], " s"),
            spread(times["untapped"], " s"),
        )
        for kind in wrap
        if kind != "untapped"
    ]
    print(table(rows, ("arm", "paired median", "range", "compile", "untapped compile")))
    return leaves


def run_compile(quick: bool) -> None:
    import jax
    import jax.numpy as jnp

    from pmaptap._trace.fphash import fingerprint64, fingerprint64_many

    rounds = 1 if quick else 5  # a round compiles every arm once
    # The second model's tree is below later.MIN_BYTES: hashed after the
    # step where the host knows the due steps, in it where only the device
    # does (the step number computed in the step).
    width = 32 if quick else 256
    leaves = [_compile_rounds(blocks, width, rounds) for blocks in ((1,) if quick else (6, 3))][0]

    def hlo_counts(fn) -> tuple[int, int, float]:
        t0 = time.perf_counter()
        text = jax.jit(fn).lower(leaves).compile().as_text()
        seconds = time.perf_counter() - t0
        lines = [ln for ln in text.splitlines() if " = " in ln]
        reductions = sum(1 for ln in lines if " reduce(" in ln or " reduce-window(" in ln)
        return len(lines), reductions, seconds

    per_leaf = hlo_counts(lambda ls: jnp.stack([fingerprint64(x) for x in ls]))
    many = hlo_counts(fingerprint64_many)
    print(
        table(
            [
                ("v. hash alone, leaf by leaf", *per_leaf[:2], f"{per_leaf[2]:.2f}"),
                ("v. hash alone, fingerprint64_many", *many[:2], f"{many[2]:.2f}"),
            ],
            ("program", "HLO instructions", "reductions", "compile s"),
        )
    )


def run_skipped(quick: bool) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    import pmaptap

    rounds, steps = (2, 5) if quick else (31, 20)
    rng = np.random.default_rng(1)
    shapes = [(64, 64), (64,), (128, 64), (64, 128), (128,)] * 10 + [(256, 64), (64,), (32,)]
    params = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes]

    def step_of(kind: str):
        def step(p, s):
            p = [a * 0.999 + 0.001 for a in p]
            if kind == "fingerprint":
                pmaptap.fingerprint(p, "skipped", step=s, every=1000)
            elif kind == "fingerprint, step computed":
                pmaptap.fingerprint(p, "skipped", step=s + 0, every=1000)
            elif kind == "tap":
                pmaptap.tap(s, "skipped_tap", step=s, every=1000)
            elif kind == "raw":
                lax.cond(
                    s % 1000 == 0,
                    lambda: jax.debug.callback(lambda *_: None, s),
                    lambda: None,
                )
            return p

        return step

    arms_of = {
        "untapped": jax.jit(step_of("untapped")),
        "jax.jit fingerprint": jax.jit(step_of("fingerprint")),
        "jax.jit raw callback": jax.jit(step_of("raw")),
        "pmaptap.jit fingerprint": pmaptap.jit(step_of("fingerprint")),
        "pmaptap.jit tap": pmaptap.jit(step_of("tap")),
        # Its step number computed in the step: the device decides which
        # steps are due, and this small tree's hash stays in the step.
        "pmaptap.jit fingerprint in the step": pmaptap.jit(step_of("fingerprint, step computed")),
    }

    def arm(fn):
        def go() -> None:
            p = params
            for s in range(1, steps + 1):
                p = fn(p, jnp.int32(s))
            jax.block_until_ready(p)

        return go

    times = interleaved_rounds({k: arm(f) for k, f in arms_of.items()}, rounds=rounds, steps=steps)
    print(
        f"v. skipped: a {len(shapes)}-leaf tree, every=1000, steps never due; "
        f"{rounds} rounds x {steps} steps; {machine()}"
    )
    rows = [
        (
            f"v. skipped {k} / untapped",
            f"{paired(times, k, 'untapped'):.2f}x",
            spread(round_ratios(times, k, "untapped"), "x"),
            spread(times[k], " ms", 1e3, 3),
        )
        for k in arms_of
        if k != "untapped"
    ]
    rows.append(("v. skipped untapped", "", "", spread(times["untapped"], " ms", 1e3, 3)))
    print(table(rows, ("arm", "paired median", "range", "ms/step")))


def run_hash(quick: bool) -> None:
    """The hash alone when due, on the compile benchmark's parameters: as
    ``fingerprint64_many`` compiles it (on a TPU, leaves of one shape
    hashed by one vmap), with that grouping off (one fold a leaf), and a
    read-once floor (a float sum of every leaf); paired per round."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pmaptap._trace import fphash, fphash_host

    blocks, width = (1, 32) if quick else (6, 256)
    rounds = 2 if quick else 15
    params, _, _ = _model(blocks, width, vocab=16 * width, seq=64)
    leaves = jax.tree.leaves(params)
    saved = fphash.GROUP_MAX_BYTES
    grouped = jax.jit(fphash.fingerprint64_many).lower(leaves).compile()
    fphash.GROUP_MAX_BYTES = 0
    try:
        per_leaf = jax.jit(lambda ls: fphash.fingerprint64_many(ls)).lower(leaves).compile()
    finally:
        fphash.GROUP_MAX_BYTES = saved
    floor = jax.jit(lambda ls: jnp.stack([jnp.sum(x) for x in ls])).lower(leaves).compile()
    fns = {"grouped": grouped, "one fold a leaf": per_leaf, "floor": floor}
    assert (jax.device_get(grouped(leaves)) == jax.device_get(per_leaf(leaves))).all()
    if leaves[0].devices().pop().platform == "cpu":
        # What pmaptap.jit does there: NumPy on the arrays where they lie
        # (_trace/fphash_host.py), no program.
        fns["on the host"] = lambda ls: fphash_host.fingerprints([np.asarray(x) for x in ls])
        assert (fns["on the host"](leaves) == jax.device_get(grouped(leaves))).all()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(rounds):
        for k, f in list(fns.items())[::-1] if r % 2 else fns.items():
            jax.block_until_ready(f(leaves))
            t0 = time.perf_counter()
            for _ in range(10):
                out = f(leaves)
            jax.block_until_ready(out)
            times[k].append((time.perf_counter() - t0) / 10)
    print(f"v. hash when due: {len(leaves)} leaves; {rounds} rounds; {machine()}")
    rows = [
        (
            f"v. hash {k} / floor",
            f"{paired(times, k, 'floor'):.2f}x",
            spread(round_ratios(times, k, "floor"), "x"),
            spread(times[k], " ms", 1e3, 3),
        )
        for k in fns
        if k != "floor"
    ]
    print(table(rows, ("arm", "paired median", "range", "ms")))


def run(quick: bool) -> None:
    import pmaptap

    out_dir = tempfile.mkdtemp(prefix="pmaptap-fpcost-")
    session = pmaptap.Session(os.path.join(out_dir, "fp.jsonl"), run="fpcost").open()
    try:
        run_compile(quick)
        run_hash(quick)
        run_skipped(quick)
    finally:
        session.close()


if __name__ == "__main__":
    if "--tpu" in sys.argv:  # the device's own backend, not simulated CPU devices
        run(quick="--quick" in sys.argv)
    else:
        main_quick(run, 1)
