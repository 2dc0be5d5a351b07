"""Reading tap files: every valid record in file order, never eval/pickle."""
from __future__ import annotations

import os
import warnings
from typing import BinaryIO, Iterator

from pmaptap.tapfile import parse
from pmaptap.tapfile.format import decode_record, record_key
from pmaptap.tapfile.parse import parse_line

__all__ = ["iter_lines", "parse_line", "read", "reconcile_divergence"]

_SKIP_CHUNK = 1 << 20


def iter_lines(path: str | os.PathLike) -> Iterator[tuple[int, dict | None, str | None]]:
    """(line number, record or None, problem or None) for every line, read a
    line at a time: a line longer than parse.MAX_LINE_BYTES is reported
    without being held in memory."""
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


def reconcile_divergence(records: list[dict]) -> None:
    """Mark every replicated record of a (run, name, step, pass) divergent when
    the file holds different values for it from different processes (the
    first writer could not know that a later process would disagree; see
    xdedup). One process re-writing a key with new values is not divergence."""
    seen: dict[tuple, dict[str, set]] = {}
    for r in records:
        if r.get("kind") == "replicated" and r.get("vhash"):
            seen.setdefault(record_key(r), {}).setdefault(r["vhash"], set()).add(
                r.get("process"))
    for r in records:
        if r.get("kind") != "replicated":
            continue
        hashes = seen.get(record_key(r), {})
        if len(hashes) > 1 and len(set().union(*hashes.values())) > 1:
            r["divergent"] = True
