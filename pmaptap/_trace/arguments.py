"""Trace-time argument checks shared by every tapping API (``tap``,
``tap_grad``, ``host_callback``): each raises where the user wrote the tap,
naming it and saying what is allowed."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pmaptap._common.spec import DEDUP_MODES
from pmaptap._trace.primitive import eager
from pmaptap.errors import resumed_step_message
from pmaptap.tapfile.record import check_step_range, check_text, encodable


def check_common(name: Any, dedup: Any, every: Any, fn: str) -> None:
    if not isinstance(name, str):
        raise TypeError(
            f"{fn}: name must be a str, got {type(name).__name__} "
            f"({name!r}). Example: {fn}(x, 'loss')."
        )
    if not name:
        raise ValueError(f"{fn}: name must be a non-empty string.")
    check_text(name, f"{fn}({name!r})")
    if dedup not in DEDUP_MODES:
        raise ValueError(
            f"{fn}({name!r}): dedup must be one of "
            f"{', '.join(repr(m) for m in DEDUP_MODES)}; got {dedup!r}."
        )
    if isinstance(every, bool) or not isinstance(every, (int, np.integer)):
        raise TypeError(
            f"{fn}({name!r}): every must be an int >= 1, got {type(every).__name__} ({every!r})."
        )
    if every < 1:
        raise ValueError(
            f"{fn}({name!r}): every must be >= 1 (1 records every "
            f"step, N records steps where step % N == 0); got {every}."
        )


def is_key(leaf: Any) -> bool:
    """Whether ``leaf`` is a typed PRNG key array (``jax.random.key``)."""
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def as_leaf(path, leaf, name: str, fn: str, *, exact: bool = False):
    """``leaf`` as a value a tap can send (numbers become arrays, typed PRNG
    keys their key data), or a TypeError naming the tap and the leaf.
    ``exact`` (``pmaptap.tap``): a Python number tapped eagerly keeps its
    value, as a NumPy float64 / int64 (uint64) / complex128 / bool, which
    the eager path hands to the host as it is (primitive.emit_callback);
    traced, it is a constant of the trace and takes JAX's dtype."""
    if isinstance(leaf, (np.ndarray, np.generic)) and leaf.dtype.kind in "OSUMm":
        # object / bytes / str / datetime arrays: JAX would refuse them
        # too, but without naming the tap or the leaf.
        where = jax.tree_util.keystr(path) or "the value"
        raise TypeError(
            f"{fn}({name!r}): {where} is a NumPy array of dtype "
            f"{leaf.dtype}; taps accept numeric and bool arrays only. Convert "
            "it, or leave it out of the tapped value."
        )
    if is_key(leaf):
        # A typed PRNG key (jax.random.key) has no NumPy dtype: its key data
        # (uint32) is what the host receives, as the old host_callback did.
        return jax.random.key_data(leaf)
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic)) or isinstance(leaf, jax.core.Tracer):
        return leaf
    if isinstance(leaf, (bool, int, float, complex)):
        if exact and eager():
            return _exact_number(path, leaf, name, fn)
        return jnp.asarray(leaf)
    where = jax.tree_util.keystr(path) or "the value"
    raise TypeError(
        f"{fn}({name!r}): {where} is a {type(leaf).__name__}; taps accept "
        "arrays, NumPy/Python numbers and pytrees (dict/list/tuple/None) of "
        "them. Convert it, or leave it out of the tapped value."
    )


def _exact_number(path, leaf: bool | int | float | complex, name: str, fn: str) -> np.ndarray:
    """A Python number as NumPy keeps it whole: ``time.time()`` as float64
    (float32 kept 1796571900.0 of 1796571845.16), an int as int64 (uint64
    above it; JAX's int32 refused 2**40)."""
    value = np.asarray(leaf)
    if value.dtype == object:
        where = jax.tree_util.keystr(path) or "the value"
        raise TypeError(
            f"{fn}({name!r}): {where} is the Python int {leaf}, outside int64 and "
            "uint64; a tap sends fixed-width numbers. Tap it as a float, or as text "
            "elsewhere."
        )
    return value


def check_dtype(path, leaf, name: str, fn: str) -> None:
    """Refuse, here at trace time, a dtype the host cannot write (float0
    tangents, strings, any future JAX dtype the encoder does not know):
    otherwise the record would be dropped at the next flush."""
    dt = np.dtype(leaf.dtype)
    where = jax.tree_util.keystr(path) or "the value"
    if jnp.issubdtype(dt, jnp.integer) and jnp.iinfo(dt).bits == 1:
        # Checked on JAX 0.10 CPU: int1 values cannot be passed to a jitted
        # function (XLA expects pred), uint1 ones do not compile, and int1
        # 1 reads back as 1 in JAX but -1 in NumPy: no value to trust.
        raise TypeError(
            f"{fn}({name!r}): {where} has dtype {dt}; 1-bit integers cannot "
            "be tapped (JAX and NumPy disagree on their values). Convert it, "
            "e.g. x.astype(jnp.int8)."
        )
    if not encodable(dt):
        raise TypeError(
            f"{fn}({name!r}): {where} has dtype {dt}, which tap files cannot "
            "hold; taps write bool, integer (int2/int4/uint2/uint4 included), "
            "floating (bfloat16, float8/float6/float4 variants included) and "
            "complex arrays. Convert it (e.g. x.astype(jnp.float32)), or leave "
            "it out of the tapped value."
        )


def check_step(step: Any, name: str, fn: str):
    """Returns (static_int_or_None, traced_or_None)."""
    if step is None:
        check_automatic_step(name, fn)
        return None, None
    if isinstance(step, bool):
        raise TypeError(f"{fn}({name!r}): step must be an integer, got bool.")
    if isinstance(step, (int, np.integer)):
        return check_step_range(step, f"{fn}({name!r})"), None
    if isinstance(step, (jax.Array, jax.core.Tracer, np.ndarray)):
        dtype = step.dtype
        if not jnp.issubdtype(dtype, jnp.integer) or step.shape != ():
            raise TypeError(
                f"{fn}({name!r}): step must be an integer scalar "
                f"(Python int or traced int array of shape ()), got "
                f"{dtype}{list(step.shape)}."
            )
        return None, step
    raise TypeError(
        f"{fn}({name!r}): step must be None (automatic counter), a "
        f"Python int, or a traced integer scalar; got "
        f"{type(step).__name__}."
    )


def check_automatic_step(name: str, fn: str) -> None:
    """A tap with no ``step=`` traced while a resumed session is open: refused
    here, where the user wrote it. (One traced before such a session opened
    is refused on the host: ``Aggregator(refuse_automatic_steps=True)``.)"""
    from pmaptap._host.routing import active_session

    s = active_session()
    if s is not None and getattr(s, "resume", False):
        raise ValueError(resumed_step_message(name, fn))
