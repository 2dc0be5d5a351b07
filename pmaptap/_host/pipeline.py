"""The host-side pipeline of one session: callback hand-off, the aggregator
thread and the writer thread, with a bounded amount of pending data.

    XLA callback thread --ingest()--> [ingress] --aggregator--> [outbox] --writer--> Sink

The callback thread only appends to ``ingress`` (it must return at once: it
blocks its device and holds the GIL). The aggregator converts arrays to
NumPy, assigns steps, groups and dedups. The writer batches records into the
sink. Errors in either thread are collected and raised as ``TapError`` at the
next ``flush()``/``close()``.

Bound and overflow policy: events in ``ingress`` plus records in ``outbox``
are limited to ``max_pending`` items and ``max_pending_bytes`` bytes. Past
that, ``overflow`` decides: "block" (the callback waits for room: nothing is
lost, the devices slow down), "drop_oldest" (default: the oldest queued item
is discarded; items already in a thread's hands, at most one aggregation
chunk and one write batch, cannot be, and when only those remain the
arriving one is) or "drop_newest" (the arriving one is). No event is
admitted past the bound (one event can still become several records, e.g.
one per device). Drops are counted, written to the file as a
``pmaptap/dropped`` meta record at the next flush/close (never dropped
itself) and warned about.
"""
from __future__ import annotations

import collections
import socket
import threading
import time
import warnings
from typing import Any

import numpy as np

from pmaptap._host.aggregate import Aggregator
from pmaptap.errors import TapError
from pmaptap.tapfile.format import Record
from pmaptap._host.sink import Sink
from pmaptap.errors import LockBusy
from pmaptap._trace.spec import TapSpec

OVERFLOW_POLICIES = ("block", "drop_oldest", "drop_newest")
_LINGER_MAX = 64     # queued callbacks that end the aggregator's linger


class _Marker:
    """Travels through both queues; set when everything before it is written."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.failed = False


class _Stop(_Marker):
    pass


def _nbytes(arrays: tuple[Any, ...]) -> int:
    try:                       # NumPy arrays from host_call: the common case
        return 64 + sum(a.nbytes for a in arrays)
    except AttributeError:
        return 64 + sum(int(getattr(a, "nbytes", 0) or 0) for a in arrays)


def _record_bytes(r: Record) -> int:
    return 256 + (len(str(r.value)) if r.kind == "meta" else 0)


class Pipeline:
    def __init__(self, sink: Sink, *, run: str, process: int | None = None,
                 host: str | None = None, overflow: str = "drop_oldest",
                 max_pending: int = 1_000_000,
                 max_pending_bytes: int = 1 << 30,
                 flush_interval: float = 0.02, group_timeout: float = 5.0,
                 retry_interval: float = 0.2, max_batch: int = 20_000) -> None:
        if overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"overflow must be one of {OVERFLOW_POLICIES}, got "
                             f"{overflow!r}")
        if process is None:
            import jax
            process = jax.process_index()
        self.sink = sink
        self.run = run
        self.process = process
        self.host = host or socket.gethostname()
        self.overflow = overflow
        self.max_pending = max_pending
        self.max_pending_bytes = max_pending_bytes
        self.flush_interval = flush_interval
        self.retry_interval = retry_interval
        self.max_batch = max_batch
        self.agg = Aggregator(run, process, self.host, group_timeout=group_timeout)

        # One lock, three conditions, so each wake-up reaches the thread
        # that has work (a shared notify_all cost ~20% of throughput).
        self._lock = threading.Lock()
        self._agg_cv = threading.Condition(self._lock)
        self._write_cv = threading.Condition(self._lock)
        self._space_cv = threading.Condition(self._lock)
        self._agg_waiting = False
        self._agg_lingering = False
        # One wake-up per 20 ms of callbacks (or per _LINGER_MAX): measured
        # 20-25 us less aggregator CPU per step than 5 ms at a 1 ms step.
        self.agg_linger = 0.02
        self._write_waiting = False
        self._write_lingering = False
        self._outbox_markers = 0
        self._ingress: collections.deque = collections.deque()
        self._outbox: collections.deque = collections.deque()
        self._pending_items = 0
        self._pending_bytes = 0
        self._errors: list[BaseException] = []
        self._last_busy = ""          # why the last lock attempt failed
        self.dropped = 0
        self._dropped_reported = 0
        self.written = 0
        self.closed = False
        self._stopping = False
        self._agg_thread = threading.Thread(target=self._agg_loop, daemon=True,
                                            name=f"pmaptap-aggregate-{run}")
        self._write_thread = threading.Thread(target=self._write_loop, daemon=True,
                                              name=f"pmaptap-write-{run}")
        self._agg_thread.start()
        self._write_thread.start()

    # ---------------------------------------------------- callback thread
    def ingest(self, spec: TapSpec, arrays: tuple[Any, ...]) -> bool:
        """Queue one callback payload. False when close() has shut admission
        (the caller sends it elsewhere); True when queued, or dropped and
        counted under the overflow policy."""
        size = _nbytes(arrays)
        with self._lock:
            if self._stopping:
                return False
            while self._over(1, size):
                if self.overflow == "drop_newest" or not self._agg_thread.is_alive():
                    self.dropped += 1
                    return True
                if self.overflow == "drop_oldest":
                    if not self._drop_oldest_locked():
                        # Everything pending is in the threads' hands (being
                        # aggregated or written): drop the arriving item
                        # rather than exceed the bound.
                        self.dropped += 1
                        return True
                    continue
                if self._agg_lingering:
                    self._agg_cv.notify()   # room comes from aggregating now
                self._space_cv.wait(0.1)    # "block"
                if self._stopping:
                    return False            # close() began: not ours to write
            self._ingress.append((spec, arrays, size))
            self._pending_items += 1
            self._pending_bytes += size
            if self._agg_waiting or (self._agg_lingering and
                                     len(self._ingress) >= _LINGER_MAX):
                self._agg_cv.notify()
            return True

    @property
    def admitting(self) -> bool:
        return not self._stopping

    def _over(self, items: int, size: int) -> bool:
        return (self._pending_items + items > self.max_pending or
                (self._pending_bytes + size > self.max_pending_bytes
                 and self._pending_items > 0))

    def _drop_oldest_locked(self) -> bool:
        # The outbox holds the older items (already aggregated), so it is
        # searched first. Markers and meta records (the drop counts
        # themselves) are never dropped.
        for q in (self._outbox, self._ingress):
            for i, item in enumerate(q):
                if isinstance(item, _Marker) or (
                        q is self._outbox and item[0].kind == "meta"):
                    continue
                del q[i]
                size = item[2] if q is self._ingress else item[1]
                self._pending_items -= 1
                self._pending_bytes -= size
                self.dropped += 1
                return True
        return False

    def record_error(self, e: BaseException) -> None:
        with self._lock:
            self._errors.append(e)

    # ---------------------------------------------------- aggregator
    def _agg_loop(self) -> None:
        while True:
            with self._lock:
                if not self._ingress:
                    self._agg_waiting = True
                    self._agg_cv.wait(0.25)
                    self._agg_waiting = False
                if self._ingress and len(self._ingress) < _LINGER_MAX and \
                        not isinstance(self._ingress[-1], _Marker):
                    # Linger a moment so one wake-up handles many callbacks:
                    # waking per callback costs more than the work on a busy
                    # machine. A marker (flush/close) ends the linger.
                    self._agg_lingering = True
                    self._agg_cv.wait(self.agg_linger)
                    self._agg_lingering = False
                items = []
                while self._ingress and len(items) < 4096:
                    items.append(self._ingress.popleft())
                    if isinstance(items[-1], _Marker):
                        break      # records before a marker go out before it
            recs: list[Record] = []
            freed_items = freed_bytes = 0
            last = items[-1] if items else None
            for item in items:
                if isinstance(item, _Marker):
                    continue
                spec, arrays, size = item
                freed_items += 1
                freed_bytes += size
                try:
                    recs += self.agg.add_payload(spec, [np.asarray(a) for a in arrays])
                except BaseException as e:  # noqa: BLE001
                    self.record_error(TapError(
                        f"could not process tap {spec.name!r}: {e!r}"))
            # Drop array references now (they may pin device buffers).
            arrays = item = items = None  # noqa: F841
            recs += self._safe(self.agg.expire)
            marker = last if isinstance(last, _Marker) else None
            if marker is not None:
                recs += self._safe(self.agg.finalize_all)
                recs += self._dropped_record()
            # The events stay counted until their records are queued (same
            # critical section): freeing them first let ingest() admit up to
            # one chunk (4096) past max_pending.
            self._push(recs, marker=marker, freed=(freed_items, freed_bytes))
            if isinstance(marker, _Stop):
                return

    def _safe(self, fn) -> list[Record]:
        try:
            return fn()
        except BaseException as e:  # noqa: BLE001
            self.record_error(TapError(f"aggregation failed: {e!r}"))
            return []

    def _dropped_record(self) -> list[Record]:
        with self._lock:
            new = self.dropped - self._dropped_reported
            if not new:
                return []
            self._dropped_reported = self.dropped
            total = self.dropped
        warnings.warn(f"pmaptap dropped {new} tap event(s) (total {total}) "
                      f"under overflow policy {self.overflow!r}; raise "
                      "max_pending/max_pending_bytes or use overflow='block'.",
                      RuntimeWarning, stacklevel=2)
        return [Record(run=self.run, name="pmaptap/dropped", step=total,
                       kind="meta", value=new, dtype="int64", shape=[],
                       process=self.process, time=time.time(), host=self.host,
                       extra={"dropped_total": total, "policy": self.overflow})]

    def _push(self, recs: list[Record], marker: _Marker | None = None,
              freed: tuple[int, int] = (0, 0)) -> None:
        if not recs and marker is None and not freed[0]:
            return
        with self._lock:
            self._pending_items -= freed[0]
            self._pending_bytes -= freed[1]
            if freed[0] > len(recs):
                self._space_cv.notify_all()     # net room for "block" waiters
            for r in recs:
                b = _record_bytes(r)
                self._outbox.append((r, b))
                self._pending_items += 1
                self._pending_bytes += b
            if marker is not None:
                self._outbox.append(marker)
                self._outbox_markers += 1
            if self._write_waiting or (self._write_lingering and marker is not None):
                self._write_cv.notify()

    # ---------------------------------------------------- writer
    def _take_batch(self) -> tuple[list[tuple[Record, int]], list[_Marker]]:
        """Called with the lock held and the outbox non-empty."""
        batch: list[tuple[Record, int]] = []
        markers: list[_Marker] = []
        while self._outbox and len(batch) < self.max_batch:
            item = self._outbox.popleft()
            if isinstance(item, _Marker):
                markers.append(item)
                self._outbox_markers -= 1
                break
            batch.append(item)
        return batch, markers

    def _write_loop(self) -> None:
        while True:
            with self._lock:
                while not self._outbox:
                    self._write_waiting = True
                    self._write_cv.wait()
                    self._write_waiting = False
                # Linger briefly to batch more lines per lock acquisition,
                # unless someone waits on a marker.
                if not self._outbox_markers and len(self._outbox) < self.max_batch:
                    self._write_lingering = True    # only a marker ends it
                    self._write_cv.wait(self.flush_interval)
                    self._write_lingering = False
                batch, markers = self._take_batch()
            ok = self._write_batch(batch)
            if not ok:
                with self._lock:
                    # Keep the records (in order) for a later retry; the
                    # markers are answered "failed" so flush() can report.
                    self._outbox.extendleft(reversed(batch))
                for m in markers:
                    m.failed = True
                    m.event.set()
                    if isinstance(m, _Stop):
                        return
                time.sleep(self.retry_interval)
                continue
            for m in markers:
                m.event.set()
                if isinstance(m, _Stop):
                    return

    def _write_batch(self, batch: list[tuple[Record, int]]) -> bool:
        if not batch:
            return True
        try:
            self.sink.write([r for r, _ in batch])
        except LockBusy as e:
            # Kept for the flush-timeout message: in soft mode it names the
            # marker's holder (pid, host) and the file to remove.
            self._last_busy = str(e)
            return False
        except BaseException as e:  # noqa: BLE001
            self.record_error(e)
            return False
        rejected = getattr(self.sink, "rejected", None)
        if rejected:
            # Written as pmaptap/unencodable meta records in their place.
            self.record_error(TapError(
                f"{len(rejected)} record(s) could not be encoded as JSON and "
                f"were replaced by pmaptap/unencodable records: "
                f"{'; '.join(rejected[:3])}"))
            del rejected[:]
        with self._lock:
            self._pending_items -= len(batch)
            self._pending_bytes -= sum(b for _, b in batch)
            self.written += len(batch)
            self._space_cv.notify_all()
        return True

    # ---------------------------------------------------- control
    def _send_marker(self, marker: _Marker, timeout: float | None, *,
                     stopping: bool = False) -> bool:
        with self._lock:
            if stopping:
                self._stopping = True
            self._ingress.append(marker)
            self._agg_cv.notify()            # also ends a linger
        return marker.event.wait(timeout)

    def _drain(self, timeout: float | None, *, give_up_on_error: bool) -> None:
        """Send markers until one comes back written, retrying while the lock
        is busy or writes fail, until ``timeout``. flush() stops at the first
        error (to report it); close() keeps trying (space may come back)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            m = _Marker()
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._send_marker(m, left) or not m.failed:
                return
            if (give_up_on_error and self._errors) or \
                    (deadline is not None and time.monotonic() >= deadline):
                return
            time.sleep(self.retry_interval)

    def flush(self, timeout: float | None = None) -> None:
        """Write everything ingested so far; raise TapError on failures."""
        if self.closed:
            raise TapError("flush() on a closed pmaptap pipeline")
        self._drain(timeout, give_up_on_error=True)
        self.raise_errors(pending_ok=False)

    def pending(self) -> int:
        with self._lock:
            return self._pending_items

    def raise_errors(self, pending_ok: bool = True) -> None:
        with self._lock:
            errors, self._errors = self._errors, []
            pending = self._pending_items
        if errors:
            path = getattr(self.sink, "path", None)
            seen: dict[str, int] = {}
            for e in errors:
                text = f"{type(e).__name__}: {e}"
                seen[text] = seen.get(text, 0) + 1
            reasons = "; ".join(t + (f" (x{n})" if n > 1 else "")
                                for t, n in list(seen.items())[:5])
            msg = (f"pmaptap could not write {pending} pending record(s)"
                   f"{' to ' + repr(path) if path else ''}: {reasons}")
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
            raise TapError(msg, path=path, errors=tuple(errors)) from errors[0]
        if pending and not pending_ok:
            path = getattr(self.sink, "path", None)
            busy = self._last_busy
            raise TapError(f"pmaptap flush timed out with {pending} record(s) "
                           f"still queued for {path!r} (is another process "
                           "holding the lock?). They stay queued and are "
                           "retried." + (f" Last lock attempt: {busy}" if busy
                                         else ""), path=path)

    def close(self, timeout: float | None = None) -> None:
        """Drain, stop both threads, close the sink. Raises TapError if
        records could not be written (they are counted in the message)."""
        if self.closed:
            return
        stop = _Stop()
        try:
            self._drain(timeout, give_up_on_error=False)
        finally:
            # Shut admission and queue the stop marker in one critical
            # section: every payload admitted is ahead of the marker, so it
            # is written before close() returns; ingest() refuses the rest
            # (routing sends them to the console) instead of losing them.
            self._send_marker(stop, 5.0, stopping=True)
            # Join so no pmaptap thread (holding array references) is still
            # unwinding when the interpreter finalizes: that aborted the
            # process ("FATAL: exception not rethrown") in testing.
            for t in (self._agg_thread, self._write_thread):
                if t is not threading.current_thread():
                    t.join(5.0)
            self.closed = True
            lost = self.pending()
            try:
                self.sink.close()
            finally:
                if lost:
                    self.record_error(TapError(
                        f"{lost} record(s) were not written before close"))
                self.raise_errors()
