"""``pmaptap export --tensorboard``: event files read back with TensorBoard's
own reader (EventAccumulator), once and while a writer appends (--follow)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap

import pytest

import pmaptap
from conftest import ROOT, run_python, subprocess_env, wait_for

pytest.importorskip("tensorboardX")
event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

# A pmap program on 8 devices: a replicated scalar loss (NaN at step 1), a
# per-device scalar, a per-device pytree with an array leaf, a replicated
# array with an inf at step 2, and an eager scalar.
_PROGRAM = """
    import jax, jax.numpy as jnp, pmaptap

    def body(x, step):
        loss = jax.lax.pmean(jnp.mean(x), "dp")
        pmaptap.tap(jnp.where(step == 1, jnp.nan, loss), "loss", step=step,
                    dedup="replicated")
        pmaptap.tap(jnp.sum(x), "gnorm", step=step, dedup="per_device")
        pmaptap.tap({"w": x, "b": jnp.sum(x)}, "params", step=step,
                    dedup="per_device")
        act = jnp.arange(4.0) + step
        pmaptap.tap(jnp.where((step == 2) & (act == 3.0), jnp.inf, act), "act",
                    step=step, dedup="replicated")
        return x + 1

    f = jax.pmap(body, axis_name="dp", in_axes=(0, None))
    with pmaptap.Session(PATH, run="tb/run"):
        x = jnp.arange(16.0).reshape(8, 2)
        for s in range(3):
            x = f(x, s)
            pmaptap.tap(jnp.float32(0.5 ** s), "lr", step=s)
"""


def export(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pmaptap", "export", *args],
        env=subprocess_env(1),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def load_run(logdir: str):
    # size_guidance 0: keep every event (the defaults sample long series).
    ea = event_accumulator.EventAccumulator(logdir, size_guidance={"scalars": 0, "histograms": 0})
    ea.Reload()
    return ea


def scalars(ea, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in ea.Scalars(tag)]


@pytest.fixture(scope="module")
def taps(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tb") / "taps.jsonl")
    run_python(textwrap.dedent(_PROGRAM).replace("PATH", repr(path)))
    return path


def test_export_reads_back_with_tensorboards_reader(taps, tmp_path):
    out = export(taps, "--tensorboard", str(tmp_path / "tb"))
    assert out.returncode == 0, out.stderr
    # The run id "tb/run" is one directory, never a path.
    assert os.listdir(tmp_path / "tb") == ["tb_run"]
    ea = load_run(str(tmp_path / "tb" / "tb_run"))
    tags = ea.Tags()
    assert set(tags["scalars"]) == (
        {"loss", "lr", "act/nonfinite"}
        | {f"gnorm/device_{d}" for d in range(8)}
        | {f"params/b/device_{d}" for d in range(8)}
    )
    assert set(tags["histograms"]) == {"act"} | {f"params/w/device_{d}" for d in range(8)}

    recs = pmaptap.read(taps)
    loss = scalars(ea, "loss")
    assert [s for s, _ in loss] == [0, 1, 2]
    assert math.isnan(loss[1][1])  # NaN kept, as TensorBoard keeps it
    want = {r["step"]: r["value"] for r in recs if r["name"] == "loss"}
    assert loss[0][1] == pytest.approx(want[0]) and loss[2][1] == pytest.approx(want[2])
    # The event's wall time is when the job tapped the value.
    assert ea.Scalars("loss")[0].wall_time == pytest.approx(
        next(r["time"] for r in recs if r["name"] == "loss"), abs=1e-3
    )
    assert scalars(ea, "lr") == [(0, 1.0), (1, 0.5), (2, 0.25)]

    for d in range(8):
        got = scalars(ea, f"gnorm/device_{d}")
        want = [(r["step"], r["value"]) for r in recs if r["name"] == "gnorm" and r["device"] == d]
        assert got == [(s, pytest.approx(v)) for s, v in want]
    w3 = ea.Histograms("params/w/device_3")
    assert [h.step for h in w3] == [0, 1, 2]
    h = w3[1].histogram_value  # device 3 holds [6, 7] + 1 at step 1
    assert (h.num, h.min, h.max, h.sum) == (2, 7.0, 8.0, 15.0)

    # The inf is left out of the histogram and counted beside it.
    act = ea.Histograms("act")
    assert [(a.step, a.histogram_value.num) for a in act] == [(0, 4), (1, 4), (2, 3)]
    assert act[2].histogram_value.max == 5.0
    assert scalars(ea, "act/nonfinite") == [(2, 1.0)]
    assert "records as" in out.stderr and "NaN or Inf" not in out.stderr


def test_export_filters_and_keeps_per_device_series_apart(taps, tmp_path):
    out = export(
        taps,
        "--tensorboard",
        str(tmp_path / "tb"),
        "--name",
        "gnorm",
        "--device",
        "5",
        "--step",
        "1:",
    )
    assert out.returncode == 0, out.stderr
    ea = load_run(str(tmp_path / "tb" / "tb_run"))
    assert ea.Tags()["scalars"] == ["gnorm/device_5"]
    assert [s for s, _ in scalars(ea, "gnorm/device_5")] == [1, 2]


def test_run_ids_are_directory_names():
    from pmaptap.tapfile.export.tensorboard import run_dirname

    assert run_dirname("../../etc") == ".._.._etc"
    assert run_dirname("..") == "_.." and run_dirname("") == "_"
    assert run_dirname("a b/c") == "a_b_c"


def test_long_and_colliding_run_ids_get_their_own_bounded_directories(tmp_path):
    """A 10,000-character run id (cut, with a hash of the whole id) no longer
    fails the export of every run after it (File name too long); two long ids
    that differ only at their end, and two ids made safe to the same name,
    keep their series apart."""
    from pmaptap.tapfile.export.tensorboard import RUN_DIRNAME_MAX

    path = str(tmp_path / "runs.jsonl")
    ids = ["x" * 10_000 + "1", "x" * 10_000 + "2", "a b", "a_b", "short"]
    for i, run in enumerate(ids):
        with pmaptap.Writer(path, run=run, process=i, layout="file") as w:
            for step in range(2):
                w.write("loss", step, float(i))
    tb = str(tmp_path / "tb")
    out = export(path, "--tensorboard", tb)
    assert out.returncode == 0, out.stderr[-300:]
    assert f"in {len(ids)} run(s)" in out.stderr, out.stderr[-300:]
    names = sorted(os.listdir(tb))
    assert len(names) == len(ids), names
    assert all(len(n) <= RUN_DIRNAME_MAX for n in names), [len(n) for n in names]
    assert sum(n.startswith("x" * 100) for n in names) == 2  # still recognizable
    assert "short" in names and "a_b" in names
    # Each directory holds exactly one run's series (its value is its index).
    got = sorted(scalars(load_run(os.path.join(tb, n)), "loss")[0][1] for n in names)
    assert got == [float(i) for i in range(len(ids))]
    assert scalars(load_run(os.path.join(tb, "short")), "loss") == [(0, 4.0), (1, 4.0)]


def test_missing_tensorboardx_names_the_extra(taps, tmp_path):
    code = (
        "import sys; sys.modules['tensorboardX'] = None\n"
        "from pmaptap.cli import main\n"
        f"sys.exit(main(['export', {taps!r}, '--tensorboard', "
        f"{str(tmp_path / 'tb')!r}]))"
    )
    proc = run_python(code, check=False)
    assert proc.returncode == 2
    assert 'pip install "pmaptap[tensorboard]"' in proc.stderr
    assert not os.path.exists(tmp_path / "tb")


def test_follow_needs_tensorboard_and_targets_exclude_each_other(taps, tmp_path):
    out = export(taps, "--csv", str(tmp_path / "x.csv"), "--follow")
    assert out.returncode == 2 and "--follow works with --tensorboard only" in out.stderr
    out = export(taps, "--csv", "-", "--tensorboard", str(tmp_path / "tb"))
    assert out.returncode == 2 and "not allowed with" in out.stderr
    out = export(taps)
    assert out.returncode == 2 and "one of the arguments" in out.stderr


# A JAX-free writer appending records as a job would: N lines per line of
# stdin ("go N"), then a torn half line on "torn", exit on EOF.
_WRITER = r"""
import json, sys, time
path = sys.argv[1]
step = 0
for cmd in sys.stdin:
    with open(path, "ab") as f:
        if cmd.startswith("torn"):
            f.write(b'{"run":"live","name":"loss"')
        else:
            for _ in range(int(cmd.split()[1])):
                value = "NaN" if step == 3 else 1.0 / (step + 1)
                rec = {"run": "live", "name": "loss", "step": step,
                       "kind": "replicated", "value": value, "dtype": "float32",
                       "shape": [], "process": 0, "time": time.time(),
                       "host": "h", "replicas": 8}
                f.write((json.dumps(rec) + "\n").encode())
                step += 1
    print("done", flush=True)
"""


def test_follow_converts_appends_live_and_stops_on_sigint(tmp_path):
    path, tb = str(tmp_path / "live.jsonl"), str(tmp_path / "tb")
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, path],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    exporter = None
    try:

        def write(cmd: str) -> None:
            writer.stdin.write(cmd + "\n")
            writer.stdin.flush()
            assert writer.stdout.readline() == "done\n"

        def points() -> list[tuple[int, float]]:
            if not os.path.isdir(os.path.join(tb, "live")):
                return []
            ea = load_run(os.path.join(tb, "live"))
            return scalars(ea, "loss") if "loss" in ea.Tags()["scalars"] else []

        # Started before the file exists: it waits for it.
        exporter = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pmaptap",
                "export",
                path,
                "--tensorboard",
                tb,
                "--follow",
                "--interval",
                "0.05",
            ],
            env=subprocess_env(1),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert "waiting for" in exporter.stderr.readline()
        write("go 3")
        wait_for(lambda: len(points()) == 3, 30, "the first 3 points")
        write("go 4")
        write("torn")
        wait_for(lambda: len(points()) == 7, 30, "7 points")
        got = points()
        assert [s for s, _ in got] == list(range(7))
        assert math.isnan(got[3][1]) and got[6][1] == pytest.approx(1 / 7)
        assert exporter.poll() is None  # still following

        exporter.send_signal(signal.SIGINT)
        _, err = exporter.communicate(timeout=30)
        assert exporter.returncode == 0, err
        assert "Traceback" not in err
        assert "unterminated" in err and "wrote 7 records" in err
        assert len(points()) == 7
    finally:
        writer.stdin.close()
        writer.wait(timeout=30)
        if exporter is not None and exporter.poll() is None:
            exporter.kill()


def test_follow_stops_on_sigterm_and_timeout(tmp_path):
    path, tb = str(tmp_path / "t.jsonl"), str(tmp_path / "tb")
    rec = {
        "run": "r",
        "name": "x",
        "step": 0,
        "kind": "replicated",
        "value": 1.5,
        "dtype": "float32",
        "shape": [],
        "process": 0,
        "time": 1.0,
        "host": "h",
        "replicas": 1,
    }
    with open(path, "w") as f:
        f.write(json.dumps(rec) + "\n")
    out = export(path, "--tensorboard", tb, "--follow", "--timeout", "0.5")
    assert out.returncode == 0 and "wrote 1 records" in out.stderr
    proc = subprocess.Popen(
        [sys.executable, "-m", "pmaptap", "export", path, "--tensorboard", tb + "2", "--follow"],
        env=subprocess_env(1),
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: os.path.isdir(os.path.join(tb + "2", "r")), 30, "the run dir")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "wrote 1 records" in err, err
    assert scalars(load_run(os.path.join(tb + "2", "r")), "x") == [(0, 1.5)]
