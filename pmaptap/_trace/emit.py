"""The entry point of emission: everything ``tap`` and ``tap_grad`` trace
ends here. ``emit`` sends values that only travel to the host (through a
transport layout, layouts.py, or a ``group``), through our own callback
primitive (primitive.py says why not ``jax.debug.callback``). The old
host_callback API has its own primitives (host_callback/_linked.py).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import core as _core

from pmaptap._common.spec import TapSpec
from pmaptap._trace.group import auto_offer, auto_step_key, current_group, settle
from pmaptap._trace.layouts import choose_layout, emit_now, emitter
from pmaptap._trace.placement import every_due
from pmaptap._trace.primitive import eager


def axis_coords(axis_names: Sequence, loops: Sequence = ()) -> jax.Array:
    """This device's coordinate along each manual axis, then the index of
    each enclosing loop's iteration, outermost first (iteration.indices;
    ``TapSite.iterations`` says how many): an int32 vector."""
    parts = [lax.axis_index(n).astype(jnp.int32) for n in axis_names] + list(loops)
    if not parts:
        return jnp.zeros((0,), jnp.int32)
    return jnp.stack(parts)


def emit(
    spec: TapSpec,
    raw_names: tuple,
    leaves: Sequence[jax.Array],
    coords: jax.Array,
    step: jax.Array,
    *,
    traced_every: bool,
) -> None:
    """Send ``leaves`` to the host, tagged with ``coords`` and ``step``.

    With ``traced_every`` the decision ``step % every == 0`` is made on the
    device, so skipped steps make no host call (and no collective) at all;
    devices whose steps differ decide alike (placement.every_due).
    """
    if not eager():
        # Eagerly there is no gradient to stop, and stop_gradient would make a
        # NumPy float64 / int64 leaf 32 bits (emit_callback says why not).
        leaves = [lax.stop_gradient(x) for x in leaves]
    spec = choose_layout(spec, leaves, raw_names)  # before our own cond below
    g = current_group()
    if g is not None and g.offer(spec, tuple(raw_names), leaves, coords, step, traced_every):
        return
    if auto_offer(spec, tuple(raw_names), leaves, coords, step, traced_every):
        return  # emitted with the trace's other taps when it ends
    # Deferred taps of the same name (automatic steps) run first: they came first.
    settle({auto_step_key(spec)}, _core.trace_ctx.trace)
    if eager():
        # Nothing to batch; emitter's custom_vmap would bind (see above).
        def fn(coords, step, *leaves) -> None:
            emit_now(spec, tuple(raw_names), coords, step, leaves)
    else:
        fn = emitter(spec, tuple(raw_names))
    if traced_every:

        def fire() -> None:  # whatever fn returns: cond's branches return nothing
            fn(coords, step, *leaves)

        lax.cond(every_due(step, spec.site.every), fire, lambda: None)
    else:
        fn(coords, step, *leaves)
