"""Live forwarding: ``Session(path, forward=[...])`` hands every record this
process wrote to the file to user code (a logger, a dashboard, a CLU
``MetricWriter``).

The writer thread calls ``Forwarders.offer`` with what ``FileSink.write``
actually appended, i.e. after cross-process dedup, so a replicated loss is
forwarded by exactly one process of the job. ``offer`` only appends
references to a bounded queue: the forwarders run on their own thread, so one
that raises or is slow never delays the file or the training step. When the
queue is full the oldest records are dropped and counted; failures and drops
are reported once, as a TapError at the next ``flush()``/``close()``.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from pmaptap.tapfile.format import Record, decode_record
from pmaptap.tapfile.parse import parse_line
from pmaptap.tapfile.tensorboard import leaves, tag_parts


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
    return decode_record(d)


class _Target:
    """One forwarder and what happened to it since the last report."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj
        self.scalars = getattr(obj, "write_scalars", None)
        self.failures = 0
        self.first_error: BaseException | None = None
        self.failures_total = 0

    def name(self) -> str:
        obj = self.obj
        return getattr(obj, "__qualname__", None) or type(obj).__qualname__

    def deliver(self, dicts: list[dict]) -> None:
        if self.scalars is None:
            for d in dicts:
                self._call(self.obj, d)
            return
        # CLU's protocol writes one step's scalars at a time.
        per_step: dict[int, dict[str, float]] = {}
        for d in dicts:
            for tag, v in scalar_series(d):
                per_step.setdefault(d.get("step"), {})[tag] = v
        for step, mapping in per_step.items():
            self._call(self.scalars, step, mapping)

    def _call(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - counted, reported at flush/close
            self.failures += 1
            self.failures_total += 1
            if self.first_error is None:
                self.first_error = e


class Forwarders:
    """The forwarding thread of one pipeline and its bounded queue."""

    def __init__(
        self, targets: Sequence[Any], *, max_pending: int = 100_000, name: str = "pmaptap-forward"
    ) -> None:
        self.targets = [_Target(t) for t in targets]
        self.max_pending = max_pending
        self._queue: collections.deque[Record] = collections.deque()
        self._cond = threading.Condition()
        self._offered = 0  # records offered (dropped ones included)
        self._done = 0  # records forwarded or dropped
        self._dropped = 0  # since the last report
        self.dropped_total = 0
        self._stop = False
        self.thread = threading.Thread(target=self._run, daemon=True, name=name)
        self.thread.start()

    def offer(self, records: Sequence[Record]) -> None:
        """Called by the writer thread after a successful write: O(records),
        never waits for a forwarder."""
        with self._cond:
            if self._stop:
                self._drop(len(records))
                self._offered += len(records)
                return
            self._queue.extend(records)
            self._offered += len(records)
            over = len(self._queue) - self.max_pending
            if over > 0:
                for _ in range(over):
                    self._queue.popleft()
                self._drop(over)
            self._cond.notify_all()

    def _drop(self, n: int) -> None:
        self._dropped += n
        self.dropped_total += n
        self._done += n

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stop:
                    self._cond.wait()
                if not self._queue and self._stop:
                    return
                batch = list(self._queue)
                self._queue.clear()
            try:
                dicts = [_as_read(r) for r in batch]
                for t in self.targets:
                    t.deliver(dicts)
            except Exception as e:  # noqa: BLE001 - e.g. a record that will not decode
                for t in self.targets:
                    t.failures += 1
                    t.first_error = t.first_error or e
            with self._cond:
                self._done += len(batch)
                self._cond.notify_all()

    def drain(self, timeout: float | None) -> bool:
        """Wait until everything offered so far was forwarded (or dropped)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            target = self._offered
            while self._done < target:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        for t in self.targets:
            # A CLU writer's flush, or a callable forwarder's that buffers
            # (pmaptap.forwarders: a step's metrics wait for the next step).
            fl = getattr(t.obj, "flush", None)
            if callable(fl):
                t._call(fl)
        return True

    def close(self, timeout: float | None) -> None:
        """Forward what is queued (up to ``timeout``), then stop; what is
        still queued then is counted as dropped."""
        self.drain(timeout)
        with self._cond:
            self._stop = True
            left = len(self._queue)
            self._queue.clear()
            self._drop(left)
            self._cond.notify_all()
        self.thread.join(1.0)

    def problems(self) -> str | None:
        """What went wrong since the last call, as one message, or None."""
        parts = []
        with self._cond:
            dropped, self._dropped = self._dropped, 0
        if dropped:
            parts.append(
                f"{dropped} record(s) were not forwarded (the "
                f"forwarders fell {self.max_pending} records behind, "
                "or close() timed out waiting for them)"
            )
        for t in self.targets:
            if t.failures:
                parts.append(
                    f"forwarder {t.name()} failed {t.failures} time(s), first: {t.first_error!r}"
                )
                t.failures, t.first_error = 0, None
        if not parts:
            return None
        return "pmaptap forwarding: " + "; ".join(parts) + ". The tap file holds every record."
