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
    # Gather the per-device copies on device and call back once per process
    # (instead of once per device) when the gathered payload is at most
    # gather_max_bytes. Off: one callback per device, as jax.debug.callback.
    gather: bool = True
    gather_max_bytes: int = 1 << 20
    # Replicated taps: compare a 64-bit hash of every copy on device and send
    # one copy (plus the hashes). Off: send one copy unverified (cheapest;
    # a divergence between replicas then goes unnoticed).
    verify_replicated: bool = True
    # Replicated (and auto) taps whose value JAX shows at trace time to be
    # the same on every device (the output of a pmean/psum over all the
    # tap's axes, and pure arithmetic on such values; see
    # _trace/invariant.py) send the leader's copy without comparing copies:
    # the comparison could not find a difference. Off: always compare.
    prove_replicated: bool = True
    # A leaf bigger than this (bytes of one copy, one vmap element) is not
    # sent: its statistics are computed on device and the record says
    # "summarized": true (see stats.device_statistics). None: always send whole values.
    # host_callback.id_tap functions always receive the whole value.
    # 16 MiB since arrays are stored as their bytes (tapfile/source/arrays.py): a
    # whole activation costs a copy and a write, not JSON; the limit is now
    # about disk (a tap of N bytes every step writes N bytes a step).
    max_value_bytes: int | None = 16 << 20
    # Taps of one traced body (jit/pmap/shard_map step, scan/cond/while or
    # remat body) that are not in a pmaptap.group() block share ONE
    # gather + cond + callback, emitted when the body's trace ends (see
    # group.auto_offer). Off: one each, where each tap is written.
    auto_group: bool = True
    # pmaptap.jit / pmaptap.pmap: bytes of step outputs (tapped values) on
    # their way to the host before the next step's dispatch waits for them
    # (read at each call, not at trace time): a slow disk slows the loop
    # rather than dropping values or holding unbounded memory.
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
