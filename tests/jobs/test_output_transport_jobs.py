"""The output transport across real processes (jax.distributed on loopback,
started by pmaptap.launch, 2 processes x 4 CPU devices): a pmaptap.pmap
step and a pmaptap.jit step sharded over all 8 devices write, field for
field, the records the callback transport (jax.pmap / jax.jit) writes for
the same program, and the steps are never waited on.

Device ids on multi-process CPU: process p's k-th device is p*2048+k."""

from __future__ import annotations

import json

import pmaptap
from conftest import job_failed, prefixed, python_cmd, run_launch

_JOB = """
    import os
    import jax, jax.numpy as jnp, numpy as np
    from jax import lax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import pmaptap, pmaptap.distributed as dist

    dist.initialize()
    p = jax.process_index()
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    start = np.arange(32.0, dtype=np.float32).reshape(8, 4)

    def pbody(x):
        pmaptap.tap(lax.psum(x.sum(), "i"), "p_loss", dedup="replicated")
        pmaptap.tap(x, "p_x", dedup="per_device")
        pmaptap.tap(x.mean(), "p_auto")            # differs per device
        pmaptap.tap(lax.pmean(x, "i"), "p_mean")   # the same on all 8

        def body(c, xi):
            pmaptap.tap(xi, "p_scan", dedup="per_device")
            return c, None

        lax.scan(body, 0.0, x)
        return x * 2

    def jbody(x):
        pmaptap.tap(x.sum(), "j_loss")                             # replicated
        pmaptap.tap(x, "j_x", dedup="per_device")                  # one shard per device
        pmaptap.tap(x.sum(axis=1), "j_rows", dedup="per_device")   # copies along "model"
        pmaptap.tap(x.sum(axis=1), "j_rows_auto")
        pmaptap.tap({"w": x[0], "m": x.mean()}, "j_tree")
        return x + 1

    for transport in ("callback", "outputs"):
        if transport == "callback":
            jit, pmap = jax.jit, jax.pmap
        else:
            jit, pmap = pmaptap.jit, pmaptap.pmap
        with pmaptap.Session(os.environ["TAP_" + transport], run="mp"):
            f = pmap(pbody, axis_name="i")
            g = jit(jbody)
            xl = jnp.arange(4.0 * 3).reshape(4, 3) + 100 * p
            xg = jax.make_array_from_callback(
                (8, 4), NamedSharding(mesh, P("data", "model")), lambda i: start[i]
            )
            for step in range(3):
                xl = f(xl)
                xg = g(xg)
                if transport == "callback":
                    # Host callbacks of steps dispatched ahead abort the CPU
                    # backend (a rendezvous timeout): waited for.
                    jax.block_until_ready((xl, xg))
            # The output transport's steps were never waited for.
    print("DONE", flush=True)
"""


def _load(path) -> list[dict]:
    with open(path) as f:
        recs = [json.loads(line) for line in f]
    for r in recs:
        r.pop("time")
    return sorted(
        recs,
        key=lambda r: json.dumps(
            [r["name"], r["step"], r.get("coords"), r.get("index"), r["value"]]
        ),
    )


def test_two_processes_write_what_the_callback_transport_writes(tmp_path):
    cb, out = str(tmp_path / "cb.jsonl"), str(tmp_path / "out.jsonl")
    files = {"TAP_callback": cb, "TAP_outputs": out}
    proc, _ = run_launch(2, 4, python_cmd(_JOB), launcher_timeout=200, timeout=300, **files)
    assert proc.returncode == 0, job_failed(proc)
    assert all("DONE" in prefixed(proc.stdout, p) for p in (0, 1)), job_failed(proc)
    want, got = _load(cb), _load(out)
    assert len(got) == len(want)
    for o, c in zip(got, want):
        if c["kind"] == "replicated":
            # Whichever process writes a replicated value first writes it
            # (the other finds it in the file): a race in either transport.
            assert o["process"] in o["processes"], o
            o, c = {**o, "process": None}, {**c, "process": None}
        assert o == c
    # What the records say, read back (reconciled as a user reads them).
    recs = pmaptap.read(out)
    by = {}
    for r in recs:
        by.setdefault(r["name"], []).append(r)
    devices = {p * 2048 + k for p in (0, 1) for k in range(4)}
    for name in ("p_loss", "p_mean", "j_loss"):
        assert sorted(r["step"] for r in by[name]) == [0, 1, 2], name
        assert all(set(r["devices"]) == devices for r in by[name]), name
    for name in ("p_x", "j_x", "p_auto"):
        for step in range(3):
            got_devs = sorted(r["device"] for r in by[name] if r["step"] == step)
            assert got_devs == sorted(devices), (name, step)
    # Each process wrote its own devices' values.
    assert {(r["device"] // 2048, r["process"]) for r in by["p_x"]} == {(0, 0), (1, 1)}
    # The pmap step's per-device values: process p's device k holds
    # arange(3) + 3k + 100p, doubled each step.
    for r in by["p_x"]:
        p, k = divmod(r["device"], 2048)
        assert r["value"] == [(3 * k + j + 100 * p) * 2 ** r["step"] for j in range(3)], r
    # The jit step's shards: global rows/columns where the mesh puts them.
    for r in by["j_x"]:
        (r0, r1), (c0, c1) = r["index"]
        assert r["value"] == [
            [float(4 * i + j + r["step"]) for j in range(c0, c1)] for i in range(r0, r1)
        ], r
