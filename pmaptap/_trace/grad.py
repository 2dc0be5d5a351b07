"""``pmaptap.tap_grad``: an identity whose backward pass records the
cotangent arriving at the tapped value (docs/api.md, "Backward taps").

A ``jax.custom_vjp`` identity: the forward rule emits nothing (it keeps a
traced ``step`` as a residual); the backward rule hands the cotangent to
``tap.send`` with ``pass_="backward"``, so checks, dedup, step counters and
``every`` are the tap's (automatic steps are keyed by (name, pass, device)).
Hence one record per backward execution, never duplicated by
``jax.checkpoint``'s recomputation, and automatic steps in the order the
backward pass runs (last-to-first in a ``scan``; pass ``step=i``).
Forward mode has no rule: ``_forward_mode_trace`` turns JAX's generic
refusal into a message that says what to do.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from pmaptap._common.switch import taps_off
from pmaptap._trace.arguments import as_leaf, check_common, check_step
from pmaptap._trace.tap import send

T = TypeVar("T")
FN = "pmaptap.tap_grad"


@dataclasses.dataclass(frozen=True)
class _Site:
    """What the backward rule needs, fixed at trace time (hashable: it is a
    ``nondiff_argnums`` argument of the custom_vjp)."""

    name: str
    dedup: str
    every: int
    static_step: int | None  # a Python int step, else None
    treedef: Any  # structure of the tapped value
    diff: tuple[bool, ...]  # per leaf: goes through the identity


def _is_differentiable(leaf: Any) -> bool:
    # Only JAX values can carry a gradient; NumPy arrays and Python scalars
    # are constants to JAX, and integer/bool dtypes have float0 cotangents.
    return isinstance(leaf, (jax.Array, jax.core.Tracer)) and jnp.issubdtype(
        leaf.dtype, jnp.inexact
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _identity(site: _Site, steps: tuple, leaves: tuple) -> tuple:
    del site, steps
    return leaves


def _identity_fwd(site: _Site, steps: tuple, leaves: tuple):
    # symbolic_zeros=True wraps each primal as CustomVJPPrimal(value, perturbed).
    del site
    values = tuple(p.value for p in leaves)
    # The traced step (if any) is the only residual: the backward rule needs
    # the step of the forward execution it belongs to.
    return values, tuple(p.value for p in steps)


def _identity_bwd(site: _Site, steps: tuple, cts: tuple):
    it = iter(cts)
    # Non-differentiable leaves never entered the identity: null in the record.
    # A symbolic zero: JAX proved at trace time that no gradient reaches the
    # leaf; written null rather than as materialised zeros of its shape.
    full = [None if not d or isinstance(ct := next(it), SymbolicZero) else ct for d in site.diff]
    step = steps[0] if steps else site.static_step
    send(
        jax.tree_util.tree_unflatten(site.treedef, full),
        site.name,
        step=step,
        dedup=site.dedup,
        every=site.every,
        pass_="backward",
        fn=FN,
    )
    # Integer step: no cotangent (None is JAX's spelling of a zero one).
    return (None,) * len(steps), cts


_identity.defvjp(_identity_fwd, _identity_bwd, symbolic_zeros=True)


def _has_tangent(leaf: Any, trace: Any) -> bool:
    """Whether ``leaf`` carries a known (not partial-eval) tangent of the AD
    ``trace``, looking through the tracers of inner transformations."""
    from jax._src import core
    from jax._src.interpreters import ad
    from jax._src.interpreters import partial_eval as pe

    while isinstance(leaf, core.Tracer):
        if leaf._trace is trace:
            tangent = getattr(leaf, "tangent", None)
            # Reverse mode through jvp + partial eval (jax.checkpoint, custom_jvp
            # rules, jax_use_direct_linearize=False) has *unknown* tangents:
            # that is not forward mode, and custom_vjp handles it.
            return (
                tangent is not None
                and type(tangent) is not ad.Zero
                and not isinstance(tangent, pe.JaxprTracer)
            )
        leaf = getattr(leaf, "primal", getattr(leaf, "val", None))
    return False


def _forward_mode_trace(leaves: list) -> bool:
    """True if forward-mode AD would process tap_grad's custom_vjp before any
    reverse-mode trace does (JAX then fails with a generic message).

    Relies on JAX 0.10 internals (``core.trace_ctx``, ``ad.JVPTrace`` /
    ``LinearizeTrace``, ``parent_trace``): a call is processed by the current
    trace first, then by each parent in turn. tests/trace/test_tap_grad.py checks
    the message under jvp and jacfwd, so an upgrade that breaks this fails
    there (and users then see JAX's own error, never a wrong result).
    """
    from jax._src import core
    from jax._src.interpreters import ad

    trace = core.trace_ctx.trace
    while trace is not None:
        if isinstance(trace, (ad.JVPTrace, ad.LinearizeTrace)) and any(
            _has_tangent(x, trace) for x in leaves
        ):
            # jax.linearize (is_vjp=False) is forward mode too, but JAX only
            # fails when its linear function is *evaluated*; its transpose
            # (jax.linear_transpose) works, so let it through.
            return isinstance(trace, ad.JVPTrace)
        trace = getattr(trace, "parent_trace", None)
    return False


def tap_grad(x: T, name: str, *, dedup: str = "auto", every: int = 1, step: Any = None) -> T:
    """Identity on ``x`` (an array or pytree of arrays) whose backward pass
    records the cotangent arriving at ``x`` as ``pmaptap.tap`` records a value
    (``"pass": "backward"``). step: None counts backward executions; a Python
    int or traced integer of the *forward* pass labels the record. Arguments
    are checked at trace time; forward mode is a TypeError. docs/api.md,
    "Backward taps".
    """
    check_common(name, dedup, every, FN)
    static_step, traced_step = check_step(step, name, FN)
    path_leaves, treedef = jax.tree_util.tree_flatten_with_path(x)
    for path, leaf in path_leaves:
        as_leaf(path, leaf, name, FN)  # raises for non-array leaves
    leaves = [leaf for _, leaf in path_leaves]
    diff = tuple(_is_differentiable(leaf) for leaf in leaves)
    if not any(diff):
        kinds = sorted({str(getattr(leaf, "dtype", type(leaf).__name__)) for leaf in leaves}) or [
            "no leaves"
        ]
        raise TypeError(
            f"{FN}({name!r}): no gradient can reach this value: it has no "
            f"floating-point or complex JAX array leaf (found: "
            f"{', '.join(kinds)}). Tap the float value the loss depends on, "
            "or use pmaptap.tap to record the value itself."
        )
    if taps_off() or (static_step is not None and static_step % every != 0):
        return x  # untapped, or decided at trace time: nothing to record
    diff_leaves = [leaf for leaf, d in zip(leaves, diff) if d]
    if _forward_mode_trace(diff_leaves):
        raise TypeError(
            f"{FN}({name!r}): forward-mode differentiation (jax.jvp, jax.jacfwd) "
            "reached tap_grad; it records cotangents of reverse "
            "mode only (jax.grad, jax.value_and_grad, jax.vjp, jax.jacrev, and "
            "jax.hessian, whose inner pass is reverse mode). Remove tap_grad from "
            "code you differentiate forward, or compute the tangent explicitly "
            "and record it with pmaptap.tap: `y, t = jax.jvp(f, (x,), (v,)); "
            "pmaptap.tap(t, 'tangent')`."
        )
    site = _Site(
        name=name,
        dedup=dedup,
        every=int(every),
        static_step=static_step,
        treedef=treedef,
        diff=diff,
    )
    steps = () if traced_step is None else (traced_step,)
    outs = iter(_identity(site, steps, tuple(diff_leaves)))
    return jax.tree_util.tree_unflatten(
        treedef, [next(outs) if d else leaf for leaf, d in zip(leaves, diff)]
    )
