"""pmaptap.forwarders against the real libraries, fed by a real Session of a
pmap step on the 8 simulated devices: TensorBoard event files read back with
TensorBoard's EventAccumulator, W&B in offline mode read back with W&B's
own reader of the run's .wandb file, MLflow with a local sqlite store read
back through MlflowClient. A resumed run ends with one point per step in
TensorBoard, from the live forwarder and from ``export --follow``."""

from __future__ import annotations

import glob
import math
import os
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import pmaptap
from conftest import ROOT, subprocess_env, wait_for, wandb_history

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
pytest.importorskip("tensorboardX")


def _train(path, steps, offset=0.0, forward=(), **session):
    """A pmap'd step on 8 devices: a replicated scalar loss (NaN at step 2
    of the first attempt), a per-device scalar and a per-device array;
    ``offset`` tells the attempt that wrote a value."""

    def body(x, i):
        loss = jax.lax.pmean(x, "d") * 0 + i + offset
        loss = jnp.where((i == 2) & (offset == 0), jnp.nan, loss)
        pmaptap.tap(loss, "loss", step=i)
        pmaptap.tap(x + i + offset, "gn", step=i, dedup="per_device")
        pmaptap.tap(x * jnp.ones(3) + i, "w", step=i, dedup="per_device")
        return x

    f = jax.pmap(body, axis_name="d", in_axes=(0, None))
    with pmaptap.Session(path, forward=list(forward), **session) as s:
        for i in steps:
            f(jnp.arange(8.0), i)
    return s


def _loss(i, offset=0.0):
    return math.nan if (i == 2 and offset == 0) else i + offset


def _same(a, b):
    return a == b or (math.isnan(a) and math.isnan(b))


def _load(logdir):
    ea = event_accumulator.EventAccumulator(
        str(logdir), size_guidance={"scalars": 0, "histograms": 0}
    )
    ea.Reload()
    return ea


def _points(ea, tag):
    return [(e.step, e.value) for e in ea.Scalars(tag)]


def test_forwarders_module_is_lazy_and_public():
    from conftest import run_python

    run_python("""
        import sys, pmaptap
        f = pmaptap.forwarders
        assert "wandb" not in sys.modules and "mlflow" not in sys.modules
        assert "tensorboardX" not in sys.modules and "jax" not in sys.modules
        assert sorted(f.__all__) == ["MLflow", "TensorBoard", "WandB"]
        assert f.TensorBoard.__module__ == "pmaptap._host.forward.dashboards"
        assert "wandb" not in sys.modules and "mlflow" not in sys.modules
        """)


# ------------------------------------------------------------------ TensorBoard


def test_tensorboard_forwarder_writes_scalars_and_histograms(tap_path, tmp_path):
    tb = pmaptap.forwarders.TensorBoard(tmp_path / "tb")
    _train(tap_path, range(4), forward=[tb], run="tbf")
    ea = _load(tmp_path / "tb" / "tbf")
    got = _points(ea, "loss")
    assert [s for s, _ in got] == [0, 1, 2, 3]
    assert all(_same(v, _loss(s)) for s, v in got)
    for d in range(8):
        assert _points(ea, f"gn/device_{d}") == [(s, float(d + s)) for s in range(4)]
        assert [h.step for h in ea.Histograms(f"w/device_{d}")] == [0, 1, 2, 3]
    tb.close()


def test_tensorboard_forwarder_of_a_resumed_run_ends_with_one_point_per_step(tap_path, tmp_path):
    logdir = tmp_path / "tb"
    # Two forwarder objects, as two processes (the job, then its restart)
    # would have: the second knows nothing of what the first wrote.
    _train(tap_path, range(8), 0.0, [pmaptap.forwarders.TensorBoard(logdir)], run="r")
    first = _load(logdir / "r")
    assert [s for s, _ in _points(first, "loss")] == list(range(8))
    second = pmaptap.forwarders.TensorBoard(logdir)
    s = _train(tap_path, range(5, 10), 100.0, [second], run="r", resume=True)
    assert s.attempt == 1
    ea = _load(logdir / "r")
    want = {i: _loss(i, 100.0 if i >= 5 else 0.0) for i in range(10)}
    got = _points(ea, "loss")
    assert [st for st, _ in got] == list(range(10)), got  # one point per step
    assert all(_same(v, want[st]) for st, v in got)
    for d in (0, 7):
        got = _points(ea, f"gn/device_{d}")
        assert got == [(i, d + i + (100.0 if i >= 5 else 0.0)) for i in range(10)]
        assert [h.step for h in ea.Histograms(f"w/device_{d}")] == list(range(10))
    # The batch readers tell the same story.
    loss = {r["step"]: r["value"] for r in pmaptap.read(tap_path) if r["name"] == "loss"}
    assert all(_same(loss[i], want[i]) for i in range(10)) and len(loss) == 10


def test_export_follow_of_a_restart_ends_with_one_point_per_step(tap_path, tmp_path):
    tb = str(tmp_path / "tb")
    exporter = subprocess.Popen(
        [sys.executable, "-m", "pmaptap", "export", tap_path, "--tensorboard", tb]
        + ["--follow", "--interval", "0.05", "--name", "loss"],
        env=subprocess_env(1),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    def points():
        if not glob.glob(os.path.join(tb, "f", "events.*")):
            return []
        ea = _load(os.path.join(tb, "f"))
        return _points(ea, "loss") if "loss" in ea.Tags()["scalars"] else []

    try:
        _train(tap_path, range(8), 0.0, run="f")
        wait_for(lambda: len(points()) == 8, 60, "the first attempt's 8 points")
        _train(tap_path, range(5, 10), 100.0, run="f", resume=True)
        want = {i: _loss(i, 100.0 if i >= 5 else 0.0) for i in range(10)}
        wait_for(lambda: [s for s, _ in points()] == list(range(10)), 60, "one point per step 0-9")
        got = points()
        assert all(_same(v, want[s]) for s, v in got), got
        assert exporter.poll() is None
        exporter.send_signal(signal.SIGINT)
        _, err = exporter.communicate(timeout=60)
        assert exporter.returncode == 0, err
        assert "Traceback" not in err
        assert [s for s, _ in points()] == list(range(10))
    finally:
        if exporter.poll() is None:
            exporter.kill()
            exporter.wait()


def test_callable_forwarders_see_the_attempt(tap_path):
    _train(tap_path, range(3), run="a")
    got: list[dict] = []
    _train(tap_path, range(2, 4), 100.0, [got.append], run="a", resume=True)
    data = [r for r in got if r["kind"] != "meta"]
    assert data and all(r["attempt"] == 1 for r in data)
    meta = [r for r in got if r["name"] == "pmaptap/attempt"]
    assert [m["attempt"] for m in meta] == [1]


# ------------------------------------------------------------------ W&B


def _wval(v):
    return float(v) if isinstance(v, str) else v  # "NaN", "Infinity"


def test_wandb_forwarder_offline(tap_path, tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    # No run yet: the forwarder would start its own at the session's open.
    assert pmaptap.forwarders.WandB().owned
    run = wandb.init(
        project="pmaptap-test", dir=str(tmp_path), settings=wandb.Settings(console="off")
    )
    try:
        assert not pmaptap.forwarders.WandB().owned  # the user's run
        with pytest.raises(ValueError, match=r"wandb.init\(\) arguments"):
            pmaptap.forwarders.WandB(project="other")  # a run exists already
        _train(tap_path, range(4), forward=[pmaptap.forwarders.WandB()], run="wb")
        # A restart replaying steps 2-3 (a fresh forwarder, as in a new process).
        fw = pmaptap.forwarders.WandB()
        _train(tap_path, range(2, 4), 100.0, [fw], run="wb", resume=True)
    finally:
        run.finish()
    (run_dir,) = glob.glob(os.path.join(tmp_path, "wandb", "offline-run-*"))
    rows = wandb_history(run_dir)
    # One row per step: the loss and the 8 devices' series together; W&B
    # cannot rewrite the replayed steps, they come again, the restart marked.
    assert [r["pmaptap/step"] for r in rows] == [0, 1, 2, 3, 2, 3]
    assert [r.get("pmaptap/attempt") for r in rows] == [None] * 4 + [1, None]
    assert [(r["loss"], r["gn/device_1"]) for r in rows[4:]] == [(102, 103), (103, 104)]
    rows = rows[:4]
    for r in rows:
        s = r["pmaptap/step"]
        assert _same(_wval(r["loss"]), _loss(s))
        assert {k: r[k] for k in r if k.startswith("gn/")} == {
            f"gn/device_{d}": d + s for d in range(8)
        }
        assert not any(k.startswith("w") for k in r)  # arrays are not metrics


# ------------------------------------------------------------------ MLflow


def test_mlflow_forwarder_logs_into_the_users_run_by_id(tap_path, tmp_path):
    mlflow = pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    try:
        # No active run: one of its own, created at the session's open only.
        assert pmaptap.forwarders.MLflow().owned
        with mlflow.start_run() as active:
            fw = pmaptap.forwarders.MLflow()
            assert not fw.owned
            # A tap whose replicas disagree: each value in its own series.
            f = jax.pmap(
                lambda x: pmaptap.tap(x, "split", step=0, dedup="replicated"),
                axis_name="d",
                devices=jax.devices()[:2],
            )
            with pmaptap.Session(tap_path, run="ml", forward=[fw]):
                f(jnp.arange(2.0))
            # Another file: a plain session on run "ml" again would be refused.
            _train(str(tmp_path / "train.jsonl"), range(4), forward=[fw], run="ml")
            # A backward tap's tag (g@backward): MLflow refuses '@'.
            rec = {"name": "g", "step": 7, "kind": "replicated", "dtype": "float32"}
            fw({**rec, "value": 0.5, "time": 1.0})
            fw({**rec, "value": 0.25, "time": 1.0, "pass": "backward"})
            fw.flush()
        run_id = active.info.run_id
    finally:
        mlflow.set_tracking_uri(None)
    client = MlflowClient(uri)
    # Everything in the user's run; no stray runs made on the forwarding thread.
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r.info.run_id for r in runs] == [run_id]
    hist = client.get_metric_history(run_id, "loss")
    assert [m.step for m in hist] == [0, 1, 2, 3]
    assert all(_same(m.value, _loss(m.step)) for m in hist)
    for d in (0, 5):
        assert [(m.step, m.value) for m in client.get_metric_history(run_id, f"gn/device_{d}")] == [
            (s, d + s) for s in range(4)
        ]
    assert client.get_metric_history(run_id, "w/device_0") == []
    recs = [r for r in pmaptap.read(tap_path) if r["name"] == "split"]
    assert len(recs) == 2 and all(r.get("divergent") for r in recs)
    for d in (0, 1):
        (m,) = client.get_metric_history(run_id, f"split/divergent/device_{d}")
        assert (m.step, m.value) == (0, float(d))
    assert client.get_metric_history(run_id, "split") == []
    assert [m.value for m in client.get_metric_history(run_id, "g")] == [0.5]
    (m,) = client.get_metric_history(run_id, "g_backward")
    assert (m.step, m.value, m.timestamp) == (7, 0.25, 1000)


def test_mlflow_forwarder_of_a_resumed_run_marks_the_restart(tap_path, tmp_path):
    mlflow = pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("e")).info.run_id
    _train(tap_path, range(4), forward=[pmaptap.forwarders.MLflow(run_id, tracking_uri=uri)])
    _train(
        tap_path,
        range(2, 5),
        100.0,
        [pmaptap.forwarders.MLflow(run_id, tracking_uri=uri)],
        resume=True,
    )
    # MLflow keeps every value logged at a step: both attempts' at 2 and 3.
    hist = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "loss"))
    assert [s for s, _ in hist] == [0, 1, 2, 2, 3, 3, 4]
    att = [(m.step, m.value) for m in client.get_metric_history(run_id, "pmaptap/attempt")]
    assert att == [(2, 1.0)]
    assert mlflow is not None
