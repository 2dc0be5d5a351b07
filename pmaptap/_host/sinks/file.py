"""The shared-file sink (the interface every sink implements is in base.py).

``FileSink`` appends whole lines to one file shared by every process of a
job: each batch encoded outside the lock, then one ``os.writev`` on an
``O_APPEND`` descriptor under ``FileLock(path + ".lock")``, so no line is
torn or interleaved by another process; a torn last line (a killed writer)
gets a newline before the next batch. The lock waits ``lock_timeout`` per
attempt: a stuck holder makes ``write`` raise ``LockBusy`` and the pipeline
retries while taps keep returning. The cross-process dedup indexes from the
run's start in the file (``index_from``; docs/architecture.md, "A late
opener knows what the others wrote"). A file truncated, replaced or removed
under a running job is noticed under the lock before each batch and written
to as it now is (docs/faults.md, "Faults").
"""

from __future__ import annotations

import errno
import os
from typing import Sequence

import filelock

from pmaptap import distributed
from pmaptap._host.sinks.base import Sink, prepare_path
from pmaptap._host.sinks.blobs import BlobFile
from pmaptap._host.sinks.crossdedup import CrossProcessIndex
from pmaptap._log import log
from pmaptap.errors import LockBusy, TapError
from pmaptap.tapfile.record import MAX_LINE_BYTES, Record

# Bytes just before the sink's last offset that it remembers: different bytes
# there mean the file was truncated and written again past that offset. 1 KiB
# holds a whole ordinary line, and the tail of any line holds its process and
# time (written after the value), so a regrown file differs there.
_MARK_BYTES = 1024
# Bytes read back per pread when indexing what others appended.
_READ_CHUNK = 16 << 20

LOCK_MODES = ("flock", "soft")
# errnos by which flock says "this filesystem cannot do that" (Lustre mounted
# without -o flock, some FUSE and NFS setups), as opposed to contention.
_NO_FLOCK_ERRNOS = frozenset({errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP})


class FileSink(Sink):
    """Appends record batches to the shared file under a cross-process lock.

    lock="flock" (default): ``filelock.FileLock(path + ".lock")`` and one
    ``O_APPEND`` descriptor kept open: the processes of one host.
    lock="soft": ``filelock.SoftFileLock(path + ".softlock")``, the file
    re-opened per batch (why: docs/multihost.md, "Where the file may live";
    O_APPEND with a client's cached size could overwrite another's bytes).
    """

    def __init__(
        self,
        path: str,
        *,
        lock_timeout: float = 1.0,
        lock: str = "flock",
        process: int | None = None,
        index_existing: bool = False,
    ) -> None:
        # Validated once, where users pass it (Session).
        assert lock in LOCK_MODES, lock
        self.path = prepare_path(path)
        self.lock_timeout = lock_timeout
        self.lock_mode = lock
        if lock == "flock":
            # O_RDWR so the tail byte can be read for torn-line repair;
            # O_APPEND so every write lands at the end whatever others wrote.
            self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
            # No silent soft fallback where flock is missing: filelock would
            # take the pre-created, empty lock file for a marker held forever.
            self._lock = filelock.FileLock(
                self.path + ".lock", timeout=lock_timeout, fallback_to_soft=False
            )
            st = os.fstat(self._fd)
        else:
            self._fd = -1  # opened per batch, under the lock
            self._lock = filelock.SoftFileLock(self.path + ".softlock", timeout=lock_timeout)
            st = os.stat(self.path)
        size = st.st_size
        # The file this sink writes to, to notice one put in its place.
        self._ident = (st.st_dev, st.st_ino)
        self.process = distributed.process_index(process)
        self.index = CrossProcessIndex(self.process)
        # The file's size when this sink opened it: where this process's part
        # of the run starts at the earliest (see index_from).
        self.opened_size = size
        # Bytes before this offset were already indexed (or predate us).
        # index_existing: a writer joining a run late (pmaptap.Writer) dedups
        # against what is already there, read at its first batch.
        self._seen = 0 if index_existing else size
        # _seen may fall inside a line (index_from): skip to its end first.
        self._mid_line = False
        self._mark = (
            b""
            if index_existing
            else self._read_mark(self._fd, size)
            if lock == "flock"
            else self._read_mark_at(self.path, size)
        )
        self.lines_written = 0
        self.bytes_read = 0  # others' lines read back for the dedup
        self.truncations = 0
        self.replacements = 0
        self._warned: set[str] = set()
        # Records that could not be encoded since the pipeline last looked
        # (see _encode); the pipeline reports them as a TapError.
        self.rejected: list[str] = []

    def write(self, records: Sequence[Record]) -> list[Record]:
        """Append ``records`` (all or none; raises otherwise) and return the
        ones actually written: cross-process dedup skips replicated values
        another process wrote (their positions in ``left``), and unencodable
        ones are replaced."""
        self.left = []
        if not records:
            return []
        # Encode outside the lock; only the dedup decision needs it. Stored
        # values of replicated records wait for it: another process may
        # have written the value already, and then its bytes are not needed.
        encoded, records = self._encode(records, defer_replicated=True)
        self._read_ahead()
        self._acquire()
        soft = self.lock_mode == "soft"
        fd = -1
        try:
            # soft: a fresh descriptor per batch (close-to-open, see above)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666) if soft else self._current_fd()
            st = os.fstat(fd)
            size = st.st_size
            self._check_same_file(fd, st)
            if size > self._seen:
                self._catch_up(fd, size)
            left: list[int] = []
            keep, new_keys = self.index.plan(records, left)
            if any(id(r) not in encoded for r in keep):
                keep = self._encode_deferred(keep, encoded)
            # A list of lines, not one joined buffer: writev hands them to
            # the kernel without first copying megabytes into a new bytes
            # object (a copy that showed even for small per-device taps).
            chunks = [encoded.get(id(r)) or r.encode() for r in keep]
            if chunks and size and os.pread(fd, 1, size - 1) != b"\n":
                chunks.insert(0, b"\n")  # a killed writer left a torn line
            written = self._append(fd, size, chunks, soft)
            self.index.commit(new_keys)
            # flock: where O_APPEND put our bytes, which is past ``size`` if a
            # program that takes no lock (echo >> file) appended meanwhile.
            self._seen = os.lseek(fd, 0, os.SEEK_CUR) if written and not soft else size + written
            if written:
                self._mark = _tail(self._mark, chunks)
        finally:
            if soft and fd >= 0:
                os.close(fd)
            self._lock.release()
        self.left = left
        self.lines_written += len(keep)
        return keep

    def close(self) -> None:
        super().close()
        # The lock object dropped now rather than at interpreter exit, where
        # the finalizer of some filelock releases (4.0.x) reads module
        # globals that teardown has already cleared and prints a traceback.
        # Nothing writes through a closed sink (the pipeline closes it last).
        self._lock = None  # type: ignore[assignment]

    def index_from(self, offset: int) -> None:
        """Index, at the next batch, every line appended since ``offset``, where
        the job's processes agreed this run starts (``distributed.session_start``;
        docs/architecture.md, "A late opener knows what the others wrote"). Call
        before the first ``write``."""
        if offset > self.opened_size or offset < 0:
            # Not this file's offset (it was truncated or replaced between
            # the first process's open and ours): all of this file is new.
            offset = 0
        if offset >= self._seen:
            return
        self._seen = offset
        self._mark = (
            self._read_mark(self._fd, offset)
            if self.lock_mode == "flock"
            else self._read_mark_at(self.path, offset)
        )
        self._mid_line = bool(offset) and not self._mark.endswith(b"\n")

    def _read_ahead(self) -> None:
        """Index a long stretch that others appended (a late opener's
        catch-up, a writer that fell far behind) *before* taking the lock,
        so the other writers do not wait while this one reads: lines already
        in the file never change (it is append-only, under the lock), and a
        truncation meanwhile is caught under the lock by the mark. Whole
        lines only; the rest is read under the lock as usual. flock mode
        only: on NFS (soft) only the lock holder's view of the file is
        trusted."""
        if self.lock_mode != "flock":
            return
        try:
            size = os.fstat(self._fd).st_size
        except OSError:
            return
        if size - self._seen > _READ_CHUNK:
            self._catch_up(self._fd, size, whole_lines=True)

    def _catch_up(self, fd: int, size: int, whole_lines: bool = False) -> None:
        """Index the lines others appended between ``_seen`` and ``size``, a
        bounded chunk at a time (a late opener may have megabytes to read),
        never splitting a line between two chunks. ``whole_lines``: leave a
        partial last line (and ``_seen`` before it) for the next call."""
        pos, carry = self._seen, b""
        while pos < size:
            data = os.pread(fd, min(_READ_CHUNK, size - pos), pos)
            if not data:
                break  # cut under us by a program that takes no lock
            self.bytes_read += len(data)
            pos += len(data)
            buf = carry + data
            if self._mid_line:  # the rest of a line begun before _seen
                cut = buf.find(b"\n")
                skip = len(buf) if cut < 0 else cut + 1
                self._mid_line = cut < 0
                self._mark = (self._mark + buf[:skip])[-_MARK_BYTES:]
                self._seen = pos - len(buf) + skip
                buf = buf[skip:]
            # Whole lines now; a partial last one waits for the next chunk
            # (unless it is already longer than any line a reader keeps).
            last = pos >= size and not whole_lines
            cut = len(buf) if last else buf.rfind(b"\n") + 1
            if len(buf) - cut > MAX_LINE_BYTES:
                cut = len(buf)
            start = pos - len(buf)
            self._observe(buf[:cut], start)
            carry = buf[cut:]
            self._seen = start + cut
            self._mark = (self._mark + buf[:cut])[-_MARK_BYTES:]

    # ------------------------------------------ the file under our feet
    def _current_fd(self) -> int:
        """flock mode's descriptor, re-opened on the file now at the path if
        that is another file (moved away and recreated) or none (removed:
        created again, as at open)."""
        try:
            st = os.stat(self.path)
            same = (st.st_dev, st.st_ino) == self._ident
        except FileNotFoundError:
            same = False
        if not same:
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
            os.close(self._fd)
            self._fd = fd
        return self._fd

    def _check_same_file(self, fd: int, st: os.stat_result) -> None:
        """Is ``fd`` (the file now at the path) the file this sink last saw,
        holding what it saw? If not, start over on it: read it from byte 0
        for the dedup, forget what the old file held."""
        ident = (st.st_dev, st.st_ino)
        if ident != self._ident:
            self._ident = ident
            self.replacements += 1
            self._restart(
                "replaced",
                f"{self.path!r} was replaced (moved away "
                "or removed, and created again) under this writer",
            )
        elif st.st_size < self._seen or (
            self._seen and self._read_mark(fd, self._seen) != self._mark
        ):
            self.truncations += 1
            self._restart(
                "truncated",
                f"{self.path!r} was truncated (now "
                f"{st.st_size} bytes; this writer had seen "
                f"{self._seen}) or rewritten under this writer",
            )

    def _restart(self, kind: str, what: str) -> None:
        self._seen, self._mark, self._mid_line = 0, b"", False
        self.index.reset()
        self._warn_once(
            kind,
            f"pmaptap: {what}. Appending continues to the "
            "file now at that path: records written before are "
            "wherever that file went, nothing still queued is "
            "lost. (Warned once per writer; counted in "
            f"FileSink.{'replacements' if kind == 'replaced' else 'truncations'}.)",
        )

    def _observe(self, data: bytes, offset: int) -> None:
        before = self.index.corrupt
        self.index.observe(data, offset)
        if self.index.corrupt > before and self.index.first_corrupt:
            where, why = self.index.first_corrupt
            self._warn_once(
                "corrupt",
                (
                    f"pmaptap: {self.path!r} holds a line that is not a pmaptap "
                    f"record at byte offset {where} ({why}); it was skipped for "
                    "the cross-process dedup and costs nothing else (readers "
                    "skip and report it; 'pmaptap validate' lists every bad "
                    "line). Further ones are counted in FileSink.corrupt_lines."
                ),
            )

    @property
    def corrupt_lines(self) -> int:
        return self.index.corrupt

    def _warn_once(self, kind: str, message: str) -> None:
        if kind in self._warned:
            return
        self._warned.add(kind)
        try:
            log.warning(message)
        except Exception:  # noqa: BLE001 - a raising handler of the
            pass  # application's: a warning must never cost a write

    @staticmethod
    def _read_mark(fd: int, end: int) -> bytes:
        start = max(0, end - _MARK_BYTES)
        return os.pread(fd, end - start, start)

    @staticmethod
    def _read_mark_at(path: str, end: int) -> bytes:
        fd = os.open(path, os.O_RDONLY)
        try:
            return FileSink._read_mark(fd, end)
        finally:
            os.close(fd)

    def _blob_file(self) -> BlobFile:
        return BlobFile(self.path, self.process, sync=self.lock_mode == "soft")

    def _encode_deferred(self, keep: list[Record], encoded: dict) -> list[Record]:
        """Store and encode the deferred records the dedup kept (under the
        lock; ``encoded`` gains their lines); ``keep`` with any unencodable
        one replaced."""
        out = []
        for r in keep:
            if id(r) in encoded:
                out.append(r)
                continue
            lines, (r2,) = self._encode([r])
            encoded.update(lines)
            out.append(r2)
        return out

    def _acquire(self) -> None:
        try:
            # flock: a retry is one cheap system call, and filelock's 50 ms
            # default starved contending writers. soft: each retry is a file
            # creation on the (NFS) server, so keep the default there.
            self._lock.acquire(
                timeout=self.lock_timeout,
                poll_interval=0.005 if self.lock_mode == "flock" else 0.05,
            )
        except filelock.Timeout as e:
            raise LockBusy(self._busy_message(e)) from None
        except OSError as e:
            if self.lock_mode == "flock" and e.errno in _NO_FLOCK_ERRNOS:
                raise TapError(
                    f"cannot lock {self.path + '.lock'!r}: this filesystem does "
                    f"not support flock ({e}). Use pmaptap.Session(path, "
                    "lock='soft') on NFS, Lustre and other shared filesystems.",
                    path=self.path,
                ) from e
            raise

    def _busy_message(self, e: BaseException) -> str:
        if self.lock_mode != "soft":
            return str(e)
        # SoftFileLock's marker starts with the holder's pid and host lines.
        try:
            with open(self._lock.lock_file, encoding="utf-8", errors="replace") as f:
                pid, host = (f.read(512).split("\n") + ["", ""])[:2]
        except OSError:
            pid = host = ""
        who = f" (held by pid {pid} on host {host!r})" if pid else ""
        return (
            f"{e}{who}. If that process is gone from another host, remove {self._lock.lock_file!r}."
        )


def _tail(mark: bytes, chunks: Sequence[bytes]) -> bytes:
    """The last _MARK_BYTES of ``mark`` followed by ``chunks``."""
    out = b""
    for c in reversed(chunks):
        out = c[-(_MARK_BYTES - len(out)) :] + out
        if len(out) >= _MARK_BYTES:
            return out
    return (mark + out)[-_MARK_BYTES:]
