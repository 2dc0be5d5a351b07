"""Per-tap summaries of a list of records (as ``pmaptap.read`` returns them):
``summary_table(records) -> str`` for people (``pmaptap summary``, the end of a
training run) and ``tap_summaries(records)`` for code."""
from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Iterable, Sequence

from pmaptap.tapfile.checks import count_missing, find_duplicates, format_gaps, step_gaps
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


def _summarize_one(run: str, name: str, recs: Sequence[dict]) -> TapSummary:
    kinds = tuple(sorted({r.get("kind") for r in recs}))
    steps = [r["step"] for r in recs]
    processes: set[int] = set()
    devices: set = set()
    by_step: dict[int, list[float]] = defaultdict(list)
    finite: list[float] = []
    nonfinite = nonscalar = 0
    for r in recs:
        processes.add(r.get("process"))
        processes.update(r.get("processes") or ())
        if r.get("kind") == "per_device":
            devices.add(r.get("device"))
        else:
            devices.update(r.get("devices") or ())
        x = scalar(r.get("value"))
        if x is None:
            nonscalar += 1
            continue
        by_step[r["step"]].append(x)
        if math.isfinite(x):
            finite.append(x)
        else:
            nonfinite += 1
    divergent = {r["step"] for r in recs if r.get("divergent")}
    if "replicated" in kinds and "per_device" in kinds:
        # dedup="auto": identical copies give a replicated record, differing
        # ones per-device records, so a per-device step here is a divergence.
        divergent |= {r["step"] for r in recs if r.get("kind") == "per_device"}
    incomplete: set[int] = set()
    per_dev: dict[int, set] = defaultdict(set)
    for r in recs:
        if r.get("kind") == "per_device":
            per_dev[r["step"]].add((r.get("device"), str(r.get("coords"))))
    if kinds == ("per_device",):
        full = max((len(v) for v in per_dev.values()), default=0)
        incomplete = {s for s, v in per_dev.items() if len(v) < full}
    stride, gaps = step_gaps(steps)
    last_vals = by_step.get(max(by_step), []) if by_step else []
    return TapSummary(
        run=run, name=name, kinds=kinds, records=len(recs),
        first_step=min(steps), last_step=max(steps),
        processes=tuple(sorted((p for p in processes if p is not None),
                               key=id_order)),
        devices=tuple(sorted(devices, key=id_order)),
        last=tuple(dict.fromkeys(last_vals)),
        min=min(finite) if finite else None,
        max=max(finite) if finite else None,
        mean=math.fsum(finite) / len(finite) if finite else None,
        nonfinite=nonfinite, nonscalar=nonscalar,
        divergent_steps=tuple(sorted(divergent)), stride=stride,
        gaps=tuple(gaps), missing=count_missing(stride, gaps),
        incomplete_steps=tuple(sorted(incomplete)),
        duplicates=len(find_duplicates(recs)))


def tap_summaries(records: Iterable[dict]) -> list[TapSummary]:
    """One TapSummary per (run, name), runs in file order, names sorted."""
    groups: dict[str, dict[str, list[dict]]] = {}
    for r in records:
        groups.setdefault(r.get("run", ""), {}).setdefault(r["name"], []).append(r)
    return [_summarize_one(run, name, recs)
            for run, names in groups.items()
            for name, recs in sorted(names.items())]


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


def summary_table(records: Iterable[dict]) -> str:
    """A per-tap text table: record count, step range, processes and devices
    seen, last/min/max/mean of scalar values (min/max/mean over finite
    values), and divergences, missing steps and duplicate records."""
    summaries = tap_summaries(records)
    if not summaries:
        return "no records"
    out: list[str] = []
    for run in dict.fromkeys(s.run for s in summaries):
        group = [s for s in summaries if s.run == run]
        n = sum(s.records for s in group)
        procs = format_ids(sorted({p for s in group for p in s.processes},
                                  key=id_order))
        devs = format_ids([d for s in group for d in s.devices])
        out.append(f"run {run}: {n} records, {len(group)} tap(s), "
                   f"processes {procs}, devices {devs}")
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
