"""A process that opens its session late (issue 24.1): every replicated value
is written once per run, however late each process of the job opens."""

from __future__ import annotations

import os

import pytest

import pmaptap
from conftest import job_failed, python_cmd, run_launch
from pmaptap import cli
from pmaptap.tapfile.record.format import Record

# Plain jit over the job's 8 devices (2 processes x 4): nothing holds the
# processes together at each step, so process 1, after a "slow setup", opens
# its session only once process 0 has written all its steps.
LATE = """
    import os, time, jax, jax.numpy as jnp, numpy as np, pmaptap
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from pmaptap import distributed
    distributed.initialize()
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    def put(spec):
        s = NamedSharding(mesh, spec)
        full = np.arange(64.0, dtype=np.float32).reshape(8, 8)
        return jax.make_array_from_callback((8, 8), s, lambda i: full[i])
    @jax.jit
    def step(a, b, i):
        pmaptap.tap(jnp.sin(a) + i, "pd", step=i, dedup="per_device")
        # Replicated along "data": each slice has holders on both processes.
        pmaptap.tap(jnp.cos(b) + i, "rep", step=i, dedup="auto")
        return a
    a, b = put(P("data", "model")), put(P(None, "model"))
    path, done = os.environ["TAP"], os.environ["TAP"] + ".p0-wrote"
    if jax.process_index() == 1:
        while not os.path.exists(done):  # the slow setup
            time.sleep(0.05)
    with pmaptap.Session(path, run="late", layout=os.environ["LAYOUT"]) as s:
        for i in range(3):
            step(a, b, i)
        s.flush()
        if jax.process_index() == 0:
            open(done, "w").close()
    print("OPENED", jax.process_index(), flush=True)
"""


@pytest.mark.parametrize("layout", ["file", "sharded"])
def test_a_process_opening_late_writes_no_replicated_value_twice(tmp_path, layout):
    path = str(tmp_path / "late.jsonl")
    proc, _ = run_launch(
        2, 4, python_cmd(LATE), timeout=300, launcher_timeout=240, TAP=path, LAYOUT=layout
    )
    assert proc.returncode == 0, job_failed(proc)
    recs = pmaptap.read(path)
    rep = [(r["step"], r["index"][1][0], r["process"]) for r in recs if r["name"] == "rep"]
    # 3 steps x 2 slices, each written once for the job (by whichever
    # process got there first), naming its holders on both processes.
    assert sorted(k[:2] for k in rep) == [(i, c) for i in range(3) for c in (0, 4)], rep
    for r in recs:
        if r["name"] == "rep":
            assert r["processes"] == [0, 1] and not r.get("divergent"), r
    assert len([r for r in recs if r["name"] == "pd"]) == 3 * 8
    assert cli.main(["validate", path]) == 0


def _loss(run, step, process, vhash=None):
    return Record(
        run=run,
        name="loss",
        step=step,
        kind="replicated",
        value=float(step),
        dtype="float32",
        shape=[],
        process=process,
        time=1.0,
        host="h",
        replicas=1,
        vhash=vhash or f"{step:x}",
    )


@pytest.mark.parametrize("chunk", [64, 1 << 24])
def test_late_sink_indexes_from_the_agreed_start_not_before(tmp_path, monkeypatch, chunk):
    """The sink side of the fix: a late writer indexes every line from the
    run's start on (read a chunk at a time, lines split across chunks, the
    start inside a line), and nothing before it: an earlier job's records
    under the same run id are not this job's."""
    from pmaptap._host.sinks import file as sink_mod

    monkeypatch.setattr(sink_mod, "_READ_CHUNK", chunk)
    path = str(tmp_path / "t.jsonl")
    early = sink_mod.FileSink(path, process=0)
    early.write([_loss("r", s, 0) for s in range(100, 103)])  # an earlier job
    # The agreed start falls inside the earlier job's last line (a size seen
    # while another job was appending): that line is not indexed, nor counted.
    start = os.path.getsize(path) - 10
    first = sink_mod.FileSink(path, process=0)
    first.index_from(start)
    first.write([_loss("r", s, 0) for s in range(50)])
    late = sink_mod.FileSink(path, process=1)
    late.index_from(start)
    assert late.bytes_read == 0  # nothing read at open
    kept = late.write([_loss("r", s, 1) for s in [*range(50), 100]])
    # Steps 0-49 are this job's, written by process 0: skipped. Step 100 is
    # only in the earlier job's part: written.
    assert [r.step for r in kept] == [100]
    assert late.corrupt_lines == 0 and late.index.skipped == 50
    assert late.bytes_read == os.path.getsize(path) - start - len(kept[0].encode())
    # A start past the end of the file a late writer finds (it was truncated
    # in between): all of it is this job's.
    open(path, "w").close()
    first.write([_loss("r", 7, 0)])
    again = sink_mod.FileSink(path, process=1)
    again.index_from(start)
    assert again.write([_loss("r", 7, 1), _loss("r", 8, 1)])[0].step == 8
    for s in (early, first, late, again):
        s.close()


def test_a_long_catch_up_is_read_before_taking_the_lock(tmp_path, monkeypatch):
    """A writer far behind (a late opener) reads what it missed without the
    lock, so the others keep writing meanwhile; only the rest is read under it."""
    from pmaptap._host.sinks import file as sink_mod

    monkeypatch.setattr(sink_mod, "_READ_CHUNK", 1000)
    path = str(tmp_path / "t.jsonl")
    first = sink_mod.FileSink(path, process=0)
    first.write([_loss("r", s, 0) for s in range(200)])
    late = sink_mod.FileSink(path, process=1)
    late.index_from(0)
    seen_under_lock = []
    acquire = late._acquire

    def spy():
        seen_under_lock.append(late._seen)
        acquire()

    monkeypatch.setattr(late, "_acquire", spy)
    assert late.write([_loss("r", s, 1) for s in range(201)])[0].step == 200
    # Under the lock, at most the last chunk's worth was left to read.
    assert os.path.getsize(path) - len(_loss("r", 200, 1).encode()) - seen_under_lock[0] < 1000
    first.close()
    late.close()
