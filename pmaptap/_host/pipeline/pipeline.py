"""The host-side pipeline of one session: it wires the bounded queue
(queue.py) to its two threads (loops.py) and answers flush() and close()
(docs/architecture.md, "From pmaptap.tap to the file", step 6). The callback
thread only queues: it blocks its device and holds the GIL. Failures of
either thread are kept in an ``ErrorLog`` and raised as ``TapError`` at the
next ``flush()``/``close()``.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pmaptap import distributed
from pmaptap._host.forward import Forwarders, select
from pmaptap._host.options import DEFAULTS
from pmaptap._host.pipeline.aggregate import Aggregator
from pmaptap._host.pipeline.loops import AggregateLoop, WriteLoop
from pmaptap._host.pipeline.queue import BoundedQueue, Marker, Stop
from pmaptap._host.pipeline.records import RecordBuilder
from pmaptap._host.sinks import Sink
from pmaptap._log import log
from pmaptap.errors import TapError

if TYPE_CHECKING:  # pragma: no cover
    from pmaptap._common.spec import TapSpec
    from pmaptap.tapfile.record import Record


class ErrorLog:
    """Failures from any thread (callback, aggregator, writer) until the next
    flush()/close() reports them. Its own small lock: appends come from
    threads that must not wait on the queue."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._errors: list[BaseException] = []

    def add(self, e: BaseException) -> None:
        with self._lock:
            self._errors.append(e)

    def __bool__(self) -> bool:
        return bool(self._errors)

    def take(self) -> list[BaseException]:
        with self._lock:
            errors, self._errors = self._errors, []
            return errors


class Pipeline:
    def __init__(
        self,
        sink: Sink,
        *,
        run: str,
        process: int | None = None,
        host: str | None = None,
        overflow: str = DEFAULTS.overflow,
        max_pending: int = DEFAULTS.max_pending,
        max_pending_bytes: int = DEFAULTS.max_pending_bytes,
        flush_interval: float = DEFAULTS.flush_interval,
        group_timeout: float = DEFAULTS.group_timeout,
        retry_interval: float = DEFAULTS.retry_interval,
        max_batch: int = DEFAULTS.max_batch,
        forward: Sequence[Any] = (),
        forward_timeout: float | None = DEFAULTS.forward_timeout,
        forward_replicated: str = DEFAULTS.forward_replicated,
        attempt: int = 0,
        resume: bool = DEFAULTS.resume,
    ) -> None:
        self.queue = BoundedQueue(
            overflow=overflow, max_pending=max_pending, max_pending_bytes=max_pending_bytes
        )
        self.sink = sink
        self.run = run
        self.process = process = distributed.process_index(process)
        self.host = host or socket.gethostname()
        self.overflow = overflow
        self.retry_interval = retry_interval
        self.errors = ErrorLog()
        self.closed = False
        self._close_lock = threading.Lock()
        self.forward_timeout = forward_timeout
        self.forwarders = (
            Forwarders(forward, name=f"pmaptap-forward-{run}", run=run, attempt=attempt)
            if forward
            else None
        )
        self.forward_replicated = forward_replicated
        self.abandoned = False
        # Set by SIGTERM (a killed close, or one in progress when it came):
        # the close's drain stops at its next failed write instead of
        # retrying until close_timeout; a drain that writes goes on.
        self.hurried = threading.Event()
        # Names counting their steps automatically that step outputs
        # delivered, those host callbacks delivered, and those said (see
        # ingest).
        self._auto_outputs: set[tuple] = set()
        self._auto_callbacks: set[tuple] = set()
        self._auto_said: dict[tuple, object] = {}
        # The one maker of this pipeline's records, with its identity.
        self.records = RecordBuilder(run, process, self.host, attempt=attempt)
        self._aggregator = AggregateLoop(
            self.queue,
            Aggregator(self.records, group_timeout=group_timeout, refuse_automatic_steps=resume),
            self.errors.add,
            name=f"pmaptap-aggregate-{run}",
        )
        self._writer = WriteLoop(
            self.queue,
            sink,
            self.errors.add,
            name=f"pmaptap-write-{run}",
            flush_interval=flush_interval,
            retry_interval=retry_interval,
            max_batch=max_batch,
            on_written=self._offer if self.forwarders else None,
        )

    def _offer(self, decided: list[tuple["Record", bool]]) -> None:
        # On the writer thread, after a successful write: only queues.
        fw = self.forwarders
        if fw is not None:
            records = select(decided, self.process, self.forward_replicated)
            if records:
                fw.offer(records)

    def abandon(self) -> None:
        """In a forked child: this pipeline's threads stayed in the parent,
        which writes its records. Mark it closed without draining, writing,
        joining or closing the sink (the parent's file lock may be held on
        the inherited descriptor)."""
        self.closed = True
        self.abandoned = True
        self._close_lock = threading.Lock()  # a parent's thread may have held it

    def ingest(self, spec: "TapSpec", arrays: tuple[Any, ...], *, block: bool = False) -> bool:
        """Called on XLA's callback thread: queue one payload. False once
        close() has shut admission (routing then uses the console).
        ``block``: wait for room rather than apply the overflow policy
        (the output transport's drain: its payloads come with it)."""
        site = getattr(spec, "site", None)
        if site is not None and not site.explicit_step:
            key = (site.name, site.pass_)
            if block:
                self._auto_outputs.add(key)
                self._say_mixed(key)  # on the drain's thread, not XLA's
            else:
                # XLA's callback thread only notes the name (no logging
                # here), whichever transport came first: the drain may
                # deliver a step's outputs after the callbacks of later
                # steps (JAX 0.12 runs them at dispatch).
                self._auto_callbacks.add(key)
        return self.queue.admit(spec, arrays, block=block)

    def _say_mixed(self, *keys: tuple) -> None:
        """Say once per name when a name with automatic steps comes by both
        transports: its counter numbers records as they arrive, and step
        outputs arrive after their step, callbacks during it, so the two
        transports' records are not numbered in program order. Checked at
        each output delivery (``keys``: its name) and at each flush/close
        (every name: callbacks noted after the last delivery)."""
        # The drain's thread and flush/close's may both check a name: the
        # one whose token setdefault keeps says it (no lock: a SIGTERM
        # handler's close may interrupt a flush of its own thread here).
        token = object()
        for key in keys or list(self._auto_outputs):
            if key in self._auto_callbacks and self._auto_said.setdefault(key, token) is token:
                log.warning(
                    f"pmaptap: tap {key[0]!r} counts its steps automatically (step=None) "
                    "and is recorded both by host callbacks and as step outputs "
                    "(pmaptap.jit / pmaptap.pmap) in this session: steps are counted in "
                    "the order records reach the host, which differs between the two, "
                    "so these steps are not in program order. Pass step= to the tap. "
                    "(Said once per tap.)"
                )

    @property
    def admitting(self) -> bool:
        return self.queue.admitting

    @property
    def dropped(self) -> int:
        return self.queue.dropped

    @property
    def written(self) -> int:
        return self._writer.written

    def pending(self) -> int:
        return self.queue.pending

    # ---------------------------------------------------- flush / close
    def _drain(self, timeout: float | None, *, give_up_on_error: bool) -> None:
        """Send markers until one comes back written, retrying while the lock
        is busy or writes fail, until ``timeout``. flush() stops at the first
        error (to report it); close() keeps trying (space may come back)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            m = Marker()
            self.queue.send(m)
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not m.event.wait(left) or not m.failed:
                return
            if (
                (give_up_on_error and self.errors)
                or self.hurried.is_set()
                or (deadline is not None and time.monotonic() >= deadline)
            ):
                return
            time.sleep(self.retry_interval)

    def flush(self, timeout: float | None = None) -> None:
        """Write everything ingested so far; raise TapError on failures."""
        if self.closed:
            raise TapError("flush() on a closed pmaptap pipeline")
        self._drain(timeout, give_up_on_error=True)
        self._say_mixed()
        self.raise_errors(pending_ok=False)
        if self.forwarders is not None:
            # Written is what flush() promises; forwarding gets a bounded
            # wait (a slow forwarder keeps going in the background).
            self.forwarders.drain(_shorter(timeout, self.forward_timeout))
            self._raise_forward_problems()

    def _raise_forward_problems(self) -> None:
        msg = self.forwarders.problems() if self.forwarders else None
        if msg:
            raise TapError(msg, path=getattr(self.sink, "path", None))

    def raise_errors(self, pending_ok: bool = True) -> None:
        errors = self.errors.take()
        pending = self.queue.pending
        path = getattr(self.sink, "path", None)
        if errors:
            seen: dict[str, int] = {}
            for e in errors:
                text = f"{type(e).__name__}: {e}"
                seen[text] = seen.get(text, 0) + 1
            reasons = "; ".join(
                t + (f" (x{n})" if n > 1 else "") for t, n in list(seen.items())[:5]
            )
            msg = (
                f"pmaptap could not write {pending} pending record(s)"
                f"{' to ' + repr(path) if path else ''}: {reasons}"
            )
            if not pending:  # nothing left unwritten: the errors say it all
                msg = f"pmaptap{' (' + repr(path) + ')' if path else ''}: {reasons}"
            log.warning(msg)
            raise TapError(msg, path=path, errors=tuple(errors)) from errors[0]
        if pending and not pending_ok:
            busy = self._writer.last_busy
            raise TapError(
                f"pmaptap flush timed out with {pending} record(s) "
                f"still queued for {path!r} (is another process "
                "holding the lock?). They stay queued and are "
                "retried." + (f" Last lock attempt: {busy}" if busy else ""),
                path=path,
            )

    def close(self, timeout: float | None = None, outcome: str = "finished") -> None:
        """Drain, stop both threads, close the sink, end the forwarders
        (``outcome``: see Forwarders.close). Raises TapError if records could
        not be written (they are counted in the message). Two threads may
        call it (the SIGTERM watcher, the main thread): one closes, the
        other waits for it and returns."""
        if outcome == "killed":
            self.hurried.set()
        with self._close_lock:
            if self.closed:
                return
            self._close(timeout, outcome)

    def _close(self, timeout: float | None, outcome: str) -> None:
        try:
            self._drain(timeout, give_up_on_error=False)
            self._say_mixed()
        finally:
            # Shut admission and queue the stop marker in one step: every
            # payload admitted is ahead of the marker, so it is written
            # before close() returns; ingest() refuses the rest (routing
            # sends them to the console) instead of losing them.
            stop = Stop()
            self.queue.shut(stop)
            stop.event.wait(5.0)
            # Join so no pmaptap thread (holding array references) is still
            # unwinding when the interpreter finalizes: that aborted the
            # process ("FATAL: exception not rethrown") in testing.
            for t in (self._aggregator.thread, self._writer.thread):
                if t is not threading.current_thread():
                    t.join(5.0)
            self.closed = True
            lost = self.queue.pending
            try:
                self.sink.close()
            finally:
                if self.forwarders is not None:
                    self.forwarders.close(self.forward_timeout, outcome)
                if lost:
                    self.errors.add(TapError(f"{lost} record(s) were not written before close"))
                self.raise_errors()
                self._raise_forward_problems()


def _shorter(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a if b is None else min(a, b)
