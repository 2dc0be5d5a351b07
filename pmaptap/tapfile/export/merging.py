"""``pmaptap merge RUN -o OUT [--follow]``: a sharded run as one file, in
the merged order readers use (docs/cli.md)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import TYPE_CHECKING, Callable

from pmaptap.tapfile import source
from pmaptap.tapfile.record import encode_line
from pmaptap.tapfile.source import iter_lines

if TYPE_CHECKING:
    from pmaptap.tapfile.read import StopFlag


def _checked(run: str, out: str) -> source.Run:
    """The run, once ``out`` is neither among its files nor in its shard
    directory (``-o RUN.d/p00009.jsonl`` would be read back as a shard)."""
    run = source.Run.of(run)
    if run.url:
        return run
    target = os.path.realpath(out)
    if any(os.path.realpath(f) == target for f in source.sources(run)):
        raise ValueError(f"{out!r} is one of the files of run {run!r}; merge into another file")
    shards = os.path.realpath(source.shard_dir(run))
    if os.path.commonpath([shards, target]) == shards:
        raise ValueError(
            f"{out!r} is inside {shards!r}, the shard directory of run "
            f"{run!r}; merge into a file outside it"
        )
    return run


def merge(run: str, out: str) -> tuple[int, list[tuple[int, str]]]:
    """Every record of ``run`` into ``out`` (replaced at once); returns
    (records written, [(position, problem)] of skipped lines)."""
    run = _checked(run, out)
    bad: list[tuple[int, str]] = []
    n = 0
    directory = os.path.dirname(os.path.abspath(out))
    fd, tmp = tempfile.mkstemp(prefix=".merge-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            for _pos, d in source.records(iter_lines(run), lambda n, why: bad.append((n, why))):
                f.write(encode_line(d))
                n += 1
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    return n, bad


def merge_follow(
    run: str,
    out: str,
    *,
    stop: StopFlag,
    interval: float,
    timeout: float | None,
    report: Callable[[int, str], None] | None = None,
) -> int:
    """Append the run's records to ``out`` as written; returns how many."""
    from pmaptap.tapfile.read import RunFollower, polls

    run = _checked(run, out)
    follower = RunFollower(run)
    n = 0
    with open(out, "ab") as f:
        try:
            for _ in polls(stop, interval, timeout):
                for _pos, d in source.records(source.parsed(follower.poll()), report):
                    f.write(encode_line(d))
                    n += 1
                f.flush()
            return n
        finally:
            follower.close()
