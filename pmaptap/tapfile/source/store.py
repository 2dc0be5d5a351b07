"""A run on an object store: the objects' names (a *chunk* per batch, a
*rollup* of chunks ``first..last``), their listing, and what a reader
takes of them so that nothing is read twice or missed whichever of chunks
and rollup a listing shows (docs/multihost.md, "Rollups"; docs/faults.md)."""

from __future__ import annotations

import errno
import re
import time
from typing import Any, Iterator, NamedTuple

from pmaptap import errors

SHARD_SUFFIX = ".d"

# Chunks a writer rolls up at most into one object (and a rollup's most).
ROLLUP_CHUNKS = 64
# ... or fewer when their bytes reach this (the writer holds them until then).
ROLLUP_BYTES = 16 << 20

# Seconds a follower waits for a writer's missing chunks to be listed
# before it reads on after them (Cursor.plan).
GAP_WAIT_S = 30.0

_NAME = re.compile(
    r"p(\d+)-([0-9]+-[0-9a-f]+)-([0-9]+)(?:\.r([0-9]+)\.b([0-9]+)|\.b([0-9]+))?\.jsonl\Z"
)


def url_fs(url: str):
    """(fsspec filesystem, path inside it) for ``url``."""
    extra = "gcs" if url.startswith(("gs:", "gcs:")) else "s3"
    return errors.optional("fsspec.core", repr(url), extra).url_to_fs(url)


def chunk_name(directory: str, process: int, writer: str, seq: int, start: int) -> str:
    return f"{directory}/p{process:05d}-{writer}-{seq:09d}.b{start}.jsonl"


def rollup_name(
    directory: str, process: int, writer: str, first: int, last: int, start: int
) -> str:
    return f"{directory}/p{process:05d}-{writer}-{last:09d}.r{first:09d}.b{start}.jsonl"


class Object(NamedTuple):
    """A listed chunk (``first == last``) or rollup; ``start`` (in its
    writer's stream) and ``size`` -1 where not known (an older writer's)."""

    name: str
    process: int
    writer: str
    first: int
    last: int
    start: int
    size: int
    rollup: bool = False


def parse_name(name: str, size: "int | None") -> "Object | None":
    m = _NAME.match(name.rsplit("/", 1)[-1])
    if m is None:
        return None
    size = -1 if size is None else int(size)  # None: the listing gives none
    proc, writer, last, first, start, chunk_start = m.groups()
    if first is None:
        at = -1 if chunk_start is None else int(chunk_start)
        return Object(name, int(proc), writer, int(last), int(last), at, size)
    return Object(name, int(proc), writer, int(first), int(last), int(start), size, True)


def objects(url: str, *, missing_ok: bool = False) -> dict[int, list[Object]]:
    """process -> its objects in name (write) order, as listed now. No
    object at all is a ``FileNotFoundError`` (every writer puts an empty
    chunk at open), or ``{}`` with ``missing_ok``."""
    fs, prefix = url_fs(url)
    where = prefix + SHARD_SUFFIX
    try:
        entries = fs.ls(where, detail=True, refresh=True)
        why = "no chunks there"
    except FileNotFoundError as e:
        entries, why = [], str(e) or "not found"
    out: dict[int, list[Object]] = {}
    for e in sorted(entries, key=lambda e: e["name"]):
        o = parse_name(e["name"], e.get("size"))
        if o is not None:
            out.setdefault(o.process, []).append(o)
    if not out and not missing_ok:
        raise FileNotFoundError(
            errno.ENOENT, f"no such run: {url} (nothing under {url}{SHARD_SUFFIX}/: {why})"
        )
    return out


def objects_after(
    url: str, last: dict[int, str], pool=None, *, new: bool = False
) -> "dict[int, list[Object]] | None":
    """process -> its objects named after ``last[process]`` (S3's StartAfter;
    docs/multihost.md), with ``new`` those of processes not in ``last`` too;
    None where the client has no such listing."""
    fs, prefix = url_fs(url)
    call = getattr(fs, "call_s3", None)
    if call is None or not hasattr(fs, "split_path"):
        return None
    bucket, key, _ = fs.split_path(prefix + SHARD_SUFFIX)

    def pages(**kw: Any) -> Iterator[dict]:
        while True:
            out = call("list_objects_v2", Bucket=bucket, **kw)
            yield out
            if not out.get("IsTruncated"):
                return
            kw["ContinuationToken"] = out["NextContinuationToken"]

    def listing(item: tuple[int, str]) -> tuple[int, list[Object]]:
        proc, after = item
        kw = {"Prefix": f"{key}/p{proc:05d}-"}
        if after:
            kw["StartAfter"] = after.split("/", 1)[1] if after.startswith(bucket + "/") else after
        found = [
            got
            for out in pages(**kw)
            for o in out.get("Contents", ())
            if (got := parse_name(f"{bucket}/{o['Key']}", o.get("Size"))) is not None
        ]
        return proc, sorted(found)

    items = sorted(last.items())
    if new:
        known = set(last)
        for out in pages(Prefix=f"{key}/p", Delimiter="-"):
            for cp in out.get("CommonPrefixes", ()):
                m = _PROCESS_PREFIX.match(cp["Prefix"].rsplit("/", 1)[-1])
                if m is not None and int(m.group(1)) not in known:
                    items.append((int(m.group(1)), ""))
    found = pool.map(listing, items) if pool is not None else map(listing, items)
    return {proc: objs for proc, objs in found if objs}


_PROCESS_PREFIX = re.compile(r"p(\d+)-\Z")


class Cursor:
    """What a reader has taken of one process's objects: per writer, the
    next seq not taken and where in its stream what was taken ends."""

    __slots__ = ("next", "taken", "last", "gaps")

    def __init__(self) -> None:
        self.next: dict[str, int] = {}
        self.taken: dict[str, int] = {}
        self.last = ""  # the last object name taken (a follower lists after it)
        # writer -> (first seq missing, when a listing first lacked it)
        self.gaps: dict[str, tuple[int, float]] = {}

    def plan(self, objs: list[Object], *, wait: bool = False) -> list[tuple[Object, int]]:
        """(object, bytes of it to skip) of what the reader has not taken of
        ``objs`` (a listing, in name order); past a gap at once, or with
        ``wait`` (a follower) once it has lasted GAP_WAIT_S (docs/multihost.md)."""
        covered: dict[str, list[tuple[int, int]]] = {}
        for o in objs:
            if o.rollup:
                covered.setdefault(o.writer, []).append((o.first, o.last))
        out = []
        nxt = dict(self.next)
        stopped: set[str] = set()
        gapped: set[str] = set()
        for o in objs:
            w = o.writer
            n = nxt.get(w, 0)
            if w in stopped or o.last < n:
                continue  # after a gap we wait on; or taken
            if not o.rollup and any(f <= o.first <= la for f, la in covered.get(w, ())):
                continue  # its rollup, in this listing, is read instead
            if o.first > n:
                gapped.add(w)
                if not self._past_gap(o, n, wait):
                    stopped.add(w)
                    continue
            # A rollup's part after what was taken of its chunks.
            skip = max(0, self.taken.get(w, 0) - o.start) if o.rollup and o.first < n else 0
            out.append((o, skip))
            nxt[w] = o.last + 1
        for w in list(self.gaps):
            if w not in gapped:
                del self.gaps[w]  # the listing had what was missing
        return out

    def _past_gap(self, o: Object, n: int, wait: bool) -> bool:
        now = time.monotonic()
        first_seen = self.gaps.setdefault(o.writer, (n, now))
        if first_seen[0] != n:
            first_seen = self.gaps[o.writer] = (n, now)
        if wait and now - first_seen[1] < GAP_WAIT_S:
            return False
        from pmaptap._log import log  # on use: a sharded read that skips nothing loads no logging

        log.warning(
            f"pmaptap: chunks {n}-{o.first - 1} of process {o.process}'s writer {o.writer} "
            f"are not in the run's listing; reading on after them ({o.name})"
        )
        del self.gaps[o.writer]
        return True

    def take(self, o: Object, skip: int, data_len: int) -> None:
        """``data_len`` bytes of ``o`` after ``skip`` were read."""
        self.next[o.writer] = o.last + 1
        # An older writer's chunk has no start: right while no chunk was missed.
        start = o.start + skip if o.start >= 0 else self.taken.get(o.writer, 0)
        self.taken[o.writer] = start + data_len
        if o.name > self.last:
            self.last = o.name


# A rollup is fetched in pieces of FETCH_BYTES / processes, within these
# bounds (docs/multihost.md); not less: each request costs CPU (signing).
FETCH_BYTES = 32 << 20
MIN_PIECE_BYTES = 16 << 10
MAX_PIECE_BYTES = 4 << 20


def piece_bytes(processes: int) -> int:
    return max(MIN_PIECE_BYTES, min(MAX_PIECE_BYTES, FETCH_BYTES // max(processes, 1)))


def fetch(fs, o: Object, start: int, end: "int | None") -> bytes:
    """Bytes ``start:end`` of ``o`` as a range request: without one, s3fs
    asks its directory cache, which may predate the object."""
    return fs.cat_file(o.name, start=start, end=end)


class Reader:
    """What ``cursor`` has not taken of one process's ``objs``: ``next()``
    gives ``(object, whole lines)`` or None, the next fetched meanwhile."""

    # New listings in a row that may still miss a chunk before it counts
    # as gone (a store that lists a deleted object for a moment).
    RELISTS = 3

    def __init__(
        self,
        url: str,
        fs,
        process: int,
        objs: list[Object],
        cursor: Cursor,
        pool,
        *,
        wait: bool = False,
        piece: int = MAX_PIECE_BYTES,
    ) -> None:
        self.url, self.fs, self.process, self.cursor, self.pool = url, fs, process, cursor, pool
        self.wait = wait  # Cursor.plan's: a follower waits at a gap
        self.piece = piece
        # (object, first byte to fetch, the object's first piece?), last first
        self.todo = [(o, skip, True) for o, skip in reversed(cursor.plan(objs, wait=wait))]
        self.relists = 0
        self.skip = 0  # of the object being read: where it was started
        self.got = 0  # and its bytes fetched so far
        self.carry = b""  # the start of a line the next piece ends
        self.fut = None
        self._fetch()

    def _fetch(self) -> None:
        if not self.todo:
            self.fut = None
            return
        o, start, first = self.todo.pop()
        end = o.size if o.size >= 0 else None  # None: not known, to the end
        if end is not None and o.rollup and end - start > self.piece:
            end = start + self.piece
            self.todo.append((o, end, False))
        # An empty chunk (every writer's first) costs no request.
        if end is not None and start >= end:
            got: "bytes | Any" = b""
        else:
            got = self.pool.submit(fetch, self.fs, o, start, end)
        self.fut = (o, start, end, first, got)

    def next(self) -> "tuple[Object, bytes] | None":
        while self.fut is not None:
            o, start, end, first, got = self.fut
            try:
                data = got if isinstance(got, bytes) else got.result()
            except FileNotFoundError:
                if o.rollup or self.relists >= self.RELISTS:
                    raise  # a rollup is never deleted; a chunk gone for good
                self.relists += 1
                # This process's objects after the last one read (its
                # rollup sorts after the missing chunk), or the run's.
                last = {self.process: self.cursor.last} if self.cursor.last else {}
                found = objects_after(self.url, last) if last else None
                if found is None:
                    found = objects(self.url, missing_ok=True)
                plan = self.cursor.plan(found.get(self.process, []), wait=self.wait)
                self.todo = [(o, skip, True) for o, skip in reversed(plan)]
                self._fetch()
                continue
            self.relists = 0
            self._fetch()
            if first:
                self.skip, self.got, self.carry = start, 0, b""
            self.got += len(data)
            if self.carry:
                data = self.carry + data
            if end is not None and end < o.size:  # a piece: its line may go on
                cut = data.rfind(b"\n") + 1
                data, self.carry = data[:cut], data[cut:]
            else:
                self.carry = b""
                self.cursor.take(o, self.skip, self.got)
            if data:
                return o, data
        return None
