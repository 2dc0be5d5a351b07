"""Checks on tap files beyond "is it a record": the strict schema of the
record format (format.py), duplicates, missing steps. Used by
``pmaptap validate`` and ``pmaptap summary``.

Duplicates (what the cross-process dedup in _host/crossdedup.py should have
prevented, or a file concatenated twice):
- replicated: the same (run, name, step, pass) with the same ``vhash`` (or the
  same value where there is no hash) twice. The same key with *different*
  hashes is a cross-process divergence, which is data, not a duplicate.
- per_device: the same (run, name, step, pass, index, device, coords) twice.
"""

from __future__ import annotations

import dataclasses
import json
import math
import operator
import os
from itertools import compress
from typing import Any, Iterable, Sequence

from pmaptap.tapfile.arrays import ByteStore, byte_leaves, field_problem, is_ref
from pmaptap.tapfile.attempts import attempt_of, scan
from pmaptap.tapfile.format import (
    FINGERPRINT,
    MAX_STEP,
    NONFINITE,
    NOT_CLEAN,
    STRICT_RULES,
    _is_int,
    _is_num,
    record_key,
)
from pmaptap.tapfile.speedups import SPEEDUPS

_MARKERS = tuple(NONFINITE)


# ------------------------------------------------------------------ schema


def _scalar_problem(v: Any, dtype: str) -> str | None:
    if dtype == "bool":
        ok = isinstance(v, bool)
    elif dtype.startswith(("int", "uint")):
        ok = _is_int(v)
    else:
        # Floats (and complex parts): numbers, or the documented markers for
        # non-finite values, which is how strict JSON carries them.
        ok = _is_num(v) or v in _MARKERS
    return None if ok else f"value element {v!r} does not fit dtype {dtype}"


def _leaf_problem(value: Any, dtype: str, shape: Any) -> str | None:
    if not isinstance(shape, list) or not all(_is_int(n) and n >= 0 for n in shape):
        return f"shape must be a list of non-negative integers, got {shape!r}"
    dims = list(shape) + ([2] if dtype.startswith("complex") else [])

    def walk(v: Any, depth: int) -> str | None:
        if depth == len(dims):
            return _scalar_problem(v, dtype)
        if not isinstance(v, list) or len(v) != dims[depth]:
            return f"value does not match shape {shape} (dtype {dtype})"
        for x in v:
            problem = walk(x, depth + 1)
            if problem:
                return problem
        return None

    return walk(value, 0)


def value_problem(value: Any, dtype: Any, shape: Any, stored: Any = None) -> str | None:
    """Does ``value`` have the nesting that ``dtype``/``shape`` describe?
    ``stored``: the record's ``bytes`` field, whose leaves are null in
    ``value`` (tapfile/arrays.py checks the references themselves)."""
    if value is None and dtype is None and shape is None:
        return None  # a None inside a tapped pytree (no leaves)
    if isinstance(dtype, str):
        if value is None and is_ref(stored):
            return None
        return _leaf_problem(value, dtype, shape)
    sub = stored if isinstance(stored, (dict, list)) else None
    if isinstance(dtype, dict):
        if not (
            isinstance(value, dict)
            and isinstance(shape, dict)
            and set(value) == set(dtype) == set(shape)
        ):
            return "pytree value, dtype and shape do not have the same keys"
        for k in dtype:
            problem = value_problem(
                value[k], dtype[k], shape[k], sub.get(k) if isinstance(sub, dict) else None
            )
            if problem:
                return f"[{k}]: {problem}"
        return None
    if isinstance(dtype, list):
        if not (
            isinstance(value, list)
            and isinstance(shape, list)
            and len(value) == len(dtype) == len(shape)
        ):
            return "pytree value, dtype and shape do not have the same length"
        subs = sub if isinstance(sub, list) and len(sub) == len(dtype) else [None] * len(dtype)
        for i, (v, d, s, b) in enumerate(zip(value, dtype, shape, subs)):
            problem = value_problem(v, d, s, b)
            if problem:
                return f"[{i}]: {problem}"
        return None
    return f"dtype must be a string or a pytree of strings, got {dtype!r}"


def _fields_clean(d: dict) -> bool:
    """True only where ``schema_problems`` finds nothing wrong outside the
    value: its checks with exact type tests, inline, for the records every
    file is made of (``validate`` runs this on every line). False means
    "run the full checks"."""
    # format.RULES' strict rules, hand-inlined (a loop over the table costs
    # every line of a validate); tests/tapfile/test_record_rules.py checks
    # that schema_problems flags what any strict rule refuses.
    step, process, t = d["step"], d["process"], d["time"]
    if not (
        type(step) is int
        and 0 <= step <= MAX_STEP
        and type(process) is int
        and process >= 0
        and type(t) is float
        and t - t == 0.0  # finite
        and type(d["host"]) is str
        and d.get("divergent", True) is True
        and type(d.get("pass", "forward")) is str
    ):
        return False
    kind = d["kind"]
    if kind == "per_device":
        device = d["device"]
        if device is not None and type(device) is not int or type(d["coords"]) is not dict:
            return False
        for v in d["coords"].values():
            if type(v) is not int:
                return False
        return True
    if kind == "replicated":
        replicas = d["replicas"]
        if type(replicas) is not int or replicas < 1:
            return False
        devices = d.get("devices")
        if devices is not None:
            if type(devices) is not list or len(devices) != replicas:
                return False
            for x in devices:
                if x is not None and type(x) is not int:
                    return False
        if "processes" in d:
            processes = d["processes"]
            if type(processes) is not list:
                return False
            for x in processes:
                if type(x) is not int:
                    return False
        return "vhash" not in d or type(d["vhash"]) is str
    return kind == "meta"


def schema_problems(d: dict) -> list[str]:
    """Violations of the record format in a dict that already passed
    ``format.validate_dict`` (which only checks what readers rely on)."""
    # The fast path covers the fields of plain records; a record with a
    # field it leaves to the full checks (format.NOT_CLEAN: a stored
    # value, a shard's global shape, copies_seen) takes every check.
    if d.keys().isdisjoint(NOT_CLEAN) and _fields_clean(d):
        dtype, shape = d["dtype"], d["shape"]
        if type(dtype) is str and type(shape) is list and not shape:
            # A scalar (complex ones are pairs: the full walk). A float in a
            # float dtype first: most lines of a file.
            t = type(d["value"])
            if (t is float or t is int) and dtype.startswith(("float", "bfloat")):
                return []
            if not dtype.startswith("complex"):
                problem = _scalar_problem(d["value"], dtype)
                return [problem] if problem else []
        problem = value_problem(d["value"], dtype, shape)
        return [problem] if problem else []
    # The format's rule of each field (format.RULES) the record's kind has.
    kind = d["kind"]
    out = [
        rule.strict_problem.format(v=d[rule.name])
        for rule in STRICT_RULES
        if rule.name in d and kind in rule.kinds and not rule.strict(d[rule.name], d)
    ]
    problem = field_problem(d)
    if problem:
        out.append(problem)
    problem = value_problem(d["value"], d["dtype"], d["shape"], d.get("bytes"))
    if problem:
        out.append(problem)
    return out


# ------------------------------------------------------------------ duplicates


def _canonical(x: Any) -> str:
    # sort_keys so dict order cannot hide a duplicate; default=str for the
    # complex numbers of decoded records; NaN is allowed here (a key, not output).
    return json.dumps(x, sort_keys=True, default=str)


def _coords_key(coords: Any) -> Any:
    # Mesh coordinates are small dicts of ints: a sorted item tuple is an exact
    # key and ~10x cheaper than JSON text (this runs for every per-device
    # record of a summary). Anything else falls back to the JSON text; equal
    # coordinates always take the same branch.
    if type(coords) is dict and len(coords) == 1:  # one mesh axis: no sort
        item = next(iter(coords.items()))
        if type(item[1]) is int:
            return (item,)
    if isinstance(coords, dict) and all(type(v) is int for v in coords.values()):
        return tuple(sorted(coords.items()))
    return _canonical(coords)


def duplicate_parts(r: dict) -> tuple | None:
    """duplicate_key as (key without step and value, step, value): the
    value is the replicated value's hash (or its text), None for a
    per-device record (its device and coordinates are in the key)."""
    # Shards of one value (``index``) are different values, never duplicates:
    # record_key holds the index.
    run, name, step, pass_, index, attempt = record_key(r)
    kind = r.get("kind")
    if kind == "replicated":
        value = r.get("vhash") or _canonical(r.get("value"))
        return ("replicated", run, name, pass_, index, attempt), step, value
    if kind == "per_device":
        device, coords = r.get("device"), _coords_key(r.get("coords"))
        return ("per_device", run, name, pass_, index, attempt, device, coords), step, None
    return None  # meta records (counters) may legitimately repeat


def duplicate_key(r: dict) -> tuple | None:
    parts = duplicate_parts(r)
    if parts is None:
        return None
    (kind, run, name, pass_, index, attempt, *rest), step, value = parts
    key = (kind, run, name, step, pass_, index, attempt, *rest)
    return key if value is None else (*key, value)


def find_duplicates(records: Sequence[dict]) -> list[tuple[int, int]]:
    """(index, index of its first copy) for every record repeating an earlier one."""
    first: dict[tuple, int] = {}
    out: list[tuple[int, int]] = []
    for i, r in enumerate(records):
        key = duplicate_key(r)
        if key is None:
            continue
        if key in first:
            out.append((i, first[key]))
        else:
            first[key] = i
    return out


# ------------------------------------------------------------------ gaps


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


def count_missing(stride: int, gaps: Sequence[tuple[int, int]]) -> int:
    return sum((hi - lo) // stride + 1 for lo, hi in gaps)


def format_gaps(stride: int, gaps: Sequence[tuple[int, int]], limit: int = 5) -> str:
    parts = [str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in gaps[:limit]]
    if len(gaps) > limit:
        parts.append("...")
    text = ",".join(parts)
    return text + (f" (every {stride})" if stride > 1 and gaps else "")


# ------------------------------------------------------------------ validate


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
    """``find_duplicates`` one record at a time, holding small per-key state
    (never a record): ``add(r, line)`` returns the line of r's first copy
    if r repeats an earlier record (duplicate_key), else None. By key without
    its step, then by step: an int per per-device record, a (vhash, line)
    per replicated one."""

    def __init__(self) -> None:
        self._keys: dict[tuple, dict] = {}

    def add(self, r: dict, line: int) -> int | None:
        parts = duplicate_parts(r)
        if parts is None:
            return None
        group, step, value = parts
        steps = self._keys.get(group)
        if steps is None:
            steps = self._keys[group] = {}
        if value is not None:  # replicated
            got = steps.get(step)
            if got is None:
                steps[step] = (value, line)
                return None
            if isinstance(got, tuple):
                if got[0] == value:
                    return got[1]
                got = steps[step] = {got[0]: got[1]}
            first = got.get(value)
            if first is None:
                got[value] = line
            return first
        first = steps.get(step)
        if first is None:
            steps[step] = line
        return first


def validate_file(path: str | os.PathLike) -> Report:
    """Every problem of a file, in one streaming pass: its state is per key
    (FirstCopies, DivergenceIndex), never the records. The pass assumes the
    run was never resumed (most runs); a record of a later attempt means it
    was, and then the file is read again, after a scan of the lines that
    mention an attempt (attempts.scan: what each later attempt superseded)."""
    report = _validate(path, None)
    return report if report is not None else _validate(path, scan(path))


def _validate(path: str | os.PathLike, attempts: Any) -> Report | None:
    """validate_file's pass; ``attempts`` None: assume no later attempt,
    None back at the first record of one."""
    from pmaptap.tapfile.divergence import DivergenceIndex
    from pmaptap.tapfile.lines import iter_batches

    report = Report(os.fspath(path))
    problems = report.problems
    # Records of steps that a resumed run replayed are superseded by the
    # later attempt's (tapfile/attempts.py): history, not duplicates (their
    # keys differ in ``attempt``, so FirstCopies does not pair them).
    superseded = attempts.superseded if attempts else None
    guess = attempts is None
    firsts = FirstCopies()
    index = DivergenceIndex()
    flagged: set = set()  # keys of replicated records the file flags divergent
    fingerprinted: set = set()  # (run, name, step) whose fingerprints differed
    records = lines = 0
    store = None
    add_first, add_index = firsts.add, index.add
    # schema_problems' fast path in C (_speedups.c scalar_clean): True only
    # where it finds nothing; anything else is checked here.
    clean = SPEEDUPS.scalar_clean if SPEEDUPS is not None else None
    # Runs of the simplest per-device records in C (_speedups.c
    # validate_run: this loop's steps for them), when no attempt is known.
    run_c = SPEEDUPS.validate_run if SPEEDUPS is not None and superseded is None else None
    groups = firsts._keys
    # validate_run's: each device's group the last time (no group tuple
    # built and hashed a record), and NOT_CLEAN as a tuple (no iterator).
    cache: dict = {}
    not_clean = tuple(NOT_CLEAN)
    for first_line, batch, bad in iter_batches(path):
        lines = first_line + len(batch) - 1
        k, n = 0, len(batch)
        while k < n:
            if run_c is not None:
                k, took = run_c(batch, k, first_line, groups, not_clean, cache)
                records += took
                if k >= n:
                    break
            d, lineno = batch[k], first_line + k
            k += 1
            if d is None:
                problems.append((lineno, bad.get(lineno) or "invalid"))
                continue
            if guess and "attempt" in d and attempt_of(d) and d["kind"] != "meta":
                return None  # resumed after all: read again, knowing that
            records += 1
            if clean is None or not clean(d, not_clean):
                for p in schema_problems(d):
                    problems.append((lineno, f"schema: {p}"))
            if "bytes" in d:
                # Stored values: their bytes are there (sizes, not contents:
                # one stat per byte file, whatever the run's size).
                store = store or ByteStore(path)
                for leaf, ref, _dt, _sh in byte_leaves(d["bytes"], d["dtype"], d["shape"]):
                    missing = store.missing_problem(ref)
                    if missing:
                        problems.append((lineno, f"bytes{leaf}: {missing}"))
            first = add_first(d, lineno)
            if first is not None:
                what = f"{d['kind']} {d['name']!r} step {d['step']}" + (
                    f" device {d.get('device')}" if d["kind"] == "per_device" else ""
                )
                problems.append((lineno, f"duplicate of line {first} ({what})"))
            if d["kind"] == "replicated":
                add_index(d)
                if d.get("divergent"):
                    flagged.add(record_key(d)[:5])
            elif d["kind"] == FINGERPRINT and d.get("divergent"):
                fingerprinted.add((d["run"], d["name"], d["step"]))
            if superseded is not None and superseded(d):
                report.superseded += 1
    report.records = records
    report.lines = lines
    problems.sort()
    flagged.update(key[:5] for key in index.divergent_keys())
    report.divergent_keys = len(flagged)
    report.divergent_fingerprints = len(fingerprinted)
    return report
