"""Per-process grouping of per-device copies, and the dedup policies.

Pure logic, no threads: ``Aggregator.add`` takes one callback's payload
(already converted to NumPy by the aggregator thread) and returns the records
that became complete. A group is one (name, step, pass) on this process; it is
complete when every local device that runs the tap has reported, when the
same device reports that key again, when it has waited ``group_timeout``
seconds (a tap under a ``cond`` that fired on some devices only), or at flush.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
import weakref
from collections import OrderedDict
from typing import Any, Callable

import numpy as np

from pmaptap._common.spec import GroupSpec, Layout, PayloadSpec, TapSpec, flat_index
from pmaptap._host import shards as shard_host
from pmaptap._host.encode import encode_rows, encode_tree, value_key
from pmaptap._log import log
from pmaptap.tapfile.format import (
    COPIES_SEEN,
    MAX_STEP,
    META_DROPPED,
    META_REFUSED,
    ORJSON,
    Record,
    meta_record,
    new_record,
)

# Payloads holding the leader's own copy of a replicated tap: unverified
# (VERIFIED_OFF) or proven replicated at trace time (PROVEN, _trace/invariant.py).
_LEADER_COPY = (Layout.VERIFIED_OFF, Layout.PROVEN)


@dataclasses.dataclass
class Copy:
    spec: TapSpec
    coords: tuple[int, ...]
    device: int | None
    process: int
    leaves: list[np.ndarray]
    key: bytes  # bitwise identity of the value
    # Per-shard taps (Layout.SHARDS): the shard's partition, its global
    # slice, the partitions holding the same slice, and per-shard summaries.
    partition: int = -1
    index: Any = None
    slice_key: Any = None
    summaries: tuple = ()


@dataclasses.dataclass
class _Group:
    first: float
    copies: list[Copy]


class _Table:
    """Per tap site: coordinates, device, process and counter key of every
    flat coordinate, and which of them are local (computed once)."""

    def __init__(self, spec: TapSpec, me: int) -> None:
        where = spec.placement
        n = where.total_copies
        self.coords = [where.coords_of(k) for k in range(n)]
        self.devices = [where.device_of(c) for c in self.coords]
        procs = [where.process_of(c) for c in self.coords]
        self.processes = [me if p is None else p for p in procs]
        self.local = [
            k for k in range(n) if spec.placement.device_processes is None or procs[k] == me
        ]
        # Automatic steps count per device (per coordinate where the device
        # is unknown). Outside any mapping (jit, eager) there is one counter,
        # whatever device an eager value sat on.
        self.counter_keys = [
            (d if d is not None else c) if spec.placement.axis_names else ()
            for d, c in zip(self.devices, self.coords)
        ]
        # Record fields of the gathered fast paths (shared, never mutated).
        self.coord_dicts = [dict(zip(spec.placement.axis_names, c)) for c in self.coords]
        self.all_devices = tuple(self.devices)
        self.all_processes = tuple(sorted(set(self.processes)))
        # Counter keys of the local devices, for _auto_step (built on first use).
        self.auto_keys: list[tuple] | None = None
        # Per-device record templates of the gathered path, per (batch_dims,
        # summaries) of the spec (see Aggregator._per_device_records_of_rows).
        self.per_device_templates: dict[tuple, list[dict]] = {}
        # (template key, dtype) -> per device, its line cut around the step,
        # the value and the time (None where it cannot be: _line_pieces).
        self.per_device_lines: dict[tuple, list] = {}
        self.replicated_templates: dict[tuple, dict] = {}


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


class Aggregator:
    def __init__(
        self,
        run: str,
        process: int,
        host: str,
        *,
        group_timeout: float = 5.0,
        clock: Callable[[], float] = time.time,
        attempt: int = 0,
    ) -> None:
        self.run, self.process, self.host = run, process, host
        self.attempt = attempt
        self.group_timeout = group_timeout
        self.clock = clock
        self._counters: dict[tuple, int] = {}
        self._groups: OrderedDict[tuple, _Group] = OrderedDict()
        self._tables: dict[tuple, _Table] = {}
        # Per-shard taps: per ShardPlacement (one per tap per lowering, so
        # dropped with its executable), per (site, partition): the record
        # template of its per_device records.
        self._shard_templates: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # Payloads refused for a traced step outside 0..2**63-1, per tap
        # name: [count, first bad step]; reported by refused_records().
        self._refused: dict[str, list[int]] = {}

    # ------------------------------------------------------------ input
    def add(
        self, spec: TapSpec, coords: np.ndarray, step: int, leaves: list[np.ndarray]
    ) -> list[Record]:
        t = self._table(spec)
        k = _flat(coords, spec.placement.axis_sizes)
        c, device = t.coords[k], t.devices[k]
        if not spec.site.explicit_step:
            # Automatic step: the k-th execution of this tap name on this
            # device. Callbacks of one device arrive in execution order.
            ckey = (spec.name, spec.site.pass_, t.counter_keys[k])
            step = self._counters.get(ckey, 0)
            self._counters[ckey] = step + 1
            if step % spec.site.every:
                return []
        if spec.placement.local_copies == 1 and not self._groups:
            # Fast path (plain jit / eager): a group of one is complete now.
            if spec.site.dedup == "per_device":
                return [
                    self._per_device_record(
                        spec,
                        int(step),
                        self._value(spec, leaves),
                        t.processes[k],
                        device,
                        t.coord_dicts[k],
                        self.clock(),
                    )
                ]
            copy = Copy(spec, c, device, t.processes[k], leaves, value_key(leaves))
            return [self._replicated_record_of_holders(spec, int(step), [copy], False)]
        copy = Copy(spec, c, device, t.processes[k], leaves, value_key(leaves))
        out: list[Record] = []
        gkey = (spec.name, int(step), spec.site.pass_)
        group = self._groups.get(gkey)
        if group is not None and any(cp.coords == c and cp.device == device for cp in group.copies):
            # Same device again for this key (two tap sites sharing a name,
            # or a fixed Python step in a loop): close the earlier group.
            out += self._resolve(gkey, self._groups.pop(gkey))
            group = None
        if group is None:
            group = self._groups[gkey] = _Group(self.clock(), [])
        group.copies.append(copy)
        if len(group.copies) >= spec.placement.local_copies:
            out += self._resolve(gkey, self._groups.pop(gkey))
        return out

    def add_callback(self, spec: PayloadSpec, arrays: list[np.ndarray]) -> list[Record]:
        """One host callback's arrays as they travelled: sub-byte leaves are
        narrowed back to their own dtype first (``spec.restore`` indexes the
        operands after a partitioned payload's leading partition number)."""
        if spec.restore:
            skip = (
                1
                if (spec.partitioned if isinstance(spec, GroupSpec) else spec.shards is not None)
                else 0
            )
            arrays = list(arrays)
            for i, dtype in spec.restore:
                arrays[skip + i] = arrays[skip + i].astype(dtype)
        return self.add_payload(spec, arrays)

    def add_payload(self, spec: PayloadSpec, arrays: list[np.ndarray]) -> list[Record]:
        """Dispatch one callback payload by its layout (see _trace/layouts.py)."""
        if isinstance(spec, GroupSpec):
            return self._add_group(spec, arrays)
        if spec.shards is not None:
            if spec.transport.layout is Layout.WHOLE:
                return self._add_whole(spec, arrays)
            return self._add_shard(spec, arrays)
        coords = arrays[0]
        step = _step(arrays[1])
        if spec.site.explicit_step and not 0 <= step <= MAX_STEP:
            return self._refuse(spec.site.name, step)
        layout, packing = spec.transport.layout, spec.transport.packing
        if packing:
            arrays = [arrays[0], arrays[1], *unpack(arrays[2], packing)]
        if layout in (Layout.COPY, Layout.SHARDS, Layout.WHOLE):
            # SHARDS / WHOLE without a placement: the computation was not
            # partitioned, one whole copy came (summarized on device).
            return self.add(spec, coords, step, arrays[2:])
        if layout is Layout.GATHERED:
            return self._add_gathered(spec, step, arrays[2:])
        if layout in (Layout.VERIFIED, *_LEADER_COPY):
            # PROVEN: replication shown at trace time counts as verified.
            return self._add_one_copy(
                spec, step, arrays[2:], verified=layout is not Layout.VERIFIED_OFF
            )
        raise ValueError(f"unknown payload layout {layout!r}")

    def _add_shard(self, spec: TapSpec, arrays: list[np.ndarray]) -> list[Record]:
        """One shard of a partitioned value: (partition, coords, step, *leaves)
        with ``spec.shards`` telling where partition k lives."""
        place, site = spec.shards, spec.site
        k = int(np.asarray(arrays[0]).reshape(-1)[0])
        step = _step(arrays[2])
        if site.explicit_step and not 0 <= step <= MAX_STEP:
            return self._refuse(site.name, step)
        if place.padding(k):
            return []  # an uneven sharding's padding tile: no element of the value
        raw = place.crop(k, list(arrays[3:]))
        device = place.devices[k]
        if not site.explicit_step:
            # Counted per device: each device runs every execution once, in order.
            ckey = (site.name, site.pass_, device)
            step = self._counters.get(ckey, 0)
            self._counters[ckey] = step + 1
            if step % site.every:
                return []
        leaves, summaries = shard_host.summarize_leaves(site, raw)
        if site.dedup == "per_device":
            # Nothing to compare: the shard's record now, without waiting
            # for the step's other shards.
            return [self._per_device_record_of_shard_now(spec, step, k, raw, leaves, summaries)]
        copy = Copy(
            spec,
            (k,),
            device,
            place.processes[k],
            leaves,
            # per_device shards are never compared: no copy of their bytes
            # for a key (a 2 MiB activation is two 2 MiB copies a step).
            b"" if site.dedup == "per_device" else value_key(leaves),
            partition=k,
            index=place.index_of(k, raw),
            slice_key=tuple(place.holders(k)),
            summaries=summaries,
        )
        out: list[Record] = []
        gkey = (site.name, step, site.pass_)
        group = self._groups.get(gkey)
        if group is not None and any(cp.device == device for cp in group.copies):
            out += self._resolve(gkey, self._groups.pop(gkey))
            group = None
        if group is None:
            group = self._groups[gkey] = _Group(self.clock(), [])
        group.copies.append(copy)
        if len(group.copies) >= max(1, place.local_expected()):
            out += self._resolve(gkey, self._groups.pop(gkey))
        return out

    def _add_whole(self, spec: TapSpec, arrays: list[np.ndarray]) -> list[Record]:
        """A scalar tap under plain jit on several devices (Layout.WHOLE):
        (partition, coords, step, *leaves). Every device holds the value;
        only partition 0's copy is read (in a partitioned group every device
        carries one: the others are skipped here), and the record names every
        device of the computation and says one copy was seen."""
        place, site = spec.shards, spec.site
        if int(np.asarray(arrays[0]).reshape(-1)[0]) != 0:
            return []
        step = _step(arrays[2])
        if site.explicit_step and not 0 <= step <= MAX_STEP:
            return self._refuse(site.name, step)
        if not site.explicit_step:
            # One counter, as for any tap outside a mapping (see _Table).
            ckey = (site.name, site.pass_, ())
            step = self._counters.get(ckey, 0)
            self._counters[ckey] = step + 1
            if step % site.every:
                return []
        leaves = list(arrays[3:])
        if site.dedup == "per_device":
            # The one copy read is device 0's: exactly that device's record.
            return [
                self._per_device_record(
                    spec,
                    step,
                    self._value(spec, leaves),
                    place.processes[0],
                    place.devices[0],
                    place.coords[0],
                    self.clock(),
                )
            ]
        return [
            self._replicated_record(
                spec,
                step,
                self._value(spec, leaves),
                place.devices,
                tuple(sorted(set(place.processes))),
                value_key(leaves),
                extra={COPIES_SEEN: 1},
            )
        ]

    def _resolve_shards(self, spec: TapSpec, step: int, copies: list[Copy]) -> list[Record]:
        """Records of one step's shards on this process (see _host/shards.py)."""
        place, dedup = spec.shards, spec.site.dedup
        out: list[Record] = []
        for holders, cps in shard_host.by_slice(copies).items():
            if dedup == "per_device":
                out += [self._per_device_record_of_shard(spec, step, cp) for cp in cps]
                continue
            by_value: OrderedDict[bytes, list[Copy]] = OrderedDict()
            for cp in cps:
                by_value.setdefault(cp.key, []).append(cp)
            if len(by_value) == 1:
                cp = cps[0]
                if dedup == "auto" and len(holders) == 1:
                    out.append(self._per_device_record_of_shard(spec, step, cp))
                    continue
                # Every holder in the job, this process's ones compared; the
                # other processes' copies are compared in the file (vhash).
                out.append(
                    self._replicated_record(
                        spec,
                        step,
                        self._shard_value(spec, cp),
                        tuple(place.devices[j] for j in holders),
                        tuple(sorted({place.processes[j] for j in holders})),
                        cp.key,
                        index=cp.index,
                    )
                )
                continue
            if dedup == "auto":
                out += [self._per_device_record_of_shard(spec, step, cp) for cp in cps]
                continue
            for group in by_value.values():
                extra = {
                    "holders": [
                        {
                            "device": h.device,
                            "process": h.process,
                            "coords": place.coords[h.partition],
                        }
                        for h in group
                    ]
                }
                out.append(
                    self._replicated_record(
                        spec,
                        step,
                        self._shard_value(spec, group[0]),
                        tuple(h.device for h in group),
                        tuple(sorted({h.process for h in group})),
                        group[0].key,
                        divergent=True,
                        extra=extra,
                        index=group[0].index,
                    )
                )
        return out

    def _shard_value(self, spec: TapSpec, cp: Copy) -> tuple:
        return encode_tree(spec.site.treedef, cp.leaves, cp.summaries)

    def _per_device_record_of_shard(self, spec: TapSpec, step: int, cp: Copy) -> Record:
        """The per_device record of one shard's copy (with its index)."""
        return self._per_device_record(
            spec,
            step,
            self._shard_value(spec, cp),
            cp.process,
            cp.device,
            spec.shards.coords[cp.partition],
            self.clock(),
            index=cp.index,
        )

    def _per_device_record_of_shard_now(
        self,
        spec: TapSpec,
        step: int,
        k: int,
        raw: list[np.ndarray],
        leaves: list[np.ndarray],
        summaries: tuple,
    ) -> Record:
        """The per_device record of partition ``k``'s shard, a copy of the
        partition's template (as ``_per_device_records_of_rows``: every field
        but the step, value and time is fixed for a lowering's partition; a
        step of many sharded taps makes one record per tap per device)."""
        place = spec.shards
        per = self._shard_templates.get(place)
        if per is None:
            per = self._shard_templates[place] = {}
        tkey = (spec.site.tap_id, spec.site.batch_dims, k)
        template = per.get(tkey)
        if template is None:
            template = per[tkey] = dict(
                self._per_device_record(
                    spec,
                    0,
                    (None, None, None),
                    place.processes[k],
                    place.devices[k],
                    place.coords[k],
                    0.0,
                    index=place.index_of(k, raw),
                ).__dict__
            )
        value, dtype, shape = encode_tree(spec.site.treedef, leaves, summaries)
        return _from_template(template, step, value, dtype, shape, self.clock())

    def _add_group(self, spec: GroupSpec, arrays: list[np.ndarray]) -> list[Record]:
        """A group payload: coords, one step per member, then every member's
        gathered leaves (packed when spec.packing); a partitioned one (taps
        under plain jit) starts with the partition number, which every
        member's payload gets too."""
        if spec.partitioned:
            pid, arrays = arrays[0], arrays[1:]
        m = len(spec.members)
        coords, steps, payload = arrays[0], arrays[1 : 1 + m], arrays[1 + m :]
        if spec.packing:
            payload = unpack(payload[0], spec.packing)
        out: list[Record] = []
        i = 0
        for member, step, n in zip(spec.members, steps, spec.member_leaves):
            leaves = payload[i : i + n]
            i += n
            if spec.gathered and member.transport.layout in _LEADER_COPY:
                # Written from the caller's own copy (unverified, or proven
                # at trace time), exactly as the tap alone would be (the
                # others were gathered for the group's other members, not to
                # check this one). Ungathered groups carry that copy only.
                row = _flat(coords, member.placement.axis_sizes)
                leaves = [a[row] for a in leaves]
            if spec.partitioned:
                out += self.add_payload(member, [pid, coords, step, *leaves])
            else:
                out += self.add_payload(member, [coords, step, *leaves])
        return out

    def _table(self, spec: TapSpec) -> "_Table":
        key = (spec.site.tap_id, spec.placement.axis_sizes)
        t = self._tables.get(key)
        if t is None:
            t = self._tables[key] = _Table(spec, self.process)
        return t

    def _auto_step(self, spec: TapSpec, t: "_Table") -> int:
        """Automatic step for a payload that stands for every local device:
        each of them executed the tap once more."""
        keys = t.auto_keys
        if keys is None:
            # Built once per site: this runs for every gathered payload (the
            # tuples cost more than the counting on a scalar tap's path).
            keys = t.auto_keys = [(spec.name, spec.site.pass_, t.counter_keys[k]) for k in t.local]
        if not keys:
            return 0
        get = self._counters.get
        now = [get(k, 0) for k in keys]
        self._counters.update(zip(keys, [s + 1 for s in now]))
        return min(now)

    def _step_or_skip(self, spec: TapSpec, t: "_Table", step: int) -> int | None:
        """The payload's step (automatic if not explicit), or None when
        ``every`` skips it on the host."""
        if spec.site.explicit_step:
            return step
        step = self._auto_step(spec, t)
        return None if step % spec.site.every else step

    def _add_gathered(self, spec: TapSpec, step: int, stacked: list[np.ndarray]) -> list[Record]:
        t = self._table(spec)
        step = self._step_or_skip(spec, t, step)
        if step is None:
            return []
        if spec.site.dedup == "per_device":
            # This process writes its own devices only; the other processes'
            # leaders write theirs. No value comparison needed.
            texts: list[bytes] = []
            encoded = encode_rows(
                spec.site.treedef, stacked, t.local, spec.site.summaries, texts=texts
            )
            return self._per_device_records_of_rows(spec, t, step, encoded, texts)
        if _rows_identical(stacked):
            # Every copy agrees (the common case): one record held by all.
            row0 = [a[0] for a in stacked]
            encoded = encode_rows(spec.site.treedef, stacked, [0], spec.site.summaries)[0]
            return [self._replicated_record_of_all(spec, step, t, encoded, value_key(row0))]
        copies = []
        for k in range(spec.placement.total_copies):  # copies disagree: key each one
            row = [a[k] for a in stacked]
            copies.append(
                Copy(spec, t.coords[k], t.devices[k], t.processes[k], row, value_key(row))
            )
        # Replicated / agreeing auto: every process sees all copies, writes
        # the same record(s), and the file-level index keeps one. Disagreeing
        # auto becomes per-device records: of this process's devices only.
        return self._resolve(
            (spec.name, step, spec.site.pass_),
            _Group(self.clock(), copies),
            local={t.coords[k] for k in t.local},
        )

    def _add_one_copy(
        self, spec: TapSpec, step: int, leaves: list[np.ndarray], *, verified: bool
    ) -> list[Record]:
        t = self._table(spec)
        step = self._step_or_skip(spec, t, step)
        if step is None:
            return []
        return [
            self._replicated_record_of_all(
                spec,
                step,
                t,
                self._value(spec, leaves),
                value_key(leaves),
                extra=None if verified else {"verified": False},
            )
        ]

    def expire(self) -> list[Record]:
        now = self.clock()
        out: list[Record] = []
        while self._groups:
            gkey, group = next(iter(self._groups.items()))
            if now - group.first < self.group_timeout:
                break
            out += self._resolve(gkey, self._groups.pop(gkey))
        return out

    def finalize_all(self) -> list[Record]:
        out: list[Record] = []
        while self._groups:
            gkey, group = self._groups.popitem(last=False)
            out += self._resolve(gkey, group)
        return out + self.refused_records()

    def _refuse(self, name: str, step: int) -> list[Record]:
        # A traced step out of range (Python ints are checked at trace
        # time): a record with it would be one no reader can place. Counted
        # here, reported by refused_records() at the next flush/close.
        self._refused.setdefault(name, [0, step])[0] += 1
        return []

    def refused_records(self) -> list[Record]:
        """One ``pmaptap/refused`` meta record (and a warning) per tap name
        whose traced step was out of range since the last call."""
        refused, self._refused = self._refused, {}
        out = []
        for name, (count, example) in refused.items():
            log.warning(
                f"pmaptap refused {count} callback(s) of tap {name!r}: traced "
                f"step {example} is outside 0..2**63-1 (steps are int64 >= "
                "0); nothing was written for them."
            )
            out.append(
                meta_record(
                    count=count,
                    run=self.run,
                    name=META_REFUSED,
                    step=0,
                    process=self.process,
                    time=self.clock(),
                    host=self.host,
                    extra={"tap": name, "reason": "step out of range", "example_step": example},
                )
            )
        return out

    def dropped_record(self, new: int, total: int, policy: str) -> Record:
        """The meta record of overflow drops since the last one (written at
        the next flush/close; never dropped itself)."""
        return meta_record(
            count=new,
            run=self.run,
            name=META_DROPPED,
            step=total,
            process=self.process,
            time=self.clock(),
            host=self.host,
            attempt=self.attempt,
            extra={"dropped_total": total, "policy": policy},
        )

    # ------------------------------------------------------------ dedup
    def _resolve(self, gkey: tuple, group: _Group, local: set | None = None) -> list[Record]:
        """Records of one complete group. ``local``: the coordinates whose
        per-device records this process writes (None: all it received)."""
        copies = sorted(group.copies, key=lambda cp: cp.coords)
        spec = copies[0].spec
        step = gkey[1]
        if spec.shards is not None:
            return self._resolve_shards(spec, step, copies)
        by_value: OrderedDict[bytes, list[Copy]] = OrderedDict()
        for cp in copies:
            by_value.setdefault(cp.key, []).append(cp)
        if spec.site.dedup == "per_device" or (spec.site.dedup == "auto" and len(by_value) > 1):
            return [
                self._per_device_record_of_copy(spec, step, cp)
                for cp in copies
                if local is None or cp.coords in local
            ]
        divergent = len(by_value) > 1
        return [
            self._replicated_record_of_holders(spec, step, holders, divergent)
            for holders in by_value.values()
        ]

    def _value(self, spec: TapSpec, leaves: list[np.ndarray]) -> tuple[Any, Any, Any]:
        return encode_tree(spec.site.treedef, leaves, spec.site.summaries)

    # Record builders: one per kind (_per_device_record, _replicated_record,
    # dropped_record); the *_of_* helpers say what they build it from.
    def _per_device_record_of_copy(self, spec: TapSpec, step: int, cp: Copy) -> Record:
        """The per_device record of one device's copy (grouped path)."""
        return self._per_device_record(
            spec,
            step,
            self._value(spec, cp.leaves),
            cp.process,
            cp.device,
            dict(zip(spec.placement.axis_names, cp.coords)),
            self.clock(),
        )

    def _per_device_records_of_rows(
        self,
        spec: TapSpec,
        t: "_Table",
        step: int,
        encoded: list[tuple],
        texts: list[bytes] | None = None,
    ) -> list[Record]:
        """The per_device records of a gathered payload, one per local device
        (``encoded`` in ``t.local`` order). Every field but the step, the value
        and the time is the same at every step of a site, so each record is a
        copy of a per-device template built (and checked) once by
        ``_per_device_record``: about half the cost of building each record
        field by field, on the path of every gathered per_device tap."""
        # Fixed per site today; keyed anyway, so that a variant of a spec
        # (with_batch) could never take another's template.
        key = (spec.site.batch_dims, spec.site.summaries)
        templates = t.per_device_templates.get(key)
        if templates is None:
            templates = t.per_device_templates[key] = [
                dict(
                    self._per_device_record(
                        spec,
                        0,
                        (None, None, None),
                        t.processes[k],
                        t.devices[k],
                        t.coord_dicts[k],
                        0.0,
                    ).__dict__
                )
                for k in t.local
            ]
        now = self.clock()
        out = []
        for template, (value, dtype, shape) in zip(templates, encoded):
            out.append(_from_template(template, step, value, dtype, shape, now))
        if texts and len(texts) == len(out):
            # Scalars of one dtype (encode_rows' fast path): each line is the
            # site's per-device line with the step, value and time put in,
            # instead of a dict per record and one orjson call each. That
            # encoding was most of what a scalar per_device tap costs the
            # host above handing its values over (docs/performance.md, per_device).
            lkey = (key, out[0].dtype)
            pieces = t.per_device_lines.get(lkey)
            if pieces is None:
                pieces = t.per_device_lines[lkey] = [
                    _line_pieces(tpl, out[0].dtype, out[0].shape) for tpl in templates
                ]
            if all(pieces):
                step_b, time_b = b"%d" % int(step), ORJSON.dumps(round(now, 6))
                for r, (p0, p1, p2, p3), text in zip(out, pieces, texts):
                    r.__dict__["_line"] = b"".join((p0, step_b, p1, text, p2, time_b, p3))
        return out

    def _per_device_record(
        self,
        spec: TapSpec,
        step: int,
        encoded: tuple,
        process: int,
        device: int | None,
        coords: dict,
        now: float,
        index: Any = None,
    ) -> Record:
        """The per_device record builder."""
        return self._site_record(
            spec,
            step,
            "per_device",
            encoded,
            process,
            now,
            device=device,
            coords=coords,
            index=index,
        )

    def _replicated_record_of_all(
        self,
        spec: TapSpec,
        step: int,
        t: _Table,
        encoded: tuple,
        key: bytes,
        extra: dict | None = None,
    ) -> Record:
        """The replicated record of a value every copy of the tap site holds
        (agreement established). A copy of a per-site template, as
        ``_per_device_records_of_rows``: only the step, value, time and value
        hash change from step to step."""
        tkey = (
            spec.site.batch_dims,
            spec.site.summaries,
            None if extra is None else tuple(sorted(extra.items())),
        )
        template = t.replicated_templates.get(tkey)
        if template is None:
            template = t.replicated_templates[tkey] = dict(
                self._replicated_record(
                    spec, 0, (None, None, None), t.all_devices, t.all_processes, b"", extra=extra
                ).__dict__
            )
        r = object.__new__(Record)
        d = r.__dict__
        d.update(template)
        d["step"], d["time"] = step, self.clock()
        d["value"], d["dtype"], d["shape"] = encoded
        d["vhash"] = hashlib.blake2b(key, digest_size=8).hexdigest()
        return r

    def _replicated_record_of_holders(
        self, spec: TapSpec, step: int, holders: list[Copy], divergent: bool
    ) -> Record:
        """The replicated record of one value and the copies that hold it
        (all of a group, or one of a divergent group's values)."""
        extra = None
        if divergent:
            # Which coordinates held this value: the device may be unknown
            # (null) but the coordinates never are.
            extra = {
                "holders": [
                    {
                        "device": h.device,
                        "process": h.process,
                        "coords": dict(zip(spec.placement.axis_names, h.coords)),
                    }
                    for h in holders
                ]
            }
        return self._replicated_record(
            spec,
            step,
            self._value(spec, holders[0].leaves),
            tuple(h.device for h in holders),
            tuple(sorted({h.process for h in holders})),
            holders[0].key,
            divergent=divergent,
            extra=extra,
        )

    def _replicated_record(
        self,
        spec: TapSpec,
        step: int,
        encoded: tuple,
        devices: tuple,
        processes: tuple,
        key: bytes,
        *,
        divergent: bool = False,
        extra: dict | None = None,
        index: Any = None,
    ) -> Record:
        """The replicated record builder."""
        return self._site_record(
            spec,
            step,
            "replicated",
            encoded,
            self.process,
            self.clock(),
            replicas=len(devices),
            devices=devices,
            processes=processes,
            divergent=divergent,
            extra=extra,
            index=index,
            vhash=hashlib.blake2b(key, digest_size=8).hexdigest(),
        )

    def _site_record(
        self,
        spec: TapSpec,
        step: int,
        kind: str,
        encoded: tuple,
        process: int,
        now: float,
        **fields: Any,
    ) -> Record:
        """The fields every record of a tap site carries (its name, pass,
        batch dims, summaries; this run, host and attempt) plus the kind's
        own ``fields``."""
        value, dtype, shape = encoded
        if spec.shards is not None and spec.transport.layout is Layout.SHARDS:
            # A shard: the global shape its index lies in (pmaptap.assemble).
            # A whole value read from one device (Layout.WHOLE, a scalar) is
            # no shard and has none.
            shapes = spec.shards.shapes
            fields["global_shape"] = (
                list(shapes[0]) if len(shapes) == 1 else [list(s) for s in shapes]
            )
        return new_record(
            run=self.run,
            name=spec.name,
            step=step,
            kind=kind,
            value=value,
            dtype=dtype,
            shape=shape,
            process=process,
            time=now,
            host=self.host,
            batch_dims=spec.site.batch_dims,
            pass_=spec.site.pass_,
            summarized=bool(spec.site.summaries),
            attempt=self.attempt,
            **fields,
        )


def _from_template(
    template: dict, step: Any, value: Any, dtype: Any, shape: Any, now: float
) -> Record:
    """A per_device record: ``template`` (a record's fields) with its step,
    value, dtype, shape and time, without the dataclass constructor."""
    r = object.__new__(Record)
    d = r.__dict__
    d.update(template)
    d["step"], d["value"], d["dtype"], d["shape"], d["time"] = step, value, dtype, shape, now
    return r


# Sentinels put in a template record where the step, the value and the
# time go; each must appear exactly once, after its key, in the encoded line
# (a name or host that happens to contain one just keeps the ordinary path).
_STEP_SENTINEL = -4242424242424242
_VALUE_SENTINEL = "\x01pmaptap-value\x01"
_TIME_SENTINEL = -4242424242.424242


def _line_pieces(template: dict, dtype: Any, shape: Any) -> tuple[bytes, ...] | None:
    """The encoded line of a per_device record built from ``template``, cut
    into the four pieces around its step, value and time, or None when it
    cannot be cut unambiguously (then records are encoded one by one).
    Cut from ``Record.encode`` itself, so the joined line is byte for byte
    the one that encoding would write (tests/trace/test_fast_lines.py)."""
    if ORJSON is None:
        return None
    line = _from_template(
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
