"""Ready forwarders for ``Session(path, forward=[...])``: the glue to the
dashboards users already run is one line.

```python
pmaptap.Session(path, forward=[pmaptap.forwarders.TensorBoard("tb")])
pmaptap.Session(path, forward=[pmaptap.forwarders.WandB()])    # after wandb.init()
pmaptap.Session(path, forward=[pmaptap.forwarders.MLflow()])   # in mlflow.start_run()
```

Each imports its library (an optional extra: ``pmaptap[wandb]``,
``pmaptap[mlflow]``, ``pmaptap[tensorboard]``) when it is constructed, never
at ``import pmaptap``. What each logs, and what a restarted run looks like
in each: docs/forwarders.md. The implementation is in
``pmaptap._host.forward`` (dashboards.py).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_IMPL = "pmaptap._host.forward"
__all__ = ["MLflow", "TensorBoard", "WandB"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'pmaptap.forwarders' has no attribute {name!r}")
    obj = getattr(importlib.import_module(_IMPL), name)
    globals()[name] = obj
    return obj


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from pmaptap._host.forward import MLflow, TensorBoard, WandB
