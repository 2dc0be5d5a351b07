"""Reading tap files: every valid record in file order, never eval/pickle."""
from __future__ import annotations

import os
import warnings
from typing import Any, BinaryIO, Iterator

from pmaptap.tapfile import parse, runs
from pmaptap.tapfile.format import decode_record, record_key
from pmaptap.tapfile.parse import parse_line

__all__ = ["DivergenceIndex", "iter_file_lines", "iter_lines", "parse_line", "read",
           "reconcile_divergence"]

_SKIP_CHUNK = 1 << 20


def iter_lines(path: str | os.PathLike) -> Iterator[tuple[int, dict | None, str | None]]:
    """(line number, record or None, problem or None) for every line, read a
    line at a time: a line longer than parse.MAX_LINE_BYTES is reported
    without being held in memory. A run in the sharded layout (``path.d/``)
    is read as one stream merged from its shards (tapfile/runs.py)."""
    if runs.is_sharded(path):
        return runs.iter_merged(path, iter_file_lines)
    return iter_file_lines(path)


def iter_file_lines(path: str | os.PathLike) -> Iterator[tuple[int, dict | None, str | None]]:
    """``iter_lines`` of one file."""
    limit = parse.MAX_LINE_BYTES
    with open(path, "rb") as f:
        lineno = 0
        while True:
            raw = f.readline(limit + 1)
            if not raw:
                return
            lineno += 1
            if raw.endswith(b"\n"):
                d, problem = parse_line(raw[:-1])
            elif len(raw) > limit:
                size = len(raw) + _skip_line(f)
                d, problem = None, (f"line too long ({size} bytes or more; "
                                    f"readers take at most {limit})")
            else:
                # No newline at the end of the file: a writer is still
                # writing this line, or was killed while writing it.
                d, problem = parse_line(raw)
                if problem is not None and problem.startswith("not valid JSON"):
                    problem = "torn last line (no newline)"
            yield lineno, d, problem


def _skip_line(f: BinaryIO) -> int:
    """Read past the rest of an over-long line; returns the bytes skipped."""
    skipped = 0
    while True:
        chunk = f.readline(_SKIP_CHUNK)
        skipped += len(chunk)
        if not chunk or chunk.endswith(b"\n"):
            return skipped


def read(path: str | os.PathLike, *, as_frame: bool = False):
    """All valid records of a tap file, in file order, as dicts.

    Lines that are not valid records (garbage, a torn last line from a killed
    writer) are skipped with one warning that lists them. Non-finite numbers
    come back as float NaN/inf. ``as_frame=True`` returns a tidy pandas
    DataFrame, one row per record (columns: pmaptap/tapfile/frame.py).
    """
    out: list[dict] = []
    bad: list[tuple[int, str]] = []
    for lineno, d, problem in iter_lines(path):
        if d is None:
            if problem != "empty line":
                bad.append((lineno, problem or "invalid"))
            continue
        out.append(decode_record(d))
    reconcile_divergence(out)
    if bad:
        shown = "; ".join(f"line {n}: {why}" for n, why in bad[:5])
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        warnings.warn(f"pmaptap.read({os.fspath(path)!r}) skipped {len(bad)} "
                      f"invalid line(s): {shown}{more}", RuntimeWarning,
                      stacklevel=2)
    if as_frame:
        from pmaptap.tapfile.frame import to_frame
        return to_frame(out)
    return out


class DivergenceIndex:
    """Which replicated keys (run, name, step, pass) the file holds with more
    than one value from more than one process: ``add`` every replicated
    record seen, then ask ``divergent``. The first writer of a key could not
    know that a later process would disagree (see xdedup); one process
    re-writing a key with new values is not divergence. Holds one small entry
    per replicated key, never the records."""

    def __init__(self) -> None:
        # key -> vhash -> processes; a key seen with one vhash stays a tuple
        # (vhash, process) to keep the common case small.
        self._seen: dict[tuple, Any] = {}

    def add(self, r: dict) -> None:
        if r.get("kind") != "replicated" or not r.get("vhash"):
            return
        key = record_key(r)
        vhash, proc = r["vhash"], r.get("process")
        got = self._seen.get(key)
        if got is None:
            self._seen[key] = (vhash, proc)
            return
        if isinstance(got, tuple):
            if got == (vhash, proc):
                return
            got = self._seen[key] = {got[0]: {got[1]}}
        got.setdefault(vhash, set()).add(proc)

    def divergent(self, r: dict) -> bool:
        if r.get("kind") != "replicated":
            return False
        got = self._seen.get(record_key(r))
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
