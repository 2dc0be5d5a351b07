"""Resuming a run after a restart: later attempts supersede replayed steps
(issue 16.2, 16.3)."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import pmaptap
from conftest import logs_warning, record_dict, run_python
from pmaptap.tapfile.analyze.summary import summarize_file
from pmaptap.tapfile.analyze.table import summary_table
from pmaptap.tapfile.analyze.validate import validate_file
from pmaptap.tapfile.read.query import Filter


def _train(path, steps, offset, devices, **session):
    """A pmap'd step over ``devices`` devices tapping a per-device value and
    a replicated one; ``offset`` marks which attempt wrote a value."""
    f = jax.pmap(
        lambda x, i: (
            pmaptap.tap(x + i + offset, "w", step=i, dedup="per_device"),
            pmaptap.tap(jax.lax.psum(x, "d") * 0 + i + offset, "loss", step=i),
        )[0],
        axis_name="d",
        devices=jax.devices()[:devices],
        in_axes=(0, None),
    )
    with pmaptap.Session(path, **session) as s:
        for i in steps:
            f(jnp.arange(float(devices)), i)
    return s


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "pmaptap", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_resume_supersedes_replayed_steps_and_every_reader_shows_one_story(tap_path):
    _train(tap_path, range(8), 0.0, 4, run="r")
    s = _train(tap_path, range(5, 10), 100.0, 4, run="r", resume=True)
    assert (s.run, s.attempt) == ("r", 1)
    recs = pmaptap.read(tap_path)
    w = [r for r in recs if r["name"] == "w"]
    keys = [(r["step"], r["device"]) for r in w]
    assert sorted(keys) == [(i, d) for i in range(10) for d in range(4)]  # one each
    for r in w:
        want = (100.0 if r["step"] >= 5 else 0.0) + r["step"] + r["device"]
        assert r["value"] == want and r.get("attempt", 0) == (r["step"] >= 5)
    loss = {r["step"]: r["value"] for r in recs if r["name"] == "loss"}
    assert loss == {i: i + (100.0 if i >= 5 else 0.0) for i in range(10)}
    # Every attempt on request, tagged.
    every = pmaptap.read(tap_path, attempts="all")
    assert len([r for r in every if r["name"] == "w"]) == 4 * (8 + 5)
    assert {r["attempt"] for r in every} == {0, 1}
    with pytest.raises(ValueError, match="attempts"):
        pmaptap.read(tap_path, attempts="newest")
    # The file stays append-only: the first attempt's lines are all there.
    lines = open(tap_path).read().splitlines()
    assert sum('"attempt"' not in line for line in lines) == 4 * 8 + 8
    meta = [json.loads(x) for x in lines if "pmaptap/attempt" in x]
    assert len(meta) == 1 and meta[0]["attempt"] == 1 and meta[0]["device_count"] == 8
    # validate: clean, the superseded records named as such.
    report = validate_file(tap_path)
    assert report.ok, report.problems
    assert report.superseded == 4 * 3 + 3
    out = _cli("validate", tap_path)
    assert out.returncode == 0 and "15 record(s) superseded" in out.stdout, out.stdout
    # summary: the restart, no duplicates, steps 0-9 complete.
    sums, _, _, _ = summarize_file(tap_path)
    table = summary_table(sums)
    assert "2 attempts; restarted at step 5" in table, table
    by = {x.name: x for x in sums}
    assert by["w"].records == 40 and by["w"].duplicates == 0 and not by["w"].incomplete_steps
    assert by["loss"].records == 10 and not by["loss"].divergent_steps
    all_sums, _, _, _ = summarize_file(tap_path, Filter(all_attempts=True))
    assert {x.name: x.records for x in all_sums}["w"] == 52
    # show / export / summary on the command line.
    out = _cli("show", tap_path, "--name", "loss", "--json")
    assert [json.loads(x)["value"] for x in out.stdout.splitlines()] == [
        i + (100.0 if i >= 5 else 0.0) for i in range(10)
    ]
    out = _cli("show", tap_path, "--name", "loss", "--json", "--all-attempts")
    assert len(out.stdout.splitlines()) == 13
    out = _cli("export", tap_path, "--name", "w", "--csv", "-")
    rows = list(csv.DictReader(io.StringIO(out.stdout)))
    assert len(rows) == 40
    out = _cli("summary", tap_path)
    assert "restarted at step 5" in out.stdout, out.stdout


def test_resume_without_run_continues_the_last_run_of_the_file(tap_path):
    _train(tap_path, range(4), 0.0, 2, run="old")
    _train(tap_path, range(6), 0.0, 2)  # an automatic run id
    first_run = pmaptap.read(tap_path)[-1]["run"]
    s1 = _train(tap_path, range(3, 6), 10.0, 2, resume=True)
    s2 = _train(tap_path, range(5, 7), 20.0, 2, resume=True)
    assert (s1.run, s1.attempt, s2.run, s2.attempt) == (first_run, 1, first_run, 2)
    loss = {
        r["step"]: r["value"]
        for r in pmaptap.read(tap_path)
        if r["name"] == "loss" and r["run"] == first_run
    }
    assert loss == {0: 0.0, 1: 1.0, 2: 2.0, 3: 13.0, 4: 14.0, 5: 25.0, 6: 26.0}
    sums, _, _, _ = summarize_file(tap_path)
    assert "3 attempts; restarted at steps 3, 5" in summary_table(sums)
    # The other run is untouched.
    assert len([r for r in pmaptap.read(tap_path) if r["run"] == "old"]) == 4 * 2 + 4


def test_resume_on_a_new_file_is_a_first_attempt(tap_path, monkeypatch):
    s = _train(tap_path, range(2), 0.0, 2, resume=True)
    assert s.attempt == 0
    assert not any(
        "attempt" in r and r["kind"] != "meta" for r in pmaptap.read(tap_path, attempts="latest")
    )
    monkeypatch.setenv("PMAPTAP_ATTEMPT", "3")
    s = _train(tap_path, range(1, 2), 5.0, 2, resume=True)
    assert s.attempt == 3 and s.run == pmaptap.read(tap_path)[0]["run"]
    monkeypatch.setenv("PMAPTAP_ATTEMPT", "x")
    with pytest.raises(ValueError, match="PMAPTAP_ATTEMPT"):
        pmaptap.Session(tap_path, resume=True).open()


def test_elastic_restart_supersedes_a_replayed_step_as_a_whole(tap_path):
    # 8 devices, then a restart on 4: the old attempt's records of devices
    # 4-7 for the replayed steps must not survive next to the new ones.
    _train(tap_path, range(6), 0.0, 8, run="e")
    _train(tap_path, range(3, 6), 50.0, 4, run="e", resume=True)
    w = [r for r in pmaptap.read(tap_path) if r["name"] == "w"]
    devices = {}
    for r in w:
        devices.setdefault(r["step"], set()).add(r["device"])
    assert devices == {
        **{i: set(range(8)) for i in range(3)},
        **{i: set(range(4)) for i in range(3, 6)},
    }
    assert all(r["value"] == 50.0 + r["step"] + r["device"] for r in w if r["step"] >= 3)
    report = validate_file(tap_path)
    assert report.ok and report.superseded == 8 * 3 + 3
    sums, _, _, _ = summarize_file(tap_path)
    # Fewer devices after an elastic restart is not "steps missing devices".
    w_sum = {x.name: x for x in sums}["w"]
    assert w_sum.records == 8 * 3 + 4 * 3 and not w_sum.incomplete_steps


def test_divergence_and_supersession_are_judged_within_an_attempt(tmp_path, caplog):
    # Hand-written lines: step 1 replayed by attempt 1, whose two processes
    # disagree (a divergence); step 0's values differ between attempts only
    # (a supersession, not a divergence).
    def rec(step, value, process, attempt, vhash):
        d = record_dict(
            name="loss",
            step=step,
            value=value,
            dtype="float32",
            process=process,
            devices=[process],
            processes=[process],
            vhash=vhash,
        )
        if attempt:
            d["attempt"] = attempt
        return json.dumps(d)

    path = tmp_path / "t.jsonl"
    path.write_text(
        "\n".join(
            [
                rec(0, 1.0, 0, 0, "a"),
                rec(1, 2.0, 0, 0, "b"),
                rec(1, 2.0, 1, 0, "b"),
                rec(0, 5.0, 0, 1, "c"),
                rec(1, 6.0, 0, 1, "d"),
                rec(1, 7.0, 1, 1, "e"),
            ]
        )
        + "\n"
    )
    recs = pmaptap.read(path)
    assert [(r["step"], r["value"], bool(r.get("divergent"))) for r in recs] == [
        (0, 5.0, False),
        (1, 6.0, True),
        (1, 7.0, True),
    ]
    sums, _, _, _ = summarize_file(path)
    assert sums[0].divergent_steps == (1,) and sums[0].records == 3
    assert validate_file(path).superseded == 3
    bad = path.read_text().replace('"attempt": 1', '"attempt": -1', 1)
    path.write_text(bad)
    with logs_warning(caplog, "attempt must be a non-negative integer"):
        pmaptap.read(path)


def test_resume_point_reads_the_last_run_from_the_end_of_a_large_file(tmp_path):
    from pmaptap._host.session.runid import _last_attempt, _last_run

    def line(run, step, attempt=0):
        d = record_dict(run=run, name="x", step=step)
        if attempt:
            d["attempt"] = attempt
        return json.dumps(d, separators=(",", ":")) + "\n"

    path = tmp_path / "t.jsonl"
    with open(path, "w") as f:
        f.write(line("a", 0))
        f.write(line("b", 0) + line("b", 1, attempt=2) + line("a", 1, attempt=1))
        f.write("x" * (3 << 20) + "\n")  # 3 MiB of garbage after the last record
        f.write('{"torn')  # and a torn last line
    assert _last_run(str(path)) == "a"
    assert _last_attempt(str(path), None) == ("a", 1)
    assert _last_attempt(str(path), "b") == ("b", 2)
    assert _last_attempt(str(path), "c") == ("c", None)
    assert _last_attempt(str(tmp_path / "none.jsonl"), None) == (None, None)


def test_plot_and_tensorboard_export_show_the_latest_attempt(tap_path, tmp_path):
    pytest.importorskip("matplotlib")
    ea_mod = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    from read_definitions import load_matching

    from pmaptap.tapfile.export import tensorboard
    from pmaptap.tapfile.export.plot import build_figure

    _train(tap_path, range(6), 0.0, 8, run="p")
    _train(tap_path, range(3, 6), 50.0, 4, run="p", resume=True)  # elastic
    want = {i: i + (50.0 if i >= 3 else 0.0) for i in range(6)}
    import matplotlib.pyplot as plt

    for flt, n_lines in ((Filter(), 8), (Filter(all_attempts=True), 8)):
        entries = load_matching(tap_path, flt)[0]
        fig = build_figure([e.rec for e in entries], "w")
        lines = [line for ax in fig.axes for line in ax.get_lines()]  # a panel each
        assert len(lines) == n_lines
        xs = sorted(len(line.get_xdata()) for line in lines)
        # Devices 4-7 exist only for steps 0-2 unless every attempt is shown.
        assert xs == ([3] * 4 + [6] * 4 if not flt.all_attempts else [6] * 8)
        plt.close(fig)
    fig = build_figure([e.rec for e in load_matching(tap_path, Filter())[0]], "loss")
    (line,) = fig.axes[0].get_lines()
    assert dict(zip(line.get_xdata(), line.get_ydata())) == want
    plt.close(fig)
    stats, _ = tensorboard.export(tap_path, tmp_path / "tb", Filter(names=("loss",)))
    assert stats.records == 6
    ea = ea_mod.EventAccumulator(str(tmp_path / "tb" / "p"), size_guidance={"scalars": 0})
    ea.Reload()
    (tag,) = [t for t in ea.Tags()["scalars"] if "loss" in t]
    assert {e.step: e.value for e in ea.Scalars(tag)} == want
    stats, _ = tensorboard.export(
        tap_path, tmp_path / "tb2", Filter(names=("loss",), all_attempts=True)
    )
    assert stats.records == 9


def test_resume_numbered_0_by_the_environment_still_continues_above_the_file(tap_path, monkeypatch):
    """PMAPTAP_ATTEMPT is a floor: a resumed session of a run that already
    has attempts continues above them (issue 24.2), never as a second attempt
    0 (plain duplicates) or below an attempt that would hide it."""
    _train(tap_path, range(6), 0.0, 2, run="r")
    monkeypatch.setenv("PMAPTAP_ATTEMPT", "0")
    s1 = _train(tap_path, range(3, 6), 10.0, 2, run="r", resume=True)
    monkeypatch.setenv("PMAPTAP_ATTEMPT", "5")
    s2 = _train(tap_path, range(4, 6), 20.0, 2, run="r", resume=True)
    monkeypatch.setenv("PMAPTAP_ATTEMPT", "1")
    s3 = _train(tap_path, range(5, 7), 30.0, 2, run="r", resume=True)
    assert (s1.attempt, s2.attempt, s3.attempt) == (1, 5, 6)
    loss = {r["step"]: r["value"] for r in pmaptap.read(tap_path) if r["name"] == "loss"}
    assert loss == {0: 0.0, 1: 1.0, 2: 2.0, 3: 13.0, 4: 24.0, 5: 35.0, 6: 36.0}
    report = validate_file(tap_path)
    assert report.ok and report.superseded == 3 * 3 + 2 * 3 + 1 * 3, (
        report.problems,
        report.superseded,
    )


def test_show_all_attempts_names_the_attempt_of_every_record(tap_path):
    _train(tap_path, range(3), 0.0, 2, run="s")
    _train(tap_path, range(1, 3), 100.0, 2, run="s", resume=True)
    out = _cli("show", tap_path, "--name", "loss", "--json", "--all-attempts")
    got = [(r["step"], r["attempt"], r["value"]) for r in map(json.loads, out.stdout.split())]
    # attempt 0 written out too, as read(path, attempts="all") gives it.
    assert got == [(0, 0, 0.0), (1, 0, 1.0), (2, 0, 2.0), (1, 1, 101.0), (2, 1, 102.0)]
    assert got == [
        (r["step"], r["attempt"], r["value"])
        for r in pmaptap.read(tap_path, attempts="all")
        if r["name"] == "loss"
    ]
    # The table has an attempt column, only with --all-attempts.
    out = _cli("show", tap_path, "--name", "loss", "--all-attempts")
    header, *rows = out.stdout.splitlines()
    cols = header.split()
    assert cols[:4] == ["line", "name", "step", "attempt"], header
    assert [(r.split()[2], r.split()[3]) for r in rows] == [
        ("0", "0"),
        ("1", "0"),
        ("2", "0"),
        ("1", "1"),
        ("2", "1"),
    ]
    header = _cli("show", tap_path, "--name", "loss").stdout.splitlines()[0]
    assert "attempt" not in header.split()
    out = _cli("show", tap_path, "--name", "loss", "--json")
    assert all(
        "attempt" not in json.loads(x) or json.loads(x)["attempt"] == 1 for x in out.stdout.split()
    )


_AUTO_STEPS = """
    import os, signal, time, jax, jax.numpy as jnp, pmaptap
    path, attempt = os.environ["TAP"], int(os.environ["ATTEMPT"])
    # A training step whose taps have no step=: automatic counters.
    f = jax.pmap(lambda x: pmaptap.tap(jax.lax.pmean(x, "d"), "loss"), axis_name="d")
    x = lambda i: jnp.full(jax.local_device_count(), float(i))
    if attempt == 0:
        with pmaptap.Session(path, run="auto") as s:
            for i in range(10):
                f(x(i))
            s.flush()
            os.kill(os.getpid(), signal.SIGKILL)  # preempted after step 9
    # The restart resumes from a checkpoint at step 6. Its step function was
    # compiled before the session opened (as a warm-up or an AOT compile
    # does): the tap is refused on the host.
    compiled = f.lower(x(0)).compile()
    s = pmaptap.Session(path, run="auto", resume=True).open()
    for i in range(6, 10):
        compiled(x(i)).block_until_ready()
        # The host sees each refused callback in its own batch, as it does
        # when steps are slow: still one count at close.
        time.sleep(0.1)
    try:
        # Traced now, with the resumed session open: refused where it is written.
        jax.pmap(lambda v: pmaptap.tap(v, "gn"), axis_name="d")(x(0))
    except ValueError as e:
        print("TRACE:", e, flush=True)
    try:
        s.close()
    except pmaptap.TapError as e:
        print("CLOSE:", e, flush=True)
"""


def test_resumed_session_refuses_taps_with_automatic_steps(tap_path):
    """A restart's replay of steps 6-9 numbered 0-3 by the automatic
    counters would supersede the first attempt's real steps 0-3 (read()
    showed the wrong values, validate said OK). Refused instead: at trace
    time naming the tap and step=, and on the host (a step traced before the
    session opened) as a TapError at close, nothing written."""
    first = run_python(_AUTO_STEPS, check=False, devices=2, TAP=tap_path, ATTEMPT="0")
    assert first.returncode == -9, first.stderr
    second = run_python(_AUTO_STEPS, devices=2, TAP=tap_path, ATTEMPT="1")
    (trace,) = [x for x in second.stdout.splitlines() if x.startswith("TRACE:")]
    assert "pmaptap.tap('gn') has no step=" in trace and "Session(resume=True)" in trace
    (close,) = [x for x in second.stdout.splitlines() if x.startswith("CLOSE:")]
    assert "4 callback(s) not written" in close and "pmaptap.tap('loss') has no step=" in close
    recs = [r for r in pmaptap.read(tap_path, attempts="all") if r["kind"] != "meta"]
    # The file holds the first attempt's steps, each with its own value.
    assert sorted((r["step"], r["value"], r.get("attempt", 0)) for r in recs) == [
        (i, float(i), 0) for i in range(10)
    ]
    assert validate_file(tap_path).ok


def test_a_restarted_attempt_on_a_fixed_run_must_resume(tap_path, monkeypatch):
    """PMAPTAP_ATTEMPT >= 1 (a launcher's restart) and a fixed run id, no
    resume=True: SessionError at open, before the file is created, naming
    the run, where it was fixed, and both ways out. The same attempt with
    no fixed run id, or resuming, opens."""
    monkeypatch.setenv("PMAPTAP_ATTEMPT", "1")
    with pytest.raises(pmaptap.SessionError, match=r"attempt 1 .*'fixed' \(run=\).*resume=True"):
        pmaptap.Session(tap_path, run="fixed").open()
    monkeypatch.setenv("PMAPTAP_RUN", "env")
    with pytest.raises(pmaptap.SessionError, match=r"'env' \(PMAPTAP_RUN\)"):
        pmaptap.Session(tap_path).open()
    assert not os.path.exists(tap_path)
    assert pmaptap.active_session() is None
    s = _train(tap_path, range(2), 0.0, 2, resume=True)
    assert (s.run, s.attempt) == ("env", 1)
    monkeypatch.delenv("PMAPTAP_RUN")
    s = _train(tap_path, range(2), 0.0, 2)
    assert s.run != "env" and s.attempt == 0
    monkeypatch.setenv("PMAPTAP_ATTEMPT", "0")  # a first attempt may fix its run
    assert _train(tap_path, range(2), 0.0, 2, run="fixed").run == "fixed"


def _two_sessions(path: str, **opts) -> list:
    """Open two sessions in a row on ``path`` with ``opts``; the second's
    SessionError if it is refused (None if it opens)."""
    out = []
    for _ in range(2):
        try:
            with pmaptap.Session(path, **opts):
                pmaptap.tap(1.0, "x")
            out.append(None)
        except pmaptap.SessionError as e:
            out.append(e)
    return out


@pytest.mark.parametrize("layout", ["file", "sharded"])
def test_a_fixed_run_reopened_without_resume_is_refused_at_open(tmp_path, monkeypatch, layout):
    """Two sessions in a row with run="exp-1" on one file: the second
    appended the same steps again without a word (validate: hundreds of
    duplicates and divergences). Now it is refused at open, naming the ways
    out, whether the run is fixed by run= or PMAPTAP_RUN, in the one file
    or its shards; nothing of it is written. Resuming, or another run id,
    opens; so does a session after the run's last records were by a side
    Writer only (process numbers above the job's)."""
    path = str(tmp_path / "run.jsonl")
    first, second = _two_sessions(path, run="exp-1", layout=layout)
    assert first is None and second is not None
    said = str(second)
    assert "already ends with records of run 'exp-1' (run=)" in said
    assert "resume=True" in said and "another run id" in said
    assert len(pmaptap.read(path)) == 1
    monkeypatch.setenv("PMAPTAP_RUN", "exp-1")
    with pytest.raises(pmaptap.SessionError, match=r"'exp-1' \(PMAPTAP_RUN\)"):
        pmaptap.Session(path, layout=layout).open()
    monkeypatch.delenv("PMAPTAP_RUN")
    with pmaptap.Session(path, run="exp-1", resume=True, layout=layout) as s:
        pmaptap.tap(2.0, "x", step=0)
    assert s.attempt == 1
    assert _two_sessions(path, run="exp-2", layout=layout)[0] is None
    # A side process (Writer, process 1000) of a run the job has not written.
    with pmaptap.Writer(path, run="exp-3", process=1000, layout=layout) as w:
        w.write("eval", 0, 0.5)
    assert _two_sessions(path, run="exp-3", layout=layout)[0] is None
    assert [r["value"] for r in pmaptap.read(path, name="x", run="exp-1")] == [2.0]


def test_the_reopen_check_reads_only_the_end_of_a_large_file(tmp_path, monkeypatch):
    # 64 MiB of another run before the last session's records: the check
    # reads back from the end, never the whole file.
    from pmaptap._host.session import runid

    path = str(tmp_path / "big.jsonl")
    line = json.dumps(record_dict(run="old", name="pad", step=0, value=0.0)) + "\n"
    with open(path, "w") as f:
        f.write(line * ((64 << 20) // len(line)))
    with pmaptap.Session(path, run="exp"):
        pmaptap.tap(1.0, "x")
    read = []
    last_run_in = runid._last_run_in

    def counting(reader, size, processes=None):
        return last_run_in(lambda a, b: read.append(b - a) or reader(a, b), size, processes)

    monkeypatch.setattr(runid, "_last_run_in", counting)
    with pytest.raises(pmaptap.SessionError, match="already ends with records of run 'exp'"):
        pmaptap.Session(path, run="exp").open()
    assert sum(read) <= 1 << 20
