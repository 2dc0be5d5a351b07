"""The ready forwarders of ``pmaptap.forwarders`` (docs/forwarders.md).

Each is a callable taking one record dict, as ``Session(forward=[...])``
calls every forwarder, with a ``flush()`` that the session calls at its
``flush()``/``close()``. They run on the forwarding thread
(``_host/forward.py``), so none may rely on state that a library keeps per
thread (MLflow's active run): what they log to is fixed when they are
constructed, on the user's thread.

What becomes what, the same in all three (``forward.scalar_series``, tagged
as ``pmaptap export --tensorboard`` tags them):

- each real scalar leaf is a metric at the record's step: ``loss``,
  ``tree/<leaf>``, ``name@backward``; per-device records put the device in
  the name (``grad_norm/device_3``), one series per device;
- each copy of a divergent replicated value (its devices disagreed) goes to
  ``<tag>/divergent/device_<first holder>``, not to ``<tag>``;
- arrays: TensorBoard histograms; W&B and MLflow leave them out (the tap
  file holds them);
- fingerprint records (``pmaptap.fingerprint``): nothing while the copies
  agree; the divergent ones as divergent copies are
  (``tapfile/fingerprints.py: divergence_series``);
- meta records (``pmaptap/dropped``, ``pmaptap/attempt``) are not logged;
- the attempt of a resumed run: TensorBoard purges the replayed steps
  (``purge_step``); W&B and MLflow cannot rewrite what they hold, so they log
  ``pmaptap/attempt`` at the step where a later attempt starts.
"""

from __future__ import annotations

import importlib
import math
import os
import re
import threading
from typing import Any

from pmaptap._host.forward import scalar_series
from pmaptap.tapfile.attempts import attempt_of

ATTEMPT_METRIC = "pmaptap/attempt"


def _require(module: str, extra: str, who: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"pmaptap.forwarders.{who} needs {extra}, an optional extra: "
            f'pip install "pmaptap[{extra}]" (or pip install {extra})'
        ) from e


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
    """Logs to a W&B run: ``run`` or, by default, ``wandb.run`` (the one
    ``wandb.init()`` started; call it first, on the process that forwards).

    W&B's own ``_step`` must only grow, and a tap's steps need not (taps with
    their own ``step=``, a restart): each metric is plotted against
    ``step_metric`` (``pmaptap/step``, set with ``define_metric``) instead.
    A resumed run's replayed steps are logged again (W&B cannot rewrite a
    run's history); ``pmaptap/attempt`` marks the step where they begin."""

    def __init__(self, run: Any = None, *, step_metric: str = "pmaptap/step") -> None:
        super().__init__()
        if run is None:
            wandb = _require("wandb", "wandb", "WandB")
            run = wandb.run
        if run is None:
            raise ValueError(
                "pmaptap.forwarders.WandB: no W&B run; call wandb.init() before "
                "constructing it (on the process that forwards), or pass run="
            )
        self.run = run
        self.step_metric = step_metric
        self._defined: set[str] = set()
        run.define_metric(step_metric)

    def _write(self, step: int, metrics: dict[str, float], time: float | None) -> None:
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

    ``run_id`` defaults to the active run of the thread that constructs the
    forwarder (construct it inside ``with mlflow.start_run():``);
    ``tracking_uri`` to ``mlflow.get_tracking_uri()`` there. Each metric has
    the record's step and time. MLflow keeps every value logged at a step, so
    a resumed run's replayed steps hold both attempts' values (its charts
    draw both); ``pmaptap/attempt`` marks the step where the replay begins."""

    # MLflow's limit of metrics per log_batch call.
    BATCH = 1000

    def __init__(self, run_id: str | None = None, *, tracking_uri: str | None = None) -> None:
        super().__init__()
        mlflow = _require("mlflow", "mlflow", "MLflow")
        if run_id is None:
            active = mlflow.active_run()
            if active is None:
                raise ValueError(
                    "pmaptap.forwarders.MLflow: no active MLflow run in this "
                    "thread; construct it inside `with mlflow.start_run():`, "
                    "or pass run_id="
                )
            run_id = active.info.run_id
        self.run_id = run_id
        self.tracking_uri = tracking_uri or mlflow.get_tracking_uri()
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        self._client = MlflowClient(self.tracking_uri)

    def _write(self, step: int, metrics: dict[str, float], time: float | None) -> None:
        ms = int((time if time is not None and math.isfinite(time) else 0.0) * 1000)
        batch = [self._metric(mlflow_key(k), v, ms, step) for k, v in metrics.items()]
        for i in range(0, len(batch), self.BATCH):
            self._client.log_batch(self.run_id, metrics=batch[i : i + self.BATCH])


class TensorBoard:
    """Writes TensorBoard event files from the job itself (tensorboardX; no
    TensorFlow), laid out as ``pmaptap export --tensorboard`` lays them out:
    ``logdir/<run>/``, scalars as series, arrays as histograms.

    A resumed run: the first record of the new attempt reopens the run's
    event file with ``purge_step`` at its step, so TensorBoard drops the
    earlier attempt's points from there and shows one point per step. One
    process should write a run's directory (process 0, or a ``logdir`` per
    process): TensorBoard reads one growing event file per directory."""

    def __init__(self, logdir: str | os.PathLike) -> None:
        try:
            from pmaptap.tapfile.tensorboard import TensorBoardExport

            self._tb = TensorBoardExport(logdir, mark_divergent=True)
        except ImportError as e:
            raise ImportError(
                "pmaptap.forwarders.TensorBoard needs tensorboardX, an optional "
                'extra: pip install "pmaptap[tensorboard]" (or pip install tensorboardX)'
            ) from e
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
