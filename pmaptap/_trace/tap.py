"""``pmaptap.tap``: the traced side. Checks arguments at trace time, finds the
mapped axes and this device's coordinates, decides ``every`` for static steps
and hands the rest to the single emission helper."""

from __future__ import annotations

from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from pmaptap._trace import placement, primitive
from pmaptap._trace.emit import axis_coords, emit
from pmaptap._trace.layouts import static_step_operand
from pmaptap._trace.options import options
from pmaptap._trace.spec import DEDUP_MODES, Layout, TapSite, TapSpec
from pmaptap._trace.untapped import taps_off
from pmaptap.tapfile.format import COUNT_BASE, MAX_STEP, encodable

T = TypeVar("T")


def check_common(name: Any, dedup: Any, every: Any, fn: str) -> None:
    if not isinstance(name, str):
        raise TypeError(
            f"{fn}: name must be a str, got {type(name).__name__} "
            f"({name!r}). Example: {fn}(x, 'loss')."
        )
    if not name:
        raise ValueError(f"{fn}: name must be a non-empty string.")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as e:
        # A lone surrogate (e.g. from os.fsdecode of a non-UTF-8 file name)
        # has no JSON/UTF-8 form: refuse it here rather than at write time.
        raise ValueError(
            f"{fn}({name!r}): name is not valid Unicode text "
            f"({e.reason} at index {e.start}); tap files are "
            "UTF-8 JSON. Clean the name, e.g. "
            "name.encode('utf-8', 'replace').decode()."
        ) from None
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


def as_leaf(path, leaf, name: str, fn: str):
    if isinstance(leaf, (np.ndarray, np.generic)) and leaf.dtype.kind in "OSUMm":
        # object / bytes / str / datetime arrays: JAX would refuse them
        # too, but without naming the tap or the leaf.
        where = jax.tree_util.keystr(path) or "the value"
        raise TypeError(
            f"{fn}({name!r}): {where} is a NumPy array of dtype "
            f"{leaf.dtype}; taps accept numeric and bool arrays only. Convert "
            "it, or leave it out of the tapped value."
        )
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic)) or isinstance(leaf, jax.core.Tracer):
        return leaf
    if isinstance(leaf, (bool, int, float, complex)):
        return jnp.asarray(leaf)
    where = jax.tree_util.keystr(path) or "the value"
    raise TypeError(
        f"{fn}({name!r}): {where} is a {type(leaf).__name__}; taps accept "
        "arrays, NumPy/Python numbers and pytrees (dict/list/tuple/None) of "
        "them. Convert it, or leave it out of the tapped value."
    )


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
        return None, None
    if isinstance(step, bool):
        raise TypeError(f"{fn}({name!r}): step must be an integer, got bool.")
    if isinstance(step, (int, np.integer)):
        if not 0 <= step <= MAX_STEP:
            raise ValueError(
                f"{fn}({name!r}): step must be >= 0 and at most "
                f"2**63-1 (steps are int64); got {step}."
            )
        return int(step), None
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


def device_statistics(x: jax.Array) -> jax.Array:
    """float32[8] statistics of ``x``, computed where ``x`` lives (layout in
    tapfile.format.SUMMARY_FIELDS): min, max, mean, std over the finite elements
    (NaN when there are none; of ``|x|`` for complex; min/max of integers
    are exact below 2**24), then the NaN and inf counts split in two float32
    each so that they stay exact. Under vmap it batches like any jnp code."""
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        nan = jnp.isnan(x.real) | jnp.isnan(x.imag)
        inf = jnp.isinf(x.real) | jnp.isinf(x.imag)
        xf = jnp.abs(x).astype(jnp.float32)
        finite = ~(nan | inf)
    elif jnp.issubdtype(x.dtype, jnp.inexact):
        xf = x.astype(jnp.float32)  # bf16/fp8/f16 widen exactly
        nan, inf = jnp.isnan(x), jnp.isinf(x)
        finite = jnp.isfinite(x)
    else:  # integers and bool: all finite
        xf = x.astype(jnp.float32)
        nan = inf = jnp.zeros(x.shape, bool)
        finite = jnp.ones(x.shape, bool)
    n = jnp.sum(finite, dtype=jnp.int32)
    denom = jnp.maximum(n, 1).astype(jnp.float32)
    mean = jnp.sum(jnp.where(finite, xf, 0.0)) / denom
    std = jnp.sqrt(jnp.sum(jnp.where(finite, jnp.square(xf - mean), 0.0)) / denom)
    if jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_:
        lo, hi = jnp.min(x).astype(jnp.float32), jnp.max(x).astype(jnp.float32)
    else:
        lo = jnp.min(jnp.where(finite, xf, jnp.inf))
        hi = jnp.max(jnp.where(finite, xf, -jnp.inf))
    none = n == 0
    stats = [jnp.where(none, jnp.nan, v) for v in (lo, hi, mean, std)]
    for count in (jnp.sum(nan, dtype=jnp.int32), jnp.sum(inf, dtype=jnp.int32)):
        stats += [
            (count // COUNT_BASE).astype(jnp.float32),
            (count % COUNT_BASE).astype(jnp.float32),
        ]
    return jnp.stack(stats)


def _statistics_of_big_leaves(leaves: list, compute: bool = True) -> tuple[list, tuple]:
    """Replace every leaf above options().max_value_bytes by its statistics
    (decided at trace time, so the big array never leaves the device).
    Returns (leaves to send, TapSpec.summaries). ``compute=False`` only
    marks them (per-shard taps: the lowering decides, see shardcall.py)."""
    limit = options().max_value_bytes
    if limit is None:
        return leaves, ()
    out, summaries = [], []
    for x in leaves:
        dtype = jnp.dtype(x.dtype)
        if int(np.prod(np.shape(x), dtype=np.int64)) * dtype.itemsize > limit:
            out.append(device_statistics(jnp.asarray(x)) if compute else x)
            summaries.append((dtype.name, tuple(int(d) for d in np.shape(x))))
        else:
            out.append(x)
            summaries.append(None)
    return out, (tuple(summaries) if any(summaries) else ())


def jit_layout(leaves) -> Layout | None:
    """The layout of a tap traced under plain jit (no mapped axes, a traced
    leaf), whose lowering decides per device (shardcall.py): SHARDS when a
    leaf is an array that may be partitioned, WHOLE when every leaf is a
    scalar (a loss: replicated, never sharded; one copy is read). None
    elsewhere (mapped axes, eager)."""
    if placement.mapped_axes()[0]:
        return None
    if not any(isinstance(x, jax.core.Tracer) for x in leaves):
        return None
    return Layout.SHARDS if any(np.ndim(x) > 0 for x in leaves) else Layout.WHOLE


def send(
    x: Any,
    name: str,
    *,
    step=None,
    dedup: str = "auto",
    every: int = 1,
    pass_: str = "forward",
    fn: str = "pmaptap.tap",
) -> None:
    """Validate and emit ``x`` (no return value; shared by tap and tap_grad)."""
    check_common(name, dedup, every, fn)
    static_step, traced_step = check_step(step, name, fn)
    if static_step is not None and static_step % every != 0:
        return  # decided at trace time: nothing is compiled for this step
    path_leaves, treedef = jax.tree_util.tree_flatten_with_path(x)
    leaves = [as_leaf(p, leaf, name, fn) for p, leaf in path_leaves]
    for (p, _), leaf in zip(path_leaves, leaves):
        check_dtype(p, leaf, name, fn)
    if taps_off():
        return  # pmaptap.untapped: checked, then removed

    def emit_leaves(leaves: list, traced_step) -> None:
        _emit_leaves(
            leaves,
            traced_step,
            static_step,
            name=name,
            dedup=dedup,
            every=every,
            treedef=treedef,
            explicit=step is not None,
            pass_=pass_,
        )

    if primitive.staged_for_later(leaves):
        # A tangent inside a custom_jvp rule under grad/vjp/linearize: emit
        # it in the part of the program that runs later (see
        # primitive.run_later), as jax.debug.callback would be.
        primitive.run_later(emit_leaves, leaves, traced_step)
        return
    emit_leaves(leaves, traced_step)


def _emit_leaves(
    leaves: list,
    traced_step,
    static_step: int | None,
    *,
    name: str,
    dedup: str,
    every: int,
    treedef,
    explicit: bool,
    pass_: str,
) -> None:
    jit = jit_layout(leaves)
    # Per-shard taps only mark big leaves: a summary of a partitioned value
    # would need an all-reduce, so their lowering decides (shardcall.py).
    sent, summaries = _statistics_of_big_leaves(leaves, compute=jit is not Layout.SHARDS)
    where, raw_names = placement.current(leaves)
    site = TapSite(
        name=name,
        dedup=dedup,
        every=int(every),
        treedef=treedef,
        explicit_step=explicit,
        pass_=pass_,
        summaries=summaries,
    )
    spec = TapSpec(site=site, placement=where)
    if jit is not None:
        spec = spec.with_transport(layout=jit)
    coords = axis_coords(raw_names)
    if traced_step is not None:
        step_arr = traced_step
    else:
        step_arr = static_step_operand(-1 if static_step is None else static_step)
    emit(
        spec, raw_names, sent, coords, step_arr, traced_every=traced_step is not None and every > 1
    )


def tap(x: T, name: str, *, step=None, dedup: str = "auto", every: int = 1) -> T:
    """Send ``x`` (an array or pytree of arrays) to the host, tagged with the
    device, process and mesh coordinates it came from. Returns ``x`` unchanged;
    gradients flow as if the tap were absent.

    dedup: "replicated" (one record per step; divergent copies are all kept
    and flagged), "per_device" (one record per device per step) or "auto"
    (identical copies -> replicated, otherwise per_device).
    step: None for an automatic per-(session, name, device) counter, or a
    Python int / traced integer scalar. every: record steps where
    ``step % every == 0``; with a traced step the skip is decided on device.
    """
    send(x, name, step=step, dedup=dedup, every=every)
    return x
