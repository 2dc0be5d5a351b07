"""The one inventory of what pmaptap reads from JAX's internals (``jax._src``).

Every ``from jax._src... import m`` in the package, and every attribute the
code then reads from ``m`` (``core.Primitive``, ``pe.DynamicJaxprTrace``...),
must exist in the installed JAX; so must the frames and names pmaptap
recognises by string (control flow where a collective is unsafe, the
shard_map staging frame). After a JAX upgrade this file says what moved,
by name, instead of a tap failing somewhere or a collective landing inside a
``cond`` and hanging the suite."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from conftest import run_python
from pmaptap._trace import jax_support


def test_every_jax_internal_pmaptap_reads_exists():
    uses = jax_support.internal_uses()
    # The inventory is not empty by accident: the primitive, the trace-end
    # hook and the mesh look-up all read jax._src.
    assert ("jax._src.core", "Primitive") in uses
    assert ("jax._src.interpreters.partial_eval", "JaxprStackFrame") in uses
    assert ("jax._src.distributed", "global_state") in uses
    assert len(uses) > 40, len(uses)
    assert jax_support.missing_internals() == []
    # Private attributes of public classes are checked too (the drain's
    # partition order), and a missing one is named.
    assert ("jax.sharding", "Sharding", "_device_assignment") in jax_support.CLASS_READS
    absent = (("jax.sharding", "Sharding", "_no_such_attribute"),)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(jax_support, "CLASS_READS", absent)
        assert jax_support.missing_internals() == [
            "jax.sharding.Sharding._no_such_attribute (jax_support.py)"
        ]


def test_pyproject_admits_exactly_the_tested_releases():
    import re

    from conftest import ROOT

    with open(f"{ROOT}/pyproject.toml", encoding="utf-8") as f:
        text = f.read()
    tested = jax_support.TESTED
    for pkg in ("jax", "jaxlib"):
        m = re.search(rf'"{pkg}>=(\d+)\.(\d+)[.\d]*,<(\d+)\.(\d+)"', text)
        assert m, f"no {pkg} range in pyproject.toml"
        a, b, c, d = map(int, m.groups())
        # From the oldest tested minor up to the newest tested one: a
        # release only checked statically is not installed by pip.
        assert (a, b) == min(tested) and (c, d) == (max(tested)[0], max(tested)[1] + 1), m[0]
    # The README states the same range, and pyproject's Python.
    with open(f"{ROOT}/README.md", encoding="utf-8") as f:
        readme = f.read()
    floor = re.search(r'"jax>=([\d.]+),', text)[1]
    python = re.search(r'requires-python = ">=([\d.]+)"', text)[1]
    newest = f"{max(tested)[0]}.{max(tested)[1]}.x"
    assert f"Python >= {python}, JAX {floor} to {newest} " in readme
    # The suite runs on one of them (on a tested one in CI, .ci/run).
    known = tested + jax_support.CHECKED
    assert tuple(map(int, jax.__version__.split(".")[:2])) in known, jax.__version__


_UNTESTED = """
    import warnings
    warnings.simplefilter("always")
    import jax
    from jax._src.interpreters import partial_eval as pe
    jax.__version__ = "0.99.0"  # a release nobody ran the suite on
    if MISSING:
        del pe.JaxprStackFrame.to_jaxpr, pe.JaxprStackFrame  # a JAX that moved it
    with warnings.catch_warnings(record=True) as seen:
        try:
            import pmaptap._trace
        except Exception:
            pass
        import pmaptap._trace.jax_support as js
        js.check_version()  # once only
    for w in seen:
        print(w.category.__name__, "|", w.message)
"""


@pytest.mark.parametrize("missing", [False, True])
def test_an_untested_jax_warns_once_naming_what_it_lacks(missing):
    out = run_python(_UNTESTED.replace("MISSING", str(missing)), devices=1).stdout
    lines = [x for x in out.splitlines() if "pmaptap is tested with JAX" in x]
    assert len(lines) == 1, out
    (line,) = lines
    assert line.startswith("RuntimeWarning |") and "JAX 0.99.0 is neither tested" in line
    if missing:
        assert "jax._src.interpreters.partial_eval.JaxprStackFrame; used at" in line
        assert "traceend.py" in line
    else:
        assert "every JAX internal pmaptap reads is present" in line


def test_the_control_flow_frames_are_seen_where_collectives_are_unsafe():
    # placement.inside_divergent_control_flow finds cond branches and while
    # bodies by their frames in JAX's source. If JAX renames them, a gathered
    # tap would put a collective inside a cond that only some devices take,
    # and the program would hang: this test fails instead.
    from pmaptap._trace import placement

    seen = {}

    def probe(where):
        def f(x):
            seen[where] = placement.inside_divergent_control_flow()
            return x

        return f

    @partial(jax.pmap, axis_name="i")
    def step(x):
        x = lax.cond(x.sum() > 0, probe("cond"), lambda y: y, x)
        x = lax.switch(0, [probe("switch"), lambda y: y], x)
        x = lax.while_loop(lambda c: c[1] < 1, lambda c: (probe("while")(c[0]), c[1] + 1), (x, 0))[
            0
        ]
        x, _ = lax.scan(lambda c, _: (probe("scan")(c), None), x, None, length=1)
        return probe("body")(x)

    step(jnp.ones((jax.local_device_count(), 2)))
    assert seen == {"cond": True, "switch": True, "while": True, "scan": False, "body": False}
