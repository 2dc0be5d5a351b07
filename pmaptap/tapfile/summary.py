"""Per-tap summaries of a list of records (as ``pmaptap.read`` returns them):
``summary_table(records) -> str`` for people (``pmaptap summary``, the end of a
training run) and ``tap_summaries(records)`` for code."""

from __future__ import annotations

import dataclasses
import math
import os
from array import array
from collections import Counter
from itertools import chain, compress, repeat
from typing import Any, Iterable, Sequence

from pmaptap.tapfile.attempts import Attempts, Restarts, attempt_of, scan
from pmaptap.tapfile.checks import _canonical, _coords_key, count_missing, format_gaps, step_gaps
from pmaptap.tapfile.divergence import DivergenceIndex
from pmaptap.tapfile.format import _SCALAR_TYPES, NONFINITE, holder_ids
from pmaptap.tapfile.lines import collector_paused as _collector_paused
from pmaptap.tapfile.lines import iter_batches, iter_file_batches
from pmaptap.tapfile.parse import parse_line
from pmaptap.tapfile.query import Filter
from pmaptap.tapfile.runs import is_sharded
from pmaptap.tapfile.views import Table, format_ids, format_number, id_order, scalar


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


class _TapAcc:
    """One tap's summary, built from its records in file order, one at a
    time (``add``) or a batch at a time (``add_many``, the same result in a
    few C-level passes per batch): what it keeps grows with the tap's
    distinct steps and devices, not with its values."""

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
        self.rep_keys: set[tuple] = set()  # (step, pass, attempt) of replicated records
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
        pass_ = get("pass", "forward")
        self.rep_keys.add((step, pass_, get("attempt", 0)))
        key = (step, pass_, get("vhash") or _canonical(r["value"]))
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
            for step, pass_, attempt in chain(self.rep_keys, fast):
                if index.divergent(dict(probe, step=step, attempt=attempt, **{"pass": pass_})):
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
        self._groups: dict[str, dict[str, _TapAcc]] = {}
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
        names = self._groups.get(run)
        if names is None:
            names = self._groups[run] = {}
        acc = names.get(r["name"])
        if acc is None:
            acc = names[r["name"]] = _TapAcc(run, r["name"])
        acc.add(r)

    def add_batch(
        self, rs: list, lines: list[bytes] | None = None, first: int = 1, bad: list | None = None
    ) -> None:
        """``add(r)`` for every r of ``rs``, a tap at a time, each tap's
        part in one tight loop (``pmaptap summary`` of a large file): the
        same summaries.

        ``rs``: records every reader accepts (format.first_not_plain), or,
        with ``lines``, what orjson made of each of those lines (line
        ``first`` on), not yet checked as records: then an item this loop
        does not take as a usual record goes through parse.parse_line, the
        one definition, and is added from there or its (line, problem)
        appended to ``bad``."""
        if not rs:
            return
        if lines is not None and set(map(type, rs)) != {dict}:
            rs, lines = _checked(rs, lines, first, bad)
            if not rs:  # no line of the batch was a record (``5``, ``[1]``)
                return
        try:
            names = list(map(dict.get, rs, repeat("name")))
            # A record without a run is no record: None, which is no str.
            runs = list(map(dict.get, rs, repeat("run")))
            if runs.count(runs[0]) == len(runs):
                groups = _group(rs, names)
                keys = [(runs[0], group[0]) for group in groups]
            else:
                groups = _group(rs, list(zip(runs, names)))
                keys = [group[0] for group in groups]
        except TypeError:  # an unhashable name or run: not a record
            rs, lines = _checked(rs, lines, first, bad)
            for r in rs:
                self.add(r)
            return
        for (run, name), (_, part, where) in zip(keys, groups):
            if type(run) is not str or type(name) is not str or not name:
                # Not records (or not plain ones): each on its own.
                for r, i in zip(part, where):
                    self._odd(r, i, lines, first, bad)
                continue
            by_run = self._groups.get(run)
            if by_run is None:
                by_run = self._groups[run] = {}
            acc = by_run.get(name)
            if acc is None:
                acc = by_run[name] = _TapAcc(run, name)
            self._add_part(acc, part, where, lines, first, bad)

    def _odd(self, r: Any, i: int, lines: list[bytes] | None, first: int, bad: list | None) -> None:
        """A batch item the tight loop does not take: a checked record is
        added as ``add`` adds it; an unchecked one is parsed again by
        parse_line, the definition, and added or reported."""
        if lines is not None:
            r, problem = parse_line(lines[i])
            if r is None:
                if bad is not None:
                    bad.append((first + i, problem or "invalid"))
                return
        self.add(r)

    def _add_part(
        self,
        acc: _TapAcc,
        part: list,
        where: list[int],
        lines: list[bytes] | None,
        first: int,
        bad: list | None,
    ) -> None:
        """``add`` of each item of one tap's part of a batch (all of the
        tap's run and name), the usual records inline: a finite number in
        the forward pass of the first attempt, not marked divergent, a
        per-device one at its device's usual coordinates, a replicated one
        with a vhash. The conditions imply every check format.validate_dict
        makes (an item that fails one is _odd). Any other item is _odd, in
        its place, so the file order the summary keeps is kept."""
        scalar = _SCALAR_TYPES
        kinds = acc.kinds
        processes = acc.processes
        pd_keys = acc.pd_keys
        masks = acc.pd_masks
        dev_coords = acc.dev_coords
        steps = acc.steps
        devices = acc.devices
        values: list[float] = []  # finite values, for acc.finite
        rep_steps = acc.rep_steps
        dup_keys = acc.dup_keys
        index = self._index
        # DivergenceIndex entries of this tap's forward, first-attempt steps.
        seen = index.steps_of(acc.run, acc.name) if index is not None else None
        last, last_vals = acc.last_step, acc.last_vals
        new_steps: list[int] = []  # steps of new per-device keys
        added = dups = 0
        prev_kind = prev_proc = None
        # orjson never makes a NaN or inf: only checked records (decoded
        # ones) need the finite test.
        decoded = lines is None
        for r, i in zip(part, where):
            # The group's run and name are present; these four and dtype,
            # shape, time and host make the ten required fields. The usual
            # record has no other field than its kind's (so no pass,
            # attempt, index, divergent...): checked by counting its keys.
            try:
                v = r["value"]
                step = r["step"]
                kind = r["kind"]
                proc = r["process"]
            except KeyError:
                kind = None
            else:
                tv = type(v)
                tp = type(proc)
                if not (
                    (tv is float or tv is int)
                    and (not decoded or v - v == 0)
                    and type(step) is int
                    and (tp is int or tp in scalar)
                    and "dtype" in r
                    and "shape" in r
                    and "time" in r
                    and "host" in r
                ):
                    kind = None
            if kind == "per_device":
                # Twelve fields: the ten, device and coords.
                try:
                    dev = r["device"]
                    coords = r["coords"]
                    usual = len(r) == 12 and coords == dev_coords[dev]
                except (KeyError, TypeError):  # unknown or unhashable device
                    usual = False
                if usual:  # _int_values, inline (one axis the quickest)
                    try:
                        (c,) = coords.values()
                        usual = type(c) is int
                    except ValueError:
                        usual = _int_values(coords)
                if usual:
                    # _pd_key of a device at its usual coordinates, and _key
                    d = dev if type(dev) is int else int(dev)
                    if d < _MASK_DEVICES:
                        bit = 1 << d
                        mask = masks.get(step, 0)
                        if mask & bit:
                            dups += 1
                        else:
                            masks[step] = mask | bit
                    else:
                        key = step << 20 | d
                        if key in pd_keys:
                            dups += 1
                        else:
                            pd_keys.add(key)
                            new_steps.append(step)
            elif kind == "replicated":
                vhash = r.get("vhash")
                devs = r.get("devices")
                procs = r.get("processes")
                usual = (
                    type(vhash) is str
                    and vhash != ""
                    and "replicas" in r
                    and len(r) == 12 + (devs is not None) + (procs is not None)
                    and (devs is None or type(devs) is list and set(map(type, devs)) <= scalar)
                    and (procs is None or type(procs) is list and set(map(type, procs)) <= scalar)
                )
                if usual:
                    if procs:
                        # The writer's process first, as ``add`` does: of
                        # equal ids (1, 1.0, True) the set keeps the first.
                        processes.add(proc)
                        processes.update(procs)
                    steps.add(step)
                    if devs:
                        devices.update(devs)
                    rep_steps.add(step)
                    dup = (step, "forward", vhash)
                    if dup in dup_keys:
                        dups += 1
                    else:
                        dup_keys.add(dup)
                    if seen is not None:  # DivergenceIndex.add, inline
                        entry = (vhash, proc)
                        if seen.setdefault(step, entry) is not entry:
                            index.repeat(seen, step, entry)
            else:
                usual = False
            if not usual:
                acc.records += added
                acc.duplicates += dups
                acc.last_step, acc.last_vals = last, last_vals
                added = dups = 0
                self._odd(r, i, lines, first, bad)
                last, last_vals = acc.last_step, acc.last_vals
                continue
            # What every usual record adds (the key parts are done above).
            added += 1
            if kind != prev_kind:
                kinds.add(kind)
                prev_kind = kind
            if proc is not prev_proc:  # small ints are one object each
                processes.add(proc)
                prev_proc = proc
            if last is None or step > last:
                last, last_vals = step, [v]
            elif step == last:
                last_vals.append(v)
            values.append(v)
        acc.records += added
        acc.duplicates += dups
        acc.last_step, acc.last_vals = last, last_vals
        acc.pd_count.update(new_steps)
        acc.finite.extend(values)

    def names_and_runs(self) -> tuple[set, set]:
        """The names and runs of the records added."""
        return {n for names in self._groups.values() for n in names}, set(self._groups)

    def summaries(self) -> list[TapSummary]:
        """One TapSummary per (run, name), runs in file order, names sorted."""
        out = [
            acc.result(self._index)
            for names in self._groups.values()
            for _, acc in sorted(names.items())
        ]
        for s in out:
            s.restarts = self._restarts.text(s.run)
        return out


def _group(rs: list, keys: list) -> list[tuple[Any, list, list[int]]]:
    """``rs`` split by ``keys`` (one per item, hashable): (key, items,
    their positions in ``rs``) per key, each part in order, parts in the
    order their keys first appear. A few taps per batch (the usual case)
    take a few C-level passes each; many take one Python pass in all."""
    distinct = list(dict.fromkeys(keys))
    if len(distinct) == 1:
        return [(distinct[0], rs, range(len(rs)))]
    if len(distinct) <= 8 and all(type(k) is str for k in distinct):
        out = []
        for k in distinct:
            picked = list(map(k.__eq__, keys))
            out.append((k, list(compress(rs, picked)), list(compress(range(len(rs)), picked))))
        return out
    parts: dict = {}
    for i, (k, r) in enumerate(zip(keys, rs)):
        part = parts.get(k)
        if part is None:
            parts[k] = ([r], [i])
        else:
            part[0].append(r)
            part[1].append(i)
    return [(k, a, b) for k, (a, b) in parts.items()]


def _checked(
    rs: list, lines: list[bytes] | None, first: int, bad: list | None
) -> tuple[list, None]:
    """The records among unchecked items, each as parse.parse_line makes it
    (the others' (line, problem) appended to ``bad``); checked ones as they
    are."""
    if lines is None:
        return rs, None
    out = []
    for i, raw in enumerate(lines):
        d, problem = parse_line(raw)
        if d is None:
            if bad is not None:
                bad.append((first + i, problem or "invalid"))
        else:
            out.append(d)
    return out, None


def summarize_file(
    path: str | os.PathLike, flt: Filter | None = None
) -> tuple[list[TapSummary], list[tuple[int, str]], set, set]:
    """``pmaptap summary``: the summaries of the records of ``path`` that
    ``flt`` matches, streaming the file (records are parsed, summarized and
    dropped; values are never decoded). Also the (line, problem) list of
    lines that are not records and every name and run read."""
    flt = flt or Filter()
    if not flt.active and not flt.all_attempts and not is_sharded(path):
        # The common case in one pass, assuming the run was never resumed;
        # a record of a later attempt means it was: then the pass below,
        # which first finds what later attempts superseded.
        with _collector_paused():
            acc, bad = _summarize_plain(path)
        if not acc.resumed:
            names, runs = acc.names_and_runs()
            return acc.summaries(), bad, names, runs
    acc = Summarizer()
    # What a later attempt of a resumed run replaced is not part of the story.
    attempts = scan(path) if not flt.all_attempts else Attempts()
    bad: list[tuple[int, str]] = []
    names: set = set()
    runs: set = set()
    everything = not flt.active
    resumed = bool(attempts)
    # The loop allocates a few small objects per line and frees the record,
    # creating no reference cycles; the cyclic collector would still walk the
    # growing per-tap sets again and again (a third of the time of a large
    # file), so it waits until the file is read.
    with _collector_paused():
        for _, records, problems in iter_batches(path):
            if problems:
                bad.extend(problems.items())
                records = [d for d in records if d is not None]
            if resumed:
                kept = []
                for d in records:
                    if attempts.superseded(d):
                        names.add(d["name"])
                        runs.add(d["run"])
                    else:
                        kept.append(d)
                records = kept
            if everything:
                acc.add_batch(records)
                continue
            matched = []
            for d in records:
                if flt(d):
                    matched.append(d)
                    continue
                names.add(d["name"])
                runs.add(d["run"])
                if flt.key_match(d):
                    acc.see(d)
            acc.add_batch(matched)
    added_names, added_runs = acc.names_and_runs()
    return acc.summaries(), bad, names | added_names, runs | added_runs


def _summarize_plain(path: str | os.PathLike) -> tuple[Summarizer, list[tuple[int, str]]]:
    """Every record of one file, orjson's values straight into add_batch,
    which checks the usual records itself (parse_line the rest)."""
    acc = Summarizer()
    bad: list[tuple[int, str]] = []
    for first, items, problems, lines in iter_file_batches(path, unchecked=True):
        if lines is not None:
            acc.add_batch(items, lines, first, bad)
            continue
        if problems:
            bad.extend(problems.items())
            items = [d for d in items if d is not None]
        acc.add_batch(items)
    bad.sort()  # found a tap at a time: back in line order
    return acc, bad


def tap_summaries(records: Iterable[dict]) -> list[TapSummary]:
    """One TapSummary per (run, name), runs in file order, names sorted."""
    acc = Summarizer()
    for r in records:
        acc.add(r)
    return acc.summaries()


def _steps_text(steps: Sequence[int], limit: int = 5) -> str:
    shown = ",".join(map(str, steps[:limit]))
    return shown + (",..." if len(steps) > limit else "")


def _issues(s: TapSummary) -> str:
    out = []
    if s.divergent_steps:
        out.append(
            f"divergent at {len(s.divergent_steps)} step(s) ({_steps_text(s.divergent_steps)})"
        )
    if s.missing:
        out.append(f"{s.missing} missing step(s) ({format_gaps(s.stride, list(s.gaps))})")
    if s.incomplete_steps:
        out.append(
            f"{len(s.incomplete_steps)} step(s) missing devices ({_steps_text(s.incomplete_steps)})"
        )
    if s.duplicates:
        out.append(f"{s.duplicates} duplicate record(s)")
    if s.nonfinite:
        where = f", first at step {s.first_nonfinite_step}"
        if s.first_nonfinite_devices:
            where += f" on device(s) {format_ids(list(s.first_nonfinite_devices))}"
        out.append(f"{s.nonfinite} non-finite value(s){where}")
    if s.per_device_steps:
        out.append(
            f"per-device data at {len(s.per_device_steps)} step(s) "
            f"before the copies first agreed ({_steps_text(s.per_device_steps)})"
        )
    return "; ".join(out)


def _num(x: float | None) -> str:
    return "-" if x is None else format_number(x)


def _last(s: TapSummary) -> str:
    if not s.last:
        return "-"
    if len(s.last) == 1:
        return format_number(s.last[0])
    finite = [x for x in s.last if math.isfinite(x)]
    if not finite:
        lo_hi = "nan"
    elif min(finite) == max(finite):
        lo_hi = format_number(finite[0])
    else:
        lo_hi = f"{format_number(min(finite))}..{format_number(max(finite))}"
    return lo_hi + ("+nan" if len(finite) < len(s.last) and finite else "")


_COLUMNS = (
    "name",
    "kind",
    "records",
    "steps",
    "procs",
    "devices",
    "last",
    "min",
    "max",
    "mean",
    "norm",
    "issues",
)


def summary_table(records: Iterable[dict] | Sequence[TapSummary]) -> str:
    """A per-tap text table: record count, step range, processes and devices
    seen, last/min/max/mean of scalar values and, for array taps, min/max/mean
    over their finite elements and the L2 norm at the last step; divergences
    (of replicated values, and of auto taps whose copies had agreed before),
    missing steps, duplicate records, and where the first NaN/inf was. Takes
    records, or the summaries of ``Summarizer.summaries()``."""
    records = list(records)
    summaries = (
        records if records and isinstance(records[0], TapSummary) else tap_summaries(records)
    )
    if not summaries:
        return "no records"
    out: list[str] = []
    for run in dict.fromkeys(s.run for s in summaries):
        group = [s for s in summaries if s.run == run]
        n = sum(s.records for s in group)
        procs = format_ids(sorted({p for s in group for p in s.processes}, key=id_order))
        devs = format_ids([d for s in group for d in s.devices])
        restarts = next((s.restarts for s in group if s.restarts), "")
        out.append(
            f"run {run}: {n} records, {len(group)} tap(s), "
            f"processes {procs}, devices {devs}" + (f"; {restarts}" if restarts else "")
        )
        table = Table(_COLUMNS, right={"records"})
        rows = [
            {
                "name": s.name,
                "kind": "+".join(s.kinds),
                "records": str(s.records),
                "steps": f"{s.first_step}-{s.last_step}"
                if s.first_step != s.last_step
                else str(s.first_step),
                "procs": format_ids(s.processes),
                "devices": format_ids(s.devices),
                "last": _last(s) if not s.nonscalar else "(array)",
                "min": _num(s.min),
                "max": _num(s.max),
                "mean": _num(s.mean),
                "norm": _num(s.norm),
                "issues": _issues(s) or "-",
            }
            for s in group
        ]
        table.fit(rows)
        out.append(table.header())
        out.extend(table.format(r) for r in rows)
        out.append("")
    return "\n".join(out).rstrip("\n")
