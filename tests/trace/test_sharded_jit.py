"""Sharded arrays under plain ``jax.jit`` (GSPMD / NamedSharding, and explicit
mesh axes under ``jax.set_mesh``): one record per shard with its exact device,
coordinates and global ``index``, and never a gather (issue 13)."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pmaptap
from conftest import job_failed, python_cmd, run_launch, run_python, train_argv

pytestmark = pytest.mark.usefixtures("transport")

COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all")


def _mesh(order=None, explicit: bool = False) -> Mesh:
    devs = np.array(jax.devices())
    if order is not None:
        devs = devs[np.array(order)]
    types = (AxisType.Explicit,) * 2 if explicit else (AxisType.Auto,) * 2
    return Mesh(devs.reshape(4, 2), ("data", "model"), axis_types=types)


def _coords_of(mesh: Mesh, device_id: int) -> dict:
    pos = np.argwhere(np.vectorize(lambda d: d.id)(mesh.devices) == device_id)[0]
    return {n: int(i) for n, i in zip(mesh.axis_names, pos)}


def _index_of(shard, shape) -> list:
    return [[s.start or 0, s.stop if s.stop is not None else n] for s, n in zip(shard.index, shape)]


def _x(mesh: Mesh, spec) -> jax.Array:
    return jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, spec))


def _step(dedup: str, name: str = "act"):
    @jax.jit
    def step(x):
        y = jnp.sin(x) * 2
        pmaptap.tap(y, name, dedup=dedup)
        return y

    return step


def _check_per_device(recs: list[dict], y: jax.Array, mesh: Mesh) -> None:
    assert len(recs) == 8, recs
    by_dev = {r["device"]: r for r in recs}
    assert len(by_dev) == 8
    for shard in y.addressable_shards:
        r = by_dev[shard.device.id]
        assert r["kind"] == "per_device"
        assert r["coords"] == _coords_of(mesh, shard.device.id)
        assert r["index"] == _index_of(shard, y.shape)
        assert r["shape"] == list(shard.data.shape)
        np.testing.assert_array_equal(np.array(r["value"], np.float32), np.asarray(shard.data))


@pytest.mark.parametrize(
    "order",
    [None, list(range(7, -1, -1)), [3, 6, 0, 5, 1, 7, 2, 4]],
    ids=["ordered", "reversed", "shuffled"],
)
def test_per_device_records_match_addressable_shards(tap_path, order):
    mesh = _mesh(order)
    x = _x(mesh, P("data", "model"))
    with pmaptap.Session(tap_path, run="t"):
        y = _step("per_device")(x)
    _check_per_device(pmaptap.read(tap_path), y, mesh)


def test_an_inner_jit_with_a_tap_keeps_its_own_shardings(tap_path):
    """A layer jitted with ``in_shardings`` and ``out_shardings`` and a tap
    inside, called in a step: the step returns the layer's out_shardings
    and the tap sees the value as in_shardings lays it out (its shards'
    indices), under either transport (the output transport inlines the
    layer to lift its tap: it dropped both, and the step came back sharded
    by rows)."""
    mesh = _mesh()
    cols, want = NamedSharding(mesh, P(None, "model")), NamedSharding(mesh, P("model", "data"))
    layer = jax.jit(
        lambda x: pmaptap.tap(x, "seen", dedup="auto") * 2, in_shardings=cols, out_shardings=want
    )
    with pmaptap.Session(tap_path, run="t"):
        y = jax.jit(lambda x: layer(x + 1))(_x(mesh, P("data")))
    assert y.sharding.is_equivalent_to(want, y.ndim), y.sharding
    recs = pmaptap.read(tap_path, name="seen")
    assert sorted(map(str, (r["index"] for r in recs))) == ["[[0, 8], [0, 4]]", "[[0, 8], [4, 8]]"]


def test_a_pytree_with_an_empty_leaf_is_one_record_with_its_index(tap_path):
    """A replicated value tapped beside an empty array (known where the step
    is traced, so no output of the step): one replicated record for the 8
    copies, its index naming both leaves' slices, under either transport
    (outputs left the empty leaf's slice unknown, so the index, and the
    copies went unmerged: 8 per-device records)."""
    mesh = Mesh(np.array(jax.devices()), ("d",))
    x = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P()))
    with pmaptap.Session(tap_path, run="t"):
        jax.jit(lambda x: pmaptap.tap((x * 2, jnp.zeros((0,))), "with_empty"))(x)
    recs = pmaptap.read(tap_path)
    assert [(r["kind"], r["index"], r["replicas"]) for r in recs] == [
        ("replicated", [[[0, 4]], [[0, 0]]], 8)
    ], recs


def test_auto_replicated_slices_one_record_per_slice_with_holders(tap_path):
    mesh = _mesh()
    x = _x(mesh, P("data", None))
    with pmaptap.Session(tap_path, run="t"):
        y = _step("auto")(x)
    recs = pmaptap.read(tap_path)
    assert len(recs) == 4, recs
    holders: dict[tuple, list[int]] = {}
    data: dict[tuple, np.ndarray] = {}
    for s in y.addressable_shards:
        key = tuple(map(tuple, _index_of(s, y.shape)))
        holders.setdefault(key, []).append(s.device.id)
        data[key] = np.asarray(s.data)
    for r in recs:
        key = tuple(map(tuple, r["index"]))
        assert r["kind"] == "replicated" and not r.get("divergent")
        assert sorted(r["devices"]) == sorted(holders[key]) and len(r["devices"]) == 2
        assert r["replicas"] == 2
        np.testing.assert_array_equal(np.array(r["value"], np.float32), data[key])
    assert {tuple(map(tuple, r["index"])) for r in recs} == set(holders)


def test_per_device_on_replicated_slices_names_every_device(tap_path):
    mesh = _mesh()
    x = _x(mesh, P("data", None))
    with pmaptap.Session(tap_path, run="t"):
        y = _step("per_device")(x)
    _check_per_device(pmaptap.read(tap_path), y, mesh)


@pytest.mark.callback_only(
    "a jit output is never unevenly sharded: as an output the value is laid out "
    "evenly (docs/api.md, the output transport)"
)
@pytest.mark.parametrize("dedup", ["per_device", "auto", "replicated"])
def test_uneven_sharding_writes_no_padding_and_crops_padded_tiles(tap_path, dedup):
    # 2 and 5 rows over the 4-way "data" axis: XLA pads every tile to
    # ceil(rows / 4) rows, the last tiles past the end. Those devices hold no
    # element of the value (nothing may be written for them) and the tile
    # cut by the end holds fewer rows than it carries (only those are the
    # value); every record says which slice it is.
    mesh = _mesh()
    x = _x(mesh, P("data", "model"))

    @jax.jit
    def step(v):
        pmaptap.tap(v[:2, :2], "two", dedup=dedup, step=0)
        pmaptap.tap(v[:5, :] * 1.0, "five", dedup=dedup, step=0)
        return v

    with pmaptap.Session(tap_path, run="t"):
        step(x)
    want = {"two": np.arange(64.0).reshape(8, 8)[:2, :2], "five": np.arange(64.0).reshape(8, 8)[:5]}
    recs = pmaptap.read(tap_path)
    for name, full in want.items():
        rs = [r for r in recs if r["name"] == name]
        cover = np.zeros(full.shape, int)
        for r in rs:
            (a, b), (c, d) = r["index"]
            assert r["global_shape"] == list(full.shape)
            assert r["shape"] == [b - a, d - c], r
            np.testing.assert_array_equal(np.array(r["value"], np.float64), full[a:b, c:d])
            cover[a:b, c:d] += 1 if dedup != "per_device" else 0
        if dedup != "per_device":  # each slice once, whatever holds it
            assert (cover == 1).all(), (name, cover)
        np.testing.assert_array_equal(pmaptap.assemble(tap_path, name, 0), full)
    # devices past the end (rows 2..3 of "two" over 4 tiles: devices 4-7)
    # wrote nothing for "two"
    held = {d for r in recs if r["name"] == "two" for d in r.get("devices") or [r.get("device")]}
    assert held == {0, 1, 2, 3}, held


def test_explicit_axes_give_the_same_records(tap_path):
    mesh = _mesh([3, 6, 0, 5, 1, 7, 2, 4], explicit=True)
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.arange(64.0).reshape(8, 8), P("data", "model"))
        x2 = jax.device_put(jnp.arange(64.0).reshape(8, 8), P("data", None))
        with pmaptap.Session(tap_path, run="t"):
            y = _step("per_device", "pd")(x)
            y2 = _step("auto", "au")(x2)
    recs = pmaptap.read(tap_path)
    _check_per_device([r for r in recs if r["name"] == "pd"], y, mesh)
    auto = [r for r in recs if r["name"] == "au"]
    assert len(auto) == 4 and all(len(r["devices"]) == 2 for r in auto)
    for r in auto:
        i0, i1 = r["index"][0]
        np.testing.assert_array_equal(np.array(r["value"], np.float32), np.asarray(y2)[i0:i1])


def _collectives(text: str) -> dict:
    return {c: len(re.findall(rf"\b{c}(-start)?\(", text)) for c in COLLECTIVES}


@pytest.mark.parametrize(
    "spec", [P("data", "model"), P("data", None), P(None, "model"), P()], ids=str
)
@pytest.mark.parametrize("dedup", ["per_device", "auto"])
def test_no_added_collectives(spec, dedup):
    mesh = _mesh()
    x = _x(mesh, spec)

    def base(x):
        y = jnp.sin(x) * 2
        return y, jnp.sum(y)

    def tapped(x):
        y, loss = base(x)
        pmaptap.tap(y, "act", dedup=dedup)
        pmaptap.tap({"y": y, "loss": loss}, "tree", dedup=dedup)
        return y, loss

    plain = _collectives(jax.jit(base).lower(x).compile().as_text())
    with_tap = _collectives(jax.jit(tapped).lower(x).compile().as_text())
    assert with_tap == plain, (with_tap, plain)


@pytest.mark.callback_only("its steps run in a subprocess: the transport fixture cannot reach them")
def test_no_rematerialization_warning_and_console_line():
    # No session: the console prints one line per shard. XLA's warning about
    # a gather goes to stderr of the process, so it runs in its own.
    proc = run_python("""
        import jax, jax.numpy as jnp, numpy as np, pmaptap
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
        x = jax.device_put(jnp.arange(64.).reshape(8, 8), NamedSharding(mesh, P("data", "model")))
        @jax.jit
        def step(x):
            y = jnp.sin(x) * 2
            pmaptap.tap(y, "act", dedup="per_device")
            return y
        step(x)
        jax.effects_barrier()
    """)
    assert "rematerialization" not in proc.stderr, proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.startswith("[pmaptap] act step=0")]
    assert len(lines) == 8, proc.stderr
    assert any("device=5 data=2 model=1 index=[4:6, 4:8]: [[" in l for l in lines), lines


def test_fully_replicated_scalar_is_one_record_per_step(tap_path):
    mesh = _mesh()
    x = _x(mesh, P("data", "model"))

    @jax.jit
    def step(x):
        loss = jnp.mean(jnp.sin(x))
        pmaptap.tap(loss, "loss")
        return loss

    with pmaptap.Session(tap_path, run="t"):
        for _ in range(3):
            loss = step(x)
    recs = pmaptap.read(tap_path)
    assert [r["step"] for r in recs] == [0, 1, 2]
    assert all(r["kind"] == "replicated" for r in recs)
    assert recs[-1]["value"] == pytest.approx(float(loss))


def test_automatic_steps_and_every_count_per_device(tap_path):
    mesh = _mesh()
    x = _x(mesh, P("data", "model"))

    @jax.jit
    def step(x):
        pmaptap.tap(x, "x", dedup="per_device", every=2)
        return x + 1

    with pmaptap.Session(tap_path, run="t"):
        for _ in range(5):
            x = step(x)
    recs = pmaptap.read(tap_path)
    steps: dict[int, list[int]] = {}
    for r in recs:
        steps.setdefault(r["device"], []).append(r["step"])
    assert steps == {d: [0, 2, 4] for d in range(8)}
    r = next(r for r in recs if r["device"] == 3 and r["step"] == 4)
    i0, j0 = r["index"][0][0], r["index"][1][0]
    assert r["value"][0][0] == float(i0 * 8 + j0 + 4)


def test_traced_step_with_every(tap_path):
    mesh = _mesh()
    x = _x(mesh, P("data", "model"))

    @jax.jit
    def step(x, i):
        pmaptap.tap(x * i, "x", step=i, every=3, dedup="per_device")
        return x

    with pmaptap.Session(tap_path, run="t"):
        for i in range(7):
            step(x, jnp.int32(i))
    recs = pmaptap.read(tap_path)
    assert sorted({r["step"] for r in recs}) == [0, 3, 6]
    assert len(recs) == 24 and {r["device"] for r in recs} == set(range(8))


def test_tap_grad_cotangents_per_shard(tap_path):
    mesh = _mesh()
    x = _x(mesh, P("data", "model"))

    def loss(x):
        y = pmaptap.tap_grad(jnp.sin(x), "dy", dedup="per_device")
        return jnp.sum(y * y)

    with pmaptap.Session(tap_path, run="t"):
        jax.jit(jax.grad(loss))(x)
    recs = pmaptap.read(tap_path)
    assert len(recs) == 8 and {r["device"] for r in recs} == set(range(8))
    full = np.asarray(2 * jnp.sin(jnp.arange(64.0).reshape(8, 8)))
    for r in recs:
        assert r["pass"] == "backward"
        (a, b), (c, d) = r["index"]
        np.testing.assert_allclose(np.array(r["value"]), full[a:b, c:d], rtol=1e-6)


def test_max_value_bytes_makes_statistics_of_each_shard(tap_path):
    mesh = _mesh()
    x = _x(mesh, P("data", "model"))
    with pmaptap.configured(max_value_bytes=16):
        with pmaptap.Session(tap_path, run="t"):
            y = _step("per_device")(x)
    recs = pmaptap.read(tap_path)
    assert len(recs) == 8
    for s in y.addressable_shards:
        r = next(r for r in recs if r["device"] == s.device.id)
        assert r["summarized"] and r["index"] == _index_of(s, y.shape)
        data = np.asarray(s.data)
        assert r["value"]["min"] == pytest.approx(float(data.min()))
        assert r["value"]["max"] == pytest.approx(float(data.max()))
        assert r["value"]["mean"] == pytest.approx(float(data.mean()), rel=1e-5)


def test_untapped_removes_sharded_taps(tap_path):
    mesh = _mesh()
    x = _x(mesh, P("data", "model"))

    def step(x):
        pmaptap.tap(x, "x", dedup="per_device")
        return x * 2

    with pmaptap.Session(tap_path, run="t"):
        jax.jit(pmaptap.untapped(step))(x)
    assert pmaptap.read(tap_path) == []


def test_cli_views_show_index(tap_path, capsys):
    from pmaptap import cli

    mesh = _mesh()
    with pmaptap.Session(tap_path, run="t"):
        _step("per_device")(_x(mesh, P("data", "model")))
    assert cli.main(["validate", tap_path]) == 0
    capsys.readouterr()
    cli.main(["show", tap_path])
    assert "4:6,4:8" in capsys.readouterr().out
    out_csv = tap_path + ".csv"
    cli.main(["export", tap_path, "--csv", out_csv])
    import csv

    with open(out_csv) as f:
        rows = list(csv.DictReader(f))
    assert {r["index"] for r in rows if r["device"] == "5"} == {"4:6,4:8"}
    capsys.readouterr()
    cli.main(["summary", tap_path])
    assert "act" in capsys.readouterr().out


def test_single_device_jit_is_unchanged(tap_path):
    @jax.jit
    def step(x):
        pmaptap.tap(x, "x", dedup="per_device")
        return x

    with pmaptap.Session(tap_path, run="t"):
        step(jnp.arange(4.0))
    (r,) = pmaptap.read(tap_path)
    assert "index" not in r and r["value"] == [0.0, 1.0, 2.0, 3.0]


def test_placement_internals_still_exist():
    # The per-shard lowering reads JAX internals (see placement.py); a JAX
    # upgrade that moves them must fail here, loudly, not silently degrade.
    from pmaptap._trace import placement

    placement.check_shard_internals()


MULTI = """
    import os, jax, jax.numpy as jnp, numpy as np, pmaptap
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from pmaptap import distributed
    distributed.initialize()
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    def put(spec):
        s = NamedSharding(mesh, spec)
        full = np.arange(64.0, dtype=np.float32).reshape(8, 8)
        return jax.make_array_from_callback((8, 8), s, lambda i: full[i])
    @jax.jit
    def step(a, b):
        ya, yb = jnp.sin(a) * 2, jnp.cos(b)
        pmaptap.tap(ya, "pd", dedup="per_device")
        # Replicated along "data": each slice has holders on both processes.
        pmaptap.tap(yb, "rep", dedup="auto")
        return ya, yb
    with pmaptap.Session(os.environ["TAP"], run="mp"):
        for _ in range(2):
            ya, yb = step(put(P("data", "model")), put(P(None, "model")))
    import json
    where = {d.id: [d.process_index, [[i.start or 0, i.stop or 8] for i in idx]]
             for d, idx in ya.sharding.devices_indices_map((8, 8)).items()}
    print("MAP " + json.dumps(where), flush=True)
"""


@pytest.mark.callback_only("its steps run in a subprocess: the transport fixture cannot reach them")
def test_two_processes_write_each_shard_once(tmp_path):
    path = str(tmp_path / "mp.jsonl")
    proc, _ = run_launch(2, 4, python_cmd(MULTI), timeout=240, launcher_timeout=200, TAP=path)
    assert proc.returncode == 0, job_failed(proc)
    recs = pmaptap.read(path)
    line = next(l for l in proc.stdout.splitlines() if "MAP " in l)
    where = {int(k): v for k, v in json.loads(line.split("MAP ", 1)[1]).items()}
    assert sorted(p for p, _ in where.values()) == [0] * 4 + [1] * 4
    full = np.arange(64.0, dtype=np.float32).reshape(8, 8)
    pd = [r for r in recs if r["name"] == "pd"]
    assert len(pd) == 16
    for step in (0, 1):
        rs = [r for r in pd if r["step"] == step]
        assert sorted(r["device"] for r in rs) == sorted(where)
        for r in rs:
            assert [r["process"], r["index"]] == where[r["device"]]
            (a, b), (c, d) = r["index"]
            np.testing.assert_allclose(r["value"], np.sin(full[a:b, c:d]) * 2, rtol=1e-6)
    rep = [r for r in recs if r["name"] == "rep"]
    # 2 slices x 2 steps, each written once for the job with its 4 holders.
    assert len(rep) == 4, [(r["step"], r["index"], r["process"]) for r in rep]
    for r in rep:
        assert r["kind"] == "replicated" and len(r["devices"]) == 4
        assert r["processes"] == [0, 1] and not r.get("divergent")
        (a, b), (c, d) = r["index"]
        assert (a, b) == (0, 8)
        np.testing.assert_allclose(r["value"], np.cos(full[:, c:d]), rtol=1e-6)
    from pmaptap import cli

    assert cli.main(["validate", path]) == 0, json.dumps(recs[:3])


@pytest.mark.callback_only("its steps run in a subprocess: the transport fixture cannot reach them")
def test_train_variant_jit_two_processes(tmp_path):
    from conftest import expected_step0_grad_norm

    out = str(tmp_path / "jit.jsonl")
    proc, _ = run_launch(
        2,
        4,
        train_argv(out, "--variant", "jit", "--no-summary", steps=3, batch=8),
        timeout=240,
        launcher_timeout=200,
    )
    assert proc.returncode == 0, job_failed(proc)
    recs = pmaptap.read(out)
    assert [r["step"] for r in recs if r["name"] == "loss"] == [0, 1, 2]
    for name in ("grad_norm", "act"):
        for step in range(3):
            rs = [r for r in recs if r["name"] == name and r["step"] == step]
            assert len(rs) == 8 and len({r["device"] for r in rs}) == 8
            assert sorted(r["process"] for r in rs) == [0] * 4 + [1] * 4
    for r in recs:
        if r["name"] == "grad_norm" and r["step"] == 0:
            ((g, g1),) = r["index"]
            assert g1 == g + 1 and r["process"] == g // 4
            assert r["value"][0] == pytest.approx(expected_step0_grad_norm(g, 8), rel=1e-4)
        if r["name"] == "act":
            (a, b), (c, d) = r["index"]
            assert (b - a, c, d) == (8, 0, 32) and r["process"] == a // 32
    from pmaptap import cli

    assert cli.main(["validate", out]) == 0


def _flax_mlp():
    from flax import nnx

    init = nnx.initializers.lecun_normal()

    class MLP(nnx.Module):
        """Tensor parallel: fc1 split over "model" by columns, fc2 by rows."""

        def __init__(self, rngs):
            self.fc1 = nnx.Linear(
                8, 16, kernel_init=nnx.with_partitioning(init, (None, "model")), rngs=rngs
            )
            self.fc2 = nnx.Linear(
                16, 4, kernel_init=nnx.with_partitioning(init, ("model", None)), rngs=rngs
            )

        def __call__(self, x):
            h = nnx.relu(self.fc1(x))
            pmaptap.tap(h, "h", dedup="per_device")
            h = pmaptap.tap_grad(h, "dh", dedup="per_device")
            y = self.fc2(h)
            pmaptap.tap(y, "y")
            return y

    return nnx, MLP


def test_flax_nnx_data_and_tensor_parallel_step(tap_path, transport):
    # A Flax NNX train step on a 4x2 (data x model) mesh: taps in __call__,
    # inside the differentiated function, in one group() with the loss.
    import optax

    nnx, MLP = _flax_mlp()
    mesh = _mesh()
    with jax.set_mesh(mesh):
        model = MLP(nnx.Rngs(0))
        w1 = np.asarray(model.fc1.kernel[...])
        b1 = np.asarray(model.fc1.bias[...])
        opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        xs = np.linspace(-1, 1, 16 * 8, dtype=np.float32).reshape(16, 8)
        x = jax.device_put(xs, P("data", None))
        t = jax.device_put(np.zeros((16, 4), np.float32), P("data", None))

        def train_step(model, opt, x, t):
            def loss_fn(m):
                with pmaptap.group():
                    loss = jnp.mean((m(x) - t) ** 2)
                    pmaptap.tap(loss, "loss")
                return loss

            loss, grads = nnx.value_and_grad(loss_fn)(model)
            opt.update(model, grads)
            return loss

        gdef, state = nnx.split((model, opt))

        def pure(state, x, t):
            m, o = nnx.merge(gdef, state)
            return train_step(m, o, x, t)

        # The forward taps and the loss: one partitioned callback; the
        # backward tap (the cotangent, in the transposed program) another.
        # As outputs (pmaptap.jit): the compiled step holds no host call at all.
        calls = (2, 0) if transport == "callback" else (0, 0)
        assert _host_calls(jax.jit(pure).lower(state, x, t).compile().as_text()) == calls
        step = nnx.jit(train_step)
        with pmaptap.Session(tap_path, run="flax"):
            losses = [float(step(model, opt, x, t)) for _ in range(2)]
    recs = pmaptap.read(tap_path)
    h_full = np.maximum(xs @ w1 + b1, 0)
    coords = {int(d.id): c for c, d in np.ndenumerate(mesh.devices)}
    for name in ("h", "dh"):
        for step_ in (0, 1):
            rs = [r for r in recs if r["name"] == name and r["step"] == step_]
            assert sorted(r["device"] for r in rs) == list(range(8)), (name, step_)
            covered = np.zeros((16, 16), int)
            for r in rs:
                assert r["coords"] == dict(zip(("data", "model"), coords[r["device"]]))
                (a, b), (c, d) = r["index"]
                covered[a:b, c:d] += 1
                if name == "h" and step_ == 0:
                    np.testing.assert_allclose(r["value"], h_full[a:b, c:d], rtol=1e-5, atol=1e-6)
            assert (covered == 1).all()  # each element in exactly one shard
    # y is sharded over "data" and replicated over "model": one record per
    # slice, compared across its 2 holders.
    ys = [r for r in recs if r["name"] == "y" and r["step"] == 0]
    assert len(ys) == 4 and all(r["replicas"] == 2 for r in ys)
    loss = [r for r in recs if r["name"] == "loss"]
    assert [r["value"] for r in loss] == pytest.approx(losses)
    assert all(r["replicas"] == 8 and r["copies_seen"] == 1 for r in loss)


def _host_calls(hlo: str) -> tuple[int, int]:
    """(partitioned, whole) python host callbacks in a compiled program."""
    return (
        len(re.findall(r'custom_call_target="xla_ffi_partitioned_python_cpu_callback"', hlo)),
        len(re.findall(r'custom_call_target="xla_ffi_python_cpu_callback"', hlo)),
    )
