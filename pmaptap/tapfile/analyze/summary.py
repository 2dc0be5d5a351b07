"""Per-tap summaries: ``tap_summaries(records)`` for code,
``summarize_file(path)`` for ``pmaptap summary`` (streaming).

A tap's ``_TapAcc`` grows with its distinct steps and devices, never with
its values, and merges exactly (``Summarizer.absorb``: ``--jobs N`` prints
what ``--jobs 1`` prints). So nothing here depends on the order records
come in except through their positions (``pos``, comparable across pieces).
Sums are exact (``_exact``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections import Counter, defaultdict
from functools import partial
from itertools import compress
from operator import attrgetter, eq, itemgetter
from typing import Any, Iterable

import msgspec

from pmaptap.errors import NeedSerial
from pmaptap.tapfile.analyze.fingerprints import FingerprintAcc
from pmaptap.tapfile.analyze.validate import _canonical, _coords_key, step_gaps
from pmaptap.tapfile.read import (
    Attempts,
    DivergenceIndex,
    Filter,
    Restarts,
    attempt_of,
    id_order,
    leaves,
    scalar,
    scan,
    sorted_ids,
)
from pmaptap.tapfile.record import (
    FINGERPRINT,
    NONFINITE,
    UNSET,
    AnyRecord,
    PerDevice,
    Replicated,
    from_dict,
    holder_ids,
    index_key,
    part_key,
    shown_name,
)
from pmaptap.tapfile.source import Run, collector_paused, iter_record_batches


@dataclasses.dataclass
class TapSummary:
    run: str
    name: str
    kinds: tuple[str, ...]
    records: int
    first_step: int
    last_step: int
    processes: tuple[int, ...]
    devices: tuple[int | None, ...]
    last: tuple[float, ...]  # scalar values at the last step (distinct)
    min: float | None  # over finite scalar values
    max: float | None
    mean: float | None
    nonfinite: int  # NaN/inf scalar values
    nonscalar: int  # records whose value is not one number
    divergent_steps: tuple[int, ...]
    stride: int  # gcd of step differences (every=N)
    gaps: tuple[tuple[int, int], ...]
    missing: int  # steps missing inside the range
    incomplete_steps: tuple[int, ...]  # per_device steps lacking some devices
    duplicates: int
    # The lowest step holding a NaN/inf (in a scalar or an array element) and
    # the devices that held it there (empty for a replicated value).
    first_nonfinite_step: int | None = None
    first_nonfinite_devices: tuple[int | None, ...] = ()
    # Array taps: the L2 norm of the finite elements at the last step (the
    # largest of the devices'); min/max/mean then cover every finite element.
    norm: float | None = None
    # dedup="auto" taps: steps whose copies differed before the tap ever
    # agreed. That is per-device data, not a divergence.
    per_device_steps: tuple[int, ...] = ()
    restarts: str = ""  # the run's attempts ("2 attempts; restarted at step 5")
    fingerprint: str = ""  # pmaptap.fingerprint: where copies first differed, the suspects
    # The tap the row is of, as ``name`` shows it: its name (a looped tap's
    # iteration's: ``act[3]``), or for a pytree's leaf row (``stats/mean``)
    # the pytree's (``stats``), whose records it shares.
    tap: str = ""


# Devices below this are kept as bits (per step and lane, a bytearray); a
# device at other coordinates than its first ones, or any other id, as a
# (step, device, coordinates key) of its own.
_BIT_DEVICES = 1 << 16
# Finite values summed once this many are waiting (see _exact).
_FOLD = 4096


def _exact(xs: list) -> list[float]:
    """Floats whose exact sum is ``xs``'s, each math.fsum of what is left (so
    they are few); a sum beyond the float range is that infinity."""
    parts: list[float] = []
    xs = list(xs)
    try:
        while True:
            s = math.fsum(xs)
            if s == 0.0:
                return parts
            parts.append(s)
            xs.append(-s)
    except OverflowError:
        return [math.copysign(math.inf, sum(map(float, xs)))]


def _union(a: set, b: Iterable, ordered: bool) -> None:
    """``a |= b``. A set keeps the first of equal ids (1, 1.0, True): unless
    ``ordered``, an id in both with another type has no order to go by."""
    if not ordered:
        mine = {x: x for x in a}
        for x in b:
            y = mine.get(x, x)
            if type(y) is not type(x):
                raise NeedSerial(f"id {x!r} written as {type(x).__name__} and {type(y).__name__}")
    a.update(b)


def _or(a: bytes, b: bytes) -> bytearray:
    n = max(len(a), len(b))
    x = int.from_bytes(a, "little") | int.from_bytes(b, "little")
    return bytearray(x.to_bytes(n, "little"))


@dataclasses.dataclass(slots=True)
class _Lane:
    """A tap's per-device keys of one (pass, attempt): per step, a bit per
    device at its usual coordinates (bytearray), and the other keys."""

    bits: dict[int, bytearray] = dataclasses.field(default_factory=dict)
    keys: set[tuple] = dataclasses.field(default_factory=set)


class _TapAcc:
    """One tap's summary state."""

    def __init__(self, run: str, name: str, iteration: Any = None, tap: str | None = None) -> None:
        # A looped tap: one accumulator per ``iteration``; ``tap``: as TapSummary.tap.
        self.run, self.name, self.iteration = run, name, iteration
        self.tap = name if tap is None else tap
        self.kinds: set = set()
        self.records = 0
        self.steps: set = set()  # of replicated and meta records
        self.processes: set = set()
        self.devices: set = set()
        # (devices?, text): holders written as ranges text, expanded once,
        # in result(), so a record of a large job costs what one of 2 does.
        self.holder_texts: set = set()
        self.last_step: Any = None  # the highest step with a scalar
        self.last_vals: list = []  # its scalar values, and their positions
        self.last_at: list = []
        # Finite scalar values waiting to be summed; the exact sum of those
        # summed, their count, min and max.
        self.vals: list = []
        self.sums: list[float] = []
        self.count = 0
        self.lo = math.inf
        self.hi = -math.inf
        self.nonfinite = self.nonscalar = 0
        self.divergent: set = set()
        self.rep_keys: set[tuple] = set()  # (step, pass, attempt[, shard]) replicated
        # Per-device keys by (pass, attempt); each device's usual coordinates.
        self.lanes: defaultdict[tuple, _Lane] = defaultdict(_Lane)
        self.dev_coords: dict = {}
        self.attempt_of_step: dict = {}  # per-device steps: the latest attempt
        self.dup_keys: set[tuple] = set()
        self.duplicates = 0
        self.first_bad: Any = None  # first step with a NaN/inf
        self.first_bad_devs: set = set()
        # Finite array elements: count and each record's sum; the norm at the highest step.
        self.a_count = 0
        self.a_sums: list = []
        self.norm_step: Any = None
        self.norm: float | None = None
        self.fp = FingerprintAcc()  # fingerprint records' suspects
        # Whether a record with a non-int id (1.0, true) was added: of equal
        # ids the sets keep the first met, which shardwise.py cannot order.
        self.odd_ids = False

    def holders(self, devices: bool, ids: Any) -> None:
        """A record's ``devices`` or ``processes`` (ranges text kept as text)."""
        if ids:
            if type(ids) is str:
                self.holder_texts.add((devices, ids))
            else:
                (self.devices if devices else self.processes).update(ids)

    def _fold(self) -> None:
        vals = self.vals
        if vals:
            self.lo = min(self.lo, min(vals))
            self.hi = max(self.hi, max(vals))
            self.count += len(vals)
        self.sums = _exact(self.sums + vals + self.a_sums)
        self.vals = []
        self.a_sums = []

    def _last(self, step: Any, x: Any, pos: Any) -> None:
        last = self.last_step
        if last is None or step > last:
            self.last_step, self.last_vals, self.last_at = step, [x], [pos]
        elif step == last:
            self.last_vals.append(x)
            self.last_at.append(pos)

    def _nonfinite_at(self, step: Any, r: AnyRecord) -> None:
        dev = r.device if r.kind == "per_device" else None
        if self.first_bad is None or step < self.first_bad:
            self.first_bad, self.first_bad_devs = step, set()
        if step == self.first_bad and dev is not None:
            self.first_bad_devs.add(dev)

    def _array(self, step: Any, r: AnyRecord, v: object) -> None:
        """Statistics of a numeric array value; pytrees, complex and summarized ones left out."""
        import numpy as np  # array taps only: a scalar-only summary starts faster

        dtype = r.dtype
        if not isinstance(v, list) or not isinstance(dtype, str) or dtype.startswith("complex"):
            return
        try:
            # float() of the markers "NaN"/"Infinity"/"-Infinity" is exact.
            arr = np.asarray(v, dtype=np.float64)
        except (TypeError, ValueError):
            return
        fin = np.isfinite(arr)
        finite = arr[fin] if not fin.all() else arr.ravel()
        bad = arr.size - finite.size
        if bad:
            self.nonfinite += bad
            self._nonfinite_at(step, r)
        if finite.size:
            self.lo = min(self.lo, float(finite.min()))
            self.hi = max(self.hi, float(finite.max()))
            self.a_sums.append(float(finite.sum()))
            self.a_count += finite.size
        self._norm_at(step, float(np.sqrt(np.dot(finite, finite))))

    def _norm_at(self, step: Any, norm: float) -> None:
        """The norm at the highest step (the largest there)."""
        if self.norm_step is None or step > self.norm_step:
            self.norm_step, self.norm = step, norm
        elif step == self.norm_step:
            self.norm = max(self.norm or 0.0, norm)

    def add(self, r: AnyRecord, pos: Any) -> None:
        """A record (a Struct) at position ``pos`` of the stream."""
        kind = r.kind
        step = r.step
        self.kinds.add(kind)
        self.records += 1
        if r.odd and not _int_ids(r):
            self.odd_ids = True
        self.processes.add(r.process)
        self.holders(False, r.processes)
        if r.divergent:
            self.divergent.add(step)
        if kind == FINGERPRINT:
            self._fingerprint(r, step)
            return
        v = r.value
        x: Any = v if type(v) is float or type(v) is int else _scalar(v)
        if x is None:
            self.nonscalar += 1
            self._array(step, r, v)
        else:
            self._last(step, x, pos)
            if x - x == 0:  # finite (inf - inf and NaN - NaN are NaN)
                self.vals.append(x)
                if len(self.vals) >= _FOLD:
                    self._fold()
            else:
                self.nonfinite += 1
                self._nonfinite_at(step, r)
        if kind == "per_device":
            self._per_device(r, step)
            return
        self.steps.add(step)
        self.holders(True, r.devices)
        if kind != "replicated":
            return  # meta records (counters) may legitimately repeat
        # record_key (schema.py) less the run and name every record of this
        # tap shares; a shard's index only where there is one.
        p, a, shard = r.pass_, r.attempt, r.index
        pass_ = "forward" if p is UNSET else p
        attempt = 0 if a is UNSET else a
        key = (step, pass_, r.vhash or _canonical(v))
        if attempt:
            key += (("attempt", attempt),)  # a replay: see _per_device
        if shard is UNSET or shard is None:
            self.rep_keys.add((step, pass_, attempt))
        else:
            # Shards of one value are different values: neither duplicates
            # of each other nor, differing, a divergence.
            shard = index_key(shard)
            self.rep_keys.add((step, pass_, attempt, shard))
            key += (shard,)
        n = len(self.dup_keys)
        self.dup_keys.add(key)
        self.duplicates += len(self.dup_keys) == n

    def _fingerprint(self, r: AnyRecord, step: Any) -> None:
        """A fingerprint record: its step and holders; no number to sum."""
        self.steps.add(step)
        self.holders(True, r.devices)
        self.fp.add(r)

    def _per_device(self, r: AnyRecord, step: Any) -> None:
        """A per-device record's key: a bit of its (pass, attempt) lane at its
        step (a device at its usual coordinates), else a key of its own."""
        dev, coords = r.device, r.coords
        self.devices.add(dev)
        p, a = r.pass_, r.attempt
        lane_key = ("forward" if p is UNSET else p, 0 if a is UNSET else a)
        if lane_key[1]:  # an elastic restart may have fewer devices: compare within an attempt
            at = self.attempt_of_step
            if lane_key[1] > at.get(step, 0):
                at[step] = lane_key[1]
        lane = self.lanes[lane_key]
        d = self._bit(dev, coords)
        if d is None:
            key = (step, dev, _coords_key(coords))
            self.duplicates += key in lane.keys
            lane.keys.add(key)
            return
        bits = lane.bits.get(step)
        i = d >> 3
        if bits is None:
            bits = lane.bits[step] = bytearray(max(i + 1, 128))
        elif len(bits) <= i:
            bits.extend(bytes(i + 1 - len(bits)))
        m = 1 << (d & 7)
        self.duplicates += bool(bits[i] & m)
        bits[i] |= m

    def _bit(self, dev: Any, coords: Any) -> int | None:
        """The bit of a device at its usual coordinates (the first integer
        ones met; 1.0 or True is device 1), None for any other key."""
        try:
            usual = self.dev_coords.get(dev)
        except TypeError:  # unhashable: no record has one, but a dict could
            return None
        if usual is not None:
            if coords == usual and all(type(c) is int for c in coords.values()):
                return int(dev)
            return None
        if (
            isinstance(dev, (int, float))
            and dev == dev
            and 0 <= dev < _BIT_DEVICES
            and dev == int(dev)
            and type(_coords_key(coords)) is tuple
        ):
            self.dev_coords[int(dev)] = coords
            return int(dev)
        return None

    def absorb(self, o: _TapAcc, ordered: bool) -> None:
        """Another piece's state of this tap (``ordered``: the piece after this one)."""
        self._fold()
        o._fold()
        self.kinds |= o.kinds
        self.records += o.records
        self.odd_ids = self.odd_ids or o.odd_ids
        self.steps |= o.steps
        _union(self.processes, o.processes, ordered)
        _union(self.devices, o.devices, ordered)
        self.holder_texts |= o.holder_texts
        for x, pos in zip(o.last_vals, o.last_at):
            self._last(o.last_step, x, pos)
        self.sums = _exact(self.sums + o.sums)
        self.count += o.count
        self.lo, self.hi = min(self.lo, o.lo), max(self.hi, o.hi)
        self.nonfinite += o.nonfinite
        self.nonscalar += o.nonscalar
        self.divergent |= o.divergent
        self.fp.absorb(o.fp)
        self.rep_keys |= o.rep_keys
        for dev, coords in o.dev_coords.items():
            mine = self.dev_coords.setdefault(dev, coords)
            if mine != coords:
                raise NeedSerial(f"device {dev} at two sets of coordinates")
        self.duplicates += o.duplicates
        for key, lane in o.lanes.items():
            mine = self.lanes[key]
            for step, bits in lane.bits.items():
                have = mine.bits.get(step)
                if have is None:
                    mine.bits[step] = bits
                else:
                    both = int.from_bytes(have, "little") & int.from_bytes(bits, "little")
                    self.duplicates += both.bit_count()
                    mine.bits[step] = _or(have, bits)
            self.duplicates += len(mine.keys & lane.keys)
            mine.keys |= lane.keys
        at = self.attempt_of_step
        for step, a in o.attempt_of_step.items():
            if a > at.get(step, 0):
                at[step] = a
        self.duplicates += len(self.dup_keys & o.dup_keys)
        self.dup_keys |= o.dup_keys
        if o.first_bad is not None:
            if self.first_bad is None or o.first_bad < self.first_bad:
                self.first_bad, self.first_bad_devs = o.first_bad, set(o.first_bad_devs)
            elif o.first_bad == self.first_bad:
                _union(self.first_bad_devs, o.first_bad_devs, ordered)
        self.a_count += o.a_count
        if o.norm_step is not None:
            self._norm_at(o.norm_step, o.norm)

    def _per_step(self) -> Counter:
        """step -> how many distinct (device, coordinates) wrote it."""
        lanes = list(self.lanes.values())
        union: dict = {}
        for lane in lanes:
            for s, bits in lane.bits.items():
                union[s] = _or(union[s], bits) if s in union else bits
        out = Counter({s: int.from_bytes(b, "little").bit_count() for s, b in union.items()})
        others = {key for lane in lanes for key in lane.keys}
        out.update(s for s, _, _ in others)
        return out

    def result(self, index: DivergenceIndex) -> TapSummary:
        self._fold()
        kinds = tuple(sorted(self.kinds))
        per_dev = self._per_step()
        per_device_steps = set(per_dev)
        devices, processes = set(self.devices), set(self.processes)
        for is_devices, text in self.holder_texts:
            (devices if is_devices else processes).update(holder_ids(text))
        steps = self.steps | per_device_steps
        divergent = set(self.divergent)
        if index.any_repeat:
            for step, pass_, attempt, *shard in self.rep_keys:
                part = part_key(shard[0] if shard else None, self.iteration)
                if index.is_divergent((self.run, self.tap, step, pass_, part, attempt)):
                    divergent.add(step)
        data_steps: set = set()
        if "replicated" in kinds and "per_device" in kinds:
            # dedup="auto": copies that differ once the tap has agreed are a
            # divergence; before it first agreed, per-device data.
            agreed = min(key[0] for key in self.rep_keys)
            divergent |= {s for s in per_device_steps if s > agreed}
            data_steps = {s for s in per_device_steps if s < agreed}
        incomplete: set = set()
        if kinds == ("per_device",):
            at = self.attempt_of_step
            if not at:  # one attempt: compared with the fullest step, in C passes
                full_one = max(per_dev.values())
                incomplete = set(compress(per_dev.keys(), map(full_one.__gt__, per_dev.values())))
            else:
                full: dict = {}
                for s, n in per_dev.items():
                    a = at.get(s, 0)
                    full[a] = max(full.get(a, 0), n)
                incomplete = {s for s, n in per_dev.items() if n < full[at.get(s, 0)]}
        stride, gaps = step_gaps(steps)
        count = self.count + self.a_count
        # The values at the last step in stream order (their positions).
        last = [x for _, x in sorted(zip(self.last_at, self.last_vals), key=itemgetter(0))]
        try:
            total = math.fsum(self.sums)
        except (OverflowError, ValueError):  # infinite sums of both signs
            total = math.nan
        return TapSummary(
            run=self.run,
            name=shown_name(self.name, self.iteration),
            kinds=kinds,
            records=self.records,
            first_step=min(steps),
            last_step=max(steps),
            processes=tuple(sorted_ids(p for p in processes if p is not None)),
            devices=tuple(sorted_ids(devices)),
            last=tuple(dict.fromkeys(last)),
            # A zero without its sign: min() and max() keep the first of
            # -0.0 and 0.0, and pieces read apart meet them in another order.
            min=self.lo + 0.0 if count else None,
            max=self.hi + 0.0 if count else None,
            mean=total / count if count else None,
            nonfinite=self.nonfinite,
            nonscalar=self.nonscalar,
            divergent_steps=tuple(sorted(divergent)),
            stride=stride,
            gaps=tuple(gaps),
            missing=sum((hi - lo) // stride + 1 for lo, hi in gaps),
            incomplete_steps=tuple(sorted(incomplete)),
            duplicates=self.duplicates,
            first_nonfinite_step=self.first_bad,
            first_nonfinite_devices=tuple(sorted(self.first_bad_devs, key=id_order)),
            norm=self.norm,
            per_device_steps=tuple(sorted(data_steps)),
            fingerprint=self.fp.text(),
            tap=shown_name(self.tap, self.iteration),
        )


def _int_ids(r: AnyRecord) -> bool:
    """Whether every process and device id of ``r`` is an int or None."""
    ids = [r.process, getattr(r, "device", None)]
    for holders in (r.devices, r.processes):
        if type(holders) is list:
            ids += holders
    return all(type(i) is int or i is None for i in ids)


def _scalar(v: object) -> float | None:
    """views.scalar, also for a value as written (a non-finite marker)."""
    return NONFINITE.get(v) if isinstance(v, str) else scalar(v)


class Summarizer:
    """Per-tap summaries of a stream of records, holding none of them:
    ``add(r)`` every record covered, ``see(r)`` one of a covered key filtered
    out (by process or device: divergence is judged on every copy); ``take``
    a batch, adding what ``flt`` and ``attempts`` keep."""

    def __init__(self, flt: Filter | None = None, attempts: Attempts | None = None) -> None:
        # The accumulators by run and name; each run's first position.
        self._taps: dict[Any, dict[str, _TapAcc]] = {}
        self._first: dict[Any, Any] = {}
        self._index = DivergenceIndex()
        self._restarts = Restarts()
        self.resumed = False  # whether a record of a later attempt was added
        self._pos = 0  # for add() without a position: one after another
        self.flt = flt or Filter()
        self.attempts = Attempts() if attempts is None else attempts
        self.names: set = set()
        self.runs: set = set()
        self.bad: list = []  # (position, why) of lines that are no record
        self.lines = 0  # the lines read (summarize_batches)

    def see(self, r: Any) -> None:
        self._index.add(r)

    def add(self, r: Any, pos: Any = None) -> None:
        """A record (a Struct or its line's object) at ``pos`` (default: the next)."""
        if type(r) is dict:
            r = from_dict(r)
        if pos is None:
            self._pos += 1
            pos = self._pos
        self._add_one(r, pos, self._acc(r.run, _tap_of(r), pos))

    def _acc(self, run: Any, name: Any, pos: Any, tap: Any = None) -> _TapAcc:
        names = self._taps.get(run)
        if names is None:
            names = self._taps[run] = {}
            self._first[run] = pos
        elif pos < self._first[run]:  # pieces added out of stream order
            self._first[run] = pos
        acc = names.get(name)
        if acc is None:  # a looped tap's key: (name, iteration)
            key = name if type(name) is tuple else (name,)
            acc = names[name] = _TapAcc(run, *key, tap=tap)
        return acc

    def add_batch(self, records: list, first: Any = 1, positions: Any = None) -> None:
        """``add`` of each record of ``records`` (None for a line that is no
        record) from ``first`` (or at ``positions``), a tap at a time (_add_part)."""
        if positions is None:
            positions = range(first, first + len(records))
        if None in records:
            where = [i for i, r in enumerate(records) if r is not None]
            records = [records[i] for i in where]
            positions = [positions[i] for i in where]
        if not records:
            return
        names = list(map(_NAME, records))
        if any(r.iteration is not UNSET for r in records):
            names = list(map(_tap_of, records))
        runs = list(map(_RUN, records))
        if runs.count(runs[0]) == len(runs):
            parts = _parts_by_key(names)
            keys = [(runs[0], k) for k, _ in parts]
        else:
            parts = _parts_by_key(list(zip(runs, names)))
            keys = [k for k, _ in parts]
        for (run, name), (_, at) in zip(keys, parts):
            if len(parts) == 1:
                part, where = records, positions
            else:
                part, where = [records[i] for i in at], [positions[i] for i in at]
            self._add_part(self._acc(run, name, where[0]), part, where)

    def _add_part(self, acc: _TapAcc, part: list, where: Any) -> None:
        """``add`` of one tap's records, in order: the usual record (a
        number, first attempt, forward pass, whole, not divergent: most
        lines of a run) in a loop of local names; any other through ``add``."""
        lane = acc.lanes[_USUAL_LANE]
        bits_of, dev_coords = lane.bits, acc.dev_coords
        processes, devices, vals = acc.processes, acc.devices, acc.vals
        steps, dup_keys = acc.steps, acc.dup_keys
        index = self._index
        # DivergenceIndex.add's entries of this tap's usual replicated keys.
        seen = index.steps_of(acc.run, acc.name, index=part_key(None, acc.iteration))
        last, last_vals, last_at = acc.last_step, acc.last_vals, acc.last_at
        added = dups = replicated = 0
        prev_proc = prev_dev = cur = prev_procs = prev_devs = None
        bits = at_last = None
        rep_keys = acc.rep_keys
        for r, pos in zip(part, where):
            if type(r) is Replicated:
                step, v, p, vhash, devs, procs = _USUAL_REPLICATED(r)
                tv = type(v)
                if (tv is float or tv is int) and vhash and _MATTERS_REPLICATED(r) == _NONE4:
                    # _TapAcc.add and DivergenceIndex.add of this record.
                    replicated += 1
                    processes.add(p)
                    if procs != prev_procs:  # the holders, as the last record's mostly
                        prev_procs = procs
                        acc.holders(False, procs)
                    steps.add(step)
                    if devs != prev_devs:
                        prev_devs = devs
                        acc.holders(True, devs)
                    if last is None or step > last:
                        last, last_vals, last_at = step, [v], [pos]
                    elif step == last:
                        last_vals.append(v)
                        last_at.append(pos)
                    vals.append(v)
                    rep_keys.add((step, "forward", 0))
                    n = len(dup_keys)
                    dup_keys.add((step, "forward", vhash))
                    if len(dup_keys) == n:
                        dups += 1
                    if seen.setdefault(step, vhash) is not vhash:
                        index.repeat(seen, step, vhash)
                    prev_proc = prev_dev = cur = None
                    continue
            if type(r) is PerDevice:  # not an odd one (schema.from_dict)
                step, d, v, p, coords = _USUAL(r)
                tv = type(v)
                if (
                    (tv is float or tv is int)
                    and type(d) is int
                    and _MATTERS(r) == _NONE_OF_THEM
                    and coords == dev_coords.get(d, 0)
                ):
                    # _TapAcc.add of this record (JSON has no NaN: finite).
                    added += 1
                    if p is not prev_proc:  # small ints are one object each
                        processes.add(p)
                        prev_proc = p
                    if d is not prev_dev:
                        devices.add(d)
                        prev_dev = d
                    if step != cur:  # a step's records come together: once per step
                        cur = step
                        bits = bits_of.get(step)
                        if bits is None:
                            bits = bits_of[step] = bytearray(128)
                        if last is None or step > last:
                            last, last_vals, last_at = step, [], []
                        at_last = step == last
                    if at_last:
                        last_vals.append(v)
                        last_at.append(pos)
                    vals.append(v)
                    i = d >> 3
                    if len(bits) <= i:
                        bits.extend(bytes(i + 1 - len(bits)))
                    m = 1 << (d & 7)
                    if bits[i] & m:
                        dups += 1
                    else:
                        bits[i] |= m
                    continue
            # Anything else through add(), the locals written back first.
            self._flush_part(acc, added, replicated, dups, last, last_vals, last_at)
            added = dups = replicated = 0
            self._add_one(r, pos, acc)
            last, last_vals, last_at = acc.last_step, acc.last_vals, acc.last_at
            vals = acc.vals
            prev_proc = prev_dev = cur = None
        self._flush_part(acc, added, replicated, dups, last, last_vals, last_at)
        if len(acc.vals) >= _FOLD:
            acc._fold()

    @staticmethod
    def _flush_part(acc: _TapAcc, added: int, replicated: int, dups: int, *last: Any) -> None:
        """_add_part's counts and last step written into ``acc``."""
        acc.records += added + replicated
        acc.duplicates += dups
        acc.last_step, acc.last_vals, acc.last_at = last
        if added:
            acc.kinds.add("per_device")
        if replicated:
            acc.kinds.add("replicated")

    def _add_one(self, r: AnyRecord, pos: Any, acc: _TapAcc) -> None:
        kind = r.kind
        # Restarts reads only later attempts and meta records.
        if kind == "replicated":
            self._index.add(r)
        if r.attempt is not UNSET or kind == "meta":
            self._restarts.add(r)
            if attempt_of(r) and kind != "meta":
                self.resumed = True
        dtype = r.dtype
        if (type(dtype) is dict or type(dtype) is list) and kind != FINGERPRINT:
            # A pytree: a row per leaf, named as TensorBoard tags it.
            for path, v, leaf_dtype in leaves(r.value, dtype):
                leaf = msgspec.structs.replace(r, value=v, dtype=leaf_dtype)
                name = acc.name + path
                key = name if acc.iteration is None else (name, acc.iteration)
                self._acc(r.run, key, pos, acc.name).add(leaf, pos)
            return
        acc.add(r, pos)

    def take(self, records: list, first: int = 1, positions: Any = None) -> None:
        """A batch's records (Structs or None) from ``first`` (or at ``positions``)."""
        if not self.attempts and not self.flt.active:
            self.add_batch(records, first, positions)
            return
        if positions is None:
            positions = range(first, first + len(records))
        flt, attempts = self.flt, self.attempts
        for pos, r in zip(positions, records):
            if r is None:
                continue
            superseded = attempts and attempts.superseded(r)
            if not superseded and (not flt.active or flt(r)):
                self.add(r, pos)
                continue
            self.names.add(r.name)
            self.runs.add(r.run)
            if not superseded and flt.key_match(r):
                self.see(r)

    def absorb(self, other: Summarizer, offset: "int | None" = 0) -> None:
        """Add another Summarizer's state: of the piece after this one's,
        its positions ``offset`` lines on (as Validator.absorb), or (None)
        of anywhere in the stream (positions decide)."""
        ordered = offset is not None
        if offset:
            other._first = {run: p + offset for run, p in other._first.items()}
            for names in other._taps.values():
                for acc in names.values():
                    acc.last_at = [p + offset for p in acc.last_at]
            other.bad = [(pos + offset, why) for pos, why in other.bad]
        if ordered:
            self.lines = offset + other.lines
        self.bad += other.bad
        for run, names in other._taps.items():
            mine = self._taps.get(run)
            if mine is None:
                mine = self._taps[run] = {}
                self._first[run] = other._first[run]
            elif not ordered:
                self._first[run] = min(self._first[run], other._first[run])
            for name, acc in names.items():
                if name in mine:
                    mine[name].absorb(acc, ordered)
                else:
                    mine[name] = acc
        self._index.absorb(other._index)
        self._restarts.absorb(other._restarts)
        self.resumed = self.resumed or other.resumed
        self.names |= other.names
        self.runs |= other.runs

    def result(self, bad: "list | None" = None) -> Result:
        """summarize_file's result, ``bad`` its lines that are no record
        where another process placed them."""
        names = {n[0] if type(n) is tuple else n for taps in self._taps.values() for n in taps}
        bad = self.bad if bad is None else bad
        return self.summaries(), bad, self.names | names, self.runs | set(self._taps)

    def summaries(self) -> list[TapSummary]:
        """One TapSummary per (run, name), runs in stream order, names sorted."""
        runs = sorted(self._taps, key=self._first.__getitem__)
        out = [
            acc.result(self._index)
            for run in runs
            for _, acc in sorted(self._taps[run].items(), key=_tap_order)
            if acc.records  # not a pytree tap's own: its leaves have rows
        ]
        for s in out:
            s.restarts = self._restarts.text(s.run)
        return out


_USUAL_LANE = ("forward", 0)
_NAME, _RUN = attrgetter("name"), attrgetter("run")


def _tap_order(item: tuple) -> tuple:
    """Summary rows by tap name, a looped tap's iterations in loop order."""
    k = item[0]
    return k if type(k) is tuple else (k, ())


def _tap_of(r: AnyRecord) -> Any:
    """A summary row's key: the tap's name, or (name, iteration)."""
    it = r.iteration
    return r.name if it is UNSET else (r.name, tuple(it))


# A per-device record's fields the usual one reads (one C call), and those
# that would change its part, none of which the usual one has.
_USUAL = attrgetter("step", "device", "value", "process", "coords")
_USUAL_REPLICATED = attrgetter("step", "value", "process", "vhash", "devices", "processes")
_MATTERS = attrgetter("pass_", "attempt", "index", "divergent", "processes")
_MATTERS_REPLICATED = attrgetter("pass_", "attempt", "index", "divergent")
_NONE_OF_THEM, _NONE4 = (UNSET,) * 5, (UNSET,) * 4


def _parts_by_key(keys: list) -> list[tuple[Any, list[int]]]:
    """The positions of each distinct key of ``keys``, in the order keys
    first appear: a few keys in C-level passes, many in one Python pass."""
    distinct = list(dict.fromkeys(keys))
    if len(distinct) == 1:
        return [(distinct[0], range(len(keys)))]
    if len(distinct) <= 8:
        idx = range(len(keys))
        # operator.eq, not k.__eq__: a (name, iteration) key's tuple.__eq__
        # of a name is NotImplemented, which is true, so a looped tap's
        # part took every other tap's records too.
        return [(k, list(compress(idx, map(partial(eq, k), keys)))) for k in distinct]
    parts: defaultdict = defaultdict(list)
    for i, k in enumerate(keys):
        parts[k].append(i)
    return list(parts.items())


def tap_summaries(records: Iterable[dict]) -> list[TapSummary]:
    """One TapSummary per (run, name), runs in file order, names sorted."""
    acc = Summarizer()
    for r in records:
        acc.add(r)
    return acc.summaries()


Result = tuple[list[TapSummary], list[tuple[int, str]], set, set]


def summarize_file(path: str | os.PathLike, flt: Filter | None = None) -> Result:
    """``pmaptap summary`` (docs/cli.md): the summaries, lines that are no
    record, names and runs read. The definition parallel.py and shardwise.py match."""
    path = Run.of(path)
    flt = flt or Filter()
    if not flt.active and not flt.all_attempts:
        # One pass assuming the run was never resumed; if it was, the pass
        # below, which first finds what later attempts superseded.
        acc, _ = _summarize_merged(path)
        if not acc.resumed:
            return acc.result()
    return _summarize_scanned(path, flt)


def summarize_batches(
    batches: Iterable, flt: Filter | None = None, attempts: Attempts | None = None
) -> Summarizer:
    """The Summarizer of ``batches`` (source.iter_record_batches'); ``attempts``
    None: assume no later attempt, and stop at the first record of one (``resumed``)."""
    acc = Summarizer(flt, attempts)
    with collector_paused():
        for first, records, problems in batches:
            if problems:
                acc.bad.extend(problems.items())
            acc.take(records, first)
            acc.lines = first + len(records) - 1
            if attempts is None and acc.resumed:
                break
    return acc


def first_attempts(path: str | os.PathLike, flt: Filter) -> "Attempts | None":
    """What a summary's first pass knows of later attempts: None (assume
    none) where no filter is active; else what they superseded."""
    if not flt.active and not flt.all_attempts:
        return None
    return Attempts() if flt.all_attempts else scan(path)


def _summarize_scanned(path: str | os.PathLike, flt: Filter) -> Result:
    """summarize_file's pass after attempts.scan (any filter, any run)."""
    attempts = Attempts() if flt.all_attempts else scan(path)
    return summarize_batches(iter_record_batches(path), flt, attempts).result()


def _summarize_merged(path: str | os.PathLike) -> tuple[Summarizer, list[tuple[int, str]]]:
    """summarize_file's pass assuming no later attempt (until one: ``resumed``)."""
    acc = summarize_batches(iter_record_batches(path))
    return acc, acc.bad
