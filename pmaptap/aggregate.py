"""Per-process grouping of per-device copies, and the dedup policies.

Pure logic, no threads: ``Aggregator.add`` takes one callback's payload
(already converted to NumPy by the aggregator thread) and returns the records
that became complete. A group is one (name, step, pass) on this process; it is
complete when every local device that runs the tap has reported, when the
same device reports that key again, when it has waited ``group_timeout``
seconds (a tap under a ``cond`` that fired on some devices only), or at flush.
"""
from __future__ import annotations

import dataclasses
import hashlib
import time
from collections import OrderedDict
from typing import Any, Callable

import numpy as np

from .records import Record, encode_tree
from .spec import TapSpec


@dataclasses.dataclass
class Copy:
    spec: TapSpec
    coords: tuple[int, ...]
    device: int | None
    process: int
    leaves: list[np.ndarray]
    key: bytes                      # bitwise identity of the value


@dataclasses.dataclass
class _Group:
    first: float
    copies: list[Copy]


def value_key(leaves: list[np.ndarray]) -> bytes:
    parts = []
    for a in leaves:
        parts.append(f"{a.dtype.str}{a.shape}|".encode())
        parts.append(np.ascontiguousarray(a).tobytes())
    return b"".join(parts)


class Aggregator:
    def __init__(self, run: str, process: int, host: str, *,
                 group_timeout: float = 5.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.run, self.process, self.host = run, process, host
        self.group_timeout = group_timeout
        self.clock = clock
        self._counters: dict[tuple, int] = {}
        self._groups: OrderedDict[tuple, _Group] = OrderedDict()

    # ------------------------------------------------------------ input
    def add(self, spec: TapSpec, coords: np.ndarray, step: int,
            leaves: list[np.ndarray]) -> list[Record]:
        c = tuple(int(v) for v in coords.reshape(-1))
        device = spec.device_of(c)
        if not spec.explicit_step:
            # Automatic step: the k-th execution of this tap name on this
            # device. Callbacks of one device arrive in execution order.
            ckey = (spec.name, spec.pass_, device if device is not None else c)
            step = self._counters.get(ckey, 0)
            self._counters[ckey] = step + 1
            if step % spec.every:
                return []
        proc = spec.process_of(c)
        copy = Copy(spec, c, device, self.process if proc is None else proc,
                    leaves, value_key(leaves))
        out: list[Record] = []
        gkey = (spec.name, int(step), spec.pass_)
        group = self._groups.get(gkey)
        if group is not None and any(cp.coords == c and cp.device == device
                                     for cp in group.copies):
            # Same device again for this key (two tap sites sharing a name,
            # or a fixed Python step in a loop): close the earlier group.
            out += self._resolve(gkey, self._groups.pop(gkey))
            group = None
        if group is None:
            group = self._groups[gkey] = _Group(self.clock(), [])
        group.copies.append(copy)
        if len(group.copies) >= spec.local_copies:
            out += self._resolve(gkey, self._groups.pop(gkey))
        return out

    def expire(self) -> list[Record]:
        now = self.clock()
        out: list[Record] = []
        while self._groups:
            gkey, group = next(iter(self._groups.items()))
            if now - group.first < self.group_timeout:
                break
            out += self._resolve(gkey, self._groups.pop(gkey))
        return out

    def finalize_all(self) -> list[Record]:
        out: list[Record] = []
        while self._groups:
            gkey, group = self._groups.popitem(last=False)
            out += self._resolve(gkey, group)
        return out

    @property
    def open_groups(self) -> int:
        return len(self._groups)

    # ------------------------------------------------------------ dedup
    def _resolve(self, gkey: tuple, group: _Group) -> list[Record]:
        copies = group.copies
        spec = copies[0].spec
        step = gkey[1]
        by_value: OrderedDict[bytes, list[Copy]] = OrderedDict()
        for cp in sorted(copies, key=lambda cp: cp.coords):
            by_value.setdefault(cp.key, []).append(cp)
        if spec.dedup == "per_device" or (spec.dedup == "auto" and len(by_value) > 1):
            return [self._per_device(spec, step, cp)
                    for cp in sorted(copies, key=lambda cp: cp.coords)]
        divergent = len(by_value) > 1
        return [self._replicated(spec, step, holders, divergent)
                for holders in by_value.values()]

    def _value(self, spec: TapSpec, leaves: list[np.ndarray]) -> tuple[Any, Any, Any]:
        return encode_tree(spec.treedef, leaves)

    def _per_device(self, spec: TapSpec, step: int, cp: Copy) -> Record:
        value, dtype, shape = self._value(spec, cp.leaves)
        return Record(
            run=self.run, name=spec.name, step=step, kind="per_device",
            value=value, dtype=dtype, shape=shape, process=cp.process,
            time=self.clock(), host=self.host, device=cp.device,
            coords=dict(zip(spec.axis_names, cp.coords)),
            batch_dims=spec.batch_dims, pass_=spec.pass_)

    def _replicated(self, spec: TapSpec, step: int, holders: list[Copy],
                    divergent: bool) -> Record:
        value, dtype, shape = self._value(spec, holders[0].leaves)
        extra = None
        if divergent:
            # Which coordinates held this value: the device may be unknown
            # (null) but the coordinates never are.
            extra = {"holders": [{"device": h.device, "process": h.process,
                                  "coords": dict(zip(spec.axis_names, h.coords))}
                                 for h in holders]}
        return Record(
            run=self.run, name=spec.name, step=step, kind="replicated",
            value=value, dtype=dtype, shape=shape, process=self.process,
            time=self.clock(), host=self.host, replicas=len(holders),
            devices=tuple(h.device for h in holders),
            processes=tuple(sorted({h.process for h in holders})),
            divergent=divergent, batch_dims=spec.batch_dims, pass_=spec.pass_,
            extra=extra, vhash=hashlib.blake2b(holders[0].key,
                                               digest_size=8).hexdigest())
