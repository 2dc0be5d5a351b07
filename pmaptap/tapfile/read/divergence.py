"""Divergence on reading: which replicated keys a file holds with more than
one value."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from pmaptap.tapfile.record import key_with_step, record_key, split_step


class DivergenceIndex:
    """Which replicated keys (``record_key``) have more than one ``vhash``
    (the first writer of a key could not know a later one would disagree);
    a small entry per key, never the records."""

    def __init__(self) -> None:
        # split_step's rest of a key -> step -> the vhash seen there while
        # one was, then the set of the vhashes seen: a small entry per step.
        self._seen: defaultdict[tuple, dict[Any, Any]] = defaultdict(dict)
        # Whether any key was seen with a second vhash: only then can
        # ``divergent`` be true (readers skip asking otherwise).
        self.any_repeat = False

    def steps_of(
        self, run: Any, name: Any, pass_: Any = "forward", index: Any = None, attempt: Any = 0
    ) -> dict[Any, Any]:
        """The step -> entry map of split_step's rest of a key."""
        return self._seen[(run, name, pass_, index, attempt)]

    def add(self, r: Any) -> None:
        """A record (a line's object or a schema.py Struct)."""
        if type(r) is dict:
            kind, vhash = r.get("kind"), r.get("vhash")
        else:
            kind, vhash = r.kind, r.vhash
        if kind != "replicated" or not vhash:
            return
        rest, step = split_step(record_key(r))
        steps = self._seen[rest]
        if steps.setdefault(step, vhash) is not vhash:
            self.repeat(steps, step, vhash)

    def repeat(self, steps: dict, step: Any, vhash: str) -> None:
        got = steps[step]
        if type(got) is str:
            if got == vhash:
                return
            self.any_repeat = True
            steps[step] = {got, vhash}
        else:
            got.add(vhash)

    def divergent(self, r: Any) -> bool:
        return r.get("kind") == "replicated" and self.is_divergent(record_key(r))

    def is_divergent(self, key: tuple) -> bool:
        """Whether the replicated key ``key`` (record_key) is divergent."""
        rest, step = split_step(key)
        steps = self._seen.get(rest)
        return steps is not None and type(steps.get(step)) is set

    def absorb(self, other: DivergenceIndex) -> None:
        """Add what another index saw (of another piece of the stream)."""
        for rest, steps in other._seen.items():
            mine = self._seen[rest]
            for step, got in steps.items():
                for vhash in [got] if type(got) is str else got:
                    if mine.setdefault(step, vhash) is not vhash:
                        self.repeat(mine, step, vhash)

    def divergent_keys(self):
        """The record_key of every divergent key, as ``divergent`` judges."""
        if not self.any_repeat:
            return
        for rest, steps in self._seen.items():
            for step, got in steps.items():
                if type(got) is set:
                    yield key_with_step(rest, step)


def mark_divergent(records: list[dict], index: DivergenceIndex) -> None:
    """Set ``divergent`` on each of ``records`` that ``index`` calls
    divergent, asking only of a divergent name's (divergence is rare)."""
    if not index.any_repeat:
        return
    keys = set(index.divergent_keys())
    names = {k[1] for k in keys}
    for r in records:
        if r.get("kind") == "replicated" and r.get("name") in names and record_key(r) in keys:
            r["divergent"] = True
