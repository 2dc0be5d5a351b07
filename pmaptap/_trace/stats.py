"""Statistics computed on the device for leaves too big to send whole
(``options().max_value_bytes``): the float32[8] layout of
tapfile.record.format.SUMMARY_FIELDS. Used by every tap path (tap.py, shardcall.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pmaptap._trace.options import options
from pmaptap.tapfile.record import COUNT_BASE


def device_statistics(x: jax.Array, valid: jax.Array | None = None) -> jax.Array:
    """float32[8] statistics of ``x``, computed where ``x`` lives (layout in
    tapfile.record.format.SUMMARY_FIELDS): min, max, mean, std over the finite elements
    (NaN when there are none; of ``|x|`` for complex; min/max of integers
    are exact below 2**24), then the NaN and inf counts split in two float32
    each so that they stay exact. Under vmap it batches like any jnp code.
    ``valid``: a bool mask of the elements that count (the rest, an uneven
    shard's padding, are in no statistic)."""
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
    if valid is not None:
        nan, inf, finite = nan & valid, inf & valid, finite & valid
    n = jnp.sum(finite, dtype=jnp.int32)
    denom = jnp.maximum(n, 1).astype(jnp.float32)
    mean = jnp.sum(jnp.where(finite, xf, 0.0)) / denom
    std = jnp.sqrt(jnp.sum(jnp.where(finite, jnp.square(xf - mean), 0.0)) / denom)
    if (jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_) and valid is None:
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


def statistics_of_big_leaves(leaves: list, compute: bool = True) -> tuple[list, tuple]:
    """Replace every leaf above options().max_value_bytes by its statistics
    (decided at trace time, so the big array never leaves the device).
    Returns (leaves to send, TapSite.as_statistics). ``compute=False`` only
    marks them (per-shard taps: the lowering decides, see shardcall.py)."""
    limit = options().max_value_bytes
    if limit is None:
        return leaves, ()
    out, as_statistics = [], []
    for x in leaves:
        dtype = jnp.dtype(x.dtype)
        if int(np.prod(np.shape(x), dtype=np.int64)) * dtype.itemsize > limit:
            out.append(device_statistics(jnp.asarray(x)) if compute else x)
            as_statistics.append((dtype.name, tuple(int(d) for d in np.shape(x))))
        else:
            out.append(x)
            as_statistics.append(None)
    return out, (tuple(as_statistics) if any(as_statistics) else ())
