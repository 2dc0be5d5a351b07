"""The two primitives behind ``pmaptap.host_callback``: ``linked_tap_p``
(``id_tap``/``id_print``, the identity on what it carries) and
``linked_call_p`` (``call``), and the effect that puts them in program
order. docs/host_callback.md says what they promise; here, why they are so.

- Both carry ``ORDERED``, an ordered, shardable JAX effect of our own, so
  JAX threads one XLA token through every tap, print and call (without it
  XLA's CPU runtime ran eight independent taps as 1, 7, 6, 5, 4, 3, 2, 0).
  JAX refuses other ordered effects on more than one device.
- Every returned leaf is XORed with an ``int32`` 0 the callback returns, so
  nothing using the value runs before the callback (the old module's
  promise). Both ties cost a little per tap, which is why ``pmaptap.tap``
  pays neither.
- A tap or call batched inside a ``while_loop`` *condition* is bound
  unordered: JAX 0.10 lowers an ordered condition inside the body, and with
  a batched predicate that lowering drops the select that stops finished
  elements (wrong values; seen with ``jax.debug.print(ordered=True)``).
- The transformation rules are the old module's, not ``pmaptap.tap``'s:
  tangents pass untapped, a tapped tangent transposes to a tap of the
  cotangent with ``("transpose",)`` appended, vmap sends the whole batch
  with its batch dims, ``jax.checkpoint`` replays the callback.
- ``linked_call_p`` is not ``io_callback`` (its ordered effect is its own,
  so calls would not be ordered with taps; it refuses vmap and
  ``custom_vjp``/``custom_jvp``) nor ``pure_callback`` (dropped when unused,
  may repeat). Under vmap it calls once per element, in order.

Reads ``jax._src`` as primitive.py does; tests/test_host_callback* and
tests/trace/test_while_predicate.py fail loudly if an upgrade breaks it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import callback as cb
from jax._src import core, debugging, dispatch, effects
from jax._src.interpreters import ad, batching, mlir
from jax._src.interpreters import partial_eval as pe

from pmaptap._trace import jax_support, primitive


class _HostCallbackOrder(effects.Effect):
    """The effect of every tap, print and call of ``pmaptap.host_callback``:
    ordered (JAX threads a token through them) and allowed wherever
    ``jax.debug.callback``'s effect is (control flow, custom_jvp/custom_vjp,
    checkpoint, kept by partial eval), which keeps the jaxprs acceptable to
    JAX's checker (``jax_enable_checks``)."""

    def __str__(self) -> str:
        return "pmaptap.host_callback"


ORDERED = _HostCallbackOrder()
for _kind in (
    effects.ordered_effects,
    effects.shardable_ordered_effects,
    effects.lowerable_effects,
    effects.control_flow_allowed_effects,
    effects.custom_derivatives_allowed_effects,
    effects.remat_allowed_effects,
    effects.partial_eval_kept_effects,
):
    _kind.add_type(_HostCallbackOrder)

linked_tap_p = core.Primitive("pmaptap_hcb_tap")
linked_tap_p.multiple_results = True
# "callback" in the name: the replication prover (_trace/invariant.py) treats
# such a primitive's result as a host answer that may differ per device.
linked_call_p = core.Primitive("pmaptap_hcb_call_callback")
linked_call_p.multiple_results = True

_TOKEN_AVAL = core.ShapedArray((), np.int32)
_TOKEN = np.zeros((), np.int32)

# host_fn(transforms, coords, *arrays): transforms in the order they were
# applied, each ("batch", dims) (one 0 or None per array) or ("transpose",);
# hashable, as primitive parameters must be. The consumer unpacks them.
HostFn = Callable[..., None]


def linked_tap(
    host_fn: HostFn,
    coords: Any,
    tapped: Sequence[Any],
    passed: Sequence[Any] = (),
    *,
    ordered: bool = True,
) -> tuple[list, list]:
    """Bind the primitive: ``host_fn`` gets ``tapped``; returns
    ``(tapped, passed)``, the same values, tied to the host call.
    ``ordered=False`` leaves the call out of the program-order chain (only
    benchmarks/bench_host_callback.py uses it, to measure the chain)."""
    outs = linked_tap_p.bind(
        coords,
        *tapped,
        *passed,
        host_fn=host_fn,
        transforms=(),
        ntap=len(tapped),
        ordered=ordered,
    )
    return list(outs[: len(tapped)]), list(outs[len(tapped) :])


def linked_call(
    host_fn: Callable[..., Sequence],
    coords: Any,
    leaves: Sequence[Any],
    result_avals: Sequence[Any],
    *,
    what: str,
) -> list:
    """Run ``host_fn(coords, *leaves)`` on the host, in program order with
    the taps, and return its results (one array per entry of
    ``result_avals``; ``host_fn`` must return exactly those or raise, which
    fails the computation with its message). ``what`` names the call in the
    error raised when something differentiates through it."""
    avals = tuple(core.ShapedArray(tuple(a.shape), a.dtype) for a in result_avals)
    return list(
        linked_call_p.bind(
            coords,
            *leaves,
            host_fn=host_fn,
            result_avals=avals,
            what=what,
            ordered=True,
        )
    )


def after_dispatched() -> None:
    """Called before an eager tap or call runs on the caller's thread: wait
    until the taps and calls of the computations this thread dispatched
    before have run (JAX keeps the last ``ORDERED`` token of each thread).
    XLA's CPU client runs such computations before dispatch returns, so this
    returns at once there; an asynchronous backend would otherwise let the
    eager tap overtake them."""
    token = dispatch.runtime_tokens.current_tokens.get(ORDERED)
    if token is not None:
        token.block_until_ready()


def _in_while_condition() -> bool:
    """Whether JAX is tracing (a function called from) a ``while_loop``
    condition, where an ordered effect under a batched predicate makes JAX
    0.10 compute wrong values (see the module doc). Reads the chain of
    traces (``parent_trace``) and the name JAX gives a condition's trace."""
    trace = core.trace_ctx.trace
    while trace is not None:
        frame = getattr(trace, "frame", None)
        info = getattr(frame, "debug_info", None)
        if getattr(info, "traced_for", None) == "while_cond":
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


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
def _impl(coords, *args, host_fn, transforms, ntap, ordered):
    # Eager: the caller's thread, concrete values; nothing to order.
    del ordered
    host_fn(transforms, np.asarray(coords), *[np.asarray(a) for a in args[:ntap]])
    return list(args)


def _effects(ordered: bool) -> set:
    # Unordered (see _in_while_condition): debug_callback's effect, allowed
    # in the same places.
    return {ORDERED if ordered else debugging.debug_effect}


@linked_tap_p.def_effectful_abstract_eval
def _abstract_eval(coords, *avals, host_fn, transforms, ntap, ordered):
    del coords, host_fn, transforms, ntap
    return list(avals), _effects(ordered)


def _jvp(primals, tangents, **params):
    # Taps see primal values; the identity's tangents are its input tangents.
    return linked_tap_p.bind(*primals, **params), list(tangents[1:])


def _transpose(cts, coords, *args, host_fn, transforms, ntap, ordered):
    """Reached only when a leaf is a tangent (see the module doc): tap the
    cotangents of the tapped leaves; passed leaves' cotangents pass through.
    A cotangent that is a symbolic zero (the tap's result is not used) is
    tapped as zeros, as the old module did: the tap never vanishes. Tapped
    leaves that are not linear (primal values tapped with ``result=`` a
    tangent) are tapped as they are: this is where they run."""
    tap_cts, pass_cts = list(cts[:ntap]), list(cts[ntap:])
    params = dict(host_fn=host_fn, ntap=ntap, ordered=ordered)
    if any(ad.is_undefined_primal(a) for a in args[:ntap]):
        tap_cts = linked_tap_p.bind(
            coords,
            *[
                ad.instantiate_zeros(ct) if type(ct) is ad.Zero or ad.is_undefined_primal(a) else ct
                for ct, a in zip(tap_cts, args)
            ],
            transforms=transforms + (("transpose",),),
            **params,
        )
    else:
        linked_tap_p.bind(coords, *args[:ntap], transforms=transforms, **params)
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


def _batch(args, dims, *, host_fn, transforms, ntap, ordered):
    coords, moved, level = _batched_args(args, dims)
    out = linked_tap_p.bind(
        coords,
        *moved,
        host_fn=host_fn,
        transforms=transforms + (("batch", level[:ntap]),),
        ntap=ntap,
        ordered=ordered and not _in_while_condition(),
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


# --------------------------------------------------------------- call
def _call_abstract_eval(coords, *avals, host_fn, result_avals, what, ordered):
    del coords, avals, host_fn, what
    return list(result_avals), _effects(ordered)


def _call_jvp(primals, tangents, *, what, **params):
    # Only reached when a non-zero tangent reaches the call (JAX skips the
    # rule otherwise), so stop_gradient'ed arguments pass.
    raise NotImplementedError(
        f"{what}: cannot differentiate through a host call, JAX cannot see "
        "inside the host function. If no gradient should flow through it, "
        "wrap its argument in jax.lax.stop_gradient(...); otherwise give it "
        "a derivative with jax.custom_vjp (e.g. a second host call that "
        "computes the VJP on the host)."
    )


def _call_batch(args, dims, *, ordered, **params):
    """One call per element, in order: a host function written for one
    unbatched argument gets one (the old ``call`` raised under vmap)."""
    coords, moved, level = _batched_args(args, dims)
    batched = [x for x, d in zip(moved, level) if d is not None]
    ordered = ordered and not _in_while_condition()

    def one(elements):
        it = iter(elements)
        leaves = [next(it) if d is not None else x for x, d in zip(moved, level)]
        return linked_call_p.bind(coords, *leaves, ordered=ordered, **params)

    outs = lax.map(one, batched)
    return outs, [0] * len(outs)


linked_call_p.def_effectful_abstract_eval(_call_abstract_eval)
linked_call_p.def_impl(functools.partial(dispatch.apply_primitive, linked_call_p))
ad.primitive_jvps[linked_call_p] = _call_jvp
batching.primitive_batchers[linked_call_p] = _call_batch


# --------------------------------------------------------------- lowering
def _emit(ctx, args, run, avals_out, ordered):
    """The host callback ``run(*args)``; returns its results. In the chain of
    ``ORDERED`` tokens when ``ordered``. Nothing in the second evaluation of
    a batched while predicate, where the callback already ran for the same
    values in the loop's condition (zeros returned: the tap's token is 0
    either way)."""
    if primitive.recomputed_while_predicate(ctx):
        if ordered:
            ctx.set_tokens_out(ctx.tokens_in)
        return [mlir.ir_constant(np.zeros(a.shape, a.dtype)) for a in avals_out]
    avals_in = ctx.avals_in[: len(args)]
    sub = ctx.replace(avals_in=avals_in, avals_out=list(avals_out))
    sharding = cb._callback_op_sharding(ctx.module_context.axis_context, None, sub.avals_out)
    results, token, _ = cb.emit_python_callback(
        sub,
        run,
        ctx.tokens_in.get(ORDERED) if ordered else None,
        list(args),
        avals_in,
        sub.avals_out,
        has_side_effect=True,
        returns_token=ordered,
        sharding=sharding,
    )
    if ordered:
        if _on_one_device(sharding):
            _token_on_the_callbacks_device(ctx, token, sharding)
            token = _token_past_the_callback(token)
        ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({ORDERED: token})))
    return results


def _on_one_device(sharding) -> bool:
    """Whether JAX placed the callback on one device (a maximal sharding:
    under jit, outside any manual region), as ``cb._callback_op_sharding``
    does with Shardy (one logical device id) or GSPMD (``MAXIMAL``)."""
    from jax._src import sharding_impls
    from jax._src.lib import xla_client as xc

    if isinstance(sharding, sharding_impls.SdyArrayList):
        return bool(sharding.shardings and sharding.shardings[0].logical_device_ids)
    return isinstance(sharding, xc.OpSharding) and sharding.type == xc.OpSharding.Type.MAXIMAL


def _token_past_the_callback(token):
    """The token the chain goes on with after a callback on one device: a
    fresh ``after_all`` of the callback's token (ordered after it by data).

    Not the callback's own token: a shard_map body (what ``pmap`` lowers to
    inside an outer jit) takes its token replicated, and JAX 0.12's Shardy
    propagation writes that sharding back onto the value it is given, which the
    partitioner refuses on a side-effecting op ("side-effect HLO cannot have a
    replicated sharding"). ``after_all`` has no side effect and takes the
    sharding its users need; each device's chain stays in order."""
    from jax._src.lib.mlir.dialects import hlo

    return hlo.after_all([token])


def _token_on_the_callbacks_device(ctx, token, sharding) -> None:
    """The ordered callback's token result on the callback's own device.

    Under jit (one device runs the callback: a maximal sharding) JAX 0.9
    annotates that token as replicated (Shardy), which XLA refuses for a
    side-effecting op ("side-effect HLO cannot have a replicated sharding");
    JAX 0.10 gives it the callback's device, as done here (a no-op there)."""
    from jax._src import config, sharding_impls

    if not config.use_shardy_partitioner.value or not isinstance(
        sharding, sharding_impls.SdyArrayList
    ):
        return
    ids = sharding.shardings[0].logical_device_ids
    op = token.owner
    if len(op.results) != len(sharding.shardings) + 1:
        # No result but the token, which the callback's one annotation covers.
        return
    fixed = sharding_impls.SdyArrayList(
        (
            sharding_impls.SdyArray(mesh_shape=(), dim_shardings=(), logical_device_ids=ids),
            *sharding.shardings,
        )
    )
    jax_support.set_sharding(ctx.module_context, op, fixed)


def _lowering(ctx, coords, *leaves, host_fn, transforms, ntap, ordered):
    def run(coords, *flat):
        # XLA's buffers are valid during the call only: copy.
        host_fn(transforms, np.array(coords, copy=True), *[np.array(a, copy=True) for a in flat])
        return (_TOKEN,)

    (token,) = _emit(ctx, (coords, *leaves[:ntap]), run, [_TOKEN_AVAL], ordered)
    outs = []
    for x, aval in zip(leaves, ctx.avals_in[1:]):
        if aval.size and jnp.dtype(aval.dtype).kind in "biufc":
            # tokens_out=None: lower_fun sets its own (the XOR has no effect).
            sub = ctx.replace(
                primitive=None, avals_in=[aval, _TOKEN_AVAL], avals_out=[aval], tokens_out=None
            )
            (x,) = mlir.lower_fun(_xor_token, multiple_results=False)(sub, x, token)
        outs.append(x)
    return outs


def _call_lowering(ctx, coords, *leaves, host_fn, result_avals, what, ordered):
    del what
    return _emit(ctx, (coords, *leaves), host_fn, result_avals, ordered)


# cacheable=False: the rules need the caller's name stack.
mlir.register_lowering(linked_tap_p, _lowering, cacheable=False)
mlir.register_lowering(linked_call_p, _call_lowering, cacheable=False)
