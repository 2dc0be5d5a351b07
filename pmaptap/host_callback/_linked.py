"""``linked_tap``: the host callback behind ``id_tap``/``id_print``. Unlike
``pmaptap.tap``'s primitive it has an output, a token (``int32[]``) that
exists only once the host function has been called, so the value ``id_tap``
returns can be tied to it (see ``tie``) and the taps of one device run in the
order the program's data flow gives them, inside loops and conds too. That is
the old module's promise ("executed before the returned value is used"); it
costs a 4-byte result per callback and an ``optimization_barrier``, which is
why ``pmaptap.tap`` does not pay it (benchmarks/bench_taps.py measures both).

The two other transformation rules are the old module's as well, and differ
from ``pmaptap.tap`` on purpose:

- vmap: one callback with the whole batch; a batched argument gets its batch
  axis at position 0, an unbatched one travels unchanged, and each vmap level
  appends the per-argument batch dims (``None`` for unbatched) to
  ``batch_dims`` (innermost level first).
- ``jax.checkpoint``: the callback is in both the forward computation and the
  rematerialized one, so under ``grad`` it runs twice, as the old module's
  documentation says; ``pmaptap.tap`` runs once.

Like primitive.py this reads ``jax._src`` (JAX 0.10); tests/test_host_callback*
fail loudly if an upgrade breaks it.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import callback as cb
from jax._src import core, debugging
from jax._src.interpreters import ad, batching, mlir
from jax._src.interpreters import partial_eval as pe

from pmaptap._trace import primitive

linked_tap_p = core.Primitive("pmaptap_hcb_tap")
linked_tap_p.multiple_results = True

_TOKEN_AVAL = core.ShapedArray((), np.int32)
_TOKEN = np.zeros((), np.int32)

# host_fn(batch_dims, coords, *arrays): batch_dims holds one tuple per vmap
# level (innermost first), with 0 or None per array.
HostFn = Callable[..., None]


def linked_tap(host_fn: HostFn, coords: Any, leaves: Sequence[Any]) -> jax.Array:
    """Bind the primitive; returns the token (``int32[]``)."""
    (tok,) = linked_tap_p.bind(coords, *leaves, host_fn=host_fn, batch_dims=())
    return tok


def tie(value: Any, token: jax.Array) -> Any:
    """``value`` with every array leaf made to depend on ``token``, so nothing
    that uses the result can run before the host callback has run.

    Why XOR with the token (always 0, but XLA cannot know): XLA's CPU
    pipeline drops an ``optimization_barrier`` whose second output is unused
    before it schedules, and the taps were seen to run out of order with one.
    The XOR is one elementwise pass that fuses into the value's consumers; a
    ``custom_jvp`` makes it an identity for derivatives."""
    leaves, treedef = jax.tree_util.tree_flatten(value)
    idx = [
        i
        for i, x in enumerate(leaves)
        if isinstance(x, (jax.Array, core.Tracer, np.ndarray, np.generic))
        and np.size(x) > 0
        and jnp.dtype(x.dtype).kind in "biufc"
    ]
    if not idx:
        return value
    tied = _tie_leaves(token, *[leaves[i] for i in idx])
    for i, x in zip(idx, tied):
        leaves[i] = x
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _xor_token(x: jax.Array, token: jax.Array) -> jax.Array:
    x = jnp.asarray(x)
    kind = jnp.dtype(x.dtype).kind
    if kind == "b":
        return jnp.logical_xor(x, token != 0)
    if kind == "c":
        return lax.complex(_xor_token(x.real, token), _xor_token(x.imag, token))
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[x.dtype.itemsize]
    bits = lax.bitcast_convert_type(x, width) if x.dtype != width else x
    bits = bits ^ token.astype(width)
    return lax.bitcast_convert_type(bits, x.dtype) if x.dtype != width else bits


@jax.custom_jvp
def _tie_leaves(token, *leaves):
    return tuple(_xor_token(x, token) for x in leaves)


@_tie_leaves.defjvp
def _tie_jvp(primals, tangents):
    token, *leaves = primals
    return _tie_leaves(token, *leaves), tuple(tangents[1:])


@linked_tap_p.def_impl
def _impl(coords, *args, host_fn, batch_dims):
    # Eager: the caller's thread, concrete values.
    host_fn(batch_dims, np.asarray(coords), *[np.asarray(a) for a in args])
    return [jax.numpy.asarray(_TOKEN)]


@linked_tap_p.def_effectful_abstract_eval
def _abstract_eval(*avals, host_fn, batch_dims):
    del avals, host_fn, batch_dims
    # debug_effect: allowed wherever debug_callback is (custom_jvp/vjp, cond,
    # while, scan, checkpoint, pmap, shard_map), which keeps the jaxprs
    # acceptable to JAX's checker (jax_enable_checks).
    return [_TOKEN_AVAL], {debugging.debug_effect}


def _batch(args, dims, *, host_fn, batch_dims):
    coords, *leaves = args
    cdim, *ldims = dims
    if cdim is not None:
        # Coordinates never depend on a vmapped value; keep one copy.
        coords = lax.index_in_dim(coords, 0, cdim, keepdims=False)
    moved = [x if d is None else jax.numpy.moveaxis(x, d, 0) for x, d in zip(leaves, ldims)]
    level = tuple(None if d is None else 0 for d in ldims)
    out = linked_tap_p.bind(coords, *moved, host_fn=host_fn, batch_dims=batch_dims + (level,))
    return out, [None]


batching.primitive_batchers[linked_tap_p] = _batch


def _jvp(primals, tangents, **params):
    # id_tap stops gradients before binding, so this only runs if someone
    # binds the primitive with a live tangent: the token has no derivative.
    del tangents
    out = linked_tap_p.bind(*primals, **params)
    return out, [ad.Zero.from_primal_value(t) for t in out]


ad.primitive_jvps[linked_tap_p] = _jvp
ad.primitive_transposes[linked_tap_p] = lambda _, *args, **params: [None] * len(args)


def _remat_rule(saveable, unks_in, inst_in, eqn):
    """Partial eval under ``jax.checkpoint``: known inputs (the usual case,
    arguments are primal values) put the callback in the forward jaxpr AND in
    the rematerialized one, so it runs again when residuals are recomputed,
    like the old module. Unknown inputs: only the staged one."""
    del saveable
    if any(unks_in):
        res = [v for v, inst in zip(eqn.invars, inst_in) if not inst]
        return None, eqn, [True], [True], res
    return eqn, eqn, [False], [True], []


pe.partial_eval_jaxpr_custom_rules[linked_tap_p] = _remat_rule


def _lowering(ctx, *args, host_fn, batch_dims):
    if primitive.recomputed_while_predicate(ctx):
        # The second evaluation of a batched while predicate: the callback
        # already ran for these values in the loop's condition. The token is
        # 0 either way.
        return [mlir.ir_constant(_TOKEN)]

    def run(coords, *flat):
        # XLA's buffers are valid during the call only: copy.
        host_fn(batch_dims, np.array(coords, copy=True), *[np.array(a, copy=True) for a in flat])
        return (_TOKEN,)

    sharding = cb._callback_op_sharding(ctx.module_context.axis_context, None, ctx.avals_out)
    result, _, _ = cb.emit_python_callback(
        ctx,
        run,
        None,
        list(args),
        ctx.avals_in,
        ctx.avals_out,
        has_side_effect=True,
        returns_token=False,
        sharding=sharding,
    )
    return result


# cacheable=False: the rule needs the caller's name stack.
mlir.register_lowering(linked_tap_p, _lowering, cacheable=False)
