"""The write side of array values stored as bytes (format:
tapfile/source/arrays.py; docs/architecture.md, "Array values stored as
bytes").

``BlobFile`` (file and sharded layouts): one append-only file per writer,
``<run>.bytes/p<process>-<writer id>.bin``, only this writer writes it, so
no lock: a process's bytes never wait on another's. The bytes are written
before the lines that point at them, so a writer killed in between leaves
bytes nobody points at, never a line pointing at bytes that are not there.
The object sink puts one such object per batch (``objects_blob``). A batch
retried after a failed line write keeps its references (RawArray.ref): a
value's bytes are written once.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from typing import Iterable, Sequence

from pmaptap.tapfile.record import RawArray, Record, has_raw, raw_leaves
from pmaptap.tapfile.source import bytes_dir, npy_chunks, run_root

_IOV_MAX = 1024  # buffers per writev(2) call: Linux's UIO_MAXIOV
_last_ms = 0
_ms_lock = threading.Lock()


def new_writer_id() -> str:
    """Start time (ms) and a random token: a restarted process never
    appends to (or overwrites) an earlier writer's file, and sorts after it.
    The time is later than any earlier writer's of this process (two opened
    within a millisecond would sort by their token, and a follower listing
    after the first one's objects would miss the second's)."""
    global _last_ms
    with _ms_lock:
        _last_ms = max(int(time.time() * 1000), _last_ms + 1)
        return f"{_last_ms:013d}-{secrets.token_hex(3)}"


def unstored(records: Iterable[Record]) -> list[RawArray]:
    """The RawArray leaves of ``records`` that have no place yet."""
    out: list[RawArray] = []
    for r in records:
        v = r.value
        if type(v) is RawArray:
            if v.ref is None:
                out.append(v)
        elif type(v) in (dict, list) and type(r.dtype) is not str and has_raw(v, r.dtype):
            out.extend(x for x in raw_leaves(v, r.dtype) if x.ref is None)
    return out


def has_unstored(r: Record) -> bool:
    return bool(unstored((r,)))


class BlobFile:
    """One writer's byte file beside a local run (created on first use)."""

    def __init__(self, run_path: str, process: int, *, sync: bool = False) -> None:
        self.directory = bytes_dir(run_path)
        self.root = run_root(run_path)
        self.name = f"p{int(process):05d}-{new_writer_id()}.bin"
        self.path = os.path.join(self.directory, self.name)
        self.rel = os.path.relpath(self.path, self.root).replace(os.sep, "/")
        # lock="soft" (NFS): fsync before the lines are written, so a host
        # that reads a line also finds its bytes at the server.
        self.sync = sync
        self._fd = -1

    def store(self, raws: Sequence[RawArray]) -> None:
        """Append the .npy of each of ``raws`` and set their references; all
        or nothing (a failed write is cut back and raises)."""
        if not raws:
            return
        if self._fd < 0:
            os.makedirs(self.directory, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        start = os.fstat(self._fd).st_size
        chunks, refs, off = _npy_parts(raws, self.rel, start)
        try:
            _write_all(self._fd, chunks, off - start)
            if self.sync:
                os.fsync(self._fd)
        except OSError:
            try:
                os.ftruncate(self._fd, start)
            except OSError:
                pass
            raise
        for raw, ref in zip(raws, refs):
            raw.ref = ref

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _write_all(fd: int, chunks: list, want: int) -> None:
    done = 0
    while chunks:
        n = os.writev(fd, chunks[:_IOV_MAX])
        done += n
        # Drop what was written (short writes: keep the rest of a chunk).
        while chunks and n >= _len(chunks[0]):
            n -= _len(chunks[0])
            chunks.pop(0)
        if n:
            chunks[0] = memoryview(chunks[0])[n:]
    assert done == want, (done, want)


def _len(c) -> int:
    return len(c) if isinstance(c, bytes) else c.nbytes


def object_blob(raws: Sequence[RawArray], rel: str) -> tuple[bytes, list[dict]]:
    """One object holding the .npy of each of ``raws``, and their references
    into it (``rel``: the object's name relative to the run's directory);
    the caller sets them once the object is stored."""
    parts, refs, _ = _npy_parts(raws, rel, 0)
    return b"".join(parts), refs


def _npy_parts(raws: Sequence[RawArray], rel: str, off: int) -> tuple[list, list[dict], int]:
    """The .npy pieces of ``raws`` written from byte ``off`` of file
    ``rel``, each one's reference there, and the end offset."""
    parts: list = []
    refs = []
    for raw in raws:
        chunk = npy_chunks(raw)
        n = sum(_len(p) for p in chunk)
        parts += chunk
        refs.append({"file": rel, "offset": off, "nbytes": n})
        off += n
    return parts, refs, off
