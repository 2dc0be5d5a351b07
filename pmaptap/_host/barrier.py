"""A child forked after JAX's runtime started: what it must not wait on.

JAX cannot run computations in such a child: the runtime's threads (the
PjRt client's, the MLIR thread pool's) stay in the parent; only the objects
that stand for them are copied. Yet at exit the child acted on them, as if
they were its own:

- JAX's ``atexit`` handlers, registered when JAX is imported:
  ``api.clean_up`` -> ``clear_backends`` -> ``effects_barrier()`` and
  ``dispatch.wait_for_tokens`` wait on the parent's runtime tokens, which no
  thread of the child will ever complete (a bare ``os.fork()`` child ending
  in ``sys.exit(0)`` after tapped ``pmap`` steps hung there for > 90 s);
  ``distributed.shutdown()`` there would speak for the parent to the
  coordination service.
- The interpreter's teardown: clearing the modules destroys the inherited
  MLIR thread pool (``mlir.global_thread_pool``) and clients, whose
  destructors join threads that do not exist here (``LLVM ERROR:
  pthread_join failed``, SIGABRT).

So the at-fork hook below, in a child forked after the runtime started (a
backend was created, or ``jax.distributed`` connected), unregisters those
JAX exit handlers and keeps those inherited objects alive until the process
ends (one reference each, deliberately never released: the operating system
reclaims them at exit, which is all the clean-up a child's copies need).
pmaptap's own ``jax.effects_barrier()`` calls (a session's flush/close, the
console at exit) go through ``effects_barrier`` here, which in such a child
returns at once: no computation can have been dispatched in it. The child's
other exit handlers, the user's and pmaptap's, run as usual.

A child forked before the runtime started owns a fresh JAX and is left alone.
The names read from JAX are guarded by
``tests/host/test_fork.py::test_jax_exit_internals_the_fork_hook_reads_are_still_there``.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import sys

# True in a child forked after JAX's runtime started in its parent.
_inherited_runtime = False


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
    # outputs, on the output transport's thread (outputs.py); looked up, not
    # imported: a process that never used it has nothing to wait for.
    outputs = sys.modules.get("pmaptap._host.outputs")
    return outputs is None or outputs.wait(timeout)


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
