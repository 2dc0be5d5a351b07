"""The same program writes the same records on every JAX pmaptap supports.

One program of the usual kinds of tap (a replicated loss under ``jit`` with
sharded inputs, per-shard and per-device values, a ``pmap`` argument with
``in_axes=None``, a shard_map body, statistics of a value above
``max_value_bytes``, a fingerprint, taps in a ``scan``) runs under both
transports; its file, less what differs from run to run (time, host, run
id), must equal ``data/same_records.jsonl``. CI runs this on two JAX
releases (.ci/run: the pins' own and the newest), so a file written on one
reads back as the other's. The values are small integers, exact in every
float type, so no reduction order of any XLA can change them.

When pmaptap's own records change on purpose, rewrite the expected file:
``PMAPTAP_WRITE_EXPECTED=1 python -m pytest tests/trace/test_same_records_every_jax.py``
(on any supported JAX), and say why in the commit.
"""

from __future__ import annotations

import json
import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pmaptap

EXPECTED = os.path.join(os.path.dirname(__file__), "data", "same_records.jsonl")
# What differs between two runs of one program, whatever the JAX.
_RUN_FIELDS = ("time", "host", "run")


def _program(path: str, jit, pmap) -> None:
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    x = jax.device_put(
        jnp.arange(64.0, dtype=jnp.float32).reshape(8, 8), NamedSharding(mesh, P("data", "model"))
    )

    @jit
    def step(x, k):
        loss = jnp.mean(x) + k
        pmaptap.tap(loss, "loss", step=k, dedup="replicated")
        pmaptap.tap(x, "x_shards", step=k, dedup="per_device")
        pmaptap.fingerprint({"x": x}, "fp", step=k)
        with pmaptap.configured(max_value_bytes=16):
            pmaptap.tap(x * 2.0, "x_stats", step=k)

        def layer(h, w):
            h = h + w
            pmaptap.tap(jnp.max(h), "layer_max", step=k)
            return h, None

        h, _ = lax.scan(layer, jnp.zeros(()), jnp.arange(3.0))
        return loss + h

    @partial(pmap, axis_name="i", in_axes=(0, None))
    def per_device(v, k):
        pmaptap.tap(v.sum(), "row_sum", step=k, dedup="per_device")
        pmaptap.tap(k * 2, "k2", step=k)
        return lax.psum(v, "i")

    def body(block):
        total = lax.psum(jnp.sum(block), "model")
        pmaptap.tap(total, "block_total", dedup="auto")
        return block

    shard = jax.shard_map(body, mesh=mesh, in_specs=P(None, "model"), out_specs=P(None, "model"))
    with pmaptap.Session(path, run="same"):
        for k in range(2):
            step(x, k)
            per_device(jnp.arange(16.0).reshape(8, 2), k)
        jit(shard)(x)


def _normalized(path: str) -> list[dict]:
    out = []
    for r in pmaptap.read(path):
        r = {k: v for k, v in r.items() if k not in _RUN_FIELDS}
        out.append(r)
    # Records of one flush are in no fixed order between devices.
    return sorted(out, key=lambda r: json.dumps(r, sort_keys=True))


def test_the_records_are_the_same_on_every_supported_jax(tmp_path, transport):
    path = str(tmp_path / "run.jsonl")
    _program(path, jax.jit, jax.pmap)
    got = _normalized(path)
    lines = [json.dumps(r, sort_keys=True) for r in got]
    if os.environ.get("PMAPTAP_WRITE_EXPECTED") and transport == "callback":
        os.makedirs(os.path.dirname(EXPECTED), exist_ok=True)
        with open(EXPECTED, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
    with open(EXPECTED, encoding="utf-8") as f:
        expected = f.read().splitlines()
    names = {r["name"] for r in got}
    assert {"loss", "x_shards", "fp", "x_stats", "layer_max", "row_sum", "k2"} <= names, names
    assert lines == expected, f"JAX {jax.__version__}: the records differ from {EXPECTED}"
