"""Statistics of a partitioned value computed per shard, on the device that
holds each shard, for a tap under plain jit whose leaf is above
``options().max_value_bytes``: one small row a device leaves it
(_common/shard_placement.py: ``read_statistics_rows``), whatever the shard's
size.

A ``custom_partitioning`` op, as fingerprint_jit.py's and for its reason
(which slice a device holds is known only once XLA's partitioner ran): the
``partition`` rule gets the operand's actual sharding (nothing gathered or
resharded), and each device computes its block's statistics (an uneven
sharding's padding masked out) into its own row, with its device id and
global slice. The callback transport (shardcall.py) keeps the rows one per
device (``P(all mesh axes)``), each callback reading its own; the output
transport (lift.py through ``lifted``) all-gathers them into one replicated
table of ``jax.device_count()`` rows (_outputs/drain.py). One device: one
row of the whole value, no case of its own.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import core, dispatch
from jax._src.interpreters import mlir
from jax.experimental.custom_partitioning import SdyShardingRule, custom_partitioning
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pmaptap._common.shard_placement import (
    PARTITION_AXIS,
    STATS_HEAD,
    _slices_by_device,
    statistics_row_width,
)
from pmaptap._common.spec import Layout, TapSpec
from pmaptap._trace import placement
from pmaptap._trace.stats import device_statistics


def _statistics(block: jax.Array, valid: jax.Array | None, batch_dims: int) -> jax.Array:
    """float32[*batch, 8] of one block (stats.device_statistics per batch element)."""
    fn = device_statistics
    for _ in range(batch_dims):
        fn = jax.vmap(fn)
    if valid is None:
        return fn(block)
    return fn(block, valid)


def _row(head: jax.Array, stats: jax.Array, lead: tuple[int, ...]) -> jax.Array:
    """One row: ``head`` then the statistics' bits, batch axes padded to ``lead``."""
    pad = [(0, g - n) for g, n in zip(lead, stats.shape[:-1])] + [(0, 0)]
    stats = jnp.pad(stats, pad)
    bits = lax.bitcast_convert_type(stats, jnp.uint32).reshape(-1)
    return jnp.concatenate([head, bits])


def _head(device: Any, index: tuple | None, shape: tuple[int, ...]) -> np.ndarray:
    box = [v for se in index for v in se] if index is not None else [0] * (2 * len(shape))
    return np.array([int(device.id) + 1, index is not None, len(shape), *shape, *box], np.uint32)


def _whole(device: Any, aval: core.ShapedArray, batch_dims: int):
    """The one row of a computation on one device (``device`` None: unknown)."""
    shape = tuple(int(s) for s in aval.shape)
    if device is None:
        head = np.zeros(STATS_HEAD + 3 * len(shape), np.uint32)
    else:
        head = _head(device, tuple((0, s) for s in shape), shape)

    def fn(x):
        return _row(jnp.asarray(head), _statistics(x, None, batch_dims), shape[:batch_dims])[None]

    return fn


def _per_partition(devices: tuple, aval: core.ShapedArray, batch_dims: int, replicated: bool):
    """The function lowered in place of the rows on a partitioned
    computation: one ``custom_partitioning`` call (see the module
    docstring). ``replicated``: every device ends up with every row (on the
    operand's mesh, so that the table's sharding names its axes), else each
    device holds its own, row k on ``devices[k]``."""
    n, shape = len(devices), tuple(int(s) for s in aval.shape)
    lead, rank = shape[:batch_dims], len(shape)

    @custom_partitioning
    def rows(x):
        # The unpartitioned meaning (never run once partitioned): the
        # statistics of the whole value in rows that name no device (which
        # the host refuses); a device table would be a constant, which this
        # function may not close over.
        head = jnp.zeros(STATS_HEAD + 3 * rank, jnp.uint32)
        row = _row(head, _statistics(x, None, batch_dims), lead)
        return jnp.broadcast_to(row, (n, row.size))

    def _mesh(mesh):
        if not replicated or mesh.empty or math.prod(mesh.shape.values()) != n:
            return Mesh(np.array(devices), (PARTITION_AXIS,))
        return mesh

    def partition(mesh, arg_shapes, result_shape):
        sharding = arg_shapes[0].sharding
        mesh = _mesh(mesh)
        axes = tuple(mesh.axis_names)
        try:
            slices = _slices_by_device(sharding, shape)
        except Exception:  # noqa: BLE001 - unknown slices stay unknown (null index)
            slices = {}
        # Row-major over the mesh axes: the position lax.axis_index gives below.
        heads = np.stack([_head(d, slices.get(d.id), shape) for d in mesh.devices.flat])

        def lower(block):
            k = jnp.int32(0)
            for a in axes:
                k = k * int(mesh.shape[a]) + lax.axis_index(a)
            head = jnp.asarray(heads)[k]
            # An uneven sharding pads the last tiles: only the elements
            # inside this device's slice count.
            at = STATS_HEAD + rank
            valid = jnp.ones(block.shape, jnp.bool_)
            for d in range(rank):
                extent = (head[at + 2 * d + 1] - head[at + 2 * d]).astype(jnp.int32)
                valid &= lax.broadcasted_iota(jnp.int32, block.shape, d) < extent
            valid = jnp.where(head[1] > 0, valid, True)  # slice unknown: all of it
            row = _row(head, _statistics(block, valid, batch_dims), lead)[None]
            return lax.all_gather(row, axes, axis=0, tiled=True) if replicated else row

        return mesh, lower, _out(mesh), (sharding,)

    def _out(mesh):
        axes = tuple(mesh.axis_names)
        return NamedSharding(mesh, PartitionSpec() if replicated else PartitionSpec(axes))

    def infer(mesh, arg_shapes, result_shape):  # GSPMD's propagation
        return _out(_mesh(mesh))

    # Shardy: the operand's dimensions reduce into the rows, so the rule
    # never asks the operand to change its sharding.
    factors = tuple(f"d{i}" for i in range(rank))
    rows.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer,
        propagate_user_sharding=lambda mesh, user_shape: user_shape.sharding,
        sharding_rule=SdyShardingRule(
            operand_mappings=(factors,),
            result_mappings=(("rows", "width"),),
            reduction_factors=factors,
        ),
    )
    return rows


def lower_rows(ctx, x, aval: core.ShapedArray, batch_dims: int, *, replicated: bool):
    """Lower the statistics rows of ``x`` (of ``aval``) inside the lowering
    ``ctx``: (the rows, uint32[partitions, width], their aval). One row on a
    computation that is not partitioned."""
    where = placement.shard_context(ctx)
    if where is None:
        assignment = getattr(ctx.module_context.axis_context, "device_assignment", None)
        n, fn = 1, _whole(assignment[0] if assignment else None, aval, batch_dims)
    else:
        devices = where[0]
        n, fn = len(devices), _per_partition(tuple(devices), aval, batch_dims, replicated)
    shape = tuple(int(s) for s in aval.shape)
    rows_aval = core.ShapedArray(
        (n, statistics_row_width(shape, batch_dims)), jnp.dtype(jnp.uint32)
    )
    sub = ctx.replace(primitive=None, avals_in=[aval], avals_out=[rows_aval])
    (rows,) = mlir.lower_fun(fn, multiple_results=False)(sub, x)
    if where is not None and not replicated:
        # Each device keeps its own row (a consumer such as the partitioned
        # callback would otherwise get them all-gathered).
        rows = placement.split_rows(ctx, rows, rows_aval, tuple(where[0]))
    return rows, rows_aval


# ------------------------------------------------------------ as step outputs
statistics_table_p = core.Primitive("pmaptap_statistics_table")
dispatch.prim_requires_devices_during_lowering.add(statistics_table_p)
statistics_table_p.def_impl(partial(dispatch.apply_primitive, statistics_table_p))


@statistics_table_p.def_abstract_eval
def _table_abstract_eval(aval, *, batch_dims: int, rows: int):
    shape = tuple(int(s) for s in aval.shape)
    return core.ShapedArray((rows, statistics_row_width(shape, batch_dims)), jnp.dtype(jnp.uint32))


def _table_lowering(ctx, x, *, batch_dims: int, rows: int):
    table, aval = lower_rows(ctx, x, ctx.avals_in[0], batch_dims, replicated=True)
    n = aval.shape[0]
    if n > rows:
        raise ValueError(
            f"a pmaptap tap under pmaptap.jit: the computation spans {n} devices, "
            f"more than jax.device_count() ({rows}), the rows its statistics were "
            "given when traced. Use jax.jit for this step."
        )
    sub = ctx.replace(primitive=None, avals_in=[aval], avals_out=ctx.avals_out)
    (table,) = mlir.lower_fun(
        lambda t: jnp.pad(t, ((0, rows - n), (0, 0))), multiple_results=False
    )(sub, table)
    return [table]


# cacheable=False: the lowering depends on the computation's devices.
mlir.register_lowering(statistics_table_p, _table_lowering, cacheable=False)


def lifted(operands: list, *, spec: TapSpec, traced_every: bool = False) -> list:
    """A tap mark's operands (coords, step, [due], *leaves) as lift.py makes
    them outputs: under plain jit (``Layout.SHARDS``) each leaf marked in
    ``spec.site.as_statistics`` replaced by its table of per-shard
    statistics (uint32[jax.device_count(), width], see above)."""
    marks = spec.site.as_statistics
    if spec.transport.layout is not Layout.SHARDS or not marks:
        return operands
    k = 3 if traced_every else 2
    head, leaves = operands[:k], operands[k:]
    rows = jax.device_count()
    return head + [
        statistics_table_p.bind(x, batch_dims=spec.site.batch_dims, rows=rows) if m else x
        for x, m in zip(leaves, marks)
    ]
