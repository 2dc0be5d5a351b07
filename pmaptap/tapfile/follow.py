"""``pmaptap tail [-f]``: reading a tap file while writers append to it.

Writers append whole lines with one ``write`` under a lock (sink.py), but a
reader takes no lock, so it can see a line that is still being written, and a
killed writer leaves a torn line that the next writer terminates with a
newline. So bytes after the last newline are held back until their newline
arrives; only then is the line parsed (and reported if it is not a record).
"""
from __future__ import annotations

import argparse
import collections
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterator

from pmaptap.tapfile import parse, views
from pmaptap.tapfile.parse import parse_line
from pmaptap.tapfile.format import decode_record

PROG = "pmaptap"

_CHUNK = 1 << 20


class LineFollower:
    """Complete lines of ``path`` from the start, then as they are appended.

    ``poll()`` yields the (line number, bytes) of lines completed since the
    last call, a chunk at a time so a large file is never held in memory
    (consume it fully: a chunk's offset is committed when it is read). A
    file that is replaced (new inode) or truncated is read again from its
    start, since its old offsets mean nothing any more.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self._f = None
        self._ino: int | None = None
        self._pos = 0
        self._partial = b""
        self.lineno = 0
        self.restarted = 0

    def _open(self) -> bool:
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            return False
        self._f = f
        self._ino = os.fstat(f.fileno()).st_ino
        self._pos, self._partial, self.lineno = 0, b"", 0
        return True

    def _check_replaced(self) -> None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return          # removed: keep what we have, wait for it to return
        if st.st_ino != self._ino or st.st_size < self._pos:
            self.close()
            self.restarted += 1
            self._open()

    def poll(self) -> Iterator[tuple[int, bytes]]:
        if self._f is None and not self._open():
            return
        self._check_replaced()
        if self._f is None:
            return
        while True:
            self._f.seek(self._pos)
            chunk = self._f.read(_CHUNK)
            if not chunk:
                return
            self._pos += len(chunk)
            pieces = (self._partial + chunk).split(b"\n")
            self._partial = pieces.pop()   # b"" when the chunk ended a line
            if len(self._partial) > parse.MAX_LINE_BYTES:
                # Keep one byte past the limit, enough for parse_line to
                # report the line as too long once its newline comes: memory
                # stays bounded whatever a line's length.
                self._partial = self._partial[: parse.MAX_LINE_BYTES + 1]
            for raw in pieces:
                self.lineno += 1
                yield self.lineno, raw

    @property
    def exists(self) -> bool:
        return self._f is not None

    @property
    def pending(self) -> bytes:
        """Bytes of a line not yet terminated (torn, or being written)."""
        return self._partial

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def tail(args: argparse.Namespace, flt: views.Filter) -> int:
    """``pmaptap tail``: the last ``args.lines`` matching records, then with
    ``args.follow`` every new one until a signal, the timeout or the count."""
    lf = LineFollower(args.file)
    try:
        return _tail(args, flt, lf)
    finally:
        if lf.pending:
            print(f"{PROG} tail: the last line is unterminated "
                  f"({len(lf.pending)} bytes: being written, or torn)",
                  file=sys.stderr)
        lf.close()


def _tail(args: argparse.Namespace, flt: views.Filter, lf: LineFollower) -> int:
    # Initial part: keep only the last N matches, so a large file is streamed.
    last: collections.deque = collections.deque(maxlen=max(args.lines, 0))
    for lineno, raw in lf.poll():
        d, _ = parse_line(raw)
        if d is not None:
            rec = decode_record(d)
            if flt(rec):
                last.append(views.Entry(lineno, d, rec))
    printer = _TailPrinter(args)
    printer.emit(list(last))
    if not args.follow or printer.done:
        return 0
    stop = threading.Event()
    restore = _on_stop_signals(stop.set)
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    try:
        while not stop.is_set() and not printer.done:
            batch = []
            for lineno, raw in lf.poll():
                d, problem = parse_line(raw)
                if d is None:
                    if problem != "empty line":
                        print(f"{PROG} tail: line {lineno}: {problem} (skipped)",
                              file=sys.stderr)
                    continue
                rec = decode_record(d)
                if flt(rec):
                    batch.append(views.Entry(lineno, d, rec))
            printer.emit(batch)
            wait = args.interval
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
                if wait <= 0:
                    break
            stop.wait(wait)
    finally:
        restore()
    return 0


class _TailPrinter:
    """Prints tail output; columns are fitted to the first rows and then only
    grow (with room for typical values), since later rows are unknown."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.json = args.json
        self.follow = args.follow
        self.width = args.width
        self.max = args.max_records
        self.count = 0
        self.table: views.Table | None = None

    @property
    def done(self) -> bool:
        return bool(self.max) and self.count >= self.max

    def emit(self, entries: list[views.Entry]) -> None:
        if self.max:
            entries = entries[: max(self.max - self.count, 0)]
        if not entries:
            return
        self.count += len(entries)
        if self.json:
            for e in entries:
                print(views.json_line(e))
        else:
            rows = [views.row(e, self.width) for e in entries]
            if self.table is None:
                self.table = views.Table()
                if self.follow:
                    # Room for rows not seen yet, so columns rarely shift.
                    self.table.widths.update(line=6, name=10, step=6,
                                             device=6, value=12)
                self.table.fit(rows)
                print(self.table.header())
            for r in rows:
                print(self.table.format(r))
        # Piped output is block-buffered: follow mode must show rows now.
        sys.stdout.flush()


def _on_stop_signals(callback: Callable[[], None]) -> Callable[[], None]:
    """Ctrl-C / SIGTERM end ``tail -f`` cleanly (no traceback, exit 0):
    the handler only sets a flag that the poll loop checks."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous: dict[int, Any] = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, lambda signum, frame: callback())

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return restore
