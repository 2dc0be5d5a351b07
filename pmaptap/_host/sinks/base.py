"""What every sink shares: the writer interface (``Sink``: write/close),
the path a local sink writes to made ready (``prepare_path``), a batch
encoded line by line with an unencodable record replaced by a meta record
(``Sink._encode``), and lines appended all or nothing (``Sink._append``).
The sinks themselves: file.py (the shared file), directory.py (one file per
process), objectstore.py (immutable chunks), console.py (stderr)."""

from __future__ import annotations

import abc
import errno
import os
from typing import Sequence

from pmaptap._host.sinks.blobs import _IOV_MAX, BlobFile, has_unstored, unstored
from pmaptap.errors import TapPathError
from pmaptap.tapfile.record import META_UNENCODABLE, RawArray, Record, line_problem, meta_record


class Sink(abc.ABC):
    # The writer's byte file for array values stored as bytes (local
    # layouts; created on first use: blobs.py).
    _blobs: BlobFile | None = None
    # The local layouts' descriptor of the file they append to (-1: none).
    _fd: int = -1

    def _blob_file(self) -> BlobFile:
        raise NotImplementedError

    def _store_raws(self, raws: Sequence[RawArray]) -> None:
        """Give ``raws`` their place (write their bytes) before their lines."""
        if raws:
            if self._blobs is None:
                self._blobs = self._blob_file()
            self._blobs.store(raws)

    # Positions, in the last write()'s input, of the replicated records the
    # sink did not write because another process of the job writes them
    # (cross-process dedup, the sharded owner rule). The write loop needs them
    # to forward what this process computed, not only what it wrote
    # (``Session(forward_replicated=...)``, _host/forward/).
    left: Sequence[int] = ()

    @abc.abstractmethod
    def write(self, records: Sequence[Record]) -> Sequence[Record] | None:
        """Write all of ``records`` or raise (then none or all were written).
        A sink that filters (cross-process dedup) returns what it wrote, in
        order, one record per input record not in ``left`` (a record may come
        back replaced: flagged divergent, or an unencodable one's meta
        record)."""

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
            chunks = [b"".join(chunks[i : i + k]) for i in range(0, len(chunks), k)]
        offset = size
        try:
            want = sum(map(len, chunks))
            # soft: at the size just read, never a cached one
            n = os.pwritev(fd, chunks, offset) if soft else os.writev(fd, chunks)
            offset += n
            if n < want:  # short write: finish the rest byte-wise
                view = memoryview(b"".join(chunks))[n:]
                while view:
                    n = os.pwrite(fd, view, offset) if soft else os.write(fd, view)
                    view, offset = view[n:], offset + n
            if soft and offset > size:
                os.fsync(fd)  # at the server before we unlock
        except OSError:
            try:
                os.ftruncate(fd, size)
            except OSError:
                pass
            raise
        return offset - size

    def _encode(
        self, records: Sequence[Record], defer_replicated: bool = False
    ) -> tuple[dict, list[Record]]:
        """Encode every record. One that cannot be (a str that is not valid
        UTF-8, e.g. a lone surrogate from os.fsdecode in a pytree key) is
        replaced by a ``pmaptap/unencodable`` meta record that names it:
        raising would make the pipeline retry the whole batch forever, and
        nothing queued behind it would ever be written.

        Values stored as bytes get their place first (their bytes are
        written before any line points at them); ``defer_replicated``
        leaves replicated ones unstored and unencoded (not in the dict)."""
        self._store_raws(
            unstored(r for r in records if not (defer_replicated and r.kind == "replicated"))
        )
        encoded: dict[int, bytes] = {}
        keep: list[Record] = []
        for r in records:
            if defer_replicated and r.kind == "replicated" and has_unstored(r):
                keep.append(r)
                continue
            try:
                line = r.encode()
                # Readers refuse lines past parse.MAX_LINE_BYTES/MAX_DEPTH: never
                # write one that every reader would then skip.
                problem = line_problem(line)
                if problem:
                    raise ValueError(problem)
                encoded[id(r)] = line
            except (TypeError, ValueError, RecursionError) as e:
                # UnicodeError is a ValueError; RecursionError: json's encoder
                # on a pytree too deep to write.
                self.rejected.append(f"{ascii(r.name)} step {r.step}: {e}")
                r = meta_record(
                    count=1,
                    run=_utf8(r.run),
                    name=META_UNENCODABLE,
                    step=r.step,
                    process=r.process,
                    time=r.time,
                    host=_utf8(r.host),
                    attempt=r.attempt,
                    extra={"tap": ascii(r.name), "error": str(e)},
                )
                encoded[id(r)] = r.encode()
            keep.append(r)
        return encoded, keep

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._blobs is not None:
            self._blobs.close()


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
        raise TapPathError(
            f"cannot create the directory for tap file {path!r}: "
            f"a parent component is a file ({e}). Choose another "
            "path.",
            path=path,
            errno=e.errno,
        ) from e
    except PermissionError as e:
        raise TapPathError(
            f"cannot create the directory for tap file {path!r}: permission denied ({e}).",
            path=path,
            errno=e.errno,
        ) from e
    if os.path.isdir(path):
        raise TapPathError(
            f"tap file {path!r} is a directory; give a file path such as 'taps/run.jsonl'.",
            path=path,
            errno=errno.EISDIR,
        )
    for target, what in ((path, "tap file"), (path + ".lock", "lock file")):
        try:
            fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
            os.close(fd)
        except OSError as e:
            hint = (
                "the directory is not writable"
                if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS)
                else e.strerror
            )
            raise TapPathError(
                f"cannot open {what} {target!r} for appending: "
                f"{hint} ({e}). pmaptap needs write access to "
                "the file and its directory.",
                path=path,
                errno=e.errno,
            ) from e
    return path


def _utf8(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
