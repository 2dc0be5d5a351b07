"""Streaming readers (issue 27.4): ``pmaptap show``, ``pmaptap validate``,
``read(..., as_frame=True)`` and ``export --csv`` read a file twice (or once)
instead of holding it, and give exactly what their in-memory definitions
give: the definitions are kept here, as they were, and compared on the
fuzzer's files (hostile lines, divergence, duplicates, resumed runs, odd
ids, torn and over-long last lines) and on a file that grows while read."""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import random
from contextlib import redirect_stderr, redirect_stdout

import pytest
from read_definitions import duplicate_key, find_duplicates, index_records, load, load_matching
from test_read_fuzz import LIMIT, SEEDS, _file_bytes, _filters, _read_kwargs, _reference_read

from conftest import per_device_dict, replicated_dict
from pmaptap import cli
from pmaptap.errors import CliError
from pmaptap.tapfile.analyze.validate import Report, schema_problems, validate_file
from pmaptap.tapfile.export.csv_rows import write_csv
from pmaptap.tapfile.read import frame, reader, stream, views
from pmaptap.tapfile.read.query import Filter
from pmaptap.tapfile.record import parse
from pmaptap.tapfile.record.format import COORDS_COLUMN_PREFIX
from pmaptap.tapfile.source import lines as tapfile_lines


def _reference_validate(path) -> Report:
    """``validate_file`` as it was: every record in memory (read_definitions.load)."""
    entries, bad = load(path)
    report = Report(os.fspath(path), records=len(entries))
    report.problems.extend(bad)
    for e in entries:
        for problem in schema_problems(e.raw):
            report.problems.append((e.line, f"schema: {problem}"))
    raws = [e.raw for e in entries]
    for i, j in find_duplicates(raws):
        r = raws[i]
        what = f"{r['kind']} {r['name']!r} step {r['step']}" + (
            f" device {r.get('device')}" if r["kind"] == "per_device" else ""
        )
        report.problems.append((entries[i].line, f"duplicate of line {entries[j].line} ({what})"))
    attempts = index_records(raws)
    report.superseded = sum(map(attempts.superseded, raws)) if attempts else 0
    report.problems.sort()
    report.lines = max([e.line for e in entries] + [n for n, _ in bad] + [0])
    report.divergent_keys = len(
        {
            duplicate_key(e.rec)[1:6]
            for e in entries
            if e.rec.get("divergent") and e.rec.get("kind") == "replicated"
        }
    )
    return report


def _reference_frame(records: list[dict]):
    """``to_frame`` as it was: every row built first, then each column."""
    pd = frame._pandas()
    rows = [frame._row(r) for r in records]
    names: dict[str, None] = dict.fromkeys(frame._FIRST)
    for row in rows:
        names.update(dict.fromkeys(row))
    coords = sorted(k for k in names if k.startswith(COORDS_COLUMN_PREFIX))
    values = [k for k in names if k == "value" or k.startswith("value.")]
    rest = [k for k in names if k not in frame._FIRST and k not in coords and k not in values]
    columns = {}
    for col in (*frame._FIRST, *coords, *values, *rest):
        columns[col] = frame._column(pd, col, [row.get(col) for row in rows])
    return pd.DataFrame(columns, index=pd.RangeIndex(len(rows)))


def _reference_select(path, command: str, flt: Filter) -> list:
    """The commands' ``_select`` as it was: every matching entry in memory."""
    cli._check_file(path)
    picked, bad, names, runs = load_matching(path, flt)
    cli._report_skipped(bad, path, command)
    if not picked:
        cli._no_match(command, path, flt, names, runs)
    return picked


def _reference_show(args: argparse.Namespace) -> None:
    """``cmd_show`` as it was: load_matching holds every matched entry."""
    flt = cli._filter(args)
    entries = _reference_select(args.file, "show", flt)
    if args.limit:
        entries = entries[: args.limit]
    if not entries:
        return
    if args.json:
        for e in entries:
            print(views.json_line(e, attempt=flt.all_attempts))
    else:
        columns = views.COLUMNS_ALL_ATTEMPTS if flt.all_attempts else views.COLUMNS
        if len({e.rec.get("run") for e in entries}) > 1:
            columns = views.with_run(columns)  # rows of several runs say which
        table = views.Table(columns)
        rows = [views.row(e, args.width) for e in entries]
        table.fit(rows)
        print(table.header())
        for r in rows:
            print(table.format(r))


def _run(fn, *a) -> tuple[str, str, str | None]:
    out, err = io.StringIO(), io.StringIO()
    raised = None
    with redirect_stdout(out), redirect_stderr(err):
        try:
            fn(*a)
        except CliError as e:
            raised = str(e)
    return out.getvalue(), err.getvalue(), raised


def _show_argv(path, flt: Filter, *, json_mode: bool, limit: int, width: int) -> list[str]:
    argv = ["show", str(path), "--limit", str(limit), "--width", str(width)]
    argv += _filter_argv(flt)
    if json_mode:
        argv.append("--json")
    return argv


def _reference_export_csv(args: argparse.Namespace) -> None:
    """``export --csv -`` as it was: load_matching holds every entry."""
    import sys

    entries = _reference_select(args.file, "export", cli._filter(args))
    n = write_csv(entries, sys.stdout)
    print(f"wrote {n} rows to {args.csv}", file=sys.stderr)


def _filter_argv(flt: Filter) -> list[str]:
    argv: list[str] = []
    for n in flt.names:
        argv += ["--name", n]
    lo, hi = flt.steps
    if (lo, hi) != (None, None):
        argv += ["--step", f"{'' if lo is None else lo}:{'' if hi is None else hi}"]
    for k in ("run", "device", "process"):
        if getattr(flt, k) is not None:
            argv += [f"--{k}", str(getattr(flt, k))]
    if flt.all_attempts:
        argv.append("--all-attempts")
    return argv


def _dump(x) -> str:
    return json.dumps(x, sort_keys=True, default=repr)


def _frames_equal(got, want) -> None:
    assert list(got.columns) == list(want.columns)
    assert [str(t) for t in got.dtypes] == [str(t) for t in want.dtypes]
    assert _dump(got.to_dict("list")) == _dump(want.to_dict("list"))


@pytest.mark.parametrize("seed", range(SEEDS))
def test_streaming_readers_equal_their_in_memory_definitions(tmp_path, monkeypatch, seed):
    rnd = random.Random(2000 + seed)
    data = _file_bytes(rnd)
    path = tmp_path / "t.jsonl"
    path.write_bytes(data)
    monkeypatch.setattr(parse, "MAX_LINE_BYTES", LIMIT)
    monkeypatch.setattr(tapfile_lines, "BATCH_BYTES", rnd.choice([97, 700, 4096, 1 << 16]))
    # The second pass reads the file again, or walks the matches the first
    # pass kept (all, or some before it gave up keeping).
    monkeypatch.setattr(stream, "KEEP_RECORDS", [0, 5, 100_000][seed % 3])

    assert dataclasses.asdict(validate_file(path)) == dataclasses.asdict(_reference_validate(path))

    recs = [d for _, d, _ in tapfile_lines.iter_lines(path) if d is not None]
    parser = cli.build_parser()
    for flt in _filters(recs, rnd) + [Filter(names=("nope",)), Filter(run="nope")]:
        for json_mode in (False, True):
            limit = rnd.choice([0, 0, 1, 7])
            argv = _show_argv(
                path, flt, json_mode=json_mode, limit=limit, width=rnd.choice([60, 12])
            )
            got = _run(cli.main, argv)
            want = _run(_reference_show, parser.parse_args(argv))
            # main() prints a CliError as "pmaptap show: error: ..." and
            # returns 2; the definition raises it.
            if want[2] is not None:
                assert got[1].endswith(f"error: {want[2]}\n"), (argv, got[1])
                assert got[0] == want[0]
            else:
                assert got[:2] == want[:2], argv
        # export --csv streams (two passes over the entries, no row held)
        # what it wrote from the entries load_matching held.
        fp = stream.first_pass(path, flt)
        a, b = io.StringIO(), io.StringIO()
        assert write_csv(lambda: views.iter_entries(path, flt, fp), a) == write_csv(
            load_matching(path, flt)[0], b
        )
        assert a.getvalue() == b.getvalue()
        csv_argv = ["export", str(path), "--csv", "-", *_filter_argv(flt)]
        got = _run(cli.main, csv_argv)
        want = _run(_reference_export_csv, parser.parse_args(csv_argv))
        if want[2] is not None:
            assert got[1].endswith(f"error: {want[2]}\n") and got[0] == want[0], csv_argv
        else:
            assert got[:2] == want[:2], csv_argv
        # read(..., as_frame=True): built while streaming, the frame of the
        # list read() returns.
        pytest.importorskip("pandas")
        ref_flt = flt if flt.active or flt.all_attempts else None
        kw = _read_kwargs(flt)
        try:
            want = _reference_frame(_reference_read(path, ref_flt))
        except (OverflowError, ValueError):
            # An int column past int64, a time past pandas' datetimes (the
            # fuzzer's extreme ids and times): the definition fails, and so
            # must the streamed frame (which of the columns fails first
            # follows the order they are converted in).
            with pytest.raises((OverflowError, ValueError)):
                reader.read(path, as_frame=True, **kw)
            continue
        _frames_equal(reader.read(path, as_frame=True, **kw), want)


def test_show_of_a_file_growing_between_its_passes_shows_what_it_indexed(tmp_path, monkeypatch):
    """A second pass stops at the first pass's last line: a record appended
    meanwhile (here: a divergent copy of a shown key) is neither shown nor
    half-judged; a torn last line completed meanwhile is not shown either."""
    path = tmp_path / "g.jsonl"
    lines = [json.dumps(replicated_dict(s, 1.0 * s, "loss", vhash=f"h{s}")) for s in range(3)]
    torn = json.dumps(per_device_dict(3, 0, 2.0, "g"))
    path.write_text("\n".join(lines) + "\n" + torn[:20])
    real = stream.first_pass

    def first_then_append(p, flt):
        fp = real(p, flt)
        with open(path, "a") as f:
            f.write(torn[20:] + "\n")
            f.write(json.dumps(replicated_dict(1, 9.0, "loss", vhash="other", process=1)) + "\n")
        return fp

    monkeypatch.setattr(stream, "first_pass", first_then_append)
    monkeypatch.setattr(stream, "KEEP_RECORDS", 0)  # the second pass reads the file
    out, err, raised = _run(cli.main, ["show", str(path), "--json"])
    assert raised is None
    got = [json.loads(x) for x in out.splitlines()]
    assert [(r["name"], r["step"]) for r in got] == [("loss", 0), ("loss", 1), ("loss", 2)]
    assert not any(r.get("divergent") for r in got)
    assert "torn last line" in err


@pytest.mark.parametrize("resumed", [False, True])
@pytest.mark.parametrize("big", [False, True])
def test_streamed_frame_of_a_job_equals_the_definition(tmp_path, monkeypatch, resumed, big):
    """A job's file (NaN/inf, arrays, divergence, duplicates, odd ids, a
    backward pass, a shard index, a restart): the frame that
    ``read(as_frame=True)`` builds while streaming is the definition's, and
    fails alike where the definition does (an int past int64)."""
    pytest.importorskip("pandas")
    from test_read_batch import _job_records, _line, _resumed

    recs = _job_records(random.Random(7))
    if not big:
        recs = [r for r in recs if r["name"] != "big"]
    if resumed:
        recs = _resumed(recs)
    path = tmp_path / "job.jsonl"
    path.write_bytes(b"".join(_line(r) + b"\n" for r in recs))
    monkeypatch.setattr(frame, "_MAX_CODES", 3)  # text columns switch to plain cells
    monkeypatch.setattr(stream, "KEEP_RECORDS", 0 if resumed else 100_000)
    for kw in ({}, {"attempts": "all"}, {"name": ["g", "loss"]}, {"device": 2}):
        ref_flt = Filter(all_attempts=True) if kw.get("attempts") == "all" else None
        if "name" in kw:
            ref_flt = Filter(names=tuple(kw["name"]))
        if "device" in kw:
            ref_flt = Filter(device=kw["device"])
        try:
            want = _reference_frame(_reference_read(path, ref_flt))
        except OverflowError:
            assert big
            with pytest.raises(OverflowError):
                reader.read(path, as_frame=True, **kw)
            continue
        got = reader.read(path, as_frame=True, **kw)
        _frames_equal(got, want)
    assert big or len(got) > 0


def test_frame_builder_cells_equal_the_plain_cells():
    """Every way a column's compact cells can change form (ints widening
    past 8, 16 and 32 bits and past int64, None first, ints then floats,
    bools, long and many distinct texts, lists shared or not) gives the
    frame that the plain cells give."""
    pd = pytest.importorskip("pandas")
    rows = []
    for i in range(40):
        rows.append(
            {
                "run": "r",
                "name": f"n{i % 3}",
                "step": [0, 100, 40_000, 3_000_000_000, -5][i % 5] + i,
                "kind": "replicated" if i % 2 else "per_device",
                "process": None if i < 3 else i % 2,
                "time": 1.8e9 + i if i % 4 else 1_800_000_000 + i,
                "value": [1, 2.5, None, True, "NaN"][i % 5] if i > 20 else i,
                "dtype": "x" * (70 if i == 5 else 3),
                "shape": [] if i % 3 else [2, i],
                "devices": [0, 1] if i % 2 else None,
                "vhash": f"{i:016x}",
                "extra": [1, [2]] if i == 30 else None,
                # past int64 (then a text cell: the definition's column
                # holds objects)
                "big": 2**63 if i == 35 else "s" if i == 36 else i,
            }
        )
    want = _reference_frame(rows)
    builder = frame.FrameBuilder()
    for r in rows:
        builder.add(r)
    _frames_equal(builder.frame(), want)
    # The shared lists hold what the records held.
    assert want["shape"].tolist() == [r["shape"] for r in rows]
    assert isinstance(pd.DataFrame, type)


def _reference_plot(args: argparse.Namespace) -> None:
    """``cmd_plot`` as it was: every record of the file in memory."""
    from pmaptap.tapfile.export.plot import PlotError, plot_tap

    flt = cli._filter(args)
    flt.names = ()
    recs = [e.rec for e in _reference_select(args.file, "plot", flt)]
    try:
        plot_tap(recs, args.name[0], args.output, logy=args.logy, smooth=args.smooth)
    except PlotError as e:
        raise CliError(str(e)) from None


@pytest.mark.parametrize("name", ["loss", "g", "nope"])
def test_streamed_plot_draws_what_the_whole_file_drew(tmp_path, name):
    """``plot`` keeps the plotted tap's records and one of each other tap
    (for the list of what the file holds), and draws the same PNG."""
    pytest.importorskip("matplotlib")
    from test_read_batch import _job_records, _line, _resumed

    path = tmp_path / "job.jsonl"
    recs = _resumed([r for r in _job_records(random.Random(3)) if r["name"] != "big"])
    path.write_bytes(b"".join(_line(r) + b"\n" for r in recs))
    got_png, want_png = tmp_path / "got.png", tmp_path / "want.png"
    argv = ["plot", str(path), "--name", name, "--step", "2:35"]
    got = _run(cli.main, [*argv, "-o", str(got_png)])
    want = _run(_reference_plot, cli.build_parser().parse_args([*argv, "-o", str(want_png)]))
    if name == "nope":
        assert not got_png.exists() and "no records named 'nope'" in got[1], got
        assert want[2] is not None and got[1].endswith(f"error: {want[2]}\n")
        return
    assert want[2] is None and got[0] == want[0], (got, want)
    assert got_png.read_bytes() == want_png.read_bytes()
