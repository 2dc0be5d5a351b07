"""Which pipeline receives a host callback: the open session's, or a
process-wide console pipeline that prints readable lines to stderr."""
from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from .pipeline import Pipeline
    from .spec import TapSpec

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
            from .pipeline import Pipeline
            from .sink import ConsoleSink
            _console = Pipeline(ConsoleSink(), run="console")
        return _console


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
