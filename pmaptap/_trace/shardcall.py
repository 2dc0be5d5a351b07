"""``shard_call``: the host callback of taps outside any mapped axis (plain
``jit``): once per device with its own shards on a partitioned computation,
never gathering (docs/architecture.md, "Exact or null placement").

Why a second primitive: whether a jit computation is partitioned, and over
which devices, is known only when it is lowered (the same traced step runs
on one device or on a mesh), and the tapped value's sharding only once
XLA's partitioner chose it. So the lowering decides:

- over several devices: a *partitioned* XLA python callback (as
  ``jax.debug.callback(partitioned=True)``), beside a tiny ``iota(n)`` tiled
  over the devices so each callback knows its partition, hence its device
  (placement.partition_ids); each operand's sharding, reported at compile
  time (InspectSharding), fills a ``ShardPlacement`` per tap. ONE call
  carries every tap of a step (group.py), scalar ones (``Layout.WHOLE``)
  read from partition 0 only; a step of scalars only is one
  non-partitioned callback from device 0.
- otherwise (one device, or inside shard_map/pmap): ``callback_p``'s own
  lowering, after the ``max_value_bytes`` statistics on the device (on a
  partitioned computation, per shard: shardstats.py).

Relies on ``jax._src`` (JAX 0.10) through placement.py and the lowering
helpers below; tests/trace/test_sharded_jit.py fails loudly if that breaks.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax._src import callback as cb
from jax._src import core, dispatch
from jax._src.interpreters import mlir

from pmaptap._common.shard_placement import ShardPlacement
from pmaptap._trace import placement, primitive, shardstats

shard_call_p = core.Primitive("pmaptap_shard_call")
shard_call_p.multiple_results = True
# The lowering needs the device assignment (ShardingContext.device_assignment).
dispatch.prim_requires_devices_during_lowering.add(shard_call_p)

# The partition number of a payload read from the first device only (a
# computation with no per-shard member: one non-partitioned callback, which
# XLA runs on device 0 of the assignment).
_FIRST_PARTITION = np.zeros((1,), np.uint32)

Entry = Callable[[Any], Callable[..., None]]


def shard_call(
    entry: Entry,
    coords,
    steps: Sequence,
    leaves: Sequence,
    *,
    members: tuple[tuple[int, bool], ...],
    as_statistics: tuple[bool, ...] = (),
    batch_dims: int = 0,
) -> None:
    """One host call carrying the taps ``members`` of a step under plain jit:
    per member ``(number of leaves, per_shard)``, its step in ``steps`` and
    its leaves, in order, in ``leaves``. ``entry(places)`` is called when the
    call is lowered (eagerly: when it runs) and returns the host function,
    which receives NumPy arrays:

    - ``places``, one ``ShardPlacement`` per member (partitioned over several
      devices): ``(partition, coords, *steps, *leaves)``, from each device with
      its own shards when any member is per-shard (a leaf in ``as_statistics``:
      its shard's statistics row), else from device 0 with the whole values;
    - ``places`` None (one device, shard_map/pmap, eager): ``(coords, *steps,
      *leaves)`` once, ``as_statistics`` leaves as their statistics.
    """
    shard_call_p.bind(
        coords,
        *steps,
        *leaves,
        entry=entry,
        members=tuple(members),
        as_statistics=tuple(as_statistics),
        batch_dims=batch_dims,
    )


@shard_call_p.def_impl
def _impl(coords, *args, entry, members, as_statistics, batch_dims):
    # Eager: one concrete value on the caller's thread.
    m = len(members)
    steps, leaves = args[:m], args[m:]
    leaves = [
        _statistics(x, batch_dims) if s else x
        for x, s in zip(leaves, as_statistics or (False,) * len(leaves))
    ]
    entry(None)(*[np.array(a) for a in (coords, *steps, *leaves)])
    return ()


primitive.register_tap_rules(shard_call_p)


def _statistics(x, batch_dims: int):
    from pmaptap._trace.stats import device_statistics

    fn = device_statistics
    for _ in range(batch_dims):
        fn = jax.vmap(fn)
    return fn(x)


def _lower_whole(ctx, coords, *args, host_fn, members, as_statistics, batch_dims):
    """Not partitioned: statistics on device, then ``callback_p``'s lowering
    (once, with the whole values; on device 0 of a multi-device computation)."""
    m = len(members)
    steps, leaves = args[:m], args[m:]
    operands, avals = [coords, *steps], list(ctx.avals_in[: 1 + m])
    for x, aval, s in zip(leaves, ctx.avals_in[1 + m :], as_statistics or (False,) * len(leaves)):
        if s:
            out_aval = jax.eval_shape(
                partial(_statistics, batch_dims=batch_dims),
                jax.ShapeDtypeStruct(aval.shape, aval.dtype),
            )
            out_aval = core.ShapedArray(out_aval.shape, out_aval.dtype)
            sub = ctx.replace(primitive=None, avals_in=[aval], avals_out=[out_aval])
            (x,) = mlir.lower_fun(
                partial(_statistics, batch_dims=batch_dims), multiple_results=False
            )(sub, x)
            aval = out_aval
        operands.append(x)
        avals.append(aval)
    return primitive._lowering(ctx.replace(avals_in=avals), *operands, host_fn=host_fn)


def _lowering(ctx, coords, *args, entry, members, as_statistics, batch_dims):
    if primitive.recomputed_while_predicate(ctx):
        return []  # a duplicate (see primitive.recomputed_while_predicate)
    params = dict(members=members, as_statistics=as_statistics, batch_dims=batch_dims)
    where = placement.shard_context(ctx)
    if where is None:
        return _lower_whole(ctx, coords, *args, host_fn=entry(None), **params)
    devices, names, sizes = where
    m = len(members)
    steps, leaves = args[:m], args[m:]
    leaf_avals = ctx.avals_in[1 + m :]
    common = dict(
        devices=tuple(int(d.id) for d in devices),
        processes=tuple(int(d.process_index) for d in devices),
        axis_names=tuple(placement.display_axis_name(n) for n in names or ()),
        axis_sizes=tuple(sizes or ()),
        me=jax.process_index(),
    )
    places, i = [], 0
    for n, per_shard in members:
        place = ShardPlacement(
            shapes=tuple(tuple(int(s) for s in a.shape) for a in leaf_avals[i : i + n]),
            **common,
        )
        if per_shard:
            for j, x in enumerate(leaves[i : i + n]):
                placement.inspect_operand_sharding(ctx, x, devices, partial(place.set_sharding, j))
        places.append(place)
        i += n
    fn = entry(tuple(places))
    if not any(per_shard for _, per_shard in members):
        # Scalars only (replicated by construction): ONE copy is enough, so
        # one callback from device 0 rather than one per device; the
        # placements still name every device that holds them.
        return _lower_whole(
            ctx, coords, *args, host_fn=lambda *a: fn(_FIRST_PARTITION, *a), **params
        )
    # Scalar members ride along, read from partition 0: each device must
    # hold the whole value (see placement.replicated). Big leaves travel as
    # each device's row of its shard's statistics (shardstats.py).
    leaves, leaf_avals, i = list(leaves), list(leaf_avals), 0
    for n, per_shard in members:
        for j in range(i, i + n):
            if not per_shard:
                leaves[j] = placement.replicated(ctx, leaves[j], leaf_avals[j], devices)
            elif as_statistics and as_statistics[j]:
                leaves[j], leaf_avals[j] = shardstats.lower_rows(
                    ctx, leaves[j], leaf_avals[j], batch_dims, replicated=False
                )
        i += n
    pid, pid_aval = placement.partition_ids(ctx, devices)
    avals = [pid_aval, *ctx.avals_in[: 1 + m], *leaf_avals]
    result, _, _ = cb.emit_python_callback(
        ctx.replace(avals_in=avals),
        primitive._copying(fn),
        None,
        [pid, coords, *steps, *leaves],
        avals,
        ctx.avals_out,
        has_side_effect=True,
        returns_token=True,
        partitioned=True,
    )
    return result


def _lower_tpu(ctx, coords, *args, entry, members, as_statistics, batch_dims):
    # TPU: no partitioned python callbacks; the whole values, as before.
    return _lower_whole(
        ctx,
        coords,
        *args,
        host_fn=entry(None),
        members=members,
        as_statistics=as_statistics,
        batch_dims=batch_dims,
    )


# cacheable=False: the rule needs the caller's name stack.
mlir.register_lowering(shard_call_p, _lowering, platform="cpu", cacheable=False)
mlir.register_lowering(shard_call_p, _lowering, platform="gpu", cacheable=False)
mlir.register_lowering(shard_call_p, _lower_tpu, platform="tpu", cacheable=False)
