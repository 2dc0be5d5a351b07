"""Python's cyclic garbage collector is held off while pmaptap.jit /
pmaptap.pmap lift a step (lift.collector_held; why: docs/performance.md,
"The trace's garbage"), and is on again after, as it was before: also when
the trace raises, when another thread lifts at the same time, and never
turned on where the program had turned it off."""

from __future__ import annotations

import gc
import threading

import jax
import jax.numpy as jnp
import pytest

import pmaptap


def _step(seen: list):
    def step(x):
        seen.append(gc.isenabled())
        pmaptap.tap(x.sum(), "total")
        return x * 2

    return step


@pytest.mark.parametrize("wrap", ["jit", "pmap"])
def test_the_collector_is_off_while_a_step_is_lifted_and_on_after(tmp_path, wrap):
    assert gc.isenabled()
    seen: list = []
    if wrap == "jit":
        fn, x = pmaptap.jit(_step(seen)), jnp.arange(4.0)
    else:
        n = jax.local_device_count()
        fn, x = pmaptap.pmap(_step(seen)), jnp.arange(4.0 * n).reshape(n, 4)
    path = tmp_path / "c.jsonl"
    with pmaptap.Session(str(path), run="gc"):
        out = fn(x)
    assert seen == [False]  # traced once, with the collector off
    assert gc.isenabled()
    assert jnp.array_equal(out, x * 2)
    totals = {float(r["value"]) for r in pmaptap.read(str(path)) if r["name"] == "total"}
    assert totals == {float(v) for v in (x.reshape(-1, 4).sum(axis=1))}


def test_the_collector_is_on_again_when_the_trace_raises():
    def bad(x):
        pmaptap.tap(x, "x")
        raise ValueError("the user's own error")

    with pytest.raises(ValueError, match="the user's own error"):
        pmaptap.jit(bad)(jnp.ones(3))
    assert gc.isenabled()


def test_a_collector_the_program_turned_off_stays_off():
    seen: list = []
    gc.disable()
    try:
        pmaptap.jit(_step(seen))(jnp.ones(3))
        assert seen == [False]
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_collector_stays_off_until_the_last_of_two_threads_lifting_ends():
    """Thread A is inside its lift while thread B lifts and ends: the
    collector must stay off for A (turned on by the last lift to end)."""
    a_inside, b_done = threading.Event(), threading.Event()
    seen: dict[str, list] = {"a": [], "b": []}
    errors: list = []

    def step_a(x):
        seen["a"].append(gc.isenabled())
        a_inside.set()
        b_done.wait(30)
        seen["a"].append(gc.isenabled())  # after B's lift ended
        return x + 1

    def step_b(x):
        seen["b"].append(gc.isenabled())
        return x + 2

    def run(fn, x, wait=None):
        try:
            if wait is not None:
                wait.wait(30)
            jax.block_until_ready(pmaptap.jit(fn)(x))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def run_b():
        run(step_b, jnp.ones(2), wait=a_inside)
        b_done.set()

    threads = [
        threading.Thread(target=run, args=(step_a, jnp.ones(3))),
        threading.Thread(target=run_b),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert seen == {"a": [False, False], "b": [False]}
    assert gc.isenabled()
