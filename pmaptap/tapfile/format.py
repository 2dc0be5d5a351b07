"""The record type and its strict-JSON line encoding (RFC 8259).

Non-finite floats have no JSON number form, so inside ``value`` they are
written as the strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"``; values
are always numeric, so a string there is unambiguous, and ``decode`` turns
them back into floats. Complex numbers are ``[re, im]`` pairs (the ``dtype``
says complex). bfloat16 / float8 / float16 are widened to float for JSON but
keep their own ``dtype`` name. A pytree value is nested JSON objects (dicts,
namedtuples) and arrays (lists, tuples); ``dtype`` and ``shape`` then have the
same nesting.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Iterator

import numpy as np

KINDS = ("replicated", "per_device", "meta")
REQUIRED = ("run", "name", "step", "kind", "value", "dtype", "shape",
            "process", "time", "host")
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
# Arrays up to this size get the shortest repr of their own precision
# (0.1 in float32 is written 0.1, not 0.10000000149011612).
_SHORT_REPR_MAX = 4096


@dataclasses.dataclass(frozen=True)
class Record:
    run: str
    name: str
    step: int
    kind: str
    value: Any                    # already JSON-able (see encode_tree)
    dtype: Any
    shape: Any
    process: int
    time: float
    host: str
    device: int | None = None     # per_device only
    coords: dict | None = None    # per_device only
    replicas: int | None = None   # replicated only
    devices: tuple | None = None  # replicated: devices holding this value
    processes: tuple | None = None
    divergent: bool = False
    batch_dims: int = 0
    pass_: str = "forward"
    extra: dict | None = None     # meta records: counters etc.
    vhash: str | None = None      # replicated: hash of the value's bits
    summarized: bool = False      # a leaf's value is statistics (SUMMARY_FIELDS)

    def to_json_dict(self) -> dict:
        d: dict[str, Any] = {
            "run": self.run, "name": self.name, "step": int(self.step),
            "kind": self.kind, "value": self.value, "dtype": self.dtype,
            "shape": self.shape, "process": self.process,
            "time": round(self.time, 6), "host": self.host,
        }
        if self.kind == "per_device":
            d["device"] = self.device
            d["coords"] = self.coords if self.coords is not None else {}
        elif self.kind == "replicated":
            d["replicas"] = self.replicas
            if self.devices is not None:
                d["devices"] = list(self.devices)
            if self.processes is not None:
                d["processes"] = list(self.processes)
            if self.vhash:
                d["vhash"] = self.vhash
        if self.divergent:
            d["divergent"] = True
        if self.batch_dims:
            d["batch_dims"] = self.batch_dims
        if self.pass_ != "forward":
            d["pass"] = self.pass_
        if self.summarized:
            d["summarized"] = True
        if self.extra:
            d.update(self.extra)
        return d

    def encode(self) -> bytes:
        return encode_line(self.to_json_dict())


_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Record)}
_REQUIRED_FIELDS = frozenset(k for k, v in _FIELD_DEFAULTS.items()
                             if v is dataclasses.MISSING)


def new_record(**fields: Any) -> Record:
    """``Record(**fields)`` for the aggregator's per-copy hot path: fills the
    instance dict directly instead of running the frozen dataclass __init__
    (one object.__setattr__ per field: 3.4 us vs 1.2 us a record). The same
    fields are required and no others are taken."""
    keys = fields.keys()
    if not (_REQUIRED_FIELDS <= keys <= _FIELD_DEFAULTS.keys()):
        raise TypeError(f"Record fields missing {sorted(_REQUIRED_FIELDS - keys)} "
                        f"or unknown {sorted(keys - _FIELD_DEFAULTS.keys())}")
    r = object.__new__(Record)
    d = r.__dict__
    d.update(_FIELD_DEFAULTS)
    d.update(fields)
    return r


try:  # orjson encodes NumPy arrays ~25x faster than json (measured: 20 us vs
    # 520 us for 1024 float32); json stays as the fallback.
    import orjson as _orjson
    _ORJSON_OPTS = _orjson.OPT_SERIALIZE_NUMPY
except ImportError:  # pragma: no cover - exercised via PMAPTAP_NO_ORJSON
    _orjson = None
import os as _os
if _os.environ.get("PMAPTAP_NO_ORJSON"):
    _orjson = None


def _json_default(o: Any) -> Any:
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, np.generic):
        return o.item()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def encode_line(d: dict) -> bytes:
    """One strict-JSON line. Values may hold finite NumPy arrays."""
    if _orjson is not None:
        return _orjson.dumps(d, option=_ORJSON_OPTS | _orjson.OPT_APPEND_NEWLINE)
    # allow_nan=False: a stray non-finite float is a bug, never a bad line.
    return (json.dumps(d, separators=(",", ":"), allow_nan=False,
                       ensure_ascii=False, default=_json_default) + "\n").encode("utf-8")


# ---------------------------------------------------------------- arrays

def _is_float_like(dt: np.dtype) -> bool:
    return dt.kind == "f" or (dt.kind == "V" and "float" in dt.name)


def _nonfinite_list(out: np.ndarray) -> Any:
    out = np.asarray(out)      # a NumPy scalar (a row of a stacked 1-D leaf)
    if out.dtype == np.float32 and out.size <= _SHORT_REPR_MAX:
        # shortest float32 repr for the finite elements (0.1, not 0.1000000015)
        obj = np.array([float(str(v)) for v in out.reshape(-1)],
                       dtype=object).reshape(out.shape)
    else:
        obj = out.astype(np.float64).astype(object)
    obj[np.isnan(out)] = "NaN"
    obj[out == math.inf] = "Infinity"
    obj[out == -math.inf] = "-Infinity"
    return obj.tolist()


def _float_value(a: np.ndarray) -> Any:
    """float-like array -> JSON-able value (finite: a float32/64 array that
    orjson writes with the shortest repr of its own precision)."""
    if a.dtype not in (np.float32, np.float64):
        a = a.astype(np.float32)      # bf16 / fp8 / f16 widen exactly
    if not np.isfinite(a).all():
        return _nonfinite_list(a)
    if _orjson is None:
        if a.size <= _SHORT_REPR_MAX and a.dtype == np.float32:
            # str() of a float32 is its shortest round-trip repr.
            return np.array([float(str(v)) for v in a.reshape(-1)],
                            dtype=np.float64).reshape(a.shape).tolist()
        return a.tolist()
    return a[()] if a.ndim == 0 else np.ascontiguousarray(a)


def encode_array(a: np.ndarray) -> tuple[Any, str, list[int]]:
    dt = a.dtype
    if a.ndim == 0 and dt in _FAST_SCALARS:
        # Scalars are most taps (losses, norms, steps): skip the array path.
        v = a.item()
        if dt.kind != "f" or math.isfinite(v):
            if dt == np.float32:
                v = float(str(a[()]))      # shortest float32 repr
            return v, _dtype_name(dt), []
    if dt.kind == "b" or dt.kind in "iu":
        if _orjson is None or a.ndim == 0:
            value = a.tolist()
        else:
            value = np.ascontiguousarray(a)
    elif dt.kind == "c":
        value = _float_value(np.stack([a.real, a.imag], axis=-1))
    elif _is_float_like(dt):
        value = _float_value(a)
    else:
        raise TypeError(f"cannot encode dtype {dt} as JSON")
    return value, _dtype_name(dt), list(a.shape)


_DTYPE_NAMES: dict = {}
_FAST_SCALARS = frozenset(np.dtype(t) for t in (np.float32, np.float64, np.int32,
                                               np.int64, np.uint32, np.uint64, np.bool_))


def _dtype_name(dt: np.dtype) -> str:
    # np.dtype.name is a slow property (~5 us); records ask for it per copy.
    name = _DTYPE_NAMES.get(dt)
    if name is None:
        name = _DTYPE_NAMES[dt] = dt.name
    return name


# A leaf above options().max_value_bytes travels as float32[8] statistics
# computed on device (tap.summarize): min, max, mean, std over the finite
# elements (of |z| for complex), then the NaN and inf counts, each as two
# float32 (count // COUNT_BASE, count % COUNT_BASE) so that counts up to 2**31
# stay exact, which one float32 (24-bit mantissa) would not.
SUMMARY_FIELDS = ("min", "max", "mean", "std", "nan", "inf")
COUNT_BASE = 4096


def encode_summary(stats: np.ndarray, dtype: str,
                   shape: tuple[int, ...]) -> tuple[dict, str, list[int]]:
    """float32[..., 8] statistics -> ({"min": ..., "nan": ...}, the original
    dtype, the original shape after any leading vmap axes of ``stats``)."""
    stats = np.asarray(stats, np.float32)
    value: dict[str, Any] = {}
    for i, field in enumerate(SUMMARY_FIELDS[:4]):
        value[field] = _float_value(stats[..., i].copy())   # 0-d stays 0-d
    for j, field in enumerate(SUMMARY_FIELDS[4:]):
        hi = stats[..., 4 + 2 * j].astype(np.int64)
        lo = stats[..., 5 + 2 * j].astype(np.int64)
        value[field] = encode_array(hi * COUNT_BASE + lo)[0]
    return value, dtype, list(stats.shape[:-1]) + list(shape)


def _structure(treedef, it: Iterator[Any]) -> Any:
    """Rebuild a pytree's nesting as JSON containers."""
    import jax
    if jax.tree_util.treedef_is_leaf(treedef):
        return next(it) if treedef.num_leaves == 1 else None
    typ, aux = treedef.node_data()
    vals = [_structure(c, it) for c in treedef.children()]
    if isinstance(aux, (list, tuple)) and len(aux) == len(vals) and \
            issubclass(typ, dict):
        return {str(k): v for k, v in zip(aux, vals)}
    if hasattr(typ, "_fields"):
        return dict(zip(typ._fields, vals))
    if typ in (list, tuple):
        return vals
    # Custom pytree node: keep children in flatten order.
    return vals


def encode_rows(treedef, stacked: list[np.ndarray], rows: list[int],
                summaries: tuple = ()) -> list[tuple[Any, Any, Any]]:
    """``encode_tree`` of row k of every stacked leaf (copies, *shape), for
    each k in ``rows``: the gathered payloads' per-copy values.

    A single finite float32/float64/int/bool leaf is encoded for all rows at
    once (one orjson round trip gives every scalar its shortest repr; array
    rows stay NumPy views for orjson to write), ~10x less Python per copy
    than row by row. Everything else goes row by row."""
    if _orjson is not None and not summaries and len(stacked) == 1 and \
            treedef.num_nodes == 1 and treedef.num_leaves == 1:
        a = np.ascontiguousarray(stacked[0])    # orjson takes C order only
        dt = a.dtype
        if dt in _FAST_SCALARS and (dt.kind != "f" or np.isfinite(a).all()):
            name, shape = _dtype_name(dt), list(a.shape[1:])
            if a.ndim == 1:
                vals = _orjson.loads(_orjson.dumps(a, option=_ORJSON_OPTS))
                return [(vals[k], name, shape) for k in rows]
            return [(a[k], name, shape) for k in rows]
    return [encode_tree(treedef, [x[k] for x in stacked], summaries) for k in rows]


def encode_tree(treedef, leaves: list[np.ndarray],
                summaries: tuple = ()) -> tuple[Any, Any, Any]:
    """(value, dtype, shape) of a pytree; ``summaries`` (TapSpec.summaries)
    marks the leaves that arrive as statistics."""
    encoded = [encode_summary(a, *summaries[i]) if summaries and summaries[i]
               else encode_array(a) for i, a in enumerate(leaves)]
    if treedef.num_nodes == 1 and treedef.num_leaves == 1:   # a single array
        return encoded[0]
    return tuple(_structure(treedef, iter([e[i] for e in encoded]))
                 for i in range(3))


# ---------------------------------------------------------------- decoding

def _decode_nonfinite(v: Any) -> Any:
    if isinstance(v, list):
        return [_decode_nonfinite(x) for x in v]
    if isinstance(v, str) and v in _NONFINITE:
        return _NONFINITE[v]
    return v


def _decode_complex(v: Any, depth: int) -> Any:
    if depth == 0:
        return complex(v[0], v[1])
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
        return {k: _decode_value(value[k], dtype[k], (shape or {}).get(k))
                for k in value}
    if isinstance(dtype, list) and isinstance(value, list):
        shapes = shape if isinstance(shape, list) else [None] * len(value)
        return [_decode_value(v, d, s) for v, d, s in zip(value, dtype, shapes)]
    return _decode_nonfinite(value)


def validate_dict(d: Any) -> str | None:
    """Why ``d`` is not a record, or None if it is one."""
    if not isinstance(d, dict):
        return "not a JSON object"
    missing = [k for k in REQUIRED if k not in d]
    if missing:
        return "missing field(s): " + ", ".join(missing)
    if not isinstance(d["name"], str) or not d["name"]:
        return "name must be a non-empty string"
    if not isinstance(d["step"], int) or isinstance(d["step"], bool):
        return "step must be an integer"
    if d["kind"] not in KINDS:
        return f"kind must be one of {KINDS}"
    if not isinstance(d["run"], str):
        return "run must be a string"
    if d["kind"] == "per_device" and ("device" not in d or "coords" not in d):
        return "per_device record without device/coords"
    if d["kind"] == "replicated" and "replicas" not in d:
        return "replicated record without replicas"
    return None


def decode_record(d: dict) -> dict:
    d = dict(d)
    d["value"] = _decode_value(d["value"], d.get("dtype"), d.get("shape"))
    return d
