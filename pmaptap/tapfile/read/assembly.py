"""``pmaptap.assemble``: a tapped sharded value's global array. The first
pass over the run reads lines only (no stored bytes) and picks this tap's
records at one step; then one shard at a time is loaded into the array."""

from __future__ import annotations

import itertools
import os
from typing import Any

from pmaptap.errors import AssembleError, MissingBytes
from pmaptap.tapfile.read.attempts import Attempts
from pmaptap.tapfile.record import decode_record, index_text, is_ref
from pmaptap.tapfile.source import ByteStore, Run, iter_lines, numpy_dtype

__all__ = ["assemble"]

_SHOWN = 8  # missing shards named in an error


def assemble(
    path: str | os.PathLike,
    name: str,
    step: int,
    *,
    run: str | None = None,
    backward: bool = False,
    leaf: str | tuple | None = None,
) -> Any:
    """The global array of tap ``name`` at ``step`` from its per-shard
    records, bit for bit: docs/api.md, "pmaptap.assemble"."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"pmaptap.assemble: name must be a non-empty str, got {name!r}")
    if not isinstance(step, int) or isinstance(step, bool):
        raise TypeError(f"pmaptap.assemble: step must be an int, got {step!r}")
    path = Run.of(path)
    pass_ = "backward" if backward else "forward"
    what = f"tap {name!r} step {step}" + (" (backward)" if backward else "")
    recs: list[dict] = []
    later = Attempts()
    runs: set = set()
    for _lineno, d, _problem in iter_lines(path):
        if (
            d is None
            or d["name"] != name
            or d["step"] != step
            or d.get("pass", "forward") != pass_
            or d["kind"] == "meta"
        ):
            continue
        runs.add(d["run"])
        if run is not None and d["run"] != run:
            continue
        later.add(d)
        recs.append(d)
    where = f"{what} in {os.fspath(path)!r}"
    if not recs:
        extra = f" of run {run!r} (runs with it: {sorted(runs)})" if run and runs else ""
        raise AssembleError(f"pmaptap.assemble: no records of {where}{extra}")
    if run is None and len(runs) > 1:
        raise AssembleError(
            f"pmaptap.assemble: {where} exists in several runs {sorted(runs)}; pass run=..."
        )
    if later:
        recs = [r for r in recs if not later.superseded(r)]
    if any(r.get("summarized") for r in recs):
        raise AssembleError(
            f"pmaptap.assemble: {where} was written as statistics (a leaf above "
            "max_value_bytes, 'summarized'): there is no array to assemble. Tap it "
            "with pmaptap.configure(max_value_bytes=None) or a larger limit."
        )
    store = ByteStore(path)
    dtype = recs[0]["dtype"]
    paths = _leaf_paths(dtype)
    chosen = paths if leaf is None else [_leaf_key(leaf)]
    if leaf is not None and chosen[0] not in paths:
        raise AssembleError(
            f"pmaptap.assemble: {what} has no leaf {leaf!r}; its leaves: "
            f"{['/'.join(map(str, p)) for p in paths]}"
        )
    sharded = [r for r in recs if "index" in r or "global_shape" in r]
    if not sharded:
        out = _unsharded(recs, where, store)
        return out if leaf is None else _get(out, chosen[0])
    # A None hole of the pytree is no leaf to JAX: positions in ``index``
    # and ``global_shape`` count array leaves only.
    at = _array_paths(dtype)
    arrays = {p: _assemble_leaf(sharded, at, p, where, store) for p in chosen if p in at}
    return arrays.get(chosen[0]) if leaf is not None or paths == [()] else _nest(dtype, arrays)


def _leaf_paths(dtype: Any, prefix: tuple = ()) -> list[tuple]:
    """Leaf paths in flatten order, ``None`` holes (dtype null) included."""
    if isinstance(dtype, dict):
        return [p for k, d in dtype.items() for p in _leaf_paths(d, (*prefix, k))]
    if isinstance(dtype, list):
        return [p for i, d in enumerate(dtype) for p in _leaf_paths(d, (*prefix, i))]
    return [prefix]


def _array_paths(dtype: Any) -> list[tuple]:
    """The array leaves' paths (``index``'s and ``global_shape``'s order)."""
    return [p for p in _leaf_paths(dtype) if _get(dtype, p) is not None]


def _leaf_key(leaf: Any) -> tuple:
    parts = leaf.strip("/").split("/") if isinstance(leaf, str) else list(leaf)
    return tuple(int(p) if isinstance(p, str) and p.isdigit() else p for p in parts if p != "")


def _get(tree: Any, path: tuple) -> Any:
    for p in path:
        tree = tree[p]
    return tree


def _nest(dtype: Any, arrays: dict, prefix: tuple = ()) -> Any:
    """The value's nesting with ``arrays`` at its leaves (None at its holes)."""
    if isinstance(dtype, dict):
        return {k: _nest(d, arrays, (*prefix, k)) for k, d in dtype.items()}
    if isinstance(dtype, list):
        return [_nest(d, arrays, (*prefix, i)) for i, d in enumerate(dtype)]
    return None if dtype is None else arrays[prefix]


def _devices(recs: "dict | list[dict]") -> str:
    """The devices of records, for an error: ``device 3``, ``devices 0, 1``."""
    out: list[str] = []
    for r in [recs] if isinstance(recs, dict) else recs:
        held = r.get("devices") if r.get("device") is None else [r.get("device")]
        if isinstance(held, list):
            out += [str(x) for x in held]
        elif held is not None:
            out.append(str(held))
    if not out:
        return "devices unknown"
    more = f" and {len(out) - _SHOWN} more" if len(out) > _SHOWN else ""
    return f"device{'s' if len(out) > 1 else ''} {', '.join(out[:_SHOWN])}{more}"


def _leaf_value(d: dict, path: tuple, store: ByteStore, label: str = "") -> Any:
    """One leaf of a record as an ndarray of its own dtype (loaded if
    stored), or AssembleError (``label``) or MissingBytes."""
    import numpy as np

    dtype, shape, field = d["dtype"], d["shape"], d.get("bytes")
    for p in path:
        dtype, shape = dtype[p], shape[p]
        field = field[p] if isinstance(field, (dict, list)) and not is_ref(field) else None
    if is_ref(field):
        return store.load_leaf(field, dtype, shape)
    value = _get(decode_record(d)["value"], path)
    try:
        return np.asarray(value, dtype=numpy_dtype(dtype)).reshape(shape)
    except (TypeError, ValueError) as e:
        raise AssembleError(
            f"pmaptap.assemble: {label}: the record of {_devices(d)} holds a value that "
            f"is not a {dtype}{list(shape) if isinstance(shape, list) else shape} ({e})"
        ) from None


def _unsharded(recs: list[dict], where: str, store: ByteStore) -> Any:
    """A value that was not sharded: one replicated value (in agreement)."""
    kinds = {r["kind"] for r in recs}
    if "per_device" in kinds:
        devices = sorted({str(r.get("device")) for r in recs if r["kind"] == "per_device"})
        raise AssembleError(
            f"pmaptap.assemble: {where} is per_device (one value per device, on devices "
            f"{', '.join(devices)}), not the shards of one array: read them with "
            "pmaptap.read(path, name=..., step=...)"
        )
    hashes = {r.get("vhash") for r in recs}
    if len(hashes) > 1 or any(r.get("divergent") for r in recs):
        raise AssembleError(
            f"pmaptap.assemble: {where} is divergent (its copies disagree: "
            f"{len(hashes)} values, from {_devices(recs)}); read them with pmaptap.read"
        )
    d = recs[0]
    paths = _array_paths(d["dtype"])
    leaves = {p: _leaf_value(d, p, store, where) for p in paths}
    return leaves[()] if paths == [()] else _nest(d["dtype"], leaves)


def _slice_text(box: tuple) -> str:
    return f"[{index_text([list(b) for b in box])}]"


def _same_bits(a: Any, b: Any) -> bool:
    """Bit for bit (a NaN equals itself, -0.0 is not 0.0)."""
    return a.shape == b.shape and a.tobytes() == b.tobytes()


def _overlaps(boxes: list[tuple]) -> dict[tuple, list[tuple]]:
    """For each box, the boxes before it that share cells with it: a sweep
    along the first dimension (a slice meets only its neighbours there)."""
    out: dict[tuple, list[tuple]] = {b: [] for b in boxes}
    if not boxes or not boxes[0]:
        return out  # a 0-d value: one cell
    order = sorted(range(len(boxes)), key=lambda i: boxes[i][0][0])
    active: list[int] = []
    for i in order:
        b = boxes[i]
        active = [j for j in active if boxes[j][0][1] > b[0][0]]
        for j in active:
            c = boxes[j]
            if all(max(x0, y0) < min(x1, y1) for (x0, x1), (y0, y1) in zip(b, c)):
                later, earlier = (b, c) if j < i else (c, b)
                out[later].append(earlier)
        active.append(i)
    return out


def _assemble_leaf(recs: list[dict], paths: list, path: tuple, where: str, store: ByteStore):
    """One leaf's global array; copies and overlaps must hold the same bits
    (the leaf's own, not the record's hash), each value fill its slice."""
    import numpy as np

    # A pytree's index and global_shape: one per array leaf, in ``paths``' order.
    k = paths.index(path)
    label = where + ("" if path == () else f" leaf {'/'.join(map(str, path))!r}")
    gshapes: dict[Any, list[dict]] = {}
    for r in recs:
        g = r.get("global_shape")
        g = tuple(g if len(paths) == 1 else g[k]) if isinstance(g, list) else None
        gshapes.setdefault(g, []).append(r)
    if len(gshapes) != 1 or None in gshapes:
        seen = "; ".join(f"{list(g) if g else g} ({_devices(rs)})" for g, rs in gshapes.items())
        raise AssembleError(
            f"pmaptap.assemble: {label}: its records do not agree on the global shape: {seen}"
        )
    gshape = next(iter(gshapes))
    unknown = [r for r in recs if r.get("index") is None]
    if unknown:
        raise AssembleError(
            f"pmaptap.assemble: {label}: the global slice of {len(unknown)} shard(s) "
            f"({_devices(unknown)}) is unknown (no index: the executable's sharding was "
            "never reported, e.g. loaded from a compilation cache)"
        )
    dtypes: dict[Any, list[dict]] = {}
    for r in recs:
        dtypes.setdefault(_get(r["dtype"], path), []).append(r)
    if len(dtypes) != 1:
        seen = "; ".join(f"{t} ({_devices(rs)})" for t, rs in dtypes.items())
        raise AssembleError(f"pmaptap.assemble: {label}: shards of different dtypes: {seen}")
    out = np.empty(gshape, dtype=numpy_dtype(next(iter(dtypes))))
    copies: dict[tuple, list[dict]] = {}  # box -> its records, in file order
    for r in recs:
        box = tuple(tuple(p) for p in (r["index"] if len(paths) == 1 else r["index"][k]))
        if len(box) != len(gshape) or any(not 0 <= a <= b <= n for (a, b), n in zip(box, gshape)):
            raise AssembleError(
                f"pmaptap.assemble: {label}: the record of {_devices(r)} has index "
                f"{_slice_text(box)}, which does not lie in the global shape {list(gshape)}"
            )
        copies.setdefault(box, []).append(r)
    boxes = list(copies)
    meets = _overlaps(boxes)
    for box in boxes:
        first, *others = copies[box]
        value = _filling(first, box, path, store, label)
        for r in others:
            if first.get("vhash") is not None and r.get("vhash") == first.get("vhash"):
                continue  # the whole record's bits are the same: so are the leaf's
            if not _same_bits(_filling(r, box, path, store, label), value):
                raise AssembleError(
                    f"pmaptap.assemble: {label}: the copies of slice {_slice_text(box)} "
                    f"disagree: {_devices(first)} and {_devices(r)} hold different values "
                    "(divergent); read them with pmaptap.read"
                )
        for other in meets[box]:
            cut = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(box, other))
            mine = value[tuple(slice(a - s, b - s) for (a, b), (s, _) in zip(cut, box))]
            theirs = out[tuple(slice(a, b) for a, b in cut)]
            if not _same_bits(np.ascontiguousarray(mine), np.ascontiguousarray(theirs)):
                raise AssembleError(
                    f"pmaptap.assemble: {label}: slices {_slice_text(other)} "
                    f"({_devices(copies[other][0])}) and {_slice_text(box)} "
                    f"({_devices(first)}) overlap at {_slice_text(cut)} and disagree there"
                )
        out[tuple(slice(a, b) for a, b in box)] = value
    missing = _missing(boxes, gshape)
    if missing:
        shown = "; ".join(_slice_text(m) for m in missing[:_SHOWN])
        more = f" and {len(missing) - _SHOWN} more" if len(missing) > _SHOWN else ""
        raise AssembleError(
            f"pmaptap.assemble: {label}: no record holds the slice(s) {shown}{more} of the "
            f"global shape {list(gshape)} (found {len(boxes)} slice(s), from "
            f"{_devices([c[0] for c in copies.values()])}: a process's records missing, "
            "or filtered by dedup/every)"
        )
    return out


def _filling(r: dict, box: tuple, path: tuple, store: ByteStore, label: str) -> Any:
    """A record's value of the leaf, checked to fill its slice ``box``."""
    try:
        value = _leaf_value(r, path, store, label)
    except MissingBytes as e:
        raise MissingBytes(f"pmaptap.assemble: {label}: the record of {_devices(r)}: {e}") from None
    want = tuple(b - a for a, b in box)
    if value.shape != want:
        raise AssembleError(
            f"pmaptap.assemble: {label}: the record of {_devices(r)} holds a value of shape "
            f"{list(value.shape)} for its slice {_slice_text(box)}, of shape {list(want)}"
        )
    return value


def _missing(boxes: list[tuple], shape: tuple) -> list[tuple]:
    """Cells of the grid cut by every box's edges that no box covers."""
    cuts = []
    for dim, n in enumerate(shape):
        edges = sorted({0, n} | {b[dim][0] for b in boxes} | {b[dim][1] for b in boxes})
        cuts.append([(a, b) for a, b in zip(edges, edges[1:]) if a < b])
    out = []
    for cell in itertools.product(*cuts):
        if not any(all(a <= c0 and c1 <= b for (c0, c1), (a, b) in zip(cell, bx)) for bx in boxes):
            out.append(cell)
    return out
