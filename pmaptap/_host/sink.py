"""Where finished records go: a small writer interface (write/close) with a
shared-file implementation and a console implementation.

``FileSink`` appends whole lines to one file shared by every process of a job.
Each batch is encoded outside the lock, then written with a single
``os.writev`` of its lines on an ``O_APPEND`` descriptor while holding
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

from pmaptap.errors import LockBusy, TapError, TapPathError
from pmaptap.tapfile.format import Record, encode_line
from pmaptap._host.crossdedup import CrossProcessIndex

_IOV_MAX = 1024    # buffers per writev(2) call: Linux's UIO_MAXIOV



class Sink(abc.ABC):
    @abc.abstractmethod
    def write(self, records: Sequence[Record]) -> None:
        """Write all of ``records`` or raise (then none or all were written)."""

    def close(self) -> None:
        pass


def prepare_path(path: str) -> str:
    """Create parent directories and the file; raise TapPathError (a TapError
    and an OSError) with the reason.

    Called at Session.open() so path problems surface there, not later.
    A symlink is followed to its target, which then gets the data *and* the
    lock file: processes that reach one file through different links must
    share one lock (a lock beside each link would exclude nobody).
    """
    path = os.path.realpath(os.fspath(path))
    parent = os.path.dirname(path)
    try:
        os.makedirs(parent, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as e:
        raise TapPathError(f"cannot create the directory for tap file {path!r}: "
                           f"a parent component is a file ({e}). Choose another "
                           "path.", path=path, errno=e.errno) from e
    except PermissionError as e:
        raise TapPathError(f"cannot create the directory for tap file {path!r}: "
                           f"permission denied ({e}).", path=path,
                           errno=e.errno) from e
    if os.path.isdir(path):
        raise TapPathError(f"tap file {path!r} is a directory; give a file path "
                           "such as 'taps/run.jsonl'.", path=path,
                           errno=errno.EISDIR)
    for target, what in ((path, "tap file"), (path + ".lock", "lock file")):
        try:
            fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
            os.close(fd)
        except OSError as e:
            hint = ("the directory is not writable" if e.errno in
                    (errno.EACCES, errno.EPERM, errno.EROFS) else e.strerror)
            raise TapPathError(f"cannot open {what} {target!r} for appending: "
                               f"{hint} ({e}). pmaptap needs write access to "
                               "the file and its directory.", path=path,
                               errno=e.errno) from e
    return path


LOCK_MODES = ("flock", "soft")
# errnos by which flock says "this filesystem cannot do that" (Lustre mounted
# without -o flock, some FUSE and NFS setups), as opposed to contention.
_NO_FLOCK_ERRNOS = frozenset({errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP})


class FileSink(Sink):
    """Appends record batches to the shared file under a cross-process lock.

    lock="flock" (default): ``filelock.FileLock(path + ".lock")`` (flock(2))
      and one ``O_APPEND`` descriptor kept open. Right for a local disk, i.e.
      for the processes of one host.
    lock="soft": for shared filesystems where flock may not exclude across
      hosts (NFS clients, Lustre without ``-o flock``). The lock is
      ``filelock.SoftFileLock(path + ".softlock")``: a marker file created
      with ``O_CREAT | O_EXCL`` (atomic at an NFSv3+ server) that records pid
      and host. A marker left by a dead process of the same host is
      reclaimed; one left by a crashed host blocks writers until it is
      removed (the LockBusy message names the holder). Each batch re-opens
      the file under the lock, writes at the size the server reports, fsyncs
      and closes before releasing: NFS close-to-open consistency then lets
      the next holder, on any host, see these bytes and append after them
      (O_APPEND with a client's cached size could overwrite them).
    """

    def __init__(self, path: str, *, lock_timeout: float = 1.0,
                 lock: str = "flock", process: int | None = None) -> None:
        if lock not in LOCK_MODES:
            raise ValueError(f"lock must be one of {LOCK_MODES} (\"soft\" for "
                             f"NFS and other shared filesystems), got {lock!r}")
        self.path = prepare_path(path)
        self.lock_timeout = lock_timeout
        self.lock_mode = lock
        if lock == "flock":
            # O_RDWR so the tail byte can be read for torn-line repair;
            # O_APPEND so every write lands at the end whatever others wrote.
            self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT,
                               0o666)
            # No silent soft fallback where flock is missing: filelock would
            # take the pre-created, empty lock file for a marker held forever.
            self._lock = filelock.FileLock(self.path + ".lock",
                                           timeout=lock_timeout,
                                           fallback_to_soft=False)
            size = os.fstat(self._fd).st_size
        else:
            self._fd = -1      # opened per batch, under the lock
            self._lock = filelock.SoftFileLock(self.path + ".softlock",
                                               timeout=lock_timeout)
            size = os.stat(self.path).st_size
        if process is None:
            import jax
            process = jax.process_index()
        self.index = CrossProcessIndex(process)
        # Bytes before this offset were already indexed (or predate us).
        self._seen = size
        self.lines_written = 0
        self.bytes_written = 0
        self.repairs = 0
        # Records that could not be encoded since the pipeline last looked
        # (see _encode); the pipeline reports them as a TapError.
        self.rejected: list[str] = []

    def write(self, records: Sequence[Record]) -> None:
        if not records:
            return
        # Encode outside the lock; only the dedup decision needs it.
        encoded, records = self._encode(records)
        self._acquire()
        soft = self.lock_mode == "soft"
        fd = -1
        try:
            # soft: a fresh descriptor per batch (close-to-open, see above)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666) if soft else self._fd
            size = os.fstat(fd).st_size
            if size > self._seen:
                self.index.observe(os.pread(fd, size - self._seen, self._seen))
            keep, new_keys = self.index.plan(records)
            # A list of lines, not one joined buffer: writev hands them to
            # the kernel without first copying megabytes into a new bytes
            # object (measured ~50 us a step for 8 x 4 KiB per-device taps).
            chunks = [encoded.get(id(r)) or r.encode() for r in keep]
            if chunks and size and os.pread(fd, 1, size - 1) != b"\n":
                chunks.insert(0, b"\n")   # a killed writer left a torn line
                self.repairs += 1
            written = self._append(fd, size, chunks, soft)
            self.index.commit(new_keys)
            self._seen = size + written
        finally:
            if soft and fd >= 0:
                os.close(fd)
            self._lock.release()
        self.lines_written += len(keep)
        self.bytes_written += written

    @staticmethod
    def _append(fd: int, size: int, chunks: list[bytes], soft: bool) -> int:
        """Write ``chunks`` at the end (``size``), all or nothing, and return
        the byte count: a partial batch (disk full, EFBIG) would leave a torn
        line and half a batch, so it is cut back (we hold the lock) and the
        pipeline retries it whole."""
        if len(chunks) > _IOV_MAX:
            # One system call per batch: every call drops the GIL, and taking
            # it back behind busy Python threads costs up to the switch
            # interval (5 ms). Many small lines are joined in runs instead.
            k = -(-len(chunks) // _IOV_MAX)
            chunks = [b"".join(chunks[i:i + k]) for i in range(0, len(chunks), k)]
        offset = size
        try:
            want = sum(map(len, chunks))
            # soft: at the size just read, never a cached one
            n = os.pwritev(fd, chunks, offset) if soft else os.writev(fd, chunks)
            offset += n
            if n < want:   # short write: finish the rest byte-wise
                view = memoryview(b"".join(chunks))[n:]
                while view:
                    n = os.pwrite(fd, view, offset) if soft else os.write(fd, view)
                    view, offset = view[n:], offset + n
            if soft and offset > size:
                os.fsync(fd)   # at the server before we unlock
        except OSError:
            try:
                os.ftruncate(fd, size)
            except OSError:
                pass
            raise
        return offset - size

    def _encode(self, records: Sequence[Record]) -> tuple[dict, list[Record]]:
        """Encode every record. One that cannot be (a str that is not valid
        UTF-8, e.g. a lone surrogate from os.fsdecode in a pytree key) is
        replaced by a ``pmaptap/unencodable`` meta record that names it:
        raising would make the pipeline retry the whole batch forever, and
        nothing queued behind it would ever be written."""
        encoded: dict[int, bytes] = {}
        keep: list[Record] = []
        for r in records:
            try:
                encoded[id(r)] = r.encode()
            except (TypeError, ValueError) as e:   # UnicodeError is a ValueError
                self.rejected.append(f"{ascii(r.name)} step {r.step}: {e}")
                r = Record(run=_utf8(r.run), name="pmaptap/unencodable",
                           step=r.step, kind="meta", value=1, dtype="int64",
                           shape=[], process=r.process, time=r.time,
                           host=_utf8(r.host),
                           extra={"tap": ascii(r.name), "error": str(e)})
                encoded[id(r)] = r.encode()
            keep.append(r)
        return encoded, keep

    def _acquire(self) -> None:
        try:
            # flock: a retry is one cheap system call, and filelock's 50 ms
            # default starved contending writers. soft: each retry is a file
            # creation on the (NFS) server, so keep the default there.
            self._lock.acquire(timeout=self.lock_timeout,
                               poll_interval=0.005 if self.lock_mode == "flock" else 0.05)
        except filelock.Timeout as e:
            raise LockBusy(self._busy_message(e)) from None
        except OSError as e:
            if self.lock_mode == "flock" and e.errno in _NO_FLOCK_ERRNOS:
                raise TapError(
                    f"cannot lock {self.path + '.lock'!r}: this filesystem does "
                    f"not support flock ({e}). Use pmaptap.Session(path, "
                    "lock='soft') on NFS, Lustre and other shared filesystems.",
                    path=self.path) from e
            raise

    def _busy_message(self, e: BaseException) -> str:
        if self.lock_mode != "soft":
            return str(e)
        # SoftFileLock's marker starts with the holder's pid and host lines.
        try:
            with open(self._lock.lock_file, encoding="utf-8",
                      errors="replace") as f:
                pid, host = (f.read(512).split("\n") + ["", ""])[:2]
        except OSError:
            pid = host = ""
        who = f" (held by pid {pid} on host {host!r})" if pid else ""
        return (f"{e}{who}. If that process is gone from another host, "
                f"remove {self._lock.lock_file!r}.")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _utf8(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


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
    # Through JSON so NumPy arrays print as plain lists ([0.5, 1.0]).
    shown = encode_line({"v": value}).decode("utf-8").strip()[5:-1]
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
