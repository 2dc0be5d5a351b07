"""pmaptap.untapped(fn): a second compilation of a tapped step with every tap
removed, for recording every N-th step from the host at no cost between."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pmaptap
from conftest import run_python

pytestmark = pytest.mark.usefixtures("transport")


def _make_step():
    # A jitted helper and a scan body with taps: JAX caches both traces, so
    # the two versions must not share them.
    @jax.jit
    def helper(v):
        pmaptap.tap(v, "inner", dedup="per_device")
        return v * 2

    def body(c, _):
        pmaptap.tap(c, "scan", dedup="per_device")
        return c + 1, None

    def step(v, s):
        pmaptap.tap(lax.pmean(v, "i"), "loss", step=s, dedup="replicated")
        v, _ = lax.scan(body, v, None, length=2)
        return helper(v)

    return step


@pytest.mark.parametrize("first", ["quiet", "loud"])
def test_untapped_version_records_nothing_and_never_leaks_into_the_tapped_one(
    session, tap_path, first
):
    step = _make_step()
    loud = jax.pmap(step, axis_name="i", in_axes=(0, None))
    quiet = jax.pmap(pmaptap.untapped(step), axis_name="i", in_axes=(0, None))
    x = jnp.arange(8.0)
    order = [quiet, loud, quiet, loud] if first == "quiet" else [loud, quiet, loud, quiet]
    outs = [np.asarray(f(x, i)) for i, f in enumerate(order)]
    session.flush()
    recs = pmaptap.read(tap_path)
    loud_steps = [i for i, f in enumerate(order) if f is loud]
    assert sorted(r["step"] for r in recs if r["name"] == "loss") == loud_steps
    assert len([r for r in recs if r["name"] == "inner"]) == 2 * 8
    assert len([r for r in recs if r["name"] == "scan"]) == 2 * 2 * 8
    for out in outs:  # same computation
        np.testing.assert_array_equal(out, (np.arange(8.0) + 2) * 2)


@pytest.mark.callback_only("the tapped step holds callbacks only on that transport")
def test_untapped_compiles_without_any_host_callback():
    step = _make_step()
    x = jnp.arange(8.0)
    loud = jax.pmap(step, axis_name="i", in_axes=(0, None)).lower(x, 0).as_text()
    quiet = jax.pmap(pmaptap.untapped(step), axis_name="i", in_axes=(0, None)).lower(x, 0).as_text()
    assert "callback" in loud
    assert "callback" not in quiet


def test_untapped_removes_tap_grad_and_id_tap_but_keeps_call(session, tap_path):
    from pmaptap import host_callback as hcb

    seen = []

    def f(v):
        v = pmaptap.tap_grad(v, "g")
        v = hcb.id_tap(lambda a, t: seen.append(float(a)), v)
        doubled = hcb.call(
            lambda a: np.asarray(a * 2, np.float32),
            lax.stop_gradient(v),
            result_shape=jax.ShapeDtypeStruct((), jnp.float32),
        )
        return jnp.sum(doubled * v)

    g = jax.jit(jax.grad(pmaptap.untapped(f)))(jnp.float32(3.0))
    hcb.barrier_wait()
    session.flush()
    assert float(g) == 6.0  # call's result still flows: d/dv (6 * v) at v=3
    assert seen == [] and pmaptap.read(tap_path) == []


def test_untapped_still_checks_arguments():
    with pytest.raises(ValueError, match="name"):
        jax.jit(pmaptap.untapped(lambda v: pmaptap.tap(v, "")))(1.0)
    with pytest.raises(TypeError, match="is a str"):
        jax.jit(pmaptap.untapped(lambda v: pmaptap.tap({"s": "text"}, "x")))(1.0)
    with pytest.raises(TypeError, match="callable"):
        pmaptap.untapped(3)


@pytest.mark.callback_only("its steps run in a subprocess: the transport fixture cannot reach them")
def test_environment_variable_removes_every_tap_of_the_process():
    out = run_python(
        """
        import tempfile, jax, jax.numpy as jnp, pmaptap
        path = tempfile.mktemp(suffix=".jsonl")
        with pmaptap.Session(path, run="env"):
            jax.pmap(lambda v: pmaptap.tap(v, "x"))(jnp.arange(8.0))
            pmaptap.tap(1.0, "eager")
        print("records", len(pmaptap.read(path)))
    """,
        PMAPTAP_UNTAPPED="1",
    ).stdout
    assert "records 0" in out


def test_untapped_state_exists_on_this_jax():
    # pmaptap.untapped rests on a JAX-internal config state keyed into JAX's
    # caches; a JAX upgrade that moves it must fail here, loudly.
    from pmaptap._common.switch import _MISSING, _TAPS_OFF

    assert _TAPS_OFF is not None, _MISSING
    with _TAPS_OFF(True):
        assert pmaptap.untapped.__module__ == "pmaptap._trace.untapped"
        from pmaptap._common.switch import taps_off

        assert taps_off()
    assert not taps_off()


@pytest.mark.parametrize(
    "value, records, warned",
    [("", 8, False), ("maybe", 8, True), ("0", 8, False), ("TRUE", 0, False)],
)
@pytest.mark.callback_only("its steps run in a subprocess: the transport fixture cannot reach them")
def test_environment_variable_values(value, records, warned):
    # Empty means unset (VAR= lines in job files); a value that is neither
    # true nor false warns and leaves taps on, never breaking the import.
    proc = run_python(
        """
        import tempfile, jax, jax.numpy as jnp, pmaptap
        path = tempfile.mktemp(suffix=".jsonl")
        with pmaptap.Session(path, run="env"):
            jax.pmap(lambda v: pmaptap.tap(v, "x", dedup="per_device"))(jnp.arange(8.0))
        print("records", len(pmaptap.read(path)))
    """,
        PMAPTAP_UNTAPPED=value,
    )
    assert f"records {records}" in proc.stdout
    assert ("PMAPTAP_UNTAPPED='maybe' is not one of" in proc.stderr) is warned


@pytest.mark.parametrize(
    "imports", ["import jax, jax.numpy as jnp, pmaptap", "import pmaptap, jax, jax.numpy as jnp"]
)
@pytest.mark.callback_only("its steps run in a subprocess: the transport fixture cannot reach them")
def test_first_tapped_step_is_traced_once(imports):
    # The untapped switch is a JAX state keyed into jit caches; registered in
    # the middle of the first tapped trace it changed that function's cache
    # key, and every user's first step was traced and compiled twice.
    out = run_python(
        f"""
        {imports}
        import tempfile
        traces = []

        @jax.jit
        def step(x):
            traces.append(1)
            pmaptap.tap(x.sum(), "loss")
            return x * 2

        path = tempfile.mktemp(suffix=".jsonl")
        with pmaptap.Session(path):
            for _ in range(3):
                step(jnp.ones(4)).block_until_ready()
        print("traces", len(traces), "records", len(pmaptap.read(path)))
        """
    ).stdout
    assert "traces 1 records 3" in out, out
