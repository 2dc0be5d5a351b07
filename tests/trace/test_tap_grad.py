"""pmaptap.tap_grad: cotangents recorded in the backward pass."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pmaptap
from conftest import BAD_TAP_ARGS

pytestmark = pytest.mark.usefixtures("transport")


def _named(recs, name, pass_="backward"):
    return [r for r in recs if r["name"] == name and r.get("pass", "forward") == pass_]


def _read(session, tap_path):
    session.flush()
    return pmaptap.read(tap_path)


def _nonfinite(value) -> bool:
    return not np.isfinite(np.asarray(value, dtype=np.float64)).all()


# ------------------------------------------------------------ values


def test_cotangent_matches_hand_computed_gradient(session, tap_path):
    x = jnp.array([0.5, -1.0, 2.0])

    def loss(w):
        z = pmaptap.tap_grad(w * x, "z")
        return jnp.sum(jnp.tanh(z) ** 2)

    w = jnp.array([0.3, 0.7, -0.2])
    g = jax.jit(jax.grad(loss))(w)
    session.flush()
    (r,) = _named(pmaptap.read(tap_path), "z")
    # d/dz sum(tanh(z)^2) = 2 tanh(z) (1 - tanh(z)^2), by hand
    t = np.tanh(np.asarray(w * x, np.float64))
    np.testing.assert_allclose(r["value"], 2 * t * (1 - t**2), rtol=1e-5)
    assert r["pass"] == "backward" and r["step"] == 0
    assert r["dtype"] == "float32" and r["shape"] == [3]
    # ... and tap_grad leaves the gradient itself unchanged
    ref = jax.grad(lambda w: jnp.sum(jnp.tanh(w * x) ** 2))(w)
    np.testing.assert_allclose(g, ref, rtol=1e-6)
    np.testing.assert_allclose(g, np.asarray(r["value"]) * np.asarray(x), rtol=1e-5)


def test_value_and_grad_and_vjp(session, tap_path):
    def f(w):
        return pmaptap.tap_grad(w, "w") * 3.0

    w = jnp.array([1.0, 2.0])
    val, g = jax.value_and_grad(lambda w: jnp.sum(f(w) ** 2))(w)
    np.testing.assert_allclose(val, 45.0)
    np.testing.assert_allclose(g, 18.0 * w)
    # jax.vjp: the cotangent we feed in comes back, times 3, at w
    y, vjp_fn = jax.vjp(f, w)
    (gw,) = vjp_fn(jnp.array([10.0, -1.0]))
    np.testing.assert_allclose(gw, [30.0, -3.0])
    recs = _named(_read(session, tap_path), "w")
    assert [(r["step"], r["value"]) for r in recs] == [(0, [18.0, 36.0]), (1, [30.0, -3.0])]


def test_forward_is_identity_and_keeps_non_float_leaves():
    tree = {"w": jnp.arange(3.0), "n": jnp.int32(4), "s": 2.5, "none": None}
    out = pmaptap.tap_grad(tree, "id")
    assert out["n"] is tree["n"] and out["s"] == 2.5 and out["none"] is None
    np.testing.assert_array_equal(out["w"], tree["w"])
    y = jax.jit(lambda t: pmaptap.tap_grad(t, "id"))(tree)
    np.testing.assert_array_equal(y["w"], tree["w"])
    assert int(y["n"]) == 4
    pmaptap.flush()


def test_pytree_cotangent_with_null_where_no_gradient_reaches(session, tap_path):
    def loss(t):
        t = pmaptap.tap_grad(t, "tree")
        # "b" is never used (a symbolic zero), "n" is an integer
        return jnp.sum(t["a"] * jnp.array([1.0, 2.0])) * t["n"]

    tree = {"a": jnp.ones(2), "b": jnp.ones(3), "n": jnp.int32(3)}
    jax.jit(jax.grad(loss, allow_int=True))(tree)
    (r,) = _named(_read(session, tap_path), "tree")
    assert r["value"] == {"a": [3.0, 6.0], "b": None, "n": None}
    assert r["dtype"] == {"a": "float32", "b": None, "n": None}


def test_no_record_when_no_gradient_reaches_the_value(session, tap_path):
    def loss(w):
        pmaptap.tap_grad(w * 2.0, "unused")  # result dropped
        return jnp.sum(w)

    jax.grad(loss)(jnp.ones(2))
    jax.jit(jax.grad(loss))(jnp.ones(2))
    assert _named(_read(session, tap_path), "unused") == []


# ------------------------------------------------------------ tap + tap_grad


def test_tap_and_tap_grad_on_the_same_value(session, tap_path):
    def loss(w):
        h = pmaptap.tap(pmaptap.tap_grad(jnp.sin(w), "h"), "h")
        return jnp.sum(h**3)

    w = jnp.array([0.1, 0.2])
    jax.jit(jax.grad(loss))(w)
    recs = [r for r in _read(session, tap_path) if r["name"] == "h"]
    assert len(recs) == 2
    fwd, bwd = _named(recs, "h", "forward"), _named(recs, "h")
    assert len(fwd) == 1 and len(bwd) == 1
    assert "pass" not in fwd[0] and bwd[0]["pass"] == "backward"
    assert fwd[0]["step"] == bwd[0]["step"] == 0
    h = np.sin(np.asarray(w, np.float64))
    np.testing.assert_allclose(fwd[0]["value"], h, rtol=1e-6)
    np.testing.assert_allclose(bwd[0]["value"], 3 * h**2, rtol=1e-5)


# ------------------------------------------------------------ devices


def test_pmap_per_device_cotangents_before_pmean(session, tap_path):
    x = jnp.arange(8.0) + 1.0  # one example per device

    def local_loss(w, xi):
        h = pmaptap.tap_grad(w * xi, "h")  # dedup="auto"
        return h**2

    step = jax.pmap(lambda w, xi: lax.pmean(jax.grad(local_loss)(w, xi), "i"), axis_name="i")
    w = 0.5
    g = step(jnp.full(8, w), x)
    recs = _named(_read(session, tap_path), "h")
    # Different per device -> auto keeps one record per device.
    assert len(recs) == 8 and all(r["kind"] == "per_device" for r in recs)
    # d(h^2)/dh = 2h = 2 w x_d on the device holding x_d (pmap puts shard d on
    # jax.devices()[d]); the mean over devices is what the update sees.
    assert {r["device"]: r["value"] for r in recs} == {d: 2 * w * float(x[d]) for d in range(8)}
    assert all(r["coords"] == {"i": r["device"]} for r in recs)
    np.testing.assert_allclose(g, np.mean(2 * w * np.asarray(x) * np.asarray(x)))


def test_dedup_modes_on_cotangents(session, tap_path):
    def body(v):
        def loss(v):
            same = lax.pmean(v, "i")  # identical on every device
            a = pmaptap.tap_grad(same, "auto_same")
            b = pmaptap.tap_grad(same, "per_dev", dedup="per_device")
            c = pmaptap.tap_grad(v, "repl_div", dedup="replicated")
            return a * 2.0 + b * 3.0 + c * (lax.axis_index("i") >= 6)

        return jax.grad(loss)(v)

    jax.pmap(body, axis_name="i")(jnp.arange(8.0))
    recs = _read(session, tap_path)
    (same,) = _named(recs, "auto_same")
    assert same["kind"] == "replicated" and same["replicas"] == 8
    assert same["value"] == 2.0 and sorted(same["devices"]) == list(range(8))
    per = _named(recs, "per_dev")
    assert sorted(r["device"] for r in per) == list(range(8))
    assert all(r["value"] == 3.0 and r["kind"] == "per_device" for r in per)
    div = {r["value"]: r for r in _named(recs, "repl_div")}
    assert set(div) == {0.0, 1.0}
    assert all(r["divergent"] is True for r in div.values())
    assert sorted(div[1.0]["devices"]) == [6, 7]
    assert sorted(div[0.0]["devices"]) == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("where", ["grad_inside", "grad_outside"])
def test_shard_map_2d_mesh(session, tap_path, where):
    devs = np.array(jax.devices()[::-1]).reshape(2, 4)  # not 0..7 on purpose
    mesh = Mesh(devs, ("dp", "mp"))
    xs = jax.device_put(jnp.arange(8.0).reshape(2, 4), NamedSharding(mesh, P("dp", "mp")))
    spec = dict(mesh=mesh, in_specs=P("dp", "mp"), out_specs=P("dp", "mp"))

    def local(v):
        return jnp.sum(pmaptap.tap_grad(v * v, "sm", dedup="per_device") ** 2)

    if where == "grad_inside":
        jax.jit(jax.shard_map(jax.grad(local), **spec))(xs)
    else:
        f = jax.shard_map(lambda v: pmaptap.tap_grad(v * v, "sm", dedup="per_device") ** 2, **spec)
        jax.jit(jax.grad(lambda x: jnp.sum(f(x))))(xs)
    recs = _named(_read(session, tap_path), "sm")
    assert len(recs) == 8
    for r in recs:
        i, j = r["coords"]["dp"], r["coords"]["mp"]
        assert r["device"] == devs[i, j].id
        v = float(np.arange(8.0).reshape(2, 4)[i, j])
        assert r["value"] == [[2 * v * v]]  # d(h^2)/dh = 2h


# ------------------------------------------------------------ NaN hunting


def _nan_loss(w, x, step=None):
    # Forward: sqrt(z^2) = |z|, finite everywhere. Backward at z == 0:
    # d sqrt(h)/dh = inf at h = 0, then d(z^2)/dz * inf = 0 * inf = NaN.
    z = pmaptap.tap_grad(w * x, "z", step=step)
    h = pmaptap.tap_grad(z**2, "h", step=step)
    loss = jnp.sum(jnp.sqrt(h))
    pmaptap.tap(loss, "loss", step=step)
    return loss


def _train(step_fn, w, data):
    for t, x in enumerate(data):
        w = step_fn(w, x, t)
    return w


def _data():
    # Only step 2 has an example that lands exactly on z == 0.
    return [
        jnp.array([1.0, 2.0]),
        jnp.array([3.0, -1.0]),
        jnp.array([2.0, 0.0]),
        jnp.array([-2.0, 4.0]),
    ]


def _update(w, g):
    # The usual guard: skip non-finite updates, so only step 2 goes bad.
    return jnp.where(jnp.isfinite(g), w - 0.01 * g, w)


@pytest.mark.parametrize("steps", ["automatic", "explicit"])
def test_nan_born_in_backward_pass_is_caught_at_its_step(session, tap_path, steps):
    if steps == "automatic":
        fn = jax.jit(lambda w, x, t: _update(w, jax.grad(_nan_loss)(w, x)))
        offset = 0
    else:
        offset = 100  # e.g. resuming at step 100
        fn = jax.jit(lambda w, x, t: _update(w, jax.grad(_nan_loss)(w, x, t + offset)))
    _train(fn, jnp.float32(0.5), _data())
    recs = _read(session, tap_path)
    loss, z, h = (_named(recs, "loss", "forward"), _named(recs, "z"), _named(recs, "h"))
    assert [r["step"] for r in z] == [offset + t for t in range(4)]
    assert not any(_nonfinite(r["value"]) for r in loss)  # forward: fine
    bad_z = [r["step"] for r in z if _nonfinite(r["value"])]
    bad_h = [r["step"] for r in h if _nonfinite(r["value"])]
    assert bad_z == bad_h == [offset + 2]
    # Where it starts: at h the cotangent is inf (sqrt' at 0), one op further
    # back (z^2) it has become NaN, only in the element with x == 0.
    (h2,) = [r for r in h if r["step"] == offset + 2]
    (z2,) = [r for r in z if r["step"] == offset + 2]
    assert h2["value"][1] == math.inf and np.isfinite(h2["value"][0])
    assert math.isnan(z2["value"][1]) and np.isfinite(z2["value"][0])


# ------------------------------------------------------------ loops, steps


def _scan_loss(c0, a, explicit):
    def body(carry, ai):
        i, c = carry
        h = pmaptap.tap_grad(c * ai, "scan", step=i if explicit else None)
        return (i + 1, h), None

    (_, c), _ = lax.scan(body, (0, c0), a)
    return c


@pytest.mark.parametrize("explicit", [True, False])
def test_scan_one_backward_record_per_iteration(session, tap_path, explicit):
    a = jnp.array([2.0, 3.0, 5.0, 7.0])
    g = jax.jit(jax.grad(_scan_loss), static_argnums=2)(1.0, a, explicit)
    assert float(g) == 210.0
    recs = _named(_read(session, tap_path), "scan")
    # c_{i+1} = a_i c_i, loss = c_4: the cotangent at h_i is prod(a[i+1:]).
    by_iteration = [105.0, 35.0, 7.0, 1.0]
    # The backward pass runs the iterations last to first, each record
    # with its forward iteration's index.
    assert [(r["iteration"], r["value"]) for r in recs] == [
        ([i], by_iteration[i]) for i in range(3, -1, -1)
    ]
    if explicit:
        # step=i travels to the backward pass as a residual: forward index.
        assert [r["step"] for r in recs] == [3, 2, 1, 0]
    else:
        # automatic steps count backward executions (calls), not iterations.
        assert [r["step"] for r in recs] == [0, 0, 0, 0]


def test_automatic_steps_count_backward_passes_apart_from_forward(session, tap_path):
    def loss(w):
        return jnp.sum(pmaptap.tap(pmaptap.tap_grad(w, "p"), "p") ** 2)

    grad = jax.jit(jax.grad(loss))
    fwd_only = jax.jit(loss)
    for k in range(3):
        grad(jnp.float32(k))
        fwd_only(jnp.float32(k))  # a forward pass with no backward
    recs = _read(session, tap_path)
    assert [r["step"] for r in _named(recs, "p", "forward")] == list(range(6))
    assert [(r["step"], r["value"]) for r in _named(recs, "p")] == [(0, 0.0), (1, 2.0), (2, 4.0)]


def test_every_on_backward_records(session, tap_path):
    grad = jax.jit(jax.grad(lambda w: pmaptap.tap_grad(w, "auto", every=2) * w))
    for k in range(5):
        grad(jnp.float32(k))

    def scan_loss(c0):
        def body(c, i):
            return pmaptap.tap_grad(c, "traced", step=i, every=3) * 2.0, None

        return lax.scan(body, c0, jnp.arange(7))[0]

    jax.jit(jax.grad(scan_loss))(1.0)
    # A Python step that is not a multiple of `every`: nothing compiled.
    jax.jit(jax.grad(lambda w: pmaptap.tap_grad(w, "py", step=5, every=2) * w))(1.0)
    recs = _read(session, tap_path)
    assert [(r["step"], r["value"]) for r in _named(recs, "auto")] == [(0, 0.0), (2, 2.0), (4, 4.0)]
    assert sorted((r["step"], r["value"]) for r in _named(recs, "traced")) == [
        (0, 2.0**7),
        (3, 2.0**4),
        (6, 2.0),
    ]
    assert _named(recs, "py") == []


def test_checkpoint_recomputation_does_not_repeat_backward_records(session, tap_path):
    """Under jax.checkpoint the forward pass is replayed inside the backward
    pass. tap_grad sends nothing in the forward pass, so the replay adds no
    record: one backward record per backward execution, steps 0, 1, 2; the
    forward tap on the same value also writes one record per execution."""

    def block(w):
        h = pmaptap.tap(pmaptap.tap_grad(jnp.sin(w), "ck"), "ck")
        return jnp.sum(h**2)

    policies = [
        jax.checkpoint(block),
        jax.checkpoint(block, policy=jax.checkpoint_policies.nothing_saveable),
    ]
    for f in policies:
        for k in range(3):
            jax.jit(jax.grad(f))(jnp.array([0.1 * (k + 1)]))

    # remat'd scan body (the usual layer stack), explicit steps per layer
    def stack(w):
        def body(c, i):
            return jnp.sin(pmaptap.tap_grad(c, "layer", step=i)), None

        return lax.scan(jax.checkpoint(body), w, jnp.arange(3))[0]

    gs = jax.jit(jax.grad(stack))(0.5)
    recs = _read(session, tap_path)
    for pass_ in ("forward", "backward"):
        ck = _named(recs, "ck", pass_)
        assert [r["step"] for r in ck] == list(range(6)), pass_
    bwd = _named(recs, "ck")
    for k in range(3):
        h = math.sin(0.1 * (k + 1))
        for r in (bwd[k], bwd[k + 3]):
            assert r["value"] == pytest.approx([2 * h], rel=1e-5)
    layer = _named(recs, "layer")
    assert sorted(r["step"] for r in layer) == [0, 1, 2]
    # cotangent at c_i is prod of cos(c_j) for j >= i
    c = [0.5]
    for _ in range(3):
        c.append(math.sin(c[-1]))
    want = {i: math.prod(math.cos(c[j]) for j in range(i, 3)) for i in range(3)}
    assert {r["step"]: r["value"] for r in layer} == pytest.approx(want, rel=1e-5)
    assert float(gs) == pytest.approx(want[0], rel=1e-5)


def test_vmap_per_example_gradients_are_one_batched_record(session, tap_path):
    def loss(w, x):
        return pmaptap.tap_grad(w * x, "ex") ** 2

    xs = jnp.array([1.0, 2.0, 3.0])
    jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0)))(2.0, xs)
    (r,) = _named(_read(session, tap_path), "ex")
    assert r["batch_dims"] == 1 and r["value"] == [4.0, 8.0, 12.0]


# ------------------------------------------------------------ higher order, jvp


@pytest.mark.callback_only("no jit or pmap step: nothing a transport carries")
def test_second_order_reverse_mode_works_and_records_first_order(session, tap_path):
    def f(x):
        return jnp.sum(pmaptap.tap_grad(jnp.sin(x), "s") ** 2)

    x = jnp.array([0.3, 1.1])
    gg = jax.grad(lambda x: jnp.sum(jax.grad(f)(x)))(x)
    hvp = jax.jvp(jax.grad(f), (x,), (jnp.ones(2),))[1]  # forward-over-reverse
    hess = jax.hessian(f)(x)
    ref_f = lambda x: jnp.sum(jnp.sin(x) ** 2)  # noqa: E731
    np.testing.assert_allclose(gg, jax.grad(lambda x: jnp.sum(jax.grad(ref_f)(x)))(x), rtol=1e-6)
    np.testing.assert_allclose(hvp, jax.jvp(jax.grad(ref_f), (x,), (jnp.ones(2),))[1], rtol=1e-6)
    np.testing.assert_allclose(hess, jax.hessian(ref_f)(x), rtol=1e-6)
    recs = _named(_read(session, tap_path), "s")
    # One record per evaluation of the inner backward pass: the first-order
    # cotangent 2 sin(x). The outer differentiation records nothing more.
    assert [r["step"] for r in recs] == [0, 1, 2]
    first = 2 * np.sin(np.asarray(x, np.float64))
    np.testing.assert_allclose(recs[0]["value"], first, rtol=1e-5)
    np.testing.assert_allclose(recs[1]["value"], first, rtol=1e-5)
    # jax.hessian = jacfwd(jacrev): jacrev's vmap over the output basis
    # (one row for a scalar output) is a batch axis of the record.
    assert recs[2]["batch_dims"] == 1
    np.testing.assert_allclose(recs[2]["value"], [first], rtol=1e-5)


@pytest.mark.parametrize("how", ["jvp", "jit_of_jvp", "jacfwd", "grad_of_jvp"])
def test_forward_mode_is_refused_with_a_clear_error(how):
    f = lambda x: jnp.sum(pmaptap.tap_grad(jnp.sin(x), "fm") ** 2)  # noqa: E731
    x = jnp.array([0.3, 1.1])
    run = {
        "jvp": lambda: jax.jvp(f, (x,), (x,)),
        "jit_of_jvp": lambda: jax.jit(lambda x: jax.jvp(f, (x,), (x,)))(x),
        "jacfwd": lambda: jax.jacfwd(f)(x),
        "grad_of_jvp": lambda: jax.grad(lambda x: jax.jvp(f, (x,), (x,))[1])(x),
    }[how]
    with pytest.raises(
        TypeError,
        match=r"tap_grad\('fm'\): forward-mode .* "
        r"records cotangents of reverse mode only",
    ):
        run()


def test_forward_mode_through_an_already_traced_function_is_jax_error():
    """Documented limit: when jvp meets tap_grad inside a function that was
    already traced (jvp of jit / scan / checkpoint), tap_grad's Python code
    does not run under jvp, and JAX's own custom_vjp error is what appears."""
    f = jax.jit(lambda x: jnp.sum(pmaptap.tap_grad(jnp.sin(x), "fm2") ** 2))
    with pytest.raises(TypeError, match="forward-mode autodiff .* custom_vjp"):
        jax.jvp(f, (jnp.ones(2),), (jnp.ones(2),))


def test_jvp_with_no_tangent_reaching_tap_grad_is_fine():
    # The tangent flows through y only; x's tap_grad sees no forward mode.
    def f(x, y):
        return pmaptap.tap_grad(x, "nt") * 2.0 + y

    out, t = jax.jvp(lambda y: f(jnp.float32(1.0), y), (jnp.float32(1.0),), (jnp.float32(1.0),))
    assert float(out) == 3.0 and float(t) == 1.0
    pmaptap.flush()


# ------------------------------------------------------------ argument checks


@pytest.mark.parametrize("kwargs, exc, text", BAD_TAP_ARGS)
def test_bad_arguments_raise_at_trace_time_without_any_gradient(kwargs, exc, text):
    kwargs = dict(kwargs)  # the table is shared: do not mutate it
    name = kwargs.pop("name")
    with pytest.raises(exc, match=r"pmaptap\.tap_grad.*" + text if name == "x" else text):
        jax.jit(lambda v: pmaptap.tap_grad(v, name, **kwargs))(jnp.ones(2))


def test_bad_values_raise_at_trace_time():
    with pytest.raises(TypeError, match=r"\['label'\] is a str"):
        pmaptap.tap_grad({"label": "hello", "x": jnp.ones(1)}, "bad")
    with pytest.raises(TypeError, match="no gradient can reach .* int32"):
        jax.jit(lambda v: pmaptap.tap_grad(v, "ints"))(jnp.arange(3))
    with pytest.raises(TypeError, match="step must be an integer scalar"):
        jax.jit(lambda v, s: pmaptap.tap_grad(v, "s", step=s))(jnp.ones(2), jnp.ones(2))


def test_exported_from_the_package():
    assert "tap_grad" in pmaptap.__all__
    assert pmaptap.__all__ == sorted(pmaptap.__all__)


# ------------------------------------------------------------ custom_jvp rules


def _sin_tapping_its_tangent(tap):
    """sin with a custom_jvp rule that taps its primal and its tangent."""

    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    @f.defjvp
    def f_jvp(primals, tangents):
        (x,), (dx,) = primals, tangents
        tap(dx, "tangent")
        tap(x, "primal")
        return jnp.sin(x), jnp.cos(x) * dx

    return f


def _fwd(recs, name):
    return [r["value"] for r in recs if r["name"] == name]


def test_tap_of_a_tangent_in_a_custom_jvp_rule_under_grad_vjp_and_jvp(session, tap_path):
    """Issue 28: reverse mode never computes the tangent (it transposes the
    rule's linear part) and no cotangent flows through pmaptap.tap, so there
    is nothing to record: refused at trace time naming the tap (it used to
    vanish without a word)."""
    f = _sin_tapping_its_tangent(pmaptap.tap)
    refused = r"pmaptap\.tap\('tangent'\) taps a tangent inside a jax\.custom_jvp rule.*tap_grad"
    with pytest.raises(TypeError, match=refused):
        jax.grad(lambda x: 3 * f(x))(0.5)
    with pytest.raises(TypeError, match=refused):
        jax.jit(jax.grad(lambda x: 3 * f(x)))(0.25)
    _, pullback = jax.vjp(f, 0.75)
    with pytest.raises(TypeError, match=refused):
        pullback(1.0)
    # jvp / linearize: the tangent is a value of the forward computation.
    _, t = jax.jvp(f, (1.0,), (2.0,))
    assert t == pytest.approx(2 * math.cos(1.0))
    _, lin = jax.linearize(f, 1.5)
    assert lin(4.0) == pytest.approx(4 * math.cos(1.5))
    recs = _read(session, tap_path)
    assert _fwd(recs, "tangent") == [2.0, 4.0]
    # 0.5 and 0.75: eager grad and jax.vjp ran the forward pass before the
    # backward pass was refused (jit(grad) compiles nothing)
    assert _fwd(recs, "primal") == [0.5, 0.75, 1.0, 1.5]


def test_tap_of_a_tangent_under_pmap_grad_and_vmap_jvp(session, tap_path):
    f = _sin_tapping_its_tangent(lambda v, name: pmaptap.tap(v, name, dedup="per_device"))
    xs = jnp.arange(8.0)
    with pytest.raises(TypeError, match=r"pmaptap\.tap\('tangent'\)"):
        jax.pmap(jax.grad(lambda x: 2 * f(x)))(xs)
    t8 = jax.pmap(lambda x: jax.jvp(lambda v: 2 * f(v), (x,), (1.0,))[1])(xs)
    np.testing.assert_allclose(t8, 2 * np.cos(np.arange(8.0)), rtol=1e-6)
    _, t = jax.vmap(lambda a: jax.jvp(f, (a,), (3 * a,)))(jnp.arange(3.0))
    recs = _read(session, tap_path)
    assert {
        r["device"]: r["value"]
        for r in recs
        if r["name"] == "primal" and r.get("device") is not None
    } == {d: float(d) for d in range(8)}
    assert sorted(
        r["device"] for r in recs if r["name"] == "tangent" and r.get("device") is not None
    ) == list(range(8))
    (tangent,) = [r for r in recs if r["name"] == "tangent" and r.get("device") is None]
    assert tangent["value"] == [0.0, 3.0, 6.0] and tangent["batch_dims"] == 1
