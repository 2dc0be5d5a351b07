"""The entry points of emission: everything traced (``tap``, ``tap_grad``,
the host_callback shims) ends here. ``emit`` for values that only travel to
the host (through a transport layout, see layouts.py, or a ``group``),
``emit_call`` for the one case where the host must answer with a value
(``host_callback.call``).

Why our own callback primitive (primitive.py, ``emit_callback``) and not ``jax.debug.callback``:
it has the same semantics (allowed under ``grad``, where it sees primals,
``scan``/``cond``/``while``, ``checkpoint``, and once per device inside fully
manual ``shard_map``/``pmap`` bodies) without its ``jax.device_put`` on XLA's
callback thread.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import core as _core
from jax.experimental import io_callback

from pmaptap._common.spec import TapSpec
from pmaptap._trace.group import auto_offer, auto_step_key, current_group, settle
from pmaptap._trace.layouts import choose_layout, emitter


def axis_coords(axis_names: Sequence) -> jax.Array:
    """This device's coordinate along each manual axis (int32 vector)."""
    if not axis_names:
        return jnp.zeros((0,), jnp.int32)
    return jnp.stack([lax.axis_index(n).astype(jnp.int32) for n in axis_names])


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
    the step must then be the same on every device, as a loop counter is.
    """
    leaves = [lax.stop_gradient(x) for x in leaves]
    spec = choose_layout(spec, leaves, raw_names)  # before our own cond below
    g = current_group()
    if g is not None and g.offer(spec, tuple(raw_names), leaves, coords, step, traced_every):
        return
    if auto_offer(spec, tuple(raw_names), leaves, coords, step, traced_every):
        return  # emitted with the trace's other taps when it ends
    # Deferred taps of the same name (automatic steps) run first: they came first.
    settle({auto_step_key(spec)}, _core.trace_ctx.trace)
    fn = emitter(spec, tuple(raw_names))
    if traced_every:

        def fire():
            fn(coords, step, *leaves)

        lax.cond(step % spec.site.every == 0, fire, lambda: None)
    else:
        fn(coords, step, *leaves)


def emit_call(
    host_fn: Callable[..., Sequence],
    coords: jax.Array,
    leaves: Sequence[jax.Array],
    result_avals: Sequence[jax.ShapeDtypeStruct],
    *,
    what: str,
) -> list[jax.Array]:
    """Run ``host_fn(coords, *leaves)`` on the host and return its results
    (one array per entry of ``result_avals``) into the computation.

    ``host_fn`` runs on XLA's callback thread and blocks the device until it
    returns; it must return arrays matching ``result_avals`` exactly, or raise
    (which fails the computation with that message).

    Why ``io_callback(ordered=False)`` and not ``pure_callback``: the old
    ``host_callback.call`` always ran, once per execution and device.
    ``pure_callback`` is declared side-effect free, so JAX drops it when its
    result is unused (checked on JAX 0.10: zero host calls) and may repeat it
    under remat. ``io_callback`` keeps it; unordered, it is allowed inside
    ``pmap``/``shard_map`` bodies (once per device, with the local value) and
    batches under ``vmap`` as one host call per element, which is what a
    host function written for one unbatched argument expects.

    Why a ``custom_jvp`` identity on the arguments: JAX cannot differentiate
    a host function. Its rule runs only when a non-zero tangent reaches the
    call, and replaces JAX's generic refusal with one that says what to do.
    The callback itself stays outside the ``custom_jvp``: JAX's jaxpr checker
    (``jax_enable_checks``) refuses an ``io_callback`` effect inside one.
    """
    avals = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in result_avals)

    @jax.custom_jvp
    def guard(*leaves):
        return leaves

    @guard.defjvp
    def _no_derivative(primals, tangents):
        raise NotImplementedError(
            f"{what}: cannot differentiate through a host call, JAX cannot see "
            "inside the host function. If no gradient should flow through it, "
            "wrap its argument in jax.lax.stop_gradient(...); otherwise give it "
            "a derivative with jax.custom_vjp (e.g. a second host call that "
            "computes the VJP on the host)."
        )

    leaves = guard(*leaves) if leaves else ()
    return list(io_callback(host_fn, avals, coords, *leaves, ordered=False))
