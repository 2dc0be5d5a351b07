"""The host side of ``pmaptap.fingerprint``: a payload of per-device
fingerprints (_common/fingerprint.py) compared, and its records built
(``"kind": "fingerprint"``). Which copies are compared and what the records
say: docs/api.md, "Fingerprint records"; docs/architecture.md, "Replica
fingerprints".

GATHERED and JIT payloads hold every device of the job, so one process
writes the records (no cross-process dedup); COPY payloads (cond/while
bodies) wait for every local device (aggregate.py's pending copies) and are
compared among this process's devices.

Functions of the ``Aggregator`` (aggregate.py), whose ``count``, ``refuse``,
``hold`` and ``records`` they use.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any, Callable, Protocol

import numpy as np

from pmaptap import distributed
from pmaptap._common.fingerprint import FingerprintLayout, FingerprintSpec
from pmaptap._host.pipeline.payload import Copy, Part, _Pending
from pmaptap._host.pipeline.records import RecordBuilder
from pmaptap.tapfile.record import FINGERPRINT, MAX_STEP, RANGES_ABOVE, Record


class Aggregator(Protocol):
    """What these functions use of aggregate.py's ``Aggregator`` (typed
    here, not imported: aggregate.py imports this module)."""

    records: RecordBuilder

    def count(self, key: tuple) -> int: ...
    def refuse(self, name: str, step: int) -> list[Record]: ...
    def hold(self, pkey: tuple, copy: Copy, expected: int) -> list[Record]: ...


# (device, process, mesh coordinates) of the copy in row k of a payload.
Holder = tuple[Any, Any, dict]


def add(agg: "Aggregator", part: Part) -> list[Record]:
    """One callback's part (payload.split; see _common/fingerprint.py for
    the forms)."""
    spec: FingerprintSpec = part.spec
    if spec.layout is FingerprintLayout.COPY:
        return _add_copy(agg, spec, part)
    step = part.step
    if spec.explicit_step and not 0 <= step <= MAX_STEP:
        return agg.refuse(spec.name, step)
    step = _step_or_skip(agg, spec, step, ())
    if step is None:
        return []
    fps = np.asarray(part.leaves[0]).reshape(-1, len(spec.leaves), 2)
    if spec.layout is FingerprintLayout.JIT:
        place = spec.shards
        if place is None:  # a device pmaptap could not name: one copy
            me = [(None, agg.records.process, {})]
            return _records(agg, spec, step, fps, me, _whole, _no_slice)
        holders = [(place.devices[k], place.processes[k], place.coords[k]) for k in range(len(fps))]
        return _records(agg, spec, step, fps, holders, _slices_of(place), _index_of(place))
    where = spec.placement
    holders = []
    for k in range(len(fps)):
        c = where.coords_of(k)
        holders.append((where.device_of(c), where.process_of(c), dict(zip(where.axis_names, c))))
    return _records(agg, spec, step, fps, holders, _groups_of(spec), _coords_of(spec))


def _step_or_skip(agg: "Aggregator", spec: FingerprintSpec, step: int, who: Any) -> int | None:
    """The payload's step (counted per name, and per device ``who`` for
    COPY payloads, when not explicit), or None when ``every`` skips it."""
    if spec.explicit_step:
        return step
    step = agg.count((spec.name, "fingerprint", who))
    return None if step % spec.every else step


def _add_copy(agg: "Aggregator", spec: FingerprintSpec, part: Part) -> list[Record]:
    """One device's own fingerprints (inside a cond/while body): pending
    until this process's other devices have sent theirs."""
    where = spec.placement
    c = where.coords_of(part.k)
    device = where.device_of(c)
    step = part.step
    if spec.explicit_step and not 0 <= step <= MAX_STEP:
        return agg.refuse(spec.name, step)
    step = _step_or_skip(agg, spec, step, device if device is not None else c)
    if step is None:
        return []
    process = where.process_of(c)
    process = agg.records.process if process is None else process
    copy = Copy(spec, c, device, process, part.leaves, b"")
    return agg.hold((spec.name, step, "fingerprint"), copy, where.local_copies)


def resolve(agg: "Aggregator", pkey: tuple, pending: "_Pending") -> list[Record]:
    """The records of the COPY fingerprints that arrived for one step."""
    copies = sorted(pending.copies, key=lambda cp: cp.coords)
    spec = copies[0].spec
    where = spec.placement
    fps = np.stack([np.asarray(cp.leaves[0]).reshape(len(spec.leaves), 2) for cp in copies])
    holders = [(cp.device, cp.process, dict(zip(where.axis_names, cp.coords))) for cp in copies]
    return _records(agg, spec, pkey[1], fps, holders, _groups_of(spec), _coords_of(spec))


# ------------------------------------------------------------ groups
# groups(leaf, holders) -> {slice key: [row, ...]}: the rows whose copies of
# the leaf should be equal; describe(leaf, slice key) -> the record fields
# that say which slice (index, slice_coords).
Groups = Callable[[int, list], "OrderedDict[Any, list[int]]"]
Describe = Callable[[int, Any], dict]


def _whole(j: int, holders: list) -> "OrderedDict[Any, list[int]]":
    return OrderedDict({(): list(range(len(holders)))})


def _no_slice(j: int, key: Any) -> dict:
    return {}


def _groups_of(spec: FingerprintSpec) -> Groups:
    """Mapped copies: by coordinates on the axes the leaf varies over."""
    names = spec.placement.axis_names

    def groups(j: int, holders: list) -> "OrderedDict[Any, list[int]]":
        axes = spec.varying[j] if j < len(spec.varying) else ()
        out: OrderedDict[Any, list[int]] = OrderedDict()
        for k, (_, _, coords) in enumerate(holders):
            out.setdefault(tuple(coords[names[i]] for i in axes), []).append(k)
        return out

    return groups


def _coords_of(spec: FingerprintSpec) -> Describe:
    names = spec.placement.axis_names

    def describe(j: int, key: Any) -> dict:
        axes = spec.varying[j] if j < len(spec.varying) else ()
        return {"slice_coords": {names[i]: int(c) for i, c in zip(axes, key)}} if axes else {}

    return describe


def _slices_of(place: Any) -> Groups:
    """Partitions under jit: by the global slice they hold (from the
    sharding XLA chose, known at compile time); partitions holding only an
    uneven sharding's padding are no copy; an unknown slice (an executable
    whose sharding was never reported) is compared with nothing."""

    def groups(j: int, holders: list) -> "OrderedDict[Any, list[int]]":
        out: OrderedDict[Any, list[int]] = OrderedDict()
        slices = place.slices[j] if j < len(place.slices) else None
        for k in range(len(holders)):
            if slices is None:
                out[("unknown", k)] = [k]
                continue
            box = slices[k]
            if box and any(b <= s for s, b in box):
                continue  # padding only
            out.setdefault(box, []).append(k)
        return out

    return groups


def _index_of(place: Any) -> Describe:
    def describe(j: int, key: Any) -> dict:
        if not key or key[0] == "unknown":
            return {}
        if tuple((0, n) for n in place.shapes[j]) == key:
            return {}  # the whole array: a replicated leaf needs no index
        return {"index": [[s, b] for s, b in key]}

    return describe


# ------------------------------------------------------------ records


def _value(pair: np.ndarray) -> str:
    """A fingerprint as the record writes it: 16 hexadecimal digits (the
    high half first)."""
    hi, lo = (int(v) for v in pair)
    return f"{hi:08x}{lo:08x}"


def _records(
    agg: "Aggregator",
    spec: FingerprintSpec,
    step: int,
    fps: np.ndarray,
    holders: list[Holder],
    groups: Groups,
    describe: Describe,
) -> list[Record]:
    """The records of one step's fingerprints: ``fps[row, leaf]`` of the
    copy held by ``holders[row]``."""
    now = agg.records.clock()
    divergent: list[Record] = []
    digest = hashlib.blake2b(digest_size=8)
    compared: set[int] = set()
    slices = 0
    for j, leaf in enumerate(spec.leaves):
        for key, rows in groups(j, holders).items():
            slices += 1
            compared.update(rows)
            by_value: OrderedDict[str, list[int]] = OrderedDict()
            for k in rows:
                by_value.setdefault(_value(fps[k, j]), []).append(k)
            if len(by_value) == 1:
                digest.update(repr((j, key, next(iter(by_value)))).encode())
                continue
            # Most holders first: the copies that agree with the majority,
            # then each odd one out.
            for value, alike in sorted(by_value.items(), key=lambda kv: (-len(kv[1]), kv[1][0])):
                divergent.append(
                    _record(
                        agg,
                        spec,
                        step,
                        value,
                        [holders[k] for k in alike],
                        now,
                        divergent=True,
                        extra={
                            "leaf": leaf,
                            **describe(j, key),
                            "compared": len(rows),
                            **_holders(agg, [holders[k] for k in alike]),
                        },
                    )
                )
    if divergent:
        return divergent
    rows = sorted(compared)
    return [
        _record(
            agg,
            spec,
            step,
            digest.hexdigest(),
            [holders[k] for k in rows],
            now,
            extra={"leaves": len(spec.leaves), "slices": slices},
        )
    ]


def _holders(agg: "Aggregator", holders: list[Holder]) -> dict:
    """The ``holders`` field of a divergent record: each copy's device,
    process, host and coordinates, for a value held by a few copies (the
    odd ones out); past RANGES_ABOVE, the majority of a big job, its
    ``devices`` and ``processes`` (ranges text) say who, and the line stays
    small."""
    if len(holders) > RANGES_ABOVE:
        return {}
    return {"holders": [_holder(agg, *h) for h in holders]}


def _holder(agg: "Aggregator", device: Any, process: Any, coords: dict) -> dict:
    me = agg.records
    host = me.host if process == me.process else None
    if host is None and process is not None:
        host = distributed.host_of(process)
    return {"device": device, "process": process, "host": host, "coords": coords}


def _record(
    agg: "Aggregator",
    spec: FingerprintSpec,
    step: int,
    value: str,
    holders: list[Holder],
    now: float,
    *,
    divergent: bool = False,
    extra: dict,
) -> Record:
    index = extra.pop("index", None)
    devices = tuple(h[0] for h in holders)
    processes = tuple(sorted({h[1] for h in holders if h[1] is not None}))
    return agg.records.record(
        name=spec.name,
        step=int(step),
        kind=FINGERPRINT,
        # No array data: the fingerprint is its own field (hex text, as
        # vhash), so that no reader takes it for a number to sum or plot.
        value=None,
        dtype=None,
        shape=None,
        time=now,
        replicas=len(devices),
        devices=devices,
        processes=processes,
        divergent=divergent,
        index=index,
        extra={"fingerprint": value, **extra},
    )
