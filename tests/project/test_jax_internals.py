"""The one inventory of what pmaptap reads from JAX's internals (``jax._src``).

Every ``from jax._src... import m`` in the package, and every attribute the
code then reads from ``m`` (``core.Primitive``, ``pe.DynamicJaxprTrace``...),
must exist in the installed JAX; so must the frames and names pmaptap
recognises by string (control flow where a collective is unsafe, the
shard_map staging frame). After a JAX upgrade this file says what moved,
by name, instead of a tap failing somewhere or a collective landing inside a
``cond`` and hanging the suite."""

from __future__ import annotations

import ast
import importlib
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from conftest import package_sources


def _uses() -> dict[tuple[str, str | None], list[str]]:
    """(jax._src module, attribute or None) -> where the package uses it."""
    uses: dict[tuple[str, str | None], list[str]] = {}
    for rel, tree in package_sources():
        alias: dict[str, str] = {}  # local name -> jax._src module
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jax._src"):
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    if importlib.util.find_spec(full.rsplit(".", 1)[0]) and _is_module(full):
                        alias[a.asname or a.name] = full
                    else:  # a name imported from a module
                        uses.setdefault((node.module, a.name), []).append(f"{rel}:{node.lineno}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("jax._src"):
                        uses.setdefault((a.name, None), []).append(f"{rel}:{node.lineno}")
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in alias
            ):
                key = (alias[node.value.id], node.attr)
                uses.setdefault(key, []).append(f"{rel}:{node.lineno}")
            elif (  # getattr(pe, "JaxprStackFrame", None): read by name
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "getattr"
                and len(node.args) >= 2
                and isinstance(node.args[0], ast.Name)
                and node.args[0].id in alias
                and isinstance(node.args[1], ast.Constant)
            ):
                key = (alias[node.args[0].id], node.args[1].value)
                uses.setdefault(key, []).append(f"{rel}:{node.lineno}")
        for mod in alias.values():
            uses.setdefault((mod, None), []).append(rel)
    return uses


def _is_module(name: str) -> bool:
    try:
        importlib.import_module(name)
        return True
    except ImportError:
        return False


def check_jax_internals() -> list[str]:
    """What pmaptap reads from jax._src that this JAX lacks ([] when all is
    there), each with where pmaptap uses it."""
    missing = []
    for (mod, attr), where in sorted(_uses().items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
        try:
            m = importlib.import_module(mod)
        except ImportError as e:
            missing.append(f"module {mod} ({e}); used at {where[:3]}")
            continue
        if attr is not None and not hasattr(m, attr):
            missing.append(f"{mod}.{attr}; used at {where[:3]}")
    # Names pmaptap recognises by string, not by import.
    from pmaptap._trace import invariant, placement

    for mod, fn in placement._DIVERGENT_FLOW + tuple(
        (m, None) for m in placement._MESH_FRAME_MODULES
    ):
        try:
            m = importlib.import_module(mod)
        except ImportError:
            missing.append(f"frame module {mod} (placement.py)")
            continue
        if fn is not None and not hasattr(m, fn):
            missing.append(f"frame function {mod}.{fn} (placement.py)")
    assert invariant  # its frame module is jax._src.shard_map, checked above
    return missing


def test_every_jax_internal_pmaptap_reads_exists():
    uses = _uses()
    # The inventory is not empty by accident: the primitive, the trace-end
    # hook and the mesh look-up all read jax._src.
    assert ("jax._src.core", "Primitive") in uses
    assert ("jax._src.interpreters.partial_eval", "JaxprStackFrame") in uses
    assert len(uses) > 40, len(uses)
    assert check_jax_internals() == []


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
