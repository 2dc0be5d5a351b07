"""Session lifecycle: the active session, flush/close, exit and SIGTERM.

Ordering against JAX's own exit handlers: ``atexit`` runs handlers last-in
first-out, and JAX registers its backend clean-up when it is imported. We
register at ``open()`` (after ``import jax``), so our close runs first, while
the backends still exist for ``jax.effects_barrier()``.
"""

from __future__ import annotations

import atexit
import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from pmaptap import distributed
from pmaptap._host import barrier, routing
from pmaptap._host.barrier import time_left
from pmaptap._host.forward import check_replicated, check_targets
from pmaptap._host.options import DEFAULTS
from pmaptap._host.pipeline import OVERFLOW_POLICIES, Pipeline
from pmaptap._host.session import sigterm
from pmaptap._host.session.runid import (
    _queue_attempt_record,
    _resume_point,
    default_run_id,
    refuse_reopened_run,
    refuse_unresumed_restart,
)
from pmaptap._host.sinks import LOCK_MODES, FileSink, open_sink, write_target
from pmaptap._log import log
from pmaptap.errors import SessionError, TapError, checked_flag, checked_number
from pmaptap.tapfile import source
from pmaptap.tapfile.record import check_text

# SIGTERM: how long the watcher thread waits for the main thread's handler
# before acting itself, and how long dispatched steps may go without a tap
# arriving before the wait for them is given up (docs/faults.md, SIGTERM).
# Not a bound on the whole wait: that lost steps whose taps were arriving.
MAIN_HANDLER_WAIT_S = 0.3
SIGTERM_WAIT_S = 3.0
# How soon a SIGTERM that interrupted pmaptap's host code is raised again.
SIGTERM_RETRY_S = 0.01
# pmaptap's host-side code (the queue, pipeline, routing: all of _host/, of
# which this is session/): a SIGTERM handler that interrupted the main thread
# there must not close (_on_sigterm).
_HOST_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

# Serializes open() against close()'s clearing of the active session. The
# active session itself is held by routing (the callback path reads it there).
_open_lock = threading.Lock()
active_session = routing.active_session


class Session:
    """One tap file for this process; ``with Session(path):`` opens and closes.

    Every option, its default and what it does: docs/api.md, "pmaptap.Session"
    (the table); ``resume``: "Resuming a run after a restart" there.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        run: str | None = None,
        overflow: str = DEFAULTS.overflow,
        max_pending: int = DEFAULTS.max_pending,
        max_pending_bytes: int = DEFAULTS.max_pending_bytes,
        lock_timeout: float = DEFAULTS.lock_timeout,
        flush_timeout: float | None = DEFAULTS.flush_timeout,
        close_timeout: float = DEFAULTS.close_timeout,
        group_timeout: float = DEFAULTS.group_timeout,
        flush_interval: float = DEFAULTS.flush_interval,
        lock: str = DEFAULTS.lock,
        forward: Sequence[Any] | None = None,
        forward_timeout: float | None = DEFAULTS.forward_timeout,
        forward_replicated: str = DEFAULTS.forward_replicated,
        resume: bool = DEFAULTS.resume,
        layout: str = DEFAULTS.layout,
    ) -> None:
        if overflow not in OVERFLOW_POLICIES:
            raise ValueError(
                f"Session: overflow must be one of {OVERFLOW_POLICIES}, got {overflow!r}"
            )
        if run is not None and (not isinstance(run, str) or not run):
            raise ValueError(f"Session: run must be a non-empty str, got {run!r}")
        check_text(run, f"Session(run={run!r})", "run")
        if lock not in LOCK_MODES:
            raise ValueError(
                f"Session: lock must be one of {LOCK_MODES} "
                f'("soft" for NFS/Lustre/GPFS), got {lock!r}'
            )
        # Not bool(resume): resume="no" resumed, and readers then hid the
        # previous attempt's replayed steps as superseded.
        resume = checked_flag("Session", "resume", resume)
        self.lock = lock
        n = functools.partial(checked_number, "Session")
        max_pending = n("max_pending", max_pending, integer=True, least=1)
        max_pending_bytes = n("max_pending_bytes", max_pending_bytes, integer=True, least=1)
        lock_timeout = n("lock_timeout", lock_timeout)
        flush_timeout = n("flush_timeout", flush_timeout, none=True)
        close_timeout = n("close_timeout", close_timeout)
        group_timeout = n("group_timeout", group_timeout)
        flush_interval = n("flush_interval", flush_interval)
        forward_timeout = n("forward_timeout", forward_timeout, none=True)
        # The path resolved once (an object-store URL kept as given, and
        # always in the sharded layout): shared with Writer (sinks/).
        self._target = target = write_target("Session", path, layout, flush_interval)
        self.path = str(target.run)
        self.layout, flush_interval = target.layout, target.flush_interval
        self.run = run
        self.resume = resume
        self.attempt = 0
        self._opts: dict[str, Any] = dict(
            overflow=overflow,
            max_pending=max_pending,
            max_pending_bytes=max_pending_bytes,
            group_timeout=group_timeout,
            flush_interval=flush_interval,
            forward=check_targets(forward),
            forward_timeout=forward_timeout,
            forward_replicated=check_replicated(forward_replicated),
        )
        self.lock_timeout = lock_timeout
        self.flush_timeout = flush_timeout
        self.close_timeout = close_timeout
        self.pipeline: Pipeline | None = None
        self._prev_sigterm: Any = None
        self._sigterm_installed = False
        self._phase = ""  # "", "drain" or "barrier" (close)
        self._closer: int | None = None  # the thread in close(), by ident
        self._close_lock = threading.Lock()
        self._closed = False
        self._sigterm_pending = False
        self._main_saw_sigterm = threading.Event()
        self._watcher_acted = False

    def __repr__(self) -> str:
        state = "open" if self.pipeline is not None and not self.pipeline.closed else "closed"
        return f"Session(path={self.path!r}, run={self.run!r}, {state})"

    def open(self) -> "Session":
        with _open_lock:
            current = routing.active_session()
            if current is not None:
                raise SessionError(
                    f"another pmaptap session is already open in this process: "
                    f"{current!r}. Close it (session.close() or leave "
                    "its `with` block) before opening a new one."
                )
            if self.pipeline is not None:
                raise SessionError(
                    f"{self!r} was already used; create a new Session to open again."
                )
            if not self.resume:
                refuse_unresumed_restart(self.run)
            # Before the first tapped step is traced: see _common/switch.py.
            import pmaptap._common.switch  # noqa: F401

            distributed.warn_if_launched_alone()
            import jax

            if self.layout == "auto":
                self.layout = source.file_layout("auto", jax.process_count())
            if not self.resume:
                refuse_reopened_run(self._target.run, self.run, jax.process_count())
            sink = open_sink(
                self._target.run,
                self.layout,
                lock_timeout=self.lock_timeout,
                lock=self.lock,
            )
            try:
                if self.resume:
                    self.run, self.attempt = _resume_point(self._target.run, self.run)
                elif self.run is None:
                    self.run = default_run_id()
                if isinstance(sink, FileSink):
                    start = distributed.session_start(self.run, self.attempt, sink.opened_size)
                    if start is not None:
                        sink.index_from(start)
                self.pipeline = Pipeline(
                    sink, run=self.run, attempt=self.attempt, resume=self.resume, **self._opts
                )
                if self.resume:
                    _queue_attempt_record(self.pipeline, self.attempt)
            except BaseException:
                sink.close()
                raise
            routing.set_active(self)
        atexit.register(self._close_at_exit)
        self._install_sigterm()
        return self

    def __enter__(self) -> "Session":
        if routing.active_session() is self:
            return self  # `s.open()` earlier, then `with s:` is fine
        return self.open()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        # An exception is leaving the block: still write everything, but do
        # not hide the user's exception behind a TapError.
        ok = exc_type is SystemExit and getattr(exc, "code", None) in (None, 0)
        try:
            self._close("finished" if ok else "failed")
        except TapError as e:
            log.warning(f"pmaptap: {e}")

    def flush(self, timeout: float | None = -1) -> None:
        """Return once every tap dispatched before this call is written by this
        process. Raises TapError for background failures since the last call."""
        p = self._require_open("flush")
        _flush(p, self.flush_timeout if timeout == -1 else timeout)

    def _require_open(self, what: str) -> Pipeline:
        if self.pipeline is None or self.pipeline.closed:
            raise SessionError(
                f"{what}() on {self!r}: open it first (session.open() or `with Session(path):`)."
            )
        return self.pipeline

    def close(self) -> None:
        """Write everything dispatched, wait for the other processes (multi-
        process jobs), and end the session. Safe to call twice."""
        self._close("finished")

    def _close(self, outcome: str) -> None:
        """close(), telling the forwarders how the session ends (their
        ``end(outcome)``): "finished", "failed" (an exception), "killed"
        (SIGTERM: dispatched steps get a bounded wait and the close barrier
        is skipped, a peer may be dead and the grace before SIGKILL short).
        One thread closes; another caller waits for it, then returns."""
        killed = outcome == "killed"
        try:
            with self._close_lock:
                self._close_locked(outcome, killed)
        finally:
            # A SIGTERM that came during the drain, on this thread: acted on
            # now, even when close() raises.
            if self._sigterm_pending and self._closed:
                self._sigterm_pending = False
                self._deliver_sigterm(self._prev_sigterm, signal.SIGTERM, None)

    def _close_locked(self, outcome: str, killed: bool) -> None:
        p = self.pipeline
        if p is None or self._closed:
            return
        self._closer = threading.get_ident()
        try:
            if not p.closed:  # the SIGTERM watcher may have drained it
                self._phase = "drain"
                # One close_timeout for both waits: the steps' taps reaching
                # the pipeline and the pipeline writing them (concurrent).
                deadline = time.monotonic() + self.close_timeout
                try:
                    barrier.before_close(SIGTERM_WAIT_S if killed else None, p, self.close_timeout)
                finally:
                    p.close(timeout=time_left(deadline), outcome=outcome)
        finally:
            try:
                self._phase = "barrier"
                self._after_close(wait=not killed)
            finally:
                self._phase = ""
                self._closed = True
                self._closer = None
                with _open_lock:
                    if routing.active_session() is self:
                        routing.set_active(None)
                try:
                    atexit.unregister(self._close_at_exit)
                except Exception:  # noqa: BLE001
                    pass
                self._restore_sigterm()

    def _abandon_after_fork(self) -> None:
        """In a forked child (routing's at-fork hook): this session belongs
        to the parent. Forget it here without writing or waiting, so the
        child's exit is immediate and the parent's records are written once,
        by the parent."""
        if self.pipeline is not None:
            self.pipeline.abandon()
        self._closed = True
        self._close_lock = threading.Lock()  # a parent thread may have held it
        try:
            atexit.unregister(self._close_at_exit)
        except Exception:  # noqa: BLE001
            pass
        try:
            self._restore_sigterm()
        except Exception:  # noqa: BLE001
            pass

    def _after_close(self, wait: bool = True) -> None:
        """Multi-process: wait (bounded) until every process has closed, so the
        file holds every record once close() returns anywhere; what the sharded
        layout writes for owners that did not close, and ``wait=False`` on
        SIGTERM: ``distributed.close_barrier``."""
        held = getattr(self.pipeline.sink, "held", None) if self.pipeline else None
        distributed.close_barrier(
            self.run or "",
            timeout=self.close_timeout,
            on_unclosed=self._write_held if held else None,
            eager=not wait,
            wait=wait,
        )

    def _write_held(self, owners: list[int] | None) -> None:
        """Write the replicated values this process left to ``owners`` (None:
        to anyone) in the sharded layout: they did not close, so they may
        never have written them (_host/sinks/directory.py: Held). Readers keep one
        copy of each value."""
        sink = self.pipeline.sink if self.pipeline else None
        held = getattr(sink, "held", None)
        if held is None or not held or owners == []:
            return
        released = {o: n for o, n in held.released.items() if owners is None or o in owners}
        who = "other processes" if owners is None else f"process(es) {', '.join(map(str, owners))}"
        try:
            n = sink.write_held(owners)
        except Exception as e:  # noqa: BLE001 - close must not raise for it
            log.error(
                f"pmaptap: could not write the replicated values left to {who}, "
                f"which did not close ({type(e).__name__}: {e}); those they had "
                "not written are missing."
            )
            return
        if n:
            log.warning(
                f"pmaptap: wrote {n} replicated value(s) that {who} own "
                "(they did not close, so they may not have written them); "
                "readers keep one copy of each."
            )
        if released:
            log.warning(
                f"pmaptap: {sum(released.values())} older replicated value(s) "
                f"left to {who} were no longer kept (past "
                f"{held.limit >> 20} MiB); any of them those processes had "
                "not written are missing."
            )

    def _close_at_exit(self) -> None:
        # An unhandled exception ends the script: the interpreter keeps it
        # in sys.last_value before the exit handlers run.
        failed = getattr(sys, "last_value", None) is not None
        try:
            self._close("failed" if failed else "finished")
        except BaseException as e:  # noqa: BLE001
            log.error(f"[pmaptap] error while closing {self!r} at exit: {e}")

    # ------------------------------------------------------------- SIGTERM
    def _install_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        try:
            self._prev_sigterm = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, self._on_sigterm)
            self._sigterm_installed = True
        except (ValueError, OSError):
            return
        # A main thread blocked in C++ never runs the handler: the watcher
        # thread acts for it (sigterm.py).
        sigterm.install()

    def _restore_sigterm(self) -> None:
        if not self._sigterm_installed:
            return
        if threading.current_thread() is not threading.main_thread():
            # signal.signal works on the main thread only: the watcher
            # closed the session; the handler stays until the main thread
            # runs it (then it hands the signal on, see _on_sigterm).
            return
        self._sigterm_installed = False
        try:
            if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                signal.signal(
                    signal.SIGTERM,
                    self._prev_sigterm if self._prev_sigterm is not None else signal.SIG_DFL,
                )
        except (ValueError, OSError):
            pass

    def _on_sigterm(self, signum, frame) -> None:
        """The handler, on the main thread."""
        prev = self._prev_sigterm
        closing_here = self._closer == threading.get_ident()
        if not closing_here and _in_host_code(frame):
            # It interrupted pmaptap's own host code on this thread, which
            # may hold a lock the close takes (closing here hung for ever;
            # docs/faults.md): a timer raises SIGTERM again in a few ms.
            # (Starting one here is safe: pmaptap starts its threads at open,
            # before this handler is installed, and in close, not left here.)
            if _raise_again_later():
                return
        self._main_saw_sigterm.set()  # the watcher stands back
        if closing_here:
            if self._phase == "drain":
                # close() is writing the records on this very thread (the
                # handler interrupted it): let it finish, then act on the
                # signal; a drain whose writes fail (a full disk, a lock
                # another process holds) stops at its next failure instead
                # of retrying for close_timeout.
                self._sigterm_pending = True
                if self.pipeline is not None:
                    self.pipeline.hurried.set()
                return
            # Waiting for peers ("barrier"): stop waiting, our records are
            # already written; so are, now, the values we left to peers that
            # have not closed.
            if self._phase == "barrier":
                try:
                    self._write_held(distributed.unclosed_now(self.run or ""))
                except BaseException as e:  # noqa: BLE001
                    log.error(f"[pmaptap] error while closing on SIGTERM: {e}")
        else:
            try:
                # Not closing yet: close now (after the watcher's drain, if
                # it ran while this thread was blocked).
                self._close("killed")
            except BaseException as e:  # noqa: BLE001
                log.error(f"[pmaptap] error while closing on SIGTERM: {e}")
            self._restore_sigterm()
        self._deliver_sigterm(prev, signum, frame)

    def _sigterm_from_watcher(self) -> None:
        """SIGTERM seen by the watcher thread (sigterm.py): acts only if the
        main thread does not run _on_sigterm within MAIN_HANDLER_WAIT_S
        (docs/faults.md, "SIGTERM while the main thread is blocked in C++")."""
        if self._main_saw_sigterm.wait(MAIN_HANDLER_WAIT_S) or self._watcher_acted:
            return
        self._watcher_acted = True
        p = self.pipeline
        if p is not None and not p.closed:
            log.warning(
                "pmaptap: SIGTERM while the main thread is blocked outside Python "
                "(a collective whose peer died?); writing what is queued from "
                "another thread"
            )
            try:
                deadline = time.monotonic() + self.close_timeout
                barrier.before_close(SIGTERM_WAIT_S, p, self.close_timeout)
                p.close(timeout=time_left(deadline), outcome="killed")
                if getattr(p.sink, "held", None):
                    self._after_close(wait=False)  # values left to dead owners
            except BaseException as e:  # noqa: BLE001 - we are dying: say it
                log.error(f"[pmaptap] error while closing on SIGTERM: {e}")
        if self._main_saw_sigterm.is_set():
            return  # the main thread came back meanwhile: its handler goes on
        prev = self._prev_sigterm
        if prev in (None, signal.SIG_DFL):
            sigterm.die_by_sigterm()
        # SIG_IGN: nothing. A Python handler: it runs on the main thread
        # when it returns to Python (the signal is still pending there).

    def _deliver_sigterm(self, prev, signum, frame) -> None:
        # Then behave as the process would have without us.
        if callable(prev) and prev not in (signal.SIG_DFL, signal.SIG_IGN):
            prev(signum, frame)
        elif prev == signal.SIG_IGN:
            return
        else:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)


def _raise_again_later() -> bool:
    """SIGTERM raised again in SIGTERM_RETRY_S by a timer thread; False if
    it cannot be started (then the handler acts at once)."""
    try:
        t = threading.Timer(SIGTERM_RETRY_S, os.kill, (os.getpid(), signal.SIGTERM))
        t.daemon = True
        t.start()
    except Exception:  # noqa: BLE001
        return False
    return True


def _in_host_code(frame: Any) -> bool:
    """Whether ``frame`` (where a signal handler interrupted its thread) or
    a caller of it is pmaptap's host-side code."""
    while frame is not None:
        if frame.f_code.co_filename.startswith(_HOST_DIR):
            return True
        frame = frame.f_back
    return False


def _flush(p: Pipeline, timeout: float | None) -> None:
    """Every tap dispatched so far written by ``p`` within one ``timeout``
    (None: no bound): the steps of ``pmaptap.jit`` / ``pmaptap.pmap``
    delivered, then the pipeline flushed; its errors are raised first (the
    cause), then a TapError if some steps were not delivered in time."""
    deadline = None if timeout is None else time.monotonic() + timeout
    delivered = barrier.effects_barrier(timeout)
    p.flush(time_left(deadline))
    if not delivered:
        raise TapError(
            f"pmaptap flush timed out after {timeout:g}s with "
            f"{barrier.undelivered()} dispatched step(s) of pmaptap.jit / "
            "pmaptap.pmap taps not yet handed to the pipeline (its queue is "
            "full and takes nothing: overflow='block' with writes that fail?). "
            "They stay queued and are delivered once there is room.",
            path=getattr(p.sink, "path", None),
        )


def _after_fork_in_child() -> None:
    global _open_lock
    _open_lock = threading.Lock()  # a parent thread may have held it


os.register_at_fork(after_in_child=_after_fork_in_child)


def flush(timeout: float | None = -1) -> None:
    """Flush the active session, or the stderr console pipeline if none."""
    s = routing.active_session()
    if s is not None:
        s.flush(timeout)
        return
    _flush(routing.console(), None if timeout == -1 else timeout)
