"""The ready forwarders of ``pmaptap.forwarders``; what each record becomes
(metrics, histograms, divergent copies, a resumed attempt) and whose run
they log to: docs/forwarders.md.

They run on the forwarding thread (``relay.py``), so none may rely on state
a library keeps per thread (MLflow's active run): what they log to is fixed
when they are constructed, on the user's thread. The series are
``relay.scalar_series``'s, tagged as ``pmaptap export --tensorboard`` tags
them.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import threading
from typing import Any

from pmaptap import distributed
from pmaptap._host.forward.relay import scalar_series
from pmaptap.errors import optional
from pmaptap.tapfile.read import attempt_of

ATTEMPT_METRIC = "pmaptap/attempt"
# Where an owned run records the pmaptap run it belongs to.
RUN_TAG = "pmaptap.run"
KEY_TAG = "pmaptap.key"


def run_key(run: str, process: int = 0) -> str:
    """What identifies the dashboard run of pmaptap run ``run`` as forwarded
    by ``process``: the run id itself for process 0, ``<run>/p<k>`` for
    another process that forwards too (each its own dashboard run)."""
    return run if process == 0 else f"{run}/p{process}"


def wandb_id(run: str, process: int = 0) -> str:
    """The W&B run id of a pmaptap run (every attempt uses it, with
    ``resume="allow"``): its characters W&B allows, at most 40, and a hash
    of the whole id, so that distinct ids never meet."""
    key = run_key(run, process)
    safe = re.sub(r"[^A-Za-z0-9_-]+", "-", key).strip("-")[:40]
    return f"{safe}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


class _ByStep:
    """Collects the scalars of the step being forwarded and sends them as one
    row/batch when a record of another step (or attempt) comes, or at
    ``flush()``: the per-device records of one step become one W&B row, one
    MLflow batch."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # flush() runs on the user's thread
        self._step: int | None = None
        self._attempt: int | None = None
        self._time: float | None = None
        self._metrics: dict[str, float] = {}

    def __call__(self, rec: dict) -> None:
        if rec.get("kind") == "meta":
            return
        series = list(scalar_series(rec, mark_divergent=True))
        if not series:
            return
        step, attempt = rec.get("step"), attempt_of(rec)
        t = rec.get("time")
        with self._lock:
            if self._metrics and (step != self._step or attempt != self._attempt):
                self._send()
            if attempt != self._attempt and (self._attempt is not None or attempt > 0):
                # Where a restart begins: the dashboards cannot drop the
                # replayed steps' earlier points, so they are told.
                self._metrics[ATTEMPT_METRIC] = float(attempt)
            self._step, self._attempt = step, attempt
            self._time = float(t) if isinstance(t, (int, float)) else None
            self._metrics.update(series)

    def flush(self) -> None:
        with self._lock:
            self._send()

    def _send(self) -> None:
        if self._metrics and self._step is not None:
            metrics, self._metrics = self._metrics, {}
            self._write(self._step, metrics, self._time)

    def _write(self, step: int, metrics: dict[str, float], time: float | None) -> None:
        raise NotImplementedError


class WandB(_ByStep):
    """Logs to a W&B run: ``run``, or ``wandb.run``, or else one it starts for
    the pmaptap run (``wandb_id(run)``, ``resume="allow"``: every attempt
    continues it) and finishes at the session's end; docs/forwarders.md.

    W&B's own ``_step`` must only grow, and a tap's steps need not (``step=``,
    a restart): each metric is plotted against ``step_metric`` instead."""

    EXIT_CODES = {"finished": 0, "failed": 1, "killed": 143}

    def __init__(self, run: Any = None, *, step_metric: str = "pmaptap/step", **init: Any) -> None:
        super().__init__()
        self.step_metric = step_metric
        self._defined: set[str] = set()
        self._wandb = None
        if run is None:
            wandb = optional("wandb", "pmaptap.forwarders.WandB", "wandb")
            run = wandb.run
            if run is None:
                self._wandb = wandb  # ours to start at open()
        if run is not None and init:
            raise ValueError(
                f"pmaptap.forwarders.WandB: {sorted(init)} are wandb.init() arguments, "
                "for the run the forwarder starts when there is none; this one logs "
                "to an existing run"
            )
        self._init = init
        self.owned = self._wandb is not None
        self.run = run
        if run is not None:
            run.define_metric(step_metric)

    def open(self, run: str, attempt: int) -> None:
        """Start (attempt 0) or continue the W&B run of pmaptap run ``run``."""
        if not self.owned:
            return
        process = distributed.process_index()
        init = dict(self._init)
        config = dict(init.pop("config", None) or {})
        config.setdefault("pmaptap_run", run)
        init.setdefault("name", run_key(run, process))
        init.setdefault("group", run)
        self.run = self._wandb.init(
            id=wandb_id(run, process), resume="allow", config=config, **init
        )
        self._defined = set()
        self.run.define_metric(self.step_metric)

    def end(self, outcome: str) -> None:
        """Finish the run this forwarder started (its exit code says how the
        session ended); a run of the user's is left alone."""
        if not self.owned or self.run is None:
            return
        run, self.run = self.run, None
        run.finish(exit_code=self.EXIT_CODES.get(outcome, 1))

    def _write(self, step: int, metrics: dict[str, float], time: float | None) -> None:
        if self.run is None:
            raise RuntimeError("pmaptap.forwarders.WandB: its W&B run is not open")
        for key in metrics.keys() - self._defined:
            self.run.define_metric(key, step_metric=self.step_metric)
            self._defined.add(key)
        self.run.log({**metrics, self.step_metric: step})


# MLflow refuses other characters in a metric name (on Windows ':' too).
_MLFLOW_BAD = re.compile(r"[^/\w.\- ]" if os.name == "nt" else r"[^/\w.\- :]")


def mlflow_key(tag: str) -> str:
    """A tag as an MLflow metric name: characters MLflow refuses (``@`` of
    ``loss@backward``) become ``_``."""
    return _MLFLOW_BAD.sub("_", tag)


class MLflow(_ByStep):
    """Logs to an MLflow run by its id, through ``MlflowClient``: MLflow's
    active run is per thread, and forwarders run on pmaptap's forwarding
    thread, where ``mlflow.log_metric`` would start a run of its own.

    Which run, the one it owns across attempts, its status at the session's
    end and a resumed run's replayed steps: docs/forwarders.md."""

    # MLflow's limit of metrics per log_batch call.
    BATCH = 1000
    STATUS = {"finished": "FINISHED", "failed": "FAILED", "killed": "KILLED"}

    def __init__(
        self,
        run_id: str | None = None,
        *,
        tracking_uri: str | None = None,
        experiment: str | None = None,
    ) -> None:
        super().__init__()
        mlflow = optional("mlflow", "pmaptap.forwarders.MLflow", "mlflow")
        if run_id is None:
            active = mlflow.active_run()
            if active is not None:
                run_id = active.info.run_id
        if run_id is not None and experiment is not None:
            raise ValueError(
                "pmaptap.forwarders.MLflow: experiment= is where the forwarder "
                "creates its own run; this one logs to an existing run"
            )
        self.owned = run_id is None
        self.run_id = run_id
        self.tracking_uri = tracking_uri or mlflow.get_tracking_uri()
        self._experiment_id: str | None = None
        self._experiment_name = experiment
        if self.owned and experiment is None:
            self._experiment_id = _chosen_experiment(mlflow)
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        self._client = MlflowClient(self.tracking_uri)

    def open(self, run: str, attempt: int) -> None:
        """Continue the MLflow run of pmaptap run ``run`` or create it."""
        if not self.owned:
            return
        client = self._client
        experiment_id = self._experiment_id
        if experiment_id is None:
            name = self._experiment_name or "Default"
            found = client.get_experiment_by_name(name)
            experiment_id = found.experiment_id if found else client.create_experiment(name)
        key = run_key(run, distributed.process_index())
        # Searched by a hash: a run id may hold quotes that a filter string
        # would have to escape.
        digest = hashlib.sha256(key.encode()).hexdigest()[:32]
        runs = client.search_runs(
            [experiment_id], filter_string=f"tags.`{KEY_TAG}` = '{digest}'", max_results=1
        )
        if runs:
            self.run_id = runs[0].info.run_id
            client.update_run(self.run_id, status="RUNNING")
        else:
            tags = {RUN_TAG: run, KEY_TAG: digest}
            # MLflow limits a run name to 250 characters; the tag holds it all.
            self.run_id = client.create_run(
                experiment_id, run_name=key[:250], tags=tags
            ).info.run_id

    def end(self, outcome: str) -> None:
        """Set the status of the run this forwarder owns; a run of the
        user's is left as it is."""
        if self.owned and self.run_id is not None:
            self._client.set_terminated(self.run_id, self.STATUS.get(outcome, "FAILED"))

    def _write(self, step: int, metrics: dict[str, float], time: float | None) -> None:
        if self.run_id is None:
            raise RuntimeError("pmaptap.forwarders.MLflow: its MLflow run is not open")
        ms = int((time if time is not None and math.isfinite(time) else 0.0) * 1000)
        batch = [self._metric(mlflow_key(k), v, ms, step) for k, v in metrics.items()]
        for i in range(0, len(batch), self.BATCH):
            self._client.log_batch(self.run_id, metrics=batch[i : i + self.BATCH])


def _chosen_experiment(mlflow: Any) -> str | None:
    """The experiment ``mlflow.set_experiment`` (or MLFLOW_EXPERIMENT_*)
    chose, as ``mlflow.start_run()`` on this thread would use it; None when
    this MLflow cannot say (then MLflow's default experiment). MLflow has no
    public getter for it: its fluent API's own lookup is used, guarded."""
    getter = getattr(getattr(mlflow.tracking, "fluent", None), "_get_experiment_id", None)
    try:
        return str(getter()) if getter is not None else None
    except Exception:  # noqa: BLE001
        return None


class TensorBoard:
    """Writes TensorBoard event files from the job itself (tensorboardX; no
    TensorFlow), laid out as ``pmaptap export --tensorboard`` lays them out;
    one writer per directory, and a resumed run's ``purge_step``:
    docs/forwarders.md."""

    def __init__(self, logdir: str | os.PathLike) -> None:
        optional("tensorboardX", "pmaptap.forwarders.TensorBoard", "tensorboard")
        from pmaptap.tapfile.export import TensorBoardExport

        self._tb = TensorBoardExport(logdir, mark_divergent=True)
        self.logdir = os.fspath(logdir)
        self._lock = threading.Lock()  # flush()/close() run on the user's thread

    def __call__(self, rec: dict) -> None:
        with self._lock:
            self._tb.add(rec)

    def flush(self) -> None:
        """Everything forwarded so far on disk (the session's ``flush()`` and
        ``close()`` call it). tensorboardX's own flush does not wait for its
        writer thread, so this closes the event files; the next record opens
        new ones."""
        with self._lock:
            self._tb.close_files()

    def close(self) -> None:
        with self._lock:
            self._tb.close()
