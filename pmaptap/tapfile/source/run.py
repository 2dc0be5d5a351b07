"""A run's path resolved once (``Run``), and a sharded run's sources merged
into one stream ordered by record time (docs/multihost.md): of a
replicated value written by several processes the first copy of a (key,
vhash) is kept, as the one-file writer would have skipped the others."""

from __future__ import annotations

import bisect
import contextlib
import heapq
import os
import re
from itertools import accumulate
from typing import Any, Callable, Iterator, NamedTuple

from pmaptap.tapfile.record import decode_block
from pmaptap.tapfile.source import store
from pmaptap.tapfile.source.store import SHARD_SUFFIX

# How a run is stored (Session(layout=...), Writer(layout=...)): one shared
# file, or one file per process under <path>.d/; "auto" picks by job size.
FILE_LAYOUTS = ("auto", "file", "sharded")
# "auto" shards a job with more processes than this. At 32 writers the shared
# file still keeps up (docs/performance.md); at 128 its lock collapses.
SHARDED_ABOVE = 32


def file_layout(layout: str, processes: int) -> str:
    """``layout`` with "auto" resolved for a job of ``processes`` processes
    (the same answer on every process of the job)."""
    if layout == "auto":
        return "sharded" if processes > SHARDED_ABOVE else "file"
    return layout


_SHARD_NAME = re.compile(r"p(\d+)\.jsonl\Z")


def shard_dir(path: str | os.PathLike) -> str:
    """``<path>.d`` (``path`` itself if it already names that directory)."""
    path = _run_path(path)
    return path if path.endswith(SHARD_SUFFIX) and os.path.isdir(path) else path + SHARD_SUFFIX


def _run_path(path: str | os.PathLike) -> str:
    """``path`` as text, a directory's spelled as its name: ``RUN.d/`` and
    ``RUN.d/.`` are the run ``RUN.d`` names, shared file ``RUN`` included
    (read without it, a run would lose that file's records, and ``merge
    RUN.d/ -o RUN`` would replace it)."""
    path = os.fspath(path)
    return os.path.normpath(path) if os.path.isdir(path) else path


def shard_path(path: str | os.PathLike, process: int) -> str:
    return os.path.join(shard_dir(path), f"p{int(process):05d}.jsonl")


def _shards(directory: str) -> list[str]:
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = [(int(m.group(1)), n) for n in names if (m := _SHARD_NAME.match(n))]
    return [os.path.join(directory, n) for _, n in sorted(found)]


def shard_process(path: str | os.PathLike) -> int | None:
    """The process of a shard file (``p00003.jsonl``); None for any other."""
    m = _SHARD_NAME.match(os.path.basename(os.fspath(path)))
    return None if m is None else int(m.group(1))


def _sharded_on_disk(path: str | os.PathLike) -> bool:
    d = base_and_directory(path)[1]  # <path>.d, or a directory of shards
    return os.path.isdir(d) and (d.endswith(SHARD_SUFFIX) or bool(_shards(d)))


def sources(path: str | os.PathLike) -> list[str]:
    """The run's files: its shared file (if any) and each shard, in order."""
    base, directory = base_and_directory(path)
    out = [base] if base and os.path.isfile(base) else []
    return out + _shards(directory)


def base_and_directory(path: str | os.PathLike) -> "tuple[str | None, str]":
    """The run's shared file (None for a directory not named ``*.d``) and
    its shard directory."""
    path = _run_path(path)
    if os.path.isdir(path):
        base = path[: -len(SHARD_SUFFIX)] if path.endswith(SHARD_SUFFIX) else None
        return base, path
    return path, path + SHARD_SUFFIX


def owner(key: tuple, processes: "tuple | list") -> int:
    """The one process among ``processes`` (a tuple: sorted already) that
    writes a replicated value they all verified on device: a stable hash of
    the key, so every process picks the same and the writing is spread."""
    procs = processes if type(processes) is tuple else sorted(processes)
    # blake2b, not crc32: crc32's low bits of keys that differ only in the
    # step's digits are far from uniform (one process owned none of 40 steps).
    import hashlib  # on use: readers of one file start faster

    digest = hashlib.blake2b(repr(key).encode("utf-8", "backslashreplace"), digest_size=8).digest()
    return procs[int.from_bytes(digest, "little") % len(procs)]


def is_url(path: str | os.PathLike) -> bool:
    """An object-store run (``s3://``, ``gs://``, ``memory://``...)."""
    if isinstance(path, Run):
        return path.url
    return isinstance(path, str) and "://" in path and not path.startswith("file://")


class Run(str):
    """A run's path, with how it is stored worked out once: ``url``,
    ``sharded`` (sources to merge) or neither (one file)."""

    url: bool
    sharded: bool

    def __new__(cls, path: str | os.PathLike) -> "Run":
        self = super().__new__(cls, os.fspath(path))
        text = str(self)
        self.url = is_url(text)
        self.sharded = self.url or _sharded_on_disk(text)
        return self

    @classmethod
    def of(cls, path: "str | os.PathLike | Run") -> "Run":
        return path if isinstance(path, Run) else cls(path)

    def __reduce__(self) -> tuple:
        # To a worker process as resolved, not resolved again there.
        return (str.__new__, (Run, str(self)), {"url": self.url, "sharded": self.sharded})


# What the merge holds, all sources together (docs/multihost.md): each
# source parsed MERGE_BYTES / sources and read READ_BYTES / sources at a time.
MERGE_BYTES = 4 << 20
MIN_PIECE_BYTES = 1 << 10
MAX_PIECE_BYTES = 64 << 10
READ_BYTES = 32 << 20
MIN_READ_BYTES = 4 << 10
MAX_READ_BYTES = 1 << 20
# Object-store chunks fetched at once: a round trip each, so in parallel.
FETCH_THREADS = 16
# Records per batch of the merged stream.
MERGED_BATCH = 512

# lines.read_at, passed in (lines imports this module).
ReadAt = Callable[[str, int, int], tuple[bytes, "tuple | None", int]]
Batch = tuple[int, list, dict]
_NUMBER = (int, float)


def copy_key(r: Any) -> tuple:
    """What the merge keeps one copy of (a replicated record's)."""
    return (r.key(), r.vhash)


class SourceLine(NamedTuple):
    """A line of a sharded run by its source and line there (a run too big
    to place its lines in the merged stream)."""

    source: int
    line: int
    path: str

    def __str__(self) -> str:
        return f"{os.path.basename(self.path)} line {self.line}"


def source_problem(why: str, name: str, line: int) -> str:
    return f"{why} ({name} line {line})"


def merge_keys(records: list, holes: bool, t: float) -> tuple[list[float], float]:
    """The merge keys of a source's next ``records`` (``holes``: some are
    None) after key ``t``, and the last: each the largest time up to its
    line, so a clock stepping back does not reorder a source's own lines."""
    times = None if holes else [r.time for r in records]
    if times and len(set(map(type, times))) == 1 and type(times[0]) is float:
        # The usual piece: the running largest time in C passes.
        run = list(accumulate(times, max, initial=t))
        del run[0]
        return run, (run[-1] if run else t)
    keys = []
    for r in records:
        if r is not None:
            tt = r.time
            if type(tt) in _NUMBER and tt > t:
                t = float(tt)
        keys.append(t)
    return keys, t


class _Source:
    """One source of the merge, read a piece at a time: the records loaded
    and not yet merged, their merge keys, how far the merge took them."""

    name = ""

    def __init__(self, size: int) -> None:
        self.size = size  # bytes parsed a piece
        self.data = b""  # whole lines loaded, parsed from ``off`` on
        self.off = 0
        self.t = float("-inf")
        self.lineno = 1  # of the next line read from the source
        self.records: list = []
        self.keys: list = []
        # Per record, what the merge must look at: None (nothing), a str (a
        # line that is no record: its problem, naming source and line) or a
        # replicated value's (copy_key, process) (the merge keeps one copy).
        self.marks: list = []
        self.pos = 0  # records[:pos] are merged
        self.last_piece = 0  # records in the last piece read
        self.done = False

    def load(self) -> "tuple[list, dict] | bool":
        """The next lines into ``data`` (True), a piece of its own, or False."""
        raise NotImplementedError

    def piece(self) -> "tuple[list, dict] | None":
        """(records, problems by index) of the next piece."""
        while self.off >= len(self.data):
            got = self.load()
            if got is not True:
                return got or None
            self.off = 0
        # About ``size`` bytes of whole lines.
        data, off = self.data, self.off
        end = data.find(b"\n", min(off + self.size, len(data)) - 1)
        self.off = len(data) if end < 0 else end + 1
        return decode_block(data[off : self.off])

    def extend(self) -> bool:
        """Drop what the merge took, append the next piece (False: done)."""
        pos = self.pos
        if pos:
            # In place: a copy of what is left would touch every record again.
            del self.records[:pos]
            del self.keys[:pos]
            del self.marks[:pos]
            self.pos = 0
        got = self.piece()
        if got is None:
            self.done = True
            return False
        records, problems = got
        base = len(self.records)
        first = self.lineno
        self.lineno += len(records)
        marks = self.marks
        got, self.t = merge_keys(records, bool(problems), self.t)
        self.keys += got
        marks += [None] * len(records)
        for j, why in problems.items():
            marks[base + j] = source_problem(why, self.name, first + j)
        copies = (
            [j for j, r in enumerate(records) if r is not None and r.vhash]
            if problems
            else [j for j, r in enumerate(records) if r.vhash]
        )
        for j in copies:
            r = records[j]
            if r.kind == "replicated":
                marks[base + j] = (copy_key(r), r.process)
        self.records += records
        self.last_piece = len(records)
        return True


class _FileSource(_Source):
    def __init__(self, path: str, read_at: ReadAt, size: int, read_size: int) -> None:
        super().__init__(size)
        self.path, self.name = path, os.path.basename(path)
        self.offset = 0  # in the file, of the next read
        self.read_size = read_size
        self.read_at = read_at
        self.tail: "tuple | None" = None  # read_block's last line, after data

    def load(self) -> "tuple[list, dict] | bool":
        if self.tail is not None:
            d, why = self.tail
            self.tail = None
            return [d], ({} if why is None else {0: why})
        self.data, self.tail, self.offset = self.read_at(self.path, self.offset, self.read_size)
        return bool(self.data) or self.tail is not None


class _ChunkSource(_Source):
    """A process's objects on an object store, in order (``store.Reader``):
    whole objects, so every line ends with a newline."""

    def __init__(self, reader, size: int) -> None:
        super().__init__(size)
        self.reader = reader

    def load(self) -> bool:
        got = self.reader.next()
        if got is None:
            return False
        o, self.data = got
        self.name = o.name.rsplit("/", 1)[-1]
        return True


def _sources(path, read_at: ReadAt, stack: contextlib.ExitStack) -> list[_Source]:
    """One source per shard (and the shared file), or per process's chunks."""
    url = os.fspath(path) if Run.of(path).url else None
    found = sorted(store.objects(url).items()) if url else sources(path)
    n = max(len(found), 1)
    size = max(MIN_PIECE_BYTES, min(MAX_PIECE_BYTES, MERGE_BYTES // n))
    if url is None:
        read_size = max(MIN_READ_BYTES, min(MAX_READ_BYTES, READ_BYTES // n))
        return [_FileSource(f, read_at, size, read_size) for f in found]
    from concurrent.futures import ThreadPoolExecutor  # on use: object stores only

    fs, _ = store.url_fs(url)
    pool = ThreadPoolExecutor(max_workers=FETCH_THREADS, thread_name_prefix="pmaptap-fetch")
    stack.callback(pool.shutdown, wait=False, cancel_futures=True)
    piece = store.piece_bytes(len(found))
    return [
        _ChunkSource(store.Reader(url, fs, p, objs, store.Cursor(), pool, piece=piece), size)
        for p, objs in found
    ]


def iter_merged(path: str | os.PathLike, read_at: ReadAt) -> Iterator[Batch]:
    """Batches ``(first, records, problems)`` of the run's sources merged by
    record time (ties: the shared file, then shards in process order); a
    problem names its shard file (or chunk) and line there."""
    with contextlib.ExitStack() as stack:  # the fetch pool's shutdown
        srcs = _sources(path, read_at, stack)
        for s in srcs:
            s.extend()
        yield from _merge(srcs)


def _merge(srcs: list[_Source]) -> Iterator[Batch]:
    """The merge, in rounds. A round takes every loaded record that must
    come before anything not loaded yet: the watermark W is the smallest
    last loaded key of a source not read to its end (M: the first such
    source), and a record goes if its key is below W, or equal to W in a
    source up to M. The round's slices are put in order by one stable sort
    (C, not a heap operation a record); every round empties M. The result:
    every source's lines sorted by (key, source, line), less the copies of
    a replicated value that another process's line gave first."""
    inf = float("inf")
    lasts = [s.keys[-1] if s.keys and not s.done else inf for s in srcs]
    heap = [(s.keys[0], i) for i, s in enumerate(srcs) if s.keys]
    heapq.heapify(heap)
    heappop, heappush = heapq.heappop, heapq.heappush
    # The watermark: the smallest of ``lasts`` (ties: the first source), from
    # a heap whose entries go stale as lasts change (a scan of every source
    # a round was most of the time of a merge of thousands of shards).
    marks = [(last, i) for i, last in enumerate(lasts) if last != inf]
    heapq.heapify(marks)
    right, left = bisect.bisect_right, bisect.bisect_left
    first: dict[tuple, object] = {}  # key + vhash -> the process that wrote it first
    pos = 0  # of the last line given out
    while heap:
        while marks and lasts[marks[0][1]] != marks[0][0]:
            heappop(marks)
        w, m = marks[0] if marks else (inf, 0)
        keys_in: list = []
        recs_in: list = []
        marks_in: list = []
        wm = (w, m)  # sources whose next record is below W, or at W up to M
        taking = []
        while heap and heap[0] <= wm:
            taking.append(heappop(heap)[1])
        taking.sort()  # source order: the stable sort below breaks ties so
        for i in taking:
            s = srcs[i]
            keys, p = s.keys, s.pos
            cut = (right if i <= m else left)(keys, w, p)
            if cut > p:
                keys_in += keys[p:cut]
                recs_in += s.records[p:cut]
                marks_in += s.marks[p:cut]
            s.pos = cut
        start = pos + 1
        if recs_in:
            out, problems, pos = _merge_round(keys_in, recs_in, marks_in, first, pos)
        else:
            out, problems = [], {}
        for i in taking:
            s = srcs[i]
            keys = s.keys
            if not s.done and (len(keys) - s.pos) * 2 < max(s.last_piece, 1):
                s.extend()
                keys = s.keys
                last = keys[-1] if keys and not s.done else inf
                if last != lasts[i]:
                    lasts[i] = last
                    if last != inf:
                        heappush(marks, (last, i))
            elif s.done:
                lasts[i] = inf
            if s.pos < len(keys):
                heappush(heap, (keys[s.pos], i))
        if out:
            yield from _batches(start, out, problems)


def _merge_round(
    keys_in: list, recs_in: list, marks_in: list, first: dict, pos: int
) -> tuple[list, dict, int]:
    """A round's records in merged order, problems by position, the last
    position; only the marked lines are looked at one by one."""
    order = sorted(range(len(keys_in)), key=keys_in.__getitem__)
    out = [recs_in[k] for k in order]
    problems: dict = {}
    marks = [marks_in[k] for k in order]
    dropped = []
    for i in [i for i, m in enumerate(marks) if m is not None]:
        m = marks[i]
        if type(m) is str:
            problems[pos + i + 1 - len(dropped)] = m
        elif first.setdefault(m[0], m[1]) != m[1]:
            dropped.append(i)  # the same value from another process: one copy
    if dropped:
        drop = set(dropped)
        out = [r for i, r in enumerate(out) if i not in drop]
    return out, problems, pos + len(out)


_NONES = [None] * MERGED_BATCH


def _batches(start: int, out: list, problems: dict) -> Iterator[Batch]:
    """A round's records as batches of at most MERGED_BATCH."""
    found = iter(problems.items())  # in line order
    ahead = next(found, None)
    for k in range(0, len(out), MERGED_BATCH):
        part = out[k : k + MERGED_BATCH]
        # Let go of what is handed on: a consumer that drops a batch frees
        # its records while they are in the cache.
        out[k : k + MERGED_BATCH] = _NONES[: len(part)]
        end = start + k + len(part)
        mine = {}
        while ahead is not None and ahead[0] < end:
            mine[ahead[0]] = ahead[1]
            ahead = next(found, None)
        yield start + k, part, mine
