"""``pmaptap.fingerprint`` under plain jit: each device fingerprints its own
copy (or slice) of every leaf; the fingerprints (8 bytes a leaf a device)
are brought to device 0 of the computation, which calls back once.

Why a primitive whose lowering does the work: under jit a value has global
semantics. ``fingerprint64`` of a replicated ``x`` is one value to XLA, and
an all-gather of a replicated value is a no-op to the partitioner: the
copies could never be told apart. Each device's fingerprint must be a
different *element* of the program, computed from its own buffer in a
manual region, and which slice a device holds is known only after XLA's
partitioner propagated the shardings. ``custom_partitioning``'s
``partition`` rule runs then: it receives every operand's actual sharding
(and asks for no other: nothing is gathered or resharded), fingerprints the
local block, and gives the result one row per device (``P(all mesh
axes)``), distinct elements no pass can fold into one. The lowering, where
the device assignment is known, makes the ``ShardPlacement`` and binds the
host function to it, once per lowering.

Relies on ``jax.experimental.custom_partitioning`` and, through placement.py
and primitive.py, on ``jax._src`` lowering internals (JAX 0.10);
tests/trace/test_fingerprint.py fails loudly if they move.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import core, dispatch
from jax._src.interpreters import mlir
from jax.experimental.custom_partitioning import SdyShardingRule, custom_partitioning
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pmaptap._common.fingerprint import FingerprintSpec, bind_lowering
from pmaptap._common.shard_placement import ShardPlacement
from pmaptap._host.routing import deliver
from pmaptap._trace import placement, primitive
from pmaptap._trace.fphash import fingerprint64_many

fingerprint_p = core.Primitive("pmaptap_fingerprint")
fingerprint_p.multiple_results = True
# The lowering needs the device assignment (ShardingContext.device_assignment).
dispatch.prim_requires_devices_during_lowering.add(fingerprint_p)
primitive.register_tap_rules(fingerprint_p)
# Eager: compiled and run as a one-primitive computation over the arguments'
# devices (their shardings decide the partitioning, as under jit).
fingerprint_p.def_impl(partial(dispatch.apply_primitive, fingerprint_p))


def fingerprint_jit(spec: FingerprintSpec, step: jax.Array, leaves) -> None:
    """Fingerprint ``leaves`` (traced under plain jit, or concrete) on every
    device holding them; the host receives ``(step, fps[n, leaves, 2])``."""
    fingerprint_p.bind(step, *leaves, spec=spec)


def _entry(spec: FingerprintSpec):
    def entry(*arrays) -> None:
        # XLA's callback thread: only hands over (deliver never raises).
        deliver(spec, arrays)

    return entry


def _lowering(ctx, step, *leaves, spec: FingerprintSpec):
    if primitive.recomputed_while_predicate(ctx):
        return []  # a duplicate (see primitive.recomputed_while_predicate)
    place, partitioned, fps_aval, fps = _fingerprints(
        ctx, list(ctx.avals_in[1:]), leaves, replicated=False
    )
    host_fn = _entry(dataclasses.replace(spec, shards=place))
    sub = ctx.replace(avals_in=[ctx.avals_in[0], fps_aval], avals_out=[])
    if not partitioned:
        return primitive._lowering(sub, step, fps, host_fn=host_fn)
    # The fingerprint rows are moved to device 0 for ONE host call.
    return primitive.emit_on_device_0(sub, step, fps, host_fn=host_fn)


def _fingerprints(ctx, leaf_avals: list, leaves, *, replicated: bool):
    """Lower the fingerprints of ``leaves``, one row per partition of the
    computation (one row: a computation on one device). Returns (the
    lowering's placement, whether it is partitioned, the rows' aval, the
    rows). ``replicated``: every device ends up with every row (gathered)
    instead of its own."""
    shapes = tuple(tuple(int(s) for s in a.shape) for a in leaf_avals)
    # The platform this module is lowered for (more than one only for an
    # export to several): the hash then traces only its layout.
    platforms = tuple(getattr(ctx.module_context, "platforms", ()) or ())
    platform = platforms[0] if len(platforms) == 1 else None
    where = placement.shard_context(ctx)
    if where is None:
        place = _one_device(ctx, shapes)
        n, fn = 1, partial(_local, platform=platform)
    else:
        devices, names, sizes = where
        place = ShardPlacement(
            devices=tuple(int(d.id) for d in devices),
            processes=tuple(int(d.process_index) for d in devices),
            axis_names=tuple(placement.display_axis_name(a) for a in names or ()),
            axis_sizes=tuple(sizes or ()),
            shapes=shapes,
            me=jax.process_index(),
        )
        n, fn = (
            len(devices),
            _per_device(place, tuple(devices), leaf_avals, replicated, platform),
        )
    fps_aval = core.ShapedArray((n, len(leaves), 2), jnp.dtype(jnp.uint32))
    sub = ctx.replace(primitive=None, avals_in=leaf_avals, avals_out=[fps_aval])
    (fps,) = mlir.lower_fun(fn, multiple_results=False)(sub, *leaves)
    return place, where is not None, fps_aval, fps


# ------------------------------------------------------------ as step outputs
# Under pmaptap.jit the same rows leave the step as outputs, gathered on
# every device (partition 0's process reads them), padded to a row count
# known at trace time (the partitions are known only when it is lowered),
# with the number of the lowering's bound spec (bind_lowering).
fingerprint_table_p = core.Primitive("pmaptap_fingerprint_table")
fingerprint_table_p.multiple_results = True
dispatch.prim_requires_devices_during_lowering.add(fingerprint_table_p)
fingerprint_table_p.def_impl(partial(dispatch.apply_primitive, fingerprint_table_p))


def fingerprint_table(spec: FingerprintSpec, leaves) -> tuple[jax.Array, jax.Array]:
    """(the lowering's number uint32[], fps uint32[rows, leaves, 2]) of
    ``leaves``: row k is partition k's, ``rows`` is ``jax.device_count()``
    (rows past the lowering's partitions are zeros)."""
    key, table = fingerprint_table_p.bind(*leaves, spec=spec, rows=jax.device_count())
    return key, table


@fingerprint_table_p.def_abstract_eval
def _table_abstract_eval(*leaf_avals, spec: FingerprintSpec, rows: int):
    return [
        core.ShapedArray((), jnp.dtype(jnp.uint32)),
        core.ShapedArray((rows, len(leaf_avals), 2), jnp.dtype(jnp.uint32)),
    ]


def _table_lowering(ctx, *leaves, spec: FingerprintSpec, rows: int):
    place, _, fps_aval, fps = _fingerprints(ctx, list(ctx.avals_in), leaves, replicated=True)
    n = fps_aval.shape[0]
    if n > rows:
        raise ValueError(
            f"pmaptap.fingerprint({spec.name!r}) under pmaptap.jit: the computation "
            f"spans {n} devices, more than jax.device_count() ({rows}), the rows "
            "its fingerprints were given when traced. Use jax.jit for this step."
        )
    key = bind_lowering(dataclasses.replace(spec, shards=place))
    sub = ctx.replace(primitive=None, avals_in=[fps_aval], avals_out=[ctx.avals_out[1]])
    (table,) = mlir.lower_fun(
        lambda f: jnp.pad(f, ((0, rows - n), (0, 0), (0, 0))), multiple_results=False
    )(sub, fps)
    return [mlir.ir_constant(np.uint32(key)), table]


def _local(*leaves, platform: str | None = None):
    """One copy (a computation on one device): its fingerprints, (1, L, 2)."""
    return fingerprint64_many(list(leaves), platform=platform)[None]


def _one_device(ctx, shapes) -> ShardPlacement | None:
    """The placement of a computation on one device (its one copy holds
    every element), or None where the device is not known here."""
    from jax._src import sharding_impls

    axis_context = ctx.module_context.axis_context
    devices = getattr(axis_context, "device_assignment", None)
    if not isinstance(axis_context, sharding_impls.ShardingContext) or not devices:
        return None
    return one_device_placement(devices[0], shapes)


def one_device_placement(device: jax.Device, shapes: tuple) -> ShardPlacement:
    """The placement of one copy on ``device`` holding every element of
    leaves of ``shapes`` (also the host's hash's: _outputs/later.py)."""
    place = ShardPlacement(
        devices=(int(device.id),),
        processes=(int(device.process_index),),
        axis_names=(),
        axis_sizes=(),
        shapes=shapes,
        me=jax.process_index(),
    )
    for j, shape in enumerate(shapes):
        place.slices[j] = (tuple((0, s) for s in shape),)
    return place


def _per_device(
    place: ShardPlacement,
    devices: tuple,
    leaf_avals: list,
    replicated: bool,
    platform: str | None = None,
):
    """The function lowered in place of the fingerprints: one
    ``custom_partitioning`` call whose partitioned form computes each
    device's fingerprints from its own blocks (see the module docstring).
    Made per lowering: its ``partition`` rule fills this lowering's
    ``place``. ``replicated``: the rows are all-gathered in the partitioned
    form (the one tiny collective), so that every device holds every row."""
    n, count = len(devices), len(leaf_avals)

    @custom_partitioning
    def per_device(*leaves):
        # The unpartitioned meaning: every device's row is the value's
        # fingerprint (what one copy gives).
        return jnp.broadcast_to(_local(*leaves, platform=platform), (n, count, 2))

    def partition(mesh, arg_shapes, result_shape):
        shardings = tuple(a.sharding for a in arg_shapes)
        for j, s in enumerate(shardings):
            place.set_sharding(j, s)
        if mesh.empty or math.prod(mesh.shape.values()) != n:
            mesh = Mesh(np.array(devices), ("_pmaptap_partition",))
        axes = tuple(mesh.axis_names)
        out = NamedSharding(mesh, PartitionSpec() if replicated else PartitionSpec(axes))
        masks = [_padding_mask(s, a.shape) for s, a in zip(shardings, arg_shapes)]

        def lower(*blocks):
            valids = [None if m is None else m(b.shape) for b, m in zip(blocks, masks)]
            rows = fingerprint64_many(list(blocks), valids, platform)[None]
            # all_gather over every mesh axis: row-major, the order of the
            # rows of PartitionSpec(axes) above.
            return lax.all_gather(rows, axes, axis=0, tiled=True) if replicated else rows

        return mesh, lower, out, shardings

    def infer(mesh, arg_shapes, result_shape):  # GSPMD's propagation
        if mesh.empty:
            mesh = Mesh(np.array(devices), ("_pmaptap_partition",))
        axes = tuple(mesh.axis_names)
        return NamedSharding(mesh, PartitionSpec() if replicated else PartitionSpec(axes))

    # Shardy's propagation: the operands' dimensions are reductions into
    # the result (whose dimensions are its own), so the rule never asks an
    # operand to change its sharding.
    factors = [tuple(f"l{j}d{i}" for i in range(len(a.shape))) for j, a in enumerate(leaf_avals)]
    rule = SdyShardingRule(
        operand_mappings=tuple(factors),
        result_mappings=(("rows", "leaves", "halves"),),
        reduction_factors=tuple(f for fs in factors for f in fs),
    )
    per_device.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer,
        propagate_user_sharding=lambda mesh, user_shape: user_shape.sharding,
        sharding_rule=rule,
    )
    return per_device


def _padding_mask(sharding, shape: tuple[int, ...]):
    """For an uneven sharding (XLA pads the last tiles), a function of the
    local block's shape giving the elements that lie inside the array, from
    this device's position on the mesh axes that split each dimension; None
    when every tile is whole (or the sharding names no mesh axes)."""
    spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
    if spec is None or mesh is None:
        return None
    dims, uneven = [], False
    for d, size in enumerate(shape):
        axes = spec[d] if d < len(spec) else None
        axes = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
        parts = math.prod(int(mesh.shape[a]) for a in axes)
        uneven |= parts > 1 and size % parts != 0
        dims.append((axes, parts, -(-size // parts) if parts else size))
    if not uneven:
        return None

    def mask(block_shape):
        valid = jnp.ones(block_shape, jnp.bool_)
        for d, (axes, parts, tile) in enumerate(dims):
            if parts <= 1:
                continue
            k = jnp.int32(0)
            for a in axes:
                k = k * int(mesh.shape[a]) + lax.axis_index(a)
            at = lax.broadcasted_iota(jnp.int32, block_shape, d) + k * tile
            valid = valid & (at < shape[d])
        return valid

    return mask


# cacheable=False: the rule needs the caller's name stack.
for _platform in ("cpu", "gpu", "tpu"):
    mlir.register_lowering(fingerprint_p, _lowering, platform=_platform, cacheable=False)
    # cacheable=False: each lowering numbers its own bound spec.
    mlir.register_lowering(
        fingerprint_table_p, _table_lowering, platform=_platform, cacheable=False
    )
