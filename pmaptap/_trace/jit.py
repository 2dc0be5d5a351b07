"""``pmaptap.jit`` / ``pmaptap.pmap``: ``jax.jit`` / ``jax.pmap`` whose taps
leave the compiled step as extra outputs instead of host callbacks.

The step is traced with the taps marked (outputs.py), the marks are lifted
into outputs (lift.py), and after each dispatch the extra outputs go to the
host half (``_host/outputs.py``: copied asynchronously, given to the
pipeline on its thread); the caller gets the function's own outputs, as
from ``jax.jit``. Called inside another trace (a jit, a scan body, another
``pmaptap.jit``), the wrapper is a plain jit of the function: the taps
inside are the enclosing trace's to lift or call back.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
from jax._src import core

from pmaptap._host.routing import submit_outputs
from pmaptap._trace.lift import Lifted, lift, on_rows
from pmaptap._trace.options import options
from pmaptap._trace.outputs import collecting

# JAX's own, as imported: what the wrappers stage with.
_jax_jit, _jax_pmap = jax.jit, jax.pmap


class _Step:
    """A compiled step whose taps are outputs (what pmaptap.jit/pmap return)."""

    def __init__(self, fun: Callable, staged: Callable, plain: Callable) -> None:
        self._staged, self._plain = staged, plain
        functools.update_wrapper(self, fun)

    def __call__(self, *args, **kwargs):
        # Inside another trace (its arguments or closed-over values
        # tracers): the enclosing trace's to lift or call back. JAX's own
        # flag, not a walk over the arguments on every dispatch.
        if collecting() or not core.trace_state_clean():
            return self._plain(*args, **kwargs)
        out, lifted = self._staged(*args, **kwargs)
        submit_outputs(lifted.nodes, lifted.arrays, options().max_in_flight_bytes)
        return out

    def lower(self, *args, **kwargs):
        """The lowered step (``jax.jit(...).lower``): its outputs are the
        function's, then the lifted taps' values."""
        return self._staged.lower(*args, **kwargs)

    def trace(self, *args, **kwargs):
        return self._staged.trace(*args, **kwargs)

    def __get__(self, obj, objtype=None):
        # As a method: bind like a function does.
        return self if obj is None else functools.partial(self, obj)


def jit(fun: Callable | None = None, /, *, jit: Callable | None = None, **kwargs: Any):
    """``jax.jit(fun, **kwargs)`` whose taps leave the step as outputs.

    Same arguments (shardings, ``donate_argnums``, static arguments, ...)
    and same return values. ``jit=`` another jit-like wrapper to compose
    with (``equinox.filter_jit``, ``flax.nnx.jit``), given ``kwargs``.
    Usable as a decorator, with or without arguments.
    """
    if fun is None:
        return functools.partial(_jit, wrapper=jit, kwargs=kwargs)
    return _jit(fun, wrapper=jit, kwargs=kwargs)


def _jit(fun: Callable, *, wrapper: Callable | None, kwargs: dict) -> _Step:
    wrapper = _jax_jit if wrapper is None else wrapper
    staged_kwargs = dict(kwargs)
    if staged_kwargs.get("out_shardings") is not None:
        # The lifted values: wherever the compiler puts them (the tap's own
        # sharding), so their shards stay where they live.
        staged_kwargs["out_shardings"] = (staged_kwargs["out_shardings"], None)
    return _Step(fun, wrapper(lift(fun), **staged_kwargs), wrapper(fun, **kwargs))


def pmap(fun: Callable | None = None, /, **kwargs: Any):
    """``jax.pmap(fun, **kwargs)`` whose taps leave the step as outputs, one
    row per device."""
    if fun is None:
        return functools.partial(pmap, **kwargs)
    lifted = lift(fun)

    @functools.wraps(fun)
    def rows(*args, **kw):
        out, got = lifted(*args, **kw)
        return out, Lifted(on_rows(got.nodes), got.arrays)

    staged_kwargs = dict(kwargs)
    if "out_axes" in staged_kwargs:
        staged_kwargs["out_axes"] = (staged_kwargs["out_axes"], 0)
    return _Step(fun, _jax_pmap(rows, **staged_kwargs), _jax_pmap(fun, **kwargs))
