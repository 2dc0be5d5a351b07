"""Lifting a step copies its equations that hold no mark into jit's trace
as they are (``lift._copied``), instead of binding each again: the type
and sharding rules of the step's primitives run once per trace, not twice
(docs/performance.md, "The second pass copied"). What must hold: the
program is the one binding gave (its names and source lines too), and an
equation whose inputs changed type on the way is bound, not copied."""

from __future__ import annotations

import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import mlir

import pmaptap
from pmaptap._outputs import lift


def _step(x):
    with jax.named_scope("outer_blk"):
        y = jnp.sin(x) * 2
    pmaptap.tap(y.sum(), "top")

    def body(c, row):
        with jax.named_scope("body_blk"):
            c = c + jnp.cos(row).sum()
        pmaptap.tap(c, "in_scan")
        return c, None

    c, _ = lax.scan(body, 0.0, y)
    return y + c


def _user_lines(text: str) -> set[int]:
    """The lines of ``_step`` that the lowered program's locations name."""
    src, first = inspect.getsourcelines(_step)
    lines = {int(n) for n in re.findall(re.escape(__file__.split("/")[-1]) + r'":(\d+):', text)}
    return {n for n in lines if first <= n < first + len(src)}


def _scoped_names(text: str) -> set[str]:
    return set(re.findall(r'"([^"]*(?:outer|body)_blk/[^"]*)"', text))


def test_the_lifted_program_keeps_the_steps_names_and_source_lines(tmp_path):
    """The ops of the step's own code carry, under pmaptap.jit, the names
    (named_scope under jit's name) and source lines they carry under
    jax.jit, at the step's level and inside a scan that holds a tap; and
    the step computes what jax.jit computes."""
    x = jnp.arange(12.0).reshape(4, 3)
    ours = pmaptap.jit(_step).lower(x).as_text(debug_info=True)
    theirs = jax.jit(_step).lower(x).as_text(debug_info=True)
    names = _scoped_names(ours)
    assert names == _scoped_names(theirs)
    assert {"jit(_step)/outer_blk/sin", "jit(_step)/outer_blk/mul"} <= names
    assert any("body_blk/" in n for n in names)
    lines = _user_lines(ours)
    assert lines == _user_lines(theirs)
    assert len(lines) >= 5  # the sin, the mul, the tap, the scan, its body
    with pmaptap.Session(str(tmp_path / "t.jsonl"), run="copy"):
        got = pmaptap.jit(_step)(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(jax.jit(_step)(x)), rtol=1e-6)
    recs = pmaptap.read(str(tmp_path / "t.jsonl"))
    (top,) = [r["value"] for r in recs if r["name"] == "top"]
    assert np.isclose(top, float((np.sin(np.asarray(x)) * 2).sum()), rtol=1e-6)
    assert sum(r["name"] == "in_scan" for r in recs) == 4


def test_a_primitives_type_rule_runs_once_per_trace_of_a_tapped_step():
    """A primitive of the step's, its type rule counting its calls, at the
    step's level and inside a scan holding a tap: as often under
    pmaptap.jit's trace as under jax.jit's (the first pass; the lifted
    copy does not ask again; the scan rebuilt around the lifted tap is
    not traced again for its types)."""
    calls: list[int] = []
    counted_p = Primitive("pmaptap_test_counted")
    counted_p.def_impl(lambda v: v)
    counted_p.def_abstract_eval(lambda aval: (calls.append(1), aval)[1])
    mlir.register_lowering(counted_p, mlir.lower_fun(lambda v: v, multiple_results=False))

    def step(x):
        y = counted_p.bind(x) + 1
        pmaptap.tap(y.sum(), "y")

        def body(c, row):
            c = c + counted_p.bind(row).sum()
            pmaptap.tap(c, "c")
            return c, None

        c, _ = lax.scan(body, 0.0, y)
        return c

    x = jnp.ones((3, 2))
    jax.jit(step).trace(x)
    under_jax = len(calls)
    calls.clear()
    pmaptap.jit(step).trace(x)
    assert under_jax >= 2  # the step's level, the scan's body (traced twice there)
    assert len(calls) == under_jax


def test_an_equation_whose_input_changed_type_is_bound_again():
    """``run`` given an input of another type than the jaxpr recorded (a
    weakly typed float for a float32): the equation on it is bound, so its
    output has the type binding gives (weak), not the recorded one, and
    the value is right."""
    closed = jax.make_jaxpr(jnp.sin)(np.float32(1))
    assert not closed.jaxpr.invars[0].aval.weak_type

    def outer(v):
        outs, nodes, flat = lift.run(closed.jaxpr, closed.consts, [v])
        assert not nodes and not flat
        assert outs[0].aval.weak_type  # bound on the weak input, not copied
        return outs[0]

    assert np.isclose(float(jax.jit(outer)(3.0)), np.sin(3.0), rtol=1e-6)
    # The same input typed as recorded: copied, the recorded type.
    typed = jax.jit(lambda v: lift.run(closed.jaxpr, closed.consts, [v])[0][0])
    assert not typed.trace(np.float32(3)).jaxpr.out_avals[0].weak_type
