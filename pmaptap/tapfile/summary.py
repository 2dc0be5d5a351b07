"""Per-tap summaries of a list of records (as ``pmaptap.read`` returns them):
``tap_summaries(records)`` for code; summary_table.py's
``summary_table(records) -> str`` for people (``pmaptap summary``, the end of
a training run).

This is the reference path: ``Summarizer.add``, one record at a time, into a
tap's ``_TapAcc``. summary_batch.py holds the fast batched path that
``pmaptap summary`` takes (``BatchSummarizer.add_batch``, ``summarize_file``),
which must give the same summaries."""

from __future__ import annotations

import dataclasses
import math
from array import array
from collections import Counter
from itertools import chain, compress
from typing import Any, Iterable

from pmaptap.tapfile.attempts import Restarts, attempt_of
from pmaptap.tapfile.checks import _canonical, _coords_key, count_missing, step_gaps
from pmaptap.tapfile.divergence import DivergenceIndex
from pmaptap.tapfile.fingerprints import FingerprintAcc
from pmaptap.tapfile.format import FINGERPRINT, NONFINITE, holder_ids, index_key
from pmaptap.tapfile.views import id_order, scalar


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
    # largest, if several devices wrote one); min/max/mean above then cover
    # every finite element of every record.
    norm: float | None = None
    # dedup="auto" taps: steps whose copies differed before the tap ever
    # agreed. That is per-device data, not a divergence.
    per_device_steps: tuple[int, ...] = ()
    restarts: str = ""  # the run's attempts ("2 attempts; restarted at step 5")
    # pmaptap.fingerprint records: where the copies first differed and the
    # suspect devices (tapfile/fingerprints.py), "" when they always agreed.
    fingerprint: str = ""


class _TapAcc:
    """One tap's summary, built from its records in file order, one at a
    time (``add``) or a batch at a time (summary_batch.py's
    ``BatchSummarizer._add_part``, the same result in a few C-level passes
    per batch): what it keeps grows with the tap's distinct steps and
    devices, not with its values."""

    def __init__(self, run: str, name: str) -> None:
        self.run, self.name = run, name
        self.kinds: set = set()
        self.records = 0
        self.steps: set[int] = set()  # of replicated and meta records
        self.processes: set = set()
        self.devices: set = set()
        # (devices?, text): holders written as ranges text (format.
        # holders_field), kept as text per record so that a record of a
        # 4,096-process job costs the same as one of 2.
        self.holder_texts: set = set()
        self.last_step: int | None = None  # the highest step with a scalar
        self.last_vals: list[float] = []
        self.finite = array("d")
        self.nonfinite = self.nonscalar = 0
        self.divergent: set[int] = set()
        # (step, pass, attempt[, shard index]) of replicated records
        self.rep_keys: set[tuple] = set()
        self.rep_steps: set[int] = set()  # those of pass forward and attempt 0: their steps
        # Per-device records: the distinct keys (_pd_key: step, device and
        # coordinates) written in the forward pass, (key, pass) in another;
        # a record adding nothing here is a duplicate. pd_count: step -> its
        # forward keys, while no other pass was seen (then result() counts
        # from pd_keys).
        self.pd_keys: set = set()
        self.pd_count: Counter = Counter()
        # The forward keys of devices below _MASK_DEVICES at their usual
        # coordinates, the most common ones, kept as step -> bit mask of
        # devices: a few bytes a step instead of an int and a set slot a
        # record (and the memory pages that go with them).
        self.pd_masks: dict[int, int] = {}
        self.pd_passes = False  # whether pd_keys holds another pass
        # The key of a per-device record is (step, device) when its
        # coordinates are its device's usual ones (dev_coords: the first
        # integer coordinates seen for that device), else (step, device, id
        # of checks._coords_key(coords)): cheaper to build, hash and keep
        # than the coordinates, and equal exactly when theirs are.
        self.dev_coords: dict = {}
        self.ck_ids: dict = {}
        self.attempt_of_step: dict[int, int] = {}
        self.dup_keys: set[tuple] = set()
        self.duplicates = 0
        self.first_bad: int | None = None  # first step with a NaN/inf
        self.first_bad_devs: set = set()
        # Array elements (finite ones): running min/max/sum/count, and the
        # norm at the highest step.
        self.a_min = math.inf
        self.a_max = -math.inf
        self.a_sum = 0.0
        self.a_count = 0
        self.norm_step: int | None = None
        self.norm: float | None = None
        self.fp: FingerprintAcc | None = None  # fingerprint records' suspects

    def _nonfinite_at(self, step: int, r: dict) -> None:
        dev = r.get("device") if r.get("kind") == "per_device" else None
        if self.first_bad is None or step < self.first_bad:
            self.first_bad, self.first_bad_devs = step, set()
        if step == self.first_bad and dev is not None:
            self.first_bad_devs.add(dev)

    def _array(self, step: int, r: dict, v: object) -> None:
        """Statistics of a numeric array value (as written: NaN/inf markers,
        or decoded: floats); pytrees, complex and summarized leaves are left
        to the per-record views."""
        import numpy as np  # array taps only: a scalar-only summary starts faster

        dtype = r.get("dtype")
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
            self.a_min = min(self.a_min, float(finite.min()))
            self.a_max = max(self.a_max, float(finite.max()))
            self.a_sum += float(finite.sum())
            self.a_count += finite.size
        norm = float(np.sqrt(np.dot(finite, finite)))
        if self.norm_step is None or step > self.norm_step:
            self.norm_step, self.norm = step, norm
        elif step == self.norm_step:
            self.norm = max(self.norm or 0.0, norm)

    def add(self, r: dict) -> None:
        """A record as written or decoded (non-finite markers or floats)."""
        get = r.get
        kind = r["kind"]
        step = r["step"]
        self.kinds.add(kind)
        self.records += 1
        self.processes.add(r["process"])
        procs = get("processes")
        if procs:
            if type(procs) is str:  # ranges text: expanded once, in result()
                self.holder_texts.add((False, procs))
            else:
                self.processes.update(procs)
        if "divergent" in r and r["divergent"]:
            self.divergent.add(step)
        if kind == FINGERPRINT:
            self._fingerprint(r, step)
            return
        v = r["value"]
        x: float | None
        if type(v) is float or type(v) is int:
            x = v
        else:
            x = _scalar(v)
        if x is None:
            self.nonscalar += 1
            self._array(step, r, v)
        else:
            last = self.last_step
            if last is None or step > last:
                self.last_step, self.last_vals = step, [x]
            elif step == last:
                self.last_vals.append(x)
            if x - x == 0:  # finite (inf - inf and NaN - NaN are NaN)
                self.finite.append(x)
            else:
                self.nonfinite += 1
                self._nonfinite_at(step, r)
        self._key(r, kind, step)

    def _fingerprint(self, r: dict, step: int) -> None:
        """A fingerprint record: its step and holders; its value is no
        number to sum up, the divergent ones name suspects (fingerprints.py)."""
        self.steps.add(step)
        devs = r.get("devices")
        if devs:
            if type(devs) is str:
                self.holder_texts.add((True, devs))
            else:
                self.devices.update(devs)
        if self.fp is None:
            self.fp = FingerprintAcc()
        self.fp.add(r)

    def _key(self, r: dict, kind: str, step: int) -> None:
        """The record's identity part of ``add``: steps, devices, attempts
        and the duplicate check within this tap (checks.duplicate_key without
        the run and name, which all of a tap's records share)."""
        get = r.get
        if kind == "per_device":
            dev = r["device"]
            self.devices.add(dev)
            a = get("attempt")
            if a:  # an elastic restart may have fewer devices: compare within an attempt
                self.attempt_of_step[step] = a
            pass_ = get("pass", "forward")
            key = self._pd_key(step, dev, r["coords"])
            if a:
                # A later attempt's replay of a step is not a duplicate of
                # the step it superseded (--all-attempts shows both), as in
                # checks.duplicate_key; the usual (attempt 0) keys are the
                # ones summary_batch.py adds inline.
                key = (key, ("attempt", a))
            if pass_ == "forward" and type(key) is int and key & _DEV_MASK < _MASK_DEVICES:
                bit = 1 << (key & _DEV_MASK)
                mask = self.pd_masks.get(step, 0)
                if mask & bit:
                    self.duplicates += 1
                else:
                    self.pd_masks[step] = mask | bit
                return
            if pass_ != "forward":
                key = (key, pass_)
                self.pd_passes = True
            if key in self.pd_keys:
                self.duplicates += 1
                return
            self.pd_keys.add(key)
            if pass_ == "forward":
                self.pd_count[step] += 1
            return
        self.steps.add(step)
        devs = get("devices")
        if devs:
            if type(devs) is str:
                self.holder_texts.add((True, devs))
            else:
                self.devices.update(devs)
        if kind != "replicated":
            return  # meta records (counters) may legitimately repeat
        # record_key (format.py) less the run and name every record of this
        # tap shares; a shard's index only where there is one, so that the
        # usual record's keys stay the ones summary_batch.py adds inline.
        pass_ = get("pass", "forward")
        key = (step, pass_, get("vhash") or _canonical(r["value"]))
        attempt = get("attempt", 0)
        if attempt:
            key += (("attempt", attempt),)  # a replay: see the per_device case
        shard = get("index")
        if shard is None:
            self.rep_keys.add((step, pass_, get("attempt", 0)))
        else:
            # Shards of one value are different values: neither duplicates
            # of each other nor, differing, a divergence.
            shard = index_key(shard)
            self.rep_keys.add((step, pass_, get("attempt", 0), shard))
            key += (shard,)
        n = len(self.dup_keys)
        self.dup_keys.add(key)
        if len(self.dup_keys) == n:
            self.duplicates += 1

    def _pd_key(self, step: int, dev: Any, coords: Any) -> Any:
        """A per-device record's key in pd_keys (see dev_coords): for a
        device at its usual coordinates ``step << 20 | device`` (devices
        are registered there only if ints in [0, _DEV_LIMIT); an equal id
        such as 1.0 or True is the same device, as it is in the tuple keys
        otherwise used), else (step, device, id of the coordinates)."""
        usual = self.dev_coords.get(dev)
        if usual is not None and coords == usual and _int_values(coords):
            return step << 20 | int(dev)
        ckey = _coords_key(coords)
        if usual is None and type(ckey) is tuple and type(dev) is int and 0 <= dev < _DEV_LIMIT:
            # checks._coords_key gives a tuple for integer coordinates only.
            self.dev_coords[dev] = coords
            return step << 20 | dev
        ids = self.ck_ids
        return (step, dev, ids.setdefault(ckey, len(ids)))

    def result(self, index: DivergenceIndex | None) -> TapSummary:
        kinds = tuple(sorted(self.kinds))
        # step -> how many distinct (device, coords key) wrote it, over passes
        per_dev = Counter(self.pd_count)
        for s, mask in self.pd_masks.items():
            per_dev[s] += mask.bit_count()
        if self.pd_passes:
            # (key, pass) pairs hold their forward key: counted once.
            bases = {k[0] if type(k) is tuple and len(k) == 2 else k for k in self.pd_keys}
            for s, mask in self.pd_masks.items():
                bases.update(s << 20 | d for d in range(mask.bit_length()) if mask >> d & 1)
            per_dev = Counter(k >> 20 if type(k) is int else k[0] for k in bases)
        per_device_steps = set(per_dev)
        for is_devices, text in self.holder_texts:
            (self.devices if is_devices else self.processes).update(holder_ids(text))
        self.holder_texts.clear()
        devices = self.devices
        steps = self.steps | per_device_steps
        divergent = set(self.divergent)
        if index is not None and index.any_repeat:
            probe = {"run": self.run, "name": self.name, "kind": "replicated"}
            fast = ((step, "forward", 0) for step in self.rep_steps)
            for step, pass_, attempt, *shard in chain(self.rep_keys, fast):
                at = dict(probe, step=step, attempt=attempt, **{"pass": pass_})
                if shard:
                    at["index"] = shard[0]
                if index.divergent(at):
                    divergent.add(step)
        data_steps: set[int] = set()
        if "replicated" in kinds and "per_device" in kinds:
            # dedup="auto": identical copies give a replicated record, differing
            # ones per-device records. Copies that differ once the tap has
            # agreed are a divergence; copies that differ from the start (and
            # until they first agree) are per-device data, e.g. a per-shard
            # value that happened to agree at some step.
            # the (step, pass, attempt) keys and the steps of the plain ones
            agreed = min(chain((key[0] for key in self.rep_keys), self.rep_steps))
            divergent |= {s for s in per_device_steps if s > agreed}
            data_steps = {s for s in per_device_steps if s < agreed}
        incomplete: set[int] = set()
        if kinds == ("per_device",):
            at = self.attempt_of_step
            if not at:  # one attempt: compared with the fullest step, in C passes
                full_one = max(per_dev.values())
                incomplete = set(compress(per_dev.keys(), map(full_one.__gt__, per_dev.values())))
            else:
                full: dict[int, int] = {}
                for s, n in per_dev.items():
                    a = at.get(s, 0)
                    full[a] = max(full.get(a, 0), n)
                incomplete = {s for s, n in per_dev.items() if n < full[at.get(s, 0)]}
        stride, gaps = step_gaps(steps)
        finite = self.finite
        count = len(finite) + self.a_count
        lo = min(min(finite, default=math.inf), self.a_min)
        hi = max(max(finite, default=-math.inf), self.a_max)
        return TapSummary(
            run=self.run,
            name=self.name,
            kinds=kinds,
            records=self.records,
            first_step=min(steps),
            last_step=max(steps),
            processes=tuple(sorted((p for p in self.processes if p is not None), key=id_order)),
            devices=tuple(sorted(devices, key=id_order)),
            last=tuple(dict.fromkeys(self.last_vals)),
            min=lo if count else None,
            max=hi if count else None,
            mean=(math.fsum(finite) + self.a_sum) / count if count else None,
            nonfinite=self.nonfinite,
            nonscalar=self.nonscalar,
            divergent_steps=tuple(sorted(divergent)),
            stride=stride,
            gaps=tuple(gaps),
            missing=count_missing(stride, gaps),
            incomplete_steps=tuple(sorted(incomplete)),
            duplicates=self.duplicates,
            first_nonfinite_step=self.first_bad,
            first_nonfinite_devices=tuple(sorted(self.first_bad_devs, key=id_order)),
            norm=self.norm,
            per_device_steps=tuple(sorted(data_steps)),
            fingerprint=self.fp.text() if self.fp is not None else "",
        )


# A default no JSON value has (a record without the field).
_ABSENT = object()
# A device id below this makes the per-device key one int (see _pd_key).
_DEV_LIMIT = 1 << 20
_DEV_MASK = _DEV_LIMIT - 1
# Devices below this are kept in per-step bit masks (_TapAcc.pd_masks).
_MASK_DEVICES = 1024


def _int_values(coords: Any) -> bool:
    for c in coords.values():
        if type(c) is not int:
            return False
    return True


def _scalar(v: object) -> float | None:
    """views.scalar, also for a value as written (a non-finite marker)."""
    if isinstance(v, str):
        return NONFINITE.get(v)
    return scalar(v)


class Summarizer:
    """Per-tap summaries of a stream of records, holding none of them.

    ``add(r)`` every record that the summary covers; ``see(r)`` a record
    that it does not cover but that is of a covered key (filtered out by
    process or device), so that divergence is judged on every copy. With
    ``reconcile`` (records as written, not yet reconciled) replicated keys
    written with different values by different processes are divergent;
    records from ``pmaptap.read`` already carry that mark."""

    def __init__(self, reconcile: bool = True) -> None:
        # The accumulators by run and name (runs in file order).
        self._taps: dict[str, dict[str, _TapAcc]] = {}
        self._index = DivergenceIndex() if reconcile else None
        self._restarts = Restarts()
        self.resumed = False  # whether a record of a later attempt was added

    def see(self, r: dict) -> None:
        if self._index is not None:
            self._index.add(r)

    def add(self, r: dict) -> None:
        if self._index is not None and r["kind"] == "replicated":
            self._index.add(r)
        # Restarts reads only later attempts (and the meta record a resumed
        # session writes): skip the rest, most of a file.
        if "attempt" in r or r["kind"] == "meta":
            self._restarts.add(r)
            if attempt_of(r) and r["kind"] != "meta":
                self.resumed = True  # a later attempt's record (see Attempts)
        run = r.get("run", "")
        names = self._taps.get(run)
        if names is None:
            names = self._taps[run] = {}
        acc = names.get(r["name"])
        if acc is None:
            acc = names[r["name"]] = _TapAcc(run, r["name"])
        acc.add(r)

    def names_and_runs(self) -> tuple[set, set]:
        """The names and runs of the records added."""
        return {n for names in self._taps.values() for n in names}, set(self._taps)

    def summaries(self) -> list[TapSummary]:
        """One TapSummary per (run, name), runs in file order, names sorted."""
        out = [
            acc.result(self._index)
            for names in self._taps.values()
            for _, acc in sorted(names.items())
        ]
        for s in out:
            s.restarts = self._restarts.text(s.run)
        return out


def tap_summaries(records: Iterable[dict]) -> list[TapSummary]:
    """One TapSummary per (run, name), runs in file order, names sorted."""
    acc = Summarizer()
    for r in records:
        acc.add(r)
    return acc.summaries()
