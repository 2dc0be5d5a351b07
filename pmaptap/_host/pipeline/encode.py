"""The last stage of the aggregation path (payload.py -> aggregate.py ->
records.py -> here): NumPy leaves and pytrees -> JSON-able values for
records (the format itself lives in ``pmaptap.tapfile.record.format``).

Leaves above ``INLINE_MAX_BYTES`` are handed to the writer as ``RawArray``s,
stored as their bytes (tapfile/source/arrays.py). Arrays up to ``_SHORT_REPR_MAX``
elements get the shortest repr of their own precision; non-finite floats
become the format's ``NONFINITE`` markers.
"""

from __future__ import annotations

import math
from typing import Any, Iterator

import numpy as np

from pmaptap.tapfile.record import (
    COUNT_BASE,
    NAN,
    NEG_INF,
    ORJSON,
    ORJSON_OPTS,
    POS_INF,
    SUMMARY_FIELDS,
    RawArray,
    encodable,
    is_complex,
    is_float_like,
    is_narrow_int,
)
from pmaptap.tapfile.source import INLINE_MAX_BYTES, npy_header, stored_as_bytes

# Arrays up to this size get the shortest repr of their own precision
# (0.1 in float32 is written 0.1, not 0.10000000149011612).
_SHORT_REPR_MAX = 4096


# The complex dtypes whose .real/.imag NumPy gives as their parts.
_NUMPY_COMPLEX = frozenset(map(np.dtype, (np.complex64, np.complex128, np.clongdouble)))


def _nonfinite_list(out: np.ndarray) -> Any:
    out = np.asarray(out)  # a NumPy scalar (a row of a stacked 1-D leaf)
    if out.dtype == np.float32 and out.size <= _SHORT_REPR_MAX:
        # shortest float32 repr for the finite elements (0.1, not 0.1000000015)
        obj = np.array([float(str(v)) for v in out.reshape(-1)], dtype=object).reshape(out.shape)
    else:
        obj = out.astype(np.float64).astype(object)
    obj[np.isnan(out)] = NAN
    obj[out == math.inf] = POS_INF
    obj[out == -math.inf] = NEG_INF
    return obj.tolist()


def _float_value(a: np.ndarray) -> Any:
    """float-like array -> JSON-able value (finite: a float32/64 array that
    orjson writes with the shortest repr of its own precision)."""
    if a.dtype not in (np.float32, np.float64):
        a = a.astype(np.float32)  # bf16 / fp8 / f16 widen exactly
    if not np.isfinite(a).all():
        return _nonfinite_list(a)
    if ORJSON is None:
        if a.size <= _SHORT_REPR_MAX and a.dtype == np.float32:
            # str() of a float32 is its shortest round-trip repr.
            return (
                np.array([float(str(v)) for v in a.reshape(-1)], dtype=np.float64)
                .reshape(a.shape)
                .tolist()
            )
        return a.tolist()
    return a[()] if a.ndim == 0 else np.ascontiguousarray(a)


def encode_array(a: np.ndarray) -> tuple[Any, str, list[int]]:
    dt = a.dtype
    if a.ndim == 0 and dt in _FAST_SCALARS:
        # Scalars are most taps (losses, norms, steps): skip the array path.
        v = a.item()
        if dt.kind != "f" or math.isfinite(v):
            if dt == np.float32:
                v = float(str(a[()]))  # shortest float32 repr
            return v, _dtype_name(dt), []
    if stored_as_bytes(a.nbytes, dt) and encodable(dt):
        # Stored as its bytes by the writer (tapfile/source/arrays.py): exact, and
        # no per-element work here.
        # (ascontiguousarray would make a 0-d leaf 1-d.)
        a = a if a.flags.c_contiguous else np.ascontiguousarray(a)
        return RawArray(a), _dtype_name(dt), list(a.shape)
    if dt.kind == "b" or dt.kind in "iu":
        if ORJSON is None or a.ndim == 0:
            value = a.tolist()
        else:
            value = np.ascontiguousarray(a)
    elif is_narrow_int(dt):
        value = a.astype(np.int64).tolist()
    elif is_complex(dt):
        if dt not in _NUMPY_COMPLEX:
            # ml_dtypes' complex32: NumPy's .real/.imag of it are the whole
            # value and zeros (the imaginary part was lost, with a
            # ComplexWarning); complex64 holds it exactly.
            a = a.astype(np.complex64)
        value = _float_value(np.stack([a.real, a.imag], axis=-1))
    elif is_float_like(dt) and dt.fields is None:
        value = _float_value(a)
    else:
        raise TypeError(f"cannot encode dtype {dt} as JSON")
    return value, _dtype_name(dt), list(a.shape)


_DTYPE_NAMES: dict = {}
_FAST_SCALARS = frozenset(
    np.dtype(t)
    for t in (np.float32, np.float64, np.int32, np.int64, np.uint32, np.uint64, np.bool_)
)


def _dtype_name(dt: np.dtype) -> str:
    # np.dtype.name is a slow property (computed in Python on every read); records
    # ask for it per copy.
    name = _DTYPE_NAMES.get(dt)
    if name is None:
        name = _DTYPE_NAMES[dt] = dt.name
    return name


def encode_statistics(
    stats: np.ndarray, dtype: str, shape: tuple[int, ...]
) -> tuple[dict, str, list[int]]:
    """float32[..., 8] statistics -> ({"min": ..., "nan": ...}, the original
    dtype, the original shape after any leading vmap axes of ``stats``)."""
    stats = np.asarray(stats, np.float32)
    value: dict[str, Any] = {}
    for i, field in enumerate(SUMMARY_FIELDS[:4]):
        value[field] = _float_value(stats[..., i].copy())  # 0-d stays 0-d
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
    if isinstance(aux, (list, tuple)) and len(aux) == len(vals) and issubclass(typ, dict):
        return {str(k): v for k, v in zip(aux, vals)}
    if hasattr(typ, "_fields"):
        return dict(zip(typ._fields, vals))
    if typ in (list, tuple):
        return vals
    names = _child_names(treedef)
    if names is not None and len(names) == len(vals):
        return dict(zip(names, vals))
    # A list-like custom node (indexed, or keys without names): its
    # children in flatten order.
    return vals


_CHILD_NAMES: dict = {}


def _child_names(treedef) -> tuple[str, ...] | None:
    """The names of a custom pytree node's children from their key paths
    (``jax.tree_util.tree_flatten_with_path``), so the node is written as an
    object like a dict: ``GetAttrKey`` names (``register_dataclass``, Flax
    ``nnx.Variable``'s ``value``, flax-style TrainStates) and ``DictKey``
    keys as text (Flax ``nnx.State``, any ``register_pytree_with_keys``
    node keyed by name). None, and the node stays an array, when any child
    has another key (``SequenceKey``, ``FlattenedIndexKey``, a key type of
    the user's) or two children would get the same name. Cached per node
    treedef."""
    try:
        return _CHILD_NAMES[treedef]
    except KeyError:
        pass
    except TypeError:  # an unhashable node's aux data
        return None
    import jax

    tu = jax.tree_util
    names = None
    try:
        # Rebuild the node around placeholder leaves and read its children's
        # keys; a node that refuses placeholders keeps the list form.
        node = tu.tree_unflatten(treedef, range(treedef.num_leaves))
        children, _ = tu.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
        found = []
        for path, _ in children:
            key = path[0] if path else None
            if isinstance(key, tu.GetAttrKey):
                found.append(key.name)
            elif isinstance(key, tu.DictKey):
                found.append(str(key.key))
            else:
                found = None
                break
        if found and len(set(found)) == len(found) and len(found) == len(treedef.children()):
            names = tuple(found)
    except Exception:  # noqa: BLE001 - user code in the node's unflatten
        names = None
    _CHILD_NAMES[treedef] = names
    return names


def encode_rows(
    treedef,
    stacked: list[np.ndarray],
    rows: list[int],
    as_statistics: tuple = (),
    texts: list[bytes] | None = None,
) -> list[tuple[Any, Any, Any]]:
    """``encode_tree`` of row k of every stacked leaf (copies, *shape), for
    each k in ``rows``: the gathered payloads' per-copy values.

    A single finite float32/float64/int/bool leaf is encoded for all rows at
    once (one orjson round trip gives every scalar its shortest repr; array
    rows stay NumPy views for orjson to write), far less Python per copy
    than row by row. Everything else goes row by row.

    On that one-round-trip path, ``texts`` (when given) also receives each
    row's value as the JSON text orjson wrote for it (numbers and booleans
    hold no comma), for records whose lines are built from a template
    (``Record.put_lines`` in tapfile/record/format.py); elsewhere it stays empty."""
    if (
        ORJSON is not None
        and not as_statistics
        and len(stacked) == 1
        and treedef.num_nodes == 1
        and treedef.num_leaves == 1
    ):
        a = np.ascontiguousarray(stacked[0])  # orjson takes C order only
        dt = a.dtype
        if dt in _FAST_SCALARS and a.ndim > 1 and a[0].nbytes > INLINE_MAX_BYTES:
            # Rows stored as bytes (no finiteness check, no JSON).
            name, shape = _dtype_name(dt), list(a.shape[1:])
            header = npy_header(dt, a.shape[1:])  # one for every row
            return [(RawArray(a[k], header), name, shape) for k in rows]
        if dt in _FAST_SCALARS and (dt.kind != "f" or np.isfinite(a).all()):
            name, shape = _dtype_name(dt), list(a.shape[1:])
            if a.ndim == 1:
                raw = ORJSON.dumps(a, option=ORJSON_OPTS)
                vals = ORJSON.loads(raw)
                if texts is not None:
                    parts = raw[1:-1].split(b",")
                    texts.extend(parts[k] for k in rows)
                return [(vals[k], name, shape) for k in rows]
            return [(a[k], name, shape) for k in rows]
    return [encode_tree(treedef, [x[k] for x in stacked], as_statistics) for k in rows]


def encode_tree(
    treedef, leaves: list[np.ndarray], as_statistics: tuple = ()
) -> tuple[Any, Any, Any]:
    """(value, dtype, shape) of a pytree; ``as_statistics`` (TapSite.as_statistics)
    marks the leaves that arrive as statistics."""
    encoded = [
        encode_statistics(a, *as_statistics[i])
        if as_statistics and as_statistics[i]
        else encode_array(a)
        for i, a in enumerate(leaves)
    ]
    if treedef.num_nodes == 1 and treedef.num_leaves == 1:  # a single array
        return encoded[0]
    return tuple(_structure(treedef, iter([e[i] for e in encoded])) for i in range(3))
