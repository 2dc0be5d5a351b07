"""Records as a tidy pandas DataFrame (``pmaptap.read(..., as_frame=True)``),
Parquet (``pmaptap export --parquet``) and step x device tables
(``pmaptap.per_device``).

One row per record, in file order. Columns:

- ``run``, ``name``, ``pass``, ``kind``, ``host``: text; ``step``: int64;
  ``process``, ``device`` (null for replicated records), ``replicas``:
  nullable integers (``Int64``); ``divergent``: bool; ``time``: a UTC
  datetime (the file's seconds since the epoch);
- ``coords.<axis>``: a per-device record's mesh coordinates, nullable ints;
- ``value`` for a plain value, ``value.<key>`` / ``value.<index>`` for pytree
  leaves (``value.<leaf>.min`` ... for a summarized leaf). A column whose
  cells are all numbers is numeric: NaN/inf are real floats there, and an
  empty cell (another tap's row) is NaN (or <NA> in an integer column).
  A column holding arrays keeps them as (nested) lists;
- ``devices``/``processes`` (the holders of a replicated value), ``dtype``,
  ``shape`` and any other field as read.

Parquet stores what it can natively (numbers, text, lists of one type);
a column it cannot (scalars mixed with arrays, complex numbers) is written as
strict JSON text, as the CSV export does.

pandas and pyarrow are optional extras, imported only here. No JAX.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

from pmaptap.tapfile.format import COORDS_COLUMN_PREFIX, NAN, NEG_INF, POS_INF, coords_column

MISSING_PANDAS = (
    "pmaptap.read(..., as_frame=True) needs pandas: pip install pandas (or 'pmaptap[frame]')."
)
MISSING_PYARROW = (
    "pmaptap export --parquet needs pyarrow, an optional extra: "
    'pip install "pmaptap[parquet]" (or pip install pyarrow)'
)

_FIRST = (
    "run",
    "name",
    "step",
    "pass",
    "kind",
    "process",
    "device",
    "replicas",
    "divergent",
    "time",
    "host",
)
_INTS = ("process", "device", "replicas")
_UNDER = ("value", "coords")  # flattened into "<field>.<path>" columns


def _pandas() -> Any:
    try:
        import pandas as pd
    except ImportError as e:
        raise ImportError(MISSING_PANDAS) from e
    return pd


def _value_cells(value: Any, dtype: Any, prefix: str, out: dict[str, Any]) -> None:
    # ``dtype`` has the value's pytree nesting: it tells a pytree list
    # (one column per index) from an array (one cell).
    if isinstance(dtype, dict) and isinstance(value, dict):
        for k, v in value.items():
            _value_cells(v, dtype.get(k), f"{prefix}.{k}", out)
    elif isinstance(dtype, list) and isinstance(value, list):
        for i, v in enumerate(value):
            _value_cells(v, dtype[i] if i < len(dtype) else None, f"{prefix}.{i}", out)
    elif isinstance(value, dict):  # summarized leaf: its statistics
        for k, v in value.items():
            out[f"{prefix}.{k}"] = v
    else:
        out[prefix] = value


def _row(r: dict) -> dict[str, Any]:
    row = {k: v for k, v in r.items() if k not in _UNDER}
    coords = r.get("coords")
    if isinstance(coords, dict):
        for axis, i in coords.items():
            row[coords_column(axis)] = i
    _value_cells(r.get("value"), r.get("dtype"), "value", row)
    return row


def _number_kind(cells: list) -> str | None:
    """'bool', 'int' or 'float' when every non-null cell is a number of that
    kind ('float' for a mix), None when a cell is not a number or all are null."""
    kinds = set()
    for c in cells:
        if c is None:
            continue
        if isinstance(c, bool):
            kinds.add("bool")
        elif isinstance(c, int):
            kinds.add("int")
        elif isinstance(c, float):
            kinds.add("float")
        else:
            return None
    if len(kinds) == 1:
        return kinds.pop()
    return "float" if kinds else None


class FrameBuilder:
    """``to_frame`` one record at a time: each record's cells go straight
    into their columns (a missing cell is None), so a reader that streams a
    file holds the columns, never the records or their rows. Short text
    cells (run, name, kind, host, dtype, ...) are shared: a file repeats a
    few of them on every line."""

    def __init__(self) -> None:
        self._pd = _pandas()  # the error at once, before a file is read
        self.n = 0
        self._cells: dict[str, list] = {col: [] for col in _FIRST}
        self._texts: dict[str, str] = {}

    def add(self, r: dict) -> None:
        n = self.n
        cells = self._cells
        texts = self._texts
        for col, v in _row(r).items():
            column = cells.get(col)
            if column is None:
                column = cells[col] = [None] * n
            elif len(column) < n:
                column.extend([None] * (n - len(column)))
            if type(v) is str and len(v) <= 64:
                v = texts.setdefault(v, v)
            column.append(v)
        self.n = n + 1

    def frame(self) -> Any:
        """The DataFrame; the builder is spent (its cells go column by column
        into pandas, each list freed once its column is made)."""
        pd, n, cells = self._pd, self.n, self._cells
        for column in cells.values():
            if len(column) < n:
                column.extend([None] * (n - len(column)))
        names = list(cells)
        coords = sorted(k for k in names if k.startswith(COORDS_COLUMN_PREFIX))
        values = [k for k in names if k == "value" or k.startswith("value.")]
        rest = [k for k in names if k not in _FIRST and k not in coords and k not in values]
        columns: dict[str, Any] = {}
        for col in (*_FIRST, *coords, *values, *rest):
            columns[col] = _column(pd, col, cells.pop(col))
        self._texts = {}
        return pd.DataFrame(columns, index=pd.RangeIndex(n))


def to_frame(records: Iterable[dict]) -> Any:
    """The tidy DataFrame of decoded records (``pmaptap.read``'s dicts)."""
    builder = FrameBuilder()
    for r in records:
        builder.add(r)
    return builder.frame()


def _column(pd: Any, col: str, cells: list) -> Any:
    if col == "time":
        secs = [float(c) if isinstance(c, (int, float)) else None for c in cells]
        return pd.to_datetime(pd.Series(secs, dtype="float64"), unit="s", utc=True)
    if col == "divergent":
        return pd.Series([bool(c) for c in cells], dtype=bool)
    if col == "step":
        if all(isinstance(c, int) for c in cells):
            return pd.Series(cells, dtype="int64")
    if col == "pass":
        return pd.Series([c or "forward" for c in cells], dtype="str")
    kind = _number_kind(cells)
    if (col in _INTS or col.startswith(COORDS_COLUMN_PREFIX)) and all(
        c is None or isinstance(c, int) and not isinstance(c, bool) for c in cells
    ):
        return pd.Series(cells, dtype="Int64")
    if kind == "bool" and (col == "value" or col.startswith("value.")):
        return pd.Series(cells, dtype="boolean")
    if kind == "int":
        return pd.Series(cells, dtype="Int64")
    if kind == "float":
        return pd.Series([float("nan") if c is None else float(c) for c in cells], dtype="float64")
    if all(c is None or isinstance(c, str) for c in cells) and any(
        isinstance(c, str) for c in cells
    ):
        return pd.Series(cells, dtype="str")
    return pd.Series(cells, dtype=object)


# ------------------------------------------------------------------ parquet


def _json_text(c: Any) -> Any:
    if c is None:
        return None

    def enc(x: Any) -> Any:
        if isinstance(x, complex):
            return [enc(x.real), enc(x.imag)]
        if isinstance(x, float) and x != x:
            return NAN
        if isinstance(x, float) and x in (float("inf"), float("-inf")):
            return POS_INF if x > 0 else NEG_INF
        if isinstance(x, list):
            return [enc(y) for y in x]
        if isinstance(x, dict):
            return {k: enc(v) for k, v in x.items()}
        return x

    return json.dumps(enc(c), separators=(",", ":"), allow_nan=False)


def write_parquet(records: Iterable[dict], path: str | os.PathLike) -> int:
    """One row per decoded record, the columns of ``to_frame``; returns the
    number of rows."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(MISSING_PYARROW) from e
    df = to_frame(records)
    for col in df.columns:
        if df[col].dtype != object:
            continue
        cells = df[col].tolist()
        try:
            pa.array(cells, from_pandas=False)
        except (
            pa.ArrowInvalid,
            pa.ArrowTypeError,
            pa.ArrowNotImplementedError,
            TypeError,
            ValueError,
            OverflowError,
        ):
            df[col] = _pandas().Series([_json_text(c) for c in cells], dtype="str", index=df.index)
    table = pa.Table.from_pandas(df, preserve_index=False)
    pq.write_table(table, os.fspath(path))
    return len(df)


# ------------------------------------------------------------------ pivot


def _has_leaf(dtype: Any, path: list[str], summarized: bool) -> bool:
    if isinstance(dtype, str) and dtype[:1] in ("{", "["):
        try:  # JSON text, as a Parquet file holds it
            dtype = json.loads(dtype)
        except ValueError:
            return False
    for i, key in enumerate(path):
        if isinstance(dtype, dict) and key in dtype:
            dtype = dtype[key]
        elif isinstance(dtype, list) and key.isdigit() and int(key) < len(dtype):
            dtype = dtype[int(key)]
        elif isinstance(dtype, str) and summarized:
            # A summarized leaf's statistic (value.<leaf>.min): one level
            # below a leaf's dtype name.
            return i == len(path) - 1
        else:
            return False
    return isinstance(dtype, str)


def per_device(frame: Any, value: str = "value") -> Any:
    """A step x device table of ``value`` from a tidy frame (``read(...,
    as_frame=True)``, or one read from ``export --parquet``).

    Per-device records give their device's cell; a replicated record stands
    for every device that held its value (its ``devices``), so a
    ``dedup="auto"`` tap gives a full table whichever way each step was
    written. Rows are ``step``, preceded by ``run``/``name``/``pass`` when the
    frame holds several of them; the last record of a (key, device) wins.
    NaN/inf stay as they are."""
    pd = _pandas()
    if value not in frame.columns:
        raise KeyError(
            f"no column {value!r}; value columns: "
            f"{[c for c in frame.columns if str(c).startswith('value')]}"
        )
    keys = ["run", "name", "pass", "step"]
    # Only records that have this leaf: a NaN cell is the tap's NaN only there
    # (elsewhere it is another tap's empty cell).
    path = value.split(".")[1:]
    summarized = (
        frame["summarized"].fillna(False).astype(bool)
        if "summarized" in frame.columns
        else pd.Series(False, index=frame.index)
    )
    has = [_has_leaf(d, path, bool(s)) for d, s in zip(frame["dtype"], summarized)]
    frame = frame[has]
    per = frame[frame["kind"] == "per_device"][[*keys, "device", value]]
    parts = [per]
    if "devices" in frame.columns:
        rep = frame[(frame["kind"] == "replicated") & frame["devices"].notna()]
        rep = rep[[*keys, "devices", value]].copy()
        if len(rep):
            devices = rep["devices"].map(lambda d: json.loads(d) if isinstance(d, str) else list(d))
            rep = rep.assign(device=devices).drop(columns="devices").explode("device")
            parts.append(rep)
    cells = pd.concat(parts, ignore_index=True)
    cells = cells[cells["device"].notna()]
    cells = cells.astype({"device": "int64"})
    index = [k for k in keys[:-1] if cells[k].nunique() > 1] + ["step"]
    cells = cells.drop_duplicates(subset=[*keys, "device"], keep="last")
    table = cells.pivot(index=index, columns="device", values=value)
    table.columns.name = "device"
    return table.sort_index()
