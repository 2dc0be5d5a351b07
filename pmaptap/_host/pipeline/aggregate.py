"""The second stage of the aggregation path (payload.py -> here ->
records.py -> encode.py; docs/architecture.md, "From pmaptap.tap to the
file", step 6): per-device copies, their steps, and the dedup policies.

Pure logic, no threads: ``Aggregator.add_payload`` takes one callback's
parts (payload.split) and returns the records that became complete. The
copies of one (name, step, pass) on this process (``_Pending``) are
complete when every local device that runs the tap has reported, when the
same device reports that key again, after ``group_timeout`` (a ``cond``
that fired on some devices only), or at flush; compared by ``value_key``.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from pmaptap._common.fingerprint import FingerprintSpec
from pmaptap._common.spec import LEADER_COPY, Layout, TapSpec
from pmaptap._host.options import DEFAULTS
from pmaptap._host.pipeline import fingerprints
from pmaptap._host.pipeline import shards as shard_host
from pmaptap._host.pipeline.payload import Copy, Part, _Pending
from pmaptap._host.pipeline.records import RecordBuilder
from pmaptap._log import log
from pmaptap.tapfile.record import COPIES_SEEN, MAX_STEP, META_REFUSED, Record
from pmaptap.tapfile.source import INLINE_MAX_BYTES


def value_key(leaves: list[np.ndarray]) -> bytes:
    """The bitwise identity of a value: each leaf's dtype, shape and bytes
    (a leaf of more than ``INLINE_MAX_BYTES``: a 256-bit blake2b digest of
    its bytes, read in place, instead of a copy of them: a replicated 2 MiB
    activation was copied a second time here, then hashed whole anyway).
    Copies are compared by it, and a replicated record's ``vhash`` is its
    blake2b digest, for a session's records and a ``Writer``'s alike: equal
    values of one dtype hash alike, whichever wrote them."""
    parts = []
    for a in leaves:
        parts.append(f"{a.dtype.str}{a.shape}|".encode())
        if a.nbytes > INLINE_MAX_BYTES and not _padded(a.dtype):
            raw = np.ascontiguousarray(a)  # no copy unless it is not C order
            parts.append(hashlib.blake2b(raw.reshape(-1).view(np.uint8), digest_size=32).digest())
        else:
            parts.append(_value_bytes(a))
    return b"".join(parts)


# x87 extended precision (longdouble on x86): 10 bytes of value in a
# 16-byte slot whose other 6 bytes are whatever was in memory, so two equal
# values can differ there; only the 10 are the value.
_X87 = np.finfo(np.longdouble).nmant == 63 and np.dtype(np.longdouble).itemsize == 16


def _padded(dt: np.dtype) -> bool:
    return _X87 and dt.kind in "fc" and dt.itemsize == (16 if dt.kind == "f" else 32)


def _value_bytes(a: np.ndarray) -> bytes:
    raw = np.ascontiguousarray(a)
    if _padded(raw.dtype):
        return raw.view(np.uint8).reshape(-1, 16)[:, :10].tobytes()
    return raw.tobytes()


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


class Aggregator:
    def __init__(
        self,
        records: RecordBuilder,
        *,
        group_timeout: float = DEFAULTS.group_timeout,
        refuse_automatic_steps: bool = False,
    ) -> None:
        # Every record is made by the pipeline's builder (records.py), its
        # clock the one pending copies wait by.
        self.records = records
        self.process = records.process
        self.clock = records.clock
        # A resumed session (Session(resume=True)): a tap with no step= was
        # numbered from 0 again, misfiling the replay; refused, never written
        # (counted per tap name, reported at the next flush/close).
        self.refuse_automatic_steps = refuse_automatic_steps
        self._automatic_refused: dict[str, int] = {}
        self.group_timeout = group_timeout
        self._counters: dict[tuple, int] = {}
        # A looped tap's part being added: its loop iteration (see
        # add_payload), else None. Per automatic-step counter of a looped
        # tap, the iterations seen in its current step (count).
        self._it: tuple | None = None
        self._seen: dict[tuple, set] = {}
        # (name, step, pass) -> the copies awaiting comparison: record_key
        # (format.py) less what one aggregator shares (run, attempt) and what
        # the copies carry (a shard's index): the records do not exist yet.
        self._pending: OrderedDict[tuple, _Pending] = OrderedDict()
        self._tables: dict[tuple, _Table] = {}
        # Payloads refused for a traced step outside 0..2**63-1, per tap
        # name: [count, first bad step]; reported by refused_records().
        self._refused: dict[str, list[int]] = {}

    # ------------------------------------------------------------ input
    def add_payload(self, parts: list[Part]) -> list[Record]:
        """The records one callback's parts (payload.split) completed."""
        out: list[Record] = []
        for part in parts:
            out += self._add_part(part)
        return out

    def _add_part(self, part: Part) -> list[Record]:
        spec = part.spec
        if isinstance(spec, FingerprintSpec):
            return fingerprints.add(self, part)  # pmaptap.fingerprint
        if self.refuse_automatic_steps and not spec.site.explicit_step:
            name = spec.site.name
            self._automatic_refused[name] = self._automatic_refused.get(name, 0) + 1
            return []
        if not spec.site.iterations:
            return self._add_tap(spec, part)
        # A tap in a loop body: its iteration keys the copies compared
        # (_pkey) and the automatic steps (count), and every record made.
        it = part.iteration
        self._it = it
        try:
            out = self._add_tap(spec, part)
        finally:
            self._it = None
        if it is not None:
            Record.set_iteration(out, it)
        return out

    def _pkey(self, name: str, step: int, pass_: str) -> tuple:
        """The key of one value's pending copies: (name, step, pass), and
        the loop iteration of a looped tap's."""
        if self._it is None:
            return (name, step, pass_)
        return (name, step, pass_, self._it)

    def count(self, ckey: tuple) -> int:
        """The automatic step of one more execution counted by ``ckey``.
        A looped tap's counts calls of the step, not iterations: its step
        moves on when an iteration comes again (a new call of the loop),
        whatever the loop's trip count or the iterations a ``cond`` skips."""
        step = self._counters.get(ckey, 0)
        it = self._it
        if it is not None:
            seen = self._seen.get(ckey)
            if seen is not None and it not in seen and step > 0:
                seen.add(it)
                return step - 1
            self._seen[ckey] = {it}
        elif self._seen:
            # A loop-free execution of the name ends its loop's step.
            self._seen.pop(ckey, None)
        self._counters[ckey] = step + 1
        return step

    def _add_tap(self, spec: TapSpec, part: Part) -> list[Record]:
        if spec.shards is not None:
            if spec.transport.layout is Layout.WHOLE:
                return self._add_whole(spec, part)
            return self._add_shard(spec, part)
        step = part.step
        if spec.site.explicit_step and not 0 <= step <= MAX_STEP:
            return self.refuse(spec.site.name, step)
        layout = spec.transport.layout
        if layout in (Layout.COPY, Layout.SHARDS, Layout.WHOLE):
            # SHARDS / WHOLE without a placement: the computation was not
            # partitioned, one whole copy came (big leaves: statistics made on device).
            return self._add_copy(spec, part.k, step, part.leaves)
        if layout is Layout.GATHERED:
            return self._add_gathered(spec, step, part.leaves)
        if layout in (Layout.VERIFIED, *LEADER_COPY):
            # PROVEN: replication shown at trace time counts as verified.
            return self._add_one_copy(spec, step, part.leaves)
        raise ValueError(f"unknown payload layout {layout!r}")

    def _add_copy(self, spec: TapSpec, k: int, step: int, leaves: list[np.ndarray]) -> list[Record]:
        """One device's copy: the device at flat coordinates ``k``."""
        t = self._table(spec)
        c, device = t.coords[k], t.devices[k]
        if not spec.site.explicit_step:
            # Automatic step: the k-th execution of this tap name on this
            # device. Callbacks of one device arrive in execution order.
            step = self.count((spec.name, spec.site.pass_, t.counter_keys[k]))
            if step % spec.site.every:
                return []
        if spec.placement.local_copies == 1 and not self._pending:
            # Fast path (plain jit / eager): a value of one copy is complete now.
            if spec.site.dedup == "per_device":
                return [
                    self.records.per_device(
                        spec, int(step), leaves, t.processes[k], device, t.coord_dicts[k]
                    )
                ]
            copy = Copy(spec, c, device, t.processes[k], leaves, value_key(leaves))
            return [self.records.replicated_of_holders(spec, int(step), [copy], False)]
        copy = Copy(spec, c, device, t.processes[k], leaves, value_key(leaves))
        pkey = self._pkey(spec.name, int(step), spec.site.pass_)
        return self.hold(pkey, copy, spec.placement.local_copies)

    def _add_shard(self, spec: TapSpec, part: Part) -> list[Record]:
        """One shard of a partitioned value: partition ``part.k``, with
        ``spec.shards`` telling where partition k lives."""
        place, site = spec.shards, spec.site
        k, step = part.k, part.step
        if site.explicit_step and not 0 <= step <= MAX_STEP:
            return self.refuse(site.name, step)
        if place.padding(k):
            return []  # an uneven sharding's padding tile: no element of the value
        device = place.devices[k]
        if not site.explicit_step:
            # Counted per device: each device runs every execution once, in order.
            step = self.count((site.name, site.pass_, device))
            if step % site.every:
                return []
        leaves, as_statistics, index = shard_host.shard_leaves(site, place, k, part.leaves)
        if site.dedup == "per_device":
            # Nothing to compare: the shard's record now, without waiting
            # for the step's other shards.
            return [
                self.records.per_device_of_shard_now(spec, step, k, index, leaves, as_statistics)
            ]
        copy = Copy(
            spec,
            (k,),
            device,
            place.processes[k],
            leaves,
            value_key(leaves),
            partition=k,
            index=index,
            slice_key=tuple(place.holders(k)),
            as_statistics=as_statistics,
        )
        # A partition is one device: its coordinates are (k,).
        return self.hold(
            self._pkey(site.name, step, site.pass_), copy, max(1, place.local_expected())
        )

    def _add_whole(self, spec: TapSpec, part: Part) -> list[Record]:
        """A scalar tap under plain jit on several devices (Layout.WHOLE),
        partition ``part.k``. Every device holds the value;
        only partition 0's copy is read (in a partitioned group every device
        carries one: the others are skipped here), and the record names every
        device of the computation and says one copy was seen."""
        place, site = spec.shards, spec.site
        if part.k != 0:
            return []
        step = part.step
        if site.explicit_step and not 0 <= step <= MAX_STEP:
            return self.refuse(site.name, step)
        if not site.explicit_step:
            # One counter, as for any tap outside a mapping (see _Table).
            step = self.count((site.name, site.pass_, ()))
            if step % site.every:
                return []
        leaves = part.leaves
        if site.dedup == "per_device":
            # The one copy read is device 0's: exactly that device's record.
            return [
                self.records.per_device(
                    spec, step, leaves, place.processes[0], place.devices[0], place.coords[0]
                )
            ]
        return [
            self.records.replicated(
                spec,
                step,
                leaves,
                site.as_statistics,
                place.devices,
                tuple(sorted(set(place.processes))),
                value_key(leaves),
                extra={COPIES_SEEN: 1},
            )
        ]

    def _resolve_shards(self, spec: TapSpec, step: int, copies: list[Copy]) -> list[Record]:
        """Records of one step's shards on this process (see shards.py)."""
        place, dedup = spec.shards, spec.site.dedup
        out: list[Record] = []
        for holders, cps in shard_host.by_slice(copies).items():
            if dedup == "per_device":
                out += [self.records.per_device_of_shard(spec, step, cp) for cp in cps]
                continue
            by_value: OrderedDict[bytes, list[Copy]] = OrderedDict()
            for cp in cps:
                by_value.setdefault(cp.key, []).append(cp)
            if len(by_value) == 1:
                cp = cps[0]
                if dedup == "auto" and len(holders) == 1:
                    out.append(self.records.per_device_of_shard(spec, step, cp))
                    continue
                # Every holder in the job, this process's ones compared; the
                # other processes' copies are compared in the file (vhash).
                out.append(
                    self.records.replicated(
                        spec,
                        step,
                        cp.leaves,
                        cp.as_statistics,
                        tuple(place.devices[j] for j in holders),
                        tuple(sorted({place.processes[j] for j in holders})),
                        cp.key,
                        index=cp.index,
                    )
                )
                continue
            if dedup == "auto":
                out += [self.records.per_device_of_shard(spec, step, cp) for cp in cps]
                continue
            for alike in by_value.values():
                extra = {
                    "holders": [
                        {
                            "device": h.device,
                            "process": h.process,
                            "coords": place.coords[h.partition],
                        }
                        for h in alike
                    ]
                }
                out.append(
                    self.records.replicated(
                        spec,
                        step,
                        alike[0].leaves,
                        alike[0].as_statistics,
                        tuple(h.device for h in alike),
                        tuple(sorted({h.process for h in alike})),
                        alike[0].key,
                        divergent=True,
                        extra=extra,
                        index=alike[0].index,
                    )
                )
        return out

    def _table(self, spec: TapSpec) -> "_Table":
        key = (spec.site.tap_id, spec.placement.axis_sizes)
        t = self._tables.get(key)
        if t is None:
            t = self._tables[key] = _Table(spec, self.process)
        return t

    def _auto_step(self, spec: TapSpec, t: "_Table") -> int | list[int]:
        """Automatic step for a payload that stands for every local device:
        each of them executed the tap once more. The step they share, or,
        where they ran it unequally often (a pmap called on fewer devices,
        then on more), each local device's own step, in ``t.local`` order."""
        keys = t.auto_keys
        if keys is None:
            # Built once per site: this runs for every gathered payload (the
            # tuples cost more than the counting on a scalar tap's path).
            keys = t.auto_keys = [(spec.name, spec.site.pass_, t.counter_keys[k]) for k in t.local]
        if not keys:
            return 0
        if self._it is not None:
            now = [self.count(k) for k in keys]
        else:
            get = self._counters.get
            now = [get(k, 0) for k in keys]
            self._counters.update(zip(keys, [s + 1 for s in now]))
            if self._seen:  # as in count
                for k in keys:
                    self._seen.pop(k, None)
        step = now[0]
        return step if now.count(step) == len(now) else now

    def _step_or_skip(self, spec: TapSpec, t: "_Table", step: int) -> int | list[int] | None:
        """The payload's step (automatic if not explicit), or None when
        ``every`` skips it on the host; a list where the local devices are
        at different automatic steps (see _auto_step)."""
        if spec.site.explicit_step:
            return step
        step = self._auto_step(spec, t)
        if type(step) is int:
            return None if step % spec.site.every else step
        return step

    def _add_by_device_step(
        self,
        spec: TapSpec,
        t: "_Table",
        steps: list[int],
        rows: list[list[np.ndarray]],
        key: bytes | None = None,
    ) -> list[Record]:
        """A gathered payload whose local devices are at different automatic
        steps: each local device's copy (``rows`` and ``steps`` in
        ``t.local`` order) waits with the other copies of its own step, as
        the output transport's per-device rows do (``_add_copy``), so both
        transports write the same records. The other processes' copies are
        theirs to count and write. ``key``: every row's value key, where
        one copy stands for all (a leader's copy)."""
        every = spec.site.every
        out: list[Record] = []
        for k, step, row in zip(t.local, steps, rows):
            if step % every:
                continue
            ck = value_key(row) if key is None else key
            copy = Copy(spec, t.coords[k], t.devices[k], t.processes[k], row, ck)
            out += self.hold(
                self._pkey(spec.name, step, spec.site.pass_), copy, spec.placement.local_copies
            )
        return out

    def _add_gathered(self, spec: TapSpec, step: int, stacked: list[np.ndarray]) -> list[Record]:
        t = self._table(spec)
        step = self._step_or_skip(spec, t, step)
        if step is None:
            return []
        if type(step) is list:
            return self._add_by_device_step(
                spec, t, step, [[a[k] for a in stacked] for k in t.local]
            )
        if spec.site.dedup == "per_device":
            # This process writes its own devices only; the other processes'
            # leaders write theirs. No value comparison needed.
            return self.records.per_device_rows(spec, t, step, stacked)
        if _rows_identical(stacked):
            # Every copy agrees (the common case): one record held by all.
            key = value_key([a[0] for a in stacked])
            return [self.records.replicated_of_all(spec, step, t, key, stacked=stacked)]
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
            self._pkey(spec.name, step, spec.site.pass_),
            _Pending(self.clock(), copies),
            local={t.coords[k] for k in t.local},
        )

    def _add_one_copy(self, spec: TapSpec, step: int, leaves: list[np.ndarray]) -> list[Record]:
        t = self._table(spec)
        step = self._step_or_skip(spec, t, step)
        if step is None:
            return []
        if type(step) is list:
            # The one copy stands for each local device's copy.
            return self._add_by_device_step(spec, t, step, [leaves] * len(step), value_key(leaves))
        return [self.records.replicated_of_all(spec, step, t, value_key(leaves), leaves=leaves)]

    def expire(self) -> list[Record]:
        now = self.clock()
        out: list[Record] = []
        while self._pending:
            pkey, pending = next(iter(self._pending.items()))
            if now - pending.first < self.group_timeout:
                break
            out += self._resolve(pkey, self._pending.pop(pkey))
        return out

    def finalize_all(self) -> list[Record]:
        out: list[Record] = []
        while self._pending:
            pkey, pending = self._pending.popitem(last=False)
            out += self._resolve(pkey, pending)
        return out + self.refused_records()

    def take_automatic_refused(self) -> dict[str, int]:
        """Callbacks refused per tap name since the last call, which the
        aggregator thread makes at each flush/close (taps with no step= in a
        resumed session)."""
        refused, self._automatic_refused = self._automatic_refused, {}
        return refused

    def refuse(self, name: str, step: int) -> list[Record]:
        """Refuse a payload whose traced step is out of range (Python ints
        are checked at trace time): a record with it would be one no reader
        can place. Counted here, reported by refused_records() at the next
        flush/close."""
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
            # attempt=0, as these records have always been written: without
            # the "attempt" field, whatever the session's attempt.
            extra = {"tap": name, "reason": "step out of range", "example_step": example}
            out.append(self.records.meta(META_REFUSED, count, 0, extra, attempt=0))
        return out

    def hold(self, pkey: tuple, copy: Copy, expected: int) -> list[Record]:
        """Hold ``copy`` with the other copies of ``pkey`` that arrived;
        their records once ``expected`` copies are there (or the same device
        reports ``pkey`` again). Fingerprints sent by each device
        (fingerprints.py) wait here."""
        out: list[Record] = []
        pending = self._pending.get(pkey)
        if pending is not None and any(
            cp.coords == copy.coords and cp.device == copy.device for cp in pending.copies
        ):
            out += self._resolve(pkey, self._pending.pop(pkey))
            pending = None
        if pending is None:
            pending = self._pending[pkey] = _Pending(self.clock(), [])
        pending.copies.append(copy)
        if len(pending.copies) >= expected:
            out += self._resolve(pkey, self._pending.pop(pkey))
        return out

    # ------------------------------------------------------------ dedup
    def _resolve(self, pkey: tuple, pending: _Pending, local: set | None = None) -> list[Record]:
        """Records of one value's copies, all arrived (or waited for long
        enough). ``local``: the coordinates whose
        per-device records this process writes (None: all it received)."""
        if isinstance(pending.copies[0].spec, FingerprintSpec):
            return fingerprints.resolve(self, pkey, pending)
        out = self._resolve_copies(pkey, pending, local)
        if len(pkey) > 3:  # a looped tap's (_pkey), resolved at any time
            Record.set_iteration(out, pkey[3])
        return out

    def _resolve_copies(
        self, pkey: tuple, pending: _Pending, local: set | None = None
    ) -> list[Record]:
        copies = sorted(pending.copies, key=lambda cp: cp.coords)
        spec = copies[0].spec
        step = pkey[1]
        if spec.shards is not None:
            return self._resolve_shards(spec, step, copies)
        by_value: OrderedDict[bytes, list[Copy]] = OrderedDict()
        for cp in copies:
            by_value.setdefault(cp.key, []).append(cp)
        if spec.site.dedup == "per_device" or (spec.site.dedup == "auto" and len(by_value) > 1):
            return [
                self.records.per_device_of_copy(spec, step, cp)
                for cp in copies
                if local is None or cp.coords in local
            ]
        divergent = len(by_value) > 1
        return [
            self.records.replicated_of_holders(spec, step, holders, divergent)
            for holders in by_value.values()
        ]
