"""The in-memory readers that the streaming ones (``pmaptap show``, ``export``,
``validate``, ``read(as_frame=True)``: tapfile/read/stream.py) are held to:
every record of a file in memory, divergence and attempts judged on all of
them. Definitions for tests, moved here from tapfile/read/views.py (and
validate.py's duplicate_key and find_duplicates)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

from pmaptap.tapfile.analyze.validate import FirstCopies, duplicate_parts
from pmaptap.tapfile.read.attempts import Attempts
from pmaptap.tapfile.read.divergence import DivergenceIndex, mark_divergent
from pmaptap.tapfile.read.query import Filter
from pmaptap.tapfile.read.views import Entry
from pmaptap.tapfile.record import as_dicts, decode_block, decode_record, from_dict
from pmaptap.tapfile.source import Run, iter_lines


def index_records(records: Iterable[dict]) -> Attempts:
    idx = Attempts()
    for r in records:
        idx.add(r)
    return idx


def load(path: str | os.PathLike) -> tuple[list[Entry], list[tuple[int, str]]]:
    """Every valid record with its line number, plus the (line, problem) list
    of lines that are not records (garbage, torn, empty)."""
    path = Run.of(path)
    entries: list[Entry] = []
    problems: list[tuple[int, str]] = []
    for lineno, d, problem in iter_lines(path):
        if d is None:
            problems.append((lineno, problem or "invalid"))
            continue
        entries.append(Entry(lineno, d, decode_record(d)))
    mark_divergence(entries)
    return entries, problems


def load_matching(
    path: str | os.PathLike, flt: Filter
) -> tuple[list[Entry], list[tuple[int, str]], set, set]:
    """Like ``load`` but keeps only the records ``flt`` matches, filtering
    before decoding values; also every name and run read. Divergence is
    judged on every copy of a matched key."""
    path = Run.of(path)
    entries: list[Entry] = []
    problems: list[tuple[int, str]] = []
    names: set = set()
    runs: set = set()
    index = DivergenceIndex()
    attempts = Attempts()
    for lineno, d, problem in iter_lines(path):
        if d is None:
            problems.append((lineno, problem or "invalid"))
            continue
        names.add(d["name"])
        runs.add(d["run"])
        if not flt.key_match(d):
            continue
        attempts.add(d)
        index.add(d)
        if flt(d):
            entries.append(Entry(lineno, d, decode_record(d)))
    for e in entries:
        if index.divergent(e.raw):
            e.mark_divergent()
    if not flt.all_attempts and attempts:
        # Records of a key share their step key, so one matched record's
        # supersession is judged on the same records as any other's.
        entries = [e for e in entries if not attempts.superseded(e.raw)]
    return entries, problems, names, runs


def mark_divergence(entries: Sequence[Entry]) -> None:
    """As ``pmaptap.read`` does: a replicated key written with several values
    by different processes is divergent on every one of its records."""
    recs = [e.rec for e in entries]
    index = DivergenceIndex()
    for r in recs:
        index.add(r)
    mark_divergent(recs, index)
    for e in entries:
        if e.rec.get("divergent"):
            e.mark_divergent()


def duplicate_key(r: dict) -> tuple | None:
    parts = duplicate_parts(from_dict(r))
    if parts is None:
        return None
    (kind, run, name, pass_, index, attempt, *rest), step, value = parts
    key = (kind, run, name, step, pass_, index, attempt, *rest)
    return key if value is None else (*key, value)


def find_duplicates(records: Sequence[dict]) -> list[tuple[int, int]]:
    """(index, index of its first copy) for every record repeating an earlier one."""
    firsts = FirstCopies()
    out: list[tuple[int, int]] = []
    for i, r in enumerate(records):
        parts = duplicate_parts(from_dict(r))
        first = None if parts is None else firsts.add_parts(parts, i)
        if first is not None:
            out.append((i, first))
    return out


def parse_lines(lines: list[bytes]) -> tuple[list, dict]:
    """``parse_line`` of every line of ``lines``, through the batch decoder
    (``decode_block``) the readers use."""
    records, problems = decode_block(b"\n".join(lines), lines)
    return as_dicts(records), problems
