"""pmaptap.host_callback: the old jax.experimental.host_callback API.

The first tests are the examples of the old module's documentation, adapted
only by the import. Devices report in no fixed order, so per-device results
are compared as sets / dicts keyed by device.
"""

from __future__ import annotations

import functools
import gc
import io
import threading
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pmaptap
from pmaptap import host_callback as hcb

pytestmark = pytest.mark.usefixtures("hcb_drained")


def _shard_values(out) -> dict:
    """{device: value} from a pmap output, i.e. where each result lived."""
    return {
        s.device: np.asarray(s.data).reshape(np.shape(s.data)[1:]) for s in out.addressable_shards
    }


# ------------------------------------------------------------ old doc examples
def test_import_paths():
    assert pmaptap.host_callback is hcb
    for name in (
        "id_tap",
        "id_print",
        "call",
        "barrier_wait",
        "CallbackException",
        "stop_outfeed_receiver",
    ):
        assert hasattr(hcb, name)
    hcb.stop_outfeed_receiver()  # old code may call it: waits, raises nothing


def test_doc_id_tap_under_jit_and_barrier_wait():
    # "Using barrier_wait to wait until all callbacks have executed"
    accumulator = []

    def host_log(arg, transforms):
        accumulator.append((arg, transforms))

    def device_fun(x):
        hcb.id_tap(host_log, x)
        hcb.id_tap(host_log, 2.0 * x)
        return x + 1

    f = jax.jit(device_fun)
    r1, r2 = f(1.0), f(3.0)
    hcb.barrier_wait()
    assert float(r1) == 2.0 and float(r2) == 4.0
    assert [float(a) for a, _ in accumulator] == [1.0, 2.0, 3.0, 6.0]
    assert all(t == () for _, t in accumulator)
    assert all(isinstance(a, np.ndarray) for a, _ in accumulator)


def test_doc_id_tap_pytree_and_partial():
    got = []

    def host_func(arg, transforms, what=None):
        got.append((what, jax.tree_util.tree_map(np.asarray, arg)))

    x = jnp.arange(3.0)
    out = jax.jit(lambda x: hcb.id_tap(host_func, (2 * x, 3 * x)))(x)
    jax.jit(
        lambda x: hcb.id_tap(functools.partial(host_func, what="activation"), {"x": x, "y": x + 1})
    )(x)
    hcb.barrier_wait()
    assert isinstance(out, tuple)
    np.testing.assert_array_equal(out[1], 3 * x)
    (w0, a0), (w1, a1) = got
    assert w0 is None and isinstance(a0, tuple)
    np.testing.assert_array_equal(a0[0], 2 * np.arange(3.0))
    np.testing.assert_array_equal(a0[1], 3 * np.arange(3.0))
    assert w1 == "activation" and sorted(a1) == ["x", "y"]
    np.testing.assert_array_equal(a1["y"], np.arange(3.0) + 1)


def _power3(x, stream):
    y = x * x
    # Print both 'x' and 'x^2'. Must pack as a tuple.
    hcb.id_print((x, y), what="x,x^2", output_stream=stream)
    return y * x


def test_doc_id_print_with_what():
    s = io.StringIO()
    assert float(jax.jit(_power3, static_argnums=1)(jnp.float32(3.0), s)) == 27.0
    hcb.barrier_wait()
    assert s.getvalue() == "what: x,x^2\n( 3. 9. )\n"


def test_doc_id_print_under_grad_sees_primals_and_under_vmap_the_batch():
    s = io.StringIO()
    g = jax.grad(lambda x: _power3(x, s))(3.0)
    hcb.barrier_wait()
    assert float(g) == 27.0
    assert s.getvalue() == "what: x,x^2\n( 3. 9. )\n"
    s = io.StringIO()
    jax.vmap(lambda x: _power3(x, s))(np.array([2.0, 3.0], np.float32))
    hcb.barrier_wait()
    # The old documentation prints exactly this line for this example.
    assert s.getvalue() == (
        "transforms: [('batch', {'batch_dims': (0, 0)})] what: x,x^2\n( [2. 3.] [4. 9.] )\n"
    )


def test_id_print_stdout_threshold_and_extra_kwargs(capsys):
    jax.jit(lambda x: hcb.id_print(x, what="big", threshold=5, step=7))(jnp.arange(100))
    hcb.barrier_wait()
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == "step: 7 what: big"
    assert lines[1] == np.array2string(np.arange(100), threshold=5)
    assert "..." in lines[1]


def test_doc_call_numpy_eigenvalues():
    # This function runs on the host
    def host_eig(m: np.ndarray) -> np.ndarray:
        assert isinstance(m, np.ndarray)
        ev = np.linalg.eigvals(m)
        # NumPy >= 2.5 returns complex eigenvalues whatever their imaginary
        # parts (before: real ones where all were real, as the doc expects).
        return ev.real.astype(m.dtype) if not ev.imag.any() else ev

    # This function is used in JAX
    def device_fun(m):
        # Given an input of shape (..., d, d), eig output has shape (..., d)
        return hcb.call(host_eig, m, result_shape=jax.ShapeDtypeStruct(m.shape[:-1], m.dtype))

    rng = np.random.default_rng(0)
    a = rng.normal(size=(3, 4, 4)).astype(np.float32)
    sym = a + np.swapaxes(a, -1, -2)  # real eigenvalues, float32 result
    got = jax.jit(device_fun)(sym)
    assert got.shape == (3, 4) and got.dtype == jnp.float32
    np.testing.assert_allclose(
        np.sort(np.asarray(got), -1), np.sort(np.linalg.eigvalsh(sym), -1), rtol=1e-4, atol=1e-4
    )
    # A rotation has eigenvalues +-i: result_shape names complex64.
    rot = np.array([[0.0, -1.0], [1.0, 0.0]], np.float32)
    ev = jax.jit(
        lambda m: hcb.call(
            host_eig, m, result_shape_dtypes=jax.ShapeDtypeStruct((2,), jnp.complex64)
        )
    )(rot)
    assert ev.dtype == jnp.complex64
    assert sorted(np.asarray(ev).imag.tolist()) == [-1.0, 1.0]


# ------------------------------------------------------------ devices
def test_tap_with_device_under_pmap_matches_where_values_lived():
    devs = jax.devices()[::-1]  # coordinate i runs on device 7 - i
    seen = []

    def host(arg, transforms, *, device):
        seen.append((device, np.asarray(arg).copy(), transforms))

    f = jax.pmap(lambda v: hcb.id_tap(host, v * 10, tap_with_device=True) + 0, devices=devs)
    x = jnp.arange(8 * 3, dtype=jnp.float32).reshape(8, 3)
    out = f(x)
    hcb.barrier_wait()
    where = _shard_values(out)
    assert len(seen) == 8, "one tap per device, no dedup"
    assert {d for d, _, _ in seen} == set(where) == set(jax.devices())
    for device, value, transforms in seen:
        assert isinstance(device, jax.Device)
        np.testing.assert_array_equal(value, where[device])
        assert transforms == ()
    # Not the identity mapping: the reversed device order was honoured.
    assert where[jax.devices()[7]][0] == 0.0


def test_call_with_device_under_pmap():
    devs = jax.devices()[::-1]

    def host_sin(x, *, device):
        return np.concatenate([np.sin(x), np.array([device.id], x.dtype)])

    f = jax.pmap(
        lambda x: hcb.call(
            host_sin, x, result_shape=jax.ShapeDtypeStruct((5,), x.dtype), call_with_device=True
        ),
        devices=devs,
    )
    x = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
    out = f(x)
    for device, val in _shard_values(out).items():
        assert val[4] == device.id
        i = devs.index(device)
        np.testing.assert_allclose(val[:4], np.sin(x[i]), rtol=1e-6)


def test_device_under_jit_and_eager():
    got = []

    def host(arg, transforms, *, device):
        got.append(device)

    jax.jit(lambda v: hcb.id_tap(host, v, tap_with_device=True))(jnp.ones(2))
    jax.jit(lambda v: hcb.id_tap(host, v, tap_with_device=True, device_index=2))(jnp.ones(2))
    # Outside jit the value's own device is known exactly.
    hcb.id_tap(host, jax.device_put(jnp.ones(2), jax.devices()[5]), tap_with_device=True)
    hcb.barrier_wait()
    assert got == [jax.local_devices()[0], jax.local_devices()[2], jax.devices()[5]]


# ------------------------------------------------------------ vmap
def test_vmap_transforms():
    got = []

    def host(arg, transforms):
        got.append((jax.tree_util.tree_map(np.shape, arg), transforms))

    x = jnp.arange(6.0).reshape(2, 3)
    jax.vmap(lambda v: hcb.id_tap(host, v))(x)
    jax.vmap(jax.vmap(lambda v: hcb.id_tap(host, (v, 2 * v))))(x)
    # An unbatched leaf arrives unchanged, with batch dim None (old module).
    jax.vmap(lambda v: hcb.id_tap(host, (v, jnp.float32(1))))(x[0])
    hcb.barrier_wait()
    one = ("batch", {"batch_dims": (0,)})
    two = ("batch", {"batch_dims": (0, 0)})
    assert got == [
        ((2, 3), (one,)),
        ((((2, 3)), (2, 3)), (two, two)),
        (((3,), ()), (("batch", {"batch_dims": (0, None)}),)),
    ]


def test_call_under_vmap_runs_once_per_element():
    calls = []

    def host(v):
        calls.append(v.shape)
        return v * 2

    out = jax.vmap(lambda v: hcb.call(host, v, result_shape=v))(jnp.ones((3, 2)))
    np.testing.assert_array_equal(out, 2 * np.ones((3, 2)))
    assert calls == [(2,)] * 3


# ------------------------------------------------------------ errors
def test_tap_error_raised_once_at_barrier_and_result_unchanged():
    def bad(arg, transforms):
        raise ValueError(f"boom {float(arg)}")

    def good(arg, transforms):
        seen.append(float(arg))

    seen = []
    f = jax.jit(lambda x: hcb.id_tap(bad, x) * 2 + hcb.id_tap(good, x))
    r = f(jnp.float32(1.0))
    r2 = f(jnp.float32(2.0))
    assert float(r) == 3.0 and float(r2) == 6.0  # computation unaffected
    with pytest.raises(hcb.CallbackException, match="boom 1.0") as info:
        hcb.barrier_wait("after-f")
    e = info.value
    assert isinstance(e.original, ValueError) and e.__cause__ is e.original
    assert [str(x) for x in e.errors] == ["boom 1.0", "boom 2.0"]
    assert "after-f" in str(e) and "1 more" in str(e)
    assert sorted(seen) == [1.0, 2.0]  # the good tap still ran
    hcb.barrier_wait()  # raised once only
    # The executor survived: later taps run.
    jax.jit(lambda x: hcb.id_tap(good, x))(jnp.float32(5.0))
    hcb.barrier_wait()
    assert seen[-1] == 5.0


def test_barrier_waits_for_slow_taps():
    done = []

    def slow(arg, transforms):
        time.sleep(0.05)
        done.append(float(arg))

    f = jax.jit(lambda x: hcb.id_tap(slow, x))
    for i in range(5):
        f(jnp.float32(i))
    hcb.barrier_wait()
    assert done == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_call_shape_and_dtype_mismatch_errors_name_both():
    x = jnp.ones(2, jnp.float32)
    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        jax.jit(
            lambda v: hcb.call(lambda a: a, v, result_shape=jax.ShapeDtypeStruct((3,), jnp.float32))
        )(x).block_until_ready()
    assert "returned float32[2] but result_shape expects float32[3]" in str(info.value)
    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        jax.jit(lambda v: hcb.call(lambda a: a.astype(np.int32), v, result_shape=v))(
            x
        ).block_until_ready()
    assert "returned int32[2] but result_shape expects float32[2]" in str(info.value)
    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        jax.jit(lambda v: hcb.call(lambda a: a, v, result_shape=(v, v)))(x).block_until_ready()
    assert "returned float32[2] but result_shape expects ('float32[2]', 'float32[2]')" in str(
        info.value
    )


def test_bad_arguments_are_clear_errors_at_trace_time():
    with pytest.raises(ValueError, match="result_shape.*must have `shape` and `dtype`"):
        hcb.call(lambda a: a, 1.0, result_shape="float32")
    with pytest.raises(ValueError, match="not both"):
        hcb.call(lambda a: a, 1.0, result_shape=1.0, result_shape_dtypes=1.0)
    with pytest.raises(TypeError, match="functools.partial"):
        hcb.id_tap(lambda a, t: None, 1.0, what="x")
    with pytest.raises(TypeError, match="tap_func must be callable"):
        hcb.id_tap(None, 1.0)
    with pytest.raises(ValueError, match="device_index"):
        hcb.id_tap(lambda a, t: None, 1.0, device_index=99)


def test_differentiating_through_call_says_what_to_do():
    def f(x):
        return hcb.call(np.sin, x, result_shape=x).sum()

    with pytest.raises(NotImplementedError, match="stop_gradient.*custom_vjp"):
        jax.grad(f)(jnp.ones(3))
    # The suggested fix works: no gradient flows through the host call.
    g = jax.grad(
        lambda x: hcb.call(np.sin, jax.lax.stop_gradient(x), result_shape=x).sum() + x.sum()
    )(jnp.ones(3))
    np.testing.assert_array_equal(g, np.ones(3))


# ------------------------------------------------------------ call arguments
def test_tuple_argument_rule_both_ways():
    a, b = jnp.float32(2.0), jnp.float32(5.0)
    shape = jax.ShapeDtypeStruct((), jnp.float32)

    def two(x, y):  # tutorial style: spread
        return x - y

    def whole(xy):  # old style: the tuple as one argument
        x, y = xy
        return x - y

    def optional(x, y=None):  # both bind: old style wins
        assert isinstance(x, tuple) and y is None
        return x[0] - x[1]

    def with_device(x, y, *, device):
        assert isinstance(device, jax.Device)
        return x - y

    for fn, kw in [
        (two, {}),
        (whole, {}),
        (optional, {}),
        (with_device, {"call_with_device": True}),
    ]:
        out = jax.jit(lambda a, b: hcb.call(fn, (a, b), result_shape=shape, **kw))(a, b)
        assert float(out) == -3.0, fn.__name__
    # A one-element tuple stays whole even for a one-parameter function.
    out = hcb.call(lambda t: t[0] * 2, (a,), result_shape=shape)
    assert float(out) == 4.0


def test_call_without_result_runs_even_if_unused():
    log = []
    f = jax.jit(lambda x: (hcb.call(lambda v: log.append(float(v)), x), x + 1)[1])
    assert float(f(jnp.float32(1.0))) == 2.0
    assert float(f(jnp.float32(2.0))) == 3.0
    assert log == [1.0, 2.0]


def test_call_pytree_result_and_python_scalar_shape():
    def host(d):
        return {"s": d["a"].sum(), "n": np.int32(d["a"].size)}

    out = jax.jit(lambda v: hcb.call(host, {"a": v}, result_shape={"s": 0.0, "n": np.int32(0)}))(
        jnp.arange(4.0)
    )
    assert float(out["s"]) == 6.0 and int(out["n"]) == 4
    assert out["s"].dtype == jnp.float32 and out["n"].dtype == jnp.int32


def test_id_tap_result_is_returned_and_not_sent(monkeypatch):
    got, sent = [], []
    from pmaptap.host_callback._taps import _TapConsumer as consumer

    original = consumer.__call__

    def recording(self, batch_dims, coords, *arrays):
        sent.append([np.shape(a) for a in arrays])
        original(self, batch_dims, coords, *arrays)

    # Every id_tap payload, eager or compiled, enters the host here.
    monkeypatch.setattr(consumer, "__call__", recording)
    x = jnp.arange(3.0)
    res = {"r": jnp.ones(7)}
    assert hcb.id_tap(lambda a, t: got.append(a), x, result=res) is res
    y = jax.jit(lambda x, r: hcb.id_tap(lambda a, t: got.append(a), x, result=r) * 2)(x, res["r"])
    hcb.barrier_wait()
    np.testing.assert_array_equal(y, 2 * np.ones(7))
    assert len(got) == 2
    for a in got:
        np.testing.assert_array_equal(a, np.arange(3.0))
    assert sent == [[(3,)], [(3,)]], "only arg travels to the host"


def test_barrier_wait_inside_a_tap_function_is_refused():
    errors = []

    def nested(arg, transforms):
        try:
            hcb.barrier_wait()
        except RuntimeError as e:
            errors.append(str(e))

    jax.jit(lambda x: hcb.id_tap(nested, x))(1.0)
    hcb.barrier_wait()
    assert errors and "would wait for itself" in errors[0]


def test_taps_from_many_threads():
    got = []
    lock = threading.Lock()

    def host(arg, transforms):
        with lock:
            got.append(int(arg))

    f = jax.jit(lambda x: hcb.id_tap(host, x))
    threads = [threading.Thread(target=lambda i=i: f(jnp.int32(i))) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    hcb.barrier_wait()
    assert sorted(got) == list(range(8))


def test_call_nested_in_a_tap_function_runs_inline():
    # A tap function (on the executor thread) runs a computation holding a
    # call. On CPU, JAX executes it on the calling thread, so the call's
    # callback arrives on the executor itself and must run inline: queueing
    # it behind the tap that waits for it would deadlock. A subprocess with a
    # timeout turns such a deadlock into a failure instead of a hung suite.
    from conftest import run_python

    proc = run_python(
        """
        import jax, jax.numpy as jnp, numpy as np
        from pmaptap import host_callback as hcb
        inner = jax.jit(lambda v: hcb.call(np.sin, v, result_shape=v))
        out = []
        jax.jit(lambda x: hcb.id_tap(lambda a, t: out.append(float(inner(a)[0])), x))(
            jnp.ones(3))
        hcb.barrier_wait()
        print("RESULT", out)
    """,
        timeout=60,
    )
    assert "RESULT [0.84147" in proc.stdout, proc.stdout


def test_tap_function_is_freed_with_its_compiled_function():
    """Nothing in pmaptap keeps a user's tap function alive once the jitted
    functions using it are deleted and JAX's caches cleared (a process-wide
    cache of specs once held up to 4,096 of them). Traced under vmap and
    under pmap + scan, so the batching rule and the fast path are covered."""

    class Recorder:
        def __init__(self) -> None:
            self.seen: list[np.ndarray] = []

        def __call__(self, x, transforms) -> None:
            self.seen.append(np.asarray(x))

    def run_and_forget() -> weakref.ref:
        rec = Recorder()
        f = jax.jit(jax.vmap(lambda x: hcb.id_tap(rec, x * 2)))
        g = jax.pmap(
            lambda x: jax.lax.scan(lambda c, v: (c + hcb.id_tap(rec, v), None), 0.0, x)[0],
            axis_name="i",
        )
        f(jnp.arange(3.0))
        g(jnp.ones((jax.device_count(), 2)))
        hcb.barrier_wait()
        assert len(rec.seen) == 1 + 2 * jax.device_count()
        return weakref.ref(rec)  # f, g and rec go out of scope here

    ref = run_and_forget()
    jax.clear_caches()
    gc.collect()
    assert ref() is None, [type(r).__name__ for r in gc.get_referrers(ref())]


def test_id_tap_of_a_tangent_in_a_custom_jvp_rule_under_grad_vjp_and_jvp():
    """Issue 28: under grad/vjp an unused tapped tangent is tapped as its
    cotangent, zeros, marked 'transpose' (the old module's transpose rule
    instantiated zeros); it used to vanish without a word."""
    seen = []

    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    @f.defjvp
    def f_jvp(primals, tangents):
        (x,), (dx,) = primals, tangents
        hcb.id_tap(lambda v, t: seen.append(("tangent", float(v), t)), dx)
        hcb.id_tap(lambda v, t: seen.append(("primal", float(v), t)), x)
        return jnp.sin(x), jnp.cos(x) * dx

    assert float(jax.grad(f)(0.5)) == pytest.approx(np.cos(0.5))
    assert float(jax.vjp(f, 0.25)[1](1.0)[0]) == pytest.approx(np.cos(0.25))
    hcb.barrier_wait()
    # the tapped tangent is not used: its cotangent is zero (see
    # test_host_callback_fidelity for a used one)
    transposed = (("transpose", {}),)
    assert seen == [
        ("primal", 0.5, ()),
        ("tangent", 0.0, transposed),
        ("primal", 0.25, ()),
        ("tangent", 0.0, transposed),
    ]
    seen.clear()
    _, t = jax.jvp(f, (1.0,), (2.0,))
    hcb.barrier_wait()
    assert float(t) == pytest.approx(2 * np.cos(1.0))
    assert seen == [("tangent", 2.0, ()), ("primal", 1.0, ())]


def test_id_tap_refuses_a_dtype_tap_files_cannot_hold_at_trace_time():
    from jax._src.dtypes import float0

    def my_tap(x, transforms):
        pass

    with pytest.raises(TypeError, match=r"id_tap\('my_tap'\).*float0|my_tap.*dtype"):
        jax.jit(lambda v: hcb.id_tap(my_tap, (v, np.zeros(2, float0))))(1.0)
