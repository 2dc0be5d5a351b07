"""Session(path, forward=[...]): records reach user code after they are
written, off the writer's critical path; in a multi-process job process 0
forwards every replicated record of the job (forward_replicated)."""

from __future__ import annotations

import json
import math
import os
import re
import threading
import time

import jax
import jax.numpy as jnp
import pytest

import pmaptap
from conftest import job_failed, python_cmd, run_launch, wait_for
from pmaptap.errors import TapError


class CluLike:
    """The CLU MetricWriter protocol, as far as forwarding uses it."""

    def __init__(self) -> None:
        self.scalars: list[tuple[int, dict]] = []
        self.flushes = 0

    def write_scalars(self, step: int, scalars: dict) -> None:
        self.scalars.append((step, dict(scalars)))

    def flush(self) -> None:
        self.flushes += 1


def _body(x):
    pmaptap.tap(jax.lax.pmean(x, "i"), "loss", dedup="replicated")
    pmaptap.tap(x * 2, "g", dedup="per_device")
    pmaptap.tap({"a": x[0] * 0 + 1.5, "v": x}, "tree", dedup="per_device")
    return x


def test_callable_and_clu_writer_get_every_written_record(tap_path):
    got: list[dict] = []
    clu = CluLike()
    f = jax.pmap(lambda x: _body(x), axis_name="i", devices=jax.devices()[:2])
    with pmaptap.Session(tap_path, run="fw", forward=[got.append, clu]):
        for step in range(3):
            f(jnp.stack([jnp.arange(2.0) + step, jnp.arange(2.0) + 10 * step]))
    recs = pmaptap.read(tap_path)
    # The callable saw exactly the file's records, decoded like read().
    assert sorted(json.dumps(r, sort_keys=True) for r in got) == sorted(
        json.dumps(r, sort_keys=True) for r in recs
    )
    assert {r["name"] for r in got} == {"loss", "g", "tree"}
    # CLU: scalars only, grouped per step, tagged like the TensorBoard export.
    by_step: dict[int, dict] = {}
    for step, m in clu.scalars:
        by_step.setdefault(step, {}).update(m)
    assert sorted(by_step) == [0, 1, 2]
    assert by_step[1] == {"tree/a/device_0": 1.5, "tree/a/device_1": 1.5}
    assert clu.flushes >= 1  # close() flushed the writer
    # "loss" and "g" are arrays (shape [2]): not scalars, not sent to CLU.


class Hooked:
    """A forwarder with the optional session hooks: every call, in order,
    with the thread it ran on."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def open(self, run, attempt):
        self.calls.append(("open", run, attempt, threading.current_thread().name))

    def __call__(self, rec):
        self.calls.append(("record", rec["step"]))

    def flush(self):
        self.calls.append(("flush",))

    def end(self, outcome):
        self.calls.append(("end", outcome, threading.current_thread().name))


def test_forwarder_hooks_open_first_and_end_last_with_the_outcome(tap_path):
    f = jax.pmap(lambda x, i: pmaptap.tap(x, "x", step=i, dedup="per_device"), in_axes=(0, None))
    fw = Hooked()
    with pmaptap.Session(tap_path, run="hooks", forward=[fw]):
        for i in range(3):
            f(jnp.arange(8.0), i)
    first, *middle, last = fw.calls
    # open(run, attempt) with the session's run id, before any record; on the
    # forwarding thread, as every other call.
    assert first[:3] == ("open", "hooks", 0) and first[3].startswith("pmaptap-forward")
    assert sorted(c[1] for c in middle if c[0] == "record") == sorted(list(range(3)) * 8)
    assert middle[-1] == ("flush",)  # the records, flushed, then the end
    assert last[:2] == ("end", "finished") and last[2].startswith("pmaptap-forward")
    # A resumed attempt opens with its number; an exception leaving the
    # block ends it "failed" (the exception is the user's, unchanged).
    again = Hooked()
    with pytest.raises(RuntimeError, match="boom"):
        with pmaptap.Session(tap_path, run="hooks", resume=True, forward=[again]):
            f(jnp.arange(8.0), 2)
            raise RuntimeError("boom")
    assert again.calls[0][:3] == ("open", "hooks", 1)
    assert again.calls[-1][:2] == ("end", "failed")
    # A forwarder without the hooks is not required to have them; one whose
    # hook raises is reported like a failed record, the others go on.

    class Broken(Hooked):
        def open(self, run, attempt):
            raise ValueError("no dashboard")

    broken, got = Broken(), []
    with pytest.raises(TapError, match=r"forwarder .*Broken failed 1 time.*no dashboard"):
        with pmaptap.Session(tap_path, run="hooks2", forward=[broken, got.append]):
            f(jnp.arange(8.0), 0)
    assert len(got) == 8 and broken.calls[-1][:2] == ("end", "finished")


def test_scalar_loss_and_nonfinite_reach_clu(tap_path):
    clu = CluLike()
    f = jax.jit(lambda v, s: pmaptap.tap(v, "loss", step=s))
    with pmaptap.Session(tap_path, run="fw", forward=[clu]):
        f(jnp.float32(0.5), 0)
        f(jnp.float32(jnp.nan), 1)
    assert [s for s, _ in clu.scalars] == [0, 1]
    assert clu.scalars[0][1] == {"loss": 0.5}
    assert math.isnan(clu.scalars[1][1]["loss"])


def test_raising_forwarder_never_stops_the_file_and_is_reported_once(tap_path):
    calls = []

    def bad(rec):
        calls.append(rec["step"])
        raise ValueError("dashboard down")

    f = jax.jit(lambda v, s: pmaptap.tap(v, "x", step=s))
    s = pmaptap.Session(tap_path, run="fw", forward=[bad]).open()
    try:
        for i in range(5):
            f(jnp.float32(i), i)
        with pytest.raises(TapError, match=r"bad failed 5 time\(s\).*dashboard down"):
            s.flush()
        s.flush()  # reported once, then clear
        f(jnp.float32(9), 9)
    finally:
        with pytest.raises(TapError, match="failed 1 time"):
            s.close()
    assert [r["step"] for r in pmaptap.read(tap_path)] == [0, 1, 2, 3, 4, 9]
    assert calls == [0, 1, 2, 3, 4, 9]


def test_slow_forwarder_blocks_neither_taps_nor_the_file(tap_path):
    release = threading.Event()
    seen = []

    def slow(rec):
        release.wait(30)
        seen.append(rec["step"])

    f = jax.jit(lambda v, s: pmaptap.tap(v, "x", step=s))
    s = pmaptap.Session(tap_path, run="fw", forward=[slow], forward_timeout=0.2).open()
    try:
        t0 = time.monotonic()
        for i in range(20):
            f(jnp.float32(i), i).block_until_ready()
        s.flush()  # written; forwarding waits only 0.2 s
        assert time.monotonic() - t0 < 20
        assert len(pmaptap.read(tap_path)) == 20
        assert seen == []
    finally:
        release.set()
        s.close()
    assert seen == list(range(20))


def test_full_forward_queue_drops_oldest_and_reports(tap_path):
    release = threading.Event()
    seen = []

    def slow(rec):
        release.wait(30)
        seen.append(rec["step"])

    f = jax.jit(lambda v, s: pmaptap.tap(v, "x", step=s))
    s = pmaptap.Session(tap_path, run="fw", forward=[slow], forward_timeout=0.1)
    s.open()
    s.pipeline.forwarders.max_pending = 5
    try:
        for i in range(30):
            f(jnp.float32(i), i).block_until_ready()
        # Written in full; the forwarder (stuck on its first record) kept
        # only the newest 5 of the rest.
        with pytest.raises(TapError, match=r"\d+ record\(s\) were not forwarded"):
            s.flush()
        assert len(pmaptap.read(tap_path)) == 30
        release.set()
    finally:
        release.set()
        s.close()
    assert len(pmaptap.read(tap_path)) == 30  # the file has them all
    assert seen[-1] == 29 and len(seen) < 30
    assert s.pipeline.forwarders.dropped_total == 30 - len(seen)


class BlockingFlush(CluLike):
    """A CLU-protocol writer whose flush() blocks (a dashboard that hangs)."""

    def __init__(self, release: threading.Event) -> None:
        super().__init__()
        self.release = release
        self.in_flush = threading.Event()
        self.flush_returned = threading.Event()

    def flush(self) -> None:
        self.in_flush.set()
        self.release.wait(60)
        self.flush_returned.set()


def test_forwarder_flush_that_blocks_holds_neither_flush_nor_close(tap_path):
    # The forwarder's flush() ran on the caller's thread: Session.flush() and
    # close() blocked as long as it did, whatever forward_timeout said.
    release = threading.Event()
    clu = BlockingFlush(release)
    f = jax.jit(lambda v, s: pmaptap.tap(v, "loss", step=s))
    s = pmaptap.Session(tap_path, run="fw", forward=[clu], forward_timeout=0.5).open()
    try:
        for i in range(3):
            f(jnp.float32(i), i).block_until_ready()
        wait_for(lambda: len(clu.scalars) == 3, 60, "the 3 records forwarded")
        s.flush()  # written; the forwarders get forward_timeout, no more
        assert len(pmaptap.read(tap_path)) == 3
        # flush() asked for the forwarder's flush() and returned without it.
        assert clu.in_flush.wait(60) and not clu.flush_returned.is_set()
        with pytest.raises(TapError, match=r"BlockingFlush's flush\(\) had not returned") as e:
            s.close()
        assert "forward_timeout=0.5" in str(e.value) and "not forwarded" not in str(e.value)
        # close() returned while the forwarder's flush() was still blocked.
        assert not clu.flush_returned.is_set()
    finally:
        release.set()
        s.close()
    assert sorted(st for st, _ in clu.scalars) == [0, 1, 2]
    assert len(pmaptap.read(tap_path)) == 3


@pytest.mark.parametrize("exc", [SystemExit(3), KeyboardInterrupt()], ids=repr)
def test_forwarder_raising_systemexit_or_keyboardinterrupt_is_named_and_forwarding_goes_on(
    tap_path, exc
):
    # It killed the forwarding thread (a traceback on stderr), and close()
    # blamed "fell behind" without naming it.
    seen, got = [], []

    def quits(rec):
        seen.append(rec["step"])
        if rec["step"] == 2:
            raise exc

    f = jax.jit(lambda v, s: pmaptap.tap(v, "x", step=s))
    s = pmaptap.Session(tap_path, run="fw", forward=[quits, got.append]).open()
    try:
        for i in range(6):
            f(jnp.float32(i), i).block_until_ready()
    finally:
        with pytest.raises(TapError) as e:
            s.close()
    msg = str(e.value)
    assert f"quits failed 1 time(s), first: {exc!r}" in msg, msg
    assert "not forwarded" not in msg and "behind" not in msg, msg
    assert s.pipeline.forwarders.thread.is_alive() is False
    assert seen == [0, 1, 2, 3, 4, 5]
    assert [r["step"] for r in got] == [0, 1, 2, 3, 4, 5]


def test_not_forwarded_count_includes_the_records_in_the_threads_hands(tap_path):
    # close() counted only what was still queued, not the batch the thread
    # had taken (90 reported, 539 true). Now: every record whose forwarding
    # had not completed when close() stopped waiting, and nothing is handed
    # over after that.
    release = threading.Event()
    started, returned = [], []

    def stuck(rec):
        started.append(rec["step"])
        if len(started) == 5:
            release.wait(60)
        returned.append(rec["step"])

    f = jax.jit(lambda v, s: pmaptap.tap(v, "x", step=s))
    s = pmaptap.Session(tap_path, run="fw", forward=[stuck], forward_timeout=0.5).open()
    try:
        for i in range(30):
            f(jnp.float32(i), i).block_until_ready()
        s.flush()
        wait_for(lambda: len(started) == 5, 60, "the forwarder blocked on its 5th record")
        with pytest.raises(TapError, match=r"(\d+) record\(s\) were not forwarded") as e:
            s.close()
        done_at_close = len(returned)
    finally:
        release.set()
        s.close()
    reported = int(re.search(r"(\d+) record\(s\) were not forwarded", str(e.value)).group(1))
    assert done_at_close == 4
    assert reported == 30 - done_at_close, str(e.value)
    assert re.search(r"forwarder \S*\.stuck had not returned", str(e.value)), str(e.value)
    fw = s.pipeline.forwarders
    fw.thread.join(30)
    assert not fw.thread.is_alive()
    # The blocked call finished after close(); no other call began.
    assert started == [0, 1, 2, 3, 4] and fw.dropped_total == reported
    assert len(pmaptap.read(tap_path)) == 30


@pytest.mark.parametrize("bad", ["x", 3, [3], print])
def test_bad_forward_argument_is_refused_at_construction(tap_path, bad):
    with pytest.raises(TypeError, match="forward"):
        pmaptap.Session(tap_path, forward=bad)


_JOB = """
    import json, os, jax, jax.numpy as jnp, pmaptap, pmaptap.distributed as dist
    dist.initialize()
    p = jax.process_index()
    calls, scalars = [], []

    class Clu:
        def write_scalars(self, step, mapping):
            scalars.append([step, mapping])

    def body(x):
        loss = jax.lax.pmean(x, "i")
        pmaptap.tap(loss, "loss", dedup="replicated")
        pmaptap.tap(x, "x", dedup="per_device")
        return x

    f = jax.pmap(body, axis_name="i")
    opts = json.loads(os.environ.get("OPTS", "{}"))
    # LAG0: process 0's writer holds its lines until close() and process 1
    # writes step 0 before step 1 can run anywhere (the pmean joins them), so
    # process 1 writes replicated records first, whatever the scheduling.
    lag0 = os.environ.get("LAG0") == "1"
    if lag0 and p == 0:
        opts["flush_interval"] = 600.0
    with pmaptap.Session(os.environ["TAP"], forward=[calls.append, Clu()], **opts) as s:
        for step in range(int(os.environ.get("STEPS", "3"))):
            f(jnp.arange(jax.local_device_count(), dtype=jnp.float32)
              + 2 * p + 10 * step)
            if lag0 and p == 1 and step == 0:
                s.flush()
    with open(os.path.join(os.environ["OUT"], f"p{p}.json"), "w") as fh:
        json.dump({"calls": calls, "scalars": scalars}, fh)
"""


def test_two_process_job_forwards_the_replicated_loss_once(tmp_path):
    """forward_replicated="written": each process forwards what it wrote,
    so the job's records reach the two processes' forwarders once in all."""
    tap, out = str(tmp_path / "job.jsonl"), str(tmp_path / "fw")
    os.makedirs(out)
    proc, _ = run_launch(
        2,
        2,
        python_cmd(_JOB),
        launcher_timeout=90,
        TAP=tap,
        OUT=out,
        OPTS=json.dumps({"forward_replicated": "written"}),
    )
    assert proc.returncode == 0, job_failed(proc)
    per = [json.load(open(os.path.join(out, f"p{p}.json"))) for p in (0, 1)]
    calls = [r for d in per for r in d["calls"]]
    # The callables of the two processes together saw each record once.
    loss = [r for r in calls if r["name"] == "loss"]
    assert sorted(r["step"] for r in loss) == [0, 1, 2]
    # pmean of (k + 2p + 10 s) over k in 0..1, p in 0..1: 1.5 + 10 s.
    assert {r["step"]: r["value"] for r in loss} == {0: 1.5, 1: 11.5, 2: 21.5}
    # Per-device records: each process forwards its own devices.
    xs = sorted((r["step"], r["device"]) for r in calls if r["name"] == "x")
    assert len(xs) == 12 and len(set(xs)) == 12
    for p, d in enumerate(per):
        assert {r["process"] for r in d["calls"] if r["name"] == "x"} == {p}
    file_recs = pmaptap.read(tap)
    assert sorted(json.dumps(r, sort_keys=True) for r in calls) == sorted(
        json.dumps(r, sort_keys=True) for r in file_recs
    )
    # The CLU-protocol objects: the loss once per step for the job, and each
    # device's scalar once.
    loss_points = [(s, m["loss"]) for d in per for s, m in d["scalars"] if "loss" in m]
    assert sorted(loss_points) == [(0, 1.5), (1, 11.5), (2, 21.5)]
    dev_points = [
        (s, k) for d in per for s, m in d["scalars"] for k in m if k.startswith("x/device_")
    ]
    assert len(dev_points) == 12 and len(set(dev_points)) == 12


@pytest.mark.parametrize("layout", ["file", "sharded"])
def test_process0_forwards_the_whole_replicated_curve_once(tmp_path, layout):
    """The default: process 0's forwarders get every replicated step of the
    job exactly once, whichever process wrote it to the file (the dedup
    splits the writing over both); process 1's get none. Per-device records
    reach the forwarders of the process that holds the device."""
    steps = 30
    tap, out = str(tmp_path / "job.jsonl"), str(tmp_path / "fw")
    os.makedirs(out)
    proc, _ = run_launch(
        2,
        2,
        python_cmd(_JOB),
        launcher_timeout=150,
        timeout=240,
        TAP=tap,
        OUT=out,
        STEPS=str(steps),
        OPTS=json.dumps({"layout": layout}),
        LAG0="1",
    )
    assert proc.returncode == 0, job_failed(proc)
    per = [json.load(open(os.path.join(out, f"p{p}.json"))) for p in (0, 1)]
    loss0 = [r for r in per[0]["calls"] if r["name"] == "loss"]
    assert sorted(r["step"] for r in loss0) == list(range(steps))
    assert {r["step"]: r["value"] for r in loss0} == {s: 1.5 + 10 * s for s in range(steps)}
    assert [r for r in per[1]["calls"] if r["kind"] == "replicated"] == []
    file_loss = [r for r in pmaptap.read(tap) if r["name"] == "loss"]
    # The file holds each step once, and process 1 wrote some of them (LAG0
    # makes sure): the case that used to cost process 0 part of its curve.
    assert sorted(r["step"] for r in file_loss) == list(range(steps))
    assert 1 in {r["process"] for r in file_loss}, "process 1 wrote no loss record"
    # What process 0 forwarded is the file's loss, as process 0 computed it
    # (its own "process" and "time" where process 1 wrote the line).

    def same(r):
        return json.dumps({k: v for k, v in r.items() if k not in ("process", "time")})

    assert sorted(map(same, loss0)) == sorted(map(same, file_loss))
    assert {r["process"] for r in loss0} == {0}
    points = [(s, m["loss"]) for s, m in per[0]["scalars"] if "loss" in m]
    assert sorted(points) == [(s, 1.5 + 10 * s) for s in range(steps)]
    assert not any("loss" in m for _, m in per[1]["scalars"])
    # Per-device records: each device's step once, on its own process.
    for p, d in enumerate(per):
        xs = [(r["step"], r["device"]) for r in d["calls"] if r["name"] == "x"]
        assert len(xs) == 2 * steps and len(set(xs)) == 2 * steps
        assert {r["process"] for r in d["calls"] if r["name"] == "x"} == {p}
    file_x = [r for r in pmaptap.read(tap) if r["name"] == "x"]
    forwarded_x = [r for d in per for r in d["calls"] if r["name"] == "x"]
    assert sorted(json.dumps(r, sort_keys=True) for r in forwarded_x) == sorted(
        json.dumps(r, sort_keys=True) for r in file_x
    )


def test_forward_replicated_is_checked(tap_path):
    with pytest.raises(ValueError, match="forward_replicated must be one of"):
        pmaptap.Session(tap_path, forward_replicated="process_0")


def test_forward_replicated_all_gives_every_process_its_own_copy(tmp_path):
    """forward_replicated="all": each process forwards every replicated
    record it computed (its own "process"), whoever wrote the line."""
    steps = 6
    tap, out = str(tmp_path / "job.jsonl"), str(tmp_path / "fw")
    os.makedirs(out)
    proc, _ = run_launch(
        2,
        2,
        python_cmd(_JOB),
        launcher_timeout=90,
        TAP=tap,
        OUT=out,
        STEPS=str(steps),
        OPTS=json.dumps({"forward_replicated": "all"}),
    )
    assert proc.returncode == 0, job_failed(proc)
    for p in (0, 1):
        d = json.load(open(os.path.join(out, f"p{p}.json")))
        loss = [r for r in d["calls"] if r["name"] == "loss"]
        assert sorted(r["step"] for r in loss) == list(range(steps))
        assert {r["process"] for r in loss} == {p}
        assert {r["process"] for r in d["calls"] if r["name"] == "x"} == {p}
    assert sorted(r["step"] for r in pmaptap.read(tap) if r["name"] == "loss") == list(range(steps))
