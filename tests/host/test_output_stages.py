"""The ahead-of-time stages of pmaptap.jit / pmaptap.pmap steps (issue 57,
items 1 and 13): ``lower(...).compile()`` and ``trace(...).lower().compile()``
give a compiled step whose calls return the function's outputs and write the
records a call of the step writes (was: ``(outputs, pmaptap's internal
pytree)`` returned and nothing written); what the stages say about the
outputs (``out_info``, ``out_tree``, ``output_shardings``, ``eval_shape``)
is the function's, as jax.jit's stages say; and the wrapped function offers
what jax.jit's / jax.pmap's offers (``eval_shape``, ``clear_cache``, ...).
"""

from __future__ import annotations

import json
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pmaptap


def _records(path) -> list[str]:
    """The file's records, time left out, in a canonical order."""
    out = []
    for r in pmaptap.read(str(path)):
        r.pop("time", None)
        out.append(json.dumps(r, sort_keys=True))
    return sorted(out)


def _written(path, call: Callable, args: tuple, times: int = 2) -> tuple[list[str], list]:
    """(records, outputs) of ``call(*args)`` run ``times`` times in a session."""
    outs = []
    with pmaptap.Session(str(path), run="aot"):
        for _ in range(times):
            outs.append(call(*args))
    return _records(path), outs


def _same_outputs(got, want) -> None:
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _sharded_step(x, c):
    """Taps of every kind a sharded jit step holds: per shard, replicated,
    in a scan (stacked rows), in a cond."""
    pmaptap.tap(x * 2, "doubled", dedup="per_device")
    pmaptap.tap(c, "c")
    total, _ = lax.scan(lambda t, row: (pmaptap.tap(t + row.sum(), "in_scan"), None), 0.0, x)
    y = lax.cond(total > 0, lambda v: pmaptap.tap(v, "in_cond") + 1, lambda v: v, total)
    return {"x": x + 1, "y": y}, c * 3


def _sharded_args():
    mesh = Mesh(np.array(jax.devices()), ("d",))
    x = jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(mesh, P("d")))
    c = jax.device_put(jnp.float32(5), NamedSharding(mesh, P()))
    return x, c


def test_a_compiled_jit_step_writes_the_records_of_calling_the_step(tmp_path):
    """On 8 devices with a sharded input: the compiled step (from lower,
    and from trace -> lower) returns the function's outputs and writes the
    records, field for field but the time, that calling the step writes."""
    args = _sharded_args()
    assert len(args[0].sharding.device_set) == 8
    step = pmaptap.jit(_sharded_step)
    called, want = _written(tmp_path / "called.jsonl", step, args)
    assert {json.loads(r)["name"] for r in called} == {"doubled", "c", "in_scan", "in_cond"}
    # One record per shard per call for the per-device tap.
    assert sum(json.loads(r)["name"] == "doubled" for r in called) == 2 * 8
    stages = {
        "lowered": step.lower(*args).compile(),
        "traced": step.trace(*args).lower().compile(),
    }
    for how, compiled in stages.items():
        got, outs = _written(tmp_path / f"{how}.jsonl", compiled, args)
        for o, w in zip(outs, want):
            _same_outputs(o, w)
        assert got == called, how


def _pmap_step(v):
    loss = lax.pmean(jnp.sum(v**2), "i")
    pmaptap.tap(loss, "loss", dedup="replicated")
    pmaptap.tap(v, "v", dedup="per_device")
    pmaptap.tap(v.sum() - lax.axis_index("i"), "auto")
    return v * 0.5, loss


def test_a_compiled_pmap_step_writes_the_records_of_calling_the_step(tmp_path):
    x = jnp.arange(24.0).reshape(8, 3)
    step = pmaptap.pmap(_pmap_step, axis_name="i")
    called, want = _written(tmp_path / "called.jsonl", step, (x,))
    assert {json.loads(r)["name"] for r in called} == {"loss", "v", "auto"}
    got, outs = _written(tmp_path / "compiled.jsonl", step.lower(x).compile(), (x,))
    for o, w in zip(outs, want):
        _same_outputs(o, w)
    assert got == called


def _same_info(got, want) -> None:
    """Two output descriptions (trees of ShapeDtypeStruct / avals /
    shardings) are alike: tree, shapes, dtypes, shardings."""
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    assert jax.tree_util.tree_leaves(got) == jax.tree_util.tree_leaves(want)


def test_the_stages_describe_the_functions_outputs_as_jax_jits_do():
    """out_info / out_tree / out_avals / output_shardings / eval_shape of a
    pmaptap step are those of the function, as jax.jit's (whose taps are
    host callbacks) say: not the taps' extra outputs. The lowered text and
    the jaxpr are of the program that runs, which returns the taps too."""
    args = _sharded_args()
    ours, theirs = pmaptap.jit(_sharded_step), jax.jit(_sharded_step)
    _same_info(ours.eval_shape(*args), theirs.eval_shape(*args))
    t_ours, t_theirs = ours.trace(*args), theirs.trace(*args)
    assert t_ours.out_tree == t_theirs.out_tree
    _same_info(t_ours.out_info, t_theirs.out_info)
    _same_info(t_ours.out_avals, t_theirs.out_avals)
    # The program's own outputs: the function's, then the taps' values.
    n = t_theirs.out_tree.num_leaves
    assert len(t_ours.jaxpr.out_avals) > n
    assert t_ours.jaxpr.out_avals[:n] == t_theirs.jaxpr.out_avals
    l_ours, l_theirs = ours.lower(*args), theirs.lower(*args)
    assert l_ours.out_tree == l_theirs.out_tree
    _same_info(l_ours.out_info, l_theirs.out_info)
    assert l_ours.in_tree == l_theirs.in_tree
    assert "callback" not in l_ours.as_text() and "callback" in l_theirs.as_text()
    c_ours, c_theirs = l_ours.compile(), l_theirs.compile()
    assert c_ours.out_tree == c_theirs.out_tree
    _same_info(c_ours.out_info, c_theirs.out_info)
    _same_info(c_ours.output_shardings, c_theirs.output_shardings)
    _same_info(c_ours.output_formats, c_theirs.output_formats)
    _same_info(c_ours.input_shardings, c_theirs.input_shardings)
    assert c_ours.cost_analysis() is not None
    # The same under pmap.
    x = jnp.ones((8, 3))
    p_ours = pmaptap.pmap(_pmap_step, axis_name="i").lower(x)
    p_theirs = jax.pmap(_pmap_step, axis_name="i").lower(x)
    assert p_ours.out_tree == p_theirs.out_tree
    _same_info(p_ours.out_info, p_theirs.out_info)
    c_ours, c_theirs = p_ours.compile(), p_theirs.compile()
    assert c_ours.out_tree == c_theirs.out_tree
    _same_info(c_ours.output_shardings, c_theirs.output_shardings)


def _public(obj) -> set[str]:
    return {a for a in dir(obj) if not a.startswith("_")}


def test_the_steps_and_stages_offer_what_jaxs_offer():
    """Every public attribute of jax.jit's / jax.pmap's wrapped function,
    and of its Traced / Lowered / Compiled, exists on pmaptap's (was:
    ``pmaptap.jit(f).eval_shape`` an AttributeError), with ``__wrapped__``;
    and none that jax's lacks (pmap has no ``trace``)."""
    x = jnp.ones((8, 3))
    for ours, theirs in (
        (pmaptap.jit(_pmap_step_free), jax.jit(_pmap_step_free)),
        (pmaptap.pmap(_pmap_step, axis_name="i"), jax.pmap(_pmap_step, axis_name="i")),
    ):
        assert _public(theirs) <= _public(ours), _public(theirs) - _public(ours)
        assert _public(ours) <= _public(theirs) | {"lower"}, _public(ours) - _public(theirs)
        assert ours.__wrapped__ is theirs.__wrapped__
        assert ours.__name__ == theirs.__name__
        l_ours, l_theirs = ours.lower(x), theirs.lower(x)
        assert _public(l_theirs) <= _public(l_ours)
        assert _public(l_theirs.compile()) <= _public(l_ours.compile())
    ours, theirs = pmaptap.jit(_pmap_step_free), jax.jit(_pmap_step_free)
    assert _public(theirs.trace(x)) <= _public(ours.trace(x))
    assert not hasattr(pmaptap.pmap(_pmap_step, axis_name="i"), "trace")


def _pmap_step_free(v):
    pmaptap.tap(jnp.sum(v), "s")
    return v * 0.5


def test_clear_cache_and_eval_shape_inside_a_trace(tmp_path):
    """``clear_cache`` forgets the traced step (the next call traces again,
    and still writes its taps); ``eval_shape`` works inside another trace,
    as jax.jit's does."""
    traces = []

    def f(v):
        traces.append(1)
        pmaptap.tap(jnp.sum(v), "s")
        return v * 2

    step = pmaptap.jit(f)
    x = jnp.ones((4,))
    with pmaptap.Session(str(tmp_path / "t.jsonl"), run="c"):
        step(x)
        step(x)
        assert len(traces) == 1
        step.clear_cache()
        step(x)
        assert len(traces) == 2
    assert [r["step"] for r in pmaptap.read(str(tmp_path / "t.jsonl"))] == [0, 1, 2]

    @jax.jit
    def outer(v):
        info = step.eval_shape(v)
        return jnp.zeros(info.shape, info.dtype)

    assert outer(x).shape == (4,)


def test_a_traced_step_runs_and_writes_its_taps_but_not_inside_a_trace(tmp_path):
    """``Traced.__call__`` (jax evaluates the traced program) returns the
    function's outputs and writes the taps; inside another trace, where the
    taps' values could not reach the host, it is refused, saying what to
    call instead (a plain TypeError, never a silently lost tap)."""
    step = pmaptap.jit(_pmap_step_free)
    x = jnp.arange(3.0)
    traced = step.trace(x)
    with pmaptap.Session(str(tmp_path / "t.jsonl"), run="c"):
        _same_outputs(traced(x), x * 0.5)
    assert [r["value"] for r in pmaptap.read(str(tmp_path / "t.jsonl"))] == [3.0]
    with pytest.raises(TypeError, match=r"call the pmaptap.jit step itself there"):
        jax.jit(lambda v: traced(v))(x)


def test_stages_of_a_step_composed_with_another_jit(tmp_path):
    """With ``jit=equinox.filter_jit`` / ``flax.nnx.jit`` the compiled
    stage of that wrapper also writes the taps and returns the function's
    outputs, and ``eval_shape`` (nnx's) gives the function's shapes; a
    method the wrapper lacks (equinox's eval_shape) is an AttributeError
    naming the wrapper."""
    eqx = pytest.importorskip("equinox")  # in the test extra: CI runs both
    nnx = pytest.importorskip("flax.nnx")
    x = jnp.arange(4.0)
    want = _pmap_step_free(x)
    path = tmp_path / "t.jsonl"
    with pmaptap.Session(str(path), run="c"):
        for wrapper in (eqx.filter_jit, nnx.jit):
            step = pmaptap.jit(_pmap_step_free, jit=wrapper)
            _same_outputs(step.lower(x).compile()(x), want)
    assert [r["value"] for r in pmaptap.read(str(path))] == [6.0, 6.0]
    shape = pmaptap.jit(_pmap_step_free, jit=nnx.jit).eval_shape(x)
    assert (shape.shape, shape.dtype) == ((4,), jnp.float32)
    with pytest.raises(AttributeError, match=r"_JitWrapper \(the jit this step was made with\)"):
        pmaptap.jit(_pmap_step_free, jit=eqx.filter_jit).eval_shape(x)
