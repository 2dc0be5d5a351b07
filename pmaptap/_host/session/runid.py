"""Run ids and resuming: a fresh run id, the one a job agrees on, and the
(run, attempt) a resumed session continues, read back from the tap file;
the ``pmaptap/attempt`` meta record a resumed session writes first."""

from __future__ import annotations

import datetime
import os
import secrets
from typing import Callable, Iterator

from pmaptap import distributed
from pmaptap._host.pipeline import Pipeline
from pmaptap.tapfile import source


def _new_run_id() -> str:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{secrets.token_hex(3)}"


def default_run_id() -> str:
    """PMAPTAP_RUN if set; in a multi-process job an id agreed through JAX's
    coordination service; otherwise a fresh timestamped id."""
    env = os.environ.get("PMAPTAP_RUN")
    if env:
        return env
    return distributed.agree_run_id(_new_run_id) or _new_run_id()


def _env_attempt() -> int | None:
    text = os.environ.get("PMAPTAP_ATTEMPT")
    if not text:
        return None
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"PMAPTAP_ATTEMPT must be a whole number >= 0, got {text!r}")
    return n


def refuse_unresumed_restart(run: str | None) -> None:
    """A session opened without ``resume=True`` by a restarted attempt
    (``PMAPTAP_ATTEMPT`` >= 1) on a fixed run id: SessionError, before any file
    is opened (its records would be a second story of attempt 0's steps;
    docs/api.md, "Resuming a run after a restart"). Decided from the
    environment alone, so every process of the job decides alike."""
    attempt = _env_attempt()
    env_run = os.environ.get("PMAPTAP_RUN") or None
    fixed = run or env_run
    if not attempt or not fixed:
        return
    from pmaptap.errors import SessionError

    source = "run=" if run else "PMAPTAP_RUN"
    raise SessionError(
        f"pmaptap.Session: this is attempt {attempt} of a restarted job "
        f"(PMAPTAP_ATTEMPT={attempt}, set by `pmaptap.launch --restarts`) on the fixed "
        f"run id {fixed!r} ({source}), opened without resume=True: its records would be "
        "attempt 0's again, beside the earlier attempt's records of the same steps. Open "
        "it with resume=True to continue the run as a new attempt (readers then show "
        "each step's latest attempt; every tap needs step=, the training step), or "
        "leave the run id unset (no run=, no PMAPTAP_RUN) so that each attempt is a "
        "run of its own."
    )


def _last_run_in(
    read: Callable[[int, int], bytes], size: int, processes: int | None = None
) -> str | None:
    """The run of the last record of ``size`` bytes that ``read(start,
    end)`` gives, reading back from the end (a restart must not parse a
    large file whole). ``processes``: of the last record written by a
    process numbered below it (a JAX job's own; side ``Writer``s number
    theirs above the job's)."""
    from pmaptap.tapfile.record import parse_line

    chunk = 1 << 20
    while True:
        start = max(0, size - chunk)
        lines = read(start, size).split(b"\n")
        if start > 0:
            lines = lines[1:]  # maybe the middle of a line
        for raw in reversed(lines):
            d, _ = parse_line(raw) if raw.strip() else (None, None)
            if d is None:
                continue
            process = d.get("process")
            if processes is None or (type(process) is int and 0 <= process < processes):
                return d["run"]
        if start == 0:
            return None
        chunk *= 4


def _last_run(path: str, processes: int | None = None) -> str | None:
    """``_last_run_in`` of a local file."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        return _last_run_in(lambda a, b: os.pread(f.fileno(), b - a, a), size, processes)


def _last_runs(path: source.Run, processes: int) -> Iterator[str | None]:
    """The last run of each place the run at ``path`` is written to, by the
    job's processes (``_last_run_in``): the one shared file and the shards
    of processes below ``processes``, or on an object store each such
    process's last object that holds anything. Each read from its end: a
    few KB each, however long the run."""
    if not path.url:
        for src in source.sources(path):
            k = source.shard_process(src)
            if k is None or k < processes:
                yield _last_run(src, processes)
        return
    fs, _ = source.url_fs(path)
    for proc, objs in sorted(source.objects(path, missing_ok=True).items()):
        if proc >= processes:
            continue
        for o in reversed(objs):
            size = o.size if o.size >= 0 else fs.size(o.name)
            if size:

                def read(a: int, b: int, o: source.Object = o) -> bytes:
                    return source.fetch(fs, o, a, b)

                yield _last_run_in(read, size, processes)
                break


def refuse_reopened_run(path: source.Run, run: str | None, processes: int) -> None:
    """A session opened without ``resume=True`` on a fixed run id that the
    tap file already ends with: SessionError (docs/api.md, "pmaptap.Session",
    says why and what is read). Process 0 decides and tells the others before
    any of them writes (distributed.agree), so all of them raise, or none."""
    fixed = run or os.environ.get("PMAPTAP_RUN") or None
    if not fixed:
        return

    def decide() -> str:
        return "reopened" if fixed in _last_runs(path, processes) else "new"

    if (distributed.agree(f"reopened/{fixed}", decide) or decide()) == "new":
        return
    from pmaptap.errors import SessionError

    source = "run=" if run else "PMAPTAP_RUN"
    raise SessionError(
        f"pmaptap.Session: {path} already ends with records of run {fixed!r} ({source}), "
        "and this session does not resume it: its records would be a second story of "
        "the same steps under one run id (automatic steps counting from 0 again), which "
        "readers show as duplicates and divergences. Open it with resume=True to continue "
        "that run as a new attempt (readers then show each step's latest attempt; every "
        "tap needs step=), or pass another run id (or none: a fresh one each time)."
    )


def _last_attempt_merged(path: str, run: str | None) -> tuple[str | None, int | None]:
    """``_last_attempt`` of a sharded run (local shards or object-store
    chunks): the merged stream read once (the last run is that of the
    latest record by time)."""
    from pmaptap.tapfile.read import attempt_of

    last_run: str | None = None
    found: dict[str, int] = {}
    for _, d, _ in source.iter_lines(path):
        if d is not None:
            last_run = d["run"]
            found[d["run"]] = max(found.get(d["run"], 0), attempt_of(d))
    run = run or last_run
    return run, found.get(run) if run is not None else None


def _last_attempt(path: str | source.Run, run: str | None) -> tuple[str | None, int | None]:
    """(``run``, else the last run in the file; its highest attempt, or None
    if the file holds no record of it). Only lines holding the run's JSON
    text are parsed. ``path``: the session's Run (a path is resolved)."""
    import json

    from pmaptap.tapfile import record
    from pmaptap.tapfile.read import attempt_of

    path = source.Run.of(path)
    if path.sharded:
        return _last_attempt_merged(path, run)
    if not os.path.exists(path):
        return run, None
    if run is None:
        run = _last_run(path)
        if run is None:
            return None, None
    needle = json.dumps(run, ensure_ascii=False).encode("utf-8")
    found: int | None = None
    limit = record.MAX_LINE_BYTES
    with open(path, "rb") as f:
        while True:
            raw = f.readline(limit + 1)
            if not raw:
                return run, found
            if len(raw) > limit and not raw.endswith(b"\n"):
                while raw and not raw.endswith(b"\n"):
                    raw = f.readline(1 << 20)
                continue
            if needle not in raw:
                continue
            d, _ = record.parse_line(raw.rstrip(b"\n"))
            if d is not None and d["run"] == run:
                found = max(found or 0, attempt_of(d))


def _resume_point(path: source.Run, run: str | None) -> tuple[str, int]:
    """The (run, attempt) a resumed session continues, the same on every
    process of a job: process 0 reads the file and tells the others through
    the coordination service (agree_run_id), as for a fresh run id.

    The attempt is above every attempt the run already has in the file,
    whoever numbers it: PMAPTAP_ATTEMPT is a floor, not the answer. A
    launcher started again on a run whose restarts ran out numbers its
    first attempt 0 again; taken as is, the run's earlier attempt 1 would
    supersede the new records of every step it wrote, and the new ones
    would duplicate those of the earlier attempt 0."""
    run = run or os.environ.get("PMAPTAP_RUN") or None
    env = _env_attempt()
    if env == 0 and run is None:
        return default_run_id(), 0  # a launcher's first attempt: a new run

    def decide() -> str:
        last_run, last = _last_attempt(path, run)
        chosen = last_run or _new_run_id()
        attempt = max(env or 0, 0 if last is None else last + 1)
        return f"{attempt}:{chosen}"

    agreed = distributed.agree_run_id(decide) or decide()
    attempt, _, chosen = agreed.partition(":")
    return chosen, int(attempt)


def _queue_attempt_record(p: Pipeline, attempt: int) -> None:
    """The ``pmaptap/attempt`` meta record (process 0 only): which attempt
    this is and the job's shape, so readers can tell the restarts apart."""
    if p.process != 0:
        return
    import jax

    from pmaptap.tapfile.read import ATTEMPT_NAME

    r = p.records.meta(
        ATTEMPT_NAME,
        attempt,
        attempt,
        {
            "process_count": jax.process_count(),
            "device_count": jax.device_count(),
            "local_device_count": jax.local_device_count(),
        },
    )
    p.queue.put_records([r], None, (0, 0))
