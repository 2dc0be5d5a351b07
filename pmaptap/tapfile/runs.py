"""A run written in the *sharded* layout, read as one stream.

In the sharded layout (``Session(path, layout="sharded")``, ``Writer``) each
process appends to its own file ``<path>.d/p<process>.jsonl``: no shared lock
and nothing read back, so a process's cost does not depend on how many others
there are. Readers put the shards (and ``<path>`` itself, if processes in the
one-file layout wrote there too) back together here: one stream, ordered by
record time, that ``pmaptap.read`` and every command consume exactly as they
consume one file.

Replicated values: a value that every holding process verified on device (the
gathered/verified layouts, ``processes`` naming more than one process) is
written by one owner only (see ``owner``). Others (per-process taps, side
writers) are written by each process into its own shard; here the first copy
of a (key, vhash) is kept and the same value from another process is dropped,
as the one-file writer would have skipped it. A different value from another
process stays and is marked divergent by the usual reconciliation.
"""

from __future__ import annotations

import errno
import heapq
import os
import re
from typing import Callable, Iterator

from pmaptap.tapfile.format import record_key

__all__ = [
    "SHARD_SUFFIX",
    "shard_dir",
    "shard_path",
    "is_sharded",
    "sources",
    "owner",
    "iter_merged",
]

SHARD_SUFFIX = ".d"

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

Line = tuple[int, "dict | None", "str | None"]


def shard_dir(path: str | os.PathLike) -> str:
    """The directory of a run's shards: ``<path>.d`` (``path`` itself if it
    already names that directory)."""
    path = os.fspath(path)
    if path.endswith(SHARD_SUFFIX) and os.path.isdir(path):
        return path
    return path + SHARD_SUFFIX


def shard_path(path: str | os.PathLike, process: int) -> str:
    return os.path.join(shard_dir(path), f"p{int(process):05d}.jsonl")


def _shards(directory: str) -> list[str]:
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = [(int(m.group(1)), n) for n in names if (m := _SHARD_NAME.match(n))]
    return [os.path.join(directory, n) for _, n in sorted(found)]


def is_sharded(path: str | os.PathLike) -> bool:
    """Does ``path`` (the run's file name, or its ``.d`` directory) have
    shards to merge?"""
    if is_url(path):
        return True
    path = os.fspath(path)
    if os.path.isdir(path):
        return path.endswith(SHARD_SUFFIX) or bool(_shards(path))
    return os.path.isdir(path + SHARD_SUFFIX)


def sources(path: str | os.PathLike) -> list[str]:
    """Every file that holds records of the run at ``path``: the one shared
    file (if any process wrote there) and each shard, in process order."""
    path = os.fspath(path)
    if os.path.isdir(path):
        base = path[: -len(SHARD_SUFFIX)] if path.endswith(SHARD_SUFFIX) else None
        directory = path
    else:
        base, directory = path, path + SHARD_SUFFIX
    out = [base] if base and os.path.isfile(base) else []
    return out + _shards(directory)


def owner(key: tuple, processes: "tuple | list") -> int:
    """The one process among ``processes`` that writes a replicated value
    they all verified on device. A stable hash (not Python's salted
    ``hash``), so every process picks the same owner, and by key, so the
    writing is spread over the processes instead of all on one."""
    procs = sorted(processes)
    # blake2b, not crc32: crc32's low bits of keys that differ only in the
    # step's digits are far from uniform (one process owned none of 40 steps).
    import hashlib  # on use: readers of one file start faster

    digest = hashlib.blake2b(repr(key).encode("utf-8", "backslashreplace"), digest_size=8).digest()
    return procs[int.from_bytes(digest, "little") % len(procs)]


def is_url(path: str | os.PathLike) -> bool:
    """An object-store run (``s3://``, ``gs://``, ``memory://``...)."""
    return isinstance(path, str) and "://" in path and not path.startswith("file://")


def url_fs(url: str):
    """(fsspec filesystem, path inside it) for ``url``; fsspec and the
    store's client (s3fs, gcsfs) are optional dependencies."""
    try:
        import fsspec
    except ImportError:
        raise ImportError(
            f"{url!r}: object stores need fsspec and the store's "
            "client: pip install 'pmaptap[s3]' (or [gcs])"
        ) from None
    return fsspec.core.url_to_fs(url)


_CHUNK_NAME = re.compile(r"p(\d+)-[0-9]+-[0-9a-f]+-[0-9]+\.jsonl\Z")


def chunks(url: str, *, missing_ok: bool = False) -> dict[int, list[str]]:
    """process -> its committed chunks in write order (names sort by writer
    start time, then sequence number).

    A run with no chunk at all (no such bucket, no such prefix) raises
    ``FileNotFoundError`` naming the URL and the store's own reason, as a
    missing local file does: every writer puts an empty chunk there when it
    opens, so a run that was ever opened has one. ``missing_ok`` (a follower
    waiting for the run to start) returns ``{}`` instead."""
    fs, prefix = url_fs(url)
    where = prefix + SHARD_SUFFIX
    try:
        names = fs.ls(where, detail=False, refresh=True)
        why = "no chunks there"
    except FileNotFoundError as e:
        names, why = [], str(e) or "not found"
    out: dict[int, list[str]] = {}
    for n in sorted(names):
        m = _CHUNK_NAME.match(n.rsplit("/", 1)[-1])
        if m:
            out.setdefault(int(m.group(1)), []).append(n)
    if not out and not missing_ok:
        raise FileNotFoundError(
            errno.ENOENT, f"no such run: {url} (nothing under {url}{SHARD_SUFFIX}/: {why})"
        )
    return out


def iter_chunks(fs, names: list[str]) -> Iterator[tuple[int, "dict | None", "str | None", str]]:
    """(line number, record or None, problem or None, chunk) over the lines
    of one process's chunks, in order. A chunk is whole (objects are
    written at once), so every line ends with a newline."""
    from pmaptap.tapfile.parse import parse_line

    lineno = 0
    for name in names:
        data = fs.cat_file(name)
        lines = data.split(b"\n")
        if lines[-1] == b"":
            lines.pop()  # the newline ending the last line (or empty)
        for raw in lines:
            lineno += 1
            d, problem = parse_line(raw)
            yield lineno, d, problem, name.rsplit("/", 1)[-1]


def _streams(path, iter_file) -> list[Iterator[tuple]]:
    """One (line number, record, problem, source name) iterator per source."""
    if is_url(path):
        fs, _ = url_fs(os.fspath(path))
        return [iter_chunks(fs, names) for _, names in sorted(chunks(path).items())]

    def local(f: str) -> Iterator[tuple]:
        name = os.path.basename(f)
        for lineno, d, problem in iter_file(f):
            yield lineno, d, problem, name

    return [local(f) for f in sources(path)]


def iter_merged(
    path: str | os.PathLike, iter_file: Callable[[str], Iterator[Line]]
) -> Iterator[Line]:
    """(position, record or None, problem or None) over every source of the
    run, merged by record time. Positions count lines of the merged stream;
    a problem names the shard file and its own line number."""

    def keyed(i: int, stream: Iterator[tuple]) -> Iterator[tuple]:
        t = float("-inf")
        for lineno, d, problem, name in stream:
            if d is not None:
                tt = d.get("time")
                if isinstance(tt, (int, float)) and not isinstance(tt, bool):
                    t = max(t, float(tt))  # keep each source non-decreasing
            elif problem is not None:
                problem = f"{problem} ({name} line {lineno})"
            yield t, i, lineno, d, problem

    # key + vhash -> the process that wrote it first
    first: dict[tuple, object] = {}
    pos = 0
    for _t, _i, _n, d, problem in heapq.merge(
        *(keyed(i, st) for i, st in enumerate(_streams(path, iter_file))),
        key=lambda x: (x[0], x[1], x[2]),
    ):
        if d is not None and d.get("kind") == "replicated" and d.get("vhash"):
            k = (record_key(d), d["vhash"])
            proc = d.get("process")
            got = first.setdefault(k, proc)
            if got != proc:
                continue  # the same value from another process: one copy
        pos += 1
        yield pos, d, problem
