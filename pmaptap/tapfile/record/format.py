"""The writer's record type and its strict-JSON line encoding, and decoding
a value as readers give it (docs/api.md, "Record format")."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

from pmaptap.tapfile.record.rawarray import RawArray, has_raw, split_raw
from pmaptap.tapfile.record.schema import (
    FINGERPRINT,
    MAX_STEP,
    NONFINITE,
    AnyRecord,
    Holders,
    _is_pair,
    as_dict,
    holders_count,
    holders_field,
)

if TYPE_CHECKING:  # numpy loads only when a value needs it: readers start faster
    import numpy as np

# The names of the meta records pmaptap writes (kind "meta", never a tapped
# value): the one registry, for writers and readers.
META_DROPPED = "pmaptap/dropped"  # values the bounded queue dropped, counted
META_REFUSED = "pmaptap/refused"  # a tap the host could not record (and why)
META_UNENCODABLE = "pmaptap/unencodable"  # a record replaced: it could not be encoded
META_ATTEMPT = "pmaptap/attempt"  # a resumed run's attempt began here


def check_step_range(step: int, where: str) -> int:
    """``step`` as int, or ``ValueError`` naming ``where``: readers reject a
    step outside 0..MAX_STEP, so it is never written."""
    if not 0 <= step <= MAX_STEP:
        raise ValueError(
            f"{where}: step must be >= 0 and at most 2**63-1 (steps are int64); got {step}."
        )
    return int(step)


def check_text(text: "str | None", where: str, what: str = "name") -> None:
    """A str (or None) of valid Unicode, refused here naming ``where`` (a lone
    surrogate has no UTF-8 form: better than a record replaced at write time)."""
    if text is None:
        return
    if not isinstance(text, str):
        raise TypeError(
            f"{where}: {what} must be a str (or None for the default), got "
            f"{type(text).__name__} {text!r}"
        )
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{where}: {what} is not valid Unicode text "
            f"({e.reason} at index {e.start}); tap files are "
            f"UTF-8 JSON. Clean the {what}, e.g. "
            f"{what}.encode('utf-8', 'replace').decode()."
        ) from None


# The columns of a table of records, in their order (CSV, frames, Parquet,
# ``show``); after them come a per-device record's mesh coordinates
# ("coords.<axis>"), its value, then any other field.
RECORD_COLUMNS = (
    "run",
    "name",
    "step",
    "pass",
    "kind",
    "process",
    "device",
    "devices",
    "replicas",
    "divergent",
    "index",
    "dtype",
    "shape",
    "time",
    "host",
)
COORDS_COLUMN_PREFIX = "coords."


def coords_column(axis: Any) -> str:
    return f"{COORDS_COLUMN_PREFIX}{axis}"


def is_float_like(dt: np.dtype) -> bool:
    return dt.kind == "f" or (dt.kind == "V" and "float" in dt.name)


def is_narrow_int(dt: np.dtype) -> bool:
    # ml_dtypes' sub-byte integers (int1/2/4, uint1/2/4): NumPy sees them as
    # opaque "V" types, but they widen exactly to int64 and are written as
    # plain JSON integers under their own dtype name.
    return dt.kind == "V" and dt.name.startswith(("int", "uint")) and dt.fields is None


def is_complex(dt: np.dtype) -> bool:
    # ml_dtypes' complex32 is of kind "c" from ml_dtypes 0.7 on, "W" before
    # (the kind first: dtype.name is slow, and encoding asks per array).
    return dt.kind == "c" or (dt.kind == "W" and dt.name == "complex32")


def encodable(dt: np.dtype) -> bool:
    """Whether records hold arrays of ``dt`` (checked at trace time)."""
    return (
        dt.kind in "biuf"
        or is_complex(dt)
        or is_narrow_int(dt)
        or (is_float_like(dt) and dt.fields is None)
    )


@dataclasses.dataclass(frozen=True)
class Record:
    run: str
    name: str
    step: int
    kind: str
    value: Any  # already JSON-able (see encode_tree)
    dtype: Any
    shape: Any
    process: int
    time: float
    host: str
    device: int | None = None  # per_device only
    coords: dict | None = None  # per_device only
    replicas: int | None = None  # replicated only
    devices: tuple | None = None  # replicated: devices holding this value
    processes: tuple | None = None
    divergent: bool = False
    batch_dims: int = 0
    pass_: str = "forward"
    extra: dict | None = None  # meta records: counters etc.
    vhash: str | None = None  # replicated: hash of the value's bits
    summarized: bool = False  # a leaf's value is statistics (SUMMARY_FIELDS)
    # None or 0: not written.
    index: list | None = None
    global_shape: list | None = None
    attempt: int = 0
    iteration: tuple | None = None
    # Not a field: the line put_lines built, in those records' instance dict
    # only (a class default: reading __dict__ would make CPython build a
    # dict for every other record).
    _line: ClassVar[bytes | None] = None

    def to_json_dict(self) -> dict:
        value, stored = self.value, None
        dtype = self.dtype
        if type(value) is RawArray or (
            type(value) in (dict, list) and type(dtype) is not str and has_raw(value, dtype)
        ):
            value, stored = split_raw(value, self.dtype)  # null here, their place in "bytes"
        d: dict[str, Any] = {
            "run": self.run,
            "name": self.name,
            "step": int(self.step),
            "kind": self.kind,
            "value": value,
            "dtype": self.dtype,
            "shape": self.shape,
            "process": self.process,
            "time": round(self.time, 6),
            "host": self.host,
        }
        if self.iteration is not None:
            d["iteration"] = list(self.iteration)
        if self.kind == "per_device":
            d["device"] = self.device
            d["coords"] = self.coords if self.coords is not None else {}
        elif self.kind == "replicated" or self.kind == FINGERPRINT:
            d["replicas"] = self.replicas
            if self.devices is not None:
                d["devices"] = holders_field(self.devices)
            if self.processes is not None:
                d["processes"] = holders_field(self.processes)
            if self.vhash:
                d["vhash"] = self.vhash
        if self.index is not None:
            d["index"] = self.index
        if self.global_shape is not None:
            d["global_shape"] = self.global_shape
        if stored is not None:
            d["bytes"] = stored
        if self.divergent:
            d["divergent"] = True
        if self.batch_dims:
            d["batch_dims"] = self.batch_dims
        if self.pass_ != "forward":
            d["pass"] = self.pass_
        if self.summarized:
            d["summarized"] = True
        if self.attempt:
            d["attempt"] = self.attempt
        if self.extra:
            d.update(self.extra)
        return d

    def encode(self) -> bytes:
        line = self._line
        return line if line is not None else encode_line(self.to_json_dict())

    # The aggregator's fast path (docs/architecture.md): they write the
    # instance dict of a frozen dataclass, so they live here (test_layout.py).

    def template(self) -> dict:
        fields = dict(self.__dict__)
        fields.pop("_line", None)  # a line belongs to one record, never its copies
        return fields

    @classmethod
    def from_template(
        cls,
        template: dict,
        step: Any,
        value: Any,
        dtype: Any,
        shape: Any,
        time: float,
        vhash: str | None = None,
    ) -> Record:
        """A record with ``template``'s fields and these, filled directly."""
        r = object.__new__(cls)
        d = r.__dict__
        d.update(template)
        d["step"], d["value"], d["dtype"], d["shape"], d["time"] = step, value, dtype, shape, time
        if vhash is not None:
            d["vhash"] = vhash
        return r

    @classmethod
    def line_pieces(cls, template: dict, dtype: Any, shape: Any) -> tuple[bytes, ...] | None:
        """The line of ``template`` with this dtype and shape cut into the
        four pieces around step, value and time (None: not unambiguously)."""
        if ORJSON is None:
            return None
        line = cls.from_template(
            template, _STEP_SENTINEL, _VALUE_SENTINEL, dtype, shape, _TIME_SENTINEL
        ).encode()
        cuts = []
        for key, value in (
            (b'"step":', _STEP_SENTINEL),
            (b'"value":', _VALUE_SENTINEL),
            (b'"time":', _TIME_SENTINEL),
        ):
            text = ORJSON.dumps(value)
            probe = key + text
            if line.count(probe) != 1 or line.count(text) != 1:
                return None
            start = line.index(probe) + len(key)
            cuts.append((start, start + len(text)))
        (s0, e0), (s1, e1), (s2, e2) = cuts
        if not (e0 <= s1 and e1 <= s2):
            return None
        return line[:s0], line[e0:s1], line[e1:s2], line[e2:]

    @staticmethod
    def set_iteration(records: Sequence[Record], iteration: tuple) -> None:
        """Give a looped tap's new ``records`` their ``iteration``."""
        for r in records:
            d = r.__dict__
            if d.get("iteration") is None and r.kind != "meta":
                d["iteration"] = iteration
                d.pop("_line", None)

    @staticmethod
    def put_lines(
        records: Sequence[Record],
        pieces: Sequence[tuple[bytes, ...]],
        texts: Sequence[bytes],
        step: int,
        time: float,
    ) -> None:
        """Each record's line: its ``line_pieces`` around step, value, time."""
        step_b, time_b = b"%d" % int(step), ORJSON.dumps(round(time, 6))
        for r, (p0, p1, p2, p3), text in zip(records, pieces, texts):
            r.__dict__["_line"] = b"".join((p0, step_b, p1, text, p2, time_b, p3))


# Sentinels where the step, value and time go (Record.line_pieces).
_STEP_SENTINEL = -4242424242424242
_VALUE_SENTINEL = "\x01pmaptap-value\x01"
_TIME_SENTINEL = -4242424242.424242


_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Record)}
_REQUIRED_FIELDS = frozenset(k for k, v in _FIELD_DEFAULTS.items() if v is dataclasses.MISSING)


def new_record(**fields: Any) -> Record:
    """``Record(**fields)`` for the aggregator's per-copy hot path, without
    the frozen dataclass __init__ (one object.__setattr__ per field)."""
    keys = fields.keys()
    if not (_REQUIRED_FIELDS <= keys <= _FIELD_DEFAULTS.keys()):
        raise TypeError(
            f"Record fields missing {sorted(_REQUIRED_FIELDS - keys)} "
            f"or unknown {sorted(keys - _FIELD_DEFAULTS.keys())}"
        )
    r = object.__new__(Record)
    d = r.__dict__
    d.update(_FIELD_DEFAULTS)
    d.update(fields)
    return r


def meta_record(*, count: int, **fields: Any) -> Record:
    """A ``kind="meta"`` record whose value is one int64 ``count``."""
    return Record(kind="meta", value=count, dtype="int64", shape=[], **fields)


def split_step(key: tuple) -> tuple[tuple, Any]:
    """A ``record_key`` as (the key less its step, the step)."""
    return key[:2] + key[3:], key[2]


def key_with_step(rest: tuple, step: Any) -> tuple:
    """The ``record_key`` of ``rest`` (``split_step``) at ``step``."""
    return (*rest[:2], step, *rest[2:])


def index_text(index: Any, sep: str = ",") -> str:
    """``[[4, 6], [0, 8]]`` -> ``4:6,0:8`` (a pytree's leaves in brackets)."""
    if not index:
        return ""
    if all(_is_pair(p) for p in index):
        return sep.join(f"{a}:{b}" for a, b in index)
    return sep.join("[" + index_text(i, sep) + "]" for i in index)


# A leaf above options().max_value_bytes travels as float32[8] statistics:
# min, max, mean, std of the finite elements, then the NaN and inf counts,
# each as two float32 (count // COUNT_BASE, count % COUNT_BASE) so that
# counts up to 2**31 stay exact.
SUMMARY_FIELDS = ("min", "max", "mean", "std", "nan", "inf")
COUNT_BASE = 4096


try:  # orjson encodes NumPy arrays far faster; json stays as the fallback
    import orjson as ORJSON

    ORJSON_OPTS = ORJSON.OPT_SERIALIZE_NUMPY
except ImportError:  # pragma: no cover - exercised via PMAPTAP_NO_ORJSON
    ORJSON, ORJSON_OPTS = None, 0
if os.environ.get("PMAPTAP_NO_ORJSON"):
    ORJSON = None


def _json_default(o: Any) -> Any:
    import numpy as np

    if isinstance(o, (np.ndarray, np.generic)):
        return o.tolist()  # a NumPy scalar's: its Python scalar
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def encode_line(d: dict) -> bytes:
    """One strict-JSON line (values may hold finite NumPy arrays)."""
    if ORJSON is not None:
        return ORJSON.dumps(d, option=ORJSON_OPTS | ORJSON.OPT_APPEND_NEWLINE)
    # allow_nan=False: a stray non-finite float is a bug, never a bad line.
    text = json.dumps(
        d, separators=(",", ":"), allow_nan=False, ensure_ascii=False, default=_json_default
    )
    return (text + "\n").encode("utf-8")


def _decode_nonfinite(v: Any) -> Any:
    if isinstance(v, list):
        return [_decode_nonfinite(x) for x in v]
    return NONFINITE[v] if isinstance(v, str) and v in NONFINITE else v


def _decode_complex(v: Any, depth: int) -> Any:
    # Total: a value that does not have the shape's nesting of [re, im]
    # pairs is left as written (``pmaptap validate`` reports it).
    if depth == 0:
        if isinstance(v, list) and len(v) == 2 and all(isinstance(x, (int, float)) for x in v):
            return complex(v[0], v[1])
        return v
    if not isinstance(v, list):
        return v
    return [_decode_complex(x, depth - 1) for x in v]


def decode_value(value: Any, dtype: Any, shape: Any) -> Any:
    if isinstance(dtype, str) and isinstance(value, dict):
        # A summarized leaf: statistics, never complex pairs.
        return {k: _decode_nonfinite(v) for k, v in value.items()}
    if isinstance(dtype, str):
        value = _decode_nonfinite(value)
        if dtype.startswith("complex") and isinstance(shape, list):
            value = _decode_complex(value, len(shape))
        return value
    if isinstance(dtype, dict) and isinstance(value, dict):
        shapes = shape if isinstance(shape, dict) else {}
        return {k: decode_value(v, dtype.get(k), shapes.get(k)) for k, v in value.items()}
    if isinstance(dtype, list) and isinstance(value, list):
        shapes = shape if isinstance(shape, list) else [None] * len(value)
        return [decode_value(v, d, s) for v, d, s in zip(value, dtype, shapes)]
    return _decode_nonfinite(value)


def decoded(r: AnyRecord) -> dict:
    """A Struct as pmaptap.read gives it (decode_record's decoding)."""
    if r.odd:
        return decode_record(r.source)
    d = as_dict(r)
    v = r.value
    if type(v) is not float and type(v) is not int:
        d["value"] = decode_value(v, r.dtype, r.shape)
    if type(r.devices) is str:
        d["devices"] = Holders.of(r.devices)
    if type(r.processes) is str:
        d["processes"] = Holders.of(r.processes)
    return d


def decode_record(d: dict) -> dict:
    """A line's object as readers give it (docs/api.md, "Record format")."""
    d = dict(d)
    d["value"] = decode_value(d["value"], d.get("dtype"), d.get("shape"))
    for field in ("devices", "processes"):
        v = d.get(field)
        if type(v) is str and holders_count(v) is not None:
            d[field] = Holders.of(v)
    return d
