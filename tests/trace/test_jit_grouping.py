"""Taps under plain ``jax.jit`` on a mesh (issue 26, points 2 and 5): the
per-shard taps of one traced step and its scalar taps share ONE host call
per device (automatically and in ``pmaptap.group()``), counted in the
compiled HLO, with records exactly those of the taps emitted one by one; and
a replicated scalar names every device and process its sharding puts it on,
saying that one copy was read (``copies_seen``)."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pmaptap
from conftest import job_failed, python_cmd, run_launch

# The custom-call targets of XLA's python callbacks on CPU: partitioned (one
# call per device with its shards) and not (one call, from device 0).
PARTITIONED = "xla_ffi_partitioned_python_cpu_callback"
WHOLE = "xla_ffi_python_cpu_callback"
ORDER = [3, 6, 0, 5, 1, 7, 2, 4]


def _mesh(order=None) -> Mesh:
    devs = np.array(jax.devices())
    if order is not None:
        devs = devs[np.array(order)]
    return Mesh(devs.reshape(4, 2), ("data", "model"))


def _x(mesh: Mesh, spec=None) -> jax.Array:
    spec = P("data", "model") if spec is None else spec
    return jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, spec))


def host_calls(fn, *args) -> dict[str, int]:
    """Python host callbacks in the compiled (partitioned) program."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    return {
        "partitioned": len(re.findall(rf'custom_call_target="{PARTITIONED}"', text)),
        "whole": len(re.findall(rf'custom_call_target="{WHOLE}"', text)),
    }


def _records(path) -> list[str]:
    """Records without their wall-clock time, comparable as a multiset."""
    out = []
    for r in pmaptap.read(path):
        d = dict(r)
        d.pop("time", None)
        out.append(json.dumps(d, sort_keys=True, default=str))
    return sorted(out)


def _ten_taps(x, i):
    """8 sharded taps (several shardings, dedups, a pytree, a traced step
    with every) and 2 scalar ones, as a step would have them."""
    y = jnp.sin(x) * 2
    pmaptap.tap(y, "y", dedup="per_device")
    pmaptap.tap(y + 1, "y_auto")  # one holder per slice: per-device records
    pmaptap.tap(jnp.cos(x), "tree_a", dedup="per_device")
    pmaptap.tap({"a": y * 3, "b": jnp.tanh(x)}, "tree", dedup="per_device")
    pmaptap.tap(y[:, :4], "half", dedup="per_device")
    pmaptap.tap(x.astype(jnp.bfloat16), "bf16", dedup="per_device")
    pmaptap.tap((x > 30).astype(jnp.int4), "i4", dedup="per_device")
    pmaptap.tap(y * i, "every2", step=i, every=2, dedup="per_device")
    pmaptap.tap(jnp.mean(y), "loss")
    pmaptap.tap(jnp.float32(0.1), "lr")
    return y


def _run(path, fn, args_of_step, steps=3):
    with pmaptap.Session(str(path), run="g"):
        for s in range(steps):
            jax.block_until_ready(fn(*args_of_step(s)))
    return _records(path)


def test_sharded_and_scalar_taps_of_a_step_are_one_host_call(tmp_path):
    mesh = _mesh(ORDER)
    x = _x(mesh)

    def args(s):
        return x + s, jnp.int32(s)

    calls, recs = {}, {}
    for auto in (True, False):
        with pmaptap.configured(auto_group=auto):
            fn = jax.jit(lambda x, i: _ten_taps(x, i))
            calls[auto] = host_calls(lambda x, i: _ten_taps(x, i), *args(0))
            recs[auto] = _run(tmp_path / f"{auto}.jsonl", fn, args)
    # Grouped: ONE partitioned callback (the step's `every=2` tap sits in
    # its own cond, which is the second); one by one: a callback per tap.
    assert calls[True] == {"partitioned": 2, "whole": 0}, calls
    assert calls[False] == {"partitioned": 8, "whole": 2}, calls
    # Grouping adds no collective: each device sends what it holds.
    texts = []
    for auto in (True, False):
        with pmaptap.configured(auto_group=auto):
            f = jax.jit(lambda x, i: _ten_taps(x, i))
            texts.append(f.lower(*args(0)).compile().as_text())
    for op in ("all-gather", "all-reduce", "all-to-all", "collective-permute"):
        n = [len(re.findall(rf"\b{op}(-start)?\(", t)) for t in texts]
        assert n[0] == n[1], (op, n)
    assert recs[True] == recs[False]
    got = [json.loads(r) for r in recs[True]]
    per_tap = {}
    for r in got:
        per_tap.setdefault(r["name"], []).append(r)
    assert {k: len(v) for k, v in per_tap.items()} == {
        "y": 24,
        "y_auto": 24,
        "tree_a": 24,
        "tree": 24,
        "half": 24,
        "bf16": 24,
        "i4": 24,
        "every2": 16,  # steps 0 and 2
        "loss": 3,
        "lr": 3,
    }
    assert sorted({r["step"] for r in per_tap["every2"]}) == [0, 2]
    # Values and placement are each device's own shard (step 1: x + 1).
    full = np.arange(64.0, dtype=np.float32).reshape(8, 8) + 1
    coords = {int(d.id): c for c, d in np.ndenumerate(mesh.devices)}
    for r in per_tap["i4"] + per_tap["half"]:
        if r["step"] != 1:
            continue
        assert r["coords"] == dict(zip(("data", "model"), coords[r["device"]]))
        (a, b), (c, d) = r["index"]
        want = (full[a:b, c:d] > 30) if r["name"] == "i4" else np.sin(full[:, :4][a:b, c:d]) * 2
        assert r["dtype"] == ("int4" if r["name"] == "i4" else "float32")
        np.testing.assert_allclose(np.array(r["value"], np.float32), want, rtol=1e-6)


def test_group_block_makes_one_host_call_without_auto_grouping(tmp_path):
    mesh = _mesh()
    x = _x(mesh)

    def step(x):
        with pmaptap.group():
            for k in range(16):
                pmaptap.tap(x * k, f"t{k}", dedup="per_device")
            pmaptap.tap(jnp.sum(x), "loss")
        return x

    with pmaptap.configured(auto_group=False):
        assert host_calls(step, x) == {"partitioned": 1, "whole": 0}
        with pmaptap.Session(str(tmp_path / "g.jsonl"), run="g"):
            jax.jit(step)(x)
        ungrouped = lambda x: [pmaptap.tap(x * k, f"t{k}", dedup="per_device") for k in range(16)]
        assert host_calls(ungrouped, x) == {"partitioned": 16, "whole": 0}
    # The same 16 taps with automatic grouping (the default), no block.
    assert host_calls(lambda v: ungrouped(v) and v, x) == {"partitioned": 1, "whole": 0}
    recs = pmaptap.read(str(tmp_path / "g.jsonl"))
    assert len(recs) == 16 * 8 + 1
    for r in recs:
        if r["name"] == "t5" and r["device"] == 5:
            (a, b), (c, d) = r["index"]
            np.testing.assert_array_equal(r["value"], 5 * np.arange(64.0).reshape(8, 8)[a:b, c:d])


def test_scalar_taps_alone_are_one_call_from_device_zero(tmp_path):
    mesh = _mesh()
    x = _x(mesh)

    def step(x):
        loss = jnp.mean(jnp.sin(x))
        pmaptap.tap(loss, "loss")
        pmaptap.tap(loss * 2, "loss2")
        pmaptap.tap(jnp.int32(7), "k", dedup="per_device")
        return loss

    # No sharded tap: no partitioned callback (8 host calls), one from device 0.
    assert host_calls(step, x) == {"partitioned": 0, "whole": 1}


def test_replicated_scalar_names_every_device_and_says_one_copy_was_seen(tmp_path):
    mesh = _mesh(ORDER)
    x = _x(mesh)

    def step(x, with_shards):
        loss = jnp.mean(jnp.sin(x))
        pmaptap.tap(loss, "loss")
        pmaptap.tap(loss, "loss_pd", dedup="per_device")
        if with_shards:  # the scalars ride in the partitioned callback
            pmaptap.tap(x, "x", dedup="per_device")
        return loss

    path = str(tmp_path / "r.jsonl")
    with pmaptap.Session(path, run="r"):
        for with_shards in (False, True):
            f = jax.jit(lambda x, w=with_shards: step(x, w))
            for _ in range(2):
                loss = f(x)
    recs = pmaptap.read(path)
    first = int(mesh.devices.flat[0].id)
    for name in ("loss", "loss_pd"):
        rs = [r for r in recs if r["name"] == name]
        assert [r["step"] for r in rs] == [0, 1, 2, 3]
        for r in rs:
            assert r["value"] == pytest.approx(float(loss))
            if name == "loss":
                assert r["kind"] == "replicated" and r["replicas"] == 8
                assert sorted(r["devices"]) == list(range(8)) and r["devices"][0] == first
                assert r["processes"] == [0] and r["copies_seen"] == 1
            else:  # the one copy read is device 0's: its exact record
                assert r["kind"] == "per_device" and "copies_seen" not in r
                assert r["device"] == first and r["coords"] == {"data": 0, "model": 0}
    assert len([r for r in recs if r["name"] == "x"]) == 16
    from pmaptap import cli

    assert cli.main(["validate", path]) == 0


def test_single_device_scalar_is_unchanged(tmp_path):
    path = str(tmp_path / "one.jsonl")
    with pmaptap.Session(path, run="o"):
        jax.jit(lambda v: pmaptap.tap(jnp.sum(v), "loss"))(jnp.arange(4.0))
    (r,) = pmaptap.read(path)
    assert r["replicas"] == 1 and "copies_seen" not in r


def test_validate_checks_copies_seen(tmp_path, capsys):
    from pmaptap import cli

    base = {
        "run": "v",
        "name": "loss",
        "step": 0,
        "kind": "replicated",
        "value": 1.0,
        "dtype": "float32",
        "shape": [],
        "process": 0,
        "time": 1.0,
        "host": "h",
        "replicas": 2,
        "devices": [0, 1],
        "processes": [0],
    }
    for seen, ok in ((1, True), (2, True), (0, False), (3, False), ("1", False)):
        path = tmp_path / f"v{seen!r}.jsonl"
        path.write_text(json.dumps({**base, "copies_seen": seen}) + "\n")
        assert (cli.main(["validate", str(path)]) == 0) is ok, seen
        if not ok:
            assert "copies_seen" in capsys.readouterr().out


MULTI = """
    import os, jax, jax.numpy as jnp, numpy as np, pmaptap
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from pmaptap import distributed
    distributed.initialize()
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    s = NamedSharding(mesh, P("data", "model"))
    full = np.arange(64.0, dtype=np.float32).reshape(8, 8)
    x = jax.make_array_from_callback((8, 8), s, lambda i: full[i])
    @jax.jit
    def step(x):
        y = jnp.sin(x)
        pmaptap.tap(y, "y", dedup="per_device")
        pmaptap.tap(y * 2, "y2", dedup="per_device")
        pmaptap.tap(jnp.mean(y), "loss")
        return y
    for layout in ("file", "sharded"):
        with pmaptap.Session(os.environ["TAP"] + "." + layout, run="mp", layout=layout):
            for _ in range(6):
                step(x)
"""


def test_two_processes_grouped_step_and_replicated_scalar(tmp_path):
    path = str(tmp_path / "mp.jsonl")
    proc, _ = run_launch(2, 4, python_cmd(MULTI), timeout=240, launcher_timeout=200, TAP=path)
    assert proc.returncode == 0, job_failed(proc)
    for layout in ("file", "sharded"):
        recs = pmaptap.read(f"{path}.{layout}")
        for name in ("y", "y2"):
            rs = [r for r in recs if r["name"] == name]
            assert len(rs) == 6 * 8, (layout, name, len(rs))
            assert sorted(r["process"] for r in rs if r["step"] == 0) == [0] * 4 + [1] * 4
        loss = [r for r in recs if r["name"] == "loss"]
        # Once per step for the job (read on device 0, process 0), naming
        # all 8 devices on both processes; in the sharded layout it is not
        # left to an "owner" process that never saw it.
        assert [r["step"] for r in loss] == list(range(6)), (layout, loss)
        devices = sorted(r["device"] for r in recs if r["name"] == "y" and r["step"] == 0)
        assert len(set(devices)) == 8
        for r in loss:
            assert r["processes"] == [0, 1] and sorted(r["devices"]) == devices
            assert r["replicas"] == 8 and r["copies_seen"] == 1 and r["process"] == 0
            assert r["value"] == pytest.approx(float(np.mean(np.sin(np.arange(64.0)))), rel=1e-4)


def test_a_vmapped_scalar_riding_in_a_partitioned_call_is_read_whole(tmp_path):
    # vmap of a jitted step: its grouped scalar tap gains the batch axis,
    # which may be split over the devices; partition 0 must still read the
    # whole batch (the scalar's operand is made replicated).
    mesh = _mesh()
    x = _x(mesh)

    def step(row):
        pmaptap.tap(row, "row", dedup="per_device")
        pmaptap.tap(jnp.sum(row), "rowsum")
        return row

    f = jax.jit(jax.vmap(jax.jit(step)))
    assert host_calls(jax.vmap(jax.jit(step)), x) == {"partitioned": 1, "whole": 0}
    path = str(tmp_path / "v.jsonl")
    with pmaptap.Session(path, run="v"):
        jax.block_until_ready(f(x))
    recs = pmaptap.read(path)
    (r,) = [r for r in recs if r["name"] == "rowsum"]
    assert r["batch_dims"] == 1 and r["shape"] == [8]
    np.testing.assert_array_equal(r["value"], np.arange(64.0).reshape(8, 8).sum(1))
    assert len([r for r in recs if r["name"] == "row"]) == 8


def test_taps_inside_the_differentiated_function_join_the_step_call(tmp_path):
    # Taps in a model's forward pass run inside grad's trace (as in a Flax
    # train step): they wait for the jitted step's end like its own taps,
    # and all of them share one partitioned call.
    mesh = _mesh()
    x = _x(mesh)

    def step(x):
        def loss_fn(w):
            h = jnp.sin(w)
            pmaptap.tap(h, "h", dedup="per_device")
            loss = jnp.mean(h**2)
            pmaptap.tap(loss, "loss_in")
            return loss

        loss, g = jax.value_and_grad(loss_fn)(x)
        pmaptap.tap(g, "g", dedup="per_device")
        pmaptap.tap(loss, "loss")
        return g

    calls, recs = {}, {}
    for auto in (True, False):
        with pmaptap.configured(auto_group=auto):
            calls[auto] = host_calls(lambda x: step(x), x)
            recs[auto] = _run(
                tmp_path / f"d{auto}.jsonl", jax.jit(lambda x: step(x)), lambda s: (x,)
            )
    assert calls == {
        True: {"partitioned": 1, "whole": 0},
        False: {"partitioned": 2, "whole": 2},
    }, calls
    assert recs[True] == recs[False]
    names = [json.loads(r)["name"] for r in recs[True]]
    assert {n: names.count(n) for n in set(names)} == {"h": 24, "g": 24, "loss_in": 3, "loss": 3}
