"""The 64-bit fingerprint of one device's copy of an array, computed on that
device from the bits it holds (``pmaptap.fingerprint``, fingerprint.py).

What it is: the array's bits taken as 32-bit *words*, folded into 32-bit
*lanes* (each the sum of a bounded run of words, a *fold*, each word
weighted by an odd multiplier of its row), every lane mixed (MurmurHash3's
finalizer, a bijection, salted) and weighted by an odd multiplier of its
position, and summed: twice, with other salts and multipliers, for the two
halves. Integer arithmetic modulo 2**32 only (floats round; NaN != NaN).

What it guarantees: a change confined to one word changes its lane by
``delta * odd``, never 0 modulo 2**32, so it is always detected. Changes in
several lanes collide with a probability of about 2**-64; changes confined
to one lane can cancel in the weighted sum (about 2**-32, more often when
all in the top bits: an even number of flipped sign bits always cancels),
the price of a first pass that is one multiply-add per word. A lane depends
on the platform (what a lane holds per platform and dtype:
docs/api.md, "Silent data corruption"): fingerprints are only compared
within one program, so each platform reads the bits in its memory order.

Why it is shaped this way: it must cost one read of the array, as a float
sum does, and every platform makes a second pass out of something else
(the figures: docs/performance.md, "Fingerprints").

- XLA:CPU keeps arrays dense, row-major: the words reshape for free into
  ``(FOLD, LANES)`` blocks, 32 rows into 1021 lanes (a prime, so a
  power-of-two stride spreads over lanes), one fused loop (a plain
  weighted ``jnp.sum`` was not: docs/performance.md). 8- and 16-bit values
  are packed into words by strided slices taken before their bitcast (a
  bitcast by a reshape to ``(-1, 2)`` was a separate pass; a bitcast
  before the slices broke vectorization);
  bfloat16, whose slices XLA:CPU computes in float32 (slow, not bit-exact
  for NaN payloads), is widened one element to a word, in rows of
  2 x 1021 words. The mixing works on the lanes, not the words.
- XLA:TPU keeps (8, 128) tiles of 32-bit words, so a flat reshape is a
  relayout copy and a minor dimension of 2 pads to 128 lanes. There the
  fold is over the rows as they lie (leading dimensions merged),
  ``FOLD_TPU`` rows of one column to a lane, every element widened inside
  the fused reduction; an optimization barrier after the reshape keeps XLA
  from hoisting the widening out of it (a second pass).
- Elsewhere (GPU) dense as on the CPU, with a fold of ``FOLD_ELSEWHERE``
  rows (why not 32: docs/performance.md).

An element's words (a 64-bit value's halves, a complex value's parts) share
its lane, each with a multiplier of its own (``_fold``); sub-byte dtypes are
widened first (layouts._wire).
"""

from __future__ import annotations

import functools
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pmaptap._trace.layouts import _bits, _sub_byte, _wire

FOLD = 32  # rows summed by one fused loop on XLA:CPU (see above)
# Lanes of the CPU's blocks summed into one before the mixing (its cost:
# docs/performance.md).
REGROUP = 8
FOLD_ELSEWHERE = 256  # on GPUs (see above)
FOLD_TPU = 256  # at most this many rows of a column to a lane on a TPU
LANES = 1021  # words per row of the CPU's (and GPU's) blocks: a prime (see above)
# Below this many bytes every platform takes the CPU's layout (its cost is
# lost in the call's).
SMALL = 1 << 20
# Odd multipliers come from these constants (any odd constants with mixed
# bits would do; these are the golden ratio and MurmurHash3's).
_ROW = np.uint32(0x9E3779B1)
_HALF = (np.uint32(0x85EBCA77), np.uint32(0xC2B2AE3D))
_SALT = (np.uint32(0x27D4EB2F), np.uint32(0x165667B1))


def fingerprint64(x: jax.Array, valid: jax.Array | None = None) -> jax.Array:
    """The fingerprint of ``x`` as uint32[2] (the high and low halves).
    ``valid`` (bool, ``x``'s shape): elements outside it count as zeros
    (the padding of an uneven shard, which is no element of the value)."""
    x = jnp.asarray(x)
    parts = _parts(x)
    if valid is not None:
        valid = jnp.broadcast_to(jnp.asarray(valid, jnp.bool_), x.shape)
    out = jnp.full((2,), np.uint32(x.size % 2**32), jnp.uint32)
    if x.size == 0:
        return out
    cpu = partial(_flat, fold=FOLD, regroup=REGROUP)
    if parts[0].size * parts[0].dtype.itemsize < SMALL:
        return out + cpu(parts, valid)  # the same everywhere
    # The layout that suits the platform the program is compiled for: the
    # fingerprint of given bits is the same wherever that platform runs it
    # (only copies computed by one program are ever compared).
    return out + lax.platform_dependent(
        parts, valid, cpu=cpu, tpu=_tiled_parts, default=partial(_flat, fold=FOLD_ELSEWHERE)
    )


def fingerprint64_many(
    leaves: list[jax.Array],
    valids: list[jax.Array | None] | None = None,
    platform: str | None = None,
) -> jax.Array:
    """``fingerprint64`` of each of ``leaves`` (``valids``: each one's
    ``valid``, or None), as uint32[len(leaves), 2], in a number of hash
    operations that does not grow with the leaves (hashing each on its own made
    compiling a model's parameters' fingerprint markedly slower). Each
    CPU-layout leaf (``_flat``) is read by its own fold (``_split``), then all
    are hashed together (``_cpu_layout``). Where some leaf is big (``SMALL``
    bytes or more), all are one ``platform_dependent``: on the CPU one
    ``_cpu_layout``; elsewhere the small leaves in it and the big ones in
    the platform's layout (on a TPU those of one shape and dtype together,
    ``_tpu_layout``). ``platform``: the one the program is lowered for,
    where the caller knows it (a lowering rule): then only its layout is
    traced."""
    valids = [None] * len(leaves) if valids is None else list(valids)
    leaves = [jnp.asarray(x) for x in leaves]
    valids = [
        None if v is None else jnp.broadcast_to(jnp.asarray(v, jnp.bool_), x.shape)
        for x, v in zip(leaves, valids)
    ]
    ks = [k for k, x in enumerate(leaves) if x.size]
    if not ks:  # every leaf empty: its size alone (fingerprint64's)
        return jnp.stack([fingerprint64(x) for x in leaves])
    args = ([leaves[k] for k in ks], [valids[k] for k in ks])
    if platform == "cpu" or not any(_big(x) for x in args[0]):
        # Every leaf in one ``_cpu_layout``, in order: one hash after the
        # folds (one for the small leaves and one for the big ones, or the
        # rows put back one by one, compiled slower: docs/performance.md).
        fps = _cpu_layout(*args)
    elif platform is None:
        fps = lax.platform_dependent(
            *args, cpu=_cpu_layout, tpu=_by_size(_tpu_layout), default=_by_size(_one_by_one)
        )
    else:
        fps = _by_size(_tpu_layout if platform == "tpu" else _one_by_one)(*args)
    if len(ks) == len(leaves):
        return fps
    # Empty leaves: their fingerprint is their size alone (fingerprint64's).
    rows = [None if x.size else fingerprint64(x) for x in leaves]
    for j, k in enumerate(ks):
        rows[k] = fps[j]
    return jnp.stack(rows)


def _big(x: jax.Array) -> bool:
    """Whether the platform's own layout reads ``x`` (``SMALL`` bytes or more)."""
    part = _parts(x)[0]
    return part.size * part.dtype.itemsize >= SMALL


@functools.cache
def _by_size(layout: Callable) -> Callable:
    """A branch of ``fingerprint64_many`` off the CPU: the leaves below
    ``SMALL`` in the CPU layout, the others in ``layout``, (L, 2) in the
    leaves' order. One function per layout, so that JAX's cache of a
    branch's trace finds it again (another tree of the same types traces
    nothing anew)."""

    def branch(leaves: list, valids: list) -> jax.Array:
        flags = [_big(x) for x in leaves]
        small = [k for k, b in enumerate(flags) if not b]
        big = [k for k, b in enumerate(flags) if b]
        out = layout([leaves[k] for k in big], [valids[k] for k in big])
        if not small:
            return out
        out = jnp.concatenate(
            [_cpu_layout([leaves[k] for k in small], [valids[k] for k in small]), out]
        )
        return out[np.argsort(small + big)]

    return branch


def _one_by_one(leaves: list[jax.Array], valids: list) -> jax.Array:
    """Off the CPU and TPU (a GPU): each leaf's own tiled fold, (L, 2)."""
    fold = partial(_flat, fold=FOLD_ELSEWHERE)
    return jnp.stack([fold(_parts(x), v) for x, v in zip(leaves, valids)]) + _sizes(leaves)


def _sizes(leaves: list[jax.Array]) -> jax.Array:
    """Each leaf's element count modulo 2**32, in both halves (L, 2): the
    start of every fingerprint (``fingerprint64``)."""
    return jnp.stack([jnp.full((2,), np.uint32(x.size % 2**32)) for x in leaves])


# Lanes summed per row before the per-leaf sums in ``_cpu_layout``; each
# leaf's lanes are padded to whole rows (weight 0).
_ROW_LANES = 128


def _cpu_layout(leaves: list[jax.Array], valids: list) -> jax.Array:
    """``fingerprint64`` in the CPU layout (``_flat`` with ``FOLD`` and
    ``REGROUP``) of non-empty leaves, uint32[L, 2], hashed together after
    each leaf's fold (``_split``):

    - the rows of lanes of every leaf's blocks, one after another, each
      leaf's padded to whole groups of ``REGROUP`` rows (weight 0), go
      through ``_regrouped``'s steps at once: per half, salted, xor-shifted,
      each row weighted by an odd multiplier of its row in its group, the
      groups summed; each group's lanes then have the positions ``_half``
      gives them in their leaf;
    - the words past every leaf's last whole block, each its own lane, go
      after them, their positions continuing in their leaf as in ``_flat``;
    - every lane mixed and weighted as ``_half`` does, summed per row of
      ``_ROW_LANES``, then per leaf (``_per_leaf``).

    Built in the program, not from array constants: custom_partitioning
    (fingerprint_jit.py) refuses a function that closes over any."""
    blocks, row_weight, group_leaf, group_index = [], [], [], []
    # The words past the blocks, and per row of ``_ROW_LANES`` of them: its
    # leaf, the position of its first word in that leaf, its words that
    # are not padding (per-row values: the words alone are full size).
    words, row_leaf, row_first, row_count = [], [], [], []

    def add(k: int, word: jax.Array, first: int) -> None:
        n = word.size
        pad = -n % _ROW_LANES
        rows = (n + pad) // _ROW_LANES
        words.append(word)
        if pad:
            words.append(jnp.zeros((pad,), jnp.uint32))
        row_leaf.append(jnp.full((rows,), k, jnp.int32))
        row_first.append(
            lax.iota(jnp.uint32, rows) * np.uint32(_ROW_LANES) + np.uint32(first % 2**32)
        )
        row_count.append(
            jnp.minimum(n - lax.iota(jnp.int32, rows) * _ROW_LANES, _ROW_LANES).astype(jnp.int32)
        )

    for k, (x, valid) in enumerate(zip(leaves, valids)):
        # One fold a leaf, not grouped as on the TPU: on XLA:CPU a vmap of
        # the fold over stacked leaves compiled slower and ran slower
        # (docs/performance.md).
        lanes, tails = _split(_parts(x), None if valid is None else valid.reshape(-1), FOLD)
        first = 0
        if lanes is not None:
            r = lanes.shape[0]
            pad = -r % REGROUP
            blocks.append(lanes)
            row_weight.append(_odd(lax.iota(jnp.uint32, r) % np.uint32(REGROUP), _ROW))
            if pad:
                blocks.append(jnp.zeros((pad, LANES), jnp.uint32))
                row_weight.append(jnp.zeros((pad,), jnp.uint32))
            groups = (r + pad) // REGROUP
            group_leaf.append(jnp.full((groups,), k, jnp.int32))
            group_index.append(lax.iota(jnp.uint32, groups))
            first = r * LANES
        for word in tails:
            add(k, word, first)
            first += word.size
    count = len(leaves)
    out = _sizes(leaves)
    if blocks:
        v = jnp.concatenate(blocks)
        wr = jnp.concatenate(row_weight)[:, None]
        # Each group's lane at column c of group g of its leaf: position
        # g * LANES + c (``_regrouped``'s ``_half`` calls).
        cell = jnp.concatenate(group_index)[:, None] * np.uint32(LANES) + lax.iota(
            jnp.uint32, LANES
        )
        halves = []
        for h in (0, 1):
            w = v ^ _SALT[h]
            w = (w ^ (w >> 16)) * wr
            u = jnp.sum(w.reshape(-1, REGROUP, LANES), axis=1, dtype=jnp.uint32)
            halves.append(jnp.sum(_fmix(u ^ _SALT[h]) * _odd(cell, _HALF[h]), axis=1))
        out = out + _per_leaf(jnp.stack(halves, axis=1), jnp.concatenate(group_leaf), count)
    if words:
        w = jnp.concatenate(words).reshape(-1, _ROW_LANES)
        column = lax.broadcasted_iota(jnp.int32, w.shape, 1)
        cell = jnp.concatenate(row_first)[:, None] + column.astype(jnp.uint32)
        real = column < jnp.concatenate(row_count)[:, None]
        halves = [
            jnp.sum(
                jnp.where(real, _fmix(w ^ _SALT[h]) * _odd(cell, _HALF[h]), np.uint32(0)),
                axis=1,
                dtype=jnp.uint32,
            )
            for h in (0, 1)
        ]
        out = out + _per_leaf(jnp.stack(halves, axis=1), jnp.concatenate(row_leaf), count)
    return out


def _per_leaf(sums: jax.Array, leaf: jax.Array, count: int) -> jax.Array:
    """Rows of sums (r, 2) added up per leaf (``leaf``: each row's, in
    order), (count, 2): integer sums modulo 2**32, exact in any order."""
    out = jax.ops.segment_sum(sums, leaf, num_segments=count, indices_are_sorted=True)
    return out.astype(jnp.uint32)


def _parts(x: jax.Array) -> list[jax.Array]:
    """``x`` as arrays whose elements are 1, 2, 4 or 8 bytes of its bits
    (complex: the real and imaginary parts; bool as bytes; sub-byte dtypes
    widened exactly)."""
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return [jnp.real(x), jnp.imag(x)]
    if _sub_byte(x.dtype):
        return [_wire(x)]
    return [x]


def _mask(u: jax.Array, valid: jax.Array | None) -> jax.Array:
    return u if valid is None else jnp.where(valid, u, jnp.zeros((), u.dtype))


def _words(u: jax.Array) -> list[jax.Array]:
    """Unsigned elements as 32-bit words, one per element (two for 64-bit
    ones: their halves, as planes of their own)."""
    if u.dtype == jnp.uint64:
        low = (u & np.uint64(0xFFFFFFFF)).astype(jnp.uint32)
        return [low, (u >> np.uint64(32)).astype(jnp.uint32)]
    return [u.astype(jnp.uint32)]


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
    """Both halves of the fingerprint of lanes ``v`` (any shape) whose
    positions are ``first`` plus their row-major index (uint32[2])."""
    return jnp.stack([_half(v, first, h) for h in (0, 1)])


def _half(v: jax.Array, first: int, h: int) -> jax.Array:
    """Half ``h`` of the fingerprint of lanes ``v``: each lane mixed (with
    the half's salt) and weighted by an odd multiplier of its position."""
    cell = jnp.full(v.shape, np.uint32(first % 2**32), jnp.uint32)
    stride = 1
    for d in reversed(range(v.ndim)):
        cell = cell + lax.broadcasted_iota(jnp.uint32, v.shape, d) * np.uint32(stride % 2**32)
        stride *= v.shape[d]
    return jnp.sum(_fmix(v ^ _SALT[h]) * _odd(cell, _HALF[h]), dtype=jnp.uint32)


def _fold(planes: list[jax.Array], axis: int) -> jax.Array:
    """Words summed over ``axis`` (the fold), each weighted by an odd
    multiplier of its row there. Several planes of words of one shape (a
    64-bit value's halves, a complex value's parts) are folded together, in
    one pass, as if their rows were interleaved: plane ``p`` of row ``r`` is
    row ``r * len(planes) + p`` of the fold."""
    shape = [1] * planes[0].ndim
    shape[axis] = planes[0].shape[axis]
    row = lax.broadcasted_iota(jnp.uint32, tuple(shape), axis) * np.uint32(len(planes))
    total = None
    for p, words in enumerate(planes):
        term = words * _odd(row + np.uint32(p), _ROW)
        total = term if total is None else total + term
    return jnp.sum(total, axis=axis, dtype=jnp.uint32)


# ------------------------------------------------------------ CPU and GPU


def _flat(
    parts: list[jax.Array],
    valid: jax.Array | None,
    fold: int,
    regroup: int = 1,
    first: int = 0,
) -> jax.Array:
    """Dense row-major layouts: the flat elements in blocks of ``fold`` rows
    x ``LANES`` words, whose lanes are folded again ``regroup`` at a time
    (the words past the last whole block: each its own lane), their
    positions counted from ``first`` (``_split`` says how)."""
    lanes, tails = _split(parts, None if valid is None else valid.reshape(-1), fold)
    out = jnp.zeros((2,), jnp.uint32)
    if lanes is not None:
        out = out + _regrouped(lanes, regroup, first)
        first += lanes.size
    for word in tails:
        out = out + _lanes(word, first)
        first += word.size
    return out


def _split(
    parts: list[jax.Array], ok: jax.Array | None, fold: int
) -> tuple[jax.Array | None, list[jax.Array]]:
    """(the rows of lanes of the whole blocks of ``fold`` rows x ``LANES``
    words, (r, LANES), or None; the words past the last whole block, each
    its own lane, as planes in order) of ``_flat``'s layout; ``ok`` the
    flat valid mask. Every word of an element (the halves of a 64-bit one,
    the parts of a complex one) goes to the same lane, in the same pass
    (``_fold``): one plane per pass read the array once per plane, a
    float32 sum's time for each (docs/performance.md)."""
    x = parts[0]
    n, size = x.size, x.dtype.itemsize
    # Elements to a word; bfloat16 is widened, a row's two halves two rows
    # of lanes (module docstring).
    per = 1 if x.dtype == jnp.bfloat16 else max(1, 4 // size)
    pair = 2 if x.dtype == jnp.bfloat16 else 1
    if per == 1:
        # Bitcast before any slice: it stays in the fused loop, and
        # XLA:CPU would compute bfloat16 slices in float32.
        planes = [w for part in parts for w in _words(_mask(_bits(part.reshape(-1)), ok))]
    else:
        flat = x.reshape(-1)  # packed: sliced before any bitcast (below)
    block = fold * LANES * per * pair
    main = n - n % block
    lanes = None
    if main:
        if per > 1:
            # Strided slices of the row first, each then bitcast and
            # shifted into its byte(s) of the word (module docstring).
            rows = flat[:main].reshape(-1, fold, LANES * per)
            ok_rows = None if ok is None else ok[:main].reshape(rows.shape)
            word = None
            for j in range(per):
                bits = _bits(rows[:, :, j::per])
                bits = _mask(bits, None if ok_rows is None else ok_rows[:, :, j::per])
                bits = bits.astype(jnp.uint32) << np.uint32(8 * size * j)
                word = bits if word is None else word | bits
            lanes = _fold([word], 1)
        else:
            lanes = _fold([w[:main].reshape(-1, fold, LANES * pair) for w in planes], 1)
        # Rows of lanes (a bfloat16 row's two halves are two rows).
        lanes = lanes.reshape(-1, LANES)
    tails: list[jax.Array] = []
    if main < n:
        if per > 1:
            tails = _words(_mask(_bits(flat[main:]), None if ok is None else ok[main:]))
        else:
            tails = [w[main:] for w in planes]
    return lanes, tails


def _regrouped(v: jax.Array, regroup: int, first: int) -> jax.Array:
    """Both halves of the fingerprint of rows of lanes ``v`` (r, LANES),
    ``regroup`` rows summed into one before the mixing: each weighted by an
    odd multiplier of its row there, after a xor-shift (a bijection that
    moves a lane's top bits down, so that flipped sign bits in two of the
    rows do not cancel as they would in one). The mixing then costs
    1/``regroup`` of what it did. Each half sums on its own: the lanes then
    have two readers, which keeps XLA:CPU from fusing the first fold into
    the second (one loop that no longer ran along the lanes: far slower)."""
    if regroup == 1:
        return _lanes(v, first)
    main = v.shape[0] - v.shape[0] % regroup
    halves = []
    for h in (0, 1):
        w = v ^ _SALT[h]
        w = w ^ (w >> 16)
        total = jnp.zeros((), jnp.uint32)
        if main:
            total = total + _half(_fold([w[:main].reshape(-1, regroup, LANES)], 1), first, h)
        if main < v.shape[0]:
            total = total + _half(_fold([w[main:]], 0), first + main // regroup * LANES, h)
        halves.append(total)
    return jnp.stack(halves)


# ------------------------------------------------------------ TPU


# The most bytes of leaves of one shape stacked to be hashed together by
# ``_tpu_layout`` (a copy on the device while the hash runs).
GROUP_MAX_BYTES = 256 << 20


def _tpu_layout(leaves: list[jax.Array], valids: list) -> jax.Array:
    """``fingerprint64`` in the TPU layout of non-empty leaves, uint32[L, 2],
    the leaves of one shape hashed together (``_each_grouped``)."""
    rows = _each_grouped(leaves, valids, lambda x, v: _tiled_parts(_parts(x), v))
    return jnp.stack(rows) + _sizes(leaves)


def _each_grouped(leaves: list[jax.Array], valids: list, fn: Callable) -> list:
    """``fn(leaf, valid)`` of every leaf, the leaves of one shape and dtype
    (most of a model's: every block's) stacked, up to ``GROUP_MAX_BYTES``,
    under one ``vmap`` of ``fn``: the same values as one by one (a vmap
    changes no arithmetic), in one fold for the group. A fold a leaf made a
    model's fingerprint a large part of its step's compile time
    (docs/performance.md). A leaf with a mask (an uneven shard) is its own."""
    out: list = [None] * len(leaves)
    groups: dict[tuple, list[list[int]]] = {}
    for k, (x, valid) in enumerate(zip(leaves, valids)):
        if valid is not None:
            out[k] = fn(x, valid)
            continue
        chunks = groups.setdefault((x.shape, jnp.dtype(x.dtype)), [[]])
        over = (len(chunks[-1]) + 1) * x.size * jnp.dtype(x.dtype).itemsize > GROUP_MAX_BYTES
        if chunks[-1] and over:
            chunks.append([])
        chunks[-1].append(k)
    for chunks in groups.values():
        for ks in chunks:
            if len(ks) == 1:
                out[ks[0]] = fn(leaves[ks[0]], None)
                continue
            got = jax.vmap(lambda x: fn(x, None))(jnp.stack([leaves[k] for k in ks]))
            for j, k in enumerate(ks):
                out[k] = jax.tree.map(lambda a, j=j: a[j], got)
    return out


def _tile_rows(dtype) -> int:
    """Rows of one (8, 128) tile of 32-bit sublanes in XLA:TPU's layout."""
    return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


def _tiled_parts(parts: list[jax.Array], valid: jax.Array | None) -> jax.Array:
    """Each part (a complex value's real and imaginary parts) read in place
    as ``_tiled`` reads it, with lanes of its own."""
    out, first = jnp.zeros((2,), jnp.uint32), 0
    for part in parts:
        out = out + _tiled(part, valid, first)
        first += 2 * part.size  # at most two lanes to an element
    return out


def _tiled(x: jax.Array, valid: jax.Array | None, first: int = 0) -> jax.Array:
    """XLA:TPU's tiled layout: the array as (leading, rows, columns), each
    run of up to ``FOLD_TPU`` rows of a column one lane (module docstring),
    their positions counted from ``first``."""
    if x.ndim == 1:
        if x.shape[0] % 128:
            return _flat([x], valid, FOLD_ELSEWHERE, first=first)  # no tiles to read in place
        x = x.reshape(-1, 128)
        valid = None if valid is None else valid.reshape(x.shape)
    rows, cols = x.shape[-2], x.shape[-1]
    fold = _tpu_fold(rows, _tile_rows(x.dtype))
    shape = (-1, rows // fold, fold, cols)
    # Reshapes that only merge leading dimensions or split the rows at a
    # whole number of tiles: the buffer read in place.
    x = lax.optimization_barrier(x.reshape(shape))
    ok = None if valid is None else valid.reshape(shape)
    # A 64-bit value's two halves go to one lane, in one pass (as on the CPU).
    return _lanes(_fold(_words(_mask(_bits(x), ok)), 2), first)


def _tpu_fold(rows: int, tile: int) -> int:
    """The rows to a lane: the largest whole number of tiles up to
    ``FOLD_TPU`` that divides ``rows``; all of them where none does (a
    column is then one lane)."""
    for fold in range(FOLD_TPU - FOLD_TPU % tile, 0, -tile):
        if rows % fold == 0:
            return fold
    return rows
