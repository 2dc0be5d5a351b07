"""Dedup policies: replicated, per_device, auto, and divergence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

import pmaptap


def _run(fn, session, tap_path, steps=1, x=None):
    x = jnp.arange(8.0) if x is None else x
    f = jax.pmap(fn, axis_name="i")
    for _ in range(steps):
        f(x)
    session.flush()
    return pmaptap.read(tap_path)


def test_replicated_is_written_once_per_step(session, tap_path):
    def fn(v):
        loss = lax.pmean(v, "i")
        pmaptap.tap(loss, "loss", dedup="replicated")
        return v

    recs = _run(fn, session, tap_path, steps=3)
    loss = [r for r in recs if r["name"] == "loss"]
    assert [r["step"] for r in loss] == [0, 1, 2]
    for r in loss:
        assert r["kind"] == "replicated" and r["value"] == 3.5
        assert r["replicas"] == 8 and sorted(r["devices"]) == list(range(8))
        assert "divergent" not in r


def test_replicated_divergence_keeps_every_value_with_its_devices(session, tap_path):
    def fn(v):
        # devices 0..5 agree, 6 and 7 hold something else
        bad = jnp.where(lax.axis_index("i") >= 6, 1.0, 0.0)
        pmaptap.tap(lax.pmean(v, "i") + bad, "loss", dedup="replicated")
        return v

    recs = [r for r in _run(fn, session, tap_path) if r["name"] == "loss"]
    assert len(recs) == 2
    by_value = {r["value"]: r for r in recs}
    assert set(by_value) == {3.5, 4.5}
    assert all(r["divergent"] is True and r["kind"] == "replicated" for r in recs)
    assert sorted(by_value[3.5]["devices"]) == [0, 1, 2, 3, 4, 5]
    assert sorted(by_value[4.5]["devices"]) == [6, 7]
    assert by_value[4.5]["replicas"] == 2
    assert sorted(h["coords"]["i"] for h in by_value[4.5]["holders"]) == [6, 7]


def test_per_device_one_record_per_device_even_if_identical(session, tap_path):
    recs = _run(lambda v: pmaptap.tap(v * 0, "z", dedup="per_device"), session, tap_path, steps=2)
    z = [r for r in recs if r["name"] == "z"]
    assert len(z) == 16
    assert sorted((r["step"], r["device"]) for r in z) == [
        (s, d) for s in range(2) for d in range(8)
    ]


def test_auto_identical_is_replicated_and_different_is_per_device(session, tap_path):
    def fn(v):
        pmaptap.tap(lax.psum(v, "i"), "same")  # dedup="auto" default
        pmaptap.tap(v, "diff")
        return v

    recs = _run(fn, session, tap_path)
    same = [r for r in recs if r["name"] == "same"]
    diff = [r for r in recs if r["name"] == "diff"]
    assert len(same) == 1 and same[0]["kind"] == "replicated" and same[0]["replicas"] == 8
    assert same[0]["value"] == 28.0
    assert len(diff) == 8 and all(r["kind"] == "per_device" for r in diff)
    assert not any(r.get("divergent") for r in diff)
    assert {r["device"]: r["value"] for r in diff} == {d: float(d) for d in range(8)}


def test_nan_replicas_agree_bitwise(session, tap_path):
    recs = _run(
        lambda v: pmaptap.tap(lax.pmean(v, "i") * jnp.nan, "n", dedup="replicated"),
        session,
        tap_path,
    )
    n = [r for r in recs if r["name"] == "n"]
    assert len(n) == 1 and n[0]["value"] != n[0]["value"]  # NaN


def test_cond_firing_on_some_devices_is_flushed_with_fewer_replicas(session, tap_path):
    def fn(v):
        lax.cond(
            lax.axis_index("i") < 3,
            lambda: pmaptap.tap(jnp.float32(1.0), "partial", dedup="replicated"),
            lambda: jnp.float32(1.0),
        )
        return v

    recs = [r for r in _run(fn, session, tap_path) if r["name"] == "partial"]
    assert len(recs) == 1 and recs[0]["replicas"] == 3
    assert sorted(recs[0]["devices"]) == [0, 1, 2]
