"""The bounded queue of one pipeline and its overflow policy.

    callback --admit()--> [ingress] --aggregator--> [outbox] --writer--> sink

Payloads plus records share ONE bound (``max_pending`` items,
``max_pending_bytes`` bytes), so memory stays bounded whichever stage is
slow; past it ``overflow`` decides, drops are counted (a ``pmaptap/dropped``
record at the next marker) and the aggregator says once that the bound was
met (``bound_reached``): docs/faults.md, "Tap flood".

Markers (flush, close) travel through both stages in order. ``shut()``
queues the close marker in the same critical section that ends admission:
every admitted payload is ahead of it, hence written before close()
returns, and ``admit`` refuses later ones (False) so the caller can send
them elsewhere rather than lose them.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

from pmaptap.tapfile.record import RawArray, Record, raw_leaves

OVERFLOW_POLICIES = ("block", "drop_oldest", "drop_newest")

# A consumer that lingers (to take many items per wake-up) is woken early
# once this many payloads wait.
LINGER_MAX = 64
# ... or once this many bytes wait, and then does not linger: lingering
# batches lines under the file lock, which array bytes do not need
# (docs/architecture.md, "Array values stored as bytes").
LINGER_BYTES = 4 << 20
# Payloads the aggregator takes per wake-up: bounds one chunk's latency and
# what drop_oldest cannot reach.
CHUNK = 4096

# What a consumer thread is doing, so producers notify only a listener.
_BUSY, _WAITING, _LINGERING = 0, 1, 2


class Marker:
    """Travels through both stages; set when everything before it is written."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.failed = False


class Stop(Marker):
    """The close marker: the threads end after answering it."""


def payload_bytes(arrays: tuple[Any, ...]) -> int:
    try:  # NumPy arrays from host_call: the common case
        return 64 + sum(a.nbytes for a in arrays)
    except AttributeError:
        return 64 + sum(int(getattr(a, "nbytes", 0) or 0) for a in arrays)


# What a queued record counts for beside the bytes it holds.
RECORD_OVERHEAD = 256


def record_bytes(r: Record) -> int:
    v = r.value
    if type(v) is RawArray:  # a stored value: its bytes wait in the queue
        return RECORD_OVERHEAD + v.array.nbytes
    if type(v) in (dict, list) and type(r.dtype) is not str:
        return RECORD_OVERHEAD + sum(x.array.nbytes for x in raw_leaves(v, r.dtype))
    return RECORD_OVERHEAD + (len(str(v)) if r.kind == "meta" else 0)


class BoundedQueue:
    def __init__(
        self,
        *,
        overflow: str,
        max_pending: int,
        max_pending_bytes: int,
    ) -> None:
        # Their defaults: options.py (the pipeline passes them). Validated
        # once, where users pass it (Session); a bad value here is a bug in
        # pmaptap, not user input.
        assert overflow in OVERFLOW_POLICIES, overflow
        self.overflow = overflow
        self.max_pending = max_pending
        self.max_pending_bytes = max_pending_bytes
        # One lock for both stages (the bound and drop_oldest span them) and
        # three conditions on it, so each wake-up reaches the thread that has
        # work: a shared notify_all woke threads with nothing to do, at a
        # cost in throughput (docs/performance.md). Never held
        # across I/O or aggregation, so the callback only ever waits for
        # another thread's queue operation (or for room, under "block").
        self._lock = threading.Lock()
        self._payload_cv = threading.Condition(self._lock)  # aggregator
        self._record_cv = threading.Condition(self._lock)  # writer
        self._space_cv = threading.Condition(self._lock)  # "block" admit
        self._aggregator = _BUSY
        self._writer = _BUSY
        self._ingress: collections.deque = collections.deque()
        self._outbox: collections.deque = collections.deque()
        self._outbox_markers = 0
        self._items = 0
        self._bytes = 0
        # Bytes waiting in each deque (ingress: payload sizes; outbox: the
        # stored values' bytes), for the lingers' early end (LINGER_BYTES).
        self._ingress_bytes = 0
        self._outbox_bytes = 0
        # The bound was reached (which one, its value, the policy): set once
        # per pipeline by the callback, said once by the aggregator thread
        # (``bound_reached``), never logged on XLA's thread.
        self._bound: tuple | None = None
        self._bound_said = False
        self.dropped = 0
        self._dropped_reported = 0
        # Payloads offered so far (queued or dropped): SIGTERM's wait for
        # dispatched steps goes on while this grows (session.py).
        self.offered = 0
        self.admitting = True
        # Cleared when the aggregator thread ends for any reason: past the
        # bound, "block" would then wait forever, so it drops instead.
        self.aggregator_running = True
        # The writer's last write failed (requeue) and none succeeded since
        # (written): a blocking admit then follows the overflow policy.
        self.writer_failing = False

    # ------------------------------------------------------ callback side
    def admit(self, item: Any, arrays: tuple[Any, ...], *, block: bool = False) -> bool:
        """Queue one payload ``(item, arrays)``. False once shut (the caller
        sends it elsewhere); True when queued, or dropped and counted.
        ``block``: wait for room whatever the overflow policy while the
        writer writes (the output transport's drain thread, whose waiting
        slows the loop's dispatch instead of dropping values:
        _outputs/drain.py); the policy while its writes fail."""
        size = payload_bytes(arrays)
        with self._lock:
            if not self.admitting:
                return False
            self.offered += 1
            while self._over(size):
                # A blocking admit (the output transport's drain) waits for
                # the writer while it writes: it drops nothing, and the loop
                # it slows says so itself (_outputs/drain.py), so no word of a
                # policy not applied. While the writer's writes fail (a full
                # disk, a lock another process holds) room may never come:
                # the session's policy applies to it as to a callback, so the
                # drain, and every flush, close and exit waiting for it, never
                # waits on the disk for ever.
                waits = block and not self.writer_failing
                policy = "block" if waits else self.overflow
                if not waits and not self._bound_said and self._bound is None:
                    self._bound = self._which_bound(size)
                if policy == "drop_newest" or not self.aggregator_running:
                    self.dropped += 1
                    return True
                if policy == "drop_oldest":
                    if not self._drop_oldest():
                        # Everything pending is in the threads' hands (being
                        # aggregated or written): drop the arriving item
                        # rather than exceed the bound.
                        self.dropped += 1
                        return True
                    continue
                if self._aggregator == _LINGERING:
                    self._payload_cv.notify()  # room comes from aggregating now
                self._space_cv.wait(0.1)  # "block"
                if not self.admitting:
                    return False  # close() began: not its to write
            self._ingress.append((item, arrays, size))
            self._items += 1
            self._bytes += size
            self._ingress_bytes += size
            if self._aggregator == _WAITING or (
                self._aggregator == _LINGERING
                and (len(self._ingress) >= LINGER_MAX or self._ingress_bytes >= LINGER_BYTES)
            ):
                self._payload_cv.notify()
            return True

    def _which_bound(self, size: int) -> tuple:
        if self._items + 1 > self.max_pending:
            return ("max_pending", self.max_pending, f"{self._items} taps and records")
        return ("max_pending_bytes", self.max_pending_bytes, f"{self._bytes + size} bytes")

    def bound_reached(self) -> str | None:
        """Once per queue, after admit() first met its bound: what to say
        (the bound, what waits, what the policy does now); else None."""
        if self._bound is None:  # the usual answer, without the lock
            return None
        with self._lock:
            bound, self._bound = self._bound, None
            if bound is None or self._bound_said:
                return None
            self._bound_said = True
        name, limit, what = bound
        doing = {
            "block": "taps now wait for the writer (the devices wait with them)",
            "drop_oldest": "the oldest waiting taps are dropped (counted; a "
            "pmaptap/dropped record says how many)",
            "drop_newest": "new taps are dropped (counted; a pmaptap/dropped record says how many)",
        }[self.overflow]
        return (
            f"pmaptap: {what} wait to be written, the queue's bound "
            f"({name}={limit}): {doing} until the writer catches up. It is "
            "behind: the disk (or the sink, or a lock another process holds) "
            "takes the taps more slowly than the training produces them; "
            f"raise {name}, tap less often (every=N) or smaller values. "
            "(Said once.)"
        )

    def _over(self, size: int) -> bool:
        return self._items + 1 > self.max_pending or (
            self._bytes + size > self.max_pending_bytes and self._items > 0
        )

    def _drop_oldest(self) -> bool:
        # The outbox holds the older items (already aggregated), so it is
        # searched first. Markers and meta records (the drop counts
        # themselves) are never dropped.
        for q in (self._outbox, self._ingress):
            for i, entry in enumerate(q):
                if isinstance(entry, Marker) or (q is self._outbox and entry[0].kind == "meta"):
                    continue
                del q[i]
                self._items -= 1
                self._bytes -= entry[-1]
                if q is self._outbox:
                    self._outbox_bytes -= entry[-1] - RECORD_OVERHEAD
                else:
                    self._ingress_bytes -= entry[-1]
                self.dropped += 1
                return True
        return False

    # ------------------------------------------------------ control
    def send(self, marker: Marker) -> None:
        """Queue a flush marker behind everything admitted so far."""
        with self._lock:
            self._ingress.append(marker)
            self._payload_cv.notify()  # also ends a linger

    def shut(self, stop: Stop) -> None:
        """End admission and queue the close marker, atomically (see top)."""
        with self._lock:
            self.admitting = False
            self._space_cv.notify_all()  # "block" waiters: refused now
            self._ingress.append(stop)
            self._payload_cv.notify()

    @property
    def pending(self) -> int:
        """Payloads and records not yet written (or dropped)."""
        with self._lock:
            return self._items

    # ------------------------------------------------------ aggregator side
    def take_payloads(self, linger: float) -> list:
        """The next chunk of payloads, ending at the first marker (records of
        payloads before a marker must reach the outbox before it). Waits up
        to 0.25 s for any, then lingers up to ``linger`` for more, so one
        wake-up handles many callbacks: waking per callback costs more than
        the work on a busy machine. A marker ends the linger."""
        with self._lock:
            if not self._ingress:
                self._aggregator = _WAITING
                self._payload_cv.wait(0.25)
                self._aggregator = _BUSY
            if (
                self._ingress
                and len(self._ingress) < LINGER_MAX
                and self._ingress_bytes < LINGER_BYTES
                and not isinstance(self._ingress[-1], Marker)
            ):
                self._aggregator = _LINGERING
                self._payload_cv.wait(linger)
                self._aggregator = _BUSY
            items = []
            while self._ingress and len(items) < CHUNK:
                item = self._ingress.popleft()
                items.append(item)
                if isinstance(item, Marker):
                    break
                self._ingress_bytes -= item[-1]
            return items

    def put_records(
        self, recs: list[Record], marker: Marker | None, freed: tuple[int, int]
    ) -> None:
        """Queue the records made from ``freed`` (payload count, bytes) and
        the marker that ended the chunk. The payloads stay counted until
        their records are queued (same critical section): freeing them first
        let admit() take up to one chunk past max_pending."""
        if not recs and marker is None and not freed[0]:
            return
        with self._lock:
            self._items -= freed[0]
            self._bytes -= freed[1]
            if freed[0] > len(recs):
                self._space_cv.notify_all()  # net room for "block" waiters
            for r in recs:
                b = record_bytes(r)
                self._outbox.append((r, b))
                self._items += 1
                self._bytes += b
                self._outbox_bytes += b - RECORD_OVERHEAD
            if marker is not None:
                self._outbox.append(marker)
                self._outbox_markers += 1
            # One wake-up per chunk of records at most (a step's shards come
            # in one chunk), none while the writer works.
            if self._writer == _WAITING or (
                self._writer == _LINGERING
                and (marker is not None or self._outbox_bytes >= LINGER_BYTES)
            ):
                self._record_cv.notify()

    def new_drops(self) -> tuple[int, int]:
        """(drops since the last call, total drops)."""
        with self._lock:
            new = self.dropped - self._dropped_reported
            self._dropped_reported = self.dropped
            return new, self.dropped

    def aggregator_ended(self) -> None:
        with self._lock:
            self.aggregator_running = False
            self._space_cv.notify_all()

    # ------------------------------------------------------ writer side
    def take_batch(
        self, linger: float, max_batch: int
    ) -> tuple[list[tuple[Record, int]], list[Marker]]:
        """Up to ``max_batch`` records and the marker after them, if any.
        Waits for records, then lingers up to ``linger`` to batch more lines
        per lock acquisition unless someone waits on a marker."""
        with self._lock:
            while not self._outbox:
                self._writer = _WAITING
                self._record_cv.wait()
                self._writer = _BUSY
            if (
                not self._outbox_markers
                and len(self._outbox) < max_batch
                and self._outbox_bytes < LINGER_BYTES
            ):
                self._writer = _LINGERING  # a marker or LINGER_BYTES ends it
                self._record_cv.wait(linger)
                self._writer = _BUSY
            batch: list[tuple[Record, int]] = []
            markers: list[Marker] = []
            while self._outbox and len(batch) < max_batch:
                entry = self._outbox.popleft()
                if isinstance(entry, Marker):
                    markers.append(entry)
                    self._outbox_markers -= 1
                    break
                batch.append(entry)
                self._outbox_bytes -= entry[1] - RECORD_OVERHEAD
            return batch, markers

    def requeue(self, batch: list[tuple[Record, int]]) -> None:
        """A batch that could not be written goes back in front, in order."""
        with self._lock:
            self._outbox.extendleft(reversed(batch))
            self._outbox_bytes += sum(b - RECORD_OVERHEAD for _, b in batch)
            if not self.writer_failing:
                self.writer_failing = True
                self._space_cv.notify_all()  # a blocking admit: the policy now

    def written(self, batch: list[tuple[Record, int]]) -> None:
        with self._lock:
            self._items -= len(batch)
            self._bytes -= sum(b for _, b in batch)
            self.writer_failing = False
            self._space_cv.notify_all()
