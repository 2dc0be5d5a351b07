"""pmaptap.fingerprint of many leaves (issue 59, items 2 and 3): the whole
tree hashed together (fphash.fingerprint64_many) must write exactly the
records that hashing leaf by leaf wrote, and the program must not grow by
a handful of hash operations per leaf, nor compute any of them on a step
where the fingerprint is skipped.

The pinned digests below were written by the code before the change
(commit ddbb1fc, each leaf its own ``fingerprint64``), running
``_records`` on 8 simulated CPU devices."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pmaptap
from pmaptap._trace.fphash import SMALL, fingerprint64, fingerprint64_many

# Leaves of every kind of layout: whole blocks and a tail, a tail only,
# scalars, an empty one, a big one (>= fphash.SMALL: the platform's layout).
SHAPES = ((64, 33), (7,), (), (0, 3), (3, 5, 7), (300, 200), (1, 32 * 1021 * 2 + 3))
DTYPES = ("float32", "bfloat16", "float16", "int8", "uint8", "bool", "complex64", "int4", "int32")
WIDE = ("uint64", "int64", "float64", "complex128")  # under x64


def _leaf(dtype: str, shape: tuple, seed: int) -> np.ndarray:
    """Deterministic bits of every byte value (bool: 0/1, int4: -8..7)."""
    n = int(np.prod(shape))
    dt = jnp.dtype(dtype)
    raw = (np.arange(n * 16, dtype=np.uint64) * 2654435761 + seed * 97) >> np.uint64(7)
    raw = (raw % 251).astype(np.uint8)
    if dt == jnp.bool_:
        return (raw[:n] % 2 == 1).reshape(shape)
    if dtype == "int4":
        return (raw[:n] % 16).astype(np.int8).reshape(shape) - 8
    x = raw[: n * dt.itemsize].view(dt).reshape(shape)
    if jnp.issubdtype(dt, jnp.inexact):
        # Finite: how XLA carries a NaN's payload bits through a copy differs
        # between JAX releases (0.10 and 0.12 do not agree), so a NaN would
        # pin a digest of one release, not pmaptap's.
        x = np.where(np.isfinite(x), x, np.zeros((), dt))
    return x


def _tree(dtypes, seed: int = 0) -> dict:
    return {
        f"{d}_{i}": jnp.asarray(_leaf(d, s, seed + i), jnp.dtype(d))
        for d in dtypes
        for i, s in enumerate(SHAPES)
    }


def _digests(path: str) -> list[tuple]:
    out = []
    for r in pmaptap.read(path):
        if r["kind"] == "fingerprint":
            out.append((r["name"], r["step"], r["fingerprint"], bool(r.get("divergent"))))
    return sorted(out)


def _records(path: str, wrap) -> list[tuple]:
    """A session's fingerprint records (name, step, digest, divergent) of
    trees of every dtype: under jit on a 4x2 mesh (replicated, sharded,
    uneven slices and a big leaf per shard), under pmap, and under x64."""
    session = pmaptap.Session(path, run="pin").open()
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    rows = NamedSharding(mesh, P("data"))

    def step(t, s):
        t = jax.tree.map(lambda x: x if x.ndim < 2 else lax.with_sharding_constraint(x, rows), t)
        pmaptap.fingerprint(t, "jit", step=s)
        big = jnp.arange(2048 * 520, dtype=jnp.float32).reshape(2048, 520)  # > SMALL
        pmaptap.fingerprint({"big": big, "uneven": t["float32_0"][:6, :5]}, "big", step=s)
        return t

    wrap(step)(_tree(DTYPES), 0)
    pm = jax.pmap(
        lambda i, t, s: pmaptap.fingerprint(t, "pmap", step=s), "i", in_axes=(0, None, None)
    )
    pm(jnp.arange(8), _tree(("float32", "bfloat16", "int8", "bool"), seed=5), 1)
    with jax.enable_x64(True):
        wrap(lambda t, s: pmaptap.fingerprint(t, "x64", step=s))(_tree(WIDE, seed=9), 2)
    session.close()
    return _digests(path)


# Written by ``_records`` with the code before fingerprint64_many (see the
# module docstring); equal under jax.jit and pmaptap.jit.
PINNED = [
    ("big", 0, "293719312778fbe9", False),
    ("jit", 0, "38613c79449eb37b", False),
    ("pmap", 1, "dd2ad0d67c90cbf8", False),
    ("x64", 2, "750428c4ad0261d5", False),
]


@pytest.mark.parametrize("wrap", [jax.jit, pmaptap.jit], ids=["jax.jit", "pmaptap.jit"])
def test_records_are_those_the_leaf_by_leaf_hash_wrote(tmp_path, wrap):
    got = _records(str(tmp_path / "fp.jsonl"), wrap)
    assert got == PINNED


def test_fingerprint64_many_equals_each_leafs_fingerprint64():
    # Big leaves too (>= SMALL: the platform's layout, one
    # platform_dependent for all of them).
    big = [_leaf(d, (1024, 1100), 3) for d in ("float32", "bfloat16", "int8")]
    leaves = list(_tree(DTYPES).values()) + [jnp.asarray(x) for x in big]
    valids = [
        None if i % 2 else jnp.arange(x.size).reshape(x.shape) % 3 != 0
        for i, x in enumerate(leaves)
    ]
    assert any(x.size * x.dtype.itemsize >= SMALL for x in leaves)
    many = np.asarray(jax.jit(fingerprint64_many)(leaves, valids))
    # Each leaf hashed by fingerprint64 alone, its own computation: all of
    # them in one program (one compile, not one per leaf's shape and dtype).
    each = jax.jit(lambda ls, vs: [fingerprint64(x, v) for x, v in zip(ls, vs)])(leaves, valids)
    np.testing.assert_array_equal(many, np.stack([np.asarray(e) for e in each]))


@pytest.mark.parametrize("platform", ["tpu", "default"])
def test_the_other_platforms_branches_give_each_leafs_own_fingerprint(platform):
    # fingerprint64_many's branches for a TPU and for other platforms (run
    # here on the CPU: the same integer arithmetic): the small leaves in
    # the CPU layout, the big ones in the platform's, as fingerprint64 and
    # the platform's layout give each leaf alone, in the leaves' order.
    from pmaptap._trace import fphash

    small = list(_tree(DTYPES).values())
    big = [jnp.asarray(_leaf(d, (1024, 1100), 3)) for d in ("float32", "bfloat16", "int8")]
    leaves = big[:1] + small + big[1:]
    valids = [
        None if i % 2 else jnp.arange(x.size).reshape(x.shape) % 3 != 0
        for i, x in enumerate(leaves)
    ]
    layout = {"tpu": fphash._tpu_layout, "default": fphash._one_by_one}[platform]
    got = jax.jit(fphash._by_size(layout))(leaves, valids)

    def alone(x, v, is_big):
        if not is_big:
            return fingerprint64(x, v)
        if platform == "tpu":
            return fphash._tiled_parts(fphash._parts(x), v) + x.size
        return fphash._flat(fphash._parts(x), v, fphash.FOLD_ELSEWHERE) + x.size

    flags = [x.size * x.dtype.itemsize >= SMALL for x in leaves]
    assert flags[0] and not flags[1] and flags[-1]
    each = jax.jit(lambda ls, vs: [alone(x, v, b) for x, v, b in zip(ls, vs, flags)])(
        leaves, valids
    )
    want = np.stack([np.asarray(e).astype(np.uint32) for e in each])
    np.testing.assert_array_equal(np.asarray(got), want)


def test_small_leaves_beside_big_ones_join_their_hash():
    # On the CPU the small leaves are hashed with the big ones, after the
    # folds, by one hash: adding them adds no reductions (a second hash of
    # their own compiled ~2x slower).
    big = [jnp.zeros((1024, 1100), jnp.float32) for _ in range(2)]
    small = [jnp.zeros((64,), jnp.float32) for _ in range(12)]
    assert _reductions(big + small) == _reductions(big)


@pytest.mark.parametrize("wrap", [jax.jit, pmaptap.jit], ids=["jax.jit", "pmaptap.jit"])
def test_a_lowering_traces_only_its_platforms_layout(monkeypatch, tmp_path, wrap):
    # The lowering knows the platform (here the CPU): the TPU's and other
    # platforms' layouts of big leaves are not traced at all (with
    # platform_dependent every one was, and the program compiled slower).
    from pmaptap._trace import fphash

    traced = []

    def spy(name, layout):
        def traced_layout(*args):
            traced.append(name)
            return layout(*args)

        return traced_layout

    monkeypatch.setattr(fphash, "_tpu_layout", spy("tpu", fphash._tpu_layout))
    monkeypatch.setattr(fphash, "_one_by_one", spy("default", fphash._one_by_one))
    tree = [jnp.ones((1024, 1100), jnp.float32), jnp.ones((64,), jnp.float32)]
    with pmaptap.Session(str(tmp_path / "fp.jsonl")):
        out = wrap(lambda t: pmaptap.fingerprint(t, "p", step=0))(tree)
        jax.block_until_ready(out)
    assert traced == []
    # The values are the CPU layout's, as before (PINNED, whose "big" tree
    # has a big leaf); here: the record was written.
    assert [d[0] for d in _digests(str(tmp_path / "fp.jsonl"))] == ["p"]


def _reductions(tree) -> int:
    """Reductions in the compiled program of a step fingerprinting ``tree``."""
    txt = jax.jit(lambda t: pmaptap.fingerprint(t, "n")).lower(tree).compile().as_text()
    return len(re.findall(r" (?:reduce|reduce-window)\(", txt))


@pytest.mark.parametrize("shape, dtype", [((64,), jnp.float32), ((16, 16), jnp.bfloat16)])
def test_small_leaves_add_no_hash_operations(shape, dtype):
    # Leaves without a whole block of the layout: hashed together, the
    # same reductions for 2 leaves as for 12 (each leaf added 4 before).
    def tree(n):
        return [jnp.zeros(shape, dtype) for _ in range(n)]

    assert _reductions(tree(12)) == _reductions(tree(2))


def test_leaves_with_blocks_add_their_fold_only():
    # Each leaf's blocks are read by a fold of its own (one pass over its
    # bits); everything after it is hashed together (11 reductions a leaf
    # before).
    def tree(n):
        return [jnp.zeros((300, 200), jnp.float32) for _ in range(n)]

    assert _reductions(tree(12)) - _reductions(tree(2)) <= 2 * 10


def test_tpu_layout_hashes_leaves_of_one_shape_together_and_alike():
    # The TPU's layout of big leaves (run here on the CPU: the same integer
    # arithmetic): leaves of one shape and dtype stacked and hashed by one
    # vmap give each leaf's own fingerprint, with masks, odd shapes and
    # every dtype; and the hash operations no longer grow with such leaves.
    from pmaptap._trace import fphash

    shapes = ((64, 256), (3, 16, 128), (256,), (300,), (40, 33))
    leaves, valids = [], []
    for i, (d, s) in enumerate((d, s) for d in DTYPES for s in shapes for _ in range(3)):
        leaves.append(jnp.asarray(_leaf(d, s, i), jnp.dtype(d)))
        valids.append(None if i % 4 else jnp.arange(np.prod(s)).reshape(s) % 3 != 0)
    grouped = np.asarray(jax.jit(fphash._tpu_layout)(leaves, valids))

    def each(x, v):
        return fphash._tiled_parts(fphash._parts(x), v) + x.size % 2**32

    # Each leaf hashed alone, its own computation: all of them in one
    # program (one compile, not one per leaf's shape, dtype and mask).
    alone = jax.jit(lambda ls, vs: [each(x, v) for x, v in zip(ls, vs)])(leaves, valids)
    want = np.stack([np.asarray(a).astype(np.uint32) for a in alone])
    np.testing.assert_array_equal(grouped, want)

    def reductions(n: int) -> int:
        tree = [jnp.zeros((64, 256), jnp.float32) for _ in range(n)]
        txt = jax.jit(fphash._tpu_layout).lower(tree, [None] * n).compile().as_text()
        return len(re.findall(r" (?:reduce|reduce-window)\(", txt))

    assert reductions(12) == reductions(2)
