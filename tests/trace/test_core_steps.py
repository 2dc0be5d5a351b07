"""Steps (automatic and explicit), `every`, control flow, vmap and grad."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pmaptap
from conftest import BAD_TAP_ARGS, record_dict

pytestmark = pytest.mark.usefixtures("transport")


def _named(recs, name):
    return [r for r in recs if r["name"] == name]


def test_automatic_steps_count_executions_per_device(session, tap_path):
    f = jax.pmap(lambda v: pmaptap.tap(v, "x", dedup="per_device"))
    for _ in range(4):
        f(jnp.arange(8.0))
    session.flush()
    recs = _named(pmaptap.read(tap_path), "x")
    for d in range(8):
        assert sorted(r["step"] for r in recs if r["device"] == d) == [0, 1, 2, 3]


def test_scan_and_fori_loop_iterations_are_iterations_of_one_step(session, tap_path):
    @jax.jit
    def f(xs):
        def body(c, x):
            pmaptap.tap(x, "scan")
            return c + x, None

        c, _ = lax.scan(body, 0.0, xs)

        def fbody(i, acc):
            pmaptap.tap(acc, "fori", step=i)
            return acc + 1.0

        return lax.fori_loop(0, 4, fbody, c)

    f(jnp.arange(5.0))
    session.flush()
    recs = pmaptap.read(tap_path)
    # Automatic steps count calls of the step, not iterations (issue 57).
    assert [(r["step"], r["iteration"], r["value"]) for r in _named(recs, "scan")] == [
        (0, [i], float(i)) for i in range(5)
    ]
    assert [(r["step"], r["iteration"], r["value"]) for r in _named(recs, "fori")] == [
        (i, [i], 10.0 + i) for i in range(4)
    ]


def test_while_loop_and_cond(session, tap_path):
    def body(c):
        i, x = c
        pmaptap.tap(x, "w", step=i)
        return i + 1, x * 2

    jax.jit(lambda x: lax.while_loop(lambda c: c[0] < 3, body, (0, x)))(jnp.float32(1.0))
    jax.jit(lambda p, x: lax.cond(p, lambda: pmaptap.tap(x, "c"), lambda: x))(True, 5.0)
    jax.jit(lambda p, x: lax.cond(p, lambda: pmaptap.tap(x, "c"), lambda: x))(False, 6.0)
    session.flush()
    recs = pmaptap.read(tap_path)
    assert [(r["step"], r["value"]) for r in _named(recs, "w")] == [(0, 1.0), (1, 2.0), (2, 4.0)]
    assert [r["value"] for r in _named(recs, "c")] == [5.0]


@pytest.mark.callback_only("counts host callbacks; the output transport has none")
def test_every_with_traced_step_skips_on_device(session, tap_path, spy_deliveries):
    calls = spy_deliveries()

    @jax.jit
    def f(xs):
        def body(c, i):
            pmaptap.tap(i * 10, "e", step=i, every=3)
            return c, None

        lax.scan(body, 0, xs)

    f(jnp.arange(10))
    session.flush()
    recs = _named(pmaptap.read(tap_path), "e")
    assert [r["step"] for r in recs] == [0, 3, 6, 9]
    assert [r["value"] for r in recs] == [0, 30, 60, 90]
    assert calls.count("e") == 4, "skipped steps must not reach the host"


def test_every_with_python_step_and_automatic_step(session, tap_path):
    for s in range(6):
        jax.jit(lambda x, s=s: pmaptap.tap(x, "py", step=s, every=2))(jnp.float32(s))
    f = jax.jit(lambda x: pmaptap.tap(x, "auto", every=4))
    for s in range(9):
        f(jnp.float32(s))
    session.flush()
    recs = pmaptap.read(tap_path)
    assert [r["step"] for r in _named(recs, "py")] == [0, 2, 4]
    assert [(r["step"], r["value"]) for r in _named(recs, "auto")] == [(0, 0.0), (4, 4.0), (8, 8.0)]


_STEPS_DIFFER = """
    import json, jax, jax.numpy as jnp, pmaptap
    n = jax.device_count()

    def body(x, step):
        pmaptap.tap(x, "rep", step=step, every=2, dedup="replicated")
        pmaptap.tap(x * jax.lax.axis_index("i"), "pd", step=step, every=2, dedup="per_device")
        with pmaptap.group():
            pmaptap.tap(x, "g1", step=step, every=2)
            pmaptap.tap(x + 1, "g2", step=step, every=2)
        pmaptap.fingerprint(x, "fp", step=step, every=2)
        return x + 1

    def alone(x, step):
        pmaptap.tap(x.sum(), "alone", step=step, every=2, dedup="replicated")
        return x

    with pmaptap.Session(PATH):
        f, g = jax.pmap(body, axis_name="i"), jax.pmap(alone, axis_name="i")
        for s in range(4):
            steps = jnp.arange(n) + s  # device d is at step s + d
            f(jnp.ones((n, 3)), steps).block_until_ready()
            g(jnp.ones((n, 3)), steps).block_until_ready()
    out = {}
    for r in pmaptap.read(PATH):
        out.setdefault(r["name"], []).append([r["step"], r.get("device")])
    print(json.dumps(out))
"""


@pytest.mark.callback_only("its steps run in a subprocess: the transport fixture cannot reach them")
def test_every_with_steps_that_differ_between_devices_under_pmap(tmp_path):
    # The `every` cond guards a collective (the gather to the leader, the
    # fingerprints' all-gather): decided per device, devices at different
    # steps took different branches and XLA aborted after ~60 s in its
    # rendezvous. It is decided on the smallest step of the mapped axes,
    # alike on every device: calls s = 0 and 2 (device 0 at step s) record,
    # 1 and 3 skip. In a fresh process with a timeout: a regression fails
    # here instead of aborting the test run.
    import json

    from conftest import run_python

    path = str(tmp_path / "t.jsonl")
    proc = run_python(_STEPS_DIFFER.replace("PATH", repr(path)), timeout=45)
    recs = json.loads(proc.stdout.strip().splitlines()[-1])
    # Each record carries its own device's step: device d recorded s + d.
    # (A fingerprint compares every device's copy in one record: its step
    # is the leader's, device 0's.)
    assert sorted(step for step, _ in recs["fp"]) == [0, 2], recs["fp"]
    for name in ("rep", "g1", "g2", "alone"):
        assert {step for step, _ in recs[name]} == set(range(10)), (name, recs[name])
    # one record per device per recorded call
    assert sorted(map(tuple, recs["pd"])) == sorted((s + d, d) for s in (0, 2) for d in range(8))


def test_every_adds_no_collective_when_the_step_is_the_same_everywhere():
    # The uniform decision costs one pmin over the mapped axes, and none
    # where the trace proves the step identical on every device (here a
    # pmax result; a loop counter or a constant likewise).
    def pmins(step_fn):
        def body(x, step):
            pmaptap.tap(x, "e", step=step_fn(step), every=2, dedup="replicated")
            return x

        jaxpr = jax.make_jaxpr(jax.pmap(body, axis_name="i"))(jnp.ones((8, 2)), jnp.arange(8))
        return str(jaxpr).count("pmin")

    assert pmins(lambda s: s) == 1
    assert pmins(lambda s: lax.pmax(s, "i")) == 0


@pytest.mark.callback_only("no jit or pmap step: nothing a transport carries")
def test_grad_records_primal_and_gradient_unchanged(session, tap_path):
    def loss(w):
        h = pmaptap.tap(jnp.tanh(w), "h")
        return jnp.sum(h**2)

    w = jnp.array([0.1, -0.2, 0.3])
    g = jax.grad(loss)(w)
    ref = jax.grad(lambda w: jnp.sum(jnp.tanh(w) ** 2))(w)
    np.testing.assert_allclose(g, ref)
    session.flush()
    recs = _named(pmaptap.read(tap_path), "h")
    assert len(recs) == 1
    np.testing.assert_allclose(recs[0]["value"], np.tanh(w), rtol=1e-6)


def test_checkpoint_recomputation_does_not_repeat_a_tap(session, tap_path):
    def f(x):
        pmaptap.tap(x, "ck")
        return jnp.sum(jnp.sin(x))

    x = jnp.arange(3.0)
    jax.grad(jax.checkpoint(f))(x)
    jax.jit(jax.grad(jax.checkpoint(f)))(x)
    session.flush()
    recs = _named(pmaptap.read(tap_path), "ck")
    assert [r["step"] for r in recs] == [0, 1]  # one record per execution


def test_vmap_records_the_whole_batch_once_per_execution(session, tap_path):
    f = jax.jit(jax.vmap(lambda x: pmaptap.tap(x * 2, "vm")))
    f(jnp.arange(6.0).reshape(3, 2))
    f(jnp.ones((3, 2)))
    g = jax.vmap(jax.vmap(lambda x: pmaptap.tap(x, "vm2")))
    g(jnp.arange(6.0).reshape(2, 3))
    session.flush()
    recs = pmaptap.read(tap_path)
    vm = _named(recs, "vm")
    assert [r["step"] for r in vm] == [0, 1]
    assert vm[0]["batch_dims"] == 1 and vm[0]["shape"] == [3, 2]
    assert vm[0]["value"] == (np.arange(6.0).reshape(3, 2) * 2).tolist()
    vm2 = _named(recs, "vm2")
    assert len(vm2) == 1 and vm2[0]["batch_dims"] == 2
    assert vm2[0]["value"] == np.arange(6.0).reshape(2, 3).tolist()


def test_pmap_of_vmap_of_scan(session, tap_path):
    def inner(x):
        def body(c, xi):
            pmaptap.tap(xi, "deep", dedup="per_device")
            return c, None

        lax.scan(body, 0.0, x)
        return x

    jax.pmap(jax.vmap(inner))(jnp.arange(8 * 2 * 3, dtype=jnp.float32).reshape(8, 2, 3))
    session.flush()
    recs = _named(pmaptap.read(tap_path), "deep")
    # 8 devices x 3 scan steps, each holding the vmapped batch of 2
    assert len(recs) == 24
    for r in recs:
        d, s = r["coords"]["pmap"], r["iteration"][0]
        assert r["step"] == 0
        assert r["batch_dims"] == 1
        assert r["value"] == [float(d * 6 + s), float(d * 6 + 3 + s)]


def test_pytree_value(session, tap_path):
    tree = {"w": jnp.ones((2,), jnp.float32), "b": (jnp.int32(3), None), "ok": jnp.bool_(True)}
    jax.jit(lambda t: pmaptap.tap(t, "tree"))(tree)
    session.flush()
    (r,) = _named(pmaptap.read(tap_path), "tree")
    assert r["value"] == {"b": [3, None], "ok": True, "w": [1.0, 1.0]}
    assert r["dtype"] == {"b": ["int32", None], "ok": "bool", "w": "float32"}
    assert r["shape"] == {"b": [[], None], "ok": [], "w": [2]}


def test_tap_returns_its_input_unchanged():
    x = {"a": jnp.arange(3.0)}
    assert pmaptap.tap(x, "same") is x
    y = jax.jit(lambda v: pmaptap.tap(v, "same") + 1)(jnp.float32(1))
    assert float(y) == 2.0
    pmaptap.flush()


@pytest.mark.parametrize("kwargs, exc, text", BAD_TAP_ARGS)
def test_bad_arguments_raise_at_trace_time(kwargs, exc, text):
    kwargs = dict(kwargs)  # the table is shared: do not mutate it
    name = kwargs.pop("name")
    with pytest.raises(exc, match=text):
        jax.jit(lambda v: pmaptap.tap(v, name, **kwargs))(jnp.ones(2))


def test_non_array_leaf_is_a_clear_type_error():
    with pytest.raises(TypeError, match=r"\['label'\] is a str"):
        pmaptap.tap({"label": "hello", "x": jnp.ones(1)}, "bad")


def test_one_automatic_counter_outside_any_mapping(session, tap_path):
    pmaptap.tap(jnp.float32(1), "e")  # eager, on a device
    jax.jit(lambda v: pmaptap.tap(v, "e"))(jnp.float32(1))
    jax.jit(lambda v: pmaptap.tap(v, "e"))(jnp.float32(1))
    session.flush()
    assert [r["step"] for r in _named(pmaptap.read(tap_path), "e")] == [0, 1, 2]


def test_rerunning_explicit_steps_in_one_process_keeps_every_record(session, tap_path):
    f = jax.jit(lambda v, s: pmaptap.tap(v, "again", step=s, dedup="replicated"))
    for _ in range(2):  # e.g. two evaluation passes
        for s in range(3):
            f(jnp.float32(7), s)
    session.flush()
    recs = _named(pmaptap.read(tap_path), "again")
    assert [r["step"] for r in recs] == [0, 1, 2, 0, 1, 2]
    assert not any(r.get("divergent") for r in recs)


# ------------------------------------------------------------ big and bad steps

_BIG_STEPS = """
    import json, sys, tempfile
    import jax
    jax.config.update("jax_enable_x64", sys.argv[1] == "on") if len(sys.argv) > 1 else None
    import jax.numpy as jnp, pmaptap
    path = tempfile.mktemp(suffix=".jsonl")
    with pmaptap.Session(path, run="big"):
        for s in (2**31 + 5, 2**63 - 1):
            pmaptap.tap(jnp.float32(1), "eager", step=s)
            jax.jit(lambda v: pmaptap.tap(v, "jit", step=s))(jnp.float32(2))
            jax.pmap(lambda v: pmaptap.tap(v, "pmap", step=s, dedup="per_device"))(
                jnp.arange(8.0))
            def grouped(v):
                with pmaptap.group():
                    pmaptap.tap(v, "g1", step=s, dedup="per_device")
                    pmaptap.tap(v * 0, "g2", step=s, dedup="replicated")
                return v
            jax.pmap(grouped)(jnp.arange(8.0))
            pmaptap.tap_grad(jnp.float32(3), "tg", step=s)   # traced: no backward
            jax.grad(lambda v: pmaptap.tap_grad(v, "tg", step=s) * 2)(1.0)
    print(json.dumps([(r["name"], r["step"], r.get("pass", "forward"))
                      for r in pmaptap.read(path)]))
"""


@pytest.mark.parametrize("x64", ["off", "on"])
@pytest.mark.callback_only("its steps run in a subprocess: the transport fixture cannot reach them")
def test_python_int_steps_up_to_int64_max_eager_and_jit(x64):
    import json

    from conftest import run_python

    out = run_python(
        f"import sys; sys.argv.append({x64!r})\n" + __import__("textwrap").dedent(_BIG_STEPS)
    ).stdout
    recs = json.loads(out.strip().splitlines()[-1])
    for s in (2**31 + 5, 2**63 - 1):
        got = sorted(n for n, step, _ in recs if step == s)
        assert got == sorted(["eager", "jit"] + ["pmap"] * 8 + ["g1"] * 8 + ["g2", "tg"]), (s, got)
        assert [p for n, step, p in recs if n == "tg" and step == s] == ["backward"]
    assert {step for _, step, _ in recs} == {2**31 + 5, 2**63 - 1}


@pytest.mark.parametrize("bad", [-1, 2**63, 2**64 + 3, np.uint64(2**64 - 1)])
def test_out_of_range_python_steps_are_refused_at_trace_time(session, tap_path, bad):
    with pytest.raises(
        ValueError,
        match=r"pmaptap.tap\('x'\): step must be >= 0 "
        r"and at most 2\*\*63-1",
    ):
        pmaptap.tap(1.0, "x", step=bad)
    with pytest.raises(ValueError, match=r"pmaptap.tap\('x'\)"):
        jax.jit(lambda v: pmaptap.tap(v, "x", step=bad))(1.0)
    with pytest.raises(ValueError, match=r"pmaptap.tap_grad\('g'\)"):
        pmaptap.tap_grad(1.0, "g", step=bad)


def test_negative_traced_step_is_refused_counted_and_reported(session, tap_path, caplog, transport):
    f = jax.jit(lambda v, i: pmaptap.tap(v, "x", step=i))
    f(1.0, 3)
    f(2.0, -4)
    f(3.0, -5)
    jax.pmap(lambda v, i: pmaptap.tap(v, "p", step=i, dedup="per_device"), in_axes=(0, None))(
        jnp.arange(8.0), -1
    )
    import logging

    with caplog.at_level(logging.WARNING, logger="pmaptap"):
        session.flush()  # reported (logged), not raised
    texts = sorted(
        r.getMessage()
        for r in caplog.records
        if r.name == "pmaptap" and "refused" in r.getMessage()
    )
    assert len(texts) == 2
    # One gathered callback for the 8 devices; as outputs, one payload per device.
    copies = 1 if transport == "callback" else 8
    assert f"refused {copies} callback(s) of tap 'p': traced step -1" in texts[int(copies > 2)]
    assert "refused 2 callback(s) of tap 'x': traced step -4" in texts[int(copies <= 2)]
    recs = pmaptap.read(tap_path)
    assert [(r["name"], r["step"], r["value"]) for r in recs if r["kind"] != "meta"] == [
        ("x", 3, 1.0)
    ]
    refused = {r["tap"]: r for r in recs if r["name"] == "pmaptap/refused"}
    assert refused["x"]["value"] == 2 and refused["x"]["example_step"] == -4
    assert refused["p"]["value"] >= 1 and refused["p"]["example_step"] == -1
    from pmaptap.tapfile.analyze.validate import validate_file

    assert validate_file(tap_path).ok  # what was written is valid
    session.flush()  # reported once, not again
    assert len([r for r in pmaptap.read(tap_path) if r["name"] == "pmaptap/refused"]) == 2


def test_validate_flags_steps_outside_int64_range(tmp_path):
    import json

    from pmaptap.tapfile.analyze.validate import validate_file

    good = record_dict()
    p = tmp_path / "f.jsonl"
    p.write_text("".join(json.dumps(dict(good, step=s)) + "\n" for s in (0, -3, 2**63 - 1, 2**63)))
    report = validate_file(p)
    assert [(line, "step" in why) for line, why in report.problems] == [(2, True), (4, True)]
