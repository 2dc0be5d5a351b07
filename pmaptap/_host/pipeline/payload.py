"""What one host callback carries, taken apart: the sub-byte leaves restored
to their own dtype, packed payloads unpacked, the step and the flat
coordinates read, and ``Copy``, one device's copy of a tap's value as the
aggregator groups it (see aggregate.py; the layouts: _trace/layouts.py)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from pmaptap._common.spec import GroupSpec, PayloadSpec, TapSpec, flat_index


@dataclasses.dataclass
class Copy:
    spec: TapSpec
    coords: tuple[int, ...]
    device: int | None
    process: int
    leaves: list[np.ndarray]
    key: bytes  # bitwise identity of the value
    # Per-shard taps (Layout.SHARDS): the shard's partition, its global
    # slice, the partitions holding the same slice, and which leaves are
    # statistics made on the host for this shard (TapSite.as_statistics's form).
    partition: int = -1
    index: Any = None
    slice_key: Any = None
    as_statistics: tuple = ()


@dataclasses.dataclass
class _Pending:
    """The copies of one value that arrived so far, waiting for the rest
    (``first``: when the first came, for ``group_timeout``); the aggregator's
    and fingerprints.py's."""

    first: float
    copies: list[Copy]


def restore(spec: PayloadSpec, arrays: list[np.ndarray]) -> list[np.ndarray]:
    """One host callback's arrays as they travelled, with sub-byte leaves
    narrowed back to their own dtype (``spec.restore`` indexes the operands
    after a partitioned payload's leading partition number)."""
    if spec.restore:
        skip = (
            1
            if (spec.partitioned if isinstance(spec, GroupSpec) else spec.shards is not None)
            else 0
        )
        arrays = list(arrays)
        for i, dtype in spec.restore:
            arrays[skip + i] = arrays[skip + i].astype(dtype)
    return arrays


def unpack(packed: np.ndarray, packing) -> list[np.ndarray]:
    """Split a gathered uint8 payload (copies, bytes) back into stacked leaves
    (copies, *shape) of their own dtypes (see _trace/layouts.gather_packed)."""
    import ml_dtypes  # noqa: F401 - registers bfloat16/float8 with NumPy

    n = packed.shape[0]
    out, off = [], 0
    for dtype, shape in packing:
        dt = np.dtype(dtype)
        size = math.prod(shape) * (1 if dt == np.bool_ else dt.itemsize)
        chunk = np.ascontiguousarray(packed[:, off : off + size])
        off += size
        if dt == np.bool_:
            arr = chunk.astype(bool)
        else:
            arr = chunk.view(dt)
        out.append(arr.reshape((n, *shape)))
    return out


def _flat(coords: np.ndarray, sizes: tuple[int, ...]) -> int:
    """Flat index of a callback's coordinates (an int32 vector)."""
    return flat_index(tuple(int(v) for v in coords.reshape(-1)), sizes)


def _rows_identical(stacked: list[np.ndarray]) -> bool:
    """Whether every row (copy) of the stacked leaves is bitwise identical.
    Gathered payloads are small (gather_max_bytes), so comparing bytes
    objects is cheaper than NumPy's elementwise machinery."""
    for a in stacked:
        n = a.shape[0]
        if n < 2 or a.size == 0:
            continue
        raw = np.ascontiguousarray(a).tobytes()
        if raw != raw[: len(raw) // n] * n:
            return False
    return True


def _step(a: np.ndarray) -> int:
    """A payload's step: a scalar, or a Python-int step >= 2**31 that
    travelled as its (high, low) uint32 halves (layouts.static_step_operand)."""
    return (int(a[0]) << 32) | int(a[1]) if a.shape == (2,) else int(a)


def iteration_of(spec: TapSpec, arrays: list[np.ndarray]) -> tuple[int, ...] | None:
    """A looped tap's loop iteration, outermost loop first: the last
    ``spec.site.iterations`` of its coordinates (after a partitioned
    payload's partition number). None if a loop left an index unset (-1,
    _trace/iteration.py): no iteration is better than a wrong one."""
    coords = np.asarray(arrays[1 if spec.shards is not None else 0]).reshape(-1)
    it = tuple(int(v) for v in coords[len(coords) - spec.site.iterations :])
    return None if any(v < 0 for v in it) else it
