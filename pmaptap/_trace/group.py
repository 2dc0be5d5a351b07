"""``pmaptap.group``: taps made in one block share ONE host callback per
process, emitted when the block ends (see ``group``'s docstring)."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, NamedTuple

from jax import lax
from jax._src import core as _core
from jax._src.interpreters import batching as _batching

from pmaptap._trace.layouts import emitter, gather_packed, is_leader, nbytes, send_payload
from pmaptap._trace.options import options
from pmaptap._trace.spec import GroupSpec, Layout, TapSpec

_local = threading.local()


class group(contextlib.ContextDecorator):
    """``with pmaptap.group():`` (or ``@pmaptap.group()``) inside a traced
    step: the taps made directly in the block share ONE host callback per
    process, emitted when the block ends, instead of one each.

    Only taps at the block's own trace level join (a tap inside a nested
    scan/cond/vmap body is emitted on its own as usual), and only those on
    the fast path (mapped axes, small enough to gather). Taps with a traced
    ``step`` and ``every > 1`` join too: those sharing the same step and
    ``every`` are decided by ONE on-device ``step % every == 0`` and share
    one callback, so a logging block costs one never-firing branch on the
    steps it skips, not one per tap. Records are exactly those of separate
    taps.
    """

    def __enter__(self) -> "group":
        self._trace = _core.trace_ctx.trace
        self._members: list[_Member] = []
        _local.__dict__.setdefault("stack", []).append(self)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        _local.stack.pop()
        if exc_type is None:
            _emit_group(self._members)

    def offer(
        self, spec: TapSpec, raw_names: tuple, leaves, coords, step, traced_every: bool = False
    ) -> bool:
        if (
            _core.trace_ctx.trace is not self._trace
            or isinstance(self._trace, _batching.BatchTrace)
            or spec.transport.layout not in (Layout.GATHERED, Layout.VERIFIED_OFF)
        ):
            return False
        if (
            spec.transport.layout is Layout.VERIFIED_OFF
            and nbytes(leaves) * spec.placement.total_copies > options().gather_max_bytes
        ):
            return False  # the group gathers every member: only small ones
        if self._members:
            first = self._members[0]
            if (
                first.spec.transport.leaders != spec.transport.leaders
                or first.raw_names != raw_names
            ):
                return False
        # Members deciding `every` on device are bucketed by (every, step):
        # each bucket gets one cond (see _emit_group).
        bucket = (spec.site.every, id(step)) if traced_every else None
        self._members.append(_Member(spec, raw_names, list(leaves), coords, step, bucket))
        return True


class _Member(NamedTuple):
    """A tap waiting in a group for the block's end."""

    spec: TapSpec
    raw_names: tuple
    leaves: list
    coords: Any
    step: Any
    bucket: tuple | None  # (every, id(step)) when decided on device


def current_group() -> "group | None":
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


def _emit_group(members: list[_Member]) -> None:
    buckets: dict[tuple | None, list[_Member]] = {}
    for m in members:
        buckets.setdefault(m.bucket, []).append(m)
    for key, bucket in buckets.items():
        if key is None:
            _emit_members(bucket)
            continue
        every, step = key[0], bucket[0].step
        lax.cond(step % every == 0, lambda b=bucket: _emit_members(b), lambda: None)


def _emit_members(members: list[_Member]) -> None:
    first = members[0]
    if len(members) == 1:
        emitter(first.spec, first.raw_names)(first.coords, first.step, *first.leaves)
        return
    # Every member is gathered (small by construction), all in ONE packed
    # all_gather: each collective costs ~0.1 ms here, the bytes almost nothing.
    # Members keep their layout: an unverified replicated one (VERIFIED_OFF)
    # is written from the caller's copy, as it would be alone.
    payload, packing = gather_packed([x for m in members for x in m.leaves], first.raw_names)
    # Each member's step travels as its own operand, in its own dtype (a
    # stacked int32 would wrap steps >= 2**31).
    steps = [m.step for m in members]
    gspec = GroupSpec(
        members=tuple(m.spec for m in members),
        member_leaves=tuple(len(m.leaves) for m in members),
        packing=packing,
    )
    lax.cond(
        is_leader(first.spec, first.coords),
        lambda: send_payload(gspec, first.coords, *steps, *payload),
        lambda: None,
    )
