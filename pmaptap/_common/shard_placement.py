"""Where each shard of a tapped value lives: one ``ShardPlacement`` per tap
per lowering of a call under plain jit (see shardcall.py), read by the
aggregator. A scalar tap's placement (``Layout.WHOLE``) names the devices
and processes of the computation; its slices stay unknown (unused).

Identity is exact by construction. Every callback carries its partition
number ``k`` (see placement.partition_ids), so its device is
``devices[k]`` of the computation's device assignment: no value comparison,
no guess, even for replicated slices. The global slice a device holds comes
from the sharding XLA chose for the operand, reported at compile time
(placement.inspect_operand_sharding); a shard whose shape does not match
that slice, or an executable whose sharding was never reported (loaded from
a compilation cache), gets ``index`` None: exact or null.

Pure Python: the aggregator thread reads it, JAX is not called there.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

Index = tuple[tuple[int, int], ...]  # (start, stop) per dimension


@dataclasses.dataclass(eq=False)
class ShardPlacement:
    devices: tuple[int, ...]  # device id of partition k
    processes: tuple[int, ...]  # process index of partition k
    axis_names: tuple[str, ...]  # mesh axes ((): no mesh known)
    axis_sizes: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]  # global shape of each tapped leaf
    me: int  # this process
    # Per leaf: partition k -> its global slice, filled at compile time.
    slices: list[tuple[Index, ...] | None] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.slices = [None] * len(self.shapes)
        self.local_count = sum(1 for p in self.processes if p == self.me)
        self._holders: dict[int, list[int]] = {}  # holders(), once slices are known
        if self.axis_names:
            self.coords = [
                dict(zip(self.axis_names, (int(c) for c in np.unravel_index(k, self.axis_sizes))))
                for k in range(len(self.devices))
            ]
        else:
            self.coords = [{} for _ in self.devices]

    # -------------------------------------------------- compile time
    def set_sharding(self, leaf: int, sharding: Any) -> None:
        """Record the sharding XLA chose for leaf ``leaf`` (a jax Sharding over
        ``devices``). Called from XLA's partitioner, so it never raises."""
        try:
            shape = self.shapes[leaf]
            by_device = _slices_by_device(sharding, shape)
            self.slices[leaf] = tuple(by_device[dev] for dev in self.devices)
        except Exception:  # noqa: BLE001 - unknown stays unknown (null)
            self.slices[leaf] = None
        self._holders = {}

    # -------------------------------------------------- host side
    def padding(self, k: int) -> bool:
        """Whether partition ``k`` holds no element of any tapped leaf: an
        uneven sharding's last tiles hold only XLA's padding, and its bytes
        are no value (never written)."""
        if not self.slices or any(s is None for s in self.slices):
            return False
        return all(any(b <= s for s, b in leaf[k]) for leaf in self.slices)

    def local_expected(self) -> int:
        """How many of this process's partitions send a shard worth waiting
        for (padding-only partitions are dropped on arrival)."""
        return sum(1 for k, p in enumerate(self.processes) if p == self.me and not self.padding(k))

    def crop(self, k: int, leaves: list[np.ndarray]) -> list[np.ndarray]:
        """Partition ``k``'s shards without XLA's padding: under an uneven
        sharding a tile is padded to the size of the others, and only the
        part inside the global shape is the value."""
        out = []
        for leaf, a in zip(self.slices, leaves):
            if leaf is not None and np.ndim(a) == len(leaf[k]):
                extent = tuple(max(0, b - s) for s, b in leaf[k])
                if extent != np.shape(a) and all(e <= n for e, n in zip(extent, np.shape(a))):
                    a = a[tuple(slice(0, e) for e in extent)]
            out.append(a)
        return out

    def index_of(self, k: int, leaves: list[np.ndarray]) -> list | None:
        """The record's ``index`` for partition ``k``: [[start, stop], ...]
        for one leaf, a list of those for several; None when any leaf's slice
        is unknown or does not match the shard that arrived."""
        out = []
        for leaf, a in zip(self.slices, leaves):
            if leaf is None:
                return None
            idx = leaf[k]
            if tuple(b - s for s, b in idx) != tuple(np.shape(a)):
                return None
            out.append([[s, b] for s, b in idx])
        return out[0] if len(out) == 1 else out

    def holders(self, k: int) -> list[int]:
        """Partitions holding the same slices as ``k`` (``k`` included; every
        process's), in partition order; ``[k]`` when slices are unknown."""
        if any(s is None for s in self.slices):
            return [k]
        out = self._holders.get(k)
        if out is None:
            # Once per partition: the slices are fixed once compiled, and
            # this runs for every shard of every step.
            mine = tuple(s[k] for s in self.slices)
            out = self._holders[k] = [
                j for j in range(len(self.devices)) if tuple(s[j] for s in self.slices) == mine
            ]
        return out


def _slices_by_device(sharding: Any, shape: tuple[int, ...]) -> dict[int, Index]:
    """device id -> its global slice of an array of ``shape`` under
    ``sharding``. JAX's devices_indices_map refuses an uneven tiling (2 rows
    over 4 devices), which XLA compiles by padding every tile to the same
    size, the last ones past the end: the tiles of a shape made divisible
    (each dimension times the device count: a mesh's tile counts divide it)
    give each device's tile coordinate, and its slice is that tile of the
    padded shape cut at the real one (empty for padding only)."""
    try:
        return {
            d.id: tuple(
                (0 if s.start is None else int(s.start), n if s.stop is None else int(s.stop))
                for s, n in zip(idx, shape)
            )
            for d, idx in sharding.devices_indices_map(shape).items()
        }
    except ValueError:  # IndivisibleError: an uneven tiling
        pass
    count = len(sharding.device_set)
    big = tuple(max(n, 1) * count for n in shape)
    out = {}
    for d, idx in sharding.devices_indices_map(big).items():
        box = []
        for s, n, nb in zip(idx, shape, big):
            start = 0 if s.start is None else int(s.start)
            stop = nb if s.stop is None else int(s.stop)
            tiles = nb // (stop - start)
            size = -(-n // tiles)  # XLA's tile: ceil(n / tiles), padded
            c = start // (stop - start)
            box.append((min(c * size, n), min((c + 1) * size, n)))
        out[d.id] = tuple(box)
    return out
