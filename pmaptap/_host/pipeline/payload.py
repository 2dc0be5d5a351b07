"""The first stage of the aggregation path (aggregate.py -> records.py ->
encode.py follow): one host callback's payload taken apart, before any
copy is grouped. ``split`` narrows sub-byte leaves back to their own dtype,
splits a group payload into its members' (a member's own copy picked from a
gathered leader-copy member), unpacks packed payloads, and reads each
part's step, flat coordinates or partition, and loop iteration (the
layouts: _trace/layouts.py). ``Copy`` is one device's copy of a tap's value
as the aggregator groups it, ``_Pending`` the copies of one value waiting
for the rest."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from pmaptap._common.fingerprint import FingerprintLayout, FingerprintSpec
from pmaptap._common.spec import LEADER_COPY, GroupSpec, Layout, PayloadSpec, TapSpec, flat_index


@dataclasses.dataclass
class Part:
    """One tap's (or one fingerprint call's) share of a callback payload."""

    spec: Any  # TapSpec or FingerprintSpec
    # The step as it travelled: a traced or Python step= (automatic steps
    # are counted by the aggregator and ignore it).
    step: int
    # The value's leaves: one copy's, or every copy's stacked (GATHERED).
    leaves: list[np.ndarray]
    # The flat index of the copy's mesh coordinates (per-copy layouts),
    # or the partition number (per-shard and WHOLE payloads); else -1.
    k: int = -1
    # A looped tap's loop iteration, outermost first (None: not looped, or
    # an index the loop left unset).
    iteration: tuple[int, ...] | None = None


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


def split(spec: PayloadSpec, arrays: list[np.ndarray]) -> list[Part]:
    """One host callback's arrays (NumPy, as they travelled) as the parts
    the aggregator takes: one per tap (a group's members in order), or the
    fingerprint call's."""
    arrays = restore(spec, arrays)
    if isinstance(spec, FingerprintSpec):
        if spec.layout is FingerprintLayout.COPY:
            # (coords, step, fingerprints): one device's own, in a cond/while body.
            k = _flat(arrays[0], spec.placement.axis_sizes)
            return [Part(spec, _step(arrays[1]), [arrays[2]], k)]
        return [Part(spec, _step(arrays[0]), [arrays[1]])]
    if isinstance(spec, GroupSpec):
        return _members(spec, arrays)
    return [_part(spec, arrays)]


def _members(spec: GroupSpec, arrays: list[np.ndarray]) -> list[Part]:
    """A group payload: coords, one step per member, then every member's
    gathered leaves (packed when spec.packing); a partitioned one (taps
    under plain jit) starts with the partition number, which every
    member's part gets too."""
    if spec.partitioned:
        pid, arrays = arrays[0], arrays[1:]
    m = len(spec.members)
    coords, steps, payload = arrays[0], arrays[1 : 1 + m], arrays[1 + m :]
    if spec.packing:
        payload = unpack(payload[0], spec.packing)
    out: list[Part] = []
    i = 0
    for member, step, n in zip(spec.members, steps, spec.member_leaves):
        leaves = payload[i : i + n]
        i += n
        if spec.gathered and member.transport.layout in LEADER_COPY:
            # Written from the caller's own copy (unverified, or proven
            # at trace time), exactly as the tap alone would be (the
            # others were gathered for the group's other members, not to
            # check this one). Ungathered groups carry that copy only.
            row = _flat(coords, member.placement.axis_sizes)
            leaves = [a[row] for a in leaves]
        if spec.partitioned:
            out.append(_part(member, [pid, coords, step, *leaves]))
        else:
            out.append(_part(member, [coords, step, *leaves]))
    return out


def _part(spec: TapSpec, arrays: list[np.ndarray]) -> Part:
    """One tap's payload: (coords, step, *leaves), or with ``spec.shards``
    (partition, coords, step, *leaves)."""
    it = iteration_of(spec, arrays) if spec.site.iterations else None
    if spec.shards is not None:
        k = int(np.asarray(arrays[0]).reshape(-1)[0])
        return Part(spec, _step(arrays[2]), list(arrays[3:]), k, it)
    layout, packing = spec.transport.layout, spec.transport.packing
    leaves = unpack(arrays[2], packing) if packing else arrays[2:]
    k = -1
    if layout in (Layout.COPY, Layout.SHARDS, Layout.WHOLE):
        # One device's copy (SHARDS / WHOLE without a placement: the
        # computation was not partitioned, one whole copy came).
        k = _flat(arrays[0], spec.placement.axis_sizes)
    return Part(spec, _step(arrays[1]), leaves, k, it)


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
