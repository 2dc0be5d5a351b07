"""The static description of one tap site, fixed at trace time.

A ``TapSpec`` travels inside the host callback's closure, so everything the
host needs to turn raw arrays into records (names, dedup policy, where each
mesh coordinate lives) is known without calling JAX from the callback thread.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any

DEDUP_MODES = ("auto", "replicated", "per_device")

_ids = itertools.count()


def next_tap_id() -> int:
    return next(_ids)


@dataclasses.dataclass(frozen=True)
class TapSpec:
    name: str
    dedup: str
    every: int
    treedef: Any                     # jax PyTreeDef of the tapped value
    axis_names: tuple[str, ...]      # manual mesh axes, in mesh order ("" never)
    axis_sizes: tuple[int, ...]
    # Device id / process index for every coordinate (row-major over
    # axis_names), or None where pmaptap cannot know: never guessed.
    device_ids: tuple[int, ...] | None
    device_processes: tuple[int, ...] | None
    local_copies: int                # copies this process should receive per step
    explicit_step: bool              # step travels as an argument
    batch_dims: int = 0              # leading axes added by vmap
    pass_: str = "forward"           # "forward" or "backward" (tap_grad)
    eager_device: int | None = None  # device of a concrete (non-traced) value
    # host_callback shims: a callable ``consumer(spec, arrays)`` that receives
    # the raw callback payload instead of the session pipeline. It runs on
    # XLA's callback thread, so it must only hand the payload over.
    consumer: Any = None
    # How copies travel (see emit.py): "copy" = one callback per device with
    # its own value; "gathered" = all copies stacked on axis 0, one callback
    # per process; "verified" = one copy, all copies' hashes compared on
    # device; "verified_off" = the leader's copy, unverified.
    layout: str = "copy"
    leaders: tuple[bool, ...] | None = None  # per flat coord: calls back for its process
    # layout "group": the member taps one callback carries, and how many
    # payload leaves belong to each (see emit.group).
    members: tuple["TapSpec", ...] = ()
    member_leaves: tuple[int, ...] = ()
    # Gathered payloads packed into one uint8 array: (dtype, shape) per leaf.
    packing: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # Per leaf: None (sent whole) or the (dtype, shape) of a leaf above
    # options().max_value_bytes whose statistics travel instead (see
    # tap.summarize); () when no leaf is summarized.
    summaries: tuple[tuple[str, tuple[int, ...]] | None, ...] = ()
    tap_id: int = dataclasses.field(default_factory=next_tap_id)

    def with_batch(self) -> "TapSpec":
        return dataclasses.replace(self, batch_dims=self.batch_dims + 1)

    @property
    def total_copies(self) -> int:
        n = 1
        for s in self.axis_sizes:
            n *= s
        return n

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


def flat_index(coords: tuple[int, ...], sizes: tuple[int, ...]) -> int:
    idx = 0
    for c, s in zip(coords, sizes):
        idx = idx * s + int(c)
    return idx
