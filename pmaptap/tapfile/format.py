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
where its exact bytes are (tapfile/arrays.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Sequence

from pmaptap.tapfile.rawarray import RawArray, has_raw, split_raw

if TYPE_CHECKING:  # numpy loads only when a value needs it: readers start faster
    import numpy as np

# ---------------------------------------------------------------- fingerprints
# pmaptap.fingerprint's records (_host/fingerprints.py writes them;
# docs/api.md#fingerprint-records describes every field). "kind":
# "fingerprint", the fields every record has ("value", "dtype" and "shape"
# null: no array data), ``fingerprint`` (16 hexadecimal digits, the 64-bit
# fingerprint), ``replicas``, ``devices``, ``processes`` (the holders, as a
# replicated record lists them) and either
# - all copies agree: ``leaves`` (how many were fingerprinted) and
#   ``slices`` (how many groups of copies were compared); ``fingerprint`` is
#   a digest of every group's fingerprint;
# - copies differ: ``divergent: true``, ``leaf`` (its path, "" for a bare
#   array), ``index`` (under jit, the slice of a sharded leaf) or
#   ``slice_coords`` (inside shard_map, the coordinates on the axes the leaf
#   varies over), ``compared`` (the copies of that slice) and, for a
#   fingerprint held by at most RANGES_ABOVE copies, ``holders`` (one
#   {device, process, host, coords} per copy holding it).
# Their rules are in RULES below (the fingerprint-only ones are the
# format's own: pmaptap validate checks them), and a fingerprint record
# always takes the full checks (UNPLAIN_KINDS).
FINGERPRINT = "fingerprint"
# ----------------------------------------------------------------------------

KINDS = ("replicated", "per_device", "meta", FINGERPRINT)
# The kinds that carry a tapped value (meta records carry counters,
# fingerprint records a fingerprint of the devices' copies).
VALUE_KINDS = KINDS[:2]
# Kinds whose records no fast check takes (first_not_plain, the C loops,
# checks._fields_clean, summary's usual records): one a step at most, they
# take the full checks.
UNPLAIN_KINDS = (FINGERPRINT,)
# The names of the meta records pmaptap writes: facts about the run (kind
# "meta"), never a tapped value; a reader keeps them visible whatever the
# attempt. The one registry: writers and readers name them from here.
META_DROPPED = "pmaptap/dropped"  # values the bounded queue dropped, counted
META_REFUSED = "pmaptap/refused"  # a tap the host could not record (and why)
META_UNENCODABLE = "pmaptap/unencodable"  # a record replaced: it could not be encoded
META_ATTEMPT = "pmaptap/attempt"  # a resumed run's attempt began here
META_NAMES = (META_DROPPED, META_REFUSED, META_UNENCODABLE, META_ATTEMPT)
# Steps are integers from 0 to the int64 maximum, whatever form the tap got.
MAX_STEP = 2**63 - 1


def check_step_range(step: int, where: str) -> int:
    """An integer step given on the host (a tap's Python int, a ``Writer``'s
    step) as int, or ``ValueError`` naming ``where``: readers reject any
    record whose step is outside 0..MAX_STEP, so it is never written."""
    if not 0 <= step <= MAX_STEP:
        raise ValueError(
            f"{where}: step must be >= 0 and at most 2**63-1 (steps are int64); got {step}."
        )
    return int(step)


# The strings that stand for non-finite floats inside ``value`` (JSON has no
# number form for them); the one place that names them.
NAN, POS_INF, NEG_INF = "NaN", "Infinity", "-Infinity"
NONFINITE = {NAN: math.nan, POS_INF: math.inf, NEG_INF: -math.inf}
# Replicated records only, absent unless fewer copies were read than
# ``replicas`` (the devices named in ``devices``) hold: how many were read.
# A scalar tapped under plain jit is replicated on every device of the
# computation by its sharding; one copy (device 0's) is read, the others
# are neither seen nor compared. An integer from 1 to ``replicas``.
COPIES_SEEN = "copies_seen"


# The holders of a replicated value (its ``devices`` and ``processes``): a
# list of ids, or, past RANGES_ABOVE ids that are all integers, their ranges
# as text ("0-4095", "0-3,8-11", ascending, disjoint), so that a record's
# size and the work each reader does with it stay the same at 4,096
# processes as at 2 (a list of 4,096 ids is ~20 KB a line). Readers take
# both forms; decode_record (pmaptap.read, show) gives the list.
RANGES_ABOVE = 16
# At most this many ids in one ranges text: a reader expands them (read()'s
# lists), and a hostile "0-9999999999" must cost only its line.
MAX_HOLDERS = 1 << 20
_RANGES_TEXT = re.compile(r"(?:0|[1-9][0-9]{0,18})(?:-(?:0|[1-9][0-9]{0,18}))?")


def holders_field(ids: "tuple | list") -> "list | str":
    """The ``devices``/``processes`` field for ``ids`` as written: the list,
    or its ranges text past RANGES_ABOVE integer ids that are ascending
    and distinct (a holder set as the aggregator builds it)."""
    if len(ids) <= RANGES_ABOVE or not all(type(i) is int and i >= 0 for i in ids):
        return list(ids)
    parts = []
    start = prev = ids[0]
    for i in ids[1:]:
        if i <= prev:
            return list(ids)  # not ascending: the list says it as it is
        if i != prev + 1:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = i
        prev = i
    parts.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(parts)


def id_ranges(text: Any) -> "list[tuple[int, int]] | None":
    """The inclusive (first, last) ranges of a holders text, None if
    ``text`` is not one (not ascending and disjoint, not the form, or more
    than MAX_HOLDERS ids)."""
    if type(text) is not str or not text:
        return None
    out: list[tuple[int, int]] = []
    prev = -1
    count = 0
    for part in text.split(","):
        if not _RANGES_TEXT.fullmatch(part):
            return None
        lo, _, hi = part.partition("-")
        a, b = int(lo), int(hi or lo)
        count += b - a + 1
        if a <= prev or b < a or count > MAX_HOLDERS:
            return None
        out.append((a, b))
        prev = b
    return out


def holder_ids(v: Any) -> list:
    """The ids of a ``devices``/``processes`` field in either form (a list
    as it is; ranges text expanded)."""
    ranges = id_ranges(v) if type(v) is str else None
    if ranges is None:
        return v if isinstance(v, list) else []
    return [i for a, b in ranges for i in range(a, b + 1)]


def holds(v: Any, x: Any) -> bool:
    """Whether a ``devices``/``processes`` field (either form) names ``x``,
    without expanding ranges."""
    if type(v) is str:
        if not isinstance(x, int) or isinstance(x, bool):
            return False
        return any(a <= x <= b for a, b in id_ranges(v) or ())
    return x in (v or ())


def holders_count(v: Any) -> int:
    if type(v) is str:
        return sum(b - a + 1 for a, b in id_ranges(v) or ())
    return len(v) if isinstance(v, list) else 0


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
            # Leaves stored as bytes (tapfile/arrays.py): null here, their
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

    # The aggregator's fast path (_host/records.py). Every field of a tap
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


def record_key(r: "dict | Record") -> tuple:
    """The identity of a value in a tap file: replicated records with the same
    key hold the same value (or are divergent); per-device records add the
    device. One definition for the writer's cross-process dedup (a Record
    about to be written, or a line other processes wrote) and readers.
    Shards of one value are different values: their ``index`` is part of it.
    So is the ``attempt`` of a resumed run: a replayed step's new value is
    neither a duplicate nor a divergence of the old one (it supersedes it:
    tapfile/attempts.py)."""
    if isinstance(r, Record):
        return (r.run, r.name, r.step, r.pass_, index_key(r.index), r.attempt)
    get = r.get  # once per record of every read: no call it can spare
    index = get("index")
    return (
        get("run"),
        get("name"),
        get("step"),
        get("pass", "forward"),
        index if index is None else index_key(index),
        get("attempt", 0),
    )


def step_key(r: dict) -> tuple:
    """A record's step of a tap, (run, name, step, pass): ``record_key``'s
    first four fields, every shard and every attempt of that step. The unit
    a later attempt of a resumed run supersedes (tapfile/attempts.py)."""
    return (r.get("run"), r.get("name"), r.get("step"), r.get("pass", "forward"))


def split_step(key: tuple) -> tuple[tuple, Any]:
    """A ``record_key`` as (the key less its step, the step): the rest is
    (run, name, pass, index, attempt), for an index that keeps one such
    key's steps together as small ints (tapfile/divergence.py).
    ``key_with_step`` gives the key back."""
    return key[:2] + key[3:], key[2]


def key_with_step(rest: tuple, step: Any) -> tuple:
    """The ``record_key`` of ``rest`` (``split_step``) at ``step``."""
    return (*rest[:2], step, *rest[2:])


def index_key(index: Any) -> Any:
    """A hashable form of a record's ``index`` (None when it has none)."""
    if isinstance(index, (list, tuple)):
        return tuple(index_key(i) for i in index)
    return index


def _is_pair(p: Any) -> bool:
    return (
        isinstance(p, (list, tuple))
        and len(p) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in p)
    )


def index_text(index: Any, sep: str = ",") -> str:
    """``[[4, 6], [0, 8]]`` -> ``4:6,0:8`` (one ``start:stop`` per dimension;
    a pytree's leaves each in brackets); "" when there is none."""
    if not index:
        return ""
    if all(_is_pair(p) for p in index):
        return sep.join(f"{a}:{b}" for a, b in index)
    return sep.join("[" + index_text(i, sep) + "]" for i in index)


def valid_index(index: Any, depth: int = 0) -> bool:
    """[[start, stop], ...], or a list of those (one per pytree leaf)."""
    if not isinstance(index, list) or depth > 1:
        return False
    return all(_is_pair(p) or (depth == 0 and valid_index(p, 1)) for p in index)


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


def _decode_value(value: Any, dtype: Any, shape: Any) -> Any:
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
        return {k: _decode_value(v, dtype.get(k), shapes.get(k)) for k, v in value.items()}
    if isinstance(dtype, list) and isinstance(value, list):
        shapes = shape if isinstance(shape, list) else [None] * len(value)
        return [_decode_value(v, d, s) for v, d, s in zip(value, dtype, shapes)]
    return _decode_nonfinite(value)


# ---------------------------------------------------------------- the rules
#
# What a record is, field by field, in one table (RULES): validate_dict's
# full checks and checks.schema_problems' per-field checks are made from it;
# the fast checks (first_not_plain here, checks._fields_clean and
# summary_batch.BatchSummarizer._add_part) are hand-inlined copies of it for
# speed (a loop over the table costs every line of every read), and
# tests/tapfile/test_record_rules.py derives from the table a record
# breaking each rule and checks that each of them refuses it.


def _is_scalar(x: Any) -> bool:
    return x is None or isinstance(x, (str, int, float))


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


# The exact types a JSON parser returns for a field readers only compare,
# hash and print (process, device, a holder id): any JSON scalar.
_SCALAR_TYPES = frozenset((type(None), str, int, float, bool))
_STR = frozenset((str,))
_INT = frozenset((int,))


def _holders_ok(ids: Any) -> bool:
    """A ``devices``/``processes`` field as readers take it: absent or null,
    a list of scalars, or ranges text (holders_field)."""
    return (
        ids is None
        or isinstance(ids, list)
        and all(map(_is_scalar, ids))
        or id_ranges(ids) is not None
    )


def _strict_holders(ids: Any, element: Any) -> bool:
    return isinstance(ids, list) and all(map(element, ids)) or id_ranges(ids) is not None


def _strict_devices(ids: Any, d: dict) -> bool:
    # One holder per replica, in either form of the holders.
    replicas = d["replicas"]
    return ids is None or (
        _strict_holders(ids, lambda x: x is None or _is_int(x))
        and (not _is_int(replicas) or holders_count(ids) == replicas)
    )


def _strict_copies_seen(seen: Any, d: dict) -> bool:
    replicas = d["replicas"]
    return _is_int(seen) and 1 <= seen and (not _is_int(replicas) or seen <= replicas)


def _global_shape_ok(g: Any, d: dict | None = None) -> bool:
    if isinstance(g, list) and all(_is_int(n) and n >= 0 for n in g):
        return True
    return isinstance(g, list) and all(
        isinstance(x, list) and all(_is_int(n) and n >= 0 for n in x) for x in g
    )


@dataclasses.dataclass(frozen=True)
class FieldRule:
    """One field of a record: what readers need of it (``types``, ``ok``:
    validate_dict) and what the format says beyond that (``strict``:
    ``pmaptap validate``, checks.schema_problems)."""

    name: str
    # The JSON types readers take, as a parser returns them (the fast
    # checks test the exact type; the full checks take subclasses, but
    # never a bool for an int); None: any value.
    types: frozenset | None = None
    # What a value of those types must also be (None: nothing more).
    ok: Callable[[Any], bool] | None = None
    must: str = ""  # validate_dict's problem: "<name> must be <must>"
    # The kinds of record the field belongs to. A required field is in
    # every record of those kinds and checked there only; readers check an
    # optional field in any record that has it; the strict check runs in
    # those kinds only.
    kinds: tuple = KINDS
    required: bool = False
    # first_not_plain takes records with this field (False: they take the
    # full checks); checks._fields_clean likewise.
    plain: bool = True
    clean: bool = True
    # The format's own rule, checked on records readers take (the record
    # is the second argument), and its problem (str.format'ed with v=).
    strict: Callable[[Any, dict], bool] | None = None
    strict_problem: str = ""

    def accepts(self, v: Any) -> bool:
        """Whether readers take ``v`` in this field (validate_dict)."""
        types = self.types
        if types is not None and not (
            isinstance(v, tuple(types)) and (bool in types or not isinstance(v, bool))
        ):
            return False
        return self.ok is None or bool(self.ok(v))


_REP, _PD = ("replicated",), ("per_device",)
# The kinds that list the holders of a value (replicas, devices, processes).
_HELD = ("replicated", FINGERPRINT)
_FP = (FINGERPRINT,)
_HEX16 = re.compile(r"[0-9a-f]{16}")


def _fp_rule(name: str, strict: Callable[[Any, dict], bool], problem: str) -> FieldRule:
    """A field of fingerprint records only, the format's own rule (readers
    take any value: no fast check needs to know it)."""
    return FieldRule(name, kinds=_FP, strict=strict, strict_problem=problem)


def _holders_rule(name: str, strict: Callable[[Any, dict], bool], problem: str) -> FieldRule:
    """The rule of a holders field (``devices``, ``processes``): readers take
    either form (holders_field) in any record; the format's own rule is a
    replicated record's."""
    return FieldRule(
        name,
        frozenset((type(None), list, str)),
        _holders_ok,
        'a list of numbers or ranges text ("0-4095,4100")',
        kinds=_HELD,
        strict=strict,
        strict_problem=problem,
    )


# The table, in the order validate_dict looks for a problem (it names the
# first it finds). Fields not here (batch_dims, summarized, a meta
# record's counters) are not checked.
RULES: tuple[FieldRule, ...] = (
    FieldRule("name", _STR, bool, "a non-empty string", required=True),
    FieldRule(
        "step",
        _INT,
        must="an integer",
        required=True,
        strict=lambda v, d: 0 <= v <= MAX_STEP,
        strict_problem="step must be from 0 to 2**63-1, got {v}",
    ),
    FieldRule("kind", _STR, KINDS.__contains__, f"one of {KINDS}", required=True),
    FieldRule("run", _STR, must="a string", required=True),
    FieldRule("value", required=True),
    FieldRule("dtype", required=True),
    FieldRule("shape", required=True),
    FieldRule("pass", _STR, must="a string"),
    FieldRule(
        "process",
        _SCALAR_TYPES,
        must="a number",
        required=True,
        strict=lambda v, d: _is_int(v) and v >= 0,
        strict_problem="process must be a non-negative integer",
    ),
    FieldRule(
        "time",
        required=True,
        strict=lambda v, d: _is_num(v) and math.isfinite(v),
        strict_problem="time must be a finite number (unix seconds)",
    ),
    FieldRule(
        "host",
        required=True,
        strict=lambda v, d: isinstance(v, str),
        strict_problem="host must be a string",
    ),
    FieldRule("vhash", _STR, must="a string"),
    _holders_rule(
        "devices",
        _strict_devices,
        "devices must list one integer-or-null per replica",
    ),
    _holders_rule(
        "processes",
        lambda v, d: _strict_holders(v, _is_int),
        "processes must be a list of integers (or their ranges text)",
    ),
    FieldRule(
        "device",
        _SCALAR_TYPES,
        must="a number or null",
        kinds=_PD,
        required=True,
        strict=lambda v, d: v is None or _is_int(v),
        strict_problem="device must be an integer or null",
    ),
    FieldRule(
        "coords",
        frozenset((dict,)),
        must="an object",
        kinds=_PD,
        required=True,
        strict=lambda v, d: all(map(_is_int, v.values())),
        strict_problem="coords must be an object of axis name -> integer index",
    ),
    FieldRule(
        "replicas",
        kinds=_HELD,
        required=True,
        strict=lambda v, d: _is_int(v) and v >= 1,
        strict_problem="replicas must be a positive integer",
    ),
    FieldRule("attempt", _INT, lambda v: v >= 0, "a non-negative integer"),
    FieldRule(
        "index",
        frozenset((list,)),
        valid_index,
        "[[start, stop], ...] (a list of those per leaf)",
        plain=False,
    ),
    FieldRule(
        "divergent",
        strict=lambda v, d: v is True,
        strict_problem="divergent, when present, must be true",
    ),
    FieldRule(
        COPIES_SEEN,
        kinds=_REP,
        clean=False,
        strict=_strict_copies_seen,
        strict_problem=f"{COPIES_SEEN}, when present, must be an integer from 1 to replicas",
    ),
    FieldRule(
        "global_shape",
        clean=False,
        strict=_global_shape_ok,
        strict_problem="global_shape must be a list of non-negative integers (a list per leaf)",
    ),
    # A stored value's references: tapfile/arrays.py field_problem checks them.
    FieldRule("bytes", clean=False),
    # Fingerprint records (FINGERPRINT above).
    FieldRule(
        "fingerprint",
        _STR,
        must="a string",
        kinds=_FP,
        required=True,
        strict=lambda v, d: _HEX16.fullmatch(v) is not None,
        strict_problem="fingerprint must be 16 hexadecimal digits",
    ),
    _fp_rule("leaf", lambda v, d: isinstance(v, str), "leaf must be a string (the leaf's path)"),
    _fp_rule(
        "leaves",
        lambda v, d: _is_int(v) and v >= 1,
        "leaves must be a positive integer",
    ),
    _fp_rule(
        "slices",
        lambda v, d: _is_int(v) and v >= 1,
        "slices must be a positive integer",
    ),
    _fp_rule(
        "compared",
        lambda v, d: _is_int(v) and v >= 1 and (not _is_int(d["replicas"]) or v >= d["replicas"]),
        "compared must be an integer, at least replicas",
    ),
    _fp_rule(
        "slice_coords",
        lambda v, d: isinstance(v, dict) and all(map(_is_int, v.values())),
        "slice_coords must be an object of axis name -> integer index",
    ),
    _fp_rule(
        "holders",
        lambda v, d: (
            isinstance(v, list)
            and all(isinstance(h, dict) for h in v)
            and (not _is_int(d["replicas"]) or len(v) == d["replicas"])
        ),
        "holders must list one object per replica",
    ),
)
RULE = {r.name: r for r in RULES}
# What the checks use, made once here (never per record).
# The fields every record has, in the order a line holds them (Record's).
REQUIRED = tuple(
    f.name
    for f in dataclasses.fields(Record)
    if f.name in RULE and RULE[f.name].required and RULE[f.name].kinds == KINDS
)
_REQUIRED_KEYS = frozenset(REQUIRED)
# Every field a record of each kind must have (REQUIRED first).
REQUIRED_BY_KIND = {
    kind: REQUIRED
    + tuple(r.name for r in RULES if r.required and kind in r.kinds and r.kinds != KINDS)
    for kind in KINDS
}
# What validate_dict checks: a field's type or condition, a kind's fields.
_READER_RULES = tuple(
    r for r in RULES if r.types is not None or r.ok is not None or r.required and r.kinds != KINDS
)
STRICT_RULES = tuple(r for r in RULES if r.strict is not None)
# Fields whose records the fast checks leave to the full ones.
NOT_PLAIN = frozenset(r.name for r in RULES if not r.plain)
NOT_CLEAN = frozenset(r.name for r in RULES if not r.clean)


def _plainly_valid(d: dict) -> bool:
    """True only for records validate_dict accepts, checked with exact type
    tests as a JSON parser returns them: the records every reader meets, so
    ``pmaptap summary`` of a big file pays for these and not for the full
    checks. False means "run the full checks", which then find the problem
    (or accept a rarer form). The checks themselves: first_not_plain."""
    return first_not_plain((d,)) == 1


def first_not_plain(ds: Sequence[Any], start: int = 0) -> int:
    """The index of the first item of ``ds`` from ``start`` on that is not
    a plainly valid record (see _plainly_valid), len(ds) if there is none.
    One Python loop with every check inline (no call per record, no loop
    per field): this runs for every line of every read."""
    # RULES, hand-inlined (measured: a loop over the table's fields takes
    # ~1.5x as long): the required fields of every record and of each kind, exact
    # types from the table's type sets (scalar: _SCALAR_TYPES), and no
    # field that is not plain (NOT_PLAIN: index). test_record_rules.py
    # checks that it refuses what any rule of the table refuses.
    scalar = _SCALAR_TYPES
    i = start
    for i in range(start, len(ds)):
        d = ds[i]
        if type(d) is not dict:
            return i
        try:
            name, step, kind, run, process = (
                d["name"],
                d["step"],
                d["kind"],
                d["run"],
                d["process"],
            )
        except KeyError:
            return i
        if not (
            "value" in d
            and "dtype" in d
            and "shape" in d
            and "time" in d
            and "host" in d
            and "index" not in d
            and type(name) is str
            and name
            and type(step) is int
            and type(run) is str
            and type(process) in scalar
        ):
            return i
        # Optional fields, each tested for presence first (most records
        # have few of them).
        if "pass" in d and type(d["pass"]) is not str:
            return i
        if "vhash" in d and type(d["vhash"]) is not str:
            return i
        if "attempt" in d:
            attempt = d["attempt"]
            if type(attempt) is not int or attempt < 0:
                return i
        ids = d.get("devices")
        if ids is not None and not (
            type(ids) is list and set(map(type, ids)) <= scalar or id_ranges(ids) is not None
        ):
            return i
        ids = d.get("processes")
        if ids is not None and not (
            type(ids) is list and set(map(type, ids)) <= scalar or id_ranges(ids) is not None
        ):
            return i
        if kind == "per_device":
            if "device" not in d or type(d["device"]) not in scalar:
                return i
            if type(d.get("coords")) is not dict:
                return i
        elif kind == "replicated":
            if "replicas" not in d:
                return i
        elif kind != "meta":
            return i
    else:
        return len(ds)
    return len(ds)


def validate_dict(d: Any) -> str | None:
    """Why ``d`` is not a record, or None if it is one.

    Checks what every reader relies on: the record's identity (run, name,
    step, pass: hashable, see record_key), and fields that readers index,
    sort or iterate having a usable type (RULES). ``pmaptap validate``
    checks the rest of the format (checks.schema_problems)."""
    if type(d) is dict and _plainly_valid(d):
        return None
    return _record_problem(d)


def _record_problem(d: Any) -> str | None:
    """validate_dict's full checks (any input, any subclass): RULES in
    their order, the first problem found."""
    if not isinstance(d, dict):
        return "not a JSON object"
    missing = [k for k in REQUIRED if k not in d]
    if missing:
        return "missing field(s): " + ", ".join(missing)
    kind = d["kind"]
    for rule in _READER_RULES:
        name = rule.name
        if rule.required and rule.kinds != KINDS:
            if kind not in rule.kinds:
                continue  # not this kind's field: readers never look at it
            own = REQUIRED_BY_KIND[kind][len(REQUIRED) :]
            if any(f not in d for f in own):
                return f"{kind} record without {'/'.join(own)}"
        elif name not in d:
            continue
        if not rule.accepts(d[name]):
            return f"{name} must be {rule.must}"
    return None


def decode_owned(d: dict) -> dict:
    """``decode_record(d)`` for a ``d`` the caller gives up (a record just
    parsed, held nowhere else): ``d`` itself where decoding would change
    nothing in it (a number as value, holders as lists: most records), so
    the common record is not copied; else decode_record's new dict."""
    v = d["value"]
    if (
        (type(v) is float or type(v) is int)
        and type(d.get("devices")) is not str
        and type(d.get("processes")) is not str
    ):
        return d
    return decode_record(d)


def decode_record(d: dict) -> dict:
    d = dict(d)
    d["value"] = _decode_value(d["value"], d.get("dtype"), d.get("shape"))
    for field in ("devices", "processes"):
        if type(d.get(field)) is str:
            d[field] = holder_ids(d[field])
    return d
