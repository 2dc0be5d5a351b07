"""``emit_callback``: binds ``callback_p``, the single JAX host-callback
primitive pmaptap emits.

Why not ``jax.debug.callback`` itself: its runtime path calls
``jax.device_put`` on the callback's arguments *inside XLA's callback thread*
(``debugging.debug_callback_impl``), which costs a JAX dispatch per call and
is a JAX call on a thread where JAX calls can deadlock. This primitive has the
same transformation semantics as ``debug_callback_p`` (it reuses its effect,
so grad / scan / cond / while / checkpoint / shard_map treat it alike, and its
partial-eval rule), but its lowering hands the NumPy arrays XLA gives the
callback to ``host_fn`` as they are (``host_copy``: they already hold their
own copy of the device's buffers).
Partial-auto shard_map contexts and TPU, where the callback needs JAX's own
gather/cond or send/recv plumbing, delegate to ``debug_callback``'s
lowering.

This module relies on ``jax._src`` internals (JAX 0.10); tests/trace/test_primitive.py
fails loudly if a JAX upgrade breaks it.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import numpy as np
from jax._src import callback as cb
from jax._src import core, custom_batching, debugging, sharding_impls, source_info_util
from jax._src.interpreters import ad, batching, mlir
from jax._src.interpreters import partial_eval as pe
from jax._src.lib import xla_client as xc
from jax._src.state import discharge as state_discharge

callback_p = core.Primitive("pmaptap_callback")
callback_p.multiple_results = True


def eager() -> bool:
    """Whether nothing is being traced: a tap here runs now, on the
    caller's thread, with concrete values."""
    return core.trace_ctx.is_top_level()


def emit_callback(host_fn: Callable[..., None], *args: Any) -> None:
    """Call ``host_fn(*numpy_arrays)`` on the host when this point of the
    program runs (once per device inside a fully manual shard_map/pmap).
    Eager: now, with the values as they are. ``bind`` would first make
    each a JAX value, and with x64 off a NumPy float64 or int64 (an eager
    Python number, ``time.time()``) became 32 bits: rounded, or wrapped."""
    if eager():
        _impl(*args, host_fn=host_fn)
        return
    callback_p.bind(*args, host_fn=host_fn)


@callback_p.def_impl
def _impl(*args, host_fn):
    # Eager (not staged): we are on the caller's thread, values are concrete.
    host_fn(*[np.array(a) for a in args])
    return ()


def register_tap_rules(prim: core.Primitive) -> None:
    """The transformation rules of a host-callback primitive that returns
    nothing (``callback_p``, shardcall.py's ``shard_call_p``): the effect and
    partial-eval rule of ``debug_callback_p``, a JVP that taps the primals,
    no cotangent, the batching of ``jax.debug.callback``, and a state
    discharge that keeps the call."""

    def abstract_eval(*avals, **params):
        return [], {debugging.debug_effect}

    def jvp(primals, tangents, **params):
        return prim.bind(*primals, **params), []

    def discharge(in_avals, out_avals, *args, **params):
        return args, prim.bind(*args, **params)

    prim.def_effectful_abstract_eval(abstract_eval)
    ad.primitive_jvps[prim] = jvp
    ad.primitive_transposes[prim] = lambda _, *args, **params: [None] * len(args)
    batching.primitive_batchers[prim] = partial(debugging.debug_batching_rule, primitive=prim)
    pe.partial_eval_jaxpr_custom_rules[prim] = partial(
        debugging._debug_partial_eval_custom, primitive=prim
    )
    state_discharge.register_discharge_rule(prim)(discharge)


register_tap_rules(callback_p)


# --- taps of tangents (a tap inside a jax.custom_jvp rule, under grad/vjp)
# JAX has no transpose rule for the custom_vmap_call around a tap, and
# reverse mode never computes that tangent: nothing to record, and dropping
# the tap would lose it without a word, so the rule refuses at trace time
# (docs/faults.md, "Bad input"). Other custom_vmap functions keep JAX's.
_TAP_RULE = "_pmaptap_tap_rule"
_jax_transpose = ad.primitive_transposes.get(custom_batching.custom_vmap_p)


def mark_tap_vmap_rule(rule: Callable, name: str = "") -> Callable:
    """Mark a ``custom_vmap`` rule as a tap's (see _custom_vmap_transpose);
    ``name`` is the tap's, for the error. ``ClosedRule`` copies the
    function's ``__dict__``, so the mark survives."""
    setattr(rule, _TAP_RULE, name)
    return rule


def _tangent_tap_error(name: str) -> TypeError:
    tap = f"pmaptap.tap({name!r})" if name else "A pmaptap tap"
    return TypeError(
        f"{tap} taps a tangent inside a jax.custom_jvp rule, "
        "and reverse mode (jax.grad, jax.vjp, jax.linear_transpose) reached "
        "it. Reverse mode never computes that tangent and pmaptap.tap "
        "returns its argument untouched, so no cotangent flows through it: "
        "there is nothing to record. To record the cotangent, wrap the value "
        "it belongs to: `y = pmaptap.tap_grad(y, 'name')` (or use "
        "pmaptap.host_callback.id_tap and use its result); to record "
        "tangents, differentiate with jax.jvp; or move the tap out of the "
        "jvp rule."
    )


def _custom_vmap_transpose(cts, *args, call, rule, in_tree, out_tree):
    name = getattr(getattr(rule, "rule", rule), _TAP_RULE, None)
    if name is not None:
        raise _tangent_tap_error(name)
    if _jax_transpose is not None:
        return _jax_transpose(cts, *args, call=call, rule=rule, in_tree=in_tree, out_tree=out_tree)
    raise NotImplementedError(
        "Transpose rule (for reverse-mode differentiation) for 'custom_vmap_call' not implemented"
    )


ad.primitive_transposes[custom_batching.custom_vmap_p] = _custom_vmap_transpose
# emit.py's custom_vmap wraps every tap; JAX would lower each call once,
# cached with an empty name stack, and reuse it, hiding a batched while
# predicate's second evaluation from the callback inside
# (recomputed_while_predicate). Lowered inline instead, like callback_p.
mlir._uncacheable_primitives.add(custom_batching.custom_vmap_p)


def staged_for_later(leaves) -> bool:
    """Whether a value is only known in a part of the program that runs
    later: a tangent inside a ``jax.custom_jvp`` rule under grad/vjp/
    linearize, an unknown tracer of JAX's partial evaluation."""
    return any(isinstance(x, pe.JaxprTracer) and not x.pval.is_known() for x in leaves)


def run_later(body: Callable[..., None], leaves: list, step: Any, name: str) -> None:
    """Trace ``body(leaves, step)`` (which emits taps) as ONE custom_vmap
    call whose inputs are the values that are not known yet.

    That call goes where JAX puts the rest of the tangent computation: run
    when that part runs (jax.jvp of a linearized function, jax.linearize),
    refused, naming the tap ``name``, by the transpose rule above under
    grad/vjp, which never compute the tangent. Emitting the tap's own
    operations (stop_gradient, gather, statistics) directly there would
    need a transpose rule for each."""
    import jax
    from jax.custom_batching import custom_vmap

    n = len(leaves)

    def split(args):
        return list(args[:n]), (args[n] if step is not None else None)

    @custom_vmap
    def later(*args):
        body(*split(args))
        return ()

    @later.def_vmap
    @partial(mark_tap_vmap_rule, name=name)
    def _batched(axis_size, in_batched, *args):
        # The body's own taps batch themselves (emit's custom_vmap rule).
        jax.vmap(
            lambda *a: body(*split(a)),
            in_axes=[0 if b else None for b in in_batched],
            axis_size=axis_size,
        )(*args)
        return (), ()

    later(*leaves, *([] if step is None else [step]))


# --- the batched predicate of a while_loop, lowered twice
# JAX lowers a batched predicate's condition jaxpr twice, in the condition
# region (".../while/cond") and again in the body (".../while/body_pred") on
# the same carry: the callback lowerings emit nothing in the second. That
# needs the real name stack, given only to uncached lowerings
# (cacheable=False); control flow nested in the condition is lowered once and
# reused, so a callback there still runs twice (docs/host_callback.md).
# tests/trace/test_while_predicate.py fails loudly if JAX renames the scope.
_WHILE_SCOPE, _PRED_SCOPE = "while", "body_pred"


def recomputed_while_predicate(ctx: Any) -> bool:
    """Whether this lowering is inside the second evaluation of a batched
    while_loop predicate (see above); its callbacks are duplicates."""
    stack = ctx.name_stack.stack
    return any(
        isinstance(a, source_info_util.Scope)
        and isinstance(b, source_info_util.Scope)
        and a.name == _WHILE_SCOPE
        and b.name == _PRED_SCOPE
        for a, b in zip(stack, stack[1:])
    )


def host_copy(a: np.ndarray) -> np.ndarray:
    """An argument of XLA's python callback as pmaptap may keep it after the
    call returns, with no second copy of its bytes: XLA hands over arrays that
    already own a copy of the device buffer (docs/architecture.md, "Array
    values stored as bytes", says how on CPU and GPU), so they are kept as
    they are. Only a view with no owner, should a JAX hand one over, is copied."""
    if a.base is None and not a.flags.owndata:
        return np.array(a, copy=True)
    return a


def _copying(host_fn):
    def run(*flat_args):
        host_fn(*[host_copy(a) for a in flat_args])
        return ()

    return run


def _delegate(ctx, *args, host_fn):
    if recomputed_while_predicate(ctx):
        return []

    def as_debug_callback(*jax_arrays):
        host_fn(*[np.asarray(a) for a in jax_arrays])

    return debugging.debug_callback_lowering(
        ctx, *args, effect=debugging.debug_effect, partitioned=False, callback=as_debug_callback
    )


def _lowering(ctx, *args, host_fn):
    if recomputed_while_predicate(ctx):
        return []
    from jax._src import config

    axis_context = ctx.module_context.axis_context
    sharding: Any = None
    if isinstance(axis_context, sharding_impls.SPMDAxisContext):
        if set(axis_context.mesh.axis_names) != set(axis_context.manual_axes):
            return _delegate(ctx, *args, host_fn=host_fn)  # partial-auto
        # Fully manual: per-device semantics, the callback runs on each device.
        if config.use_shardy_partitioner.value:
            sharding = cb._get_sdy_array_list_for_callbacks(ctx.avals_out)
        else:
            sharding = xc.OpSharding()
            sharding.type = xc.OpSharding.Type.MANUAL
    elif isinstance(axis_context, sharding_impls.ShardingContext):
        # Automatic sharding (plain jit, one device or whole values): run
        # once, on the full logical value, on device 0 of the computation.
        return emit_on_device_0(ctx, *args, host_fn=host_fn)
    return _emit(ctx, args, host_fn, sharding)


def emit_on_device_0(ctx, *args, host_fn):
    """ONE host call, on device 0 of the computation, with the arrays XLA
    hands over: the MAXIMAL sharding debug_callback's lowering sets, without
    its jax.device_put (see the module docstring). Plain jit taps, and
    fingerprints gathered from every device (fingerprint_jit.py)."""
    from jax._src import config

    if config.use_shardy_partitioner.value:
        sharding: Any = sharding_impls.SdyArrayList(
            (sharding_impls.SdyArray(mesh_shape=(), dim_shardings=(), logical_device_ids=(0,)),)
        )
    else:
        sharding = xc.OpSharding()
        sharding.type = xc.OpSharding.Type.MAXIMAL
        sharding.tile_assignment_dimensions = [1]
        sharding.tile_assignment_devices = [0]
    return _emit(ctx, args, host_fn, sharding)


def _emit(ctx, args, host_fn, sharding) -> Any:
    """The host callback itself, ordered and effectful, on ``sharding``."""
    result, _, _ = cb.emit_python_callback(
        ctx,
        _copying(host_fn),
        None,
        list(args),
        ctx.avals_in,
        ctx.avals_out,
        has_side_effect=True,
        returns_token=True,
        partitioned=False,
        sharding=sharding,
    )
    return result


# cacheable=False: the rule needs the caller's name stack (see
# recomputed_while_predicate); a cached lowering gets an empty one.
mlir.register_lowering(callback_p, _lowering, platform="cpu", cacheable=False)
mlir.register_lowering(callback_p, _lowering, platform="gpu", cacheable=False)
mlir.register_lowering(callback_p, _delegate, platform="tpu", cacheable=False)
