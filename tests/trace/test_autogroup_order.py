"""Automatic grouping keeps automatic step counters in program order. The
host numbers a name's taps without a ``step`` in the order their callbacks
run; a tap deferred to its trace's end must not run after a later tap of the
same name (in a scan body, an inner jit, a ``group()`` block, a tap emitted
on its own). Records must equal those of ``configure(auto_group=False)``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

import pmaptap


def _steps_and_values(tmp_path, make, args, tag: str):
    out = {}
    for auto in (True, False):
        path = tmp_path / f"{tag}{auto}.jsonl"
        with pmaptap.configured(auto_group=auto):
            f = make()
            with pmaptap.Session(str(path), run="o"):
                for _ in range(2):
                    jax.block_until_ready(f(*args))
        out[auto] = sorted(
            (r["name"], r.get("device"), r["step"], str(r["value"])) for r in pmaptap.read(path)
        )
    return out[True], out[False]


def test_a_name_tapped_in_the_step_and_in_a_scan_body_keeps_its_step_order(tmp_path):
    def body(v):
        pmaptap.tap(v, "x", dedup="per_device")

        def inner(c, _):
            pmaptap.tap(c * 10, "x", dedup="per_device")
            return c + 1, None

        c, _ = lax.scan(inner, v, None, length=2)
        pmaptap.tap(c * 100, "x", dedup="per_device")
        return c

    auto, one = _steps_and_values(
        tmp_path, lambda: jax.pmap(lambda v: body(v), axis_name="i"), (jnp.arange(8.0),), "s"
    )
    assert auto == one
    dev0 = [(s, v) for n, d, s, v in one if d == 0]
    # Program order: v, 10*v, 10*(v+1), 100*(v+2), twice; the scan's two
    # iterations are one execution of their tap, one step.
    assert dev0 == [
        (0, "0.0"),
        (1, "0.0"),
        (1, "10.0"),
        (2, "200.0"),
        (3, "0.0"),
        (4, "0.0"),
        (4, "10.0"),
        (5, "200.0"),
    ]


def test_an_inner_jit_called_twice_from_its_cache_keeps_the_step_order(tmp_path):
    @jax.jit
    def g(v):
        pmaptap.tap(v + 1000, "x", dedup="per_device")
        return v

    def body(v):
        pmaptap.tap(v, "x", dedup="per_device")
        g(v)
        pmaptap.tap(v + 2000, "x", dedup="per_device")
        g(v)  # the same jaxpr again, from JAX's cache: no trace-time event
        pmaptap.tap(v + 3000, "x", dedup="per_device")
        return v

    auto, one = _steps_and_values(
        tmp_path, lambda: jax.pmap(lambda v: body(v), axis_name="i"), (jnp.arange(8.0),), "j"
    )
    # XLA may order these independent callbacks as it likes (it does, here,
    # with or without grouping); deferral must not change what it does.
    assert auto == one


def test_a_group_block_after_a_deferred_tap_of_the_same_name_keeps_the_order(tmp_path):
    def body(v):
        loss = lax.pmean(jnp.sum(v), "i")
        pmaptap.tap(loss, "x", dedup="replicated")
        with pmaptap.group():
            pmaptap.tap(loss + 1, "x", dedup="replicated")
            pmaptap.tap(loss + 2, "y", dedup="replicated")
        pmaptap.tap(loss + 3, "x", dedup="replicated")
        return v

    auto, one = _steps_and_values(
        tmp_path, lambda: jax.pmap(lambda v: body(v), axis_name="i"), (jnp.arange(8.0),), "g"
    )
    assert auto == one
