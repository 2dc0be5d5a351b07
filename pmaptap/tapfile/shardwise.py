"""``pmaptap summary`` of a sharded run, a source at a time: the shared file
and each shard (runs.sources) read as one file is read, their records
summarized as they come, without the merge (runs.iter_merged) that
``read()`` and the streaming commands need: it cost more than the summary
itself (docs/performance.md).

A summary depends on the order of its records only through their positions
(summary.py), so each record's position is its place in the merge: its
merge key (runs.merge_keys), its source's index and its line there, which
order as the merge orders. What the merge decides across sources is
decided here once every source is read:

- the copies of a replicated value: the merge keeps the first copy of a
  (key, vhash) and every later one of the same process, and drops the
  other processes' (runs._merge_round). Here each (key, vhash) keeps the
  copies of the process whose copy has the least position. Replicated
  records are summarized last, kept copies only, in the merge's order
  (divergence is judged in stream order);
- the line number in the merged stream of a line that is no record: from
  every source's merge keys (kept as runs of equal keys) and the dropped
  copies, counted only when there is such a line.

A run that was resumed is read again once what its later attempts
superseded is known (attempts.scan), as summary.py does. Where this cannot
be exact the merged stream is read instead: an id written with two types
(1 and 1.0) in two sources (a set keeps the first met, and here "first" is
not the merge's). tapfile/jobs.py reads groups of sources so in worker
processes and absorbs their states.
"""

from __future__ import annotations

import bisect
import os
from array import array
from collections import Counter
from itertools import accumulate, repeat
from operator import attrgetter, itemgetter
from typing import Any

from pmaptap.tapfile import runs
from pmaptap.tapfile.attempts import Attempts, scan
from pmaptap.tapfile.lines import collector_paused, iter_file_records
from pmaptap.tapfile.query import Filter
from pmaptap.tapfile.schema import UNSET
from pmaptap.tapfile.summary import FilteredSummarizer, Result, Summarizer

_POS = itemgetter(0)
_COPY = attrgetter("run", "name", "step", "process", "vhash", "pass_", "index", "attempt")


class _Keys:
    """One source's merge keys, line by line, as runs of equal keys (a
    process's records of one step share theirs): 16 bytes a run."""

    __slots__ = ("keys", "ends", "t")

    def __init__(self) -> None:
        self.keys = array("d")
        self.ends = array("q")  # lines up to the end of each run
        self.t = float("-inf")

    def add(self, records: list, holes: bool) -> list[float]:
        """The keys of the source's next lines (their records)."""
        keys, self.t = runs.merge_keys(records, holes, self.t)
        counts = Counter(keys)  # in key order: a source's keys never decrease
        ks, ns = list(counts), list(counts.values())
        done = self.ends[-1] if self.ends else 0
        if ks and self.keys and self.keys[-1] == ks[0]:
            self.ends[-1] += ns[0]
            done += ns.pop(0)
            ks.pop(0)
        ends = list(accumulate(ns, initial=done))
        del ends[0]
        self.keys.extend(ks)
        self.ends.extend(ends)
        return keys

    def below(self, t: float, inclusive: bool) -> int:
        """How many lines have a key below ``t`` (or equal, ``inclusive``)."""
        i = (bisect.bisect_right if inclusive else bisect.bisect_left)(self.keys, t)
        return self.ends[i - 1] if i else 0

    def key(self, line: int) -> float:
        return self.keys[bisect.bisect_left(self.ends, line)]


class ShardwiseSummary:
    """The summary state of some of a run's sources (``add_source`` each),
    positions and all; ``absorb`` another's (tapfile/jobs.py: the sources
    of a worker process), ``result`` once every source is in."""

    def __init__(self, flt: Filter, attempts: "Attempts | None") -> None:
        # attempts None: assumed never resumed (``resumed`` tells otherwise).
        self.optimistic = attempts is None
        self.acc = FilteredSummarizer(flt, Attempts() if attempts is None else attempts)
        self.bad: list = []  # (position, why) of lines that are no record
        self.keys: dict[int, _Keys] = {}  # by source index
        # (record key, vhash) -> [least position, its process, [(position,
        # record) of that process's copies]]; replicated records without a
        # hash (never dropped) as (position, record).
        self.copies: dict[tuple, list] = {}
        self.unhashed: list = []
        self.dropped: dict[int, array] = {}  # lines of the copies dropped, by source

    @property
    def resumed(self) -> bool:
        """Whether a record of a later attempt was met, assumed none."""
        return self.optimistic and self.acc.resumed

    def add_source(self, index: int, path: str) -> None:
        """Every line of the source ``path``, the run's ``index``-th."""
        name = os.path.basename(path)
        keys = self.keys[index] = _Keys()
        for first, records, problems in iter_file_records(path):
            n = len(records)
            mine = keys.add(records, bool(problems))
            at = list(zip(mine, repeat(index, n), range(first, first + n)))
            for line, why in problems.items():
                self.bad.append((at[line - first], f"{why} ({name} line {line})"))
            copies = [i for i, r in enumerate(records) if r is not None and r.kind == "replicated"]
            if copies:
                records = list(records)
                self._copies([at[i] for i in copies], [records[i] for i in copies])
                for i in copies:
                    records[i] = None
            self.acc.take(records, positions=at)
            if self.resumed:
                return

    def _copies(self, at: list, records: list) -> None:
        """Replicated records at their positions."""
        copies, dropped = self.copies, self.dropped
        for pos, r in zip(at, records):
            run, name, step, p, vhash, pass_, index, attempt = _COPY(r)
            if not vhash:
                self.unhashed.append((pos, r))
                continue
            if pass_ is UNSET and index is UNSET and attempt is UNSET:
                k = ((run, name, step, "forward", None, 0), vhash)  # r.key(), quicker
            else:
                k = (r.key(), vhash)
            got = copies.get(k)
            if got is None:
                copies[k] = [pos, p, [(pos, r)]]
                continue
            if p == got[1]:
                got[2].append((pos, r))
                if pos < got[0]:
                    got[0] = pos
                continue
            if pos < got[0]:  # an earlier copy of another process
                gone = got[2]
                copies[k] = [pos, p, [(pos, r)]]
            else:
                gone = [(pos, r)]
            for q, _ in gone:
                lines = dropped.get(q[1])
                if lines is None:
                    lines = dropped[q[1]] = array("q")
                lines.append(q[2])

    def absorb(self, other: ShardwiseSummary) -> None:
        """Another's state, of other sources."""
        self.acc.absorb(other.acc, ordered=False)
        self.bad += other.bad
        self.keys.update(other.keys)
        self.unhashed += other.unhashed
        for src, lines in other.dropped.items():
            self.dropped[src] = lines
        held = [x for _, _, mine in other.copies.values() for x in mine]
        self._copies([pos for pos, _ in held], [r for _, r in held])

    def result(self) -> "Result | None":
        """The summary (summary.summarize_file's result); None if it would
        not be exact (see the module's docstring) or ``resumed``."""
        acc = self.acc
        kept = self.unhashed + [x for _, _, held in self.copies.values() for x in held]
        kept.sort(key=_POS)
        acc.take([r for _, r in kept], positions=[pos for pos, _ in kept])
        if self.resumed or not _plain_ids(acc):
            return None
        return acc.result(self._placed())

    def _placed(self) -> list[tuple[int, str]]:
        """The lines that are no record at their lines of the merged stream."""
        if not self.bad:
            return []
        bad = sorted(self.bad, key=_POS)
        at = [pos for pos, _ in bad]
        before = [0] * (len(at) + 1)  # lines of other runs of keys before each
        rest = [0] * len(at)
        by = [(t, s) for t, s, _ in at]
        for src, keys in self.keys.items():
            if len(keys.keys) <= len(at):
                # Each run of keys counts before the lines past it.
                start = 0
                for t, end in zip(keys.keys, keys.ends):
                    before[bisect.bisect_right(by, (t, src))] += end - start
                    start = end
            else:
                for i, (t, s, _) in enumerate(at):
                    if s != src:
                        rest[i] += keys.below(t, src < s)
                        continue
                    rest[i] += keys.below(t, False)
        for i, (t, s, line) in enumerate(at):
            # The line's own source: its lines before it at its key too.
            rest[i] += line - 1 - self.keys[s].below(t, False)
        dropped = sorted(
            (self.keys[src].key(line), src, line)
            for src, lines in self.dropped.items()
            for line in lines
        )
        out = []
        total = 0
        for i, (pos, why) in enumerate(bad):
            total += before[i]
            out.append((total + rest[i] + 1 - bisect.bisect_left(dropped, pos), why))
        return out


def _plain_ids(acc: Summarizer) -> bool:
    """Whether every process and device id of every tap is an int (or
    None): then no two equal ids of two types met in two orders."""
    for names in acc._taps.values():
        for tap in names.values():
            for ids in (tap.processes, tap.devices, tap.first_bad_devs):
                if set(map(type, ids)) - {int, type(None)}:
                    return False
    return True


def summarize(path: str | os.PathLike, flt: Filter) -> "Result | None":
    """The summary of the records of the local sharded run ``path`` that
    ``flt`` matches (summary.summarize_file), or None where it would not
    be exact (the caller reads the merged stream)."""
    path = os.fspath(path)
    optimistic = not flt.active and not flt.all_attempts
    attempts = None if optimistic else (Attempts() if flt.all_attempts else scan(path))
    got = read_sources(path, range(len(runs.sources(path))), flt, attempts)
    if got.resumed:  # a record of a later attempt: what it superseded first
        got = read_sources(path, range(len(runs.sources(path))), flt, scan(path))
    return got.result()


def read_sources(
    path: str, indexes: Any, flt: Filter, attempts: "Attempts | None"
) -> ShardwiseSummary:
    """The state of the sources of ``path`` at ``indexes`` (of runs.sources),
    until one is ``resumed`` (``attempts`` None: assumed never)."""
    got = ShardwiseSummary(flt, attempts)
    files = runs.sources(path)
    with collector_paused():
        for i in indexes:
            got.add_source(i, files[i])
            if got.resumed:
                break
    return got
