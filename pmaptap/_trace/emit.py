"""The one place in pmaptap that emits a JAX host callback.

Everything traced (``tap``, ``tap_grad``, the host_callback shims) ends here:
``emit`` for values that only travel to the host, ``emit_call`` for the one
case where the host must answer with a value (``host_callback.call``).
The callback itself only hands the arrays to the active pipeline (see
``routing.deliver``) and returns: XLA's callback thread holds the GIL and
blocks its device, and converting or encoding there was seen to hang.

Why ``hostcall.host_call``: it has ``jax.debug.callback``'s semantics (allowed
under ``grad``, where it sees primals, ``scan``/``cond``/``while``,
``checkpoint``, and once per device inside fully manual ``shard_map``/``pmap``
bodies) without its ``jax.device_put`` on XLA's callback thread. Why
``custom_vmap`` around it: a plain batching rule unrolls a vmapped callback
into one call per element, in no guaranteed order and with no element index.
Our rule instead emits *one* callback carrying the whole batch, and counts
the vmapped axes in ``TapSpec.batch_dims`` (nested vmaps stack, outermost
first). The wrapper also keeps ``jax.checkpoint`` from replaying the tap
when it recomputes the forward pass (tests/test_hostcall.py shows the bare
primitive is replayed).

The fast path (``layout``). A host callback costs far more than a small
collective (on CPU about 0.3 ms per device callback against ~0.01 ms for an
all_gather of a scalar), so under a mapped axis we avoid one callback per
device:

- "gathered": ``all_gather`` the copies over the manual axes; only the first
  device of each process (its *leader*) calls back, with every copy stacked
  on axis 0 in row-major coordinate order. Used for per_device/auto taps
  whose gathered size is at most ``gather_max_bytes``.
  Several leaves (a pytree, or all members of a ``group``) are packed into
  one uint8 vector so they cost ONE collective. Small replicated taps use it
  too: gathering the values is as cheap as gathering hashes.
- "verified": replicated taps above ``gather_max_bytes`` gather a 64-bit hash
  of each copy's bits; if all agree, the leader sends its one copy; if not,
  the full copies are gathered so every distinct value can be written.
  "verified_off" (``verify_replicated=False``): the leader's copy.
- "copy": one callback per device (payloads too big to gather, placement
  unknown in a multi-process job, or a tap traced inside ``cond``/``switch``/
  ``while_loop``, where devices may diverge and a collective that only some
  of them reach would deadlock).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import core as _core
from jax._src.interpreters import batching as _batching
from jax.custom_batching import custom_vmap
from jax.experimental import io_callback

from pmaptap._trace import placement
from pmaptap._trace.primitive import host_call
from pmaptap._trace.options import options
from pmaptap._host.routing import deliver
from pmaptap._trace.spec import TapSpec


def _host_entry(spec: TapSpec, *arrays) -> None:
    # Runs on XLA's callback thread. `deliver` never raises.
    deliver(spec, arrays)


def _callback(spec: TapSpec, *args) -> None:
    host_call(functools.partial(_host_entry, spec), *args)


def _bits(x: jax.Array) -> jax.Array:
    """``x``'s bits as unsigned integers of its own width (bool as uint8),
    ready to bitcast on; complex dtypes are not taken."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint8)
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
            w = jnp.stack([(w & 0xFFFFFFFF).astype(jnp.uint32),
                           (w >> 32).astype(jnp.uint32)], -1)
        w = w.astype(jnp.uint32).reshape(-1)
        pos = jnp.arange(w.size, dtype=jnp.uint32)
        m1 = pos * jnp.uint32(0x9E3779B1) + jnp.uint32(2 * i + 1)
        m2 = pos * jnp.uint32(0x85EBCA77) + jnp.uint32(0xC2B2AE3D + i)
        acc = acc + jnp.stack([jnp.sum(w * (m1 | 1)), jnp.sum((w ^ m2) * (m2 | 1))])
        acc = acc + jnp.uint32(w.size)
    return acc


def _gather_packed(leaves: Sequence[jax.Array], raw_names: tuple):
    """all_gather several leaves with ONE collective: their bytes are
    concatenated into a uint8 vector (bitcast, so bit-exact). Returns the
    gathered arrays and the packing (dtype, shape per leaf) the host needs to
    split them again; packing is () when the leaves are gathered one by one
    (complex dtypes, which bitcast does not take)."""
    leaves = [jnp.asarray(x) for x in leaves]
    if len(leaves) < 2 or any(jnp.issubdtype(x.dtype, jnp.complexfloating)
                              for x in leaves):
        return [lax.all_gather(x, raw_names) for x in leaves], ()
    parts = [lax.bitcast_convert_type(_bits(x), jnp.uint8).reshape(-1) for x in leaves]
    packed = lax.all_gather(jnp.concatenate(parts), raw_names)
    packing = tuple((jnp.dtype(x.dtype).name, tuple(x.shape)) for x in leaves)
    return [packed], packing


def _flat_index(coords: jax.Array, sizes: Sequence[int]) -> jax.Array:
    flat = jnp.int32(0)
    for i, s in enumerate(sizes):
        flat = flat * s + coords[i]
    return flat


def _is_leader(spec: TapSpec, coords: jax.Array) -> jax.Array:
    """Whether this device calls back for its process (see spec.leaders)."""
    return jnp.asarray(np.array(spec.leaders))[_flat_index(coords, spec.axis_sizes)]


def _emit_now(spec: TapSpec, raw_names: tuple, coords, step, leaves) -> None:
    if spec.layout == "copy":
        _callback(spec, coords, step, *leaves)
        return
    is_leader = _is_leader(spec, coords)

    def gathered():
        stacked, packing = _gather_packed(leaves, raw_names)
        lax.cond(is_leader, lambda: _callback(
            dataclasses.replace(spec, layout="gathered", packing=packing),
            coords, step, *stacked), lambda: None)

    if spec.layout == "gathered":
        gathered()
        return
    if spec.layout == "verified_off":
        lax.cond(is_leader, lambda: _callback(spec, coords, step, *leaves),
                 lambda: None)
        return
    # "verified": the predicate comes from gathered hashes, so it is the same
    # on every device and the collectives inside the branches are safe.
    hashes = lax.all_gather(_hash64(leaves), raw_names)
    agree = jnp.all(hashes == hashes[0])

    def one_copy():
        # Agreement was decided here, on device: the host needs the copy only.
        lax.cond(is_leader, lambda: _callback(spec, coords, step, *leaves),
                 lambda: None)

    lax.cond(agree, one_copy, gathered)


@functools.lru_cache(maxsize=4096)
def _emitter(spec: TapSpec, raw_names: tuple):
    @custom_vmap
    def emit_fn(coords, step, *leaves):
        _emit_now(spec, raw_names, coords, step, leaves)
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
        _emitter(spec.with_batch(), raw_names)(coords, step, *leaves)
        return coords, False

    return emit_fn


def axis_coords(axis_names: Sequence) -> jax.Array:
    """This device's coordinate along each manual axis (int32 vector)."""
    if not axis_names:
        return jnp.zeros((0,), jnp.int32)
    return jnp.stack([lax.axis_index(n).astype(jnp.int32) for n in axis_names])


def _nbytes(leaves: Sequence) -> int:
    return sum(int(np.prod(np.shape(x))) * jnp.dtype(x.dtype).itemsize for x in leaves)


def choose_layout(spec: TapSpec, leaves: Sequence) -> TapSpec:
    """Pick the transport for this tap site (see module docstring)."""
    opts = options()
    if not spec.axis_names or spec.consumer is not None or not opts.gather:
        return spec
    n = spec.total_copies
    if n < 2:
        return spec
    mask = placement.leader_mask(spec.device_processes, n)
    if mask is None or placement.inside_divergent_control_flow():
        return spec
    if spec.dedup == "replicated" and not opts.verify_replicated:
        layout = "verified_off"          # the leader's copy alone
    elif _nbytes(leaves) * n <= opts.gather_max_bytes:
        # Gathering the values themselves is as cheap as gathering hashes
        # when they are small, and needs a single callback.
        layout = "gathered"
    elif spec.dedup == "replicated":
        layout = "verified"
    else:
        return spec
    return dataclasses.replace(spec, layout=layout,
                               leaders=tuple(bool(b) for b in mask))


# ------------------------------------------------------------------ groups
_local = threading.local()


class group(contextlib.ContextDecorator):
    """``with pmaptap.group():`` (or ``@pmaptap.group()``) inside a traced
    step: the taps made directly in the block share ONE host callback per
    process, emitted when the block ends, instead of one each.

    Only taps at the block's own trace level join (a tap inside a nested
    scan/cond/vmap body is emitted on its own as usual), and only those on
    the fast path (mapped axes, small enough to gather). Taps with a traced
    ``step`` and ``every > 1`` join too: those sharing the same step and
    ``every`` are decided by ONE on-device ``step % every == 0`` and share
    one callback, so a logging block costs one never-firing branch on the
    steps it skips, not one per tap. Records are exactly those of separate
    taps.
    """

    def __enter__(self) -> "group":
        self._trace = _core.trace_ctx.trace
        self._members: list[_Member] = []
        _local.__dict__.setdefault("stack", []).append(self)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        _local.stack.pop()
        if exc_type is None:
            _emit_group(self._members)

    def offer(self, spec: TapSpec, raw_names: tuple, leaves, coords, step,
              traced_every: bool = False) -> bool:
        if (_core.trace_ctx.trace is not self._trace or
                isinstance(self._trace, _batching.BatchTrace) or
                spec.layout not in ("gathered", "verified_off")):
            return False
        if spec.layout == "verified_off" and \
                _nbytes(leaves) * spec.total_copies > options().gather_max_bytes:
            return False    # the group gathers every member: only small ones
        if self._members:
            first = self._members[0]
            if first.spec.leaders != spec.leaders or first.raw_names != raw_names:
                return False
        # Members deciding `every` on device are bucketed by (every, step):
        # each bucket gets one cond (see _emit_group).
        bucket = (spec.every, id(step)) if traced_every else None
        self._members.append(_Member(spec, raw_names, list(leaves), coords, step, bucket))
        return True


class _Member(NamedTuple):
    """A tap waiting in a group for the block's end."""
    spec: TapSpec
    raw_names: tuple
    leaves: list
    coords: Any
    step: Any
    bucket: tuple | None       # (every, id(step)) when decided on device


def _current_group() -> "group | None":
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


def _emit_group(members: list[_Member]) -> None:
    buckets: dict[tuple | None, list[_Member]] = {}
    for m in members:
        buckets.setdefault(m.bucket, []).append(m)
    for key, bucket in buckets.items():
        if key is None:
            _emit_members(bucket)
            continue
        every, step = key[0], bucket[0].step
        lax.cond(step % every == 0, lambda b=bucket: _emit_members(b), lambda: None)


def _emit_members(members: list[_Member]) -> None:
    first = members[0]
    if len(members) == 1:
        _emitter(first.spec, first.raw_names)(first.coords, first.step, *first.leaves)
        return
    # Every member is gathered (small by construction), all in ONE packed
    # all_gather: each collective costs ~0.1 ms here, the bytes almost nothing.
    # Members keep their layout: an unverified replicated one ("verified_off")
    # is written from the caller's copy, as it would be alone.
    payload, packing = _gather_packed([x for m in members for x in m.leaves],
                                      first.raw_names)
    # Each member's step travels as its own operand, in its own dtype (a
    # stacked int32 would wrap steps >= 2**31).
    steps = [m.step for m in members]
    gspec = dataclasses.replace(
        first.spec, name="pmaptap/group", layout="group", treedef=None,
        members=tuple(m.spec for m in members),
        member_leaves=tuple(len(m.leaves) for m in members), packing=packing)
    lax.cond(_is_leader(first.spec, first.coords),
             lambda: _callback(gspec, first.coords, *steps, *payload), lambda: None)


def emit(spec: TapSpec, raw_names: tuple, leaves: Sequence[jax.Array],
         coords: jax.Array, step: jax.Array, *, traced_every: bool) -> None:
    """Send ``leaves`` to the host, tagged with ``coords`` and ``step``.

    With ``traced_every`` the decision ``step % every == 0`` is made on the
    device, so skipped steps make no host call (and no collective) at all;
    the step must then be the same on every device, as a loop counter is.
    """
    leaves = [lax.stop_gradient(x) for x in leaves]
    spec = choose_layout(spec, leaves)   # before our own cond below
    g = _current_group()
    if g is not None and g.offer(spec, tuple(raw_names), leaves, coords, step,
                                 traced_every):
        return
    fn = _emitter(spec, tuple(raw_names))
    if traced_every:
        def fire():
            fn(coords, step, *leaves)
        lax.cond(step % spec.every == 0, fire, lambda: None)
    else:
        fn(coords, step, *leaves)


def emit_call(host_fn: Callable[..., Sequence], coords: jax.Array,
              leaves: Sequence[jax.Array],
              result_avals: Sequence[jax.ShapeDtypeStruct], *,
              what: str) -> list[jax.Array]:
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

    Why ``custom_jvp``: JAX cannot differentiate a host function. The rule
    runs only when a non-zero tangent reaches the call, and replaces JAX's
    generic refusal with one that says what to do.
    """
    avals = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in result_avals)

    @jax.custom_jvp
    def call_fn(coords, *leaves):
        return io_callback(host_fn, avals, coords, *leaves, ordered=False)

    @call_fn.defjvp
    def _no_derivative(primals, tangents):
        raise NotImplementedError(
            f"{what}: cannot differentiate through a host call, JAX cannot see "
            "inside the host function. If no gradient should flow through it, "
            "wrap its argument in jax.lax.stop_gradient(...); otherwise give it "
            "a derivative with jax.custom_vjp (e.g. a second host call that "
            "computes the VJP on the host).")

    return list(call_fn(coords, *leaves))
