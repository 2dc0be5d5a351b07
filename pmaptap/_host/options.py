"""Every default of the host pipeline, once: ``Session``, ``pmaptap.Writer``
and ``Pipeline`` (with its queue) take their keyword defaults from
``DEFAULTS``, so that a default changed here is changed for all of them
(docs/api.md's option tables document these values). Nothing here imports
JAX (``pmaptap.Writer`` imports it with JAX made unimportable)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    # The bounded queue between XLA's callback thread and the aggregator
    # (queue.py): its policy when full and its bounds.
    overflow: str = "drop_oldest"
    max_pending: int = 1_000_000
    max_pending_bytes: int = 1 << 30
    # Seconds one lock attempt of the shared file waits before a retry.
    lock_timeout: float = 1.0
    # "flock" (local disk) or "soft" (NFS and other shared filesystems).
    lock: str = "flock"
    # "file", "sharded" or "auto" (tapfile/source: file_layout).
    layout: str = "auto"
    # Seconds flush() waits for a busy lock (None: no limit), and close()
    # for the drain and the other processes.
    flush_timeout: float | None = 120.0
    close_timeout: float = 60.0
    # Seconds the copies of a step's value wait for the missing ones.
    group_timeout: float = 5.0
    # A session's writer thread: linger to batch lines per lock, the pause
    # after a failed write, and the most records one write takes.
    flush_interval: float = 0.02
    retry_interval: float = 0.2
    max_batch: int = 20_000
    # Forwarders: the most seconds flush()/close() wait for them, and which
    # replicated records reach them.
    forward_timeout: float | None = 10.0
    forward_replicated: str = "process0"
    resume: bool = False
    # pmaptap.Writer (no threads): its buffer goes to the file after this
    # many seconds or records.
    writer_flush_interval: float = 1.0
    max_buffer: int = 1024


DEFAULTS = PipelineOptions()
