"""Where finished records go: a small writer interface (write/close) with a
shared-file implementation and a console implementation.

``FileSink`` appends whole lines to one file shared by every process of a job.
Each batch is encoded outside the lock, then written with a single
``os.write`` on an ``O_APPEND`` descriptor while holding
``FileLock(path + ".lock")``: no line is torn or interleaved by another
process. A writer killed mid-line leaves a file that does not end in a
newline; the next batch (from any process) starts with one, so at most that
torn line is lost. The lock only waits ``lock_timeout`` per attempt: a stuck
holder makes ``write`` raise ``LockBusy`` and the pipeline retries later
while taps keep returning.
"""
from __future__ import annotations

import abc
import errno
import os
import sys
from typing import Sequence

import filelock

from .errors import TapError
from .records import Record
from .xdedup import CrossProcessIndex


class LockBusy(Exception):
    """The shared lock was not acquired in time; retry, this is not an error."""


class Sink(abc.ABC):
    @abc.abstractmethod
    def write(self, records: Sequence[Record]) -> None:
        """Write all of ``records`` or raise (then none or all were written)."""

    def close(self) -> None:
        pass


def prepare_path(path: str) -> str:
    """Create parent directories and the file; raise TapError with the reason.

    Called at Session.open() so path problems surface there, not later.
    """
    path = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(path)
    try:
        os.makedirs(parent, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as e:
        raise TapError(f"cannot create the directory for tap file {path!r}: a "
                       f"parent component is a file ({e}). Choose another path.",
                       path=path) from e
    except PermissionError as e:
        raise TapError(f"cannot create the directory for tap file {path!r}: "
                       f"permission denied ({e}).", path=path) from e
    if os.path.isdir(path):
        raise TapError(f"tap file {path!r} is a directory; give a file path "
                       "such as 'taps/run.jsonl'.", path=path)
    for target, what in ((path, "tap file"), (path + ".lock", "lock file")):
        try:
            fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
            os.close(fd)
        except OSError as e:
            hint = ("the directory is not writable" if e.errno in
                    (errno.EACCES, errno.EPERM, errno.EROFS) else e.strerror)
            raise TapError(f"cannot open {what} {target!r} for appending: {hint}"
                           f" ({e}). pmaptap needs write access to the file "
                           "and its directory.", path=path) from e
    return path


class FileSink(Sink):
    def __init__(self, path: str, *, lock_timeout: float = 1.0) -> None:
        self.path = prepare_path(path)
        self.lock_timeout = lock_timeout
        # O_RDWR so the tail byte can be read for torn-line repair;
        # O_APPEND so every write lands at the end whatever others wrote.
        self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
        self._lock = filelock.FileLock(self.path + ".lock", timeout=lock_timeout)
        self.index = CrossProcessIndex()
        # Bytes before this offset were already indexed (or predate us).
        self._seen = os.fstat(self._fd).st_size
        self.lines_written = 0
        self.bytes_written = 0
        self.repairs = 0

    def write(self, records: Sequence[Record]) -> None:
        if not records:
            return
        # Encode outside the lock; only the dedup decision needs it.
        encoded = {id(r): r.encode() for r in records}
        try:
            self._lock.acquire(timeout=self.lock_timeout)
        except filelock.Timeout as e:
            raise LockBusy(str(e)) from None
        try:
            size = os.fstat(self._fd).st_size
            if size > self._seen:
                self.index.observe(os.pread(self._fd, size - self._seen, self._seen))
            keep, new_keys = self.index.plan(records)
            data = b"".join(encoded.get(id(r)) or r.encode() for r in keep)
            if data and size and os.pread(self._fd, 1, size - 1) != b"\n":
                data = b"\n" + data   # a killed writer left a torn line
                self.repairs += 1
            try:
                view = memoryview(data)
                while view:
                    n = os.write(self._fd, view)
                    view = view[n:]
            except OSError:
                # A partial batch (disk full, EFBIG) would leave a torn line
                # and half a batch; we hold the lock, so cut back to where
                # we started and let the pipeline retry the whole batch.
                try:
                    os.ftruncate(self._fd, size)
                except OSError:
                    pass
                raise
            self.index.commit(new_keys)
            self._seen = size + len(data)
        finally:
            self._lock.release()
        self.lines_written += len(keep)
        self.bytes_written += len(data)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def format_console(r: Record) -> str:
    parts = [f"[pmaptap] {r.name} step={r.step} process={r.process}"]
    if r.kind == "per_device":
        parts.append(f"device={r.device}")
        parts.extend(f"{k}={v}" for k, v in (r.coords or {}).items())
    elif r.kind == "replicated":
        parts.append(f"replicas={r.replicas}")
    if r.divergent:
        parts.append("DIVERGENT")
    if r.pass_ != "forward":
        parts.append(f"pass={r.pass_}")
    text = " ".join(parts)
    value = r.value if r.kind != "meta" else r.extra
    shown = str(value)
    if len(shown) > 200:
        shown = shown[:197] + "..."
    return f"{text}: {shown}"


class ConsoleSink(Sink):
    """No open session: one readable line per record on stderr."""

    def __init__(self, stream=None) -> None:
        self.stream = stream

    def write(self, records: Sequence[Record]) -> None:
        stream = self.stream or sys.stderr
        stream.write("".join(format_console(r) + "\n" for r in records))
        stream.flush()
