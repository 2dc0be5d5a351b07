"""The host side of ``pmaptap.host_callback``: one background thread per
process (the *executor*) that converts tapped arrays, resolves devices and
runs the user's tap / print / call functions in arrival order, catching
their errors for ``barrier_wait``. XLA's callback thread only queues work
here (it holds the GIL and blocks its device)."""

from __future__ import annotations

import atexit
import collections
import os
import threading
import traceback
from typing import Any, Callable

import jax
import numpy as np

from pmaptap._common.spec import Placement
from pmaptap._log import log


# --------------------------------------------------------------- executor
class _Executor:
    """One FIFO worker thread; ``submit`` never blocks, so it is safe to call
    from XLA's callback thread. Tickets number the jobs so ``wait`` can tell
    when everything submitted before a point has run."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._jobs: collections.deque[Callable[[], None]] = collections.deque()
        self._submitted = 0
        self._done = 0
        # (error, name of the function that raised), in the order they came.
        self._errors: list[tuple[BaseException, str]] = []
        self._stopping = False
        self.pid = os.getpid()
        self.thread = threading.Thread(target=self._loop, daemon=True, name="pmaptap-host-callback")
        self.thread.start()

    def submit(self, job: Callable[[], None]) -> int:
        with self._cv:
            self._jobs.append(job)
            self._submitted += 1
            self._cv.notify_all()
            return self._submitted

    def ticket(self) -> int:
        with self._cv:
            return self._submitted

    def wait(self, ticket: int, timeout: float | None = None) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: self._done >= ticket, timeout)

    def record_error(self, e: BaseException, where: str = "a host callback") -> None:
        with self._cv:
            self._errors.append((e, where))

    def take_errors(self) -> list[tuple[BaseException, str]]:
        with self._cv:
            errors, self._errors = self._errors, []
            return errors

    def stop(self, timeout: float) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self.thread.join(timeout)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._stopping:
                    self._cv.wait()
                if not self._jobs:
                    return
                job = self._jobs.popleft()
            try:
                job()
            except BaseException as e:  # noqa: BLE001 - jobs report their own
                self.record_error(e)  # errors; this is a last resort
            finally:
                del job  # drop array references before waiting again
                with self._cv:
                    self._done += 1
                    self._cv.notify_all()


_executor_lock = threading.Lock()
_executor_obj: _Executor | None = None


def _executor() -> _Executor:
    global _executor_obj
    with _executor_lock:
        # A forked child inherits the object but not the thread: start anew.
        if _executor_obj is None or _executor_obj.pid != os.getpid():
            first = _executor_obj is None
            _executor_obj = _Executor()
            if first:
                # Registered after jax's own handlers, so it runs before them:
                # taps still queued at exit are run while JAX is alive, and the
                # thread is stopped before the interpreter tears down.
                atexit.register(_at_exit)
        return _executor_obj


def _on_executor_thread() -> bool:
    ex = _executor_obj
    return ex is not None and threading.current_thread() is ex.thread


def _at_exit() -> None:
    ex = _executor_obj
    if ex is None or ex.pid != os.getpid():
        return
    try:
        jax.effects_barrier()
        if not ex.wait(ex.ticket(), timeout=30.0):
            log.warning("[pmaptap] host_callback: tap functions still running at exit")
        for e, _ in ex.take_errors():
            log.error(
                "[pmaptap] host_callback: a tap function raised and no "
                "barrier_wait() reported it:\n" + _format(e)
            )
    except BaseException as e:  # noqa: BLE001 - never fail the exit
        log.error(f"[pmaptap] host_callback exit handler: {e!r}")
    finally:
        ex.stop(5.0)


def _format(e: BaseException) -> str:
    return "".join(traceback.format_exception(type(e), e, e.__traceback__))


# --------------------------------------------------------------- devices
class _Devices:
    """Built at trace time (JAX must not be called from the callback thread):
    device id -> Device, and the device reported when no mesh is mapped."""

    def __init__(self, device_index: int, fn: str) -> None:
        local = jax.local_devices()
        if (
            isinstance(device_index, bool)
            or not isinstance(device_index, int)
            or not 0 <= device_index < len(local)
        ):
            raise ValueError(
                f"{fn}: device_index must be an int in "
                f"[0, {len(local)}) (this process's local devices); "
                f"got {device_index!r}."
            )
        self.by_id = {d.id: d for d in jax.devices()}
        # Under plain jit the callback carries no device identity. The old
        # CPU implementation reported local_devices()[replica_id], replica 0
        # outside pmap; device_index selects another one, as it did there.
        self.default = local[device_index]

    def resolve(self, where: Placement, coords: np.ndarray):
        if where.axis_names:
            dev_id = where.device_of(tuple(int(c) for c in coords))
            # None when pmaptap cannot know the mesh: reported, never guessed.
            return None if dev_id is None else self.by_id.get(dev_id)
        if where.eager_device is not None:
            return self.by_id.get(where.eager_device)
        return self.default


def _name_of(fn: Any) -> str:
    inner = getattr(fn, "func", fn)  # functools.partial
    return getattr(inner, "__qualname__", None) or type(inner).__name__
