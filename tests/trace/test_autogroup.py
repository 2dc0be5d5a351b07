"""Automatic grouping (issue 17): the taps of one traced body that are not in
a ``pmaptap.group()`` block share ONE gather + cond + host callback, emitted
when the body's trace ends. Records must be exactly those of the same taps
emitted one by one (``configure(auto_group=False)``); only the number of
callbacks changes."""

from __future__ import annotations

import inspect
import json
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pmaptap
from pmaptap._trace import traceend
from pmaptap._trace.primitive import callback_p
from pmaptap._trace.shardcall import shard_call_p


def _subjaxprs(value):
    if isinstance(value, ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _subjaxprs(v)


def count_callbacks(jaxpr) -> int:
    """pmaptap host-callback equations in ``jaxpr`` and every jaxpr nested
    in its equations' parameters (pmap/shard_map/jit bodies, cond branches,
    scan bodies, custom_vmap calls): ``callback_p``, and ``shard_call_p``
    for taps under plain jit."""
    if isinstance(jaxpr, ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive is callback_p or eqn.primitive is shard_call_p
        for p in eqn.params.values():
            n += sum(count_callbacks(j) for j in _subjaxprs(p))
    return n


def _records(path) -> list[str]:
    """The records without their wall-clock time, comparable as a multiset."""
    out = []
    for r in pmaptap.read(path):
        d = r.to_dict() if hasattr(r, "to_dict") else dict(r)
        d.pop("time", None)
        out.append(json.dumps(d, sort_keys=True, default=str))
    return sorted(out)


def _run(tmp_path, make, args, *, auto: bool, steps: int = 2, tag: str = ""):
    """(records, callbacks in the traced program) of ``make()`` called
    ``steps`` times on ``args``. ``make`` must wrap a fresh function each
    time: JAX caches traces per function, and options are read at trace
    time."""
    path = tmp_path / f"{tag}{'auto' if auto else 'one'}.jsonl"
    with pmaptap.configured(auto_group=auto):
        f = make()
        n = count_callbacks(jax.make_jaxpr(f)(*args))
        with pmaptap.Session(str(path), run="ag"):
            for _ in range(steps):
                jax.block_until_ready(f(*args))
    return _records(path), n


def _four_taps(v):
    loss = lax.pmean(jnp.sum(v), "i")
    pmaptap.tap(loss, "loss", dedup="replicated")
    pmaptap.tap(v, "act", dedup="per_device")
    pmaptap.tap({"a": v * 2, "b": jnp.int32(3)}, "tree")
    # Diverges on device 3 only: a verified replicated tap must flag it.
    pmaptap.tap(loss + (lax.axis_index("i") == 3), "diverges", dedup="replicated")
    return v


def test_n_ungrouped_taps_in_a_pmap_step_are_one_callback_with_the_same_records(tmp_path):
    args = (jnp.arange(8.0),)

    def make():
        return jax.pmap(lambda v: _four_taps(v), axis_name="i")

    auto, n_auto = _run(tmp_path, make, args, auto=True)
    one, n_one = _run(tmp_path, make, args, auto=False)
    assert n_auto == 1
    assert n_one == 4  # auto_group off: one callback per tap, as before
    assert auto == one
    diverged = [json.loads(r) for r in auto if '"diverges"' in r]
    assert diverged and all(r["divergent"] for r in diverged)
    assert len([r for r in auto if '"name": "act"' in r]) == 2 * 8


def test_n_ungrouped_taps_in_a_shard_map_step_are_one_callback(tmp_path):
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    xs = jax.device_put(jnp.arange(8.0).reshape(4, 2), NamedSharding(mesh, P("x", "y")))

    def body(v):
        m = lax.pmean(jnp.sum(v), ("x", "y"))
        for k in range(16):
            pmaptap.tap(m * k if k % 2 else v * (k + 1), f"t{k}", dedup="auto")
        return v

    def make():
        return jax.jit(
            jax.shard_map(lambda v: body(v), mesh=mesh, in_specs=P("x", "y"), out_specs=P("x", "y"))
        )

    auto, n_auto = _run(tmp_path, make, (xs,), auto=True)
    one, n_one = _run(tmp_path, make, (xs,), auto=False)
    assert (n_auto, n_one) == (1, 16)
    assert auto == one and len(auto) == 2 * (8 * 8 + 8)


def test_taps_in_a_scan_body_and_in_the_step_are_grouped_per_trace(tmp_path):
    def body(v):
        pmaptap.tap(v, "outer_a", dedup="per_device")

        def inner(c, x):
            pmaptap.tap(c, "in_carry", dedup="per_device")
            pmaptap.tap(lax.pmean(c, "i"), "in_mean", dedup="replicated")
            pmaptap.tap(x, "in_x")
            return c + x, None

        c, _ = lax.scan(inner, v, jnp.arange(3.0))
        pmaptap.tap(c, "outer_b", dedup="per_device")
        return c

    def make():
        return jax.pmap(lambda v: body(v), axis_name="i")

    args = (jnp.arange(8.0),)
    auto, n_auto = _run(tmp_path, make, args, auto=True)
    one, n_one = _run(tmp_path, make, args, auto=False)
    assert (n_auto, n_one) == (2, 5)  # one in the scan body, one in the step
    assert auto == one
    got = sorted(
        {(d["step"], *d["iteration"]) for d in map(json.loads, auto) if d["name"] == "in_carry"}
    )
    assert got == [(s, k) for s in range(2) for k in range(3)]  # 2 calls x 3 iterations


def test_taps_under_grad_and_vmap_keep_their_records(tmp_path):
    def body(v):
        def loss(w):
            pmaptap.tap(w, "w_in_grad", dedup="per_device")  # JVP/linearize trace
            pmaptap.tap(jnp.sin(w), "sin_in_grad", dedup="per_device")
            return jnp.sum(jnp.sin(w) ** 2)

        g = jax.grad(loss)(v)
        jax.vmap(lambda e: pmaptap.tap(e * 2, "in_vmap", dedup="per_device"))(jnp.stack([v, g]))
        pmaptap.tap(g, "g", dedup="per_device")
        pmaptap.tap(lax.pmean(g, "i"), "g_mean", dedup="replicated")
        return g

    def make():
        return jax.pmap(lambda v: body(v), axis_name="i")

    args = (jnp.arange(8.0),)
    auto, n_auto = _run(tmp_path, make, args, auto=True)
    one, n_one = _run(tmp_path, make, args, auto=False)
    assert auto == one
    # The taps inside the differentiated function (grad's linearize trace,
    # directly in the pmap body) wait for the body's end with g and g_mean:
    # the four share one callback; the tap under vmap is not deferred (its
    # operands are batched).
    assert (n_one, n_auto) == (5, 2)
    vm = [json.loads(r) for r in auto if '"in_vmap"' in r]
    assert len(vm) == 2 * 8 and all(r["shape"] == [2] for r in vm)


def test_a_vmapped_and_rematerialized_step_writes_each_record_once(tmp_path):
    # The group's callback is wrapped like a single tap's: vmap(jit(step))
    # batches it into one callback, and jax.checkpoint does not replay it in
    # the backward pass. Before, an explicit group() under remat + grad wrote
    # every record twice, and one under vmap(jit) made one callback per
    # element with unbatched records.
    def step(v):
        pmaptap.tap(v, "a", dedup="per_device")
        pmaptap.tap(v * 2, "b", dedup="per_device")
        return jnp.sin(v)

    def body(v, grouped):
        def loss(w):
            f = pmaptap.group()(step) if grouped else step
            return jnp.sum(jax.checkpoint(f)(w))

        g = jax.grad(loss)(v)
        jax.vmap(jax.jit(pmaptap.group()(step) if grouped else step))(jnp.stack([v, g, v]))
        return g

    for grouped in (False, True):

        def make(grouped=grouped):
            return jax.pmap(partial(body, grouped=grouped), axis_name="i")

        args = (jnp.arange(8.0),)
        auto, n_auto = _run(tmp_path, make, args, auto=True, tag=f"g{grouped}")
        one, _ = _run(tmp_path, make, args, auto=False, tag=f"g{grouped}")
        assert auto == one
        assert n_auto == 2  # remat body, the vmapped jit body
        recs = [json.loads(r) for r in auto]
        assert len(recs) == 2 * 2 * 2 * 8  # 2 steps x (remat + vmap) x 2 taps x 8
        assert sorted({tuple(r["shape"]) for r in recs}) == [(), (3,)]


def test_traced_every_is_decided_once_for_the_trace(tmp_path):
    def body(v, step):
        # Proven the same on every device (a pmax): no check of the steps
        # on device (layouts.from_leader_if_steps_alike), which would add its own branch.
        step = lax.pmax(step, "i")
        pmaptap.tap(v, "y", step=step, every=3, dedup="per_device")
        pmaptap.tap(lax.pmean(v, "i"), "m", step=step, every=3, dedup="replicated")
        pmaptap.tap(v * 2, "z", step=step, dedup="per_device")
        return v

    calls = {}
    for auto in (True, False):
        path = tmp_path / f"e{auto}.jsonl"
        with pmaptap.configured(auto_group=auto):
            f = jax.pmap(lambda v, s: body(v, s), axis_name="i", in_axes=(0, None))
            calls[auto] = count_callbacks(jax.make_jaxpr(f)(jnp.arange(8.0), jnp.int32(0)))
            with pmaptap.Session(str(path), run="e"):
                for s in range(7):
                    f(jnp.arange(8.0) + s, jnp.int32(s))
        calls[auto, "recs"] = _records(path)
    assert calls[True, "recs"] == calls[False, "recs"]
    # y and m share one cond and callback; z (every step) is alone in its
    # own bucket.
    assert (calls[True], calls[False]) == (2, 3)
    ys = [json.loads(r) for r in calls[True, "recs"] if '"name": "y"' in r]
    assert sorted({r["step"] for r in ys}) == [0, 3, 6] and len(ys) == 3 * 8


def test_explicit_group_and_automatic_grouping_side_by_side(tmp_path):
    def body(v):
        with pmaptap.group():
            pmaptap.tap(v, "g1", dedup="per_device")
            pmaptap.tap(v + 1, "g2", dedup="per_device")
        pmaptap.tap(v + 2, "a1", dedup="per_device")
        pmaptap.tap(v + 3, "a2", dedup="per_device")
        return v

    def make():
        return jax.pmap(lambda v: body(v), axis_name="i")

    auto, n_auto = _run(tmp_path, make, (jnp.arange(8.0),), auto=True)
    one, n_one = _run(tmp_path, make, (jnp.arange(8.0),), auto=False)
    assert (n_auto, n_one) == (2, 3) and auto == one


def _count_prims(jaxpr, name: str) -> int:
    if isinstance(jaxpr, ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == name
        for p in eqn.params.values():
            n += sum(_count_prims(j, name) for j in _subjaxprs(p))
    return n


@pytest.fixture
def deliveries(spy_deliveries):
    """Names of the specs reaching the host, one per host callback."""
    return spy_deliveries()


def test_taps_in_cond_and_while_bodies_share_one_callback_per_device(tmp_path, deliveries):
    # Inside cond/while bodies devices may diverge, so these taps call back
    # from every device with no collective; grouped, each device makes ONE
    # callback for all of them instead of one per tap.
    def body(v):
        def yes(w):
            pmaptap.tap(w, "c1", dedup="per_device")
            pmaptap.tap(w * 2, "c2", dedup="per_device")
            pmaptap.tap(w * 0 + 1, "c3")  # equal wherever it fires
            return w

        def loop(c):
            pmaptap.tap(c[0], "w1", dedup="per_device")
            pmaptap.tap(c[0] * 3, "w2", dedup="per_device")
            return c[0] + 1, c[1] + 1

        w = lax.cond(v > 3, yes, lambda w: w, v)
        return lax.while_loop(lambda c: c[1] < v, loop, (w, jnp.float32(0)))[0]

    def make():
        return jax.pmap(lambda v: body(v), axis_name="i")

    args = (jnp.arange(8.0) % 3 + 2,)
    auto, n_auto = _run(tmp_path, make, args, auto=True)
    calls_auto, deliveries[:] = list(deliveries), []
    one, n_one = _run(tmp_path, make, args, auto=False)
    assert (n_auto, n_one) == (2, 5)
    assert auto == one
    # 2 steps: the cond fires on the devices with v > 3 (values 4: 2 of 8);
    # the loop runs v times on every device (2, 3 or 4).
    loops = int(sum(args[0]))
    assert len(calls_auto) == 2 * (2 + loops)
    assert len(deliveries) == 2 * (3 * 2 + 2 * loops)
    with pmaptap.configured(auto_group=True):
        grouped = jax.make_jaxpr(make())(*args)
    assert _count_prims(grouped, "all_gather") == 0  # no collective where devices diverge


def test_scalar_taps_under_plain_jit_share_one_callback(tmp_path, deliveries):
    def step(x):
        loss = jnp.sum(x**2)
        pmaptap.tap(loss, "loss")
        pmaptap.tap(jnp.float32(0.1), "lr")
        pmaptap.tap(jnp.sqrt(loss), "norm")
        return x - 0.1 * x

    def make():
        return jax.jit(lambda x: step(x))

    args = (jnp.arange(4.0),)
    auto, n_auto = _run(tmp_path, make, args, auto=True, steps=3)
    calls_auto, deliveries[:] = list(deliveries), []
    one, n_one = _run(tmp_path, make, args, auto=False, steps=3)
    assert (n_auto, n_one) == (1, 3)
    assert auto == one and len(auto) == 3 * 3
    assert calls_auto == ["pmaptap/group"] * 3 and len(deliveries) == 3 * 3


def test_auto_group_option_is_checked():
    with pytest.raises(ValueError, match="auto_group must be True or False"):
        pmaptap.configure(auto_group="yes")
    assert pmaptap.options().auto_group is True


def test_trace_end_hook_still_sits_where_jax_ends_a_trace():
    # Automatic grouping needs to run just before a DynamicJaxprTrace becomes
    # a jaxpr. On JAX 0.10 that is JaxprStackFrame.to_jaxpr(frame, trace,
    # out_tracers, debug_info, source_info). If this fails after a JAX
    # upgrade, find where partial_eval now turns a trace's equations into a
    # Jaxpr and move the hook in pmaptap/_trace/traceend.py there.
    from jax._src.interpreters import partial_eval as pe

    assert traceend.installed(), "pmaptap/_trace/traceend.py found no JaxprStackFrame.to_jaxpr"
    hooked = pe.JaxprStackFrame.to_jaxpr
    assert getattr(hooked, "_pmaptap_trace_end_hook", False)
    params = list(inspect.signature(hooked.__wrapped__).parameters)
    assert params[:3] == ["self", "trace", "out_tracers"], params
    assert "frame.to_jaxpr(trace" in inspect.getsource(pe.trace_to_jaxpr_dynamic)
    # JAX 0.9 ends a staging trace there in two places, 0.10 in three (its
    # lower_jaxpr too): every one goes through the hooked method.
    assert inspect.getsource(pe).count("trace.frame.to_jaxpr(trace") >= 2

    # And it works end to end: work deferred for a trace is bound into it.
    seen = []

    class Probe:
        def flush(self):
            seen.append(type(traceend.core.trace_ctx.trace).__name__)
            pmaptap.tap(jnp.float32(1.0), "probe")

    def f(x):
        traceend.deferred(traceend.staging_trace(), "probe", Probe)
        return x + 1

    with pmaptap.configured(auto_group=False):
        jaxpr = jax.make_jaxpr(f)(1.0)
    assert seen == ["DynamicJaxprTrace"]
    assert count_callbacks(jaxpr) == 1


def test_a_scan_body_closing_over_the_traced_step_is_grouped(tmp_path):
    # The step is a tracer of the enclosing pmap body, closed over by the
    # scan body: its taps still share one callback per `every` bucket.
    def body(v, step):
        def inner(c, _):
            pmaptap.tap(c, "c", step=step, dedup="per_device")
            pmaptap.tap(c * 2, "d", step=step, dedup="per_device")
            pmaptap.tap(lax.pmean(c, "i"), "m", step=step, every=2, dedup="replicated")
            pmaptap.tap(c + 1, "n", step=step, every=2, dedup="per_device")
            return c + 1, None

        c, _ = lax.scan(inner, v, None, length=1)
        return c

    recs, calls = {}, {}
    for auto in (True, False):
        path = tmp_path / f"s{auto}.jsonl"
        with pmaptap.configured(auto_group=auto):
            f = jax.pmap(lambda v, s: body(v, s), axis_name="i", in_axes=(0, None))
            calls[auto] = count_callbacks(jax.make_jaxpr(f)(jnp.arange(8.0), jnp.int32(0)))
            with pmaptap.Session(str(path), run="s"):
                for s in range(4):
                    f(jnp.arange(8.0) + s, jnp.int32(s))
        recs[auto] = _records(path)
    # Two buckets and four taps, each with its branch for steps that differ
    # between devices (the trace does not prove a step closed over by the
    # scan body alike: layouts.from_leader_if_steps_alike), which the records show unused.
    assert (calls[True], calls[False]) == (2 * 2, 4 * 2)
    assert recs[True] == recs[False]
    ms = [json.loads(r) for r in recs[True] if '"name": "m"' in r]
    assert sorted(r["step"] for r in ms) == [0, 2]


def test_grouped_sub_byte_and_narrow_dtypes_keep_their_values(tmp_path):
    # Sub-byte operands travel widened and are narrowed back on the host by
    # operand index: in a group those indexes span every member's operands.
    def step(x):
        # Scalars: under plain jit an array may be sharded, and per-shard
        # taps keep one callback per shard.
        pmaptap.tap(-x[3].astype(jnp.int4), "i4")
        pmaptap.tap(x[1].astype(jnp.bfloat16) / 3, "bf16")
        pmaptap.tap(x[3].astype(jnp.float4_e2m1fn), "f4")
        pmaptap.tap((x[2] > 1).astype(jnp.uint2) * 3, "u2")
        return x

    def make():
        return jax.jit(lambda x: step(x))

    args = (jnp.arange(4.0),)
    auto, n_auto = _run(tmp_path, make, args, auto=True)
    one, n_one = _run(tmp_path, make, args, auto=False)
    assert (n_auto, n_one) == (1, 4)
    assert auto == one
    dtypes = {json.loads(r)["name"]: json.loads(r)["dtype"] for r in auto}
    assert dtypes == {"i4": "int4", "bf16": "bfloat16", "f4": "float4_e2m1fn", "u2": "uint2"}
    values = {json.loads(r)["name"]: json.loads(r)["value"] for r in auto}
    assert (values["i4"], values["f4"], values["u2"]) == (-3, 3.0, 3)


def test_taps_inside_grad_wait_for_the_enclosing_trace():
    # Automatic grouping looks through JAX's forward-differentiation traces
    # (traceend.staging_target): if a JAX upgrade renames them, taps inside
    # grad would silently stop being grouped; this says where to look.
    from jax._src.interpreters import ad

    assert traceend._DIFFERENTIATION_TRACES, "ad.LinearizeTrace / ad.JVPTrace are gone"
    seen = []

    def f(x):
        def loss(w):
            seen.append((type(traceend.core.trace_ctx.trace), traceend.staging_target()))
            return jnp.sum(w**2)

        jax.grad(loss)(x)
        jax.jvp(loss, (x,), (x,))
        seen.append(("body", traceend.staging_trace()))
        return x

    jax.make_jaxpr(f)(jnp.ones(3))
    body = seen[-1][1]
    assert body is not None
    assert [t for t, _ in seen[:2]] == [ad.LinearizeTrace, ad.JVPTrace]
    assert all(target is body for _, target in seen[:2])
