"""Multi-process support (placeholder until the multi-host issue lands):
run-id agreement and the close barrier are no-ops in a lone process."""
from __future__ import annotations

from typing import Callable


def _multi_process() -> bool:
    import jax
    try:
        return jax.process_count() > 1
    except Exception:  # noqa: BLE001
        return False


def agree_run_id(make: Callable[[], str]) -> str | None:
    if not _multi_process():
        return None
    return None


def close_barrier(run: str, timeout: float) -> None:
    if not _multi_process():
        return
