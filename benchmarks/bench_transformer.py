"""w. A transformer's training step, tapped as a user taps a model they did
not write (issue 59, item 4): what it adds to the step and to its compile.

The model (Flax linen): a token embedding and learned positions, N pre-LN
blocks (layer norm, causal multi-head attention, residual; layer norm, a
GELU MLP of 4x the width, residual), a final layer norm, logits through
the embedding; next-token cross-entropy, optax ``adamw``. Tapped from
outside the model code (``flax.linen.intercept_methods``): every block's
output RMS, plus the loss and a fingerprint of the parameters every
``EVERY`` steps (the step number traced).

Arms (one device; each compiled once with ``.lower().compile()`` and run
one step (the compile time: a due step compiles what runs then), timed,
then run interleaved, paired medians of the per-round step times):

- ``untapped``: the step, nothing tapped;
- ``by hand``: the same values returned by the step (the block RMS values
  and the loss every step; the fingerprints, computed by pmaptap's own
  hash inside a ``lax.cond``, on due steps) and copied to the host
  asynchronously, read one step later: what a careful user writes;
  ``by hand unread``: the same step, none of its extra values read (what the
  program alone costs); ``by hand no fingerprint``: the RMS values and
  the loss only (what ``pmaptap.jit no fingerprint`` compares with);
- ``pmaptap.jit``: the taps leave the step as outputs, a session writing
  the file; ``pmaptap.jit no fingerprint`` (its compile time tells the
  fingerprint's share); ``pmaptap.jit host step``: its step numbers NumPy
  values, which the host reads at the call (every other arm's are
  ``jnp.int32(s)``, whose copy to the device may still be in flight at
  the call: then the device decides which steps are due, and the hash
  program is dispatched every step);
- ``jax.jit``: the same taps as host callbacks;
- ``raw``: the same values (RMS and loss) through raw
  ``jax.debug.callback``, doing nothing on the host; ``floor``: ONE raw
  callback a step, of the loss.

Checked: every record of the loss equals the loss the step returned, the
block RMS records equal the by-hand arm's values of the same step (within
float rounding: another program), one fingerprint record a due step, none
divergent. Printed: ms added per step against the untapped step and the
ratio to by-hand, raw and floor; compile seconds and their ratio to the
untapped compile; the model's size; peak RSS.

``--tpu``: the TPU configuration (6 blocks of width 512, bf16, 32 x 256
tokens); ``--rounds``, ``--steps``: other than the configuration's;
``--free-running``: the loop of the arms that read nothing by hand does
not read the loss the step before returned either (by default every loop
does, so that arms differ in what they tap, not in how far ahead of the
device the host runs: docs/performance.md);
``--arms`` a comma-separated subset (one device-machine call holds
about five compiles of that model); ``--compile-rounds N``: only the
compiles, N interleaved rounds of each arm's, paired medians against the
untapped compile; ``--first-trace N``: only the step's first trace, each
in a fresh process (N an arm, alternating), with the full collections of
Python's garbage collector that ran during it; its arm ``pmaptap.jit
collector on`` is ``pmaptap.jit`` with the collector left on while the step
is lifted (docs/performance.md, "The trace's garbage"); ``--quick`` (the
test suite): a tiny model, two rounds, one round of the compiles and one
of the first traces.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (  # noqa: E402
    machine,
    paired,
    round_ratios,
    rss_mib,
    set_devices,
    settled,
    spread,
    table,
)

EVERY = 10
ARMS = (
    "untapped",
    "by hand",
    "by hand unread",
    "by hand no fingerprint",
    "pmaptap.jit",
    "pmaptap.jit no fingerprint",
    "pmaptap.jit host step",
    "jax.jit",
    "raw",
    "floor",
)

# --first-trace only: pmaptap.jit with lift's collector_held undone.
COLLECTOR_ON = "pmaptap.jit collector on"
TAPPED = ("pmaptap.jit", "pmaptap.jit no fingerprint", "pmaptap.jit host step", "jax.jit")


def _step_type(arm: str):
    """What an arm's step numbers are made with (see the arms above)."""
    import jax.numpy as jnp
    import numpy as np

    return np.int32 if arm == "pmaptap.jit host step" else jnp.int32


@dataclasses.dataclass(frozen=True)
class Config:
    blocks: int
    width: int
    heads: int
    vocab: int
    seq: int
    batch: int
    dtype: str
    rounds: int
    steps: int


QUICK = Config(2, 32, 2, 128, 16, 2, "float32", 2, 10)
CPU = Config(4, 256, 4, 4096, 128, 8, "float32", 9, 10)
TPU = Config(6, 512, 8, 32000, 256, 32, "bfloat16", 9, 20)


def _model(cfg: Config):
    import flax.linen as nn
    import jax.numpy as jnp

    dtype = jnp.dtype(cfg.dtype)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, mask):
            h = nn.LayerNorm(dtype=dtype)(x)
            h = nn.MultiHeadDotProductAttention(num_heads=cfg.heads, dtype=dtype)(h, h, mask=mask)
            x = x + h
            h = nn.LayerNorm(dtype=dtype)(x)
            h = nn.Dense(4 * cfg.width, dtype=dtype)(h)
            h = nn.Dense(cfg.width, dtype=dtype)(nn.gelu(h))
            return x + h

    class LM(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            embed = nn.Embed(cfg.vocab, cfg.width)
            pos = self.param("pos", nn.initializers.normal(0.02), (cfg.seq, cfg.width))
            x = (embed(tokens) + pos[: tokens.shape[1]]).astype(dtype)
            mask = nn.make_causal_mask(tokens)
            for i in range(cfg.blocks):
                x = Block(name=f"block{i}")(x, mask)
            x = nn.LayerNorm(dtype=dtype)(x)
            return embed.attend(x.astype(jnp.float32))

    return LM(), Block


def _arms(cfg: Config):
    """(step functions by arm, their prefixes, initial state, tokens, the
    model's size, and ``make(arm, prefix)``: a new step function of that arm)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax import lax

    import pmaptap
    from pmaptap._trace.fphash import fingerprint64_many

    model, Block = _model(cfg)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab, (cfg.batch, cfg.seq + 1)), jnp.int32)
    # Jitted: one compile instead of an eager dispatch (and compile) per op.
    params = jax.jit(model.init)(jax.random.key(0), tokens[:, :-1])["params"]
    opt = optax.adamw(1e-3, weight_decay=1e-4)
    state = (params, opt.init(params))
    n_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))

    def with_blocks(seen):
        """Runs the model with every block's output RMS handed to ``seen``
        (name, value): from outside the model code."""

        def intercept(next_fun, args, kwargs, context):
            out = next_fun(*args, **kwargs)
            if isinstance(context.module, Block) and context.method_name == "__call__":
                seen(context.module.name, jnp.sqrt(jnp.mean(jnp.square(out.astype(jnp.float32)))))
            return out

        return intercept

    def make(arm: str, prefix: str):
        fingerprint = arm in ("pmaptap.jit", "pmaptap.jit host step", "jax.jit")
        taps = fingerprint or arm == "pmaptap.jit no fingerprint"

        def step(state, tokens, s):
            params, opt_state = state
            rms: dict = {}

            def seen(name, v):
                if taps:
                    pmaptap.tap(v, f"{prefix}rms/{name}", step=s)
                elif arm.startswith("by hand") or arm == "raw":
                    rms[name] = v

            def loss_fn(p):
                with nn.intercept_methods(with_blocks(seen)):
                    logits = model.apply({"params": p}, tokens[:, :-1])
                loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
                # Seen under value_and_grad: returned as its aux.
                return loss.mean(), dict(rms)

            (loss, rms), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
            updates, opt_state = opt.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            extra: tuple = ()
            if taps:
                pmaptap.tap(loss, f"{prefix}loss", step=s)
            if fingerprint:
                pmaptap.fingerprint(params, f"{prefix}params", step=s, every=EVERY)
            if arm == "by hand no fingerprint":
                extra = (rms,)
            elif arm in ("by hand", "by hand unread"):
                leaves = jax.tree.leaves(params)
                fps = lax.cond(
                    s % EVERY == 0,
                    lambda: fingerprint64_many(leaves),
                    lambda: jnp.zeros((len(leaves), 2), jnp.uint32),
                )
                extra = (rms, fps)
            elif arm == "raw":
                jax.debug.callback(lambda *_: None, loss, rms)
            elif arm == "floor":
                jax.debug.callback(lambda *_: None, loss)
            return (params, opt_state), loss, extra

        wrap = pmaptap.jit if arm.startswith("pmaptap.jit") else jax.jit
        return wrap(step)

    prefixes = {arm: f"w{i}/" for i, arm in enumerate(ARMS)}
    fns = {arm: make(arm, prefixes[arm]) for arm in ARMS}
    return fns, prefixes, state, tokens, n_params, make


def run(
    cfg: Config,
    arms: list[str],
    profile: bool = False,
    warm: bool = True,
    compile_rounds: int = 0,
    paced: bool = True,
) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import pmaptap

    fns, prefixes, state0, tokens, n_params, make = _arms(cfg)
    fns = {a: fns[a] for a in arms}
    out_dir = tempfile.mkdtemp(prefix="pmaptap-transformer-")
    path = os.path.join(out_dir, "w.jsonl")
    session = pmaptap.Session(path, run="transformer").open()
    # The first compile of a process also pays the compiler's own start:
    # paid here, by a one-block model, not by the first arm. (Not in
    # --quick, whose compile times mean nothing.)
    if warm:
        warm_fns, _, warm_state, *_ = _arms(dataclasses.replace(cfg, blocks=1))
        warm_fns["untapped"].lower(warm_state, tokens, jnp.int32(0)).compile()
    if compile_rounds:
        _compile_rounds(make, prefixes, list(fns), state0, tokens, compile_rounds, cfg)
        session.close()
        return
    compiled, compile_s, first_loss = {}, {}, {}
    step_of = {arm: _step_type(arm) for arm in fns}
    for arm, fn in fns.items():
        settled()
        t = time.perf_counter()
        compiled[arm] = fn.lower(state0, tokens, step_of[arm](0)).compile()
        # And a first step, not counted among the rounds' (step numbers
        # from 1): pmaptap.jit compiles the hash of the step's outputs, a
        # program of its own, at the first due step.
        first = compiled[arm](state0, tokens, step_of[arm](0))
        jax.block_until_ready(first)
        compile_s[arm] = time.perf_counter() - t
        first_loss[arm] = first[1]
    states = {a: state0 for a in fns}
    step_no = {a: 1 for a in fns}
    returned: dict[str, dict[int, float]] = {a: {0: first_loss[a]} for a in fns}
    by_hand: dict[int, tuple] = {}
    flush_s: dict[str, list[float]] = {a: [] for a in fns}

    def round_of(arm: str, probe: dict | None = None):
        # The by-hand arms read each step's values once the next is
        # dispatched: into by_hand for "by hand" (the records' reference).
        # ``probe`` (--profile's host pass): each call's time and whether
        # its step number was still on its way to the device, appended.
        read_into = {"by hand": by_hand, "by hand no fingerprint": {}}.get(arm)

        def read(pending) -> None:
            ps, pl, (prms, *pfps) = pending
            rms = {k: float(v) for k, v in prms.items()}
            read_into[ps] = (float(pl), rms, *(np.asarray(x) for x in pfps))

        def go() -> None:
            f, st, pending, last = compiled[arm], states[arm], None, None
            for _ in range(cfg.steps):
                s = step_no[arm]
                number = step_of[arm](s)
                if probe is None:
                    st, loss, extra = f(st, tokens, number)
                else:
                    flying = isinstance(number, jax.Array) and not number.is_ready()
                    t0 = time.perf_counter()
                    st, loss, extra = f(st, tokens, number)
                    probe["call"].append(time.perf_counter() - t0)
                    probe["in flight"].append(flying)
                if read_into is not None:
                    for x in jax.tree.leaves((loss, extra)):
                        x.copy_to_host_async()
                    if pending is not None:  # the step before, read by hand
                        read(pending)
                    pending = (s, loss, extra)
                elif paced:
                    # Every other arm's loop reads the loss the step before
                    # returned, as the by-hand arms read theirs (and a loop
                    # that logs its loss does): the arms then differ in
                    # what they tap, not in how far the host runs ahead.
                    loss.copy_to_host_async()
                    if last is not None:
                        float(last)
                    last = loss
                returned[arm][s] = loss
                step_no[arm] = s + 1
            jax.block_until_ready(st)
            if pending is not None:
                read(pending)
            states[arm] = st
            if arm in TAPPED:
                t = time.perf_counter()
                session.flush()
                flush_s[arm].append(time.perf_counter() - t)
            elif arm in ("raw", "floor"):
                jax.effects_barrier()

        return go

    for arm in fns:  # warm-up round: first calls, first writes
        round_of(arm)()
    times: dict[str, list[float]] = {a: [] for a in fns}
    for r in range(cfg.rounds):
        order = list(fns) if r % 2 == 0 else list(reversed(fns))
        for arm in order:
            t = time.perf_counter()
            round_of(arm)()
            times[arm].append((time.perf_counter() - t) / cfg.steps)
    if profile:
        _device_profile(round_of, list(fns), cfg.steps)
        _host_profile(round_of, list(fns), cfg.steps)
    session.close()
    _check(path, prefixes, fns, returned, by_hand, cfg)

    print(
        f"w. transformer step: {cfg.blocks} blocks of width {cfg.width}, {cfg.heads} heads, "
        f"vocab {cfg.vocab}, {cfg.batch} x {cfg.seq} tokens, {cfg.dtype}, adamw; "
        f"{n_params / 1e6:.1f}M parameters in {len(jax.tree.leaves(state0[0]))} leaves; "
        f"taps: {cfg.blocks} block RMS + loss, fingerprint every {EVERY}; "
        f"{cfg.rounds} rounds x {cfg.steps} steps; {machine()}"
    )
    base = "untapped"
    rows = []
    for arm in fns:
        added = [t - b for t, b in zip(times[arm], times[base])]
        row = [
            f"w. {arm}",
            spread(times[arm], " ms", 1e3, 2),
            "" if arm == base else spread(added, " ms", 1e3, 2),
        ]
        for ref in ("by hand", "raw", "floor"):
            ok = arm not in (base, ref) and ref in times
            row.append(f"{paired(times, arm, ref, base):.2f}x" if ok else "")
        row.append(f"{compile_s[arm]:.1f} s")
        row.append(f"{compile_s[arm] / compile_s[base]:.3f}x" if base in compile_s else "")
        rows.append(tuple(row))
    print(
        table(
            rows,
            (
                "arm",
                "ms/step",
                "added ms/step",
                "added / by hand",
                "/ raw",
                "/ floor",
                "compile",
                "compile / untapped",
            ),
        )
    )
    flushes = ", ".join(
        f"{arm} {spread([f / cfg.steps for f in v], ' ms', 1e3, 2)}"
        for arm, v in flush_s.items()
        if v
    )
    print(f"w. of which the session's flush at the end of each round, per step: {flushes}")
    print(f"w. peak RSS {rss_mib():.0f} MiB; records checked against the returned values")


def _compile_rounds(make, prefixes, arms, state0, tokens, rounds: int, cfg: Config) -> None:
    """``--compile-rounds``: each arm's compile and first (due) step, a new
    step function each time (nothing cached), the arms in alternating
    order round after round; paired medians of each round's ratio to the
    untapped compile (single compiles of one model move 10-15% between
    runs)."""
    import jax

    # Per arm, per round, per phase (trace, lower, XLA's compile, first
    # step): seconds, to say where an arm's extra time is.
    phases: dict[str, list[list[float]]] = {a: [] for a in arms}
    # pmaptap.jit's trace split: lift's first pass (the step's function
    # traced, inside jit's trace) and its second (the jaxpr bound again).
    passes: dict[str, list[list[float]]] = {a: [] for a in arms}
    for r in range(rounds):
        for arm in arms if r % 2 == 0 else arms[::-1]:
            step = _step_type(arm)
            fn = make(arm, prefixes[arm])
            settled()
            t = [time.perf_counter()]
            with _lift_timed() as split:
                traced = fn.trace(state0, tokens, step(0))
            t.append(time.perf_counter())
            if split["first"]:
                passes[arm].append([split["first"], split["second"]])
            lowered = traced.lower()
            t.append(time.perf_counter())
            compiled = lowered.compile()
            t.append(time.perf_counter())
            jax.block_until_ready(compiled(state0, tokens, step(0)))
            t.append(time.perf_counter())
            phases[arm].append([b - a for a, b in zip(t, t[1:])])
    times = {a: [sum(p) for p in phases[a]] for a in arms}
    print(
        f"w. compile + first step: {cfg.blocks} blocks of width {cfg.width}, {cfg.dtype}; "
        f"{rounds} rounds; {machine()}"
    )
    rows = [
        (
            f"w. compile {arm}",
            spread(times[arm], " s"),
            "" if arm == "untapped" else f"{paired(times, arm, 'untapped'):.3f}x",
            " ".join(f"{x:.3f}" for x in round_ratios(times, arm, "untapped")),
            " / ".join(f"{statistics.median(p):.2f}" for p in zip(*phases[arm])),
            " / ".join(f"{statistics.median(p):.3f}" for p in zip(*passes[arm])),
        )
        for arm in arms
    ]
    print(
        table(
            rows,
            (
                "arm",
                "compile",
                "paired / untapped",
                "each round",
                "trace / lower / XLA / first step (s, medians)",
                "lift: first / second pass (s)",
            ),
        )
    )


@contextlib.contextmanager
def _lift_timed():
    """Seconds of lift's first pass (the step's function traced) and of
    its second (``lift.run`` on the step's jaxpr, the outermost call) in
    a trace under this context: lift's functions timed in place (the
    benchmark's, not the package's)."""
    from pmaptap._outputs import lift

    split = {"first": 0.0, "second": 0.0}
    trace, run, depth = lift._trace, lift.run, [0]

    def timed_trace(fn, args, what="pmaptap lift"):
        t = time.perf_counter()
        try:
            return trace(fn, args, what)
        finally:
            if what == "pmaptap.jit":
                split["first"] += time.perf_counter() - t

    def timed_run(*a, **k):
        depth[0] += 1
        t = time.perf_counter()
        try:
            return run(*a, **k)
        finally:
            depth[0] -= 1
            if depth[0] == 0:
                split["second"] += time.perf_counter() - t

    lift._trace, lift.run = timed_trace, timed_run
    try:
        yield split
    finally:
        lift._trace, lift.run = trace, run


def _first_trace(argv: list[str], arms: list[str], rounds: int) -> None:
    """``--first-trace N``: each arm's first trace of the step in a fresh
    process (``--trace-once``), N processes an arm, the arms alternating;
    the collector as the program leaves it (not settled), as at the first
    compile of a training run."""
    import json
    import subprocess

    got: dict[str, list[dict]] = {a: [] for a in arms}
    for r in range(rounds):
        for arm in arms if r % 2 == 0 else arms[::-1]:
            proc = subprocess.run(
                [sys.executable, os.path.abspath(__file__), *argv, "--trace-once", arm],
                capture_output=True,
                text=True,
            )
            if proc.returncode != 0:
                raise RuntimeError(f"--trace-once {arm!r} failed:\n{proc.stderr[-3000:]}")
            got[arm].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    times = {a: [g["trace_s"] for g in got[a]] for a in arms}
    rows = [
        (
            f"w. first trace {arm}",
            spread(times[arm], " s"),
            "" if arm == "untapped" else f"{paired(times, arm, 'untapped'):.3f}x",
            f"{statistics.mean(g['full'] for g in got[arm]):.1f}",
            f"{statistics.median(g['full_s'] for g in got[arm]):.3f} s",
        )
        for arm in arms
    ]
    print(f"w. first trace of the step, a fresh process each: {rounds} rounds; {machine()}")
    print(
        table(
            rows,
            ("arm", "trace", "paired / untapped", "full collections", "their time (median)"),
        )
    )


def _trace_once(cfg: Config, arm: str) -> None:
    """``--trace-once ARM`` (a process of ``--first-trace``): the step
    traced once; prints its time and the full collections during it."""
    import gc
    import json

    if arm == COLLECTOR_ON:
        from pmaptap._outputs import lift

        lift.collector_held = contextlib.nullcontext
    base = "pmaptap.jit" if arm == COLLECTOR_ON else arm
    _, prefixes, state0, tokens, _, make = _arms(cfg)
    fn = make(base, prefixes[base])
    full: list[float] = []

    def on_gc(phase: str, info: dict) -> None:
        if info["generation"] == 2:
            full.append(time.perf_counter())

    gc.callbacks.append(on_gc)
    t = time.perf_counter()
    fn.trace(state0, tokens, _step_type(base)(0))
    took = time.perf_counter() - t
    gc.callbacks.remove(on_gc)
    spent = sum(b - a for a, b in zip(full[::2], full[1::2]))
    print(json.dumps({"trace_s": took, "full": len(full) // 2, "full_s": spent}))


def _device_profile(round_of, arms: list[str], steps: int) -> None:
    """``--profile``: one round of each arm under JAX's profiler; per step,
    the device's busy time and its ops by kind (an op's HLO name without
    its number: ``fusion``, ``copy-done``, ...), each arm's difference to
    the untapped step's largest first: where the device spends what an arm
    adds. Reported only where the profile has a device plane (TPU, GPU)."""
    import collections
    import glob
    import re

    import jax

    kinds: dict[str, collections.Counter] = {}
    busy: dict[str, float] = {}
    for arm in arms:
        where = tempfile.mkdtemp(prefix="pmaptap-profile-")
        with jax.profiler.trace(where):
            round_of(arm)()
        (pb,) = glob.glob(os.path.join(where, "**", "*.xplane.pb"), recursive=True)
        ns = collections.Counter()
        for plane in jax.profiler.ProfileData.from_file(pb).planes:
            if plane.name.startswith("/device:"):
                for line in plane.lines:
                    if line.name == "XLA Ops":
                        for e in line.events:
                            ns[re.match(r"%?([^.= ]+)", e.name).group(1)] += e.duration_ns
        kinds[arm], busy[arm] = ns, sum(ns.values()) / steps / 1e3
    if not any(busy.values()):
        print("w. device profile: no device plane (XLA ran on the host)")
        return
    for arm in arms[1:]:
        diff = kinds[arm].copy()
        diff.subtract(kinds[arms[0]])
        top = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:4]
        parts = ", ".join(f"{k} {v / steps / 1e3:+.1f}" for k, v in top)
        print(
            f"w. device profile: {arm} busy {busy[arm] - busy[arms[0]]:+.1f} us/step "
            f"over {arms[0]} ({busy[arms[0]]:.0f} us); by op kind: {parts}"
        )


def _host_profile(round_of, arms: list[str], steps: int) -> None:
    """``--profile``'s host pass: one round of each arm with each call
    timed (the host's time in it, a step), whether the call's step number
    was still on its way to the device just before the call (at most what
    pmaptap then saw: the device decides which steps are due for those,
    the hash program dispatched every step), the output transport's
    thread's CPU and wall time delivering a step, and the session's flush
    at the round's end in its two parts (every dispatched step delivered;
    the pipeline written); then how long a fresh ``jnp.int32`` takes to
    reach the device."""
    import statistics

    import jax
    import jax.numpy as jnp

    from pmaptap._host import barrier
    from pmaptap._host.pipeline.pipeline import Pipeline
    from pmaptap._outputs.drain import Drain

    def timed(owner, name: str, into: list, cpu: list | None = None):
        """Time ``owner.name`` into ``into`` (and its thread's CPU time into
        ``cpu``); returns the real one, for restoring it."""
        real = getattr(owner, name)

        def wrapper(*args, **kwargs):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return real(*args, **kwargs)
            finally:
                into.append(time.perf_counter() - t0)
                if cpu is not None:
                    cpu.append(time.thread_time() - c0)

        setattr(owner, name, wrapper)
        return real

    def us(values: list[float]) -> str:
        return f"{statistics.median(values) * 1e6:.0f} us" if values else "-"

    for arm in arms:
        probe: dict[str, list] = {"call": [], "in flight": []}
        parts: dict[str, list] = {"deliver": [], "cpu": [], "barrier": [], "pipeline": []}
        reals = [
            (Drain, "_deliver", timed(Drain, "_deliver", parts["deliver"], parts["cpu"])),
            (barrier, "effects_barrier", timed(barrier, "effects_barrier", parts["barrier"])),
            (Pipeline, "flush", timed(Pipeline, "flush", parts["pipeline"])),
        ]
        try:
            round_of(arm, probe)()
        finally:
            for owner, name, real in reals:
                setattr(owner, name, real)
        line = (
            f"w. host profile: {arm}: call {us(probe['call'])} a step, step number in flight "
            f"at {sum(probe['in flight'])}/{len(probe['call'])} calls"
        )
        if parts["deliver"]:
            # Its CPU time is what it takes from the loop; its wall time
            # also holds its waits for the steps' outputs (the device).
            line += (
                f", output thread {sum(parts['cpu']) / steps * 1e6:.0f} us CPU a step "
                f"({sum(parts['deliver']) / steps * 1e6:.0f} us wall)"
            )
        if parts["pipeline"]:
            line += (
                f"; flush: steps delivered {us(parts['barrier'])} + written {us(parts['pipeline'])}"
            )
        print(line)
    ready, flying = [], 0
    for k in range(50):
        t0 = time.perf_counter()
        x = jnp.int32(k)
        flying += not x.is_ready()
        while not x.is_ready():
            pass
        ready.append(time.perf_counter() - t0)
    print(
        f"w. host profile: a fresh jnp.int32(s) still on its way to the device after the "
        f"call that made it {flying}/50 times; ready {us(ready)} after it began "
        f"(max {max(ready) * 1e6:.0f} us); {jax.devices()[0].platform}"
    )


def _check(path, prefixes, fns, returned, by_hand, cfg: Config) -> None:
    """The records are the values the steps computed (see the docstring)."""
    import numpy as np

    import pmaptap

    recs = pmaptap.read(path)
    for arm in TAPPED:
        if arm not in fns:
            continue
        p = prefixes[arm]
        loss = {r["step"]: np.float32(r["value"]) for r in recs if r["name"] == f"{p}loss"}
        want = {s: np.float32(v) for s, v in returned[arm].items()}
        assert loss == want, (arm, len(loss), len(want))
        for s, (_, rms, _) in by_hand.items():
            for block, v in rms.items():
                got = next(
                    r["value"] for r in recs if r["name"] == f"{p}rms/{block}" and r["step"] == s
                )
                tol = 2e-2 if cfg.dtype == "bfloat16" else 1e-4
                assert np.isclose(got, v, rtol=tol), (arm, block, s, got, v)
        fps = [r for r in recs if r["name"] == f"{p}params"]
        if arm != "pmaptap.jit no fingerprint":
            due = sorted(s for s in returned[arm] if s % EVERY == 0)
            assert sorted({r["step"] for r in fps}) == due, (arm, due)
            assert not [r for r in fps if r.get("divergent")], arm
        else:
            assert not fps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="a tiny model: checks that it runs")
    ap.add_argument("--tpu", action="store_true", help="the TPU configuration, on the TPU")
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of the arms")
    ap.add_argument("--blocks", type=int, default=0, help="blocks (0: the configuration's)")
    ap.add_argument("--steps", type=int, default=0, help="steps a round (0: the configuration's)")
    ap.add_argument("--rounds", type=int, default=0, help="rounds (0: the configuration's)")
    ap.add_argument(
        "--free-running",
        action="store_true",
        help="the arms that read nothing do not read the step before's loss either",
    )
    ap.add_argument(
        "--compile-rounds",
        type=int,
        default=0,
        help="only the compiles: this many interleaved rounds of every arm's",
    )
    ap.add_argument(
        "--first-trace",
        type=int,
        default=0,
        help="only the step's first trace: this many fresh processes of each arm's",
    )
    ap.add_argument("--trace-once", default="", help=argparse.SUPPRESS)
    ap.add_argument(
        "--profile",
        action="store_true",
        help="and the device's time per op kind, each arm's; and a host pass: each call "
        "timed, pmaptap's output thread and the flush in parts",
    )
    a = ap.parse_args(argv)
    if not a.tpu:
        set_devices(1)
    cfg = QUICK if a.quick else TPU if a.tpu else CPU
    if a.blocks:
        cfg = dataclasses.replace(cfg, blocks=a.blocks)
    if a.steps:
        cfg = dataclasses.replace(cfg, steps=a.steps)
    if a.rounds:
        cfg = dataclasses.replace(cfg, rounds=a.rounds)
    if a.trace_once:
        _trace_once(cfg, a.trace_once)
        return 0
    arms = [x.strip() for x in a.arms.split(",")]
    unknown = [x for x in arms if x not in ARMS + (COLLECTOR_ON,)]
    if unknown:
        ap.error(f"--arms: unknown {unknown}; choose from {list(ARMS) + [COLLECTOR_ON]}")
    if "untapped" not in arms:
        arms.insert(0, "untapped")
    # The configuration's arguments, for the processes of --first-trace.
    config = [*(["--quick"] if a.quick else []), *(["--tpu"] if a.tpu else [])]
    config += [f"--blocks={a.blocks}"] if a.blocks else []
    if a.first_trace:
        _first_trace(config, arms, a.first_trace)
        return 0
    if COLLECTOR_ON in arms:
        ap.error(f"--arms: {COLLECTOR_ON!r} is an arm of --first-trace only")
    run(
        cfg,
        arms,
        a.profile or a.quick,
        warm=not a.quick,
        compile_rounds=a.compile_rounds,
        paced=not a.free_running,
    )
    if a.quick and not a.compile_rounds:  # and the compile-only modes, one round
        run(cfg, ["untapped", "pmaptap.jit"], warm=False, compile_rounds=1)
        _first_trace(config, ["untapped", "pmaptap.jit", COLLECTOR_ON], 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
