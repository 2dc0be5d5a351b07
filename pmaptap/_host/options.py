"""Every default of the host pipeline, once: ``Session``, ``pmaptap.Writer``
and ``Pipeline`` (with its queue) take their keyword defaults from
``DEFAULTS``, so that a default changed here is changed for all of them
(docs/api.md's option tables document these values). Nothing here imports
JAX (``pmaptap.Writer`` imports it with JAX made unimportable)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    # Session's options, as docs/api.md's table says them.
    overflow: str = "drop_oldest"
    max_pending: int = 1_000_000
    max_pending_bytes: int = 1 << 30
    lock_timeout: float = 1.0
    lock: str = "flock"
    layout: str = "auto"
    flush_timeout: float | None = 120.0
    close_timeout: float = 60.0
    group_timeout: float = 5.0
    flush_interval: float = 0.02
    forward_timeout: float | None = 10.0
    forward_replicated: str = "process0"
    resume: bool = False
    # The writer thread's pause after a failed write, and the most records
    # one write takes.
    retry_interval: float = 0.2
    max_batch: int = 20_000
    # pmaptap.Writer (no threads): its buffer goes to the file after this
    # many seconds or records.
    writer_flush_interval: float = 1.0
    max_buffer: int = 1024


DEFAULTS = PipelineOptions()
