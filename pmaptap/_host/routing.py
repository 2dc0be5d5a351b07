"""Which pipeline receives a host callback: the active session's, or a
process-wide console pipeline that prints readable lines to stderr.

The active session is held here and nowhere else (``session.py`` reads and
sets it through this module), so the callback path and the session
lifecycle cannot disagree about it. A payload a closing pipeline refuses
goes to the console: never nowhere (docs/architecture.md, "A close never
strands a tap").
"""

from __future__ import annotations

import atexit
import gc
import os
import threading
from typing import TYPE_CHECKING, Any, Protocol

from pmaptap._host.barrier import effects_barrier
from pmaptap._log import log

if TYPE_CHECKING:  # pragma: no cover
    from pmaptap._common.spec import TapSpec
    from pmaptap._host.pipeline import Pipeline


class Session(Protocol):
    """What routing uses of the active ``session.Session`` (typed here, not
    imported: session.py imports this module)."""

    pipeline: "Pipeline"

    def _abandon_after_fork(self) -> None: ...

    def _close_at_exit(self) -> None: ...


# Guards the creation of the console pipeline only; the callback path reads
# ``_active`` without it (one reference read is atomic in Python).
_console_lock = threading.Lock()
_active: "Session | None" = None
_console: "Pipeline | None" = None
# At exit, how long the stderr printer waits for taps still on their way to
# it and for its own writer.
CONSOLE_EXIT_S = 10.0


def active_session() -> "Session | None":
    return _active


def set_active(s: "Session | None") -> None:
    """Called by Session.open()/close() under the session module's open lock."""
    global _active
    _active = s


def console() -> "Pipeline":
    """The console pipeline, started on first use and again after it closed
    (or began closing: at exit a late tap gets a fresh one rather than a
    pipeline that no longer admits)."""
    global _console
    with _console_lock:
        if _console is None or not _console.admitting:
            from pmaptap._host.pipeline import Pipeline
            from pmaptap._host.sinks import ConsoleSink

            _console = Pipeline(ConsoleSink(), run="console")
            # Print what is pending and stop its threads before JAX's own
            # exit handlers (registered earlier, so they run later).
            atexit.register(_close_console, _console)
        return _console


def _close_console(p: "Pipeline") -> None:
    if p.closed:
        return  # closed already, or inherited across fork (abandoned)
    try:
        effects_barrier(CONSOLE_EXIT_S)
        p.close(timeout=CONSOLE_EXIT_S)
    except BaseException as e:  # noqa: BLE001
        log.error(f"[pmaptap] console output incomplete at exit: {e}")


def deliver(spec: "TapSpec", arrays: tuple[Any, ...], *, block: bool = False) -> None:
    """Entry point of every host callback, and of the output transport's
    drain (``block``: wait for room in the queue rather than drop). Never
    raises into XLA: a failure is recorded on the pipeline and re-raised at
    the next flush()/close()."""
    try:
        s = _active
        if s is not None and s.pipeline.ingest(spec, arrays, block=block):
            return
        # No session, or its close() already shut admission.
        if console().ingest(spec, arrays, block=block):
            return
        # The console itself closed between the two lines above (interpreter
        # exit); one more fresh console, and a word on stderr if even that
        # does not take it.
        if not console().ingest(spec, arrays, block=block):
            log.warning(
                f"[pmaptap] a tap of {spec.name!r} arrived while "
                "pmaptap was shutting down and was not written"
            )
    except BaseException as e:  # noqa: BLE001 - must not propagate into XLA
        report(e, spec.name)


def report(e: BaseException, name: str) -> None:
    """A failure on a pmaptap thread, for the next flush()/close() of the
    active session (or the console's): never raised where it happened."""
    try:
        s = _active
        p = s.pipeline if s is not None else _console
        if p is not None:
            p.errors.add(e)
        else:
            log.error(f"[pmaptap] dropped a tap of {name!r}: {e!r}")
    except BaseException:  # noqa: BLE001
        pass


def close_session_at_exit() -> None:
    """Interpreter exit: the session still open is closed (its close waits
    for the taps still on their way, within its close_timeout)."""
    s = _active
    if s is not None:
        s._close_at_exit()  # logs its own failure; never raises


def close_console_at_exit() -> None:
    """Interpreter exit: the stderr printer prints what it holds and stops."""
    if _console is not None:
        _close_console(_console)


def _after_fork_in_child() -> None:
    """A forked child forgets its parent's pipelines without writing or
    waiting (docs/architecture.md, "A forked child owns nothing of its
    parent's"); it starts with no session and may open its own."""
    global _active, _console, _console_lock
    # The parent's objects are the parent's: a garbage collection in the
    # child that finalizes inherited JAX objects (their runtime threads did not
    # survive the fork) crashed the child at exit (SIGSEGV while
    # "Garbage-collecting", tests/host/test_fork.py). Freezing moves everything
    # inherited out of the collector's reach; the child's own objects are
    # collected as usual.
    gc.freeze()
    _console_lock = threading.Lock()  # may have been held by a parent thread
    s, _active = _active, None
    console_p, _console = _console, None
    if console_p is not None:
        console_p.abandon()
    if s is not None:
        s._abandon_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)
