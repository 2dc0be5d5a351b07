"""``pmaptap.fingerprint``: a 64-bit fingerprint of every device's copy of a
value, computed on the device (fphash.py), compared on the host
(_host/pipeline/fingerprints.py), so that the device whose copy differs is
named. docs/architecture.md, "Replica fingerprints", draws where the copies
come from under pmap/shard_map (here), plain jit (fingerprint_jit.py) and
``pmaptap.jit`` (``fingerprint_out_p`` below, lifted by lift.py); docs/api.md
says which copies are compared.

Each device's copy is read where it lies, after an optimization barrier:
otherwise XLA fused the value's producer into the fingerprint's loop, and
the fingerprint was of a second computation of the value, not of the bits
the device keeps.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import core as jax_core
from jax._src import debugging, dispatch
from jax._src.interpreters import mlir
from jax.custom_batching import custom_vmap

from pmaptap import distributed
from pmaptap._common.fingerprint import FingerprintLayout, FingerprintSpec
from pmaptap._common.switch import taps_off
from pmaptap._host.routing import deliver
from pmaptap._trace import marks, placement
from pmaptap._trace.arguments import as_leaf, check_common, check_dtype, check_step
from pmaptap._trace.emit import axis_coords
from pmaptap._trace.fingerprint_jit import fingerprint_jit, fingerprint_table
from pmaptap._trace.fphash import fingerprint64_many
from pmaptap._trace.invariant import varying_axes
from pmaptap._trace.layouts import _flat_index, static_step_operand
from pmaptap._trace.primitive import (
    emit_callback,
    mark_tap_vmap_rule,
    register_tap_rules,
    run_later,
    staged_for_later,
)

T = TypeVar("T")
FN = "pmaptap.fingerprint"


def fingerprint(x: T, name: str, *, step=None, every: int = 1) -> T:
    """Fingerprint every device's copy of ``x`` (an array or pytree of
    arrays) on the device and name the devices whose copies differ. Returns
    ``x`` unchanged; gradients flow as if the call were absent.

    step: None for an automatic per-name counter, a Python int or a traced
    integer scalar. every: fingerprint steps where ``step % every == 0``.
    Which copies are compared and the records written: docs/api.md, "Silent
    data corruption"."""
    send(x, name, step=step, every=every)
    return x


def send(x: Any, name: str, *, step=None, every: int = 1) -> None:
    check_common(name, "replicated", every, FN)
    static_step, traced_step = check_step(step, name, FN)
    if static_step is not None and static_step % every != 0:
        return  # decided at trace time: nothing is compiled for this step
    path_leaves, _ = jax.tree_util.tree_flatten_with_path(x)
    if not path_leaves:
        raise ValueError(f"{FN}({name!r}): the value has no array leaves to fingerprint.")
    leaves = [as_leaf(p, leaf, name, FN) for p, leaf in path_leaves]
    for (p, _), leaf in zip(path_leaves, leaves):
        check_dtype(p, leaf, name, FN)
    if taps_off():
        return  # pmaptap.untapped: checked, then removed
    names, _ = placement.mapped_axes()
    amesh = jax.sharding.get_abstract_mesh()
    if names and len(names) != len(amesh.axis_names):
        raise ValueError(
            f"{FN}({name!r}) is inside a shard_map that is manual over "
            f"{list(names)} only (automatic over the other mesh axes): each "
            "device's copy cannot be told apart there. Fingerprint the value "
            "outside the shard_map (under jit, each slice's holders are "
            "compared), or make the shard_map manual over every mesh axis."
        )
    # Other processes' holders are named with their host (multi-process only).
    distributed.publish_host()
    spec = FingerprintSpec(
        name=name,
        every=int(every),
        explicit_step=step is not None,
        leaves=tuple(jax.tree_util.keystr(p, simple=True, separator="/") for p, _ in path_leaves),
        layout=FingerprintLayout.JIT,
    )
    step_arr = (
        traced_step
        if traced_step is not None
        else static_step_operand(-1 if static_step is None else static_step)
    )
    if staged_for_later(leaves):
        run_later(lambda ls, s: _emit(spec, ls, s, traced_step is not None), leaves, step_arr, name)
        return
    _emit(spec, leaves, step_arr, traced_step is not None)


def _emit(spec: FingerprintSpec, leaves: list, step, traced: bool) -> None:
    if marks.at_step_level() and not placement.mapped_axes()[0]:
        # Directly in a pmaptap.jit step's body: lift.py hashes the leaves
        # after the step when they are its outputs, else here (``later``).
        fingerprint_later_p.bind(step, *leaves, spec=spec, traced=traced)
        return
    leaves = [lax.stop_gradient(x) for x in leaves]
    # Decided before our own cond below, whose predicate is the same on
    # every device (a collective inside it is safe).
    fn = _emitter(spec, placement.inside_divergent_control_flow())
    if traced and spec.every > 1:
        # On the device: skipped steps compute, gather and call nothing (the
        # decision is the same on every device, placement.every_due, so the
        # collective inside is reached by all or none).
        due = placement.every_due(step, spec.every)
        lax.cond(due, lambda: [fn(step, *leaves)][:0], lambda: [])
    else:
        fn(step, *leaves)


def _emitter(spec: FingerprintSpec, divergent_flow: bool):
    """The vmap-aware emission, as layouts.emitter: under vmap the batch is
    part of what each device holds, so it is fingerprinted whole (one call,
    not one per element), and jax.checkpoint does not replay it."""

    @custom_vmap
    def emit_fn(step, *leaves):
        _emit_now(spec, step, list(leaves), divergent_flow)
        return step

    @emit_fn.def_vmap
    @functools.partial(mark_tap_vmap_rule, name=spec.name)
    def _batched(axis_size, in_batched, step, *leaves):
        if in_batched[0]:
            raise ValueError(
                f"{FN}({spec.name!r}): the `step` argument is batched by vmap; "
                "pass a step that is the same for the whole batch."
            )
        leaves = [
            x if b else jnp.broadcast_to(x, (axis_size,) + x.shape)
            for x, b in zip(leaves, in_batched[1:])
        ]
        _emitter(spec, divergent_flow)(step, *leaves)
        return step, False

    return emit_fn


def _emit_now(spec: FingerprintSpec, step, leaves: list, divergent_flow: bool) -> None:
    where, raw_names = placement.current(leaves)
    if not raw_names:
        if not any(isinstance(x, jax.core.Tracer) for x in leaves):
            leaves = [jnp.asarray(x) for x in leaves]
        _send_or_mark(spec, axis_coords(()), step, lax.optimization_barrier(leaves))
        return
    varying = []
    for x in leaves:
        axes = varying_axes(x, raw_names)
        varying.append(tuple(i for i, a in enumerate(raw_names) if axes and a in axes))
    # The bits each device holds, read where they lie (module docstring).
    fps = fingerprint64_many(lax.optimization_barrier(leaves))
    coords = axis_coords(raw_names)
    if divergent_flow:
        _send_or_mark(_with(spec, FingerprintLayout.COPY, where, varying), coords, step, [fps])
        return
    spec = _with(spec, FingerprintLayout.GATHERED, where, varying)
    gathered = lax.all_gather(fps, raw_names)  # (n, leaves, 2), row-major coordinates
    _send_or_mark(spec, coords, step, [gathered])


def _send_or_mark(spec: FingerprintSpec, coords, step, data: list) -> None:
    """Under pmaptap.jit / pmaptap.pmap, mark what is sent (lift.py makes it
    outputs of the step); else send it now (``_send``)."""
    if marks.collecting():
        fingerprint_out_p.bind(coords, step, *data, spec=spec)
    else:
        _send(coords, step, *data, spec=spec)


def _send(coords, step, *data, spec: FingerprintSpec) -> list:
    """The host callback of one fingerprint, by layout: JIT ``data`` is the
    leaves (fingerprint_jit.py fingerprints and sends them), COPY this
    device's fingerprints, GATHERED every device's, sent by coordinate 0."""
    if spec.layout is FingerprintLayout.JIT:
        fingerprint_jit(spec, step, data)
    elif spec.layout is FingerprintLayout.COPY:
        emit_callback(functools.partial(_deliver, spec), coords, step, *data)
    else:
        first = _flat_index(coords, spec.placement.axis_sizes) == 0
        lax.cond(
            first,
            lambda: emit_callback(functools.partial(_deliver, spec), step, *data),
            lambda: None,
        )
    return []


# ------------------------------------------------------------ as step outputs
# A fingerprint under pmaptap.jit / pmaptap.pmap: its operands (coords,
# step, then what ``_send`` takes) marked in the program, as a tap's are by
# outputs.tap_out_p. lift.py turns the mark into outputs (``lifted``); a
# mark it cannot lift (a while_loop body) lowers to ``_send``, the callback
# transport's own emission. The transformation rules are the callback's.
fingerprint_out_p = jax_core.Primitive("pmaptap_fingerprint_out")
fingerprint_out_p.multiple_results = True
register_tap_rules(fingerprint_out_p)
fingerprint_out_p.def_impl(_send)
# The JIT layout's lowering (fingerprint_jit.py) needs the device assignment.
dispatch.prim_requires_devices_during_lowering.add(fingerprint_out_p)
# cacheable=False: the callback lowerings inside read the caller's name stack.
mlir.register_lowering(
    fingerprint_out_p, mlir.lower_fun(_send, multiple_results=True), cacheable=False
)


# A fingerprint written directly in a pmaptap.jit step's body
# (outputs.at_step_level), its operands (step, *leaves) marked for lift.py,
# which alone sees whether the leaves are outputs of the step: then it is
# hashed after the step (_outputs/later.py says why), else in it. Bound only
# in the step's own trace: no transformation rule, no lowering.
fingerprint_later_p = jax_core.Primitive("pmaptap_fingerprint_later")
fingerprint_later_p.multiple_results = True


@fingerprint_later_p.def_effectful_abstract_eval
def _later_abstract_eval(*avals, **params):
    # The debug effect keeps the mark through DCE, as a tap's.
    return [], {debugging.debug_effect}


def hashed(spec: FingerprintSpec, leaves: list, due) -> tuple[jax.Array, jax.Array]:
    """(the lowering's number, the table) of ``leaves`` (``fingerprint_table``,
    each read where it lies: optimization barrier), computed only where
    ``due`` (None: always); zeros where not (the host reads neither then)."""

    def table():
        return tuple(fingerprint_table(spec, lax.optimization_barrier(list(leaves))))

    if due is None:
        return table()
    rows = (jax.device_count(), len(leaves), 2)
    return lax.cond(due, table, lambda: (jnp.zeros((), jnp.uint32), jnp.zeros(rows, jnp.uint32)))


def lifted(spec: FingerprintSpec, operands: list) -> list:
    """A mark's operands as lift.py makes them outputs, (coords, step, *data)
    with data what the host half turns into the callback's payload
    (_outputs/drain.py): GATHERED every device's fingerprints (read from the
    row of coordinate 0), COPY a device's own, JIT (the lowering's number,
    the table of every partition's) in place of the leaves."""
    if spec.layout is not FingerprintLayout.JIT:
        return operands
    coords, step, *leaves = operands
    return [coords, step, *fingerprint_table(spec, leaves)]


def _with(spec: FingerprintSpec, layout: FingerprintLayout, where, varying) -> FingerprintSpec:
    return dataclasses.replace(spec, layout=layout, placement=where, varying=tuple(varying))


def _deliver(spec: FingerprintSpec, *arrays) -> None:
    # XLA's callback thread: only hands over (deliver never raises).
    deliver(spec, arrays)
