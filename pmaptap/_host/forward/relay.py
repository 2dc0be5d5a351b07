"""Live forwarding: ``Session(path, forward=[...])`` hands the records of a
job to user code (a logger, a dashboard, a CLU ``MetricWriter``) on a
thread of their own behind a bounded queue (docs/api.md, "Live forwarding:
forward="). Which records a process forwards (``forward_replicated``,
``select``): docs/api.md, "Which process forwards what".
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from pmaptap.tapfile.analyze import divergence_series
from pmaptap.tapfile.export import tag_parts
from pmaptap.tapfile.read import leaves
from pmaptap.tapfile.record import FINGERPRINT, Record, decode_record, parse_line, raw_leaves
from pmaptap.tapfile.source import load_value

# Session(forward_replicated=...): docs/api.md, "Which process forwards what".
FORWARD_REPLICATED = ("process0", "written", "all")


def check_replicated(policy: Any) -> str:
    """Validate ``forward_replicated=`` where the user passed it."""
    if policy not in FORWARD_REPLICATED:
        raise ValueError(
            f"Session: forward_replicated must be one of {FORWARD_REPLICATED}, got {policy!r}"
        )
    return policy


def select(decided: Sequence[tuple[Record, bool]], process: int, policy: str) -> list[Record]:
    """The records of a written batch that this process forwards under
    ``policy`` (FORWARD_REPLICATED), in order. ``decided``: each record with
    whether this process wrote it (only replicated records are ever left to
    another process)."""
    if policy == "written":
        return [r for r, wrote in decided if wrote]
    if policy == "all" or process == 0:
        return [r for r, _ in decided]
    return [r for r, _ in decided if r.kind != "replicated"]


def check_targets(targets: Iterable[Any] | None) -> list[Any]:
    """Validate ``forward=`` where the user passed it (Session.__init__)."""
    if targets is None:
        return []
    if (
        callable(targets)
        or hasattr(targets, "write_scalars")
        or isinstance(targets, (str, bytes))
        or not isinstance(targets, Iterable)
    ):
        raise TypeError(
            "Session: forward must be a list of forwarders, "
            f"got {targets!r}; wrap a single one as forward=[f]"
        )
    out = list(targets)
    for i, t in enumerate(out):
        ws = getattr(t, "write_scalars", None)
        if ws is not None and not callable(ws):
            raise TypeError(
                f"Session: forward[{i}] ({t!r}) has a write_scalars attribute that is not callable"
            )
        if ws is None and not callable(t):
            raise TypeError(
                f"Session: forward[{i}] must be a callable taking a record "
                "dict, or an object with write_scalars(step, mapping) (the "
                f"CLU MetricWriter protocol); got {t!r}"
            )
    return out


def scalar_series(rec: dict, *, mark_divergent: bool = False) -> Iterator[tuple[str, float]]:
    """(tag, value) of each real scalar leaf of a decoded record, tagged as
    ``pmaptap export --tensorboard`` tags them (``name/<leaf>``,
    ``/device_<id>`` for per-device taps, ``@backward``; ``mark_divergent``:
    see ``tag_parts``). Arrays, complex and non-numeric leaves are not
    scalars; meta records are pmaptap's own."""
    if rec.get("kind") == "meta":
        return
    if rec.get("kind") == FINGERPRINT:
        yield from divergence_series(rec)  # copies that differ, not the fingerprint
        return
    base, suffix = tag_parts(rec, mark_divergent=mark_divergent)
    for path, v, _dtype in leaves(rec.get("value"), rec.get("dtype")):
        if isinstance(v, (int, float)):  # bool is an int: 0/1
            yield base + path + suffix, float(v)


def _as_read(r: Record) -> dict:
    """The record as ``pmaptap.read`` returns it: through its JSON line, so
    arrays are lists and NaN/inf are floats, whatever the Record held."""
    d, problem = parse_line(r.encode())
    if d is None:
        raise ValueError(f"record {r.name!r} step {r.step}: {problem}")
    out = decode_record(d)
    if "bytes" in d:
        # Stored values as read() returns them (ndarrays), from the arrays
        # the record still holds: the forwarder reads nothing back.
        held = {(x.ref["file"], x.ref["offset"]): x.array for x in raw_leaves(r.value, r.dtype)}
        out["value"] = load_value(out, _Held(held))
    return out


class _Held:
    """load_value's store for a record's own arrays (forwarders)."""

    def __init__(self, held: dict) -> None:
        self.held = held

    def load_leaf(self, ref: dict, dtype: str, shape: Any) -> Any:
        return self.held[(ref["file"], ref["offset"])]


class _Target:
    """One forwarder and what happened to it since the last report."""

    def __init__(self, obj: Any, lock: threading.Condition) -> None:
        self.obj = obj
        # The Forwarders' lock: failures are counted on the forwarding thread
        # and taken by problems() on the caller's.
        self.lock = lock
        self.scalars = getattr(obj, "write_scalars", None)
        # A CLU writer's flush(), or a callable forwarder's that buffers
        # (pmaptap.forwarders: a step's metrics wait for the next step);
        # called on the forwarding thread, never on the caller's.
        fl = getattr(obj, "flush", None)
        self.flush = fl if callable(fl) else None
        # The optional session hooks (docs/forwarders.md): open(run, attempt)
        # once the run id is agreed, end(outcome) when the session ends.
        op, end = getattr(obj, "open", None), getattr(obj, "end", None)
        self.open = op if callable(op) else None
        self.end = end if callable(end) else None
        self.failures = 0
        self.first_error: BaseException | None = None

    def name(self) -> str:
        obj = self.obj
        return getattr(obj, "__qualname__", None) or type(obj).__qualname__

    def deliver(self, dicts: list[dict], stopped: Callable[[], bool]) -> None:
        """Hand ``dicts`` over; ``stopped()`` is asked before each call, so
        nothing is handed over once close() stopped waiting."""
        if self.scalars is None:
            for d in dicts:
                if stopped():
                    return
                self._call(self.obj, d)
            return
        # CLU's protocol writes one step's scalars at a time.
        per_step: dict[int, dict[str, float]] = {}
        for d in dicts:
            for tag, v in scalar_series(d):
                per_step.setdefault(d.get("step"), {})[tag] = v
        for step, mapping in per_step.items():
            if stopped():
                return
            self._call(self.scalars, step, mapping)

    def fail(self, e: BaseException) -> None:
        with self.lock:
            self.failures += 1
            if self.first_error is None:
                self.first_error = e

    def _call(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - counted, reported at flush/close
            # SystemExit/KeyboardInterrupt too: raised by a forwarder on this
            # thread they are its failure, not a request to stop the process
            # (a signal's KeyboardInterrupt goes to the main thread).
            self.fail(e)


def _units(batch: list[Record]) -> Iterator[list[Record]]:
    """Runs of consecutive records of one step: the unit the thread forwards
    and counts (a CLU writer gets one write_scalars per unit)."""
    unit: list[Record] = []
    for r in batch:
        if unit and r.step != unit[0].step:
            yield unit
            unit = []
        unit.append(r)
    if unit:
        yield unit


class Forwarders:
    """The forwarding thread of one pipeline and its bounded queue.

    Counting: every record offered is, in the end, either forwarded (handed to
    every forwarder, each call returned or raised) or not forwarded: dropped
    from a full queue, or still queued or in the thread's hands when close()
    stopped waiting. ``problems()`` reports the latter, exactly."""

    def __init__(
        self,
        targets: Sequence[Any],
        *,
        max_pending: int = 100_000,
        name: str = "pmaptap-forward",
        run: str | None = None,
        attempt: int = 0,
    ) -> None:
        self._cond = threading.Condition()
        self.targets = [_Target(t, self._cond) for t in targets]
        # The forwarders' open(run, attempt): the thread's first job, before
        # any record (the session creates this object once the run is agreed).
        self._opening = (
            (run, attempt) if run is not None and any(t.open for t in self.targets) else None
        )
        self._ending: str | None = None  # end(outcome) asked by close()
        self._ended = False
        self.max_pending = max_pending
        self._queue: collections.deque[Record] = collections.deque()
        self._offered = 0  # records offered (dropped ones included)
        self._done = 0  # records forwarded or not forwarded (counted)
        self._hand = 0  # records the thread took off the queue, not yet done
        self._overflowed = 0  # dropped from a full queue, since the last report
        self._abandoned = 0  # left when close() stopped waiting, ditto
        self._close_note = ""  # why close() stopped waiting, for the report
        self.dropped_total = 0  # every record not forwarded, ever
        self._flush_asked = 0  # flush rounds asked for by drain()
        self._flush_done = 0  # flush rounds the thread completed
        # What the thread is doing right now, for the report when close()
        # gives up on it: "forwarder X" or "forwarder X's flush()".
        self._busy = ""
        self._died: BaseException | None = None
        self._died_unreported: BaseException | None = None
        self._stop = False
        self.thread = threading.Thread(target=self._run, daemon=True, name=name)
        self.thread.start()

    def offer(self, records: Sequence[Record]) -> None:
        """Called by the writer thread after a successful write: O(records),
        never waits for a forwarder."""
        with self._cond:
            self._offered += len(records)
            if self._stop:
                self._not_forwarded(len(records), overflow=False)
                return
            self._queue.extend(records)
            over = len(self._queue) - self.max_pending
            if over > 0:
                for _ in range(over):
                    self._queue.popleft()
                self._not_forwarded(over, overflow=True)
            self._cond.notify_all()

    def _not_forwarded(self, n: int, *, overflow: bool) -> None:
        # Under self._cond.
        if overflow:
            self._overflowed += n
        else:
            self._abandoned += n
        self.dropped_total += n
        self._done += n

    def _stopped(self) -> bool:
        return self._stop  # one attribute read: no lock needed

    # ------------------------------------------------------ the thread
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - a bug of ours: reported, waits end
            with self._cond:
                self._died = self._died_unreported = e
                self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (
                    self._opening
                    or self._queue
                    or self._stop
                    or self._flush_done < self._flush_asked
                    or (self._ending is not None and not self._ended)
                ):
                    self._cond.wait()
                if self._stop:
                    return
                # In this order: open() first, records, a flush asked after
                # them, end() last (close() asks for it once drained).
                opening, self._opening = self._opening, None
                batch: list[Record] = []
                if opening is None:
                    batch = list(self._queue)
                    self._queue.clear()
                    self._hand = len(batch)
                flush_round = self._flush_asked
                flushing = self._flush_done < flush_round
                ending = self._ending if not self._ended else None
            if opening is not None:
                self._call_each("open", opening)
            elif batch:
                self._forward(batch)
            elif flushing:
                self._call_each("flush", ())
                with self._cond:
                    self._flush_done = flush_round
                    self._cond.notify_all()
            elif ending is not None:
                self._call_each("end", (ending,))
                with self._cond:
                    self._ended = True
                    self._cond.notify_all()

    def _call_each(self, hook: str, args: tuple) -> None:
        """Each forwarder's ``hook`` (open, flush, end) that it has."""
        for t in self.targets:
            fn = getattr(t, hook)
            if fn is not None and not self._stop:
                self._set_busy(f"forwarder {t.name()}'s {hook}()")
                t._call(fn, *args)
        self._set_busy("")

    def _set_busy(self, what: str) -> None:
        with self._cond:
            self._busy = what

    def _forward(self, batch: list[Record]) -> None:
        for unit in _units(batch):
            dicts = []
            for r in unit:
                try:
                    dicts.append(_as_read(r))
                except BaseException as e:  # noqa: BLE001 - e.g. a record that will not decode
                    for t in self.targets:
                        t.fail(e)
            for t in self.targets:
                if self._stop:
                    return  # close() counted this unit and the rest
                self._set_busy(f"forwarder {t.name()}")
                t.deliver(dicts, self._stopped)
            with self._cond:
                self._busy = ""
                if self._stop:
                    return  # close() stopped waiting first: counted there
                self._done += len(unit)
                self._hand -= len(unit)
                self._cond.notify_all()

    # ------------------------------------------------- flush / close
    def _wait(self, done: Callable[[], bool], deadline: float | None) -> bool:
        # Under self._cond. False at the deadline, or if the thread is gone.
        while not done():
            if self._died is not None or not self.thread.is_alive():
                return False
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self._cond.wait(left)
        return True

    def drain(self, timeout: float | None) -> bool:
        """Wait until everything offered so far was forwarded (or dropped),
        then until the forwarders' flush() returned: at most ``timeout`` in
        all. Nothing of a forwarder runs on the caller's thread."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            target = self._offered
            if not self._wait(lambda: self._done >= target, deadline):
                return False
            if not any(t.flush is not None for t in self.targets):
                return True
            self._flush_asked += 1
            want = self._flush_asked
            self._cond.notify_all()
            return self._wait(lambda: self._flush_done >= want, deadline)

    def close(self, timeout: float | None, outcome: str = "finished") -> None:
        """Forward what is queued, flush, and call the forwarders' ``end(outcome)``
        (up to ``timeout`` in all), then stop; what is still queued or in
        the thread's hands then is counted as not forwarded, and the thread
        hands nothing more over."""
        deadline = None if timeout is None else time.monotonic() + timeout
        drained = self.drain(timeout)
        if drained and any(t.end is not None for t in self.targets):
            with self._cond:
                self._ending = outcome
                self._cond.notify_all()
                drained = self._wait(lambda: self._ended, deadline)
        with self._cond:
            self._stop = True
            left = len(self._queue) + self._hand
            self._queue.clear()
            self._hand = 0
            if left:
                self._not_forwarded(left, overflow=False)
            if not drained:
                busy = f": {self._busy} had not returned" if self._busy else ""
                self._close_note = (
                    "the forwarding thread had stopped"
                    if self._died is not None
                    else f"close() stopped waiting after forward_timeout={timeout} s{busy}"
                )
            self._cond.notify_all()
        # An idle thread ends at once; one stuck in a forwarder is a daemon
        # and is not waited for.
        self.thread.join(1.0 if drained else 0.0)

    def problems(self) -> str | None:
        """What went wrong since the last call, as one message, or None."""
        parts = []
        with self._cond:
            overflowed, self._overflowed = self._overflowed, 0
            abandoned, self._abandoned = self._abandoned, 0
            note, self._close_note = self._close_note, ""
            died, self._died_unreported = self._died_unreported, None
            failed = []
            for t in self.targets:
                if t.failures:
                    failed.append((t, t.failures, t.first_error))
                    t.failures, t.first_error = 0, None
        if overflowed:
            parts.append(
                f"{overflowed} record(s) were not forwarded (the forwarders fell "
                f"{self.max_pending} records behind and the oldest were dropped)"
            )
        if abandoned:
            parts.append(
                f"{abandoned} record(s) were not forwarded ({note or 'offered after close()'})"
            )
        elif note:
            parts.append(note)
        if died is not None:
            parts.append(f"the forwarding thread stopped: {died!r}")
        for t, n, first in failed:
            parts.append(f"forwarder {t.name()} failed {n} time(s), first: {first!r}")
        if not parts:
            return None
        return "pmaptap forwarding: " + "; ".join(parts) + ". The tap file holds every record."
