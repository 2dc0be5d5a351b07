"""``emit_callback``: binds ``callback_p``, the single JAX host-callback
primitive pmaptap emits.

Why not ``jax.debug.callback`` itself: its runtime path calls
``jax.device_put`` on the callback's arguments *inside XLA's callback thread*
(``debugging.debug_callback_impl``), which costs about 70 us per call here and
is a JAX call on a thread where JAX calls can deadlock. This primitive has the
same transformation semantics as ``debug_callback_p`` (it reuses its effect,
so grad / scan / cond / while / checkpoint / shard_map treat it alike, and its
partial-eval rule), but its lowering hands the raw NumPy views XLA gives the
callback to ``host_fn`` after one ``np.array`` copy (the views are only valid
during the call). Partial-auto shard_map contexts and TPU, where the callback
needs JAX's own gather/cond or send/recv plumbing, delegate to
``debug_callback``'s lowering.

This module relies on ``jax._src`` internals (JAX 0.10); tests/test_primitive.py
fails loudly if a JAX upgrade breaks it.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable

import numpy as np
from jax._src import callback as cb
from jax._src import core, debugging, sharding_impls
from jax._src.interpreters import ad, batching, mlir
from jax._src.interpreters import partial_eval as pe
from jax._src.lib import xla_client as xc
from jax._src.state import discharge as state_discharge

callback_p = core.Primitive("pmaptap_callback")
callback_p.multiple_results = True


def emit_callback(host_fn: Callable[..., None], *args: Any) -> None:
    """Call ``host_fn(*numpy_arrays)`` on the host when this point of the
    program runs (once per device inside a fully manual shard_map/pmap)."""
    callback_p.bind(*args, host_fn=host_fn)


@callback_p.def_impl
def _impl(*args, host_fn):
    # Eager (not staged): we are on the caller's thread, values are concrete.
    host_fn(*[np.array(a) for a in args])
    return ()


@callback_p.def_effectful_abstract_eval
def _abstract_eval(*avals, host_fn):
    del avals, host_fn
    return [], {debugging.debug_effect}


def _jvp(primals, tangents, **params):
    return callback_p.bind(*primals, **params), []


ad.primitive_jvps[callback_p] = _jvp
ad.primitive_transposes[callback_p] = lambda _, *args, **params: [None] * len(args)
batching.primitive_batchers[callback_p] = partial(
    debugging.debug_batching_rule, primitive=callback_p)
pe.partial_eval_jaxpr_custom_rules[callback_p] = partial(
    debugging._debug_partial_eval_custom, primitive=callback_p)


@state_discharge.register_discharge_rule(callback_p)
def _discharge(in_avals, out_avals, *args, **params):
    del in_avals, out_avals
    return args, callback_p.bind(*args, **params)


def _copying(host_fn):
    def run(*flat_args):
        host_fn(*[np.array(a, copy=True) for a in flat_args])
        return ()
    return run


def _delegate(ctx, *args, host_fn):
    def as_debug_callback(*jax_arrays):
        host_fn(*[np.asarray(a) for a in jax_arrays])
    return debugging.debug_callback_lowering(
        ctx, *args, effect=debugging.debug_effect, partitioned=False,
        callback=as_debug_callback)


def _lowering(ctx, *args, host_fn):
    axis_context = ctx.module_context.axis_context
    sharding: Any = None
    if isinstance(axis_context, sharding_impls.SPMDAxisContext):
        if set(axis_context.mesh.axis_names) != set(axis_context.manual_axes):
            return _delegate(ctx, *args, host_fn=host_fn)   # partial-auto
        # Fully manual: per-device semantics, the callback runs on each device.
        from jax._src import config
        if config.use_shardy_partitioner.value:
            sharding = cb._get_sdy_array_list_for_callbacks(ctx.avals_out)
        else:
            sharding = xc.OpSharding()
            sharding.type = xc.OpSharding.Type.MANUAL
    elif isinstance(axis_context, sharding_impls.ShardingContext):
        # Automatic sharding: run once, on the full logical value.
        return _delegate(ctx, *args, host_fn=host_fn)
    result, _, _ = cb.emit_python_callback(
        ctx, _copying(host_fn), None, list(args), ctx.avals_in, ctx.avals_out,
        has_side_effect=True, returns_token=True, partitioned=False,
        sharding=sharding)
    return result


mlir.register_lowering(callback_p, _lowering, platform="cpu")
mlir.register_lowering(callback_p, _lowering, platform="gpu")
mlir.register_lowering(callback_p, _delegate, platform="tpu", cacheable=False)
