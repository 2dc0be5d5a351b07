"""Trace-time proof that a tapped value is the same on every device along
the tap's manual axes (owned by placement.py; docs/architecture.md, "Exact
or null placement").

Why: a ``dedup="replicated"`` tap compares its copies with an
``all_gather``, a second rendezvous of every device after the step's own
``pmean`` (on a scalar loss most of what the tap costs). When JAX shows the
value cannot differ between devices, the comparison is skipped
(``Layout.PROVEN``).

Two sources, both JAX 0.10 internals:

a. Varying-manual-axes typing (``shard_map(check_vma=True)``):
   ``core.typeof(x).mat`` names the axes ``x`` may vary over. Trusted only
   when no enclosing shard_map turned checking off (pmap is
   ``check_vma=False``: every set is empty there, proving nothing), and not
   for a value made from a per-device source JAX types from its operands
   (``_per_device_eqn``: a host callback's answer, ``rng_uniform``, code JAX
   does not read), looked for by a walk back (``_from_per_device_source``)
   that stops at an all-reduce over the tap's axes.
b. A conservative walk back through the recorded equations
   (``DynamicJaxprTracer.parent``): invariant are literals and concrete
   constants, all-reduces (psum, pmax, pmin, all_gather) over every one of
   the tap's axes, whitelisted pure primitives of invariant operands, and
   shard_map (or pmap) body inputs whose in_spec names no axis, read off the
   staging frame on the Python stack (``_shard_map_staging``); lift.py's
   re-trace says which outer value each input is (``same_as``). Anything
   else is not proven.

Nothing here may fail a user's trace: any exception means "not proven".
``tests/trace/test_prove.py::test_jax_internals_the_proof_reads_are_still_there``
fails loudly if a JAX upgrade moves what is read here.
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from typing import Any, Callable, NamedTuple, Sequence

from pmaptap._trace.jax_support import BODY_TRACING_FRAMES, manual_axes_of

# All-reduce collectives: every participant ends with the same value when
# the reduction covers all of the tap's axes (and no axis_index_groups).
# The parameter naming the axes differs between them.
_ALL_REDUCE = {
    "psum": "axes",
    "psum_invariant": "axes",
    "pmax": "axes",
    "pmin": "axes",
    "all_gather": "axis_name",
    "all_gather_invariant": "axis_name",
}

# Pure primitives: deterministic functions of their operands alone, with no
# inner jaxpr, no effects, no device-dependent behaviour. Same operands on
# every device, same result. Listed by name (stable across JAX releases;
# an unknown name is simply not proven).
_PURE = frozenset(
    """
    neg sign floor ceil round is_finite exp exp2 log log1p expm1 tanh logistic
    sin cos tan asin acos atan sinh cosh asinh acosh atanh sqrt rsqrt cbrt abs
    pow integer_pow square add sub mul div rem max min atan2 nextafter
    and or xor not shift_left shift_right_arithmetic shift_right_logical
    population_count clz eq ne lt le gt ge select_n clamp
    convert_element_type bitcast_convert_type reduce_precision
    real imag conj complex erf erfc erf_inv lgamma digamma
    reshape broadcast_in_dim squeeze expand_dims transpose slice dynamic_slice
    dynamic_update_slice gather concatenate pad rev iota copy copy_p
    reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor
    argmax argmin cumsum cumprod cummax cummin cumlogsumexp sort
    dot_general stop_gradient pvary
    """.split()
)

# Equations visited per proof before giving up (not proven): the tapped
# value of a big step may sit behind thousands of equations.
MAX_EQUATIONS = 512

_lock = threading.Lock()
# trace -> {Var: proven}: a Var's answer never changes, and the taps of one
# body (an automatic group, a pytree's leaves) share most of their history.
_memo: "weakref.WeakKeyDictionary[Any, dict[Any, bool]]" = weakref.WeakKeyDictionary()
# trace -> {input Var: the value of the enclosing trace it stands for}
# (``same_as``: pmaptap.jit/pmap's second trace of a body).
_aliases: "weakref.WeakKeyDictionary[Any, dict[Any, Any]]" = weakref.WeakKeyDictionary()


def same_as(inner: Sequence[Any], outer: Sequence[Any]) -> None:
    """The inputs ``inner`` of the trace being built are the enclosing
    trace's values ``outer`` (lift.py traces a step's body again, on its
    arguments' types): what is proven of those is proven of these."""
    try:
        from jax._src import core
        from jax._src.interpreters import partial_eval as pe

        trace = core.trace_ctx.trace
        with _lock:
            got = _aliases.get(trace)
            if got is None:
                got = _aliases[trace] = {}
        for i, o in zip(inner, outer):
            if isinstance(i, pe.DynamicJaxprTracer) and i.parent is None:  # an input
                got[i.val] = o
    except Exception:  # noqa: BLE001 - never fail a user's trace: proves nothing
        pass


def proven_invariant(leaves: Sequence[Any], axis_names: Sequence[Any]) -> bool:
    """True only if every leaf is provably identical on every device along
    ``axis_names`` (the raw JAX names of the tap's manual axes)."""
    try:
        axes = frozenset(axis_names)
        if not axes:
            return False
        return all(_leaf_invariant(x, axes) for x in leaves)
    except Exception:  # never fail a user's trace over an optimisation
        return False


def _leaf_invariant(x: Any, axes: frozenset) -> bool:
    from jax._src import core

    if not isinstance(x, core.Tracer):
        return True  # a concrete value baked into the program
    if _vma_trusted():
        manual = manual_axes_of(core.typeof(x))
        if manual is not None and not manual & axes and not _from_per_device_source(x, axes):
            return True
    return _walk_in(x, axes, core.trace_ctx.trace, depth=0)


def _walk_in(x: Any, axes: frozenset, trace: Any, depth: int) -> bool:
    """The walk (source b) of ``x``, a value of ``trace``; its inputs proven
    as the values of the enclosing trace they stand for (``same_as``), or
    as a shard_map body's replicated inputs (``_replicated_input``)."""
    from jax._src import core
    from jax._src.interpreters import partial_eval as pe

    if not isinstance(x, core.Tracer):
        return True
    if not isinstance(x, pe.DynamicJaxprTracer) or x._trace is not trace or depth > 4:
        return False  # another transformation's value, or an enclosing trace's
    with _lock:
        memo = _memo.get(trace)
        if memo is None:
            memo = _memo[trace] = {}
        aliases = _aliases.get(trace, {})

    def input_invariant(var: Any) -> bool:
        outer = aliases.get(var)
        if outer is not None:
            return _walk_in(outer, axes, getattr(outer, "_trace", None), depth + 1)
        return _replicated_input(trace, var, axes)

    return _walk(x, axes, trace.frame, memo, input_invariant)


def _replicated_input(trace: Any, var: Any, axes: frozenset) -> bool:
    """Whether ``var``, an input of ``trace``, is a shard_map body's input
    whose in_spec names no axis (the same on every device of that
    shard_map's axes, which cover ``axes``): found by the staging frame on
    the Python stack that traces this body."""
    staging = _staging_of(trace)
    if staging is None:
        return False
    low = getattr(trace, "requires_low", True)  # unknown: not proven
    if low or not axes <= frozenset(staging["newly_manual_axes"]):
        return False
    specs = staging["in_specs"]
    invars = trace.frame.invars
    if len(invars) != len(specs):
        return False
    spec = specs[invars.index(var)]
    named = any(p is not None for p in spec)
    partial = getattr(spec, "unreduced", None) or getattr(spec, "reduced", None)
    return not named and not partial


def _per_device_eqn(primitive: Any) -> bool:
    """Whether an equation's result may differ between the devices while
    JAX's varying-axes typing (which types it from its operands, or from what
    its caller declared) says it cannot: a host callback (io_callback,
    pure_callback, host_callback.call, buffer_callback: each device may get its
    own answer; pmaptap's taps return no host answer), ``rng_uniform`` (XLA's
    stateful generator; every ``jax.random`` draw is a function of its key),
    ``precv``, and code JAX does not read (``ffi_call``, ``pallas_call``,
    ``tpu_custom_call``, ``core_map``, ``call_exported``).
    """
    name = primitive.name
    if name in _NO_HOST_ANSWER:
        return False
    return "callback" in name or name in _PER_DEVICE_PRIMITIVES


_NO_HOST_ANSWER = frozenset({"pmaptap_callback", "pmaptap_hcb_tap", "debug_callback"})
_PER_DEVICE_PRIMITIVES = frozenset(
    """
    rng_uniform precv ffi_call pallas_call tpu_custom_call core_map call_exported
    """.split()
)


@functools.lru_cache(maxsize=1024)
def _jaxpr_has_per_device_eqn(jaxpr: Any) -> bool:
    """Whether an equation of ``jaxpr`` (inner jaxprs included, at any
    depth) is a per-device source: no dataflow, as a jaxpr is read once per
    object (the bodies of scans and jits, met again by every later tap)."""
    for eqn in jaxpr.eqns:
        if _per_device_eqn(eqn.primitive) or _holds_per_device_eqn(eqn):
            return True
    return False


def _holds_per_device_eqn(eqn: Any) -> bool:
    from jax._src import core

    return any(_jaxpr_has_per_device_eqn(j) for j in core.jaxprs_in_params(eqn.params))


def _covers(eqn: Any, axes: frozenset) -> bool:
    """Whether ``eqn`` is an all-reduce over every one of ``axes`` (no
    axis_index_groups): every device ends with the same value, whatever its
    operands were."""
    param = _ALL_REDUCE.get(eqn.primitive.name)
    if param is None:
        return False
    names = eqn.params.get(param)
    names = names if isinstance(names, (tuple, list)) else (names,)
    named = {n for n in names if not isinstance(n, int)}
    return eqn.params.get("axis_index_groups") is None and axes <= named


# trace -> how many of its recorded equations are known to hold no
# per-device source (-1: one does). Equations are only ever appended.
_clean: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()


def _records_per_device_eqn(trace: Any) -> bool:
    """Whether an equation recorded so far in ``trace`` is (or holds) a
    per-device source; read once per equation over all proofs."""
    eqns = trace.frame.tracing_eqns
    with _lock:
        done = _clean.get(trace, 0)
    if done < 0:
        return True
    for i in range(done, len(eqns)):
        e = eqns[i]
        e = e() if isinstance(e, weakref.ref) else e
        if e is not None and (_per_device_eqn(e.primitive) or _holds_per_device_eqn(e)):
            with _lock:
                _clean[trace] = -1
            return True
    with _lock:
        known = _clean.get(trace, 0)
        if known >= 0:  # not found dirty meanwhile
            _clean[trace] = max(known, len(eqns))
    return False


def _from_per_device_source(x: Any, axes: frozenset) -> bool:
    """Whether ``x`` may depend on a per-device source (``_per_device_eqn``)
    other than through an all-reduce over every one of ``axes`` (or the
    walk cannot tell): then JAX's varying-axes typing proves nothing for it.

    A bounded walk back through the equations that made ``x`` (their inner
    jaxprs read whole), through values closed over from enclosing traces,
    and from an input of a trace to where it came from (``_input_origins``).
    """
    from jax._src import core, shard_map
    from jax._src.interpreters import partial_eval as pe

    budget = MAX_EQUATIONS * 4
    seen: set = set()
    stack: list = [x]
    while stack:
        t = stack.pop()
        if isinstance(t, _Input):
            if t in seen:
                continue
            seen.add(t)
            origins = _input_origins(t.trace, t.var)
            if origins is None:
                return True
            stack.extend(origins)
            continue
        if not isinstance(t, core.Tracer):
            continue
        if isinstance(t, shard_map.ShardMapTracer):
            return True  # an eager shard_map's: computed already, its history gone
        if not isinstance(t, pe.DynamicJaxprTracer):
            inner = getattr(t, "primal", None)
            if inner is None:
                inner = getattr(t, "val", None)
            if inner is None:
                return True  # a transformation whose value cannot be read
            stack.append(inner)
            continue
        if id(t) in seen:
            continue
        seen.add(id(t))
        budget -= 1
        if budget < 0:
            return True
        eqn = t.parent
        if eqn is None:
            if isinstance(t.val, core.Literal):
                continue
            consts = t._trace.frame.constvar_to_val
            if t.val in consts:
                stack.append(consts[t.val])  # closed over: its own history
            else:
                stack.append(_Input(t._trace, t.val))
            continue
        if _per_device_eqn(eqn.primitive):
            return True
        if eqn.primitive.name in _ALL_REDUCE and _covers(eqn, axes):
            continue  # the same on every device, whatever came in
        if any(_jaxpr_has_per_device_eqn(j) for j in core.jaxprs_in_params(eqn.params)):
            return True
        stack.extend(eqn.in_tracers)
    return False


class _Input(NamedTuple):
    """An input of a trace being built, met by the walk."""

    trace: Any
    var: Any


def _input_origins(trace: Any, var: Any) -> list | None:
    """What the input ``var`` of ``trace`` may have been made from, to walk
    on, or None where unknown (then it may be per-device): for pmaptap.jit's
    second trace of a body, the value it stands for (``same_as``); for a
    shard_map body, the value its staging passed in if that is itself
    per-device (a jit's value is kept replicated by its compiler); for a body
    traced inside another trace (scan, jit, cond, checkpoint, ...), unknown
    which: every equation recorded there so far is read and that trace's own
    inputs and closed-over values are walked on.
    """
    from jax._src.interpreters import partial_eval as pe

    with _lock:
        outer = _aliases.get(trace, {}).get(var)
    if outer is not None:
        return [outer]
    staging = _staging_of(trace)
    if staging is not None:
        args = staging["args"]
        invars = trace.frame.invars
        if getattr(trace, "requires_low", True) or len(invars) != len(args):
            return None
        # The mesh it was staged with names the axes already manual around
        # it: none for a shard_map of the whole computation.
        around = getattr(staging["mesh"], "manual_axes", None)
        return [args[invars.index(var)]] if around or around is None else []
    parent = getattr(trace, "parent_trace", None)
    while parent is not None and not isinstance(parent, pe.DynamicJaxprTrace):
        parent = getattr(parent, "parent_trace", None)  # grad, vmap: their traces
    if parent is None:
        # A trace of the whole computation (jit): its inputs are global
        # values; or one not known, whose inputs typed per device say so.
        return None if _manual_input(var) else []
    if _records_per_device_eqn(parent):
        return None
    frame = parent.frame
    return [*frame.constvar_to_val.values(), *(_Input(parent, v) for v in frame.invars)]


def _manual_input(var: Any) -> bool:
    """Whether ``var``, an input of a trace, is one value per device (its
    type names manual axes; unknown: it is)."""
    mesh = getattr(getattr(getattr(var, "aval", None), "sharding", None), "mesh", None)
    return mesh is None or bool(getattr(mesh, "manual_axes", True))


def _staging_of(trace: Any) -> dict | None:
    """The locals of the ``_shard_map_staging`` frame on the Python stack
    that traces ``trace`` as a shard_map body, or None."""
    frame = sys._getframe(1)
    while frame is not None:
        if (
            frame.f_code.co_name in BODY_TRACING_FRAMES
            and frame.f_locals.get("trace") is trace
            and frame.f_back is not None
            and frame.f_back.f_code.co_name == "_shard_map_staging"
            and frame.f_back.f_globals.get("__name__") == "jax._src.shard_map"
        ):
            return frame.f_back.f_locals
        frame = frame.f_back
    return None


def varying_axes(x: Any, axis_names: Sequence[Any]) -> frozenset | None:
    """The axes of ``axis_names`` along which ``x``'s copies may differ by
    design (a block of a value split over them, or partial sums), as JAX's
    varying-axes typing says (source a above); None where that typing is off
    (``check_vma=False``, pmap) and says nothing. pmaptap.fingerprint
    compares the copies that agree on these axes."""
    from jax._src import core

    try:
        if not _vma_trusted():
            return None
        axes = manual_axes_of(core.typeof(x))
        if axes is None:
            return None
        return axes & frozenset(axis_names)
    except Exception:  # noqa: BLE001 - unknown: compare as replicated
        return None


def _vma_trusted() -> bool:
    """Whether JAX's varying-axes typing is on for every manual axis now: on
    in the innermost shard_map and not turned off by an enclosing one."""
    from jax._src import config

    if not config._check_vma.value:
        return False
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") == "jax._src.shard_map":
            if frame.f_locals.get("check_vma", True) is False:
                return False
        frame = frame.f_back
    return True


def _walk(
    root: Any, axes: frozenset, frame: Any, memo: dict, input_invariant: Callable[[Any], bool]
) -> bool:
    """The dataflow proof (source b), iterative so deep chains cannot hit
    Python's recursion limit; answers are memoized per Var."""
    from jax._src import core

    budget = MAX_EQUATIONS
    stack = [root]
    while stack:
        t = stack[-1]
        var = t.val
        if isinstance(var, core.Literal):
            stack.pop()
            continue
        known = memo.get(var)
        if known is not None:
            stack.pop()
            if not known:
                return False
            continue
        verdict, pending = _step(t, var, axes, frame, memo, input_invariant)
        if verdict is None:  # operands to prove first
            budget -= 1
            if budget < 0:
                return False  # not proven; nothing memoized as false
            stack.extend(pending)
            continue
        memo[var] = verdict
        stack.pop()
        if not verdict:
            # The values still on the stack are not all dependents of this
            # one (siblings wait there too): only its own answer is kept.
            return False
    return True


def _step(t: Any, var: Any, axes: frozenset, frame: Any, memo: dict, input_invariant: Callable):
    """(True/False, ()) when ``t`` is decided, or (None, operands) when its
    operands must be proven first."""
    from jax._src import core

    eqn = t.parent
    if eqn is None:
        # A constant (one that is itself a tracer is a value closed over
        # from an enclosing trace: not proven), or an input of the trace.
        if var in frame.constvar_to_val:
            return not isinstance(frame.constvar_to_val[var], core.Tracer), ()
        return input_invariant(var), ()
    name = eqn.primitive.name
    if name in _ALL_REDUCE:
        return _covers(eqn, axes), ()
    if name not in _PURE or eqn.effects:
        return False, ()
    pending = []
    for i in eqn.in_tracers:
        if isinstance(i.val, core.Literal):
            continue
        known = memo.get(i.val)
        if known is False:
            return False, ()
        if known is None:
            pending.append(i)
    if not pending:
        return True, ()
    return None, pending


def check_internals() -> None:
    """Raise if a JAX upgrade moved what the proof reads (run by
    tests/trace/test_prove.py, so that it fails there, loudly, rather than every
    replicated tap silently falling back to comparing copies): the fields and
    parameters below; the module-level names are jax_support's inventory."""
    import inspect

    from jax._src import core, shard_map
    from jax._src.interpreters import partial_eval as pe

    missing = []
    # Its frame's local ``trace`` is a shard_map body's trace (a cached
    # function, so not read here: test_prove.py's shard_map test fails if it
    # moves); recognised by name, so not in the inventory.
    if not hasattr(pe, "trace_to_jaxpr"):
        missing.append("partial_eval.trace_to_jaxpr")
    # The manual axes of an aval (manual_axes_of): JAX 0.10's ManualAxisType,
    # else 0.9's ShapedArray.vma. Its name is held in a variable: an optional
    # read, so not in jax_support's inventory of what every JAX must have.
    optional = "ManualAxisType"
    if hasattr(core, optional):
        axes_type = (getattr(core, optional), ("varying", "unreduced", "reduced"))
    else:
        axes_type = (core.ShapedArray, ("vma", "sharding"))
    for cls, slots in (
        (getattr(pe, "DynamicJaxprTracer", None), ("val", "parent")),
        (getattr(pe, "DynamicJaxprTrace", None), ("frame", "parent_trace")),
        (getattr(pe, "JaxprStackFrame", None), ("constvar_to_val", "invars", "tracing_eqns")),
        axes_type,
    ):
        # Slots, or declared fields (0.9's JaxprStackFrame has no slots).
        have = set(getattr(cls, "__slots__", ())) | set(getattr(cls, "__annotations__", {}))
        missing += [f"{getattr(cls, '__name__', cls)}.{s}" for s in slots if s not in have]
    tracing_eqn = getattr(pe, "TracingEqn", None)
    if tracing_eqn is not None:
        fields = inspect.signature(tracing_eqn).parameters
        missing += [
            f"TracingEqn.{f}"
            for f in ("in_tracers", "primitive", "params", "effects")
            if f not in fields
        ]
    staging = getattr(shard_map, "_shard_map_staging", None)
    if staging is not None:
        params = inspect.signature(staging).parameters
        missing += [
            f"_shard_map_staging({p}=)"
            for p in ("args", "mesh", "check_vma", "in_specs", "newly_manual_axes")
            if p not in params
        ]
    if missing:
        raise RuntimeError(
            "pmaptap's trace-time proof of replication relies on JAX internals "
            "that this JAX does not have: " + ", ".join(missing)
        )
