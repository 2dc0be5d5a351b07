"""Which loop iteration a tap runs in: ``iteration_p`` and the loops that
give it its value (the ``"iteration"`` field, docs/api.md: so two
iterations of one step are never taken for two replicas of one value).

JAX gives a loop body no iteration counter, so pmaptap threads one:

- ``indices()``, called by a tap, binds ONE ``iteration_p`` (no operands,
  an int32 scalar) at the top level of each enclosing loop body's trace
  (found by its ``DebugInfo.traced_for``), whatever trace the tap is in: a
  ``cond``, ``checkpoint`` or ``jit`` inside the body closes over it.
- When the loop's equation is staged (``scan_p`` / ``while_p``, a
  ``custom_staging_rules`` entry every staged loop passes through), a body
  holding an ``iteration_p`` gets one more carry, a counter from 0, and
  each ``iteration_p`` becomes it: for a scan the index into ``xs`` (a
  ``reverse`` scan counts down, as the output transport's stacked rows are
  indexed), for a ``while_loop`` the number of body runs before it.

Both transports carry the indices: after the mesh coordinates (emit.py) or
with the lifted loop's stacked rows (lift.py).

vmap, jvp and linearize re-trace the body with the operand-less
``iteration_p`` at its top level, so it stays unbatched and
un-differentiated. JAX's scan linearization hoists what depends only on
loop constants out of the body (``_scan_known_hoisting``); ``iteration_p``
depends on nothing, so that step is skipped for bodies that hold one
(``_keep_in_body``).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np
from jax import lax
from jax._src import core
from jax._src import linear_util as lu
from jax._src.interpreters import ad, batching, mlir
from jax._src.interpreters import partial_eval as pe
from jax._src.lax.control_flow import loops

from pmaptap._trace import traceend
from pmaptap._trace.jax_support import closed, scan_counts, scan_with_extra_carry, unhoisted

iteration_p = core.Primitive("pmaptap_iteration")

_INDEX = core.ShapedArray((), np.dtype(np.int32))
# The DebugInfo.traced_for of the traces JAX makes for loop bodies (JAX
# 0.10: lax.scan and lax.map "scan", lax.fori_loop "fori_loop" whether it
# becomes a scan or a while_loop, lax.while_loop "while_body"/"while_cond").
# tests/trace/test_iterations.py fails loudly if JAX renames them.
LOOP_BODIES = frozenset({"scan", "fori_loop", "while_body", "while_cond"})


@iteration_p.def_abstract_eval
def _abstract_eval():
    return _INDEX


def _unreplaced(*args, **params):
    # Only bound into the trace of a loop body, which becomes a loop whose
    # staging replaces it. A loop body whose equation never reaches a
    # staging trace (a JAX that stages loops otherwise) has no index to
    # give: -1, which the host reads as "no iteration" (never a wrong one).
    return np.int32(-1)


iteration_p.def_impl(_unreplaced)
mlir.register_lowering(iteration_p, lambda ctx: [mlir.ir_constant(np.array(-1, np.int32))])
# No operands: never batched (None: JAX's "not mapped" out dimension).
batching.primitive_batchers[iteration_p] = lambda args, dims: (iteration_p.bind(), None)
ad.primitive_jvps[iteration_p] = lambda primals, tangents: (
    iteration_p.bind(),
    ad.Zero.from_primal_value(np.int32(0)),
)


_lock = threading.Lock()
# loop body trace -> its one iteration_p tracer (weakly keyed: a trace JAX
# drops is forgotten with it).
_bound: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def _loop_body(trace: Any) -> bool:
    if not traceend.staging_trace_type(trace):
        return False
    info = getattr(trace.frame, "debug_info", None)
    return getattr(info, "traced_for", None) in LOOP_BODIES


def _index_in(trace: Any) -> Any:
    with _lock:
        v = _bound.get(trace)
    if v is None:
        with core.set_current_trace(trace):
            v = iteration_p.bind()
        with _lock:
            v = _bound.setdefault(trace, v)
    return v


def indices() -> list:
    """The iteration index of every loop enclosing the current trace,
    outermost first (int32 scalars of those loops' body traces); [] outside
    any loop body."""
    out = [_index_in(t) for t in traceend.enclosing(core.trace_ctx.trace) if _loop_body(t)]
    return out[::-1]


# ------------------------------------------------------ the loops' staging
def _holds_index(jaxpr: Any) -> bool:
    return any(e.primitive is iteration_p for e in jaxpr.jaxpr.eqns)


class _Substitute(threading.local):
    def __init__(self) -> None:
        self.by_trace: dict[int, Any] = {}


_subst = _Substitute()


def _stage_index(trace, source_info, **params):
    # iteration_p bound while a loop's counted body is traced (_counted):
    # the counter; anywhere else, an equation as usual.
    v = _subst.by_trace.get(id(trace))
    if v is not None:
        return v
    return trace.default_process_primitive(iteration_p, [], params, source_info)


pe.custom_staging_rules[iteration_p] = _stage_index


def _counted(jaxpr: Any, at: int, index_of, counter: core.ShapedArray = _INDEX) -> Any:
    """``jaxpr`` with an int32 counter inserted among its inputs at ``at``
    and its ``iteration_p`` equations replaced by ``index_of(counter)``;
    its outputs unchanged (the caller adds the counter's next value where
    its loop needs it, via ``index_of``'s second result)."""
    avals = list(jaxpr.in_avals)
    avals.insert(at, counter)
    box: dict[str, Any] = {}

    def fun(*args):
        args = list(args)
        counter = args.pop(at)
        index, box["next"] = index_of(counter)
        trace = core.trace_ctx.trace
        _subst.by_trace[id(trace)] = index
        try:
            outs = core.jaxpr_as_fun(jaxpr)(*args)
        finally:
            del _subst.by_trace[id(trace)]
        return [*outs, box["next"]]

    info = jaxpr.jaxpr.debug_info
    # One more argument than the loop body's names: its names are dropped.
    info = info.with_unknown_names() if info is not None else None
    new, _, consts = pe.trace_to_jaxpr_dynamic(lu.wrap_init(fun, debug_info=info), avals)
    return closed(new, consts)


def _scan_staging(trace, source_info, *tracers, **params):
    jaxpr = params["jaxpr"]
    if not _holds_index(jaxpr):
        return _stage(loops.scan_p, trace, source_info, tracers, params)
    nc, _ = scan_counts(params)
    length, reverse = params["length"], params["reverse"]

    def index_of(i):
        return ((length - 1) - i if reverse else i), i + 1

    body = _counted(jaxpr, nc, index_of)
    # The counter's next value is the body's last output; a carry is among
    # the first outputs: move it to the front of the carries.
    outvars = list(body.jaxpr.outvars)
    nxt = outvars.pop()
    outvars.insert(0, nxt)
    body = closed(body.jaxpr.replace(outvars=outvars), body.consts)
    new_params = scan_with_extra_carry(params, body)
    zero = trace.to_jaxpr_tracer(np.int32(0), source_info=source_info)
    ins = [*tracers[:nc], zero, *tracers[nc:]]
    outs = _stage(loops.scan_p, trace, source_info, ins, new_params)
    return outs[1:]


def _while_staging(trace, source_info, *tracers, **params):
    cond, body = params["cond_jaxpr"], params["body_jaxpr"]
    if not (_holds_index(cond) or _holds_index(body)):
        return _stage(loops.while_p, trace, source_info, tracers, params)
    cn, bn = params["cond_nconsts"], params["body_nconsts"]
    # A predicate batched by vmap (a condition that depends on the batch):
    # JAX's lowering keeps each element's carry where its loop has ended
    # (a select on the predicate), which needs every carry batched like
    # the predicate. So is the counter then, one per element; the
    # elements still running are at the loop's iteration, the largest.
    shape = cond.out_avals[0].shape
    counter = core.ShapedArray(shape, np.dtype(np.int32))

    def current(i):
        return (i.max() if shape else i).astype(np.int32)

    def same(i):
        return current(i), i

    def plus_one(i):
        return current(i), i + 1

    new_cond = _counted(cond, cn, same, counter)
    # The condition returns its one boolean only.
    new_cond = closed(new_cond.jaxpr.replace(outvars=new_cond.jaxpr.outvars[:1]), new_cond.consts)
    new_body = _counted(body, bn, plus_one, counter)
    outvars = list(new_body.jaxpr.outvars)
    outvars.insert(0, outvars.pop())
    new_body = closed(new_body.jaxpr.replace(outvars=outvars), new_body.consts)
    new_params = dict(params, cond_jaxpr=new_cond, body_jaxpr=new_body)
    with core.set_current_trace(trace):
        zero = lax.full(shape, 0, np.int32)
    ins = [*tracers[: cn + bn], zero, *tracers[cn + bn :]]
    outs = _stage(loops.while_p, trace, source_info, ins, new_params)
    return outs[1:]


# The staging rule a loop primitive had before ours (None: JAX's default).
_before: dict[Any, Any] = {}


def _stage(prim, trace, source_info, tracers, params):
    """Stage ``prim`` as it was staged before this module's rule."""
    rule = _before.get(prim)
    if rule is not None:
        return rule(trace, source_info, *tracers, **params)
    return trace.default_process_primitive(prim, list(tracers), params, source_info)


def _install() -> None:
    for prim, rule in ((loops.scan_p, _scan_staging), (loops.while_p, _while_staging)):
        if pe.custom_staging_rules.get(prim) is rule:
            continue  # this module imported again: once only
        _before[prim] = pe.custom_staging_rules.get(prim)
        pe.custom_staging_rules[prim] = rule
    original = getattr(loops, "_scan_known_hoisting", None)
    if original is None or getattr(original, "_pmaptap", False):
        # A JAX without that step hoists nothing this module needs to keep.
        return

    def _keep_in_body(jaxpr_known, known_consts, *num_res):
        if _holds_index(jaxpr_known):
            return unhoisted(jaxpr_known, known_consts, *num_res)
        return original(jaxpr_known, known_consts, *num_res)

    _keep_in_body.__wrapped__ = original  # type: ignore[attr-defined]
    _keep_in_body._pmaptap = True  # type: ignore[attr-defined]
    loops._scan_known_hoisting = _keep_in_body


_install()
