"""Run deferred emission at the end of a jaxpr trace: the hook behind
automatic grouping (group.py, ``auto_offer``).

Why a hook into JAX: automatic grouping must emit the one shared callback
of a trace's ungrouped taps after the last of them and before the trace
becomes a jaxpr, and JAX has no public "trace is ending" callback. On JAX
0.10 every staging trace ends in ``JaxprStackFrame.to_jaxpr`` before it
snapshots the frame's equations; we wrap that one method, binding the
deferred work under that trace (made current again) first.

The only place that hooks JAX's tracing; beside it only trace types and
their ``parent_trace`` are read (``staging_target``).
``tests/trace/test_autogroup.py::test_trace_end_hook_still_sits_where_jax_ends_a_trace``
fails loudly if a JAX upgrade moves it. Should the method be gone, nothing
is hooked (``installed()`` is False) and taps are emitted one by one:
slower, never lost.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Protocol

from jax._src import core
from jax._src.interpreters import ad
from jax._src.interpreters import partial_eval as pe

# Forward differentiation traces whose primal values live in the enclosing
# trace (see staging_target); absent ones (a JAX that renamed them) are
# simply never looked through.
_DIFFERENTIATION_TRACES = tuple(
    t for t in (getattr(ad, "LinearizeTrace", None), getattr(ad, "JVPTrace", None)) if t
)


class Deferred(Protocol):
    def flush(self) -> None: ...


_lock = threading.Lock()
# trace -> the objects whose flush() emits its deferred work. Weakly keyed,
# so a trace that JAX drops without ending it (its function raised) does not
# stay here through its key; its deferred values (tracers, which refer to
# it) do keep it alive until the process ends: small, and only after an
# error that already aborted that compilation.
_pending: "weakref.WeakKeyDictionary[Any, dict[Any, Deferred]]" = weakref.WeakKeyDictionary()
_HOOKED = "_pmaptap_trace_end_hook"


def staging_trace() -> Any | None:
    """The current trace if it is a plain staging trace (a jaxpr being built
    for jit/pmap/shard_map, a control-flow or remat body), else None.

    Linearize's and the new remat's tangent traces are DynamicJaxprTraces
    too, with a ``tag``: their jaxprs are built and replayed by JAX's own
    transformation machinery, so nothing is deferred there."""
    t = core.trace_ctx.trace
    if type(t) is pe.DynamicJaxprTrace and getattr(t, "tag", None) is None:
        return t
    return None


def staging_target() -> Any | None:
    """The staging trace whose end a tap made now may wait for: the current
    trace if it is a plain staging trace; under ``grad``/``vjp``/``jvp``/
    ``linearize`` traced inside one (JAX's ``LinearizeTrace`` or ``JVPTrace``
    directly in a jit/pmap/shard_map body, as Flax's ``nnx.value_and_grad``
    in a jitted step), that enclosing staging trace. There a tap's
    ``stop_gradient``-ed operands are already that trace's tracers, and the
    tap's differentiation rule would bind its callback on the primals there
    anyway. None elsewhere (vmap's batching, eager, a remat or linearize
    tangent trace, nested transformations)."""
    t = staging_trace()
    if t is not None:
        return t
    cur = core.trace_ctx.trace
    if isinstance(cur, _DIFFERENTIATION_TRACES):
        parent = getattr(cur, "parent_trace", None)
        if staging_trace_type(parent):
            return parent
    return None


def staging_trace_type(t: Any) -> bool:
    """Whether ``t`` is a plain staging trace (see ``staging_trace``)."""
    return type(t) is pe.DynamicJaxprTrace and getattr(t, "tag", None) is None


def stageable(values) -> bool:
    """Whether every traced value in ``values`` is a staging tracer (of this
    trace, or of an enclosing one that this trace closes over: JAX lifts
    those into the jaxpr the same way whenever they are first used, now or
    at the trace's end); constants are fine. A value of any other
    transformation (a JVP or batch tracer) keeps its tap immediate."""
    return all(
        not isinstance(v, core.Tracer) or isinstance(v, pe.DynamicJaxprTracer) for v in values
    )


def deferred(trace: Any, key: Any, make: Callable[[], Deferred]) -> Deferred:
    """The object deferred under ``key`` for ``trace``'s end, made by
    ``make()`` on first use; its ``flush()`` runs, with ``trace`` current,
    just before the trace becomes a jaxpr."""
    with _lock:
        per_trace = _pending.get(trace)
        if per_trace is None:
            per_trace = _pending[trace] = {}
        obj = per_trace.get(key)
        if obj is None:
            obj = per_trace[key] = make()
        return obj


def pending(trace: Any) -> list[Deferred]:
    """The objects deferred for ``trace``'s end, still waiting (a copy)."""
    with _lock:
        return list(_pending.get(trace, {}).values())


def enclosing(trace: Any):
    """``trace`` and the traces it is nested in (innermost first): a scan
    body's trace, then the jit body that called lax.scan, and so on."""
    while trace is not None:
        yield trace
        trace = getattr(trace, "parent_trace", None)


def _flush(trace: Any) -> None:
    # Deferred work may trace more (a cond, a custom_vmap body: their own
    # traces, ending here too); anything deferred for THIS trace while
    # flushing is flushed as well.
    while True:
        with _lock:
            per_trace = _pending.pop(trace, None)
        if not per_trace:
            return
        with core.set_current_trace(trace):
            for obj in per_trace.values():
                obj.flush()


def _install() -> bool:
    frame_cls = getattr(pe, "JaxprStackFrame", None)
    original = getattr(frame_cls, "to_jaxpr", None)
    if original is None:
        return False
    if getattr(original, _HOOKED, False):
        return True  # this module was imported again (a reload): once only

    def to_jaxpr(self, trace, *args, **kwargs):
        if _pending:  # nothing deferred anywhere: one check, no lock
            _flush(trace)
        return original(self, trace, *args, **kwargs)

    setattr(to_jaxpr, _HOOKED, True)
    to_jaxpr.__wrapped__ = original  # type: ignore[attr-defined]
    to_jaxpr.__doc__ = original.__doc__
    frame_cls.to_jaxpr = to_jaxpr
    return True


_installed = _install()


def installed() -> bool:
    """Whether the trace-end hook is in place (else nothing is deferred)."""
    return _installed
