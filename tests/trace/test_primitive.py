"""The callback primitive (pmaptap/_trace/primitive.py) leans on jax._src internals;
these tests fail loudly if a JAX upgrade breaks them."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pmaptap._trace.primitive import emit_callback


def _collector():
    got, lock = [], threading.Lock()

    def fn(*arrays):
        with lock:
            got.append(arrays)

    return got, fn


def test_receives_numpy_copies_not_jax_arrays():
    got, fn = _collector()
    jax.jit(lambda x: emit_callback(fn, x, x * 2))(jnp.arange(4.0))
    jax.effects_barrier()
    ((a, b),) = got
    assert type(a) is np.ndarray and type(b) is np.ndarray
    assert a.flags.owndata or a.base is not None
    np.testing.assert_array_equal(b, np.arange(4.0) * 2)


def test_once_per_device_under_pmap_and_once_under_jit():
    got, fn = _collector()
    jax.pmap(lambda x: emit_callback(fn, x, lax.axis_index("i")), axis_name="i")(jnp.arange(8.0))
    jax.effects_barrier()
    assert sorted((float(a), int(i)) for a, i in got) == [(float(i), i) for i in range(8)]


def test_transformations_keep_it_and_leave_values_alone():
    got, fn = _collector()

    def f(x):
        emit_callback(fn, x)
        return jnp.sum(jnp.sin(x))

    x = jnp.arange(3.0)
    g = jax.grad(jax.checkpoint(f))(x)
    np.testing.assert_allclose(g, jnp.cos(x))
    jax.jit(
        lambda xs: lax.scan(lambda c, v: (emit_callback(fn, v), None)[1] or (c, None), 0.0, xs)
    )(jnp.arange(5.0))
    jax.effects_barrier()
    # the bare primitive is replayed by checkpoint's recomputation (2 calls);
    # pmaptap.tap wraps it in custom_vmap, which is not (test_core_steps).
    assert len(got) == 2 + 5


def test_partial_auto_shard_map_delegates_and_still_calls_back():
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    got, fn = _collector()
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))

    def body(x):
        emit_callback(fn, x.sum())
        return x

    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("a"), out_specs=P("a"), axis_names={"a"}))(
        jnp.arange(8.0).reshape(2, 4)
    )
    jax.effects_barrier()
    assert sorted(float(a) for (a,) in got) == [6.0, 22.0]
