"""Taps inside loop bodies: every record says which iteration it comes from
("iteration", outermost loop first), under both transports, and two
iterations of one step are never compared as replicas (issue 57, item 4)."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import pmaptap

pytestmark = pytest.mark.usefixtures("transport")

LAYERS, STEPS = 4, 5


def _lines(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _taps(path, name):
    return [d for d in _lines(path) if d["name"] == name]


def _layers(h, ws, name="act_rms", **kw):
    def layer(h, w):
        h = jnp.tanh(h * w)
        pmaptap.tap(jnp.sqrt(jnp.mean(h**2)), name, **kw)
        return h, None

    return lax.scan(layer, h, ws)[0]


def test_scan_layers_are_iterations_of_one_step_not_divergent_replicas(session, tap_path):
    """The issue's training step: per-layer taps in a scan over layers, a
    pmean'd value, under pmap: one record per (step, layer), none divergent,
    automatic steps counting calls of the step."""

    step = jax.pmap(_layers)
    ws = jnp.broadcast_to(jnp.arange(1.0, LAYERS + 1) / 4, (8, LAYERS))
    x = jnp.ones((8, 3))
    for i in range(STEPS):
        step(x * (i + 1), ws)
    session.flush()
    recs = _taps(tap_path, "act_rms")
    assert not any(r.get("divergent") for r in recs)
    assert [(r["step"], r["iteration"]) for r in recs] == [
        (s, [k]) for s in range(STEPS) for k in range(LAYERS)
    ]
    assert all(r["kind"] == "replicated" and r["replicas"] == 8 for r in recs)


def test_explicit_traced_step_keyed_by_step_and_layer(session, tap_path):
    @jax.jit
    def step(x, ws, i):
        return _layers(x, ws, step=i)

    ws = jnp.arange(1.0, LAYERS + 1)
    for i in range(3):
        step(jnp.ones(2) * i, ws, i)
    session.flush()
    recs = _taps(tap_path, "act_rms")
    assert [(r["step"], r["iteration"]) for r in recs] == [
        (s, [k]) for s in range(3) for k in range(LAYERS)
    ]


def test_nested_loops_fori_while_and_remat(session, tap_path):
    @jax.jit
    def step(x):
        def outer(c, _):
            def inner(i, acc):
                pmaptap.tap(acc, "inner")
                return acc + 1.0

            c = lax.fori_loop(0, 3, inner, c)

            @jax.checkpoint
            def remat(y):
                pmaptap.tap(y * 2, "remat")
                return y

            c = remat(c)
            pmaptap.tap(c, "outer")
            return c, None

        c, _ = lax.scan(outer, x, None, length=2)

        def cond(v):
            pmaptap.tap(v[0], "cond")
            return v[0] < 3.0

        def body(v):
            pmaptap.tap(v[0], "body")
            return v + 1.0

        return lax.while_loop(cond, body, jnp.stack([c - c, c]))

    for _ in range(2):
        step(jnp.float32(0.0))
    session.flush()
    inner = _taps(tap_path, "inner")
    assert [(r["step"], r["iteration"], r["value"]) for r in inner] == [
        (s, [o, i], float(3 * o + i)) for s in range(2) for o in range(2) for i in range(3)
    ]
    assert [(r["step"], r["iteration"]) for r in _taps(tap_path, "outer")] == [
        (s, [o]) for s in range(2) for o in range(2)
    ]
    assert [(r["step"], r["iteration"]) for r in _taps(tap_path, "remat")] == [
        (s, [o]) for s in range(2) for o in range(2)
    ]
    # The body ran 3 times; the condition was evaluated 4 times, each
    # before the iteration the body is about to run.
    assert [(r["step"], r["iteration"], r["value"]) for r in _taps(tap_path, "body")] == [
        (s, [k], float(k)) for s in range(2) for k in range(3)
    ]
    assert [(r["step"], r["iteration"]) for r in _taps(tap_path, "cond")] == [
        (s, [k]) for s in range(2) for k in range(4)
    ]


def test_reverse_scan_iteration_is_the_index_into_xs(session, tap_path):
    @jax.jit
    def step(xs):
        def body(c, x):
            pmaptap.tap(x, "rev")
            return c, None

        return lax.scan(body, 0.0, xs, reverse=True)[0]

    step(jnp.arange(3.0))
    session.flush()
    assert [(r["iteration"], r["value"]) for r in _taps(tap_path, "rev")] == [
        ([2], 2.0),
        ([1], 1.0),
        ([0], 0.0),
    ]


def test_vmap_and_every_inside_a_scan(session, tap_path):
    """vmap: one record per iteration holding the batch; every=N with a
    traced step: steps are the step's, every iteration of a due step kept."""

    @jax.jit
    def step(x, ws, i):
        h = jax.vmap(lambda r: _layers(r, ws, name="vm"))(x)
        return _layers(h, ws, name="ev", step=i, every=2)

    ws = jnp.arange(1.0, 4.0)
    for i in range(4):
        step(jnp.ones((2, 2)), ws, i)
    session.flush()
    vm = _taps(tap_path, "vm")
    assert [(r["step"], r["iteration"], r["batch_dims"]) for r in vm] == [
        (s, [k], 1) for s in range(4) for k in range(3)
    ]
    ev = _taps(tap_path, "ev")
    assert [(r["step"], r["iteration"]) for r in ev] == [(s, [k]) for s in (0, 2) for k in range(3)]


def test_loop_free_records_have_no_iteration_field(session, tap_path):
    jax.jit(lambda x: pmaptap.tap(x, "plain"))(jnp.ones(2))
    session.flush()
    assert all("iteration" not in r for r in _lines(tap_path))


def test_validate_is_clean(session, tap_path):
    from pmaptap.tapfile.analyze import validate as checks

    # An explicit step: every layer's record of a step has that step.
    f = jax.pmap(lambda x, ws, i: _layers(x, ws, step=i), in_axes=(0, 0, None))
    ws = jnp.broadcast_to(jnp.arange(1.0, LAYERS + 1), (8, LAYERS))
    for i in range(2):
        f(jnp.ones((8, 2)), ws, i)
    session.flush()
    report = checks.validate_file(tap_path)
    assert report.ok and report.divergent_keys == 0, report.problems
    recs = _taps(tap_path, "act_rms")
    assert not any(r.get("divergent") for r in recs)
    assert [(r["step"], r["iteration"], r["replicas"]) for r in recs] == [
        (s, [k], 8) for s in range(2) for k in range(LAYERS)
    ]


@pytest.mark.callback_only("compares the two transports itself")
def test_both_transports_write_the_same_records(tmp_path):
    """The same program under jax.jit/pmap (callbacks) and pmaptap.jit/pmap
    (outputs): the same lines, but for the time and what outputs tell more
    (the device of a one-device jit step, docs/api.md "Same records")."""

    def program(jit, pmap, path):
        @pmap
        def step(x, ws):
            h = _layers(x, ws)

            def inner(i, acc):
                pmaptap.tap(acc, "fori", dedup="per_device")
                return acc * 0.5

            return lax.fori_loop(0, 2, inner, h)

        @jit
        def nested(x):
            def outer(c, _):
                c, _ = lax.scan(lambda a, _: (pmaptap.tap(a + 1, "in"), None), c, None, length=2)
                return c, None

            return lax.scan(outer, x, None, length=3)[0]

        with pmaptap.Session(path, run="r"):
            for i in range(3):
                step(jnp.ones((8, 2)) * i, jnp.ones((8, LAYERS)))
                nested(jnp.float32(i))
        out = []
        for d in _lines(path):
            d.pop("time")
            if d["name"] == "in":
                d.pop("devices")
            out.append(d)
        return out

    a = program(jax.jit, jax.pmap, str(tmp_path / "cb.jsonl"))
    b = program(pmaptap.jit, pmaptap.pmap, str(tmp_path / "out.jsonl"))

    # Each tap's records in the same order; how two steps' records
    # interleave differs (outputs reach the host after their step).
    def by_tap(recs):
        return sorted(recs, key=lambda d: (d["name"], d["step"], d["iteration"], d.get("device")))

    assert by_tap(a) == by_tap(b)
    assert [d for d in a if d["name"] == "act_rms"] == [d for d in b if d["name"] == "act_rms"]
    assert {tuple(d["iteration"]) for d in a if d["name"] == "in"} == {
        (o, i) for o in range(3) for i in range(2)
    }
    assert os.path.getsize(tmp_path / "cb.jsonl") > 0


def _cli(*args):
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "pmaptap", *args], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.callback_only("reads a file: the readers, not the transports")
def test_readers_keep_iterations_apart(session, tap_path):
    from pmaptap.tapfile.export import plot, tensorboard

    f = jax.pmap(_layers)
    ws = jnp.broadcast_to(jnp.arange(1.0, LAYERS + 1), (8, LAYERS))
    for i in range(3):
        f(jnp.ones((8, 2)) * i, ws)
    session.flush()
    summary = _cli("summary", tap_path)
    rows = [line.split()[0] for line in summary.splitlines()[2:] if line.strip()]
    assert rows == [f"act_rms[{k}]" for k in range(LAYERS)]
    assert "divergent" not in summary
    # The parallel summary is byte-identical to the serial one.
    assert _cli("summary", "--jobs", "2", tap_path) == summary
    shown = _cli("show", tap_path).splitlines()[1:]
    assert [line.split()[1] for line in shown] == [
        f"act_rms[{k}]" for _ in range(3) for k in range(LAYERS)
    ]
    recs = pmaptap.read(tap_path)
    assert {tensorboard.tag_parts(r)[0] for r in recs} == {f"act_rms/{k}" for k in range(LAYERS)}
    assert {plot._label(r, False) for r in recs} == {
        f"act_rms/{k}: replicated" for k in range(LAYERS)
    }


@pytest.mark.callback_only("a fact about JAX's traces, not about a transport")
def test_jax_still_names_its_loop_body_traces_as_iteration_expects():
    """If this fails, JAX renamed the DebugInfo.traced_for of its loop
    bodies: update iteration.LOOP_BODIES."""
    from jax._src import core

    from pmaptap._trace import iteration

    seen = set()

    def note(x):
        seen.add(core.trace_ctx.trace.frame.debug_info.traced_for)
        return x

    def f(x, n):
        x = lax.scan(lambda c, _: (note(c), None), x, None, length=2)[0]
        x = lax.fori_loop(0, 2, lambda i, c: note(c), x)
        x = lax.fori_loop(0, n, lambda i, c: note(c), x)
        return lax.while_loop(lambda c: note(c) < 5, note, x)

    jax.make_jaxpr(f)(0, 3)
    assert seen == set(iteration.LOOP_BODIES)


def test_vmapped_while_body_with_a_batched_predicate(session, tap_path):
    """Elements whose loops end at different iterations (a batched
    predicate): one record per iteration of the loop, holding the batch."""
    f = jax.jit(
        jax.vmap(lambda x: lax.while_loop(lambda c: c < 3, lambda c: pmaptap.tap(c, "wb") + 1, x))
    )
    f(jnp.array([0, 2]))
    session.flush()
    assert [(r["step"], r["iteration"], r["value"]) for r in _taps(tap_path, "wb")] == [
        (0, [0], [0, 2]),
        (0, [1], [1, 3]),
        (0, [2], [2, 3]),
    ]


def test_tap_grad_in_a_scan_carries_the_forward_iteration(session, tap_path):
    def f(x):
        def body(c, w):
            return pmaptap.tap_grad(c * w, "g"), None

        return lax.scan(body, x, jnp.arange(1.0, 4.0))[0].sum()

    g = jax.jit(jax.grad(f))
    for _ in range(2):
        g(jnp.ones(2))
    session.flush()
    recs = _taps(tap_path, "g")
    assert [(r["step"], r["iteration"], r["pass"]) for r in recs] == [
        (s, [k], "backward") for s in range(2) for k in (2, 1, 0)
    ]


def test_shard_map_and_eager_scans(session, tap_path):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("d",))

    def body(x):
        def layer(h, _):
            pmaptap.tap(lax.pmean(h.mean(), "d"), "sm")
            return h * 2, None

        return lax.scan(layer, x, None, length=3)[0]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    xs = jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("d")))
    f(xs)
    f(xs)
    lax.scan(lambda c, x: (pmaptap.tap(c + x, "eager"), None), 0.0, jnp.arange(2.0))
    session.flush()
    sm = _taps(tap_path, "sm")
    assert [(r["step"], r["iteration"], r["replicas"]) for r in sm] == [
        (s, [k], 8) for s in range(2) for k in range(3)
    ]
    assert not any(r.get("divergent") for r in sm)
    assert [(r["step"], r["iteration"]) for r in _taps(tap_path, "eager")] == [(0, [0]), (0, [1])]


@pytest.mark.callback_only("reads a file: the readers, not the transports")
def test_csv_and_frame_keep_iterations_apart(session, tap_path, tmp_path):
    pytest.importorskip("pandas")
    f = jax.pmap(lambda x, ws: _layers(x, ws, dedup="per_device"))
    ws = jnp.broadcast_to(jnp.arange(1.0, 3.0), (8, 2))
    for i in range(2):
        f(jnp.ones((8, 2)) * jnp.arange(8.0)[:, None] * (i + 1), ws)
    session.flush()
    out = tmp_path / "t.csv"
    _cli("export", tap_path, "--csv", str(out))
    import csv

    with open(out, newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["step"], r["iteration"]) for r in rows if r["device"] == "0"] == [
        (str(s), str(k)) for s in range(2) for k in range(2)
    ]
    table = pmaptap.per_device(pmaptap.read(tap_path, as_frame=True))
    assert list(table.index) == [(s, (k,)) for s in range(2) for k in range(2)]
    assert list(table.columns) == list(range(8))


def test_a_name_tapped_in_a_loop_and_outside_counts_calls(session, tap_path):
    """Automatic steps of one name tapped in a loop body (a cond there
    firing at one iteration) and after the loop: each call of the step is
    two steps (the loop's iterations one, the tap after it one)."""

    @jax.jit
    def step(x, fire):
        def body(c, i):
            lax.cond(i == fire, lambda: pmaptap.tap(c, "x"), lambda: c)
            return c + 1.0, None

        c, _ = lax.scan(body, x, jnp.arange(3))
        return pmaptap.tap(c * 100, "x")

    step(jnp.float32(0.0), 0)
    step(jnp.float32(0.0), 1)
    session.flush()
    assert [(r["step"], r.get("iteration")) for r in _taps(tap_path, "x")] == [
        (0, [0]),
        (1, None),
        (2, [1]),
        (3, None),
    ]


def test_jvp_and_linearize_of_a_scan_with_a_carry_without_tangent(session, tap_path):
    """jvp/linearize bind the scan again with carry groups JAX nests and
    filters (a primal carry whose tangent is symbolically zero, an int
    counter of the user's own): the counter is added beside them, and every
    forward iteration is still told apart."""

    def f(x):
        def body(carry, w):
            h, k = carry
            h = jnp.tanh(h * w)
            pmaptap.tap(jnp.sum(h), "jv")
            return (h, k + 1), k

        (h, _), ks = lax.scan(body, (x, jnp.int32(0)), jnp.arange(1.0, 4.0))
        return h.sum(), ks

    ones = jnp.ones(2)
    primal, tangent = jax.jit(lambda x, t: jax.jvp(f, (x,), (t,)))(ones, ones)
    assert primal[1].tolist() == [0, 1, 2]
    y, f_jvp = jax.linearize(lambda x: f(x)[0], ones)
    jax.jit(f_jvp)(ones)
    session.flush()
    recs = _taps(tap_path, "jv")
    # The eager linearize runs the forward scan: a call of its own.
    assert [(r["step"], r["iteration"]) for r in recs] == [
        (s, [k]) for s in range(2) for k in range(3)
    ]
