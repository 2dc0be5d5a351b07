"""Reading a tap file while writers append to it (``pmaptap tail -f``):
no lock, so bytes after the last newline (a line being written, or torn)
are held back until their newline arrives."""

from __future__ import annotations

import contextlib
import heapq
import os
import select
import signal
import threading
import time
from typing import Any, Callable, Iterator

from pmaptap.tapfile import record, source
from pmaptap.tapfile.read import views
from pmaptap.tapfile.read.query import Filter
from pmaptap.tapfile.record import decode_record, parse_line, record_key

_CHUNK = 1 << 20
# The first poll of a local sharded run merges its shards holding about
# this many bytes of lines in all (a chunk of each shard, at least 4 KiB).
FIRST_POLL_BYTES = 32 << 20
# Seconds between two listings of a whole object-store run (docs/multihost.md):
# they find what sorts before a process's last object read (an older writer's).
RELIST_S = 30.0


class LineFollower:
    """``poll()``: (line number, bytes) of the lines of ``path`` completed
    since the last poll (consume it fully: a chunk's offset is committed
    when read); a file replaced or truncated is read again from its start."""

    def __init__(
        self, path: str | os.PathLike, keep_open: bool = True, chunk: int = _CHUNK
    ) -> None:
        self.path = os.fspath(path)
        # keep_open=False: the file is open only while a chunk is read, so
        # the open-file limit does not bound how many shards are followed.
        self.keep_open = keep_open
        self.chunk = chunk
        self._f = None
        self._ino: int | None = None
        self._pos = 0
        self._partial = b""
        self.lineno = 0
        self.restarted = 0

    def _chunks(self) -> Iterator[bytes]:
        """Chunks from where the last read stopped: of the file kept open
        (opened again if replaced or truncated; a removed one: what it
        holds), or with keep_open=False opened for each chunk (one replaced
        during this poll waits for the next)."""
        first = True
        while True:
            f = self._f
            if f is not None and first:
                try:
                    st = os.stat(self.path)
                except FileNotFoundError:
                    st = None  # removed: keep what we have, wait for it to return
                if st is not None and (st.st_ino != self._ino or st.st_size < self._pos):
                    self.close()  # read again from the start, below
                    f, self._ino = None, -1
            if f is None:
                try:
                    f = open(self.path, "rb")
                except FileNotFoundError:
                    return  # removed: keep what we have, wait for it to return
                st = os.fstat(f.fileno())
                if st.st_ino != self._ino or st.st_size < self._pos:
                    if not first:
                        f.close()
                        return
                    if self._ino is not None:
                        self.restarted += 1
                    self._ino = st.st_ino
                    self._pos, self._partial, self.lineno = 0, b"", 0
                if self.keep_open:
                    self._f = f
            with contextlib.nullcontext() if self.keep_open else f:
                f.seek(self._pos)
                chunk = f.read(self.chunk)
            first = False
            if not chunk:
                return
            self._pos += len(chunk)
            yield chunk
            if not self.keep_open and len(chunk) < self.chunk:
                return  # the end of the file as it was: no second open to see it

    def poll(self) -> Iterator[tuple[int, bytes]]:
        for chunk in self._chunks():
            pieces = (self._partial + chunk).split(b"\n")
            self._partial = pieces.pop()  # b"" when the chunk ended a line
            if len(self._partial) > record.MAX_LINE_BYTES:
                # One byte past the limit lets parse_line report the line as
                # too long: memory stays bounded whatever a line's length.
                self._partial = self._partial[: record.MAX_LINE_BYTES + 1]
            for raw in pieces:
                self.lineno += 1
                yield self.lineno, raw

    @property
    def pending(self) -> bytes:
        """Bytes of a line not yet terminated (torn, or being written)."""
        return self._partial

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def matching(
    lf: LineFollower, flt: Filter, report: Callable[[int, str], None] | None = None
) -> Iterator[views.Entry]:
    """The records ``flt`` passes among the lines of a poll; lines that are
    not records (blank ones aside) go to ``report(line number, problem)``."""
    for lineno, d in source.records(source.parsed(lf.poll()), report):
        rec = decode_record(d)
        if flt(rec):
            yield views.Entry(lineno, d, rec)


def follow(
    lf: LineFollower,
    flt: Filter,
    *,
    stop: StopFlag,
    interval: float,
    timeout: float | None,
    report: Callable[[int, str], None] | None = None,
) -> Iterator[list[views.Entry]]:
    """A batch of new matching records per poll (``polls``)."""
    for _ in polls(stop, interval, timeout):
        if stop.is_set():
            return  # tail stops at once, without a last poll
        yield list(matching(lf, flt, report))


def polls(stop: StopFlag, interval: float, timeout: float | None) -> Iterator[None]:
    """A follow loop's polls: the first at once, then one every
    ``interval`` seconds until the poll after ``stop`` or ``timeout``."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        yield
        if stop.is_set():
            return
        wait = interval
        if deadline is not None:
            wait = min(wait, deadline - time.monotonic())
            if wait <= 0:
                return
        stop.wait(wait)


class StopFlag:
    """What ends a follow loop; ``set()`` may be called from a signal handler.

    A ``threading.Event``'s ``set()`` may not: it takes the lock the main
    thread may hold inside ``Event.wait`` (CPython gh-126434: a hang seen in
    CI). Here ``set()`` writes a byte to a pipe that ``wait()`` selects on.
    """

    def __init__(self) -> None:
        self._set = False
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)

    def set(self) -> None:
        self._set = True
        with contextlib.suppress(OSError):  # full (already woken many times) or closed
            os.write(self._w, b"x")

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        """Sleep until ``set()`` or ``timeout``; True if set (a handler's
        byte is in the pipe before ``select`` resumes: PEP 475)."""
        if not self._set:
            select.select([self._r], [], [], None if timeout is None else max(timeout, 0.0))
        return self._set

    def close(self) -> None:
        for fd in (self._r, self._w):
            with contextlib.suppress(OSError):
                os.close(fd)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopFlag]:
    """Ctrl-C / SIGTERM set the flag a follow loop checks (exit 0, no
    traceback), undone when the block ends."""
    stop = StopFlag()
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda signum, frame: stop.set())
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        stop.close()


class RunFollower:
    """``LineFollower`` of a sharded run: its sources' new lines ordered as
    ``pmaptap.read`` orders them, a new shard picked up at the next poll."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = source.Run.of(path)
        self._files: dict[str, LineFollower] = {}
        self._first: dict[tuple, Any] = {}
        self._cursors: dict[int, Any] = {}  # object store: source.Cursor per process
        self._lines: dict[int, int] = {}  # object store: lines per process
        self._relist_at = 0.0
        self._pool: Any = None
        self._dir_key: Any = ()  # local: (inode, mtime) of path.d when listed
        self._polled = False
        self.lineno = 0

    def poll(self) -> Iterator[tuple[int, bytes]]:
        first, self._polled = not self._polled, True
        sources = self._sources(first)
        if first:
            # The run so far, merged a chunk of each source at a time; a
            # replicated value another process gave earlier in merged order
            # is left out (as read() leaves it out: the dedup follows the merge).
            streams = [self._stream(i, lines) for i, lines in enumerate(sources)]
            for _t, _i, _n, raw, d in heapq.merge(*streams):
                if not self._is_copy(d):
                    self.lineno += 1
                    yield self.lineno, raw
            return
        batch: list[tuple[float, int, int, bytes]] = []
        for i, lines in enumerate(sources):
            for n, raw in lines:
                d, _ = parse_line(raw)
                if not self._is_copy(d):
                    batch.append((_time_of(d), i, n, raw))
        batch.sort(key=lambda x: x[:3])
        for _t, _i, _n, raw in batch:
            self.lineno += 1
            yield self.lineno, raw

    def _is_copy(self, d: dict | None) -> bool:
        """Whether another process's line gave ``d``'s replicated value first."""
        if d is None or d.get("kind") != "replicated" or not d.get("vhash"):
            return False
        if _time_of(d) == float("-inf"):
            return False  # as before: a line without a time is never deduped
        got = self._first.setdefault((record_key(d), d["vhash"]), d.get("process"))
        return got != d.get("process")

    def _sources(self, first: bool) -> list[Iterator[tuple[int, bytes]]]:
        """Each source's new (line number, bytes), in source order: a store's
        processes' new chunks, or the local files'."""
        if self.path.url:
            found = sorted(self._list_objects().items())
            return [self._object_lines(self._reader(p, objs, len(found))) for p, objs in found]
        paths = self._local_sources()
        chunk = max(4096, min(_CHUNK, FIRST_POLL_BYTES // max(len(paths), 1))) if first else _CHUNK
        for f in paths:
            if f not in self._files:
                self._files[f] = LineFollower(f, keep_open=False, chunk=chunk)
        return [lf.poll() for lf in self._files.values()]

    def _reader(self, proc: int, objs: list, processes: int):
        """A source.Reader of ``proc``'s ``objs`` not read yet, its first
        fetch started now (not when the merge pulls: one after another)."""
        fs, _ = source.url_fs(self.path)
        cursor = self._cursors.setdefault(proc, source.Cursor())
        pool, piece = self._fetch_pool(), source.piece_bytes(processes)
        return source.Reader(self.path, fs, proc, objs, cursor, pool, wait=True, piece=piece)

    def _object_lines(self, reader) -> Iterator[tuple[int, bytes]]:
        proc = reader.process
        while (got := reader.next()) is not None:
            for raw in got[1].split(b"\n"):
                if raw:
                    n = self._lines[proc] = self._lines.get(proc, 0) + 1
                    yield n, raw

    def _fetch_pool(self):
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(
                max_workers=source.FETCH_THREADS, thread_name_prefix="pmaptap-follow"
            )
        return self._pool

    def _stream(
        self, i: int, lines: Iterator[tuple[int, bytes]]
    ) -> Iterator[tuple[float, int, int, bytes, Any]]:
        """(merge key as run.merge_keys', source, line number, bytes,
        record or None) of its lines."""
        t = float("-inf")
        for n, raw in lines:
            # Every line counts for the running time, a copy the merge will
            # drop included (as the merge of read() counts it).
            d, _ = parse_line(raw)
            t = max(t, _time_of(d))
            yield t, i, n, raw, d

    def _local_sources(self) -> list[str]:
        """The run's files to add this poll: the shard directory listed
        only when its mtime changed (a quiet one costs a stat)."""
        base, directory = source.base_and_directory(self.path)
        try:
            st = os.stat(directory)
            key: Any = (st.st_ino, st.st_mtime_ns)
            # A file system stamps times at a clock tick (ms), so two
            # creations within one tick leave one mtime: a directory that
            # changed in the last second is listed anyway.
            recent = time.time() - st.st_mtime < 1.0
        except (FileNotFoundError, NotADirectoryError):
            key, recent = None, False
        if key != self._dir_key or recent:
            self._dir_key = key
            return source.sources(self.path)
        if base is not None and base not in self._files and os.path.isfile(base):
            return [base]
        return []

    def _list_objects(self) -> dict:
        """process -> its objects to look at this poll: those after its
        last read (``objects_after``), the whole run every RELIST_S."""
        now = time.monotonic()
        last = {p: c.last for p, c in self._cursors.items() if c.last}
        if last and now < self._relist_at:
            found = source.objects_after(self.path, last, self._fetch_pool(), new=True)
            if found is not None:
                return found
        self._relist_at = now + RELIST_S
        return source.objects(self.path, missing_ok=True)

    @property
    def restarted(self) -> int:
        """Shards replaced or truncated under the follower (each re-read)."""
        return sum(lf.restarted for lf in self._files.values())

    @property
    def pending(self) -> bytes:
        return b"".join(lf.pending for lf in self._files.values())

    def close(self) -> None:
        for lf in self._files.values():
            lf.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)


class PendingFollower:
    """The follower of a run that does not exist yet (its layout unknown
    until its first writer opens it): each poll looks for either."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self._inner: "LineFollower | RunFollower | None" = None

    def poll(self) -> Iterator[tuple[int, bytes]]:
        if self._inner is None:
            # Resolved again at every poll until the run appears: its
            # layout is what its first writer makes it.
            self._inner = _follower(source.Run(self.path))
            if self._inner is None:
                return
        yield from self._inner.poll()

    @property
    def restarted(self) -> int:
        return 0 if self._inner is None else self._inner.restarted

    @property
    def pending(self) -> bytes:
        return b"" if self._inner is None else self._inner.pending

    def close(self) -> None:
        if self._inner is not None:
            self._inner.close()


def open_follower(path: str | os.PathLike) -> "LineFollower | RunFollower | PendingFollower":
    """The follower for ``path``: a sharded run's, one file's or a pending one."""
    run = source.Run.of(path)
    return _follower(run) or PendingFollower(run)


def _follower(run: source.Run) -> "LineFollower | RunFollower | None":
    if run.sharded:
        return RunFollower(run)
    return LineFollower(run) if os.path.exists(run) else None


def _time_of(d: dict | None) -> float:
    """A record's time as the merge orders it (-inf without a numeric one)."""
    t = d.get("time") if d is not None else None
    if not isinstance(t, (int, float)) or isinstance(t, bool):
        return float("-inf")
    return float(t)
