"""Device / process / coordinate tags, checked against where data lives."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pmaptap

pytestmark = pytest.mark.usefixtures("transport")


def _per_device(records, name):
    return [r for r in records if r["name"] == name and r["kind"] == "per_device"]


def test_pmap_unnamed_axis_tags_each_device(session, tap_path):
    x = jnp.arange(8.0) * 10

    @jax.pmap
    def f(v):
        pmaptap.tap(v, "x", dedup="per_device")
        return v

    out = f(x)
    session.flush()
    recs = _per_device(pmaptap.read(tap_path), "x")
    assert len(recs) == 8
    # The shard of `out` on each device tells us what lived where.
    truth = {s.device.id: float(np.asarray(s.data).reshape(())) for s in out.addressable_shards}
    got = {r["device"]: r["value"] for r in recs}
    assert got == truth
    assert sorted(r["coords"]["pmap"] for r in recs) == list(range(8))
    assert all(r["process"] == 0 and r["step"] == 0 for r in recs)


def test_pmap_devices_in_reverse_order_is_exact(session, tap_path):
    devs = jax.devices()[::-1]

    @jax.pmap
    def ident(v):
        return v

    f = jax.pmap(
        lambda v: pmaptap.tap(v, "rev", dedup="per_device") * 1, axis_name="i", devices=devs
    )
    out = f(jnp.arange(8.0))
    session.flush()
    recs = _per_device(pmaptap.read(tap_path), "rev")
    truth = {s.device.id: float(np.asarray(s.data).reshape(())) for s in out.addressable_shards}
    assert {r["device"]: r["value"] for r in recs} == truth
    # coordinate i sits on device devs[i]
    assert {r["coords"]["i"]: r["device"] for r in recs} == {i: d.id for i, d in enumerate(devs)}


def _mesh_2d():
    devs = np.array(jax.devices()[::-1]).reshape(2, 4)  # deliberately not 0..7
    return Mesh(devs, ("dp", "mp"))


def _sharded_input(mesh):
    x = jnp.arange(8.0).reshape(2, 4)
    return jax.device_put(x, NamedSharding(mesh, P("dp", "mp")))


@pytest.mark.parametrize("how", ["jit_mesh_arg", "eager_mesh_arg", "set_mesh"])
def test_shard_map_2d_tags(session, tap_path, how):
    mesh = _mesh_2d()
    xs = _sharded_input(mesh)

    def body(v):
        pmaptap.tap(v, "sm", dedup="per_device")
        return v

    if how == "set_mesh":
        with jax.set_mesh(mesh):
            jax.jit(jax.shard_map(body, in_specs=P("dp", "mp"), out_specs=P("dp", "mp")))(xs)
    else:
        f = jax.shard_map(body, mesh=mesh, in_specs=P("dp", "mp"), out_specs=P("dp", "mp"))
        (jax.jit(f) if how == "jit_mesh_arg" else f)(xs)
    session.flush()
    recs = _per_device(pmaptap.read(tap_path), "sm")
    assert len(recs) == 8
    truth = {s.device.id: np.asarray(s.data).tolist() for s in xs.addressable_shards}
    for r in recs:
        assert r["device"] is not None
        assert r["value"] == truth[r["device"]]
        assert mesh.devices[r["coords"]["dp"], r["coords"]["mp"]].id == r["device"]


def test_partial_manual_shard_map_reports_null_device_not_a_guess(session, tap_path):
    mesh = _mesh_2d()
    xs = _sharded_input(mesh)

    def body(v):
        pmaptap.tap(v.sum(), "partial", dedup="per_device")
        return v

    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"), axis_names={"dp"}))(
        xs
    )
    session.flush()
    recs = [r for r in pmaptap.read(tap_path) if r["name"] == "partial"]
    assert recs, "partial-manual taps must still be recorded"
    assert all(r["device"] is None for r in recs)
    assert sorted(r["coords"]["dp"] for r in recs) == [0, 1]
    # value: the sum of row dp of the array
    for r in recs:
        assert r["value"] == float(np.arange(8.0).reshape(2, 4)[r["coords"]["dp"]].sum())


def test_plain_jit_and_eager_have_empty_coords(session, tap_path, transport):
    jax.jit(lambda v: pmaptap.tap(v, "jit", dedup="per_device"))(jnp.ones(2))
    x = jax.device_put(jnp.arange(3.0), jax.devices()[5])
    pmaptap.tap(x, "eager", dedup="per_device")
    session.flush()
    recs = {r["name"]: r for r in pmaptap.read(tap_path)}
    # A host callback cannot say which device it came from; an output can
    # (the one device of the computation).
    device = None if transport == "callback" else jax.devices()[0].id
    assert recs["jit"]["coords"] == {} and recs["jit"]["device"] == device
    assert recs["eager"]["coords"] == {} and recs["eager"]["device"] == 5
    assert recs["eager"]["value"] == [0.0, 1.0, 2.0]


def test_placement_can_still_find_the_pmap_mesh():
    """Fails loudly when a JAX upgrade moves the concrete mesh out of reach
    (pmaptap would then write device=null everywhere under pmap)."""
    from pmaptap._trace import placement

    found = {}

    def body(v):
        names, sizes = placement.mapped_axes()
        found["table"] = placement.device_table(names, sizes)
        return v

    devs = jax.devices()[:4][::-1]
    jax.pmap(body, devices=devs)(jnp.zeros(4))
    ids, procs = found["table"]
    assert ids == tuple(d.id for d in devs), (
        "pmaptap.placement could not read the concrete mesh from JAX's "
        "shard_map frames; update jax_support.MESH_FRAME_MODULES for this JAX"
    )
    assert procs == (0, 0, 0, 0)
