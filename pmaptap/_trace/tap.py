"""``pmaptap.tap``: the traced side. Checks arguments at trace time, finds the
mapped axes and this device's coordinates, decides ``every`` for static steps
and hands the rest to the single emission helper."""

from __future__ import annotations

from typing import Any, TypeVar

import jax
import numpy as np

from pmaptap._common.spec import LEADER_COPY, Layout, TapSite, TapSpec
from pmaptap._common.switch import taps_off
from pmaptap._trace import iteration, marks, placement, primitive
from pmaptap._trace.arguments import as_leaf, check_common, check_dtype, check_step
from pmaptap._trace.emit import axis_coords, emit
from pmaptap._trace.layouts import choose_layout, static_step_operand, steps_may_differ
from pmaptap._trace.stats import statistics_of_big_leaves
from pmaptap.distributed import warn_if_launched_alone

T = TypeVar("T")


def jit_layout(leaves) -> Layout | None:
    """The layout of a tap traced under plain jit (no mapped axes, a traced
    leaf), whose lowering decides per device (shardcall.py): SHARDS when a
    leaf is an array that may be partitioned, WHOLE when every leaf is a
    scalar (a loss: replicated, never sharded; one copy is read). None
    elsewhere (mapped axes, eager)."""
    if placement.mapped_axes()[0]:
        return None
    if not any(isinstance(x, jax.core.Tracer) for x in leaves):
        return None
    return Layout.SHARDS if any(np.ndim(x) > 0 for x in leaves) else Layout.WHOLE


def send(
    x: Any,
    name: str,
    *,
    step=None,
    dedup: str = "auto",
    every: int = 1,
    pass_: str = "forward",
    fn: str = "pmaptap.tap",
) -> None:
    """Validate and emit ``x`` (no return value; shared by tap and tap_grad)."""
    check_common(name, dedup, every, fn)
    static_step, traced_step = check_step(step, name, fn)
    if static_step is not None and static_step % every != 0:
        return  # decided at trace time: nothing is compiled for this step
    path_leaves, treedef = jax.tree_util.tree_flatten_with_path(x)
    leaves = [as_leaf(p, leaf, name, fn, exact=True) for p, leaf in path_leaves]
    for (p, _), leaf in zip(path_leaves, leaves):
        check_dtype(p, leaf, name, fn)
    if taps_off():
        return  # pmaptap.untapped: checked, then removed
    warn_if_launched_alone()

    def _emit_leaves(leaves: list, traced_step) -> None:
        jit = jit_layout(leaves)
        # Per-shard taps only mark big leaves: which slice a device holds is
        # known only when the step is lowered, so the statistics of each shard
        # are computed there, on its device (shardstats.py).
        sent, as_statistics = statistics_of_big_leaves(leaves, compute=jit is not Layout.SHARDS)
        where, raw_names = placement.current(leaves)
        loops = iteration.indices()
        site = TapSite(
            name=name,
            dedup=dedup,
            every=int(every),
            treedef=treedef,
            explicit_step=step is not None,
            pass_=pass_,
            as_statistics=as_statistics,
            iterations=len(loops),
        )
        spec = TapSpec(site=site, placement=where)
        if jit is not None:
            spec = spec.with_transport(layout=jit)
        coords = axis_coords(raw_names, loops)
        if traced_step is not None:
            step_arr = traced_step
            if steps_may_differ(traced_step, tuple(raw_names)):
                spec = spec.with_transport(check_steps=True)
        else:
            step_arr = static_step_operand(-1 if static_step is None else static_step)
        traced_every = traced_step is not None and every > 1
        if marks.collecting():
            # pmaptap.jit / pmaptap.pmap: the tap leaves the step as an output
            # (lift.py); one copy per process travels when the value is the same
            # on every device by construction, as the callback transport's
            # PROVEN / VERIFIED_OFF layouts send one; with the leader's step, so
            # only where every device's step is that step by construction too
            # (a per-device counter travels with each device's copy).
            chosen = choose_layout(spec, sent, raw_names)
            if chosen.transport.layout in LEADER_COPY and not spec.transport.check_steps:
                spec = chosen
            due = placement.every_due(step_arr, every) if traced_every else None
            marks.mark(spec, coords, step_arr, sent, due=due)
            return
        emit(spec, raw_names, sent, coords, step_arr, traced_every=traced_every)

    if primitive.staged_for_later(leaves):
        # A tangent inside a custom_jvp rule under grad/vjp/linearize: emit
        # it in the part of the program that runs later (see
        # primitive.run_later), as jax.debug.callback would be; refused
        # with a message naming the tap if reverse mode reaches it.
        primitive.run_later(_emit_leaves, leaves, traced_step, name)
        return
    _emit_leaves(leaves, traced_step)


def tap(x: T, name: str, *, step=None, dedup: str = "auto", every: int = 1) -> T:
    """Send ``x`` (an array or pytree of arrays) to the host, tagged with the
    device, process and mesh coordinates it came from. Returns ``x`` unchanged;
    gradients flow as if the tap were absent.

    dedup: "replicated" (one record per step; divergent copies are all kept
    and flagged), "per_device" (one record per device per step) or "auto"
    (identical copies -> replicated, otherwise per_device).
    step: None for an automatic per-(session, name, device) counter, or a
    Python int / traced integer scalar. every: record steps where
    ``step % every == 0``; with a traced step the skip is decided on device.
    """
    send(x, name, step=step, dedup=dedup, every=every)
    return x
