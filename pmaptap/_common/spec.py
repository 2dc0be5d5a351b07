"""The static description of one tap site, fixed at trace time.

A ``TapSpec`` travels inside the host callback's closure, so everything the
host needs to turn raw arrays into records is known without calling JAX
from the callback thread: ``TapSite`` (what was tapped and how it is
recorded), ``Placement`` (where the copies live), ``Transport`` (how they
travel, layouts.py) and, on the host, the ``shards`` of a per-shard
payload. A ``GroupSpec`` describes one callback carrying several taps.
Specs are frozen and compared by value, but nothing hashes them: the
aggregator keys its per-site tables on ``TapSite.tap_id``.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
from typing import Any, ClassVar, Union

DEDUP_MODES = ("auto", "replicated", "per_device")

_ids = itertools.count()


def next_tap_id() -> int:
    return next(_ids)


class Layout(enum.Enum):
    """How the copies of one tap execution travel (see layouts.py); the
    aggregator dispatches on it (_host/pipeline/aggregate.py)."""

    COPY = "copy"  # one callback per device with its own value
    GATHERED = "gathered"  # all copies stacked on axis 0, one callback per process
    VERIFIED = "verified"  # one copy; all copies' hashes compared on device
    VERIFIED_OFF = "verified_off"  # the leader's copy, unverified
    # The leader's copy of a value proven identical on every device at trace
    # time (invariant.py): sent as VERIFIED_OFF, written as VERIFIED.
    PROVEN = "proven"
    # One callback per shard of a partitioned value under plain jit (see
    # shardcall.py); statistics of big leaves, if any, made per shard on its
    # device (shardstats.py).
    SHARDS = "shards"
    # A tap of scalars under plain jit: replicated on every device of the
    # computation by construction. Its callback reads ONE copy, the first
    # device's (partition 0); the record names every device of the
    # computation's device assignment and says one copy was seen
    # (``copies_seen``). Emitted through shardcall.py too (it is the lowering
    # that knows the device assignment), alone or riding in the partitioned
    # callback of the step's per-shard taps.
    WHOLE = "whole"


# The layouts in which one copy per process (its leader's) travels, written
# without a comparison of copies: unverified (VERIFIED_OFF) or proven the
# same on every device at trace time (PROVEN, _trace/invariant.py).
LEADER_COPY = (Layout.VERIFIED_OFF, Layout.PROVEN)


@dataclasses.dataclass(frozen=True)
class TapSite:
    """The tap as written, and the value it sends."""

    name: str
    dedup: str
    every: int
    treedef: Any  # jax PyTreeDef of the tapped value
    explicit_step: bool  # step travels as an argument
    pass_: str = "forward"  # "forward" or "backward" (tap_grad)
    batch_dims: int = 0  # leading axes added by vmap
    # Per leaf: None (sent whole) or the (dtype, shape) of a leaf above
    # options().max_value_bytes whose statistics travel instead (see
    # stats.device_statistics); () when every leaf is sent whole.
    as_statistics: tuple[tuple[str, tuple[int, ...]] | None, ...] = ()
    # Loops enclosing the tap (a scan / fori_loop / while_loop body, nested
    # ones): their iteration indices, outermost first, travel after the
    # device's mesh coordinates (_trace/iteration.py) and records carry them
    # as "iteration". 0 outside any loop body.
    iterations: int = 0
    # One per traced tap: what the aggregator keys its per-site tables on.
    tap_id: int = dataclasses.field(default_factory=next_tap_id)


@dataclasses.dataclass(frozen=True)
class Placement:
    """The manual mesh axes at the tap and who holds each coordinate."""

    axis_names: tuple[str, ...] = ()  # manual mesh axes, in mesh order
    axis_sizes: tuple[int, ...] = ()
    # Device id / process index for every coordinate (row-major over
    # axis_names), or None where pmaptap cannot know: never guessed.
    device_ids: tuple[int, ...] | None = None
    device_processes: tuple[int, ...] | None = None
    local_copies: int = 1  # copies this process receives per step
    eager_device: int | None = None  # device of a concrete (non-traced) value

    @property
    def total_copies(self) -> int:
        return math.prod(self.axis_sizes)

    def coords_of(self, flat: int) -> tuple[int, ...]:
        out = []
        for s in reversed(self.axis_sizes):
            out.append(flat % s)
            flat //= s
        return tuple(reversed(out))

    def device_of(self, coords: tuple[int, ...]) -> int | None:
        if not self.axis_names:
            return self.eager_device
        if self.device_ids is None:
            return None
        return self.device_ids[flat_index(coords, self.axis_sizes)]

    def process_of(self, coords: tuple[int, ...]) -> int | None:
        if self.device_processes is None or not self.axis_names:
            return None
        return self.device_processes[flat_index(coords, self.axis_sizes)]


@dataclasses.dataclass(frozen=True)
class Transport:
    """How copies travel (see layouts.py)."""

    layout: Layout = Layout.COPY
    leaders: tuple[bool, ...] | None = None  # per flat coord: calls back for its process
    # Gathered payloads packed into one uint8 array: (dtype, shape) per leaf.
    packing: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # Sub-byte operands travel widened (layouts._wire): (operand index, own
    # dtype) pairs, narrowed back by the aggregator, off XLA's thread.
    restore: tuple[tuple[int, Any], ...] = ()
    # The step is traced and not proven the same on every device (a
    # per-device counter may differ): the leader layouts, which send the
    # leader's step with every copy, check on device first (layouts.py).
    check_steps: bool = False


@dataclasses.dataclass(frozen=True)
class TapSpec:
    site: TapSite
    placement: Placement
    transport: Transport = Transport()
    # Layout.SHARDS on the host side: the ShardPlacement (_common/shard_placement.py) of
    # the lowering a payload came from; None at trace time.
    shards: Any = None

    @property
    def name(self) -> str:
        """The tap's name (what every message about a payload names)."""
        return self.site.name

    def with_batch(self) -> "TapSpec":
        site = dataclasses.replace(self.site, batch_dims=self.site.batch_dims + 1)
        return dataclasses.replace(self, site=site)

    @property
    def restore(self) -> tuple[tuple[int, Any], ...]:
        return self.transport.restore

    def with_transport(self, **changes: Any) -> "TapSpec":
        return dataclasses.replace(self, transport=dataclasses.replace(self.transport, **changes))


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """One callback carrying the payloads of several taps (see group.py):
    coords, a step per member, then every member's leaves (gathered and
    packed, the leader's copies, one device's own copies, or one device's
    shards under plain jit)."""

    members: tuple[TapSpec, ...]
    member_leaves: tuple[int, ...]  # payload leaves of each member
    packing: tuple[tuple[str, tuple[int, ...]], ...] = ()
    restore: tuple[tuple[int, Any], ...] = ()  # as Transport.restore
    # False when every member is sent from the leader's own copy (all
    # PROVEN or VERIFIED_OFF): nothing was gathered, leaves are that copy.
    gathered: bool = True
    # Taps under plain jit (SHARDS / WHOLE members) bound to the placement of
    # a multi-device lowering (shardcall.py): the payload starts with the
    # partition number (coords, the steps and the leaves follow, one
    # device's shard of each), and each member's ``shards`` is set.
    partitioned: bool = False
    # What routing and error messages read from any payload spec.
    name: ClassVar[str] = "pmaptap/group"


# What one host callback carries a description of.
PayloadSpec = Union[TapSpec, GroupSpec]  # noqa: UP007 (a runtime alias on 3.10)


def flat_index(coords: tuple[int, ...], sizes: tuple[int, ...]) -> int:
    idx = 0
    for c, s in zip(coords, sizes):
        idx = idx * s + int(c)
    return idx
