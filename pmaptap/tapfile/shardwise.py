"""``pmaptap summary`` and ``validate`` of a sharded run, a source at a
time: the shared file and each shard (runs.sources) read as one file is
read, their records summarized or checked as they come, without the merge
(runs.iter_merged) that ``read()`` and the streaming commands need: it
cost more than the summary itself (docs/performance.md).

A summary or a check depends on the order of its records only through
their positions (summary.py, checks.Validator), so each record's position
is its place in the merge: its merge key (runs.merge_keys), its source's
index and its line there, which order as the merge orders. What the merge
decides across sources is decided here once every source is read:

- the copies of a replicated value: the merge keeps the first copy of a
  (key, vhash) and every later one of the same process, and drops the
  other processes' (runs._merge_round). Here each (key, vhash) keeps the
  copies of the process whose copy has the least position. Replicated
  records are taken last, kept copies only, in the merge's order
  (divergence and duplicates are judged in stream order);
- a per-device record's first copy (validate): within a source it is the
  first met; a key with copies in two sources gets the least position;
- the line number in the merged stream of a line with a problem: from
  every source's merge keys (kept as runs of equal keys) and the dropped
  copies, counted only when there is such a line.

A run that was resumed is read again once what its later attempts
superseded is known (attempts.scan), as summary.py and checks.py do. Where
a summary cannot be exact the merged stream is read instead: an id written
with two types (1 and 1.0) in two sources (a set keeps the first met, and
here "first" is not the merge's); a process's copies of replicated values
in two sources (the shared file and its shard: a copy dropped before the
other source is read may belong to the first process after all).
tapfile/jobs.py reads groups of sources so in worker processes and absorbs
their states.
"""

from __future__ import annotations

import bisect
import os
from array import array
from collections import Counter
from itertools import accumulate, repeat
from operator import itemgetter
from typing import Any

from pmaptap.tapfile import runs
from pmaptap.tapfile.attempts import Attempts, scan
from pmaptap.tapfile.checks import Report, Validator, _what
from pmaptap.tapfile.lines import collector_paused, iter_file_records
from pmaptap.tapfile.query import Filter
from pmaptap.tapfile.summary import FilteredSummarizer, Result, Summarizer

_POS = itemgetter(0)
_LINE_BITS = 40  # a line number below 2**40 in a source
# The runs of merge keys (16 bytes each) kept to place lines in the merged
# stream: past this (a run of ~4 M host-steps), a summary or validate that
# finds a line to place reads the merged stream instead.
MAX_KEY_RUNS = 4 << 20
# The replicated records held until every source is read (the copies a
# value's first process wrote: one a value where its owner writes it once),
# ~300 bytes each: past this, the merged stream is read instead, whose
# memory does not grow with the run.
MAX_HELD_COPIES = 1 << 18
_LINE_MASK = (1 << _LINE_BITS) - 1


class _Keys:
    """One source's merge keys, line by line, as runs of equal keys (a
    process's records of one step share theirs): 16 bytes a run, kept
    while ``keep``; and how many lines it has."""

    __slots__ = ("keys", "ends", "t", "lines")

    def __init__(self) -> None:
        self.keys = array("d")
        self.ends = array("q")  # lines up to the end of each run
        self.t = float("-inf")
        self.lines = 0

    def add(self, records: list, holes: bool, keep: bool) -> tuple[list[float], int]:
        """The keys of the source's next lines (their records), and the
        runs kept for them."""
        keys, self.t = runs.merge_keys(records, holes, self.t)
        self.lines += len(keys)
        if not keep:
            return keys, 0
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
        return keys, len(ks)

    def below(self, t: float, inclusive: bool) -> int:
        """How many lines have a key below ``t`` (or equal, ``inclusive``)."""
        i = (bisect.bisect_right if inclusive else bisect.bisect_left)(self.keys, t)
        return self.ends[i - 1] if i else 0

    def key(self, line: int) -> float:
        return self.keys[bisect.bisect_left(self.ends, line)]


class _Shardwise:
    """What a pass over some of a run's sources holds besides its
    accumulator (``add_source`` each source; ``absorb`` another's, of other
    sources: tapfile/jobs.py's workers; ``finish`` once all are in)."""

    def __init__(self, optimistic: bool) -> None:
        # optimistic: assumed never resumed (``resumed`` tells otherwise).
        self.optimistic = optimistic
        self.bad: list = []  # (position, why) of lines that are no record
        self.keys: dict[int, _Keys] = {}  # by source index
        # runs.copy_key -> [least position, its process, [(position,
        # record) of that process's copies]]; replicated records without a
        # hash (never dropped) as (position, record).
        self.copies: dict[tuple, list] = {}
        self.unhashed: list = []
        self.dropped: dict[int, array] = {}  # lines of the copies dropped, by source
        self.n_dropped = 0
        # Whether lines can still be placed in the merged stream: the keys'
        # runs and the dropped lines are kept up to MAX_KEY_RUNS runs.
        self.placeable = True
        self.runs_kept = 0
        self.key_budget = MAX_KEY_RUNS  # of this state's sources (_read)
        # Copies held (in ``copies`` and ``unhashed``); past MAX_HELD_COPIES,
        # or a process's copies met in two sources (``copy_sources``:
        # process -> the source of its copies; see _copies), the pass stops
        # (``overflow``) and the merged stream is read.
        self.held = 0
        self.held_budget = MAX_HELD_COPIES
        self.overflow = False
        self.copy_sources: dict = {}

    @property
    def resumed(self) -> bool:
        """Whether a record of a later attempt was met, assumed none."""
        raise NotImplementedError

    def _take(self, records: list, at: Any) -> None:
        """Records (None for what is taken elsewhere) at their positions
        (``_positions``)."""
        raise NotImplementedError

    def _positions(self, keys: list, index: int, first: int) -> Any:
        """The positions of a source's lines from ``first``, their merge
        ``keys`` given: (key, source, line)."""
        return list(zip(keys, repeat(index, len(keys)), range(first, first + len(keys))))

    def add_source(self, index: int, path: str) -> None:
        """Every line of the source ``path``, the run's ``index``-th."""
        name = os.path.basename(path)
        keys = self.keys[index] = _Keys()
        for first, records, problems in iter_file_records(path):
            mine, kept = keys.add(records, bool(problems), self.placeable)
            self.runs_kept += kept
            if self.runs_kept > self.key_budget:
                self._forget()
            for line, why in problems.items():
                self.bad.append(
                    ((mine[line - first], index, line), runs.source_problem(why, name, line))
                )
            copies = [i for i, r in enumerate(records) if r is not None and r.kind == "replicated"]
            if copies:
                records = list(records)
                at = [(mine[i], index, first + i) for i in copies]
                self._copies(at, [records[i] for i in copies])
                for i in copies:
                    records[i] = None
            self._take(records, self._positions(mine, index, first))
            if self.held > self.held_budget:
                self.overflow = True
            if self.resumed or self.overflow:
                return

    def _copies(self, at: list, records: list) -> None:
        """Replicated records at their positions.

        A copy dropped here is gone for good, which is exact only while no
        copy of its process can come later with a lesser position (its
        process would then be the first, every copy of it kept). Within a
        source positions only grow, so this holds while each process's
        copies are in one source; a process met in two (a layout changed
        by a restart: the shared file and a shard; odd ids, ``true`` and
        1) ends the pass (``overflow``): the merged stream decides."""
        copies, dropped, sources = self.copies, self.dropped, self.copy_sources
        for pos, r in zip(at, records):
            if not r.vhash:
                self.unhashed.append((pos, r))
                self.held += 1
                continue
            if sources.setdefault(r.process, pos[1]) != pos[1]:
                self.overflow = True
                return
            k = runs.copy_key(r)
            got = copies.get(k)
            if got is None:
                copies[k] = [pos, r.process, [(pos, r)]]
                self.held += 1
                continue
            p = r.process
            if p == got[1]:
                got[2].append((pos, r))
                self.held += 1
                if pos < got[0]:
                    got[0] = pos
                continue
            if pos < got[0]:  # an earlier copy of another process
                gone = got[2]
                copies[k] = [pos, p, [(pos, r)]]
                self.held += 1 - len(gone)
            else:
                gone = [(pos, r)]
            self.n_dropped += len(gone)
            if not self.placeable:
                continue
            for q, _ in gone:
                lines = dropped.get(q[1])
                if lines is None:
                    lines = dropped[q[1]] = array("q")
                lines.append(q[2])

    def _forget(self) -> None:
        """Stop keeping what places lines in the merged stream (a run past
        MAX_KEY_RUNS: a line with a problem then has the merged stream read)."""
        self.placeable = False
        for k in self.keys.values():
            k.keys, k.ends = array("d"), array("q")
        self.dropped = {}

    def absorb(self, other: _Shardwise) -> None:
        """Another's state (the accumulator: the subclass's), of other sources."""
        self.bad += other.bad
        self.keys.update(other.keys)
        self.unhashed += other.unhashed
        self.held += len(other.unhashed)
        self.dropped.update(other.dropped)
        self.n_dropped += other.n_dropped
        self.runs_kept += other.runs_kept
        if not (self.placeable and other.placeable) or self.runs_kept > MAX_KEY_RUNS:
            self._forget()
        for p, src in other.copy_sources.items():
            if self.copy_sources.setdefault(p, src) != src:
                self.overflow = True
        held = [x for _, _, mine in other.copies.values() for x in mine]
        self._copies([pos for pos, _ in held], [r for _, r in held])
        self.overflow = self.overflow or other.overflow or self.held > MAX_HELD_COPIES

    def finish(self) -> None:
        """Take the copies of replicated values the merge keeps, in its order."""
        kept = self.unhashed + [x for _, _, held in self.copies.values() for x in held]
        kept.sort(key=_POS)
        self._take([r for _, r in kept], self._kept([pos for pos, _ in kept]))
        self.copies, self.unhashed = {}, []

    def _kept(self, positions: list) -> Any:
        """Positions (key, source, line) as ``_take`` takes them."""
        return positions

    def lines(self) -> int:
        """The lines of the merged stream."""
        return sum(k.lines for k in self.keys.values()) - self.n_dropped

    def placed(self, positions: list) -> "dict | None":
        """Each of ``positions`` (of lines read) -> its line in the merged
        stream; None if that is no longer known (``placeable``)."""
        at = sorted(set(positions))
        if not at:
            return {}
        if not self.placeable:
            return None
        before = [0] * (len(at) + 1)  # lines of other sources' runs of keys before each
        rest = [0] * len(at)
        by = [(t, s) for t, s, _ in at]
        for src, keys in self.keys.items():
            if len(keys.keys) <= len(at):
                # Each run of keys counts before the positions past it.
                start = 0
                for t, end in zip(keys.keys, keys.ends):
                    before[bisect.bisect_right(by, (t, src))] += end - start
                    start = end
            else:
                for i, (t, s, _) in enumerate(at):
                    rest[i] += keys.below(t, src < s)
        for i, (t, s, line) in enumerate(at):
            # The line's own source: its lines before it at its key too.
            rest[i] += line - 1 - self.keys[s].below(t, False)
        dropped = sorted(
            (self.keys[src].key(line), src, line)
            for src, lines in self.dropped.items()
            for line in lines
        )
        out = {}
        total = 0
        for i, pos in enumerate(at):
            total += before[i]
            out[pos] = total + rest[i] + 1 - bisect.bisect_left(dropped, pos)
        return out


class ShardwiseSummary(_Shardwise):
    """A summary's state of some of a run's sources, positions and all."""

    def __init__(self, flt: Filter, attempts: "Attempts | None") -> None:
        super().__init__(attempts is None)
        self.acc = FilteredSummarizer(flt, Attempts() if attempts is None else attempts)

    @property
    def resumed(self) -> bool:
        return self.optimistic and self.acc.resumed

    def _take(self, records: list, at: list) -> None:
        self.acc.take(records, positions=at)

    def absorb(self, other: _Shardwise) -> None:
        super().absorb(other)
        self.acc.absorb(other.acc, ordered=False)

    def result(self) -> "Result | None":
        """The summary (summary.summarize_file's result), ``finish``ed; None
        if it would not be exact (see the module's docstring)."""
        if self.overflow:
            return None
        place = self.placed([pos for pos, _ in self.bad])
        if place is None or not _plain_ids(self.acc):
            return None
        return self.acc.result(sorted((place[pos], why) for pos, why in self.bad))


class ShardwiseValidation(_Shardwise):
    """A validation's state of some of a run's sources, positions and all."""

    def __init__(self, path: str, attempts: "Attempts | None") -> None:
        super().__init__(attempts is None)
        self.v = Validator(path, attempts)

    @property
    def resumed(self) -> bool:
        return self.v.resumed

    def _take(self, records: list, at: Any) -> None:
        self.v.take_records(records, at)

    # The checker keeps a position per key's first copy: as one int,
    # (source << _LINE_BITS) + line, not a tuple (the key is the source's).
    def _positions(self, keys: list, index: int, first: int) -> Any:
        base = (index << _LINE_BITS) + first
        return range(base, base + len(keys))

    def _kept(self, positions: list) -> Any:
        return [(s << _LINE_BITS) + line for _, s, line in positions]

    def _at(self, pos: Any) -> tuple:
        """A position as (key, source, line)."""
        if type(pos) is tuple:
            return pos
        src, line = pos >> _LINE_BITS, pos & _LINE_MASK
        return (self.keys[src].key(line), src, line)

    def absorb(self, other: _Shardwise) -> None:
        super().absorb(other)
        v, o = self.v, other.v
        v.records += o.records
        v.superseded += o.superseded
        v.problems += o.problems
        for pos, parts in o.dups:
            v.dups.append((pos, parts))
        v.absorb_firsts(o)
        v.index.absorb(o.index)
        v.flagged |= o.flagged
        v.fingerprinted |= o.fingerprinted

    def report(self) -> "Report | None":
        """The report (checks.validate_file's), ``finish``ed; None where a
        per-device key has copies in two sources (which one is first is the
        merge's to say: the caller reads the merged stream)."""
        if self.overflow:
            return None
        v = self.v
        first, at = v.firsts.first, self._at
        dups = [(pos, first(parts), parts) for pos, parts in v.dups]
        if any(
            parts[0][0] == "per_device" and a >> _LINE_BITS != b >> _LINE_BITS
            for a, b, parts in dups
        ):
            return None
        if not self.placeable and (dups or v.problems or self.bad):
            return None
        dups = [(at(a), at(b), parts) for a, b, parts in dups]
        problems = [(at(pos), why) for pos, why in v.problems] + self.bad
        place = self.placed([p for p, _ in problems] + [p for d in dups for p in d[:2]])
        v.problems = [(place[pos], why) for pos, why in problems]
        dups = [(place[a], place[b], _what(parts)) for a, b, parts in dups]
        return v.report(dups, self.lines())


def _plain_ids(acc: Summarizer) -> bool:
    """Whether every process and device id of every record added is an int
    (or None): then no two equal ids of two types met in two orders."""
    return not any(tap.odd_ids for names in acc._taps.values() for tap in names.values())


def _read(got: _Shardwise, path: str, indexes: "list[int] | None") -> _Shardwise:
    """``got`` of the sources of ``path`` at ``indexes`` (of runs.sources;
    None: every one, then ``finish``ed), until one is ``resumed``."""
    files = runs.sources(path)
    if indexes is not None:  # a share of the sources: of the budgets too
        share = len(indexes) / max(len(files), 1)
        got.key_budget = int(MAX_KEY_RUNS * share)
        got.held_budget = int(MAX_HELD_COPIES * share)
    with collector_paused():
        for i in range(len(files)) if indexes is None else indexes:
            got.add_source(i, files[i])
            if got.resumed or got.overflow:
                return got
        if indexes is None:
            got.finish()
    return got


def summary_of(
    path: str, indexes: "list[int] | None", flt: Filter, attempts: "Attempts | None"
) -> ShardwiseSummary:
    """The summary state of the sources of ``path`` at ``indexes``."""
    return _read(ShardwiseSummary(flt, attempts), path, indexes)


def summarize(path: str | os.PathLike, flt: Filter) -> "Result | None":
    """The summary of the records of the local sharded run ``path`` that
    ``flt`` matches (summary.summarize_file), or None where it would not
    be exact (the caller reads the merged stream)."""
    path = os.fspath(path)
    optimistic = not flt.active and not flt.all_attempts
    attempts = None if optimistic else (Attempts() if flt.all_attempts else scan(path))
    got = summary_of(path, None, flt, attempts)
    if got.resumed:  # a record of a later attempt: what it superseded first
        got = summary_of(path, None, flt, scan(path))
    return got.result()


def validation_of(
    path: str, indexes: "list[int] | None", attempts: "Attempts | None"
) -> ShardwiseValidation:
    """The validation state of the sources of ``path`` at ``indexes``."""
    return _read(ShardwiseValidation(path, attempts), path, indexes)


def validate(path: str | os.PathLike) -> "Report | None":
    """checks.validate_file of the local sharded run ``path``, or None
    where it would not be exact (the caller reads the merged stream)."""
    path = os.fspath(path)
    got = validation_of(path, None, None)
    if got.resumed:
        got = validation_of(path, None, scan(path))
    return got.report()
