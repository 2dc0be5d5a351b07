"""A differential fuzzer for the batched reading side (issue 15): on files
built from valid records of every kind mixed with hostile lines, the batched
parser, ``pmaptap.read`` (with and without filters), ``pmaptap summary``
(its one-pass fast path and its filtered pass), ``validate`` and the CSV
export give what the line-at-a-time definitions give. Deterministic seeds,
a few seconds in all."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import random

import pytest
from read_definitions import index_records, load_matching, parse_lines
from test_read_batch import _lines_one_at_a_time

from conftest import record_dict
from pmaptap.tapfile.analyze.summary import Summarizer, summarize_file
from pmaptap.tapfile.analyze.table import summary_table
from pmaptap.tapfile.analyze.validate import validate_file
from pmaptap.tapfile.export.csv_rows import write_csv
from pmaptap.tapfile.read import reader
from pmaptap.tapfile.read.divergence import DivergenceIndex
from pmaptap.tapfile.read.query import Filter
from pmaptap.tapfile.record import parse
from pmaptap.tapfile.record.format import decode_record
from pmaptap.tapfile.source import iter_lines
from pmaptap.tapfile.source import lines as tapfile_lines

# Small enough that the fuzzer's over-long lines are cheap to build.
LIMIT = 3000


def _pd(rnd, run, name, step, dev, value, **kw):
    d = record_dict(
        run=run,
        name=name,
        step=step,
        kind="per_device",
        value=value,
        dtype="float32",
        device=dev,
        coords={"dp": dev if isinstance(dev, int) else 0},
        process=(dev // 4) if isinstance(dev, int) else 0,
        time=1.0 + step,
    )
    d.update(kw)
    return d


def _rp(rnd, run, name, step, value, **kw):
    d = record_dict(
        run=run, name=name, step=step, value=value, dtype="float32", replicas=4, time=1.0 + step
    )
    if rnd.random() < 0.8:
        d["vhash"] = f"{step:x}-{name}"
    if rnd.random() < 0.7:
        d["devices"] = [0, 1, 2, 3]
    if rnd.random() < 0.5:
        d["processes"] = [0, 1]
    d.update(kw)
    return d


def _job(rnd: random.Random) -> list[dict]:
    """Valid records of every kind, in a job's order."""
    recs: list[dict] = []
    runs = ["r", "rün-2"] if rnd.random() < 0.5 else ["r"]
    steps = rnd.randrange(8, 30)
    devs = [0, 1, 2, 3] if rnd.random() < 0.7 else [0, 1, 2048, 2049]
    for run in runs:
        for s in range(steps):
            for d in devs:
                v = rnd.choice([0.5 * d + s, s, 2**53 + 1, -3, "NaN", "Infinity", "-Infinity"])
                recs.append(_pd(rnd, run, "g", s, d, v))
                # A sharded value under jit: one record per shard (index).
                recs.append(
                    _pd(
                        rnd,
                        run,
                        "act",
                        s,
                        d,
                        [[1.0, "NaN"], [2.0, 3.5]] if s % 5 == 0 else [[1.0, 2.0], [3.0, 4.0]],
                        coords={"data": d % 2, "model": d // 2 % 2},
                        index=[[2 * (d % 2), 2 * (d % 2) + 2], [0, 2]],
                        dtype="float32",
                        shape=[2, 2],
                    )
                )
            recs.append(_rp(rnd, run, "loss", s, rnd.choice([1.0 / (s + 1), "NaN", 2**70])))
            recs.append(_rp(rnd, run, "λ/grad", s, s * 0.25, **{"pass": "backward"}))
            recs.append(_rp(rnd, run, "vm", s, [1.0, 2.0], batch_dims=1, shape=[2]))
            recs.append(
                _rp(
                    rnd,
                    run,
                    "huge",
                    s,
                    {"min": 0.0, "max": 1.0, "mean": 0.5, "std": 0.1, "nan": 0, "inf": 0},
                    summarized=True,
                )
            )
            if s == steps // 2:
                recs.append(_rp(rnd, run, "loss", s, 7.0, process=1, vhash="other"))
                recs.append(_rp(rnd, run, "loss", s, 7.0, divergent=True, vhash="x"))
                recs.append(
                    record_dict(run=run, name="pmaptap/dropped", kind="meta", step=s, value=3)
                )
            if s < 3:  # an auto tap: per-device until the copies agree
                recs += [_pd(rnd, run, "auto", s, d, float(d)) for d in devs]
            else:
                recs.append(_rp(rnd, run, "auto", s, 3.0))
        recs.append(_pd(rnd, run, "g", 1, None, 1.0, coords={}))  # device unknown
        recs.append(_pd(rnd, run, "g", 2, devs[0], 1.0))  # a duplicate
        recs.append(_pd(rnd, run, "g", 2, 1.0, 1.0))  # device 1.0 is device 1
        recs.append(_pd(rnd, run, "g", 3, 1, 1.0, coords={"dp": 1.0}))
        recs.append(_pd(rnd, run, "g", 3, 1, 1.0, coords={"dp": 1, "mp": 0}))
    if rnd.random() < 0.5:
        recs += _odd_ids(rnd, runs[0], steps)
    if rnd.random() < 0.5:  # restarted at step k: attempt 1 replays the rest
        k = rnd.randrange(1, steps)
        again = [dict(r, attempt=1) for r in recs if r["step"] >= k and r["kind"] != "meta"]
        meta = record_dict(kind="meta", name="pmaptap/attempt", value=1, attempt=1, step=k)
        recs += [meta] + again[: rnd.randrange(len(again) + 1)]
    return recs


def _odd_ids(rnd: random.Random, run: str, steps: int) -> list[dict]:
    """Valid records with ids and steps writers rarely make: equal ids of
    other types (1.0, True), unknown ones (None), text, the extreme steps."""
    ids = [0, 1, 1.0, True, None, "p", 2.5, 2**40]
    out = []
    for _ in range(rnd.randrange(1, 12)):
        step = rnd.choice([0, 1, steps - 1, -5, 2**63 - 1, 2**64 - 1])
        if rnd.random() < 0.5:
            out.append(
                _pd(
                    rnd,
                    run,
                    rnd.choice(["g", "odd"]),
                    step,
                    rnd.choice(ids),
                    rnd.choice([1.5, True, 2**64 - 1, -(2**63)]),
                    process=rnd.choice(ids),
                    coords=rnd.choice([{}, {"dp": 1}, {"dp": True}, {"b": 1, "a": 0}]),
                )
            )
        else:
            out.append(
                _rp(
                    rnd,
                    run,
                    rnd.choice(["loss", "odd"]),
                    step,
                    rnd.choice([1.5, False, 2**64 - 1]),
                    process=rnd.choice(ids),
                    devices=rnd.sample(ids, 3),
                    processes=rnd.sample(ids, 2),
                )
            )
    return out


def _escape_key(line: str, key: str) -> str:
    """The same record with ``key`` spelled with a JSON escape."""
    return line.replace(f'"{key}"', f'"\\u{ord(key[0]):04x}{key[1:]}"', 1)


def _render(rnd: random.Random, r: dict) -> bytes:
    """One valid record as a line, in one of the spellings JSON allows."""
    form = rnd.random()
    if form < 0.6:
        text = json.dumps(r, separators=(",", ":"), ensure_ascii=False)
    elif form < 0.75:
        text = json.dumps(r, ensure_ascii=True)  # \u escapes in values
    elif form < 0.85:
        keys = list(r)
        rnd.shuffle(keys)
        text = json.dumps({k: r[k] for k in keys}, indent=None)
    elif form < 0.95:
        # "attempt" first: a reader that looks for it in the bytes must
        # still find it.
        key = "attempt" if "attempt" in r and rnd.random() < 0.5 else rnd.choice(list(r))
        text = _escape_key(json.dumps(r), key)
    else:  # a duplicate key: the last one wins, in every parser
        text = json.dumps(r)[:-1] + ', "host": "dup"}'
    return text.encode("utf-8")


def _hostile(rnd: random.Random, good: bytes) -> bytes:
    kind = rnd.randrange(16)
    if kind == 0:
        return good[: rnd.randrange(len(good))]  # truncated
    if kind == 1:
        return good.replace(b",", b"\x00", 1)
    if kind == 2:
        return good[:10] + b"\xff\xc3" + good[10:]  # invalid UTF-8
    if kind == 3:
        return b"\xef\xbb\xbf" + good  # a BOM
    if kind == 4:
        return rnd.choice([b"", b"   ", b"\t", b"\r"])
    if kind == 5:
        return good[:-1] + b', "pad": "' + b"x" * (LIMIT + rnd.randrange(-2, 3)) + b'"}'
    if kind == 6:
        n = rnd.choice([127, 128, 129, 200])
        return b'{"v": ' + b"[" * n + b"]" * n + b"}"
    if kind == 7:
        return rnd.choice([b"[1, 2]", b"5", b'"s"', b"null", b"true", b"{}"])
    if kind == 8:
        return good.replace(b'"step":', b'"step":"', 1).replace(b',"kind"', b'","kind"', 1)
    if kind == 9:
        return good.replace(b"0.5", b"NaN", 1) if b"0.5" in good else b"NaN"
    if kind == 10:
        return good[:-1] + b",}"  # trailing comma
    if kind == 11:
        return b'{"a": "\\ud800"}'
    if kind == 12:
        return b'{"step": 1e400, "x": 1' + b"0" * 400 + b"}"
    if kind == 13:
        return good.replace(b'"name"', b'"name\\u0000"', 1)
    if kind == 14:  # unhashable identity fields
        return good.replace(b'"name":', b'"name":["x"],"n":', 1).replace(
            b'"run":', b'"run":{"a":1},"r":', 1
        )
    return good + b" garbage"


def _file_bytes(rnd: random.Random) -> bytes:
    recs = _job(rnd)
    lines = [_render(rnd, r) for r in recs]
    for _ in range(rnd.randrange(0, 25)):
        i = rnd.randrange(len(lines))
        lines.insert(i, _hostile(rnd, lines[i]))
    if rnd.random() < 0.3:  # CRLF line endings (JSON whitespace)
        lines = [x + b"\r" for x in lines]
    data = b"\n".join(lines) + b"\n"
    tail = rnd.random()
    if tail < 0.2:
        data = data[:-1]  # no final newline: a whole last record
    elif tail < 0.4:
        data += lines[-1][: rnd.randrange(1, len(lines[-1]))]  # a torn last line
    return data


def _batch_size(rnd: random.Random, data: bytes) -> int:
    """Batch boundaries anywhere: often exactly at a line end, or a byte
    before or after one."""
    ends = [i for i, b in enumerate(data) if b == 0x0A]
    if ends and rnd.random() < 0.6:
        return max(1, rnd.choice(ends) + rnd.choice([0, 1, 2]))
    return rnd.choice([97, 512, 700, 4096, 1 << 16])


def _dump(x) -> str:
    return json.dumps(x, sort_keys=True, default=repr)


def _reference_records(path) -> tuple[list[tuple[int, dict]], list[tuple[int, str]]]:
    lines = _lines_one_at_a_time(path)
    return [(n, d) for n, d, _ in lines if d is not None], [
        (n, p) for n, d, p in lines if d is None
    ]


def _reference_read(path, flt: Filter | None) -> list[dict]:
    """pmaptap.read, line by line."""
    recs = [d for _, d in _reference_records(path)[0]]
    keyed = [d for d in recs if flt is None or flt.key_match(d)]
    index = DivergenceIndex()
    for d in keyed:
        index.add(d)
    later = index_records(keyed)
    out = []
    for d in keyed:
        if flt is not None and not flt(d):
            continue
        if later.superseded(d) and not (flt is not None and flt.all_attempts):
            continue
        r = decode_record(d)
        if index.divergent(r):
            r["divergent"] = True
        if flt is not None and flt.all_attempts:
            r.setdefault("attempt", 0)
        out.append(r)
    return out


def _reference_summary(path, flt: Filter):
    """``pmaptap summary`` defined record by record: parse_line per line,
    what a later attempt superseded left out, then add or see."""
    recs = [d for _, d in _reference_records(path)[0]]
    later = index_records(recs)
    acc = Summarizer()
    for d in recs:
        if later.superseded(d) and not flt.all_attempts:
            continue
        if flt(d):
            acc.add(d)
        elif flt.key_match(d):
            acc.see(d)
    return acc.summaries()


def _filters(recs: list[dict], rnd: random.Random) -> list[Filter]:
    names = sorted({d["name"] for d in recs})
    runs = sorted({d["run"] for d in recs})
    out = [Filter(), Filter(all_attempts=True)]
    if names:
        out.append(Filter(names=tuple(rnd.sample(names, min(2, len(names))))))
        out.append(Filter(steps=(rnd.randrange(0, 6), rnd.randrange(6, 20)), run=runs[0]))
        out.append(Filter(device=rnd.choice([0, 1, 2048])))
        out.append(Filter(process=1, names=("loss", "g")))
    return out


def _read_kwargs(flt: Filter) -> dict:
    kw: dict = {"attempts": "all" if flt.all_attempts else "latest"}
    if flt.names:
        kw["name"] = list(flt.names)
    if flt.steps != (None, None):
        kw["step"] = flt.steps
    for k in ("run", "device", "process"):
        if getattr(flt, k) is not None:
            kw[k] = getattr(flt, k)
    return kw


SEEDS = int(os.environ.get("PMAPTAP_FUZZ_SEEDS", "10"))


@pytest.mark.parametrize("seed", range(SEEDS))
def test_fuzz_batched_reading_equals_line_at_a_time(tmp_path, monkeypatch, seed):
    rnd = random.Random(1000 + seed)
    data = _file_bytes(rnd)
    path = tmp_path / "t.jsonl"
    path.write_bytes(data)
    monkeypatch.setattr(parse, "MAX_LINE_BYTES", LIMIT)
    monkeypatch.setattr(tapfile_lines, "BATCH_BYTES", _batch_size(rnd, data))

    # 1. parse_lines == parse_line, line by line.
    lines = data.split(b"\n")
    records, problems = parse_lines(lines)
    for i, raw in enumerate(lines):
        d, problem = parse.parse_line(raw)
        assert _dump(records[i]) == _dump(d) and problems.get(i) == problem, raw[:100]

    # 2. The batched reader: every line as the definition.
    want_lines = _lines_one_at_a_time(path)
    got_lines = list(iter_lines(path))
    assert len(got_lines) == len(want_lines) == data.count(b"\n") + (not data.endswith(b"\n"))
    for (n, d, p), (wn, wd, wp) in zip(got_lines, want_lines):
        assert n == wn and _dump(d) == _dump(wd), n
        assert p == wp or wp == "too long" and p.startswith("line too long"), (n, p, wp)

    good, bad = _reference_records(path)
    recs = [d for _, d in good]
    assert recs, "the fuzzer's file holds records"

    for flt in _filters(recs, rnd):
        # 3. pmaptap.read with the filter's arguments.
        got = reader.read(path, **_read_kwargs(flt))
        ref_flt = flt if flt.active or flt.all_attempts else None
        assert _dump(got) == _dump(_reference_read(path, ref_flt)), flt

        # 4. pmaptap summary: the fast path (no filter) or the filtered pass.
        summaries, sbad, names, runs = summarize_file(path, flt)
        want = _reference_summary(path, flt)
        assert _dump([dataclasses.asdict(s) for s in summaries]) == _dump(
            [dataclasses.asdict(s) for s in want]
        ), flt
        assert summary_table(summaries) == summary_table(want)
        assert [n for n, _ in sbad] == [n for n, _ in bad]

        # 5. export --csv: one row per record the filter shows.
        entries, _, _, _ = load_matching(path, flt)
        assert write_csv(entries, io.StringIO()) == len(_reference_read(path, ref_flt))

    # 6. validate: every line that is not a record is reported, every record counted.
    report = validate_file(path)
    assert report.records == len(recs)
    assert {n for n, _ in report.problems} >= {n for n, _ in bad}
    assert report.superseded == sum(map(index_records(recs).superseded, recs))


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\n",
        b"\n\n",
        b"\r\n",
        b"\xef\xbb\xbf",
        b'{"run"',
        b"\x00",
        # JSON that is no record: no batch of the summary holds one record
        b"5\n",
        b"[1, 2]\nnull\n",
        b'"s"',
    ],
    ids=repr,
)
def test_fuzz_degenerate_files(tmp_path, data):
    path = tmp_path / "t.jsonl"
    path.write_bytes(data)
    want = _lines_one_at_a_time(path)
    assert [(n, d, p) for n, d, p in iter_lines(path)] == want
    summaries, bad, names, runs = summarize_file(path)
    assert summaries == [] and names == set() and runs == set()
    assert bad == [(n, p) for n, d, p in want if d is None]
    assert reader.read(path) == []


def test_fuzz_nonfinite_and_big_values_reach_the_summary(tmp_path):
    """Sanity of the fuzzer's own material: a NaN marker and a 2**70
    integer are read as the line-at-a-time path reads them."""
    lines = [
        json.dumps(record_dict(name="x", step=0, value="NaN", replicas=1, vhash="a")),
        json.dumps(record_dict(name="x", step=1, value=2**70, replicas=1, vhash="b")),
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    (s,), _, _, _ = summarize_file(path)
    assert s.nonfinite == 1 and s.first_nonfinite_step == 0
    assert s.max == float(2**70) and not math.isnan(s.max)


def test_an_escaped_attempt_key_supersedes_in_summary_as_in_read(tmp_path):
    """``"\\u0061ttempt"`` is the key ``attempt`` (JSON escapes): attempts.scan
    looked for the bytes ``"attempt"`` only, so ``pmaptap summary`` kept the
    record a later attempt superseded while ``pmaptap.read`` dropped it."""
    lines = [
        json.dumps(record_dict(name="loss", step=s, value=float(s), vhash=str(s))) for s in range(4)
    ]
    later = record_dict(name="loss", step=2, value=99.0, vhash="x", attempt=1)
    lines.append(_escape_key(json.dumps(later), "attempt"))
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert [r["value"] for r in reader.read(path)] == [0.0, 1.0, 3.0, 99.0]
    (s,), bad, _, _ = summarize_file(path)
    assert bad == [] and s.records == 4 and s.max == 99.0
    assert validate_file(path).superseded == 1


def test_summary_fast_path_keeps_the_writers_process_id_first(tmp_path):
    """Equal ids of other types (process ``true``, processes ``[1]``): a set
    keeps the first one added, and ``add`` adds the writer's process before
    ``processes``; the fast path added them the other way round, so
    ``pmaptap summary`` showed process 1 where the line-at-a-time path
    showed True."""
    lines = [
        json.dumps(
            record_dict(name="x", step=s, value=0.5, vhash=str(s), process=True, processes=[1])
        )
        for s in range(3)
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    (got,), _, _, _ = summarize_file(path)
    (want,) = _reference_summary(path, Filter())
    assert [type(p) for p in got.processes] == [type(p) for p in want.processes] == [bool]
