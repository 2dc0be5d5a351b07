"""pmaptap.host_callback behaves like the removed jax.experimental.host_callback
where migrating code depends on it (issue 18): program order of taps, JAX's
jaxpr checker, eager ``call`` without recompiling, unbatched leaves under
vmap, taps replayed under ``jax.checkpoint``, ``jit`` around ``pmap``, and the
old error messages. Each test names the point of the issue it pins."""

from __future__ import annotations

import functools
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from pmaptap import host_callback as hcb

pytestmark = pytest.mark.usefixtures("hcb_drained")


def _recorder(log: list, label: str):
    return lambda arg, transforms: log.append(label)


# ------------------------------------------------------------ 1. program order
def test_taps_run_in_program_order_in_loops_and_conds(checks):
    """A tap whose returned value feeds the next one runs first. Without the
    data link XLA ran "B" (cheap input) before "A" (input behind a matmul)
    and the tap in the cond branch after the one that follows the cond."""
    seen: list[str] = []

    def f(x, big):
        heavy = (big @ big @ big).sum()
        y = hcb.id_tap(_recorder(seen, "A"), heavy, result=x)
        z = hcb.id_tap(_recorder(seen, "B"), y + 1)

        def body(c):
            i, v = c
            w = hcb.id_tap(_recorder(seen, "w_b_1"), (big @ big).sum(), result=v)
            w = jax.lax.cond(
                i % 2 == 0, lambda w: hcb.id_tap(_recorder(seen, "w_b_t"), w), lambda w: w, w
            )
            return i + 1, hcb.id_tap(_recorder(seen, "w_b_2"), w * 2)

        return jax.lax.while_loop(lambda c: c[0] < 3, body, (0, z))

    i, v = jax.jit(f)(1.0, jnp.ones((400, 400)))
    hcb.barrier_wait()
    assert (int(i), float(v)) == (3, 16.0)
    assert seen == [
        "A",
        "B",
        "w_b_1",
        "w_b_t",
        "w_b_2",
        "w_b_1",
        "w_b_2",
        "w_b_1",
        "w_b_t",
        "w_b_2",
    ]


def test_old_while_cond_example_prints_in_order(checks):
    s = io.StringIO()
    pr = functools.partial(hcb.id_print, output_stream=s)

    def func(x):
        x2 = pr(pr(x, where="1") + 1, where="2")

        def body(x):
            x3 = pr(x, where="w_b_1")
            x4 = jax.lax.cond(
                x % 2 == 0,
                lambda x: pr(x, where="w_b_t"),
                lambda x: pr(-1, where="w_b_f", result=x),
                x3,
            )
            return pr(x4 + 1, where="w_b_2")

        return pr(jax.lax.while_loop(lambda x: x <= 3, body, x2), where="end")

    assert int(jax.jit(func)(1)) == 4
    hcb.barrier_wait()
    assert s.getvalue().split("\n")[::2] == [
        "where: 1",
        "where: 2",
        "where: w_b_1",
        "where: w_b_t",
        "where: w_b_2",
        "where: w_b_1",
        "where: w_b_f",
        "where: w_b_2",
        "where: end",
        "",
    ]


def test_tied_result_is_an_identity_for_values_and_gradients(checks):
    vals = {
        "f": jnp.array([-0.0, np.nan, 1.5], jnp.float32),
        "i": jnp.array([-3, 7], jnp.int8),
        "b": jnp.array([True, False]),
        "c": jnp.array([1 - 2j], jnp.complex64),
        "e": jnp.zeros((0,)),
    }
    out = jax.jit(lambda v: hcb.id_tap(lambda a, t: None, v))(vals)
    for k, v in vals.items():
        assert out[k].dtype == v.dtype
        np.testing.assert_array_equal(
            np.asarray(out[k]).view(np.uint8), np.asarray(v).view(np.uint8)
        )
    g = jax.grad(lambda x: (hcb.id_tap(lambda a, t: None, x * 2) ** 2).sum())(jnp.arange(3.0))
    np.testing.assert_allclose(g, 8 * np.arange(3.0))


# ------------------------------------------------------------ 2. jax_enable_checks
def test_taps_and_calls_pass_jax_checks_in_every_transformation(checks):
    shape = jax.ShapeDtypeStruct((), jnp.float32)
    got: list[float] = []

    def tap(v):
        return hcb.id_tap(lambda a, t: got.append(np.asarray(a).sum()), v)

    def call(v):
        return hcb.call(np.sin, v, result_shape=jax.ShapeDtypeStruct(v.shape, v.dtype))

    cases = {
        "call jit+cond": lambda: jax.jit(
            lambda x: jax.lax.cond(
                x > 0, lambda x: hcb.call(np.sin, x, result_shape=shape), lambda x: x, x
            )
        )(1.0),
        "call jit+scan": lambda: jax.jit(
            lambda x: jax.lax.scan(lambda c, _: (call(c), None), x, None, length=3)[0]
        )(1.0),
        "call pmap": lambda: jax.pmap(call)(jnp.ones(8)),
        "call vmap": lambda: jax.vmap(call)(jnp.ones(3)),
        "call custom_vjp": lambda: jax.grad(_sin_with_host_vjp)(1.0),
        "tap jit+cond": lambda: jax.jit(lambda x: jax.lax.cond(x > 0, tap, lambda x: x, x))(1.0),
        "tap jit+scan": lambda: jax.jit(
            lambda x: jax.lax.scan(lambda c, _: (tap(c) + 1, None), x, None, length=3)[0]
        )(1.0),
        "tap while": lambda: jax.jit(
            lambda x: jax.lax.while_loop(lambda x: tap(x) < 3, lambda x: tap(x) + 1, x)
        )(0.0),
        "tap pmap": lambda: jax.pmap(tap)(jnp.ones(8)),
        "tap vmap": lambda: jax.vmap(tap)(jnp.ones(3)),
        "tap grad": lambda: jax.grad(lambda x: tap(x) * 2)(1.0),
        "tap remat": lambda: jax.grad(jax.checkpoint(lambda x: tap(x) * 2))(1.0),
        "tap shard_map": lambda: jax.jit(
            jax.shard_map(
                tap, mesh=Mesh(np.array(jax.devices()), ("d",)), in_specs=P("d"), out_specs=P("d")
            )
        )(jnp.ones(8)),
    }
    for name, run in cases.items():
        try:
            jax.block_until_ready(run())
        except Exception as e:  # noqa: BLE001 - re-raised with the case name
            raise AssertionError(f"{name} failed under jax_enable_checks: {e}") from e
    hcb.barrier_wait()
    assert len(got) > 20


@jax.custom_vjp
def _sin_with_host_vjp(x):
    return hcb.call(np.sin, x, result_shape=x)


def _fwd(x):
    return _sin_with_host_vjp(x), x


def _bwd(x, ct):
    return (ct * hcb.call(np.cos, x, result_shape=x),)


_sin_with_host_vjp.defvjp(_fwd, _bwd)


# ------------------------------------------------------------ 4. eager call
def test_eager_call_compiles_nothing_per_call():
    compiles: list[str] = []

    def listen(event, duration, **kw):
        if "backend_compile" in event:
            compiles.append(event)

    x = jnp.arange(3.0)
    shape = jax.ShapeDtypeStruct((3,), jnp.float32)
    hcb.call(np.sin, x, result_shape=shape)  # warm: device_put etc.
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        outs = [hcb.call(np.sin, x, result_shape=shape) for _ in range(5)]
        during_calls = list(compiles)
        jax.jit(lambda v: v * 3.25 + 0.5)(x)  # the listener sees compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert during_calls == [] and compiles
    for o in outs:
        assert isinstance(o, jax.Array)
        np.testing.assert_allclose(o, np.sin(np.arange(3.0)), rtol=1e-6)


def test_eager_call_result_lives_where_the_argument_did():
    dev = jax.devices()[3]
    out = hcb.call(
        lambda v: v * 2,
        jax.device_put(jnp.ones(2), dev),
        result_shape=jax.ShapeDtypeStruct((2,), jnp.float32),
    )
    assert out.devices() == {dev}
    seen = []
    hcb.call(lambda v, device: seen.append(device), jax.device_put(1.0, dev), call_with_device=True)
    assert seen == [dev]


# ------------------------------------------------------------ 7. unbatched leaves
def test_unbatched_leaves_arrive_unchanged_with_batch_dim_none(checks):
    got = []

    def host(arg, transforms):
        got.append((jax.tree_util.tree_map(np.shape, arg), transforms))

    a, b = jnp.float32(1), jnp.arange(6.0).reshape(2, 3)
    jax.vmap(lambda x, y: hcb.id_tap(host, (x, y)), in_axes=(None, 0))(a, b)
    jax.vmap(jax.vmap(lambda x, y: hcb.id_tap(host, (x, y)), in_axes=(None, 0)), in_axes=(0, None))(
        jnp.arange(4.0), b[0]
    )
    jax.vmap(lambda y: hcb.id_tap(host, y), in_axes=1)(b)
    hcb.barrier_wait()
    assert got == [
        (((), (2, 3)), (("batch", {"batch_dims": (None, 0)}),)),
        # innermost vmap first, as the old module listed them
        (
            ((4,), (3,)),
            (("batch", {"batch_dims": (None, 0)}), ("batch", {"batch_dims": (0, None)})),
        ),
        ((3, 2), (("batch", {"batch_dims": (0,)}),)),  # batch axis moved to 0
    ]


# ------------------------------------------------------------ 3. taps of tangents
def _scan_of_custom_jvp(s: io.StringIO):
    """The old module's test_tap_scan_custom_jvp: a custom_jvp rule that
    prints its tangent, summed by a scan."""

    @jax.custom_jvp
    def f(x):
        return x * hcb.id_print(x, output_stream=s, what="x")

    @f.defjvp
    def f_jvp(primals, tangents):
        (x,), (x_dot,) = primals, tangents
        return f(x), 3.0 * x * hcb.id_print(x_dot, output_stream=s, what="x_dot")

    def g(x):
        return jax.lax.scan(lambda c, v: (c + f(v), 0.0), np.zeros(x.shape[1:]), x)[0]

    return f, g


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_tangent_tap_in_custom_jvp_rule_prints_the_cotangent_under_grad(checks, jit):
    """Reverse mode taps the cotangent flowing into the tapped tangent
    (3 * x * 1 = 2.1 here), with transforms ['transpose'], word for word as
    the old module printed it."""
    s = io.StringIO()
    _, g = _scan_of_custom_jvp(s)
    grad = jax.jit(jax.grad(g)) if jit else jax.grad(g)
    np.testing.assert_allclose(grad(np.full((2,), 0.7, np.float32)), [2.1, 2.1], rtol=1e-6)
    hcb.barrier_wait()
    assert s.getvalue() == (
        "what: x\n0.7\nwhat: x\n0.7\n"
        "transforms: ['transpose'] what: x_dot\n2.1\n"
        "transforms: ['transpose'] what: x_dot\n2.1\n"
    )


def test_tangent_tap_cotangent_under_vjp_vmap_pmap_and_its_transforms(checks):
    seen = []

    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    @f.defjvp
    def f_jvp(primals, tangents):
        (x,), (dx,) = primals, tangents
        dx = hcb.id_tap(lambda v, t: seen.append((np.asarray(v).tolist(), t)), dx)
        return jnp.sin(x), jnp.cos(x) * dx

    _, pullback = jax.vjp(lambda x: 5.0 * f(x), 0.25)
    assert float(pullback(2.0)[0]) == pytest.approx(10.0 * np.cos(0.25))
    hcb.barrier_wait()
    # the cotangent of dx: cos(x) * (5 * 2)
    assert seen[0][0] == pytest.approx(10.0 * np.cos(0.25))
    assert seen[0][1] == (("transpose", {}),)
    seen.clear()
    xs = jnp.array([0.5, 1.0])
    np.testing.assert_allclose(jax.vmap(jax.grad(f))(xs), np.cos(xs), rtol=1e-6)
    hcb.barrier_wait()
    ((value, transforms),) = seen
    np.testing.assert_allclose(value, np.cos(xs), rtol=1e-6)
    assert transforms == (("transpose", {}), ("batch", {"batch_dims": (0,)}))
    seen.clear()
    np.testing.assert_allclose(jax.pmap(jax.grad(f))(xs), np.cos(xs), rtol=1e-6)
    hcb.barrier_wait()  # under pmap: once per device, each its own cotangent
    assert sorted(v for v, _ in seen) == pytest.approx(sorted(np.cos([0.5, 1.0])))
    assert [t for _, t in seen] == [(("transpose", {}),)] * 2


def test_tangent_tap_under_jvp_and_linearize_prints_the_tangent(checks):
    """Forward mode: the tangent itself, no transforms, as the old module's
    documented print_tangents example printed ("what: tangents ( 0.1 0.6 )")."""
    s = io.StringIO()

    @jax.custom_jvp
    def print_tangents(arg):
        return None

    @print_tangents.defjvp
    def print_tangents_jvp(primals, tangents):
        (arg_dot,) = tangents
        hcb.id_print(arg_dot, what="tangents", output_stream=s)
        return primals, tangents

    def power3_with_tangents(x):
        y = x * x
        hcb.id_print((x, y), what="x,x^2", output_stream=s)
        print_tangents((x, y))
        return y * x

    _, t = jax.jvp(power3_with_tangents, (3.0,), (0.1,))
    hcb.barrier_wait()
    assert float(t) == pytest.approx(2.7)
    assert s.getvalue() == "what: x,x^2\n( 3. 9. )\nwhat: tangents\n( 0.1 0.6 )\n"
    s.truncate(0)
    s.seek(0)
    _, g = _scan_of_custom_jvp(s)
    _, lin = jax.linearize(g, np.full((2,), 0.7, np.float32))
    hcb.barrier_wait()
    assert s.getvalue() == "what: x\n0.7\nwhat: x\n0.7\n"  # primals while linearizing
    s.truncate(0)
    s.seek(0)
    assert float(lin(np.full((2,), 0.5, np.float32))) == pytest.approx(2 * 3 * 0.7 * 0.5)
    hcb.barrier_wait()
    assert s.getvalue() == "what: x_dot\n0.5\nwhat: x_dot\n0.5\n"  # then the tangents


# ------------------------------------------------------------ 8. remat
def test_checkpoint_replays_primal_taps_like_the_old_module(checks):
    s = io.StringIO()

    def power3(x):
        y = x * x
        hcb.id_print((x, y), what="x,x^2", output_stream=s)
        return y * x

    g = jax.grad(lambda x: power3(jax.checkpoint(power3)(x)))(3.0)
    hcb.barrier_wait()
    assert float(g) == pytest.approx(9 * 3.0**8)
    # inner primal, outer primal, inner again when rematerialized
    assert s.getvalue() == (
        "what: x,x^2\n( 3. 9. )\nwhat: x,x^2\n( 27. 729. )\nwhat: x,x^2\n( 3. 9. )\n"
    )


# ------------------------------------------------------------ 6. jit around pmap
def test_jit_around_pmap_taps_once_in_order(checks):
    seen = []

    def rec(label):
        return lambda a, t: seen.append((label, np.asarray(a).tolist()))

    def f(x):
        y = hcb.id_tap(rec("outer"), x * 2)
        z = jax.pmap(lambda v: hcb.id_tap(rec("inner"), v + 1))(y)
        return hcb.id_tap(rec("after"), z.sum())

    assert float(jax.jit(f)(jnp.arange(4.0))) == 16.0
    hcb.barrier_wait()
    assert seen[0] == ("outer", [0.0, 2.0, 4.0, 6.0])
    assert sorted(seen[1:5]) == [("inner", v) for v in (1.0, 3.0, 5.0, 7.0)]
    assert seen[5:] == [("after", 16.0)]


# ------------------------------------------------------------ 9. error messages
def test_callback_exception_names_the_last_failing_tap():
    def first_bad(arg, transforms):
        raise ValueError("first")

    def second_bad(arg, transforms):
        raise KeyError("second")

    jax.jit(lambda x: hcb.id_tap(second_bad, hcb.id_tap(first_bad, x)))(1.0)
    with pytest.raises(hcb.CallbackException) as info:
        hcb.barrier_wait()
    msg = str(info.value)
    assert msg.startswith("There were exceptions during callback processing. Last one was: ")
    assert "second_bad: KeyError: 'second'" in msg.splitlines()[0]
    assert "first_bad" in msg and "ValueError: first" in msg
    assert isinstance(info.value.__cause__, ValueError)


@pytest.mark.parametrize(
    "kwarg,replacement",
    [
        ("what", "hcb.id_print(x, what=...)"),
        ("output_stream", "id_print"),
        ("callback_flavor", "delete the argument"),
        ("result_shape", "hcb.call"),
        ("step", "functools.partial(tap_func, step=...)"),
    ],
)
def test_removed_id_tap_keywords_name_their_replacement(kwarg, replacement):
    with pytest.raises(TypeError) as info:
        hcb.id_tap(lambda a, t: None, 1.0, **{kwarg: 1})
    assert f"removed keyword argument {kwarg!r}" in str(info.value)
    assert replacement in str(info.value)


def test_bad_result_shape_is_a_value_error_naming_expected_and_received():
    x = jnp.ones(2, jnp.float32)
    with pytest.raises(
        ValueError,
        match=r"returned int32\[2\] but result_shape "
        r"expects float32\[3\]",
    ):
        hcb.call(
            lambda a: np.ones(2, np.int32), x, result_shape=jax.ShapeDtypeStruct((3,), jnp.float32)
        )
    with pytest.raises(
        jax.errors.JaxRuntimeError,
        match=r"ValueError.*returned float32\[2\] but result_shape "
        r"expects float32\[3\]",
    ):
        jax.jit(
            lambda v: hcb.call(lambda a: a, v, result_shape=jax.ShapeDtypeStruct((3,), jnp.float32))
        )(x).block_until_ready()
