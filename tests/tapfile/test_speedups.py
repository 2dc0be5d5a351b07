"""The compiled reading loops (pmaptap/tapfile/_speedups.c) give exactly what
the Python loops they copy give: parse.parse_lines (plain_records), the
merge of a sharded run (time_keys, merge_round: runs._Source.extend and
runs._merge_round) and format.first_not_plain, on hostile lines, records
breaking each rule of the table and random sharded runs; and bad arguments
raise instead of crashing the interpreter, and nothing leaks.

The module must be built here: setup.py builds it wherever a C compiler is
found, and CI installs the test extra with gcc present. So a missing module
fails test_the_compiled_module_is_built (and every comparison below) rather
than the comparisons quietly running the Python loops twice. Each
comparison runs the C path with the module itself (not ``SPEEDUPS``, which
PMAPTAP_NO_SPEEDUPS=1 turns off) and the Python path with ``SPEEDUPS`` set
to None in both modules that read it (parse and runs)."""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import random
import sys
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_fuzz_tapfile import (
    _FIELDS,
    _ODD_SAMPLES,
    _PLAIN_RECORDS,
    CORPUS,
    FUZZ_LINE_LIMIT,
    _mutated,
    field_changes,
    hostile_line,
)
from test_read_batch import HOSTILE, ODD_RECORDS
from test_read_fuzz import _hostile, _job, _render
from test_record_rules import BASE, SAMPLES, _reader_cases, _with

import pmaptap
from conftest import per_device_dict, record_dict, run_python
from pmaptap import cli
from pmaptap.tapfile import checks, parse, runs, summary_batch
from pmaptap.tapfile import format as fmt
from pmaptap.tapfile import lines as tapfile_lines

try:
    from pmaptap.tapfile import _speedups as C
except ImportError:  # not built: every test below fails, none is skipped
    C = None


@pytest.fixture
def c_module():
    if C is None:
        pytest.fail("pmaptap/tapfile/_speedups.c is not built (pip install -e . with gcc)")
    return C


def test_the_compiled_module_is_built():
    """The install built _speedups.c (CI: the test extra's install, gcc
    present), and the readers use it unless PMAPTAP_NO_SPEEDUPS is set."""
    from pmaptap.tapfile.speedups import SPEEDUPS

    assert C is not None, "pmaptap/tapfile/_speedups.c is not built"
    if not os.environ.get("PMAPTAP_NO_SPEEDUPS"):
        assert SPEEDUPS is C and parse.SPEEDUPS is C and runs.SPEEDUPS is C


def _typed(x):
    """``x`` with the type of every value in it (1, 1.0 and True apart; -0.0
    and 0.0 apart), dict keys in their order."""
    if type(x) is dict:
        return ("dict", tuple((_typed(k), _typed(v)) for k, v in x.items()))
    if type(x) in (list, tuple):
        return (type(x).__name__, tuple(_typed(v) for v in x))
    return (type(x).__name__, repr(x))


class _Counting:
    """The C module, counting the calls of each function (so a comparison
    knows the C path ran)."""

    def __init__(self, module) -> None:
        self.module = module
        self.calls: collections.Counter = collections.Counter()

    def __getattr__(self, name):
        fn = getattr(self.module, name)

        def call(*args):
            self.calls[name] += 1
            return fn(*args)

        return call


def _both(fn, **patch):
    """(fn() with the C loops, fn() with the Python loops, the C calls);
    ``patch``: parse/runs module attributes set for both runs."""
    got = []
    counting = _Counting(C)
    for module in (counting, None):
        with pytest.MonkeyPatch.context() as mp:
            for user in (parse, runs, summary_batch, checks):
                mp.setattr(user, "SPEEDUPS", module)
            for name, value in patch.items():
                mp.setattr(runs if hasattr(runs, name) else parse, name, value)
            got.append(fn())
    return got[0], got[1], counting.calls


def _same_parse(lines: list, **patch) -> None:
    """parse_lines of ``lines`` with both loops: the same records (types
    too) and problems, and those of parse_line line by line (the
    definition)."""
    (c, py, calls) = _both(lambda: parse.parse_lines(lines), **patch)
    assert calls["plain_records"] == 1
    assert _typed(c[0]) == _typed(py[0])
    assert c[1] == py[1]
    with pytest.MonkeyPatch.context() as mp:
        for name, value in patch.items():
            mp.setattr(parse, name, value)
        one = [parse.parse_line(x) for x in lines]
    assert _typed(c[0]) == _typed([d for d, _ in one])
    assert c[1] == {i: why for i, (_, why) in enumerate(one) if why is not None}


def _dump(d, compact=True) -> bytes:
    seps = (",", ":") if compact else (", ", ": ")
    return json.dumps(d, separators=seps, ensure_ascii=False).encode("utf-8", "surrogatepass")


def _nested(n: int, opener: bytes = b"[") -> bytes:
    closer = b"]" if opener == b"[" else b"}"
    inner = b"0" if opener == b"[" else b""
    if opener == b"{":
        return b'{"a":' * n + b"0" + closer * n
    return opener * n + inner + closer * n


def _own_lines() -> list[bytes]:
    """Lines for every fast-path condition and every field's odd types."""
    base = record_dict(vhash="ab", devices=[0, 1], processes=[0])
    pd = per_device_dict(3, 1, 0.5)
    line = _dump(base)
    out = [
        b"",
        b" ",
        b"\t",
        b"\r",
        b"null",
        b"true",
        b"[]",
        b"{}",
        b"1",
        b'"s"',
        b"\xef\xbb\xbf" + line,  # a BOM
        line + b"\r",  # CRLF
        line + b" ",
        b" " + line,
        line + line,  # two records on one line
        line[:-1],  # torn
        line + b",",
    ]
    # Depth: the record object is a level; 128 in all is the limit.
    for n in (126, 127, 128, 129, 200):
        for opener in (b"[", b"{"):
            value = _nested(n - 1, opener)
            out.append(line.replace(b'"value":1', b'"value":' + value, 1))
            out.append(_nested(n, opener))
    out.append(_dump(dict(base, value="[" * 300)))  # brackets in a string only
    out.append(_dump(dict(base, value="{" * 100, host="[" * 100)))
    out.append(_dump(dict(base, value=[[[]]] * 60)))  # 180 brackets, depth 4
    # Numbers: big ints as step, value, time, attempt, process; non-finite.
    for field in ("step", "value", "time", "attempt", "process", "device", "replicas"):
        for digits in (
            "18446744073709551615",
            "18446744073709551616",
            "9223372036854775807",
            "-9223372036854775808",
            "-9223372036854775809",
            "1" + "0" * 30,
            "1" + "0" * 400,
            "7" * 5000,
            "1e400",
            "-1e400",
            "1e-400",
            "-0",
            "-0.0",
            "1.0",
            "NaN",
            "Infinity",
            "-Infinity",
            "nan",
            "true",
            '"1"',
            "null",
        ):
            d = dict(pd if field == "device" else base, **{field: 0})
            text = _dump(d).replace(f'"{field}":0'.encode(), f'"{field}":{digits}'.encode(), 1)
            out.append(text)
    # Text: lone surrogate escapes, invalid UTF-8, controls, escaped keys.
    for esc in (
        b"\\ud800",
        b"\\udfff",
        b"\\uDBFF",
        b"\\ud83d\\ude00",
        b"\\ud83d",
        b"\\ude00\\ud83d",
        b"\\\\ud800",
        b"\\u0000",
        b"\xff",
        b"\xc0\xaf",
        b"\xed\xa0\x80",
        b"\xf4\x90\x80\x80",
        b"\x00",
        b"\x1f",
        b"\x7f",
        b"\xe2\x82",
    ):
        out.append(line.replace(b'"host":"', b'"host":"' + esc, 1))
        out.append(line.replace(b'"name":"', b'"name":"' + esc, 1))
        out.append(line.replace(b'"run"', b'"r' + esc + b'un"', 1))
    out.append(line.replace(b'"step"', b'"\\u0073tep"', 1))
    out.append(line.replace(b'"kind"', b'"\\u006bind"', 1))
    # Duplicate keys: the last one wins.
    for dup in (
        b'"step":true',
        b'"step":2',
        b'"kind":"meta"',
        b'"kind":"per_device"',
        b'"kind":"other"',
        b'"attempt":-1',
        b'"attempt":1',
        b'"index":null',
        b'"index":[[0,1]]',
        b'"vhash":3',
        b'"vhash":""',
    ):
        out.append(line[:-1] + b"," + dup + b"}")
        out.append(b"{" + dup + b"," + line[1:])
    # Each field with each type, and each field missing.
    odd = [True, False, 0, -1, 1, 2**63 - 1, 1.5, -0.0, "", "x", None, [], [0], {}, {"a": 1}]
    odd += ["0-31", "0-31,40", "0,2-3", "3-1", "01", "0-", "-1", "0-9999999999", "1,1", "0 1"]
    odd += [[0, None, "p", 1.5, True], [[1]], [{}], "per_device", "replicated", "meta"]
    for r in (base, pd, record_dict(kind="meta", name="pmaptap/dropped", value=3)):
        for field in sorted(set(r) | {"pass", "vhash", "attempt", "index", "devices"}):
            out.append(_dump({k: v for k, v in r.items() if k != field}))
            for v in odd:
                out.append(_dump(dict(r, **{field: v})))
    out.append(_dump({**base, "process": "p7"}))  # any scalar is a process
    out.append(_dump(dict(pd, device="x", coords={"dp": [1]})))
    out.append(_dump(dict(base, divergent=True, copies_seen=2)))
    return out


def _corpus(seed: int = 0) -> list[bytes]:
    """Every hostile and odd line the other reading tests know, and ours."""
    rnd = random.Random(seed)
    lines = list(HOSTILE) + [_dump(d, compact=False) for d in ODD_RECORDS] + list(CORPUS)
    job = [_render(rnd, r) for r in _job(rnd)]
    lines += job[:300]
    lines += [_hostile(rnd, rnd.choice(job)) for _ in range(300)]
    for rule in fmt.RULES:
        for accepted in (True, False):
            for kind, value in _reader_cases(rule, accepted):
                d = _with(kind, rule.name, value)
                lines.append(_dump(d))
    for which in range(len(_PLAIN_RECORDS)):
        for field in _FIELDS:
            for value in _ODD_SAMPLES:
                lines.append(_dump(_mutated(which, [(field, value)])))
    return lines + _own_lines()


LIMITS = [
    {},
    {"MAX_LINE_BYTES": 256},
    {"MAX_LINE_BYTES": FUZZ_LINE_LIMIT},
    {"MAX_DEPTH": 3},
    {"MAX_LINE_BYTES": 97, "MAX_DEPTH": 1},
]


@pytest.mark.parametrize("limits", LIMITS, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_parse_lines_same_with_both_loops_on_hostile_lines(c_module, limits):
    lines = _corpus()
    # Over-long lines around the limit, whatever it is.
    limit = limits.get("MAX_LINE_BYTES", 4096)
    pad = record_dict(pad="")
    size = len(_dump(pad))
    for n in (limit - 1, limit, limit + 1):
        lines.append(_dump(dict(pad, pad="p" * (n - size))))
        lines.append(b" " * n)
    assert any(len(x) == limit + 1 for x in lines)
    _same_parse(lines, **limits)  # all in one batch
    rnd = random.Random(len(limits))
    plain = [_dump(per_device_dict(s, 1, 0.5)) for s in range(40)]
    for _ in range(40):  # hostile lines here and there among plain ones
        batch = plain[: rnd.randrange(40)]
        for _ in range(rnd.randrange(1, 6)):
            batch.insert(rnd.randrange(len(batch) + 1), rnd.choice(lines))
        _same_parse(batch, **limits)
    for x in lines[:: 7 if limits else 1]:  # each alone (all of them once)
        _same_parse([x], **limits)
    _same_parse([], **limits)


def test_parse_lines_takes_lines_of_any_type_alike(c_module):
    line = _dump(record_dict())
    lines = [line, bytearray(line), memoryview(line), line.decode(), None, 5, b"x", line]
    _same_parse(lines)


def test_plain_records_takes_exactly_parse_lines_fast_path(c_module):
    """A line is a record in C exactly where parse_line's own fast path
    takes it: short, at most MAX_DEPTH opening brackets, orjson takes it,
    a plainly valid record; then it is what orjson made of it."""
    import orjson

    lines = _corpus()
    for limit in (parse.MAX_LINE_BYTES, 200):
        records, slow = C.plain_records(
            lines, orjson.loads, orjson.JSONDecodeError, parse.MAX_DEPTH, limit, fmt.id_ranges
        )
        assert slow == sorted(slow) and len(records) == len(lines)
        fast = 0
        for i, raw in enumerate(lines):
            want = None
            if len(raw) <= limit and raw.count(b"[") + raw.count(b"{") <= parse.MAX_DEPTH:
                try:
                    d = orjson.loads(raw)
                except orjson.JSONDecodeError:
                    d = None
                if type(d) is dict and fmt._plainly_valid(d):
                    want = d
            assert (i in slow) == (want is None), raw[:100]
            assert _typed(records[i]) == _typed(want), raw[:100]
            fast += want is not None
        assert 200 < fast < len(lines) - 200, fast  # both kinds well covered


@settings(
    max_examples=int(os.environ.get("PMAPTAP_FUZZ_EXAMPLES", "40")) * 3,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(st.lists(hostile_line(), max_size=12))
def test_parse_lines_same_with_both_loops_fuzzed(lines):
    assert C is not None, "pmaptap/tapfile/_speedups.c is not built"
    _same_parse(lines, MAX_LINE_BYTES=FUZZ_LINE_LIMIT)


# ------------------------------------------------------------ first_not_plain


class _Dict(dict):
    pass


class _Str(str):
    pass


def _same_first_not_plain(items: list) -> None:
    for start in (0, 1, len(items) // 2, len(items), len(items) + 3):
        want = fmt.first_not_plain(items, start)
        assert C.first_not_plain(items, start, fmt.id_ranges) == want, (start, items)


def test_scalar_clean_says_clean_only_where_schema_problems_finds_nothing(c_module):
    """validate skips checks.schema_problems where the C fast check says a
    record is clean: never where schema_problems would find something, on
    every record the corpora, the rule table's samples and the mutated
    plain records give (those readers take: validate checks no other)."""
    items = [parse.parse_line(line)[0] for line in _corpus()]
    for rule in fmt.RULES:
        for accepted in (True, False):
            items += [_with(kind, rule.name, v) for kind, v in _reader_cases(rule, accepted)]
    for which in range(len(_PLAIN_RECORDS)):
        for field in _FIELDS:
            for value in _ODD_SAMPLES + SAMPLES:
                items.append(_mutated(which, [(field, value)]))
    items += [dict(r) for r in _PLAIN_RECORDS] + list(BASE.values())
    clean = checked = 0
    for d in items:
        if type(d) is not dict or fmt.validate_dict(d) is not None:
            continue
        checked += 1
        if c_module.scalar_clean(d, fmt.NOT_CLEAN):
            clean += 1
            assert checks.schema_problems(d) == [], d
    assert clean > 100 and checked - clean > 100, (clean, checked)


def test_first_not_plain_same_on_records_breaking_each_rule(c_module):
    for rule in fmt.RULES:
        for accepted in (True, False):
            for kind, value in _reader_cases(rule, accepted):
                d = _with(kind, rule.name, value)
                for other in BASE.values():
                    _same_first_not_plain([other, d, other])
                    _same_first_not_plain([d, other])
    for which in range(len(_PLAIN_RECORDS)):
        for field in _FIELDS:
            for value in _ODD_SAMPLES + SAMPLES:
                d = _mutated(which, [(field, value)])
                _same_first_not_plain([_PLAIN_RECORDS[which], d])
    plain = [d for k, d in BASE.items() if k not in fmt.UNPLAIN_KINDS]
    plain += [dict(r) for r in _PLAIN_RECORDS]
    assert C.first_not_plain(plain, 0, fmt.id_ranges) == len(plain)
    _same_first_not_plain(plain)
    # Not records, and types JSON never makes.
    base = BASE["replicated"]
    odd = [None, 1, "x", [], [base], (base,), _Dict(base), collections.OrderedDict(base)]
    odd += [dict(base, kind=_Str("meta")), dict(base, kind=_Str("replicated"))]
    odd += [dict(BASE["per_device"], kind=_Str("per_device")), dict(base, name=_Str("a"))]
    odd += [dict(base, step=_Dict()), dict(base, processes=_Str("0-3")), dict(base, kind=b"meta")]
    for d in odd:
        _same_first_not_plain([base, d, base])
    _same_first_not_plain([])


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(range(len(_PLAIN_RECORDS))), field_changes(1))
def test_first_not_plain_same_fuzzed(which, changes):
    assert C is not None, "pmaptap/tapfile/_speedups.c is not built"
    _same_first_not_plain([_PLAIN_RECORDS[which], _mutated(which, changes)])


# ------------------------------------------------------------ sharded runs


def _record(rnd: random.Random, process: int, n: int, time) -> dict:
    """A record of a shard: per-device, replicated (copies of a few values
    other shards write too, some divergent, some twice), or meta."""
    step = rnd.randrange(4)
    roll = rnd.random()
    if roll < 0.35:
        d = per_device_dict(step, process, 0.5 * n, name=rnd.choice(["g", "h"]), process=process)
    elif roll < 0.9:
        d = record_dict(name=rnd.choice(["loss", "lr"]), step=step, value=1.5, process=process)
        d["vhash"] = rnd.choice(["aa", "aa", "aa", "bb", ""])
        if rnd.random() < 0.15:
            del d["vhash"]
        if rnd.random() < 0.3:
            d["devices"], d["processes"] = "0-7", "0-3"
        if rnd.random() < 0.1:
            d["process"] = rnd.choice([float(process), None, "p", process == 1])
    else:
        d = record_dict(kind="meta", name="pmaptap/dropped", step=step, value=2, process=process)
    if rnd.random() < 0.15:
        d["attempt"] = rnd.choice([0, 1, 2])
    if rnd.random() < 0.1:
        d["pass"] = "backward"
    if rnd.random() < 0.05:
        d["index"] = [[0, 2]]
    d["n"] = n  # tells copies apart in the output
    d["time"] = time
    return d


def _time(rnd: random.Random, t: float):
    roll = rnd.random()
    if roll < 0.05:
        return rnd.choice([None, "5", True, [1.0], {"t": 1}, 2**53 + 1, 2**64 - 1, -0.0, 1e300])
    if roll < 0.1:
        return t - rnd.choice([0.5, 3])  # backwards within the shard
    if roll < 0.3:
        return int(t)
    return t


def _write_run(rnd: random.Random, path: str) -> None:
    os.makedirs(path + runs.SHARD_SUFFIX)
    procs = sorted(rnd.sample(range(8), rnd.randint(1, 5)))
    files = [(runs.shard_path(path, p), p) for p in procs]
    if rnd.random() < 0.2:
        files.append((path, 7))  # the one shared file, read first
    for name, p in files:
        t = float(rnd.randrange(3))
        lines = []
        for n in range(rnd.choice([0, 1, 3, 10, 25])):
            t += rnd.choice([0, 0, 0.5, 1, 2])
            d = _record(rnd, p, n, _time(rnd, t))
            lines.append(_dump(d, compact=rnd.random() < 0.8))
            if rnd.random() < 0.08:
                lines.append(rnd.choice([*HOSTILE[:12], _hostile(rnd, lines[-1])]))
        data = b"".join(x + b"\n" for x in lines)
        tail = rnd.random()
        if lines and tail < 0.15:
            data = data[:-1]  # a whole last line without its newline
        elif tail < 0.3:
            torn = _dump(_record(rnd, p, 99, t))
            data += torn[: rnd.randrange(1, len(torn))]  # a torn last line
        elif tail < 0.35:
            data += b'{"not": "a record"}'
        with open(name, "wb") as f:
            f.write(data)


def _cli(capsys, caplog, *args):
    caplog.clear()
    code = cli.main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err, [(r.levelno, r.getMessage()) for r in caplog.records]


def _readers(path: str, capsys, caplog):
    caplog.clear()
    batches = [
        (first, _typed(recs), probs)
        for first, recs, probs in runs.iter_merged(path, tapfile_lines.read_at)
    ]
    got = {
        "merged": batches,
        "lines": _typed(list(tapfile_lines.iter_lines(path))),
        "read": _typed(pmaptap.read(path)),
        "read_all": _typed(pmaptap.read(path, attempts="all")),
        "read_logs": [(r.levelno, r.getMessage()) for r in caplog.records],
        "summary": _cli(capsys, caplog, "summary", path),
        "validate": _cli(capsys, caplog, "validate", path),
    }
    return got


PIECES = [
    {},
    {"MERGE_BYTES": 1, "MIN_PIECE_BYTES": 1, "MIN_READ_BYTES": 1, "MAX_READ_BYTES": 1},
    {"MERGE_BYTES": 300, "MIN_PIECE_BYTES": 150, "MIN_READ_BYTES": 64, "MAX_READ_BYTES": 700},
    {"MERGE_BYTES": 1, "MIN_PIECE_BYTES": 1, "MAX_PIECE_BYTES": 1},
]


def test_sharded_runs_read_the_same_with_both_loops(c_module, tmp_path, capsys, caplog):
    """Random sharded runs (ties, copies of replicated values in several
    shards and twice in one, divergent copies, odd and backward times,
    garbage and torn last lines, empty shards, the shared file) cut into
    pieces of every size: every reader gives the same with both loops."""
    caplog.set_level(logging.WARNING)
    calls: collections.Counter = collections.Counter()
    kept = bad = 0
    for case in range(int(os.environ.get("PMAPTAP_FUZZ_SEEDS", "10")) * 16):
        rnd = random.Random(case)
        path = str(tmp_path / f"run{case}.jsonl")
        _write_run(rnd, path)
        pieces = PIECES[case % len(PIECES)]
        c, py, n = _both(lambda: _readers(path, capsys, caplog), **pieces)
        for what in c:
            assert c[what] == py[what], (case, what)
        calls.update(n)
        kinds = collections.Counter(x[1][1][0] for x in c["lines"][1])
        kept += kinds["dict"]
        bad += kinds["NoneType"]
    assert calls["plain_records"] and calls["time_keys"] and calls["merge_round"] > 500, calls
    assert calls["per_device_run"] and calls["scalar_clean"] and calls["validate_run"], calls
    assert kept > 1000 and bad > 50, (kept, bad)


def test_a_merge_drops_and_keeps_the_same_copies(c_module, tmp_path):
    """The copies of one replicated value: the first process's all kept
    (twice from one process: both), the others' dropped, a divergent value
    kept; equal process ids of other types (1 and 1.0) are one process."""

    def rec(p, n, t, vhash="aa", **kw):
        return dict(record_dict(name="loss", vhash=vhash, process=p, time=t, n=n), **kw)

    spec = {
        0: [rec(0, 0, 2.0), rec(0, 1, 2.0), rec(0, 2, 5.0, vhash="bb")],
        1: [rec(1, 3, 1.0, vhash=""), rec(1, 4, 2.0), rec(1.0, 5, 3.0, vhash="cc")],
        2: [rec(1, 6, 4.0, vhash="cc"), rec(2, 7, 4.0, vhash="cc"), rec(2, 8, 1, attempt=1)],
    }
    path = str(tmp_path / "run.jsonl")
    os.makedirs(path + ".d")
    for p, recs in spec.items():
        with open(runs.shard_path(path, p), "wb") as f:
            f.writelines(_dump(d) + b"\n" for d in recs)
    for pieces in PIECES:
        c, py, calls = _both(lambda: list(tapfile_lines.iter_lines(path)), **pieces)
        assert _typed(c) == _typed(py) and calls["merge_round"]
        assert [d["n"] for _, d, _ in c] == [3, 0, 1, 5, 6, 8, 2]


def test_a_copy_read_after_another_process_s_is_freed_and_parsed_again_if_kept(
    c_module, tmp_path, monkeypatch
):
    """A replicated copy whose value another process's copy came before (in
    the order the shards are read) is held as its line until the round
    (_speedups.c scan_copy: not even parsed); where the merge keeps it after all (it is the
    first in merged order, or its process wrote the first), the line is
    parsed again, and the stream is the one the Python loops give."""

    def rec(p, n, t):
        return record_dict(name="loss", vhash="aa", process=p, time=t, n=n)

    # Shard 0 is read first, but shard 1's copy is earlier: set aside, kept.
    # Shard 2's copy is later: set aside and dropped. Shard 0 writes again.
    spec = {0: [rec(0, 0, 2.0)], 1: [rec(1, 1, 1.0), rec(1, 2, 3.0)], 2: [rec(2, 3, 2.5)]}
    path = str(tmp_path / "run.jsonl")
    os.makedirs(path + ".d")
    for p, recs in spec.items():
        with open(runs.shard_path(path, p), "wb") as f:
            f.writelines(_dump(d) + b"\n" for d in recs)
    loaded: list = []
    real = pmaptap.tapfile.format.ORJSON

    class Counting:  # orjson, counting what it parses
        JSONDecodeError = real.JSONDecodeError

        @staticmethod
        def loads(raw):
            loaded.append(real.loads(raw)["n"])
            return real.loads(raw)

    monkeypatch.setattr(pmaptap.tapfile.format, "ORJSON", Counting)
    monkeypatch.setattr(runs, "SPEEDUPS", c_module)  # also under PMAPTAP_NO_SPEEDUPS=1
    monkeypatch.setattr(pmaptap.tapfile.parse, "SPEEDUPS", c_module)
    got = list(tapfile_lines.iter_lines(path))
    assert [d["n"] for _, d, _ in got] == [1, 2]  # process 1's copies: first in merged order
    # Process 0's copy parsed as it is read; the copies read after it
    # (process 0 first in ``seen``) read without being built (scan_copy),
    # then process 1's two parsed as they are kept after all.
    assert loaded == [0, 1, 2], loaded
    monkeypatch.setattr(runs, "SPEEDUPS", None)
    monkeypatch.setattr(pmaptap.tapfile.parse, "SPEEDUPS", None)
    assert _typed(list(tapfile_lines.iter_lines(path))) == _typed(got)


def _odd_line(d: dict, how: str) -> bytes:
    """``d``'s line, written so that a reader takes it by another road: one
    parse_line's slow path takes (more than MAX_DEPTH brackets, yet shallow;
    an index), one orjson reads to other types than json would (an integer
    past 64 bits: a float), escaped keys, a duplicate key (the last wins),
    spaces, a carriage return, holders as ranges text (id_ranges)."""
    raw = _dump(d, compact=how != "spaced")
    if how == "deep":
        return raw[:-1] + b',"pad":[' + b"[[]]," * 70 + b"[]]}"
    if how == "big":
        return raw[:-1] + b',"big":123456789012345678901234567890,"neg":-9223372036854775809}'
    if how == "escaped":
        return raw.replace(b'"name"', b'"n\\u0061me"').replace(b'"process"', b'"\\u0070rocess"')
    if how == "dup":
        return raw[:-1] + b',"n":%d}' % (d["n"] + 1000)
    if how == "cr":
        return raw + b"\r"
    return raw


_HOWS = ["plain", "spaced", "deep", "big", "escaped", "dup", "cr"]


def _odd_copies(rnd: random.Random, path: str, chunks: "str | None" = None) -> None:
    """A sharded run (and the shared file) of copies of a few replicated
    values, most of them read after another process's copy (so set aside)
    and many of those first in merged order after all (so kept: parsed
    again), their lines of every _odd_line kind; process ids of one process
    in several types (1, 1.0, True; 0, 0.0, -0.0, False) and of another
    ("1"); a process writing a value twice with another's copy between;
    ties; a copy in a last line without its newline. ``chunks``: also as
    an object store's chunks under that URL (memory://)."""
    os.makedirs(path + runs.SHARD_SUFFIX, exist_ok=True)
    ids = {0: [0, 0.0, -0.0, False], 1: [1, 1.0, True], 2: [2, "1"], 7: [7]}
    files = [(runs.shard_path(path, p), p) for p in (0, 1, 2)] + [(path, 7)]
    n = 0
    for name, p in files:
        # Shard 0 (and the shared file, read first) late, the others early.
        t = {0: 4.0, 7: 3.0}.get(p, 0.0)
        out = []
        for _ in range(rnd.randrange(6, 16)):
            t += rnd.choice([0, 0, 0.5, 1])
            d = record_dict(
                name=rnd.choice(["loss", "lr"]),
                step=rnd.randrange(2),
                vhash=rnd.choice(["aa", "aa", "bb"]),
                process=rnd.choice(ids[p]),
                time=rnd.choice([t, int(t)]),
                n=(n := n + 1),
            )
            roll = rnd.random()
            if roll < 0.1:
                d["index"] = [[0, 2]]
            elif roll < 0.2:
                d["devices"], d["processes"] = "0-7", "0-3"
            elif roll < 0.25:
                d["attempt"] = 1
            out.append(_odd_line(d, rnd.choice(_HOWS)))
        data = b"".join(x + b"\n" for x in out)
        if p == 2:
            data = data[:-1]  # a last copy without its newline: the tail's road
        with open(name, "wb") as f:
            f.write(data)
        if chunks is not None:
            import fsspec

            fs, prefix = fsspec.core.url_to_fs(chunks)
            cut = rnd.randrange(len(out) + 1)
            for k, part in enumerate((out[:cut], out[cut:])):
                fs.pipe(
                    f"{prefix}{runs.SHARD_SUFFIX}/p{p:05d}-1-ab-{k}.jsonl",
                    b"".join(x + b"\n" for x in part),
                )


class _SetAside(_Counting):
    """_Counting, also counting the lines merge_round is given in place of
    records (set aside by time_keys) and those it parses again."""

    def __init__(self, module) -> None:
        super().__init__(module)
        self.aside = self.again = 0

    def __getattr__(self, name):
        if name != "merge_round":
            return super().__getattr__(name)

        def call(parts, first, pos, loads=None):
            self.calls[name] += 1
            for records, _, _, p, cut in parts:
                self.aside += sum(type(x) is bytes for x in records[p:cut])

            def again(raw):
                self.again += 1
                return loads(raw)

            return self.module.merge_round(parts, first, pos, again if loads else None)

        return call


def test_set_aside_copies_of_odd_lines_read_the_same_with_both_loops(
    c_module, tmp_path, capsys, caplog
):
    """Copies set aside as their lines and kept after all are parsed again
    to exactly what the first parse gave, whatever road the line took
    there (parse_line's slow path, escapes, integers orjson makes floats,
    duplicate keys, the last line's road, which sets nothing aside), with
    process ids of one process in several types, ties, the shared file,
    pieces of every size and an object store's chunks: every reader gives
    what the Python loops give. Without orjson nothing is set aside."""
    caplog.set_level(logging.WARNING)
    try:
        import fsspec  # noqa: F401 - the object store's case
    except ImportError:
        fsspec = None
    aside = again = 0
    for case in range(12):
        rnd = random.Random(7000 + case)
        path = str(tmp_path / f"run{case}.jsonl")
        url = f"memory://pmaptap-set-aside-{os.getpid()}-{case}/run" if fsspec else None
        _odd_copies(rnd, path, url)
        for where in [path] + ([url] if url else []):
            pieces = PIECES[case % len(PIECES)] if where == path else {}
            got = []
            for module in (_SetAside(C), None):
                with pytest.MonkeyPatch.context() as mp:
                    mp.setattr(parse, "SPEEDUPS", module)
                    mp.setattr(runs, "SPEEDUPS", module)
                    for name, value in pieces.items():
                        mp.setattr(runs, name, value)
                    got.append(_readers(where, capsys, caplog))
                if module is not None:
                    aside += module.aside
                    again += module.again
                    assert module.calls["merge_round"], (case, where)
            for what in got[0]:
                assert got[0][what] == got[1][what], (case, where, what)
        if case % 4 == 0:  # json, not orjson: the same, nothing set aside
            got = []
            for module in (_SetAside(C), None):
                with pytest.MonkeyPatch.context() as mp:
                    mp.setattr(fmt, "ORJSON", None)
                    mp.setattr(parse, "SPEEDUPS", module)
                    mp.setattr(runs, "SPEEDUPS", module)
                    got.append(_readers(path, capsys, caplog))
                if module is not None:
                    assert module.aside == 0 and module.calls["merge_round"], case
            for what in got[0]:
                assert got[0][what] == got[1][what], (case, "no orjson", what)
        if url:
            fs, prefix = fsspec.core.url_to_fs(url)
            fs.rm(prefix + runs.SHARD_SUFFIX, recursive=True)
    # Many copies set aside; many of them kept (parsed again), not all.
    assert aside > 200 and 50 < again < aside, (aside, again)


# ------------------------------------------------------------ copies read unbuilt

_ELSEWHERE = "another process"
_MUTATIONS = b' {}[]",:\\0123456789.eE-+tfnul\x7f\xc3'


def _scanned(line: bytes, max_depth: int, max_line: int):
    """What plain_records makes of ``line`` where ``seen`` names another
    process for the value scan_copy reads in it: its (line, time, info), or
    None where scan_copy leaves it to orjson. (A first call with an empty
    ``seen`` lets scan_copy put the line's own key there; that key is then
    given to another process.)"""
    import orjson

    args = (orjson.loads, orjson.JSONDecodeError, max_depth, max_line, fmt.id_ranges)
    seen: dict = {}
    first, _ = C.plain_records([line], *args, seen)
    assert type(first[0]) is not tuple  # its own process first: no copy
    assert len(seen) <= 1
    for key in seen:
        seen[key] = _ELSEWHERE
    records, slow = C.plain_records([line], *args, seen)
    if type(records[0]) is tuple:
        assert slow == [] and len(seen) == 1
        return records[0]
    assert _typed(records) == _typed(first)  # otherwise as without seen
    return None


def _is_what_parse_line_reads(line: bytes, marker) -> None:
    """A line scan_copy took is a plainly valid replicated record with a
    vhash (so parse_line's fast path gives orjson's record), and the time
    and info it gave are that record's, types too."""
    import orjson

    d, why = parse.parse_line(line)
    assert why is None and type(d) is dict, (line, why)
    assert fmt._plainly_valid(d) and _typed(d) == _typed(orjson.loads(line)), line
    assert d["kind"] == "replicated" and type(d["vhash"]) is str and d["vhash"], line
    held, t, info = marker
    assert held is line
    assert type(d["time"]) is float and repr(t) == repr(d["time"]), (line, t)
    assert _typed(info) == _typed(((fmt.record_key(d), d["vhash"]), d["process"])), line


def _copy_lines(rnd: random.Random, n: int) -> list[bytes]:
    """Replicated records with a vhash in the forms writers write (and some
    they do not), and each mutated a byte or two: most mutations break the
    line, some leave it a record scan_copy must still read exactly."""
    out = []
    for k in range(n):
        d = record_dict(
            name=rnd.choice(["loss", "a/b", "x" * 40, "", "lr"]),
            step=rnd.choice([0, 7, 255, 256, -3, 10**17, 10**18, 10**19]),
            value=rnd.choice([1.5, -0.0, 3, None, "s", [1, 2], [[1.5, 2e-300]], {"a": [1]}]),
            vhash=rnd.choice(["00ff", "a", ""]),
            process=rnd.choice([0, 3, 4095, -1, 10**18, 1.0, True, None, "p"]),
            time=rnd.choice(
                [1.5, 1733000000.123456, 1800000000.1000998, 0.1 + 0.2, 1e-7, 5e22, 1, -0.0]
            ),
        )
        extra = rnd.random()
        if extra < 0.15:
            d["pass"] = rnd.choice(["backward", "", 3])
        elif extra < 0.3:
            d["attempt"] = rnd.choice([0, 2, -1, 1.0])
        elif extra < 0.45:
            d["devices"] = rnd.choice([[0, 1], list(range(32)), "0-31", "0-7,9", "3-1", "01", 5])
            d["processes"] = rnd.choice([[0], None, "0-1048575", "0-1048576", [[0]], ["p", 1.5]])
        elif extra < 0.5:
            d["index"] = [[0, 2]]
        elif extra < 0.55:
            d["host"] = rnd.choice(["h\u00e9", "tab\t", 'q"', "\x7f"])
        elif extra < 0.6:
            d["bytes"], d["global_shape"] = "AAAA", [4]
        line = _dump(d)
        if k % 3 == 0:
            raw = bytearray(line)
            for _ in range(rnd.choice([1, 1, 2])):
                at = rnd.randrange(len(raw) + 1)
                what = rnd.random()
                if what < 0.4 and at < len(raw):
                    raw[at] = rnd.choice(_MUTATIONS)
                elif what < 0.7 and at < len(raw):
                    del raw[at]
                else:
                    raw.insert(at, rnd.choice(_MUTATIONS))
            line = bytes(raw)
        elif k % 7 == 1:
            # A field twice (the last one counts): left to orjson.
            line = line[:-1] + b',"step":1}' if k % 2 else line[:-1] + b',"zz":1,"zz":2}'
        out.append(line)
    return out


def _own_copy_lines() -> list[bytes]:
    """Lines the writer itself writes for a replicated value held by other
    processes too (holders as a list, and as ranges text past 16)."""
    from pmaptap.tapfile.format import Record

    out = []
    for holders in ((0, 1), tuple(range(64))):
        r = Record(
            run="run-1",
            name="train/loss",
            step=12,
            kind="replicated",
            value=0.25,
            dtype="float32",
            shape=(),
            process=1,
            time=1733000000.1234567,
            host="node-1",
            replicas=8,
            devices=tuple(range(8)),
            processes=holders,
            vhash="9f86d081884c7d65",
        )
        out.append(r.encode().rstrip(b"\n"))
        out.append(dataclasses.replace(r, attempt=2, pass_="backward").encode().rstrip(b"\n"))
    return out


@pytest.mark.parametrize("limits", LIMITS, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_a_copy_read_without_building_it_is_what_parse_line_reads(c_module, limits, monkeypatch):
    """scan_copy (plain_records with ``seen``) takes a line only where
    parse_line gives a plainly valid replicated record with a vhash, and
    then gives exactly that record's time, record_key, vhash and process;
    on every hostile and odd line the other tests know, and on copies
    mutated a byte or two. The writer's own copy lines are taken."""
    for name, value in limits.items():
        monkeypatch.setattr(parse, name, value)
    rnd = random.Random(1)
    lines = _corpus() + _copy_lines(rnd, 3000)
    own = _own_copy_lines()
    taken = 0
    for line in lines + own:
        marker = _scanned(line, parse.MAX_DEPTH, parse.MAX_LINE_BYTES)
        if marker is not None:
            _is_what_parse_line_reads(line, marker)
            taken += 1
    if not limits:
        assert all(_scanned(x, parse.MAX_DEPTH, parse.MAX_LINE_BYTES) for x in own)
        assert 500 < taken < len(lines) - 500, taken  # both kinds well covered


@settings(
    max_examples=int(os.environ.get("PMAPTAP_FUZZ_EXAMPLES", "40")) * 5,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(st.one_of(hostile_line(), st.sampled_from(_own_copy_lines())), st.binary(max_size=3))
def test_a_copy_read_without_building_it_is_what_parse_line_reads_fuzzed(line, junk):
    assert C is not None, "pmaptap/tapfile/_speedups.c is not built"
    for x in (line, line[: len(line) // 2] + junk + line[len(line) // 2 :]):
        marker = _scanned(x, parse.MAX_DEPTH, FUZZ_LINE_LIMIT)
        if marker is not None and len(x) <= parse.MAX_LINE_BYTES:
            _is_what_parse_line_reads(x, marker)


def test_scan_copy_reads_times_as_orjson_does(c_module):
    """A copy's time read in C (an exactly rounded fast path for short
    mantissas, the full parse otherwise) is the double orjson reads: for
    times as writers round them and random decimal texts around the fast
    path's edges (2**53, 10**22, 17 digits, exponents)."""
    import orjson

    rnd = random.Random(3)
    texts = [repr(round(rnd.uniform(1e9, 2e9), 6)) for _ in range(2000)]
    texts += [repr(rnd.uniform(-1e3, 1e3)) for _ in range(500)]
    texts += ["9007199254740992.0", "9007199254740993.0", "90071992547409.93", "0.1", "-0.0"]
    for _ in range(3000):
        digits = "".join(rnd.choice("0123456789") for _ in range(rnd.randint(1, 17)))
        digits = digits.lstrip("0") or "0"
        cut = rnd.randint(1, len(digits))
        text = digits[:cut] + "." + (digits[cut:] or "0")
        if rnd.random() < 0.4:
            text += rnd.choice(["e", "E"]) + rnd.choice(["", "+", "-"]) + str(rnd.randint(0, 40))
        texts.append(rnd.choice(["", "-"]) + text)
    base = _dump(record_dict(vhash="ab", time=0.5))
    checked = 0
    for text in texts:
        line = base.replace(b'"time":0.5', b'"time":' + text.encode())
        marker = _scanned(line, parse.MAX_DEPTH, parse.MAX_LINE_BYTES)
        if marker is None:
            continue
        assert repr(marker[1]) == repr(orjson.loads(line)["time"]) == repr(float(text)), text
        checked += 1
    assert checked > 5000, checked


def test_scan_copy_takes_holders_text_up_to_format_s_limit(c_module):
    """The ranges text limit in C is format.MAX_HOLDERS: one id more and
    the line is no plain record (parse_line's slow path), so not taken."""
    base = record_dict(vhash="ab", time=1.5)
    for last, taken in ((fmt.MAX_HOLDERS - 1, True), (fmt.MAX_HOLDERS, False)):
        line = _dump(dict(base, processes=f"0-{last}"))
        marker = _scanned(line, parse.MAX_DEPTH, parse.MAX_LINE_BYTES)
        assert (marker is not None) is taken
        assert (fmt.id_ranges(f"0-{last}") is not None) is taken


def test_sharded_copies_read_unbuilt_merge_the_same_with_both_loops(c_module, tmp_path):
    """Runs whose shards write the same replicated values (at times that
    put one process's copy first, or another's, or tie), with per-device
    records between: most copies are read without being built, and every
    reader gives what the Python loops give."""

    class Scanned(_Counting):
        def __init__(self, module) -> None:
            super().__init__(module)
            self.unbuilt = 0

        def __getattr__(self, name):
            fn = super().__getattr__(name)
            if name != "plain_records":
                return fn

            def call(*args):
                records, slow = fn(*args)
                self.unbuilt += sum(type(x) is tuple for x in records)
                return records, slow

            return call

    unbuilt = copies = 0
    for case in range(int(os.environ.get("PMAPTAP_FUZZ_SEEDS", "10")) * 2):
        rnd = random.Random(case)
        path = str(tmp_path / f"run{case}.jsonl")
        os.makedirs(path + runs.SHARD_SUFFIX)
        for p in range(rnd.randint(2, 6)):
            out = []
            for step in range(30):
                t = step + rnd.choice([0.0, 0.0, 0.25, -0.25]) + p * rnd.choice([0, 1e-4])
                out.append(per_device_dict(step, p, 0.5, process=p, time=t))
                rep = record_dict(name="loss", step=step, vhash=f"{step % 7:04x}", time=t)
                rep.update(process=p, processes=[p], n=p)
                if rnd.random() < 0.1:
                    rep["vhash"] = f"divergent-{p}"
                out.append(rep)
                copies += 1
            with open(runs.shard_path(path, p), "wb") as f:
                f.writelines(_dump(d) + b"\n" for d in out)
        for pieces in PIECES[:3]:
            counting = Scanned(C)
            got = []
            for module in (counting, None):  # C, then the Python loops
                with pytest.MonkeyPatch.context() as mp:
                    for user in (parse, runs):
                        mp.setattr(user, "SPEEDUPS", module)
                    for name, value in pieces.items():
                        mp.setattr(runs if hasattr(runs, name) else parse, name, value)
                    got.append(_typed(list(tapfile_lines.iter_lines(path))))
            assert got[0] == got[1], case
            unbuilt += counting.unbuilt
    assert unbuilt > copies, (unbuilt, copies)  # most copies, in every cut of pieces


def test_validate_files_a_device_s_records_under_each_of_its_groups(c_module, tmp_path):
    """validate_run keeps each device's group from its last record: a
    record of the same device in another group (another run, name, pass,
    axis or coordinate) is filed under that group, and a later copy in the
    first group is still found. Both loops report the same duplicates,
    exactly these."""
    base = per_device_dict(0, 0, 0.5)
    others = [
        {"run": "r2"},
        {"name": "g2"},
        {"pass": "backward"},
        {"coords": {"tp": 0}},
        {"coords": {"dp": 1}},
    ]
    lines = []
    want = []
    for i, other in enumerate(others):
        one, two = {"step": 10 * i}, {"step": 10 * i + 1}
        lines.append(dict(base, **one))  # the device's group
        lines.append(dict(base, **two, **other))  # the same device, another group
        lines.append(dict(base, **two, **other))  # a copy there
        want.append((len(lines), len(lines) - 1))
        lines.append(dict(base, **two))  # the first group: no copy
        lines.append(dict(base, **one))  # a copy in the first group
        want.append((len(lines), len(lines) - 4))
    path = tmp_path / "run.jsonl"
    path.write_bytes(b"".join(_dump(d) + b"\n" for d in lines))

    def duplicates():
        report = checks.validate_file(path)
        return [p for p in report.problems if "duplicate" in p[1]]

    c, py, calls = _both(duplicates)
    assert c == py and calls["validate_run"], (c, py)
    assert [(line, int(why.split("line ")[1].split()[0])) for line, why in c] == want, c


# ------------------------------------------------------------ merge pieces


class _Piece(runs._Source):
    """A source whose pieces are given."""

    def __init__(self, pieces: list, name: str = "s") -> None:
        super().__init__()
        self.pieces = list(pieces)
        self.name = name

    def piece(self):
        # (records, problems): no lines, so nothing is set aside here
        return (*self.pieces.pop(0), None) if self.pieces else None


ODD_TIMES = [
    None,
    "5",
    True,
    False,
    [1.0],
    -0.0,
    0.0,
    0,
    1,
    1.0,
    2**53,
    float(2**53),
    2**53 + 1,
    2**63 - 1,
    2**64 - 1,
    2**64 + 1,
    -(2**63),
    1e300,
    -1e300,
    float("inf"),
    float("-inf"),
    float("nan"),
    1.5,
    _Str("7"),
]


def _extend_both(pieces: list):
    out = []
    for module in (C, None):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(runs, "SPEEDUPS", module)
            s = _Piece(pieces)
            try:
                while s.extend():
                    pass
            except Exception as e:  # noqa: BLE001 - compared below
                out.append(type(e))
                continue
            out.append((_typed(s.keys), _typed(s.t)))
    return out


def test_time_keys_same_as_the_python_loop_on_odd_times(c_module):
    """The running largest time: ints and floats only (not bool, nor text),
    an int compared exactly and kept as its float, NaN never taken."""
    rnd = random.Random(5)
    for _ in range(300):
        pieces = []
        for _ in range(rnd.randrange(1, 4)):
            recs = []
            for _ in range(rnd.randrange(0, 8)):
                roll = rnd.random()
                if roll < 0.1:
                    recs.append(None)
                elif roll < 0.15:
                    recs.append({})
                else:
                    recs.append({"time": rnd.choice(ODD_TIMES), "kind": "meta"})
            pieces.append((recs, {}))
        c, py = _extend_both(pieces)
        assert c == py, pieces
    big = [([{"time": 2**2000}], {})]  # no JSON number, but both refuse alike
    assert _extend_both(big) == [OverflowError, OverflowError]
    assert _extend_both([([{"time": -(2**2000)}], {})]) == [OverflowError, OverflowError]


def _round_both(sources: list[list[tuple[float, object]]], first_c: dict, first_py: dict, pos):
    """One round over ``sources`` (each (time, record or _Bad) in order,
    all taken) with merge_round and with runs._merge_round."""
    parts, keys_in, recs_in = [], [], []
    for items in sources:
        records = [None if isinstance(x, runs._Bad) else x for _, x in items]
        problems = {j: x.why for j, (_, x) in enumerate(items) if isinstance(x, runs._Bad)}
        s = _Piece([(records, problems)])
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(runs, "SPEEDUPS", C)
            s.extend()
        p = len(items) // 3
        parts.append((s.records, s.keys, s.infos, p, len(items)))
        keys_in += s.keys[p:]
        # The Python round's _Bad: the problem named as the source names it.
        recs_in += [
            info if isinstance(info, runs._Bad) else d for d, info in zip(s.records, s.infos)
        ][p:]
    c = C.merge_round(parts, first_c, pos)
    py = runs._merge_round(keys_in, recs_in, True, first_py, pos)
    return c, py


def test_merge_round_same_as_the_python_round(c_module):
    rnd = random.Random(11)
    procs = [0, 1, 1.0, True, None, "p", 2]
    for case in range(400):
        first_c: dict = {}
        first_py: dict = {}
        pos = rnd.randrange(3)
        for _ in range(3):  # rounds sharing ``first``
            sources = []
            for s in range(rnd.randrange(1, 5)):
                items = []
                t = 0.0
                for n in range(rnd.randrange(0, 9)):
                    t += rnd.choice([0, 0, 1])
                    roll = rnd.random()
                    if roll < 0.1:
                        x: object = runs._Bad(f"bad {case} {s} {n}")
                    else:
                        kind = "replicated" if roll < 0.8 else rnd.choice(["meta", "per_device"])
                        x = dict(
                            record_dict(kind=kind, step=rnd.randrange(2), time=t, n=(s, n)),
                            process=rnd.choice(procs),
                        )
                        if rnd.random() < 0.8:
                            x["vhash"] = rnd.choice(["aa", "aa", "bb", ""])
                        if rnd.random() < 0.2:
                            x["attempt"] = 1
                    items.append((t, x))
                sources.append(items)
            c, py = _round_both(sources, first_c, first_py, pos)
            assert len(c[0]) == len(py[0]) and all(a is b for a, b in zip(c[0], py[0])), case
            assert c[1:] == py[1:], case
            assert _typed(list(first_c.items())) == _typed(list(first_py.items())), case
            pos = c[2]


def test_an_unhashable_dedup_key_cannot_come_from_a_line(c_module):
    """The dedup key (record_key and vhash) of any line readers take is
    hashable: run, name, pass, vhash must be text, step and attempt
    integers, index pairs of integers. So no line can make merge_round (or
    the Python round) hash a list; given one anyway, both raise
    TypeError."""
    line = _dump(record_dict(vhash="aa"))
    for field, value in (
        ("run", ["r"]),
        ("name", {"a": 1}),
        ("step", [1]),
        ("pass", []),
        ("vhash", ["aa"]),
        ("attempt", [0]),
        ("index", [[0, [1]]]),
        ("index", [[[0, [1]]]]),
    ):
        d = dict(json.loads(line), **{field: value})
        assert parse.parse_line(_dump(d))[0] is None, field
        assert parse.parse_lines([_dump(d)])[0] == [None], field
    d = dict(json.loads(line), run=["r"])
    infos: list = []
    C.time_keys([d], float("-inf"), [], infos, fmt.record_key)
    with pytest.raises(TypeError, match="unhashable"):
        C.merge_round([([d], [1.0], infos, 0, 1)], {}, 0)
    with pytest.raises(TypeError, match="unhashable"):
        runs._merge_round([1.0], [d], True, {}, 0)


# The end of each child script below: every call, what it raised.
_RUN_CALLS = """
for name, call in calls.items():
    try:
        call()
    except Exception as e:
        print(name, "->", type(e).__name__, flush=True)
    else:
        print(name, "->", "no error", flush=True)
print("survived", len(calls))
"""


_BAD_CALLS = r"""
import sys
import numpy as np
from pmaptap.tapfile import _speedups as C
from pmaptap.tapfile.format import id_ranges, record_key
import orjson

d = {"time": 1.0}
ok = ([d], [1.0], [None], 0, 1)
class Index:
    def __index__(self):
        return 0
calls = {
    "part not a tuple": lambda: C.merge_round([[[d], [1.0], [None], 0, 1]], {}, 0),
    "part too short": lambda: C.merge_round([([d], [1.0], [None], 0)], {}, 0),
    "part too long": lambda: C.merge_round([ok + (1,)], {}, 0),
    "records not a list": lambda: C.merge_round([((d,), [1.0], [None], 0, 1)], {}, 0),
    "numpy slice": lambda: C.merge_round([([d], [1.0], [None], np.int64(0), np.int64(1))], {}, 0),
    "index slice": lambda: C.merge_round([([d], [1.0], [None], Index(), 1)], {}, 0),
    "float slice": lambda: C.merge_round([([d], [1.0], [None], 0.0, 1)], {}, 0),
    "slice past records": lambda: C.merge_round([([d], [1.0, 2.0], [None, None], 0, 2)], {}, 0),
    "slice past keys": lambda: C.merge_round([([d, d], [1.0], [None, None], 0, 2)], {}, 0),
    "slice past infos": lambda: C.merge_round([([d, d], [1.0, 2.0], [None], 0, 2)], {}, 0),
    "negative start": lambda: C.merge_round([([d], [1.0], [None], -1, 1)], {}, 0),
    "reversed slice": lambda: C.merge_round([([d], [1.0], [None], 1, 0)], {}, 0),
    "huge slice": lambda: C.merge_round([([d], [1.0], [None], 0, 2**70)], {}, 0),
    "int key": lambda: C.merge_round([([d], [1], [None], 0, 1)], {}, 0),
    "empty info": lambda: C.merge_round([([d], [1.0], [()], 0, 1)], {}, 0),
    "short info": lambda: C.merge_round([([d], [1.0], [(1,)], 0, 1)], {}, 0),
    "info no why": lambda: C.merge_round([([d], [1.0], [object()], 0, 1)], {}, 0),
    "unhashable info": lambda: C.merge_round([([d], [1.0], [([], 0)], 0, 1)], {}, 0),
    "first not a dict": lambda: C.merge_round([ok], [], 0),
    "parts not a list": lambda: C.merge_round((ok,), {}, 0),
    "time_keys record": lambda: C.time_keys([[1]], 0.0, [], [], record_key),
    "time_keys t": lambda: C.time_keys([d], 0, [], [], record_key),
    "time_keys keys": lambda: C.time_keys([d], 0.0, (), [], record_key),
    "time_keys key fn": lambda: C.time_keys(
        [{"kind": "replicated", "vhash": "a", "index": [[0, 1]]}], 0.0, [], [], None
    ),
    "time_keys raising key": lambda: C.time_keys(
        [{"kind": "replicated", "vhash": "a", "index": [[0, 1]]}], 0.0, [], [], lambda d: 1 / 0
    ),
    "time_keys bad truth": lambda: C.time_keys(
        [{"kind": "replicated", "vhash": np.array([1, 2])}], 0.0, [], [], record_key
    ),
    "plain_records lines": lambda: C.plain_records((b"{}",), orjson.loads,
                                                   orjson.JSONDecodeError, 128, 99, id_ranges),
    "plain_records loads": lambda: C.plain_records([b"{}"], lambda b: 1 / 0,
                                                   orjson.JSONDecodeError, 128, 99, id_ranges),
    "first_not_plain ids": lambda: C.first_not_plain(
        [{"name": "a", "step": 0, "kind": "meta", "run": "r", "process": 0, "value": 1,
          "dtype": "i", "shape": [], "time": 1.0, "host": "h", "devices": "0-3"}], 0, None),
}

# Callbacks that change what the C loop is reading (no caller does that; it
# must still not read freed memory: the child runs with PYTHONMALLOC=debug).
def mutating_id_ranges():
    d = json.loads(b'{"name":"a","step":0,"kind":"meta","run":"r","process":0,"value":1,'
                   b'"dtype":"i","shape":[],"time":1.0,"host":"h","devices":"0-3"}')
    items = [d, d]
    def ids(text):
        d.clear()
        items.clear()
        return [(0, 3)]
    return C.first_not_plain(items, 0, ids)
def mutating_record_key():
    vhash = "".join(["a", "b"])  # held by the record only
    recs = [{"kind": "replicated", "vhash": vhash, "process": 10**30, "index": [[0, 1]]}] * 2
    del vhash
    def key(r):
        r.clear()
        recs.clear()
        return 1
    infos = []
    C.time_keys(recs, 0.0, [], infos, key)
    assert infos == [((1, "ab"), 10**30)], infos
class Proc:
    def __ne__(self, other):
        recs.clear(), infos.clear(), keys.clear(), parts.clear()
        return True
recs, keys = [{"n": 1}, {"n": 2}, {"n": 3}], [1.0, 2.0, 3.0]
infos, parts = [(("k", "v"), 0), (("k", "v"), Proc()), None], []
parts.append((recs, keys, infos, 0, 3))
def mutating_loads():
    lines = [b"{}", b"{}"]
    return C.plain_records(lines, lambda b: lines.clear() or {}, ValueError, 9, 9, id_ranges)
calls["mutating id_ranges"] = mutating_id_ranges
calls["mutating record_key"] = mutating_record_key
calls["mutating __ne__"] = lambda: C.merge_round(parts, {}, 0)
calls["mutating loads"] = mutating_loads
import json
"""


def test_bad_arguments_raise_instead_of_crashing(c_module):
    """TypeError/ValueError, not a crash, for what callers never pass; and
    callbacks that change the lists or records being read are safe. Run in
    a child: a crash fails this test instead of ending the session."""
    proc = run_python(_BAD_CALLS + _RUN_CALLS, timeout=120, check=False, PYTHONMALLOC="debug")
    got = dict(x.split(" -> ") for x in proc.stdout.splitlines() if " -> " in x)
    assert proc.returncode == 0 and "survived" in proc.stdout, (proc.stdout, proc.stderr[-2000:])
    value = {
        "slice past records",
        "slice past keys",
        "slice past infos",
        "negative start",
        "reversed slice",
    }
    for name, error in got.items():
        if name in value:
            assert error == "ValueError", (name, error)
        elif name == "huge slice":
            assert error in ("OverflowError", "ValueError"), (name, error)
        elif name == "info no why":
            assert error == "AttributeError", (name, error)
        elif name == "time_keys raising key":
            assert error == "ZeroDivisionError", (name, error)
        elif name == "plain_records loads":
            assert error == "ZeroDivisionError", (name, error)
        elif name == "time_keys bad truth":
            assert error == "ValueError", (name, error)
        elif name in ("mutating id_ranges", "mutating record_key"):
            assert error == "no error", (name, error)
        elif name in ("mutating __ne__", "mutating loads"):
            assert error == "RuntimeError", (name, error)
        else:
            assert error == "TypeError", (name, error)
    assert f"survived {len(got)}" in proc.stdout


_SET_ASIDE_CALLS = r"""
import orjson
from pmaptap.tapfile import _speedups as C
from pmaptap.tapfile.format import record_key

def R(p, **kw):  # a replicated record whose vhash only it holds
    return dict({"kind": "replicated", "vhash": "".join(["a", "b"]), "process": p,
                 "time": 1.0, "run": "r"}, **kw)
line = b'{"kind":"replicated","vhash":"ab","process":1,"time":1.0,"run":"r"}'
info = (("k", "ab"), 1)
calls = {
    "lines not a list": lambda: C.time_keys([R(1)], 0.0, [], [], record_key, (line,), {}),
    "seen not a dict": lambda: C.time_keys([R(1)], 0.0, [], [], record_key, [line], []),
    "seen None": lambda: C.time_keys([R(1)], 0.0, [], [], record_key, [line], None),
    "seen a dict subclass": lambda: C.time_keys(
        [R(1)], 0.0, [], [], record_key, [line], type("D", (dict,), {})()),
    "unhashable key": lambda: C.time_keys(
        [R(1, run=["r"])], 0.0, [], [], record_key, [line], {}),
    "loads None": lambda: C.merge_round([([line], [1.0], [info], 0, 1)], {}, 0, None),
    "no loads": lambda: C.merge_round([([line], [1.0], [info], 0, 1)], {}, 0),
    "loads raising": lambda: C.merge_round([([line], [1.0], [info], 0, 1)], {}, 0, lambda b: 1 / 0),
    "loads not callable": lambda: C.merge_round([([line], [1.0], [info], 0, 1)], {}, 0, 5),
}

def set_aside(recs, lines):
    C.time_keys(recs, 0.0, [], [], record_key, lines, {})
    return [type(x).__name__ for x in recs]
def lines_shorter():
    assert set_aside([R(0), R(1), R(2)], [line]) == ["dict"] * 3
def lines_not_bytes():
    got = set_aside([R(0), R(1), R(2)], [line, line.decode(), bytearray(line)])
    assert got == ["dict"] * 3, got
def one_set_aside():
    assert set_aside([R(0), R(1), R(1.0), R(True), R("1")], [line] * 5) == [
        "dict", "bytes", "bytes", "bytes", "bytes"]
    assert set_aside([R(1), R(1.0), R(True), R(0)], [line] * 4) == [
        "dict", "dict", "dict", "bytes"]
# Python code run by the comparison or the key's hash, changing the lists.
class Ne:
    def __init__(self, lists):
        self.lists = lists
    def __ne__(self, other):
        for x in self.lists:
            x.clear()
        return True
    __hash__ = object.__hash__
def ne_clears():
    recs, lines = [R(0), R(1)], [line, line]
    recs[1]["process"] = Ne([recs, lines])
    C.time_keys(recs, 0.0, [], [], record_key, lines, {})
class NeSwaps:
    def __init__(self, lines):
        self.lines = lines
    def __ne__(self, other):
        self.lines[1] = "no line"
        return True
    __hash__ = object.__hash__
def ne_swaps():
    recs, lines = [R(0), R(1)], [line, bytes(line)]
    recs[1]["process"] = NeSwaps(lines)
    C.time_keys(recs, 0.0, [], [], record_key, lines, {})
    assert type(recs[1]) is dict, recs
class Key:
    def __init__(self, lists):
        self.lists = lists
    def __hash__(self):
        for x in self.lists:
            x.clear()
        return 1
    def __eq__(self, other):
        return True
def hash_clears():
    recs, lines = [R(0, index=[[0, 1]]), R(1, index=[[0, 1]])], [line, line]
    key = Key([recs, lines])
    C.time_keys(recs, 0.0, [], [], lambda d: key, lines, {})
def eq_clears_seen():
    seen = {}
    class K:
        def __hash__(self):
            return 1
        def __eq__(self, other):
            seen.clear()
            return True
    recs = [R(0, index=[[0, 1]]), R(1, index=[[0, 1]])]
    C.time_keys(recs, 0.0, [], [], lambda d: K(), [line, line], seen)
def loads_clears():
    recs, keys, infos = [bytes(line)] * 3, [1.0] * 3, [info] * 3
    def loads(b):
        recs.clear(), infos.clear(), keys.clear()
        return orjson.loads(b)
    C.merge_round([(recs, keys, infos, 0, 3)], {}, 0, loads)
def loads_swaps():
    recs = [bytes(line), bytes(line)]
    def loads(b):
        recs[:] = ["other", "other"]
        return orjson.loads(b)
    out, _, _ = C.merge_round([(recs, [1.0, 1.0], [info] * 2, 0, 2)], {}, 0, loads)
    # The slot loads changed is left as loads left it; the next one (no
    # line now) goes out as it is and its slot is let go of.
    assert recs == ["other", None] and out[1] == "other", (recs, out)
def dropped_aside():
    recs = [bytes(line)]
    out = C.merge_round([(recs, [1.0], [info], 0, 1)], {("k", "ab"): 0}, 0, None)
    assert out == ([], {}, 0) and recs == [None], (out, recs)
SCANNED = (b'{"run":"r","name":"n","step":1,"kind":"replicated","value":1,"dtype":"f",'
           b'"shape":[],"process":1,"time":1.5,"host":"h","replicas":8,"vhash":"v"}')
SCAN_KEY = (("r", "n", 1, "forward", None, 0), "v")
def scan(lines, seen):
    return C.plain_records(lines, orjson.loads, orjson.JSONDecodeError, 128, 1 << 20,
                           lambda t: None, seen)
class NeClearsLines:
    def __init__(self, lines):
        self.lines = lines
    def __ne__(self, other):
        self.lines.clear()
        return True
    __hash__ = object.__hash__
def scan_ne_clears():
    lines = [bytes(bytearray(SCANNED))]  # held by the list alone
    records, slow = scan(lines, {SCAN_KEY: NeClearsLines(lines)})
    assert type(records[0]) is tuple and orjson.loads(records[0][0])["vhash"] == "v"
def scan_ne_raises():
    class NeRaises:
        def __ne__(self, other):
            raise ZeroDivisionError
        __hash__ = object.__hash__
    scan([SCANNED], {SCAN_KEY: NeRaises()})
calls.update({
    "scan: __ne__ clears the lines": scan_ne_clears,
    "scan: __ne__ raises": scan_ne_raises,
    "scan: seen not a dict": lambda: scan([SCANNED], [SCAN_KEY]),
    "lines shorter": lines_shorter,
    "lines not bytes": lines_not_bytes,
    "set aside": one_set_aside,
    "__ne__ clears": ne_clears,
    "__ne__ swaps the line": ne_swaps,
    "key hash clears": hash_clears,
    "key eq clears seen": eq_clears_seen,
    "loads clears": loads_clears,
    "loads swaps": loads_swaps,
    "dropped copy set aside": dropped_aside,
})
"""


def test_set_aside_arguments_raise_instead_of_crashing(c_module):
    """time_keys' lines and seen, plain_records' seen (scan_copy),
    merge_round's loads: TypeError for what callers never pass (lines not
    a list, seen not a dict, a line set aside and no loads), loads' and a
    comparison's own errors, nothing set aside where the line is
    missing or no bytes; Python code run by a comparison, a key's hash or
    loads that changes the lists read is safe. In a child under
    PYTHONMALLOC=debug: a crash fails this test, not the session."""
    proc = run_python(_SET_ASIDE_CALLS + _RUN_CALLS, timeout=120, check=False, PYTHONMALLOC="debug")
    got = dict(x.split(" -> ") for x in proc.stdout.splitlines() if " -> " in x)
    assert proc.returncode == 0 and "survived" in proc.stdout, (proc.stdout, proc.stderr[-2000:])
    assert f"survived {len(got)}" in proc.stdout
    want = {
        "lines not a list": "TypeError",
        "seen not a dict": "TypeError",
        "seen None": "TypeError",
        "seen a dict subclass": "TypeError",
        "unhashable key": "TypeError",
        "loads None": "TypeError",
        "no loads": "TypeError",
        "loads raising": "ZeroDivisionError",
        "loads not callable": "TypeError",
        "loads clears": "RuntimeError",
        "scan: __ne__ raises": "ZeroDivisionError",
        "scan: seen not a dict": "TypeError",
    }
    for name, error in got.items():
        assert error == want.get(name, "no error"), (name, error, proc.stderr[-2000:])


# ------------------------------------------------------------ leaks


def _grows(fn, rounds: int = 3000) -> int:
    """Bytes still allocated after ``rounds`` more calls of ``fn`` than
    after a warm-up."""
    for _ in range(200):
        fn()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(rounds):
            fn()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def _refcounts_come_back(calls, watched: list) -> None:
    """``calls()`` 500 times more after a first: the reference counts of
    ``watched`` are where they were, and memory stays flat."""
    calls()
    counts = [sys.getrefcount(x) for x in watched]
    for _ in range(500):
        calls()
    assert [sys.getrefcount(x) for x in watched] == counts
    assert _grows(calls, 1000) < 64 << 10


def test_no_references_leak(c_module):
    """Reference counts of everything the functions touch come back to
    where they were, after results and errors alike; memory stays flat."""
    import orjson

    d = record_dict(vhash="aa", process=1, devices="0-3", time=2.0)
    pd = per_device_dict(1, 1, 0.5)
    proc, vhash = d["process"], d["vhash"]
    bad = runs._Bad("why")
    line = _dump(d)
    lines = [line, b"garbage", _dump(pd), b"[" * 200, line]
    key_fn = fmt.record_key
    watched = [d, pd, vhash, bad, bad.why, line, lines, key_fn, fmt.id_ranges, orjson.loads]

    def calls():
        records, slow = C.plain_records(
            lines, orjson.loads, orjson.JSONDecodeError, 128, 1 << 20, fmt.id_ranges
        )
        assert slow == [1, 3]
        C.first_not_plain([d, pd, 1, d], 0, fmt.id_ranges)
        keys: list = []
        infos: list = []
        C.time_keys([d, None, pd, d, {"time": 2**70}], float("-inf"), keys, infos, key_fn)
        infos[1] = bad
        first: dict = {}
        for _ in range(2):
            C.merge_round([([d, None, pd, d, pd], keys, infos, 0, 5)], first, 0)
        for args in (
            ([([d], [1], [None], 0, 1)], {}, 0),
            ([([d], [1.0], [(1,)], 0, 1)], {}, 0),
            ([([d], [1.0], [([], proc)], 0, 1)], {}, 0),
            ([([d, d], [1.0, 1.0], [None, None], 0, 3)], {}, 0),
        ):
            try:
                C.merge_round(*args)
            except (TypeError, ValueError):
                pass
        for args in (
            ([d, 5], float("-inf"), [], [], key_fn),
            ([{"time": 2**2000}], float("-inf"), [], [], key_fn),
            ([dict(d, index=[[0, 1]])], float("-inf"), [], [], lambda r: 1 / 0),
        ):
            try:
                C.time_keys(*args)
            except (TypeError, OverflowError, ZeroDivisionError):
                pass
        try:
            C.plain_records([line], lambda b: 1 / 0, ValueError, 128, 99, fmt.id_ranges)
        except ZeroDivisionError:
            pass

    calls()
    counts = [sys.getrefcount(x) for x in watched] + [sys.getrefcount(proc)]
    for _ in range(500):
        calls()
    assert [sys.getrefcount(x) for x in watched] + [sys.getrefcount(proc)] == counts
    assert _grows(calls, 1000) < 64 << 10


def test_no_references_leak_setting_aside_and_parsing_again(c_module):
    """time_keys with lines and seen (a copy set aside: its record freed,
    its line held), merge_round parsing a kept one again, and their errors:
    reference counts come back, memory stays flat."""
    import orjson

    d0 = record_dict(vhash="aa", process=0, time=1.0)
    d1 = record_dict(vhash="aa", process=1, time=2.0)
    l0, l1 = _dump(d0), _dump(d1)
    loads, key_fn = orjson.loads, fmt.record_key
    watched = [l0, l1, loads, key_fn]

    def calls():
        recs = [loads(l0), loads(l1), loads(l1), None, loads(l1)]
        lines = [l0, l1, l1, b"x"]  # the last record has no line: kept as is
        keys: list = []
        infos: list = []
        seen: dict = {}
        C.time_keys(recs, float("-inf"), keys, infos, key_fn, lines, seen)
        assert [type(x) for x in recs] == [dict, bytes, bytes, type(None), dict]
        first = {infos[1][0]: 1}  # process 1 wrote first: kept, parsed again
        out, _, _ = C.merge_round([(recs, keys, infos, 0, 5)], first, 0, loads)
        assert [d["process"] for d in out if d] == [1, 1, 1]
        for args in (
            ([dict(d1)], float("-inf"), [], [], key_fn, (l1,), {}),
            ([dict(d1)], float("-inf"), [], [], key_fn, [l1], None),
            ([dict(d1, run=["r"])], float("-inf"), [], [], key_fn, [l1], {}),
        ):
            try:
                C.time_keys(*args)
            except TypeError:
                pass
        for fn in (None, lambda b: 1 / 0):
            try:
                C.merge_round([([l1], [1.0], [((("k",), "aa"), 1)], 0, 1)], {}, 0, fn)
            except (TypeError, ZeroDivisionError):
                pass

    _refcounts_come_back(calls, watched)


def test_no_references_leak_reading_copies_unbuilt(c_module):
    """plain_records taking copies unbuilt (scan_copy), time_keys holding
    them as their lines, merge_round dropping one and parsing one again,
    and their errors: reference counts come back, memory stays flat."""
    import orjson

    l0 = _dump(record_dict(vhash="aa", process=0, time=1.0, **{"pass": "forward"}))
    l1 = _dump(record_dict(vhash="aa", process=1, time=2.0, attempt=1, devices="0-7"))
    l2 = _dump(record_dict(vhash="aa", process=2, time=3.0))
    loads, key_fn = orjson.loads, fmt.record_key
    args = (loads, orjson.JSONDecodeError, parse.MAX_DEPTH, parse.MAX_LINE_BYTES, fmt.id_ranges)
    watched = [l0, l1, l2, loads, key_fn, fmt.id_ranges]

    def calls():
        seen = {(("r", "a", 0, "forward", None, a), "aa"): 5 for a in (0, 1)}
        recs, slow = C.plain_records([l0, l1, l2, b"{"], *args, seen)
        assert [type(x) for x in recs] == [tuple, tuple, tuple, type(None)] and slow == [3]
        keys: list = []
        infos: list = []
        C.time_keys(recs, float("-inf"), keys, infos, key_fn, [l0, l1, l2, b"{"], seen)
        assert [type(x) for x in recs] == [bytes, bytes, bytes, type(None)]
        first = {infos[0][0]: 0}
        out, _, _ = C.merge_round([(recs, keys, infos, 0, 4)], first, 0, loads)
        assert [d and d["process"] for d in out] == [0, 1, None]
        for bad in ((l1, "x", None), (l1, 1.0), ("x", 1.0, None)):
            try:
                C.time_keys([bad], float("-inf"), [], [], key_fn)
            except TypeError:
                pass
        try:
            C.plain_records([l1], *args, [])
        except TypeError:
            pass

    _refcounts_come_back(calls, watched)


def test_no_references_leak_validating_with_the_group_cache(c_module):
    """validate_run with its cache (hits, misses, a group changed under a
    device, a cache entry not its own form, bad arguments): reference
    counts come back, memory stays flat."""
    pd = per_device_dict(1, 1, 0.5)
    other = dict(pd, name="g2")
    not_clean = tuple(fmt.NOT_CLEAN)
    watched = [pd, other, not_clean]

    def calls():
        groups: dict = {}
        cache: dict = {}
        batch = [dict(pd, step=s) for s in range(4)] + [dict(other, step=1), dict(pd, step=9)]
        assert C.validate_run(batch, 0, 1, groups, not_clean, cache) == (6, 6)
        assert len(groups) == 2 and list(cache) == [1]
        assert C.validate_run([dict(pd, step=2)], 0, 1, groups, not_clean, cache) == (0, 0)
        cache[1] = ("not", "a group")
        assert C.validate_run([dict(pd, step=5)], 0, 1, groups, not_clean, cache) == (1, 1)
        cache[1] = [1]
        assert C.validate_run([dict(pd, step=6)], 0, 1, groups, fmt.NOT_CLEAN, cache) == (1, 1)
        for args in ((batch, 0, 1, groups, not_clean, []), (batch, 0, 1, groups, 5, cache)):
            try:
                C.validate_run(*args)
            except TypeError:
                pass

    _refcounts_come_back(calls, watched)
