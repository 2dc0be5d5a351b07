"""Object-store runs and rollups (``pmaptap/tapfile/source/store.py``): a writer
rolls its chunks up into one object every ``ROLLUP_CHUNKS`` chunks and at
close, and deletes them; readers and followers read every line once
whichever of (chunks, rollup) they list, and when the chunks go under them.
On fsspec's in-process memory:// store (tests/host/test_object_store.py
runs the same on a real S3 server)."""

from __future__ import annotations

import json
import logging
import random
import re
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

import pmaptap
from pmaptap._host.sinks import objectstore as objsink
from pmaptap.tapfile.read import follower as follow
from pmaptap.tapfile.source import run as runs
from pmaptap.tapfile.source import store

fsspec = pytest.importorskip("fsspec", reason="fsspec is in the test extra")

_N = 0


@pytest.fixture(autouse=True)
def _empty_memory_store():
    """memory:// is one store per process: emptied after each test here
    (its rm looks at every object it holds, for each one removed, so a store
    left full by earlier tests slows the rollups of later ones)."""
    yield
    from fsspec.implementations.memory import MemoryFileSystem

    MemoryFileSystem.store.clear()


def _url() -> str:
    global _N
    _N += 1
    return f"memory://pmaptap-store-{_N}/run"


def _write_steps(url: str, steps: int) -> None:
    """A writer of process 0 putting a chunk a step (each flush), closed."""
    with pmaptap.Writer(url, run="r", process=0) as w:
        for s in range(steps):
            w.write("x", s, float(s))
            w.flush()


def _names(url: str) -> list[str]:
    fs, prefix = store.url_fs(url)
    return sorted(n.rsplit("/", 1)[-1] for n in fs.ls(prefix + runs.SHARD_SUFFIX, detail=False))


def _steps(lines) -> list[tuple[int, int]]:
    return [(d["process"], d["step"]) for d in (json.loads(x) for x in lines)]


def test_a_finished_writer_leaves_its_chunks_rolled_up():
    """151 chunks (an empty one at open and one per flush) become three
    objects: chunks 0-63, 64-127 and 128-150, each the bytes of its chunks
    joined, named with where they start in the writer's stream; the run
    reads whole and in order, and validates."""
    url = _url()
    with pmaptap.Writer(url, run="r", process=3) as w:
        for s in range(150):
            w.write("x", s, float(s), kind="per_device", device=0)
            w.flush()
        assert len(_names(url)) == 2 + 23  # two rollups, chunks 128-150
    names = _names(url)
    objs = [store.parse_name(n, 0) for n in names]
    assert [(o.first, o.last) for o in objs] == [(0, 63), (64, 127), (128, 150)]
    assert all(o.rollup and o.process == 3 for o in objs)
    fs, prefix = store.url_fs(url)
    data = [fs.cat_file(f"{prefix}.d/{n}") for n in names]
    assert [o.start for o in objs] == [0, len(data[0]), len(data[0]) + len(data[1])]
    lines = b"".join(data).splitlines()
    assert [d["step"] for d in map(json.loads, lines)] == list(range(150))
    assert [r["step"] for r in pmaptap.read(url)] == list(range(150))


def test_one_chunk_with_records_is_not_rolled_up():
    url = _url()
    with pmaptap.Writer(url, run="r", process=0) as w:
        w.write("x", 0, 1.0)
    # Each chunk named with where it starts in the writer's stream (the
    # first is empty).
    assert [n.split("-")[-1] for n in _names(url)] == ["000000000.b0.jsonl", "000000001.b0.jsonl"]


def _writer_with_window(url: str, steps: int, rollup: int, mp) -> pmaptap.Writer:
    mp.setattr(store, "ROLLUP_CHUNKS", rollup)
    w = pmaptap.Writer(url, run="r", process=0)
    for s in range(steps):
        w.write("x", s, float(s), kind="per_device", device=0)
        w.flush()
    return w


@pytest.mark.parametrize("after", [2, 4, 9])
def test_chunks_rolled_up_under_a_reader_are_read_from_the_rollup(after, monkeypatch):
    """A reader lists chunks; the writer closes (rolls them up, deletes
    them) after the reader fetched ``after`` of them: the reader's next
    fetch misses, it lists again and reads the rest of the rollup from
    where its chunks ended. Every record once, in order."""
    url = _url()
    w = _writer_with_window(url, 40, 32, monkeypatch)  # a rollup 0-31, chunks 32-40
    fs, _ = store.url_fs(url)
    cat = fs.cat_file
    fetched = []

    def cat_then_close(path, *a, **k):
        data = cat(path, *a, **k)
        fetched.append((path.rsplit("/", 1)[-1], k.get("start")))
        if len(fetched) == after:
            w.close()
        return data

    monkeypatch.setattr(fs, "cat_file", cat_then_close)
    monkeypatch.setattr(runs, "FETCH_THREADS", 1)  # fetches in order: the race where asked
    got = pmaptap.read(url)
    assert [r["step"] for r in got] == list(range(40))
    # The second rollup (chunks 32-40) was read from where the chunks taken
    # (after - 1 of them) ended.
    assert [n.split("-")[-1] for n, start in fetched if start] == [
        f"000000040.r000000032.b{store.parse_name(fetched[-1][0], 0).start}.jsonl"
    ], fetched
    assert len(_names(url)) == 2


def _poll(f) -> list[bytes]:
    return [raw for _, raw in f.poll()]


@pytest.mark.parametrize("every", [1, 2, 5, 8, 9, 13])
def test_a_follower_reads_each_line_once_across_rollups(every, monkeypatch):
    """``tail -f`` of a store while its writer rolls chunks up every 8:
    polls that took some of a window's chunks read the rest from the
    rollup, polls that took all of them skip it. Each line once, in order."""
    monkeypatch.setattr(store, "ROLLUP_CHUNKS", 8)
    url = _url()
    f = follow.RunFollower(url)
    got: list[bytes] = []
    with pmaptap.Writer(url, run="r", process=0) as w:
        for s in range(60):
            w.write("x", s, float(s), kind="per_device", device=0)
            w.flush()
            if s % every == 0:
                got += _poll(f)
    got += _poll(f)
    assert _steps(got) == [(0, s) for s in range(60)]
    assert _poll(f) == []
    f.close()


def test_a_failed_rollup_or_delete_loses_nothing_and_doubles_nothing(monkeypatch, caplog):
    """A rollup that cannot be put leaves the chunks; chunks that cannot be
    deleted stay beside their rollup and readers skip them. Either way each
    record is read once, by read() and by a follower, and a warning says
    what happened."""
    monkeypatch.setattr(store, "ROLLUP_CHUNKS", 4)
    for broken in ("pipe_file", "rm"):
        url = _url()
        fs, _ = store.url_fs(url)
        real = getattr(fs, broken)

        def fail_on_rollups(path, *a, _real=real, _broken=broken, **k):
            if _broken == "rm" or ".r" in path.rsplit("/", 1)[-1]:
                raise OSError("refused by the test")
            return _real(path, *a, **k)

        f = follow.RunFollower(url)
        got: list[bytes] = []
        caplog.clear()
        with monkeypatch.context() as mp:
            mp.setattr(fs, broken, fail_on_rollups)
            with caplog.at_level(logging.WARNING, logger="pmaptap"):
                with pmaptap.Writer(url, run="r", process=0) as w:
                    for s in range(10):
                        w.write("x", s, float(s), kind="per_device", device=0)
                        w.flush()
                        if s % 3 == 0:
                            got += _poll(f)
        got += _poll(f)
        names = _names(url)
        rollups = [n for n in names if ".r" in n]
        assert len(rollups) == (0 if broken == "pipe_file" else 3), names
        assert len(names) - len(rollups) == 11  # every chunk is still there
        assert [r["step"] for r in pmaptap.read(url)] == list(range(10))
        assert _steps(got) == [(0, s) for s in range(10)]
        assert ("roll up" if broken == "pipe_file" else "delete") in caplog.text
        f.close()


def _obj(writer: str, first: int, last: int, size: int, start: int = -1) -> store.Object:
    if start < 0:
        name = f"p00000-{writer}-{last:09d}.jsonl"
    else:
        name = f"p00000-{writer}-{last:09d}.r{first:09d}.b{start}.jsonl"
    o = store.parse_name(name, size)
    assert o is not None and (o.first, o.last, o.start) == (first, last, start)
    return o


def test_the_cursor_plans_what_was_not_taken():
    """Cursor.plan of listings a reader can meet: a rollup beside the
    chunks it covers (the chunks left out), a rollup of chunks partly taken
    (read from where they ended), wholly taken (left out), a later
    writer's objects on their own."""
    a, b = "1000-aa", "2000-bb"
    chunks = [_obj(a, s, s, 10) for s in range(6)]
    roll = _obj(a, 0, 5, 60, start=0)
    c = store.Cursor()
    assert c.plan(chunks + [roll]) == [(roll, 0)]
    for o in chunks[:3]:
        c.take(o, 0, 10)
    assert c.plan(chunks[3:] + [roll]) == [(roll, 30)]
    assert c.plan(chunks[3:]) == [(o, 0) for o in chunks[3:]]
    c.take(roll, 30, 30)
    later = [_obj(b, 0, 0, 0), _obj(b, 1, 1, 7)]
    assert c.plan([roll, _obj(a, 6, 6, 5)] + later) == [(_obj(a, 6, 6, 5), 0)] + [
        (o, 0) for o in later
    ]
    assert c.taken[a] == 60 and c.next[a] == 6 and c.last == roll.name
    # A second rollup of the same writer starts where the first ended.
    nxt = _obj(a, 6, 9, 40, start=60)
    c.take(_obj(a, 6, 6, 10), 0, 10)
    assert c.plan([nxt]) == [(nxt, 10)]
    # Names sort in write order: a rollup right after its last chunk.
    assert sorted(o.name for o in chunks + [roll, nxt]) == [o.name for o in chunks] + [
        roll.name,
        nxt.name,
    ]


def test_the_cursor_places_a_rollup_after_chunks_read_past_a_gap():
    """Chunks named with their start (store.chunk_name): after chunks 2-3
    were missed, what was taken ends where chunk 5 ends (its start plus
    its bytes), so a rollup of chunks 0-7 is read from there; chunks named
    without it (older writers) count the bytes read, which is right only
    while no chunk was missed."""
    a = "1000-aa"
    sizes = [0, 10, 11, 12, 13, 14, 15, 16]
    starts = [sum(sizes[:s]) for s in range(8)]
    chunks = [
        store.parse_name(store.chunk_name("b/run.d", 0, a, s, starts[s]), sizes[s])
        for s in range(8)
    ]
    assert [(o.first, o.start, o.rollup) for o in chunks] == [
        (s, starts[s], False) for s in range(8)
    ]
    roll = store.parse_name(store.rollup_name("b/run.d", 0, a, 0, 7, 0), sum(sizes))
    assert roll.rollup and (roll.first, roll.last, roll.start) == (0, 7, 0)
    c = store.Cursor()
    listed = chunks[:2] + chunks[4:6]  # 2 and 3 missing; 6 and 7 not put yet
    plan = c.plan(listed)  # read past the gap, with a warning
    assert [o.first for o, _ in plan] == [0, 1, 4, 5]
    for o, skip in plan:
        c.take(o, skip, o.size)
    assert c.taken[a] == starts[6] and c.next[a] == 6
    assert c.plan([roll]) == [(roll, starts[6])]
    # The same chunks without their start: the bytes read, 2 and 3's missing.
    old = [_obj(a, s, s, sizes[s]) for s in (0, 1, 4, 5)]
    c = store.Cursor()
    for o, skip in c.plan(old):
        c.take(o, skip, o.size)
    assert c.taken[a] == starts[6] - sizes[2] - sizes[3]


def test_random_writers_rollups_readers_and_followers_agree():
    """Three processes write random batches (some flushes, some closes and
    reopens: new writer ids), rolling up every 2-5 chunks, rollups read
    in ranges of 60 bytes, 400 bytes or whole; at random
    moments a follower polls and a reader reads, and some fetches of the
    reader let the writers go on (rollups deleting chunks under it). The
    follower gets every line once in each process's order; each read gets
    every record written before it started, at most those written before it
    ended, each once."""
    for seed in range(25):
        rnd = random.Random(seed)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(store, "ROLLUP_CHUNKS", rnd.randrange(2, 6))
            mp.setattr(objsink, "OBJECT_COMMIT_INTERVAL", 1e9)
            mp.setattr(runs, "FETCH_THREADS", rnd.choice([1, 4]))
            # Rollups read in ranges of a few bytes, a few lines, or whole.
            mp.setattr(store, "MIN_PIECE_BYTES", 1)
            mp.setattr(store, "MAX_PIECE_BYTES", rnd.choice([60, 400, 4 << 20]))
            url = _url()
            fs, _ = store.url_fs(url)
            fs.store.clear()  # the seeds before (see _empty_memory_store)
            writers = {p: pmaptap.Writer(url, run="r", process=p) for p in range(3)}
            step = {p: 0 for p in range(3)}
            written: list[tuple[int, int]] = []

            def work(n: int) -> None:
                for _ in range(n):
                    p = rnd.randrange(3)
                    w = writers[p]
                    for _ in range(rnd.randrange(1, 4)):
                        w.write("x", step[p], float(step[p]), kind="per_device", device=p)
                        written.append((p, step[p]))
                        step[p] += 1
                    roll = rnd.random()
                    if roll < 0.1:
                        w.close()
                        writers[p] = pmaptap.Writer(url, run="r", process=p)
                    else:
                        w.flush()

            cat = fs.cat_file
            hook = {"on": False}
            lock = threading.Lock()

            def cat_and_work(path, *a, **k):
                data = cat(path, *a, **k)
                with lock:  # fetches run on several threads
                    # At most 6 times a read: a read that lists again
                    # (a chunk rolled up under it) meets what they wrote.
                    if hook["on"] and hook["left"] and rnd.random() < 0.5:
                        hook["left"] -= 1
                        work(rnd.randrange(1, 4))
                return data

            mp.setattr(fs, "cat_file", cat_and_work)
            f = follow.RunFollower(url)
            got: list[bytes] = []
            for _ in range(12):
                work(rnd.randrange(1, 8))
                if rnd.random() < 0.6:
                    got += _poll(f)
                if rnd.random() < 0.4:
                    before = set(written)
                    hook["on"], hook["left"] = True, 6
                    recs = pmaptap.read(url)
                    hook["on"] = False
                    have = [(r["process"], r["step"]) for r in recs]
                    assert len(have) == len(set(have)), seed
                    assert before <= set(have) <= set(written), seed
            for w in writers.values():
                w.close()
            got += _poll(f)
            f.close()
            by_proc = {p: [s for q, s in _steps(got) if q == p] for p in range(3)}
            assert by_proc == {p: list(range(step[p])) for p in range(3)}, seed
            final = [(r["process"], r["step"]) for r in pmaptap.read(url)]
            assert sorted(final) == sorted(written), seed


def test_the_reader_pool_is_used_for_rollup_fetches():
    """An object's fetch goes through store.fetch with a byte offset: a
    range request for the part of a rollup after what was taken."""
    url = _url()
    _write_steps(url, 3)
    fs, _ = store.url_fs(url)
    [roll] = [o for objs in store.objects(url).values() for o in objs]
    whole = fs.cat_file(roll.name)
    with ThreadPoolExecutor(1) as pool:
        c = store.Cursor()
        first_line = len(whole.split(b"\n", 1)[0]) + 1
        c.next[roll.writer], c.taken[roll.writer] = 2, first_line
        r = store.Reader(url, fs, 0, [roll], c, pool)
        o, data = r.next()
        assert o == roll and data == whole[first_line:]
        assert r.next() is None


# --- Review additions -------------------------------------------------------


def _start_after(mp) -> None:
    """store.objects_after on memory:// as S3's StartAfter listing does it:
    per known process, only the objects named after the last one taken;
    with ``new``, every object of a process not known (its prefix listed)."""

    def objects_after(url, last, pool=None, *, new=False):
        full = store.objects(url, missing_ok=True)
        out = {}
        for p, objs in full.items():
            if p in last:
                objs = [o for o in objs if o.name > last[p]]
            elif not new:
                continue
            if objs:
                out[p] = objs
        return out

    mp.setattr(store, "objects_after", objects_after)


def test_a_follower_listing_after_its_last_object_reads_each_line_once(monkeypatch):
    """A follower whose polls list only what is named after the last object
    it took (S3 StartAfter), while its process's writer rolls up (the first
    poll's merge and a later poll each meet a rollup that deleted chunks
    they listed), restarts (a new writer id), and a second writer of the
    same process writes beside a newer one (its objects sort before the
    follower's marker: found at the next whole listing, not lost). Every
    line once, in each writer's order."""
    monkeypatch.setattr(store, "ROLLUP_CHUNKS", 3)
    monkeypatch.setattr(follow, "RELIST_S", 1e9)
    monkeypatch.setattr(runs, "FETCH_THREADS", 1)
    _start_after(monkeypatch)
    url = _url()
    fs, _ = store.url_fs(url)
    cat = fs.cat_file
    on_fetch: list = []

    def cat_then(path, *a, **k):
        data = cat(path, *a, **k)
        if on_fetch:
            on_fetch.pop(0)()
        return data

    monkeypatch.setattr(fs, "cat_file", cat_then)
    written: list[tuple[str, int]] = []
    steps: dict[str, int] = {}

    def put(w, tag, n):
        for _ in range(n):
            s = steps.setdefault(tag, 0)
            w.write(tag, s, float(s), kind="per_device", device=0)
            written.append((tag, s))
            steps[tag] = s + 1
            w.flush()

    f = follow.RunFollower(url)
    got: list[bytes] = []
    a = pmaptap.Writer(url, run="r", process=0)
    put(a, "a", 4)  # rollup 0-2, chunks 3-4
    # During the first poll's merge: chunk 5 makes the rollup 3-5 and deletes
    # chunks 3 and 4, listed by the poll and not fetched yet.
    on_fetch.append(lambda: put(a, "a", 1))
    got += _poll(f)
    put(a, "a", 2)
    on_fetch.append(lambda: a.close())  # rolls up 6-7 under the next poll
    got += _poll(f)
    b = pmaptap.Writer(url, run="r", process=0)  # restarted: a later writer id
    put(b, "b", 5)
    c = pmaptap.Writer(url, run="r", process=0)  # a third, beside b
    put(c, "c", 2)
    got += _poll(f)  # after c's last object: b's later ones are not listed
    put(b, "b", 4)
    b.close()
    c.close()
    got += _poll(f)
    f._relist_at = 0.0  # the next whole listing finds b's
    got += _poll(f)
    assert _poll(f) == []
    f.close()
    have = [(d["name"], d["step"]) for d in map(json.loads, got)]
    assert sorted(have) == sorted(written)
    for tag in "abc":
        assert [s for t, s in have if t == tag] == list(range(steps[tag])), tag


def test_a_deleted_chunk_still_listed_for_a_while_is_relisted(monkeypatch):
    """A store whose listings lag: deleted chunks still listed and their
    rollup not yet. The reader lists again (Reader.RELISTS times in a row
    at most) and reads the rest from the rollup once it is listed; a lag
    longer than that raises FileNotFoundError instead of returning less."""
    url = _url()
    w = _writer_with_window(url, 6, 4, monkeypatch)  # rollup 0-3, chunks 4-6
    fs, prefix = store.url_fs(url)
    before = fs.ls(prefix + ".d", detail=True)
    w.close()  # rollup 4-6, chunks 4-6 deleted
    real_ls = fs.ls
    stale = {"n": 0}

    def ls(path, detail=True, **k):
        out = real_ls(path, detail=True, **k)
        if stale["n"] > 0:
            stale["n"] -= 1
            out = list(before)
        return out if detail else [e["name"] for e in out]

    monkeypatch.setattr(fs, "ls", ls)
    stale["n"] = store.Reader.RELISTS  # the first listing and RELISTS - 1 relists
    assert [r["step"] for r in pmaptap.read(url)] == list(range(6))
    assert stale["n"] == 0
    stale["n"] = store.Reader.RELISTS + 1
    with pytest.raises(FileNotFoundError):
        pmaptap.read(url)
    assert stale["n"] == 0


def test_close_twice_and_windows_of_one_chunk_with_records(monkeypatch):
    """close() twice (Writer.close, then the sink's again) changes nothing;
    a window cut by ROLLUP_BYTES with one chunk of records is left as that
    chunk (no rollup of one object), two such chunks become one rollup, and
    so does nothing at close for a last window of one chunk; every record
    read once."""
    monkeypatch.setattr(store, "ROLLUP_BYTES", 1)  # every chunk ends a window
    url = _url()
    w = pmaptap.Writer(url, run="r", process=0)
    w.write("x", 0, 0.0)
    w.flush()
    assert len(_names(url)) == 2 and not any(".r" in n for n in _names(url))
    monkeypatch.setattr(store, "ROLLUP_BYTES", 300)  # two chunks of records (~200 B each)
    for s in range(1, 6):
        w.write("x", s, float(s))
        w.flush()
    w.close()
    names = _names(url)
    w.close()
    w._sink.close()
    assert _names(url) == names
    objs = [store.parse_name(n, 0) for n in names]
    assert [(o.first, o.last, o.rollup) for o in objs] == [
        (0, 0, False),
        (1, 1, False),
        (2, 3, True),
        (4, 5, True),
        (6, 6, False),  # the last window, one chunk: left as it is
    ]
    assert [r["step"] for r in pmaptap.read(url)] == list(range(6))


def test_reads_and_followers_leave_no_fetch_threads():
    """pmaptap.read and a closed follower leave no thread of their fetch
    pools running (a read per poll of a dashboard would pile them up)."""
    import time

    url = _url()
    _write_steps(url, 3)

    def fetchers():
        names = ("pmaptap-fetch", "pmaptap-follow")
        return [t for t in threading.enumerate() if t.name.startswith(names)]

    for _ in range(3):
        assert len(pmaptap.read(url)) == 3
        f = follow.RunFollower(url)
        assert len(_poll(f)) == 3
        f.close()
    deadline = time.monotonic() + 5
    while fetchers() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fetchers() == []


def test_rollups_read_a_piece_at_a_time_give_whole_lines(monkeypatch):
    """Rollups fetched in pieces of 1 byte to a few lines (ranges; a line
    cut between two pieces is joined), by read() and a follower: every line
    once, whole, in order; a piece never holds more than its bound."""
    for piece in (1, 5, 64, 300):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(store, "ROLLUP_CHUNKS", 5)
            mp.setattr(store, "MIN_PIECE_BYTES", 1)
            mp.setattr(store, "MAX_PIECE_BYTES", piece)
            url = f"memory://pieces-{piece}/run"
            fs, _ = store.url_fs(url)
            cat = fs.cat_file
            sizes = []
            mp.setattr(
                fs,
                "cat_file",
                lambda p, *a, **k: sizes.append(k["end"] - k["start"]) or cat(p, *a, **k),
            )
            f = follow.RunFollower(url)
            got = []
            with pmaptap.Writer(url, run="r", process=0) as w:
                for s in range(23):
                    w.write("x", s, float(s), kind="per_device", device=0)
                    w.flush()
                    if s % 4 == 0:
                        got += [raw for _, raw in f.poll()]
            got += [raw for _, raw in f.poll()]
            f.close()
            assert [json.loads(x)["step"] for x in got] == list(range(23)), piece
            sizes.clear()
            assert [r["step"] for r in pmaptap.read(url)] == list(range(23)), piece
            assert sizes and max(sizes) <= piece, (piece, sizes)


def _flush_failing(url: str, fail) -> tuple:
    """(a follower, a writer) of a run whose first chunk with records
    (step 0) was put, and whose second flush (step 1) raised: ``fail()``
    armed its PUT to fail."""
    f = follow.RunFollower(url)
    w = pmaptap.Writer(url, run="r", process=0)
    w.write("x", 0, 0.0)
    w.flush()
    w.write("x", 1, 1.0)
    fail()
    with pytest.raises(pmaptap.TapError) as e:  # the store's error as its cause
        w.flush()
    assert isinstance(e.value.__cause__, TimeoutError) and e.value.errors == (e.value.__cause__,)
    return f, w


def test_a_chunk_put_that_landed_but_failed_is_put_again_unchanged(monkeypatch, caplog):
    """A chunk PUT that lands but reports an error (a lost response): the
    retry puts exactly those bytes under that name again and the records
    written since as the next chunk, so a follower that read the first
    version and then a rollup reads every line once, none torn."""
    monkeypatch.setattr(store, "ROLLUP_CHUNKS", 6)
    url = _url()
    fs, prefix = store.url_fs(url)
    real = fs.pipe_file
    state = {"fail": False, "puts": {}}

    def pipe(path, data, *a, **k):
        real(path, data, *a, **k)
        state["puts"].setdefault(path, []).append(data)
        if state["fail"]:
            state["fail"] = False
            raise TimeoutError("the PUT landed, its response did not")

    monkeypatch.setattr(fs, "pipe_file", pipe)
    f, w = _flush_failing(url, lambda: state.update(fail=True))
    got = _poll(f)  # reads chunk 2 as it landed: step 1
    for s in range(2, 6):
        w.write("x", s, float(s))
        w.flush()  # chunk 2 again (step 1 only), step 2 in chunk 3, ...
    got += _poll(f)
    w.close()
    got += _poll(f)
    f.close()
    assert [json.loads(x)["step"] for x in got] == list(range(6))
    chunk2 = [v for k, v in state["puts"].items() if "-000000002.b" in k]
    assert len(chunk2) == 1 and len(chunk2[0]) == 2 and chunk2[0][0] == chunk2[0][1]
    assert [r["step"] for r in pmaptap.read(url)] == list(range(6))


def _hiding(monkeypatch, fs, hidden: str) -> dict:
    real_ls = fs.ls
    hide = {"on": True}

    def ls(path, detail=True, **k):
        out = real_ls(path, detail=True, **k)
        if hide["on"]:
            out = [e for e in out if hidden not in e["name"]]
        return out if detail else [e["name"] for e in out]

    monkeypatch.setattr(fs, "ls", ls)
    return hide


def test_a_listing_without_a_writers_earlier_objects_is_read_past_with_a_warning(
    monkeypatch, caplog
):
    """Objects missing from a listing before others of their writer (a
    lagging listing, or deleted by someone else): read() reads on after
    them and warns, naming the chunks; a follower waits for them
    (GAP_WAIT_S), reads them once they are listed, and reads on after them
    with the warning only once the wait is over."""
    monkeypatch.setattr(store, "ROLLUP_CHUNKS", 4)
    url = _url()
    _write_steps(url, 7)  # rollups 0-3 (steps 0-2) and 4-7 (steps 3-6)
    fs, _ = store.url_fs(url)
    hide = _hiding(monkeypatch, fs, ".r000000000.")
    with caplog.at_level(logging.WARNING, logger="pmaptap"):
        assert [r["step"] for r in pmaptap.read(url)] == [3, 4, 5, 6]
    assert "chunks 0-3 of process 0's writer" in caplog.text
    caplog.clear()
    f = follow.RunFollower(url)
    assert _poll(f) == [] and _poll(f) == []  # waiting for chunks 0-3
    hide["on"] = False
    assert _steps(_poll(f)) == [(0, s) for s in range(7)]
    f.close()
    assert caplog.text == ""
    hide["on"] = True
    monkeypatch.setattr(store, "GAP_WAIT_S", 0.0)
    f = follow.RunFollower(url)
    with caplog.at_level(logging.WARNING, logger="pmaptap"):
        assert _steps(_poll(f)) == [(0, s) for s in range(3, 7)]
    assert "chunks 0-3" in caplog.text
    f.close()


def test_a_listing_without_sizes_reads_every_object(monkeypatch):
    url = _url()
    _write_steps(url, 3)
    fs, _ = store.url_fs(url)
    real = fs.ls
    monkeypatch.setattr(
        fs, "ls", lambda p, detail=True, **k: [dict(e, size=None) for e in real(p, True, **k)]
    )
    assert [r["step"] for r in pmaptap.read(url)] == [0, 1, 2]


def test_a_rollup_after_chunks_read_past_a_gap_is_read_from_where_they_ended(monkeypatch, caplog):
    """Chunks 3-5 deleted by someone else: a follower reads past them (with
    the warning), then the writer rolls up chunks 0-11 (its own copy of 3-5
    included) and deletes them. The follower reads the rollup from the end
    of chunk 10, the last it read (each chunk's name says where it starts
    in the writer's stream): step 10 once. Counting the bytes it read
    instead (chunks 3-5 never were) put that point inside chunk 8: steps
    7-9 twice."""
    monkeypatch.setattr(store, "ROLLUP_CHUNKS", 12)
    monkeypatch.setattr(store, "GAP_WAIT_S", 0.0)
    url = _url()
    fs, prefix = store.url_fs(url)
    w = pmaptap.Writer(url, run="r", process=0)
    for s in range(10):  # chunks 1-10, one a step
        w.write("x", s, float(s))
        w.flush()
    gone = [n for n in fs.ls(prefix + ".d", detail=False) if re.search(r"-00000000[345]\.b", n)]
    assert len(gone) == 3
    fs.rm(gone)
    f = follow.RunFollower(url)
    with caplog.at_level(logging.WARNING, logger="pmaptap"):
        got = _poll(f)
    assert [json.loads(x)["step"] for x in got] == [0, 1, 5, 6, 7, 8, 9]
    assert "chunks 3-5 of process 0's writer" in caplog.text
    w.write("x", 10, 10.0)
    w.flush()  # chunk 11: the window of 12 rolled up (its delete of 0-11 stops at 3)
    assert [store.parse_name(n, 0).rollup for n in _names(url)][-1]
    assert [json.loads(x)["step"] for x in _poll(f)] == [10]
    w.close()
    assert _poll(f) == []
    f.close()
    assert [r["step"] for r in pmaptap.read(url)] == list(range(11))


def test_chunks_named_without_their_start_are_read():
    """A run written before chunks carried where they start
    (``p<process>-<writer>-<seq>.jsonl``), one writer rolled up and one
    not: read, followed and validated as before."""
    url = _url()
    fs, prefix = store.url_fs(url)
    d = prefix + ".d"

    def line(p: int, s: int) -> bytes:
        r = {"run": "r", "name": "x", "step": s, "kind": "per_device", "value": float(s)}
        r.update(dtype="float64", shape=[], process=p, device=p, coords={"dp": p})
        r.update(time=1e9 + s + p / 10, host="h")
        return json.dumps(r).encode() + b"\n"

    fs.pipe_file(f"{d}/p00000-1000-aa-000000000.jsonl", b"")
    for s in range(1, 4):
        fs.pipe_file(f"{d}/p00000-1000-aa-{s:09d}.jsonl", line(0, s))
    rolled = b"".join(line(1, s) for s in range(1, 4))
    fs.pipe_file(f"{d}/p00001-1000-bb-000000003.r000000000.b0.jsonl", rolled)
    got = [(r["process"], r["step"]) for r in pmaptap.read(url)]
    assert got == [(0, 1), (1, 1), (0, 2), (1, 2), (0, 3), (1, 3)]
    f = follow.RunFollower(url)
    assert sorted(_steps(_poll(f))) == sorted(got)
    f.close()


@pytest.mark.parametrize("second", ["lost", "landed"])
def test_a_batch_whose_put_fails_twice_is_put_once(monkeypatch, second):
    """A chunk PUT lands but reports an error; at the next flush its retry
    (those bytes again) goes through and the records written since fail
    (lost, or landed with an error); the flush after puts only what no try
    put for sure. Before, it put the whole batch again as a new chunk:
    step 1 twice."""
    url = _url()
    fs, _ = store.url_fs(url)
    real = fs.pipe_file
    fails: list = []  # how each next PUT fails: "landed", "lost" or None (it does not)

    def pipe(path, data, *a, **k):
        how = fails.pop(0) if fails else None
        if how != "lost":
            real(path, data, *a, **k)
        if how:
            raise TimeoutError(how)

    monkeypatch.setattr(fs, "pipe_file", pipe)
    f, w = _flush_failing(url, lambda: fails.append("landed"))
    got = _poll(f)
    w.write("x", 2, 2.0)
    fails[:] = [None, second]
    with pytest.raises(pmaptap.TapError) as e:
        w.flush()
    assert isinstance(e.value.__cause__, TimeoutError)
    got += _poll(f)
    w.write("x", 3, 3.0)
    w.flush()
    got += _poll(f)
    w.close()
    got += _poll(f)
    f.close()
    assert [json.loads(x)["step"] for x in got] == [0, 1, 2, 3]
    assert [r["step"] for r in pmaptap.read(url)] == [0, 1, 2, 3]


def test_random_foreign_deletes_lagging_listings_and_failed_puts_double_nothing(monkeypatch):
    """150 random runs of one writer (rollups every 2-8 chunks, rollups
    read in pieces of 60 bytes, 400 bytes or whole) while a follower polls:
    chunks deleted by someone else or hidden from listings for a while, a
    PUT now and then failing (landed or lost; a retry's too) and retried by
    the next flush.
    Deleted chunks may be lost (a warning says which); nothing is ever read
    twice, torn or out of order, by the follower or by a read() after."""
    monkeypatch.setattr(store, "GAP_WAIT_S", 0.0)
    monkeypatch.setattr(store, "MIN_PIECE_BYTES", 1)
    monkeypatch.setattr(objsink, "OBJECT_COMMIT_INTERVAL", 1e9)
    logger = logging.getLogger("pmaptap")
    level = logger.level
    logger.setLevel(logging.ERROR)  # the gaps' warnings
    try:
        for seed in range(150):
            rnd = random.Random(seed)
            monkeypatch.setattr(store, "ROLLUP_CHUNKS", rnd.randrange(2, 9))
            monkeypatch.setattr(store, "MAX_PIECE_BYTES", rnd.choice([60, 400, 4 << 20]))
            url = _url()
            fs, prefix = store.url_fs(url)
            cls = type(fs)
            hidden: set = set()
            fail: list = []

            def pipe(path, data, *a, _fs=fs, _fail=fail, **k):
                how = _fail.pop(0) if _fail else None
                if how != "lost":
                    cls.pipe_file(_fs, path, data, *a, **k)
                if how:
                    raise TimeoutError(how)

            def ls(path, detail=True, _fs=fs, _hidden=hidden, **k):
                out = [e for e in cls.ls(_fs, path, detail=True, **k) if e["name"] not in _hidden]
                return out if detail else [e["name"] for e in out]

            monkeypatch.setattr(fs, "pipe_file", pipe)
            monkeypatch.setattr(fs, "ls", ls)
            w = pmaptap.Writer(url, run="r", process=0)
            f = follow.RunFollower(url)
            got: list = []
            step = 0
            for _ in range(rnd.randrange(5, 40)):
                for _ in range(rnd.randrange(1, 3)):
                    w.write("x", step, float(step))
                    step += 1
                if rnd.random() < 0.15:
                    # This flush's first or second PUT (a retry's, of the
                    # bytes a failed PUT tried, then the rest) fails.
                    fail[:] = [None] * rnd.randrange(2) + [rnd.choice(["landed", "lost"])]
                try:
                    w.flush()
                except pmaptap.TapError as e:
                    assert isinstance(e.__cause__, TimeoutError), e
                    # the records stay; the next flush retries them
                names = cls.ls(fs, prefix + ".d", detail=False)
                chunks = [n for n in names if not store.parse_name(n, 0).rollup]
                r = rnd.random()
                if r < 0.15 and chunks:
                    cls.rm(fs, rnd.choice(chunks))  # someone else's delete
                elif r < 0.3 and chunks:
                    hidden.add(rnd.choice(chunks))  # a listing that lags
                if rnd.random() < 0.2:
                    hidden.clear()
                if rnd.random() < 0.5:
                    got += _poll(f)
            hidden.clear()
            fail.clear()
            w.close()
            got += _poll(f)
            f.close()
            steps = [json.loads(x)["step"] for x in got]  # no torn line
            assert steps == sorted(set(steps)), (seed, steps)
            read = [r["step"] for r in pmaptap.read(url)]
            assert read == sorted(set(read)), (seed, read)
    finally:
        logger.setLevel(level)


def test_a_store_url_without_fsspec_names_the_extra_that_installs_it(monkeypatch):
    """Without fsspec, a URL's read fails with the pip command of the extra
    that installs fsspec and that store's client (s3 or gcs)."""
    monkeypatch.setitem(sys.modules, "fsspec", None)
    monkeypatch.setitem(sys.modules, "fsspec.core", None)
    with pytest.raises(ImportError, match=r'needs fsspec.*pip install "pmaptap\[gcs\]"'):
        store.url_fs("gs://bucket/run.jsonl")
    with pytest.raises(ImportError, match=r'needs fsspec.*pip install "pmaptap\[s3\]"'):
        store.url_fs("s3://bucket/run.jsonl")
