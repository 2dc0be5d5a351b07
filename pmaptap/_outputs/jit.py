"""``pmaptap.jit`` / ``pmaptap.pmap``: ``jax.jit`` / ``jax.pmap`` whose taps
leave the compiled step as extra outputs instead of host callbacks
(docs/architecture.md, "Taps as step outputs"); the caller gets the
function's own outputs. Called inside another trace, the wrapper is a plain
jit of the function: the taps inside are the enclosing trace's to lift or
call back.

The ahead-of-time stages (``trace`` -> ``lower`` -> ``compile``) are JAX's
own objects for the lifted step, wrapped (``_Traced``, ``_Lowered``,
``_Compiled``) so that what a user reads or calls is about the function,
and a compiled call hands the taps over as a call of the step does.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import jax
import numpy as np
from jax._src import api_util, core

from pmaptap._common.lifted import FromArgument
from pmaptap._outputs import drain
from pmaptap._outputs.lift import Lifted, lift, on_rows
from pmaptap._trace.marks import collecting
from pmaptap._trace.options import options

# JAX's own, as imported: what the wrappers stage with.
_jax_jit, _jax_pmap = jax.jit, jax.pmap
_JAX_STAGES = (jax.stages.Traced, jax.stages.Lowered, jax.stages.Compiled)


def _handed_over(result: tuple[Any, Lifted], args: tuple, kwargs: dict) -> Any:
    """The function's outputs of one dispatched run of the lifted step (called
    with ``args``, ``kwargs``); its lifted taps handed to the host pipeline
    (what makes them records)."""
    out, lifted = result
    # Per (argument, leaf) the step did not return: the call's own value,
    # kept once however many of its outputs (a step, ``every`` flags) read it.
    # One still being computed that a fingerprint hashed after the step
    # decides its due steps from is kept by that program, dispatched on it
    # now (its copy, or what the host read: later.py), not by a copy of its own.
    flags = {(k.flag.key, k.flag.leaf) for k in lifted.later if isinstance(k.flag, FromArgument)}
    taken: dict[tuple, Any] = {}
    raw: dict[tuple, Any] = {}
    for k in lifted.packing or ():
        if isinstance(k, FromArgument) and (k.key, k.leaf) not in taken:
            got = args[k.key] if isinstance(k.key, int) else kwargs[k.key]
            x = jax.tree_util.tree_leaves(got)[k.leaf]
            if (k.key, k.leaf) in flags and _in_flight(x):
                taken[k.key, k.leaf] = x
                raw[k.key, k.leaf] = (x, k.dtype)
            else:
                taken[k.key, k.leaf] = _kept(x, k.dtype)
    arrays = lifted.arrays
    if lifted.later:
        arrays = [*arrays, *_hashed_later(out, lifted, taken)]
    for key, (x, dtype) in raw.items():
        if taken[key] is x:  # (no program took it: kept as any other)
            taken[key] = _kept(x, dtype)
    drain.submit(lifted.nodes, arrays, options().max_in_flight_bytes, lifted.packing, taken)
    return out


def _in_flight(x: Any) -> bool:
    """Whether ``x`` is a jax.Array still being computed (or copied to its
    device)."""
    return isinstance(x, jax.Array) and not x.is_deleted() and not x.is_ready()


def _kept(x: Any, dtype: np.dtype) -> Any:
    """An argument's value for the host to read later, whatever the caller
    does with the argument meanwhile: a jax.Array it donates to another
    computation is deleted, however many references it has. One computed
    already is read now (a few bytes); one still being computed is copied
    on its device (the donation waits for the copy's read)."""
    if not isinstance(x, jax.Array):
        return np.asarray(x, dtype)  # a Python or NumPy value: the call's own
    if x.is_deleted():
        # Donated by this very call in another argument (the step does not
        # read it, so JAX does not object as to f(donate(a), a)).
        raise ValueError(
            "pmaptap.jit: a tap's step number is an argument that this call "
            "donated too (the same array inside a donated argument), so it is "
            "gone before pmaptap can read it; pass a copy, or a Python int"
        )
    if x.is_ready():
        return np.asarray(x).astype(dtype, copy=False)
    return jax.numpy.copy(x)


def _hashed_later(out: Any, lifted: Lifted, taken: dict) -> list:
    """The tables of the fingerprints hashed after the step (lift.Later),
    dispatched now: before the caller can donate the outputs they read to
    the next step (a dispatched read holds its buffers)."""
    leaves = jax.tree_util.tree_leaves(out)
    got: list = []
    for later in lifted.later:
        flag = later.flag_source(lifted.arrays, taken)
        number, table, kept = later(flag, [leaves[i] for i in later.leaves])
        got += [number, table]
        if kept is not None:  # the call's step number, for the drain
            taken[later.flag.key, later.flag.leaf] = kept
    return got


class _Step:
    """A compiled step whose taps are outputs (what pmaptap.pmap returns;
    pmaptap.jit's adds ``_JitStep``'s methods, as jax.jit's has more than
    jax.pmap's)."""

    def __init__(self, fun: Callable, staged: Callable, plain: Callable) -> None:
        self._staged, self._plain = staged, plain
        functools.update_wrapper(self, fun)  # __wrapped__, __name__, __doc__, ...

    def __call__(self, *args, **kwargs):
        # Inside another trace (its arguments or closed-over values
        # tracers): the enclosing trace's to lift or call back. JAX's own
        # flag, not a walk over the arguments on every dispatch.
        if collecting() or not core.trace_state_clean():
            return self._plain(*args, **kwargs)
        return _handed_over(self._staged(*args, **kwargs), args, kwargs)

    def lower(self, *args, **kwargs) -> "_Lowered":
        """The lowered step, as ``jax.jit(fun).lower``: its ``compile()``
        gives a compiled step whose calls write the taps."""
        return _Lowered(self._stage("lower")(*args, **kwargs))

    def _stage(self, method: str) -> Callable:
        """The staged wrapper's ``method``; an AttributeError naming the
        wrapper where it has none (a ``jit=`` wrapper of another kind)."""
        got = getattr(self._staged, method, None)
        if got is None:
            raise AttributeError(
                f"{type(self._staged).__name__} (the jit this step was made with) "
                f"has no .{method}(), so this pmaptap step has none"
            )
        return got

    def __get__(self, obj, objtype=None):
        # As a method: bind like a function does.
        return self if obj is None else functools.partial(self, obj)


class _JitStep(_Step):
    """What pmaptap.jit returns: also ``trace``, ``eval_shape`` and
    ``clear_cache``, as jax.jit's wrapped function."""

    def trace(self, *args, **kwargs) -> "_Traced":
        """The traced step, as ``jax.jit(fun).trace``."""
        return _Traced(self._stage("trace")(*args, **kwargs))

    def eval_shape(self, *args, **kwargs) -> Any:
        """The function's outputs' shapes, dtypes and shardings, as
        ``jax.jit(fun).eval_shape``."""
        # The staged wrapper's own (a jit= wrapper's maps its inner outputs
        # back to the lifted function's): (the function's, Lifted's).
        return self._stage("eval_shape")(*args, **kwargs)[0]

    def clear_cache(self) -> None:
        """Forget the traced and compiled step (both: the lifted one and the
        plain one used inside other traces), as ``jax.jit``'s."""
        for f in (self._staged, self._plain):
            clear = getattr(f, "clear_cache", None)
            if clear is not None:
                clear()


def _outputs(name: str) -> property:
    """A stage's output description ``name``, of the function's outputs."""
    return property(lambda self: self._functions(name), doc=f"The function's {name}.")


class _Stage:
    """A stage object (JAX's ``Traced``, ``Lowered``, ``Compiled``, or a
    ``jit=`` wrapper's) of the lifted step, read as the function's own:
    its calls hand the taps over; what describes the outputs
    (``out_tree``, ``out_info``, ...) describes the function's, without the
    taps' extra ones; everything else (``as_text``, ``cost_analysis``,
    ``in_tree``, ``jaxpr``, ...) is JAX's object's, about the program that
    runs, whose outputs are the function's then the taps' values."""

    __slots__ = ("_jax",)

    def __init__(self, stage: Any) -> None:
        self._jax = stage

    def __getattr__(self, name: str) -> Any:
        if name == "_jax":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self._jax, name)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(dir(self._jax)))

    def __repr__(self) -> str:
        return f"<pmaptap {type(self._jax).__name__} of a step whose taps are outputs>"

    def _functions(self, name: str) -> Any:
        """The function's part of the output description ``name``."""
        got = getattr(self._jax, name)
        if not isinstance(self._jax, _JAX_STAGES):
            # Another wrapper's stage (jit=): it describes that wrapper's
            # inner function in its own terms, passed on as it is.
            return got
        # JAX's describes the lifted step, which returns (the function's
        # outputs, Lifted): the first half is the function's.
        return got.children()[0] if name == "out_tree" else got[0]

    out_tree = _outputs("out_tree")
    out_info = _outputs("out_info")


class _Traced(_Stage):
    __slots__ = ()

    out_avals = _outputs("out_avals")

    def lower(self, **kwargs) -> "_Lowered":
        return _Lowered(self._jax.lower(**kwargs))

    def __call__(self, *args, **kwargs):
        if not core.trace_state_clean():
            # Its taps' values would be tracers of that trace, with no way
            # to the host: the step itself is what belongs there.
            raise TypeError(
                "a traced pmaptap step cannot be called inside another trace "
                "(its taps would be lost); call the pmaptap.jit step itself there"
            )
        return _handed_over(self._jax(*args, **kwargs), args, kwargs)


class _Lowered(_Stage):
    __slots__ = ()

    def compile(self, *args, **kwargs) -> "_Compiled":
        return _Compiled(self._jax.compile(*args, **kwargs))


class _Compiled(_Stage):
    __slots__ = ()

    output_shardings = _outputs("output_shardings")
    output_formats = _outputs("output_formats")

    def __call__(self, *args, **kwargs):
        # As a call of the step: the function's outputs, the taps written.
        return _handed_over(self._jax(*args, **kwargs), args, kwargs)


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


def _jit(fun: Callable, *, wrapper: Callable | None, kwargs: dict) -> _JitStep:
    wrapper = _jax_jit if wrapper is None else wrapper
    staged_kwargs = dict(kwargs)
    if staged_kwargs.get("out_shardings") is not None:
        # The lifted values: wherever the compiler puts them (the tap's own
        # sharding), so their shards stay where they live.
        staged_kwargs["out_shardings"] = (staged_kwargs["out_shardings"], None)
    # Fingerprints of the step's outputs hashed after it: only under
    # jax.jit, whose outputs are the function's (found there), and where
    # no out_shardings may lay them out other than the step held them.
    # Arguments tapped as they came are read from the call, under jax.jit
    # (whose calls pass the arguments the function is traced with) where
    # they are not donated (a donated one is gone after the call).
    plain = wrapper is _jax_jit
    lifted = lift(
        fun,
        hash_after=plain and kwargs.get("out_shardings") is None,
        readable=_not_donated(fun, kwargs) if plain else None,
    )
    return _JitStep(fun, wrapper(lifted, **staged_kwargs), wrapper(fun, **kwargs))


def _not_donated(fun: Callable, kwargs: dict) -> Callable[[int | str], bool]:
    """Whether the argument at a position or keyword is not donated by
    ``jax.jit(fun, **kwargs)`` (``donate_argnums`` and ``donate_argnames``
    each naming the other through the signature, as jax.jit resolves them)."""
    nums, names = kwargs.get("donate_argnums"), kwargs.get("donate_argnames")
    if not nums and not names:
        return lambda key: True
    try:
        sig = inspect.signature(fun)
    except (TypeError, ValueError):
        return lambda key: False  # no signature to tell a name from a position
    nums, names = api_util.infer_argnums_and_argnames(sig, nums, names)
    count = len(sig.parameters)
    donated = {*names, *nums, *(i + count for i in nums if i < 0)}
    return lambda key: key not in donated


def pmap(fun: Callable | None = None, /, **kwargs: Any):
    """``jax.pmap(fun, **kwargs)`` whose taps leave the step as outputs, one
    row per device."""
    if fun is None:
        return functools.partial(pmap, **kwargs)
    lifted = lift(fun, pack=False)

    @functools.wraps(fun)
    def rows(*args, **kw):
        out, got = lifted(*args, **kw)
        return out, Lifted(on_rows(got.nodes), got.arrays)

    staged_kwargs = dict(kwargs)
    if "out_axes" in staged_kwargs:
        staged_kwargs["out_axes"] = (staged_kwargs["out_axes"], 0)
    return _Step(fun, _jax_pmap(rows, **staged_kwargs), _jax_pmap(fun, **kwargs))
