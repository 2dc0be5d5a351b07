"""Where a traced tap runs: mapped axes, and coordinates -> device / process.

Inside ``pmap`` and ``shard_map`` bodies the public API gives only the
*abstract* mesh; the concrete one is public only under ``jax.set_mesh``,
else a local of the JAX frame tracing the body, and this module is the one
place that reaches for it. No exact match: the device is ``None``, never
guessed (docs/architecture.md, "Exact or null placement").
"""

from __future__ import annotations

import re
import sys
from typing import Any

import jax
import numpy as np

from pmaptap._common.shard_placement import PARTITION_AXIS
from pmaptap._common.spec import Placement
from pmaptap._trace.invariant import proven_invariant as proven_invariant
from pmaptap._trace.invariant import same_as as same_as

# The trace-time proof that a value is the same on every device (what a
# replicated tap needs to skip comparing its copies) reads the trace being
# built; it lives in the sibling invariant.py, re-exported here.
from pmaptap._trace.jax_support import DIVERGENT_FLOW, MESH_FRAME_MODULES

# JAX's name for the axis of a pmap called without axis_name. Records show it
# as "pmap" so users do not see an internal identifier.
_PMAP_INTERNAL_AXIS = "_internal_pmap_axis_name"
PMAP_AXIS_DISPLAY = "pmap"
_PMAP_TEMP_AXIS = re.compile(r"<axis 0x[0-9a-f]+>")


def display_axis_name(name: Any) -> str:
    # JAX 0.10 names it _PMAP_INTERNAL_AXIS; 0.9 the text of a temporary
    # axis object, "<axis 0x7f...>", different in every process.
    if name == _PMAP_INTERNAL_AXIS or (isinstance(name, str) and _PMAP_TEMP_AXIS.fullmatch(name)):
        return PMAP_AXIS_DISPLAY
    return str(name)


def mapped_axes() -> tuple[tuple[Any, ...], tuple[int, ...]]:
    """Manual (per-device) axes of the current trace, in mesh order."""
    amesh = jax.sharding.get_abstract_mesh()
    if amesh.empty:
        return (), ()
    manual = set(amesh.manual_axes)
    names = tuple(n for n in amesh.axis_names if n in manual)
    sizes = tuple(int(amesh.shape[n]) for n in names)
    return names, sizes


def _context_mesh():
    """The mesh set by ``jax.set_mesh`` (public while tracing only through the
    private getter; ``jax.sharding.get_mesh`` refuses inside jit)."""
    from jax._src import mesh as mesh_lib

    m = mesh_lib.get_concrete_mesh()
    return None if m is None or m.empty else m


def _frame_meshes():
    """Concrete meshes held by JAX's shard_map frames, innermost first."""
    from jax._src.mesh import Mesh

    out = []
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") in MESH_FRAME_MODULES:
            m = frame.f_locals.get("mesh")
            if isinstance(m, Mesh) and not m.empty:
                out.append(m)
        frame = frame.f_back
    return out


def find_concrete_mesh(names: tuple[Any, ...], sizes: tuple[int, ...]):
    """A concrete mesh whose axes are exactly the given manual axes, or None.

    Requiring an exact match (same axis names, same sizes, no extra axes)
    guarantees that the manual coordinates alone determine the device; with
    extra auto axes (partial-manual shard_map) they do not, and we give up.
    """
    want = dict(zip(names, sizes))
    candidates = []
    ctx = _context_mesh()
    if ctx is not None:
        candidates.append(ctx)
    candidates.extend(_frame_meshes())
    for m in candidates:
        if dict(m.shape) == want:
            return m
    return None


def device_table(
    names: tuple[Any, ...], sizes: tuple[int, ...]
) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """(device ids, process indices) row-major over ``names``, or (None, None)."""
    if not names:
        return None, None
    mesh = find_concrete_mesh(names, sizes)
    if mesh is None:
        return None, None
    # Reorder the mesh's device array to the order of `names` (already the
    # mesh order when taken from the abstract mesh, but be explicit).
    order = [list(mesh.axis_names).index(n) for n in names]
    devs = np.transpose(mesh.devices, order).reshape(-1)
    return (tuple(int(d.id) for d in devs), tuple(int(d.process_index) for d in devs))


def local_copy_count(sizes: tuple[int, ...], processes: tuple[int, ...] | None) -> int:
    """How many per-device copies of one tap execution this process receives."""
    total = int(np.prod(sizes)) if sizes else 1
    if processes is None:
        return max(1, total // max(1, jax.process_count()))
    me = jax.process_index()
    return max(1, sum(1 for p in processes if p == me))


def eager_device(leaves) -> int | None:
    """Device of concrete (non-traced) single-device arrays, else None."""
    dev = None
    for leaf in leaves:
        if isinstance(leaf, jax.core.Tracer) or not isinstance(leaf, jax.Array):
            return None
        devices = leaf.devices()
        if len(devices) != 1:
            return None
        d = next(iter(devices)).id
        if dev is not None and d != dev:
            return None
        dev = d
    return dev


def inside_divergent_control_flow() -> bool:
    """True while tracing a cond/switch branch or a while_loop body/cond."""
    frame = sys._getframe(1)
    while frame is not None:
        mod = frame.f_globals.get("__name__")
        for m, fn in DIVERGENT_FLOW:
            if mod == m and (fn is None or frame.f_code.co_name == fn):
                return True
        frame = frame.f_back
    return False


def every_due(step: Any, every: int) -> Any:
    """The on-device predicate of ``every``: ``step % every == 0``, decided
    alike on every device of the tap's mapped axes. The emission that
    ``every`` guards may hold a collective (a gather to the leader, a
    fingerprint's all-gather), which deadlocks if only some devices run it,
    so under mapped axes the decision is made on the smallest step among
    them (one pmin), unless the step is provably the same everywhere (a
    loop counter, a constant). Inside divergent control flow the emission
    holds no collective, so each device decides on its own step there (and
    a pmin would itself be a collective that only some devices reach)."""
    names, _ = mapped_axes()
    if names and not inside_divergent_control_flow() and not proven_invariant([step], names):
        step = jax.lax.pmin(step, names)
    return step % every == 0


def leader_mask(processes: tuple[int, ...] | None, n: int) -> np.ndarray | None:
    """For each flat coordinate, whether it is the first one of its process
    (the device that calls back for the whole process), or None if unknown."""
    if processes is None:
        if jax.process_count() > 1:
            return None
        processes = (0,) * n
    seen: set[int] = set()
    mask = np.zeros(n, dtype=bool)
    for i, p in enumerate(processes):
        if p not in seen:
            seen.add(p)
            mask[i] = True
    return mask


def current(leaves) -> tuple[Placement, tuple[Any, ...]]:
    """The placement of a tap traced now, and the raw (JAX) names of its
    manual axes (what ``lax.axis_index`` and collectives take)."""
    names, sizes = mapped_axes()
    ids, procs = device_table(names, sizes)
    return Placement(
        axis_names=tuple(display_axis_name(n) for n in names),
        axis_sizes=sizes,
        device_ids=ids,
        device_processes=procs,
        local_copies=local_copy_count(sizes, procs),
        eager_device=None if names else eager_device(leaves),
    ), names


# ---------------------------------------------------------------- shards
# Per-shard taps under plain jit (GSPMD / explicit axes) are lowered by
# _trace/shardcall.py; what that lowering needs from JAX's internals is here:
# the computation's device assignment and abstract mesh (from the lowering
# context), the compile-time sharding of an operand (JAX's "InspectSharding"
# custom call, as jax.debug.inspect_array_sharding uses), and an operand
# that gives each device its own partition number.


def shard_context(ctx) -> tuple[tuple, tuple | None, tuple | None] | None:
    """(devices, mesh axis names, mesh axis sizes) of an automatically
    partitioned computation over more than one device, or None (single
    device, inside shard_map/pmap, or no partitioning at all). The mesh is
    None when JAX lowers without one (then records carry no coordinates)."""
    from jax._src import sharding_impls

    axis_context = ctx.module_context.axis_context
    if not isinstance(axis_context, sharding_impls.ShardingContext):
        return None
    devices = axis_context.device_assignment
    if devices is None or len(devices) < 2:
        return None
    am = axis_context.abstract_mesh
    if am is None or am.empty or int(np.prod(am.axis_sizes)) != len(devices):
        return tuple(devices), None, None
    # JAX's own reading of the device assignment against the mesh (as in
    # inspect_array_sharding's lowering): row-major over the mesh axes.
    return tuple(devices), tuple(am.axis_names), tuple(int(s) for s in am.axis_sizes)


def inspect_operand_sharding(ctx, value, devices: tuple, callback) -> None:
    """Ask XLA for ``value``'s sharding once the SPMD partitioner has chosen
    it: ``callback(sharding)`` runs at compile time with a ``Sharding`` over
    ``devices`` (never at run time; not at all when the executable comes
    from a compilation cache)."""
    from jax._src import sharding_impls
    from jax._src.interpreters import mlir
    from jax._src.lib import xla_client as xc
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import hlo

    def on_hlo_sharding(hlo_sharding) -> None:
        callback(sharding_impls.GSPMDSharding(devices, hlo_sharding))

    key = xc.encode_inspect_sharding_callback(on_hlo_sharding)
    ctx.module_context.add_keepalive(on_hlo_sharding)
    hlo.CustomCallOp(
        [value.type],
        [value],
        call_target_name=ir.StringAttr.get("InspectSharding"),
        has_side_effect=ir.BoolAttr.get(True),
        api_version=mlir.i32_attr(1),
        called_computations=ir.ArrayAttr.get([]),
        backend_config=ir.StringAttr.get(key),
        operand_layouts=None,
        result_layouts=None,
    )


def _ir_types(ctx, aval) -> tuple:
    """``mlir.aval_to_ir_types``: JAX 0.10 added the module context as its
    first argument; 0.9 takes the aval alone."""
    import inspect

    from jax._src.interpreters import mlir

    if len(inspect.signature(mlir.aval_to_ir_types).parameters) >= 2:
        return mlir.aval_to_ir_types(ctx.module_context, aval)
    return mlir.aval_to_ir_types(aval)


def partition_ids(ctx, devices: tuple):
    """An ``iota(len(devices))`` operand tiled over every device of the
    computation: a partitioned callback's shard of it is ``[k]`` on
    ``devices[k]``. This is how each callback learns its device exactly
    (XLA's partition-id cannot be used outside manual regions). Returns
    (ir value, its aval)."""
    import jax.numpy as jnp
    from jax._src import core
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir.dialects import hlo

    n = len(devices)
    aval = core.ShapedArray((n,), jnp.dtype(jnp.uint32))
    (ty,) = _ir_types(ctx, aval)
    iota = hlo.IotaOp(ty, mlir.i64_attr(0)).result
    return split_rows(ctx, iota, aval, devices), aval


def split_rows(ctx, value, aval, devices: tuple):
    """``value`` constrained to hold row k (of its first axis, one row per
    device) on ``devices[k]``, its other axes whole."""
    from jax._src import config
    from jax._src.interpreters import mlir
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    sharding = NamedSharding(
        Mesh(np.array(devices), (PARTITION_AXIS,)), PartitionSpec(PARTITION_AXIS)
    )
    rank = len(aval.shape)
    if config.use_shardy_partitioner.value:
        proto = sharding._to_sdy_sharding(rank)
    else:
        proto = sharding._to_xla_hlo_sharding(rank).to_proto()
    return mlir.wrap_with_sharding_op(ctx, value, aval, proto)


def replicated(ctx, value, aval, devices: tuple):
    """``value`` constrained to be replicated on every device of the
    computation: a scalar tap's operand in a partitioned callback, so each
    device's copy is the whole value (already so for a 0-d value, which no
    sharding splits; a vmapped scalar's batch axis might be split, and is
    then gathered, as the non-partitioned callback would)."""
    from jax._src import config
    from jax._src.interpreters import mlir
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    sharding = NamedSharding(Mesh(np.array(devices), (PARTITION_AXIS,)), PartitionSpec())
    if config.use_shardy_partitioner.value:
        proto = sharding._to_sdy_sharding(len(aval.shape))
    else:
        proto = sharding._to_xla_hlo_sharding(len(aval.shape)).to_proto()
    return mlir.wrap_with_sharding_op(ctx, value, aval, proto)


def check_shard_internals() -> None:
    """Raise if a JAX upgrade moved what the per-shard lowering reads (run by
    tests/trace/test_sharded_jit.py, so it fails there, loudly): what
    jax_support's inventory of module-level names does not see."""
    import inspect

    from jax._src import callback, sharding_impls
    from jax._src.lib import xla_client as xc
    from jax._src.lib.mlir.dialects import hlo

    missing = []
    for owner, name in (
        (xc, "encode_inspect_sharding_callback"),
        (hlo, "IotaOp"),
        (hlo, "CustomCallOp"),
    ):
        if not hasattr(owner, name):
            missing.append(f"{owner.__name__}.{name}")
    ctx_fields = inspect.signature(sharding_impls.ShardingContext).parameters
    for f in ("device_assignment", "abstract_mesh"):
        if f not in ctx_fields:
            missing.append(f"ShardingContext.{f}")
    params = inspect.signature(callback.emit_python_callback).parameters
    if "partitioned" not in params:
        missing.append("emit_python_callback(partitioned=)")
    if missing:
        raise RuntimeError(
            "pmaptap's per-shard taps rely on JAX internals that "
            "this JAX does not have: " + ", ".join(missing)
        )
