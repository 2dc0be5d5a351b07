"""Runs on an object store: a real S3-protocol server (moto in server mode)
on loopback, started and stopped here; clients configured only through the
standard AWS environment variables."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from benchmarks.common import loopback_s3
from conftest import ROOT, job_failed, run_launch, start_python, train_argv

pytest.importorskip("s3fs", reason="the [s3] extra (s3fs) is in the test extra")
pytest.importorskip("moto.server", reason="moto[server] is in the test extra")

STEPS = 4


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """The server's environment: AWS_ENDPOINT_URL and test credentials, set
    in this process (for pmaptap.read and s3fs here) and returned for
    subprocesses. A fresh bucket per module."""
    with loopback_s3(str(tmp_path_factory.mktemp("moto") / "moto.log")) as env:
        saved = {k: os.environ.get(k) for k in env}
        try:
            os.environ.update(env)
            import s3fs

            s3fs.S3FileSystem.clear_instance_cache()
            s3fs.S3FileSystem().mkdir("taps")
            yield env
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _cli(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pmaptap", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env=dict(os.environ, **env),
    )


def test_writers_write_chunks_that_read_and_the_cli_merge(s3, tmp_path):
    import s3fs

    import pmaptap

    url = "s3://taps/side/run"
    for p in range(3):
        with pmaptap.Writer(url, run="r", process=p) as w:
            for step in range(STEPS):
                w.write("loss", step, 0.5 * step)
                w.write("acts", step, [p, step], kind="per_device", device=p)
            w.flush()  # a second chunk
            w.write("loss", STEPS, 9.0 if p == 2 else 1.0)
    names = s3fs.S3FileSystem().ls("taps/side/run.d", refresh=True)
    # An empty first chunk (the check at open) + 2, rolled up into one
    # object at close (tapfile/source/store.py), the chunks deleted.
    assert [n.rsplit("-", 1)[-1] for n in sorted(names)] == ["000000002.r000000000.b0.jsonl"] * 3
    recs = pmaptap.read(url)
    loss = [r for r in recs if r["name"] == "loss"]
    assert sorted((r["step"], r["value"]) for r in loss) == [(s, 0.5 * s) for s in range(STEPS)] + [
        (STEPS, 1.0),
        (STEPS, 9.0),
    ]
    assert all(r.get("divergent") for r in loss if r["step"] == STEPS)
    assert sum(r["name"] == "acts" for r in recs) == 3 * STEPS
    v = _cli("validate", url, env=s3)
    assert v.returncode == 0 and f"OK, {len(recs)} records" in v.stdout, v
    show = _cli("show", url, "--name", "acts", "--process", "1", env=s3)
    assert show.returncode == 0 and len(show.stdout.splitlines()) == 1 + STEPS, show
    tail = [
        json.loads(x) for x in _cli("tail", url, "-n", "3", "--json", env=s3).stdout.splitlines()
    ]
    assert len(tail) == 3 and (tail[-1]["value"], tail[-1]["process"]) == (9.0, 2), tail
    merged = str(tmp_path / "merged.jsonl")
    m = _cli("merge", url, "-o", merged, env=s3)
    assert m.returncode == 0, m
    assert pmaptap.read(merged) == recs


def test_four_process_job_writes_to_s3(s3):
    url = "s3://taps/job/train"
    proc, _ = run_launch(
        4,
        1,
        train_argv(url, steps=STEPS),
        launcher_timeout=120,
        timeout=240,
        **s3,
    )
    assert proc.returncode == 0, job_failed(proc)
    import pmaptap

    recs = pmaptap.read(url)
    for name in ("loss", "lr", "step"):
        assert sorted(r["step"] for r in recs if r["name"] == name) == list(range(STEPS))
    gn = [r for r in recs if r["name"] == "grad_norm"]
    assert sorted((r["step"], r["device"]) for r in gn) == sorted(
        (s, p * 2048) for s in range(STEPS) for p in range(4)
    )
    assert _cli("validate", url, env=s3).returncode == 0


def test_a_killed_process_leaves_its_committed_chunks_whole(s3):
    """SIGKILL mid-run: what flush() committed is there, nothing is torn,
    nothing needs deleting, and the next writer of the run just goes on."""
    url = "s3://taps/killed/run"
    code = f"""
import jax, jax.numpy as jnp, pmaptap
s = pmaptap.Session({url!r}, run="k").open()
f = jax.jit(lambda x, i: pmaptap.tap(x * 2, "y", step=i))
i = 0
while True:
    f(jnp.float32(i), i).block_until_ready()
    if i % 5 == 4:
        s.flush()
        print("committed", i, flush=True)
    i += 1
"""
    p = start_python(code, devices=1, **s3)
    try:
        committed = -1
        while committed < 14:
            line = p.stdout.readline()
            assert line, p.stderr.read()
            if line.startswith("committed"):
                committed = int(line.split()[1])
        p.send_signal(signal.SIGKILL)
        p.wait(30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    import pmaptap

    recs = pmaptap.read(url)
    steps = sorted(r["step"] for r in recs)
    assert steps[: committed + 1] == list(range(committed + 1)), steps
    assert steps == list(range(len(steps)))  # whole, in order, no tears
    assert _cli("validate", url, env=s3).returncode == 0
    # A new writer of the same run (a restarted process 0) adds chunks.
    with pmaptap.Writer(url, run="k", process=0) as w:
        w.write("y", 1000, 1.0)
    assert len(pmaptap.read(url)) == len(recs) + 1


def test_a_missing_bucket_or_run_is_an_error_that_says_why(s3, tmp_path):
    """No such bucket, or no run under the prefix: read() and every command
    fail as for a missing local file (exit 2), and errors keep the store's
    own reason instead of '[Errno None] None'."""
    import pmaptap

    for open_ in (
        lambda: pmaptap.Writer("s3://nobucket/run", run="r", process=0),
        lambda: pmaptap.Session("s3://nobucket/run", run="r").open(),
    ):
        with pytest.raises(pmaptap.TapPathError) as e:
            open_()
        assert "Errno None" not in str(e.value), e.value
        assert "'s3://nobucket/run'" in str(e.value)
        assert "bucket does not exist" in str(e.value), e.value
        assert e.value.filename == "s3://nobucket/run"
    local = _cli("validate", str(tmp_path / "absent.jsonl"), env=s3)
    assert local.returncode == 2 and "no such file" in local.stderr, local
    for url, why in (
        ("s3://no-such-bucket/x", "bucket does not exist"),
        ("s3://taps/nothing/here", "s3://taps/nothing/here.d/"),
    ):
        with pytest.raises(FileNotFoundError, match=f"no such run: {url}") as e:
            pmaptap.read(url)
        assert why in str(e.value)
        for args in (
            ["validate", url],
            ["show", url],
            ["summary", url],
            ["tail", url],
            ["merge", url, "-o", str(tmp_path / "m.jsonl")],
            ["export", url, "--csv", str(tmp_path / "m.csv")],
        ):
            out = _cli(*args, env=s3)
            assert out.returncode == 2, (args, out)
            assert f"error: no such run: {url}" in out.stderr and why in out.stderr, out
            assert "Traceback" not in out.stderr and "OK" not in out.stdout
    # Following waits for a run that does not exist yet, as for a local file.
    tail = _cli("tail", "s3://taps/later/run", "-f", "--timeout", "1", env=s3)
    assert tail.returncode == 0 and "waiting for s3://taps/later/run" in tail.stderr, tail


def test_stored_array_values_are_objects_put_before_their_chunk(s3):
    """Array values above INLINE_MAX_BYTES on an object store: one object of
    bytes per batch under <url>.bytes/, put before the chunk whose lines
    point at it; read, assemble, validate and show use them."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import s3fs
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import pmaptap
    from pmaptap.tapfile.source import store

    url = "s3://taps/arrays/run"
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    x = jax.device_put(jnp.arange(64.0 * 64).reshape(64, 64), NamedSharding(mesh, P("data")))

    @jax.jit
    def step(v, i):
        y = jnp.sin(v) + i
        pmaptap.tap(y, "act", step=i, dedup="per_device")
        pmaptap.tap(y.sum(), "loss", step=i)
        return y

    with pmaptap.Session(url, run="a") as s:
        ys = []
        for i in range(2):
            ys.append(np.asarray(step(x, i)))
            s.flush()  # a chunk (and its bytes object) per step
    fs = s3fs.S3FileSystem()
    blobs = fs.ls("taps/arrays/run.bytes", refresh=True)
    [rolled] = [store.parse_name(n, 0) for n in fs.ls("taps/arrays/run.d", refresh=True)]
    assert len(blobs) == 2 and all(n.endswith(".bin") for n in blobs), blobs
    # Each object of bytes is named after the chunk whose lines point at it
    # (the chunks are rolled up into one object at close).
    seqs = sorted(int(n[: -len(".bin")].rsplit("-", 1)[1]) for n in blobs)
    assert rolled.rollup and seqs == list(range(rolled.first + 1, rolled.last + 1)), (seqs, rolled)
    for i, y in enumerate(ys):
        assert np.array_equal(pmaptap.assemble(url, "act", i), y)
    recs = pmaptap.read(url, name="act")
    assert len(recs) == 16 and all(isinstance(r["value"], np.ndarray) for r in recs)
    assert _cli("validate", url, env=s3).returncode == 0
    show = _cli("show", url, "--name", "act", "--step", "1", env=s3)
    assert show.returncode == 0 and show.stdout.count("<float32[16,64] as bytes>") == 8, show


def test_a_writer_on_a_store_gathers_like_a_session(s3, monkeypatch):
    """A Writer's automatic flush on an object store waits the object
    commit interval, as a session's writer thread does: 20 writes asking
    for a flush after 0 s make one chunk, not 20 PUTs; flush() still
    commits at once."""
    import s3fs

    import pmaptap
    from pmaptap._host.sinks import objectstore as objsink

    monkeypatch.setattr(objsink, "OBJECT_COMMIT_INTERVAL", 60.0)
    url = "s3://taps/gather/run"
    with pmaptap.Writer(url, run="r", process=0, flush_interval=0.0) as w:
        for step in range(20):
            w.write("loss", step, float(step))
        assert w.pending == 20
        w.flush()
        assert w.pending == 0
    names = s3fs.S3FileSystem().ls("taps/gather/run.d", refresh=True)
    assert len(names) == 2, names  # the empty chunk written at open + one
    # Readers fetch the chunk with records only (the listing gives sizes).
    fetched = []
    cat_file = s3fs.S3FileSystem._cat_file

    async def counting(self, name, *a, **k):
        fetched.append(name)
        return await cat_file(self, name, *a, **k)

    monkeypatch.setattr(s3fs.S3FileSystem, "_cat_file", counting)
    s3fs.S3FileSystem.clear_instance_cache()  # instances bind it when made
    try:
        assert [r["step"] for r in pmaptap.read(url)] == list(range(20))
    finally:
        monkeypatch.undo()
        s3fs.S3FileSystem.clear_instance_cache()
    assert len(fetched) == 1, fetched


def test_following_a_store_lists_only_each_process_new_chunks(s3, monkeypatch):
    """tail -f / merge -f on a store: after the first poll, a poll lists
    each known process's chunks after its last one (a start-after marker)
    instead of every chunk of the run, and the run's process prefixes,
    which find a process that started late at the next poll; the whole run
    is listed again only every RELIST_S."""
    import json

    import pmaptap
    from pmaptap.tapfile.read import follower as follow
    from pmaptap.tapfile.source import store

    full, after = [], []
    objects, objects_after = store.objects, store.objects_after
    monkeypatch.setattr(store, "objects", lambda *a, **k: full.append(1) or objects(*a, **k))
    monkeypatch.setattr(
        store, "objects_after", lambda *a, **k: after.append(1) or objects_after(*a, **k)
    )
    url = "s3://taps/follow/run"
    writers = [pmaptap.Writer(url, run="r", process=p) for p in range(2)]

    def write(ws, step):
        for w in ws:
            w.write("x", step, float(step), kind="per_device", device=w.process)
            w.flush()

    write(writers, 0)
    f = follow.RunFollower(url)

    def steps():
        return sorted((d["step"], d["process"]) for _, raw in f.poll() for d in [json.loads(raw)])

    assert steps() == [(0, 0), (0, 1)] and len(full) == 1
    for step in (1, 2):
        write(writers, step)
        assert steps() == [(step, 0), (step, 1)]
    assert len(full) == 1 and len(after) == 2
    late = pmaptap.Writer(url, run="r", process=2)
    write([late], 3)
    # Read at the next poll, not RELIST_S (30 s) later at the next full
    # listing: `tail -f` showed a process that started late half a minute late.
    assert steps() == [(3, 2)] and len(full) == 1 and len(after) == 3
    write([late, *writers], 4)
    assert steps() == [(4, 0), (4, 1), (4, 2)] and len(full) == 1
    f._relist_at = 0.0  # as RELIST_S seconds later
    assert steps() == [] and len(full) == 2
    f.close()
    for w in writers + [late]:
        w.close()


def test_a_store_followers_first_poll_is_the_run_in_read_order(s3, monkeypatch):
    """The first poll of a follower of a store run (``tail``, ``merge -f``)
    merges the processes' chunks one chunk of each at a time, in the order
    ``pmaptap.read`` gives (each process's running largest time, then
    process), a replicated value once; each chunk fetched once."""
    import json

    import pmaptap
    from pmaptap.tapfile.read import follower as follow
    from pmaptap.tapfile.source import store

    url = "s3://taps/first-poll/run"
    writers = [pmaptap.Writer(url, run="r", process=p) for p in range(3)]
    for step in range(6):
        for w in writers:
            w.write("loss", step, 1.0 / (step + 1))  # every process: one copy kept
            w.write("x", step, float(step + w.process), kind="per_device", device=w.process)
            w.flush()  # a chunk a step (the writers stay open: no rollup yet)
    fetched = []
    fs, _ = store.url_fs(url)
    cat = fs.cat_file  # the follower's instance: fsspec caches it per store
    monkeypatch.setattr(fs, "cat_file", lambda p, *a, **k: fetched.append(p) or cat(p, *a, **k))

    f = follow.RunFollower(url)
    lines = f.poll()
    got = [json.loads(next(lines)[1])]
    # Before the first line: each process's first chunk with records and
    # the next one being fetched (the empty one a Writer puts at open costs
    # no request), not the run (before: every chunk fetched and held).
    early = len(fetched)
    got += [json.loads(raw) for _, raw in lines]
    f.close()
    monkeypatch.undo()
    want = pmaptap.read(url)
    key = ("name", "step", "process", "time")
    assert [tuple(d[k] for k in key) for d in got] == [tuple(r[k] for k in key) for r in want]
    assert sum(d["name"] == "loss" for d in got) == 6
    assert early <= 2 * 3 < 6 * 3 == len(fetched), (early, fetched)
    # Every chunk with records once, none twice.
    listed = [o for objs in store.objects(url).values() for o in objs if o.size]
    assert len(fetched) == len(set(fetched)) == len(listed)
    for w in writers:
        w.close()


def test_process0_forwards_every_replicated_step_on_an_object_store(s3, tmp_path):
    """On an object store (the sharded layout as chunks) the owner rule
    spreads the writing of the loss over both processes; process 0's
    forwarders still get every step once, process 1's none."""
    from test_forward import _JOB

    from conftest import python_cmd

    steps, url, out = 12, "s3://taps/job/forward", str(tmp_path / "fw")
    os.makedirs(out)
    proc, _ = run_launch(
        2,
        2,
        python_cmd(_JOB),
        launcher_timeout=150,
        timeout=240,
        TAP=url,
        OUT=out,
        STEPS=str(steps),
        **s3,
    )
    assert proc.returncode == 0, job_failed(proc)
    import pmaptap

    per = [json.load(open(os.path.join(out, f"p{p}.json"))) for p in (0, 1)]
    loss0 = sorted(r["step"] for r in per[0]["calls"] if r["name"] == "loss")
    assert loss0 == list(range(steps))
    assert [r for r in per[1]["calls"] if r["kind"] == "replicated"] == []
    file_loss = [r for r in pmaptap.read(url) if r["name"] == "loss"]
    assert sorted(r["step"] for r in file_loss) == list(range(steps))
    assert {r["process"] for r in file_loss} == {0, 1}, "the owner rule gave one process all"
    for p, d in enumerate(per):
        assert {r["process"] for r in d["calls"] if r["name"] == "x"} == {p}


def test_a_store_follower_and_reader_across_rollups_on_s3(s3, monkeypatch):
    """On S3 (start-after listings, range requests): a follower polling
    while a writer rolls its chunks up every 8 (and deletes them) gets
    every line once; a reader whose chunks are rolled up under it reads the
    rest from the rollup; a finished writer leaves one object per 8 chunks,
    each fetched once by read()."""
    import pmaptap
    from pmaptap.tapfile.read import follower as follow
    from pmaptap.tapfile.source import run as runs
    from pmaptap.tapfile.source import store

    monkeypatch.setattr(store, "ROLLUP_CHUNKS", 8)
    url = "s3://taps/rollups/run"
    f = follow.RunFollower(url)
    got = []
    w = pmaptap.Writer(url, run="r", process=0)
    for s in range(30):
        w.write("x", s, float(s), kind="per_device", device=0)
        w.flush()  # chunks 1-30 after the empty one: rollups at 7, 15, 23
        if s % 3 == 0:
            got += [json.loads(raw)["step"] for _, raw in f.poll()]
    fs, _ = store.url_fs(url)
    cat = fs.cat_file
    fetched = []

    def cat_then_close(path, *a, **k):
        fetched.append((path.rsplit("-", 1)[-1], k.get("start")))
        data = cat(path, *a, **k)
        if len(fetched) == 5:  # rollups 0-7, 8-15, 16-23, then chunks 24, 25
            w.close()  # rolls up chunks 24-30 under the reader
        return data

    monkeypatch.setattr(fs, "cat_file", cat_then_close)
    monkeypatch.setattr(runs, "FETCH_THREADS", 1)
    assert [r["step"] for r in pmaptap.read(url)] == list(range(30))
    monkeypatch.setattr(fs, "cat_file", cat)
    # The last rollup, read from where chunks 24 and 25 ended.
    assert fetched[-1][0].startswith("000000030.r000000024.") and fetched[-1][1] > 0, fetched
    got += [json.loads(raw)["step"] for _, raw in f.poll()]
    assert got == list(range(30))
    f.close()
    objs = store.objects(url)[0]
    assert [(o.first, o.last) for o in objs] == [(0, 7), (8, 15), (16, 23), (24, 30)]
    assert all(o.rollup for o in objs)


def test_live_writers_rolling_up_with_a_tail_and_a_validate_in_other_processes(s3):
    """Real processes on S3: two writer processes roll their chunks up every
    3 (one of them closes and opens a new writer halfway: a new writer id)
    while ``pmaptap tail -f --json`` follows the run from before it exists
    and ``pmaptap validate`` reads it mid-run. tail prints every record once,
    in each process's order; validate is clean; read() afterwards has every
    record once."""
    import time

    import pmaptap

    url = "s3://taps/live/run"
    steps = 40
    tail = subprocess.Popen(
        [sys.executable, "-m", "pmaptap", "tail", url, "-f", "--json", "--interval", "0.05"]
        + ["--max-records", str(2 * steps), "--timeout", "100"],
        cwd=ROOT,
        env=dict(os.environ, **s3),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(1.0)  # tail waits for the run
    writer = f"""
import sys, time, pmaptap
from pmaptap.tapfile.source import store
store.ROLLUP_CHUNKS = 3
p = int(sys.argv[1])
w = pmaptap.Writer({url!r}, run="r", process=p)
for s in range({steps}):
    w.write("x", s, float(s), kind="per_device", device=p)
    w.flush()
    if p == 1 and s == {steps} // 2:
        w.close()
        w = pmaptap.Writer({url!r}, run="r", process=p)
    time.sleep(0.01)
w.close()
"""
    procs = [start_python(writer.replace("sys.argv[1]", repr(str(p))), **s3) for p in (0, 1)]
    # Mid-run: once both writers have put records (their start, with s3fs's
    # import, took over a second under load: a fixed wait found no run).
    from pmaptap.tapfile.source import store

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = store.objects(url, missing_ok=True)
        if len(found) == 2 and all(any(o.size for o in objs) for objs in found.values()):
            break
        time.sleep(0.05)
    mid = _cli("validate", url, env=s3)
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    out, err = tail.communicate(timeout=120)
    assert tail.returncode == 0, err
    got = [json.loads(x) for x in out.splitlines()]
    assert mid.returncode == 0 and "OK," in mid.stdout, mid
    for p in (0, 1):
        assert [d["step"] for d in got if d["process"] == p] == list(range(steps)), p
    recs = pmaptap.read(url)
    assert sorted((r["process"], r["step"]) for r in recs) == [
        (p, s) for p in (0, 1) for s in range(steps)
    ]


def test_values_left_to_an_owner_that_did_not_close_are_put_as_a_chunk(s3):
    """The owner rule on a store keeps what it leaves to an owner, as the
    sharded files do (_host/sinks/directory.py: Held): put at close for an owner
    that did not close, read once beside the owner's own copy."""
    import pmaptap
    from conftest import replicated_dict
    from pmaptap._host.sinks import ObjectSink
    from pmaptap.tapfile.record import Record, record_key
    from pmaptap.tapfile.source import run as runs

    url = "s3://taps/held/run"
    recs = [Record(**replicated_dict(s, float(s), processes=(0, 1), run="r")) for s in range(12)]
    sink = ObjectSink(url, process=0)
    sink.write(recs)
    sink.close()
    theirs = [r.step for r in recs if runs.owner(record_key(r), (0, 1)) == 1]
    assert theirs and sink.skipped == len(theirs) == len(sink.held)
    assert sorted(r["step"] for r in pmaptap.read(url)) == sorted(set(range(12)) - set(theirs))
    # Process 1 never wrote (killed with its records queued): process 0,
    # not seeing its close, puts what it left to it.
    assert sink.write_held([1]) == len(theirs)
    assert sorted(r["step"] for r in pmaptap.read(url)) == list(range(12))
    # Process 1's own copies too (it wrote them after all, only its close
    # was not seen): each value is read once.
    late = ObjectSink(url, process=1)
    late.write(
        [
            Record(**{**replicated_dict(s, float(s), processes=(0, 1), run="r"), "process": 1})
            for s in theirs
        ]
    )
    late.close()
    assert sorted(r["step"] for r in pmaptap.read(url)) == list(range(12))


def test_a_fixed_run_reopened_on_a_store_is_refused_at_open(s3):
    # The store's form of test_resume.py's refusal: the run's last object
    # with records (the empty chunk each writer puts at open is passed
    # over) ends with the run, so a second plain session on it is refused;
    # resuming it opens.
    import pmaptap

    url = "s3://taps/reopen/run"
    with pmaptap.Session(url, run="exp"):
        pmaptap.tap(1.0, "x", step=0)
    with pytest.raises(pmaptap.SessionError, match="already ends with records of run 'exp'"):
        pmaptap.Session(url, run="exp").open()
    with pmaptap.Session(url, run="exp", resume=True):
        pmaptap.tap(2.0, "x", step=0)
    with pmaptap.Session(url, run="other"):
        pmaptap.tap(3.0, "x", step=0)
    assert [(r["run"], r["value"]) for r in pmaptap.read(url, name="x")] == [
        ("exp", 2.0),
        ("other", 3.0),
    ]
