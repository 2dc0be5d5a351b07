"""Reading in batches (issue 15.4): the batched parser, the batched reader
and ``pmaptap summary``'s one-pass fast path give exactly what the
line-at-a-time definitions give, on files with hostile lines anywhere in a
batch, torn and over-long last lines, NaN/inf, several runs, restarts,
divergence, duplicates and odd coordinates."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
from read_definitions import index_records, parse_lines

from conftest import per_device_dict, record_dict, replicated_dict
from pmaptap.tapfile.analyze.summary import Summarizer, summarize_file
from pmaptap.tapfile.analyze.table import summary_table
from pmaptap.tapfile.analyze.validate import _canonical, _coords_key
from pmaptap.tapfile.record import format as fmt
from pmaptap.tapfile.record import parse
from pmaptap.tapfile.record.schema import as_dict
from pmaptap.tapfile.source import iter_lines
from pmaptap.tapfile.source import lines as tapfile_lines
from pmaptap.tapfile.source.lines import iter_file_records

HOSTILE = [
    b"",
    b"   ",
    b"not json",
    b'{"run": "r", "name": "a"',  # cut short
    b"\x00\x00\x00",
    b'{"run":"r\x00"}',
    b"\xff\xfe{}",
    b"[1, 2]",
    b"5",
    b'"a string"',
    b"{}",
    b"[" * 200 + b"]" * 200,
    b'{"x": ' + b"[" * 150 + b"]" * 150 + b"}",
    b'{"step": 1e400}',
    b"NaN",
    b'{"a": 1,}',
]


def _rec(**kw) -> dict:
    return record_dict(**kw)


def _pd(step, dev, value, name="g", **kw):
    return per_device_dict(step, dev, value, name, **{"process": int(dev) // 2, **kw})


def _rp(step, value, name="loss", **kw):
    return replicated_dict(step, value, name, **{"processes": [0, 1], **kw})


# Records that are valid but not "plain", or not valid: each must get
# exactly parse_line's answer wherever it sits in a batch.
ODD_RECORDS = [
    _rec(index=[[0, 2]]),
    _rec(step=True),
    _rec(step=1.5),
    _rec(name=""),
    _rec(name=7),
    _rec(run=None),
    _rec(**{"pass": None}),
    _rec(**{"pass": "backward"}),
    _rec(attempt=-1),
    _rec(attempt=True),
    _rec(attempt=2),
    _rec(vhash=3),
    _rec(devices={"a": 1}),
    _rec(devices=[[1]]),
    _rec(processes=[None, "x", 1.5]),
    _rec(kind="other"),
    _rec(kind=["replicated"]),
    {k: v for k, v in _rec().items() if k != "replicas"},
    {k: v for k, v in _rec().items() if k != "host"},
    _rec(kind="per_device", device=1, coords=[1]),
    _rec(kind="per_device", device=[1], coords={}),
    _rec(kind="per_device", coords={}),
    _rec(kind="per_device", device=None, coords={}),
    _rec(kind="meta", name="pmaptap/dropped", value=3),
]


def _line(d) -> bytes:
    return json.dumps(d).encode()


def _mixed_lines(seed: int, n: int = 400) -> list[bytes]:
    rnd = random.Random(seed)
    good = [_line(_pd(s, d, 0.5 * d + s)) for s in range(n // 8) for d in range(4)]
    good += [_line(_rp(s, 1.0 / (s + 1))) for s in range(n // 8)]
    rnd.shuffle(good)
    for _ in range(n // 10):
        bad = rnd.choice(HOSTILE + [_line(d) for d in ODD_RECORDS])
        good.insert(rnd.randrange(len(good) + 1), bad)
    return good


@pytest.mark.parametrize("seed", range(6))
def test_parse_lines_gives_parse_line_answers(seed):
    lines = _mixed_lines(seed)
    records, problems = parse_lines(lines)
    assert len(records) == len(lines)
    for i, raw in enumerate(lines):
        d, problem = parse.parse_line(raw)
        assert records[i] == d, (i, raw[:80])
        assert problems.get(i) == problem, (i, raw[:80])


def test_parse_lines_all_plain_and_every_odd_record_alone():
    plain = [_line(_pd(s, 1, 0.5)) for s in range(50)]
    assert parse_lines(plain) == ([json.loads(x) for x in plain], {})
    for odd in ODD_RECORDS + [json.loads(x) for x in HOSTILE if _loads_or_none(x) is not None]:
        lines = plain[:10] + [_line(odd)] + plain[10:]
        records, problems = parse_lines(lines)
        d, problem = parse.parse_line(_line(odd))
        assert records[10] == d and problems.get(10) == problem, odd
        assert records[:10] + records[11:] == [json.loads(x) for x in plain]
        assert set(problems) <= {10}


def _loads_or_none(raw: bytes):
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _write(path, lines: list[bytes], tail: bytes = b"") -> str:
    path.write_bytes(b"".join(x + b"\n" for x in lines) + tail)
    return str(path)


def _lines_one_at_a_time(path) -> list[tuple[int, dict | None, str | None]]:
    """The definition: parse_line of each line, a last line without its
    newline torn if it is not valid JSON, an over-long line reported."""
    limit = parse.MAX_LINE_BYTES
    out = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if raw.endswith(b"\n"):
                raw = raw[:-1]
                if len(raw) > limit:
                    out.append((n, None, "too long"))
                    continue
                out.append((n, *parse.parse_line(raw)))
            else:
                if len(raw) > limit:
                    out.append((n, None, "too long"))
                    continue
                d, problem = parse.parse_line(raw)
                if problem is not None and problem.startswith("not valid JSON"):
                    problem = "torn last line (no newline)"
                out.append((n, d, problem))
    return out


@pytest.mark.parametrize("tail", [b"", b'{"run": "r", "na', b"\x00\x00"])
def test_batched_reader_gives_every_line_as_the_definition(tmp_path, monkeypatch, tail):
    monkeypatch.setattr(tapfile_lines, "BATCH_BYTES", 700)  # many batches, lines across them
    monkeypatch.setattr(parse, "MAX_LINE_BYTES", 3000)
    lines = _mixed_lines(1, 300)
    lines.insert(57, b'{"x": "' + b"y" * 5000 + b'"}')  # over-long, mid-file
    path = _write(tmp_path / "t.jsonl", lines, tail)
    got = list(iter_lines(path))
    want = _lines_one_at_a_time(path)
    assert len(got) == len(want) == len(lines) + (1 if tail else 0)
    for (n, d, problem), (wn, wd, wproblem) in zip(got, want):
        assert (n, d) == (wn, wd)
        if wproblem == "too long":
            # the old reader counted the newline too
            assert problem.startswith("line too long (5010 bytes or more"), problem
        else:
            assert problem == wproblem
    # The batches of records (schema.py Structs) cover the same lines, in
    # order, each the record of the definition.
    seen = []
    for first, items, problems in iter_file_records(path):
        assert [n for n, _, _ in got[first - 1 : first - 1 + len(items)]] == list(
            range(first, first + len(items))
        )
        assert [None if r is None else as_dict(r) for r in items] == [
            d for _, d, _ in got[first - 1 : first - 1 + len(items)]
        ]
        assert set(problems) == {first + i for i, r in enumerate(items) if r is None}
        seen.extend(range(first, first + len(items)))
    assert seen == list(range(1, len(got) + 1))


def _reference_summary(path):
    """``pmaptap summary`` the way it was defined before batches: every
    line through parse_line, what a later attempt superseded left out, each
    record through Summarizer.add."""
    lines = _lines_one_at_a_time(path)
    records = [d for _, d, _ in lines if d is not None]
    bad = [(n, p) for n, d, p in lines if d is None]
    later = index_records(records)
    acc = Summarizer()
    for d in records:
        if not later.superseded(d):
            acc.add(d)
    return acc.summaries(), bad


def _keys_from_scratch(path) -> dict:
    """(run, name) -> (duplicates, incomplete steps, per-device steps) as
    summary defines them, computed here in the plainest way (the summary's
    own keys are bit masks and ints: this checks them): a per-device record
    repeats (step, pass, device, coordinates), a replicated one (step, pass,
    vhash or value, index); a per-device tap's step lacks devices when it has fewer
    distinct (device, coordinates) than its attempt's fullest step."""
    lines = _lines_one_at_a_time(path)
    records = [d for _, d, _ in lines if d is not None]
    later = index_records(records)
    seen: dict = {}
    out: dict = {}
    for r in records:
        if later.superseded(r) or r["kind"] == "meta":
            continue
        tap = (r["run"], r["name"])
        dups, per_step, kinds, attempt_of = out.setdefault(tap, [0, {}, set(), {}])
        kinds.add(r["kind"])
        pass_ = r.get("pass", "forward")
        if r["kind"] == "per_device":
            who = (r["device"], _coords_key(r["coords"]))
            key = (r["step"], pass_, who)
            per_step.setdefault(r["step"], set()).add(who)
            if r.get("attempt"):
                attempt_of[r["step"]] = r["attempt"]
        else:
            # Shards of one value are different values (record_key holds the
            # index, as duplicate_parts does): never each other's copies.
            value = r.get("vhash") or _canonical(r["value"])
            key = (r["step"], pass_, value, str(r.get("index")))
        if (tap, r["kind"], key) in seen:
            out[tap][0] += 1
        seen[(tap, r["kind"], key)] = True
    result = {}
    for tap, (dups, per_step, kinds, attempt_of) in out.items():
        full: dict = {}
        for step, who in per_step.items():
            a = attempt_of.get(step, 0)
            full[a] = max(full.get(a, 0), len(who))
        incomplete = ()
        if kinds == {"per_device"}:
            incomplete = tuple(
                sorted(s for s, who in per_step.items() if len(who) < full[attempt_of.get(s, 0)])
            )
        result[tap] = (dups, incomplete, set(per_step))
    return result


def _job_records(rnd: random.Random) -> list[dict]:
    recs = []
    for s in range(40):
        for d in range(4):
            v = 0.1 * d + s
            if s == 17 and d == 2:
                v = "NaN"
            recs.append(_pd(s, d, v))
            recs.append(_pd(s, d, [1.0, "Infinity", 2.0] if s % 7 == 0 else 2.0, name="arr"))
        recs.append(_rp(s, "Infinity" if s == 23 else 1.0 / (s + 1)))
        recs.append(_rp(s, 0.01, name="lr", run="other-run"))
        # An auto tap: copies differ (per-device records) until step 10.
        if s < 10:
            recs += [_pd(s, d, float(d), name="auto") for d in range(4)]
        else:
            recs.append(_rp(s, 3.0, name="auto"))
    recs.append(_rp(5, 9.0, process=1, vhash="other"))  # a divergence
    recs.append(_pd(3, 1, 0.5))  # a duplicate of an earlier device copy
    recs.append(_rp(4, 0.2))  # a duplicate replicated value
    recs.append(_pd(8, 9, 1.0, coords={"dp": 1.0}))  # float coordinates
    recs.append(_pd(8, 9, 1.0, coords={"dp": 9, "mp": 0}))  # two axes
    recs.append(_pd(9, 1.0, 1.0, coords={"dp": 1}))  # device 1.0: device 1
    recs.append(_pd(9, True, 1.0, coords={"dp": 1}))
    recs.append(_pd(9, 2, 7.0, **{"pass": "backward"}))
    recs.append(_pd(9, 3, 7.0, divergent=True))
    recs.append(_rec(kind="meta", name="pmaptap/dropped", value=3, step=9))
    recs.append(_rp(11, 5.0, name="loss", index=[[0, 2]]))
    recs.append(_rp(12, True, name="flag"))
    recs.append(_rp(12, 2**70, name="big"))
    rnd.shuffle(recs[-14:])
    return recs


def _resumed(recs: list[dict]) -> list[dict]:
    """The same job restarted at step 30: attempt 1 rewrites steps 30-39."""
    again = [dict(r, attempt=1) for r in recs if r.get("step", 0) >= 30 and r["kind"] != "meta"]
    meta = _rec(kind="meta", name="pmaptap/attempt", value=1, attempt=1, step=0)
    return recs + [meta] + again


@pytest.mark.parametrize("resumed", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_summary_fast_path_equals_the_line_at_a_time_summary(tmp_path, monkeypatch, seed, resumed):
    rnd = random.Random(seed)
    recs = _job_records(rnd)
    if resumed:
        recs = _resumed(recs)
    lines = [_line(r) for r in recs]
    for _ in range(12):  # hostile lines in the middle of batches
        lines.insert(rnd.randrange(len(lines)), rnd.choice(HOSTILE))
    tail = rnd.choice([b"", b'{"run": "r", "name": "g", "st'])  # a torn last line
    path = _write(tmp_path / "t.jsonl", lines, tail)
    monkeypatch.setattr(tapfile_lines, "BATCH_BYTES", rnd.choice([300, 2000, 1 << 16]))
    got, bad, names, runs = summarize_file(path)
    want, want_bad = _reference_summary(path)
    assert [dataclasses.asdict(s) for s in got] == [dataclasses.asdict(s) for s in want]
    assert bad == want_bad
    assert summary_table(got) == summary_table(want)
    assert names == {s.name for s in want} and runs == {s.run for s in want}
    scratch = _keys_from_scratch(path)
    for s in got:
        if s.kinds == ("meta",):
            continue
        dups, incomplete, pd_steps = scratch[(s.run, s.name)]
        assert (s.duplicates, s.incomplete_steps) == (dups, incomplete), s.name
        assert pd_steps <= set(range(s.first_step, s.last_step + 1))
    # What the file holds shows up: NaN/inf, divergence, duplicates, restarts.
    by = {(s.run, s.name): s for s in got}
    assert by[("r", "g")].first_nonfinite_step == 17
    assert by[("r", "g")].first_nonfinite_devices == (2,)
    assert by[("r", "loss")].divergent_steps == (5,)
    assert by[("r", "auto")].per_device_steps == tuple(range(10))
    assert by[("r", "g")].duplicates >= 1 and by[("r", "loss")].duplicates >= 1
    assert (by[("r", "g")].restarts != "") == resumed


def test_summary_of_a_file_of_usual_records_takes_the_one_call_path(tmp_path, monkeypatch):
    """The benchmark's shape: every line is a record of the format, decoded
    by the Structs in one call per batch; none takes the definition's path
    (orjson, then the readers' level), and the summary is the reference's."""
    recs = []
    for s in range(50):
        recs.append(_rp(s, 1.0 / (s + 1)))
        recs += [_pd(s, d, 0.5 + d) for d in range(4)]
    path = _write(tmp_path / "t.jsonl", [_line(r) for r in recs])
    calls = {"definition": 0}
    real = parse._by_definition

    def counting(raw):
        calls["definition"] += 1
        return real(raw)

    monkeypatch.setattr(parse, "_by_definition", counting)
    got, bad, _, _ = summarize_file(path)
    assert calls == {"definition": 0}
    want, _ = _reference_summary(path)
    assert got == want and bad == []


def test_without_orjson_every_batch_takes_the_json_path(tmp_path, monkeypatch):
    """PMAPTAP_NO_ORJSON (or no orjson): the same lines, records, problems
    and summary, parsed by json line by line."""
    rnd = random.Random(7)
    lines = [_line(r) for r in _job_records(rnd)]
    for _ in range(6):
        lines.insert(rnd.randrange(len(lines)), rnd.choice(HOSTILE))
    path = _write(tmp_path / "t.jsonl", lines, b'{"torn')

    def gist(problem):  # the parsers word a JSON error each their own way
        return problem if problem is None else problem.split(" (")[0]

    def read_all():
        got = [(n, d, gist(p)) for n, d, p in iter_lines(path)]
        summaries, bad, names, runs = summarize_file(path)
        return got, summaries, [(n, gist(p)) for n, p in bad], names, runs

    with_orjson = read_all()
    monkeypatch.setattr(fmt, "ORJSON", None)
    assert parse._loads(b'{"a": [1, 2.5]}') == ({"a": [1, 2.5]}, None)  # json's
    assert read_all() == with_orjson
