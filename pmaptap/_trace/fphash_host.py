"""``fphash.fingerprint64_many`` in the CPU layout (``_cpu_layout``),
computed by NumPy on the host from the bytes a CPU device holds: the same
numbers, with no program to compile.

Why a second implementation of one definition: under ``pmaptap.jit`` on a
CPU device the program that hashes a step's outputs (_outputs/later.py)
compiled for as long as a big fraction of the step's own compile, while the
arrays it reads already lie in host memory (figures: docs/performance.md,
"Compile time and skipped steps"). The definition stays fphash's; this is
its CPU layout read with NumPy's integer arithmetic (modulo 2**32, as XLA's),
and tests/trace/test_fphash_host.py checks that both give the same numbers
for every dtype and every part of the layout (whole blocks, the rows padded
to ``REGROUP``, the words past the blocks).

How it stays one read of each array: a block's fold is one ``einsum`` over
the words as they lie (an element of two or four 32-bit words, a 64-bit or
complex value, keeps its words side by side, each weighted as its plane in
``fphash._fold``; 8- and 16-bit values are read as the little-endian words
``fphash._split`` packs them into); everything after the fold works on
1/``FOLD`` of the words, for all leaves at once.
"""

from __future__ import annotations

import sys
import threading
from typing import Sequence

import numpy as np

from pmaptap._trace.fphash import _HALF, _ROW, _SALT, FOLD, LANES, REGROUP

# The packed and multi-word reads below are little-endian views of the
# bytes; XLA's words are the same there (every platform JAX runs on).
SUPPORTED = sys.byteorder == "little"
_U32 = np.uint32


def _program_only() -> frozenset:
    """8-bit floats with several NaN encodings (IEEE-like): XLA:CPU's
    program reads their NaNs canonicalized where it packs whole blocks (its
    slices convert them), the host as they lie, so the numbers would differ;
    a tree holding one is always hashed by the program (_outputs/later.py)."""
    import ml_dtypes

    names = ("float8_e5m2", "float8_e4m3", "float8_e3m4")
    return frozenset(np.dtype(getattr(ml_dtypes, n)) for n in names if hasattr(ml_dtypes, n))


PROGRAM_ONLY = _program_only()


def fingerprints(leaves: Sequence[np.ndarray]) -> np.ndarray:
    """``fphash.fingerprint64_many(leaves, platform="cpu")`` of host arrays
    (NumPy, or ml_dtypes' narrow types), uint32[len(leaves), 2]."""
    if not SUPPORTED:
        raise NotImplementedError("the host's fingerprint reads little-endian words")
    arrays = [np.ascontiguousarray(x) for x in leaves]
    splits = [_split(x) if x.size else (None, 1, []) for x in arrays]
    key = tuple((x.shape, x.dtype) for x in arrays)
    with _plans_lock:  # (steps of several threads)
        plan = _plans.get(key)
    if plan is None:
        plan = _Plan(arrays, splits)
        with _plans_lock:
            _plans[key] = plan
            if len(_plans) > 16:  # trees of other shapes: keep the recent ones
                del _plans[next(iter(_plans))]
    out = plan.sizes.copy()
    with np.errstate(over="ignore"):
        if plan.groups:
            v = np.zeros((plan.groups * REGROUP, LANES), _U32)
            for (blocks, planes, _), at in zip((splits[k] for k in plan.folded), plan.rows_at):
                lanes = blocks.shape[0] * blocks.shape[2] // planes
                _fold(blocks, planes, v[at : at + lanes // LANES])
            for h in (0, 1):
                w = v ^ _SALT[h]
                w ^= w >> _U32(16)
                u = np.einsum("grl,gr->gl", w.reshape(-1, REGROUP, LANES), plan.row_weights)
                sums = (_fmix(u ^ _SALT[h]) * plan.cells("groups", h)).sum(axis=1, dtype=_U32)
                out[plan.folded, h] += np.add.reduceat(sums, plan.group_starts, dtype=_U32)
        if plan.tailed:
            w = np.concatenate([word for k in plan.tailed for word in splits[k][2]])
            for h in (0, 1):
                mixed = _fmix(w ^ _SALT[h]) * plan.cells("tails", h)
                out[plan.tailed, h] += np.add.reduceat(mixed, plan.tail_starts, dtype=_U32)
    return out


class _Plan:
    """What the hash of a tree of given shapes and dtypes adds up besides
    the words themselves (made once per tree: it is most of the work for
    small leaves): each leaf's element count; the leaves with whole blocks
    (``folded``), where their rows of lanes start among all of them (each
    leaf's padded to whole groups of ``REGROUP`` rows, weight 0), each row's
    weight in its group, each group's lanes' multipliers per half (their
    position in their leaf) and where each leaf's groups start; the same
    for the words past the blocks, each its own lane (``tailed``)."""

    def __init__(self, arrays: list[np.ndarray], splits: list) -> None:
        with np.errstate(over="ignore"):
            self.sizes = np.array([[x.size % 2**32] * 2 for x in arrays], _U32).reshape(-1, 2)
            self.folded, self.rows_at, weights, starts, index = [], [], [], [], []
            self.tailed, tail_starts, tail_positions = [], [], []
            groups = words = 0
            for k, (blocks, planes, rest) in enumerate(splits):
                lanes = 0
                if blocks is not None:
                    lanes = blocks.shape[0] * blocks.shape[2] // planes
                    r = lanes // LANES
                    g = -(-r // REGROUP)
                    self.folded.append(k)
                    self.rows_at.append(groups * REGROUP)
                    starts.append(groups)
                    w = np.zeros(g * REGROUP, _U32)
                    w[:r] = _odd(np.arange(r, dtype=_U32) % _U32(REGROUP), _ROW)
                    weights.append(w)
                    index.append(np.arange(g, dtype=_U32))
                    groups += g
                if rest:
                    self.tailed.append(k)
                    tail_starts.append(words)
                    n = sum(word.size for word in rest)
                    tail_positions.append((lanes, n))
                    words += n
            self.groups = groups
            self._group_index = self._tail_positions = None
            self._cells: dict[tuple[str, int], np.ndarray] = {}
            if groups:
                self.row_weights = np.concatenate(weights).reshape(-1, REGROUP)
                self._group_index = np.concatenate(index)
                self.group_starts = np.array(starts)
            if words:
                self._tail_positions = tail_positions
                self.tail_starts = np.array(tail_starts)

    def cells(self, part: str, h: int) -> np.ndarray:
        """The multipliers in half ``h`` of each group's lanes (``part``
        "groups": groups x LANES) or of each word past the blocks
        ("tails"), kept for the next hash of this tree where they are small
        (a tree of many small leaves has as many multipliers as words: kept,
        they would double what the hash holds)."""
        got = self._cells.get((part, h))
        if got is None:
            with np.errstate(over="ignore"):
                if part == "groups":
                    lane = np.arange(LANES, dtype=_U32)
                    cell = self._group_index[:, None] * _U32(LANES) + lane
                else:
                    pieces = [np.arange(a, a + n, dtype=np.uint64) for a, n in self._tail_positions]
                    cell = (np.concatenate(pieces) % 2**32).astype(_U32)
                got = _odd(cell, _HALF[h])
            if got.nbytes <= KEPT_BYTES:
                self._cells[part, h] = got
        return got


# Multipliers of a tree kept between its hashes up to this size each.
KEPT_BYTES = 4 << 20


# Plans of the trees hashed lately, by the leaves' shapes and dtypes.
_plans: dict[tuple, _Plan] = {}
_plans_lock = threading.Lock()


def _odd(index: np.ndarray, k: np.uint32) -> np.ndarray:
    return index * k | _U32(1)


def _fmix(h: np.ndarray) -> np.ndarray:
    """fphash._fmix (MurmurHash3's finalizer)."""
    h = h ^ (h >> _U32(16))
    h *= _U32(0x85EBCA6B)
    h ^= h >> _U32(13)
    h *= _U32(0xC2B2AE35)
    h ^= h >> _U32(16)
    return h


def _bits(x: np.ndarray) -> np.ndarray:
    """fphash's ``_bits`` of a part: unsigned integers of its width (bool
    as bytes; sub-byte dtypes widened exactly first, as ``layouts._wire``)."""
    if x.dtype == np.bool_:
        return x.view(np.uint8)
    x = _wire(x)
    if x.dtype.itemsize > 8:  # complex128: its words (only ever viewed so)
        return x.view(_U32)
    return x.view({1: np.uint8, 2: np.uint16, 4: _U32, 8: np.uint64}[x.dtype.itemsize])


def _wire(x: np.ndarray) -> np.ndarray:
    """``layouts._wire``: a sub-byte array (NumPy keeps one a byte) widened
    exactly to int8/uint8 or float32."""
    import ml_dtypes

    if x.dtype.itemsize != 1 or x.dtype == np.bool_:
        return x
    for info in (ml_dtypes.iinfo, ml_dtypes.finfo):
        try:
            bits = info(x.dtype).bits
        except ValueError:
            continue
        if bits >= 8:
            return x
        break
    else:
        return x
    name = x.dtype.name
    if name.startswith("int"):
        return x.astype(np.int8)
    if name.startswith("uint"):
        return x.astype(np.uint8)
    return x.astype(np.float32)


def _split(x: np.ndarray) -> tuple[np.ndarray | None, int, list[np.ndarray]]:
    """``fphash._split`` of ``x``'s parts, before the fold: (its whole
    blocks as (B, FOLD, W) words, or None; words to an element, ``planes``:
    ``_fold`` of the blocks gives B * W / planes lanes, in rows of LANES;
    the words past the blocks, as planes in order)."""
    import ml_dtypes

    n = x.size
    if x.dtype.itemsize >= 4 and x.dtype != np.bool_:
        # Elements of one or more 32-bit words (a 64-bit value's halves, a
        # complex value's real then imaginary words), side by side as they
        # lie: the planes fphash folds together.
        planes = x.dtype.itemsize // 4
        return _blocks(_bits(x.reshape(-1)).view(_U32).reshape(n, planes), planes)
    bits = _bits(x.reshape(-1))
    if bits.dtype.itemsize == 4:  # a sub-byte float, widened to float32 (``_wire``)
        return _blocks(bits.view(_U32).reshape(n, 1), 1)
    # bfloat16 is widened one element to a word, a row's two halves two
    # rows of lanes: its blocks are its own 16-bit values (the fold's einsum
    # widens them as it reads). Other 8- and 16-bit values are packed ``per``
    # to a word, little-endian (fphash's shifts): a view of their bytes.
    wide = x.dtype == ml_dtypes.bfloat16
    per = 2 if wide else 4 // bits.dtype.itemsize
    main = n - n % (FOLD * LANES * per)
    blocks = None
    if main:
        blocks = bits[:main] if wide else bits[:main].view(_U32)
        blocks = blocks.reshape(-1, FOLD, LANES * (2 if wide else 1))
    return blocks, 1, [bits[main:].astype(_U32)] if main < n else []


def _blocks(words: np.ndarray, planes: int) -> tuple[np.ndarray | None, int, list[np.ndarray]]:
    """``_split`` of ``n`` elements of ``planes`` 32-bit words each (words:
    (n, planes)): the words past the blocks one plane after another
    (fphash's order: a 64-bit value's low halves, then its high halves; a
    complex value's real words, then its imaginary ones)."""
    n = words.shape[0]
    main = n - n % (FOLD * LANES)
    blocks = words[:main].reshape(-1, FOLD, LANES * planes) if main else None
    rest = [np.ascontiguousarray(words[main:, p]) for p in range(planes)] if main < n else []
    return blocks, planes, rest


def _fold(words: np.ndarray, planes: int, out: np.ndarray) -> None:
    """``fphash._fold`` of blocks (B, FOLD, W) whose elements are
    ``planes`` consecutive words, into ``out``'s rows of lanes: each word
    weighted by an odd multiplier of row ``r * planes + p``, summed over the
    rows, and an element's words added into its lane."""
    weights = _rows(planes)
    b, _, width = words.shape
    if planes == 1:  # (16-bit words: bfloat16's, widened as read)
        np.einsum("brl,r->bl", words, weights[:, 0], out=out.reshape(b, width))
        return
    each = np.einsum("brm,rm->bm", words, np.tile(weights, (1, width // planes)))
    each.reshape(b, -1, planes).sum(axis=2, dtype=_U32, out=out.reshape(b, -1))


def _rows(planes: int) -> np.ndarray:
    """The fold's multipliers, (FOLD, planes): row ``r``, plane ``p``."""
    with np.errstate(over="ignore"):
        return _odd(np.arange(FOLD * planes, dtype=_U32), _ROW).reshape(FOLD, planes)
