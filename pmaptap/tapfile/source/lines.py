"""The lines of a run (one file, or a sharded run's merged stream) in
batches: the one place that iterates a tap file's lines for every reader."""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Callable, Iterable
from itertools import count, repeat
from typing import Any, BinaryIO, Iterator

from pmaptap.tapfile import record
from pmaptap.tapfile.record import as_dicts, decode_line, parse_line
from pmaptap.tapfile.source import run as runs
from pmaptap.tapfile.source.run import Batch

_SKIP_CHUNK = 1 << 20
# A read that has taken this long shows a progress bar on a terminal.
PROGRESS_DELAY_S = 2.0
# Unused since reads look at the clock once a batch; kept for callers that
# set it.
_PROGRESS_EVERY = 8192


class _ReadProgress:
    """A bar of MiB read once a read has lasted PROGRESS_DELAY_S (docs/cli.md)."""

    def __init__(self, f: BinaryIO, path: str | os.PathLike) -> None:
        self.f = f
        self.path = os.fspath(path)
        self.start = time.monotonic()
        self.bar: Any = None

    def tick(self) -> None:
        if self.bar is None:
            if time.monotonic() - self.start < PROGRESS_DELAY_S:
                return
            from pmaptap.progress import Progress

            self.size = os.fstat(self.f.fileno()).st_size
            # process=0: a reader never asks JAX which process it is.
            self.bar = Progress(
                max(-(-self.size >> 20), 1),
                desc=f"reading {os.path.basename(self.path)}",
                unit="MiB",
                process=0,
                min_interval=0.25,
            )
        if self.bar.enabled:
            self._show(self.f.tell() >> 20)

    def _show(self, mib: int) -> None:
        if mib > self.bar.n:
            self.bar.update(mib - self.bar.n)

    def close(self) -> None:
        if self.bar is not None and self.bar.enabled:
            if self.f.tell() >= self.size:  # read to the end: a full bar
                self._show(self.bar.total)
            self.bar.close()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic collector off while a reader holds many records (no
    cycles among them): it would walk them again and again."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        # Without freeze() + unfreeze() the next pass would walk all of it
        # as young (docs/performance.md); nothing is kept alive.
        gc.freeze()
        gc.unfreeze()
        if enabled:
            gc.enable()


def iter_lines(path: str | os.PathLike) -> Iterator[tuple[int, dict | None, str | None]]:
    """Every line of a run, the record as its line's JSON object."""
    return _flat(iter_record_batches(path))


def parsed(lines: Iterable[tuple[int, bytes]]) -> Iterator[tuple[int, dict | None, str | None]]:
    """``iter_lines``' triples of (line number, bytes) pairs (a follower's)."""
    for lineno, raw in lines:
        yield (lineno, *parse_line(raw))


def records(
    lines: Iterable[tuple[int, Any, str | None]], report: Callable[[int, str], None] | None
) -> Iterator[tuple[int, Any]]:
    """(line number, record) of each of ``iter_lines``' triples that is one;
    the others, blank lines aside, go to ``report(line number, problem)``."""
    for lineno, d, problem in lines:
        if d is not None:
            yield lineno, d
        elif report is not None and problem != "empty line":
            report(lineno, problem or "invalid")


def _flat(batches: Iterator[Batch]) -> Iterator[tuple[int, Any, str | None]]:
    for first, records, problems in batches:
        records = as_dicts(records)
        if not problems:
            yield from zip(count(first), records, repeat(None))
            continue
        for i, d in enumerate(records):
            yield first + i, d, problems.get(first + i)


def iter_record_batches(path: str | os.PathLike) -> Iterator[Batch]:
    """The lines of a run as batches ``(first, records, problems)``."""
    run = runs.Run.of(path)
    return runs.iter_merged(run, read_at) if run.sharded else iter_file_records(run)


# Bytes read per batch: ~300 records, still in the CPU cache (docs/performance.md).
BATCH_BYTES = 1 << 16


def iter_file_records(
    path: str | os.PathLike, start: int = 0, stop: int | None = None
) -> Iterator[Batch]:
    """The lines of one file as batches ``(first, records, problems)``
    (records as Structs or None; problems by line number), only those
    between bytes ``start`` and ``stop`` (line starts), numbered from 1."""
    with open(path, "rb") as f:
        if start:
            f.seek(start)
        progress = _ReadProgress(f, path)
        try:
            lineno = 1
            while True:
                size = BATCH_BYTES if stop is None else min(BATCH_BYTES, stop - f.tell())
                block = read_block(f, size) if size > 0 else None
                if block is None:
                    return
                progress.tick()
                buf, last = block
                records, where = record.decode_block(buf) if buf else ([], {})
                problems = {lineno + i: why for i, why in where.items()} if where else {}
                if last is not None:
                    if last[1] is not None:
                        problems[lineno + len(records)] = last[1]
                    records.append(last[0])
                yield lineno, records, problems
                lineno += len(records)
        finally:
            progress.close()


def read_block(
    f: BinaryIO, size: int
) -> "tuple[bytes, tuple[dict | None, str | None] | None] | None":
    """About ``size`` bytes of whole lines of ``f``: ``(buf, last)``,
    ``last`` the (record, problem) of a line without its newline, or None;
    None at the end. The one home of what only the file shows: over-long
    lines (never held) and torn last lines."""
    limit = record.MAX_LINE_BYTES
    buf = f.read(size)
    if not buf:
        return None
    last: tuple[dict | None, str | None] | None = None
    if buf[-1] != 0x0A:
        # Finish the block's last line (readline stops at its newline, or
        # once the line is over the limit).
        start = buf.rfind(b"\n") + 1
        rest = f.readline(limit + 1 - (len(buf) - start))
        if rest.endswith(b"\n"):
            buf += rest
        else:
            raw = buf[start:] + rest
            buf = buf[:start]
            if len(raw) > limit:
                size = len(raw)
                while chunk := f.readline(_SKIP_CHUNK):  # past the rest of the line
                    size += len(chunk)
                    if chunk.endswith(b"\n"):
                        break
                why = f"{size} bytes or more; readers take at most {limit}"
                last = (None, f"line too long ({why})")
            else:
                # No newline at the end of the file: a writer is still
                # writing this line, or was killed while writing it.
                d, problem = decode_line(raw)
                if problem is not None and problem.startswith("not valid JSON"):
                    problem = "torn last line (no newline)"
                last = (d, problem)
    return buf, last


def read_at(
    path: str, offset: int, size: int
) -> "tuple[bytes, tuple[dict | None, str | None] | None, int]":
    """``read_block`` of ``path`` at ``offset`` and the offset after it."""
    with open(path, "rb") as f:
        f.seek(offset)
        block = read_block(f, size)
        if block is None:
            return b"", None, offset
        buf, last = block
        return buf, last, f.tell()
