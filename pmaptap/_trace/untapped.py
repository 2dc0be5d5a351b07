"""``pmaptap.untapped(fn)``: ``fn`` traced with every tap removed.

Any computation holding a host callback runs on JAX's slower dispatch path
(effect tokens, no C++ fast path), a cost per step (docs/performance.md)
paid even when a ``lax.cond`` around the callback never fires. A training
loop that records every N-th step can instead compile the step twice, with
and without taps, and pick on the host::

    step_fn = jax.pmap(step)
    quiet_fn = jax.pmap(pmaptap.untapped(step))
    for i in range(n):
        fn = step_fn if i % 10 == 0 else quiet_fn

The switch is a JAX configuration state that is part of JAX's trace and jit
cache keys, so a jitted helper (or a scan body) traced for one version is
never reused by the other: a tapped step cannot silently inherit an
untapped trace. The state is thread-local, and ``PMAPTAP_UNTAPPED=1`` in the
environment turns it on for the whole process (every tap removed, e.g. for a
production run). Arguments are still checked at trace time.
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

from pmaptap._common.switch import _MISSING, _TAPS_OFF

F = TypeVar("F", bound=Callable)


def untapped(fn: F) -> F:
    """``fn`` with every pmaptap tap it traces removed (a no-op that returns
    its value), for a second, callback-free compilation of a tapped step.
    ``host_callback.call`` stays: its results are part of the computation."""
    if not callable(fn):
        raise TypeError(f"pmaptap.untapped(fn): fn must be callable, got {type(fn).__name__}")
    if _TAPS_OFF is None:  # pragma: no cover - only on an unsupported JAX
        raise RuntimeError(
            "pmaptap.untapped needs jax._src.config.bool_state "
            f"(JAX cache keys), which this JAX lacks: {_MISSING}"
        )

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _TAPS_OFF(True):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
