"""The trace half of the output transport: while ``pmaptap.jit`` /
``pmaptap.pmap`` trace a step, a tap binds ``tap_out_p`` instead of a host
callback, a mark of its operands that ``lift.py`` turns into extra outputs
(why a mark: docs/architecture.md, "Taps as step outputs").

A mark that cannot be lifted (a ``while_loop`` body, an unknown higher-order
primitive) is not lost: its lowering is the callback transport's emission
(``layouts.emit_now``), and ``lift.py`` says so once per tap site.

Relies on ``jax._src`` internals (JAX 0.10), as primitive.py.
"""

from __future__ import annotations

import contextlib
import threading
from functools import partial
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import core, debugging
from jax._src.interpreters import ad, batching, mlir
from jax._src.interpreters import partial_eval as pe

from pmaptap._common.spec import TapSpec
from pmaptap._common.switch import _OUTPUTS

tap_out_p = core.Primitive("pmaptap_tap_out")
tap_out_p.multiple_results = True

_state = threading.local()


def collecting() -> bool:
    """Whether taps traced now leave the step as outputs (inside the trace
    of a ``pmaptap.jit`` / ``pmaptap.pmap`` step)."""
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def collect() -> Iterator[None]:
    """Taps traced inside this block bind ``tap_out_p`` (see ``mark``).
    The JAX configuration state set with it keeps JAX's caches of traced
    bodies apart (_common/switch.py)."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        with contextlib.nullcontext() if _OUTPUTS is None else _OUTPUTS(True):
            yield
    finally:
        _state.depth -= 1


@contextlib.contextmanager
def step_body() -> Iterator[None]:
    """Around the call of the step's function by ``pmaptap.jit``'s lift: a
    value traced directly in this trace (no scan, cond, vmap, grad or
    nested jit around it) may turn out to be an output of the step, which
    a fingerprint can then hash after the step (``at_step_level``)."""
    before = getattr(_state, "top", None)
    _state.top = core.trace_ctx.trace
    try:
        yield
    finally:
        _state.top = before


def at_step_level() -> bool:
    """Whether what is traced now is traced directly in the step's body
    (``step_body``), not inside any transformation of it."""
    top = getattr(_state, "top", None)
    return top is not None and top is core.trace_ctx.trace


def mark(spec: TapSpec, coords, step, leaves, *, due=None) -> None:
    """Mark a tap's operands in the program being traced (a spec of the
    PROVEN / VERIFIED_OFF layouts: one copy per process travels). ``due``:
    the on-device decision of ``every`` (placement.every_due), made where
    the tap is traced, so that both transports decide alike; it travels as
    the operand after ``step``."""
    leaves = [lax.stop_gradient(x) for x in leaves]
    traced_every = due is not None
    head = (coords, step, due) if traced_every else (coords, step)
    tap_out_p.bind(*head, *leaves, spec=spec, traced_every=traced_every)


@tap_out_p.def_effectful_abstract_eval
def _abstract_eval(*avals, **params):
    # The debug effect keeps the mark alive through DCE and lets every
    # control-flow primitive carry it, as it lets jax.debug.callback.
    return [], {debugging.debug_effect}


def _jvp(primals, tangents, **params):
    # A tap records the primal value, as the callback transport does.
    return tap_out_p.bind(*primals, **params), []


def _batch(args, dims, *, spec: TapSpec, traced_every):
    """vmap: ONE mark carrying the whole batch, vmapped axis first (the
    record's ``batch_dims``), as the callback transport's emitter does."""
    k = 3 if traced_every else 2  # coords, step and due (derived from step)
    head, leaves, head_d, leaf_d = args[:k], args[k:], dims[:k], dims[k:]
    if any(d is not None for d in head_d):
        raise ValueError(
            f"pmaptap.tap({spec.name!r}): the `step` argument is batched by "
            "vmap; pass a step that is the same for the whole batch (e.g. "
            "tap outside the vmap, or pass a Python int)."
        )
    size = next(x.shape[d] for x, d in zip(leaves, leaf_d) if d is not None)
    leaves = [
        jnp.broadcast_to(x, (size,) + jnp.shape(x)) if d is None else jnp.moveaxis(x, d, 0)
        for x, d in zip(leaves, leaf_d)
    ]
    tap_out_p.bind(*head, *leaves, spec=spec.with_batch(), traced_every=traced_every)
    return [], []


def _partial_eval_custom(saveable, unks_in, inst_in, eqn):
    # jax.checkpoint / remat: a mark whose operands are known stays in the
    # forward part only, so the recomputation in the backward pass does not
    # record the value again (as the callback transport's custom_vmap wrapper
    # keeps its callback from being replayed).
    if any(unks_in):
        res = [v for v, inst in zip(eqn.invars, inst_in) if not inst]
        return None, eqn, [], [], res
    return eqn, None, [], [], []


ad.primitive_jvps[tap_out_p] = _jvp
ad.primitive_transposes[tap_out_p] = lambda _, *args, **params: [None] * len(args)
batching.primitive_batchers[tap_out_p] = _batch
pe.partial_eval_jaxpr_custom_rules[tap_out_p] = _partial_eval_custom


def _fallback(coords, step, *leaves, spec: TapSpec, traced_every: bool):
    """The callback transport's emission of one mark (what a mark that was
    not lifted lowers to): one host call per device under mapped axes, the
    per-shard call under plain jit."""
    from pmaptap._trace.layouts import emit_now

    due, leaves = (leaves[0], leaves[1:]) if traced_every else (None, leaves)

    def fire() -> None:
        emit_now(spec, (), coords, step, list(leaves))

    if due is not None:
        lax.cond(due, fire, lambda: None)
    else:
        fire()
    return []


def _lowering(ctx, *args, spec, traced_every):
    return mlir.lower_fun(
        partial(_fallback, spec=spec, traced_every=traced_every),
        multiple_results=True,
    )(ctx, *args)


# cacheable=False: the callback lowerings inside read the caller's name stack.
mlir.register_lowering(tap_out_p, _lowering, cacheable=False)
# Eager (outside any trace): nothing to lift; emitted as a callback now.
tap_out_p.def_impl(_fallback)


def is_tracer(x: Any) -> bool:
    return isinstance(x, core.Tracer)


def concrete(x: Any) -> Any:
    """``x`` as a NumPy value when it is known while tracing (a literal, a
    constant), else None: such an operand need not travel as an output."""
    if isinstance(x, core.Tracer):
        return None
    try:
        return np.asarray(jax.device_get(x))
    except Exception:  # noqa: BLE001 - unknown: let it travel
        return None
