"""Reading a file twice instead of holding it (docs/performance.md): a
record's divergence and supersession depend on records anywhere in it."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from typing import Any

from pmaptap.tapfile.read.attempts import Attempts
from pmaptap.tapfile.read.divergence import DivergenceIndex
from pmaptap.tapfile.read.query import Filter
from pmaptap.tapfile.record import record_key
from pmaptap.tapfile.source import Run, iter_lines


@dataclasses.dataclass
class FirstPass:
    """What the first pass learned (names and runs: to say what a file
    holds when nothing matched)."""

    # The record_key of every divergent replicated key (the index itself is
    # dropped before the second pass).
    divergent: set = dataclasses.field(default_factory=set)
    attempts: Attempts = dataclasses.field(default_factory=Attempts)
    problems: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    names: set = dataclasses.field(default_factory=set)
    runs: set = dataclasses.field(default_factory=set)
    # The file's last line then, and whether it was a record: a second pass
    # over a file still being written stops there.
    lines: int = 0
    last_bad: bool = False
    # The matched records, (line, record as written), while they are few
    # (KEEP_RECORDS); None: more matched, and the second pass reads the file.
    kept: list[tuple[int, dict]] | None = dataclasses.field(default_factory=list)


# Matched records the first pass keeps for the second when a filter is
# given: a narrow one then costs one read of the file.
KEEP_RECORDS = 20_000


def first_pass(path: str | os.PathLike, flt: Filter | None) -> FirstPass:
    """Index every record of a key ``flt`` matches (``key_match``), those
    the device and process filter leaves out too."""
    path = Run.of(path)
    fp = FirstPass()
    if flt is None or not flt.active:
        # Everything matches: more than KEEP_RECORDS in any file worth
        # streaming, so keeping would only cost memory on the way.
        fp.kept = None
    index = DivergenceIndex()
    attempts, names, runs, kept = fp.attempts, fp.names, fp.runs, fp.kept
    lineno = 0
    for lineno, d, problem in iter_lines(path):
        if d is None:
            fp.problems.append((lineno, problem or "invalid"))
            continue
        names.add(d["name"])
        runs.add(d["run"])
        if flt is not None and not flt.key_match(d):
            continue
        index.add(d)
        attempts.add(d)
        if kept is not None and (flt is None or flt(d)):
            if len(kept) < KEEP_RECORDS:
                kept.append((lineno, d))
            else:
                kept = None
    fp.kept = kept
    fp.divergent = set(index.divergent_keys())
    fp.lines = lineno
    fp.last_bad = bool(fp.problems) and fp.problems[-1][0] == lineno
    return fp


def matching(
    path: str | os.PathLike, flt: Filter | None, fp: FirstPass, *, all_attempts: bool
) -> Iterator[tuple[int, dict, bool]]:
    """(line, record as written, divergent) of each record ``flt`` keeps,
    less the superseded unless ``all_attempts``."""
    divergent, attempts = fp.divergent, fp.attempts
    check_later = bool(attempts) and not all_attempts
    last, last_bad = fp.lines, fp.last_bad
    if fp.kept is not None:
        lines: Iterator[tuple[int, dict | None, Any]] = iter(fp.kept)
        flt = None  # the kept records matched it
    else:
        lines = iter_lines(path)
    for lineno, d, *_ in lines:
        if lineno >= last and (lineno > last or last_bad):
            return
        if d is None or (flt is not None and not flt(d)):
            continue
        if check_later and attempts.superseded(d):
            continue
        yield (
            lineno,
            d,
            bool(divergent) and d.get("kind") == "replicated" and record_key(d) in divergent,
        )
