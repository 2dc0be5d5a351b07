"""``pmaptap summary --jobs N`` and ``validate --jobs N`` (tapfile/analyze/parallel.py):
pieces of a run read in worker processes give the output of ``--jobs 1``
byte for byte, on random sharded runs (copies of replicated values in
several shards, divergence, attempts, bad and torn lines, odd times and
ids, the shared file), on one file cut into byte ranges (the fuzzer's
files: hostile lines, NaN/inf, duplicates, resumed runs, gaps), and with
filters; and the merge's own rules that the pieces must keep."""

from __future__ import annotations

import json
import os
import random

import pytest
from read_definitions import parse_lines
from test_read_batch import HOSTILE
from test_read_fuzz import _file_bytes, _hostile

from conftest import per_device_dict, record_dict
from pmaptap import cli
from pmaptap.tapfile.analyze import parallel as jobs
from pmaptap.tapfile.analyze import summary
from pmaptap.tapfile.analyze import validate as checks
from pmaptap.tapfile.record import parse
from pmaptap.tapfile.source import run as runs

# ------------------------------------------------------------ random runs


def _dump(d, compact=True) -> bytes:
    seps = (",", ":") if compact else (", ", ": ")
    return json.dumps(d, separators=seps, ensure_ascii=False).encode("utf-8", "surrogatepass")


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
    """A random sharded run at ``path`` (1 to 5 of 8 processes, sometimes
    the one shared file too)."""
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


def _cli(capsys, *args):
    code = cli.main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def _commands(path: str, capsys, n: int) -> list:
    out = [
        _cli(capsys, "summary", path, "--jobs", str(n)),
        _cli(capsys, "validate", path, "--limit", "0", "--jobs", str(n)),
    ]
    for flt in (["--name", "loss"], ["--all-attempts"], ["--device", "1"]):
        out.append(_cli(capsys, "summary", path, "--jobs", str(n), *flt))
    return out


# ------------------------------------------------------------ the tests


def test_jobs_of_random_sharded_runs_print_what_one_process_prints(tmp_path, capsys):
    """60 random sharded runs: summary (with and without filters) and
    validate with 2 and 3 worker processes print exactly what --jobs 1
    prints, and the runs the pieces cannot merge (a process in two
    pieces, an id written with two types) are among them and come out the
    same too (read in one process)."""
    split = 0
    for case in range(60):
        rnd = random.Random(4000 + case)
        path = str(tmp_path / f"run{case}.jsonl")
        _write_run(rnd, path)
        want = _commands(path, capsys, 1)
        for n in (2, 3):
            assert _commands(path, capsys, n) == want, (case, n)
        pieces = jobs.plan(path, 2)
        split += pieces is not None
    assert split > 30, split


def test_jobs_split_sharded_runs_into_pieces_and_merge_them(tmp_path, capsys, monkeypatch):
    """A run of 12 shards with divergence, copies of a replicated value in
    every shard, bad and torn lines, a gap, NaN and a resumed attempt: the
    pieces are read by workers (none falls back to one process), and every
    output is --jobs 1's."""
    path = str(tmp_path / "run.jsonl")
    os.makedirs(path + ".d")
    for p in range(12):
        lines = []
        for s in range(30):
            if s == 17:
                continue  # a gap
            t = 100.0 + s + (p % 5) * 1e-3
            v = float("nan") if (p, s) == (3, 9) else 0.5 * p + s
            lines.append(_dump(per_device_dict(s, p, "NaN" if v != v else v, process=p, time=t)))
            loss = 7.0 if (p, s) == (5, 4) else 1.0 / (s + 1)
            rep = record_dict(
                name="loss", step=s, value=loss, vhash=str(loss), process=p, processes=[p], time=t
            )
            lines.append(_dump(rep))
            if (p, s) == (2, 11):
                lines.append(b"garbage, not JSON")
        if p == 4:  # resumed at step 25 on process 4
            for s in range(25, 30):
                t = 200.0 + s
                lines.append(_dump(per_device_dict(s, p, 9.0, process=p, time=t, attempt=1)))
        data = b"".join(x + b"\n" for x in lines)
        if p == 11:
            data += b'{"run": "r", "name": "g", "st'  # torn
        with open(runs.shard_path(path, p), "wb") as f:
            f.write(data)

    def one_process(*args, **kwargs):
        raise AssertionError("read in one process")

    want = _commands(path, capsys, 1)
    assert "divergent" in want[0][1] and "1 missing step" in want[0][1], want[0][1]
    assert "p00002.jsonl line" in want[1][1] and "torn last line" in want[1][1], want[1][1]
    # From here on, the pieces must merge: the one-process passes refuse.
    monkeypatch.setattr(summary, "_summarize_merged", one_process)
    monkeypatch.setattr(summary, "_summarize_scanned", one_process)
    monkeypatch.setattr(checks, "_validate", one_process)
    for n in (2, 4, 12):
        got = _commands(path, capsys, n)
        assert got == want, n


def test_jobs_of_one_file_in_byte_ranges_print_what_one_process_prints(tmp_path, capsys):
    """The fuzzer's files (hostile lines, NaN/inf, duplicates, divergence,
    restarts, torn last lines) cut into 2, 3 and 7 byte ranges at line
    starts: summary and validate print what one process prints, line
    numbers of bad lines and duplicates included."""
    for seed in range(12):
        rnd = random.Random(500 + seed)
        path = tmp_path / f"t{seed}.jsonl"
        path.write_bytes(_file_bytes(rnd))
        want = _commands(str(path), capsys, 1)
        for n in (2, 3, 7):
            pieces = jobs.plan(path, n)
            assert pieces is not None and not pieces[0] and len(pieces[1]) > 1
            assert _commands(str(path), capsys, n) == want, (seed, n)


def test_byte_ranges_start_at_lines_and_cover_the_file(tmp_path):
    lines = [b"x" * n for n in (0, 5, 70000, 1, 3, 200000, 2)]
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    data = path.read_bytes()
    for n in (2, 3, 5, 40):
        sharded, pieces, _, _ = jobs.plan(path, n)
        assert not sharded and pieces[0][0] == 0 and pieces[-1][1] == len(data)
        for (a, b), (c, _) in zip(pieces, pieces[1:]):
            assert b == c and data[b - 1 : b] == b"\n" and a < b


def test_jobs_default_is_the_cores_for_a_big_run_and_one_for_a_small(tmp_path, monkeypatch):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"x\n" * 1000)
    monkeypatch.setattr(jobs, "cores", lambda: 16)
    assert jobs.jobs_for(path, None) == 1
    assert jobs.jobs_for(path, 3) == 3
    monkeypatch.setattr(jobs, "MIN_JOB_BYTES", 100)
    assert jobs.jobs_for(path, None) == 16
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["summary", str(path), "--jobs", "0"])


def test_validate_files_a_device_s_records_under_each_of_its_groups(tmp_path):
    """A record of the same device in another group (another run, name,
    pass, axis or coordinate) is filed under that group, and a later copy
    in the first group is still found: exactly these duplicates."""
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
    for n in (1, 2, 3):
        report = jobs.validate_file(path, n)
        got = [p for p in report.problems if "duplicate" in p[1]]
        assert [(line, int(why.split("line ")[1].split()[0])) for line, why in got] == want, n


def test_an_unhashable_dedup_key_cannot_come_from_a_line():
    """The dedup key (record_key and vhash) of any line readers take is
    hashable: run, name, pass, vhash must be text, step and attempt
    integers, index pairs of integers."""
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
        assert parse_lines([_dump(d)])[0] == [None], field


# ------------------------------------------------------------ the pool

_POOL = """
import os, signal, sys, time
from pmaptap.tapfile.analyze import parallel as jobs

HERE = os.path.dirname(os.path.abspath(__file__))

def piece(i, slow, kill):
    if i == kill:
        os.kill(os.getpid(), signal.SIGKILL)
    if i != slow:
        time.sleep(0.05)
        open(os.path.join(HERE, f"done-{i}"), "w").close()
        return i, os.getpid()
    # Slower than the rest by as much as they take, however loaded the
    # machine (a fixed second was outlasted by eight pieces' round trips):
    # done once 8 others are (the free worker's), or after 20 s (a pool
    # that held those pieces back for this worker).
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if sum(n.startswith("done-") for n in os.listdir(HERE)) >= 8:
            break
        time.sleep(0.01)
    return i, os.getpid()

slow, kill = int(sys.argv[1]), int(sys.argv[2])
if len(sys.argv) > 3:  # given up: after the first result, or at an error
    t0 = time.monotonic()
    first = (time.sleep, 0.0) if sys.argv[3] == "early" else (int, "not a number")
    try:
        with jobs._Pool(2) as pool:
            pieces = pool.map([first] + [(time.sleep, 30.0)] * 5)
            next(pieces)
            pieces.close()
    except RuntimeError as e:
        print("error:", str(e).splitlines()[0], file=sys.stderr)
    print(f"{time.monotonic() - t0:.2f}")
    sys.exit(0)
try:
    with jobs._Pool(2) as pool:
        got = list(pool.map([(piece, i, slow, kill) for i in range(10)]))
except RuntimeError as e:
    print("error:", e)
    sys.exit(0)
print([i for i, _ in got])
print(sum(pid == got[slow][1] for _, pid in got))
"""


def test_the_workers_of_a_sharded_read_take_the_next_piece_when_done(tmp_path):
    """Pieces go to whichever of the processes is free (one queued beside
    the one it runs), and come back in the order of the pieces: a piece
    20x slower than the rest holds back its process alone, which reads
    that piece and the one queued beside it, while the other reads the
    other eight. Split in halves, it would have read five."""
    import subprocess
    import sys

    script = tmp_path / "pool.py"
    script.write_text(_POOL)
    out = subprocess.run(
        [sys.executable, str(script), "0", "-1"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    order, slow_ones = out.stdout.splitlines()
    assert order == str(list(range(10)))
    assert int(slow_ones) == 2, out.stdout


def _gradient_shards(tmp_path, shards: int, steps: int) -> str:
    """A sharded run of ``shards`` processes' per-device lines, ``steps``
    each (process p's device p), as a job's Writer writes them."""
    path = str(tmp_path / "run.jsonl")
    os.makedirs(path + runs.SHARD_SUFFIX)
    for p in range(shards):
        with open(runs.shard_path(path, p), "wb") as f:
            for s in range(steps):
                grad = per_device_dict(s, p, 0.5 + s, process=p, time=10.0 + s + p / (2 * shards))
                f.write(_dump(grad) + b"\n")
    return path


_UNITS = """
import os, sys, time
from pmaptap import cli
from pmaptap.tapfile.analyze import shardwise

path, log = sys.argv[1:3]
add = shardwise._Shardwise.add_source

def timed(self, index, source):
    time.sleep(3.0 if index == 0 else 0.02)  # the first source 150x slower
    with open(log, "a") as f:
        f.write(f"{index} {os.getpid()}\\n")
    return add(self, index, source)

shardwise._Shardwise.add_source = timed
combine, states = shardwise.combine, []

def counted(given, *args):
    def each():
        for state in given:
            states.append(len(state.names))
            yield state
    return combine(each(), *args)

shardwise.combine = counted
code = cli.main(["summary", path, "--jobs", "2"])
print("states", states)
sys.exit(code)
"""


def test_a_slow_source_holds_back_its_worker_by_one_unit_and_states_hold_many(tmp_path):
    """A sharded run of 16 sources read with --jobs 2, its first source
    150x slower to read than the others: the worker that takes it reads
    it and the one unit queued beside it (a source), the other worker
    reads the other 14 (before: pieces of two sources, so the slow one's
    worker read four); each worker reads its units into the state it
    holds and sends it once it holds an eighth of the run, so the parent
    takes in about 8 states, not a state a unit; the output is --jobs 1's."""
    import subprocess
    import sys

    path = _gradient_shards(tmp_path, shards=16, steps=20)
    script, log = tmp_path / "units.py", tmp_path / "log"
    script.write_text(_UNITS)
    got = subprocess.run(
        [sys.executable, str(script), path, str(log)], capture_output=True, text=True, timeout=120
    )
    assert got.returncode == 0, got.stderr
    read = dict(line.split() for line in log.read_text().splitlines())
    assert sorted(map(int, read)) == list(range(16)), read
    slow = [i for i, pid in read.items() if pid == read["0"]]
    assert len(slow) == 2, read
    states = got.stdout.splitlines()[-1]
    assert states.startswith("states "), got.stdout
    counts = eval(states[len("states ") :])
    # An eighth of the run is two sources here, give or take a few bytes.
    assert sum(counts) == 16 and 6 <= len(counts) <= 10 and max(counts) >= 2, counts
    one = subprocess.run(
        [sys.executable, "-m", "pmaptap", "summary", path, "--jobs", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert got.stdout.replace(states, "").rstrip() == one.stdout.rstrip()


_KILLED = """
import os, signal, sys
from pmaptap import cli
from pmaptap.tapfile.analyze import shardwise

add, parent = shardwise._Shardwise.add_source, os.getpid()

def dying(self, index, source):
    if index == 1 and os.getpid() != parent:  # a worker, as the OOM killer would
        os.kill(os.getpid(), signal.SIGKILL)
    return add(self, index, source)

shardwise._Shardwise.add_source = dying
sys.exit(cli.main([sys.argv[1], sys.argv[2], "--jobs", "2"]))
"""


@pytest.mark.parametrize("command", ["summary", "validate"])
def test_a_worker_killed_mid_read_is_the_commands_error_exit_2(tmp_path, command):
    """`summary`/`validate --jobs 2` whose worker is killed mid-read: one
    line saying so and exit status 2 (a usage or read error), not a
    traceback and status 1, which `validate` gives for "problems found"."""
    import subprocess
    import sys

    path = _gradient_shards(tmp_path, shards=4, steps=10)
    script = tmp_path / "killed.py"
    script.write_text(_KILLED)
    got = subprocess.run(
        [sys.executable, str(script), command, path], capture_output=True, text=True, timeout=120
    )
    assert got.returncode == 2, (got.returncode, got.stderr)
    want = f"pmaptap {command}: error: a worker process reading the run ended (exit code -9)"
    assert want in got.stderr and "Traceback" not in got.stderr, got.stderr


def test_a_worker_killed_mid_read_is_an_error_not_a_hang(tmp_path):
    """A worker killed (SIGKILL, as the OOM killer does) while it reads a
    piece: the parent says so, with the exit code, and returns."""
    import subprocess
    import sys

    script = tmp_path / "pool.py"
    script.write_text(_POOL)
    out = subprocess.run(
        [sys.executable, str(script), "-1", "5"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "error: a worker process reading the run ended (exit code -9)" in out.stdout, out.stdout


@pytest.mark.parametrize("how", ["early", "error"])
def test_pieces_given_up_are_not_waited_for(tmp_path, how):
    """A read given up after its first piece (a state resumed) or at a
    worker's error: the workers still reading are ended at once, not waited
    for (here: 30 s pieces; before, up to 10 s a worker)."""
    import subprocess
    import sys

    script = tmp_path / "pool.py"
    script.write_text(_POOL)
    out = subprocess.run(
        [sys.executable, str(script), "-1", "-1", how],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) < 5.0, out.stdout
    if how == "error":
        assert "a worker process failed: ValueError" in out.stderr, out.stderr


_PHASES = """
import os, sys, time
from pmaptap import cli
from pmaptap.tapfile.source import run as runs
from pmaptap.tapfile.analyze import shardwise

command, path, log, jobs = sys.argv[1:5]
shardwise.MAX_HELD_COPIES = 1  # every copy to a file: its buckets resolved after the reading
forks = []
os.register_at_fork(after_in_parent=lambda: forks.append(os.getpid()))
read, resolve = shardwise.read, shardwise.resolve

def note(what):
    with open(log, "a") as f:
        f.write(f"{what} {os.getpid()}\\n")

def read_noted(*args, **kwargs):
    note("read")
    return read(*args, **kwargs)

def resolve_noted(*args):
    note("resolve")
    return resolve(*args)

def sources_noted(*args):
    note("list")
    return sources(*args)

sources = runs.sources
shardwise.read, shardwise.resolve = read_noted, resolve_noted
runs.sources = sources_noted
code = cli.main([command, path, "--jobs", jobs])
print("forks", len(forks))
sys.exit(code)
"""


@pytest.mark.parametrize("command", ["summary", "validate"])
def test_one_pool_of_workers_reads_the_pieces_and_resolves_the_copies(tmp_path, command):
    """A sharded run whose replicated copies go to files (MAX_HELD_COPIES
    at 1), read with --jobs 2: two processes are forked in all, and the
    same two read the pieces and then resolve the buckets of copies (a
    second round of workers forked two more, after this process held
    every state); the workers never list the run's sources (each was
    handed its own: before, every piece listed and statted every source
    of the run); the output is --jobs 1's."""
    import subprocess
    import sys

    path = str(tmp_path / "run.jsonl")
    os.makedirs(path + runs.SHARD_SUFFIX)
    for p in range(4):
        with open(runs.shard_path(path, p), "wb") as f:
            for s in range(30):
                loss = record_dict(name="loss", step=s, value=1.0 / (s + 1), process=p)
                loss.update(vhash=f"{s:016x}", time=10.0 + s + p / 8)
                grad = per_device_dict(s, p, 0.5, process=p, time=10.0 + s + p / 8)
                f.write(_dump(loss) + b"\n" + _dump(grad) + b"\n")
    script = tmp_path / "phases.py"
    script.write_text(_PHASES)
    outs = {}
    for n in ("1", "2"):
        log = tmp_path / f"log{n}"
        got = subprocess.run(
            [sys.executable, str(script), command, path, str(log), n],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert got.returncode in (0, 1), got.stderr
        outs[n] = got.stdout
        noted = [line.split() for line in log.read_text().splitlines()]
        if n == "2":
            readers = {pid for what, pid in noted if what == "read"}
            resolvers = {pid for what, pid in noted if what == "resolve"}
            assert resolvers and resolvers <= readers and len(readers) == 2, noted
            assert not readers & {pid for what, pid in noted if what == "list"}, noted
    assert outs["1"].endswith("forks 0\n") and outs["2"].endswith("forks 2\n"), outs
    assert outs["1"].replace("forks 0", "") == outs["2"].replace("forks 2", "")


_FORKS = """
import os, time
from pmaptap.tapfile.analyze import parallel as jobs

def started(i):
    return time.monotonic()

forked = []
# Each fork made slow (0.3 s): a worker handed its tasks only once every
# worker is forked would start its first one after the last fork.
os.register_at_fork(before=lambda: (forked.append(time.monotonic()), time.sleep(0.3)))
with jobs._Pool(3) as pool:
    got = list(pool.map([(started, i) for i in range(6)]))
print(min(got) < forked[-1])
"""


def test_a_worker_reads_while_the_next_one_is_forked(tmp_path):
    """Each worker of the pool is handed its first tasks as soon as it is
    forked: its first task starts before the last worker is forked (a fork
    takes 15 ms on a 13-core node; 12 of them one after another held every
    worker idle until the last)."""
    import subprocess
    import sys

    script = tmp_path / "forks.py"
    script.write_text(_FORKS)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True", out.stdout


def _a_time_a_line(tmp_path, bad_in: int | None = None) -> tuple[str, list]:
    """A run of 4 shards of 200 per-device lines, each line a time of its
    own (a run of merge keys a line, as the JAX-free Writer's), a bad last
    line in shard ``bad_in``: (its path, its sources as read() takes them)."""
    path = str(tmp_path / "run.jsonl")
    os.makedirs(path + runs.SHARD_SUFFIX)
    for p in range(4):
        with open(runs.shard_path(path, p), "wb") as f:
            for s in range(200):
                f.write(_dump(per_device_dict(s, p, 0.5, process=p, time=s + p / 8)) + b"\n")
            if p == bad_in:
                f.write(b"garbage, not JSON\n")
    return path, list(enumerate(runs.sources(path)))


def test_a_worker_sends_its_merge_keys_by_file_and_they_are_read_back_only_to_place(
    tmp_path, capsys, monkeypatch
):
    """A worker's keys (16 bytes a run, a line's worth where each line has
    a time of its own: 78 MB at 4.9 M lines, taken in by the parent state
    after state) go to a file, not into the state it sends; the parent
    reads them back only where a line is to be placed (a bad line here),
    and places it as --jobs 1 does."""
    import pickle

    from pmaptap.tapfile.analyze import shardwise

    path, sources = _a_time_a_line(tmp_path)
    kept = shardwise.read(shardwise.ShardwiseSummary(summary.Filter(), None), sources, 1.0, 1, None)
    sent = shardwise.read(
        shardwise.ShardwiseSummary(summary.Filter(), None), sources, 1.0, 1, str(tmp_path), True
    )
    assert all(len(k.keys) == 200 for k in kept.keys.values())
    assert all(len(k.keys) == 0 and k.stored for k in sent.keys.values())
    assert len(pickle.dumps(sent)) < len(pickle.dumps(kept)) - 4 * 200 * 15  # 16 bytes a run
    loads = []
    load = shardwise._Keys.load
    monkeypatch.setattr(shardwise._Keys, "load", lambda k: (loads.append(k.stored), load(k)))
    healthy = _commands(path, capsys, 2)
    assert not [s for s in loads if s], "a healthy run's keys were read back"
    with open(runs.shard_path(path, 2), "ab") as f:
        f.write(b"garbage, not JSON\n")
    want = _commands(path, capsys, 1)
    assert want != healthy and "line 201" in want[1][1], want
    assert _commands(path, capsys, 2) == want
    assert [s for s in loads if s], "the keys were not read back to place a line"


def test_keys_that_cannot_go_to_a_file_go_in_the_state(tmp_path, capsys, monkeypatch):
    """A full TMPDIR (/dev/full: every write fails with ENOSPC): a worker's
    keys stay in the state it sends, as before the file, its file is
    removed, and --jobs 2 still prints what --jobs 1 prints."""
    from pmaptap.tapfile.analyze import shardwise

    path, sources = _a_time_a_line(tmp_path, bad_in=1)
    made = []

    def full(**kwargs):
        name = str(tmp_path / f"keys-{len(made)}")
        open(name, "wb").close()
        made.append(name)
        return os.open("/dev/full", os.O_WRONLY), name

    monkeypatch.setattr(shardwise.tempfile, "mkstemp", full)
    empty = shardwise.ShardwiseSummary(summary.Filter(), None)
    got = shardwise.read(empty, sources, 1.0, 1, str(tmp_path), True)
    assert made and not any(os.path.exists(m) for m in made)
    assert all(len(k.keys) == 200 and k.stored is None for k in got.keys.values())
    want = _commands(path, capsys, 1)
    assert "run.jsonl:799: not valid JSON" in want[1][1], want[1][1]  # placed in the merge
    assert _commands(path, capsys, 2) == want


def test_once_a_state_is_past_max_key_runs_no_worker_files_its_keys(tmp_path, capsys, monkeypatch):
    """A piece past MAX_KEY_RUNS says so in the read's directory; a piece
    read after keeps no keys (the run is past the bound, lines are named by
    shard and line), and --jobs 2 prints what --jobs 1 prints."""
    from pmaptap.tapfile.analyze import shardwise

    monkeypatch.setattr(shardwise, "MAX_KEY_RUNS", 300)
    path, sources = _a_time_a_line(tmp_path, bad_in=3)
    work = tmp_path / "read"
    work.mkdir()

    def piece(which):
        empty = shardwise.ShardwiseSummary(summary.Filter(), None)
        return shardwise.read(empty, which, 0.5, 1, str(work), True)

    assert piece(sources[2:3]).placeable and len(os.listdir(work)) == 1  # its keys' file
    assert not piece(sources[:2]).placeable  # 400 runs
    kept = []
    add = shardwise._Keys.add
    monkeypatch.setattr(
        shardwise._Keys, "add", lambda k, r, h, keep: (kept.append(keep), add(k, r, h, keep))[1]
    )
    later = piece(sources[3:])
    assert kept and not any(kept), "keys kept by a piece read after the run was past the bound"
    assert not later.placeable and len(os.listdir(work)) == 2, os.listdir(work)
    want = _commands(path, capsys, 1)
    assert "p00003.jsonl line 201" in want[1][1], want[1][1]
    assert _commands(path, capsys, 2) == want


def test_an_unreadable_shard_is_the_error_jobs_1_gives(tmp_path, capsys):
    """A shard that cannot be read (a directory where a shard's file should
    be): every --jobs says what --jobs 1 says, the OSError as the command
    says one (exit 2, "error: [Errno 21] Is a directory: ..."), not a
    worker's traceback (exit 1, which validate also gives for problems)."""
    path = str(tmp_path / "run.jsonl")
    os.makedirs(path + runs.SHARD_SUFFIX)
    for p in (0, 2, 3, 4):
        with open(runs.shard_path(path, p), "wb") as f:
            f.write(_dump(per_device_dict(0, p, 0.5, process=p, time=1.0 + p)) + b"\n")
    os.makedirs(runs.shard_path(path, 1))
    want = _commands(path, capsys, 1)
    assert all(code == 2 and "Is a directory" in err for code, _, err in want), want
    for n in (2, 3):
        assert _commands(path, capsys, n) == want, n


_ENDED = """
import os, signal, sys
from pmaptap import cli
from pmaptap.tapfile.analyze import parallel as jobs
from pmaptap.tapfile.analyze import shardwise

combine = shardwise.combine

def ended(*args):
    # Every state taken in: the workers, idle now, killed (the OOM killer).
    got = combine(*args)
    for conn, p in jobs._Pool.last.process.items():
        os.kill(p.pid, signal.SIGKILL)
        p.join()
    return got

enter = jobs._Pool.__enter__

def noted(self):
    jobs._Pool.last = self
    return enter(self)

shardwise.combine, jobs._Pool.__enter__ = ended, noted
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("command", ["summary", "validate"])
def test_workers_that_ended_once_their_tasks_were_done_leave_the_result(tmp_path, command):
    """The workers killed once every state is taken in (none is needed any
    more): the command prints what --jobs 1 prints; before, telling the
    dead workers to return raised BrokenPipeError, which the command takes
    for a reader gone: exit 0, nothing printed."""
    import subprocess
    import sys

    path, _ = _a_time_a_line(tmp_path, bad_in=2)
    script = tmp_path / "ended.py"
    script.write_text(_ENDED)
    got = subprocess.run(
        [sys.executable, str(script), command, path, "--jobs", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    one = subprocess.run(
        [sys.executable, "-m", "pmaptap", command, path, "--jobs", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert one.stdout and (got.returncode, got.stdout) == (one.returncode, one.stdout), got.stderr
