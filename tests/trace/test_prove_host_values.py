"""The trace-time proof of replication must not trust JAX's varying-axes
typing for a value a host callback returned: each device calls the host on
its own and may get its own answer, while JAX types the result invariant
when its operands are. Such a replicated tap still compares its copies, so a
divergence is flagged, as with ``prove_replicated=False``."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import pmaptap


def _host_value(kind: str):
    calls = itertools.count()

    def host(_):
        return np.float32(next(calls) % 3)  # differs between devices

    out = jax.ShapeDtypeStruct((), jnp.float32)
    if kind == "io_callback":
        return lambda: io_callback(host, out, jnp.float32(0), ordered=False)
    if kind == "hcb_call":
        from pmaptap import host_callback as hcb

        return lambda: hcb.call(host, jnp.float32(0), result_shape=out)
    if kind == "pure_callback":
        return lambda: jax.pure_callback(host, out, jnp.float32(0))
    # inside a nested jit: the callback sits in an inner jaxpr
    return jax.jit(lambda: jax.pure_callback(host, out, jnp.float32(0)) * 2)


@pytest.mark.parametrize("kind", ["io_callback", "pure_callback", "nested_jit", "hcb_call"])
def test_a_host_callback_result_is_not_proven_replicated(tmp_path, kind):
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
    value = _host_value(kind)

    def body(v):
        pmaptap.tap(value() + 1, "h", dedup="replicated")
        return v

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(("a", "b")), out_specs=P(("a", "b"))))
    path = tmp_path / "h.jsonl"
    with pmaptap.Session(str(path), run="h"):
        jax.block_until_ready(f(jnp.arange(8.0)))
    recs = list(pmaptap.read(path))
    scale = 2.0 if kind == "nested_jit" else 1.0
    assert sorted(r["value"] for r in recs) == [1.0, 1.0 + scale, 1.0 + 2 * scale]
    assert all(r.get("divergent") for r in recs)
