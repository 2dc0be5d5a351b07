"""The JAX versions pmaptap supports, and the inventory of JAX internals it
reads (docs/contributing.md#jax-versions): ``TESTED`` (the minor releases
the suite passes on), ``CHECKED`` (only checked statically by
scripts/check_jax_source.py; empty while every admitted release is tested),
anything else unknown.

Importing the trace side on a JAX outside ``TESTED`` warns once, naming the
internals that JAX lacks (``missing_internals``), instead of a tap failing
later inside JAX. The inventory is read from the package's own source
(every ``from jax._src... import`` and the attributes then read), so a new
reach into ``jax._src`` is in it by construction;
``tests/project/test_jax_internals.py`` fails when one is missing.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import warnings
from typing import Any

# (major, minor) releases, oldest first.
TESTED: tuple[tuple[int, int], ...] = ((0, 9), (0, 10), (0, 11), (0, 12))
CHECKED: tuple[tuple[int, int], ...] = ()

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_warned = False


def _sources() -> list[tuple[str, ast.Module]]:
    out = []
    for d, _, files in sorted(os.walk(_PACKAGE)):
        for f in sorted(files):
            if f.endswith(".py"):
                p = os.path.join(d, f)
                with open(p, encoding="utf-8") as fh:
                    out.append(
                        (os.path.relpath(p, os.path.dirname(_PACKAGE)), ast.parse(fh.read()))
                    )
    return out


def _is_module(name: str) -> bool:
    try:
        importlib.import_module(name)
        return True
    except ImportError:
        return False


def internal_uses() -> dict[tuple[str, str | None], list[str]]:
    """(jax._src module, attribute or None) -> where the package uses it."""
    uses: dict[tuple[str, str | None], list[str]] = {}
    for rel, tree in _sources():
        alias: dict[str, str] = {}  # local name -> jax._src module
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jax._src"):
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    parent = full.rsplit(".", 1)[0]
                    if _spec(parent) and _is_module(full):
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


def _spec(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def missing_internals() -> list[str]:
    """What pmaptap reads from jax._src that this JAX lacks ([] when all is
    there), each with where pmaptap uses it; and the frames it recognises
    by name (placement.py)."""
    missing = []
    for (mod, attr), where in sorted(
        internal_uses().items(), key=lambda kv: (kv[0][0], kv[0][1] or "")
    ):
        try:
            m = importlib.import_module(mod)
        except ImportError as e:
            missing.append(f"module {mod} ({e}); used at {where[:3]}")
            continue
        if attr is not None and not hasattr(m, attr):
            missing.append(f"{mod}.{attr}; used at {where[:3]}")
    for mod, cls, attr in CLASS_READS:
        if not hasattr(getattr(importlib.import_module(mod), cls), attr):
            missing.append(f"{mod}.{cls}.{attr} (jax_support.py)")
    for mod, fn in DIVERGENT_FLOW + tuple((m, None) for m in MESH_FRAME_MODULES):
        try:
            m = importlib.import_module(mod)
        except ImportError:
            missing.append(f"frame module {mod} (placement.py)")
            continue
        if fn is not None and not hasattr(m, fn):
            missing.append(f"frame function {mod}.{fn} (placement.py)")
    return missing


# ------------------------------------------------------------ adapters
# Where a supported JAX release changed an internal pmaptap reads, one
# function here hides the difference, so the rest of the code reads one
# shape. A name that only some supported releases have is read through
# ``_optional`` (not a bare attribute), so the inventory above, which every
# release must satisfy, does not list it.


def _optional(module: object, name: str) -> object | None:
    return getattr(module, name, None)


# Private attributes of JAX's public classes pmaptap reads (not in jax._src's
# inventory above, which sees only module-level names): (module, class,
# attribute); every supported release has them, and missing_internals says
# so when one does not.
CLASS_READS = (("jax.sharding", "Sharding", "_device_assignment"),)


def device_assignment(sharding: Any) -> tuple:
    """The devices of a sharding in partition order (XLA's device
    assignment): what the output transport's drain names a shard's device
    by when the sharding has no mesh. Read, not guessed: a sharding without
    it fails (reported at the next flush) rather than name a wrong device."""
    return tuple(sharding._device_assignment)


def single_device_sharding(device: Any) -> Any:
    """A sharding that puts a whole array on ``device``: JAX 0.10's
    ``make_single_device_sharding`` (0.12 deprecates the class it makes),
    the class itself on 0.9."""
    import jax

    make = getattr(jax.sharding, "make_single_device_sharding", None)
    return make(device) if make is not None else jax.sharding.SingleDeviceSharding(device)


# Frames recognised by their module (and function) name (placement.py):
# these modules' frames may hold the concrete mesh in a local named "mesh"
# (jax._src.shard_map._shard_map_staging when tracing under jit,
# _run_shmap / _shard_map_impl when running shard_map eagerly).
MESH_FRAME_MODULES = ("jax._src.shard_map",)
# Tracing inside these makes a collective unsafe: devices may take different
# branches (cond/switch) or run different trip counts (while_loop), and a
# collective that only some devices reach deadlocks. scan is uniform.
DIVERGENT_FLOW = (
    ("jax._src.lax.control_flow.conditionals", None),
    ("jax._src.lax.control_flow.loops", "while_loop"),
)
# The function whose frame traces a shard_map body, called from
# ``_shard_map_staging`` (invariant.py reads that frame's locals): JAX <=
# 0.11's ``pe.trace_to_jaxpr``; on 0.12 that name is a C++ cache around
# ``pe.trace_to_jaxpr_nocache``, whose Python frame is the one on the stack.
BODY_TRACING_FRAMES = ("trace_to_jaxpr", "trace_to_jaxpr_nocache")


def input_vars(jaxpr: Any, n_consts: int) -> tuple[list, list]:
    """(the variables bound to the consts, those bound to the arguments) of
    a jaxpr traced with ``n_consts`` consts beside it. JAX <= 0.11 keeps
    them apart (``constvars``, ``invars``); 0.12 counts a constvar whose
    value is not attached to the jaxpr among its ``invars``."""
    every = [*jaxpr.constvars, *jaxpr.invars]
    return every[:n_consts], every[n_consts:]


def scan_counts(params: dict) -> tuple[int, int]:
    """(consts, carry): how many of a ``scan`` equation's operands are
    loop-invariant constants and how many the carry (the rest are the
    scanned-over ``xs``). JAX <= 0.11 has them as ``num_consts`` and
    ``num_carry``; 0.12 has one flat tree of the three groups, ``ft_in``."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def closed(jaxpr: Any, consts: list) -> Any:
    """``jaxpr`` (as ``pe.trace_to_jaxpr_dynamic`` returns it) with its
    ``consts`` attached, the form a loop's params hold. JAX <= 0.11 wraps
    the two in a ``core.ClosedJaxpr``; 0.12 has no such class, a
    ``core.Jaxpr`` carries its consts (its two-argument constructor attaches
    them). Either way ``.jaxpr`` of the result has the equations."""
    from jax._src import core

    make = _optional(core, "ClosedJaxpr") or core.Jaxpr
    return make(jaxpr, consts)


def scan_with_extra_carry(params: dict, jaxpr: Any) -> dict:
    """The params of a ``scan`` equation that runs ``jaxpr``: ``params``'
    loop with one more carry, the first of the carries (its operand right
    after the consts, its output first among the outputs). JAX <= 0.11
    counts the carries (``num_carry``, and flags each operand's linearity,
    ``linear``); 0.12 has the flat trees ``ft_in`` ((consts, carry, xs))
    and ``ft_out`` ((carry, ys)), whose carry sub-trees JAX's own rules may
    have filtered or nested: the new carry is packed beside them as is."""
    new = dict(params, jaxpr=jaxpr)
    if "num_carry" in params:
        n_consts = params["num_consts"]
        new["num_carry"] = params["num_carry"] + 1
        if "linear" in params:
            linear = list(params["linear"])
            linear.insert(n_consts, False)
            new["linear"] = tuple(linear)
        return new
    from jax._src.lax.control_flow import loops

    ft: Any = _optional(loops, "ft")  # jax._src.flattree, as loops names it
    consts, carry, xs = params["ft_in"].unpack()
    carry_out, ys = params["ft_out"].unpack()
    new["ft_in"] = ft.pack((consts, (ft.nones(1), carry), xs))
    new["ft_out"] = ft.pack(((ft.nones(1), carry_out), ys))
    return new


def unhoisted(jaxpr_known: Any, known_consts: list, num_res: int, *_more_res: int) -> tuple:
    """What ``loops._scan_known_hoisting`` returns when it hoists nothing
    out of a scan body (the form JAX's own comment there gives to disable
    it), for the arguments it was called with. JAX <= 0.11 passes it one
    residual count; 0.12 passes the unstructured residuals' count then the
    structured ones' (never hoisted, so not in the result's flags)."""
    return jaxpr_known, known_consts, [False] * num_res, []


def _minor(version: str) -> tuple[int, int] | None:
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def _name(v: tuple[int, int]) -> str:
    return f"{v[0]}.{v[1]}"


def check_version() -> None:
    """Warn once when the installed JAX is not one the suite runs on, naming
    the internals it lacks (called when the trace side is imported)."""
    global _warned
    if _warned:
        return
    _warned = True
    import jax

    version = jax.__version__
    if _minor(version) in TESTED:
        return
    try:
        missing = missing_internals()
    except Exception as e:  # noqa: BLE001 - the warning must not fail an import
        missing = [f"(the inventory could not be checked: {e!r})"]
    tested = ", ".join(f"{_name(v)}.x" for v in TESTED)
    what = "statically checked only" if _minor(version) in CHECKED else "neither tested nor checked"
    detail = (
        f"; JAX internals pmaptap reads that it lacks (taps that need them will "
        f"fail): {'; '.join(missing)}"
        if missing
        else "; every JAX internal pmaptap reads is present"
    )
    warnings.warn(
        f"pmaptap is tested with JAX {tested}; JAX {version} is {what}{detail}. "
        "See docs/contributing.md#jax-versions.",
        RuntimeWarning,
        stacklevel=2,
    )


# ------------------------------------------------------------ 0.9 against 0.10
def varying_of(aval: Any) -> frozenset:
    """The manual axes over which a value varies (JAX 0.10 keeps them in
    ``aval.mat.varying``, 0.9 in ``aval.vma``; none where neither is)."""
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()) or ())


def manual_axes_of(aval: Any) -> frozenset | None:
    """The manual axes along which a value may vary or hold partial sums
    (varying, unreduced, reduced), or None if the aval does not say. JAX
    0.10 keeps them in ``aval.mat`` (a ManualAxisType); 0.9 keeps the
    varying ones in ``aval.vma`` and the others in its sharding's spec."""
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(mat.varying | mat.unreduced | mat.reduced)
    vma = getattr(aval, "vma", None)
    if vma is None:
        return None
    spec = getattr(getattr(aval, "sharding", None), "spec", None)
    partial = frozenset(getattr(spec, "unreduced", ())) | frozenset(getattr(spec, "reduced", ()))
    return frozenset(vma) | partial


def set_sharding(module_context, op, sharding) -> None:
    """``mlir.set_sharding``: JAX 0.10 added the module context as its
    first argument; 0.9 takes the op and the sharding."""
    import inspect

    from jax._src.interpreters import mlir

    if len(inspect.signature(mlir.set_sharding).parameters) >= 3:
        mlir.set_sharding(module_context, op, sharding)
    else:
        mlir.set_sharding(op, sharding)
