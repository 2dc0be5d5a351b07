"""``shard_call``: the host callback of taps outside any mapped axis (plain
``jit``), which calls back once per shard when the computation is
partitioned over several devices, and never gathers.

Why a second primitive: whether a jit computation is partitioned, and over
which devices, is known only when it is lowered (the same traced step runs
on one device or on a mesh), and the sharding of the tapped value only when
XLA's partitioner has chosen it. So the decision is taken in the lowering:

- partitioned over several devices: a *partitioned* XLA python callback
  (the one ``jax.debug.callback(partitioned=True)`` uses), which XLA
  partitions like its operands, so each device calls back with its own shard
  and nothing moves between devices. Beside the value travels a tiny
  ``iota(n)`` tiled over all devices: each callback receives its own
  partition number, hence its exact device (placement.partition_ids). The
  operand's sharding is reported at compile time (InspectSharding) into a
  ``ShardPlacement`` made for this lowering, which maps the partition to
  the shard's global slice and mesh coordinates.
- otherwise (one device, or inside shard_map/pmap): ``callback_p``'s own
  lowering, after computing ``max_value_bytes`` summaries on the device as
  ``tap`` did before (on a partitioned value a summary of the whole array
  would need an all-reduce, so there the host summarizes each shard).

This module relies on ``jax._src`` internals (JAX 0.10) through
placement.py and the lowering helpers below; tests/test_sharded_jit.py fails
loudly if a JAX upgrade breaks them.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import jax
import numpy as np
from jax._src import callback as cb
from jax._src import core, dispatch
from jax._src.interpreters import mlir

from pmaptap._common.shard_placement import ShardPlacement
from pmaptap._trace import placement, primitive

shard_call_p = core.Primitive("pmaptap_shard_call")
shard_call_p.multiple_results = True
# The lowering needs the device assignment (ShardingContext.device_assignment).
dispatch.prim_requires_devices_during_lowering.add(shard_call_p)


def shard_call(
    host_fn: Callable[..., None],
    coords,
    step,
    *leaves,
    summarize: tuple[bool, ...] = (),
    batch_dims: int = 0,
) -> None:
    """Call ``host_fn(placement, *arrays)`` on the host: per shard with a
    ``ShardPlacement`` and ``arrays = (partition, coords, step, *shards)``
    when partitioned, else once with ``placement=None`` and
    ``arrays = (coords, step, *leaves)`` where the leaves marked in
    ``summarize`` arrive as their on-device statistics."""
    shard_call_p.bind(
        coords, step, *leaves, host_fn=host_fn, summarize=tuple(summarize), batch_dims=batch_dims
    )


@shard_call_p.def_impl
def _impl(coords, step, *leaves, host_fn, summarize, batch_dims):
    # Eager: one concrete value on the caller's thread.
    leaves = [
        _summarized(x, batch_dims) if s else x
        for x, s in zip(leaves, summarize or (False,) * len(leaves))
    ]
    host_fn(None, *[np.array(a) for a in (coords, step, *leaves)])
    return ()


primitive.register_tap_rules(shard_call_p)


def _summarized(x, batch_dims: int):
    from pmaptap._trace.stats import device_statistics

    fn = device_statistics
    for _ in range(batch_dims):
        fn = jax.vmap(fn)
    return fn(x)


def _lower_whole(ctx, coords, step, *leaves, host_fn, summarize, batch_dims):
    """Not partitioned: summaries on device, then ``callback_p``'s lowering."""
    if primitive.recomputed_while_predicate(ctx):
        return []  # a duplicate (see primitive.recomputed_while_predicate)
    args, avals = [coords, step], list(ctx.avals_in[:2])
    for x, aval, s in zip(leaves, ctx.avals_in[2:], summarize or (False,) * len(leaves)):
        if s:
            out_aval = jax.eval_shape(
                partial(_summarized, batch_dims=batch_dims),
                jax.ShapeDtypeStruct(aval.shape, aval.dtype),
            )
            out_aval = core.ShapedArray(out_aval.shape, out_aval.dtype)
            sub = ctx.replace(primitive=None, avals_in=[aval], avals_out=[out_aval])
            (x,) = mlir.lower_fun(
                partial(_summarized, batch_dims=batch_dims), multiple_results=False
            )(sub, x)
            aval = out_aval
        args.append(x)
        avals.append(aval)
    return primitive._lowering(ctx.replace(avals_in=avals), *args, host_fn=partial(host_fn, None))


def _lowering(ctx, coords, step, *leaves, host_fn, summarize, batch_dims):
    if primitive.recomputed_while_predicate(ctx):
        return []  # a duplicate (see primitive.recomputed_while_predicate)
    where = placement.shard_context(ctx)
    if where is None:
        return _lower_whole(
            ctx, coords, step, *leaves, host_fn=host_fn, summarize=summarize, batch_dims=batch_dims
        )
    devices, names, sizes = where
    place = ShardPlacement(
        devices=tuple(int(d.id) for d in devices),
        processes=tuple(int(d.process_index) for d in devices),
        axis_names=tuple(placement.display_axis_name(n) for n in names or ()),
        axis_sizes=tuple(sizes or ()),
        shapes=tuple(tuple(int(s) for s in a.shape) for a in ctx.avals_in[2:]),
        me=jax.process_index(),
    )
    for i, x in enumerate(leaves):
        placement.inspect_operand_sharding(ctx, x, devices, partial(place.set_sharding, i))
    pid, pid_aval = placement.partition_ids(ctx, devices)
    run = primitive._copying(partial(host_fn, place))
    result, _, _ = cb.emit_python_callback(
        ctx.replace(avals_in=[pid_aval, *ctx.avals_in]),
        run,
        None,
        [pid, coords, step, *leaves],
        [pid_aval, *ctx.avals_in],
        ctx.avals_out,
        has_side_effect=True,
        returns_token=True,
        partitioned=True,
    )
    return result


# cacheable=False: the rule needs the caller's name stack.
mlir.register_lowering(shard_call_p, _lowering, platform="cpu", cacheable=False)
mlir.register_lowering(shard_call_p, _lowering, platform="gpu", cacheable=False)
# TPU: no partitioned python callbacks; the whole value, as before.
mlir.register_lowering(shard_call_p, _lower_whole, platform="tpu", cacheable=False)
