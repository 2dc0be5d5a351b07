"""Fingerprints hashed after the step (``pmaptap.jit``): the program that
hashes a step's outputs, compiled while the step compiles.

lift.py leaves a fingerprint of the step's own outputs out of the step
(compiling the hash inside a big step cost several times the hash
program's own compile) and describes it by a ``Later``; jit.py dispatches
the program right after each step (not on a step the host knows is not
due: its step number an argument of the call). A thread started when the step is
traced compiles it beside XLA's compile of the step, where the outputs'
types are known then (every array on the one device of a one-device
process); else it compiles at the first step. A fingerprint of less than
``MIN_BYTES`` whose due steps only the device knows stays in the step.

On a CPU device the program waits until the run has shown it is worth
its compile: where every leaf lies on one CPU device and the host decides
the due steps (or every step is due), the host hashes the arrays where they
lie (_trace/fphash_host.py: the same numbers), on a due step once the step
has computed them, for the first ``HOST_STEPS`` due steps, or until
``IN_FLIGHT_CALLS`` calls' step numbers were still being computed on the
device (the host would wait for them on every step); only then does the
program compile, on a thread of its own, and hash the due steps from the
first one after it is ready. The program's compile beside the step's,
on the cores the step's compile uses, was most of what the fingerprint
added to the first step there; the host's hash costs a few times the
program's on each due step (figures: docs/performance.md).
"""

from __future__ import annotations

import atexit
import dataclasses
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import dispatch

from pmaptap._common.fingerprint import FingerprintSpec, bind_lowering
from pmaptap._common.lifted import FromArgument, Packed
from pmaptap._log import log
from pmaptap._trace import fingerprint, fphash_host
from pmaptap._trace.fingerprint_jit import one_device_placement
from pmaptap._trace.jax_support import single_device_sharding

# JAX's own, as imported (the tests' fixture swaps jax.jit for pmaptap.jit).
_jax_jit = jax.jit
# Leaves of fewer bytes in all are hashed in the step where the device
# decides which steps are due: the program of their own then costs a
# dispatch every step, due or not, which is noise beside a step that
# updates this much but not beside a small step (docs/performance.md).
# Where the host decides (the step number an argument), a step not due
# dispatches nothing, and the hash leaves the step whatever its size.
MIN_BYTES = 16 * 2**20
# Due steps hashed on the host (a CPU device) before the program compiles:
# a run this long has shown it will pay the compile back (docs/performance.md).
HOST_STEPS = 250
# Calls whose step number was still being computed before the program
# compiles: a loop feeding the step's own output back has one every call
# or two; a fresh ``jnp.int32(s)`` can be caught on its way to the device
# now and then, which is not worth a compile beside the steps.
IN_FLIGHT_CALLS = 8


class Later:
    """A fingerprint hashed after the step, by a program of its own, on
    outputs of the step: its (number, table) are the step's last extra
    outputs, appended by the caller of the step (jit.py). Static: one per
    trace of the step."""

    __slots__ = (
        "spec",
        "leaves",
        "flag",
        "_program",
        "_ahead",
        "_host_keys",
        "_hosted",
        "_in_flight",
        "_host_off",
    )

    def __init__(self, spec: FingerprintSpec, leaves: tuple[int, ...]) -> None:
        self.spec = spec
        self.leaves = leaves  # positions among the function's output leaves
        # Where the ``due`` flag lies among the step's extra outputs (its
        # position, or its place in the bundle), or the call's step it is
        # decided from; None: always due.
        self.flag: int | Packed | FromArgument | None = None
        self._program: Callable | None = None
        self._ahead: _Ahead | None = None
        # The host's hash (_on_host): the number its table carries, per
        # device (a lowering's, as the program's has: bind_lowering), and
        # the due steps it hashed.
        self._host_keys: dict[int, int] = {}
        self._hosted = 0
        self._in_flight = 0  # calls whose step number was in flight
        self._host_off = False  # the host's hash failed once: the program's

    def hash(self, flag_source: Any, *leaves: jax.Array) -> tuple[jax.Array, ...]:
        """The program: (the lowering's number, the table) of ``leaves``,
        computed only where the step's flag says the step is due; where
        that is decided from the call's step number, a copy of it too (the
        one jit.py keeps for the drain: no program of its own for it)."""
        if self.flag is None:
            due = None
        elif isinstance(self.flag, Packed):
            due = flag_source[self.flag.offset] != 0
        elif isinstance(self.flag, FromArgument):
            hashed = fingerprint.hashed(self.spec, list(leaves), self.flag.due(flag_source))
            return (*hashed, jnp.copy(flag_source))
        else:
            due = flag_source
        return fingerprint.hashed(self.spec, list(leaves), due)

    def flag_source(self, arrays: list, taken: dict | None = None) -> Any:
        """The one of the step's extra outputs that holds the ``due`` flag
        (the bundle where it is packed), or the call's step (from ``taken``,
        jit.py's); None: always due."""
        if self.flag is None:
            return None
        if isinstance(self.flag, FromArgument):
            return (taken or {}).get((self.flag.key, self.flag.leaf))
        return arrays[0 if isinstance(self.flag, Packed) else self.flag]

    def compile_ahead(self, flag_aval: Any, leaf_avals: list) -> None:
        """Start compiling the program for outputs of these types, where
        they are known now (see the module docstring)."""
        devices = jax.devices()
        if len(devices) != 1 or jax.process_count() != 1:
            return
        if self._host_decides() and devices[0].platform == "cpu":
            return  # hashed on the host (_on_host): nothing to compile
        self._compile_program(devices[0], flag_aval, leaf_avals, lowering=True)

    def __call__(self, flag_source: Any, leaves: list) -> list:
        """Dispatch the program on one step's outputs; none on a step the
        host knows is not due (its records are skipped by the same flag,
        so these outputs are never read). [number, table, the call's step
        number for the drain to read (a program's copy, or what the host
        read) where it was still being computed at the call, else None]."""
        if (
            isinstance(self.flag, FromArgument)
            and isinstance(flag_source, np.ndarray)
            and not self.flag.due(flag_source)
        ):
            return [None, None, None]
        ahead = self._ahead  # (read once: another thread's call may take it)
        if self._program is None and (ahead is None or ahead.running()):
            host = self._on_host(flag_source, leaves)
            if host is not None:
                return host
            ahead = self._ahead
        if self._program is None:
            self._ahead = None
            compiled = None if ahead is None else ahead.result()
            self._program = _jax_jit(self.hash) if compiled is None else compiled
        program = self._program
        try:
            got = list(program(flag_source, *leaves))
        except (TypeError, ValueError) as e:
            if not isinstance(program, jax.stages.Compiled):
                raise
            # Compiled ahead for outputs of other types or another device
            # than these (an argument committed elsewhere, a step run on
            # several devices): jit them as they come, from now on.
            log.debug(f"pmaptap: the fingerprint's program recompiles: {e}")
            self._program = _jax_jit(self.hash)
            got = list(self._program(flag_source, *leaves))
        kept = got[2] if len(got) > 2 and not isinstance(flag_source, np.ndarray) else None
        return [got[0], got[1], kept]

    def _host_decides(self) -> bool:
        """Whether the host knows which steps are due (every step, or the
        call's step number)."""
        return self.flag is None or isinstance(self.flag, FromArgument)

    def _on_host(self, flag_source: Any, leaves: list) -> list | None:
        """(the number, the table) hashed on the host where every leaf lies
        on one CPU device and the host decides the due steps (None
        elsewhere: the program hashes them). Reading the leaves waits for
        the step that computes them; the hash is done before the call
        returns, so before the caller can donate them. A step number still being
        computed when the call was made (the last step's output) is waited
        for too, which would hold the loop to the device on every step: the
        program, which decides on the device, starts compiling once
        ``IN_FLIGHT_CALLS`` calls have had one."""
        if self._host_off or not (self._host_decides() and fphash_host.SUPPORTED):
            return None
        device = None
        for x in leaves:
            if not isinstance(x, jax.Array) or len(x.sharding.device_set) != 1:
                return None
            (d,) = x.sharding.device_set
            if d.platform != "cpu" or (device is not None and d != device):
                return None
            device = d
        if device is None or any(x.dtype in fphash_host.PROGRAM_ONLY for x in leaves):
            return None
        kept = None
        if isinstance(self.flag, FromArgument):
            if not isinstance(flag_source, np.ndarray):
                if isinstance(flag_source, jax.Array) and not flag_source.is_ready():
                    self._in_flight += 1  # (not another program's copy, ready)
                    if self._in_flight >= IN_FLIGHT_CALLS:
                        self._compile_program(device, self._flag_type(), leaves)
                flag_source = kept = np.asarray(flag_source)
            if not self.flag.due(flag_source):
                return [None, None, kept]
        key = self._host_keys.get(device.id)
        if key is None:
            place = one_device_placement(device, tuple(tuple(x.shape) for x in leaves))
            key = bind_lowering(dataclasses.replace(self.spec, shards=place))
            self._host_keys[device.id] = key
        table = np.zeros((jax.device_count(), len(leaves), 2), np.uint32)
        try:
            table[0] = fphash_host.fingerprints([np.asarray(x) for x in leaves])
        except Exception as e:  # noqa: BLE001 - the program hashes them instead
            log.warning(
                f"pmaptap: fingerprint {self.spec.name!r}: the host's hash failed ({e!r}); "
                "XLA's program hashes it from now on"
            )
            self._host_off = True
            return None
        self._hosted += 1
        if self._hosted >= HOST_STEPS:
            self._compile_program(device, self._flag_type(), leaves)
        return [np.uint32(key), table, kept]

    def _flag_type(self) -> jax.ShapeDtypeStruct | None:
        """The type of the call's step number the due steps are decided
        from (None: always due)."""
        if not isinstance(self.flag, FromArgument):
            return None
        return jax.ShapeDtypeStruct(self.flag.shape, self.flag.dtype)

    def _compile_program(
        self, device: Any, flag_type: Any, leaf_types: list, lowering: bool = False
    ) -> None:
        """Start compiling the program on a thread of its own for a flag
        and outputs of these types on ``device`` (the host hashes until it
        is ready); ``lowering``: the step is being lowered on this thread
        (``_Ahead``). Once."""
        if self._ahead is not None:
            return
        one = single_device_sharding(device)

        def struct(x: Any) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one, weak_type=x.weak_type)

        flag = None if flag_type is None else struct(flag_type)
        structs = [struct(x) for x in leaf_types]
        self._ahead = _Ahead(self.hash, flag, *structs, lowering=lowering)


# How long a program waits for the step's lowering to end before it is
# traced all the same (a trace that is never lowered: eval_shape).
LOWERED_WAIT_S = 10.0
# How long the interpreter's exit waits for a program being compiled.
EXIT_WAIT_S = 60.0
# The threads that traced a step whose hash waits for its lowering to end.
_waiting: dict[int, list[threading.Event]] = {}
_waiting_lock = threading.Lock()


def _on_duration(event: str, duration_secs: float, **kwargs: Any) -> None:
    """JAX's monitoring listener: a module lowered on a thread that traced
    a step releases the hash programs waiting for it."""
    if event != dispatch.JAXPR_TO_MLIR_MODULE_EVENT:
        return
    with _waiting_lock:
        released = _waiting.pop(threading.get_ident(), [])
    for e in released:
        e.set()


jax.monitoring.register_event_duration_secs_listener(_on_duration)


# The programs being compiled, which the interpreter's exit waits for.
_compiling: set[_Ahead] = set()
_compiling_lock = threading.Lock()
_compiling_registered = False
_exiting = threading.Event()


def _at_exit() -> None:
    """Wait for the programs being compiled; those not started yet are
    not. A compile left running as the interpreter ends aborts the
    process (XLA's thread, returning into Python then, is ended in the
    middle of C++ frames: ``terminate called after throwing an instance of
    ''``). Registered at the first program, after ``import jax``, so it
    runs before JAX's own exit handlers."""
    _exiting.set()
    with _compiling_lock:
        waiting = list(_compiling)
    deadline = time.monotonic() + EXIT_WAIT_S
    for ahead in waiting:
        ahead.lowered.set()
        ahead.thread.join(max(0.0, deadline - time.monotonic()))
        if ahead.thread.is_alive():
            log.warning(
                "pmaptap: the fingerprint's program was still compiling "
                f"{EXIT_WAIT_S:g}s into the interpreter's exit"
            )
            return


class _Ahead:
    """One program compiling on a thread of its own, once the step that
    made it is lowered: tracing and lowering it are Python, which would
    hold the interpreter lock against the step's own lowering; from then
    on the step is in XLA's compiler, which does not hold it."""

    __slots__ = ("_compiled", "_x64", "lowered", "thread")

    def __init__(self, fun: Callable, *args: Any, lowering: bool = True) -> None:
        """``lowering``: a step is being lowered on this thread, which the
        program waits for (else it compiles at once)."""
        self._compiled: Any = None
        # The trace's x64 setting is the thread's own: the types must be
        # read as the step reads them.
        self._x64 = bool(jax.config.jax_enable_x64)
        self.lowered = threading.Event()
        if lowering:
            with _waiting_lock:
                _waiting.setdefault(threading.get_ident(), []).append(self.lowered)
        else:
            self.lowered.set()
        self.thread = threading.Thread(
            target=self._run, args=(fun, args), name="pmaptap-compile", daemon=True
        )
        global _compiling_registered
        with _compiling_lock:
            if not _compiling_registered:
                atexit.register(_at_exit)
                _compiling_registered = True
            _compiling.add(self)
        self.thread.start()

    def _run(self, fun: Callable, args: tuple) -> None:
        try:
            self.lowered.wait(LOWERED_WAIT_S)
            if _exiting.is_set():
                return  # (the first step would compile it: there is none)
            with jax.enable_x64(self._x64):
                self._compiled = _jax_jit(fun).lower(*args).compile()
        except Exception as e:  # noqa: BLE001 - the first step compiles it instead
            log.debug(f"pmaptap: compiling the fingerprint's program ahead failed: {e!r}")
        finally:
            with _compiling_lock:
                _compiling.discard(self)

    def running(self) -> bool:
        """Whether it is still being compiled."""
        return self.thread.is_alive()

    def result(self) -> Any:
        """The compiled program, or None where compiling it failed."""
        self.thread.join()
        return self._compiled
