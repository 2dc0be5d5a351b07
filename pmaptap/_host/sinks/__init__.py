"""The one place a sink is chosen: an object-store URL gets ``ObjectSink``
(immutable chunks), the sharded layout ``DirectorySink`` (this process's own
file), the file layout ``FileSink`` (the shared file under its lock). Used
by ``Session.open`` and ``pmaptap.Writer``; nothing here imports JAX."""

from __future__ import annotations

from pmaptap._host.dirsink import DirectorySink
from pmaptap._host.sink import FileSink, Sink
from pmaptap.tapfile.source import is_url


def open_sink(
    path: str,
    layout: str,
    *,
    url: bool | None = None,
    process: int | None = None,
    lock_timeout: float = 1.0,
    lock: str = "flock",
    index_existing: bool = False,
) -> Sink:
    """The sink for ``path`` (already made absolute unless a URL) in
    ``layout`` ("file" or "sharded", resolved by the caller). url: whether
    ``path`` is an object-store URL, as the caller decided on the path it was
    given (None: ``is_url(path)``). process: None takes JAX's process index
    (sharded layouts). lock / lock_timeout / index_existing: FileSink's."""
    if url is None:
        url = is_url(path)
    if url:
        from pmaptap._host.objsink import ObjectSink

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
