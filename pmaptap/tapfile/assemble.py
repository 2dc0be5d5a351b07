"""``pmaptap.assemble``: a tapped sharded value's global array, from the
per-shard records every process wrote (their ``index`` and ``global_shape``).

Two passes over the run: the first reads lines only (no stored bytes) and
picks this tap's records at one step; the second loads one shard at a time
into the global array. No JAX.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

from pmaptap.tapfile.arrays import ByteStore, is_ref, numpy_dtype
from pmaptap.tapfile.attempts import Attempts
from pmaptap.tapfile.format import decode_record, index_text
from pmaptap.tapfile.lines import iter_lines

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
    """The global array of tap ``name`` at ``step``, put together from the
    per-shard records of every process (dtype exact, bit for bit).

    A sharded value under ``jit`` is written one record per shard (or per
    slice, when replicated copies were deduplicated), each with its global
    slice (``index``) and the value's ``global_shape``; any record of a
    slice fills it. A pytree value comes back as the same nesting of dicts
    and lists of arrays, or one leaf with ``leaf="a/b"`` (keys and list
    positions, as ``read``'s value nests them; a tuple of them also works).
    A replicated value that was not sharded is returned as it is.

    ``run``: which run, when the file holds several. ``backward``: the
    cotangent ``tap_grad`` wrote (pass "backward") instead of the forward
    value. Of a resumed run, the latest attempt of the step counts.

    Raises ValueError naming what is missing: no such records, shards whose
    slices nobody wrote, a per-device (unsharded) tap, a summarized value,
    copies of one slice that disagree, stored bytes that are missing.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"pmaptap.assemble: name must be a non-empty str, got {name!r}")
    if not isinstance(step, int) or isinstance(step, bool):
        raise TypeError(f"pmaptap.assemble: step must be an int, got {step!r}")
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
        raise ValueError(f"pmaptap.assemble: no records of {where}{extra}")
    if run is None and len(runs) > 1:
        raise ValueError(
            f"pmaptap.assemble: {where} exists in several runs {sorted(runs)}; pass run=..."
        )
    if later:
        recs = [r for r in recs if not later.superseded(r)]
    if any(r.get("summarized") for r in recs):
        raise ValueError(
            f"pmaptap.assemble: {where} was written as statistics (a leaf above "
            "max_value_bytes, 'summarized'): there is no array to assemble. Tap it "
            "with pmaptap.configure(max_value_bytes=None) or a larger limit."
        )
    store = ByteStore(path)
    dtype = recs[0]["dtype"]
    paths = _leaf_paths(dtype)
    if leaf is not None:
        want = _leaf_key(leaf)
        if want not in paths:
            raise ValueError(
                f"pmaptap.assemble: {what} has no leaf {leaf!r}; its leaves: "
                f"{['/'.join(map(str, p)) for p in paths]}"
            )
        chosen = [want]
    else:
        chosen = paths
    sharded = [r for r in recs if "index" in r or "global_shape" in r]
    if not sharded:
        out = _unsharded(recs, where, store)
        if leaf is not None:
            return _get(out, chosen[0])
        return out
    arrays = {p: _assemble_leaf(sharded, paths, p, where, store) for p in chosen}
    if leaf is not None or paths == [()]:
        return arrays[chosen[0]]
    return _nest(dtype, arrays)


def _leaf_paths(dtype: Any, prefix: tuple = ()) -> list[tuple]:
    """Leaf paths in flatten order (the order of ``index`` per leaf)."""
    if isinstance(dtype, dict):
        return [p for k, d in dtype.items() for p in _leaf_paths(d, (*prefix, k))]
    if isinstance(dtype, list):
        return [p for i, d in enumerate(dtype) for p in _leaf_paths(d, (*prefix, i))]
    return [prefix]


def _leaf_key(leaf: Any) -> tuple:
    parts = leaf.strip("/").split("/") if isinstance(leaf, str) else list(leaf)
    return tuple(int(p) if isinstance(p, str) and p.isdigit() else p for p in parts if p != "")


def _get(tree: Any, path: tuple) -> Any:
    for p in path:
        tree = tree[p]
    return tree


def _nest(dtype: Any, arrays: dict, prefix: tuple = ()) -> Any:
    if isinstance(dtype, dict):
        return {k: _nest(d, arrays, (*prefix, k)) for k, d in dtype.items()}
    if isinstance(dtype, list):
        return [_nest(d, arrays, (*prefix, i)) for i, d in enumerate(dtype)]
    return arrays[prefix]


def _leaf_value(d: dict, path: tuple, store: ByteStore) -> Any:
    """One leaf of a record as an ndarray of its own dtype (loaded if stored)."""
    import numpy as np

    dtype, shape, field = d["dtype"], d["shape"], d.get("bytes")
    for p in path:
        dtype, shape = dtype[p], shape[p]
        field = field[p] if isinstance(field, (dict, list)) and not is_ref(field) else None
    if is_ref(field):
        return store.load_leaf(field, dtype, shape)
    value = _get(decode_record(d)["value"], path)
    return np.asarray(value, dtype=numpy_dtype(dtype)).reshape(shape)


def _unsharded(recs: list[dict], where: str, store: ByteStore) -> Any:
    """A value that was not sharded: one replicated value (in agreement)."""
    kinds = {r["kind"] for r in recs}
    if "per_device" in kinds:
        devices = sorted({str(r.get("device")) for r in recs if r["kind"] == "per_device"})
        raise ValueError(
            f"pmaptap.assemble: {where} is per_device (one value per device, on devices "
            f"{', '.join(devices)}), not the shards of one array: read them with "
            "pmaptap.read(path, name=..., step=...)"
        )
    hashes = {r.get("vhash") for r in recs}
    if len(hashes) > 1 or any(r.get("divergent") for r in recs):
        raise ValueError(
            f"pmaptap.assemble: {where} is divergent (its copies disagree: "
            f"{len(hashes)} values); read them with pmaptap.read"
        )
    d = recs[0]
    paths = _leaf_paths(d["dtype"])
    leaves = {p: _leaf_value(d, p, store) for p in paths}
    return leaves[()] if paths == [()] else _nest(d["dtype"], leaves)


def _box(index: Any, paths: list, path: tuple) -> Any:
    """One leaf's [[start, stop], ...] from a record's index (one per leaf
    in flatten order for a pytree)."""
    if index is None:
        return None
    if len(paths) == 1:
        return index
    return index[paths.index(path)]


def _assemble_leaf(recs: list[dict], paths: list, path: tuple, where: str, store: ByteStore):
    import numpy as np

    k = paths.index(path)
    label = where + ("" if path == () else f" leaf {'/'.join(map(str, path))!r}")
    gshapes = []
    for r in recs:
        g = r.get("global_shape")
        gshapes.append(tuple(g if len(paths) == 1 else g[k]) if isinstance(g, list) else None)
    if len(set(gshapes)) != 1 or gshapes[0] is None:
        raise ValueError(
            f"pmaptap.assemble: {label}: its records do not agree on the global shape "
            f"({sorted(set(map(str, gshapes)))})"
        )
    gshape = gshapes[0]
    unknown = [r for r in recs if r.get("index") is None]
    if unknown:
        devs = ", ".join(str(r.get("device", r.get("devices"))) for r in unknown[:_SHOWN])
        raise ValueError(
            f"pmaptap.assemble: {label}: the global slice of {len(unknown)} shard(s) "
            f"(device(s) {devs}) is unknown (no index: the executable's sharding was "
            "never reported, e.g. loaded from a compilation cache)"
        )
    dtypes = {(r["dtype"] if len(paths) == 1 else _get(r["dtype"], path)) for r in recs}
    if len(dtypes) != 1:
        raise ValueError(f"pmaptap.assemble: {label}: shards of different dtypes {dtypes}")
    out = np.empty(gshape, dtype=numpy_dtype(dtypes.pop()))
    filled: dict[tuple, Any] = {}  # box -> vhash of the record that filled it
    for r in recs:
        box = tuple(tuple(p) for p in _box(r["index"], paths, path))
        if len(box) != len(gshape) or any(not 0 <= a <= b <= n for (a, b), n in zip(box, gshape)):
            raise ValueError(
                f"pmaptap.assemble: {label}: index [{index_text([list(b) for b in box])}] "
                f"does not lie in the global shape {list(gshape)}"
            )
        if box in filled:
            h = r.get("vhash")
            if h is not None and filled[box] is not None and h != filled[box]:
                raise ValueError(
                    f"pmaptap.assemble: {label}: the copies of slice "
                    f"[{index_text([list(b) for b in box])}] disagree (divergent)"
                )
            continue  # a replicated slice: any copy fills it
        value = _leaf_value(r, path, store)
        out[tuple(slice(a, b) for a, b in box)] = value
        filled[box] = r.get("vhash")
    missing = _missing(list(filled), gshape)
    if missing:
        shown = "; ".join(f"[{index_text([list(b) for b in m])}]" for m in missing[:_SHOWN])
        more = f" and {len(missing) - _SHOWN} more" if len(missing) > _SHOWN else ""
        raise ValueError(
            f"pmaptap.assemble: {label}: no record holds the slice(s) {shown}{more} of the "
            f"global shape {list(gshape)} (found {len(filled)} slice(s): a process's "
            "records missing, or filtered by dedup/every)"
        )
    return out


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
