"""Per-tap summaries of a list of records (as ``pmaptap.read`` returns them):
``summary_table(records) -> str`` for people (``pmaptap summary``, the end of a
training run) and ``tap_summaries(records)`` for code."""
from __future__ import annotations

import dataclasses
import math
import os
from array import array
from collections import defaultdict
from typing import Iterable, Sequence

from pmaptap.tapfile.attempts import Attempts, Restarts, scan
from pmaptap.tapfile.checks import (_canonical, _coords_key, count_missing, format_gaps,
                                    step_gaps)
from pmaptap.tapfile.format import NONFINITE
from pmaptap.tapfile.reader import DivergenceIndex, iter_lines
from pmaptap.tapfile.views import (Filter, Table, format_ids, format_number, id_order,
                                   scalar)


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
    last: tuple[float, ...]        # scalar values at the last step (distinct)
    min: float | None              # over finite scalar values
    max: float | None
    mean: float | None
    nonfinite: int                 # NaN/inf scalar values
    nonscalar: int                 # records whose value is not one number
    divergent_steps: tuple[int, ...]
    stride: int                    # gcd of step differences (every=N)
    gaps: tuple[tuple[int, int], ...]
    missing: int                   # steps missing inside the range
    incomplete_steps: tuple[int, ...]  # per_device steps lacking some devices
    duplicates: int
    restarts: str = ""             # the run's attempts ("2 attempts; restarted at step 5")


class _TapAcc:
    """One tap's summary, built a record at a time: what it keeps grows with
    the tap's distinct steps and devices, not with its values."""

    def __init__(self, run: str, name: str) -> None:
        self.run, self.name = run, name
        self.kinds: set = set()
        self.records = 0
        self.steps: set[int] = set()
        self.processes: set = set()
        self.devices: set = set()
        self.last_step: int | None = None     # the highest step with a scalar
        self.last_vals: list[float] = []
        self.finite = array("d")
        self.nonfinite = self.nonscalar = 0
        self.divergent: set[int] = set()
        self.rep_keys: set[tuple] = set()     # (step, pass, attempt) of replicated records
        self.per_device_steps: set[int] = set()
        self.per_dev: dict[int, set] = defaultdict(set)
        self.attempt_of_step: dict[int, int] = {}
        self.dup_keys: set[tuple] = set()
        self.duplicates = 0

    def add(self, r: dict) -> None:
        """A record as written or decoded (non-finite markers or floats).
        Runs for every record of ``pmaptap summary``: kept lean."""
        get = r.get
        kind = get("kind")
        step = r["step"]
        self.kinds.add(kind)
        self.records += 1
        self.steps.add(step)
        self.processes.add(get("process"))
        procs = get("processes")
        if procs:
            self.processes.update(procs)
        if get("divergent"):
            self.divergent.add(step)
        v = get("value")
        if type(v) is float or type(v) is int:
            x: float | None = v
        else:
            x = _scalar(v)
        if x is None:
            self.nonscalar += 1
        else:
            if self.last_step is None or step > self.last_step:
                self.last_step, self.last_vals = step, [x]
            elif step == self.last_step:
                self.last_vals.append(x)
            if math.isfinite(x):
                self.finite.append(x)
            else:
                self.nonfinite += 1
        # The duplicate key within this tap (checks.duplicate_key without the
        # run and name, which all of a tap's records share).
        if kind == "per_device":
            dev = (get("device"), _coords_key(get("coords")))
            key: tuple = ("per_device", step, get("pass", "forward"), dev)
            self.devices.add(dev[0])
            self.per_device_steps.add(step)
            a = get("attempt")
            if a:       # an elastic restart may have fewer devices: compare within an attempt
                self.attempt_of_step[step] = a
        else:
            devs = get("devices")
            if devs:
                self.devices.update(devs)
            if kind != "replicated":
                return      # meta records (counters) may legitimately repeat
            pass_ = get("pass", "forward")
            self.rep_keys.add((step, pass_, get("attempt", 0)))
            key = ("replicated", step, pass_, get("vhash") or _canonical(v))
        if key in self.dup_keys:
            self.duplicates += 1
        else:
            self.dup_keys.add(key)
            if kind == "per_device":
                self.per_dev[step].add(dev)

    def result(self, index: DivergenceIndex | None) -> TapSummary:
        kinds = tuple(sorted(self.kinds))
        divergent = set(self.divergent)
        if index is not None:
            probe = {"run": self.run, "name": self.name, "kind": "replicated"}
            for step, pass_, attempt in self.rep_keys:
                if index.divergent(dict(probe, step=step, attempt=attempt,
                                        **{"pass": pass_})):
                    divergent.add(step)
        if "replicated" in kinds and "per_device" in kinds:
            # dedup="auto": identical copies give a replicated record, differing
            # ones per-device records, so a per-device step here is a divergence.
            divergent |= self.per_device_steps
        incomplete: set[int] = set()
        if kinds == ("per_device",):
            full: dict[int, int] = {}
            at = self.attempt_of_step
            for s, v in self.per_dev.items():
                a = at.get(s, 0)
                full[a] = max(full.get(a, 0), len(v))
            incomplete = {s for s, v in self.per_dev.items()
                          if len(v) < full[at.get(s, 0)]}
        stride, gaps = step_gaps(self.steps)
        finite = self.finite
        return TapSummary(
            run=self.run, name=self.name, kinds=kinds, records=self.records,
            first_step=min(self.steps), last_step=max(self.steps),
            processes=tuple(sorted((p for p in self.processes if p is not None),
                                   key=id_order)),
            devices=tuple(sorted(self.devices, key=id_order)),
            last=tuple(dict.fromkeys(self.last_vals)),
            min=min(finite) if finite else None,
            max=max(finite) if finite else None,
            mean=math.fsum(finite) / len(finite) if finite else None,
            nonfinite=self.nonfinite, nonscalar=self.nonscalar,
            divergent_steps=tuple(sorted(divergent)), stride=stride,
            gaps=tuple(gaps), missing=count_missing(stride, gaps),
            incomplete_steps=tuple(sorted(incomplete)),
            duplicates=self.duplicates)


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

    def see(self, r: dict) -> None:
        if self._index is not None:
            self._index.add(r)

    def add(self, r: dict) -> None:
        self.see(r)
        self._restarts.add(r)
        run = r.get("run", "")
        names = self._groups.get(run)
        if names is None:
            names = self._groups[run] = {}
        acc = names.get(r["name"])
        if acc is None:
            acc = names[r["name"]] = _TapAcc(run, r["name"])
        acc.add(r)

    def summaries(self) -> list[TapSummary]:
        """One TapSummary per (run, name), runs in file order, names sorted."""
        out = [acc.result(self._index)
               for names in self._groups.values()
               for _, acc in sorted(names.items())]
        for s in out:
            s.restarts = self._restarts.text(s.run)
        return out


def summarize_file(path: str | os.PathLike, flt: Filter | None = None) -> tuple[
        list[TapSummary], list[tuple[int, str]], set, set]:
    """``pmaptap summary``: the summaries of the records of ``path`` that
    ``flt`` matches, streaming the file (records are parsed, summarized and
    dropped; values are never decoded). Also the (line, problem) list of
    lines that are not records and every name and run read."""
    flt = flt or Filter()
    acc = Summarizer()
    # What a later attempt of a resumed run replaced is not part of the story.
    attempts = scan(path) if not flt.all_attempts else Attempts()
    bad: list[tuple[int, str]] = []
    names: set = set()
    runs: set = set()
    for lineno, d, problem in iter_lines(path):
        if d is None:
            bad.append((lineno, problem or "invalid"))
            continue
        names.add(d["name"])
        runs.add(d["run"])
        if attempts and attempts.superseded(d):
            continue
        if flt(d):
            acc.add(d)
        elif flt.key_match(d):
            acc.see(d)
    return acc.summaries(), bad, names, runs


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
        out.append(f"divergent at {len(s.divergent_steps)} step(s) "
                   f"({_steps_text(s.divergent_steps)})")
    if s.missing:
        out.append(f"{s.missing} missing step(s) ({format_gaps(s.stride, list(s.gaps))})")
    if s.incomplete_steps:
        out.append(f"{len(s.incomplete_steps)} step(s) missing devices "
                   f"({_steps_text(s.incomplete_steps)})")
    if s.duplicates:
        out.append(f"{s.duplicates} duplicate record(s)")
    if s.nonfinite:
        out.append(f"{s.nonfinite} non-finite value(s)")
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


_COLUMNS = ("name", "kind", "records", "steps", "procs", "devices",
            "last", "min", "max", "mean", "issues")


def summary_table(records: Iterable[dict] | Sequence[TapSummary]) -> str:
    """A per-tap text table: record count, step range, processes and devices
    seen, last/min/max/mean of scalar values (min/max/mean over finite
    values), and divergences, missing steps and duplicate records. Takes
    records, or the summaries of ``Summarizer.summaries()``."""
    records = list(records)
    summaries = (records if records and isinstance(records[0], TapSummary)
                 else tap_summaries(records))
    if not summaries:
        return "no records"
    out: list[str] = []
    for run in dict.fromkeys(s.run for s in summaries):
        group = [s for s in summaries if s.run == run]
        n = sum(s.records for s in group)
        procs = format_ids(sorted({p for s in group for p in s.processes},
                                  key=id_order))
        devs = format_ids([d for s in group for d in s.devices])
        restarts = next((s.restarts for s in group if s.restarts), "")
        out.append(f"run {run}: {n} records, {len(group)} tap(s), "
                   f"processes {procs}, devices {devs}"
                   + (f"; {restarts}" if restarts else ""))
        table = Table(_COLUMNS, right={"records"})
        rows = [{
            "name": s.name, "kind": "+".join(s.kinds), "records": str(s.records),
            "steps": f"{s.first_step}-{s.last_step}" if s.first_step != s.last_step
            else str(s.first_step),
            "procs": format_ids(s.processes), "devices": format_ids(s.devices),
            "last": _last(s) if not s.nonscalar else "(array)",
            "min": _num(s.min), "max": _num(s.max), "mean": _num(s.mean),
            "issues": _issues(s) or "-",
        } for s in group]
        table.fit(rows)
        out.append(table.header())
        out.extend(table.format(r) for r in rows)
        out.append("")
    return "\n".join(out).rstrip("\n")
