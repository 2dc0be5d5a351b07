"""``pmaptap.untapped(fn)``: ``fn`` traced with every tap removed, so a loop
that records every N-th step compiles it twice and picks on the host
(docs/api.md, "Recording every N-th step"): a host callback puts the whole
computation on JAX's slower dispatch path, even under a ``lax.cond`` that
never fires.

The switch is a JAX configuration state, part of JAX's trace and jit cache
keys, so a jitted helper traced for one version is never reused by the
other. It is thread-local; ``PMAPTAP_UNTAPPED=1`` turns it on for the whole
process. Arguments are still checked at trace time.
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
