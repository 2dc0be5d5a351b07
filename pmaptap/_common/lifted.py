"""What a step's lifted taps look like, fixed when the step is traced: the
description the trace half (``_outputs/lift.py``) writes and the host half
(``_outputs/drain.py``) reads to turn a step's extra outputs back into the
payloads a host callback would have delivered.

A step's taps form a tree in execution order: a ``Site`` is one tap in the
program, a ``Loop`` a ``scan`` whose body holds taps (its sites' outputs are
stacked, one row per iteration, outermost loop first). Each operand of a
site (valid, coords, step, then the leaves) is either known while tracing
(kept here as a NumPy value, costs no output) or one extra output of the
step, in tree order.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Union

from pmaptap._common.spec import TapSpec

# Where a lifted tap's copies live, which decides the payloads it becomes.
ROWS = "rows"  # one copy per device of a mapped axis (pmap, shard_map): a row each
SHARDS = "shards"  # plain jit: the value's shards, where the step's output holds them
ONE = "one"  # plain jit of scalars, or one device: one copy


@dataclasses.dataclass(frozen=True, eq=False)
class Site:
    spec: TapSpec
    where: str  # ROWS, SHARDS or ONE
    # Per operand (valid, coords, step, *leaves): its value when known while
    # tracing, else None (it travels as an output). valid None at its slot
    # and not traced: always recorded.
    static: tuple[Any, ...]
    traced: tuple[bool, ...]
    # The value is the same on every device by construction (a pmean result,
    # proven at trace time): one copy per process travels to the pipeline.
    proven: bool = False
    loops: int = 0  # enclosing Loops: leading axes of every output, outermost first
    # ROWS lifted out of a shard_map/pmap: the position, among the leading
    # axes, of the axis of one row per mapped device (row-major over the
    # mesh's manual axes); None before it is lifted out of one.
    rows: int | None = None

    @property
    def outputs(self) -> int:
        return sum(self.traced)


@dataclasses.dataclass(frozen=True, eq=False)
class Loop:
    length: int
    reverse: bool  # iterations ran last to first
    children: tuple["Node", ...]


@dataclasses.dataclass(frozen=True)
class Packed:
    """Where one small output the host reads whole lies in the step's
    bundle (the first extra output: every such output's bytes, each at an offset
    aligned to ``PACK_ALIGN``): one copy to the host for all of them, as a
    small device-to-host transfer costs what it costs per transfer, not per
    byte."""

    offset: int
    nbytes: int
    dtype: Any  # numpy dtype
    shape: tuple[int, ...]


PACK_ALIGN = 8
# Outputs up to this size are packed (the bundle is a copy on the device).
PACK_MAX_BYTES = 64 * 1024


@dataclasses.dataclass(frozen=True)
class FromArgument:
    """One output the host takes from the step's call instead: an argument
    the step hands to a tap as it came (the step number, most often), which
    the program then does not return (docs/performance.md, "An argument
    tapped as it came"). ``key``: the argument's position or keyword;
    ``leaf``: which of its leaves; ``dtype``, ``shape``: as traced.
    ``every`` > 0: not the argument but whether it is a multiple of
    ``every`` (a fingerprint's ``due`` flag, decided on the host)."""

    key: int | str
    leaf: int
    dtype: Any  # numpy dtype
    shape: tuple[int, ...]
    every: int = 0

    def due(self, step: Any) -> Any:
        """Whether ``step`` (the argument's value, on the host or the
        device) is a multiple of ``every``: the one rule of the three reads."""
        return step % self.every == 0


# Per output of the nodes, in order: its position among the step's extra
# outputs, where it lies in the bundle, or the argument of the call it is.
Packing = tuple[Union[int, Packed, FromArgument], ...]  # noqa: UP007 (a runtime alias on 3.10)

Node = Union[Site, Loop]  # noqa: UP007 (a runtime alias on 3.10)


def sites(nodes: tuple[Node, ...]) -> list[Site]:
    """Every site of a tree, in output order."""
    out: list[Site] = []
    for n in nodes:
        if isinstance(n, Loop):
            out += sites(n.children)
        else:
            out.append(n)
    return out
