"""The sharded layout's sink: each process appends to its own
``<path>.d/p<process>.jsonl``: no lock, nothing read back, so its cost per
record is the same at 2 processes and at 4,096 (``FileSink`` reads back what
every other process appended, N^2 over a job). Readers merge the shards
(``pmaptap/tapfile/source/run.py``); docs/architecture.md, "At scale".

A replicated record every holding process verified on device (gathered and
verified layouts: all of them build the same record) is written only by its
owner, ``source.owner(key, processes)``. Any other replicated record (copy
layout, a side ``Writer``, ``verified_off``, a plain-jit scalar read from
one device) is written by each holder and readers keep one copy of each
value: nothing a non-owner saw can be lost because the owner never saw it.
An owner that dies first: ``Held`` and ``write_held``, docs/multihost.md,
"An owner killed before it wrote what it owns".
"""

from __future__ import annotations

import abc
import os
import time
from collections import deque
from typing import Iterable, Sequence

from pmaptap import distributed
from pmaptap._host.sinks.base import Sink, prepare_path
from pmaptap._host.sinks.blobs import BlobFile
from pmaptap._log import log
from pmaptap.tapfile import source
from pmaptap.tapfile.record import COPIES_SEEN, RawArray, Record, has_raw, raw_leaves, record_key

# Seconds between two looks at the shard's path (a stat by name: a server
# round trip on NFS/Lustre) to see whether it was renamed away (log
# rotation). Every batch looks at the open file only (fstat: its size for the
# torn-tail check, its link count for a removal), which the client answers.
PATH_CHECK_S = 5.0

# What a process keeps of the values it left to their owners (estimated
# bytes: the record object, its line if the aggregator built one, the bytes
# of its stored arrays); why that is enough: docs/multihost.md.
HELD_BYTES = 64 << 20
_RECORD_BYTES = 550  # a scalar replicated Record object, measured (tracemalloc)


def _held_size(r: Record) -> int:
    line = r._line
    size = _RECORD_BYTES + (len(line) if line is not None else 0)
    v = r.value
    if type(v) is RawArray:
        size += v.nbytes
    elif type(v) in (dict, list) and type(r.dtype) is not str and has_raw(v, r.dtype):
        size += sum(x.nbytes for x in raw_leaves(v, r.dtype))
    return size


class Held:
    """The replicated values this process left to other owners, oldest
    first, at most ``limit`` estimated bytes: past it the oldest are let go
    and counted per owner in ``released`` (a warning names them if that
    owner then does not close). Only the writer thread adds; ``take`` runs
    after the pipeline's threads have ended, or on the thread that closes."""

    def __init__(self, limit: int = HELD_BYTES) -> None:
        self.limit = limit
        self._items: deque[tuple[int, Record, int]] = deque()  # (owner, record, size)
        self.bytes = 0
        self.released: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._items)

    def add(self, owner: int, r: Record) -> None:
        size = _held_size(r)
        self._items.append((owner, r, size))
        self.bytes += size
        while self.bytes > self.limit and self._items:
            o, _, n = self._items.popleft()
            self.bytes -= n
            self.released[o] = self.released.get(o, 0) + 1

    def take(self, owners: "Iterable[int] | None") -> list[Record]:
        """Remove and return the values held for ``owners`` (None: all), in
        the order they were left."""
        want = None if owners is None else set(owners)
        out, rest = [], deque()
        for item in self._items:
            if want is None or item[0] in want:
                out.append(item[1])
                self.bytes -= item[2]
            else:
                rest.append(item)
        self._items = rest
        return out


def owner_of(r: Record) -> int | None:
    """The process that writes ``r`` in the sharded layout, or None when
    every process that has it writes it: None unless ``r`` is a replicated
    value that several processes verified on device."""
    if (
        r.kind != "replicated"
        or not r.processes
        or len(r.processes) < 2
        or (r.extra and (r.extra.get("verified") is False or COPIES_SEEN in r.extra))
    ):
        return None
    return source.owner(record_key(r), r.processes)


def mine(r: Record, process: int) -> bool:
    """Does ``process`` write ``r`` in the sharded layout? Yes, unless it is
    a replicated value that several processes verified on device and another
    of them owns."""
    o = owner_of(r)
    return o is None or o == process


class ShardSink(Sink):
    """A sink of the sharded layout (a directory, an object store): this
    process writes the records it owns (``mine``) and holds the others for
    their owners (``Held``) until the close knows whether they wrote them.
    A subclass appends the lines (``_append_lines``) where it keeps them."""

    process: int
    held: Held
    skipped: int

    @abc.abstractmethod
    def _append_lines(self, keep: list[Record], chunks: list[bytes]) -> None: ...

    def own_lines(self, records: Sequence[Record]) -> tuple[list[Record], list[bytes]]:
        """The records this process writes (``mine``) and their lines;
        the others are counted in ``skipped`` and their positions kept in
        ``left``."""
        keep = []
        self.left = []
        held = self.held
        for i, r in enumerate(records):
            o = owner_of(r)
            if o is None or o == self.process:
                keep.append(r)
            else:
                self.left.append(i)
                held.add(o, r)
        self.skipped += len(self.left)
        if not keep:
            return [], []
        encoded, keep = self._encode(keep)
        return keep, [encoded.get(id(r)) or r.encode() for r in keep]

    def write_held(self, owners: "Iterable[int] | None") -> int:
        """Write the values held for ``owners`` (None: every owner), whose
        close was not seen: they may never have written them. Returns how
        many. Called after close() (the session's, once its pipeline is
        drained): the file is opened again, and closed."""
        records = self.held.take(owners)
        if not records:
            return 0
        try:
            encoded, keep = self._encode(records)
            self._append_lines(keep, [encoded.get(id(r)) or r.encode() for r in keep])
        finally:
            self.close()
        return len(keep)

    def write(self, records: Sequence[Record]) -> list[Record]:
        keep, chunks = self.own_lines(records)
        if not keep:
            return []
        self._append_lines(keep, chunks)
        return keep  # what was written: the session's forwarders get these


class DirectorySink(ShardSink):
    """Appends to ``<path>.d/p<process>.jsonl``; only this process writes it."""

    def __init__(self, path: str, *, process: int | None = None) -> None:
        self.process = distributed.process_index(process)
        self.run_path = os.path.abspath(os.fspath(path))
        self.path = prepare_path(source.shard_path(self.run_path, self.process))
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
        self.bytes_read = 0  # never reads another process's output
        self.skipped = 0  # replicated values left to their owner
        self.held = Held()  # ... kept until the close knows their owners closed
        self.replacements = 0
        self.rejected: list[str] = []

    def _blob_file(self) -> BlobFile:
        return BlobFile(self.run_path, self.process)

    def _append_lines(self, keep: list[Record], chunks: list[bytes]) -> None:
        if self._fd < 0:  # closed: write_held at the session's close
            self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
            self._end = None
        size = self._reopen_if_replaced().st_size
        # Only this process writes the shard: it ends where our last write
        # left it, on a newline, unless something else changed it; only then
        # is its last byte read (docs/faults.md, a torn shard tail).
        if size != self._end and size > 0 and os.pread(self._fd, 1, size - 1) != b"\n":
            chunks.insert(0, b"\n")
        # All or nothing (cut back on failure); the pipeline retries it whole.
        written = self._append(self._fd, size, chunks, False)
        # (Bytes another program appends between the fstat and the write
        # make the next size differ from this: a look at the tail, no more.)
        self._end = size + written
        self.lines_written += len(keep)

    def _reopen_if_replaced(self) -> os.stat_result:
        """The shard moved away or removed under us: write to the file now at the
        path, as FileSink does, and say so once (truncation needs nothing:
        O_APPEND). Returns the stat of the file written to. One fstat a batch shows
        a removal at once (no link left); a rename is seen by a stat of the path,
        at most every PATH_CHECK_S seconds (docs/faults.md)."""
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
