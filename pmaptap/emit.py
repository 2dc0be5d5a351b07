"""The one place in pmaptap that emits a JAX host callback.

Everything traced (``tap``, ``tap_grad``, the host_callback shims) ends here.
The callback itself only hands the arrays to the active pipeline (see
``routing.deliver``) and returns: XLA's callback thread holds the GIL and
blocks its device, and converting or encoding there was seen to hang.

Why ``jax.debug.callback``: it is allowed under ``grad`` (it sees primals),
``scan``/``cond``/``while``, ``checkpoint`` and inside ``shard_map``/``pmap``
bodies, where a fully manual mesh makes it run once per device with the local
value. Why ``custom_vmap`` around it: the plain batching rule of
``debug_callback`` unrolls a vmapped callback into one call per element, in no
guaranteed order and with no element index. Our rule instead emits *one*
callback carrying the whole batch, and counts the vmapped axes in
``TapSpec.batch_dims`` (nested vmaps stack, outermost first).
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_batching import custom_vmap

from .routing import deliver
from .spec import TapSpec


def _host_entry(spec: TapSpec, *arrays) -> None:
    # Runs on XLA's callback thread. `deliver` never raises.
    deliver(spec, arrays)


@functools.lru_cache(maxsize=4096)
def _emitter(spec: TapSpec):
    @custom_vmap
    def emit_fn(coords, step, *leaves):
        jax.debug.callback(functools.partial(_host_entry, spec),
                           coords, step, *leaves)
        return coords

    @emit_fn.def_vmap
    def _batched(axis_size, in_batched, coords, step, *leaves):
        coords_b, step_b, *leaves_b = in_batched
        if coords_b or step_b:
            raise ValueError(
                f"pmaptap.tap({spec.name!r}): the `step` argument is batched by "
                "vmap; pass a step that is the same for the whole batch (e.g. "
                "tap outside the vmap, or pass a Python int).")
        # Batch axes arrive at position 0. Unbatched leaves are broadcast so
        # every leaf of the record has the same leading batch axes.
        leaves = [x if b else jnp.broadcast_to(x, (axis_size,) + x.shape)
                  for x, b in zip(leaves, leaves_b)]
        _emitter(spec.with_batch())(coords, step, *leaves)
        return coords, False

    return emit_fn


def axis_coords(axis_names: Sequence) -> jax.Array:
    """This device's coordinate along each manual axis (int32 vector)."""
    if not axis_names:
        return jnp.zeros((0,), jnp.int32)
    return jnp.stack([lax.axis_index(n).astype(jnp.int32) for n in axis_names])


def emit(spec: TapSpec, leaves: Sequence[jax.Array], coords: jax.Array,
         step: jax.Array, *, traced_every: bool) -> None:
    """Send ``leaves`` to the host, tagged with ``coords`` and ``step``.

    With ``traced_every`` the decision ``step % every == 0`` is made on the
    device, so skipped steps make no host call at all.
    """
    leaves = [lax.stop_gradient(x) for x in leaves]
    fn = _emitter(spec)
    if traced_every:
        def fire():
            fn(coords, step, *leaves)
        lax.cond(step % spec.every == 0, fire, lambda: None)
    else:
        fn(coords, step, *leaves)
