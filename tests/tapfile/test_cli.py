"""The ``pmaptap`` command, run as a subprocess on files written by real
sessions (a pmap program on 8 simulated devices), plus the progress bar and
``pmaptap.read(..., as_frame=True)``."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import pmaptap
from conftest import ROOT, cli, run_python, start_python, subprocess_env
from conftest import aligned_table as _table

# Steps 0-5 of a small pmap program: a replicated loss (NaN at step 2), a
# per-device norm, a replicated tap whose copies disagree on odd steps, a
# per-device pytree, and an eager tap with a gap at step 3.
_DEMO = """
    import sys, jax, jax.numpy as jnp, pmaptap

    def body(x, step):
        loss = jax.lax.pmean(jnp.mean(x), "dp")
        loss = jnp.where(step == 2, jnp.nan, loss)
        pmaptap.tap(loss, "loss", step=step, dedup="replicated")
        pmaptap.tap(jnp.sum(x * x), "gnorm", step=step, dedup="per_device")
        idx = jax.lax.axis_index("dp")
        pmaptap.tap(jnp.where(step % 2 == 1, idx % 2, 0).astype(jnp.float32),
                    "drift", step=step, dedup="replicated")
        pmaptap.tap({"w": x, "b": loss}, "params", step=step, dedup="per_device")
        return x * 0.5

    f = jax.pmap(body, axis_name="dp", in_axes=(0, None))
    with pmaptap.Session(sys.argv[1], run="demo"):
        x = jnp.arange(16.0).reshape(8, 2) / 10
        for s in range(6):
            x = f(x, s)
            if s != 3:
                pmaptap.tap(jnp.float32(0.1 / (s + 1)), "lr", step=s)
"""
N_DEMO = 6 * (1 + 8 + 8) + 9 + 5  # loss, gnorm, params; drift; lr


def _write_demo(path: str) -> None:
    run_python(textwrap.dedent(_DEMO).replace("sys.argv[1]", repr(path)))


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("cli") / "demo.jsonl")
    _write_demo(path)
    return path


@pytest.fixture(scope="module")
def demo_lines(demo) -> list[str]:
    with open(demo, encoding="utf-8") as f:
        return f.read().splitlines()


def _strict(line: str) -> dict:
    def no_constants(name):
        raise ValueError(f"non-strict JSON constant {name}")

    return json.loads(line, parse_constant=no_constants)


# ------------------------------------------------------------------ basics


def test_demo_file_is_what_the_program_wrote(demo):
    recs = pmaptap.read(demo)
    assert len(recs) == N_DEMO
    assert {r["name"] for r in recs} == {"loss", "gnorm", "drift", "params", "lr"}


def test_help_and_console_script():
    out = cli("--help")
    assert out.returncode == 0
    for sub in ("show", "tail", "summary", "validate", "plot", "export", "launch"):
        assert sub in out.stdout
    assert cli().returncode == 2  # no subcommand: usage, status 2
    from importlib.metadata import entry_points

    eps = {e.name: e.value for e in entry_points(group="console_scripts")}
    assert eps.get("pmaptap") == "pmaptap.cli:main"


def test_version_says_which_library_decodes_records():
    import msgspec

    out = cli("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"pmaptap 0.1.0: records decoded by msgspec {msgspec.__version__}"


def test_missing_file_and_bad_step_are_usage_errors(tmp_path):
    out = cli("show", str(tmp_path / "nope.jsonl"))
    assert out.returncode == 2 and "no such file" in out.stderr
    out = cli("summary", str(tmp_path))
    assert out.returncode == 2 and "is a directory" in out.stderr


# ------------------------------------------------------------------ show


def test_show_filters_and_aligns(demo):
    out = cli("show", demo, "--name", "gnorm", "--step", "1:2", "--device", "3")
    assert out.returncode == 0, out.stderr
    header, rows = _table(out.stdout)
    assert header.split() == [
        "line",
        "name",
        "step",
        "kind",
        "proc",
        "device",
        "coords",
        "value",
        "flags",
    ]
    want = [
        r
        for r in pmaptap.read(demo)
        if r["name"] == "gnorm" and r["step"] in (1, 2) and r["device"] == 3
    ]
    assert len(rows) == len(want) == 2
    for row, rec in zip(rows, want):
        assert (row["name"], row["step"], row["device"], row["coords"]) == (
            "gnorm",
            str(rec["step"]),
            "3",
            "dp=3",
        )
        assert float(row["value"]) == pytest.approx(rec["value"], rel=1e-5)
    # Aligned: every row puts its value where the header's column starts.
    col = header.index("value")
    for line in out.stdout.splitlines()[1:]:
        assert line[col - 2 : col] == "  " and line[col] != " "


def test_show_replicated_matches_any_holder_and_marks_divergence(demo):
    out = cli("show", demo, "--name", "loss", "--device", "5", "--process", "0")
    _, rows = _table(out.stdout)
    assert [r["step"] for r in rows] == ["0", "1", "2", "3", "4", "5"]
    assert rows[2]["value"] == "nan" and rows[0]["device"] == "0-7"
    out = cli("show", demo, "--name", "drift", "--step", "1")
    _, rows = _table(out.stdout)
    assert len(rows) == 2 and all("DIVERGENT" in r["flags"] for r in rows)
    assert sorted(r["device"] for r in rows) == ["0,2,4,6", "1,3,5,7"]
    out = cli("show", demo, "--process", "1")
    assert out.returncode == 0 and out.stdout == ""
    assert "no matching records" in out.stderr


def test_show_names_the_run_of_each_row_when_rows_of_two_runs_are_shown(tmp_path):
    # Two jobs appended to one file: the same name, step and device in each.
    # Without a run column their rows looked alike.
    from conftest import per_device_dict

    path = tmp_path / "two.jsonl"
    with open(path, "w") as f:
        for run, value in (("first", 1.0), ("second", 2.0)):
            f.write(json.dumps(per_device_dict(0, 3, value, run=run)) + "\n")
    out = cli("show", str(path))
    assert out.returncode == 0, out.stderr
    header, rows = _table(out.stdout)
    assert header.split()[:3] == ["line", "run", "name"]
    assert [(r["run"], r["value"]) for r in rows] == [("first", "1"), ("second", "2")]
    # Filtered down to one run: no run column (the rows say nothing new).
    header, rows = _table(cli("show", str(path), "--run", "second").stdout)
    assert "run" not in header.split() and len(rows) == 1


def test_show_sets_a_shards_index_apart_from_its_coords(tmp_path):
    # A sharded pytree's shard under jit: coords, then the global slice of
    # each leaf, as the console prints it; never "model=0[[0:2,0:4],...".
    from conftest import per_device_dict

    path = tmp_path / "shard.jsonl"
    rec = per_device_dict(
        0,
        1,
        [[1.0, 2.0]],
        coords={"data": 0, "model": 1},
        shape=[1, 2],
        index=[[0, 1], [2, 4]],
        global_shape=[4, 4],
    )
    tree = per_device_dict(
        0,
        1,
        1.0,
        name="tree",
        coords={"data": 0, "model": 1},
        index=[[[0, 2], [0, 4]], [[0, 8]]],
    )
    with open(path, "w") as f:
        f.write(json.dumps(rec) + "\n" + json.dumps(tree) + "\n")
    out = cli("show", str(path))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "data=0,model=1 index=[0:1,2:4]" in lines[1], lines
    assert "data=0,model=1 index=[[0:2,0:4],[0:8]]" in lines[2], lines
    assert "model=1[" not in out.stdout


def test_show_json_is_strict_and_round_trips(demo, demo_lines):
    out = cli("show", demo, "--name", "loss", "--json")
    lines = out.stdout.splitlines()
    assert len(lines) == 6
    assert [_strict(x) for x in lines] == [_strict(x) for x in demo_lines if '"name":"loss"' in x]
    assert _strict(lines[2])["value"] == "NaN"  # the documented marker


def test_show_rejects_bad_step(demo):
    out = cli("show", demo, "--step", "a:b")
    assert out.returncode == 2 and "--step" in out.stderr


# ------------------------------------------------------------------ tail


def test_tail_prints_last_records(demo, demo_lines):
    out = cli("tail", demo, "-n", "3", "--json")
    assert out.returncode == 0, out.stderr
    assert [_strict(x) for x in out.stdout.splitlines()] == [_strict(x) for x in demo_lines[-3:]]
    out = cli("tail", demo, "-n", "2", "--name", "loss")
    _, rows = _table(out.stdout)
    assert [(r["name"], r["step"]) for r in rows] == [("loss", "4"), ("loss", "5")]


class _Lines:
    """Reads a process's stdout in a thread so the test can wait on it."""

    def __init__(self, stream) -> None:
        self.q: queue.Queue = queue.Queue()
        self.t = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self.t.start()

    def _pump(self, stream) -> None:
        for line in stream:
            self.q.put(line.rstrip("\n"))

    def take(self, n: int, timeout: float = 60) -> list[str]:
        out, deadline = [], time.monotonic() + timeout
        while len(out) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"waited {timeout}s for {n} lines, got {out}")
            try:
                out.append(self.q.get(timeout=left))
            except queue.Empty:
                pass
        return out


def _start_cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pmaptap", *args],
        env=subprocess_env(8),
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)


# The writer appends one step at a time and waits for the test to say "go"
# (after tail -f has shown that step), so the records can only have reached
# tail while the writer was still running: a live follow, not a re-read.
_LIVE_WRITER = """
    import os, sys, time, jax, jax.numpy as jnp, pmaptap

    def body(x):
        pmaptap.tap(jax.lax.pmean(jnp.mean(x), "dp"), "loss", dedup="replicated")
        pmaptap.tap(jnp.sum(x), "gnorm", dedup="per_device")
        return x * 0.5

    f = jax.pmap(body, axis_name="dp")
    x = jnp.ones((8, 2))
    with pmaptap.Session(os.environ["TAP"], run="live") as s:
        for step in range(5):
            time.sleep(0.4)
            x = f(x)
            s.flush()
            print("wrote", step, flush=True)
            if sys.stdin.readline().strip() != "go":
                sys.exit("test went away")
"""


def test_tail_follow_sees_a_running_writer(tmp_path):
    path = str(tmp_path / "live" / "run.jsonl")
    tail = _start_cli("tail", path, "-f", "--json", "--interval", "0.05")
    # Start the writer only once tail is following the not-yet-existing file
    # (on a loaded machine tail's start-up could otherwise lose the race).
    assert "waiting for" in tail.stderr.readline()
    writer = start_python(_LIVE_WRITER, TAP=path, stdin=True)
    try:
        out = _Lines(tail.stdout)
        wrote = _Lines(writer.stdout)
        seen = []
        for step in range(5):
            assert wrote.take(1) == [f"wrote {step}"]
            recs = [json.loads(x) for x in out.take(9)]
            assert writer.poll() is None  # the writer is still running
            assert {r["step"] for r in recs} == {step}
            assert sorted((r["name"], r.get("device", -1)) for r in recs) == [
                ("gnorm", d) for d in range(8)
            ] + [("loss", -1)]
            seen += recs
            writer.stdin.write("go\n")
            writer.stdin.flush()
        assert writer.wait(timeout=60) == 0, writer.stderr.read()
        assert len(seen) == 45
        tail.send_signal(signal.SIGTERM)  # stops cleanly, status 0
        assert tail.wait(timeout=20) == 0
        err = tail.stderr.read()
        assert "Traceback" not in err
    finally:
        _stop(tail)
        _stop(writer)


def test_tail_follow_copes_with_a_torn_tail(tmp_path, demo_lines):
    path = str(tmp_path / "torn.jsonl")
    a, b, c = demo_lines[0], demo_lines[1], demo_lines[2]
    with open(path, "w", encoding="utf-8") as f:
        f.write(a + "\n" + b[:40])  # b is still being written
    tail = _start_cli("tail", path, "-f", "-n", "5", "--json", "--interval", "0.05")
    try:
        out = _Lines(tail.stdout)
        assert [_strict(x) for x in out.take(1)] == [_strict(a)]
        with open(path, "a", encoding="utf-8") as f:
            f.write(b[40:] + "\n")  # ... and now it is complete
        assert [_strict(x) for x in out.take(1)] == [_strict(b)]
        # A writer killed mid-line: the next writer starts a new line, so the
        # torn piece becomes one bad line, reported and skipped.
        with open(path, "a", encoding="utf-8") as f:
            f.write('{"run":"demo","na')
        with open(path, "a", encoding="utf-8") as f:
            f.write("\n" + c + "\n")
        assert [_strict(x) for x in out.take(1)] == [_strict(c)]
        tail.send_signal(signal.SIGINT)  # Ctrl-C: clean, status 0
        assert tail.wait(timeout=20) == 0
        err = tail.stderr.read()
        assert "line 3: not valid JSON" in err and "Traceback" not in err
        assert tail.stdout.read() == ""
    finally:
        _stop(tail)


def test_tail_follow_started_before_a_sharded_run_sees_its_shards(tmp_path):
    """``tail -f RUN`` started before anything exists, then the run appears
    in the sharded layout (``RUN.d/`` only, never ``RUN``): its records are
    shown as the processes write them, a shard that appears later too."""
    path = str(tmp_path / "live" / "run.jsonl")
    tail = _start_cli("tail", path, "-f", "--json", "--interval", "0.05", "--timeout", "120")
    try:
        assert "waiting for" in tail.stderr.readline()
        out = _Lines(tail.stdout)
        for process in (0, 1):
            with pmaptap.Writer(path, run="r", process=process, layout="sharded") as w:
                for step in range(3):
                    w.write("acts", step, float(10 * process + step), kind="per_device")
            assert not os.path.exists(path) and os.path.isdir(path + ".d")
            got = [json.loads(x) for x in out.take(3)]
            assert [(r["process"], r["step"], r["value"]) for r in got] == [
                (process, s, 10.0 * process + s) for s in range(3)
            ], got
        tail.send_signal(signal.SIGTERM)
        assert tail.wait(timeout=20) == 0
        assert "Traceback" not in tail.stderr.read()
    finally:
        _stop(tail)


def test_a_stop_signal_never_deadlocks_the_follow_loop():
    """Ctrl-C / SIGTERM in ``tail -f`` / ``merge --follow`` / ``export
    --follow`` run their handler on the main thread, wherever it is -- also
    inside the poll loop's ``stop.wait``. A ``threading.Event`` there hangs
    for ever when the signal lands while ``wait`` holds its lock (``set``
    takes it again; CPython gh-126434; it hung ``tail -f`` in CI). A trace
    function calls ``set`` at every line the wait runs, as a handler could:
    each wait must return, set."""
    out = run_python(
        """
        import sys
        from pmaptap.tapfile.read.follower import stop_on_signals

        lines = 0
        for k in range(1, 200):
            with stop_on_signals() as stop:
                seen = 0

                def tracer(frame, event, arg):
                    global seen
                    if event == "line":
                        seen += 1
                        if seen == k:
                            stop.set()  # what the SIGTERM handler does
                    return tracer

                sys.settrace(tracer)
                got = stop.wait(0.001)
                sys.settrace(None)
            if seen < k:  # every line of the wait has had its turn
                break
            assert got and stop.is_set(), k
            lines = k
        print("lines", lines)
        """,
        devices=1,
        timeout=60,
    )
    assert int(out.stdout.split()[-1]) >= 2, out.stdout


def test_tail_follow_stops_at_timeout_and_max_records(tmp_path, demo):
    t0 = time.monotonic()
    out = cli("tail", demo, "-f", "-n", "2", "--timeout", "1", "--json")
    assert out.returncode == 0 and len(out.stdout.splitlines()) == 2
    assert 1 <= time.monotonic() - t0 < 30
    out = cli("tail", str(tmp_path / "absent.jsonl"), "-f", "--timeout", "0.5")
    assert out.returncode == 0 and "waiting for" in out.stderr
    out = cli("tail", demo, "-f", "-n", "50", "--max-records", "4", "--json")
    assert out.returncode == 0 and len(out.stdout.splitlines()) == 4


# ------------------------------------------------------------------ summary


def test_summary_per_tap(demo):
    out = cli("summary", demo)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == (f"run demo: {N_DEMO} records, 5 tap(s), processes 0, devices 0-7")
    _, rows = _table("\n".join(lines[1:]))
    by = {r["name"]: r for r in rows}
    assert by["gnorm"]["records"] == "48" and by["gnorm"]["devices"] == "0-7"
    assert by["gnorm"]["steps"] == "0-5" and by["gnorm"]["issues"] == "-"
    assert "divergent at 3 step(s) (1,3,5)" in by["drift"]["issues"]
    assert "1 missing step(s) (3)" in by["lr"]["issues"]
    assert by["lr"]["devices"] == "0" and by["lr"]["records"] == "5"
    loss = [r["value"] for r in pmaptap.read(demo) if r["name"] == "loss"]
    finite = [v for v in loss if math.isfinite(v)]
    assert "1 non-finite value(s)" in by["loss"]["issues"]
    assert float(by["loss"]["min"]) == pytest.approx(min(finite), rel=1e-5)
    assert float(by["loss"]["max"]) == pytest.approx(max(finite), rel=1e-5)
    assert float(by["loss"]["mean"]) == pytest.approx(sum(finite) / 5, rel=1e-5)
    assert float(by["loss"]["last"]) == pytest.approx(loss[-1], rel=1e-5)
    # The pytree tap: a row per leaf (an array leaf, and the loss again).
    assert by["params/w"]["last"] == "(array)" and by["params/w"]["records"] == "48"
    assert by["params/b"]["min"] == by["loss"]["min"]


def test_summary_counts_duplicates_but_not_divergence(tmp_path, demo_lines):
    path = str(tmp_path / "dup.jsonl")
    loss0 = next(x for x in demo_lines if '"name":"loss","step":0' in x)
    g = next(x for x in demo_lines if '"name":"gnorm","step":1' in x)
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(demo_lines + [loss0, g, g]) + "\n")
    from pmaptap.tapfile.analyze.summary import tap_summaries
    from pmaptap.tapfile.analyze.table import summary_table

    text = summary_table(pmaptap.read(path))
    assert "1 duplicate record(s)" in text and "2 duplicate record(s)" in text
    by = {s.name: s for s in tap_summaries(pmaptap.read(path))}
    assert (by["loss"].duplicates, by["gnorm"].duplicates, by["drift"].duplicates) == (1, 2, 0)
    assert by["drift"].divergent_steps == (1, 3, 5)


# ------------------------------------------------------------------ validate


def test_validate_clean_file(demo):
    out = cli("validate", demo)
    assert out.returncode == 0, out.stdout
    assert f"OK, {N_DEMO} records" in out.stdout
    assert "3 divergent replicated step(s)" in out.stdout


def _line(lines, name, step, extra=""):
    return next(x for x in lines if f'"name":"{name}","step":{step},' in x and extra in x)


def test_validate_lists_problems_by_line(tmp_path, demo_lines):
    loss1 = _line(demo_lines, "loss", 1)
    g2 = _line(demo_lines, "gnorm", 2, '"device":4,')
    bad_shape = (
        _line(demo_lines, "gnorm", 3)
        .replace('"shape":[]', '"shape":[2]')
        .replace('"step":3', '"step":77')
    )
    bad_proc = loss1.replace('"process":0', '"process":"zero"').replace('"step":1', '"step":99')
    # Same replicated key, another value: a cross-process divergence, which
    # validate must NOT call a duplicate.
    other = _strict(loss1)
    other.update(value=123.0, vhash="0123456789abcdef", process=1)
    lines = list(demo_lines)
    n = len(lines)
    lines += [
        "this is not json",  # n+1 garbage
        loss1,  # n+2 duplicate replicated
        g2,  # n+3 duplicate per_device
        bad_shape,  # n+4 schema: value vs shape
        bad_proc,  # n+5 schema: process
        json.dumps(other, separators=(",", ":")),  # n+6 divergence, fine
        '{"name": "x"}',  # n+7 not a record
        "",  # n+8 empty line
        '{"run":"demo","name":"loss","st',  # n+9 torn last line
    ]
    path = str(tmp_path / "bad.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))  # no final newline: torn
    out = cli("validate", path)
    assert out.returncode == 1, out.stdout
    reported = {}
    for line in out.stdout.splitlines()[:-1]:
        _, num, why = line.split(":", 2)
        reported.setdefault(int(num), []).append(why.strip())
    first_loss1 = demo_lines.index(loss1) + 1
    first_g2 = demo_lines.index(g2) + 1
    assert sorted(reported) == [n + 1, n + 2, n + 3, n + 4, n + 5, n + 7, n + 8, n + 9]
    assert reported[n + 1][0].startswith("not valid JSON")
    assert reported[n + 2] == [f"duplicate of line {first_loss1} (replicated 'loss' step 1)"]
    assert reported[n + 3] == [f"duplicate of line {first_g2} (per_device 'gnorm' step 2 device 4)"]
    assert len(reported[n + 4]) == 1
    assert "does not match shape [2]" in reported[n + 4][0]
    assert reported[n + 5] == ["schema: process must be a non-negative integer"]
    assert "missing field(s)" in reported[n + 7][0]
    assert reported[n + 8] == ["empty line"]
    assert reported[n + 9] == ["torn last line (no newline)"]
    # The cross-process divergence (n+6) is counted as data, not a problem.
    assert "8 problem(s)" in out.stdout.splitlines()[-1]
    assert "4 divergent replicated step(s)" in out.stdout.splitlines()[-1]
    limited = cli("validate", path, "--limit", "2").stdout.splitlines()
    assert [ln.split(":")[1] for ln in limited[:2]] == [str(n + 1), str(n + 2)]
    assert limited[2] == "... and 6 more (--limit 0 lists all)"


# ------------------------------------------------------------------ plot


def test_plot_writes_a_png(demo, tmp_path):
    mpl_image = pytest.importorskip("matplotlib.image")
    for name in ("gnorm", "drift", "loss"):
        png = str(tmp_path / f"{name}.png")
        out = cli("plot", demo, "--name", name, "-o", png)
        assert out.returncode == 0, out.stderr
        with open(png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        img = mpl_image.imread(png)
        assert img.shape[0] > 100 and img.shape[1] > 100
    out = cli("plot", demo, "--name", "gnorm", cwd=str(tmp_path / "."))
    assert out.returncode == 0 and os.path.exists(tmp_path / "gnorm.png")


def test_plot_lines_per_device_and_divergent_marks(demo):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from pmaptap.tapfile.export.plot import build_figure

    recs = pmaptap.read(demo)
    fig = build_figure(recs, "gnorm")
    try:
        # 8 devices: a panel each (8 lines in one axes could not be told
        # apart), in device order, sharing the value axis.
        assert [ax.get_title() for ax in fig.axes] == [f"device {d}" for d in range(8)]
        for d, ax in enumerate(fig.axes):
            assert [line.get_label() for line in ax.get_lines()] == [f"device {d}"]
            assert not ax.collections  # nothing divergent
        assert fig.axes[0].get_ylim() == fig.axes[7].get_ylim()
    finally:
        plt.close(fig)
    fig = build_figure(recs, "drift")
    try:
        ax = fig.axes[0]
        assert [line.get_label() for line in ax.get_lines()] == ["replicated"]
        marks = sorted(map(tuple, ax.collections[0].get_offsets().tolist()))
        assert marks == [(s, v) for s in (1, 3, 5) for v in (0.0, 1.0)]
        # The replicated line is broken (NaN) at the divergent steps.
        y = ax.get_lines()[0].get_ydata()
        assert [math.isnan(v) for v in y] == [False, True] * 3
    finally:
        plt.close(fig)


def test_plot_errors_are_clear(demo, tmp_path):
    out = cli("plot", demo, "--name", "nope", "-o", str(tmp_path / "x.png"))
    assert out.returncode == 2
    assert "no records named 'nope'" in out.stderr and "gnorm" in out.stderr
    out = cli("plot", demo, "--name", "params/w", "-o", str(tmp_path / "x.png"))
    assert out.returncode == 2 and "non-scalar" in out.stderr
    out = cli("plot", demo, "--name", "params", "-o", str(tmp_path / "x.png"))
    assert out.returncode == 2 and "--name params/b or params/w" in out.stderr
    # matplotlib missing: a None entry in sys.modules makes its import fail.
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from pmaptap.cli import main\n"
        f"sys.exit(main(['plot', {demo!r}, '--name', 'loss', '-o', "
        f"{str(tmp_path / 'y.png')!r}]))"
    )
    proc = run_python(code, check=False)
    assert proc.returncode == 2
    assert 'pip install "pmaptap[plot]"' in proc.stderr
    assert not os.path.exists(tmp_path / "y.png")


# ------------------------------------------------------------------ export


def test_export_csv_one_row_per_record(demo, tmp_path):
    out_csv = str(tmp_path / "out.csv")
    out = cli("export", demo, "--csv", out_csv)
    assert out.returncode == 0, out.stderr
    with open(out_csv, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    recs = pmaptap.read(demo)
    assert len(rows) == len(recs) == N_DEMO
    assert [(r["name"], int(r["step"])) for r in rows] == [(r["name"], r["step"]) for r in recs]
    loss = [r for r in rows if r["name"] == "loss"]
    assert math.isnan(float(loss[2]["value"]))
    assert float(loss[0]["value"]) == pytest.approx(
        recs[[r["name"] for r in recs].index("loss")]["value"]
    )
    p = next(r for r in rows if r["name"] == "params" and r["device"] == "3")
    # Coordinates are named as in frames and Parquet (coords.<axis>).
    assert p["coords.dp"] == "3" and p["kind"] == "per_device" and "coord.dp" not in p
    assert float(p["value.b"]) > 0 and json.loads(p["value.w"]) == [0.6, 0.7]
    assert {r["divergent"] for r in rows if r["name"] == "drift" and r["step"] == "1"} == {"True"}
    out = cli("export", demo, "--csv", "-", "--name", "lr")
    assert out.returncode == 0
    assert len(list(csv.DictReader(io.StringIO(out.stdout)))) == 5


def test_export_csv_reads_back_with_pandas(demo, tmp_path):
    pd = pytest.importorskip("pandas")
    out_csv = str(tmp_path / "out.csv")
    assert cli("export", demo, "--csv", out_csv).returncode == 0
    df = pd.read_csv(out_csv)
    assert len(df) == N_DEMO and df["value"].isna().sum() >= 1


# ------------------------------------------------------------------ read(as_frame)


def test_read_as_frame(demo):
    pd = pytest.importorskip("pandas")
    df = pmaptap.read(demo, as_frame=True)
    assert isinstance(df, pd.DataFrame) and len(df) == N_DEMO
    assert set(df["name"]) == {"loss", "gnorm", "drift", "params", "lr"}


def test_read_as_frame_without_pandas_says_what_to_install(demo):
    code = (
        "import sys; sys.modules['pandas'] = None\n"
        "import pmaptap\n"
        "try:\n"
        f"    pmaptap.read({demo!r}, as_frame=True)\n"
        "except ImportError as e:\n"
        "    print('ERR', e)\n"
    )
    out = run_python(code).stdout
    assert "ERR" in out and "needs pandas" in out and "pmaptap[frame]" in out


# ------------------------------------------------------------------ launch


def _piped(data: bytes, *args: str) -> subprocess.CompletedProcess:
    """``cat FILE | pmaptap ARGS`` with a real pipe on the command's stdin."""
    proc = subprocess.run(
        [sys.executable, "-m", "pmaptap", *args],
        input=data,
        env=subprocess_env(8),
        cwd=ROOT,
        capture_output=True,
        timeout=60,
    )
    return subprocess.CompletedProcess(
        proc.args, proc.returncode, proc.stdout.decode(), proc.stderr.decode()
    )


@pytest.mark.parametrize(
    "command",
    [
        ("show",),
        ("show", "--name", "loss", "--json"),
        ("summary",),
        ("validate",),
        ("tail", "-n", "5"),
        ("export", "--csv", "-"),
    ],
    ids=lambda c: " ".join(c),
)
def test_a_tap_file_on_a_pipe_reads_as_the_file_does(demo, command):
    """`cat run.jsonl | pmaptap show /dev/stdin`: a second pass over a
    pipe found it drained, and show said "no matching records" and exit 0
    (export --csv wrote an empty CSV; tail: "not seekable"). A pipe is read
    once, into a temporary copy: the same answer as for the file."""
    with open(demo, "rb") as f:
        data = f.read()
    want = cli(command[0], demo, *command[1:])
    got = _piped(data, command[0], "/dev/stdin", *command[1:])
    assert want.returncode == 0 and want.stdout, want.stderr
    assert got.returncode == want.returncode, got.stderr
    assert got.stdout == want.stdout.replace(demo, "/dev/stdin"), got.stderr
    assert got.stderr == want.stderr.replace(demo, "/dev/stdin")


def test_exports_and_merge_of_a_pipe_and_follow_refused(demo, tmp_path, monkeypatch):
    """The commands that write files read a pipe whole too, and --follow of
    a pipe (nothing grows) is a usage error, exit 2."""
    # The spooled copies go to a temporary directory of this test's own (the
    # shared /tmp holds other processes' files of the same name pattern).
    spool = tmp_path / "spool"
    spool.mkdir()
    monkeypatch.setenv("TMPDIR", str(spool))
    with open(demo, "rb") as f:
        data = f.read()
    for target in ("--parquet", "--tensorboard"):
        want = cli("export", demo, target, str(tmp_path / f"file{target}"))
        got = _piped(data, "export", "/dev/stdin", target, str(tmp_path / f"pipe{target}"))
        assert want.returncode == got.returncode == 0, got.stderr
        said = [p.stderr.rsplit(" to ", 1)[0] for p in (want, got)]
        assert said[0] == said[1] and f"wrote {N_DEMO} " in said[0], said
    got = _piped(data, "merge", "/dev/stdin", "-o", str(tmp_path / "m.jsonl"))
    assert got.returncode == 0 and len(pmaptap.read(str(tmp_path / "m.jsonl"))) == N_DEMO
    got = _piped(data, "plot", "/dev/stdin", "--name", "loss", "-o", str(tmp_path / "l.png"))
    assert got.returncode == 0 and os.path.getsize(tmp_path / "l.png") > 0, got.stderr
    for follow in (
        ("tail", "/dev/stdin", "-f"),
        ("export", "/dev/stdin", "--tensorboard", str(tmp_path / "tb2"), "-f"),
    ):
        got = _piped(data, *follow)
        assert got.returncode == 2, got
        assert "is not a file but a pipe or device: there is nothing to follow" in got.stderr
    assert not any(n.startswith("pmaptap-") for n in os.listdir(spool)), (
        "a spooled copy was left behind"
    )


def test_a_named_fifo_finds_the_runs_stored_values(tmp_path):
    """A FIFO named as the run: its stored values (``<name>.bytes`` beside
    it) are found, so validate says OK and export loads them."""
    import numpy as np

    run = tmp_path / "run.jsonl"
    with pmaptap.Writer(str(run), run="r", process=0) as w:
        for step in range(3):
            w.write("big", step, np.arange(512, dtype=np.float32) + step)
    fifo_dir = tmp_path / "fifo"
    fifo_dir.mkdir()
    fifo = fifo_dir / "run.jsonl"
    os.mkfifo(fifo)
    os.symlink(str(run) + ".bytes", str(fifo) + ".bytes")
    data = run.read_bytes()

    def feed():
        with open(fifo, "wb") as f:
            f.write(data)

    t = threading.Thread(target=feed, daemon=True)
    t.start()
    got = cli("validate", str(fifo))
    t.join(10)
    assert got.returncode == 0 and f"{fifo}: OK, 3 records" in got.stdout, got.stdout + got.stderr


def test_launch_delegates_to_the_launcher():
    code = (
        "import sys, types\n"
        "sys.modules['pmaptap.launch'] = types.SimpleNamespace(\n"
        "    main=lambda argv: print('ARGV', argv) or 7)\n"
        "from pmaptap.cli import main\n"
        "sys.exit(main(['launch', '-n', '2', 'train.py', '--help']))"
    )
    proc = run_python(code, check=False)
    assert proc.returncode == 7
    assert "ARGV ['-n', '2', 'train.py', '--help']" in proc.stdout
    code = (
        "import sys; sys.modules['pmaptap.launch'] = None\n"
        "from pmaptap.cli import main\n"
        "sys.exit(main(['launch']))"
    )
    proc = run_python(code, check=False)
    assert proc.returncode == 2 and "pmaptap.launch" in proc.stderr


# ------------------------------------------------------------------ progress


def test_progress_draws_on_process_zero_only():
    from pmaptap.progress import Progress, progress

    buf = io.StringIO()
    with Progress(3, desc="train", stream=buf, force=True, process=0, min_interval=0) as bar:
        for i in range(3):
            bar.update(loss=0.5 / (i + 1))
    text = buf.getvalue()
    assert text.startswith("\rtrain: [") and text.endswith("\n")
    assert "3/3 100%" in text and "loss=0.1667" in text
    assert "#" * 30 in text.splitlines()[-1]
    for kwargs in (
        {"process": 1, "force": True},  # other processes never draw
        {"process": 0},  # StringIO is not a TTY
        {"process": 0, "force": False},
    ):
        buf = io.StringIO()
        assert list(progress(range(4), stream=buf, **kwargs)) == [0, 1, 2, 3]
        assert buf.getvalue() == "", kwargs


def test_progress_uses_jax_process_index_and_tty(monkeypatch):
    import pty

    from pmaptap.progress import Progress, should_draw

    master, slave = pty.openpty()
    try:
        with os.fdopen(slave, "w", closefd=False) as tty:
            assert should_draw(tty)  # jax.process_index() == 0
            monkeypatch.setenv("PMAPTAP_PROGRESS", "0")
            assert not should_draw(tty)
        monkeypatch.setenv("PMAPTAP_PROGRESS", "1")
        assert should_draw(io.StringIO())
    finally:
        os.close(master)
        os.close(slave)
    # Throttled: a fast loop draws the first and the last step only.
    monkeypatch.delenv("PMAPTAP_PROGRESS")
    buf = io.StringIO()
    with Progress(100, stream=buf, force=True, min_interval=3600) as bar:
        for _ in range(100):
            bar.update()
    assert buf.getvalue().count("\r") == 3  # first, last, close
    assert "100/100" in buf.getvalue()


def test_a_pytree_of_scalars_is_summarized_and_plotted_per_leaf(tmp_path):
    # {"mean": m, "absmax": a} was one row "(array)" with no min/max, and
    # plot --name refused it as non-scalar; TensorBoard's export already
    # made a series per leaf (stats/mean, stats/absmax): now so do these.
    path = str(tmp_path / "run.jsonl")
    for process in (0, 1):
        with pmaptap.Writer(path, run="r", process=process) as w:
            for step in range(3):
                w.write("loss", step, float(step))
                # Process 1 disagrees about step 2: the tap's divergence.
                absmax = 2.0 * step + 1 + (process if step == 2 else 0)
                w.write("stats", step, {"mean": float(step), "absmax": absmax})
    for jobs in ("1", "2"):
        out = cli("summary", path, "--jobs", jobs)
        assert out.returncode == 0, out.stderr
        head, body = out.stdout.split("\n", 1)
        # Process 1 wrote only its divergent value: the rest it found written.
        assert head.startswith("run r: 7 records, 2 tap(s)")
        _, rows = _table(body)
        by = {r["name"]: r for r in rows}
        assert sorted(by) == ["loss", "stats/absmax", "stats/mean"]
        assert (by["stats/mean"]["min"], by["stats/mean"]["max"]) == ("0", "2")
        assert (by["stats/absmax"]["min"], by["stats/absmax"]["max"]) == ("1", "6")
        assert "divergent at 1 step(s) (2)" in by["stats/absmax"]["issues"]
    pytest.importorskip("matplotlib")
    png = str(tmp_path / "mean.png")
    out = cli("plot", path, "--name", "stats/mean", "-o", png)
    assert out.returncode == 0 and os.path.getsize(png) > 0, out.stderr
    out = cli("plot", path, "--name", "stats", "-o", png)
    assert out.returncode == 2
    assert "tap 'stats' is a pytree: plot one of its leaves" in out.stderr
    assert "--name stats/absmax or stats/mean" in out.stderr


def test_a_looped_taps_rows_take_only_its_own_records(tmp_path):
    # A batch of a loss and a looped tap's records (iteration 0 and 1): the
    # looped tap's (name, iteration) part matched every record with
    # tuple.__eq__, whose NotImplemented for a name is true, so each
    # iteration's row summed the loss too (and the loss row the act values).
    from conftest import record_dict

    path = str(tmp_path / "run.jsonl")
    with open(path, "w") as f:
        for step in range(3):
            f.write(json.dumps(record_dict(run="r", name="loss", step=step, value=1.0)) + "\n")
            for i in range(2):
                d = record_dict(run="r", name="act", step=step, value=10.0 + i, iteration=[i])
                f.write(json.dumps(d) + "\n")
    out = cli("summary", path)
    assert out.returncode == 0, out.stderr
    _, rows = _table("\n".join(out.stdout.splitlines()[1:]))
    got = {r["name"]: (r["records"], r["min"], r["max"]) for r in rows}
    assert got == {
        "act[0]": ("3", "10", "10"),
        "act[1]": ("3", "11", "11"),
        "loss": ("3", "1", "1"),
    }
