"""``pmaptap export --csv``: a row per record, the columns docs/cli.md lists."""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Iterable
from typing import IO, Any, Sequence

from pmaptap.tapfile.read import Entry, leaves
from pmaptap.tapfile.record import (
    COORDS_COLUMN_PREFIX,
    NONFINITE,
    RECORD_COLUMNS,
    coords_column,
    index_text,
)

# The record columns, after the line each row came from.
FIXED = ("line", *RECORD_COLUMNS)


def _leaf(raw: Any) -> Any:
    if isinstance(raw, str) and raw in NONFINITE:
        return NONFINITE[raw]
    if isinstance(raw, (bool, int, float)):
        return raw
    return json.dumps(raw, separators=(",", ":"))


def _text(x: Any) -> str:
    return x if isinstance(x, str) else json.dumps(x, separators=(",", ":"))


def csv_row(e: Entry) -> dict[str, Any]:
    r = e.raw
    row: dict[str, Any] = {"line": e.line, **{c: r.get(c) for c in RECORD_COLUMNS}}
    row["pass"] = r.get("pass", "forward")
    row["divergent"] = bool(e.rec.get("divergent"))
    # A shard's global slice, "start:stop" per dimension ("" if whole).
    row["index"] = index_text(r.get("index"))
    for c in ("devices", "dtype", "shape"):
        row[c] = _text(r[c]) if c in r else None
    if "iteration" in r:
        # A looped tap's iteration ("3", "1,2": outermost first): a column only where one is.
        row["iteration"] = ",".join(map(str, r["iteration"]))
    coords = r.get("coords")
    for axis, idx in (coords if isinstance(coords, dict) else {}).items():
        row[coords_column(axis)] = idx
    # A summarized leaf's statistics in one cell.
    for path, v, _ in leaves(r["value"], r["dtype"], "value", ".", stats=False):
        row[path] = _leaf(v)
    if "bytes" in r:
        # A value stored as bytes: where they are, not megabytes of numbers in a cell.
        row["bytes"] = _text(r["bytes"])
    return row


def write_csv(entries: Sequence[Entry] | Callable[[], Iterable[Entry]], out: IO[str]) -> int:
    """A row per entry; returns how many. ``entries`` may be a function that
    gives them afresh: the header found in one pass, the rows in a second."""
    held = None if callable(entries) else list(entries)
    fresh = entries if held is None else lambda: held
    extra = dict.fromkeys(k for e in fresh() for k in csv_row(e) if k not in FIXED)
    coords = sorted(k for k in extra if k.startswith(COORDS_COLUMN_PREFIX))
    values = [k for k in extra if not k.startswith(COORDS_COLUMN_PREFIX)]
    writer = csv.DictWriter(
        out, fieldnames=[*FIXED, *coords, *values], restval="", lineterminator="\n"
    )
    writer.writeheader()
    n = 0
    for e in fresh():
        writer.writerow({k: "" if v is None else v for k, v in csv_row(e).items()})
        n += 1
    return n
