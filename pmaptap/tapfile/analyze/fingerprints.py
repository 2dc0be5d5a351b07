"""Which copies of ``pmaptap.fingerprint``'s records differed, and whom to
suspect (docs/api.md, "Fingerprint records"): the summary's line
(``FingerprintAcc.text``) and ``suspects(records)`` for code."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from operator import itemgetter
from typing import Any, Iterable, Iterator

from pmaptap.tapfile.analyze.validate import steps_text
from pmaptap.tapfile.record import FINGERPRINT, first_holder, holder_ids, index_text


@dataclasses.dataclass(frozen=True)
class Suspect:
    """A copy whose fingerprint differed from the majority's."""

    device: Any  # the device id, None where unknown
    process: Any
    host: str | None
    coords: tuple[tuple[str, Any], ...]  # mesh coordinates, sorted by axis
    first_step: int  # the first step it differed at
    leaf: str  # the first leaf it differed in, at that step ("" a bare array)
    where: str  # the slice there ("" the whole leaf)
    steps: int  # how many steps it differed at
    # Whether the copies had a majority there; False: two (or more) equal
    # camps, none of them can be told wrong.
    majority: bool = True

    def describe(self) -> str:
        about = [f"process {self.process}"]
        if self.host:
            about.append(f"host {self.host}")
        if self.coords:
            about.append(",".join(f"{a}={c}" for a, c in self.coords))
        dev = "unknown" if self.device is None else self.device
        return f"device {dev} ({', '.join(about)})"


class FingerprintAcc:
    """The divergent fingerprint records of one name (see module doc)."""

    def __init__(self) -> None:
        # (step, leaf, slice) -> [(replicas, holders of that fingerprint)]
        self._groups: defaultdict[tuple, list[tuple[int, list[dict]]]] = defaultdict(list)
        self.steps: set[int] = set()  # steps whose copies differed

    def add(self, r: dict) -> None:
        if r.get("kind") != FINGERPRINT or not r.get("divergent"):
            return
        step = r["step"]
        self.steps.add(step)
        where = index_text(r.get("index")) or ",".join(
            f"{a}={c}" for a, c in sorted((r.get("slice_coords") or {}).items(), key=str)
        )
        key = (step, str(r.get("leaf", "")), where)
        replicas = r.get("replicas")
        self._groups[key].append((replicas if isinstance(replicas, int) else 0, _holders(r)))

    def absorb(self, other: "FingerprintAcc") -> None:
        """Add another piece's records of this name (summary --jobs)."""
        self.steps |= other.steps
        for key, values in other._groups.items():
            self._groups[key].extend(values)

    def suspects(self) -> list[Suspect]:
        """Every suspect copy, the earliest first (then by device). The
        same whatever order the records came in (pieces of a run summed up
        in several processes: summary --jobs)."""
        found: dict[tuple, Suspect] = {}  # each copy's first, ``steps`` counted below
        steps: dict[tuple, set] = {}
        for (step, leaf, where), values in sorted(self._groups.items(), key=itemgetter(0)):
            values = sorted(values, key=_camp_order)
            top = max(n for n, _ in values)
            majority = sum(1 for n, _ in values if n == top) == 1
            for n, holders in values:
                if majority and n == top:
                    continue
                for h in holders:
                    coords = h.get("coords")
                    coords = (
                        tuple(sorted(coords.items(), key=str)) if isinstance(coords, dict) else ()
                    )
                    who = (h.get("device"), h.get("process"), coords)
                    if who not in found:
                        found[who] = Suspect(
                            *who[:2], h.get("host"), coords, step, leaf, where, 0, majority
                        )
                    steps.setdefault(who, set()).add(step)
        return [dataclasses.replace(s, steps=len(steps[who])) for who, s in found.items()]

    def text(self) -> str:
        """The summary's line: where the copies first differed and who."""
        if not self.steps:
            return ""
        steps = sorted(self.steps)
        suspects = self.suspects()
        first = min(s.first_step for s in suspects) if suspects else steps[0]
        lead = next((s for s in suspects if s.first_step == first), None)
        where = ""
        if lead is not None:
            where = f", leaf {lead.leaf or '(the value)'}" + (
                f" [{lead.where}]" if lead.where else ""
            )
        names = "; ".join(f"{s.describe()} at {s.steps} step(s)" for s in suspects[:4])
        if len(suspects) > 4:
            names += f"; and {len(suspects) - 4} more"
        verdict = (
            f"suspect {names}"
            if suspects and all(s.majority for s in suspects)
            else f"copies disagree with no majority: {names}"
        )
        return (
            f"fingerprints differ at {len(steps)} step(s) ({steps_text(steps)}); "
            f"first at step {first}{where}: {verdict}"
        )


def _camp_order(camp: tuple) -> tuple:
    """The copies holding one fingerprint: the most held first, then by
    their holders' ids as text (ids of any JSON type compare so)."""
    n, holders = camp
    return (-n, [repr((h.get("device"), h.get("process"))) for h in holders])


def _holders(r: dict) -> list[dict]:
    """The copies holding a record's fingerprint: its ``holders`` (device,
    process, host, coordinates), else (a value held by many copies) its
    ``devices``, with the process where only one is named."""
    got = r.get("holders")
    if isinstance(got, list) and all(isinstance(h, dict) for h in got):
        return got
    procs = holder_ids(r.get("processes"))
    process = procs[0] if len(procs) == 1 else None
    return [{"device": d, "process": process} for d in holder_ids(r.get("devices"))]


def suspects(records: Iterable[dict]) -> dict[tuple[str, str], list[Suspect]]:
    """The suspects of every fingerprint name in ``records`` (as
    ``pmaptap.read`` returns them), by (run, name)."""
    accs: dict[tuple[str, str], FingerprintAcc] = {}
    for r in records:
        if r.get("kind") == FINGERPRINT:
            accs.setdefault((r.get("run"), r.get("name")), FingerprintAcc()).add(r)
    return {k: acc.suspects() for k, acc in accs.items()}


def divergence_series(rec: dict) -> Iterator[tuple[str, float]]:
    """What a dashboard gets of a fingerprint record (docs/forwarders.md): for
    a divergent one, the number of copies holding its fingerprint."""
    if rec.get("kind") != FINGERPRINT or not rec.get("divergent"):
        return
    leaf = rec.get("leaf")
    tag = str(rec.get("name")) + (f"/{leaf}" if leaf else "")
    replicas = rec.get("replicas")
    copies = float(replicas if isinstance(replicas, int) else 0)
    yield f"{tag}/divergent/device_{first_holder(rec)}", copies
