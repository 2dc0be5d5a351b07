"""Forwarding: what the writer wrote, handed on to user code as it is
written (``Session(forward=[...])``): relay.py is the forwarding thread and
which records reach it; dashboards.py the ready forwarders of
``pmaptap.forwarders`` (TensorBoard, W&B, MLflow).

The one entry of this sub-package (tests/project/test_layout.py)."""

from pmaptap._host.forward.dashboards import MLflow, TensorBoard, WandB, wandb_id
from pmaptap._host.forward.relay import (
    Forwarders,
    check_replicated,
    check_targets,
    scalar_series,
    select,
)

__all__ = [
    "Forwarders",
    "MLflow",
    "TensorBoard",
    "WandB",
    "check_replicated",
    "check_targets",
    "scalar_series",
    "select",
    "wandb_id",
]
