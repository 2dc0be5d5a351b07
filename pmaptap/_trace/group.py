"""Taps that share ONE host callback (per process when gathered, per device
for the ``copy`` layout and for taps under plain jit): ``pmaptap.group`` (a
block the user marks) and automatic grouping (every other tap of a trace,
emitted when the trace ends, see ``auto_offer`` and traceend.py)."""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax
from jax._src import core as _core
from jax._src.interpreters import batching as _batching
from jax.custom_batching import custom_vmap

from pmaptap._common.spec import LEADER_COPY, GroupSpec, Layout, TapSpec
from pmaptap._trace import traceend
from pmaptap._trace.layouts import (
    emitter,
    from_leader_if_steps_alike,
    gather_packed,
    is_leader,
    jit_call,
    nbytes,
    send_payload,
)
from pmaptap._trace.options import options
from pmaptap._trace.placement import every_due
from pmaptap._trace.primitive import mark_tap_vmap_rule

_local = threading.local()

# What a collector gathers, by the layout of its members (see _Collector).
GATHERED, COPIES, JIT = "gathered", "copies", "jit"


def kind_of(layout: Layout) -> str | None:
    """The collector kind a tap of ``layout`` joins (None: never grouped)."""
    if layout is Layout.GATHERED or layout in LEADER_COPY:
        return GATHERED
    if layout is Layout.COPY:
        return COPIES
    if layout in (Layout.SHARDS, Layout.WHOLE):
        return JIT
    return None


class _Member(NamedTuple):
    """A tap waiting in a group for the block's (or the trace's) end."""

    spec: TapSpec
    raw_names: tuple
    leaves: list
    coords: Any
    step: Any
    bucket: tuple | None  # (every, id(step)) when decided on device


def auto_step_key(spec: TapSpec) -> tuple | None:
    """What the host's automatic step counter is kept per (name, pass), for
    a tap without a ``step``; None for a tap with one (its records do not
    depend on the order its callback runs in)."""
    return None if spec.site.explicit_step else (spec.site.name, spec.site.pass_)


# trace -> automatic-step keys that were emitted inside a body nested in
# it (a scan/cond body, an inner jit): such a body may be bound again later
# in the trace from JAX's caches, with no trace-time event, so a tap of the
# same key in the enclosing trace is not deferred past it.
_nested_keys: "weakref.WeakKeyDictionary[Any, set]" = weakref.WeakKeyDictionary()
_nested_lock = threading.Lock()


def settle(keys: set, trace: Any, exclude: Any = None) -> None:
    """Keep automatic step counters in program order: the host numbers a
    name's taps without a ``step`` in the order their callbacks run, so a
    tap deferred to its trace's end must not run after a later tap of the
    same (name, pass). Called just before taps with ``keys`` are emitted
    (with ``trace`` current, or at ``trace``'s end): deferred taps holding
    one of them in ``trace`` or an enclosing trace are emitted now (there,
    before the equation being built), and the enclosing traces remember
    the keys (see ``_nested_keys``)."""
    keys = {k for k in keys if k is not None}
    if not keys:
        return
    for depth, t in enumerate(traceend.enclosing(trace)):
        for obj in traceend.pending(t):
            if obj is not exclude and isinstance(obj, _Collector) and obj.auto_keys & keys:
                with _core.set_current_trace(t):
                    obj.flush()
        if depth and traceend.staging_trace_type(t):
            with _nested_lock:
                _nested_keys.setdefault(t, set()).update(keys)


class _Collector:
    """Taps of one trace waiting to share a callback, all of one ``kind``
    (see ``kind_of``): gathered ones (one callback per process, from its
    leader), ``copy`` ones that call back from every device (automatic
    grouping only: where no collective may run), which then share one
    callback per device, or taps under plain jit, which share one
    ``shard_call``. A ``group()`` block takes the kind of its first tap."""

    def __init__(self, kind: str | None = None, trace: Any = None) -> None:
        # The trace its taps are emitted in (a group(): the current one).
        self._trace = _core.trace_ctx.trace if trace is None else trace
        self._kind = kind
        self._members: list[_Member] = []
        self.auto_keys: set = set()  # see settle()

    def offer(
        self,
        spec: TapSpec,
        raw_names: tuple,
        leaves,
        coords,
        step,
        traced_every: bool = False,
        trace: Any = None,
    ) -> bool:
        """Take the tap if it fits; ``trace``: the trace it is emitted in
        (default: the current one)."""
        kind = kind_of(spec.transport.layout)
        if (
            (_core.trace_ctx.trace if trace is None else trace) is not self._trace
            or isinstance(self._trace, _batching.BatchTrace)
            or kind is None
            or kind != (self._kind or kind)
            or (self._kind is None and kind == COPIES)  # group(): as before, not copies
        ):
            return False
        if (
            spec.transport.layout in LEADER_COPY
            and nbytes(leaves) * spec.placement.total_copies > options().gather_max_bytes
        ):
            return False  # the group gathers every member: only small ones
        if self._members:
            first = self._members[0]
            if (
                first.spec.transport.leaders != spec.transport.leaders
                or first.raw_names != raw_names
                or kind_of(first.spec.transport.layout) != kind
            ):
                return False
        # Members deciding `every` on device are bucketed by (every, step):
        # each bucket gets one cond (see _emit_group). The member holds the
        # step, so its id stays unique while the group waits.
        bucket = (spec.site.every, id(step)) if traced_every else None
        self._members.append(_Member(spec, raw_names, list(leaves), coords, step, bucket))
        self.auto_keys.add(auto_step_key(spec))
        return True

    def flush(self) -> None:
        members, self._members = self._members, []
        keys, self.auto_keys = self.auto_keys, set()
        if members:
            settle(keys, self._trace, exclude=self)
            _emit_group(members, kind_of(members[0].spec.transport.layout))


class group(_Collector, contextlib.ContextDecorator):
    """``with pmaptap.group():`` (or ``@pmaptap.group()``) inside a traced
    step: the taps made directly in the block share ONE host callback per
    process (under plain jit, one per device), emitted when the block ends
    (docs/api.md, "One callback per host, not per device").

    Only taps at the block's own trace level join, and only those on the fast
    path (mapped axes, small enough to gather) or under plain jit. Taps sharing
    a traced ``step`` and ``every > 1`` are decided by ONE on-device
    ``step % every == 0``. Records are exactly those of separate taps.
    """

    def __enter__(self) -> "group":
        _Collector.__init__(self)  # kind: its first tap's
        _local.__dict__.setdefault("stack", []).append(self)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        _local.stack.pop()
        if exc_type is None:
            self.flush()
        else:
            self._members = []


def current_group() -> "group | None":
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


def auto_offer(
    spec: TapSpec, raw_names: tuple, leaves, coords, step, traced_every: bool = False
) -> bool:
    """Defer a tap not in a ``group()`` block to the end of its trace, where
    it shares one callback with the trace's other such taps. False (emit it
    now) unless automatic grouping is on, the hook is installed, the current
    trace is a plain staging trace (or a grad/jvp trace directly in one:
    traceend.staging_target) and every traced operand is a staging tracer:
    under vmap's batching or eagerly nothing is deferred."""
    if not options().auto_group or not traceend.installed():
        return False
    # The step's staging trace, also from inside grad/jvp (staging_target).
    trace = traceend.staging_target()
    if trace is None or not traceend.stageable([*leaves, coords, step]):
        return False
    key = auto_step_key(spec)
    if key is not None:
        with _nested_lock:
            if key in _nested_keys.get(trace, ()):
                return False  # see _nested_keys: emitted now, in order
    kind = kind_of(spec.transport.layout)
    if kind is None:
        return False
    # COPY: one callback per device (cond/while bodies, no gathering);
    # JIT: per-shard and scalar taps under plain jit. The trace's such taps
    # share it.
    collector = traceend.deferred(
        trace,
        (_Collector, kind, raw_names, spec.transport.leaders),
        lambda: _Collector(kind, trace),
    )
    if key is not None:
        # This trace's other collectors (other layouts) emit their taps of
        # the same key first: they were made before this one.
        for obj in traceend.pending(trace):
            if obj is not collector and isinstance(obj, _Collector) and key in obj.auto_keys:
                with _core.set_current_trace(trace):
                    obj.flush()
    return collector.offer(spec, raw_names, leaves, coords, step, traced_every, trace=trace)


def _emit_group(members: list[_Member], kind: str) -> None:
    buckets: dict[tuple | None, list[_Member]] = {}
    for m in members:
        buckets.setdefault(m.bucket, []).append(m)
    for key, bucket in buckets.items():
        if key is None:
            _emit_members(bucket, kind)
            continue
        every, step = key[0], bucket[0].step
        lax.cond(every_due(step, every), lambda b=bucket: _emit_members(b, kind), lambda: None)


def _emit_members(members: list[_Member], kind: str) -> None:
    first = members[0]
    if len(members) == 1:
        emitter(first.spec, first.raw_names)(first.coords, first.step, *first.leaves)
        return
    n_leaves = tuple(len(m.leaves) for m in members)
    _group_fn(tuple(m.spec for m in members), first.raw_names, n_leaves, kind)(
        first.coords, *[m.step for m in members], *[x for m in members for x in m.leaves]
    )


def _group_fn(specs: tuple[TapSpec, ...], raw_names: tuple, n_leaves: tuple[int, ...], kind: str):
    """The group's counterpart of ``emitter`` (layouts.py): emits the
    members' one payload, wrapped in ``custom_vmap`` for a single tap's two
    reasons (layouts.py's docstring): one callback for a vmapped batch, and no
    replay under ``jax.checkpoint`` (a ``group()`` under remat + grad wrote
    every record twice before)."""
    m = len(specs)

    def split(args):
        return args[:m], args[m:]

    @custom_vmap
    def emit_fn(coords, *args):
        steps, flat = split(args)
        if kind == JIT:
            # Under plain jit: one shard_call carrying every member (each
            # device its own shard of each; scalars read from device 0).
            jit_call(specs, n_leaves, coords, steps, flat)
            return coords
        if kind == COPIES:
            # Every device calls back with its own copies of all members
            # (the aggregator takes each as that member's own callback).
            gspec = GroupSpec(members=specs, member_leaves=n_leaves)
            send_payload(gspec, coords, *steps, *flat)
            return coords

        def from_leader() -> None:
            if all(s.transport.layout in LEADER_COPY for s in specs):
                # Nothing to compare or collect: the leader sends its own
                # copy of every member (a step's proven loss and norms cost
                # no collective, as each alone would not).
                gspec = GroupSpec(members=specs, member_leaves=n_leaves, gathered=False)
                payload = list(flat)
            else:
                # Every member is gathered (small by construction), all in
                # ONE packed all_gather: each collective has a fixed cost,
                # the bytes almost none. Members keep their layout: an
                # unverified or proven replicated one (VERIFIED_OFF, PROVEN)
                # is written from the caller's copy, as it would be alone.
                # Each member's step travels as its own operand, in its own
                # dtype (a stacked int32 would wrap steps >= 2**31).
                payload, packing = gather_packed(list(flat), raw_names)
                gspec = GroupSpec(members=specs, member_leaves=n_leaves, packing=packing)
            lax.cond(
                is_leader(specs[0], coords),
                lambda: send_payload(gspec, coords, *steps, *payload),
                lambda: None,
            )

        def each_own() -> None:
            # A member's step differs between devices: every device sends
            # its own copies, each member's with its own step (as COPIES).
            members = tuple(s.with_transport(layout=Layout.COPY) for s in specs)
            send_payload(GroupSpec(members=members, member_leaves=n_leaves), coords, *steps, *flat)

        check = any(s.transport.check_steps for s in specs)
        from_leader_if_steps_alike(check, steps, raw_names, from_leader, each_own)
        return coords

    @emit_fn.def_vmap
    @mark_tap_vmap_rule  # a tap's rule (taps of tangents: see primitive.py)
    def _batched(axis_size, in_batched, coords, *args):
        coords_b, rest_b = in_batched[0], in_batched[1:]
        steps_b, leaves_b = split(rest_b)
        if coords_b or any(steps_b):
            raise ValueError(
                f"pmaptap.tap({specs[0].name!r}) (and the taps grouped with it): "
                "the `step` argument is batched by vmap; pass a step that is the "
                "same for the whole batch (e.g. tap outside the vmap, or pass a "
                "Python int)."
            )
        steps, flat = split(args)
        # As a single tap's rule: batch axes at 0, unbatched leaves broadcast.
        flat = [
            x if b else jnp.broadcast_to(x, (axis_size,) + x.shape) for x, b in zip(flat, leaves_b)
        ]
        batched = tuple(s.with_batch() for s in specs)
        _group_fn(batched, raw_names, n_leaves, kind)(coords, *steps, *flat)
        return coords, False

    return emit_fn
