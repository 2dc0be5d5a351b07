"""``pmaptap summary --jobs N`` and ``validate --jobs N``: the pieces'
states merged exactly (docs/architecture.md, "Summaries that split")."""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import tempfile
from typing import Any, Callable, Iterator, NamedTuple

from pmaptap.errors import NeedSerial, WorkerError
from pmaptap.tapfile import source
from pmaptap.tapfile.analyze import shardwise, summary, validate
from pmaptap.tapfile.analyze.summary import Result, Summarizer
from pmaptap.tapfile.analyze.validate import Report, Validator
from pmaptap.tapfile.read import Filter, latest
from pmaptap.tapfile.source import collector_paused, iter_file_records

# Without --jobs: a worker per this many bytes of the run at most (below
# this, one process is as quick).
MIN_JOB_BYTES = 8 << 20
# The states a worker sends per its share of a sharded run: each costs the
# parent one more take-in.
PIECES_PER_JOB = 4
# The units a sharded run's sources are handed out in, per process: the
# run ends one unit after the first worker is idle at most (equal pieces
# per process ended far apart even on equal cores).
UNITS_PER_JOB = 16


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def jobs_for(path: str | os.PathLike, asked: int | None) -> int:
    """``asked``, or (None) the cores, at most one per MIN_JOB_BYTES of the run."""
    if asked is not None:
        return asked
    run = source.Run.of(path)
    if run.url:
        return 1
    try:
        files = source.sources(run) if run.sharded else [run]
        size = sum(map(os.path.getsize, files))
    except OSError:
        return 1
    return max(1, min(cores(), size // MIN_JOB_BYTES))


class Plan(NamedTuple):
    sharded: bool
    # A sharded run: lists of source indexes (of ``files``), contiguous, of
    # about equal bytes, UNITS_PER_JOB a process; one file: (start, stop)
    # byte ranges cut at line starts.
    pieces: list
    files: list[str]  # a sharded run's sources (source.sources), listed once
    sizes: list[int]  # their bytes, each stated once

    def sources(self, piece: list[int]) -> tuple[list[tuple[int, str]], float]:
        """A sharded piece's (index, path) of each source, and its share of the run's bytes."""
        total = sum(self.sizes)
        share = sum(self.sizes[i] for i in piece) / total if total else 1.0
        return [(i, self.files[i]) for i in piece], share


def plan(path: str | os.PathLike, jobs: int) -> Plan | None:
    """The pieces ``jobs`` processes read ``path`` in; None: one reads it."""
    run = source.Run.of(path)
    if jobs < 2 or run.url:
        return None
    if run.sharded:
        files = source.sources(run)
        sizes = [os.path.getsize(f) for f in files]
        if len(sizes) < 2:
            return None
        return Plan(True, _groups(sizes, jobs * UNITS_PER_JOB), files, sizes)
    size = os.path.getsize(path)
    cuts = sorted({_line_start(path, size * k // jobs) for k in range(1, jobs)} | {0, size})
    pieces = [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]
    return Plan(False, pieces, [], []) if len(pieces) > 1 else None


def _groups(sizes: list[int], jobs: int) -> list[list[int]]:
    """Contiguous groups of indexes of about equal total size."""
    jobs = min(jobs, len(sizes))
    total = sum(sizes) or 1
    out: list[list[int]] = [[]]
    done = 0
    for i, n in enumerate(sizes):
        left = len(sizes) - i  # sources left, this one included
        groups_left = jobs - len(out)
        if out[-1] and (done >= total * len(out) / jobs or left <= groups_left):
            out.append([])
        out[-1].append(i)
        done += n
    return out


def _line_start(path: str | os.PathLike, offset: int) -> int:
    """The start of the first line at or after ``offset``."""
    if offset <= 0:
        return 0
    with open(path, "rb") as f:
        f.seek(offset - 1)
        # In blocks: a line may be longer than memory should hold.
        while (block := f.readline(1 << 16)) and not block.endswith(b"\n"):
            pass
        return f.tell()


def _context() -> Any:
    """How workers start: forked (the quickest), unless this process runs
    other threads (JAX's), which a fork would copy mid-work; then
    forkserver, or spawn where there is no fork."""
    import multiprocessing
    import sys
    import threading

    methods = multiprocessing.get_all_start_methods()
    if "fork" in methods and threading.active_count() == 1 and "jax" not in sys.modules:
        return multiprocessing.get_context("fork")
    if "forkserver" in methods:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
        return ctx
    return multiprocessing.get_context("spawn")


def _serve(conn: Any) -> None:
    """A worker: ``target(*args)`` of each task ``(target, *args)`` sent back, until None."""
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        try:
            with collector_paused():
                result = task[0](*task[1:])
            conn.send(("ok", result))
        except OSError as e:
            # An unreadable source: raised in the parent as --jobs 1 raises it.
            args = (e.errno, e.strerror, e.filename) if e.errno is not None else (str(e),)
            with contextlib.suppress(Exception):
                conn.send(("oserror", args))
        except BaseException as e:  # noqa: BLE001 - said to the parent, which raises it
            import traceback

            with contextlib.suppress(Exception):
                conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _result(p: Any, conn: Any) -> Any:
    """The result worker ``p`` sent on ``conn``; its failure, or its end
    (killed: a reset pipe, or nothing at all), raised here."""
    try:
        status, result = conn.recv()
    except (EOFError, ConnectionError):
        p.join(timeout=1)
        raise WorkerError(
            f"a worker process reading the run ended (exit code {p.exitcode})"
        ) from None
    if status == "oserror":
        raise OSError(*result)  # OSError(errno, ...) is its subclass: IsADirectoryError, ...
    if status != "ok":
        raise WorkerError(f"a worker process failed: {result}")
    return result


class _Pool(contextlib.AbstractContextManager):
    """Up to ``size`` worker processes taking tasks ``(function, *args)`` as
    each is free. One pool serves every phase of a read, so a worker is
    started once, before this process holds the workers' states (a fork of
    a large process costs more)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.process: dict[Any, Any] = {}  # connection -> its worker
        self.queued: dict[Any, list[int]] = {}  # connection -> its tasks, oldest first

    def __exit__(self, *exc: Any) -> None:
        # Killed where the read was given up (an error, a map left with tasks queued).
        kill = exc[0] is not None or any(self.queued.values())
        for conn, p in self.process.items():
            if kill:
                p.kill()
            else:
                # Done. A worker that ended already must not make the
                # pipe's error end the command (BrokenPipeError: exit 0).
                with contextlib.suppress(OSError):
                    conn.send(None)
            conn.close()
        for p in self.process.values():
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()

    def map(self, tasks: list[tuple], here: "tuple | None" = None) -> Iterator:
        """``function(*args)`` of each task, in order; ``here``: one run in this
        process (which would wait otherwise) once the workers have theirs, first."""
        todo = iter(tasks)
        results: dict[int, Any] = {}
        want = 0
        for i, result in self._each(lambda conn: next(todo, None), len(tasks), here):
            results[i] = result
            while want in results:
                yield results.pop(want)
                want += 1

    def feed(self, make: Callable[[Any], "tuple | None"], most: int) -> Iterator:
        """Results of tasks made as workers take them (``make(worker)``:
        its next task, or None), as they come; at most ``most`` workers."""
        return (result for _, result in self._each(make, most))

    def _each(
        self, take: Callable[[Any], "tuple | None"], most: int, here: "tuple | None" = None
    ) -> Iterator:
        """(i, result) of the tasks ``take(worker)`` gives (None: no more), as they
        come. Each worker has one task queued beside the one it runs, so it
        never waits while this process takes a result in."""
        numbers = itertools.count(here is not None)
        queued = self.queued

        def give(conn: Any) -> None:
            task = take(conn)
            if task is not None:
                queued[conn].append(next(numbers))
                with contextlib.suppress(ConnectionError):  # taking its result in says how
                    conn.send(task)

        for conn in list(queued):
            give(conn)
            give(conn)
        while len(self.process) < min(self.size, most):
            ctx = _context()
            conn, theirs = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(theirs,), daemon=True)
            p.start()
            theirs.close()
            self.process[conn], queued[conn] = p, []
            give(conn)
            give(conn)
        if here is not None:
            with collector_paused():
                yield 0, here[0](*here[1:])
        from multiprocessing.connection import wait

        while any(queued.values()):
            for conn in wait([c for c, q in queued.items() if q]):
                i = queued[conn].pop(0)
                result = _result(self.process[conn], conn)
                give(conn)
                yield i, result


def _sharded(pieces: Plan, empty: Any, jobs: int) -> Any:
    """The sources of a sharded run read in ``jobs`` processes into states
    like ``empty`` (shardwise.py), combined (docs/architecture.md)."""
    with tempfile.TemporaryDirectory(prefix="pmaptap-") as tmp, _Pool(jobs) as pool:
        buckets = shardwise.buckets_for(sum(pieces.sizes), jobs)
        units = iter(pieces.pieces)
        enough = 1 / (jobs * PIECES_PER_JOB)
        holds: dict[Any, float] = {}  # worker -> the share of the run its state holds

        def make(worker: Any) -> "tuple | None":
            unit = next(units, None)
            if unit is None:
                if worker not in holds:
                    return None
                sources, share, send = [], holds.pop(worker), True  # the last: sent
            else:
                sources, part = pieces.sources(unit)
                share = holds.pop(worker, 0.0) + part
                send = share >= enough
                if not send:
                    holds[worker] = share
            return (_read_on, empty, sources, share, buckets, tmp, send)

        def resolver(tasks: list) -> Iterator:
            return pool.map([(_resolve, *t) for t in tasks])

        states = pool.feed(make, len(pieces.pieces))
        return shardwise.combine((s for s in states if s is not None), jobs, resolver)


# A worker's state between the units it reads (``_read_on``).
_open: list = []


def _read_on(
    empty: Any, sources: list, share: float, buckets: int, spill_dir: str, send: bool
) -> Any:
    """``sources`` read into this worker's state (``empty`` if it has none),
    given back where ``send``, else kept for the next unit (None)."""
    got = _open.pop() if _open else empty
    shardwise.read(got, sources, share, buckets, spill_dir, sent=True, end=send)
    if send:
        return got
    _open.append(got)
    return None


def _resolve(*task: Any) -> Any:
    # Looked up when it runs: a spawned worker finds this one by name.
    return shardwise.resolve(*task)


def _read(
    path: source.Run,
    jobs: int,
    shardwise_read: Callable[["shardwise.Reader | None"], Any],
    in_pieces: Callable[[list], Any],
    merged: Callable[[], Any],
) -> Any:
    """A summary or a report of ``path`` in ``jobs`` processes: a sharded run
    shard by shard, one file in byte ranges, else (not exact) the merged stream."""
    pieces = plan(path, jobs)
    got = None
    try:
        if pieces is not None and pieces.sharded:
            got = shardwise_read(functools.partial(_sharded, pieces, jobs=jobs))
            # None: only the merged stream orders it (one process would too).
            return merged() if got is None else got
        if pieces is not None:
            got = in_pieces(pieces.pieces)
    except NeedSerial:
        pass
    if got is None and path.sharded and not path.url:
        got = shardwise_read(None)
    return got if got is not None else merged()


def summarize_file(path: str | os.PathLike, flt: Filter | None, jobs: int) -> Result:
    """summary.summarize_file in ``jobs`` processes."""
    flt = flt or Filter()
    path = source.Run.of(path)
    return _read(
        path,
        jobs,
        lambda reader: shardwise.summarize(path, flt, reader),
        lambda parts: latest(
            path,
            lambda a: _in_pieces(_summary_piece, Summarizer.result, path, parts, flt, a),
            attempts=summary.first_attempts(path, flt),
        ),
        lambda: summary.summarize_file(path, flt),
    )


def validate_file(path: str | os.PathLike, jobs: int) -> Report:
    """validate.validate_file in ``jobs`` processes."""
    path = source.Run.of(path)
    return _read(
        path,
        jobs,
        lambda reader: shardwise.validate(path, reader),
        lambda parts: latest(
            path, lambda a: _in_pieces(_validate_piece, Validator.report, path, parts, a)
        ),
        lambda: validate.validate_file(path),
    )


def _in_pieces(piece: Callable, result: Callable, path: str, parts: list, *args: Any) -> Any:
    """``result`` of the states ``piece(path, part, *args)`` of each byte range
    ``part`` (the first read in this process) merged in order; None where one
    met a later attempt while assuming none."""
    first, *rest = [(piece, path, part, *args) for part in parts]
    with _Pool(len(rest)) as pool:
        got = list(pool.map(rest, here=first))
    if any(g is None for g in got):
        return None
    merged = got[0]
    for state in got[1:]:
        merged.absorb(state, merged.lines)
    return result(merged)


def _summary_piece(path: str, part: tuple, flt: Filter, attempts: Any) -> Summarizer | None:
    acc = summary.summarize_batches(iter_file_records(path, *part), flt, attempts)
    return None if attempts is None and acc.resumed else acc


def _validate_piece(path: str, part: tuple, attempts: Any) -> Validator | None:
    return validate.check_batches(path, iter_file_records(path, *part), attempts)
