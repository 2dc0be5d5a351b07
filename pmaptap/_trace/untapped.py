"""``pmaptap.untapped(fn)``: ``fn`` traced with every tap removed.

Any computation holding a host callback runs on JAX's slower dispatch path
(effect tokens, no C++ fast path): ~0.3 ms a step on the development box,
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
import os
from typing import Callable, TypeVar

from pmaptap._log import log

F = TypeVar("F", bound=Callable)

_TRUE = ("1", "true", "yes", "on", "y", "t")
_FALSE = ("", "0", "false", "no", "off", "n", "f")


def _env_default() -> bool:
    """PMAPTAP_UNTAPPED, read here rather than by JAX: empty means unset,
    and a value that is neither true nor false warns instead of breaking
    ``import pmaptap`` (the launcher and the CLI import it too)."""
    raw = os.environ.get("PMAPTAP_UNTAPPED", "")
    val = raw.strip().lower()
    if val in _TRUE:
        return True
    if val not in _FALSE:
        log.warning(
            f"PMAPTAP_UNTAPPED={raw!r} is not one of 1/true/yes/on or "
            "0/false/no/off (or empty); taps stay on."
        )
    return False


try:
    # JAX internals: a config state that JAX's caches key on (public
    # jax.config cannot define new states); test_untapped pins this. Should
    # a JAX upgrade move it, taps keep working and only untapped() refuses.
    # (JAX reads an environment variable named after the state, hence the
    # _state suffix: PMAPTAP_UNTAPPED is parsed by _env_default.)
    from jax._src import config as _jax_config

    _TAPS_OFF = _jax_config.bool_state(
        name="pmaptap_untapped_state",
        default=_env_default(),
        help="Remove pmaptap taps (tap, tap_grad, host_callback.id_tap/"
        "id_print) from functions traced while set.",
        include_in_jit_key=True,
        include_in_trace_context=True,
    )
    _MISSING = ""
except (ImportError, AttributeError, TypeError, ValueError) as e:  # pragma: no cover
    _TAPS_OFF = None
    _MISSING = f"{type(e).__name__}: {e}"


def taps_off() -> bool:
    """Whether taps traced now are removed."""
    return _TAPS_OFF is not None and bool(_TAPS_OFF.value)


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
