"""``pmaptap validate``'s checks (the format's rules, duplicates) and the
missing steps ``pmaptap summary`` names. A duplicate is a record_key written
twice with the same value (per-device: the same device and coords); the same
key with different values is a divergence, which is data."""

from __future__ import annotations

import dataclasses
import json
import math
import operator
import os
from itertools import compress
from typing import Any, Iterable, Sequence

from pmaptap.errors import NeedSerial
from pmaptap.tapfile.read import DivergenceIndex, attempt_of, latest
from pmaptap.tapfile.record import (
    FINGERPRINT,
    UNSET,
    AnyRecord,
    PerDevice,
    format_problems,
    from_dict,
    record_key,
)
from pmaptap.tapfile.source import (
    ByteStore,
    Run,
    byte_leaves,
    collector_paused,
    field_problem,
    iter_record_batches,
)


def schema_problems(d: Any) -> list[str]:
    """schema.format_problems and arrays.field_problem of a record (a Struct or its object)."""
    r = from_dict(d) if type(d) is dict else d
    out = format_problems(r)
    if r.bytes is not UNSET:
        problem = field_problem(r)
        if problem:
            out.append(problem)
    return out


# The usual per-device record's fields Validator.take_records reads (one
# call), and those that would change its checks, none of which it has.
_USUAL = operator.attrgetter("step", "device", "value", "dtype", "shape", "coords")
_MATTERS = operator.attrgetter("pass_", "attempt", "index", "bytes", "global_shape")
_NONE_OF_THEM = (UNSET,) * 5
_FLOATS = ("float", "bfloat")
_NO_AXIS = ((), 0)


def _canonical(x: Any) -> str:
    # sort_keys so dict order cannot hide a duplicate; default=str for the
    # complex numbers of decoded records; NaN is allowed here (a key, not output).
    return json.dumps(x, sort_keys=True, default=str)


def _coords_key(coords: Any) -> Any:
    # Mesh coordinates are small dicts of ints: a sorted item tuple is an
    # exact key, far cheaper than JSON text (it runs for every per-device
    # record). Anything else falls back to the JSON text.
    if type(coords) is dict and len(coords) == 1:  # one mesh axis: no sort
        item = next(iter(coords.items()))
        if type(item[1]) is int:
            return (item,)
    if isinstance(coords, dict) and all(type(v) is int for v in coords.values()):
        return tuple(sorted(coords.items()))
    return _canonical(coords)


def duplicate_parts(r: AnyRecord) -> tuple | None:
    """What makes a record a duplicate, as (key without step and value, step,
    value): the value is the replicated value's hash (or its text), None for
    a per-device record (its device and coordinates are in the key). Shards
    of one value (record_key's ``index``) are different values."""
    run, name, step, pass_, index, attempt = r.key()
    if r.kind == "replicated":
        value = r.vhash or _canonical(r.value)
        return ("replicated", run, name, pass_, index, attempt), step, value
    if r.kind == "per_device":
        group = ("per_device", run, name, pass_, index, attempt, r.device, _coords_key(r.coords))
        return group, step, None
    return None  # meta records (counters) may legitimately repeat


def step_gaps(steps: Iterable[int]) -> tuple[int, list[tuple[int, int]]]:
    """(stride, missing ranges) of a tap's steps. The stride is the gcd of the
    differences between recorded steps, so ``every=N`` taps (steps 0, N, 2N)
    have no gaps; a missing range (lo, hi) holds lo, lo+stride, ..., hi."""
    s = sorted(set(steps))
    # C-level passes (a summary of a long run has 100,000s of steps).
    diffs = list(map(operator.sub, s[1:], s))
    stride = math.gcd(*diffs)
    if stride == 0:
        return 1, []
    wide = compress(zip(s, s[1:]), map(stride.__lt__, diffs))
    gaps = [(a + stride, b - stride) for a, b in wide]
    return stride, gaps


def steps_text(steps: Sequence, limit: int = 5) -> str:
    """Steps as the summary lists them: the first ``limit``, then ",..."."""
    return ",".join(map(str, steps[:limit])) + (",..." if len(steps) > limit else "")


def format_gaps(stride: int, gaps: Sequence[tuple[int, int]], limit: int = 5) -> str:
    parts = [str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in gaps[:limit]]
    if len(gaps) > limit:
        parts.append("...")
    text = ",".join(parts)
    return text + (f" (every {stride})" if stride > 1 and gaps else "")


@dataclasses.dataclass
class Report:
    path: str
    lines: int = 0
    records: int = 0
    problems: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    divergent_keys: int = 0
    superseded: int = 0  # records a later attempt of a resumed run replaced
    # Steps of pmaptap.fingerprint names whose copies differed: data (what a
    # device computed), not a file problem, as divergent_keys.
    divergent_fingerprints: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


class FirstCopies:
    """Each key's first copy, never a record: ``add_parts(duplicate_parts(r),
    line)`` returns the line of r's first copy if r repeats one, else None."""

    def __init__(self) -> None:
        # group -> step (per-device) or (step, value) (replicated) -> line
        self._keys: dict[tuple, dict] = {}

    def add_parts(self, parts: tuple, line: Any) -> Any:
        group, step, value = parts
        steps = self._keys.setdefault(group, {})
        key = step if value is None else (step, value)
        first = steps.get(key)
        if first is None:
            steps[key] = line
        return first

    def first(self, parts: tuple) -> Any:
        """The line of the first copy of ``parts`` (duplicate_parts)."""
        group, step, value = parts
        return self._keys[group][step if value is None else (step, value)]

    def entries(self) -> Iterable[tuple[tuple, Any]]:
        """(duplicate_parts, line) of every first copy."""
        for group, steps in self._keys.items():
            for key, line in steps.items():
                yield (group, *key) if group[0] == "replicated" else (group, key, None), line


def _what(parts: tuple) -> str:
    """A duplicate's description: "per_device 'g' step 3 device 1"."""
    group, step, _ = parts
    kind, name = group[0], group[2]
    return f"{kind} {name!r} step {step}" + (f" device {group[6]}" if kind == "per_device" else "")


class Validator:
    """``pmaptap validate``'s state over a stream of records: every problem
    with its position, per-key state, never the records. ``attempts`` None:
    assumed never resumed (``resumed`` says otherwise; the caller starts again)."""

    def __init__(self, path: str | os.PathLike, attempts: Any) -> None:
        self.path = os.fspath(path)
        self.attempts = attempts
        self.lines = self.records = self.superseded = 0
        self.problems: list[tuple[Any, str]] = []
        self.dups: list[tuple[Any, tuple]] = []  # (position, duplicate_parts)
        self.firsts = FirstCopies()
        self.index = DivergenceIndex()
        self.flagged: set = set()  # keys of replicated records the run flags divergent
        self.fingerprinted: set = set()  # (run, name, step) whose fingerprints differed
        self.resumed = False
        self._store: ByteStore | None = None
        # (run, name, device, coordinate) -> (its duplicate_parts group, the
        # group's steps in firsts), for the usual per-device record.
        self._groups: dict[tuple, tuple] = {}
        # Whether an odd record was added: only such a record has ids of
        # other types (1.0, true) (see absorb).
        self.odd = False

    def take(self, records: list, problems: dict, first: int) -> None:
        """A batch: records (Structs, None for a line that is no record)
        from position ``first``, the problems of those that are none."""
        self.lines = first + len(records) - 1
        if None in records:
            for pos, r in enumerate(records, first):
                if r is None:
                    self.problems.append((pos, problems.get(pos) or "invalid"))
        self.take_records(records, range(first, first + len(records)))

    def take_records(self, records: list, positions: Any) -> None:
        """``add`` of each record (None: none) at its position, until ``resumed``;
        the usual per-device record (most lines) in a loop of local names."""
        guess = self.attempts is None
        superseded = self.attempts.superseded if self.attempts else None
        groups = self._groups
        keys, dups = self.firsts._keys, self.dups
        usual = 0
        for r, pos in zip(records, positions):
            if r is None:
                continue
            if superseded is None and type(r) is PerDevice:
                step, d, v, dtype, shape, coords = _USUAL(r)
                tv = type(v)
                if (
                    (tv is float or tv is int)
                    and type(d) is int
                    and type(coords) is dict
                    and len(coords) < 2
                    and shape == []
                    and type(dtype) is str
                    and dtype.startswith(_FLOATS)
                    and _MATTERS(r) == _NONE_OF_THEM
                ):
                    # No coordinates (the JAX-free Writer's ``{}``): _NO_AXIS
                    # in the cache's key, which an axis's (name, int) never is.
                    item = next(iter(coords.items())) if coords else _NO_AXIS
                    if type(item[1]) is int:
                        # add(): no format problem; duplicate_parts, firsts.add_parts.
                        usual += 1
                        k = (r.run, r.name, d, item)
                        got = groups.get(k)
                        if got is None:
                            group = duplicate_parts(r)[0]
                            got = groups[k] = (group, keys.setdefault(group, {}))
                        steps = got[1]
                        if step in steps:
                            dups.append((pos, (got[0], step, None)))
                        else:
                            steps[step] = pos
                        continue
            if guess and r.attempt is not UNSET and attempt_of(r) and r.kind != "meta":
                self.resumed = True
                break
            self.add(r, pos)
            if superseded is not None and superseded(r):
                self.superseded += 1
        self.records += usual

    def add(self, r: AnyRecord, pos: Any) -> None:
        self.records += 1
        if r.odd:
            self.odd = True
        self.problems += [(pos, f"schema: {p}") for p in schema_problems(r)]
        if r.bytes is not UNSET:
            # Stored values: their bytes are there (sizes, not contents:
            # one stat per byte file, whatever the run's size).
            self._store = self._store or ByteStore(self.path)
            for leaf, ref, _dt, _sh in byte_leaves(r.bytes, r.dtype, r.shape):
                missing = self._store.missing_problem(ref)
                if missing:
                    self.problems.append((pos, f"bytes{leaf}: {missing}"))
        parts = duplicate_parts(r)
        if parts is not None and self.firsts.add_parts(parts, pos) is not None:
            self.dups.append((pos, parts))
        if r.kind == "replicated":
            self.index.add(r)
            if r.divergent:
                self.flagged.add(record_key(r)[:5])
        elif r.kind == FINGERPRINT and r.divergent:
            self.fingerprinted.add((r.run, r.name, r.step))

    def absorb(self, other: Validator, offset: int) -> None:
        """Add the state of the piece after this one's, its positions
        ``offset`` lines on (0: positions in the merge already). A first
        copy there of a key this one holds is a duplicate."""
        self.lines = offset + other.lines
        self.records += other.records
        self.superseded += other.superseded
        self.problems += [(pos + offset, why) for pos, why in other.problems]
        self.dups += [(pos + offset, parts) for pos, parts in other.dups]
        # Where a record was odd its key's ids may be of another type than
        # the line's own (1.0 for 1): then the caller reads in one process.
        self.odd = self.odd or other.odd
        for parts, pos in other.firsts.entries():
            pos += offset
            if self.firsts.add_parts(parts, pos) is not None:
                if self.odd:
                    raise NeedSerial("ids of two types")
                self.dups.append((pos, parts))
        self.index.absorb(other.index)
        self.flagged |= other.flagged
        self.fingerprinted |= other.fingerprinted
        self.resumed = self.resumed or other.resumed

    def dup_pairs(self) -> list[tuple[Any, Any, tuple]]:
        """(position, its first copy's position, duplicate_parts) of each duplicate."""
        first = self.firsts.first
        return [(pos, first(parts), parts) for pos, parts in self.dups]

    def report(self, dups: "list | None" = None, lines: "int | None" = None) -> Report:
        """The Report (``dups``, ``lines``: as dup_pairs and the line count,
        where another process placed them)."""
        problems = self.problems + [
            (pos, f"duplicate of {line_text(first)} ({_what(parts)})")
            for pos, first, parts in (self.dup_pairs() if dups is None else dups)
        ]
        flagged = self.flagged | {key[:5] for key in self.index.divergent_keys()}
        return Report(
            self.path,
            lines=self.lines if lines is None else lines,
            records=self.records,
            problems=sorted(problems),
            divergent_keys=len(flagged),
            superseded=self.superseded,
            divergent_fingerprints=len(self.fingerprinted),
        )


def line_text(pos: Any) -> str:
    """A position as printed: "line 7", or "p00003.jsonl line 7" (source.SourceLine)."""
    return f"line {pos}" if type(pos) is int else str(pos)


def validate_file(path: str | os.PathLike) -> Report:
    """``pmaptap validate`` (docs/cli.md): the definition parallel.py and
    shardwise.py match; read again after attempts.scan where resumed."""
    path = Run.of(path)
    return latest(path, lambda attempts: _validate(path, attempts))


def check_batches(path: str | os.PathLike, batches: Iterable, attempts: Any) -> Validator | None:
    """The Validator of ``batches`` (source.iter_record_batches'); ``attempts``
    None: assume no later attempt, None back at the first record of one."""
    v = Validator(path, attempts)
    with collector_paused():
        for first, records, problems in batches:
            v.take(records, problems, first)
            if v.resumed:
                return None
    return v


def _validate(path: str | os.PathLike, attempts: Any) -> Report | None:
    """validate_file's pass (check_batches' report)."""
    v = check_batches(path, iter_record_batches(path), attempts)
    return None if v is None else v.report()
