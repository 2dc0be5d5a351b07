"""What a record is: the one home of the record rules (docs/api.md,
"Record format"; docs/architecture.md, "tapfile/record", tells the levels:
the format's Structs, ``beyond_types``, what readers take, ``Odd*``)."""

from __future__ import annotations

import functools
import re
from bisect import bisect_right
from collections.abc import Sequence
from itertools import chain
from typing import Annotated, Any, ClassVar, Iterator, Literal, Union

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType, field

# Steps are integers from 0 to the int64 maximum, whatever form the tap got.
MAX_STEP = 2**63 - 1
# The strings that stand for non-finite floats inside ``value`` (JSON has no
# number form for them); the one place that names them.
NAN, POS_INF, NEG_INF = "NaN", "Infinity", "-Infinity"
NONFINITE = {NAN: float("nan"), POS_INF: float("inf"), NEG_INF: float("-inf")}
# Replicated records only: how many copies were read, where fewer than
# ``replicas`` (a scalar under plain jit: device 0's copy only).
COPIES_SEEN = "copies_seen"
# Holders past this many integer ids are written as ranges text (docs/api.md),
# so a record's size stays the same at 4,096 processes as at 2.
RANGES_ABOVE = 16
# At most this many ids in one ranges text, so a hostile "0-9999999999"
# costs only its line.
MAX_HOLDERS = 1 << 20

Scalar = None | bool | int | float | str
Name = Annotated[str, Meta(min_length=1)]
Step = Annotated[int, Meta(ge=0, le=MAX_STEP)]
Count = Annotated[int, Meta(ge=0)]
Positive = Annotated[int, Meta(ge=1)]
# Ranges text ("0-3,8-11"), checked by id_ranges (AnyRecord.__post_init__),
# not by a Meta(pattern): msgspec before 0.23 double-frees a pattern that
# shares a union with a list when the decoder is freed (abort at exit).
_ID = "(?:0|[1-9][0-9]{0,18})"
_RANGE = f"{_ID}(?:-{_ID})?"
_PART = re.compile(_RANGE)
RangesText = str
# pmaptap.fingerprint's 64-bit fingerprint of a copy's bits, as text.
Hex16 = Annotated[str, Meta(pattern="^[0-9a-f]{16}$")]


# pmaptap.fingerprint's records (docs/api.md#fingerprint-records).
FINGERPRINT = "fingerprint"
_EVERY = ("replicated", "per_device", "meta", FINGERPRINT)
_HELD = ("replicated", FINGERPRINT)  # the kinds that list a value's holders
_FP = (FINGERPRINT,)
# The fields of a record, in the order a line holds them: (name in the
# line, type, what readers take, required, the kinds that have it). Each
# kind's Struct below is made of its rows (with readers' types: the readers'
# level); a field not required is UNSET when not in the line.
FIELDS: tuple = (
    ("run", str, str, True, _EVERY),
    ("name", Name, Name, True, _EVERY),
    ("step", Step, int, True, _EVERY),
    ("value", Any, Any, True, _EVERY),
    ("dtype", Any, Any, True, _EVERY),
    ("shape", Any, Any, True, _EVERY),
    ("process", Count, Scalar, True, _EVERY),
    ("time", int | float, Any, True, _EVERY),  # unix seconds (JSON: never NaN)
    ("host", str, Any, True, _EVERY),
    # A tap in a loop body: each enclosing loop's iteration, outermost first.
    ("iteration", list[Count], list[Count], False, _EVERY),
    ("device", int | None, Scalar, True, ("per_device",)),  # null: not known
    ("coords", dict[str, int], dict, True, ("per_device",)),  # mesh axis -> index
    ("replicas", Positive, Any, True, _HELD),
    # Who held a replicated value (a list, or ranges text past RANGES_ABOVE).
    ("devices", list[int | None] | RangesText | None, list[Scalar] | str | None, False, _EVERY),
    ("processes", list[int] | RangesText | None, list[Scalar] | str | None, False, _EVERY),
    ("vhash", str, str, False, _EVERY),  # a hash of a replicated value's bits
    # A shard's global slice, [start, stop] per dimension (a list of those
    # per leaf for a pytree), and the global shape (likewise).
    ("index", list, list, False, _EVERY),
    ("global_shape", list, Any, False, _EVERY),
    ("bytes", Any, Any, False, _EVERY),  # where leaves stored as bytes are (arrays.py)
    ("divergent", Literal[True], Any, False, _EVERY),
    ("batch_dims", Count, Any, False, _EVERY),
    ("pass", str, str, False, _EVERY),  # "forward" when absent
    ("summarized", bool, Any, False, _EVERY),  # the value is statistics
    ("attempt", Count, Count, False, _EVERY),  # of a resumed run; 0 when absent
    (COPIES_SEEN, Positive, Any, False, ("replicated",)),
    ("fingerprint", Hex16, str, True, _FP),
    ("leaf", str, Any, False, _FP),  # the leaf's path ("" for a bare array)
    ("leaves", Positive, Any, False, _FP),
    ("slices", Positive, Any, False, _FP),
    ("compared", Positive, Any, False, _FP),  # copies of the slice compared
    ("slice_coords", dict[str, int], Any, False, _FP),
    ("holders", list[dict], Any, False, _FP),
)


class AnyRecord(Struct, kw_only=True):
    """What every record is besides its fields."""

    # Not fields. ``kind``: the tag; ``odd``: a record taken at the
    # readers' level (see from_dict).
    kind: ClassVar[str] = ""
    odd: ClassVar[bool] = False

    def __post_init__(self) -> None:
        # msgspec runs this while decoding: a line breaking a readers' rule
        # no type says is refused like a wrong type.
        if self.index is not UNSET or type(self.devices) is str or type(self.processes) is str:
            problem = beyond_types(self, readers=True)
            if problem:
                raise ValueError(problem[0])

    # The dict reads readers' helpers make of a record, answered as its
    # line's object would.
    def get(self, key: str, default: Any = None) -> Any:
        if key == "kind":
            return self.kind
        v = getattr(self, _ATTR.get(key, key), UNSET) if key in _ATTR else UNSET
        return default if v is UNSET else v

    def __getitem__(self, key: str) -> Any:
        v = self.get(key, UNSET)
        if v is UNSET:
            raise KeyError(key)
        return v

    def __contains__(self, key: str) -> bool:
        return self.get(key, UNSET) is not UNSET

    def key(self) -> tuple:  # record_key's
        p, i, a, it = self.pass_, self.index, self.attempt, self.iteration
        return (
            self.run,
            self.name,
            self.step,
            "forward" if p is UNSET else p,
            part_key(None if i is UNSET else i, None if it is UNSET else it),
            0 if a is UNSET else a,
        )


def _struct(kind: str, readers: bool = False, **config: Any) -> type:
    """The Struct of ``kind`` from its rows of FIELDS (``readers``: the
    readers' level, their types; the same rules beyond types)."""
    fields = []
    for name, tp, readers_tp, required, kinds in FIELDS:
        if kind in kinds:
            tp = readers_tp if readers else tp
            default = msgspec.NODEFAULT if required else UNSET
            if not required and tp is not Any:
                tp = tp | UnsetType
            attr = "pass_" if name == "pass" else name  # "pass" is Python's
            fields.append((attr, tp, field(default=default, name=name)))
    title = {"per_device": "PerDevice", "meta": "MetaRecord"}.get(kind, kind.title())
    return msgspec.defstruct(
        ("LooseRecord" if readers else "") + title,
        fields,
        bases=(AnyRecord,),
        module=__name__,
        namespace={"kind": kind},
        tag_field="kind",
        tag=kind,
        kw_only=True,
        **config,
    )


# The format: a Struct per kind, strict. Not tracked by the cyclic
# collector: a record holds no cycle, and a merge keeps many alive.
_FORMAT = dict(forbid_unknown_fields=True, omit_defaults=True, gc=False)
PerDevice = _struct("per_device", **_FORMAT)  # one device's value
Replicated = _struct("replicated", **_FORMAT)  # a value every holder had
MetaRecord = _struct("meta", **_FORMAT)  # a fact about the run (format.META_*)
Fingerprint = _struct(FINGERPRINT, **_FORMAT)  # devices' copies compared

# The kinds of record, by tag: adding one is a Struct above, listed here.
CLASSES = {c.kind: c for c in (Replicated, PerDevice, MetaRecord, Fingerprint)}
KINDS = tuple(CLASSES)
# The kinds that carry a tapped value (meta records carry counters).
VALUE_KINDS = ("replicated", "per_device")
DECODER = msgspec.json.Decoder(Union[tuple(CLASSES.values())])  # noqa: UP007 - a runtime Union of the classes

# Why a record is no record, per field (validate_dict: "<field> must be
# <this>"), and why it breaks the format (beyond_types, strict).
READERS_MUST = {
    "run": "a string",
    "name": "a non-empty string",
    "step": "an integer",
    "kind": f"one of {KINDS}",
    "pass": "a string",
    "process": "a number",
    "vhash": "a string",
    "devices": 'a list of numbers or ranges text ("0-4095,4100")',
    "processes": 'a list of numbers or ranges text ("0-4095,4100")',
    "device": "a number or null",
    "coords": "an object",
    "attempt": "a non-negative integer",
    "index": "[[start, stop], ...] (a list of those per leaf)",
    "fingerprint": "a string",
}
FORMAT_PROBLEM = {
    "step": "step must be from 0 to 2**63-1, got {v}",
    "process": "process must be a non-negative integer",
    "time": "time must be a finite number (unix seconds)",
    "host": "host must be a string",
    "devices": "devices must list one integer-or-null per replica",
    "processes": "processes must be a list of integers (or their ranges text)",
    "device": "device must be an integer or null",
    "coords": "coords must be an object of axis name -> integer index",
    "replicas": "replicas must be a positive integer",
    "divergent": "divergent, when present, must be true",
    COPIES_SEEN: f"{COPIES_SEEN}, when present, must be an integer from 1 to replicas",
    "global_shape": "global_shape must be a list of non-negative integers (a list per leaf)",
    "batch_dims": "batch_dims must be a non-negative integer",
    "summarized": "summarized, when present, must be true or false",
    "fingerprint": "fingerprint must be 16 hexadecimal digits",
    "leaf": "leaf must be a string (the leaf's path)",
    "leaves": "leaves must be a positive integer",
    "slices": "slices must be a positive integer",
    "compared": "compared must be an integer, at least replicas",
    "slice_coords": "slice_coords must be an object of axis name -> integer index",
    "holders": "holders must list one object per replica",
}


# A field's attribute by its name in a line ("pass" -> "pass_"), by kind,
# and of any kind.
_NAMES = {
    kind: {f.encode_name: f.name for f in msgspec.structs.fields(cls)}
    for kind, cls in CLASSES.items()
}
_ATTR = {k: v for names in _NAMES.values() for k, v in names.items()}
# The fields every record has, in the order a line holds them.
REQUIRED = ("run", "name", "step", "kind", "value", "dtype", "shape", "process", "time", "host")
# Every field a record of each kind must have (REQUIRED first).
REQUIRED_BY_KIND = {
    kind: REQUIRED
    + tuple(n for n, _, _, req, kinds in FIELDS if req and kind in kinds and n not in REQUIRED)
    for kind in CLASSES
}


_LOOSE = {kind: _struct(kind, readers=True) for kind in CLASSES}


def validate_dict(d: Any) -> str | None:
    """Why ``d`` (a line's JSON object) is not a record readers take, or None."""
    if not isinstance(d, dict):
        return "not a JSON object"
    missing = [k for k in REQUIRED if k not in d]
    if missing:
        return "missing field(s): " + ", ".join(missing)
    kind = d["kind"]
    if type(kind) is not str or kind not in CLASSES:
        return f"kind must be {READERS_MUST['kind']}"
    own = REQUIRED_BY_KIND[kind][len(REQUIRED) :]
    if any(f not in d for f in own):
        return f"{kind} record without {'/'.join(own)}"
    try:
        msgspec.convert(d, _LOOSE[kind])
    except msgspec.ValidationError as e:
        return _why(str(e))
    return None


_AT = re.compile(r"`\$\.([^`.\[]+)")


def _why(error: str) -> str:
    """A readers' problem from msgspec's error (it names the field)."""
    m = _AT.search(error)
    name = m.group(1) if m else ""
    if name in READERS_MUST:
        return f"{name} must be {READERS_MUST[name]}"
    return error.split(" - at ")[0] if not m else f"{name}: {error.split(' - at ')[0]}"


def from_dict(d: dict) -> AnyRecord:
    """The record of a line's object readers take, holding the object."""
    kind = d["kind"]
    names = _NAMES[kind]
    fields = {names[k]: v for k, v in d.items() if k in names}
    return _ODD[kind](source=d, **fields)


def _odd(cls: type) -> type:
    class Odd(cls, kw_only=True):  # type: ignore[misc, valid-type]
        # The line's object, for as_dict and for the fields only it has.
        source: dict
        odd: ClassVar[bool] = True

        def __post_init__(self) -> None:
            pass  # taken at the readers' level already

        def get(self, key: str, default: Any = None) -> Any:
            return self.source.get(key, default)

    Odd.__name__ = Odd.__qualname__ = "Odd" + cls.__name__
    return Odd


_ODD = {kind: _odd(cls) for kind, cls in CLASSES.items()}
# By name in this module, as pickle finds a class (summary --jobs sends
# records between processes).
globals().update({cls.__name__: cls for cls in _ODD.values()})


def beyond_types(r: Any, readers: bool = False) -> list[str]:
    """The rules no field type says that a record breaks (with ``readers``:
    the readers' ones, ranges text and a shard's index)."""
    out: list[str] = []
    if readers:
        for name in ("devices", "processes"):
            v = getattr(r, name, UNSET)
            if type(v) is str and holders_count(v) is None:
                out.append(f"{name} must be {READERS_MUST[name]}")
        index = getattr(r, "index", UNSET)
        if index is not UNSET and not valid_index(index):
            out.append(f"index must be {READERS_MUST['index']}")
        return out
    replicas = getattr(r, "replicas", None)
    if r.kind in _HELD and type(replicas) is int:
        devices = r.devices
        if devices is not None and devices is not UNSET:
            n = holders_count(devices) if type(devices) is str else len(devices)
            if n != replicas:
                out.append(FORMAT_PROBLEM["devices"])
        if r.kind == FINGERPRINT:
            compared, holders = r.compared, r.holders
            if type(compared) is int and compared < replicas:
                out.append(FORMAT_PROBLEM["compared"])
            if type(holders) is list and (
                len(holders) != replicas or not all(type(h) is dict for h in holders)
            ):
                out.append(FORMAT_PROBLEM["holders"])
        else:
            seen = r.copies_seen
            if seen is not UNSET and type(seen) is int and seen > replicas:
                out.append(FORMAT_PROBLEM[COPIES_SEEN])
    g = r.global_shape
    if g is not UNSET and not _global_shape_ok(g):
        out.append(FORMAT_PROBLEM["global_shape"])
    problem = value_problem(r.value, r.dtype, r.shape, None if r.bytes is UNSET else r.bytes)
    if problem:
        out.append(problem)
    return out


def format_problems(r: AnyRecord) -> list[str]:
    """Every way a record breaks the format (``pmaptap validate``)."""
    if not r.odd:
        if type(r) is not PerDevice or r.index is not UNSET or r.bytes is not UNSET:
            return beyond_types(r)
        # The usual per-device record: its scalar value, in a few tests.
        dtype, shape, value = r.dtype, r.shape, r.value
        if type(dtype) is str and shape == [] and r.global_shape is UNSET:
            t = type(value)
            if (t is float or t is int) and dtype.startswith(("float", "bfloat")):
                return []
            if not dtype.startswith("complex"):
                problem = _scalar_problem(value, dtype)
                return [problem] if problem else []
        return beyond_types(r)
    out = []
    strict = CLASSES[r.kind]
    for f in msgspec.structs.fields(strict):
        v = getattr(r, f.name)
        if v is UNSET:
            continue
        try:
            msgspec.convert(v, f.type)
        except msgspec.ValidationError:
            text = FORMAT_PROBLEM.get(f.encode_name)
            if text is not None:
                out.append(text.format(v=v))
    return out + beyond_types(r)


def _global_shape_ok(g: Any) -> bool:
    def dims(x: Any) -> bool:
        return isinstance(x, list) and all(type(n) is int and n >= 0 for n in x)

    return dims(g) or isinstance(g, list) and all(map(dims, g))


def _is_pair(p: Any) -> bool:
    return isinstance(p, (list, tuple)) and len(p) == 2 and all(map(_is_int, p))


def valid_index(index: Any, depth: int = 0) -> bool:
    """[[start, stop], ...], or a list of those (one per pytree leaf)."""
    if not isinstance(index, list) or depth > 1:
        return False
    return all(_is_pair(p) or (depth == 0 and valid_index(p, 1)) for p in index)


def index_key(index: Any) -> Any:
    """A hashable form of a record's ``index`` (None when it has none)."""
    return tuple(index_key(i) for i in index) if isinstance(index, (list, tuple)) else index


_MARKERS = tuple(NONFINITE)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _scalar_problem(v: Any, dtype: str) -> str | None:
    if dtype == "bool":
        ok = isinstance(v, bool)
    elif dtype.startswith(("int", "uint")):
        ok = _is_int(v)
    else:
        # Floats (and complex parts): numbers, or the documented markers for
        # non-finite values, which is how strict JSON carries them.
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) or v in _MARKERS
    return None if ok else f"value element {v!r} does not fit dtype {dtype}"


def _leaf_problem(value: Any, dtype: str, shape: Any) -> str | None:
    if not isinstance(shape, list) or not all(_is_int(n) and n >= 0 for n in shape):
        return f"shape must be a list of non-negative integers, got {shape!r}"
    dims = list(shape) + ([2] if dtype.startswith("complex") else [])

    def walk(v: Any, depth: int) -> str | None:
        if depth == len(dims):
            return _scalar_problem(v, dtype)
        if not isinstance(v, list) or len(v) != dims[depth]:
            return f"value does not match shape {shape} (dtype {dtype})"
        for x in v:
            problem = walk(x, depth + 1)
            if problem:
                return problem
        return None

    return walk(value, 0)


def is_ref(x: Any) -> bool:
    """Whether ``x`` is a reference to bytes: {file, offset, nbytes}."""
    return (
        type(x) is dict
        and len(x) == 3
        and type(x.get("file")) is str
        and bool(x["file"])
        and all(type(x.get(k)) is int and x[k] >= 0 for k in ("offset", "nbytes"))
    )


def value_problem(value: Any, dtype: Any, shape: Any, stored: Any = None) -> str | None:
    """Why ``value`` does not fit ``dtype``/``shape`` (``stored``: the
    ``bytes`` field, whose leaves are null), or None."""
    if value is None and dtype is None and shape is None:
        return None  # a None inside a tapped pytree (no leaves)
    if isinstance(dtype, str):
        if value is None and is_ref(stored):
            return None
        return _leaf_problem(value, dtype, shape)
    sub = stored if isinstance(stored, (dict, list)) else None
    if isinstance(dtype, dict):
        keys, subs = list(dtype), sub if isinstance(sub, dict) else {}
        fits = isinstance(value, dict) and isinstance(shape, dict)
        if not (fits and set(value) == set(dtype) == set(shape)):
            return "pytree value, dtype and shape do not have the same keys"
    elif isinstance(dtype, list):
        keys, n = range(len(dtype)), len(dtype)
        subs = dict(enumerate(sub)) if isinstance(sub, list) and len(sub) == n else {}
        fits = isinstance(value, list) and isinstance(shape, list)
        if not (fits and len(value) == n == len(shape)):
            return "pytree value, dtype and shape do not have the same length"
    else:
        return f"dtype must be a string or a pytree of strings, got {dtype!r}"
    for k in keys:
        problem = value_problem(value[k], dtype[k], shape[k], subs.get(k))
        if problem:
            return f"[{k}]: {problem}"
    return None


def holders_field(ids: "tuple | list") -> "list | str":
    """The ``devices``/``processes`` field for ``ids`` as written: the list,
    or its ranges text past RANGES_ABOVE ascending distinct integer ids."""
    if len(ids) <= RANGES_ABOVE or not all(type(i) is int and i >= 0 for i in ids):
        return list(ids)
    if any(b <= a for a, b in zip(ids, ids[1:])):
        return list(ids)  # not ascending: the list says it as it is
    return ranges_text(ids)


def ranges_text(nums: Sequence[int]) -> str:
    """Ascending distinct ints as ranges text (``"0-3,8-11"``)."""
    ends = [i for i in range(1, len(nums)) if nums[i] != nums[i - 1] + 1]
    return ",".join(
        str(nums[a]) if a == b - 1 else f"{nums[a]}-{nums[b - 1]}"
        for a, b in zip([0, *ends], [*ends, len(nums)])
        if b > a
    )


def id_ranges(text: Any) -> "list[tuple[int, int]] | None":
    """The inclusive (first, last) ranges of a holders text, or None."""
    if type(text) is not str or not text:
        return None
    out: list[tuple[int, int]] = []
    prev = -1
    count = 0
    for part in text.split(","):
        if not _PART.fullmatch(part):
            return None
        lo, _, hi = part.partition("-")
        a, b = int(lo), int(hi or lo)
        count += b - a + 1
        if a <= prev or b < a or count > MAX_HOLDERS:
            return None
        out.append((a, b))
        prev = b
    return out


# Cached: a run's records name the same few texts ("0-4095").
@functools.lru_cache(maxsize=4096)
def _holders(text: str) -> "Holders | None":
    ranges = id_ranges(text)
    return None if ranges is None else Holders(text, ranges)


def holders_count(text: str) -> "int | None":
    """How many ids a holders ranges text names (None: a bad one), unexpanded."""
    h = _holders(text)
    return None if h is None else len(h)


class Holders(Sequence):
    """The ids of a ranges text (``"0-4095"``), never expanded unless asked
    (docs/api.md, "Record format"); one object per text met lately."""

    __slots__ = ("text", "_starts", "_ends", "_len")

    def __init__(self, text: str, ranges: "list[tuple[int, int]]") -> None:
        self.text = text
        self._starts = [a for a, _ in ranges]
        self._ends = [b for _, b in ranges]
        self._len = sum(b - a + 1 for a, b in ranges)

    @staticmethod
    def of(text: str) -> "Holders":
        h = _holders(text)
        if h is None:
            raise ValueError(f"not a holders ranges text: {text[:80]!r}")
        return h

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[int]:
        return chain.from_iterable(map(range, self._starts, [b + 1 for b in self._ends]))

    def __contains__(self, x: object) -> bool:
        if not isinstance(x, int) or isinstance(x, bool):
            return False
        k = bisect_right(self._starts, x) - 1
        return k >= 0 and x <= self._ends[k]

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[k] for k in range(self._len)[i]]
        if not -self._len <= i < self._len:
            raise IndexError("Holders index out of range")
        i %= self._len
        for a, b in zip(self._starts, self._ends):
            if i <= b - a:
                return a + i
            i -= b - a + 1

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Holders):
            return self.text == other.text
        if isinstance(other, (list, tuple)):
            return len(other) == self._len and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.text)

    def __repr__(self) -> str:
        return f"Holders({self.text!r})"


def holder_ids(v: Any) -> list:
    """The ids of a holders field in either form."""
    if type(v) is str:
        h = _holders(v)
        return [] if h is None else list(h)
    return v if isinstance(v, list) else list(v) if isinstance(v, Holders) else []


def first_holder(rec: dict) -> str:
    """The lowest device id among a record's ``holders`` and ``devices``, as
    text (``"unknown"``: none); a ranges text is ascending: its first id."""
    ids = [h.get("device") for h in rec.get("holders") or () if isinstance(h, dict)]
    devices = rec.get("devices")
    if type(devices) is str:
        devices = _holders(devices)
    if isinstance(devices, Holders):
        ids += devices[:1]
    elif isinstance(devices, list):
        ids += devices
    ids = [d for d in ids if isinstance(d, int)]
    return str(min(ids)) if ids else "unknown"


def holds(v: Any, x: Any) -> bool:
    """Whether a holders field (either form) names ``x``, not expanded."""
    if type(v) is str:
        h = _holders(v)
        return h is not None and x in h
    return x in (v or ())


def record_key(r: Any) -> tuple:
    """The identity of a value in a tap file (docs/api.md, "Record format"),
    of a format.Record, a Struct or a line's object."""
    if isinstance(r, AnyRecord):
        return r.key()
    if not isinstance(r, dict):  # format.Record (the writer's)
        return (r.run, r.name, r.step, r.pass_, part_key(r.index, r.iteration), r.attempt)
    get = r.get
    return (
        get("run"),
        get("name"),
        get("step"),
        get("pass", "forward"),
        part_key(get("index"), get("iteration")),
        get("attempt", 0),
    )


def shown_name(name: Any, iteration: Any) -> Any:
    """A looped tap's name in summary and show: ``act_rms[3]``, ``x[1,2]``."""
    if iteration is None or iteration is UNSET:
        return name
    return f"{name}[{','.join(map(str, iteration))}]"


def curve_tag(name: Any, iteration: Any) -> str:
    """A looped tap's curve in plots and TensorBoard: ``act_rms/3``, ``x/1/2``."""
    if iteration is None or iteration is UNSET:
        return str(name)
    return "/".join([str(name), *map(str, iteration)])


def part_key(index: Any, iteration: Any) -> Any:
    """``record_key``'s part: the shard (``index``) and loop ``iteration``."""
    part = None if index is None else index_key(index)
    return part if iteration is None else ("iteration", tuple(iteration), part)


def step_key(r: Any) -> tuple:
    """(run, name, step, pass): what a later attempt supersedes."""
    return (r.get("run"), r.get("name"), r.get("step"), r.get("pass", "forward"))


def as_dict(r: AnyRecord) -> dict:
    """A record as its line's JSON object (an odd record's own object)."""
    return r.source if r.odd else msgspec.to_builtins(r)


_PLAIN = frozenset((*CLASSES.values(), type(None)))


def as_dicts(records: list) -> list:
    """as_dict of each record (None stays None), one msgspec call if it can."""
    if set(map(type, records)) <= _PLAIN:
        return msgspec.to_builtins(records)
    return [None if r is None else as_dict(r) for r in records]
