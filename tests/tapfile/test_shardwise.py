"""``pmaptap summary`` and ``validate`` of a sharded run a shard at a time
(tapfile/analyze/shardwise.py) give what the run's merged stream gives
(analyze/summary.py's summarize_file and analyze/validate.py's validate_file
over source/run.py's iter_merged, the definition; ``pmaptap summary`` and
``validate`` read shard by shard through analyze/parallel.py): on random
sharded runs (copies of replicated values in several shards, divergence,
attempts, bad and torn lines, odd times and ids, the shared file), with
filters, and with every problem and duplicate at its line of the merged
stream."""

from __future__ import annotations

import os
import random
import re
import tempfile

from test_jobs import _commands, _dump, _write_run

from conftest import per_device_dict, record_dict
from pmaptap.errors import NeedSerial
from pmaptap.tapfile.analyze import parallel as jobs
from pmaptap.tapfile.analyze import shardwise, summary
from pmaptap.tapfile.analyze import validate as checks
from pmaptap.tapfile.read.query import Filter
from pmaptap.tapfile.record.schema import UNSET
from pmaptap.tapfile.source import run as runs


def _shown(result) -> tuple:
    """A summary result as compared: names and runs are sets."""
    summaries, bad, names, runs_ = result
    return repr(summaries), bad, sorted(map(repr, names)), sorted(map(repr, runs_))


FILTERS = (
    Filter(),
    Filter(names=("loss",)),
    Filter(all_attempts=True),
    Filter(device=1),
    Filter(process=2),
    Filter(steps=(1, 2)),
)


def test_random_sharded_runs_summarize_shard_by_shard_as_their_merged_stream(tmp_path):
    answered = bad_lines = checked = problems = 0
    for case in range(80):
        rnd = random.Random(7100 + case)
        path = str(tmp_path / f"run{case}.jsonl")
        _write_run(rnd, path)
        report = shardwise.validate(path)
        if report is not None:  # None: a per-device key in two shards
            want = checks.validate_file(path)
            assert report == want, case
            checked += 1
            problems += len(want.problems)
        for flt in FILTERS:
            got = shardwise.summarize(path, flt)
            if got is None:  # ids of two types: the caller reads the merged stream
                continue
            want = summary.summarize_file(path, flt)
            assert _shown(got) == _shown(want), (case, flt)
            answered += 1
            bad_lines += len(want[1])
    # Most runs are answered shard by shard, many with bad lines placed.
    assert answered > 0.6 * 80 * len(FILTERS), answered
    assert bad_lines > 200, bad_lines
    assert checked > 60 and problems > 500, (checked, problems)


def test_bad_lines_are_placed_in_the_merged_stream_past_the_copies_it_drops(tmp_path):
    """40 shards, each writing a copy of every step's loss (the merge keeps
    the first) and per-device values at times that interleave the shards,
    garbage lines and a torn last line here and there: every bad line is
    at its line of the merged stream, in both ways of counting (more runs
    of keys than bad lines in a shard, and fewer)."""
    path = str(tmp_path / "run.jsonl")
    os.makedirs(path + runs.SHARD_SUFFIX)
    rnd = random.Random(3)
    for p in range(40):
        lines = []
        for s in range(30):
            t = 10.0 + s + rnd.choice([0.0, 0.25, 0.5])
            lines.append(_dump(per_device_dict(s, p, 0.5 * s, process=p, time=t)))
            rep = record_dict(name="loss", step=s, value=1.0, vhash="aa", process=p, time=t)
            lines.append(_dump(rep))
            if rnd.random() < 0.1:
                lines.append(b"garbage")
        data = b"".join(x + b"\n" for x in lines)
        if p % 7 == 3:
            data += b'{"run": "r", "na'
        with open(runs.shard_path(path, p), "wb") as f:
            f.write(data)
    want = summary.summarize_file(path, Filter())
    assert len(want[1]) > 100
    got = shardwise.summarize(path, Filter())
    assert got is not None and _shown(got) == _shown(want)
    report = checks.validate_file(path)
    assert len(report.problems) > 100 and shardwise.validate(path) == report


def test_a_device_key_in_two_shards_is_validated_on_the_merged_stream(tmp_path):
    """Two processes write device 0's value of step 0 (process 1 first by
    time): which copy is the duplicate is the merge's to say."""
    path = str(tmp_path / "run.jsonl")
    os.makedirs(path + runs.SHARD_SUFFIX)
    for p, time in ((0, 2.0), (1, 1.0)):
        d = per_device_dict(0, 0, 0.5, process=p, time=time)
        with open(runs.shard_path(path, p), "wb") as f:
            f.write(_dump(d) + b"\n")
    assert shardwise.validate(path) is None
    report = jobs.validate_file(path, 1)  # what `pmaptap validate` reads
    assert report == checks.validate_file(path)
    assert report.problems == [(2, "duplicate of line 1 (per_device 'g' step 0 device 0)")]


def test_an_id_of_two_types_in_two_shards_is_left_to_the_merged_stream(tmp_path):
    """Process 1 written as 1 in one shard and 1.0 in another: which one a
    summary shows depends on the merge's order, so the shard-by-shard pass
    declines and `pmaptap summary` (jobs.summarize_file) reads the merged
    stream."""
    path = str(tmp_path / "run.jsonl")
    os.makedirs(path + runs.SHARD_SUFFIX)
    for p, time, process in ((0, 2.0, 1.0), (1, 1.0, 1)):
        d = per_device_dict(0, p, 0.5, process=process, time=time)
        with open(runs.shard_path(path, p), "wb") as f:
            f.write(_dump(d) + b"\n")
    assert shardwise.summarize(path, Filter()) is None
    got = jobs.summarize_file(path, Filter(), 1)
    assert _shown(got) == _shown(summary.summarize_file(path, Filter()))
    assert got[0][0].processes == (1,) and type(got[0][0].processes[0]) is int


def _per_device_run(rnd: random.Random, resumed: bool) -> bytes:
    """Per-device records, most of them usual, some not (two mesh axes, an
    int dtype, a device 1.0, a backward pass, an array, a later attempt
    where ``resumed``), with duplicates."""
    lines = []
    for _ in range(300):
        d = per_device_dict(rnd.randrange(6), rnd.randrange(4), rnd.choice([0.5, 2, -1e300]))
        roll = rnd.random()
        if roll < 0.05:
            d["coords"] = {"dp": d["device"], "tp": 0}
        elif roll < 0.1:
            d["dtype"], d["value"] = "int32", rnd.choice([3, 2.5])
        elif roll < 0.15:
            d["device"] = float(d["device"])
        elif roll < 0.2:
            d["pass"] = "backward"
        elif roll < 0.22:
            d["value"], d["shape"] = [1.0, 2.0], [2]
        elif roll < 0.24 and resumed:
            d["attempt"] = 1
        elif roll < 0.26:
            d["name"] = "h"
        elif roll < 0.4:
            d["coords"] = {}  # the JAX-free Writer's
        lines.append(_dump(d))
    return b"".join(x + b"\n" for x in lines)


def test_the_validators_loop_for_usual_records_checks_as_add_does(tmp_path):
    """checks.Validator.take_records's loop for the usual per-device record
    gives the report that add() of each record gives (problems, duplicates
    and their first copies), on the fuzzer's files and per-device runs."""
    from test_read_fuzz import _file_bytes

    from pmaptap.tapfile.read.attempts import scan
    from pmaptap.tapfile.record import parse

    compared = 0
    for seed in range(40):
        rnd = random.Random(900 + seed)
        path = tmp_path / f"t{seed}.jsonl"
        path.write_bytes(_file_bytes(rnd) if seed % 2 else _per_device_run(rnd, seed % 4 == 0))
        records, problems = parse.decode_block(path.read_bytes())
        for attempts in (None, scan(path)):
            fast = checks.Validator(str(path), attempts)
            fast.take(records, {i + 1: why for i, why in problems.items()}, 1)
            one = checks.Validator(str(path), attempts)
            for pos, r in enumerate(records, 1):
                if r is None:
                    one.problems.append((pos, problems[pos - 1]))
                elif attempts is None and r.attempt is not UNSET and r.attempt and r.kind != "meta":
                    one.resumed = True
                    break
                else:
                    one.add(r, pos)
                    one.superseded += bool(attempts and attempts.superseded(r))
            one.lines = len(records)
            assert fast.resumed == one.resumed, seed
            if not one.resumed:
                assert fast.report() == one.report(), seed
                compared += not seed % 2
    assert compared >= 20, compared  # per-device runs, both ways of taking attempts


def test_the_writers_records_without_coordinates_take_the_usual_loop(tmp_path, monkeypatch):
    """The JAX-free Writer's per-device lines (``"coords": {}``) are checked
    by the loop for usual records, never by add(), with the duplicates that
    add() finds (a device's step twice, the same device at one coordinate
    not a duplicate of it without one)."""
    from pmaptap.tapfile.record import parse

    lines = [per_device_dict(s, d, 0.5, coords={}) for s in range(4) for d in range(3)]
    lines += [per_device_dict(2, 1, 0.5, coords={}), per_device_dict(2, 1, 0.5)]
    path = tmp_path / "w.jsonl"
    path.write_bytes(b"".join(_dump(d) + b"\n" for d in lines))
    records, _ = parse.decode_block(path.read_bytes())
    one = checks.Validator(str(path), None)
    for pos, r in enumerate(records, 1):
        one.add(r, pos)
    one.lines = len(records)

    def add(self, r, pos):
        raise AssertionError("taken by add()")

    monkeypatch.setattr(checks.Validator, "add", add)
    fast = checks.Validator(str(path), None)
    fast.take(records, {}, 1)
    assert fast.report() == one.report()
    assert fast.report().problems == [
        (13, "duplicate of line 8 (per_device 'g' step 2 device 1)")
    ], fast.report().problems


def _mixed_run(rnd: random.Random) -> bytes:
    """_per_device_run's records with replicated ones among them (holders
    as lists, ranges text or absent; steps going back; copies)."""
    lines = _per_device_run(rnd, rnd.random() < 0.3).splitlines()
    for _ in range(150):
        d = record_dict(name=rnd.choice(["loss", "g"]), step=rnd.randrange(8), value=1.5)
        d["vhash"] = rnd.choice(["aa", "bb"])
        d["process"] = rnd.randrange(3)
        roll = rnd.random()
        if roll < 0.3:
            d["devices"], d["processes"], d["replicas"] = [0, 1], [0, 1], 2
        elif roll < 0.4:
            d["devices"], d["processes"], d["replicas"] = "0-3", "0-1", 4
        lines.insert(rnd.randrange(len(lines) + 1), _dump(d))
    return b"".join(x + b"\n" for x in lines)


def test_the_summarys_loop_for_usual_records_adds_as_add_does(tmp_path):
    """summary.Summarizer.add_batch's loop for the usual records gives the
    summaries that add() of each record gives, on the fuzzer's files and
    runs of per-device and replicated records."""
    from test_read_fuzz import _file_bytes

    from pmaptap.tapfile.record import parse

    for seed in range(40):
        rnd = random.Random(1300 + seed)
        data = _file_bytes(rnd) if seed % 2 else _mixed_run(rnd)
        records, _ = parse.decode_block(data)
        batched = summary.Summarizer()
        for start in range(0, len(records), 37):  # batches cut anywhere
            batched.add_batch(records[start : start + 37], start + 1)
        one = summary.Summarizer()
        for pos, r in enumerate(records, 1):
            if r is not None:
                one.add(r, pos)
        assert repr(batched.summaries()) == repr(one.summaries()), seed


def _never_merged(monkeypatch) -> None:
    """From here on, a run read in one process through the merged stream
    (or one file's pass) fails the test."""

    def one_process(*args, **kwargs):
        raise AssertionError("read in one process")

    monkeypatch.setattr(summary, "_summarize_merged", one_process)
    monkeypatch.setattr(summary, "_summarize_scanned", one_process)
    monkeypatch.setattr(checks, "_validate", one_process)


def _spied_resolve(monkeypatch) -> list:
    """shardwise.resolve counted (in this process: --jobs 1's, and the
    share of the buckets the process that starts the workers resolves)."""
    calls: list = []
    resolve = shardwise.resolve

    def spy(got, spills, buckets, placeable):
        calls.append(len(buckets))
        return resolve(got, spills, buckets, placeable)

    monkeypatch.setattr(shardwise, "resolve", spy)
    return calls


def test_random_runs_past_the_copies_held_are_read_in_parallel_as_merged(tmp_path, monkeypatch):
    """With MAX_HELD_COPIES at 1, every run's replicated copies go to files
    and are resolved by bucket, by the workers: summary and validate with
    1, 2 and 3 jobs give what the merged stream gives, never reading it
    (but for the runs the bounds never decided: an id of two types, a
    per-device key or a process's copies in two sources)."""
    cases = []
    for case in range(30):
        rnd = random.Random(8100 + case)
        path = str(tmp_path / f"run{case}.jsonl")
        _write_run(rnd, path)
        want_v = checks.validate_file(path) if shardwise.validate(path) is not None else None
        wants = [
            summary.summarize_file(path, flt) if shardwise.summarize(path, flt) else None
            for flt in FILTERS[:4]
        ]
        cases.append((path, want_v, wants))
    monkeypatch.setattr(shardwise, "MAX_HELD_COPIES", 1)
    monkeypatch.setattr(shardwise, "BUCKET_BYTES", 64)  # many buckets
    calls = _spied_resolve(monkeypatch)
    _never_merged(monkeypatch)
    compared = 0
    for path, want_v, wants in cases:
        for n in (1, 2, 3):
            if want_v is not None:
                assert jobs.validate_file(path, n) == want_v, (path, n)
                compared += 1
            for flt, want in zip(FILTERS[:4], wants):
                if want is not None:
                    got = jobs.summarize_file(path, flt, n)
                    assert _shown(got) == _shown(want), (path, n, flt)
                    compared += 1
    assert compared > 200, compared
    assert calls, "no copies were resolved from files"


def _problem_run(path: str, shards: int = 6, steps: int = 12) -> None:
    """Shards with per-device values, a loss every process writes (the
    merge keeps the first process's), garbage lines, a duplicated device
    step, a schema problem and a torn last line."""
    os.makedirs(path + runs.SHARD_SUFFIX)
    for p in range(shards):
        lines = []
        for s in range(steps):
            t = 10.0 + s + p / 8
            lines.append(_dump(per_device_dict(s, p, 0.5 * s, process=p, time=t)))
            lines.append(_dump(record_dict(name="loss", step=s, vhash="aa", process=p, time=t)))
        if p == 3:
            lines.insert(5, b"garbage")
            lines.insert(9, lines[2])  # device 3's step 1 again
        if p == 4:
            bad = per_device_dict(99, p, 0.5, process=p, time=30.0)
            bad["shape"] = [2]  # a scalar said to be of shape [2]
            lines.append(_dump(bad))
        with open(runs.shard_path(path, p), "wb") as f:
            f.write(b"".join(x + b"\n" for x in lines) + (b'{"run": "r", "na' if p == 5 else b""))


def test_past_the_key_budget_lines_are_named_by_their_shard_and_read_in_parallel(
    tmp_path, monkeypatch, capsys
):
    """Past MAX_KEY_RUNS (the whole run's) lines are not placed in the
    merged stream: summary and validate name a bad line, a problem and a
    duplicate by its shard file and line there, with every --jobs the same
    output, read in parallel (the merged stream never read); the problems
    are the merged stream's, each at its own line of its shard."""
    clean, bad = str(tmp_path / "clean.jsonl"), str(tmp_path / "bad.jsonl")
    _problem_run(bad)
    os.makedirs(clean + runs.SHARD_SUFFIX)
    for p in range(6):
        with open(runs.shard_path(clean, p), "wb") as f:
            lines = [_dump(per_device_dict(s, p, 0.5, process=p)) for s in range(9)]
            f.write(b"".join(x + b"\n" for x in lines))
    merged = checks.validate_file(bad)
    want_clean = _commands(clean, capsys, 1)
    monkeypatch.setattr(shardwise, "MAX_KEY_RUNS", 20)
    want = _commands(bad, capsys, 1)
    assert _commands(clean, capsys, 1) == want_clean  # nothing to place: as before
    _never_merged(monkeypatch)
    for n in (2, 3, 4):
        assert _commands(bad, capsys, n) == want, n
        assert _commands(clean, capsys, n) == want_clean, n
    report = jobs.validate_file(bad, 3)

    # The merged stream's problems, each named by its source instead.
    def what(why: str) -> str:
        return re.sub(r"duplicate of (p\d+\.jsonl )?line \d+", "duplicate of X", why)

    assert sorted(map(what, dict(report.problems).values())) == sorted(
        map(what, dict(merged.problems).values())
    )
    assert len(report.problems) == len(merged.problems) == 4, report.problems
    printed = want[1][1]
    for pos, why in report.problems:
        assert isinstance(pos, runs.SourceLine), pos
        with open(pos.path, "rb") as f:
            line = f.read().split(b"\n")[pos.line - 1]
        if "duplicate" in why:
            assert "of p00003.jsonl line 3 (per_device 'g' step 1 device 3)" in why, why
            assert line == _dump(per_device_dict(1, 3, 0.5, process=3, time=11.375)), line
        elif "garbage" in line.decode() or why.startswith("not valid"):
            assert line == b"garbage" and "(p00003.jsonl line 6)" in why, (line, why)
        assert f"{pos.path}:{pos.line}: {why}" in printed
    assert "p00005.jsonl line" in printed and "torn" in printed, printed


def _device_run(rnd: random.Random, path: str) -> bool:
    """Shards whose processes write per-device values of the same devices
    (a layout a restart changed), each shard the steps of its own residue:
    sometimes all of them (one range per device, ranges that overlap),
    sometimes some (steps kept in a file), sometimes a range of steps
    (apart from the next shard's, just apart or meeting it at one step),
    sometimes a step of another shard's too (a per-device key in two
    shards, where it holds it), and a line twice in its shard now and
    then; the loss every process writes. Whether a (device, step) is in
    two shards."""
    os.makedirs(path + runs.SHARD_SUFFIX)
    shards = rnd.randint(2, 4)
    coords = rnd.choice([{}, None])  # the Writer's, or an axis "dp"
    apart = rnd.choice([40, 10, 9])  # 9: one step of a shard's range in the next's
    held: dict = {}
    clash = False
    for p in range(shards):
        if rnd.random() < 0.3:
            steps = [s for s in range(40) if s % shards == p]
        elif rnd.random() < 0.5:
            steps = sorted(rnd.sample([s for s in range(40) if s % shards == p], 5))
        else:
            steps = list(range(p * apart, p * apart + 10))  # ranges apart, or meeting
        if rnd.random() < 0.3:
            steps = sorted({*steps, rnd.randrange(40)})
        lines = []
        for s in steps:
            t = 10.0 + s + p / 8
            for d in (0, 1):
                extra = {} if coords is None else {"coords": coords}
                lines.append(_dump(per_device_dict(s, d, 0.5, process=p, time=t, **extra)))
                clash = clash or held.setdefault((d, s), p) != p
            lines.append(_dump(record_dict(name="loss", step=s, vhash="aa", process=p, time=t)))
            if rnd.random() < 0.05:
                lines.append(lines[-2])
        with open(runs.shard_path(path, p), "wb") as f:
            f.write(b"".join(x + b"\n" for x in lines))
    return clash


def test_per_device_keys_of_many_shards_are_checked_in_parallel_as_merged(tmp_path, monkeypatch):
    """Devices whose steps are spread over several shards, with the bounds
    made small (copies to files by bucket; lines named by their shard):
    validate with 1, 2 and 3 jobs gives what the merged stream gives; a
    run without a per-device key in two shards is read in parallel (the
    merged stream never read), and exactly the runs with one are left to
    the merged stream, found both where the shards' steps are ranges and
    where they are kept in a file."""
    cases = []
    kinds: set = set()
    for case in range(40):
        rnd = random.Random(5300 + case)
        path = str(tmp_path / f"run{case}.jsonl")
        clash = _device_run(rnd, path)
        assert (shardwise.validate(path) is None) == clash, case
        with monkeypatch.context() as m:
            m.setattr(shardwise, "MAX_KEY_RUNS", 10)
            assert (shardwise.validate(path) is None) == clash, case
        sources = list(enumerate(runs.sources(path)))
        state = shardwise.read(
            shardwise.ShardwiseValidation(path, None), sources, 1.0, 1, str(tmp_path)
        )
        state.settle()
        kinds |= {(clash, type(held)) for spans in state.spans.values() for *_, held in spans}
        cases.append((path, clash, checks.validate_file(path)))
    assert sum(c for _, c, _ in cases) >= 8, "too few runs with a key in two shards"
    assert sum(len(w.problems) for *_, w in cases) >= 10
    assert {(False, range), (False, tuple), (True, range), (True, tuple)} <= kinds, kinds
    for bounds in ((1, 64, 1 << 22), (1 << 17, 32 << 20, 10)):
        with monkeypatch.context() as m:
            for name, value in zip(("MAX_HELD_COPIES", "BUCKET_BYTES", "MAX_KEY_RUNS"), bounds):
                m.setattr(shardwise, name, value)
            for path, clash, want in cases:
                one = jobs.validate_file(path, 1)
                if bounds[2] > 10:
                    assert one == want, path
                with monkeypatch.context() as never:
                    if not clash:
                        _never_merged(never)
                    for n in (2, 3):
                        assert jobs.validate_file(path, n) == one, (path, n, bounds)


def test_a_worker_sends_an_entry_per_device_and_shard_not_a_position_per_line(tmp_path):
    """A job's shards (as the Writer writes them: steps one range per
    device): the state a worker sends holds no first copy of a per-device
    line, one entry of steps per device and shard, a range each."""
    path = str(tmp_path / "job.jsonl")
    os.makedirs(path + runs.SHARD_SUFFIX)
    for p in range(4):
        with open(runs.shard_path(path, p), "wb") as f:
            for s in range(500):
                for d in (2 * p, 2 * p + 1):
                    rec = per_device_dict(s, d, 0.5, process=p, time=10.0 + s + p / 8, coords={})
                    f.write(_dump(rec) + b"\n")
    files = runs.sources(path)
    sources = [(1, files[1]), (2, files[2])]
    got = shardwise.read(shardwise.ShardwiseValidation(path, None), sources, 0.5, 2, str(tmp_path))
    assert got.v.firsts._keys == {} and got.v.dups == [] and got.v.records == 2000
    assert sorted(
        (g[6], src, held) for g, spans in got.spans.items() for _, _, src, held in spans
    ) == [(d, d // 2, range(500)) for d in range(2, 6)]
    assert jobs.validate_file(path, 2) == checks.validate_file(path)


def _scattered(rnd: random.Random, path: str):
    """A reader (shardwise.summarize's and validate's) that reads the run
    as --jobs workers now do, in the worst order: the sources dealt to
    states at random (a state's sources need not follow each other), each
    read into its state a unit of one or two sources at a time, and the
    states combined in a random order (the order they come in)."""

    def reader(empty):
        files = list(enumerate(runs.sources(path)))
        sizes = {i: os.path.getsize(f) for i, f in files}
        total = sum(sizes.values()) or 1
        rnd.shuffle(files)
        k = rnd.randint(1, len(files))
        with tempfile.TemporaryDirectory() as tmp:
            buckets = shardwise.buckets_for(total, k)
            states = []
            for group in (files[j::k] for j in range(k)):
                got = empty.fresh()
                cuts = [0, *sorted(rnd.sample(range(1, len(group)), len(group) // 2)), len(group)]
                units = [group[a:b] for a, b in zip(cuts, cuts[1:])]
                share = sum(sizes[i] for i, _ in group) / total
                for n, unit in enumerate(units):
                    end = n == len(units) - 1
                    got = shardwise.read(got, unit, share, buckets, tmp, sent=True, end=end)
                states.append(got)
            rnd.shuffle(states)
            resolver = lambda tasks: [shardwise.resolve(*t) for t in tasks]  # noqa: E731
            return shardwise.combine(states, k, resolver)

    return reader


def test_states_of_any_sources_in_any_order_combine_as_the_merged_stream(tmp_path, monkeypatch):
    """What a --jobs worker sends (jobs._sharded) is a state of the units
    it happened to take, read into one state a unit at a time, and the
    parent combines the states in the order they come: on random runs,
    with the bounds as they are and made small (copies to files, lines
    named by their shard), summary and validate of states dealt and
    combined at random give what one state of every source gives, and
    that is the merged stream's."""
    compared = 0
    for bounds in ((1 << 17, 4 << 20), (1, 10)):  # MAX_HELD_COPIES, MAX_KEY_RUNS
        with monkeypatch.context() as m:
            m.setattr(shardwise, "MAX_HELD_COPIES", bounds[0])
            m.setattr(shardwise, "MAX_KEY_RUNS", bounds[1])
            for case in range(40):
                rnd = random.Random(9100 + case)
                path = str(tmp_path / f"run{case}-{bounds[0]}.jsonl")
                _write_run(rnd, path)
                want = shardwise.validate(path)
                if want is not None and bounds[0] > 1:
                    assert want == checks.validate_file(path), case
                assert shardwise.validate(path, _scattered(rnd, path)) == want, (case, bounds)
                for flt in FILTERS[:3]:
                    want = shardwise.summarize(path, flt)
                    if want is not None and bounds[0] > 1:
                        assert _shown(want) == _shown(summary.summarize_file(path, flt))
                    try:
                        got = shardwise.summarize(path, flt, _scattered(rnd, path))
                    except NeedSerial:  # ids of two types met in two states: as None
                        got = None
                    assert (got is None) == (want is None), (case, flt, bounds)
                    if want is not None:
                        assert _shown(got) == _shown(want), (case, flt, bounds)
                        compared += 1
    assert compared > 100, compared


def test_a_resumed_state_that_comes_first_ends_the_pass_at_once(tmp_path):
    """The first state the parent takes in is resumed (a worker that met a
    later attempt skips its other units, so its state tends to come
    first): combine gives it back without waiting for the other states
    (before, it took every one in, the whole run read, only to give the
    pass up)."""
    path = str(tmp_path / "run.jsonl")
    os.makedirs(path + runs.SHARD_SUFFIX)
    for p in range(4):
        lines = [per_device_dict(s, p, 0.5, process=p, time=10.0 + s) for s in range(5)]
        if p == 0:
            lines.append(per_device_dict(5, p, 0.5, process=p, time=20.0, attempt=1))
        with open(runs.shard_path(path, p), "wb") as f:
            f.write(b"".join(_dump(d) + b"\n" for d in lines))
    sources = list(enumerate(runs.sources(path)))
    for empty in (
        shardwise.ShardwiseSummary(Filter(), None),
        shardwise.ShardwiseValidation(path, None),
    ):
        with tempfile.TemporaryDirectory() as tmp:
            first = shardwise.read(empty.fresh(), sources[:1], 0.25, 1, tmp, sent=True)
            assert first.resumed
            taken = []

            def states():
                yield first
                for i in range(1, 4):
                    taken.append(i)
                    yield shardwise.read(empty.fresh(), sources[i : i + 1], 0.25, 1, tmp, sent=True)

            got = shardwise.combine(states(), 2, lambda tasks: [])
            assert got is first and got.resumed and taken == [], taken
