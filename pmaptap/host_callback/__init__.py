"""``jax.experimental.host_callback`` (removed in JAX 0.8) on today's JAX.

Old code keeps working after changing only the import::

    from pmaptap import host_callback as hcb
    hcb.id_tap(tap_func, x)          # tap_func(x, transforms) on the host
    hcb.id_print(x, what="x")        # prints "what: x" and then x
    y = hcb.call(np.linalg.eigvals, m, result_shape=...)
    hcb.barrier_wait()               # taps done; raises CallbackException once

How it is built: docs/host_callback.md, "How it is built"; why ``call``
waits on the executor: ``_CallJob.on_callback_thread``.
"""

from __future__ import annotations

import jax

from pmaptap.errors import CallbackException
from pmaptap.host_callback._call import call
from pmaptap.host_callback._taps import id_print, id_tap
from pmaptap.host_callback.executor import _executor, _format, _on_executor_thread

__all__ = [
    "CallbackException",
    "barrier_wait",
    "call",
    "id_print",
    "id_tap",
    "stop_outfeed_receiver",
]


def barrier_wait(logging_name: str | None = None) -> None:
    """Wait until every tap, print and call dispatched so far has run on the
    host; then raise ``CallbackException`` if a tap function raised since the
    previous barrier (once: the next barrier starts clean).

    ``logging_name`` names this barrier in the error message."""
    if _on_executor_thread():
        raise RuntimeError(
            "pmaptap.host_callback.barrier_wait() was called from inside a tap "
            "or call function; it would wait for itself. Call it from the "
            "thread that runs the computation."
        )
    # effects_barrier returns once every callback dispatched so far has run,
    # i.e. every tap has been *queued*; the ticket taken after it covers them.
    jax.effects_barrier()
    ex = _executor()
    ex.wait(ex.ticket())
    errors = ex.take_errors()
    if errors:
        raise _callback_exception(errors, logging_name) from errors[0][0]


def _callback_exception(
    errors: list[tuple[BaseException, str]], logging_name: str | None
) -> CallbackException:
    """The old module's message ("... Last one was: ...") naming the tap
    function that raised last; the first error (``__cause__``/``original``)
    is shown in full when there were several."""
    where = f" (barrier {logging_name!r})" if logging_name else ""
    last, last_name = errors[-1]
    first, first_name = errors[0]
    msg = (
        f"There were exceptions during callback processing{where}. Last one "
        f"was: {last_name}: {type(last).__name__}: {last}"
    )
    if len(errors) > 1:
        msg += (
            f"\nFirst one (of {len(errors)}: it and {len(errors) - 1} more), "
            f"in {first_name}:\n{_format(first)}"
        )
    else:
        msg += "\n" + _format(first)
    return CallbackException(msg, tuple(e for e, _ in errors))


def stop_outfeed_receiver() -> None:
    """Kept for old code: waits for pending taps like ``barrier_wait`` but
    raises nothing (errors stay for the next ``barrier_wait``). There is no
    outfeed receiver to stop any more."""
    jax.effects_barrier()
    ex = _executor()
    ex.wait(ex.ticket())
