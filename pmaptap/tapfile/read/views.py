"""Looking at records: the entries the commands stream, values as text and
aligned tables. Shared by the ``pmaptap`` subcommands; no JAX here."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
from typing import Any, Iterable, Iterator, Sequence

from pmaptap.tapfile.read.attempts import attempt_of
from pmaptap.tapfile.read.query import Filter
from pmaptap.tapfile.read.stream import FirstPass, matching
from pmaptap.tapfile.record import (
    FINGERPRINT,
    RECORD_COLUMNS,
    Holders,
    decode_record,
    index_text,
    ranges_text,
    shown_name,
)
from pmaptap.tapfile.source import Run, shown_value


@dataclasses.dataclass
class Entry:
    """A record's line number, its object as written (markers kept, for
    strict JSON out) and decoded (NaN/inf floats, divergence marked)."""

    line: int
    raw: dict
    rec: dict

    def mark_divergent(self) -> None:
        self.rec["divergent"] = True
        if not self.raw.get("divergent"):
            self.raw = dict(self.raw, divergent=True)


def iter_entries(
    path: str | os.PathLike, flt: "Filter", fp: "FirstPass", limit: int = 0
) -> Iterator[Entry]:
    """The entries of ``stream.matching`` (at most ``limit``, 0: all)."""
    found = matching(Run.of(path), flt, fp, all_attempts=flt.all_attempts)
    for lineno, d, divergent in itertools.islice(found, limit or None):
        e = Entry(lineno, d, decode_record(d))
        if divergent:
            e.mark_divergent()
        yield e


def scalar(v: Any) -> float | None:
    """The value as a float if it is one number (bool too), else None."""
    return float(v) if isinstance(v, (int, float)) else None  # bool too


def format_number(x: float | int | bool) -> str:
    if isinstance(x, int):  # bool too
        return str(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.6g}"


def format_value(v: Any, width: int = 60) -> str:
    """Compact text for a decoded value; long arrays are cut with '...'."""

    def fmt(x: Any) -> str:
        if isinstance(x, dict):
            return "{" + ", ".join(f"{k}: {fmt(y)}" for k, y in x.items()) + "}"
        if isinstance(x, list):
            return "[" + ", ".join(fmt(y) for y in x) + "]"
        if isinstance(x, complex):
            return f"{x.real:.6g}{x.imag:+.6g}j"
        if isinstance(x, (bool, int, float)):
            return format_number(x)
        return str(x)

    text = fmt(v)
    return text if len(text) <= width else text[: max(width - 3, 1)] + "..."


def id_order(x: Any) -> tuple:
    """Sort key for ids as read: numbers, then anything else a hand-edited
    file may hold (never a TypeError from comparing them)."""
    if isinstance(x, (int, float)) and not isinstance(x, bool) and x == x:
        return (0, x, "")
    return (1, 0, repr(x))


def sorted_ids(ids: Iterable[Any]) -> list:
    """``ids`` sorted by id_order (ints alone: by value, in one C pass)."""
    ids = list(ids)
    if len(set(map(type, ids))) == 1 and type(ids[0]) is int:
        return sorted(ids)
    return sorted(ids, key=id_order)


def format_ids(ids: Iterable[Any]) -> str:
    """Ints as ranges ("0-3,6"), then other ids as JSON, null devices "?"."""
    ids = list(ids)
    types = set(map(type, ids))
    others: list = []
    if types <= {int, type(None)}:  # the usual ids, in C passes
        nums = sorted(set(ids) - {None})
    else:
        nums = sorted({i for i in ids if type(i) is int})
        others = sorted((i for i in ids if i is not None and type(i) is not int), key=id_order)
    parts = [ranges_text(nums)] if nums else []
    parts += list(dict.fromkeys(json.dumps(i, default=repr) for i in others))  # each once
    if type(None) in types:
        parts.append("?")
    return ",".join(parts) or "-"


def device_text(r: dict) -> str:
    if r.get("kind") == "per_device":
        d = r.get("device")
        return "?" if d is None else str(d)
    devices = r.get("devices")
    if type(devices) is str:  # ranges text as written (format.holders_field)
        return devices
    if isinstance(devices, Holders):  # the same, decoded: its text, not its ids
        return devices.text
    return format_ids(list(devices or ()))


def coords_text(r: dict) -> str:
    """Mesh coordinates, then a shard's slice: ``data=2,model=1 index=[4:6,4:8]``."""
    coords = r.get("coords")
    parts = []
    if coords and isinstance(coords, dict):
        parts.append(",".join(f"{k}={v}" for k, v in coords.items()))
    if isinstance(r.get("index"), list):
        parts.append(f"index=[{index_text(r['index'])}]")
    return " ".join(parts)


def flags_text(r: dict) -> str:
    flags = []
    if r.get("divergent"):
        flags.append("DIVERGENT")
    if r.get("pass", "forward") != "forward":
        flags.append(f"pass={r['pass']}")
    if r.get("kind") == "replicated" and r.get("replicas") is not None:
        flags.append(f"x{r['replicas']}")
    return " ".join(flags)


def leaves(
    value: Any, dtype: Any, path: str = "", sep: str = "/", stats: bool = True
) -> Iterator[tuple[str, Any, Any]]:
    """(path, value, dtype) of each leaf of a decoded value, by ``dtype``'s
    nesting (a pytree list is no array); paths as tags and rows name them
    (``/<key>/<index>``; ``sep="."``: columns). A summarized leaf gives a
    leaf per statistic, unless ``stats`` is False."""
    if isinstance(dtype, dict) and isinstance(value, dict):
        for k, v in value.items():
            yield from leaves(v, dtype.get(k), f"{path}{sep}{k}", sep, stats)
    elif isinstance(dtype, list) and isinstance(value, list):
        for i, v in enumerate(value):
            d = dtype[i] if i < len(dtype) else None
            yield from leaves(v, d, f"{path}{sep}{i}", sep, stats)
    elif stats and isinstance(value, dict):
        for k, v in value.items():
            yield f"{path}{sep}{k}", v, dtype
    else:
        yield path, value, dtype


# ``show``'s table, made from RECORD_COLUMNS to fit a terminal: the line,
# the columns one looks a record up by, then text that folds several fields
# (coords, value, flags). The rest is ``show --json``'s; run only where the
# rows come from more than one (RUN, inserted by show).
_SHOWN = {"name": "name", "step": "step", "kind": "kind", "process": "proc", "device": "device"}
COLUMNS = (
    "line",
    *(_SHOWN[c] for c in RECORD_COLUMNS if c in _SHOWN),
    "coords",
    "value",
    "flags",
)
# --all-attempts: which attempt wrote each record (a replayed step shows
# once per attempt), after its step.
_AFTER_STEP = COLUMNS.index("step") + 1
COLUMNS_ALL_ATTEMPTS = (*COLUMNS[:_AFTER_STEP], "attempt", *COLUMNS[_AFTER_STEP:])
_RIGHT = {"line", "step", "attempt", "proc"}
RUN = "run"


def with_run(columns: Sequence[str]) -> tuple[str, ...]:
    """``columns`` with the run after the line (rows of several runs)."""
    return (columns[0], RUN, *columns[1:])


def row(e: Entry, width: int = 60) -> dict[str, str]:
    r = e.rec
    return {
        "line": str(e.line),
        RUN: str(r.get("run")),
        # A looped tap's iteration beside its name: act_rms[3].
        "name": str(shown_name(r.get("name"), r.get("iteration"))),
        "step": str(r.get("step")),
        "attempt": str(attempt_of(r)),
        "kind": str(r.get("kind")),
        "proc": str(r.get("process")),
        "device": device_text(r),
        "coords": coords_text(r),
        "value": value_text(r, width),
        "flags": flags_text(r),
    }


def value_text(r: dict, width: int = 60) -> str:
    """The value column (a fingerprint record's: its fingerprint and leaf,
    as _host/sinks/console.py shows it)."""
    if r.get("kind") == FINGERPRINT:
        leaf = r.get("leaf")
        fp = str(r.get("fingerprint"))
        return f"leaf={leaf} {fp}" if leaf else fp
    value = r.get("value")
    if "bytes" in r:
        value = shown_value(value, r.get("dtype"), r.get("shape"), r["bytes"])
    return format_value(value, width)


class Table:
    """Aligned columns; ``widths`` only grow (``tail -f`` prints as rows come)."""

    def __init__(self, columns: Sequence[str] = COLUMNS, right: Iterable[str] = _RIGHT) -> None:
        self.columns = tuple(columns)
        self.right = frozenset(right)
        self.widths = {c: len(c) for c in self.columns}

    def without(self, column: str) -> None:
        """Leave ``column`` out (show's run column, for rows of one run)."""
        self.columns = tuple(c for c in self.columns if c != column)

    def fit(self, rows: Iterable[dict[str, str]]) -> None:
        for r in rows:
            for c in self.columns:
                self.widths[c] = max(self.widths[c], len(r[c]))

    def header(self) -> str:
        return self.format({c: c for c in self.columns})

    def format(self, r: dict[str, str]) -> str:
        w = self.widths
        cells = (r[c].rjust(w[c]) if c in self.right else r[c].ljust(w[c]) for c in self.columns)
        return "  ".join(cells).rstrip()


def json_line(e: Entry, *, attempt: bool = False) -> str:
    """The record as one strict JSON line as written (``attempt``: with its
    ``attempt``, 0 where left out, as ``read(attempts="all")`` gives it)."""
    raw = {**e.raw, "attempt": attempt_of(e.raw)} if attempt else e.raw
    return json.dumps(raw, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
