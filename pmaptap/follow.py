"""Reading a tap file while writers append to it (``pmaptap tail -f``).

Writers append whole lines with one ``write`` under a lock (sink.py), but a
reader takes no lock, so it can see a line that is still being written, and a
killed writer leaves a torn line that the next writer terminates with a
newline. So bytes after the last newline are held back until their newline
arrives; only then is the line parsed (and reported if it is not a record).
"""
from __future__ import annotations

import os
import threading
from typing import Iterator

from .reader import parse_line

_CHUNK = 1 << 20


class LineFollower:
    """Complete lines of ``path`` from the start, then as they are appended.

    ``poll()`` yields the (line number, bytes) of lines completed since the
    last call, a chunk at a time so a large file is never held in memory
    (consume it fully: a chunk's offset is committed when it is read). A file that is replaced (new inode) or truncated is read again
    from its start, since its old offsets mean nothing any more.
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


def follow(path: str | os.PathLike, stop: threading.Event, *,
           interval: float = 0.2) -> Iterator[list[tuple[int, dict | None, str | None]]]:
    """Batches of parsed (line, record or None, problem or None), one batch
    per poll, until ``stop`` is set. Empty batches are yielded too, so the
    caller can check its own limits (time, record count) between polls."""
    lf = LineFollower(path)
    try:
        while not stop.is_set():
            batch = []
            for lineno, raw in lf.poll():
                d, problem = parse_line(raw)
                batch.append((lineno, d, problem))
            yield batch
            stop.wait(interval)
    finally:
        lf.close()
