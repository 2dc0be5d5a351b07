"""Divergence across processes: which replicated keys a file holds with
different values from different processes."""

from __future__ import annotations

from typing import Any

from pmaptap.tapfile.format import key_with_step, record_key, split_step


class DivergenceIndex:
    """Which replicated keys (``record_key``) the file holds with more
    than one value from more than one process: ``add`` every replicated
    record seen, then ask ``divergent``. The first writer of a key could not
    know that a later process would disagree (see _host/crossdedup.py); one process
    re-writing a key with new values is not divergence. Holds one small entry
    per replicated key, never the records."""

    def __init__(self) -> None:
        # split_step's rest of a key (run, name, pass, index, attempt) ->
        # step -> what was seen there: (vhash, process) while one of each,
        # then {vhash: processes}. By
        # step within the rest of the key: a small int per step, not a
        # tuple per record, for a summary of a long run.
        self._seen: dict[tuple, dict[Any, Any]] = {}
        # Whether any key was seen with a second (vhash, process): only then
        # can ``divergent`` be true (readers skip asking otherwise).
        self.any_repeat = False

    def steps_of(
        self, run: Any, name: Any, pass_: Any = "forward", index: Any = None, attempt: Any = 0
    ) -> dict[Any, Any]:
        """The step -> entry map of one (run, name, pass, index key,
        attempt): record_key without its step; an entry is (vhash, process)
        while one was seen there, then {vhash: processes}."""
        # The parameters are split_step's rest of a key, in its order.
        return self._steps((run, name, pass_, index, attempt))

    def _steps(self, rest: tuple) -> dict[Any, Any]:
        steps = self._seen.get(rest)
        if steps is None:
            steps = self._seen[rest] = {}
        return steps

    def add(self, r: Any) -> None:
        """A record (a line's object or a schema.py Struct)."""
        if type(r) is dict:
            kind, vhash, process = r.get("kind"), r.get("vhash"), r.get("process")
        else:
            kind, vhash, process = r.kind, r.vhash, r.process
        if kind != "replicated" or not vhash:
            return
        rest, step = split_step(record_key(r))
        steps = self._steps(rest)
        entry = (vhash, process)
        if steps.setdefault(step, entry) is not entry:
            self.repeat(steps, step, entry)

    def repeat(self, steps: dict, step: Any, entry: tuple) -> None:
        """``entry`` (vhash, process) met another one at ``step``."""
        got = steps[step]
        if isinstance(got, tuple):
            if got == entry:
                return
            self.any_repeat = True
            got = steps[step] = {got[0]: {got[1]}}
        got.setdefault(entry[0], set()).add(entry[1])

    def divergent(self, r: Any) -> bool:
        if r.get("kind") != "replicated":
            return False
        return self.is_divergent(record_key(r))

    def is_divergent(self, key: tuple) -> bool:
        """Whether the replicated key ``key`` (record_key) is divergent."""
        rest, step = split_step(key)
        steps = self._seen.get(rest)
        got = steps.get(step) if steps is not None else None
        if not isinstance(got, dict):
            return False
        return len(got) > 1 and len(set().union(*got.values())) > 1

    def absorb(self, other: DivergenceIndex) -> None:
        """Add what another index saw (of another piece of the stream):
        the same index as if it had seen those records too, in any order."""
        for rest, steps in other._seen.items():
            mine = self._steps(rest)
            for step, got in steps.items():
                entries = (
                    [got]
                    if isinstance(got, tuple)
                    else [(vhash, p) for vhash, procs in got.items() for p in procs]
                )
                for entry in entries:
                    if mine.setdefault(step, entry) is not entry:
                        self.repeat(mine, step, entry)

    def divergent_keys(self):
        """The record_key of every divergent key, as ``divergent`` judges."""
        if not self.any_repeat:
            return
        for rest, steps in self._seen.items():
            for step, got in steps.items():
                if isinstance(got, dict) and len(got) > 1 and len(set().union(*got.values())) > 1:
                    yield key_with_step(rest, step)


def reconcile_divergence(records: list[dict]) -> None:
    """Mark every replicated record of a key that the file holds with
    different values from different processes ``divergent`` (DivergenceIndex)."""
    index = DivergenceIndex()
    for r in records:
        index.add(r)
    mark_divergent(records, index)


def mark_divergent(records: list[dict], index: DivergenceIndex) -> None:
    """Set ``divergent`` on each of ``records`` that ``index.divergent``
    calls divergent, asking only where it can be: a key of a divergent
    name (divergence is rare, and a read holds many records)."""
    if not index.any_repeat:
        return
    keys = set(index.divergent_keys())
    names = {k[1] for k in keys}
    for r in records:
        if r.get("kind") == "replicated" and r.get("name") in names and record_key(r) in keys:
            r["divergent"] = True
