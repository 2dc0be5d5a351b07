"""Where finished records go: the sinks, and the one place a sink is chosen
(``write_target`` for ``Session`` and ``pmaptap.Writer`` alike, then
``open_sink``). Nothing here imports JAX.

The one entry of this sub-package (tests/project/test_layout.py)."""

from __future__ import annotations

import os
from typing import NamedTuple

from pmaptap._host.sinks import objectstore
from pmaptap._host.sinks.base import Sink
from pmaptap._host.sinks.console import ConsoleSink
from pmaptap._host.sinks.directory import DirectorySink
from pmaptap._host.sinks.file import LOCK_MODES, FileSink
from pmaptap._host.sinks.objectstore import ObjectSink
from pmaptap.tapfile import source

__all__ = [
    "LOCK_MODES",
    "ConsoleSink",
    "DirectorySink",
    "FileSink",
    "ObjectSink",
    "Sink",
    "Target",
    "open_sink",
    "write_target",
]


class Target(NamedTuple):
    """What a ``Session`` or ``Writer`` writes to, worked out once."""

    # The path, absolute unless an object-store URL (kept as given); whether
    # it is a URL, and whether the run already has shards to merge, resolved
    # with it (``run.url``, ``run.sharded``).
    run: source.Run
    # "auto", "file" or "sharded"; an object store's is always "sharded".
    layout: str
    # At least OBJECT_COMMIT_INTERVAL on an object store: one PUT per batch.
    flush_interval: float


def write_target(who: str, path: str | os.PathLike, layout: str, flush_interval: float) -> Target:
    """``path`` resolved once into a ``Target`` (its fields say what an
    object-store URL implies) and ``layout`` checked (a ValueError naming
    ``who``); "auto" is left to the caller, who knows the job's size."""
    if layout not in source.FILE_LAYOUTS:
        raise ValueError(f"{who}: layout must be one of {source.FILE_LAYOUTS}, got {layout!r}")
    text = os.fspath(path)
    run = source.Run(text if source.is_url(path) else os.path.abspath(text))
    if run.url:
        # Read at each use: a test may set it on the module.
        return Target(run, "sharded", max(flush_interval, objectstore.OBJECT_COMMIT_INTERVAL))
    return Target(run, layout, flush_interval)


def open_sink(
    run: source.Run,
    layout: str,
    *,
    process: int | None = None,
    lock_timeout: float,
    lock: str,
    index_existing: bool = False,
) -> Sink:
    """The sink for ``run`` (``write_target``'s) in ``layout`` ("file" or
    "sharded", resolved by the caller). process: None takes JAX's process
    index. lock / lock_timeout / index_existing: FileSink's."""
    # The sinks take the path as a plain str: what the run holds changes as
    # they write (a sharded run's directory appears), so a path they hand on
    # to the readers' helpers is resolved there, as it was.
    path = str(run)
    if run.url:
        return ObjectSink(path, process=process)
    if layout == "sharded":
        return DirectorySink(path, process=process)
    return FileSink(
        path,
        lock_timeout=lock_timeout,
        lock=lock,
        process=process,
        index_existing=index_existing,
    )
