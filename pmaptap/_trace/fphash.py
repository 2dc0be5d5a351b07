"""The 64-bit fingerprint of one device's copy of an array, computed on that
device from the bits it holds (``pmaptap.fingerprint``, fingerprint.py).

What it is: the array's bits taken as 32-bit words ``w_i``; 32 words at a
time (``FOLD``, the words ``LANES`` apart in a block) summed into one 32-bit
*lane*, each weighted by an odd multiplier of its row; then every lane
mixed (MurmurHash3's finalizer, a bijection, with a salt per half) and
weighted by an odd multiplier of its position, and summed: twice, with
different salts and multipliers, for the two 32-bit halves. All modulo
2**32, integer arithmetic only (floats would round, and NaN compares
unequal to itself).

What it guarantees: a change confined to one word (one flipped bit
anywhere, ``-0.0`` against ``0.0``, another NaN payload) changes its lane
by ``delta * odd``, never 0 modulo 2**32, so the mixed lane, and each half,
changes: always detected. Changes in several lanes collide with a
probability of about 2**-64. Changes confined to one lane (words 1021
apart within one block of 32 x 1021 words, 256 x 1021 off the CPU) can
cancel in the weighted sum: with a
probability of about 2**-32 for arbitrary changes, but more often when
they are all in the top bits of their words (an even number of flipped
sign bits there always cancels): the price of a first pass that is one
multiply-add per word.

Why it is shaped this way (measured on XLA:CPU, JAX 0.10.2, 16 MiB of
float32 on one core): XLA rewrites a long integer reduction into a tree of
``reduce-window`` ops and does not fuse the elementwise multiply into it, so
a plain weighted ``jnp.sum`` wrote the products out and read them back:
1.8-3.9 ms, against 0.65 ms for a float32 ``jnp.sum`` (XNNPACK's kernel).
Folding 32 rows at a time (``(-1, 32, LANES)``, summed over the middle
axis, a dimension short enough to stay one fused loop) takes 0.66 ms: one
pass over memory, as fast as the float sum. Any further per-word operation
(a shift, a compare, a widening) doubled that, which is why the mixing is
done on the lanes (1/32 of the words: 0.8 ms in all).

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

FOLD = 32  # rows summed by one fused loop on XLA:CPU (see above)
# Elsewhere (GPU, TPU) XLA's reductions have no such limit, and a fold of 32
# left the first pass short of work: on an H200, 1 GiB of float32 took
# 1.46 ms at 32 rows, 0.53 ms at 256 (a float32 sum: 0.47 ms).
FOLD_ELSEWHERE = 256
# Words per row, and so the lanes a block is folded into: a prime, so that a
# power-of-two stride (a column of a matrix) spreads over lanes.
LANES = 1021
# Odd multipliers come from these constants (any odd constants with mixed
# bits would do; these are the golden ratio and MurmurHash3's).
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


def _fmix(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finalizer: a bijection whose output bits each
    depend on every input bit (a multiply moves bits only upwards)."""
    h = h ^ (h >> 16)
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _lanes(v: jax.Array, first: int) -> jax.Array:
    """Both halves of the fingerprint of lane values ``v`` (flat) whose
    positions are ``first, first + 1, ...``: each mixed (with the half's
    salt) and weighted by an odd multiplier of its position (uint32[2])."""
    cell = lax.iota(jnp.uint32, v.size) + np.uint32(first % 2**32)
    return jnp.stack(
        [jnp.sum(_fmix(v ^ _SALT[h]) * _odd(cell, _HALF[h]), dtype=jnp.uint32) for h in (0, 1)]
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
    if w.size < FOLD_ELSEWHERE * LANES:
        return _folded(w, FOLD)  # the same on every platform
    # The fold that suits the platform the program is compiled for: the
    # fingerprint of given bits is the same wherever that platform runs it
    # (only copies computed by one program are ever compared).
    return lax.platform_dependent(
        w, cpu=lambda w: _folded(w, FOLD), default=lambda w: _folded(w, FOLD_ELSEWHERE)
    )


def _folded(w: jax.Array, fold: int) -> jax.Array:
    n = int(w.size)
    block = fold * LANES
    main = n - n % block
    out = jnp.full((2,), np.uint32(n % 2**32), jnp.uint32)
    if main:
        blocks = (w if main == n else w[:main]).reshape(-1, fold, LANES)
        row = lax.broadcasted_iota(jnp.uint32, blocks.shape, 0) * np.uint32(fold)
        row = row + lax.broadcasted_iota(jnp.uint32, blocks.shape, 1)
        # One fused pass over the words: each row of a block weighted by an
        # odd multiplier of its row number, `fold` rows summed into the
        # block's lanes; then the lanes, 1/fold of the words, mixed.
        folded = jnp.sum(blocks * _odd(row, _ROW), axis=1, dtype=jnp.uint32)
        out = out + _lanes(folded.reshape(-1), 0)
    if main < n:
        # The words past the last whole block: each its own lane.
        out = out + _lanes(w[main:], main // fold)
    return out
