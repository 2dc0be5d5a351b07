"""The per-tap text table of ``pmaptap summary`` and of the end of a training
run: ``summary_table(records or summaries) -> str``."""

from __future__ import annotations

import math
from typing import Iterable, Sequence

from pmaptap.tapfile.analyze.summary import TapSummary, tap_summaries
from pmaptap.tapfile.analyze.validate import format_gaps, steps_text
from pmaptap.tapfile.read import Table, format_ids, format_number


def _issues(s: TapSummary) -> str:
    out = []
    if s.fingerprint:
        out.append(s.fingerprint)  # names the steps and the suspects
    elif s.divergent_steps:
        out.append(
            f"divergent at {len(s.divergent_steps)} step(s) ({steps_text(s.divergent_steps)})"
        )
    if s.missing:
        out.append(f"{s.missing} missing step(s) ({format_gaps(s.stride, list(s.gaps))})")
    if s.incomplete_steps:
        out.append(
            f"{len(s.incomplete_steps)} step(s) missing devices ({steps_text(s.incomplete_steps)})"
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
            f"before the copies first agreed ({steps_text(s.per_device_steps)})"
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


def summary_table(records: Iterable[dict] | Sequence[TapSummary]) -> str:
    """``pmaptap summary``'s per-tap table (docs/cli.md) of records, or of
    the summaries of ``Summarizer.summaries()``."""
    records = list(records)
    summaries = (
        records if records and isinstance(records[0], TapSummary) else tap_summaries(records)
    )
    if not summaries:
        return "no records"
    out: list[str] = []
    for run in dict.fromkeys(s.run for s in summaries):
        of_run = [s for s in summaries if s.run == run]
        # A pytree tap's leaf rows share its records: counted once.
        per_tap: dict[str, int] = {}
        for s in of_run:
            per_tap[s.tap or s.name] = max(per_tap.get(s.tap or s.name, 0), s.records)
        n = sum(per_tap.values())
        procs = format_ids({p for s in of_run for p in s.processes})
        devs = format_ids([d for s in of_run for d in s.devices])
        restarts = next((s.restarts for s in of_run if s.restarts), "")
        out.append(
            f"run {run}: {n} records, {len(per_tap)} tap(s), "
            f"processes {procs}, devices {devs}" + (f"; {restarts}" if restarts else "")
        )
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
            for s in of_run
        ]
        table = Table(rows[0], right={"records"})  # the columns in the rows' order
        table.fit(rows)
        out.append(table.header())
        out.extend(table.format(r) for r in rows)
        out.append("")
    return "\n".join(out).rstrip("\n")
