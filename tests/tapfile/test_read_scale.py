"""Reading sharded runs of any size (issue 29): open files and memory that do
not depend on the shard count, the same answers as the definition of the
merge (every line of every shard by time, then process, then line; the first
copy of a replicated value kept), which benchmarks/bench_read_scale.py
writes as one file."""

from __future__ import annotations

import json
import os

import pytest

import pmaptap
from conftest import logs_warning, record_dict, run_python, shard_record

# A child reading tmp's run.jsonl (and ref.jsonl, bad.jsonl) under an
# open-file limit; ``cli(...)`` runs the pmaptap command in it.
_CHILD_START = """
import contextlib, io, json, os, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {limit}))
import pmaptap
from pmaptap.cli import main
from pmaptap.tapfile.read import follower as follow

tmp = {tmp!r}
run, ref, bad = tmp + "/run.jsonl", tmp + "/ref.jsonl", tmp + "/bad.jsonl"

def cli(*args):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(list(args))
    return code, out.getvalue()

got = {{}}
"""

_CHILD = """
got["read_equal"] = pmaptap.read(run) == pmaptap.read(ref)
got["records"] = len(pmaptap.read(run))
for name, args in (
    ("summary", ["summary"]),
    ("validate", ["validate"]),
    ("show", ["show", "--name", "loss"]),
    ("show_json", ["show", "--name", "grad_norm", "--step", "1", "--json"]),
):
    a = cli(*args[:1], run, *args[1:])
    b = cli(*args[:1], ref, *args[1:])
    got[name] = [a[0], a[1].replace(run, "RUN"), b[0], b[1].replace(ref, "RUN")]
got["bad_validate"] = cli("validate", bad)
got["bad_read"] = len(pmaptap.read(bad))
# The peak of this process's own memory (VmHWM: ru_maxrss would count the
# pages of the test process it was forked from).
hwm = [x for x in open("/proc/self/status") if x.startswith("VmHWM:")][0]
got["rss_mib"] = int(hwm.split()[1]) / 1024
print(json.dumps(got))
"""


def test_4096_shards_read_under_a_256_open_file_limit(tmp_path):
    """Every reader of a 4,096-shard run works with 256 open files allowed,
    gives the answers of the same run written as one file in merge order,
    and stays under 300 MiB (before: [Errno 24] Too many open files, every
    shard open at once)."""
    # The runs are built in another process: the peak RSS measured is the
    # readers'.
    run_python(
        f"""
        from benchmarks.bench_read_scale import generate, reference
        tmp = {str(tmp_path)!r}
        generate(tmp + "/run.jsonl", 4096, 3)
        generate(tmp + "/bad.jsonl", 4096, 3, bad=True)
        reference(tmp + "/ref.jsonl", 4096, 3)
        """,
        timeout=600,
    )
    proc = run_python((_CHILD_START + _CHILD).format(tmp=str(tmp_path), limit=256), timeout=600)
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["read_equal"] and got["records"] == 4096 * 3 + 4, got["records"]
    for name in ("summary", "validate", "show", "show_json"):
        code, text, ref_code, ref_text = got[name]
        assert (code, text) == (ref_code, ref_text), name
        assert code == 0 and text, name
    assert "12292 records" in got["validate"][1]
    assert "divergent" in got["summary"][1]
    # The show of one step has every process's record, in merge order.
    rows = [json.loads(x) for x in got["show_json"][1].splitlines()]
    assert [r["process"] for r in rows] == sorted(range(4096), key=lambda p: (p % 13, p))
    # Bad lines cost only themselves, named by shard and line.
    code, text = got["bad_validate"]
    assert code == 1, text
    assert "p00017.jsonl line 4" in text and "not valid JSON" in text, text
    assert "p04095.jsonl line 7" in text and "torn last line" in text, text
    assert got["bad_read"] == got["records"]
    assert got["rss_mib"] <= 300, got["rss_mib"]


@pytest.mark.parametrize("piece", [1, 700])
def test_merge_cut_into_tiny_pieces_reads_the_same(tmp_path, monkeypatch, caplog, piece):
    """Reads and pieces of one line (and of a few) re-open each shard at the
    offset the last read ended: the merge, the torn last line and the
    garbage line come out as with whole files."""
    from conftest import ROOT

    monkeypatch.syspath_prepend(ROOT)
    import pmaptap
    from benchmarks.bench_read_scale import generate, reference
    from pmaptap.tapfile.source import lines
    from pmaptap.tapfile.source import run as runs

    run, ref, bad = (str(tmp_path / n) for n in ("run.jsonl", "ref.jsonl", "bad.jsonl"))
    generate(run, 40, 12)
    generate(bad, 40, 12, bad=True)
    reference(ref, 40, 12)
    whole = pmaptap.read(ref)
    bad_whole = list(lines.iter_lines(bad))
    for bound in ("MIN_PIECE_BYTES", "MAX_PIECE_BYTES", "MIN_READ_BYTES", "MAX_READ_BYTES"):
        monkeypatch.setattr(runs, bound, piece)
    assert pmaptap.read(run) == whole
    cut = list(lines.iter_lines(bad))
    assert cut == bad_whole
    problems = [(n, why) for n, d, why in cut if d is None]
    assert len(problems) == 2 and "p00017.jsonl line 13" in problems[0][1], problems
    assert "torn last line" in problems[1][1] and "p00039.jsonl line 25" in problems[1][1]


def test_shard_writes_look_up_no_path_per_batch(tmp_path, monkeypatch):
    """A batch of the sharded layout costs an fstat of the open shard, not a
    stat of its path (a metadata round trip on NFS/Lustre): 50 batches, no
    path looked up (before: one per batch)."""
    import os

    from pmaptap._host.sinks import DirectorySink

    path = str(tmp_path / "run.jsonl")
    sink = DirectorySink(path, process=3)
    looked: list = []
    stat = os.stat

    def counting_stat(p, *a, **kw):
        looked.append(os.fspath(p))
        return stat(p, *a, **kw)

    monkeypatch.setattr(os, "stat", counting_stat)
    for step in range(50):
        sink.write([shard_record(step)])
    monkeypatch.undo()
    sink.close()
    assert sink.path not in looked, len(looked)
    assert [r["step"] for r in pmaptap.read(path)] == list(range(50))


def test_a_rotated_shard_moves_its_writer_within_the_path_check(tmp_path, monkeypatch, caplog):
    """A shard renamed away (log rotation) is seen by the stat of its path
    made every PATH_CHECK_S: the writer moves to a new file at the path, and
    the records written before and after are all read."""
    import os
    import time

    from pmaptap._host.sinks import directory as dirsink

    monkeypatch.setattr(dirsink, "PATH_CHECK_S", 0.2)
    path = str(tmp_path / "run.jsonl")
    sink = dirsink.DirectorySink(path, process=3)
    sink.write([shard_record(0)])
    os.rename(sink.path, sink.path + ".1")
    time.sleep(0.3)
    with logs_warning(caplog, "replaced or removed"):
        sink.write([shard_record(1)])
    sink.close()
    assert sink.replacements == 1
    assert [r["step"] for r in pmaptap.read(path)] == [1]
    assert [r["step"] for r in pmaptap.read(sink.path + ".1")] == [0]


def test_a_replicated_record_of_4096_processes_stays_small(tmp_path):
    """The holders of a value verified by 4,096 processes x 8 devices are
    written as ranges text: the line stays under 1 KB (a list was ~180 KB),
    every reader takes it (read gives the lists, filters match a holder,
    summary names them, validate is clean) and the owner alone writes it."""
    import subprocess
    import sys

    from conftest import ROOT
    from pmaptap._host.sinks import DirectorySink
    from pmaptap.tapfile.record import parse
    from pmaptap.tapfile.record.format import Record

    procs, devs = tuple(range(4096)), tuple(range(4096 * 8))
    path = str(tmp_path / "run.jsonl")

    def rec(process, step, value=0.5):
        return Record(
            run="r",
            name="loss",
            step=step,
            kind="replicated",
            value=value,
            dtype="float32",
            shape=[],
            process=process,
            time=float(step),
            host=f"h{process}",
            replicas=len(devs),
            devices=devs,
            processes=procs,
            vhash=f"{step:016x}",
        )

    line = rec(0, 0).encode()
    assert len(line) < 1024, len(line)
    assert b'"processes":"0-4095"' in line and b'"devices":"0-32767"' in line
    d, problem = parse.parse_line(line.rstrip(b"\n"))
    assert problem is None and d["processes"] == "0-4095"
    # 8 of the 4,096 processes write their shards; each record has one owner.
    written = 0
    for p in range(8):
        sink = DirectorySink(path, process=p)
        sink.write([rec(p, s) for s in range(64)])
        written += sink.lines_written
        sink.close()
    recs = pmaptap.read(path)
    assert len(recs) == written and 0 < written < 64, written
    assert recs[0]["processes"] == list(procs) and recs[0]["devices"] == list(devs)
    assert len(pmaptap.read(path, process=4000)) == written
    assert len(pmaptap.read(path, device=30000)) == written
    assert pmaptap.read(path, device=40000) == []

    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "pmaptap", *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
        )

    v = cli("validate", path)
    assert v.returncode == 0 and f"OK, {written} records" in v.stdout, v
    s = cli("summary", path)
    assert "0-4095" in s.stdout and "0-32767" in s.stdout, s.stdout
    show = cli("show", path, "--process", "17")
    assert show.returncode == 0 and "0-32767" in show.stdout, show.stdout


def test_holders_ranges_text_is_strict(tmp_path):
    """Ranges text is taken only in its one form (ascending, disjoint,
    decimal without leading zeros); anything else costs only its line,
    named as a bad ``processes``/``devices``, in parse_line and in the
    batch parser alike."""
    import orjson
    from read_definitions import parse_lines

    from pmaptap.tapfile.record import holder_ids, holders_field, parse

    base = {
        "run": "r",
        "name": "x",
        "step": 0,
        "kind": "replicated",
        "value": 1.0,
        "dtype": "float32",
        "shape": [],
        "process": 0,
        "time": 1.0,
        "host": "h",
        "replicas": 1,
        "vhash": "0",
    }
    good = ["0", "0-3", "0-3,5", "7,9-4095", "0-32767"]
    bad = ["", "3-1", "1,1", "2,1", "01", "a", "1-", "-1", "0-3,3", " 1", "1.5", "1" * 25]
    bad += ["0-9999999999999999", "0-1048576"]  # more ids than a reader expands
    lines = []
    for field in ("processes", "devices"):
        for text in good + bad:
            lines.append(orjson.dumps({**base, field: text}))
    one = [parse.parse_line(x) for x in lines]
    records, problems = parse_lines(list(lines))
    assert [d for d, _ in one] == records
    assert {i: p for i, (_, p) in enumerate(one) if p} == problems
    n = len(good) + len(bad)
    for k, field in enumerate(("processes", "devices")):
        for i, text in enumerate(good + bad):
            d, problem = one[k * n + i]
            if text in good:
                assert problem is None, (field, text, problem)
            else:
                assert problem is not None and field in problem, (field, text, problem)
    assert holders_field(tuple(range(17))) == "0-16"
    assert holders_field(tuple(range(16))) == list(range(16))  # small: the list
    assert holders_field((0, 1, *range(5, 40), 50)) == "0-1,5-39,50"
    assert holders_field(tuple(range(20, 0, -1))) == list(range(20, 0, -1))  # not ascending
    assert holder_ids("0-1,5-7,50") == [0, 1, 5, 6, 7, 50]


def test_hostile_holders_cost_only_their_line_under_a_memory_limit(tmp_path):
    """100 lines naming 2**20 holders each (``"0-1048575"``, the most a
    ranges text may name) are read by every reader in a process whose
    address space is capped at 1 GiB more than it holds after its imports:
    ``read()`` gives each record's holders as one shared ``Holders``, never
    a list per record (before: 100 lists of 2**20 ints, ~8 GB)."""
    path = tmp_path / "hostile.jsonl"
    n = 1 << 20
    lines = [
        json.dumps(
            record_dict(
                name="loss",
                step=s,
                vhash=f"{s:x}",
                replicas=n,
                devices=f"0-{n - 1}",
                processes=f"0-{n - 1}",
                time=1.0 + s,
            )
        )
        for s in range(100)
    ]
    path.write_text("\n".join(lines) + "\n")
    proc = run_python(
        f"""
        import contextlib, io, json, resource
        import pmaptap
        from pmaptap.cli import main
        from pmaptap.tapfile import analyze, record  # all imported first

        size = [x for x in open("/proc/self/status") if x.startswith("VmSize:")][0]
        cap = int(size.split()[1]) * 1024 + (1 << 30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        path = {str(path)!r}
        recs = pmaptap.read(path)
        got = {{
            "records": len(recs),
            "shared": all(r["devices"] is recs[0]["devices"] for r in recs),
            "holders": [len(recs[0]["devices"]), {n - 1} in recs[0]["processes"]],
        }}
        commands = (["summary"], ["validate"], ["show", "--process", "7"], ["export", "--csv", "-"])
        for cmd in commands:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                code = main([cmd[0], path, *cmd[1:]])
            got[cmd[0]] = [code, len(out.getvalue().splitlines())]
        print(json.dumps(got))
        """,
        timeout=300,
    )
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["records"] == 100 and got["shared"], got
    assert got["holders"] == [n, True], got
    assert got["summary"][0] == 0 and got["validate"] == [0, 1], got
    assert got["show"] == [0, 101] and got["export"] == [0, 101], got


def test_following_a_quiet_shard_directory_does_not_list_it(tmp_path, monkeypatch):
    """tail -f / merge -f of a local sharded run list path.d/ only when it
    changed (its mtime; anyway while it changed in the last second): quiet
    polls of a run's shards cost a stat of the directory, not a listing of
    every shard; a shard created later is still found at the next poll."""
    import json
    import os

    from pmaptap._host.sinks import DirectorySink
    from pmaptap.tapfile.read import follower as follow

    path = str(tmp_path / "run.jsonl")
    for p in range(2):
        sink = DirectorySink(path, process=p)
        sink.write([shard_record(0, p)])
        sink.close()
    old = os.stat(path + ".d").st_mtime - 60
    os.utime(path + ".d", (old, old))
    listed = []
    listdir = os.listdir
    monkeypatch.setattr(os, "listdir", lambda d: listed.append(d) or listdir(d))
    f = follow.RunFollower(path)

    def procs():
        return sorted(json.loads(raw)["process"] for _, raw in f.poll())

    assert procs() == [0, 1] and len(listed) == 1
    for _ in range(3):
        assert procs() == []
    assert len(listed) == 1
    sink = DirectorySink(path, process=2)
    sink.write([shard_record(0, 2)])
    sink.close()
    assert procs() == [2] and len(listed) == 2
    f.close()


def _run_and_reference(tmp_path, shards: int, steps: int) -> None:
    """tmp_path/run.jsonl, a generated run of ``shards`` shards, and
    ref.jsonl, the same run as one file in merge order; built in another
    process so that a reader's peak memory measured later is its own."""
    run_python(
        f"""
        from benchmarks.bench_read_scale import generate, reference
        tmp = {str(tmp_path)!r}
        generate(tmp + "/run.jsonl", {shards}, {steps})
        reference(tmp + "/ref.jsonl", {shards}, {steps})
        """,
        timeout=600,
    )


_FOLLOW_CHILD = """
got["tail"] = [cli("tail", p, "-n", "7", "--json") for p in (run, ref)]
f = follow.RunFollower(run)
got["first"] = sum(1 for _ in f.poll())
for shard in ("p00350", "p00007"):
    # Each shard's own per-device line of step 0, written again.
    line = open(run + ".d/" + shard + ".jsonl", "rb").readlines()[1]
    with open(run + ".d/" + shard + ".jsonl", "ab") as out:
        out.write(line)
got["appended"] = [json.loads(raw)["process"] for _, raw in f.poll()]
# A shard replaced under the follower (a new inode) is read from its start.
data = open(run + ".d/p00009.jsonl", "rb").read()
with open(run + ".d/new", "wb") as out:
    out.write(data)
os.replace(run + ".d/new", run + ".d/p00009.jsonl")
got["replaced"] = [json.loads(raw)["process"] for _, raw in f.poll()]
got["restarted"] = f.restarted
got["open_fds"] = len(os.listdir("/proc/self/fd"))
f.close()
print(json.dumps(got))
"""


def test_following_400_shards_under_a_64_open_file_limit(tmp_path):
    """tail and a follower of a run of 400 shards work with 64 open files
    allowed: a follower opens a shard only while it reads it (before: every
    shard stayed open between polls, [Errno 24] past the limit). Appended
    lines are found where the last poll left each shard; a replaced shard
    is read again from its start."""
    _run_and_reference(tmp_path, 400, 2)
    proc = run_python(
        (_CHILD_START + _FOLLOW_CHILD).format(tmp=str(tmp_path), limit=64), timeout=600
    )
    got = json.loads(proc.stdout.splitlines()[-1])
    (code, text), (ref_code, ref_text) = got["tail"]
    assert code == ref_code == 0
    assert text == ref_text and len(text.splitlines()) == 7, text
    # Every line of every shard (replicated copies of other processes
    # dropped: 400 x 2 per-device, the loss of each step once, and the
    # divergent copy).
    assert got["first"] == 400 * 2 + 2 + 1, got["first"]
    assert got["appended"] == [7, 350], got["appended"]  # by time
    assert got["replaced"] == [9, 9] and got["restarted"] == 1, got
    assert got["open_fds"] < 10, got["open_fds"]


def test_tail_of_a_large_sharded_run_holds_a_chunk_of_each_shard(tmp_path):
    """The first poll of a follower (``pmaptap tail``, ``merge -f``) merges
    the shards a chunk of each at a time: tail of a 64-shard, ~100 MB run
    with a 4 MiB bound stays far below the run's size (before: every line
    of the run held at once, ~125 MiB peak) and prints what the same run
    written as one file prints."""
    _run_and_reference(tmp_path, 64, 3500)
    child = f"""
import contextlib, io, json
from pmaptap.cli import main
from pmaptap.tapfile.read import follower as follow
follow.FIRST_POLL_BYTES = 4 << 20  # a 4 MiB bound, on a run 24x that
tmp = {str(tmp_path)!r}
got = []
for path in (tmp + "/run.jsonl", tmp + "/ref.jsonl"):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["tail", path, "-n", "20", "--json"])
    hwm = [x for x in open("/proc/self/status") if x.startswith("VmHWM:")][0]
    got.append([code, out.getvalue(), int(hwm.split()[1]) / 1024])
print(json.dumps(got))
"""
    proc = run_python(child, timeout=600)
    (code, text, rss), (ref_code, ref_text, _) = json.loads(proc.stdout.splitlines()[-1])
    assert code == ref_code == 0
    assert text == ref_text and len(text.splitlines()) == 20
    size = sum(f.stat().st_size for f in (tmp_path / "run.jsonl.d").iterdir())
    assert size > 90e6, size
    assert rss < 75, rss


def _merge_definition(shards: list[list[dict]]) -> list[dict]:
    """The merge's definition: every line by its shard's running largest
    time, then shard, then line; a replicated value another shard gave
    earlier in that order left out."""
    from pmaptap.tapfile.record import record_key

    rows = []
    for i, recs in enumerate(shards):
        t = float("-inf")
        for n, d in enumerate(recs):
            t = max(t, d["time"])
            rows.append((t, i, n, d))
    rows.sort(key=lambda x: x[:3])
    first: dict = {}
    out = []
    for *_, d in rows:
        if d["kind"] == "replicated":
            key = (record_key(d), d["vhash"])
            if first.setdefault(key, d["process"]) != d["process"]:
                continue
        out.append(d)
    return out


def _shard_record(process: int, n: int, time: float, replicated: bool) -> dict:
    common = {"value": 1.0, "dtype": "float32", "process": process, "time": time}
    if replicated:
        return record_dict(name="loss", vhash="00" * 7 + "aa", **common)
    return record_dict(
        name=f"g{process}_{n}", kind="per_device", device=process, coords={}, **common
    )


@pytest.mark.parametrize(
    "times",
    [
        # Equal keys in two shards: by shard (before, read() gave them in the
        # order the shards' first keys came).
        [[5, 6, 8], [3, 6, 9]],
        # A copy read early in one shard but later in merged order: the
        # earlier one in merged order is kept (before, by the follower: the
        # one its merge pulled first).
        [[1, "R100"], [40, "R50"]],
        # A dropped copy's time still moves its shard's running time.
        [["R5", 15], ["R20", 8]],
    ],
    ids=["ties", "copy-order", "copy-time"],
)
def test_read_and_a_followers_first_poll_follow_the_merge_definition(tmp_path, times):
    import random

    from pmaptap.tapfile.read import follower as follow
    from pmaptap.tapfile.source import lines
    from pmaptap.tapfile.source import run as runs

    def build(path, spec) -> list[list[dict]]:
        os.makedirs(path + ".d")
        shards = []
        for p, ts in enumerate(spec):
            recs = [
                _shard_record(p, n, float(str(t).lstrip("R")), str(t).startswith("R"))
                for n, t in enumerate(ts)
            ]
            with open(runs.shard_path(path, p), "w") as f:
                f.writelines(json.dumps(d) + "\n" for d in recs)
            shards.append(recs)
        return shards

    rnd = random.Random(len(str(times)))
    cases = [times] + [
        [
            [("R" if rnd.random() < 0.3 else "") + str(rnd.randint(0, 6)) for _ in range(5)]
            for _ in range(rnd.randint(2, 4))
        ]
        for _ in range(40)
    ]
    for k, spec in enumerate(cases):
        path = str(tmp_path / f"run{k}.jsonl")
        want = [(d["name"], d["process"], d["time"]) for d in _merge_definition(build(path, spec))]
        merged = [
            (d["name"], d["process"], d["time"])
            for _, recs, _ in runs.iter_merged(path, lines.read_at)
            for d in recs
        ]
        first_poll = [
            (d["name"], d["process"], d["time"])
            for _, raw in follow.RunFollower(path).poll()
            for d in [json.loads(raw)]
        ]
        assert merged == want, spec
        assert first_poll == want, spec


def test_summary_and_validate_of_a_sharded_run_assume_no_restart_and_read_again_when_wrong(
    tmp_path,
):
    """summary and validate of a sharded run read it once, assuming no
    later attempt (no scan of the attempts first), and start again with
    the scan at a record of one: the same result as the scan-first pass on
    random runs, resumed ones (records with attempts 1, 2) included."""
    import math
    import random

    from test_jobs import _write_run

    from pmaptap.tapfile.analyze import summary
    from pmaptap.tapfile.analyze import validate as checks
    from pmaptap.tapfile.read.attempts import scan
    from pmaptap.tapfile.read.query import Filter

    def same(a, b) -> bool:  # NaN statistics compare equal to themselves
        return json.dumps(a, default=repr, sort_keys=True) == json.dumps(
            b, default=repr, sort_keys=True
        ) or (isinstance(a, float) and math.isnan(a) and math.isnan(b))

    resumed = plain = 0
    for case in range(60):
        rnd = random.Random(1000 + case)
        path = str(tmp_path / f"run{case}.jsonl")
        _write_run(rnd, path)
        was_resumed = bool(scan(path))
        resumed += was_resumed
        plain += not was_resumed
        assert checks.validate_file(path) == checks._validate(path, scan(path)), case
        got = summary.summarize_file(path)
        want = summary._summarize_scanned(path, Filter())
        assert same([vars(s) for s in got[0]], [vars(s) for s in want[0]]), case
        assert got[1:] == want[1:], case
    assert resumed > 10 and plain > 10, (resumed, plain)


def _attempt_line(how: str, t: float) -> "bytes | None":
    """The one line of a run that may hold a later attempt (see
    test_summary_and_validate_restart_exactly_where_the_scan_finds_an_attempt)."""
    from conftest import per_device_dict

    rep = record_dict(name="loss", step=1, value=1.5, vhash="aa", process=0, time=t)
    pd = per_device_dict(0, 0, 0.5, process=0, time=t)
    dump = lambda d: json.dumps(d, separators=(",", ":")).encode()  # noqa: E731
    if how == "none":
        return None
    if how == "invalid":  # a record of attempt 1 but for its missing host
        return dump({k: v for k, v in dict(rep, attempt=1).items() if k != "host"})
    if how == "meta":
        return dump(record_dict(kind="meta", name="pmaptap/attempt", step=0, attempt=2, time=t))
    for name, value in (("bool", True), ("float", 1.0), ("str", "1"), ("negative", -1)):
        if how == name:  # no record: attempt is a non-negative integer
            return dump(dict(rep, attempt=value))
    if how == "zero":
        return dump(dict(rep, attempt=0))
    if how == "escaped":  # the key spelled with an escape
        return dump(dict(pd, attempt=1)).replace(b'"attempt"', b'"\\u0061ttempt"')
    if how in ("torn", "copy", "shared", "late"):
        return dump(dict(pd if how == "late" else rep, attempt=1))
    if how == "torn-invalid":
        return dump(dict(rep, attempt=1))[:-9]
    raise ValueError(how)


# Where the optimistic pass must start again: exactly where attempts.scan
# finds a later attempt.
_ATTEMPT_CASES = {
    "none": False,
    "invalid": False,
    "meta": False,
    "bool": False,
    "float": False,
    "str": False,
    "negative": False,
    "zero": False,
    "escaped": True,
    "torn": True,
    "torn-invalid": False,
    "copy": True,
    "shared": True,
    "late": True,
}


def _attempt_run(tmp_path, how: str, layout: str) -> str:
    """A run of copies of replicated values (processes 0 and 1) and
    per-device records, steps 0-2, plus ``_attempt_line(how)``: in shard 1
    (the shared file for "shared"; as shard 1's last line, without its
    newline, for "torn"/"torn-invalid"; in both shards, one copy dropped by
    the merge, for "copy"; last in time for "late"). ``layout``: sharded,
    one file (every line in it), or an object store's chunks (memory://)."""
    from conftest import per_device_dict

    files: dict = {0: [], 1: [], "shared": []}
    for p in (0, 1):
        for step in range(3):
            t = 1.0 + step
            files[p].append(record_dict(name="loss", step=step, vhash="aa", process=p, time=t))
            files[p].append(per_device_dict(step, p, 0.5 * step, process=p, time=t))
    files["shared"].append(record_dict(name="lr", step=0, process=7, time=0.5))
    raw = {k: [json.dumps(d, separators=(",", ":")).encode() for d in v] for k, v in files.items()}
    special = _attempt_line(how, 9.0 if how == "late" else 2.0)
    torn = how in ("torn", "torn-invalid")
    if special is not None:
        raw["shared" if how == "shared" else 1].append(special)
        if how == "copy":
            # Process 0's copy (kept) and process 1's (dropped by the merge).
            raw[0].append(special)
            raw[1][-1] = special.replace(b'"process":0', b'"process":1')
    path = str(tmp_path / f"{how}-{layout}.jsonl")

    def data(lines, last_torn=False):
        out = b"".join(x + b"\n" for x in lines)
        return out[:-1] if last_torn and layout != "url" else out

    if layout == "file":
        with open(path, "wb") as f:
            f.write(data(raw["shared"] + raw[0] + raw[1], torn))
        return path
    if layout == "url":
        import fsspec

        url = f"memory://pmaptap-attempts-{os.getpid()}-{tmp_path.name}/{how}"
        fs, prefix = fsspec.core.url_to_fs(url)
        for p, key in ((0, 0), (1, 1), (7, "shared")):
            fs.pipe(f"{prefix}.d/p{p:05d}-1-ab-0.jsonl", data(raw[key]))
        return url
    from pmaptap.tapfile.source import run as runs

    os.makedirs(path + runs.SHARD_SUFFIX)
    with open(path, "wb") as f:
        f.write(data(raw["shared"]))
    for p in (0, 1):
        with open(runs.shard_path(path, p), "wb") as f:
            f.write(data(raw[p], torn and p == 1))
    return path


def test_summary_and_validate_restart_exactly_where_the_scan_finds_an_attempt(tmp_path):
    """The optimistic pass of summary and validate (no scan first) starts
    again exactly for the runs where attempts.scan finds a later attempt,
    so it gives the scan-first result on every run: not for an attempt in
    a line that is no record (a missing field, a torn line, attempt true,
    1.0, "1" or -1), in a meta record, or 0; yes for one spelled with an
    escape, in a whole last line without its newline, in a copy the merge
    drops (its kept copy holds it too), in the shared file, last in time.
    Sharded, one file, and an object store's chunks; a filter takes the
    scan-first pass as before."""
    import math

    from pmaptap.tapfile.analyze import summary
    from pmaptap.tapfile.analyze import validate as checks
    from pmaptap.tapfile.read.attempts import scan
    from pmaptap.tapfile.read.query import Filter

    def same(a, b) -> bool:  # NaN statistics compare equal to themselves
        return json.dumps(a, default=repr, sort_keys=True) == json.dumps(
            b, default=repr, sort_keys=True
        ) or (isinstance(a, float) and math.isnan(a) and math.isnan(b))

    def summaries_same(got, want) -> None:
        assert same([vars(s) for s in got[0]], [vars(s) for s in want[0]]), how
        assert got[1:] == want[1:], how

    try:
        import fsspec  # noqa: F401

        layouts = ("sharded", "file", "url")
    except ImportError:
        layouts = ("sharded", "file")
    for layout in layouts:
        for how, resumed in _ATTEMPT_CASES.items():
            if layout == "file" and how in ("copy", "shared"):
                continue  # one file: no merge
            path = _attempt_run(tmp_path, how, layout)
            where = (how, layout)
            assert bool(scan(path)) == resumed, where
            assert (checks._validate(path, None) is None) == resumed, where
            report = checks.validate_file(path)
            assert report == checks._validate(path, scan(path)), where
            assert report.records >= 10, (where, report)
            if how == "late":
                assert report.superseded == 2, (where, report)  # g step 0, both processes
            if layout == "file":
                acc, _ = summary._summarize_merged(path)
            else:
                acc, _ = summary._summarize_merged(path)
            assert acc.resumed == resumed, where
            summaries_same(
                summary.summarize_file(path),
                summary._summarize_scanned(path, Filter()),
            )
            flt = Filter(names=("loss", "g"))
            summaries_same(
                summary.summarize_file(path, flt),
                summary._summarize_scanned(path, flt),
            )


def test_reading_a_sharded_run_loads_no_logging_or_object_store_client(tmp_path):
    """The CLI's start-up is part of every read: a sharded run on disk read
    whole by ``summary``, ``validate`` and ``pmaptap.read`` imports neither
    logging (only a read that has something to report does) nor fsspec."""
    path = tmp_path / "run.jsonl"
    os.makedirs(str(path) + ".d")
    for p in range(3):
        with open(pmaptap.tapfile.source.run.shard_path(path, p), "w") as f:
            for step in range(4):
                d = record_dict(name="loss", step=step, vhash="ab", process=p, time=step + 0.5)
                f.write(json.dumps(d) + "\n")
    proc = run_python(f"""
        import sys
        from pmaptap.cli import main
        import pmaptap
        for cmd in ("summary", "validate"):
            assert main([cmd, {str(path)!r}]) == 0, cmd
        assert len(pmaptap.read({str(path)!r})) == 4
        print(sorted(m for m in ("logging", "fsspec", "s3fs") if m in sys.modules))
        """)
    assert proc.stdout.strip().splitlines()[-1] == "[]"
