"""Process-wide, trace-time options of the emission fast path.

They are read when a tap is *traced*, so change them before the first call
of a jitted/pmapped function (or re-jit): compiled code keeps what it saw.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

import numpy as np

from pmaptap.errors import checked_flag


@dataclasses.dataclass(frozen=True)
class Options:
    """What each option does: docs/api.md's table under "One callback per
    host, not per device"; max_in_flight_bytes: "Taps as step outputs"."""

    gather: bool = True
    gather_max_bytes: int = 1 << 20
    verify_replicated: bool = True
    prove_replicated: bool = True  # see _trace/invariant.py
    # 16 MiB since arrays are stored as their bytes: the limit is about disk.
    # host_callback.id_tap functions always receive the whole value.
    max_value_bytes: int | None = 16 << 20
    auto_group: bool = True  # see group.auto_offer
    # pmaptap.jit / pmaptap.pmap, read at each call: a slow disk slows the
    # loop rather than dropping values or holding unbounded memory.
    max_in_flight_bytes: int = 1 << 30


_current = Options()


def options() -> Options:
    return _current


def _checked(name: str, v: Any) -> Any:
    """``v`` as option ``name`` takes it, or ValueError saying what is
    allowed: options are read at trace time, so a wrong one would surface
    only later and far away (``gather="yes"`` silently meant "on")."""
    if name in ("gather", "verify_replicated", "prove_replicated", "auto_group"):
        return checked_flag("pmaptap.configure", name, v)
    if v is None and name == "max_value_bytes":
        return None
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 0:
        never = " or None (never summarize)" if name == "max_value_bytes" else ""
        raise ValueError(f"pmaptap.configure: {name} must be an int >= 0 (bytes){never}; got {v!r}")
    return int(v)


def configure(**changes) -> Options:
    """Change the fast-path options for taps traced from now on; returns the
    previous options. Unknown names raise TypeError."""
    global _current
    fields = {f.name for f in dataclasses.fields(Options)}
    unknown = set(changes) - fields
    if unknown:
        raise TypeError(
            f"pmaptap.configure: unknown option(s) {sorted(unknown)}; known: {sorted(fields)}"
        )
    changes = {k: _checked(k, v) for k, v in changes.items()}
    prev = _current
    _current = dataclasses.replace(_current, **changes)
    return prev


@contextlib.contextmanager
def configured(**changes) -> Iterator[Options]:
    """``with pmaptap.configured(gather=False): ...`` restores on exit."""
    global _current
    prev = configure(**changes)
    try:
        yield _current
    finally:
        _current = prev
