"""``pmaptap summary`` and ``validate`` of a sharded run a source at a time,
each record at its place in the merge (docs/architecture.md, "A sharded run
summarized shard by shard"); None where that would not be exact."""

from __future__ import annotations

import bisect
import contextlib
import functools
import os
import struct
import tempfile
import zlib
from array import array
from collections import Counter, defaultdict
from itertools import accumulate, repeat
from operator import attrgetter, itemgetter
from typing import Any, Callable, Iterable, Iterator, Union

import msgspec

from pmaptap.tapfile import source
from pmaptap.tapfile.analyze.summary import Result, Summarizer, first_attempts
from pmaptap.tapfile.analyze.validate import FirstCopies, Report, Validator
from pmaptap.tapfile.read import Attempts, Filter, latest
from pmaptap.tapfile.record import CLASSES
from pmaptap.tapfile.source import collector_paused, iter_file_records

_POS = itemgetter(0)
_LINE_BITS = 40  # a line number below 2**40 in a source
# The runs of merge keys and lines of dropped copies kept to place lines in
# the merged stream, counted over the whole run so every --jobs prints the
# same; past it a line is named by its source and line (source.SourceLine).
MAX_KEY_RUNS = 4 << 20
# Replicated copies a process holds; past it, to a file (``_spill``).
MAX_HELD_COPIES = 1 << 17
# Bytes of the run per bucket of copies gone to the file.
BUCKET_BYTES = 32 << 20
_LINE_MASK = (1 << _LINE_BITS) - 1
_lines = functools.partial(defaultdict, functools.partial(array, "q"))  # picklable
# In a read's temporary directory once a state met more than MAX_KEY_RUNS.
_UNPLACEABLE = "past-max-key-runs"


class _Keys:
    """One source's merge keys as runs of equal keys (a process's records
    of one step share theirs), kept while ``keep``; and its line count."""

    __slots__ = ("keys", "ends", "t", "lines", "stored")

    def __init__(self) -> None:
        self.keys = array("d")
        self.ends = array("q")  # lines up to the end of each run
        self.t = float("-inf")
        self.lines = 0
        # (file, offset, runs): where ``_Shardwise.store_keys`` put the runs
        # (keys, then ends, 8 bytes each), or None.
        self.stored: "tuple[str, int, int] | None" = None

    def load(self) -> None:
        """The runs ``_Shardwise.store_keys`` put in a file, back."""
        if self.stored is None:
            return
        path, offset, n = self.stored
        with open(path, "rb") as f:
            f.seek(offset)
            self.keys.fromfile(f, n)
            self.ends.fromfile(f, n)
        self.stored = None

    def add(self, records: list, holes: bool, keep: bool) -> tuple[list[float], int]:
        """The keys of the source's next lines (their records), and how many
        runs they start (kept where ``keep``)."""
        before = self.t
        keys, self.t = source.merge_keys(records, holes, before)
        self.lines += len(keys)
        if not keys:
            return keys, 0
        if not keep:  # a source's keys never decrease: distinct keys are runs
            return keys, len(set(keys)) - (keys[0] == before)
        counts = Counter(keys)  # in key order: a source's keys never decrease
        ks, ns = list(counts), list(counts.values())
        done = self.ends[-1] if self.ends else 0
        if ks and self.keys and self.keys[-1] == ks[0]:
            self.ends[-1] += ns[0]
            done += ns.pop(0)
            ks.pop(0)
        self.keys.extend(ks)
        self.ends.extend(done + n for n in accumulate(ns))
        return keys, len(ks)

    def below(self, t: float, inclusive: bool) -> int:
        """How many lines have a key below ``t`` (or equal, ``inclusive``)."""
        i = (bisect.bisect_right if inclusive else bisect.bisect_left)(self.keys, t)
        return self.ends[i - 1] if i else 0

    def key(self, line: int) -> float:
        return self.keys[bisect.bisect_left(self.ends, line)]


class _Shardwise:
    """A pass over some of a run's sources, besides its accumulator
    (``add_source`` each; ``absorb`` another's; then ``combine``). A
    subclass gives ``resumed`` (a record of a later attempt met, assumed
    none), ``fresh()`` (an empty state like it) and ``_take(records, at)``."""

    def __init__(self, optimistic: bool) -> None:
        self.optimistic = optimistic  # assumed never resumed (``resumed`` says otherwise)
        self.bad: list = []  # (position, why) of lines that are no record
        self.keys: dict[int, _Keys] = {}  # by source index
        self.names: dict[int, str] = {}  # each source's path, by index
        # source.copy_key -> [least position, its process, [(position,
        # record) of that process's copies]]; replicated records without a
        # hash (never dropped) as (position, record).
        self.copies: dict[tuple, list] = {}
        self.unhashed: list = []
        self.dropped: dict[int, array] = _lines()  # of the copies dropped, by source
        self.n_dropped = 0
        self.placeable = True  # at most MAX_KEY_RUNS met: lines placed in the merge
        self.runs_met = 0
        # Copies held, at most MAX_HELD_COPIES; past it they go to ``spill``
        # (in ``spill_dir``; ``spilled``: bucket -> [(offset, length)]).
        self.held = 0
        self.buckets = 1
        self.spill_dir: "str | None" = None
        self.spill: "str | None" = None
        self.spilled: dict[int, list] = {}
        self.spills: list = []  # of the states absorbed: [(spill, spilled)]
        self.overflow = False  # a process's copies met in two sources (see _copies)
        self.copy_sources: dict = {}

    def _positions(self, keys: list, index: int, first: int) -> Any:
        """(key, source, line) of a source's lines from ``first``, given their ``keys``."""
        return list(zip(keys, repeat(index, len(keys)), range(first, first + len(keys))))

    def add_source(self, index: int, path: str) -> None:
        """Every line of the source ``path``, the run's ``index``-th."""
        name = os.path.basename(path)
        self.names[index] = path
        keys = self.keys[index] = _Keys()
        for first, records, problems in iter_file_records(path):
            mine, n = keys.add(records, bool(problems), self.placeable)
            for line, why in problems.items():
                self.bad.append(
                    ((mine[line - first], index, line), source.source_problem(why, name, line))
                )
            copies = [i for i, r in enumerate(records) if r is not None and r.kind == "replicated"]
            self.runs_met += n + len(copies)
            if self.placeable and self.runs_met > MAX_KEY_RUNS:
                self._forget()
            if copies:
                records = list(records)
                self._copies([((mine[i], index, first + i), records[i]) for i in copies])
                for i in copies:
                    records[i] = None
                if self.held > MAX_HELD_COPIES:
                    self._spill()
            self._take(records, self._positions(mine, index, first))
            if self.resumed or self.overflow:
                return
        self._source_read(index)

    def _source_read(self, index: int) -> None:
        """The ``index``-th source read whole: what is kept only meanwhile goes."""

    def settle(self) -> None:
        """What only the whole run decides (``combine``, its files still there)."""

    def _copies(self, held: Iterable[tuple]) -> None:
        """Replicated records, (position, record) each. A copy dropped here is
        gone for good: exact while each process's copies are in one source
        (positions only grow within one); a process in two ends the pass (``overflow``)."""
        copies, sources = self.copies, self.copy_sources
        for pos, r in held:
            if not r.vhash:
                self.unhashed.append((pos, r))
                self.held += 1
                continue
            if sources.setdefault(r.process, pos[1]) != pos[1]:
                self.overflow = True
                return
            k = source.copy_key(r)
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
            self._drop([q for q, _ in gone])

    def _drop(self, positions: list) -> None:
        """Copies the merge drops, at their positions."""
        self.n_dropped += len(positions)
        if self.placeable:
            for _, src, line in positions:
                self.dropped[src].append(line)

    def _spill(self) -> None:
        """The copies held to the spill file, bucketed by a stable hash of their record key."""
        held = self.unhashed + [x for _, _, mine in self.copies.values() for x in mine]
        self.copies, self.unhashed, self.held = {}, [], 0
        if not held:
            return
        if self.spill is None:
            fd, self.spill = tempfile.mkstemp(prefix="copies-", dir=self.spill_dir)
            os.close(fd)
        parts: dict[int, list] = {}
        n = self.buckets
        for pos, r in held:
            b = zlib.crc32(repr(r.key()).encode("utf-8", "backslashreplace")) % n
            parts.setdefault(b, []).append((pos, r))
        with open(self.spill, "ab") as f:
            offset = f.tell()
            for b, part in parts.items():
                blob, kept = _encode(part)
                where = self.spilled.setdefault(b, [])
                if blob:
                    f.write(blob)
                    where.append((offset, len(blob)))
                    offset += len(blob)
                if kept:
                    where.append(kept)  # in memory (see _encode)

    def end(self, share: float) -> None:
        """This pass's sources read: copies past its ``share`` of MAX_HELD_COPIES
        to the file (the one who takes every state in holds at most that)."""
        if self.spill is not None or self.held > MAX_HELD_COPIES * share:
            self._spill()

    def _forget(self) -> None:
        """Stop keeping what places lines in the merged stream (past MAX_KEY_RUNS)."""
        self.placeable = False
        for k in self.keys.values():
            k.keys, k.ends, k.stored = array("d"), array("q"), None
        self.dropped = _lines()
        if self.spill_dir is not None:
            # Said to the other workers: part of the run past the bound is
            # the whole run past it.
            open(os.path.join(self.spill_dir, _UNPLACEABLE), "wb").close()

    def store_keys(self) -> None:
        """A worker's keys to a file in ``spill_dir``, not in the state it sends:
        the parent needs them only to place a line (``load_keys``)."""
        if not self.placeable or self.spill_dir is None:
            return
        if self.past_max_key_runs():
            self._forget()  # another state was past MAX_KEY_RUNS: so is the run
            return
        try:
            fd, path = tempfile.mkstemp(prefix="keys-", dir=self.spill_dir)
        except OSError:
            return  # no file to be had: the keys stay in the state
        try:
            with os.fdopen(fd, "wb") as f:
                for k in self.keys.values():
                    k.keys.tofile(f)
                    k.ends.tofile(f)
        except OSError:  # a full TMPDIR, say: the keys go in the state, as they did
            with contextlib.suppress(OSError):
                os.unlink(path)
            return
        offset = 0
        for k in self.keys.values():
            k.stored = (path, offset, len(k.keys))
            offset += 16 * len(k.keys)
            k.keys, k.ends = array("d"), array("q")

    def past_max_key_runs(self) -> bool:
        """Whether a state of this read was past MAX_KEY_RUNS (``_forget``)."""
        return self.spill_dir is not None and os.path.exists(
            os.path.join(self.spill_dir, _UNPLACEABLE)
        )

    def load_keys(self) -> None:
        """The keys ``store_keys`` filed, back where a line is to be placed."""
        if self.placeable and self._to_place():
            for k in self.keys.values():
                k.load()

    def _to_place(self) -> bool:
        """Whether a line will be placed in the merged stream (``placed``)."""
        return bool(self.bad)

    def absorb(self, other: _Shardwise) -> None:
        """Another's state (of other sources, or copies ``resolve``d)."""
        self.bad += other.bad
        self.keys.update(other.keys)
        self.names.update(other.names)
        self.unhashed += other.unhashed
        self.held += len(other.unhashed)
        if self.placeable:
            for src, lines in other.dropped.items():
                self.dropped[src].extend(lines)
        self.n_dropped += other.n_dropped
        self.runs_met += other.runs_met
        if self.placeable and (not other.placeable or self.runs_met > MAX_KEY_RUNS):
            self._forget()
        for p, src in other.copy_sources.items():
            if self.copy_sources.setdefault(p, src) != src:
                self.overflow = True
        self._copies(x for _, _, mine in other.copies.values() for x in mine)
        self.overflow = self.overflow or other.overflow
        if other.spill is not None:
            self.spills.append((other.spill, other.spilled))

    def finish(self) -> None:
        """Take the copies of replicated values the merge keeps, in its order."""
        kept = self.unhashed + [x for _, _, held in self.copies.values() for x in held]
        kept.sort(key=_POS)
        self._take([r for _, r in kept], self._kept([pos for pos, _ in kept]))
        self.copies, self.unhashed, self.held = {}, [], 0

    def _kept(self, positions: list) -> Any:
        """Positions (key, source, line) as ``_take`` takes them."""
        return positions

    def lines(self) -> int:
        """The lines of the merged stream."""
        return sum(k.lines for k in self.keys.values()) - self.n_dropped

    def placed(self, positions: list) -> dict:
        """Each of ``positions`` -> its line in the merged stream, or (past
        MAX_KEY_RUNS: not ``placeable``) its source and line (source.SourceLine)."""
        at = sorted(set(positions))
        if not at:
            return {}
        if not self.placeable:
            names = self.names
            return {pos: source.SourceLine(pos[1], pos[2], names[pos[1]]) for pos in at}
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


# Spilled copies: positions and records in msgpack (quicker than pickling
# Structs). What msgpack does not take (an ``odd`` record, an integer past
# 64 bits) stays in memory: pmaptap imports no deserializer that runs code
# (tests/trace/test_bad_input.py).
_ENCODER = msgspec.msgpack.Encoder()
_POSITIONS = msgspec.msgpack.Decoder(list[tuple[float, int, int]])
_RECORDS = msgspec.msgpack.Decoder(list[Union[tuple(CLASSES.values())]])  # noqa: UP007 - a runtime Union
_HEAD = struct.Struct("<Q")


def _encode(part: list) -> tuple[bytes, list]:
    """(the bytes of ``part``'s plain copies, the copies kept as they are)."""
    plain = [x for x in part if not x[1].odd]
    kept = [x for x in part if x[1].odd]
    if not plain:
        return b"", kept
    try:
        positions = _ENCODER.encode([p for p, _ in plain])
        records = _ENCODER.encode([r for _, r in plain])
    except (OverflowError, TypeError, msgspec.EncodeError):
        return b"", part
    return _HEAD.pack(len(positions)) + positions + records, kept


def _decode(blob: bytes) -> list:
    (n,) = _HEAD.unpack_from(blob)
    start = _HEAD.size
    positions = _POSITIONS.decode(blob[start : start + n])
    return list(zip(positions, _RECORDS.decode(blob[start + n :])))


def resolve(got: _Shardwise, spills: list, buckets: list[int], placeable: bool) -> _Shardwise:
    """The copies in ``buckets`` of every spill file (``spills``: [(path,
    spilled)]) taken into the empty state ``got`` as the merge keeps them, a
    bucket at a time; ``placeable``: the whole run's (keep the lines dropped)."""
    if not placeable:
        got._forget()
    with collector_paused():
        for b in buckets:
            held: list = []
            for path, spilled in spills:
                parts = spilled.get(b)
                if parts:
                    with open(path, "rb") as f:
                        for part in parts:
                            if isinstance(part, list):
                                held += part  # kept in memory (see _encode)
                            else:
                                f.seek(part[0])
                                held += _decode(f.read(part[1]))
            # In the merge's order, _copies keeps the first copy's process's
            # (a process's copies are in one source: else the read stopped).
            held.sort(key=_POS)
            got._copies(held)
            got.finish()
            if got.resumed:
                break
    return got


def combine(
    states: Iterable[_Shardwise], workers: int, resolver: Callable[[list], Iterable]
) -> _Shardwise:
    """Every pass's state as one, the copies taken as the merge keeps them
    (``resolver(tasks)``: ``resolve(*task)`` of each, up to ``workers``); a
    state ``resumed`` or ``overflow`` is given back as is."""
    got = _combine(states, workers, resolver)
    if not (got.resumed or got.overflow):
        got.load_keys()
        got.settle()
    return got


def _combine(
    states: Iterable[_Shardwise], workers: int, resolver: Callable[[list], Iterable]
) -> _Shardwise:
    it = iter(states)
    got = next(it)
    if got.resumed or got.overflow:
        return got  # the pass is given up: the others are not waited for
    for other in it:
        if other.resumed or other.overflow:
            return other
        got.absorb(other)
        if got.held > MAX_HELD_COPIES:
            got._spill()
    if got.resumed or got.overflow:
        return got
    if got.spill is None and not got.spills:
        got.finish()
        return got
    got._spill()  # those held here: resolved with the rest, by bucket
    spills = [*got.spills, *([(got.spill, got.spilled)] if got.spill is not None else [])]
    used = sorted({b for _, spilled in spills for b in spilled})
    tasks = [
        (got.fresh(), spills, used[k::workers], got.placeable)
        for k in range(min(workers, len(used)))
    ]
    for other in resolver(tasks):
        if other.resumed:
            return other
        got.absorb(other)
    return got


class ShardwiseSummary(_Shardwise):
    """A summary's state of some of a run's sources, positions and all."""

    def __init__(self, flt: Filter, attempts: "Attempts | None") -> None:
        super().__init__(attempts is None)
        self.flt, self.attempts = flt, attempts
        self.acc = Summarizer(flt, attempts)

    def fresh(self) -> ShardwiseSummary:
        return ShardwiseSummary(self.flt, self.attempts)

    @property
    def resumed(self) -> bool:
        return self.optimistic and self.acc.resumed

    def _take(self, records: list, at: list) -> None:
        self.acc.take(records, positions=at)

    def absorb(self, other: _Shardwise) -> None:
        super().absorb(other)
        self.acc.absorb(other.acc, None)

    def result(self) -> "Result | None":
        """summary.summarize_file's result, ``combine``d; None if not exact."""
        # An id of another type than int (1.0, true): equal ids of two types
        # may have met in two orders.
        if self.overflow or any(t.odd_ids for n in self.acc._taps.values() for t in n.values()):
            return None
        place = self.placed([pos for pos, _ in self.bad])
        return self.acc.result(sorted((place[pos], why) for pos, why in self.bad))


class ShardwiseValidation(_Shardwise):
    """A validation's state of some of a run's sources, positions and all: a
    per-device key's first copy is found in its source, leaving per tap and
    device the steps it holds (``spans``) for ``settle``."""

    def __init__(self, path: str, attempts: "Attempts | None") -> None:
        super().__init__(attempts is None)
        self.path, self.attempts = path, attempts
        self.v = Validator(path, attempts)
        # Per-device duplicates as (position, its first copy's, parts);
        # group -> [(least step, most step, source, steps)]: steps a range,
        # a (file, offset, count) of int64s, or a frozenset (odd steps).
        self.device_dups: list = []
        self.spans: dict[tuple, list] = {}
        self.steps_file: "str | None" = None
        self.clash = False

    def fresh(self) -> ShardwiseValidation:
        return ShardwiseValidation(self.path, self.attempts)

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
        """A position as (key, source, line) (the key 0.0 where the run's
        keys are not kept: ``placed`` then names the source and line)."""
        if type(pos) is tuple:
            return pos
        src, line = pos >> _LINE_BITS, pos & _LINE_MASK
        return (self.keys[src].key(line) if self.placeable else 0.0, src, line)

    def _source_read(self, index: int) -> None:
        # While sources are read the checker meets per-device records only
        # (replicated ones are taken once every source is: ``finish``).
        v = self.v
        self.device_dups += v.dup_pairs()
        for group, steps in v.firsts._keys.items():
            lo, hi, held = self._held(steps)
            self.spans.setdefault(group, []).append((lo, hi, index, held))
        v.dups, v.firsts, v._groups = [], FirstCopies(), {}

    def _held(self, steps: dict) -> tuple:
        """(least, most, steps) of a source's steps of one device."""
        try:
            got = array("q", steps)
        except (TypeError, OverflowError):  # odd steps (1.0, "2"): never one range
            return float("-inf"), float("inf"), frozenset(steps)
        lo, hi = min(got), max(got)
        n = len(got)
        stride = (hi - lo) // (n - 1) if n > 1 else 1
        one = range(lo, hi + 1, stride)
        # n distinct steps from lo to hi are one range when they are its n.
        if len(one) == n and all(map(steps.__contains__, one)):
            return lo, hi, one
        if self.steps_file is None:
            fd, self.steps_file = tempfile.mkstemp(prefix="steps-", dir=self.spill_dir)
            os.close(fd)
        with open(self.steps_file, "ab") as f:
            offset = f.tell()
            got.tofile(f)
        return lo, hi, (self.steps_file, offset, n)

    def absorb(self, other: _Shardwise) -> None:
        super().absorb(other)
        # Positions are the merge's already (offset 0); the lines are
        # counted by the keys (``lines``), not by the checker.
        self.v.absorb(other.v, 0)
        self.device_dups += other.device_dups
        for group, theirs in other.spans.items():
            self.spans.setdefault(group, []).extend(theirs)

    def settle(self) -> None:
        """``clash``: a per-device key in two sources whose step ranges overlap."""
        self.clash = any(
            _clash(near)
            for spans in self.spans.values()
            if len(spans) > 1
            for near in _overlapping(spans)
            if len(near) > 1
        )

    def _to_place(self) -> bool:
        return bool(self.bad or self.device_dups or self.v.dups or self.v.problems)

    def report(self) -> "Report | None":
        """validate.validate_file's report, ``combine``d; None on a ``clash``."""
        if self.overflow or self.clash:
            return None
        v, at = self.v, self._at
        dups = [(at(a), at(b), parts) for a, b, parts in self.device_dups + v.dup_pairs()]
        problems = [(at(pos), why) for pos, why in v.problems] + self.bad
        place = self.placed([p for p, _ in problems] + [p for d in dups for p in d[:2]])
        v.problems = [(place[pos], why) for pos, why in problems]
        dups = [(place[a], place[b], parts) for a, b, parts in dups]
        return v.report(dups, self.lines())


def _overlapping(spans: list) -> Iterator[list]:
    """``spans`` (``ShardwiseValidation.spans``) in groups whose ranges of
    steps overlap, by least step."""
    spans.sort(key=_POS)
    near: list = []  # spans overlapping, up to step ``reach``
    reach = spans[0][1]
    for span in spans:
        if span[0] > reach:
            yield near
            near = []
        reach = max(reach, span[1])
        near.append(span)
    yield near


def _clash(spans: list) -> bool:
    """Whether two of ``spans`` (``ShardwiseValidation.spans``) share a step."""
    seen: set = set()
    for _, _, _, held in spans:
        if type(held) is tuple:
            path, offset, n = held
            got = array("q")
            with open(path, "rb") as f:
                f.seek(offset)
                got.fromfile(f, n)
            held = got
        if not seen.isdisjoint(held):
            return True
        seen.update(held)
    return False


def buckets_for(size: int, jobs: int) -> int:
    """The buckets of the copies that go to a file (``_spill``)."""
    return max(jobs, -(-size // BUCKET_BYTES))


def read(
    got: _Shardwise,
    sources: "list[tuple[int, str]]",
    share: float,
    buckets: int,
    spill_dir: "str | None",
    sent: bool = False,
    end: bool = True,
) -> _Shardwise:
    """``got`` of ``sources`` ((index, path) each) too, until ``resumed``.
    ``end``: ``got`` is whole (``share`` of the run's bytes); ``sent``: its
    keys go to ``spill_dir`` too (``store_keys``)."""
    if got.resumed or got.overflow:
        return got  # the pass stops: more sources would not change that
    got.buckets, got.spill_dir = buckets, spill_dir
    with collector_paused():
        for i, source in sources:
            if sent and got.placeable and got.past_max_key_runs():
                got._forget()  # the run is past the bound: keep no keys
            got.add_source(i, source)
            if got.resumed or got.overflow:
                return got
        if end:
            got.end(share)
            if sent:
                got.store_keys()
    return got


def _serial(empty: _Shardwise, path: str) -> _Shardwise:
    """``empty``'s state of every source of the sharded run ``path``, here."""
    files = source.sources(path)
    size = sum(os.path.getsize(f) for f in files)
    with tempfile.TemporaryDirectory(prefix="pmaptap-") as tmp:
        got = read(empty, list(enumerate(files)), 1.0, buckets_for(size, 1), tmp)
        return combine([got], 1, lambda tasks: [resolve(*t) for t in tasks])


# How an empty state comes to hold every source of a run, ``combine``d: in
# this process (``_serial``) or by parallel.py's workers.
Reader = Callable[[_Shardwise], _Shardwise]


def summarize(
    path: str | os.PathLike, flt: Filter, reader: "Reader | None" = None
) -> "Result | None":
    """summary.summarize_file of the local sharded run ``path``; None: not exact."""
    path = source.Run.of(path)
    read = reader or functools.partial(_serial, path=path)
    attempts = first_attempts(path, flt)
    return latest(path, lambda a: read(ShardwiseSummary(flt, a)), _RESUMED, attempts).result()


def validate(path: str | os.PathLike, reader: "Reader | None" = None) -> "Report | None":
    """validate.validate_file of the local sharded run ``path``; None: not exact."""
    path = source.Run.of(path)
    read = reader or functools.partial(_serial, path=path)
    return latest(path, lambda a: read(ShardwiseValidation(path, a)), _RESUMED).report()


_RESUMED = attrgetter("resumed")
