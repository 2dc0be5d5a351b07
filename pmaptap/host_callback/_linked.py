"""``linked_tap``: the host callback behind ``id_tap``/``id_print``, one
primitive that, like the old module's, is the identity on the values it
carries: the tapped leaves (sent to the host) and, with ``id_tap(...,
result=...)``, the leaves of ``result`` (passed through unsent).

Program order. Its lowering makes every returned leaf depend on the host
call (an XOR with a token, ``int32`` 0, the callback returns), so nothing
that uses the value ``id_tap`` returns runs before the callback, and the taps
of one device run in the order the program's data flow gives them, inside
loops and conds too: the old module's promise ("executed before the returned
value is used"). That costs a 4-byte result per callback and one fused
elementwise pass, which is why ``pmaptap.tap`` does not pay it
(benchmarks/bench_host_callback.py).

Transformation rules, the old module's, different from ``pmaptap.tap`` on
purpose:

- jvp: the primal values are tapped, tangents pass through (taps see primal
  values; derivatives of the identity are the identity).
- transpose: the primitive only appears in the linear part of a program when
  it taps a tangent (an ``id_tap`` of a tangent inside a ``jax.custom_jvp``
  rule, under grad/vjp/linearize). Reverse mode then taps the cotangents of
  the tapped leaves, with ``("transpose",)`` appended to the transforms;
  applied forward (``jax.linearize``'s function) it taps the tangent itself.
- vmap: one callback with the whole batch; a batched argument gets its batch
  axis at position 0, an unbatched one travels unchanged, and each vmap level
  appends the per-argument batch dims (``None`` for unbatched).
- ``jax.checkpoint``: the callback is in both the forward computation and the
  rematerialized one, so under ``grad`` it runs twice, as the old module's
  documentation says; ``pmaptap.tap`` runs once.
- a batched ``while_loop`` predicate is lowered twice by JAX; the second copy
  emits no callback (primitive.recomputed_while_predicate).

Like primitive.py this reads ``jax._src`` (JAX 0.10); tests/test_host_callback*
and tests/test_while_predicate.py fail loudly if an upgrade breaks it.
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

# host_fn(transforms, coords, *arrays): transforms in the order they were
# applied, each ("batch", dims) (one 0 or None per array) or ("transpose",);
# hashable, as primitive parameters must be. The consumer unpacks them.
HostFn = Callable[..., None]


def linked_tap(
    host_fn: HostFn, coords: Any, tapped: Sequence[Any], passed: Sequence[Any] = ()
) -> tuple[list, list]:
    """Bind the primitive: ``host_fn`` gets ``tapped``; returns
    ``(tapped, passed)``, the same values, tied to the host call."""
    outs = linked_tap_p.bind(
        coords, *tapped, *passed, host_fn=host_fn, transforms=(), ntap=len(tapped)
    )
    return list(outs[: len(tapped)]), list(outs[len(tapped) :])


def can_tie(x: Any) -> bool:
    """Whether the XOR tie applies to this value (numeric, not empty)."""
    return (
        isinstance(x, (jax.Array, core.Tracer, np.ndarray, np.generic))
        and np.size(x) > 0
        and jnp.dtype(x.dtype).kind in "biufc"
    )


def _xor_token(x: jax.Array, token: jax.Array) -> jax.Array:
    """``x`` bit for bit, but computed from ``token`` (always 0; XLA cannot
    know). Why not an ``optimization_barrier``: XLA's CPU pipeline drops one
    whose second output is unused before it schedules, and taps were seen
    to run out of order with it."""
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


@linked_tap_p.def_impl
def _impl(coords, *args, host_fn, transforms, ntap):
    # Eager: the caller's thread, concrete values; nothing to order.
    host_fn(transforms, np.asarray(coords), *[np.asarray(a) for a in args[:ntap]])
    return list(args)


@linked_tap_p.def_effectful_abstract_eval
def _abstract_eval(coords, *avals, host_fn, transforms, ntap):
    del coords, host_fn, transforms, ntap
    # debug_effect: allowed wherever debug_callback is (custom_jvp/vjp, cond,
    # while, scan, checkpoint, pmap, shard_map), which keeps the jaxprs
    # acceptable to JAX's checker (jax_enable_checks).
    return list(avals), {debugging.debug_effect}


def _jvp(primals, tangents, **params):
    # Taps see primal values; the identity's tangents are its input tangents.
    return linked_tap_p.bind(*primals, **params), list(tangents[1:])


def _transpose(cts, coords, *args, host_fn, transforms, ntap):
    """Reached only when a tapped leaf is a tangent (see the module doc):
    tap the cotangents of the tapped leaves; passed leaves' cotangents pass
    through. Leaves that are not linear (primal values tapped beside a
    tangent) get no cotangent. If the tap's result is not used, its
    cotangent is a symbolic zero and nothing is tapped, as the old module
    had no effect then ("at least one of the returned values must be
    used")."""
    tap_cts, pass_cts = list(cts[:ntap]), list(cts[ntap:])
    linear = any(ad.is_undefined_primal(a) for a in args[:ntap])
    if linear and not all(type(ct) is ad.Zero for ct in tap_cts):
        tap_cts = linked_tap_p.bind(
            coords,
            *[ad.instantiate_zeros(ct) for ct in tap_cts],
            host_fn=host_fn,
            transforms=transforms + (("transpose",),),
            ntap=ntap,
        )
    outs = [*tap_cts, *pass_cts]
    return [None] + [ct if ad.is_undefined_primal(a) else None for ct, a in zip(outs, args)]


def _batched_args(args, dims):
    """(coords, leaves with their batch axis first, this level's dims)."""
    coords, *leaves = args
    cdim, *ldims = dims
    if cdim is not None:
        # Coordinates never depend on a vmapped value; keep one copy.
        coords = lax.index_in_dim(coords, 0, cdim, keepdims=False)
    moved = [x if d is None else jax.numpy.moveaxis(x, d, 0) for x, d in zip(leaves, ldims)]
    return coords, moved, tuple(None if d is None else 0 for d in ldims)


def _batch(args, dims, *, host_fn, transforms, ntap):
    coords, moved, level = _batched_args(args, dims)
    out = linked_tap_p.bind(
        coords,
        *moved,
        host_fn=host_fn,
        transforms=transforms + (("batch", level[:ntap]),),
        ntap=ntap,
    )
    return out, list(level)


ad.primitive_jvps[linked_tap_p] = _jvp
ad.primitive_transposes[linked_tap_p] = _transpose
batching.primitive_batchers[linked_tap_p] = _batch


def _remat_rule(saveable, unks_in, inst_in, eqn):
    """Partial eval under ``jax.checkpoint``: known inputs (the usual case,
    arguments are primal values) put the callback in the forward jaxpr AND in
    the rematerialized one, so it runs again when residuals are recomputed,
    like the old module. Unknown inputs: only the staged one."""
    del saveable
    n = len(eqn.outvars)
    if any(unks_in):
        res = [v for v, inst in zip(eqn.invars, inst_in) if not inst]
        return None, eqn, [True] * n, [True] * n, res
    return eqn, eqn, [False] * n, [True] * n, []


pe.partial_eval_jaxpr_custom_rules[linked_tap_p] = _remat_rule


def _emit(ctx, args, host_fn, transforms):
    """The host callback; returns its token. Nothing in the second evaluation
    of a batched while predicate, where the callback already ran for the same
    values in the loop's condition (the token is 0 either way)."""
    if primitive.recomputed_while_predicate(ctx):
        return mlir.ir_constant(_TOKEN)

    def run(coords, *flat):
        # XLA's buffers are valid during the call only: copy.
        host_fn(transforms, np.array(coords, copy=True), *[np.array(a, copy=True) for a in flat])
        return (_TOKEN,)

    avals_in = ctx.avals_in[: len(args)]
    ctx = ctx.replace(avals_in=avals_in, avals_out=[_TOKEN_AVAL])
    sharding = cb._callback_op_sharding(ctx.module_context.axis_context, None, ctx.avals_out)
    (token,), _, _ = cb.emit_python_callback(
        ctx,
        run,
        None,
        list(args),
        avals_in,
        ctx.avals_out,
        has_side_effect=True,
        returns_token=False,
        sharding=sharding,
    )
    return token


def _lowering(ctx, coords, *leaves, host_fn, transforms, ntap):
    token = _emit(ctx, (coords, *leaves[:ntap]), host_fn, transforms)
    outs = []
    for x, aval in zip(leaves, ctx.avals_in[1:]):
        if aval.size and jnp.dtype(aval.dtype).kind in "biufc":
            sub = ctx.replace(primitive=None, avals_in=[aval, _TOKEN_AVAL], avals_out=[aval])
            (x,) = mlir.lower_fun(_xor_token, multiple_results=False)(sub, x, token)
        outs.append(x)
    return outs


# cacheable=False: the rule needs the caller's name stack.
mlir.register_lowering(linked_tap_p, _lowering, cacheable=False)
