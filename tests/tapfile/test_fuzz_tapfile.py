"""Property-based fuzzing of the tap-file parser and every reader on top of it.

Random and mutated tap files (deep nesting, long lines, invalid UTF-8, NUL,
huge numbers, wrong field types, torn and spliced lines, byte-level damage to
a 200-record file) go through parse_line, iter_lines, pmaptap.read, views,
validate, summary, export and the tail -f line follower, with orjson and with
the json fallback. Checked: no exception escapes; every line a reference
decision (plain ``json`` plus the documented limits, independent of
tapfile/record/parse.py) calls a record is returned, equal to it; every other
non-empty line is reported with its line number.

Bounded to a few seconds by default; ``PMAPTAP_FUZZ_EXAMPLES=5000 pytest
tests/tapfile/test_fuzz_tapfile.py`` runs a longer search.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import tempfile

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from read_definitions import load

import pmaptap
from pmaptap.tapfile import record as fmt
from pmaptap.tapfile.analyze import table as summary
from pmaptap.tapfile.analyze import validate as checks
from pmaptap.tapfile.export import csv_rows as export
from pmaptap.tapfile.read import follower as follow
from pmaptap.tapfile.read import views
from pmaptap.tapfile.record import parse, schema
from pmaptap.tapfile.source.lines import iter_lines

EXAMPLES = int(os.environ.get("PMAPTAP_FUZZ_EXAMPLES", "40"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# A small line limit so that "long lines" are cheap to make: the limit is
# read at call time everywhere (parse, iter_lines, the follower).
FUZZ_LINE_LIMIT = 4096
BACKENDS = ["orjson", "json"]


def _rec(**over) -> dict:
    d = {
        "run": "r1",
        "name": "loss",
        "step": 0,
        "kind": "replicated",
        "value": 0.5,
        "dtype": "float32",
        "shape": [],
        "process": 0,
        "time": 1700000000.25,
        "host": "h0",
        "replicas": 4,
        "devices": [0, 1, 2, 3],
        "processes": [0],
        "vhash": "00ff",
    }
    d.update(over)
    return d


def _dev(**over) -> dict:
    d = {
        "run": "r1",
        "name": "x",
        "step": 0,
        "kind": "per_device",
        "value": [1.0, "NaN", "-Infinity"],
        "dtype": "float32",
        "shape": [3],
        "process": 1,
        "time": 1700000000.5,
        "host": "h1",
        "device": 2,
        "coords": {"dp": 2},
    }
    d.update(over)
    return d


CORPUS = [
    json.dumps(d, separators=(",", ":"), ensure_ascii=False).encode()
    for d in [
        _rec(),
        _rec(step=1, value="NaN"),
        _rec(step=2, divergent=True),
        _rec(name="grad", step=3, **{"pass": "backward"}),
        _dev(),
        _dev(step=1, device=None, coords={}),
        _dev(name="c", dtype="complex64", shape=[2], value=[[1.0, 2.0], ["NaN", 0.0]]),
        _rec(
            name="tree",
            dtype={"a": "int32", "b": ["bool", "float16"]},
            shape={"a": [2], "b": [[], [1]]},
            value={"a": [1, 2], "b": [True, [0.25]]},
        ),
        _rec(
            name="big",
            summarized=True,
            dtype="float32",
            shape=[4096],
            value={"min": 0.0, "max": 1.0, "mean": 0.5, "std": 0.1, "nan": 0, "inf": 0},
        ),
        {
            "run": "r1",
            "name": "pmaptap/dropped",
            "step": 3,
            "kind": "meta",
            "value": 7,
            "dtype": "int64",
            "shape": [],
            "process": 0,
            "time": 1.0,
            "host": "h\u00e9 \U0001f680",
            "dropped_total": 7,
        },
        _dev(name="m", dtype="int8", shape=[2, 2], value=[[1, -2], [3, 4]]),
    ]
]
assert all(len(line) < FUZZ_LINE_LIMIT for line in CORPUS)


@contextlib.contextmanager
def fuzz_env(backend: str):
    """The parser backend and the small line limit, restored afterwards."""
    saved = fmt.ORJSON, parse.MAX_LINE_BYTES
    if backend == "json":
        fmt.ORJSON = None
    elif fmt.ORJSON is None:
        pytest.skip("orjson is not installed")
    parse.MAX_LINE_BYTES = FUZZ_LINE_LIMIT
    try:
        yield
    finally:
        fmt.ORJSON, parse.MAX_LINE_BYTES = saved


# ------------------------------------------------------------ the reference


def _no_constant(name):
    raise ValueError(name)


def _depth(obj) -> int:
    best, stack = 0, [(obj, 1)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, (dict, list)):
            best = max(best, d)
            stack.extend((y, d + 1) for y in (x.values() if isinstance(x, dict) else x))
    return best


def _normalized(x):
    """The documented number and text rules: finite doubles; integers outside
    [-2**63, 2**64) read as floats; no lone surrogates."""
    if isinstance(x, dict):
        return {_normalized(k): _normalized(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_normalized(v) for v in x]
    if isinstance(x, float) and x in (float("inf"), float("-inf")):
        raise ValueError("infinite")
    if isinstance(x, int) and not isinstance(x, bool) and not -(1 << 63) <= x < (1 << 64):
        return float(x)  # OverflowError past the double range
    if isinstance(x, str):
        x.encode("utf-8")  # UnicodeEncodeError on a lone surrogate
    return x


def reference(raw: bytes):
    """ "empty", None (must be reported) or the record it must give."""
    if len(raw) > FUZZ_LINE_LIMIT:
        return None
    if not raw.strip():
        return "empty"
    try:
        obj = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return None
    if _depth(obj) > parse.MAX_DEPTH:
        return None
    try:
        obj = _normalized(obj)
    except (ValueError, OverflowError):
        return None
    return None if fmt.validate_dict(obj) else obj


def split_lines(data: bytes) -> list[bytes]:
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    return lines


# ------------------------------------------------------------ the check


class _Collect(logging.Handler):
    """pmaptap's log messages during one read (a fixture like caplog cannot
    be reset between hypothesis examples)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def check_file(data: bytes) -> None:
    """Every reader on ``data``: nothing raises, valid lines returned, the
    others reported by line number."""
    lines = split_lines(data)
    want = [reference(raw) for raw in lines]
    for raw, w in zip(lines, want):  # the parser alone
        d, problem = parse.parse_line(raw)
        if w == "empty":
            assert d is None and problem == "empty line"
        elif w is None:
            assert d is None and problem, raw[:200]
        else:
            assert problem is None and d == w, (raw[:200], problem)

    fd, path = tempfile.mkstemp(suffix=".jsonl")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        got = list(iter_lines(path))
        assert [n for n, _, _ in got] == list(range(1, len(lines) + 1))
        for (n, d, problem), w in zip(got, want):
            if w is None or w == "empty":
                assert d is None and problem, (n, lines[n - 1][:200])
            else:
                assert d == w and problem is None, (n, problem)
        valid = [w for w in want if w not in (None, "empty")]
        bad = sum(w is None for w in want)

        caught = _Collect()
        logging.getLogger("pmaptap").addHandler(caught)
        try:
            recs = pmaptap.read(path)
        finally:
            logging.getLogger("pmaptap").removeHandler(caught)
        assert len(recs) == len(valid)
        assert [(r["name"], r["step"]) for r in recs] == [(w["name"], w["step"]) for w in valid]
        skipped = [m for m in caught.messages if "skipped" in m]
        if bad:
            assert len(skipped) == 1 and f"skipped {bad} invalid line(s)" in skipped[0]
        else:
            assert not skipped

        entries, problems = load(path)
        assert len(entries) == len(valid)
        assert sorted(n for n, _ in problems) == [
            i + 1 for i, w in enumerate(want) if w is None or w == "empty"
        ]
        for e in entries:
            views.row(e)
            json.loads(views.json_line(e))
        report = checks.validate_file(path)
        reported = {n for n, _ in report.problems}
        assert all(i + 1 in reported for i, w in enumerate(want) if w is None or w == "empty")
        summary.summary_table(recs)
        export.write_csv(entries, io.StringIO())

        lf = follow.LineFollower(path)
        try:
            followed = [parse.parse_line(raw)[0] for _, raw in lf.poll()]
        finally:
            lf.close()
        complete = lines if data.endswith(b"\n") else lines[:-1]
        assert followed == [w if w not in (None, "empty") else None for w in want[: len(complete)]]
    finally:
        os.unlink(path)


# ------------------------------------------------------------ strategies

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
FIELDS = sorted({k for line in CORPUS for k in json.loads(line)})


def _dump(d) -> bytes:
    return json.dumps(d, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass")


@st.composite
def hostile_line(draw) -> bytes:
    base = draw(st.sampled_from(CORPUS))
    kind = draw(
        st.sampled_from(
            [
                "valid",
                "deep",
                "long",
                "bytes",
                "nul",
                "number",
                "type",
                "torn",
                "splice",
                "flip",
                "dup",
                "brackets",
                "random",
                "surrogate",
            ]
        )
    )
    if kind == "valid":
        return base
    if kind == "deep":
        n = draw(
            st.sampled_from(
                [parse.MAX_DEPTH - 2, parse.MAX_DEPTH - 1, parse.MAX_DEPTH, 500, 3000, 100_000]
            )
            | st.integers(1, 400)
        )
        d = json.loads(base)
        return _dump(d).replace(
            b'"value":', b'"value":' + b"[" * n + b"0" + b"]" * n + b',"v0":', 1
        )
    if kind == "long":
        n = draw(st.integers(FUZZ_LINE_LIMIT - len(base) - 40, FUZZ_LINE_LIMIT - len(base) + 40))
        return _dump(dict(json.loads(base), pad="p" * max(n, 0)))
    if kind == "bytes":
        at = draw(st.integers(0, len(base)))
        junk = draw(st.binary(min_size=1, max_size=4).filter(lambda b: b"\n" not in b))
        return base[:at] + junk + base[at:]
    if kind == "nul":
        at = draw(st.integers(0, len(base)))
        return base[:at] + b"\x00" + base[at:]
    if kind == "number":
        digits = draw(
            st.sampled_from(
                [
                    "9" * 19,
                    "1" * 20,
                    "-" + "9" * 19,
                    "1" * 400,
                    "7" * 5000,
                    "1e400",
                    "-1e999",
                    "1e-400",
                    "1" + "0" * 309,
                    "18446744073709551615",
                    "18446744073709551616",
                    "-9223372036854775809",
                ]
            )
        )
        field = draw(st.sampled_from(["step", "value", "process", "time"]))
        d = json.loads(base)
        return _dump(d).replace(f'"{field}":'.encode(), f'"{field}":{digits},"was":'.encode(), 1)
    if kind == "type":
        d = json.loads(base)
        d[draw(st.sampled_from(FIELDS))] = draw(JSON_VALUES)
        return _dump(d)
    if kind == "surrogate":
        esc = draw(
            st.sampled_from([b"\\ud800", b"\\udfff", b"\\ud83d\\ude00", b"\\ud83d", b"\\\\ud800"])
        )
        return base.replace(b'"host":"', b'"host":"' + esc, 1)
    if kind == "torn":
        return base[: draw(st.integers(0, len(base)))]
    if kind == "splice":
        other = draw(st.sampled_from(CORPUS))
        return base[: draw(st.integers(0, len(base)))] + other[draw(st.integers(0, len(other))) :]
    if kind == "flip":
        at = draw(st.integers(0, len(base) - 1))
        bit = draw(st.integers(0, 7))
        out = bytearray(base)
        out[at] ^= 1 << bit
        return bytes(out).replace(b"\n", b" ")
    if kind == "dup":
        a = draw(st.integers(0, len(base)))
        b = draw(st.integers(a, len(base)))
        return base[:b] + base[a:b] + base[b:]
    if kind == "brackets":
        at = draw(st.integers(0, len(base)))
        return (
            base[:at]
            + draw(st.sampled_from([b"[", b"{", b'[{"a":'])) * draw(st.integers(1, 400))
            + base[at:]
        )
    return draw(st.binary(max_size=300)).replace(b"\n", b"")


@st.composite
def tap_file(draw) -> bytes:
    lines = draw(st.lists(hostile_line(), max_size=10))
    data = b"\n".join(lines)
    if lines and draw(st.booleans()):
        data += b"\n"
    return data


@pytest.mark.parametrize("backend", BACKENDS)
@FUZZ
@given(data=tap_file())
def test_fuzzed_lines_never_raise_and_valid_ones_survive(backend, data):
    with fuzz_env(backend):
        check_file(data)


def _file_200() -> bytes:
    out = []
    for step in range(40):
        out.append(_dump(_rec(step=step, value=1.0 / (step + 1))))
        for dev in range(4):
            out.append(
                _dump(_dev(step=step, device=dev, coords={"dp": dev}, value=[step, dev, 0.5]))
            )
    return b"\n".join(out) + b"\n"


FILE_200 = _file_200()


@st.composite
def mutated_file(draw) -> bytes:
    """Byte-level damage anywhere in a 200-record file (newlines included):
    bit flips, cuts, duplicated spans, runs of '['."""
    data = bytearray(FILE_200)
    for _ in range(draw(st.integers(1, 6))):
        at = draw(st.integers(0, len(data) - 1))
        op = draw(st.sampled_from(["flip", "cut", "dup", "brackets", "junk"]))
        if op == "flip":
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "cut":
            del data[at : at + draw(st.integers(1, 300))]
        elif op == "dup":
            n = draw(st.integers(1, 500))
            data[at:at] = data[at : at + n]
        elif op == "brackets":
            data[at:at] = b"[" * draw(st.sampled_from([10, 200, 5000]))
        else:
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]  # a cut-off copy
    return bytes(data)


@pytest.mark.parametrize("backend", BACKENDS)
@FUZZ
@given(data=mutated_file())
def test_mutated_200_record_files_keep_every_intact_record(backend, data):
    with fuzz_env(backend):
        check_file(data)
        # Lines the damage did not touch are records again.
        intact = set(split_lines(FILE_200)) & set(split_lines(data))
        got = {raw for raw in split_lines(data) if parse.parse_line(raw)[0]}
        assert intact <= got


@FUZZ
@given(data=tap_file())
def test_orjson_and_json_read_every_line_alike(data):
    if fmt.ORJSON is None:
        pytest.skip("orjson is not installed")
    results = {}
    for backend in BACKENDS:
        with fuzz_env(backend):
            results[backend] = [parse.parse_line(raw)[0] for raw in split_lines(data)]
    assert results["orjson"] == results["json"]


# The parser's one-call path (the format's Structs, schema.DECODER) must never
# accept a record the full checks refuse, and gives what they read: mutate
# ordinary records field by field with values of every JSON type (and a few
# Python subclasses JSON never produces).
_ODD_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.floats(allow_nan=False),
    st.sampled_from(["", "x", "replicated", "per_device", "meta", "forward"]),
    st.lists(st.one_of(st.integers(0, 3), st.none(), st.text(max_size=2)), max_size=3),
    st.lists(st.lists(st.integers(0, 4), max_size=2), max_size=2),
    st.dictionaries(st.sampled_from(["dp", "mp"]), st.integers(0, 3), max_size=2),
)
_PLAIN_RECORDS = [
    {
        "run": "r",
        "name": "loss",
        "step": 3,
        "kind": "replicated",
        "value": 1.5,
        "dtype": "float32",
        "shape": [],
        "process": 0,
        "time": 1.0,
        "host": "h",
        "replicas": 8,
        "devices": [0, 1],
        "processes": [0],
        "vhash": "ab",
    },
    {
        "run": "r",
        "name": "g",
        "step": 3,
        "kind": "per_device",
        "value": [1.0, "NaN"],
        "dtype": "float32",
        "shape": [2],
        "process": 1,
        "time": 1.0,
        "host": "h",
        "device": 5,
        "coords": {"dp": 5},
        "attempt": 1,
    },
    {
        "run": "r",
        "name": "pmaptap/dropped",
        "step": 0,
        "kind": "meta",
        "value": 2,
        "dtype": "int64",
        "shape": [],
        "process": 0,
        "time": 1.0,
        "host": "h",
    },
]
_FIELDS = sorted({k for r in _PLAIN_RECORDS for k in r} | {"pass", "attempt", "index", "divergent"})


def _fast(d: dict):
    """The record the format's Structs make of ``d``'s line (None: they
    refuse it and the definition's path reads it)."""
    try:
        return schema.DECODER.decode(json.dumps(d))
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None


def test_fast_record_check_takes_ordinary_records():
    for r in _PLAIN_RECORDS:
        assert _fast(dict(r)) is not None, r
        assert fmt.validate_dict(dict(r)) is None


_ODD_SAMPLES = [
    KeyError,  # the field removed
    None,
    True,
    False,
    0,
    -1,
    7,
    2**70,
    1.5,
    -0.0,
    "",
    "x",
    "replicated",
    "per_device",
    "meta",
    [],
    [0, 1],
    [None, "a", 1.5, True],
    [[0, 1]],
    [[[0, 1]]],
    [{"a": 1}],
    {},
    {"dp": 1},
    {"dp": [1]},
]


def _mutated(which: int, changes) -> dict:
    d = dict(_PLAIN_RECORDS[which])
    for field, value in changes:
        if value is KeyError:
            d.pop(field, None)
        else:
            d[field] = value
    return d


def _check_fast_path(d: dict) -> None:
    full = fmt.validate_dict(d)
    fast = _fast(d)
    if fast is not None:
        assert full is None, d
        assert schema.as_dict(fast) == d, d


def test_fast_record_check_accepts_only_what_full_checks_accept_one_field():
    for which in range(len(_PLAIN_RECORDS)):
        for field in _FIELDS:
            for value in _ODD_SAMPLES:
                _check_fast_path(_mutated(which, [(field, value)]))


def field_changes(min_size: int) -> st.SearchStrategy:
    """Lists of (field, odd value) to set on a plain record (_mutated)."""
    return st.lists(
        st.tuples(st.sampled_from(_FIELDS), st.one_of(st.sampled_from(_ODD_SAMPLES), _ODD_VALUES)),
        min_size=min_size,
        max_size=4,
    )


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(range(len(_PLAIN_RECORDS))), field_changes(2))
def test_fast_record_check_accepts_only_what_full_checks_accept(which, changes):
    _check_fast_path(_mutated(which, changes))
