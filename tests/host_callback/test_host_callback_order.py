"""Issue 28: every id_tap / id_print / call of one traced computation runs on
the host in program order per device, with or without a data path between
them, and the last behaviours of the old module that migrating code meets
(typed PRNG keys, call inside custom_vjp, the old error words). Before the
fix XLA ran independent taps in its own order (eight taps arrived as
1, 7, 6, 5, 4, 3, 2, 0)."""

from __future__ import annotations

import functools
import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pmaptap
from conftest import job_failed, prefixed, python_cmd, run_launch
from pmaptap import host_callback as hcb

pytestmark = pytest.mark.usefixtures("hcb_drained")

N = 8


def _eight_taps(x, seen: list):
    """Eight taps with no data path between them (results unused), each of
    a different value so XLA is free to schedule them as it likes (on 1000
    elements it ran them as 0, 7, 6, 5, 4, 3, 2, 1)."""
    for i in range(N):
        hcb.id_tap(lambda a, t, i=i: seen.append(i), jnp.sin(x) + i)
    return x + 1


def test_eight_untied_taps_in_jit_run_in_program_order(checks):
    seen: list[int] = []
    f = jax.jit(lambda x: _eight_taps(x, seen))
    for _ in range(3):
        f(jnp.ones(1000))
    hcb.barrier_wait()
    assert seen == list(range(N)) * 3


def test_id_print_loss_gnorm_w_print_in_program_order():
    """The issue's train step: nothing ties the three prints together."""
    out = io.StringIO()
    pr = functools.partial(hcb.id_print, output_stream=out)

    @jax.jit
    def step(w, x):
        loss, g = jax.value_and_grad(lambda w: jnp.sum((x @ w) ** 2))(w)
        pr(loss, what="loss")
        pr(jnp.sqrt(jnp.sum(g**2)), what="gnorm")
        pr(w, what="w")
        return w - 0.01 * g

    w = jnp.ones((3, 2))
    for _ in range(2):
        w = step(w, jnp.ones((4, 3)))
    hcb.barrier_wait()
    whats = [line for line in out.getvalue().splitlines() if line.startswith("what:")]
    assert whats == ["what: loss", "what: gnorm", "what: w"] * 2


def test_module_docstring_examples_run_in_program_order():
    """The old module docstring's "A few examples", in one jitted function."""
    seen = []

    def host_func(arg, transforms, *, device=None, what=None):
        seen.append((what, jax.tree.map(np.ndim, arg), device is not None))

    @jax.jit
    def f(x, y):
        hcb.id_tap(host_func, 2 * x)
        hcb.id_tap(host_func, (2 * x, 3 * x))
        hcb.id_tap(host_func, 2 * x, tap_with_device=True)
        hcb.id_tap(functools.partial(host_func, what="activation"), 2 * x)
        hcb.id_tap(lambda tap, transforms: host_func(tap, (), what="data"), dict(x=x, y=y))
        return x

    f(jnp.ones(3), jnp.zeros(()))
    hcb.barrier_wait()
    assert seen == [
        (None, 1, False),
        (None, (1, 1), False),
        (None, 1, True),
        ("activation", 1, False),
        ("data", {"x": 1, "y": 0}, False),
    ]


def test_taps_and_calls_in_scan_while_cond_and_nested_jit_in_program_order(checks):
    seen: list[str] = []

    def tap(label):
        return lambda a, t: seen.append(label)

    def host_double(v):
        seen.append("call")
        return 2 * v

    @jax.jit
    def inner(x):
        hcb.id_tap(tap("inner.0"), x)
        hcb.id_tap(tap("inner.1"), x + 1)
        return x

    def body(c, v):
        hcb.id_tap(tap("scan.0"), v)
        hcb.call(host_double, v, result_shape=v)
        hcb.id_tap(tap("scan.1"), c)
        return c + v, None

    def even(i):
        hcb.id_tap(tap("cond"), i)

    def w_body(i):
        hcb.id_tap(tap("while"), i)
        jax.lax.cond(i % 2 == 0, even, lambda i: None, i)
        return i + 1

    @jax.jit
    def f(x):
        hcb.id_tap(tap("start"), x)
        inner(x * 3)
        c, _ = jax.lax.scan(body, 0.0, jnp.arange(2.0) + x)
        jax.lax.while_loop(lambda i: i < 3, w_body, 0)
        hcb.id_tap(tap("end"), c)
        return c

    f(1.0)
    hcb.barrier_wait()
    assert seen == [
        "start",
        "inner.0",
        "inner.1",
        *["scan.0", "call", "scan.1"] * 2,
        "while",
        "cond",
        "while",
        "while",
        "cond",
        "end",
    ]


def test_vmap_taps_run_in_program_order(checks):
    seen: list[tuple] = []

    def f(x):
        for i in range(N):
            hcb.id_tap(lambda a, t, i=i: seen.append((i, a.shape)), jnp.sin(x) + i)
        return x

    jax.jit(jax.vmap(f))(jnp.ones((5, 200)))
    jax.vmap(jax.vmap(f))(jnp.ones((2, 5, 100)))
    hcb.barrier_wait()
    assert seen == [(i, (5, 200)) for i in range(N)] + [(i, (2, 5, 100)) for i in range(N)]


def _per_device(seen: list) -> dict:
    by_dev: dict = {}
    for dev, i in seen:
        by_dev.setdefault(dev.id, []).append(i)
    return by_dev


def test_pmap_and_shard_map_taps_in_program_order_on_each_device(checks):
    seen: list = []

    def f(x):
        for i in range(N):
            hcb.id_tap(
                lambda a, t, i=i, device=None: seen.append((device, i)), x * i, tap_with_device=True
            )
        return x

    n = jax.device_count()
    jax.pmap(f)(jnp.arange(float(n)))
    hcb.barrier_wait()
    assert _per_device(seen) == {d.id: list(range(N)) for d in jax.devices()}
    seen.clear()
    mesh = Mesh(np.array(jax.devices()), ("i",))
    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("i"), out_specs=P("i")))
    g(jnp.arange(2.0 * n))
    hcb.barrier_wait()
    assert _per_device(seen) == {d.id: list(range(N)) for d in jax.devices()}


def test_untied_taps_and_a_call_around_shard_map_in_jit_in_program_order(checks):
    """A tap and a call under jit (one device runs them) before a shard_map
    body with taps, a tap after it, no data path between any of them: on the
    device that runs the outer ones, the body's tap comes between them (the
    token alone orders them). On JAX 0.12 the body's token operand pushed its
    replicated sharding back onto the outer call's token, which XLA refuses
    on a side-effecting op ("side-effect HLO cannot have a replicated
    sharding")."""
    seen: list = []

    def rec(label):
        return lambda a, t, device=None: seen.append((device.id, label))

    def record_call(a):
        seen.append((jax.devices()[0].id, "call"))
        return a

    mesh = Mesh(np.array(jax.devices()), ("i",))
    body = jax.shard_map(
        lambda v: hcb.id_tap(rec("body"), v * 3, tap_with_device=True),
        mesh=mesh,
        in_specs=P("i"),
        out_specs=P("i"),
    )

    def f(x):
        hcb.id_tap(rec("before"), x * 2, tap_with_device=True)
        hcb.call(record_call, x[0] + 1, result_shape=jax.ShapeDtypeStruct((), x.dtype))
        y = body(x)
        hcb.id_tap(rec("after"), x * 4, tap_with_device=True)
        return y

    jax.jit(f)(jnp.arange(float(jax.device_count())))
    hcb.barrier_wait()
    first = jax.devices()[0].id
    assert [label for dev, label in seen if dev == first] == ["before", "call", "body", "after"]
    assert sorted(dev for dev, label in seen if label == "body") == sorted(
        d.id for d in jax.devices()
    )


def test_taps_of_a_sharded_jit_in_program_order():
    """Plain jit over all devices (automatic sharding): the taps run once
    each, on the whole value, in program order."""
    seen: list[int] = []
    mesh = Mesh(np.array(jax.devices()), ("d",))
    x = jax.device_put(jnp.arange(8000.0), NamedSharding(mesh, P("d")))
    jax.jit(lambda x: _eight_taps(x, seen))(x)
    hcb.barrier_wait()
    assert seen == list(range(N))


def test_batched_while_condition_with_taps_keeps_its_values(checks):
    """A tap batched in a while condition is left out of the ordered chain
    (JAX 0.10 computes wrong values for a batched predicate with an ordered
    effect: [3, 3] here instead of [1, 3]); the taps still run and the body's
    stay ordered."""
    seen: list[str] = []

    def f(n):
        def cond(c):
            return hcb.id_tap(lambda a, t: seen.append("cond"), c) < n

        def body(c):
            hcb.id_tap(lambda a, t: seen.append("b0"), c)
            hcb.id_tap(lambda a, t: seen.append("b1"), c * 2)
            return c + 1

        return jax.lax.while_loop(cond, body, 0)

    out = jax.jit(jax.vmap(f))(jnp.array([1, 3]))
    hcb.barrier_wait()
    assert out.tolist() == [1, 3]
    assert seen == ["cond"] + ["b0", "b1", "cond"] * 3


def test_call_inside_custom_vjp_runs_jax_on_another_device(checks):
    """The old module's test_jax_impl: a custom_vjp whose primal and
    backward rule are host calls that run a jitted JAX function on another
    device. JAX's checker refused io_callback's effect there ("Effects not
    supported in `custom_vjp`")."""
    other = jax.devices()[1]

    def on_other_device(fn, arg):
        return hcb.call(
            lambda a: jax.jit(fn)(jax.device_put(a, other)),
            arg,
            result_shape=jax.eval_shape(fn, arg),
        )

    @jax.custom_vjp
    def f(x):
        return on_other_device(jnp.sin, x)

    def f_bwd(x, ct):
        return (on_other_device(lambda a: jnp.cos(a[0]) * a[1], (x, ct)),)

    f.defvjp(lambda x: (f(x), x), f_bwd)
    assert float(f(3.0)) == pytest.approx(np.sin(3.0))
    assert float(jax.jit(f)(3.0)) == pytest.approx(np.sin(3.0))
    assert float(jax.jit(jax.grad(f))(0.25)) == pytest.approx(np.cos(0.25))


def test_typed_prng_keys_are_tapped_as_key_data():
    seen = []
    key = jax.random.key(7)

    @jax.jit
    def f(k):
        k2 = hcb.id_tap(lambda a, t: seen.append(a), {"k": k, "n": 1})["k"]
        k3 = hcb.id_tap(lambda a, t: seen.append(a), k, result=k2)
        hcb.id_print(jax.random.split(k3, 2), what="keys", output_stream=out)
        return jax.random.normal(k3)

    out = io.StringIO()
    assert float(f(key)) == float(jax.random.normal(key))
    hcb.id_tap(lambda a, t: seen.append(a), key)  # eagerly
    hcb.barrier_wait()
    data = np.asarray(jax.random.key_data(key))
    assert seen[0]["k"].dtype == np.uint32 and seen[0]["k"].tolist() == data.tolist()
    assert [s.tolist() for s in seen[1:]] == [data.tolist()] * 2
    split = np.asarray(jax.random.key_data(jax.random.split(key, 2)))
    assert out.getvalue() == "what: keys\n" + np.array2string(split) + "\n"


def test_pmaptap_tap_of_a_typed_prng_key_records_its_key_data(session, tap_path):
    key = jax.random.key(3)
    jax.jit(lambda k: pmaptap.tap(k, "key", step=0))(key)
    session.flush()
    (rec,) = [r for r in pmaptap.read(tap_path) if r["name"] == "key"]
    assert rec["value"] == np.asarray(jax.random.key_data(key)).tolist()


def test_errors_keep_the_old_modules_words():
    with pytest.raises(TypeError, match=r"Support for \*\*kwargs in ``id_tap``") as info:
        hcb.id_tap(lambda x, t, y: None, 1, y=2)
    assert "functools.partial(tap_func, y=...)" in str(info.value)
    old = "The values must be either numeric scalars, or must have 'shape' and 'dtype' attributes"
    for bad in ("string", lambda x: x):
        with pytest.raises(ValueError, match=old) as info:
            hcb.call(lambda x: x, 3.0, result_shape=bad)
        assert "jax.ShapeDtypeStruct" in str(info.value)


def test_eager_taps_and_calls_follow_the_taps_of_dispatched_computations():
    """Program order across dispatches: a jitted step's taps, then an eager
    id_tap and call (run on the caller's thread, after waiting for the
    taps dispatched before them)."""
    seen: list[str] = []

    @jax.jit
    def step(x):
        y = x
        for _ in range(5):
            y = jnp.sin(y @ y)
        hcb.id_tap(lambda a, t: seen.append("jit"), y)
        return y

    x = jnp.ones((200, 200)) * 1e-3
    for i in range(3):
        step(x)
        hcb.id_tap(lambda a, t, i=i: seen.append(f"eager{i}"), 1.0)
        hcb.call(lambda v, i=i: seen.append(f"call{i}"), 1.0)
    hcb.barrier_wait()
    assert seen == [s for i in range(3) for s in ("jit", f"eager{i}", f"call{i}")]


_MULTI_PROCESS = """
    import json
    import jax, jax.numpy as jnp, pmaptap.distributed as dist
    from pmaptap import host_callback as hcb
    dist.initialize()
    seen = []

    def body(x):
        for i in range(4):
            hcb.id_tap(lambda a, t, i=i, device=None: seen.append((device.id, i)),
                       jnp.sin(x) + i, tap_with_device=True)
        return hcb.call(lambda v: v * 2, x, result_shape=x)

    f = jax.pmap(body, axis_name="i")
    for step in range(2):
        out = f(jnp.ones((jax.local_device_count(), 100)) * (step + 1))
    jax.jit(lambda v: hcb.id_tap(lambda a, t: seen.append(("jit", 0)), v))(1.0)
    hcb.barrier_wait()
    by = {}
    for d, i in seen:
        by.setdefault(str(d), []).append(i)
    # This process's devices' part of the result (JAX 0.9 cannot sum a
    # global array that spans processes).
    total = sum(float(s.data.sum()) for s in out.addressable_shards)
    print("SEEN", json.dumps(by), total, flush=True)
"""


def test_taps_in_program_order_in_a_multi_process_pmap():
    """JAX threads the ordered effect's token through computations of each
    process (its own code warns that this "might still be buggy in a
    multi-process SPMD scenario"): two processes of two devices each."""
    proc, _ = run_launch(2, 2, python_cmd(_MULTI_PROCESS), launcher_timeout=120)
    assert proc.returncode == 0, job_failed(proc)
    for p in (0, 1):
        (line,) = [ln for ln in prefixed(proc.stdout, p) if ln.startswith("SEEN")]
        by, total = line.split(" ", 1)[1].rsplit(" ", 1)
        devices = [str(p * 2048 + k) for k in (0, 1)]
        assert json.loads(by) == {**{d: [0, 1, 2, 3] * 2 for d in devices}, "jit": [0]}
        assert float(total) == 2 * 2 * 100 * 2.0


def test_primal_tapped_with_a_tangent_as_result_runs_once_under_grad():
    """``dx = id_tap(f, x, result=dx)`` in a custom_jvp rule: the tap sits in
    the linear part under grad (its result is a tangent); its primal value
    is tapped there once, not dropped."""
    seen = []

    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    @f.defjvp
    def f_jvp(primals, tangents):
        (x,), (dx,) = primals, tangents
        dx = hcb.id_tap(lambda a, t: seen.append((float(a), t)), x, result=dx)
        return jnp.sin(x), jnp.cos(x) * dx

    assert float(jax.grad(f)(0.5)) == pytest.approx(np.cos(0.5))
    assert float(jax.jit(jax.grad(f))(0.25)) == pytest.approx(np.cos(0.25))
    hcb.barrier_wait()
    assert seen == [(0.5, ()), (0.25, ())]
