"""The record type and its strict-JSON line encoding (RFC 8259).

Non-finite floats have no JSON number form, so inside ``value`` they are
written as the strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"``; values
are always numeric, so a string there is unambiguous, and ``decode`` turns
them back into floats. Complex numbers are ``[re, im]`` pairs (the ``dtype``
says complex). bfloat16 / float8 / float16 are widened to float for JSON but
keep their own ``dtype`` name. A pytree value is nested JSON objects (dicts,
namedtuples) and arrays (lists, tuples); ``dtype`` and ``shape`` then have the
same nesting. Custom pytree nodes follow their key paths
(``jax.tree_util.tree_flatten_with_path``): a node whose children all have
names (``DictKey``, ``GetAttrKey``: ``register_dataclass`` classes, Flax
``nnx.State`` and ``nnx.Variable``, any ``register_pytree_with_keys`` node
keyed that way) is an object keyed by those names (``str()`` of a
``DictKey``'s key); a list-like node (``SequenceKey``, ``FlattenedIndexKey``,
other key types, repeated names) is an array in flatten order. An array leaf
above 1 KiB is not in the line: ``value`` is null there and ``bytes`` says
where its exact bytes are (tapfile/source/arrays.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

from pmaptap.tapfile.record.rawarray import RawArray, has_raw, split_raw

if TYPE_CHECKING:  # numpy loads only when a value needs it: readers start faster
    import numpy as np

# The format's constants and rules are schema.py's (the one home of what a
# record is): import them from there (or from the package, tapfile.record).
from pmaptap.tapfile.record.schema import (  # noqa: E402
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

# The names of the meta records pmaptap writes: facts about the run (kind
# "meta"), never a tapped value; a reader keeps them visible whatever the
# attempt. The one registry: writers and readers name them from here.
META_DROPPED = "pmaptap/dropped"  # values the bounded queue dropped, counted
META_REFUSED = "pmaptap/refused"  # a tap the host could not record (and why)
META_UNENCODABLE = "pmaptap/unencodable"  # a record replaced: it could not be encoded
META_ATTEMPT = "pmaptap/attempt"  # a resumed run's attempt began here
META_NAMES = (META_DROPPED, META_REFUSED, META_UNENCODABLE, META_ATTEMPT)


def check_step_range(step: int, where: str) -> int:
    """An integer step given on the host (a tap's Python int, a ``Writer``'s
    step) as int, or ``ValueError`` naming ``where``: readers reject any
    record whose step is outside 0..MAX_STEP, so it is never written."""
    if not 0 <= step <= MAX_STEP:
        raise ValueError(
            f"{where}: step must be >= 0 and at most 2**63-1 (steps are int64); got {step}."
        )
    return int(step)


def check_text(text: "str | None", where: str, what: str = "name") -> None:
    """Text that goes into records (a tap's or a Writer's name, a run id, a
    host name) must be valid Unicode, or ``ValueError`` naming ``where``:
    a lone surrogate (e.g. from os.fsdecode of a non-UTF-8 file name) has
    no JSON/UTF-8 form, and refused here it is not a record replaced by
    ``pmaptap/unencodable`` at write time (every record, for a run id).
    Anything but a str or None is a ``TypeError`` naming ``where`` and what
    it takes (``host=5`` was a bare AttributeError from ``encode``)."""
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


# The columns of a table of records, in their order: the one list. The CSV
# export (export.FIXED) and read(as_frame=True)/Parquet (frame.py) start
# with them and ``show``'s text table (views.COLUMNS) picks from them, each
# adding or leaving out columns relative to this list (the reason beside
# each); after them come a per-device record's mesh coordinates
# (coords_column), its value (``value``, ``value.<leaf>``), then any other
# field.
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
# Tables of records (the CSV export, read(as_frame=True), Parquet) name a
# per-device record's mesh coordinate on axis A "coords.A" (the record's
# field and the axis): the one definition, shared by all of them.
COORDS_COLUMN_PREFIX = "coords."


def coords_column(axis: Any) -> str:
    """The table column of the mesh coordinate on ``axis``."""
    return f"{COORDS_COLUMN_PREFIX}{axis}"


def is_float_like(dt: np.dtype) -> bool:
    return dt.kind == "f" or (dt.kind == "V" and "float" in dt.name)


def is_narrow_int(dt: np.dtype) -> bool:
    # ml_dtypes' sub-byte integers (int1/2/4, uint1/2/4): NumPy sees them as
    # opaque "V" types, but they widen exactly to int64 and are written as
    # plain JSON integers under their own dtype name.
    return dt.kind == "V" and dt.name.startswith(("int", "uint")) and dt.fields is None


def encodable(dt: np.dtype) -> bool:
    """Whether records hold arrays of ``dt`` (the writer's encode_array takes
    exactly these; pmaptap.tap checks it at trace time so that a dtype the
    format cannot hold is refused there, with the tap's name, and never
    dropped on the host)."""
    return dt.kind in "biufc" or is_narrow_int(dt) or (is_float_like(dt) and dt.fields is None)


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
    # A shard of a sharded value under jit: its global slice, [start, stop]
    # per dimension (a list of those per leaf for a pytree); None otherwise.
    index: list | None = None
    # A shard's global array shape (a list per leaf for a pytree, as index):
    # what pmaptap.assemble fills from the shards' indexes.
    global_shape: list | None = None
    # The attempt of a resumed run that wrote it (Session(resume=True)); 0,
    # the first attempt, is not written.
    attempt: int = 0
    # A tap inside a loop body (scan, fori_loop, while_loop, nested loops):
    # the index of each enclosing loop's iteration, outermost first; None
    # (not written) outside loops, so loop-free files are unchanged.
    iteration: tuple | None = None
    # Not a field: the encoded line, when the aggregator built it from a
    # per-site template (put_lines below); set in the instance dict of
    # those records only. A class default rather than self.__dict__.get():
    # reading __dict__ would make CPython build a dict for every other
    # record (measured: the writer stage 320k -> 180k rec/s).
    _line: ClassVar[bytes | None] = None

    def to_json_dict(self) -> dict:
        value, stored = self.value, None
        dtype = self.dtype
        if type(value) is RawArray or (
            type(value) in (dict, list) and type(dtype) is not str and has_raw(value, dtype)
        ):
            # Leaves stored as bytes (tapfile/source/arrays.py): null here, their
            # place in "bytes".
            value, stored = split_raw(value, self.dtype)
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
        # The aggregator may have built this record's line already, from a
        # per-site template (the same bytes: put_lines).
        line = self._line
        return line if line is not None else encode_line(self.to_json_dict())

    # The aggregator's fast path (_host/pipeline/records.py). Every field of a tap
    # site's record but its step, value and time (and a replicated value's
    # hash) is the same at every step, so the aggregator builds one record
    # per site and device once, keeps its fields (``template``) and makes
    # each later record a copy of them (``from_template``): about half the
    # cost of building a record field by field, on the path of every
    # gathered tap. Scalar per_device records of a site also get their line
    # without a dict and an orjson call each: the site's line is cut once
    # around the step, value and time (``line_pieces``) and each record's
    # line is those pieces joined around its own (``put_lines``); encoding
    # record by record was most of what such a tap cost the host
    # (docs/performance.md, per_device). tests/trace/test_fast_lines.py
    # proves the joined line equals ``encode_line(to_json_dict())``. These
    # write the instance dict of a frozen dataclass, so they live here,
    # beside the fields they fill (tests/project/test_layout.py keeps every
    # other module off ``__dict__``).

    def template(self) -> dict:
        """This record's fields, for ``from_template`` (a copy: the record
        stays as it is)."""
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
        """A record with ``template``'s fields (``Record.template``) and
        this step, value, dtype, shape, time and, when given, value hash:
        filled directly, without the frozen dataclass constructor."""
        r = object.__new__(cls)
        d = r.__dict__
        d.update(template)
        d["step"], d["value"], d["dtype"], d["shape"], d["time"] = step, value, dtype, shape, time
        if vhash is not None:
            d["vhash"] = vhash
        return r

    @classmethod
    def line_pieces(cls, template: dict, dtype: Any, shape: Any) -> tuple[bytes, ...] | None:
        """The encoded line of a record built from ``template`` with this
        dtype and shape, cut into the four pieces around its step, value and
        time (for ``put_lines``), or None when it cannot be cut
        unambiguously (a name or host that contains a sentinel; no orjson):
        then records are encoded one by one. Cut from ``encode`` itself, so
        the joined line is byte for byte the one it would write."""
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
        """Give ``records`` (a looped tap's, just built) their loop
        ``iteration``; a line already joined from a per-site template lacks
        it, so it is dropped and the record encoded with its fields."""
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
        """Give each of ``records`` (one step's, built from templates at
        ``time``) its encoded line: its ``line_pieces`` joined around the
        step, its value's JSON text (``texts``, in order) and the time,
        written as ``to_json_dict`` writes them. One call per step, not per
        record: this runs for every gathered scalar per_device tap."""
        step_b, time_b = b"%d" % int(step), ORJSON.dumps(round(time, 6))
        for r, (p0, p1, p2, p3), text in zip(records, pieces, texts):
            r.__dict__["_line"] = b"".join((p0, step_b, p1, text, p2, time_b, p3))


# Sentinels put in a template record where the step, the value and the time
# go (Record.line_pieces); each must appear exactly once, after its key, in
# the encoded line (a name or host that happens to contain one just keeps
# the ordinary path).
_STEP_SENTINEL = -4242424242424242
_VALUE_SENTINEL = "\x01pmaptap-value\x01"
_TIME_SENTINEL = -4242424242.424242


_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Record)}
_REQUIRED_FIELDS = frozenset(k for k, v in _FIELD_DEFAULTS.items() if v is dataclasses.MISSING)


def new_record(**fields: Any) -> Record:
    """``Record(**fields)`` for the aggregator's per-copy hot path: fills the
    instance dict directly instead of running the frozen dataclass __init__
    (one object.__setattr__ per field: 3.4 us vs 1.2 us a record). The same
    fields are required and no others are taken."""
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
    """A ``kind="meta"`` record whose value is one int64 ``count`` (what
    pmaptap refused, dropped or could not encode; the attempt number): the
    value's dtype and shape are always the same, the rest is ``fields``."""
    return Record(kind="meta", value=count, dtype="int64", shape=[], **fields)


def split_step(key: tuple) -> tuple[tuple, Any]:
    """A ``record_key`` as (the key less its step, the step): the rest is
    (run, name, pass, index, attempt), for an index that keeps one such
    key's steps together as small ints (tapfile/read/divergence.py).
    ``key_with_step`` gives the key back."""
    return key[:2] + key[3:], key[2]


def key_with_step(rest: tuple, step: Any) -> tuple:
    """The ``record_key`` of ``rest`` (``split_step``) at ``step``."""
    return (*rest[:2], step, *rest[2:])


def index_text(index: Any, sep: str = ",") -> str:
    """``[[4, 6], [0, 8]]`` -> ``4:6,0:8`` (one ``start:stop`` per dimension;
    a pytree's leaves each in brackets); "" when there is none."""
    if not index:
        return ""
    if all(_is_pair(p) for p in index):
        return sep.join(f"{a}:{b}" for a, b in index)
    return sep.join("[" + index_text(i, sep) + "]" for i in index)


# A leaf above options().max_value_bytes travels as float32[8] statistics
# computed on device (stats.device_statistics): min, max, mean, std over the finite
# elements (of |z| for complex), then the NaN and inf counts, each as two
# float32 (count // COUNT_BASE, count % COUNT_BASE) so that counts up to 2**31
# stay exact, which one float32 (24-bit mantissa) would not.
SUMMARY_FIELDS = ("min", "max", "mean", "std", "nan", "inf")
COUNT_BASE = 4096


try:  # orjson encodes NumPy arrays ~25x faster than json (measured: 20 us vs
    # 520 us for 1024 float32); json stays as the fallback.
    import orjson as ORJSON

    ORJSON_OPTS = ORJSON.OPT_SERIALIZE_NUMPY
except ImportError:  # pragma: no cover - exercised via PMAPTAP_NO_ORJSON
    ORJSON, ORJSON_OPTS = None, 0
if os.environ.get("PMAPTAP_NO_ORJSON"):
    ORJSON = None


def _json_default(o: Any) -> Any:
    import numpy as np

    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, np.generic):
        return o.item()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def encode_line(d: dict) -> bytes:
    """One strict-JSON line. Values may hold finite NumPy arrays."""
    if ORJSON is not None:
        return ORJSON.dumps(d, option=ORJSON_OPTS | ORJSON.OPT_APPEND_NEWLINE)
    # allow_nan=False: a stray non-finite float is a bug, never a bad line.
    return (
        json.dumps(
            d, separators=(",", ":"), allow_nan=False, ensure_ascii=False, default=_json_default
        )
        + "\n"
    ).encode("utf-8")


# ---------------------------------------------------------------- decoding


def _decode_nonfinite(v: Any) -> Any:
    if isinstance(v, list):
        return [_decode_nonfinite(x) for x in v]
    if isinstance(v, str) and v in NONFINITE:
        return NONFINITE[v]
    return v


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
    """A record (a schema.py Struct) as pmaptap.read gives it: its line's
    object with decode_record's decoding, built once (no copy of a dict
    made for the purpose)."""
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
    """A record as written (the line's object) as readers give it: its
    value decoded (non-finite markers as floats, complex pairs as complex),
    holders written as ranges text as ``Holders`` (the ids, never a list
    of them: a record of a 4,096-process job stays small)."""
    d = dict(d)
    d["value"] = decode_value(d["value"], d.get("dtype"), d.get("shape"))
    for field in ("devices", "processes"):
        v = d.get(field)
        if type(v) is str and holders_count(v) is not None:
            d[field] = Holders.of(v)
    return d
