"""Transport layouts: how the copies of one tap execution travel from the
devices to the host (gathered, verified, verified_off, proven, copy: each
drawn in docs/architecture.md, "From pmaptap.tap to the file", step 3), and
the vmap-aware emitter that sends one payload.

Why the leader layouts: a host callback costs far more than a small
collective (docs/performance.md), so under a mapped axis one device per
process calls back with every copy. "copy" (one callback per device) is
left for payloads too big to gather, a placement unknown in a multi-process
job, and taps inside ``cond``/``switch``/``while_loop``, where a collective
only some devices reach would deadlock.

Why ``custom_vmap`` around the callback: a plain batching rule unrolls a
vmapped callback into one call per element, in no guaranteed order and with
no element index; our rule emits *one* callback with the whole batch and
counts the vmapped axes in ``TapSpec.batch_dims`` (outermost first). It
also keeps ``jax.checkpoint`` from replaying the tap
(tests/trace/test_primitive.py shows the bare primitive is replayed).

The callback only hands the arrays to ``routing.deliver`` and returns: XLA's
callback thread holds the GIL and blocks its device, and converting or
encoding there was seen to hang.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_batching import custom_vmap

from pmaptap._common.spec import GroupSpec, Layout, PayloadSpec, TapSpec
from pmaptap._host.routing import deliver
from pmaptap._trace import placement
from pmaptap._trace.options import options
from pmaptap._trace.primitive import emit_callback, mark_tap_vmap_rule
from pmaptap._trace.shardcall import shard_call


def static_step_operand(step: int) -> jax.Array:
    """The operand that carries a step known at trace time: int32 when it
    fits, else its (high, low) 32-bit halves as uint32[2] (joined back by the
    aggregator), so steps up to 2**63-1 travel without jax_enable_x64."""
    if step < 2**31:
        return jnp.asarray(step, jnp.int32)
    return jnp.asarray(np.array([step >> 32, step & 0xFFFFFFFF], np.uint32))


def _host_entry(spec: PayloadSpec, *arrays) -> None:
    # Runs on XLA's callback thread: only hands over (`deliver` never raises).
    # Narrowing sub-byte leaves and joining split steps is the aggregator's.
    deliver(spec, arrays)


def _narrow(args: Sequence, skip: Sequence[bool] = ()) -> tuple[tuple, tuple]:
    """(args with sub-byte ones widened, their (index, dtype) to restore)."""
    restore = tuple(
        (i, np.dtype(a.dtype))
        for i, a in enumerate(args)
        if _sub_byte(a.dtype) and not (i < len(skip) and skip[i])
    )
    if restore:
        args = tuple(_wire(a) for a in args)
    return tuple(args), restore


def send_payload(spec: PayloadSpec, *args) -> None:
    # Sub-byte operands travel widened (see _wire) and are narrowed back on
    # the host, so records and host_callback functions see their own dtype.
    args, restore = _narrow(args)
    if restore:
        spec = (
            spec.with_transport(restore=restore)
            if isinstance(spec, TapSpec)
            else dataclasses.replace(spec, restore=restore)
        )
    emit_callback(functools.partial(_host_entry, spec), *args)


def _sub_byte(dtype) -> bool:
    """int2/int4/uint2/uint4/float4_e2m1fn/float6_*: XLA packs them below a
    byte, NumPy keeps one per byte. XLA's CPU runtime has no all-gather for
    some (int2: UNIMPLEMENTED) and was seen to hand a host callback zeros
    for several float4 operands, so they never cross a collective or a
    host call as themselves (see _wire)."""
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.iinfo(dtype).bits < 8
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.finfo(dtype).bits < 8
    return False


def _wire(x: jax.Array) -> jax.Array:
    """A sub-byte ``x`` widened exactly to a byte-wide dtype (integers to
    int8/uint8, floats to float32); anything else unchanged."""
    if not _sub_byte(x.dtype):
        return x
    if jnp.issubdtype(x.dtype, jnp.signedinteger):
        return x.astype(jnp.int8)
    if jnp.issubdtype(x.dtype, jnp.integer):
        return x.astype(jnp.uint8)
    return x.astype(jnp.float32)


def _all_gather(x: jax.Array, raw_names: tuple) -> jax.Array:
    if _sub_byte(x.dtype):
        return lax.all_gather(_wire(x), raw_names).astype(x.dtype)
    return lax.all_gather(x, raw_names)


def _bits(x: jax.Array) -> jax.Array:
    """``x``'s bits as unsigned integers of its own width (bool as uint8),
    ready to bitcast on; complex dtypes are not taken. Sub-byte dtypes widen
    exactly first (_wire): injective, which is all the hash needs (they are
    never packed)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint8)
    if _sub_byte(x.dtype):
        return _bits(_wire(x))
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}
    return lax.bitcast_convert_type(x, unsigned[x.dtype.itemsize])


def _hash64(leaves: Sequence[jax.Array]) -> jax.Array:
    """Two 32-bit position-weighted sums of a value's bits (uint32[2]).

    Bit-exact (NaN payloads and -0.0 count), cheap (one multiply-add pass),
    and order-sensitive. Two copies that differ collide with probability
    about 2**-64 for random differences."""
    acc = jnp.zeros((2,), jnp.uint32)
    for i, x in enumerate(leaves):
        x = jnp.asarray(x)
        if jnp.issubdtype(x.dtype, jnp.complexfloating):
            x = jnp.stack([x.real, x.imag], -1)
        w = _bits(x)
        if w.dtype == jnp.uint64:
            w = jnp.stack([(w & 0xFFFFFFFF).astype(jnp.uint32), (w >> 32).astype(jnp.uint32)], -1)
        w = w.astype(jnp.uint32).reshape(-1)
        pos = jnp.arange(w.size, dtype=jnp.uint32)
        m1 = pos * jnp.uint32(0x9E3779B1) + jnp.uint32(2 * i + 1)
        m2 = pos * jnp.uint32(0x85EBCA77) + jnp.uint32(0xC2B2AE3D + i)
        acc = acc + jnp.stack([jnp.sum(w * (m1 | 1)), jnp.sum((w ^ m2) * (m2 | 1))])
        acc = acc + jnp.uint32(w.size)
    return acc


def gather_packed(leaves: Sequence[jax.Array], raw_names: tuple):
    """all_gather several leaves with ONE collective: their bytes are
    concatenated into a uint8 vector (bitcast, so bit-exact). Returns the
    gathered arrays and the packing (dtype, shape per leaf) the host needs to
    split them again; packing is () when the leaves are gathered one by one
    (complex and sub-byte dtypes, which bitcast does not take)."""
    leaves = [jnp.asarray(x) for x in leaves]
    if len(leaves) < 2 or any(
        jnp.issubdtype(x.dtype, jnp.complexfloating) or _sub_byte(x.dtype) for x in leaves
    ):
        return [_all_gather(x, raw_names) for x in leaves], ()
    parts = [lax.bitcast_convert_type(_bits(x), jnp.uint8).reshape(-1) for x in leaves]
    packed = lax.all_gather(jnp.concatenate(parts), raw_names)
    packing = tuple((jnp.dtype(x.dtype).name, tuple(x.shape)) for x in leaves)
    return [packed], packing


def steps_may_differ(step: Any, raw_names: tuple) -> bool:
    """Whether the user's traced ``step`` may differ between the devices of
    the tap's axes: False when it is proven alike (a loop counter, a pmean).
    Asked where the tap is traced (tap.py sets ``Transport.check_steps``):
    further in, a step known while tracing is a tracer too (grad, vmap and
    the custom_vmap wrappers rebind it)."""
    return bool(raw_names) and not placement.proven_invariant([step], raw_names)


def from_leader_if_steps_alike(
    check: bool, steps: Sequence, raw_names: tuple, from_leader: Callable, each_own: Callable
) -> None:
    """``from_leader()`` (one callback per process, with the leader's steps)
    where ``steps`` are the same on every device of the axes, ``each_own()``
    (every device its own copy and steps) where not. ``check``: they may
    differ (``Transport.check_steps``); then it is decided on device, the
    same predicate everywhere (so the leader path's collectives are safe),
    from ONE all_gather of the steps' bytes."""
    if not check:
        from_leader()
        return
    parts = [lax.bitcast_convert_type(_bits(jnp.asarray(s)), jnp.uint8).reshape(-1) for s in steps]
    got = lax.all_gather(jnp.concatenate(parts), raw_names)
    lax.cond(jnp.all(got == got[0]), from_leader, each_own)


def _flat_index(coords: jax.Array, sizes: Sequence[int]) -> jax.Array:
    flat = jnp.int32(0)
    for i, s in enumerate(sizes):
        flat = flat * s + coords[i]
    return flat


def is_leader(spec: TapSpec, coords: jax.Array) -> jax.Array:
    """Whether this device calls back for its process (see Transport.leaders)."""
    return jnp.asarray(np.array(spec.transport.leaders))[
        _flat_index(coords, spec.placement.axis_sizes)
    ]


def jit_call(
    specs: Sequence[TapSpec], counts: Sequence[int], coords, steps: Sequence, flat: Sequence
) -> None:
    """Emit the taps ``specs`` under plain jit (SHARDS / WHOLE layouts) as
    ONE ``shard_call``: ``steps`` one per spec, ``flat`` every spec's leaves
    in order (``counts[i]`` of spec i). One spec is a single tap's payload, several a group's
    (``GroupSpec``); on a partitioned computation each device makes one call
    with its shard of every member (see shardcall.py)."""
    specs, counts = tuple(specs), tuple(counts)
    as_statistics = tuple(
        bool(s.site.as_statistics and s.site.as_statistics[i])
        for s, n in zip(specs, counts)
        for i in range(n)
    )
    # Leaves sent as statistics arrive as statistics: nothing to restore.
    skip = (False,) * (1 + len(specs)) + as_statistics
    args, restore = _narrow((coords, *steps, *flat), skip)
    m = len(specs)
    shard_call(
        functools.partial(_jit_entry, specs, counts, restore),
        args[0],
        args[1 : 1 + m],
        args[1 + m :],
        members=tuple((n, s.transport.layout is Layout.SHARDS) for s, n in zip(specs, counts)),
        as_statistics=as_statistics,
        batch_dims=specs[0].site.batch_dims,
    )


def _jit_entry(specs: tuple, counts: tuple, restore: tuple, places):
    """The host function of a ``jit_call``, made when it is lowered: the
    payload's spec is bound to that lowering's placements (one per tap) here,
    once, not on XLA's callback thread at every call. Not partitioned
    (``places`` None): one whole copy (the aggregator treats each tap as
    Layout.COPY); partitioned, the payload starts with the partition number."""
    members = specs
    if places is not None:
        members = tuple(dataclasses.replace(s, shards=p) for s, p in zip(specs, places))
    if len(members) == 1:
        spec: PayloadSpec = members[0].with_transport(restore=restore)
    else:
        spec = GroupSpec(
            members=members,
            member_leaves=counts,
            gathered=False,
            restore=restore,
            partitioned=places is not None,
        )
    return functools.partial(_host_entry, spec)


def emit_now(spec: TapSpec, raw_names: tuple, coords, step, leaves) -> None:
    layout = spec.transport.layout
    if layout in (Layout.SHARDS, Layout.WHOLE):
        jit_call((spec,), (len(leaves),), coords, (step,), leaves)
        return
    if layout is Layout.COPY:
        send_payload(spec, coords, step, *leaves)
        return
    from_leader_if_steps_alike(
        spec.transport.check_steps,
        [step],
        raw_names,
        lambda: _from_leader(spec, raw_names, coords, step, leaves),
        lambda: send_payload(spec.with_transport(layout=Layout.COPY), coords, step, *leaves),
    )


def _from_leader(spec: TapSpec, raw_names: tuple, coords, step, leaves) -> None:
    """The leader layouts: one callback per process, with the leader's step."""
    layout = spec.transport.layout
    leader = is_leader(spec, coords)

    def gathered():
        stacked, packing = gather_packed(leaves, raw_names)
        lax.cond(
            leader,
            lambda: send_payload(
                spec.with_transport(layout=Layout.GATHERED, packing=packing), coords, step, *stacked
            ),
            lambda: None,
        )

    def one_copy():
        lax.cond(leader, lambda: send_payload(spec, coords, step, *leaves), lambda: None)

    if layout is Layout.GATHERED:
        gathered()
        return
    if layout in (Layout.VERIFIED_OFF, Layout.PROVEN):
        one_copy()
        return
    # VERIFIED: the predicate comes from gathered hashes, so it is the same
    # on every device and the collectives inside the branches are safe; once
    # the copies agree on device, the host needs one of them only.
    hashes = lax.all_gather(_hash64(leaves), raw_names)
    lax.cond(jnp.all(hashes == hashes[0]), one_copy, gathered)


def emitter(spec: TapSpec, raw_names: tuple):
    """The vmap-aware function that emits ``spec``'s payload. Built anew for
    every emission and not cached: each traced tap has its own spec (its
    ``tap_id``), so a cache could only hit inside one trace (it never did
    over the test suite), and it kept the specs and the host_callback tap
    functions they hold alive for the life of the process."""

    @custom_vmap
    def emit_fn(coords, step, *leaves):
        emit_now(spec, raw_names, coords, step, leaves)
        return coords

    @emit_fn.def_vmap
    @mark_tap_vmap_rule  # a tap's rule (taps of tangents: see primitive.py)
    def _batched(axis_size, in_batched, coords, step, *leaves):
        coords_b, step_b, *leaves_b = in_batched
        if coords_b or step_b:
            raise ValueError(
                f"pmaptap.tap({spec.name!r}): the `step` argument is batched by "
                "vmap; pass a step that is the same for the whole batch (e.g. "
                "tap outside the vmap, or pass a Python int)."
            )
        # Batch axes arrive at position 0. Unbatched leaves are broadcast so
        # every leaf of the record has the same leading batch axes.
        leaves = [
            x if b else jnp.broadcast_to(x, (axis_size,) + x.shape)
            for x, b in zip(leaves, leaves_b)
        ]
        emitter(spec.with_batch(), raw_names)(coords, step, *leaves)
        return coords, False

    return emit_fn


def nbytes(leaves: Sequence) -> int:
    return sum(int(np.prod(np.shape(x))) * jnp.dtype(x.dtype).itemsize for x in leaves)


def choose_layout(spec: TapSpec, leaves: Sequence, raw_names: Sequence = ()) -> TapSpec:
    """Pick the transport for this tap site (see module docstring).
    ``raw_names``: the JAX names of the manual axes (what the proof of
    replication checks collectives against)."""
    opts = options()
    where = spec.placement
    if not where.axis_names or not opts.gather:
        return spec
    n = where.total_copies
    if n < 2:
        return spec
    mask = placement.leader_mask(where.device_processes, n)
    if mask is None or placement.inside_divergent_control_flow():
        return spec
    dedup = spec.site.dedup
    if dedup == "replicated" and not opts.verify_replicated:
        layout = Layout.VERIFIED_OFF  # the leader's copy alone, said unverified
    elif (
        dedup != "per_device"
        and opts.prove_replicated
        and placement.proven_invariant(leaves, tuple(raw_names))
    ):
        # Replicated by construction: an auto tap ("replicated if the
        # copies agree") is then replicated too, and written as one.
        layout = Layout.PROVEN
    elif nbytes(leaves) * n <= opts.gather_max_bytes:
        # Gathering the values themselves is as cheap as gathering hashes
        # when they are small, and needs a single callback.
        layout = Layout.GATHERED
    elif dedup == "replicated":
        layout = Layout.VERIFIED
    else:
        return spec
    return spec.with_transport(layout=layout, leaders=tuple(bool(b) for b in mask))
