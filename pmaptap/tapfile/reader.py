"""Reading tap files: every valid record in file order, never eval/pickle."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from itertools import count, repeat
from typing import Any, BinaryIO, Iterator

from pmaptap.tapfile import parse, runs
from pmaptap.tapfile.arrays import ByteStore, MissingBytes, load_value
from pmaptap.tapfile.attempts import Attempts, check_mode
from pmaptap.tapfile.format import decode_record, record_key
from pmaptap.tapfile.parse import parse_line

__all__ = [
    "DivergenceIndex",
    "iter_batches",
    "iter_file_batches",
    "iter_file_lines",
    "iter_lines",
    "parse_line",
    "read",
    "reconcile_divergence",
]

_SKIP_CHUNK = 1 << 20


# A read that has taken this long shows a progress bar on a terminal.
PROGRESS_DELAY_S = 2.0
# Lines between two looks at the clock. Reads now go a batch (BATCH_BYTES)
# at a time and look once per batch; kept for callers that set it.
_PROGRESS_EVERY = 8192


class _ReadProgress:
    """A bar of bytes read, on stderr, only once a read has lasted
    PROGRESS_DELAY_S and only where a person watches (a TTY; the
    PMAPTAP_PROGRESS environment variable forces it on or off)."""

    def __init__(self, f: BinaryIO, path: str | os.PathLike) -> None:
        self.f = f
        self.path = os.fspath(path)
        self.start = time.monotonic()
        self.bar: Any = None
        self.off = False

    def tick(self) -> None:
        if self.off:
            return
        if self.bar is None:
            if time.monotonic() - self.start < PROGRESS_DELAY_S:
                return
            from pmaptap.progress import Progress

            self.size = os.fstat(self.f.fileno()).st_size
            # process=0: a reader never asks JAX which process it is.
            self.bar = Progress(
                max(-(-self.size >> 20), 1),
                desc=f"reading {os.path.basename(self.path)}",
                unit="MiB",
                process=0,
                min_interval=0.25,
            )
            if not self.bar.enabled:
                self.off = True
                return
        self._show(self.f.tell() >> 20)

    def _show(self, mib: int) -> None:
        if mib > self.bar.n:
            self.bar.update(mib - self.bar.n)

    def close(self) -> None:
        if self.bar is not None and self.bar.enabled:
            if self.f.tell() >= self.size:  # read to the end: a full bar
                self._show(self.bar.total)
            self.bar.close()


def iter_lines(path: str | os.PathLike) -> Iterator[tuple[int, dict | None, str | None]]:
    """(line number, record or None, problem or None) for every line, read a
    line at a time: a line longer than parse.MAX_LINE_BYTES is reported
    without being held in memory. A run in the sharded layout (``path.d/``)
    is read as one stream merged from its shards (tapfile/runs.py)."""
    if runs.is_sharded(path):
        return runs.iter_merged(path, iter_file_lines)
    return iter_file_lines(path)


def iter_batches(path: str | os.PathLike) -> Iterator[Batch]:
    """``iter_lines`` as batches (see iter_file_batches): a run in the
    sharded layout is its merged stream cut into batches."""
    if not runs.is_sharded(path):
        return iter_file_batches(path)
    return _batched(iter_lines(path))


def _batched(
    lines: Iterator[tuple[int, dict | None, str | None]], size: int = 512
) -> Iterator[Batch]:
    # The merged stream of a sharded run numbers lines by their position in
    # it, consecutively, so one batch is a run of consecutive numbers.
    records: list = []
    problems: dict = {}
    first = 1
    for lineno, d, problem in lines:
        if not records:
            first = lineno
        records.append(d)
        if problem is not None:
            problems[lineno] = problem
        if len(records) == size:
            yield first, records, problems
            records, problems = [], {}
    if records:
        yield first, records, problems


def iter_file_lines(path: str | os.PathLike) -> Iterator[tuple[int, dict | None, str | None]]:
    """``iter_lines`` of one file. A long read draws a progress bar on a
    terminal (see _ReadProgress)."""
    for first, records, problems in iter_file_batches(path):
        if not problems:
            yield from zip(count(first), records, repeat(None))
            continue
        for i, d in enumerate(records):
            yield first + i, d, problems.get(first + i)


# Bytes read per batch: ~300 records of a training job. Small enough that a
# batch's records are still in the CPU cache when the reader walks them
# again (1 MiB batches were ~2x slower in the summary benchmark).
BATCH_BYTES = 1 << 16

Batch = tuple[int, list, dict]


def iter_file_batches(path: str | os.PathLike, unchecked: bool = False) -> Iterator[Batch]:
    """The lines of one file as batches ``(first, records, problems)``:
    ``records[i]`` is line ``first + i`` as a record (undecoded) or None,
    ``problems`` maps the line number of each line that is not a record to
    why (parse.parse_lines; an empty line is one). What each line becomes
    is exactly what parse.parse_line says, plus what only the file shows: a
    line longer than parse.MAX_LINE_BYTES is reported without being held in
    memory past that limit, and a last line without a newline that is not
    valid JSON is a torn line (a writer still writing it, or killed). A long
    read draws a progress bar on a terminal (see _ReadProgress).

    ``unchecked``: a batch whose lines orjson takes as they are comes as
    ``(first, values, {}, lines)``, what orjson made of each line, not yet
    checked as records (parse.load_lines: for a reader that checks them
    itself and hands any other line to parse.parse_line); every other batch
    comes as ``(first, records, problems, None)``. Without it, batches are
    ``(first, records, problems)``."""
    limit = parse.MAX_LINE_BYTES
    with open(path, "rb") as f:
        progress = _ReadProgress(f, path)
        try:
            lineno = 1
            while True:
                buf = f.read(BATCH_BYTES)
                if not buf:
                    return
                progress.tick()
                last: tuple[dict | None, str | None] | None = None
                if buf[-1] != 0x0A:
                    # Finish the batch's last line (readline stops at its
                    # newline, or once the line is over the limit).
                    start = buf.rfind(b"\n") + 1
                    rest = f.readline(limit + 1 - (len(buf) - start))
                    if rest.endswith(b"\n"):
                        buf += rest
                    else:
                        raw = buf[start:] + rest
                        buf = buf[:start]
                        if len(raw) > limit:
                            size = len(raw) + _skip_line(f)
                            why = f"{size} bytes or more; readers take at most {limit}"
                            last = (None, f"line too long ({why})")
                        else:
                            # No newline at the end of the file: a writer is
                            # still writing this line, or was killed while
                            # writing it.
                            d, problem = parse_line(raw)
                            if problem is not None and problem.startswith("not valid JSON"):
                                problem = "torn last line (no newline)"
                            last = (d, problem)
                records: list = []
                where: dict = {}
                if buf:
                    # buf ends with a newline: the split's last item is empty.
                    lines = buf.split(b"\n")
                    lines.pop()
                    block = buf
                    values = parse.load_lines(lines, block) if unchecked else None
                    if values is not None:
                        yield lineno, values, {}, lines
                        lineno += len(values)
                    else:
                        records, where = parse.parse_lines(lines, block)
                problems = {lineno + i: why for i, why in where.items()} if where else {}
                if last is not None:
                    if last[1] is not None:
                        problems[lineno + len(records)] = last[1]
                    records.append(last[0])
                if unchecked:
                    if records:
                        yield lineno, records, problems, None
                else:
                    yield lineno, records, problems
                lineno += len(records)
        finally:
            progress.close()


def _skip_line(f: BinaryIO) -> int:
    """Read past the rest of an over-long line; returns the bytes skipped."""
    skipped = 0
    while True:
        chunk = f.readline(_SKIP_CHUNK)
        skipped += len(chunk)
        if not chunk or chunk.endswith(b"\n"):
            return skipped


def read(
    path: str | os.PathLike,
    *,
    as_frame: bool = False,
    name: str | Iterable[str] | None = None,
    step: int | str | tuple | range | None = None,
    run: str | None = None,
    device: int | None = None,
    process: int | None = None,
    attempts: str = "latest",
):
    """All valid records of a tap file, in file order, as dicts.

    A run resumed after a restart (``Session(resume=True)``) holds the old
    attempt's records of the replayed steps too; ``attempts="latest"`` (the
    default) leaves out those a later attempt superseded (one story per
    step), ``attempts="all"`` returns every record, each with its
    ``attempt`` field (0 for the first attempt).

    A value stored as bytes (an array above tapfile/arrays.INLINE_MAX_BYTES)
    comes back as an ndarray of its own dtype and shape, bit for bit; inline
    arrays as nested lists: ``np.asarray(r["value"], dtype=r["dtype"])``
    takes both. Lines that are not valid records (garbage, a torn last line
    from a killed writer, a line whose stored bytes are missing) are skipped
    with one warning (the "pmaptap" logger) that lists
    them. Non-finite numbers come back as float NaN/inf. ``as_frame=True``
    returns a tidy pandas DataFrame, one row per record (columns:
    pmaptap/tapfile/frame.py).

    Filters, applied while parsing (a record that does not match is never
    decoded or kept): ``name`` (one name or several), ``step`` (N, an
    inclusive ``(lo, hi)`` with either end None, ``"A:B"`` as on the command
    line, or a ``range`` with step 1), ``run``, ``device`` and ``process``. A
    replicated record matches every device and process that held its value,
    and divergence is still judged on every copy of a matched step.
    """
    check_mode(attempts)
    flt = _filter(name, step, run, device, process)
    out: list[dict] = []
    bad: list[tuple[int, str]] = []
    store = None
    index = DivergenceIndex()
    later = Attempts()  # steps a later attempt rewrote
    for lineno, d, problem in iter_lines(path):
        if d is None:
            if problem != "empty line":
                bad.append((lineno, problem or "invalid"))
            continue
        if flt is not None and not flt.key_match(d):
            continue
        # Judged on every copy of a matched step, also those the device or
        # process filter leaves out: a copy filtered out still disagrees, and
        # an elastic restart supersedes a step on every device.
        index.add(d)
        later.add(d)
        if flt is not None and not flt(d):
            continue
        r = decode_record(d)
        if "bytes" in d:
            # A value stored as bytes: loaded as an ndarray of its dtype. A
            # line whose bytes are not there is reported and skipped.
            store = store or ByteStore(path)
            try:
                r["value"] = load_value(r, store)
            except (MissingBytes, OSError) as e:
                bad.append((lineno, f"{d['name']!r} step {d['step']}: {e}"))
                continue
        out.append(r)
    for r in out:
        if index.divergent(r):
            r["divergent"] = True
    if attempts == "all":
        for r in out:
            r.setdefault("attempt", 0)
    elif later:
        out = [r for r in out if not later.superseded(r)]
    if bad:
        shown = "; ".join(f"line {n}: {why}" for n, why in bad[:5])
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        from pmaptap._log import log  # on use: a read that skips nothing loads no logging

        log.warning(
            f"pmaptap.read({os.fspath(path)!r}) skipped {len(bad)} invalid line(s): {shown}{more}"
        )
    if as_frame:
        from pmaptap.tapfile.frame import to_frame

        return to_frame(out)
    return out


def _filter(name: Any, step: Any, run: Any, device: Any, process: Any) -> Any:
    """read()'s filter arguments as a views.Filter (None: no filter); a bad
    argument is a ValueError/TypeError that says what is accepted."""
    if name is None and step is None and run is None and device is None and process is None:
        return None
    # views imports this module; imported here, on use, not at load.
    from pmaptap.tapfile.views import Filter, parse_steps

    if name is None:
        names: tuple = ()
    elif isinstance(name, str):
        names = (name,)
    else:
        names = tuple(name) if isinstance(name, Iterable) else ()
        if not names or not all(isinstance(n, str) for n in names):
            raise TypeError(
                f"pmaptap.read: name must be a str or a non-empty list of str, got {name!r}"
            )
    steps: tuple = (None, None)
    if isinstance(step, bool):
        raise TypeError(
            f"pmaptap.read: step must be an int, (lo, hi), 'A:B' or a range, got {step!r}"
        )
    if isinstance(step, int):
        steps = (step, step)
    elif isinstance(step, str):
        steps = parse_steps(step)
    elif isinstance(step, range):
        if step.step != 1 or len(step) == 0:
            raise ValueError(
                f"pmaptap.read: step={step!r} must be a non-empty "
                "range with step 1 (every=N taps: give (lo, hi))"
            )
        steps = (step.start, step.stop - 1)
    elif (
        isinstance(step, (tuple, list))
        and len(step) == 2
        and all(s is None or (isinstance(s, int) and not isinstance(s, bool)) for s in step)
    ):
        steps = tuple(step)
        if None not in steps and steps[0] > steps[1]:
            raise ValueError(
                f"pmaptap.read: step={step!r} is empty "
                f"({steps[0]} > {steps[1]}); (lo, hi) includes both ends"
            )
    elif step is not None:
        raise TypeError(
            f"pmaptap.read: step must be an int, (lo, hi), 'A:B' or a range, got {step!r}"
        )
    for what, v, kind, text in (
        ("run", run, str, "a str"),
        ("device", device, int, "an int (a device id)"),
        ("process", process, int, "an int"),
    ):
        if v is not None and (not isinstance(v, kind) or isinstance(v, bool)):
            raise TypeError(f"pmaptap.read: {what} must be {text}, got {v!r}")
    return Filter(names=names, steps=steps, process=process, device=device, run=run)


class DivergenceIndex:
    """Which replicated keys (run, name, step, pass) the file holds with more
    than one value from more than one process: ``add`` every replicated
    record seen, then ask ``divergent``. The first writer of a key could not
    know that a later process would disagree (see xdedup); one process
    re-writing a key with new values is not divergence. Holds one small entry
    per replicated key, never the records."""

    def __init__(self) -> None:
        # (run, name, pass, index, attempt) -> step -> what was seen there:
        # (vhash, process) while one of each, then {vhash: processes}. By
        # step within the rest of the key: a small int per step, not a
        # tuple per record, for a summary of a long run.
        self._seen: dict[tuple, dict[Any, Any]] = {}
        # Whether any key was seen with a second (vhash, process): only then
        # can ``divergent`` be true (readers skip asking otherwise).
        self.any_repeat = False

    def steps_of(
        self, run: Any, name: Any, pass_: Any = "forward", index: Any = None, attempt: Any = 0
    ) -> dict[Any, Any]:
        """The step -> entry map of one (run, name, pass, index key,
        attempt): record_key without its step. A reader that adds many
        records of one such key (``pmaptap summary``) sets entries there
        directly: ``setdefault(step, (vhash, process))``, and ``repeat`` when
        that returns another entry."""
        key = (run, name, pass_, index, attempt)
        steps = self._seen.get(key)
        if steps is None:
            steps = self._seen[key] = {}
        return steps

    def add(self, r: dict) -> None:
        if r.get("kind") != "replicated" or not r.get("vhash"):
            return
        run, name, step, pass_, index, attempt = record_key(r)
        steps = self.steps_of(run, name, pass_, index, attempt)
        entry = (r["vhash"], r.get("process"))
        if steps.setdefault(step, entry) is not entry:
            self.repeat(steps, step, entry)

    def repeat(self, steps: dict, step: Any, entry: tuple) -> None:
        """``entry`` (vhash, process) met another one at ``step``."""
        got = steps[step]
        if isinstance(got, tuple):
            if got == entry:
                return
            self.any_repeat = True
            got = steps[step] = {got[0]: {got[1]}}
        got.setdefault(entry[0], set()).add(entry[1])

    def divergent(self, r: dict) -> bool:
        if r.get("kind") != "replicated":
            return False
        run, name, step, pass_, index, attempt = record_key(r)
        steps = self._seen.get((run, name, pass_, index, attempt))
        got = steps.get(step) if steps is not None else None
        if not isinstance(got, dict):
            return False
        return len(got) > 1 and len(set().union(*got.values())) > 1


def reconcile_divergence(records: list[dict]) -> None:
    """Mark every replicated record of a key that the file holds with
    different values from different processes ``divergent`` (DivergenceIndex)."""
    index = DivergenceIndex()
    for r in records:
        index.add(r)
    for r in records:
        if index.divergent(r):
            r["divergent"] = True
