"""Where each shard of a tapped value lives: one ``ShardPlacement`` per tap
per lowering of a call under plain jit (shardcall.py), read by the
aggregator. A scalar tap's placement (``Layout.WHOLE``) names the devices
and processes of the computation; its slices stay unknown (unused).

Exact or null (docs/architecture.md, "Exact or null placement"): a
callback's partition number ``k`` gives its device, ``devices[k]``; the
global slice comes from the sharding XLA reported at compile time; a shard
whose shape does not match it, or an executable whose sharding was never
reported (from a compilation cache), gets ``index`` None. Pure Python: the
aggregator thread reads it.
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

    def crop(self, k: int, leaves: list[np.ndarray], skip: tuple = ()) -> list[np.ndarray]:
        """Partition ``k``'s shards without XLA's padding: under an uneven
        sharding a tile is padded to the size of the others, and only the
        part inside the global shape is the value. Leaves at a true position
        of ``skip`` (statistics in place of the shard) are kept as they are."""
        out = []
        for j, (leaf, a) in enumerate(zip(self.slices, leaves)):
            if leaf is not None and not (j < len(skip) and skip[j]) and np.ndim(a) == len(leaf[k]):
                extent = tuple(max(0, b - s) for s, b in leaf[k])
                if extent != np.shape(a) and all(e <= n for e, n in zip(extent, np.shape(a))):
                    a = a[tuple(slice(0, e) for e in extent)]
            out.append(a)
        return out

    def index_of(self, k: int, leaves: list[np.ndarray], skip: tuple = ()) -> list | None:
        """The record's ``index`` for partition ``k``: [[start, stop], ...]
        for one leaf, a list of those for several; None when any leaf's slice
        is unknown or does not match the shard that arrived (not compared
        for a leaf at a true position of ``skip``: its statistics came)."""
        out = []
        for j, (leaf, a) in enumerate(zip(self.slices, leaves)):
            if leaf is None:
                return None
            idx = leaf[k]
            summary = j < len(skip) and skip[j]
            if not summary and tuple(b - s for s, b in idx) != tuple(np.shape(a)):
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


# --- a shard's statistics, as they leave the device that holds it
# (_trace/shardstats.py): one uint32 row per partition,
#   [device id + 1 (0: a row no device wrote), 1 if the slice is known,
#    the leaf's rank r, its global shape (r words), the shard's global slice
#    ((start, stop) per dimension), the bits of its float32[*batch, 8]
#    statistics (tapfile.record.format.SUMMARY_FIELDS)]
# with the batch axes at their global size (a shard whose batch axes are
# split fills the leading corner).
STATS_HEAD = 3
# The mesh axis a per-shard op lowers over when the operand's sharding
# names no mesh (placement.partition_ids, shardstats.py): no mesh axis of
# the user's, so records show no coordinates for it.
PARTITION_AXIS = "_pmaptap_partition"


def statistics_row_width(shape: tuple[int, ...], batch_dims: int) -> int:
    """The uint32 words of one partition's row for a leaf of ``shape``."""
    return STATS_HEAD + 3 * len(shape) + 8 * int(np.prod(shape[:batch_dims], dtype=np.int64))


def read_statistics_rows(
    table: np.ndarray, batch_dims: int
) -> tuple[tuple[int, ...], dict[int, tuple[Index | None, np.ndarray]]]:
    """(the leaf's global shape, device id -> (its shard's global slice or
    None, its statistics float32[*batch, 8], batch axes cut to the
    shard's)) of the rows in ``table`` (uint32[rows, width], see above)."""
    table = np.asarray(table, np.uint32)
    shape: tuple[int, ...] = ()
    out = {}
    for row in table.reshape(-1, table.shape[-1]):
        if not row[0]:
            continue
        rank = int(row[2])
        shape = tuple(int(n) for n in row[STATS_HEAD : STATS_HEAD + rank])
        at = STATS_HEAD + rank
        box = row[at : at + 2 * rank].astype(np.int64).reshape(rank, 2)
        index = tuple((int(a), int(b)) for a, b in box) if row[1] else None
        stats = np.ascontiguousarray(row[at + 2 * rank :]).view(np.float32)
        stats = stats.reshape(shape[:batch_dims] + (8,))
        if index is not None and batch_dims:
            stats = stats[tuple(slice(0, b - a) for a, b in index[:batch_dims])]
        out[int(row[0]) - 1] = (index, stats)
    return shape, out
