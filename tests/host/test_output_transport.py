"""The output transport's promises to a training loop (pmaptap.jit /
pmaptap.pmap): a step dispatched is a step written (close, SIGTERM,
interpreter exit), host memory for steps in flight is bounded without
dropping a value, a tap that cannot be an output says so once and is still
written, NaN/inf are recorded as by host callbacks, the lowered step holds
no host callback, and the wrappers compose with Equinox and Flax NNX.

The records are compared with those the callback transport (jax.jit /
jax.pmap) writes for the same program, field for field but the time.
"""

from __future__ import annotations

import json
import logging
import math
import re
import signal
import threading
import time
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pmaptap
from conftest import computed_step_number, logs_warning, run_python, start_python
from pmaptap._common.shard_placement import statistics_row_width
from pmaptap._host.sinks import file as sink
from pmaptap._outputs import drain as outputs
from pmaptap._outputs import later


def _lines(path) -> list[dict]:
    """The file's records as written (no reconciliation), time left out,
    in a canonical order (the device naming aside, see ``_assert_same``)."""
    with open(path) as f:
        recs = [json.loads(line) for line in f]
    for r in recs:
        r.pop("time", None)

    def key(r):
        return json.dumps({k: v for k, v in r.items() if k not in _DEVICE}, sort_keys=True)

    return sorted(recs, key=key)


_DEVICE = ("device", "devices")


def _assert_same(out_path, cb_path) -> list[dict]:
    """The output transport's file holds the callback transport's records,
    field for field but the time; where a callback could not name the
    device (``null``), the output transport may (a computation on one
    device: its output's sharding says which)."""
    out, cb = _lines(out_path), _lines(cb_path)
    assert len(out) == len(cb), (len(out), len(cb))
    for o, c in zip(out, cb):
        for k in _DEVICE:
            if c.get(k) in (None, [None]) and k in o:
                o = {**o, k: c.get(k)} if k in c else {x: v for x, v in o.items() if x != k}
        assert o == c
    return out


# ---------------------------------------------------------------- dispatched = written
# A loop that never waits on its steps: each step is slow (matmuls) and its
# dispatch is fast, so steps pile up in flight; after each dispatch it prints
# how many of its steps the output transport has not yet delivered.
_LOOP = """
    import os, signal, sys
    import jax, jax.numpy as jnp, numpy as np, pmaptap
    from jax import lax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from pmaptap._outputs import drain as outputs

    mode, end, n = os.environ["MODE"], os.environ["END"], int(os.environ["N"])
    s = pmaptap.Session(os.environ["TAP"], run="loop").open()
    w = jnp.eye(256, dtype=jnp.float32) * 0.5

    def work(h):
        for _ in range(12):
            h = jnp.tanh(h @ w)
        return h

    # No collective in either step: XLA's CPU backend aborts a loop of steps
    # holding an all-reduce dispatched this far ahead (a rendezvous timeout),
    # with taps or without.
    if mode == "pmap":
        def body(h, v):
            h = work(h)
            pmaptap.tap(v - lax.axis_index("i"), "c")            # the step, replicated
            pmaptap.tap(v, "v", dedup="per_device")               # step + device
            pmaptap.tap(h[0, 0], "h", dedup="per_device")
            return h, v + 1
        step = pmaptap.pmap(body, axis_name="i")
        state = (jnp.ones((8, 64, 256), jnp.float32), jnp.arange(8.0))
    else:
        mesh = Mesh(np.array(jax.devices()), ("d",))
        rows = NamedSharding(mesh, P("d"))
        def body(h, v, c):
            h = work(h)
            pmaptap.tap(c, "c")                                   # replicated on all 8
            pmaptap.tap(v, "v", dedup="per_device")               # one record per shard
            pmaptap.tap(h[:, 0], "h", dedup="per_device")
            return h, v + 1, c + 1
        step = pmaptap.jit(body)
        state = (
            jax.device_put(jnp.ones((8 * 64, 256), jnp.float32), rows),
            jax.device_put(jnp.arange(8.0), rows),
            jax.device_put(jnp.float32(0), NamedSharding(mesh, P())),
        )

    for i in range(n):
        state = step(*state)
        d = outputs._drain
        print("D", i, d._submitted - d._done, flush=True)
    if end == "close":
        s.close()
        print("CLOSED", flush=True)
    # end == "exit": no close(); the interpreter's exit closes the session
"""


def _start_loop(tmp_path, mode: str, end: str, n: int):
    tap = str(tmp_path / f"{mode}-{end}.jsonl")
    return tap, start_python(_LOOP, MODE=mode, END=end, N=str(n), TAP=tap)


def _check_steps(tap: str, at_least: int) -> int:
    """Every tap's records are steps 0..k (k + 1 >= at_least), contiguous,
    with the values those steps computed; returns k + 1."""
    recs = pmaptap.read(tap)
    assert not [r for r in recs if r["name"].startswith("pmaptap/")], "drops or errors"
    c = sorted((r["step"], r["value"]) for r in recs if r["name"] == "c")
    k = len(c)
    assert k >= at_least, (k, at_least)
    assert c == [(i, float(i)) for i in range(k)]  # 0..k-1, in order, none twice
    assert all(r["kind"] == "replicated" for r in recs if r["name"] == "c")
    v = sorted(
        (r["step"], r["coords"].get("i", r["coords"].get("d")), np.ravel(r["value"])[0])
        for r in recs
        if r["name"] == "v"
    )
    assert v == [(i, d, float(i + d)) for i in range(k) for d in range(8)]
    assert sorted({r["step"] for r in recs if r["name"] == "h"}) == list(range(k))
    # Steps are written in the order they ran: each tap's steps ascend in
    # the file.
    with open(tap) as f:
        raw = [json.loads(line) for line in f]
    order = [r["step"] for r in raw if r["name"] == "c"]
    assert order == sorted(order)
    return k


def _read_dispatches(proc) -> list[tuple[int, int]]:
    out = []
    for line in proc.stdout.read().splitlines():
        if line.startswith("D "):
            _, i, pending = line.split()
            out.append((int(i), int(pending)))
    return out


@pytest.mark.parametrize("mode", ["jit", "pmap"])
@pytest.mark.parametrize("end", ["close", "exit"])
def test_steps_dispatched_without_waiting_are_all_written(tmp_path, mode, end):
    n = 40
    tap, proc = _start_loop(tmp_path, mode, end, n)
    try:
        assert proc.wait(180) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    dispatched = _read_dispatches(proc)
    assert [i for i, _ in dispatched] == list(range(n))
    # The loop did run ahead of its steps: when it ended, some had not
    # reached the host (close / exit had them to write).
    assert dispatched[-1][1] > 0, dispatched
    _check_steps(tap, n)
    assert "pmaptap" not in proc.stderr.read()  # no warning, no error


@pytest.mark.parametrize("mode", ["jit", "pmap"])
def test_sigterm_mid_loop_writes_every_dispatched_step_in_order(tmp_path, mode):
    tap, proc = _start_loop(tmp_path, mode, "sigterm", 100000)
    try:
        # Wait until the loop is well ahead of its steps, then stop it.
        last = (-1, 0)
        while not (last[0] >= 20 and last[1] >= 3):
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            if line.startswith("D "):
                last = tuple(int(x) for x in line.split()[1:])
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGTERM, proc.stderr.read()
    # Every step dispatched before the signal (at least those the test saw,
    # `last[1]` of them not yet delivered then) is in the file, in order.
    k = _check_steps(tap, last[0] + 1)
    assert k >= last[0] + 1


# ---------------------------------------------------------------- bounded host memory
def test_slow_sink_slows_the_loop_bounded_and_drops_nothing(tap_path, monkeypatch, caplog):
    delay = 0.004
    written: list[int] = []
    real = sink.FileSink.write

    def slow(self, records):
        time.sleep(delay)  # a slow disk: every batch costs a few ms
        out = real(self, records)
        written.append(len(out))
        return out

    monkeypatch.setattr(sink.FileSink, "write", slow)
    step_bytes = 64 * 1024 * 4 + 4
    bound = 3 * step_bytes  # at most 3 steps' outputs wait for the host
    if outputs._drain is not None:
        # Said once per process: as if this were the process's first loop.
        monkeypatch.setattr(outputs._drain, "_slow_said", False)
    peak = [0]
    real_submit = outputs.Drain.submit

    def watched(self, nodes, arrays, max_bytes, *packing):
        real_submit(self, nodes, arrays, max_bytes, *packing)
        with self._cv:
            peak[0] = max(peak[0], self._in_flight)

    monkeypatch.setattr(outputs.Drain, "submit", watched)

    @pmaptap.jit
    def step(x):
        pmaptap.tap(x, "x", dedup="per_device")
        pmaptap.tap(x[0, 0], "first")
        return x + 1

    n = 60
    with pmaptap.configured(max_in_flight_bytes=bound):
        # The session's default overflow policy drops the oldest taps when
        # its queue is full; the output transport must not let it.
        s = pmaptap.Session(tap_path, run="slow", max_pending=4).open()
        assert s.pipeline.overflow == "drop_oldest"
        x = jnp.zeros((64, 1024), jnp.float32)
        with logs_warning(caplog, "max_in_flight_bytes", count=1):
            for _ in range(n):
                x = step(x)
            lag = 2 * n - sum(written)
        s.close()
    # Bounded: never more than the bound waited on the host...
    assert 0 < peak[0] <= bound, peak
    # ...so the loop was paced by the writer: when it ended, only the few
    # steps the bounds hold were unwritten (without the bound it ends at
    # once, with nearly all of its 120 records still to write).
    assert lag <= 30, lag
    # Nothing dropped, nothing said to be.
    assert s.pipeline.dropped == 0
    recs = pmaptap.read(tap_path)
    assert not [r for r in recs if r["name"].startswith("pmaptap/")]
    assert sorted((r["step"], r["value"]) for r in recs if r["name"] == "first") == [
        (i, float(i)) for i in range(n)
    ]
    xs = sorted((r["step"], r["value"][0][0], r["value"][-1][-1]) for r in recs if r["name"] == "x")
    assert xs == [(i, float(i), float(i)) for i in range(n)]
    msgs = [r.getMessage() for r in caplog.records if r.name.startswith("pmaptap")]
    assert not [m for m in msgs if "dropped" in m and "none dropped" not in m], msgs


# ---------------------------------------------------------------- fallback, never silent
def test_tap_in_a_while_loop_is_said_once_and_written_as_under_jax_jit(tmp_path, caplog):
    name = f"in_while_{uuid.uuid4().hex[:8]}"  # said once per process: a fresh site

    def body(c):
        i, x = c
        pmaptap.tap(x, name)
        return i + 1, x * 2

    def step(x):
        _, x = jax.lax.while_loop(lambda c: c[0] < 3, body, (0, x))
        pmaptap.tap(x, "after")
        return x

    def run(wrap, path):
        with pmaptap.Session(str(path), run="w"):
            f = wrap(step)
            for i in range(3):
                f(jnp.float32(i))
            f(jnp.ones((2,), jnp.float32))  # a second trace of the same site
            wrap(lambda x: step(x) + 1)(jnp.float32(5))  # and another step holding it

    run(jax.jit, tmp_path / "cb.jsonl")
    with caplog.at_level(logging.WARNING, logger="pmaptap"):
        start = len(caplog.records)
        run(pmaptap.jit, tmp_path / "out.jsonl")
        said = [r.getMessage() for r in caplog.records[start:] if r.name.startswith("pmaptap")]
    # Once, not once per call or trace; naming the tap and why.
    assert len(said) == 1, said
    assert repr(name) in said[0] and "while" in said[0] and "host callback" in said[0]
    # Its records (and the others') are those of the callback transport.
    _assert_same(tmp_path / "out.jsonl", tmp_path / "cb.jsonl")
    assert len([r for r in pmaptap.read(str(tmp_path / "out.jsonl")) if r["name"] == name]) == 15


def _marks_left(jaxpr) -> list[str]:
    """The names of the tap marks a lifted step still holds (at any depth):
    those that keep their host callback."""
    from jax._src import core

    from pmaptap._trace.marks import tap_out_p

    names = []
    for eqn in jaxpr.eqns:
        if eqn.primitive is tap_out_p:
            names.append(eqn.params["spec"].name)
        for j in core.jaxprs_in_params(eqn.params):
            names += _marks_left(j)
    return names


def test_only_the_taps_of_a_nested_shard_map_keep_their_host_callback(tmp_path, caplog):
    """An outer shard_map body holding its own tap and an inner shard_map
    with a tap: the inner one's tap keeps its host callback (said once,
    naming it), the outer body's tap is lifted as in any shard_map body.
    Before, the outer tap was said to be "inside a shard_map inside a
    shard_map" too, and kept a host callback it need not."""
    tag = uuid.uuid4().hex[:8]  # said once per process: fresh sites
    outer_name, inner_name = f"outer_{tag}", f"inner_{tag}"
    mesh = jax.make_mesh((2, 4), ("i", "j"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

    def inner(v):
        pmaptap.tap(jnp.sum(v), inner_name, dedup="per_device")
        return v * 2

    def outer(v):
        pmaptap.tap(jnp.sum(v), outer_name, dedup="per_device")
        return jax.shard_map(inner, in_specs=P("j"), out_specs=P("j"), axis_names={"j"})(v)

    def step(wrap):
        return wrap(
            jax.shard_map(outer, mesh=mesh, in_specs=P("i"), out_specs=P("i"), axis_names={"i"})
        )

    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("i")))
    with pmaptap.Session(str(tmp_path / "cb.jsonl"), run="n"):
        want = np.asarray(step(jax.jit)(x))
    with caplog.at_level(logging.WARNING, logger="pmaptap"):
        start = len(caplog.records)
        with pmaptap.Session(str(tmp_path / "out.jsonl"), run="n"):
            f = step(pmaptap.jit)
            np.testing.assert_array_equal(np.asarray(f(x)), want)
            f(x + 1)
        said = [r.getMessage() for r in caplog.records[start:] if r.name.startswith("pmaptap")]
    assert len(said) == 1 and repr(inner_name) in said[0], said
    assert "inside a shard_map inside a shard_map" in said[0]
    # The outer tap is an output of the step: only the inner one's mark is
    # left to lower to a host callback.
    assert _marks_left(f.trace(x).jaxpr.jaxpr) == [inner_name]
    # The same records as under jax.jit (the first call's; the second call
    # wrote the next steps).
    recs = pmaptap.read(str(tmp_path / "out.jsonl"))
    assert sorted((r["name"], r["step"]) for r in recs) == sorted(
        [(outer_name, s) for s in (0, 0, 1, 1)] + [(inner_name, s) for s in [0] * 8 + [1] * 8]
    )
    first = tmp_path / "first.jsonl"
    with open(tmp_path / "out.jsonl") as src, open(first, "w") as dst:
        dst.writelines(line for line in src if '"step":0' in line.replace(" ", ""))
    _assert_same(first, tmp_path / "cb.jsonl")


def test_a_name_with_automatic_steps_under_both_transports_is_said_once(tmp_path, caplog):
    """A model's tap with automatic steps, called by a train step under
    pmaptap.jit and an eval step under jax.jit in one session: its steps are
    counted as records arrive (outputs after the step, callbacks during it),
    so not in program order; that is said once, naming the tap. Not said for
    explicit steps, nor in a session where the name comes by one transport."""

    def model(x, step=None):
        pmaptap.tap(x * 2, "act", step=step)
        return jnp.sum(x)

    def run(path, mixed: bool, explicit: bool) -> list:
        with caplog.at_level(logging.WARNING, logger="pmaptap"):
            start = len(caplog.records)
            with pmaptap.Session(str(path), run="m"):
                train = pmaptap.jit(lambda x, s: model(x, s if explicit else None))
                evaluate = (jax.jit if mixed else pmaptap.jit)(
                    lambda x, s: model(x + 1, s if explicit else None)
                )
                for i in range(3):
                    train(jnp.ones(2), i)
                    evaluate(jnp.ones(2), 100 + i)
            return [r.getMessage() for r in caplog.records[start:] if r.name.startswith("pmaptap")]

    said = run(tmp_path / "mixed.jsonl", mixed=True, explicit=False)
    assert len(said) == 1 and "'act'" in said[0] and "step=" in said[0], said
    assert run(tmp_path / "explicit.jsonl", mixed=True, explicit=True) == []
    assert run(tmp_path / "one.jsonl", mixed=False, explicit=False) == []


@pytest.mark.parametrize("first", ["callbacks", "outputs"])
def test_a_name_under_both_transports_is_said_whichever_reaches_the_host_first(
    tmp_path, caplog, first
):
    """Which transport's records reach the host first is the machine's
    timing (the drain delivers a step's outputs after the step; JAX 0.12
    runs callbacks at dispatch, so a lagging drain delivers after every
    callback of the loop): said once either way. Before, only when an
    output came after a callback that came after an output: a session
    whose callbacks all came first, or none after the last output, said
    nothing."""

    def model(x):
        pmaptap.tap(x * 2, "act")
        return jnp.sum(x)

    train, evaluate = pmaptap.jit(model), jax.jit(model)
    with caplog.at_level(logging.WARNING, logger="pmaptap"):
        with pmaptap.Session(str(tmp_path / "t.jsonl"), run="m") as s:
            for f in (evaluate, train) if first == "callbacks" else (train, evaluate):
                for i in range(3):
                    f(jnp.ones(2) + i)
                s.flush()  # every step of this transport has reached the host
    said = [r.getMessage() for r in caplog.records if "counts its steps" in r.getMessage()]
    assert len(said) == 1 and "'act'" in said[0], said
    assert len(pmaptap.read(tmp_path / "t.jsonl")) == 6


def test_nested_conds_are_lifted_once_per_branch_and_written_as_under_jax_jit(
    tmp_path, monkeypatch
):
    """A nest of conds, each branch tapping, and a three-way switch inside:
    every branch's body is lifted once (a cond lifted its branches twice, so
    n nested conds cost 2^n lifts of the innermost), and the records are the
    callback transport's, for every path taken."""
    from pmaptap._outputs import lift

    depth = 6

    def nest(level: int):
        if level == depth:

            def leaf(v):
                i = jnp.clip(v.astype(jnp.int32) % 3, 0, 2)
                branches = [lambda u, k=k: pmaptap.tap(u + k, f"sw{k}") for k in range(3)]
                return jax.lax.switch(i, branches, v)

            return leaf

        def fn(v):
            pmaptap.tap(v, f"at{level}")
            return jax.lax.cond(
                v > level,
                lambda u: nest(level + 1)(pmaptap.tap(u * 2, f"yes{level}")),
                lambda u: pmaptap.tap(u - 1, f"no{level}"),
                v,
            )

        return fn

    step = nest(0)
    runs = []
    real = lift.run
    monkeypatch.setattr(lift, "run", lambda *a: runs.append(1) or real(*a))

    def go(wrap, path):
        with pmaptap.Session(str(path), run="c"):
            f = wrap(step)
            for x in (-1.0, 0.5, 3.0, 5.0, 40.0, 1e4):
                f(jnp.float32(x))

    go(jax.jit, tmp_path / "cb.jsonl")
    go(pmaptap.jit, tmp_path / "out.jsonl")
    # One lift of the step, then one of each branch: 2 per cond, 3 for the
    # switch (it was 637 for this nest: each level lifted what is below it twice).
    assert len(runs) == 1 + 2 * depth + 3, len(runs)
    recs = _assert_same(tmp_path / "out.jsonl", tmp_path / "cb.jsonl")
    names = {r["name"] for r in recs}
    assert {"no0", "yes0", f"at{depth - 1}", "sw0", "sw1", "sw2"} <= names, names


def test_every_with_per_device_steps_decides_as_the_callback_transport(tmp_path):
    """``every`` with a traced step that differs between devices: the
    callback transport decides on the smallest step among the mapped devices
    (its emission may hold a collective that all must reach); the output
    transport decides alike, so both write the same records, each with its
    device's own step, also where a cond or a scan holds the tap."""

    def body(s, x):
        own = s + jax.lax.axis_index("i")  # device d is d steps ahead
        pmaptap.tap(x, "x", step=own, every=4, dedup="per_device")
        pmaptap.tap(jax.lax.pmean(x, "i"), "mean", step=own)  # proven alike, steps not
        with pmaptap.group():
            pmaptap.tap(x * 2, "g", step=own, dedup="per_device")
            pmaptap.tap(x + 1, "h", step=s, dedup="per_device")

        def scan_body(c, k):
            pmaptap.tap(c + k, "in_scan", step=own + k, every=3, dedup="per_device")
            return c + 1, None

        c, _ = jax.lax.scan(scan_body, x, jnp.arange(3))
        return jax.lax.cond(
            x > 2,
            lambda v: pmaptap.tap(v, "in_cond", step=own, every=2, dedup="per_device"),
            lambda v: v,
            c,
        )

    def go(wrap, path):
        with pmaptap.Session(str(path), run="e"):
            f = wrap(body, axis_name="i")
            for s in range(6):
                f(jnp.full((8,), s, jnp.int32), jnp.arange(8.0))

    go(jax.pmap, tmp_path / "cb.jsonl")
    go(pmaptap.pmap, tmp_path / "out.jsonl")
    recs = _assert_same(tmp_path / "out.jsonl", tmp_path / "cb.jsonl")

    # The check costs one all_gather of the steps where the trace cannot
    # prove them alike, none where it can.
    def gathers(step_fn):
        def f(s, x):
            pmaptap.tap(jax.lax.pmean(x, "i"), "p", step=step_fn(s))
            return x

        return str(jax.make_jaxpr(jax.pmap(f, axis_name="i"))(jnp.zeros(8, int), jnp.ones(8)))

    assert gathers(lambda s: s).count("all_gather[") == 1
    assert gathers(lambda s: jax.lax.pmax(s, "i")).count("all_gather[") == 0
    xs = {(r["step"], r["coords"]["i"]) for r in recs if r["name"] == "x"}
    # Decided on the smallest step (s, device 0's): steps 0 and 4, all 8.
    assert xs == {(s + d, d) for s in (0, 4) for d in range(8)}
    assert {r["name"] for r in recs} == {"x", "in_scan", "in_cond", "mean", "g", "h"}
    # Each record carries its own device's step, also where one copy per
    # process would travel for a step the same everywhere (the leader's).
    for name, ahead in (("mean", True), ("g", True), ("h", False)):
        got = sorted((r["step"], r.get("coords", {}).get("i")) for r in recs if r["name"] == name)
        if name == "mean":  # replicated: each step once, whichever device's it was
            assert [s for s, _ in got] == list(range(6 + 7))
        else:
            want = sorted((s + d * ahead, d) for s in range(6) for d in range(8))
            assert got == want, (name, got)


def test_a_step_every_tap_skips_reads_only_the_skip_flags(tmp_path, monkeypatch):
    """``every`` with a traced step under pmaptap.jit: a step where every
    tap and fingerprint is skipped moves nothing to the host (no copy
    started on the loop's thread, no output read): the flags that say so
    are decided from the call's step number (read at the call, or, not
    computed yet then, from its copy: a scalar); a due step is written
    whole, as under jax.jit."""
    read, copied = [], []
    real_host, real_copy = outputs._host, outputs._start_copy

    def host(a):
        # What is read from the device: not a packed value (its bundle is),
        # not what the host took from the call (_Argument: the step number
        # and the flags decided from it; a copy of it is, where the call's
        # was not computed yet) nor what it read at the call.
        if not isinstance(a, (outputs._Part, outputs._Argument, np.ndarray)):
            read.append(a.shape)
        return real_host(a)

    def copy(a):
        if not isinstance(a, outputs._Part):
            copied.append(a.shape)
        real_copy(a)

    monkeypatch.setattr(outputs, "_host", host)
    monkeypatch.setattr(outputs, "_start_copy", copy)

    def step(p, s):
        p = [a * 2 for a in p]
        pmaptap.fingerprint(p, "params", step=s, every=5)
        pmaptap.tap(p[0], "w", step=s, every=5)
        pmaptap.tap(p[1].sum(), "total", step=s, every=5)
        return p

    params = [jnp.ones((6, 3)), jnp.ones((4,))]
    for wrap, name in ((jax.jit, "cb.jsonl"), (pmaptap.jit, "out.jsonl")):
        read.clear(), copied.clear()
        with pmaptap.Session(str(tmp_path / name), run="skip"):
            f, p = wrap(step), params
            for s in range(1, 5):  # never due
                p = f(p, jnp.int32(s))
            pmaptap.flush()
            skipped_reads, skipped_copies = list(read), list(copied)
            p = f(p, jnp.int32(5))  # due
    # Nothing read a skipped step but step numbers (scalars) ...
    assert skipped_copies == [], skipped_copies
    assert set(skipped_reads) <= {()}, skipped_reads
    # ... while a due step reads its bundle (the scalar tap, the
    # fingerprint's table) and its tap, whole.
    assert any(len(r) == 1 and 0 < r[0] < 256 for r in read), read
    assert (6, 3) in read and (6, 3) in copied
    recs = _assert_same(tmp_path / "out.jsonl", tmp_path / "cb.jsonl")
    assert sorted((r["name"], r["step"]) for r in recs) == [
        ("params", 5),
        ("total", 5),
        ("w", 5),
    ]


def _hashes_in(lowered) -> int:
    """How many xor operations a compiled program holds: the fingerprint's
    hash is made of them (placed by the partitioner, after lowering); the
    steps below have none of their own."""
    return lowered.compile().as_text().count(" xor(")


def test_a_fingerprint_of_the_steps_outputs_is_hashed_after_the_step(tmp_path, monkeypatch):
    """Under pmaptap.jit a fingerprint of values the step returns (the
    updated parameters) is left out of the step's program and hashed by a
    program of its own on those outputs, dispatched right after the step
    (outputs donated to the next step included): the step compiles as the
    untapped one, and the records are the callback transport's, sharded
    leaves, ``every`` and all. A fingerprint of a value the step does not
    return stays in the step, and so does one of fewer bytes than
    ``later.MIN_BYTES`` (lowered here to these small values) whose due
    steps only the device knows; one whose due steps the host decides
    (its step number the call's argument) leaves the step whatever its
    size."""
    mesh = Mesh(np.array(jax.devices()), ("d",))
    params = {
        "w": jax.device_put(jnp.arange(64.0).reshape(16, 4), NamedSharding(mesh, P("d"))),
        "b": jax.device_put(jnp.ones((5,), jnp.bfloat16), NamedSharding(mesh, P())),
    }

    def step(p, s):
        p = jax.tree.map(lambda x: x * 1.5 + 1, p)
        pmaptap.fingerprint(p, "params", step=s, every=3)
        pmaptap.fingerprint(p["w"] * 2, "doubled", step=s)  # not returned: in the step
        return p

    def returned_only(p, s):
        p = jax.tree.map(lambda x: x * 1.5 + 1, p)
        pmaptap.fingerprint(p, "params", step=s, every=3)
        return p

    def kept_only(p, s):
        pmaptap.fingerprint(p["w"] * 2, "doubled", step=s)
        return p

    def due_on_the_device(p, s):
        p = jax.tree.map(lambda x: x * 1.5 + 1, p)
        pmaptap.fingerprint(p, "params", step=s + 0, every=3)  # computed: not the argument
        return p

    s0 = jnp.int32(0)
    assert _hashes_in(pmaptap.jit(due_on_the_device).lower(params, s0)) > 0  # small: in the step
    assert _hashes_in(pmaptap.jit(returned_only).lower(params, s0)) == 0  # due on the host
    monkeypatch.setattr(later, "MIN_BYTES", 0)
    assert _hashes_in(pmaptap.jit(due_on_the_device).lower(params, s0)) == 0
    assert _hashes_in(jax.jit(returned_only).lower(params, s0)) > 0
    assert _hashes_in(pmaptap.jit(returned_only).lower(params, s0)) == 0
    assert _hashes_in(pmaptap.jit(kept_only).lower(params, s0)) > 0
    for wrap, name in ((jax.jit, "cb.jsonl"), (pmaptap.jit, "out.jsonl")):
        f = wrap(step, donate_argnums=0)
        p = jax.tree.map(jnp.copy, params)
        with pmaptap.Session(str(tmp_path / name), run="later"):
            for s in range(7):
                p = f(p, jnp.int32(s))
    recs = _assert_same(tmp_path / "out.jsonl", tmp_path / "cb.jsonl")
    steps = sorted({r["step"] for r in recs if r["name"] == "params"})
    assert steps == [0, 3, 6], steps
    assert len({r["step"] for r in recs if r["name"] == "doubled"}) == 7
    assert not any(r.get("divergent") for r in recs)
    # Eight copies of the replicated leaf, one of each slice of the sharded one.
    assert {len(r["devices"]) for r in recs if r["name"] == "params"} >= {8}


def test_the_hash_after_the_step_compiles_beside_the_step_on_one_device(tmp_path):
    """On a one-device process the program hashing the step's outputs is
    compiled on a thread of its own while the step compiles (not after it,
    at the first step), where the device decides the due steps (a step
    number computed in the step); where the host decides them, a CPU
    device compiles none (the host hashes: _trace/fphash_host.py). Records
    as jax.jit's either way."""
    out = run_python(
        f"""
        import logging, threading, jax, jax.numpy as jnp, pmaptap
        compiled = []
        class Seen(logging.Handler):
            def emit(self, r):
                if "Finished XLA compilation of jit(" in r.getMessage():
                    compiled.append((r.getMessage().split()[4], r.threadName))
        logging.getLogger("jax").addHandler(Seen())
        jax.config.update("jax_log_compiles", True)

        def step_of(decides):
            def step(p, s):
                p = jax.tree.map(lambda x: x * 1.5 + 1, p)
                s = s if decides == "host" else s + 0
                pmaptap.fingerprint(p, "params", step=s, every=2)
                return p
            return step

        params = {{"w": jnp.ones((1024, 4096 + 2)), "b": jnp.arange(10.0)}}  # > 16 MiB
        for decides in ("host", "device"):
            for wrap, name in ((jax.jit, "cb"), (pmaptap.jit, "out")):
                p = jax.tree.map(jnp.copy, params)
                path = r"{tmp_path}/" + decides + name + ".jsonl"
                with pmaptap.Session(path, run="ahead"):
                    f = wrap(step_of(decides), donate_argnums=0)
                    for s in range(3):
                        # Where the host decides: a Python int (a step number
                        # still in flight would start the program's compile).
                        p = f(p, s if decides == "host" else jnp.int32(s))
            for t in threading.enumerate():  # a program compiling ahead, if any
                if t.name == "pmaptap-compile":
                    t.join(120)
            print(sorted(compiled))
            for name in ("cb", "out"):
                print(sorted((r["step"], r["fingerprint"]) for r in
                             pmaptap.read(r"{tmp_path}/" + decides + name + ".jsonl")
                             if r["kind"] == "fingerprint"))
        """,
        devices=1,
        timeout=300,
    ).stdout.splitlines()
    compiled, cb, got = (eval(line) for line in out[-6:-3])
    assert not [c for c in compiled if c[0] == "jit(hash)"], compiled
    assert got == cb and [s for s, _ in got] == [0, 2], (got, cb)
    compiled, cb, got = (eval(line) for line in out[-3:])
    assert ("jit(hash)", "pmaptap-compile") in compiled, compiled
    assert ("jit(hash)", "MainThread") not in compiled, compiled
    assert got == cb and [s for s, _ in got] == [0, 2], (got, cb)


@pytest.mark.parametrize("x64", [False, True], ids=["x32", "x64"])
def test_small_values_of_every_dtype_travel_packed_and_exact(tmp_path, x64):
    """The small values the host reads whole (scalar taps, steps) leave the
    step in one bundle of bytes (lift.py: ``_pack``); every dtype comes back
    bit for bit, as the callback transport writes it: 1-, 2-, 4- and 8-byte
    integers and floats, bool, bfloat16, beside vectors that keep their
    own outputs, one step number shared by every tap."""
    dtypes = ["int8", "uint8", "bool", "float16", "bfloat16", "float8_e4m3fn", "int16", "uint16"]
    dtypes += ["int32", "uint32", "float32"] + (["int64", "uint64", "float64"] if x64 else [])

    def value(dtype: str, n: int):
        if dtype == "bool":
            return jnp.arange(n) % 2 == 1
        return (jnp.arange(n) * 37 - 20).astype(dtype)

    def step(s):
        for d in dtypes:
            pmaptap.tap(value(d, 1)[0] + (s * 0).astype(d), f"{d}/scalar", step=s)
            pmaptap.tap(value(d, 3), f"{d}/vector", step=s)
        return s + 1

    with jax.enable_x64(x64):
        for wrap, name in ((jax.jit, "cb.jsonl"), (pmaptap.jit, "out.jsonl")):
            with pmaptap.Session(str(tmp_path / name), run="dtypes"):
                f, s = wrap(step), jnp.int32(7)
                for _ in range(2):
                    s = f(s)
        lifted = pmaptap.jit(step).trace(jnp.int32(0)).jaxpr.out_avals
    recs = _assert_same(tmp_path / "out.jsonl", tmp_path / "cb.jsonl")
    assert len(recs) == 2 * 2 * len(dtypes)
    # The step's outputs: its own, the bundle (every scalar, the step once),
    # then each vector (plain jit reads those shard by shard).
    assert len(lifted) == 2 + len(dtypes), lifted
    assert lifted[1].dtype == jnp.uint8 and lifted[1].ndim == 1, lifted


def test_a_multi_process_step_packs_nothing(monkeypatch):
    # A bundle split over processes would hide its pieces from the processes
    # not holding them: in a multi-process job each output travels alone.
    def step(s):
        pmaptap.tap(s * 2, "a", step=s)
        pmaptap.tap(s * 3, "b", step=s)
        return s

    one = pmaptap.jit(step).trace(jnp.int32(0)).jaxpr.out_avals
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    many = pmaptap.jit(step).trace(jnp.int32(0)).jaxpr.out_avals
    assert [a.dtype for a in one] == [jnp.int32, jnp.uint8], one
    # The function's output, then each tap's value and step.
    assert len(many) == 5 and jnp.uint8 not in [a.dtype for a in many], many


def test_a_step_after_a_shutdown_that_left_steps_queued_is_delivered():
    """shutdown() at exit gives up on a drain stuck in a slow delivery and
    leaves the steps behind it queued; a step submitted after that (a late
    exit handler's) past the in-flight bound waited for room for ever: no
    thread read the queue. Now the drain runs again and delivers them all."""
    import threading

    release, delivered = threading.Event(), []

    def deliver(spec, payload, block):
        release.wait(30)  # the first delivery is stuck until released
        delivered.append(int(payload[1]))

    drain = outputs.Drain(deliver, lambda e, name: None)
    # Computed values: an argument tapped as it came is read from the call,
    # not from the step's outputs that this drain is handed.
    staged = pmaptap.jit(lambda s: pmaptap.tap(s * 1, "s", step=s * 1))._staged
    lifted = [staged(jnp.int32(k))[1] for k in range(3)]

    def submit(k: int, max_bytes: int = 1 << 30) -> None:
        drain.submit(lifted[k].nodes, lifted[k].arrays, max_bytes, lifted[k].packing)

    submit(0)
    submit(1)
    assert drain.shutdown(0.2) == 2  # step 0 stuck in delivery, step 1 queued
    release.set()
    late = threading.Thread(target=submit, args=(2, 1))  # past the bound
    late.start()
    late.join(10)
    assert not late.is_alive(), "submit waited for room with no drain to make it"
    assert drain.wait(10)
    assert sorted(delivered) == [0, 1, 2]


# A pmap step called on fewer devices first (a warm-up on a small batch):
# each device's automatic step counts its own executions of the tap.
_WARM_UP = {
    "disagreeing": (lambda x: pmaptap.tap(x, "x") * 2, [4, 8], 1),
    "agreeing": (lambda x: pmaptap.tap(x * 0 + 1, "x") * 2, [4, 8, 8], 1),
    "proven": (lambda x: pmaptap.tap(jax.lax.pmean(x, "i"), "x") * 2, [4, 8], 1),
    "per_device": (lambda x: pmaptap.tap(x, "x", dedup="per_device") * 2, [4, 8], 1),
    "replicated": (lambda x: pmaptap.tap(x, "x", dedup="replicated") * 2, [4, 8], 1),
    "every=2": (lambda x: pmaptap.tap(x, "x", every=2) * 2, [4, 8, 8, 4, 8], 2),
    "verify off": (lambda x: pmaptap.tap(x * 0 + 1, "x", dedup="replicated"), [4, 8, 8], 1),
    "grouped": (lambda x: pmaptap.tap(pmaptap.tap(x, "y") * 0 + 1, "x"), [4, 8, 8], 1),
}


@pytest.mark.parametrize("case", list(_WARM_UP))
def test_pmap_on_fewer_then_more_devices_counts_each_device_under_both_transports(tmp_path, case):
    """The same pmap step called on 4 devices, then on 8: devices 0-3 are a
    step ahead of devices 4-7 from then on. Both transports write the same
    records, and each device's k-th execution of the tap is its step k (no
    device repeats a step): agreeing values one record per step and group of
    devices, disagreeing ones per device, ``every`` kept per device."""
    body, calls, every = _WARM_UP[case]

    def go(wrap, path):
        with pmaptap.Session(str(path), run="w"):
            with pmaptap.configured(verify_replicated=case != "verify off"):
                f = wrap(body, axis_name="i")
                for n in calls:
                    f(jnp.arange(float(n)))

    go(jax.pmap, tmp_path / "cb.jsonl")
    go(pmaptap.pmap, tmp_path / "out.jsonl")
    recs = _assert_same(tmp_path / "out.jsonl", tmp_path / "cb.jsonl")
    held = sorted(
        (r["step"], d)
        for r in recs
        if r["name"] == "x"
        for d in (r["devices"] if r["kind"] == "replicated" else [r["device"]])
    )
    want = sorted(
        (s, d) for d in range(8) for s in range(sum(d < n for n in calls)) if s % every == 0
    )
    assert held == want
    kinds = {
        (r["kind"], bool(r.get("divergent")), r.get("verified")) for r in recs if r["name"] == "x"
    }
    assert (
        kinds
        == {
            "disagreeing": {("per_device", False, None)},
            "agreeing": {("replicated", False, None)},
            "proven": {("replicated", False, None)},
            "per_device": {("per_device", False, None)},
            "replicated": {("replicated", True, None)},
            "every=2": {("per_device", False, None)},
            "verify off": {("replicated", False, False)},
            "grouped": {("replicated", False, None)},
        }[case]
    )


def test_tap_in_a_host_callback_function_is_written_as_under_jax_jit(tmp_path, caplog):
    # pmaptap.tap called by the host function of a jax.debug.callback: it
    # runs on the host with a host value, outside any trace (an eager tap):
    # nothing to lift and nothing held back, under either transport.
    def host(v):
        pmaptap.tap(np.asarray(v), "in_host")

    def step(x):
        jax.debug.callback(host, x)
        pmaptap.tap(x * 2, "traced")
        return x + 1

    for wrap, out in [(jax.jit, "cb"), (pmaptap.jit, "out")]:
        with caplog.at_level(logging.WARNING, logger="pmaptap"):
            start = len(caplog.records)
            with pmaptap.Session(str(tmp_path / f"{out}.jsonl"), run="h"):
                f = wrap(step)
                for i in range(3):
                    f(jnp.float32(i))
            assert not [r for r in caplog.records[start:] if r.name.startswith("pmaptap")]
    _assert_same(tmp_path / "out.jsonl", tmp_path / "cb.jsonl")
    recs = pmaptap.read(str(tmp_path / "out.jsonl"))
    assert sorted((r["step"], r["value"]) for r in recs if r["name"] == "in_host") == [
        (0, 0.0),
        (1, 1.0),
        (2, 2.0),
    ]
    # The user's own callback stays; the traced tap is no callback.
    text = pmaptap.jit(step).lower(jnp.float32(0)).as_text()
    assert text.count("callback(") == jax.jit(lambda x: jax.debug.callback(host, x)).lower(
        jnp.float32(0)
    ).as_text().count("callback(")


# ---------------------------------------------------------------- NaN / inf
_ONE_DEVICE_BIG = """
import json, os
import jax, jax.numpy as jnp
import pmaptap

def f(x):
    pmaptap.tap(x, "big")
    pmaptap.tap(jax.vmap(lambda r: (pmaptap.tap(r, "row"), r)[1])(x.reshape(4, -1)), "rows")
    def body(c):
        pmaptap.tap(c[1], "in_while")  # keeps its callback, with the step's statistics
        return c[0] + 1, c[1] * 2
    return jnp.sum(jax.lax.while_loop(lambda c: c[0] < 2, body, (0, x))[1])

x = jnp.arange(100_000, dtype=jnp.float32) / 7
out = {"devices": jax.device_count()}
for name, jit in (("callbacks", jax.jit), ("outputs", pmaptap.jit)):
    with pmaptap.configured(max_value_bytes=1024), pmaptap.Session(os.environ["TAPS"] + name):
        step = jit(f)
        step(x).block_until_ready()
    if jit is pmaptap.jit:
        # The program's outputs: the function's, then the taps' values.
        info = step.trace(x).jaxpr.out_avals
        out["shapes"] = [list(a.shape) for a in info]
    out[name] = [
        {k: v for k, v in r.items() if k not in ("time", "run", "devices")}
        for r in pmaptap.read(os.environ["TAPS"] + name)
    ]
print(json.dumps(out))
"""


def test_one_device_big_leaves_leave_the_step_as_their_statistics(tmp_path):
    """On a one-device job (a single accelerator chip) a leaf above
    max_value_bytes is summarized in the step, as a host callback's
    lowering does: the step's outputs hold its statistics (one row of the
    device's: _trace/shardstats.py), never the leaf (before: the whole leaf
    was copied to the host every step and summarized there, in other
    arithmetic: another std, another vhash); the records are the callback
    transport's, a vmapped tap and a while_loop's fallback callback
    included (the devices field aside: outputs name the one device)."""
    proc = start_python(_ONE_DEVICE_BIG, devices=1, TAPS=str(tmp_path / "t"))
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    got = json.loads(out.splitlines()[-1])
    assert got["devices"] == 1
    # No leaf itself: the sum, and one row of statistics per big leaf (the
    # vmapped "row": the statistics of each of its 4 rows).
    w = statistics_row_width
    assert sorted(got["shapes"]) == sorted(
        [[], [1, w((100_000,), 0)], [1, w((4, 25_000), 0)], [1, w((4, 25_000), 1)]]
    ), got["shapes"]
    key = lambda r: (r["name"], r["step"], r.get("iteration"))  # noqa: E731
    cb, outs = sorted(got["callbacks"], key=key), sorted(got["outputs"], key=key)
    assert [key(r) for r in cb] == [
        ("big", 0, None),
        ("in_while", 0, [0]),  # one call of the step, two iterations of its loop
        ("in_while", 0, [1]),
        ("row", 0, None),
        ("rows", 0, None),
    ]
    assert all(r["summarized"] for r in cb)
    assert outs == cb


def test_nan_and_inf_are_recorded_as_by_host_callbacks(tmp_path):
    mesh = Mesh(np.array(jax.devices()), ("d",))
    x = jax.device_put(
        jnp.arange(32, dtype=jnp.float32).reshape(8, 4) - 3, NamedSharding(mesh, P("d"))
    )

    def step(x):
        pmaptap.tap(jnp.log(x[0, 0] + 2), "nan")  # log(-1)
        pmaptap.tap(jnp.log(x[0, 3]), "neg_inf")  # log(0)
        pmaptap.tap(x / 0.0, "ratio", dedup="per_device")  # +-inf and nan, per shard
        pmaptap.tap({"a": jnp.array([jnp.nan, jnp.inf, -jnp.inf, 1.0]) * x[1, 1]}, "tree")

        def body(c, row):
            pmaptap.tap(jnp.sqrt(row[0]), "in_scan")  # nan for negative rows
            return c, None

        jax.lax.scan(body, 0.0, x)
        return x

    def pstep(x):
        pmaptap.tap(1.0 / (x - x), "p_ratio", dedup="per_device")
        pmaptap.tap(jax.lax.psum(jnp.log(x[0]), "i"), "p_sum")
        return x

    xs = jnp.arange(8.0) - 1.0
    for wrap, pwrap, out in [(jax.jit, jax.pmap, "cb"), (pmaptap.jit, pmaptap.pmap, "out")]:
        with pmaptap.Session(str(tmp_path / f"{out}.jsonl"), run="nan"):
            wrap(step)(x)
            pwrap(pstep, axis_name="i")(xs.reshape(8, 1))
    got = _assert_same(tmp_path / "out.jsonl", tmp_path / "cb.jsonl")
    recs = {(r["name"], r["step"]): r for r in pmaptap.read(str(tmp_path / "out.jsonl"))}
    assert math.isnan(recs["nan", 0]["value"])
    assert recs["neg_inf", 0]["value"] == -math.inf
    assert recs["p_sum", 0]["value"] != recs["p_sum", 0]["value"]  # log(-1) on device 0
    scan = [r["value"] for r in got if r["name"] == "in_scan"]
    assert sum(v == "NaN" for v in scan) == 1  # row 0 starts at -3
    assert any("Infinity" in json.dumps(r["value"]) for r in got if r["name"] == "ratio")


# ---------------------------------------------------------------- no host callback
def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()), ("d",))


def _everywhere(x):
    """Taps in scan, cond, remat and shard_map bodies."""

    def body(c, xi):
        pmaptap.tap(xi, "in_scan")
        return c + xi.sum(), None

    c, _ = jax.lax.scan(body, 0.0, x)
    y = jax.lax.cond(c > 0, lambda v: pmaptap.tap(v, "in_cond") + 1, lambda v: v - 1, c)
    z = jax.checkpoint(lambda v: pmaptap.tap(jnp.sin(v), "in_remat"))(y)

    def inner(b):
        pmaptap.tap(b.sum(), "in_shard_map", dedup="per_device")
        return b * 2

    w = jax.shard_map(inner, mesh=_mesh(), in_specs=P("d"), out_specs=P("d"))(x)
    return z + w.sum()


def _everywhere_pmap(x):
    def body(c, xi):
        pmaptap.tap(xi, "in_scan")
        return c + xi, None

    c, _ = jax.lax.scan(body, 0.0, x)
    y = jax.lax.cond(c > 0, lambda v: pmaptap.tap(v, "in_cond") + 1, lambda v: v - 1, c)
    z = jax.checkpoint(lambda v: pmaptap.tap(jnp.sin(v), "in_remat"))(y)
    pmaptap.tap(x, "per_device", dedup="per_device")
    return jax.lax.psum(z, "i")


def test_lowered_steps_hold_no_host_callback(tmp_path):
    x = jnp.ones((8, 4))
    cases = [
        (jax.jit(_everywhere), pmaptap.jit(_everywhere)),
        (
            jax.pmap(_everywhere_pmap, axis_name="i"),
            pmaptap.pmap(_everywhere_pmap, axis_name="i"),
        ),
    ]
    for plain, lifted in cases:
        # The host callbacks JAX's own wrapper lowers the taps to...
        assert "callback" in plain.lower(x).as_text()
        # ...are none with pmaptap's: the taps are outputs of the step.
        text = lifted.lower(x).as_text()
        assert "callback" not in text
        assert "custom_call" not in text
        # And they are written.
        path = tmp_path / f"{uuid.uuid4().hex}.jsonl"
        with pmaptap.Session(str(path), run="l"):
            lifted(x)
        assert {r["name"] for r in pmaptap.read(str(path))} >= {
            "in_scan",
            "in_cond",
            "in_remat",
        }
    names = {r["name"] for r in pmaptap.read(str(path))}
    assert "per_device" in names


def test_bodies_traced_under_jax_jit_first_are_not_reused_with_their_callbacks(tmp_path):
    # JAX caches the traced bodies of scan (and nested jits) per function:
    # a body traced for jax.jit holds host callbacks, one traced inside a
    # pmaptap.jit step holds output marks. Neither may be reused for the
    # other (before, pmaptap.jit silently kept the callbacks).
    def body(c, xi):
        pmaptap.tap(xi, "in_scan")
        return c + xi, None

    helper = jax.jit(lambda v: pmaptap.tap(v * 2, "in_helper"))

    def step(x):
        c, _ = jax.lax.scan(body, 0.0, x)
        return helper(c)

    x = jnp.arange(4.0)
    assert "callback" in jax.jit(step).lower(x).as_text()
    jax.jit(step)(x)
    assert "callback" not in pmaptap.jit(step).lower(x).as_text()
    # And back: a new jax.jit of the same bodies has its callbacks again.
    assert "callback" in jax.jit(lambda v: step(v) + 0).lower(x).as_text()
    for wrap, out in [(jax.jit, "cb"), (pmaptap.jit, "out")]:
        with pmaptap.Session(str(tmp_path / f"{out}.jsonl"), run="c"):
            wrap(lambda v: step(v) + 1)(x)
    got = _assert_same(tmp_path / "out.jsonl", tmp_path / "cb.jsonl")
    assert sorted(r["name"] for r in got) == ["in_helper"] + ["in_scan"] * 4


def test_lowered_step_outputs_are_the_function_then_the_taps():
    f = pmaptap.jit(lambda x: (pmaptap.tap(x * 2, "y") + 1, x.sum()))
    traced = f.trace(jnp.ones((8,)))
    # The program returns the function's two outputs, then the tap's value;
    # what the stages say about the outputs is the function's only
    # (tests/host/test_output_stages.py).
    assert [o.shape for o in traced.jaxpr.out_avals] == [(8,), (), (8,)]
    assert [o.shape for o in traced.lower().out_info] == [(8,), ()]


# ---------------------------------------------------------------- composition
def _without(recs: list[dict], *keys: str) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in keys} for r in recs]


def test_composes_with_equinox_filter_jit(tmp_path):
    eqx = pytest.importorskip("equinox")  # in the test extra: CI runs it
    import optax

    key = jax.random.PRNGKey(0)
    model = eqx.nn.MLP(4, 2, 16, 2, key=key)  # holds activation functions: not arrays
    opt = optax.sgd(0.1)
    x = jax.random.normal(key, (32, 4))
    y = jnp.ones((32, 2))

    def step(model, state, x, y):
        def loss_fn(m):
            return jnp.mean((jax.vmap(m)(x) - y) ** 2)

        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        pmaptap.tap(loss, "loss")
        pmaptap.tap(optax.tree.norm(grads), "grad_norm")

        def per_layer(c, w):
            pmaptap.tap(jnp.abs(w).mean(), "w")
            return c, None

        jax.lax.scan(per_layer, 0.0, jnp.stack([lyr.weight.sum() for lyr in model.layers]))
        updates, state = opt.update(grads, state)
        return eqx.apply_updates(model, updates), state, loss

    results = {}
    for name, f in [
        ("cb", eqx.filter_jit(step)),
        ("out", pmaptap.jit(step, jit=eqx.filter_jit)),
    ]:
        m, s = model, opt.init(eqx.filter(model, eqx.is_array))
        with pmaptap.Session(str(tmp_path / f"{name}.jsonl"), run="eqx"):
            for _ in range(3):
                m, s, loss = f(m, s, x, y)
        results[name] = (m, float(loss))
    # The same training (the model came back whole, non-array fields too)...
    assert results["out"][1] == results["cb"][1]
    assert results["out"][0].layers[0].weight.tolist() == results["cb"][0].layers[0].weight.tolist()
    assert results["out"][0].activation is model.activation
    # ...and the same records.
    got = _assert_same(tmp_path / "out.jsonl", tmp_path / "cb.jsonl")
    assert sorted((r["name"], r["step"]) for r in got if r["name"] != "w") == [
        (n, i) for n in ("grad_norm", "loss") for i in range(3)
    ]


class _Model:
    """A small Flax NNX model with state that changes in a step (a counter
    Variable, and the optimizer's)."""

    @staticmethod
    def make():
        from flax import nnx

        class M(nnx.Module):
            def __init__(self, rngs):
                self.l1 = nnx.Linear(4, 16, rngs=rngs)
                self.l2 = nnx.Linear(16, 2, rngs=rngs)
                self.calls = nnx.Variable(jnp.array(0))

            def __call__(self, x):
                self.calls[...] = self.calls[...] + 1
                h = jax.nn.relu(self.l1(x))
                pmaptap.tap(jnp.mean(h), "act")
                return self.l2(h)

        return M(nnx.Rngs(0))


def _nnx_train_step(model, optimizer, x, y):
    from flax import nnx

    def loss_fn(m):
        return jnp.mean((m(x) - y) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    pmaptap.tap(loss, "loss")
    return loss


def test_composes_with_flax_nnx_jit_and_its_state_updates(tmp_path):
    import optax
    from flax import nnx

    x = jax.random.normal(jax.random.PRNGKey(1), (32, 4))
    y = jnp.ones((32, 2))
    done = {}
    for name, f in [
        ("cb", nnx.jit(_nnx_train_step)),
        ("out", pmaptap.jit(_nnx_train_step, jit=nnx.jit)),
    ]:
        model = _Model.make()
        opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        with pmaptap.Session(str(tmp_path / f"{name}.jsonl"), run="nnx"):
            losses = [float(f(model, opt, x, y)) for _ in range(3)]
        done[name] = (model, opt, losses)
    model, opt, losses = done["out"]
    # The step's changes to the module and the optimizer reached them.
    assert int(model.calls[...]) == int(done["cb"][0].calls[...]) == 3
    assert int(opt.step[...]) == 3
    assert losses == done["cb"][2] and losses[2] < losses[0]
    assert model.l1.kernel[...].tolist() == done["cb"][0].l1.kernel[...].tolist()
    _assert_same(tmp_path / "out.jsonl", tmp_path / "cb.jsonl")


def test_composes_with_flax_nnx_split_merge(tmp_path):
    import optax
    from flax import nnx

    x = jax.random.normal(jax.random.PRNGKey(1), (32, 4))
    y = jnp.ones((32, 2))
    model = _Model.make()
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    graphdef, state = nnx.split((model, opt))

    def pure(state, x, y):
        model, opt = nnx.merge(graphdef, state)
        loss = _nnx_train_step(model, opt, x, y)
        return nnx.state((model, opt)), loss

    for name, f in [("cb", jax.jit(pure)), ("out", pmaptap.jit(pure))]:
        s = state
        with pmaptap.Session(str(tmp_path / f"{name}.jsonl"), run="nnx"):
            for _ in range(3):
                s, loss = f(s, x, y)
    _assert_same(tmp_path / "out.jsonl", tmp_path / "cb.jsonl")
    nnx.update((model, opt), s)
    assert int(opt.step[...]) == 3


# ------------------------------------------------------------ arguments as they came
def _outputs_of(lowered) -> list[str]:
    """The types of the lowered program's outputs (its main function's)."""
    head = lowered.as_text().split("func.func public @main", 1)[1].split("{\n", 1)[0]
    return re.findall(r"tensor<([^>]*)>", head.split(") -> (", 1)[1])


def test_a_step_number_handed_in_is_read_from_the_call(tmp_path):
    """A tap's ``step=s`` where ``s`` is an argument as it came: the program
    does not return it (the host reads the call's own: a jax.Array or a
    Python number, by position or keyword, through the ahead-of-time stages
    too), and the records are the callback transport's; a donated argument,
    gone after the call, stays an output."""

    def step(w, s, lr):
        pmaptap.tap(lr, "lr", step=s)
        pmaptap.tap(jnp.sum(w), "total", step=s)
        return w * (1 - lr)

    w = jnp.arange(4.0)
    for wrap, name in ((jax.jit, "cb.jsonl"), (pmaptap.jit, "out.jsonl")):
        with pmaptap.Session(str(tmp_path / name), run="args"):
            f = wrap(step)
            x = f(w, jnp.int32(1), 0.5)
            x = f(x, 2, jnp.float32(0.25))
            x = f(x, s=jnp.int32(3), lr=0.125)
            x = f(x, lr=0.0625, s=4)
            compiled = f.lower(x, jnp.int32(5), 1.0).compile()
            x = compiled(x, jnp.int32(5), 1.0)
    recs = _assert_same(tmp_path / "out.jsonl", tmp_path / "cb.jsonl")
    assert [(r["step"], r["value"]) for r in recs if r["name"] == "lr"] == [
        (1, 0.5),
        (2, 0.25),
        (3, 0.125),
        (4, 0.0625),
        (5, 1.0),
    ]
    args = (w, jnp.int32(1), 0.5)
    # The function's output and one bundle of bytes (lr and the sum, 8
    # bytes each: 4, aligned); s is not returned ...
    plain = _outputs_of(pmaptap.jit(step).lower(*args))
    assert plain[1:] == ["16xui8"], plain
    # ... unless donated (by position, or by name): then it travels too.
    for donate in ({"donate_argnums": 1}, {"donate_argnames": "s"}):
        held = _outputs_of(pmaptap.jit(step, **donate).lower(*args))
        assert held[1:] == ["24xui8"], (donate, held)
    kw = _outputs_of(pmaptap.jit(step, donate_argnames="s").lower(w, s=jnp.int32(1), lr=0.5))
    assert kw[1:] == ["24xui8"], kw


def test_a_step_number_donated_elsewhere_after_the_call_is_not_lost(tmp_path, monkeypatch):
    """The step number read from the call (above) is the caller's array: one
    donated to another computation right after the call, computed already
    or still being computed, is deleted before the drain, resting between
    reads, gets to it. Every record is still written (it was read at the
    call, or copied on its device then)."""
    monkeypatch.setattr(outputs, "REST_S", 0.5)

    def step(w, s):
        pmaptap.tap(jnp.sum(w), "total", step=s)
        return w + 1

    donate = jax.jit(lambda x: x + 1, donate_argnums=0)
    path = tmp_path / "out.jsonl"
    with pmaptap.Session(str(path), run="donated"):
        f, w = pmaptap.jit(step), jnp.ones(3)
        for k in range(6):
            s = jnp.int32(k) if k % 2 == 0 else computed_step_number(k)
            w = f(w, s)
            donate(s)
    assert [r["step"] for r in pmaptap.read(str(path))] == list(range(6))


def _later_calls(monkeypatch) -> list:
    """What every call of a fingerprint's Later (later.py) returns from now
    on: [number, table, the step number kept for the drain], in order."""
    calls: list = []
    real_call = later.Later.__call__

    def call(self, flag, leaves):
        calls.append(real_call(self, flag, leaves))
        return calls[-1]

    monkeypatch.setattr(later.Later, "__call__", call)
    return calls


@pytest.mark.parametrize("hashed", ["by a program", "on the host"])
def test_a_step_number_in_flight_is_kept_by_the_fingerprint_s_program(
    tmp_path, monkeypatch, hashed
):
    """A step number still being computed at the call, from which a
    fingerprint hashed after the step decides its due steps: the program
    dispatched on it returns the copy the drain reads (or the host, which
    waited for it, its value), so no copy of its own is dispatched; donated
    elsewhere right after the call, it is not lost. Records as jax.jit's."""
    import importlib

    jit_module = importlib.import_module("pmaptap._outputs.jit")  # (the package's jit: a function)
    monkeypatch.setattr(outputs, "REST_S", 0.5)
    if hashed == "by a program":
        monkeypatch.setattr(later.fphash_host, "SUPPORTED", False)
    copied = []  # (jit.py's own copy of a step number in flight)
    real_kept = jit_module._kept

    def kept(x, dtype):
        copied.append(isinstance(x, jax.Array) and not x.is_ready())
        return real_kept(x, dtype)

    monkeypatch.setattr(jit_module, "_kept", kept)
    calls = _later_calls(monkeypatch)

    def step(w, s):
        pmaptap.tap(jnp.sum(w), "total", step=s)
        w = w * 2 + 1
        pmaptap.fingerprint(w, "w", step=s, every=3)  # (an output: hashed after the step)
        return w

    donate = jax.jit(lambda x: x + 1, donate_argnums=0)
    flying = []
    for wrap, name in ((jax.jit, "cb.jsonl"), (pmaptap.jit, "out.jsonl")):
        with pmaptap.Session(str(tmp_path / name), run="kept"):
            f, w = wrap(step), jnp.arange(6.0)
            for k in range(7):
                s = jax.block_until_ready(jnp.int32(k)) if k % 2 == 0 else computed_step_number(k)
                before = not s.is_ready()
                w = f(w, s)
                if wrap is pmaptap.jit:
                    flying.append(before)
                donate(s)
    recs = _assert_same(tmp_path / "out.jsonl", tmp_path / "cb.jsonl")
    assert sorted(r["step"] for r in recs if r["name"] == "total") == list(range(7))
    assert sorted(r["step"] for r in recs if r["kind"] == "fingerprint") == [0, 3, 6]
    assert any(flying), flying  # (some step numbers were in flight at the call)
    handed = [kept is not None for _, _, kept in calls]  # kept by the Later, per call
    assert handed == flying, (handed, flying)
    assert not any(copied), copied


@pytest.mark.parametrize("hashed", ["by a program", "on the host"])
def test_a_fingerprint_after_the_step_is_due_by_the_call_s_step(tmp_path, monkeypatch, hashed):
    """A fingerprint hashed after the step, every 3 steps of a step number
    read from the call: the step returns nothing for it (its ``due`` flag
    is decided on the host from the call's step), and a step not due
    dispatches no hash; a step number still being computed on the device
    is decided by the hash program there (as off a CPU device); where the
    host hashes (a CPU device), the first one on the host once computed,
    and the program, compiled from then on, decides the next ones on the
    device. Records as jax.jit's."""
    monkeypatch.setattr(later, "MIN_BYTES", 0)
    # The first call with a step number in flight starts the compile (a
    # run has IN_FLIGHT_CALLS of them first: test_fphash_host.py).
    monkeypatch.setattr(later, "IN_FLIGHT_CALLS", 1)
    if hashed == "by a program":
        monkeypatch.setattr(later.fphash_host, "SUPPORTED", False)
    calls = _later_calls(monkeypatch)

    def step(p, s):
        p = jax.tree.map(lambda x: x * 1.5 + 1, p)
        pmaptap.fingerprint(p, "params", step=s, every=3)
        return p

    params = {"w": jnp.arange(64.0).reshape(16, 4), "b": jnp.ones((5,), jnp.bfloat16)}
    lowered = pmaptap.jit(step).lower(params, jnp.int32(0))
    assert len(_outputs_of(lowered)) == 2, _outputs_of(lowered)  # p's leaves only
    # Per step from 4: still computed after the call (so at it), or, where
    # the host waits for it, when the call was made.
    in_flight, compiling = [], []
    for wrap, name in ((jax.jit, "cb.jsonl"), (pmaptap.jit, "out.jsonl")):
        f = wrap(step, donate_argnums=0)
        p = jax.tree.map(jnp.copy, params)
        with pmaptap.Session(str(tmp_path / name), run="due"):
            for s in range(7):
                if s < 4:
                    p = f(p, jax.block_until_ready(jnp.int32(s)))  # read at the call
                    continue
                x = computed_step_number(s)
                before = not x.is_ready()
                p = f(p, x)
                if wrap is pmaptap.jit:
                    waited = s == 4 and hashed == "on the host"  # (the host waited for it)
                    in_flight.append(before if waited else not x.is_ready())
                    for t in threading.enumerate():  # the program compiling, if any
                        if t.name == "pmaptap-compile":
                            compiling.append(s)
                            t.join(120)
    recs = _assert_same(tmp_path / "out.jsonl", tmp_path / "cb.jsonl")
    assert sorted({r["step"] for r in recs}) == [0, 3, 6]
    # Decided on the host (dispatched on due steps only), then on the device
    # (dispatched every step whose step number was still in flight); where
    # the host hashes, the first of those (step 4, not due) on the host,
    # which then compiles the program.
    dispatched = [number is not None for number, _, _ in calls]
    assert dispatched[:4] == [True, False, False, True], dispatched
    assert any(in_flight), in_flight
    late = list(zip(dispatched[4:], in_flight))
    if hashed == "on the host":
        assert in_flight[0] and not dispatched[4] and compiling == [4], (late, compiling)
        late = late[1:]
    assert all(d for d, was in late if was), late


def test_a_step_number_donated_by_the_same_call_is_a_clear_error(tmp_path):
    """The step number is also a leaf of a donated argument (``f(donate(a),
    a)``, which JAX rejects where the step reads ``a``): the step does not
    read it, so the call runs and deletes it; pmaptap says why it cannot
    take it instead of failing to read a deleted array."""

    def step(st, s):
        pmaptap.tap(jnp.sum(st["w"]), "w", step=s)
        return {"w": st["w"] + 1, "step": st["step"] + 1}

    with pmaptap.Session(str(tmp_path / "out.jsonl"), run="same"):
        f = pmaptap.jit(step, donate_argnums=0)
        st = {"w": jnp.ones(3), "step": jnp.int32(0)}
        st = f(st, jnp.int32(0))  # a step number of its own: fine
        with pytest.raises(ValueError, match="donated too"):
            f(st, st["step"])
