"""Per-process collection of per-device copies, and the dedup policies.

Pure logic, no threads: ``Aggregator.add`` takes one callback's payload
(already converted to NumPy by the aggregator thread) and returns the records
that became complete. Pending copies are those of one (name, step, pass) on
this process whose other copies are still arriving (``_Pending``); they are
complete when every local device that runs the tap has reported, when the
same device reports that key again, when they have waited ``group_timeout``
seconds (a tap under a ``cond`` that fired on some devices only), or at flush.
(Not a ``pmaptap.group()``: that is several taps sent in one callback.)
"""

from __future__ import annotations

import time
import weakref
from collections import OrderedDict
from typing import Callable

import numpy as np

from pmaptap._common.fingerprint import FingerprintSpec
from pmaptap._common.spec import LEADER_COPY, GroupSpec, Layout, PayloadSpec, TapSpec
from pmaptap._host.pipeline import fingerprints
from pmaptap._host.pipeline import shards as shard_host
from pmaptap._host.pipeline.encode import encode_rows, value_key
from pmaptap._host.pipeline.payload import (
    Copy,
    _flat,
    _Pending,
    _rows_identical,
    _step,
    iteration_of,
    restore,
    unpack,
)
from pmaptap._host.pipeline.records import RecordFactory, _Table
from pmaptap._log import log
from pmaptap.tapfile.record import (
    COPIES_SEEN,
    MAX_STEP,
    META_DROPPED,
    META_REFUSED,
    Record,
    meta_record,
)


class Aggregator(RecordFactory):
    def __init__(
        self,
        run: str,
        process: int,
        host: str,
        *,
        group_timeout: float = 5.0,
        clock: Callable[[], float] = time.time,
        attempt: int = 0,
        refuse_automatic_steps: bool = False,
    ) -> None:
        self.run, self.process, self.host = run, process, host
        self.attempt = attempt
        # A resumed session (Session(resume=True)): a tap with no step= was
        # numbered from 0 again, misfiling the replay; refused, never written
        # (counted per tap name, reported at the next flush/close).
        self.refuse_automatic_steps = refuse_automatic_steps
        self._automatic_refused: dict[str, int] = {}
        self.group_timeout = group_timeout
        self.clock = clock
        self._counters: dict[tuple, int] = {}
        # A looped tap's payload being added: its loop iteration (see
        # add_payload), else None. Per automatic-step counter of a looped
        # tap, the iterations seen in its current step (_count).
        self._it: tuple | None = None
        self._seen: dict[tuple, set] = {}
        # (name, step, pass) -> the copies awaiting comparison: record_key
        # (format.py) less what one aggregator shares (run, attempt) and what
        # the copies carry (a shard's index): the records do not exist yet.
        self._pending: OrderedDict[tuple, _Pending] = OrderedDict()
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
            step = self._count((spec.name, spec.site.pass_, t.counter_keys[k]))
            if step % spec.site.every:
                return []
        if spec.placement.local_copies == 1 and not self._pending:
            # Fast path (plain jit / eager): a value of one copy is complete now.
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
        pkey = self._pkey(spec.name, int(step), spec.site.pass_)
        pending = self._pending.get(pkey)
        if pending is not None and any(
            cp.coords == c and cp.device == device for cp in pending.copies
        ):
            # Same device again for this key (two tap sites sharing a name,
            # or a fixed Python step in a loop): complete the earlier copies.
            out += self._resolve(pkey, self._pending.pop(pkey))
            pending = None
        if pending is None:
            pending = self._pending[pkey] = _Pending(self.clock(), [])
        pending.copies.append(copy)
        if len(pending.copies) >= spec.placement.local_copies:
            out += self._resolve(pkey, self._pending.pop(pkey))
        return out

    def add_callback(self, spec: PayloadSpec, arrays: list[np.ndarray]) -> list[Record]:
        """One host callback's arrays as they travelled: sub-byte leaves are
        narrowed back to their own dtype first (``spec.restore`` indexes the
        operands after a partitioned payload's leading partition number)."""
        return self.add_payload(spec, restore(spec, arrays))

    def add_payload(self, spec: PayloadSpec, arrays: list[np.ndarray]) -> list[Record]:
        """Dispatch one callback payload by its layout (see _trace/layouts.py)."""
        if isinstance(spec, FingerprintSpec):
            return fingerprints.add(self, spec, arrays)  # pmaptap.fingerprint
        if isinstance(spec, GroupSpec):
            return self._add_group(spec, arrays)
        if not spec.site.iterations:
            return self._add_tap(spec, arrays)
        # A tap in a loop body: its iteration travels after the mesh
        # coordinates (_trace/iteration.py). It keys the copies compared
        # (_pkey) and the automatic steps (_count), and every record made.
        it = iteration_of(spec, arrays)
        self._it = it
        try:
            out = self._add_tap(spec, arrays)
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

    def _count(self, ckey: tuple) -> int:
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

    def _add_tap(self, spec: TapSpec, arrays: list[np.ndarray]) -> list[Record]:
        if self.refuse_automatic_steps and not spec.site.explicit_step:
            name = spec.site.name
            self._automatic_refused[name] = self._automatic_refused.get(name, 0) + 1
            return []
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
            # partitioned, one whole copy came (big leaves: statistics made on device).
            return self.add(spec, coords, step, arrays[2:])
        if layout is Layout.GATHERED:
            return self._add_gathered(spec, step, arrays[2:])
        if layout in (Layout.VERIFIED, *LEADER_COPY):
            # PROVEN: replication shown at trace time counts as verified.
            return self._add_one_copy(spec, step, arrays[2:])
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
        device = place.devices[k]
        if not site.explicit_step:
            # Counted per device: each device runs every execution once, in order.
            step = self._count((site.name, site.pass_, device))
            if step % site.every:
                return []
        leaves, as_statistics, index = shard_host.shard_leaves(site, place, k, list(arrays[3:]))
        if site.dedup == "per_device":
            # Nothing to compare: the shard's record now, without waiting
            # for the step's other shards.
            return [
                self._per_device_record_of_shard_now(spec, step, k, index, leaves, as_statistics)
            ]
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
            index=index,
            slice_key=tuple(place.holders(k)),
            as_statistics=as_statistics,
        )
        out: list[Record] = []
        pkey = self._pkey(site.name, step, site.pass_)
        pending = self._pending.get(pkey)
        if pending is not None and any(cp.device == device for cp in pending.copies):
            out += self._resolve(pkey, self._pending.pop(pkey))
            pending = None
        if pending is None:
            pending = self._pending[pkey] = _Pending(self.clock(), [])
        pending.copies.append(copy)
        if len(pending.copies) >= max(1, place.local_expected()):
            out += self._resolve(pkey, self._pending.pop(pkey))
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
            step = self._count((site.name, site.pass_, ()))
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
                    self._replicated_record(
                        spec,
                        step,
                        self._shard_value(spec, alike[0]),
                        tuple(h.device for h in alike),
                        tuple(sorted({h.process for h in alike})),
                        alike[0].key,
                        divergent=True,
                        extra=extra,
                        index=alike[0].index,
                    )
                )
        return out

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
            if spec.gathered and member.transport.layout in LEADER_COPY:
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
            now = [self._count(k) for k in keys]
        else:
            get = self._counters.get
            now = [get(k, 0) for k in keys]
            self._counters.update(zip(keys, [s + 1 for s in now]))
            if self._seen:  # as in _count
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
        the output transport's per-device rows do (``add``), so both
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
            out += self._add_pending(
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
            texts: list[bytes] = []
            encoded = encode_rows(
                spec.site.treedef, stacked, t.local, spec.site.as_statistics, texts=texts
            )
            return self._per_device_records_of_rows(spec, t, step, encoded, texts)
        if _rows_identical(stacked):
            # Every copy agrees (the common case): one record held by all.
            row0 = [a[0] for a in stacked]
            encoded = encode_rows(spec.site.treedef, stacked, [0], spec.site.as_statistics)[0]
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
        return [
            self._replicated_record_of_all(
                spec, step, t, self._value(spec, leaves), value_key(leaves)
            )
        ]

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
        """Callbacks refused per tap name since the last call (taps with no
        step= in a resumed session)."""
        refused, self._automatic_refused = self._automatic_refused, {}
        return refused

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

    def _add_pending(self, pkey: tuple, copy: Copy, expected: int) -> list[Record]:
        """Hold ``copy`` with the other copies of ``pkey`` that arrived;
        their records once ``expected`` copies are there (or the same device
        reports ``pkey`` again). Fingerprints sent by each device
        (_host/fingerprints.py) wait here."""
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
                self._per_device_record_of_copy(spec, step, cp)
                for cp in copies
                if local is None or cp.coords in local
            ]
        divergent = len(by_value) > 1
        return [
            self._replicated_record_of_holders(spec, step, holders, divergent)
            for holders in by_value.values()
        ]
