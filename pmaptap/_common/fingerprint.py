"""What a ``pmaptap.fingerprint`` call tells the host, fixed at trace time
(and, under plain jit, bound to the placement of the lowering it runs in).

One payload carries the 64-bit fingerprints (uint32 pairs) of every leaf on
every device holding a copy (or slice) of it, in one of three forms
(``FingerprintSpec.layout``):

- ``GATHERED`` (pmap/shard_map): ``(step, fps[n, leaves, 2])`` from ONE
  device of the job (coordinate 0), rows in row-major coordinate order.
- ``COPY`` (a cond/switch branch or while_loop body, where a collective
  could deadlock): ``(coords, step, fps[leaves, 2])`` from each device.
- ``JIT`` (plain jit, _trace/fingerprint_jit.py): ``(step, fps[n, leaves,
  2])``, one row per partition, from device 0; ``shards`` says where
  partition k lives and which slice of each leaf it holds.

Under ``pmaptap.jit`` the same payloads come from the step's outputs
(_outputs/drain.py; a JIT table with the number ``bind_lowering`` gave).
Specs compare by value: two calls of the same name and leaves are the same
call to JAX's caches. Pure Python: the aggregator thread reads it.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from typing import Any, ClassVar

from pmaptap._common.spec import Placement


class FingerprintLayout(enum.Enum):
    GATHERED = "gathered"
    COPY = "copy"
    JIT = "jit"


@dataclasses.dataclass(frozen=True)
class FingerprintSpec:
    name: str
    every: int
    explicit_step: bool  # the step travels as an argument (else counted here)
    leaves: tuple[str, ...]  # each leaf's path ("layer/w"; "" for a bare array)
    layout: FingerprintLayout
    # GATHERED / COPY: the manual axes and who holds each coordinate.
    placement: Placement = Placement()
    # GATHERED / COPY, per leaf: the positions (in placement.axis_names) of
    # the axes along which its copies differ by design (a block of a value
    # sharded over them, as JAX's varying-axes types say); the copies
    # compared are those with the same coordinates on these axes. () for a
    # replicated value: all copies compared.
    varying: tuple[tuple[int, ...], ...] = ()
    # JIT: the lowering's ShardPlacement (_common/shard_placement.py), or
    # None when the computation is not partitioned (one copy).
    shards: Any = None
    # What routing and the aggregator read from any payload spec.
    restore: ClassVar[tuple] = ()


# JIT specs bound to their lowering's placement, by the number each
# lowering puts in its step's outputs: one step (a trace) can be lowered
# several times (other argument shardings, other devices), and only the
# number in the outputs says which lowering they came from. One entry per
# lowering, as the callback transport keeps one bound host function each.
_lowered: dict[int, FingerprintSpec] = {}
_numbers = itertools.count(1)


def bind_lowering(spec: FingerprintSpec) -> int:
    """Keep ``spec`` (bound to one lowering's placement) and return its
    number (a uint32), for the host to find it again (``lowered``)."""
    key = next(_numbers) & 0xFFFFFFFF
    _lowered[key] = spec
    return key


def lowered(key: int) -> FingerprintSpec | None:
    """The spec ``bind_lowering`` numbered ``key`` (None: unknown)."""
    return _lowered.get(int(key))
