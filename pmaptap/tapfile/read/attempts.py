"""Attempts of a resumed run: which records a later attempt superseded
(docs/api.md: per step_key, the latest attempt's records only; meta
records stay)."""

from __future__ import annotations

import os
from typing import Any, Callable, TypeVar

from pmaptap.tapfile import source
from pmaptap.tapfile.record import META_ATTEMPT, parse_line, step_key

# The meta record a resumed session writes when it opens (process 0 only).
ATTEMPT_NAME = META_ATTEMPT


def attempt_of(r: dict) -> int:
    a = r.get("attempt", 0)
    return a if isinstance(a, int) and not isinstance(a, bool) else 0


class Attempts:
    """``add`` every record (any order); then ``superseded(r)``. Holds an
    int per step a resumed attempt wrote."""

    def __init__(self) -> None:
        self._latest: dict[tuple, int] = {}

    def add(self, r: dict) -> None:
        a = attempt_of(r)
        if a and r.get("kind") != "meta":
            key = step_key(r)
            if a > self._latest.get(key, 0):
                self._latest[key] = a

    def __bool__(self) -> bool:
        return bool(self._latest)

    def superseded(self, r: dict) -> bool:
        if not self._latest or r.get("kind") == "meta":
            return False
        return self._latest.get(step_key(r), 0) > attempt_of(r)


def scan(path: str | os.PathLike) -> Attempts:
    """The Attempts of a file: only lines that mention ``"attempt"`` are
    parsed (a file never resumed costs one read of its bytes)."""
    idx = Attempts()
    run = source.Run.of(path)
    if run.url:  # an object-store run (tapfile/source/run.py): its merged stream, read once
        for _, d, _ in source.iter_lines(run):
            if d is not None and "attempt" in d:
                idx.add(d)
        return idx
    # Attempts.add takes records in any order: each file on its own, no merge.
    for f in source.sources(run) if run.sharded else [run]:
        _scan_file(idx, f)
    return idx


T = TypeVar("T")


def latest(
    path: str | os.PathLike,
    read: Callable[["Attempts | None"], T],
    resumed: "Callable[[T], bool] | None" = None,
    attempts: "Attempts | None" = None,
) -> T:
    """``read(attempts)``; with ``attempts`` None, assuming no resume, read
    again after ``scan`` where it was (``resumed``; by default: got None)."""
    got = read(attempts)
    if attempts is None and (got is None if resumed is None else resumed(got)):
        return read(scan(path))
    return got


def _scan_file(idx: Attempts, path: str | os.PathLike) -> None:
    with open(path, "rb") as f:
        # Blocks of whole lines (an over-long one never held); only a block
        # that mentions "attempt" is looked at line by line.
        while (block := source.read_block(f, _SCAN_BYTES)) is not None:
            buf, last = block
            if _may_hold_attempt(buf):
                for raw in buf.split(b"\n"):
                    if _may_hold_attempt(raw):
                        d, _ = parse_line(raw)
                        if d is not None:
                            idx.add(d)
            if last is not None and last[0] is not None:  # a last line without newline
                idx.add(last[0])


_SCAN_BYTES = 1 << 20


def _may_hold_attempt(raw: bytes) -> bool:
    """Whether a line (or block) may hold an ``attempt`` key: spelled as is,
    or with a ``\\uXXXX`` escape, which JSON allows in any key and the parser
    reads as the same key (the only escape that stands for a letter)."""
    return b'"attempt"' in raw or b"\\u" in raw


class Restarts:
    """Per run: each attempt's first step, for ``summary``."""

    def __init__(self) -> None:
        self._runs: dict[Any, dict[int, int | None]] = {}

    def add(self, r: dict) -> None:
        a = attempt_of(r)
        if r.get("kind") == "meta" and (r.get("name") != ATTEMPT_NAME or not a):
            return
        step = r.get("step") if r.get("kind") != "meta" else None
        _first_step(self._runs.setdefault(r.get("run"), {}), a, step)

    def absorb(self, other: Restarts) -> None:
        """Add what another Restarts saw (of another piece of the stream)."""
        for run, theirs in other._runs.items():
            firsts = self._runs.setdefault(run, {})
            for a, step in theirs.items():
                _first_step(firsts, a, step)

    def text(self, run: Any) -> str:
        """ "2 attempts; restarted at step 5" (or "" for one attempt)."""
        firsts = self._runs.get(run) or {}
        later = sorted(a for a in firsts if a > 0)
        if not later:
            return ""
        steps = [firsts[a] for a in later]
        shown = ", ".join("?" if s is None else str(s) for s in steps)
        n = len(later) + 1
        return f"{n} attempts; restarted at step{'s' if len(steps) > 1 else ''} {shown}"


def _first_step(firsts: dict[int, int | None], a: int, step: int | None) -> None:
    """Attempt ``a`` wrote ``step`` (None: its meta record, no step)."""
    old = firsts.setdefault(a, step)
    if step is not None and (old is None or step < old):
        firsts[a] = step
