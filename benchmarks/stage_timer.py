"""Where an array tap's time goes, stage by stage: ``timed()`` wraps the
functions of pmaptap's write path with wall-clock timers for the duration
(benchmarks only: the wrappers cost a little themselves, so a pass under
them is not one of the timed rounds)."""

from __future__ import annotations

import importlib
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

# (module, attribute path, label). A label starting with "callback" is on
# XLA's callback threads, "aggregator"/"writer" on pmaptap's threads.
STAGES = (
    (
        "pmaptap._trace.primitive",
        "_copying",
        "callback: the whole host call (its arrays kept, handed over)",
    ),
    ("pmaptap._trace.layouts", "deliver", "callback: hand-over (deliver, queue admit)"),
    # payload.split, timed where the aggregator loop looks it up.
    ("pmaptap._host.pipeline.loops", "split", "aggregator: a payload taken apart"),
    (
        "pmaptap._host.pipeline.aggregate",
        "Aggregator.add_payload",
        "aggregator: its parts to records",
    ),
    ("pmaptap._host.sinks.file", "FileSink.write", "writer: a batch, all of it"),
    (
        "pmaptap._host.sinks.blobs",
        "BlobFile.store",
        "writer: bytes (.npy headers + arrays, writev)",
    ),
    ("pmaptap._host.sinks.base", "Sink._append", "writer: lines (writev, under the lock)"),
)
# Factories: the function they return is what runs per call.
FACTORIES = frozenset({"_copying"})


@contextmanager
def timed() -> Iterator[dict[str, list]]:
    """Yields {label: [seconds, thread name]} filled while inside."""
    spent: dict[str, list] = {}
    lock = threading.Lock()
    undo: list[Callable[[], None]] = []

    def timer(fn: Callable, label: str) -> Callable:
        def wrapped(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                with lock:
                    name = threading.current_thread().name
                    if name.startswith("Dummy"):
                        name = "an XLA callback thread"  # not started by Python
                    entry = spent.setdefault(label, [0.0, name])
                    entry[0] += dt

        return wrapped

    for module, attr, label in STAGES:
        owner: Any = importlib.import_module(module)
        *path, name = attr.split(".")
        for p in path:
            owner = getattr(owner, p)
        if name not in vars(owner):
            continue  # the code moved: report what is there
        orig = vars(owner)[name]
        if name in FACTORIES:

            def factory(*a: Any, _orig=orig, _label=label, **k: Any) -> Any:
                return timer(_orig(*a, **k), _label)

            new: Any = factory
        elif isinstance(orig, staticmethod):
            new = staticmethod(timer(orig.__func__, label))
        else:
            new = timer(orig, label)
        setattr(owner, name, new)
        undo.append(lambda owner=owner, name=name, orig=orig: setattr(owner, name, orig))
    try:
        yield spent
    finally:
        for u in reversed(undo):
            u()
