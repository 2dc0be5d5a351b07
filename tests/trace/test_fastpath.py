"""The transport fast path: gathered copies, verified replicas, tap groups.
Records must be identical to the one-callback-per-device path; only the
number of host calls changes."""

from __future__ import annotations

import contextlib
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pmaptap
from conftest import run_python


@pytest.fixture
def host_calls(spy_deliveries):
    """Names of the specs reaching the host, one entry per host callback."""
    return spy_deliveries()


def _step(v):
    loss = lax.pmean(jnp.sum(v), "i")
    pmaptap.tap(v, "y", dedup="per_device")
    pmaptap.tap(loss, "loss", dedup="replicated")
    pmaptap.tap(v * 0 + loss, "auto_same")
    pmaptap.tap(v, "auto_diff")
    return v


def _comparable(records):
    keep = (
        "name",
        "step",
        "kind",
        "value",
        "device",
        "coords",
        "replicas",
        "divergent",
        "dtype",
        "shape",
    )
    rows = [tuple((k, str(r.get(k))) for k in keep) for r in records]
    return sorted(rows)


def _run(tap_path, gather, grouped=False, steps=2, auto_group=False):
    # A fresh function object each run: JAX caches traces per function, and
    # the options are read when a tap is traced. Automatic grouping is off
    # unless asked: these tests count each tap's own transport.
    body = pmaptap.group()(_step) if grouped else (lambda v: _step(v))
    with pmaptap.configured(gather=gather, auto_group=auto_group):
        f = jax.pmap(body, axis_name="i")
        with pmaptap.Session(tap_path, run="fp"):
            for i in range(steps):
                f(jnp.arange(8.0) + i)
    return pmaptap.read(tap_path)


def test_gathered_records_equal_per_device_callbacks(tmp_path, host_calls):
    fast = _run(str(tmp_path / "fast.jsonl"), gather=True)
    fast_calls = len(host_calls)
    slow = _run(str(tmp_path / "slow.jsonl"), gather=False)
    assert _comparable(fast) == _comparable(slow)
    assert fast_calls == 4 * 2  # one per tap per step
    assert len(host_calls) - fast_calls == 4 * 2 * 8  # one per device


def test_group_is_one_callback_per_step_with_the_same_records(tmp_path, host_calls):
    grouped = _run(str(tmp_path / "g.jsonl"), gather=True, grouped=True)
    assert host_calls == ["pmaptap/group"] * 2
    plain = _run(str(tmp_path / "p.jsonl"), gather=True)
    assert _comparable(grouped) == _comparable(plain)


def test_large_replicated_value_uses_hashes_and_still_finds_divergence(
    session, tap_path, host_calls
):
    with pmaptap.configured(gather_max_bytes=64):

        @partial(jax.pmap, axis_name="i")
        def f(v):
            big = jnp.ones(256) * lax.pmean(v, "i")
            pmaptap.tap(big, "agree", dedup="replicated")
            bad = big + (lax.axis_index("i") == 3)
            pmaptap.tap(bad, "disagree", dedup="replicated")
            return v

        f(jnp.arange(8.0))
    session.flush()
    recs = pmaptap.read(tap_path)
    agree = [r for r in recs if r["name"] == "agree"]
    assert len(agree) == 1 and agree[0]["replicas"] == 8 and "divergent" not in agree[0]
    dis = sorted((r for r in recs if r["name"] == "disagree"), key=lambda r: r["replicas"])
    assert [r["replicas"] for r in dis] == [1, 7] and all(r["divergent"] for r in dis)
    assert dis[0]["devices"] == [3] and dis[0]["value"] == [4.5] * 256
    assert host_calls.count("agree") == 1 and host_calls.count("disagree") == 1


def test_verify_off_sends_one_unverified_copy(session, tap_path):
    with pmaptap.configured(verify_replicated=False):
        jax.pmap(lambda v: pmaptap.tap(v, "trust", dedup="replicated"))(jnp.arange(8.0))
    session.flush()
    (r,) = pmaptap.read(tap_path)
    assert r["verified"] is False and r["replicas"] == 8 and r["value"] == 0.0


def test_verify_off_divergent_copies_still_say_unverified(tmp_path):
    # A pmap over 4 devices, then over 8: devices 4-7 count their automatic
    # steps from 0, so step 1's copies are devices 0-3 of the second call
    # and devices 4-7 of the third, with different values. Both divergent
    # records are leaders' copies nobody compared on device: "verified":
    # false stays beside their holders (the holders list replaced it).
    path = str(tmp_path / "v.jsonl")
    f = jax.pmap(lambda v: pmaptap.tap(v, "trust", dedup="replicated"), axis_name="i")
    with pmaptap.configured(verify_replicated=False), pmaptap.Session(path, run="v"):
        for n, value in ((4, 1.0), (8, 2.0), (8, 3.0)):
            f(jnp.full((n,), value))
    at1 = [r for r in pmaptap.read(path) if r["step"] == 1]
    assert sorted(r["value"] for r in at1) == [2.0, 3.0]
    for r in at1:
        assert r["divergent"] is True and r["verified"] is False
        assert [h["device"] for h in r["holders"]] == r["devices"]


def test_2d_mesh_gathered_order_matches_devices(session, tap_path, host_calls):
    devs = np.array(jax.devices()).reshape(4, 2)[::-1, ::-1]
    mesh = Mesh(devs, ("x", "y"))
    xs = jax.device_put(jnp.arange(8.0).reshape(4, 2), NamedSharding(mesh, P("x", "y")))
    jax.jit(
        jax.shard_map(
            lambda v: pmaptap.tap(v, "m", dedup="per_device"),
            mesh=mesh,
            in_specs=P("x", "y"),
            out_specs=P("x", "y"),
        )
    )(xs)
    session.flush()
    truth = {s.device.id: np.asarray(s.data).tolist() for s in xs.addressable_shards}
    recs = pmaptap.read(tap_path)
    assert {r["device"]: r["value"] for r in recs} == truth
    assert host_calls == ["m"]


def test_options_are_checked():
    with pytest.raises(TypeError, match="unknown option"):
        pmaptap.configure(gahter=True)
    with pytest.raises(ValueError, match=">= 0"):
        pmaptap.configure(gather_max_bytes=-1)


def test_mixed_dtype_pytree_is_packed_into_one_gather_bit_exactly(session, tap_path):
    @partial(jax.pmap, axis_name="i")
    def f(v):
        i = lax.axis_index("i")
        tree = {
            "f": v * 0.1,
            "b": i % 2 == 0,
            "h": (v * 0.5).astype(jnp.bfloat16),
            "n": jnp.stack([i, -i]).astype(jnp.int32),
            "nan": v / 0.0,
            "u8": i.astype(jnp.uint8),
        }
        pmaptap.tap(tree, "mixed", dedup="per_device")
        return v

    f(jnp.arange(8.0))
    session.flush()
    recs = sorted(pmaptap.read(tap_path), key=lambda r: r["device"])
    assert len(recs) == 8
    for d, r in enumerate(recs):
        v = r["value"]
        assert np.float32(v["f"]) == np.float32(d) * np.float32(0.1)
        assert v["b"] is (d % 2 == 0)
        assert v["h"] == d * 0.5 and r["dtype"]["h"] == "bfloat16"
        assert v["n"] == [d, -d] and v["u8"] == d
        assert np.isnan(v["nan"]) if d == 0 else v["nan"] == np.inf


def test_group_leaves_big_unverified_replicated_taps_out_of_its_gather(tmp_path, host_calls):
    def step(v):
        with pmaptap.group():
            pmaptap.tap(v, "small", dedup="per_device")
            pmaptap.tap(jnp.ones(4096) * lax.pmean(v, "i"), "big", dedup="replicated")
        return v

    with pmaptap.configured(verify_replicated=False, gather_max_bytes=4096):
        with pmaptap.Session(str(tmp_path / "g.jsonl"), run="g"):
            jax.pmap(lambda v: step(v), axis_name="i")(jnp.arange(8.0))
    # the 16 KiB replicated value travels alone (one copy), not gathered 8x
    assert sorted(host_calls) == ["big", "small"]
    recs = {r["name"]: r for r in pmaptap.read(tmp_path / "g.jsonl")}
    assert recs["big"]["replicas"] == 8 and recs["big"]["verified"] is False


def test_group_decides_every_once_for_taps_sharing_a_traced_step(tmp_path, host_calls):
    def body(v, step, grouped):
        with pmaptap.group() if grouped else contextlib.nullcontext():
            pmaptap.tap(v, "y", step=step, every=3, dedup="per_device")
            pmaptap.tap(lax.pmean(v, "i"), "m", step=step, every=3, dedup="replicated")
            pmaptap.tap(v * 2, "z", step=step, dedup="per_device")  # every step
        return v

    def run(grouped):
        path = str(tmp_path / f"e{grouped}.jsonl")
        f = jax.pmap(partial(body, grouped=grouped), axis_name="i", in_axes=(0, None))
        # Without the block, each tap alone (automatic grouping off).
        with pmaptap.configured(auto_group=False), pmaptap.Session(path, run="e"):
            for s in range(7):
                f(jnp.arange(8.0) + s, jnp.int32(s))
        return pmaptap.read(path)

    grouped = run(True)
    calls, host_calls[:] = list(host_calls), []
    # steps 0, 3, 6: ONE callback for y and m together; z on its own each step
    assert sorted(calls) == ["pmaptap/group"] * 3 + ["z"] * 7
    plain = run(False)
    assert sorted(host_calls) == ["m"] * 3 + ["y"] * 3 + ["z"] * 7
    assert _comparable(grouped) == _comparable(plain)
    assert sorted({r["step"] for r in grouped if r["name"] != "z"}) == [0, 3, 6]
    assert len([r for r in grouped if r["name"] == "y"]) == 3 * 8


def test_group_members_keep_their_records_unverified_and_big_steps(tmp_path):
    # In a group every member is gathered (one collective for all), but an
    # unverified replicated member is still written from the caller's copy
    # with "verified": false, as alone; and each member's step keeps its
    # dtype (a uint32 step past 2**31 must not wrap).
    def body(v, step, grouped):
        with pmaptap.group() if grouped else contextlib.nullcontext():
            pmaptap.tap(v, "trusted", step=step, dedup="replicated")  # differs!
            pmaptap.tap(v, "trusted_every", step=step, every=2, dedup="replicated")
            pmaptap.tap(v, "y", step=step, every=2, dedup="per_device")
        return v

    def run(grouped):
        path = str(tmp_path / f"v{grouped}.jsonl")
        with pmaptap.configured(verify_replicated=False):
            f = jax.pmap(partial(body, grouped=grouped), axis_name="i", in_axes=(0, None))
            with pmaptap.Session(path, run="v"):
                f(jnp.arange(8.0), jnp.uint32(3_000_000_000))
        return pmaptap.read(path)

    grouped, plain = run(True), run(False)
    assert _comparable(grouped) == _comparable(plain)
    for name in ("trusted", "trusted_every"):
        (r,) = [r for r in grouped if r["name"] == name]
        assert r["verified"] is False and r["replicas"] == 8 and r["value"] == 0.0
    assert {r["step"] for r in grouped} == {3_000_000_000}
    assert len([r for r in grouped if r["name"] == "y"]) == 8


def test_float64_nonfinite_scalars_of_gathered_copies_under_x64():
    # A stacked 1-D float64 leaf with NaN/inf takes the row-by-row path,
    # where each row is a NumPy scalar (x64 only: float64 on device).
    out = run_python("""
        import jax, tempfile
        jax.config.update("jax_enable_x64", True)
        import jax.numpy as jnp, pmaptap
        path = tempfile.mktemp(suffix=".jsonl")
        f = jax.pmap(lambda v: pmaptap.tap(v / (v - 1.0), "x", dedup="per_device"),
                     axis_name="i")
        with pmaptap.Session(path, run="e"):
            f(jnp.arange(8.0, dtype=jnp.float64))
        recs = sorted(pmaptap.read(path), key=lambda r: r["device"])
        print([r["value"] for r in recs], {r["dtype"] for r in recs})
    """).stdout
    assert "[-0.0, inf, 2.0, 1.5" in out and "{'float64'}" in out


def _every_record_field_step(v):
    loss = lax.pmean(jnp.sum(v), "i")
    pmaptap.tap(v, "y", dedup="per_device")
    pmaptap.tap(loss, "loss", dedup="replicated")
    # vmapped taps: batch_dims 1 records of the same kinds
    jax.vmap(lambda r: pmaptap.tap(r, "vm_y", dedup="per_device"))(jnp.stack([v, v + 1]))
    jax.vmap(lambda r: pmaptap.tap(r * 0 + loss, "vm_loss", dedup="replicated"))(jnp.stack([v, v]))
    # leaves above max_value_bytes: statistics, summarized records
    pmaptap.tap(jnp.ones(8) * v, "big_y", dedup="per_device")
    pmaptap.tap(jnp.ones(8) * loss, "big_loss", dedup="replicated")
    return v


def test_gathered_records_equal_per_device_callbacks_in_every_field(tmp_path):
    # The gathered path builds its records from per-site templates (issue 17:
    # half the host cost of a per_device tap); every field but the time must
    # be what the one-callback-per-device path writes, step after step.
    def run(path, gather):
        with pmaptap.configured(gather=gather, max_value_bytes=16):
            f = jax.pmap(lambda v: _every_record_field_step(v), axis_name="i")
            with pmaptap.Session(path, run="fp"):
                for i in range(3):
                    f(jnp.arange(8.0) * (i + 1))
        recs = pmaptap.read(path)
        return sorted(repr(sorted((k, v) for k, v in r.items() if k != "time")) for r in recs)

    fast = run(str(tmp_path / "fast.jsonl"), True)
    slow = run(str(tmp_path / "slow.jsonl"), False)
    assert fast == slow
    assert len(fast) == 3 * (8 + 1 + 8 + 1 + 8 + 1)
    kinds = {
        (r["name"], r.get("batch_dims", 0), bool(r.get("summarized")))
        for r in pmaptap.read(str(tmp_path / "fast.jsonl"))
    }
    assert ("vm_y", 1, False) in kinds and ("vm_loss", 1, False) in kinds
    assert ("big_y", 0, True) in kinds and ("big_loss", 0, True) in kinds
    steps = sorted(
        {r["step"] for r in pmaptap.read(str(tmp_path / "fast.jsonl")) if r["name"] == "y"}
    )
    assert steps == [0, 1, 2]
