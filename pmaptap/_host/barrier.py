"""Every wait for the taps of dispatched steps: ``effects_barrier`` (flush,
close, SIGTERM, exit), a close's bounded ``before_close``; a transport that
delivers on a thread of its own (outputs.py) ``register``s its wait here.

A child forked after JAX's runtime started (what the at-fork hook below
does and why: docs/architecture.md, "A forked child owns nothing of its
parent's"): JAX's exit handlers waited on the parent's tokens (a bare
``os.fork()`` child hung > 90 s after tapped ``pmap`` steps), and the
interpreter's teardown joined threads that exist only in the parent
(``LLVM ERROR: pthread_join failed``). Guarded by
``tests/host/test_fork.py::test_jax_exit_internals_the_fork_hook_reads_are_still_there``.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Callable

from pmaptap._log import log

if TYPE_CHECKING:  # pragma: no cover
    from pmaptap._host.pipeline import Pipeline

# True in a child forked after JAX's runtime started in its parent.
_inherited_runtime = False
_transports: list[tuple[Callable[[float | None], bool], Callable[[], int]]] = []


def register(wait: Callable[[float | None], bool], undelivered: Callable[[], int]) -> None:
    """``wait(timeout)``: whether every step submitted before the call was
    delivered (False after ``timeout`` s); ``undelivered()``: steps not yet."""
    _transports.append((wait, undelivered))


def transports_wait(timeout: float | None = None) -> bool:
    """Every registered transport's wait, within one ``timeout``."""
    deadline = None if timeout is None else time.monotonic() + timeout
    return all([wait(time_left(deadline)) for wait, _ in _transports])


def undelivered() -> int:
    """Steps the registered transports have not delivered yet."""
    return sum(count() for _, count in _transports)


def effects_barrier(timeout: float | None = None) -> bool:
    """``jax.effects_barrier()``, except in a child forked after the runtime
    started, where it would wait for the parent's computations. Then the
    wait for the steps of ``pmaptap.jit`` / ``pmaptap.pmap``, at most
    ``timeout`` seconds: whether they were all delivered."""
    if _inherited_runtime:
        return True
    import jax

    jax.effects_barrier()
    # Steps of pmaptap.jit / pmaptap.pmap deliver their taps from their
    # outputs, on the output transport's thread (outputs.py).
    return transports_wait(timeout)


def dispatched_tokens() -> list:
    """The runtime tokens of the computations the calling thread dispatched
    (their host callbacks have run once these are ready). JAX keeps them
    per thread (``dispatch.runtime_tokens`` is a ``threading.local``):
    ``jax.effects_barrier()`` on another thread waits for nothing, so a
    wait handed to a helper thread takes these with it."""
    if _inherited_runtime:
        return []
    from jax._src import dispatch

    tokens = dispatch.runtime_tokens
    return [
        *getattr(tokens, "current_tokens", {}).values(),
        *getattr(tokens, "output_runtime_tokens", {}).values(),
    ]


def before_close(stall: float | None, pipeline: "Pipeline", limit: float) -> None:
    """``effects_barrier()`` before a session's close, given up after
    ``limit`` s (writes failing under overflow="block": room never comes)
    and, with ``stall``, once no tap arrived for ``stall`` s. On SIGTERM a
    step may never finish (a collective whose peer died): the wait runs on a
    daemon thread, on this thread's tokens (JAX keeps them per thread), and
    is left behind; steps still delivering taps are waited for."""
    if stall is None:
        # In slices: a SIGTERM during the close stops the wait (hurried).
        deadline = time.monotonic() + limit
        delivered = effects_barrier(0.0)
        while not delivered and not pipeline.hurried.is_set() and time_left(deadline):
            delivered = transports_wait(min(time_left(deadline), 0.1))
        if not delivered:
            _said_undelivered(limit)
        return
    tokens = dispatched_tokens()
    done = threading.Event()

    def wait() -> None:
        try:
            for t in tokens:
                t.block_until_ready()
            transports_wait(limit)  # taps leaving dispatched steps as outputs
        except BaseException:  # noqa: BLE001 - a failed step: nothing to wait for
            pass
        finally:
            done.set()

    threading.Thread(target=wait, daemon=True, name="pmaptap-effects-barrier").start()
    if not _taps_quiet(pipeline, stall, limit, done):
        log.warning(
            f"pmaptap: steps dispatched before SIGTERM delivered no tap for "
            f"{stall:g}s (a collective waiting for a dead process?); the taps "
            "of the steps that did not finish are not in the file"
        )


def _said_undelivered(limit: float) -> None:
    log.warning(
        f"pmaptap: {undelivered()} dispatched step(s) of pmaptap.jit / "
        f"pmaptap.pmap taps had not reached the session when its close stopped "
        f"waiting for them (close_timeout={limit:g}s, or SIGTERM; its writes "
        "fail, and overflow='block' keeps them waiting for room); what reaches "
        "pmaptap after the close is printed on stderr"
    )


def time_left(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (None: no deadline), at least 0."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _taps_quiet(pipeline: "Pipeline", quiet: float, limit: float, done: threading.Event) -> bool:
    """Wait until ``done`` is set (True), or no tap has reached
    ``pipeline`` for ``quiet`` seconds, or ``limit`` seconds have passed
    (False)."""
    start = quiet_since = time.monotonic()
    seen = pipeline.queue.offered
    while not done.wait(0.05):
        now, n = time.monotonic(), pipeline.queue.offered
        if n != seen:
            seen, quiet_since = n, now
        if now - quiet_since >= quiet or now - start >= limit:
            return False
    return True


def _runtime_started() -> bool:
    # Only modules already loaded are read: the hook never imports JAX.
    xb = sys.modules.get("jax._src.xla_bridge")
    if xb is not None and getattr(xb, "_backends", None):
        return True
    dist = sys.modules.get("jax._src.distributed")
    state = getattr(dist, "global_state", None)
    return getattr(state, "client", None) is not None


def _keep_alive(obj: object) -> None:
    if obj is not None:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def _after_fork_in_child() -> None:
    global _inherited_runtime
    if not _runtime_started():
        return
    _inherited_runtime = True
    api = sys.modules.get("jax._src.api")
    dispatch = sys.modules.get("jax._src.dispatch")
    for handler in (getattr(api, "clean_up", None), getattr(dispatch, "wait_for_tokens", None)):
        if handler is not None:
            atexit.unregister(handler)
    xb = sys.modules.get("jax._src.xla_bridge")
    mlir = sys.modules.get("jax._src.interpreters.mlir")
    dist = sys.modules.get("jax._src.distributed")
    for obj in (
        getattr(xb, "_backends", None),  # the clients, and their devices' threads
        getattr(xb, "_default_backend", None),
        getattr(mlir, "global_thread_pool", None),
        getattr(dist, "global_state", None),  # the parent's coordination client
    ):
        _keep_alive(obj)


os.register_at_fork(after_in_child=_after_fork_in_child)
