"""Records as a tidy pandas DataFrame, Parquet and step x device tables
(docs/api.md, "Tidy frames and Parquet")."""

from __future__ import annotations

import array
import json
import math
import os
import sys
from collections.abc import Iterable
from typing import Any

from pmaptap.errors import optional
from pmaptap.tapfile.read.views import leaves
from pmaptap.tapfile.record import (
    COORDS_COLUMN_PREFIX,
    NAN,
    NEG_INF,
    POS_INF,
    RECORD_COLUMNS,
    coords_column,
)

# The record columns the frame types itself, first; the holders, index,
# dtype and shape are kept as read, after the values.
_AS_READ = ("devices", "index", "dtype", "shape")
_FIRST = tuple(c for c in RECORD_COLUMNS if c not in _AS_READ)
_INTS = ("process", "device", "replicas")
_UNDER = ("value", "coords")  # flattened into "<field>.<path>" columns


def _pandas() -> Any:
    return optional("pandas", "pmaptap.read(..., as_frame=True)", "frame")


def _row(r: dict) -> dict[str, Any]:
    row = {k: v for k, v in r.items() if k not in _UNDER}
    coords = r.get("coords")
    if isinstance(coords, dict):
        for axis, i in coords.items():
            row[coords_column(axis)] = i
    for path, v, _ in leaves(r.get("value"), r.get("dtype"), "value", "."):
        row[path] = v
    return row


def _number_kind(cells: list) -> str | None:
    """'bool', 'int' or 'float' (a mix) of the non-null cells; None when
    one is no number or all are null."""
    kinds = set()
    for c in cells:
        if c is not None:
            if not isinstance(c, (int, float)):
                return None
            kinds.add("bool" if isinstance(c, bool) else "int" if isinstance(c, int) else "float")
    return kinds.pop() if len(kinds) == 1 else "float" if kinds else None


_INT64 = (-(1 << 63), 1 << 63)
# Columns whose equal lists of ints are one list object in a frame built while
# streaming (docs/performance.md): copy such a cell before changing it in place.
_SHARED_LISTS = frozenset({"shape", "devices", "processes"})
# Distinct cells a text column codes before it keeps plain cells (vhash).
_MAX_CODES = 1 << 17
_NOT_CODED = object()


def _wider(data: array.array, v: int) -> array.array:
    """``data`` in the narrowest wider int array that holds ``v`` (int64)."""
    for code in ("h", "i", "q"):
        if array.array(code).itemsize > data.itemsize:
            bits = 8 * array.array(code).itemsize - 1
            if -(1 << bits) <= v < 1 << bits:
                return array.array(code, data)
    raise OverflowError(v)


class _Cells:
    """One column's cells while a frame is built, compact while they allow
    (floats, narrow ints, codes of distinct text; else a list)."""

    __slots__ = ("kind", "data", "none", "table", "codes", "_shared", "_lists")

    def __init__(self, n: int, shared: dict, col: str) -> None:
        # kind None: only None cells so far (``n`` of them); "f", "q"; "c":
        # codes into ``table`` (text, None, a shared list's tuple); "o".
        self.kind: str | None = None
        self.data: Any = n
        self.none: bytearray | None = None
        self.table: list = []
        self.codes: dict = {}
        self._shared = shared
        self._lists = col in _SHARED_LISTS

    def _key(self, v: Any, t: type) -> Any:
        # What a "c" column can hold: never two equal keys of different
        # cells (no numbers: True == 1 == 1.0), so the dict is exact.
        if t is str or v is None:
            return v
        if t is list and self._lists and all(type(x) is int for x in v):
            return tuple(v)
        return _NOT_CODED

    def _append(self, v: Any) -> None:
        try:
            self.data.append(v)
        except OverflowError:  # an int past the array's width: widen it
            self.data = _wider(self.data, v)
            self.data.append(v)
        if self.none is not None:
            self.none.append(0)

    def add(self, v: Any) -> None:
        kind = self.kind
        t = type(v)
        if kind == "f" and t is float or kind == "q" and t is int and _INT64[0] <= v < _INT64[1]:
            self._append(v)
        elif kind == "c" and self._code(v, t):
            pass
        elif v is None and kind is None:
            self.data += 1
        elif v is None and (kind == "f" or kind == "q"):
            if self.none is None:
                self.none = bytearray(len(self.data))
            self.data.append(0)
            self.none.append(1)
        elif kind == "o":
            self.data.append(self._compact(v, t))
        elif kind is None and (t is float or t is int and _INT64[0] <= v < _INT64[1]):
            n = self.data
            self.kind = "f" if t is float else "q"
            self.data = array.array("d", bytes(8 * n)) if t is float else array.array("b", bytes(n))
            self.none = bytearray(b"\x01" * n) if n else None
            self.add(v)
        elif kind is None and self._key(v, t) is not _NOT_CODED:
            n = self.data
            self.kind, self.data, self.table, self.codes = "c", array.array("b"), [], {}
            for _ in range(n):
                self._code(None, type(None))
            self._code(v, t)
        else:
            cells = [*self.cells(), v]
            self.kind, self.none, self.table, self.codes = "o", None, [], {}
            self.data = [self._compact(c, type(c)) for c in cells]

    def _code(self, v: Any, t: type) -> bool:
        key = self._key(v, t)
        if key is _NOT_CODED:
            return False
        code = self.codes.get(key)
        if code is None:
            if len(self.table) >= _MAX_CODES:
                return False
            code = self.codes[key] = len(self.table)
            self.table.append(key)
        self._append(code)
        return True

    def _compact(self, v: Any, t: type) -> Any:
        if t is str and len(v) <= 64:
            return self._shared.setdefault(v, v) if len(self._shared) < 100_000 else v
        if t is list and self._lists and all(type(x) is int for x in v):
            key = tuple(v)
            return self._shared.setdefault(key, key) if len(self._shared) < 100_000 else key
        return v

    def empty_mask(self) -> Any:
        """Which cells are None, as a bool array."""
        import numpy as np

        if self.kind in ("f", "q"):
            if self.none is None:
                return np.zeros(len(self.data), bool)
            return np.frombuffer(self.none, dtype=bool).copy()
        return np.array([c is None for c in self.cells()], dtype=bool)

    def _numbers(self) -> Any:
        import numpy as np

        return np.frombuffer(self.data, dtype=np.dtype(self.data.typecode))

    def series(self, pd: Any, col: str) -> Any:
        """``_column(pd, col, self.cells())``, a number column straight from
        its array (no cells made)."""
        import numpy as np

        kind = self.kind
        if kind is None and col == "divergent":  # no record says so: all False
            return pd.Series(np.zeros(self.data, dtype=bool), dtype=bool)
        if kind is None and col == "pass":  # no record has one: all "forward"
            self.kind, self.table = "c", [None]
            self.data = array.array("b", bytes(self.data))
            kind = "c"
        if kind == "c" and col not in ("time", "divergent"):
            series = self._text_series(pd, col)
            if series is not None:
                return series
        if kind not in ("f", "q") or col in ("divergent", "pass"):
            return _column(pd, col, self.cells())
        values, mask = self._numbers(), self.empty_mask()
        if col == "time" or kind == "f":
            out = values.astype("float64")  # a copy
            out[mask] = np.nan
            return _times(pd, out) if col == "time" else pd.Series(out, dtype="float64")
        if col == "step" and not mask.any():
            return pd.Series(values.astype("int64"), dtype="int64")
        return pd.Series(pd.arrays.IntegerArray(values.astype("int64"), mask))

    def _text_series(self, pd: Any, col: str) -> Any:
        """A text column straight from the codes (an Arrow dictionary
        decoded once); None where pandas' text is not Arrow's."""
        table = self.table
        if col == "pass":
            table = ["forward" if c is None else c for c in table]
        types = set(map(type, table))  # text, and only text or None
        if str not in types or not types <= {str, type(None)}:
            return None
        # pyarrow if pandas loaded it (for its text columns).
        pa, dtype = sys.modules.get("pyarrow"), pd.Series(["x"], dtype="str").dtype
        if pa is None or getattr(dtype, "storage", None) != "pyarrow":
            return None
        codes = pa.array(self._numbers())
        words = pa.array(table, type=pa.large_string())
        text = pa.DictionaryArray.from_arrays(codes, words).cast(pa.large_string())
        return pd.Series(text.to_pandas(types_mapper={pa.large_string(): dtype}.get))

    def cells(self) -> list:
        kind, data = self.kind, self.data
        if kind is None:
            return [None] * data
        # A tuple is always a list of ints kept compact (decoded JSON holds
        # no tuples), given back as one list per value.
        if kind == "c":
            table = [list(c) if type(c) is tuple else c for c in self.table]
            return [table[i] for i in data]
        if kind in ("f", "q"):
            if self.none is None:
                return data.tolist()
            return [None if m else x for x, m in zip(data.tolist(), self.none)]
        if not self._lists:  # "o"
            return list(data)
        lists: dict = {}
        return [lists.setdefault(c, list(c)) if type(c) is tuple else c for c in data]


class FrameBuilder:
    """The tidy DataFrame of decoded records, added one at a time into
    compact columns (a streaming reader never holds records or rows)."""

    def __init__(self) -> None:
        self._pd = _pandas()  # the error at once, before a file is read
        self.n = 0
        self._shared: dict = {}
        self._cells: dict[str, _Cells] = {col: _Cells(0, self._shared, col) for col in _FIRST}
        self._filled: dict[str, int] = dict.fromkeys(_FIRST, 0)

    def add(self, r: dict) -> None:
        n = self.n
        cells, filled = self._cells, self._filled
        for col, v in _row(r).items():
            column = cells.get(col)
            if column is None:
                column = cells[col] = _Cells(n, self._shared, col)
            else:
                for _ in range(n - filled[col]):
                    column.add(None)
            column.add(v)
            filled[col] = n + 1
        self.n = n + 1

    def frame(self, empty: dict[str, Any] | None = None) -> Any:
        """The DataFrame (the builder spent); ``empty`` gets each float
        column's empty cells (Parquet keeps them apart from a tap's NaN)."""
        pd, n, cells, filled = self._pd, self.n, self._cells, self._filled
        names = list(cells)
        coords = sorted(k for k in names if k.startswith(COORDS_COLUMN_PREFIX))
        values = [k for k in names if k == "value" or k.startswith("value.")]
        rest = [k for k in names if k not in _FIRST and k not in coords and k not in values]
        order = (*_FIRST, *coords, *values, *rest)
        for column in cells.values():
            column.codes = {}  # only add() needs them: free them first
        pool = _arrow_pool()
        # Column by column, not one DataFrame(dict): that copies every
        # numeric column into one block at the peak. (Past ~100 columns
        # pandas warns of a fragmented frame: then the dict.)
        one_by_one = len(order) <= 90
        # The conversions that need the most room first, while the least is
        # in use: the times (pandas' datetime conversion makes several
        # copies), then text of many distinct cells (a value hash).
        first = sorted(order, key=lambda c: (c != "time", -len(cells[c].table)))
        columns: dict[str, Any] = {}
        for col in first:
            column = cells.pop(col)
            for _ in range(n - filled[col]):
                column.add(None)
            # (Text columns never become float: no mask to build for them.)
            wants_mask = empty is not None and col != "time" and column.kind != "c"
            mask = column.empty_mask() if wants_mask else None
            columns[col] = column.series(pd, col)
            if mask is not None and columns[col].dtype == "float64":
                empty[col] = mask
            del column
            if pool is not None:
                # pyarrow (pandas' text columns) keeps what a conversion
                # freed in its own pool: give it back before the next one.
                pool.release_unused()
        self._shared.clear()
        if not one_by_one:
            return pd.DataFrame({col: columns.pop(col) for col in order}, index=pd.RangeIndex(n))
        df = pd.DataFrame(index=pd.RangeIndex(n))
        for col in order:
            df[col] = columns.pop(col)
        return df


def _arrow_pool() -> Any:
    pa = sys.modules.get("pyarrow")
    try:
        return pa.default_memory_pool() if pa is not None else None
    except Exception:  # noqa: BLE001 - an optimization only
        return None


# Microseconds an int64 holds, either side of the epoch (~292,000 years).
_MAX_US = float(2**63 - 1)


def _times(pd: Any, secs: Any) -> Any:
    """Seconds (NaN: none) -> UTC datetimes of exact microseconds (writers
    round to them; ``unit="s"`` kept float noise); out of int64 range: NaT."""
    import numpy as np

    us = np.round(np.asarray(secs, dtype="float64") * 1e6)
    bad = ~(np.abs(us) < _MAX_US)  # NaN included
    out = np.where(bad, 0, us).astype("int64").astype("datetime64[us]")
    out[bad] = np.datetime64("NaT")
    return pd.Series(out).dt.tz_localize("UTC")


def _int_dtype(cells: list) -> str | type:
    """Int64, UInt64 (a uint64 past 2**63-1), else object."""
    ints = [c for c in cells if c is not None]
    lo, hi = (min(ints), max(ints)) if ints else (0, 0)
    if -(2**63) <= lo and hi < 2**63:
        return "Int64"
    return "UInt64" if lo >= 0 and hi < 2**64 else object


def _column(pd: Any, col: str, cells: list) -> Any:
    if col == "time":
        secs = [float(c) if isinstance(c, (int, float)) else None for c in cells]
        return _times(pd, pd.Series(secs, dtype="float64").to_numpy())
    if col == "divergent":
        return pd.Series([bool(c) for c in cells], dtype=bool)
    if col == "step" and all(isinstance(c, int) for c in cells):
        # Past int64 (readers take steps below 2**64): UInt64, as a value.
        dtype = _int_dtype(cells)
        return pd.Series(cells, dtype="int64" if dtype == "Int64" else dtype)
    if col == "pass":
        return pd.Series(["forward" if c is None else c for c in cells], dtype="str")
    kind = _number_kind(cells)
    if (col in _INTS or col.startswith(COORDS_COLUMN_PREFIX)) and all(
        c is None or isinstance(c, int) and not isinstance(c, bool) for c in cells
    ):
        return pd.Series(cells, dtype=_int_dtype(cells))
    if kind == "bool" and (col == "value" or col.startswith("value.")):
        return pd.Series(cells, dtype="boolean")
    if kind == "int":
        return pd.Series(cells, dtype=_int_dtype(cells))
    if kind == "float":
        return pd.Series([float("nan") if c is None else float(c) for c in cells], dtype="float64")
    if all(c is None or isinstance(c, str) for c in cells) and any(
        isinstance(c, str) for c in cells
    ):
        return pd.Series(cells, dtype="str")
    return pd.Series(cells, dtype=object)


def _json_text(c: Any) -> Any:
    if c is None:
        return None

    def enc(x: Any) -> Any:
        if type(x).__module__ == "numpy":
            # A value stored as bytes comes back from read() as an array
            # (and its elements as NumPy scalars): its numbers, exactly;
            # ml_dtypes' narrow floats widen exactly to float64.
            import numpy as np

            a = np.asarray(x)
            if a.dtype.kind not in "biufc":  # ml_dtypes' int4, bfloat16, fp8...
                a = a.astype(np.int64 if a.dtype.name.startswith(("int", "uint")) else np.float64)
            return enc(a.tolist())
        if isinstance(x, complex):
            return [enc(x.real), enc(x.imag)]
        if isinstance(x, float) and not math.isfinite(x):
            return NAN if x != x else POS_INF if x > 0 else NEG_INF
        if isinstance(x, list):
            return [enc(y) for y in x]
        if isinstance(x, dict):
            return {k: enc(v) for k, v in x.items()}
        return x

    return json.dumps(enc(c), separators=(",", ":"), allow_nan=False)


def write_parquet(records: Iterable[dict], path: str | os.PathLike) -> int:
    """The frame of decoded records as Parquet; returns the number of rows."""
    pa = optional("pyarrow", "pmaptap export --parquet", "parquet")
    pq = optional("pyarrow.parquet", "pmaptap export --parquet", "parquet")
    import numpy as np

    builder = FrameBuilder()
    for r in records:
        builder.add(r)
    empty: dict[str, list[bool]] = {}
    df = builder.frame(empty)
    for col in df.columns:
        if df[col].dtype != object:
            continue
        cells = df[col].tolist()
        try:  # (ArrowInvalid is a ValueError, ArrowTypeError a TypeError)
            pa.array(cells, from_pandas=False)
        except (pa.ArrowNotImplementedError, TypeError, ValueError, OverflowError):
            df[col] = _pandas().Series([_json_text(c) for c in cells], dtype="str", index=df.index)
    table = pa.Table.from_pandas(df, preserve_index=False)
    for col, mask in empty.items():
        # from_pandas makes every NaN null, the tap's NaN loss included (then
        # no reader of the file finds a NaN): only empty cells are null.
        i = table.schema.get_field_index(col)
        arr = pa.array(df[col].to_numpy(), type=pa.float64(), mask=np.array(mask, dtype=bool))
        table = table.set_column(i, table.schema.field(i), arr)
    pq.write_table(table, os.fspath(path))
    return len(df)


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


def _iteration(v: Any) -> tuple:
    """A looped tap's iteration as a tuple (() outside loops)."""
    return tuple(int(i) for i in v) if isinstance(v, (list, tuple)) or hasattr(v, "shape") else ()


def per_device(frame: Any, value: str = "value") -> Any:
    """A step x device table of ``value`` from a tidy frame (docs/api.md,
    "Tidy frames and Parquet"); the last record of a (key, device) wins."""
    pd = _pandas()
    if value not in frame.columns:
        raise KeyError(
            f"no column {value!r}; value columns: "
            f"{[c for c in frame.columns if str(c).startswith('value')]}"
        )
    # record_key's (format.py) run, name, pass and step as columns, and a
    # looped tap's iteration; not its index or attempt: a cell is one
    # device's value, the last record wins.
    keys = ["run", "name", "pass", "step"]
    # Only records that have this leaf: a NaN cell is the tap's NaN only there
    # (elsewhere it is another tap's empty cell).
    path = value.split(".")[1:]
    summarized = (
        frame["summarized"].fillna(False) if "summarized" in frame else [False] * len(frame)
    )
    has = [_has_leaf(d, path, bool(s)) for d, s in zip(frame["dtype"], summarized)]
    frame = frame[has]
    if "iteration" in frame.columns:
        keys = [*keys, "iteration"]
    parts = [frame[frame["kind"] == "per_device"][[*keys, "device", value]]]
    if "devices" in frame.columns:
        rep = frame[(frame["kind"] == "replicated") & frame["devices"].notna()]
        rep = rep[[*keys, "devices", value]].copy()
        if len(rep):
            devices = rep["devices"].map(lambda d: json.loads(d) if isinstance(d, str) else list(d))
            rep = rep.assign(device=devices).drop(columns="devices").explode("device")
            parts.append(rep)
    cells = pd.concat(parts, ignore_index=True)
    cells = cells[cells["device"].notna()].astype({"device": "int64"})
    index = [k for k in ("run", "name", "pass") if cells[k].nunique() > 1] + ["step"]
    if "iteration" in cells.columns:  # a tap in a loop body: a row per (step, iteration)
        cells = cells.assign(iteration=cells["iteration"].map(_iteration))
        index.append("iteration")
    cells = cells.drop_duplicates(subset=[*keys, "device"], keep="last")
    table = cells.pivot(index=index, columns="device", values=value)
    table.columns.name = "device"
    return table.sort_index()
