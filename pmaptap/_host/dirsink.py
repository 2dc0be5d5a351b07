"""The sharded layout's sink: each process appends to its own file.

``FileSink`` shares one file: a global lock, and under it every process reads
what all the others appended (bytes read back grow as N^2 over a job, and
the lock hand-offs serialize N processes). ``DirectorySink`` writes
``<path>.d/p<process>.jsonl`` alone: no lock, nothing read back, so its cost
per record is the same at 2 processes and at 4,096. The readers merge the
shards (``pmaptap/tapfile/runs.py``).

Replicated dedup without reading the others: a replicated record whose value
every holding process verified on device (the gathered and verified layouts;
``processes`` then names them all, and all of them build the same record) is
written only by its owner, ``runs.owner(key, processes)``. Any other
replicated record (a per-process tap in the copy layout, a side ``Writer``, a
``verified_off`` copy, a scalar under plain jit read from one device only:
``copies_seen``, whose ``processes`` name holders that never saw it) is
written by each process that has it, and readers
keep one copy of each value, flagging different values divergent: nothing a
non-owner saw can be lost because the owner never saw it.
"""

from __future__ import annotations

import os
import time
from typing import Sequence

from pmaptap._host.blobs import BlobFile
from pmaptap._host.sink import FileSink, Sink, prepare_path
from pmaptap._log import log
from pmaptap.tapfile import runs
from pmaptap.tapfile.format import COPIES_SEEN, Record, record_key

# Seconds between two looks at the shard's path (a stat by name: a server
# round trip on NFS/Lustre) to see whether it was renamed away (log
# rotation). Every batch looks at the open file only (fstat: its size for the
# torn-tail check, its link count for a removal), which the client answers.
PATH_CHECK_S = 5.0


def mine(r: Record, process: int) -> bool:
    """Does ``process`` write ``r`` in the sharded layout? Yes, unless it is
    a replicated value that several processes verified on device and another
    of them owns."""
    if (
        r.kind != "replicated"
        or not r.processes
        or len(r.processes) < 2
        or (r.extra and (r.extra.get("verified") is False or COPIES_SEEN in r.extra))
    ):
        return True
    return runs.owner(record_key(r), r.processes) == process


class DirectorySink(Sink):
    """Appends to ``<path>.d/p<process>.jsonl``; only this process writes it."""

    def __init__(self, path: str, *, process: int | None = None) -> None:
        if process is None:
            import jax

            process = jax.process_index()
        self.process = int(process)
        self.run_path = os.path.abspath(os.fspath(path))
        self.path = prepare_path(runs.shard_path(self.run_path, self.process))
        try:
            os.remove(self.path + ".lock")  # prepare_path's; no lock here
        except OSError:
            pass
        self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
        # Where this sink's last write left the shard, ending in "\n"; None:
        # not known (just opened, or replaced), so its last byte is read.
        self._end: int | None = None
        self._next_path_check = time.monotonic() + PATH_CHECK_S
        self.lines_written = 0
        self.bytes_written = 0
        self.bytes_read = 0  # never reads another process's output
        self.skipped = 0  # replicated values left to their owner
        self.repairs = 0
        self.replacements = 0
        self.rejected: list[str] = []

    # One encoder for every sink: a record that cannot be encoded becomes a
    # pmaptap/unencodable meta record (see FileSink._encode).
    _encode = FileSink._encode

    def _blob_file(self) -> BlobFile:
        return BlobFile(self.run_path, self.process)

    def own_lines(self, records: Sequence[Record]) -> tuple[list[Record], list[bytes]]:
        """The records this process writes (``mine``) and their lines;
        the others are counted in ``skipped`` and their positions kept in
        ``left``. Shared by the object sink."""
        keep = []
        self.left = []
        for i, r in enumerate(records):
            if mine(r, self.process):
                keep.append(r)
            else:
                self.left.append(i)
        self.skipped += len(self.left)
        if not keep:
            return [], []
        encoded, keep = self._encode(keep)
        return keep, [encoded.get(id(r)) or r.encode() for r in keep]

    def write(self, records: Sequence[Record]) -> list[Record]:
        keep, chunks = self.own_lines(records)
        if not keep:
            return []
        size = self._reopen_if_replaced().st_size
        # Only this process writes the shard, so it ends where our last write
        # left it, on a newline, unless something else changed it: a writer
        # of this shard killed mid-line before we opened, another program's
        # bytes, a truncation mid-line, a failed write not cut back. Only
        # then is its last byte read; a torn tail gets a newline first, or
        # the next record would be glued onto it and lost with it.
        torn = size != self._end and size > 0 and os.pread(self._fd, 1, size - 1) != b"\n"
        if torn:
            chunks.insert(0, b"\n")
        # All or nothing (cut back on failure); the pipeline retries it whole.
        written = FileSink._append(self._fd, size, chunks, False)
        # (Bytes another program appends between the fstat and the write
        # make the next size differ from this: a look at the tail, no more.)
        self._end = size + written
        self.repairs += torn
        self.lines_written += len(keep)
        self.bytes_written += written
        return keep  # what was written: the session's forwarders get these

    def _reopen_if_replaced(self) -> os.stat_result:
        """The shard moved away or removed under us (log rotation, a clean-up
        script): write to the file now at the path, as FileSink does, and
        say so once. Truncation needs nothing: O_APPEND writes at the end.
        Returns the stat of the file written to.

        A batch costs one fstat of the open file. A removed shard shows at
        once (no link left); one renamed away is seen by a stat of the path,
        made at most every PATH_CHECK_S seconds, so a rotation moves the
        writer to the new file within that time."""
        mine = os.fstat(self._fd)
        now = time.monotonic()
        if mine.st_nlink > 0 and now < self._next_path_check:
            return mine
        self._next_path_check = now + PATH_CHECK_S
        try:
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
                return mine
        except FileNotFoundError:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
        os.close(self._fd)
        self._fd = fd
        self._end = None
        self.replacements += 1
        if self.replacements == 1:
            log.warning(
                f"pmaptap: {self.path!r} was replaced or removed under "
                "this writer; appending continues to the file now at "
                "that path (counted in DirectorySink.replacements)."
            )
        return os.fstat(fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._blobs is not None:
            self._blobs.close()
