"""The 64-bit fingerprint of one device's copy of an array, computed on that
device from the bits it holds (``pmaptap.fingerprint``, fingerprint.py).

What it is: a position-weighted sum of the array's bits taken as 32-bit
words, twice, modulo 2**32 (two 32-bit halves). Every word ``w_i`` at
position ``i`` enters as ``w_i * m_i`` with an odd multiplier ``m_i``, so a
change confined to one word (a flipped bit: ``w_i`` changes by ``±2**k``,
``k < 32``) changes each half by ``±2**k * m_i``, never 0 modulo 2**32: one
flipped bit anywhere, ``-0.0`` against ``0.0``, another NaN payload, is
always a different fingerprint. For other differences two copies collide
with a probability of about 2**-64 (the halves use independent odd
weights). Integer arithmetic only: floats would round, and NaN compares
unequal to itself.

Why it is shaped this way (measured on XLA:CPU, JAX 0.10.2, 16 MiB of
float32 on one core): XLA rewrites a long integer reduction into a tree of
``reduce-window`` ops and does not fuse the elementwise multiply into it, so
a plain weighted ``jnp.sum`` wrote the products out and read them back:
1.8-3.9 ms, against 0.65 ms for a float32 ``jnp.sum`` (XNNPACK's kernel).
Folding 32 rows at a time (``(-1, 32, 1024)``, summed over the middle axis,
a dimension short enough to stay one fused loop) takes 0.67 ms: one pass
over memory, as fast as the float sum. The result, 1/32 of the words, is
then weighted and summed (a second, small pass).

The words of a value: 32-bit dtypes as they are (bitcast); 64-bit ones as
two words each; 8- and 16-bit ones packed four or two to a word when the
count allows (a bitcast), else widened one to a word; bool as bytes;
sub-byte ones widened exactly first (layouts._wire). Complex: the real and
imaginary parts, each fingerprinted and combined.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pmaptap._trace.layouts import _sub_byte, _wire

FOLD = 32  # rows summed by one fused loop (see above)
LANES = 1024  # words per row
_BLOCK = FOLD * LANES
# Odd multipliers come from these constants (any odd constants with mixed
# bits would do; these are the golden ratio and two of MurmurHash3's).
_ROW = np.uint32(0x9E3779B1)
_HALF = (np.uint32(0x85EBCA77), np.uint32(0xC2B2AE3D))
_SALT = (np.uint32(0x27D4EB2F), np.uint32(0x165667B1))


def words(x: jax.Array) -> jax.Array:
    """``x``'s bits as a flat uint32 vector (complex: not taken here)."""
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    elif _sub_byte(x.dtype):
        x = _wire(x)
    size = jnp.dtype(x.dtype).itemsize
    flat = x.reshape(-1)
    if size == 4:
        return lax.bitcast_convert_type(flat, jnp.uint32)
    if size == 8:
        return lax.bitcast_convert_type(flat, jnp.uint32).reshape(-1)
    unsigned = {1: jnp.uint8, 2: jnp.uint16}[size]
    per = 4 // size
    if flat.size % per == 0 and flat.size:
        # Packed: a word holds `per` elements (a bitcast, no arithmetic).
        return lax.bitcast_convert_type(flat.reshape(-1, per), jnp.uint32)
    return lax.bitcast_convert_type(flat, unsigned).astype(jnp.uint32)


def _odd(index: jax.Array, k: np.uint32) -> jax.Array:
    return index * k | np.uint32(1)


def _weighted(w: jax.Array, start: int) -> jax.Array:
    """Both halves' sums of a short vector of words at positions
    ``start, start + 1, ...`` (uint32[2])."""
    pos = lax.iota(jnp.uint32, w.size) + np.uint32(start % 2**32)
    return jnp.stack(
        [jnp.sum(w * _odd(pos ^ _SALT[h], _HALF[h]), dtype=jnp.uint32) for h in (0, 1)]
    )


def fingerprint64(x: jax.Array, valid: jax.Array | None = None) -> jax.Array:
    """The fingerprint of ``x`` as uint32[2] (the high and low halves).
    ``valid`` (bool, ``x``'s shape): elements outside it count as zeros
    (the padding of an uneven shard, which is no element of the value)."""
    x = jnp.asarray(x)
    if valid is not None:
        x = jnp.where(valid, x, jnp.zeros((), x.dtype))
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        re, im = fingerprint64(jnp.real(x)), fingerprint64(jnp.imag(x))
        return re * np.uint32(3) + im
    w = words(x)
    n = int(w.size)
    main = n - n % _BLOCK
    out = jnp.full((2,), np.uint32(n % 2**32), jnp.uint32)
    if main:
        blocks = (w if main == n else w[:main]).reshape(-1, FOLD, LANES)
        row = lax.broadcasted_iota(jnp.uint32, blocks.shape, 0) * np.uint32(FOLD)
        row = row + lax.broadcasted_iota(jnp.uint32, blocks.shape, 1)
        # One fused pass over the words: each row of a block weighted by an
        # odd multiplier of its row number, 32 rows summed (FOLD).
        folded = jnp.sum(blocks * _odd(row, _ROW), axis=1, dtype=jnp.uint32)
        cell = lax.broadcasted_iota(jnp.uint32, folded.shape, 0) * np.uint32(LANES)
        cell = cell + lax.broadcasted_iota(jnp.uint32, folded.shape, 1)
        out = out + jnp.stack(
            [jnp.sum(folded * _odd(cell ^ _SALT[h], _HALF[h]), dtype=jnp.uint32) for h in (0, 1)]
        )
    if main < n:
        out = out + _weighted(w[main:], main)
    return out
