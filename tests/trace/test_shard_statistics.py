"""Statistics of a sharded leaf above ``max_value_bytes`` (issue 59, item 1):
each shard's statistics are computed on the device that holds it and only
they leave it (a row of a few dozen bytes, _trace/shardstats.py), under both
transports, with the records the host made before from whole shards: the
exact device and ``index`` of every shard, values within float32 rounding
of the shard's own (computed here in NumPy from the full array), uneven
shards, replicated slices deduplicated, bf16/f16/int inputs."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pmaptap
from pmaptap._common.shard_placement import statistics_row_width

pytestmark = pytest.mark.usefixtures("transport")


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))


def _expected(a: np.ndarray) -> dict:
    """What the record of a summarized shard ``a`` holds, in float64."""
    a = np.asarray(a)
    f = a.astype(np.float64)
    finite = np.isfinite(f)
    v = f[finite]
    out = {"nan": int(np.isnan(f).sum()), "inf": int(np.isinf(f).sum())}
    if v.size:
        out.update(min=v.min(), max=v.max(), mean=v.mean(), std=v.std())
    return out


def _check(rec: dict, shard: np.ndarray) -> None:
    want = _expected(shard)
    got = rec["value"]
    assert rec["summarized"] and rec["shape"] == list(shard.shape)
    assert (got["nan"], got["inf"]) == (want["nan"], want["inf"])
    for k in ("min", "max", "mean", "std"):
        assert got[k] == pytest.approx(want[k], rel=2e-6, abs=1e-6), (k, got, want)


# (global shape, sharding in the step): even, uneven (10 over 4, 5 over 2),
# replicated along "model", fully replicated.
_LAYOUTS = {
    "even": ((16, 8), P("data", "model")),
    "uneven": ((10, 5), P("data", "model")),
    "rows": ((16, 8), P("data", None)),
    "replicated": ((16, 8), P()),
}


def _value(shape, dtype) -> np.ndarray:
    rng = np.random.default_rng(0)
    if np.dtype(dtype).kind in "iu":
        return rng.integers(-1000, 1000, shape).astype(dtype)
    a = (rng.standard_normal(shape) * 3).astype(np.float32)
    a.flat[3] = np.nan
    a.flat[7] = np.inf
    return a.astype(dtype)


def _run(tap_path, layout: str, dtype, dedup: str) -> tuple[list[dict], np.ndarray, dict]:
    """Tap a ``layout`` value of ``dtype`` summarized; (records, the full
    value, device id -> its slice as (start, stop) per dimension)."""
    mesh = _mesh()
    shape, spec = _LAYOUTS[layout]
    full = _value(shape, dtype)
    sharding = NamedSharding(mesh, spec)
    # The value is made inside the step (an uneven sharding cannot be an
    # argument's) and constrained to the layout there.
    src = jax.device_put(np.zeros((16, 8), full.dtype), NamedSharding(mesh, P()))

    @jax.jit
    def step(z):
        y = jax.lax.with_sharding_constraint(z[: shape[0], : shape[1]] + full, sharding)
        pmaptap.tap(y, "act", dedup=dedup)
        return jnp.sum(y.astype(jnp.float32))

    with pmaptap.configured(max_value_bytes=16), pmaptap.Session(tap_path, run="t"):
        step(src).block_until_ready()
    from pmaptap._common.shard_placement import _slices_by_device

    return pmaptap.read(tap_path), full, _slices_by_device(sharding, shape)


@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int32"])
def test_per_device_statistics_of_every_shard(tap_path, layout, dtype):
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    recs, full, slices = _run(tap_path, layout, dt, "per_device")
    assert sorted(r["device"] for r in recs) == [d.id for d in jax.devices()]
    for r in recs:
        box = slices[r["device"]]
        assert r["index"] == [list(b) for b in box]
        assert r["dtype"] == dt.name and r["global_shape"] == list(full.shape)
        _check(r, full[tuple(slice(a, b) for a, b in box)])


@pytest.mark.parametrize("layout", ["uneven", "rows", "replicated"])
def test_replicated_slices_are_one_record_each(tap_path, layout):
    recs, full, slices = _run(tap_path, layout, np.dtype(np.float32), "auto")
    holders: dict = {}
    for d, box in slices.items():
        holders.setdefault(box, []).append(d)
    assert len(recs) == len(holders)
    for r in recs:
        box = tuple(tuple(b) for b in r["index"])
        devices = r.get("devices") or [r["device"]]
        assert sorted(devices) == sorted(holders[box])
        assert r["kind"] == ("per_device" if len(holders[box]) == 1 else "replicated")
        _check(r, full[tuple(slice(a, b) for a, b in box)])


def test_vmapped_tap_has_statistics_per_row_of_each_shard(tap_path):
    mesh = _mesh()
    x = jax.device_put(
        jnp.arange(8 * 6, dtype=jnp.float32).reshape(8, 6) ** 1.5,
        NamedSharding(mesh, P("data", "model")),
    )

    @jax.jit
    def step(x):
        jax.vmap(lambda r: pmaptap.tap(r, "row", dedup="per_device"))(x)
        return x

    with pmaptap.configured(max_value_bytes=4), pmaptap.Session(tap_path, run="t"):
        step(x)
    recs = pmaptap.read(tap_path)
    full = np.asarray(x)
    assert len(recs) == 8
    for s in x.addressable_shards:
        r = next(r for r in recs if r["device"] == s.device.id)
        block = full[s.index]
        assert r["batch_dims"] == 1 and r["shape"] == list(block.shape)
        for i, row in enumerate(block):
            assert r["value"]["mean"][i] == pytest.approx(row.mean(), rel=1e-6)
            assert r["value"]["std"][i] == pytest.approx(row.std(), rel=1e-5)


# ------------------------------------------------- what leaves the devices
def _big_step():
    def step(x):
        pmaptap.tap(jnp.sin(x), "act")
        return jnp.sum(x)

    return step


@pytest.mark.callback_only
def test_both_transports_write_the_same_records(tmp_path):
    mesh = _mesh()
    x = jax.device_put(
        jnp.arange(12 * 10, dtype=jnp.float32).reshape(12, 10) / 7,
        NamedSharding(mesh, P("data", "model")),
    )

    def step(x):
        y = jax.lax.with_sharding_constraint(
            x[:10, :9] * 3, NamedSharding(mesh, P("data", "model"))
        )
        pmaptap.tap(y, "act", dedup="auto")
        return jnp.sum(y)

    got = {}
    for name, jit in (("callbacks", jax.jit), ("outputs", pmaptap.jit)):
        path = str(tmp_path / f"{name}.jsonl")
        with pmaptap.configured(max_value_bytes=16), pmaptap.Session(path, run="t"):
            jit(step)(x).block_until_ready()
        recs = [{k: v for k, v in r.items() if k != "time"} for r in pmaptap.read(path)]
        got[name] = sorted(recs, key=lambda r: str(r["index"]))
    assert len(got["callbacks"]) == 8
    assert got["callbacks"] == got["outputs"]


@pytest.mark.callback_only
def test_only_each_shards_statistics_reach_the_host_callback():
    """The partitioned host callback's operand on each device is that
    device's row of statistics, not its shard (before: f32[16,32], the
    shard, copied to the host and summarized there), and no collective
    gathers the rows."""
    mesh = _mesh()
    x = jax.device_put(jnp.ones((64, 64)), NamedSharding(mesh, P("data", "model")))
    with pmaptap.configured(max_value_bytes=1024):
        hlo = jax.jit(_big_step()).lower(x).compile().as_text()
    (call,) = [ln for ln in hlo.splitlines() if "partitioned_python_cpu_callback" in ln]
    operands = re.search(r"operand_layout_constraints=\{(.*?)\}, custom_call_has", call).group(1)
    width = statistics_row_width((64, 64), 0)
    assert f"u32[1,{width}]" in operands, operands
    assert "f32" not in operands, operands
    assert "all-gather" not in hlo


@pytest.mark.callback_only
def test_only_the_statistics_table_leaves_a_pmaptap_jit_step():
    """Under pmaptap.jit the tap's step output is the table of every shard's
    statistics (uint32[devices, width]), never the activation (before:
    f32[64,64], every shard copied to the host)."""
    mesh = _mesh()
    x = jax.device_put(jnp.ones((64, 64)), NamedSharding(mesh, P("data", "model")))
    with pmaptap.configured(max_value_bytes=1024):
        avals = pmaptap.jit(_big_step()).trace(x).jaxpr.out_avals
    shapes = sorted((tuple(a.shape), str(a.dtype)) for a in avals)
    assert shapes == [((), "float32"), ((8, statistics_row_width((64, 64), 0)), "uint32")]
