"""The two threads of a pipeline: the aggregator loop and the writer loop.

Both take from the pipeline's ``BoundedQueue`` and never raise: a failure is
handed to ``report`` (the pipeline's error log) and surfaces as a TapError at
the next flush()/close().
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from pmaptap._host.pipeline.aggregate import Aggregator
from pmaptap._host.pipeline.payload import split
from pmaptap._host.pipeline.queue import BoundedQueue, Marker, Stop
from pmaptap._host.sinks import Sink
from pmaptap._log import log
from pmaptap.errors import LockBusy, TapError, resumed_step_message
from pmaptap.tapfile.record import META_DROPPED, Record

Report = Callable[[BaseException], None]

# Seconds the writer waits for a busy lock before it says so.
LOCK_WAIT_WARN_S = 10.0


class AggregateLoop:
    """Payloads -> records, off the callback thread, along the aggregation
    path: NumPy conversion here, then each payload taken apart
    (payload.split), its copies collected, counted and deduplicated (the
    ``Aggregator``), records built (its RecordBuilder, records.py) and
    values encoded (encode.py)."""

    def __init__(self, queue: BoundedQueue, agg: Aggregator, report: Report, *, name: str) -> None:
        self.queue = queue
        self.agg = agg
        self.report = report
        # One wake-up per linger of callbacks (or per LINGER_MAX): at a short
        # step, a shorter linger's extra wake-ups cost the aggregator more CPU
        # per step (docs/performance.md).
        self.linger = 0.02
        self.thread = threading.Thread(target=self._run, daemon=True, name=name)
        self.thread.start()

    def _run(self) -> None:
        try:
            while self._step():
                pass
        except BaseException as e:  # noqa: BLE001 - reported, never raised
            self.report(TapError(f"the aggregator thread stopped: {e!r}"))
        finally:
            self.queue.aggregator_ended()

    def _step(self) -> bool:
        """One chunk; False after the close marker."""
        items = self.queue.take_payloads(self.linger)
        bound = self.queue.bound_reached()
        if bound:
            log.warning(bound)  # here, not on XLA's thread that met the bound
        recs: list[Record] = []
        freed_items = freed_bytes = 0
        last = items[-1] if items else None
        for item in items:
            if isinstance(item, Marker):
                continue
            spec, arrays, size = item
            freed_items += 1
            freed_bytes += size
            try:
                recs += self.agg.add_payload(split(spec, [np.asarray(a) for a in arrays]))
            except BaseException as e:  # noqa: BLE001
                self.report(TapError(f"could not process tap {spec.name!r}: {e!r}"))
        # Drop array references now (they may pin device buffers).
        arrays = item = items = None  # noqa: F841
        recs += self._safe(self.agg.expire)
        marker = last if isinstance(last, Marker) else None
        if marker is not None:
            # Counted since the last flush/close, said once: per batch, one
            # refusal would be split by the timing of the callbacks.
            for name, count in self.agg.take_automatic_refused().items():
                self.report(
                    TapError(
                        f"{count} callback(s) not written: {resumed_step_message(name)} "
                        "(refused on the host: the tap was traced before the session opened)"
                    )
                )
            recs += self._safe(self.agg.finalize_all)
            recs += self._dropped_records()
        self.queue.put_records(recs, marker, (freed_items, freed_bytes))
        return not isinstance(marker, Stop)

    def _safe(self, fn: Callable[[], list[Record]]) -> list[Record]:
        try:
            return fn()
        except BaseException as e:  # noqa: BLE001
            self.report(TapError(f"aggregation failed: {e!r}"))
            return []

    def _dropped_records(self) -> list[Record]:
        new, total = self.queue.new_drops()
        if not new:
            return []
        policy = self.queue.overflow
        log.warning(
            f"pmaptap dropped {new} tap event(s) (total {total}) "
            f"under overflow policy {policy!r}; raise "
            "max_pending/max_pending_bytes or use overflow='block'."
        )
        # The meta record of the drops since the last one (written at the
        # next flush/close; never dropped itself).
        extra = {"dropped_total": total, "policy": policy}
        return [self.agg.records.meta(META_DROPPED, new, total, extra)]


class WriteLoop:
    """Records -> sink, in batches; a failed batch is kept and retried."""

    def __init__(
        self,
        queue: BoundedQueue,
        sink: Sink,
        report: Report,
        *,
        name: str,
        flush_interval: float,
        retry_interval: float,
        max_batch: int,
        on_written: Callable[[list[tuple[Record, bool]]], None] | None = None,
    ) -> None:
        self.queue = queue
        # Gets, for live forwarding, every record of a written batch in order
        # with whether this process wrote it (False: a replicated value the
        # dedup left to another process); it must not wait (Forwarders.offer
        # only queues).
        self.on_written = on_written
        self.sink = sink
        self.report = report
        self.flush_interval = flush_interval
        self.retry_interval = retry_interval
        self.max_batch = max_batch
        # After a batch failed to write (a full disk, a file size limit),
        # the next try takes half as many records: the lines that still fit
        # are written, whole, instead of the whole batch failing forever
        # (cut back by the sink: sinks/base.py, Sink._append).
        self.batch_cap = max_batch
        self.written = 0
        # Why the last lock attempt failed, for the flush-timeout message: in
        # soft mode it names the marker's holder (pid, host) and the file.
        self.last_busy = ""
        # A lock held for long by another process is worth a word (once per
        # spell, and once more when it is over): taps keep running meanwhile.
        self.busy_since: float | None = None
        self.busy_warned = False
        self.thread = threading.Thread(target=self._run, daemon=True, name=name)
        self.thread.start()

    def _run(self) -> None:
        while True:
            batch, markers = self.queue.take_batch(self.flush_interval, self.batch_cap)
            ok = self._write(batch)
            if not ok:
                # Keep the records (in order) for a later retry; the markers
                # are answered "failed" so flush() can report.
                self.queue.requeue(batch)
            for m in markers:
                m.failed = not ok
                m.event.set()
                if isinstance(m, Stop):
                    return
            if not ok:
                time.sleep(self.retry_interval)

    def _lock_wait(self, e: LockBusy) -> None:
        now = time.monotonic()
        if self.busy_since is None:
            self.busy_since = now
        elif not self.busy_warned and now - self.busy_since >= LOCK_WAIT_WARN_S:
            self.busy_warned = True
            log.warning(
                f"pmaptap: waiting {now - self.busy_since:.0f}s for the "
                f"lock of {getattr(self.sink, 'path', '?')}; taps keep "
                f"running and records stay queued ({e})"
            )

    def _write(self, batch: list[tuple[Record, int]]) -> bool:
        if not batch:
            return True
        try:
            records = [r for r, _ in batch]
            wrote = self.sink.write(records)
        except LockBusy as e:
            self.last_busy = str(e)
            self._lock_wait(e)
            return False
        except BaseException as e:  # noqa: BLE001
            self.report(e)
            if isinstance(e, OSError):
                # Halve down to one record; then the whole batch again, so
                # that a flush() waiting behind it hears of the failure.
                self.batch_cap = len(batch) // 2 if len(batch) > 1 else self.max_batch
            return False
        self.batch_cap = self.max_batch
        rejected = getattr(self.sink, "rejected", None)
        if rejected:
            # Written as pmaptap/unencodable meta records in their place.
            self.report(
                TapError(
                    f"{len(rejected)} record(s) could not be encoded as JSON and "
                    f"were replaced by pmaptap/unencodable records: "
                    f"{'; '.join(rejected[:3])}"
                )
            )
            del rejected[:]
        self.queue.written(batch)
        self.written += len(batch)
        if self.busy_since is not None:
            if self.busy_warned:
                log.warning(
                    f"pmaptap: got the lock of "
                    f"{getattr(self.sink, 'path', '?')} after "
                    f"{time.monotonic() - self.busy_since:.0f}s; "
                    "queued records are written"
                )
            self.busy_since, self.busy_warned = None, False
        if self.on_written is not None:
            try:
                self.on_written(_decided(records, wrote, getattr(self.sink, "left", ())))
            except BaseException as e:  # noqa: BLE001 - the file has them
                self.report(TapError(f"could not forward written records: {e!r}"))
        return True


def _decided(
    records: list[Record], wrote: Sequence[Record] | None, left: Sequence[int]
) -> list[tuple[Record, bool]]:
    """Each record of a written batch, in order, with whether this process
    wrote it: the sink's output (which may have replaced a record: flagged
    divergent, or an unencodable one's meta record) where it wrote one, the
    record as computed where it left it to another process. A sink that
    returns None wrote everything as given."""
    if wrote is None:
        return [(r, True) for r in records]
    skip = set(left)
    out: list[tuple[Record, bool]] = []
    it = iter(wrote)
    for i, r in enumerate(records):
        if i in skip:
            out.append((r, False))
        else:
            w = next(it, None)
            if w is None:  # a sink that broke the contract: forward what it wrote
                return [(w, True) for w in wrote]
            out.append((w, True))
    return out
