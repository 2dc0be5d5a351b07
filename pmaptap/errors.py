"""Every exception pmaptap raises, in one place.

Each subclasses a built-in so callers can catch them generically (a path
problem is also an ``OSError``, a bad plot request a ``ValueError``), and each
message says what to do about it. ``TapError`` is the base of everything the
tap pipeline reports.
"""

from __future__ import annotations

import importlib
import numbers
from typing import Any


class TapError(RuntimeError):
    """A background failure (disk, permissions, lock, dropped records),
    reported at the next ``flush()`` / ``close()`` rather than inside XLA.

    ``path`` names the tap file when there is one; ``errors`` holds the
    underlying exceptions, oldest first."""

    def __init__(
        self, message: str, *, path: str | None = None, errors: tuple[BaseException, ...] = ()
    ) -> None:
        super().__init__(message)
        self.path = path
        self.errors = errors


class TapPathError(TapError, OSError):
    """The tap file or its lock cannot be created or opened. Also an
    ``OSError`` (``errno`` and ``filename`` kept from the cause), so the
    ``except OSError`` that code writes around file paths catches it."""

    def __init__(self, message: str, *, path: str | None = None, errno: int | None = None) -> None:
        if errno is None:
            OSError.__init__(self, message)
        else:
            OSError.__init__(self, errno, message)
        self.message = message
        self.filename = path
        self.path = path
        self.errors = ()

    def __str__(self) -> str:
        # The message, always: OSError's own str becomes "[Errno N] msg:
        # 'path'" once ``filename`` is set, and "[Errno None] None: 'path'"
        # (the message lost) when there is no errno, as for an object store.
        return self.message


class LockBusy(TapError):
    """The shared lock was not acquired in time. The pipeline retries later;
    it surfaces only in a flush/close timeout message (naming the holder)."""


class SessionError(RuntimeError):
    """A session was used in a way its lifecycle does not allow
    (a second open session, flush after close, ...)."""


class DistributedError(RuntimeError):
    """The launcher's settings are unusable or initialization came too late."""


class CallbackException(RuntimeError):
    """A host_callback tap function raised on the host. Raised once, by
    ``host_callback.barrier_wait``.

    ``original`` (also ``__cause__``) is the first exception since the previous
    barrier; ``errors`` holds all of them, in the order they happened.
    """

    def __init__(self, message: str, errors: tuple[BaseException, ...]) -> None:
        super().__init__(message)
        self.errors = errors
        self.original = errors[0] if errors else None


class AssembleError(ValueError):
    """``pmaptap.assemble`` cannot put one array together from the records
    as written (missing or disagreeing slices, a value that does not fill
    its slice, ...); the message names the tap, the step, the leaf and the
    devices."""


class MissingBytes(ValueError):
    """A record's stored bytes (an array value written as bytes beside the
    tap file) are missing or not what its line says."""


class PlotError(ValueError):
    """The records cannot be plotted as asked; the message says why."""


class NeedSerial(Exception):
    """Internal to the readers (never raised to a caller): two pieces of a
    run that ``summary``/``validate --jobs`` read in separate processes
    cannot be merged exactly (the same id written with two types, as 1 and
    1.0; a device met at two sets of coordinates), so the run is read in
    one process instead."""


class WorkerError(RuntimeError):
    """A worker process of ``summary``/``validate --jobs N`` failed (its
    traceback follows the first line) or ended (killed: the OOM killer,
    say): the read is given up. The command says so in one line and exits
    with status 2, never 1 (``validate``'s "problems found")."""


class CliError(Exception):
    """A problem with what was asked on the command line; printed as one
    line, exit status 2."""


def checked_number(
    owner: str,
    name: str,
    value: Any,
    *,
    integer: bool = False,
    least: float = 0,
    none: bool = False,
) -> Any:
    """``value`` of ``owner``'s numeric option ``name`` (``Session``'s,
    ``Writer``'s), or a ``ValueError`` saying what it takes: refused where
    it is given, a string or a negative number would surface far away (a
    bare ``TypeError`` in the writer thread, a lock that waits forever)."""
    if value is None and none:
        return None
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind) or not value >= least:
        what = "an int" if integer else "a number of seconds"
        raise ValueError(
            f"{owner}: {name} must be {what} >= {least:g}{' or None' if none else ''}; "
            f"got {value!r}"
        )
    return int(value) if integer else float(value)


def checked_flag(owner: str, name: str, value: Any) -> bool:
    """``value`` of ``owner``'s on/off option ``name``, or a ``ValueError``
    saying what it takes: ``bool(value)`` would take any non-empty string
    ("no", "false") or non-zero number for True, far from where it was
    given. A NumPy bool is a bool."""
    if isinstance(value, bool):
        return value
    import numpy as np  # here: the readers import this module without needing NumPy yet

    if not isinstance(value, np.bool_):
        raise ValueError(f"{owner}: {name} must be True or False; got {value!r}")
    return bool(value)


def resumed_step_message(name: str, fn: str = "pmaptap.tap") -> str:
    """Why a resumed session refuses a tap with no ``step=``: the trace-time
    ValueError's text and the host's TapError's (a tap traced before the
    session opened)."""
    return (
        f"{fn}({name!r}) has no step= and the session resumes a run "
        "(Session(resume=True)): an automatic step counts the tap's calls from 0 "
        "in every attempt, so a restart's replayed steps would be filed under the "
        "wrong step numbers and supersede the earlier attempt's real ones. Pass "
        f"step= (the training step: {fn}(x, {name!r}, step=step))."
    )


def optional(module: str, who: str, extra: str) -> Any:
    """``module``, of the optional extra ``extra`` that ``who`` needs; if it
    is not installed, an ImportError that says how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        raise ImportError(
            f'{who} needs {top}, an optional extra: pip install "pmaptap[{extra}]" '
            f"(or pip install {top})"
        ) from e
