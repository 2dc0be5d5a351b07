"""The switch that removes every tap (``pmaptap.untapped``,
``PMAPTAP_UNTAPPED=1``): a JAX configuration state that JAX's trace and jit
cache keys include. It lives here, below both sides, because the host side
must register it before the first tapped step is traced (``Session.open``;
registered mid-trace, at the first tap, it would change the key of the
function being traced and make JAX trace and compile it twice) while the
trace side reads it (``taps_off``)."""

from __future__ import annotations

import os

from pmaptap._log import log

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
    # Set while pmaptap.jit / pmaptap.pmap trace a step (_trace/marks.py:
    # collect): its taps are traced as output marks, not host callbacks. In
    # the cache keys too, or a scan body or jitted helper traced before
    # under jax.jit would be reused inside the step with its callbacks (and
    # the other way round).
    _OUTPUTS = _jax_config.bool_state(
        name="pmaptap_outputs_state",
        default=False,
        help="Set by pmaptap.jit / pmaptap.pmap while they trace a step.",
        include_in_jit_key=True,
        include_in_trace_context=True,
    )
    _MISSING = ""
except (ImportError, AttributeError, TypeError, ValueError) as e:  # pragma: no cover
    _TAPS_OFF = _OUTPUTS = None
    _MISSING = f"{type(e).__name__}: {e}"


def taps_off() -> bool:
    """Whether taps traced now are removed."""
    return _TAPS_OFF is not None and bool(_TAPS_OFF.value)
