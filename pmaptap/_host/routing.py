"""Which pipeline receives a host callback: the open session's, or a
process-wide console pipeline that prints readable lines to stderr."""
from __future__ import annotations

import atexit
import sys
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from pmaptap._host.pipeline import Pipeline
    from pmaptap._trace.spec import TapSpec

_lock = threading.Lock()
_active: "Pipeline | None" = None
_console: "Pipeline | None" = None


def set_active(p: "Pipeline | None") -> None:
    global _active
    with _lock:
        _active = p


def active() -> "Pipeline | None":
    return _active


def console() -> "Pipeline":
    global _console
    with _lock:
        if _console is None or _console.closed:
            from pmaptap._host.pipeline import Pipeline
            from pmaptap._host.sink import ConsoleSink
            _console = Pipeline(ConsoleSink(), run="console")
            # Print what is pending and stop its threads before JAX's own
            # exit handlers (registered earlier, so they run later).
            atexit.register(_close_console, _console)
        return _console


def _close_console(p: "Pipeline") -> None:
    try:
        import jax
        jax.effects_barrier()
        p.close(timeout=10.0)
    except BaseException as e:  # noqa: BLE001
        print(f"[pmaptap] console output incomplete at exit: {e}", file=sys.stderr)


def deliver(spec: "TapSpec", arrays: tuple[Any, ...]) -> None:
    """Entry point of every host callback. Never raises into XLA: a failure is
    recorded on the pipeline and re-raised at the next flush()/close()."""
    try:
        if spec.consumer is not None:
            spec.consumer(spec, arrays)
            return
        p = _active
        if p is None or p.closed:
            p = console()
        p.ingest(spec, arrays)
    except BaseException as e:  # noqa: BLE001 - must not propagate into XLA
        try:
            p = _active or _console
            if p is not None:
                p.record_error(e)
            else:
                print(f"[pmaptap] dropped a tap of {spec.name!r}: {e!r}",
                      file=sys.stderr)
        except BaseException:  # noqa: BLE001
            pass
