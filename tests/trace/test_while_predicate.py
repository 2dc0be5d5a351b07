"""A tap in the condition of a ``while_loop`` under ``vmap`` runs once per
iteration (issue 18, point 5), for ``pmaptap.host_callback`` and for
``pmaptap.tap``.

With a batched predicate JAX lowers the condition twice per iteration: in the
loop's condition region and again in its body (scope ``while/body_pred``) to
select which elements advance. The callback lowerings recognise the second
copy by that scope (pmaptap/_trace/primitive.py, recomputed_while_predicate)
and emit nothing there. The test of the scope name fails loudly if JAX
renames it."""

from __future__ import annotations

import io

import jax
import numpy as np
import pytest

import pmaptap
from pmaptap import host_callback as hcb
from pmaptap._trace import primitive

pytestmark = pytest.mark.usefixtures("hcb_drained")


def _maybe_jit(f, jit: bool):
    return jax.jit(f) if jit else f


# The loop of every test: x = [0, 1] counts up while x < 3, so the batched
# predicate is evaluated on [0 1], [1 2], [2 3] (true for some element, the
# loop goes on) and [3 3] (false everywhere, the loop ends): four times.
_X = np.array([0, 1], np.int32)
_PREDICATE_INPUTS = [[0, 1], [1, 2], [2, 3], [3, 3]]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_id_tap_in_a_vmapped_while_cond_runs_once_per_iteration(checks, jit):
    seen: list = []

    def cond(x):
        x = hcb.id_tap(lambda v, t: seen.append((v.tolist(), t)), x)
        return x < 3

    out = _maybe_jit(jax.vmap(lambda x: jax.lax.while_loop(cond, lambda x: x + 1, x)), jit)(_X)
    hcb.barrier_wait()
    np.testing.assert_array_equal(out, [3, 3])
    batch = (("batch", {"batch_dims": (0,)}),)
    assert seen == [(v, batch) for v in _PREDICATE_INPUTS]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_id_print_in_a_vmapped_while_cond_prints_each_predicate_once(checks, jit):
    out_stream = io.StringIO()

    def cond(x):
        return hcb.id_print(x < 3, what="pred", output_stream=out_stream)

    _maybe_jit(jax.vmap(lambda x: jax.lax.while_loop(cond, lambda x: x + 1, x)), jit)(_X)
    hcb.barrier_wait()
    lines = out_stream.getvalue().splitlines()
    assert lines[0::2] == ["transforms: [('batch', {'batch_dims': (0,)})] what: pred"] * 4
    assert lines[1::2] == ["[ True  True]", "[ True  True]", "[ True False]", "[False False]"]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_nested_vmapped_whiles_tap_each_condition_once(checks, jit):
    """An inner batched while in the outer body, taps in both conditions:
    the inner loop's recomputation is skipped, its condition region kept."""
    seen: list = []

    def rec(tag):
        return lambda v, t: seen.append((tag, v.tolist()))

    def f(x):
        def outer_body(c):
            inner = jax.lax.while_loop(
                lambda y: hcb.id_tap(rec("inner"), y) < c + 2, lambda y: y + 1, c
            )
            return inner + 1

        return jax.lax.while_loop(lambda c: hcb.id_tap(rec("outer"), c) < 2, outer_body, x)

    out = _maybe_jit(jax.vmap(f), jit)(_X)
    hcb.barrier_wait()
    np.testing.assert_array_equal(out, [3, 4])
    assert seen == [
        ("outer", [0, 1]),
        ("inner", [0, 1]),
        ("inner", [1, 2]),
        ("inner", [2, 3]),
        ("outer", [3, 4]),
    ]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_pmaptap_tap_in_a_vmapped_while_cond_writes_one_record_per_iteration(
    checks, jit, session, tap_path
):
    def cond(x):
        pmaptap.tap(x, "pred_in")
        return x < 3

    _maybe_jit(jax.vmap(lambda x: jax.lax.while_loop(cond, lambda x: x + 1, x)), jit)(_X)
    session.flush()
    recs = [r for r in pmaptap.read(tap_path) if r["name"] == "pred_in"]
    assert [r["value"] for r in recs] == _PREDICATE_INPUTS
    # One call of the loop: step 0, each evaluation its iteration.
    assert [(r["step"], r["iteration"]) for r in recs] == [(0, [k]) for k in range(4)]


def test_unbatched_while_cond_still_taps_every_evaluation(checks):
    """No vmap (or a predicate vmap does not batch): one evaluation of the
    condition per iteration, all of them tapped."""
    seen: list = []

    def cond(x):
        return hcb.id_tap(lambda v, t: seen.append(int(v)), x) < 3

    jax.jit(lambda x: jax.lax.while_loop(cond, lambda x: x + 1, x))(0)
    hcb.barrier_wait()
    assert seen == [0, 1, 2, 3]


def test_jax_still_names_the_recomputed_predicate_body_pred():
    """If this fails, JAX changed how it lowers a batched while predicate:
    update primitive._PRED_SCOPE (and check the tests above)."""
    assert (primitive._WHILE_SCOPE, primitive._PRED_SCOPE) == ("while", "body_pred")

    def f(x):
        return jax.lax.while_loop(lambda x: x < 3, lambda x: x + 1, x)

    text = jax.jit(jax.vmap(f)).lower(_X).as_text(debug_info=True)
    assert "while/body_pred" in text, "JAX no longer lowers the batched predicate as body_pred"
    assert "while/cond" in text
