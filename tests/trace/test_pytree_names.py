"""Pytrees keep their names (issue 26, point 4): the key paths of custom
pytree nodes become object keys in a record's value/dtype/shape nesting, as
dicts already do; list-like nodes stay arrays."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

import pmaptap

pytestmark = pytest.mark.usefixtures("transport")


class Named:
    """A register_pytree_with_keys node keyed by DictKey and GetAttrKey."""

    def __init__(self, a, b):
        self.a, self.b = a, b


jax.tree_util.register_pytree_with_keys(
    Named,
    lambda n: (((DictKey("alpha"), n.a), (GetAttrKey("b"), n.b)), None),
    lambda _, ch: Named(*ch),
)


class Indexed:
    """A list-like node: its children are keyed by position."""

    def __init__(self, xs):
        self.xs = list(xs)


jax.tree_util.register_pytree_with_keys(
    Indexed,
    lambda n: (tuple((SequenceKey(i), x) for i, x in enumerate(n.xs)), None),
    lambda _, ch: Indexed(ch),
)


class NoKeys:
    """Registered without keys: JAX keys its children FlattenedIndexKey."""

    def __init__(self, a, b):
        self.a, self.b = a, b


jax.tree_util.register_pytree_node(NoKeys, lambda n: ((n.a, n.b), None), lambda _, ch: NoKeys(*ch))


class SameNames:
    """Two children whose names are the same text: cannot be an object."""

    def __init__(self, a, b):
        self.a, self.b = a, b


jax.tree_util.register_pytree_with_keys(
    SameNames,
    lambda n: (((DictKey(1), n.a), (DictKey("1"), n.b)), None),
    lambda _, ch: SameNames(*ch),
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Params:
    w: jax.Array
    b: jax.Array


def _one(path, value, name="v"):
    with pmaptap.Session(str(path), run="p"):
        jax.jit(lambda v: pmaptap.tap(v, name))(value)
    (r,) = pmaptap.read(str(path))
    return r


def test_custom_nodes_with_named_keys_are_objects(tmp_path):
    v = {"n": Named(jnp.float32(1.5), jnp.arange(3)), "p": Params(jnp.ones(2), jnp.int32(4))}
    r = _one(tmp_path / "a.jsonl", v)
    assert r["value"] == {"n": {"alpha": 1.5, "b": [0, 1, 2]}, "p": {"w": [1.0, 1.0], "b": 4}}
    assert r["dtype"] == {
        "n": {"alpha": "float32", "b": "int32"},
        "p": {"w": "float32", "b": "int32"},
    }
    assert r["shape"] == {"n": {"alpha": [], "b": [3]}, "p": {"w": [2], "b": []}}


@pytest.mark.parametrize(
    "make",
    [
        lambda a, b: Indexed([a, b]),
        lambda a, b: NoKeys(a, b),
        lambda a, b: SameNames(a, b),
    ],
    ids=["SequenceKey", "FlattenedIndexKey", "same-names"],
)
def test_list_like_custom_nodes_are_arrays_in_flatten_order(tmp_path, make):
    # FlattenedIndexKey is what JAX gives a node registered without keys.
    if make(0, 1).__class__ is NoKeys:
        path, _ = jax.tree_util.tree_flatten_with_path(make(0, 1))[0][0]
        assert isinstance(path[0], FlattenedIndexKey)
    r = _one(tmp_path / "b.jsonl", {"n": make(jnp.float32(2.0), jnp.arange(2))})
    assert r["value"] == {"n": [2.0, [0, 1]]}
    assert r["dtype"] == {"n": ["float32", "int32"]} and r["shape"] == {"n": [[], [2]]}


def test_flax_nnx_state_keeps_its_names(tmp_path):
    from flax import nnx  # the test extra installs flax

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.fc1 = nnx.Linear(3, 4, rngs=rngs)
            self.fc2 = nnx.Linear(4, 2, rngs=rngs)

    model = MLP(nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    path = tmp_path / "nnx.jsonl"
    with pmaptap.Session(str(path), run="p"):

        @nnx.jit
        def step(m):
            pmaptap.tap(nnx.state(m, nnx.Param), "params", dedup="replicated")
            pmaptap.tap(m.fc1.kernel, "kernel")  # a Variable: {"value": ...}

        step(model)
    recs = {r["name"]: r for r in pmaptap.read(str(path))}
    v = recs["params"]["value"]
    assert set(v) == {"fc1", "fc2"} and set(v["fc1"]) == {"bias", "kernel"}
    np.testing.assert_allclose(
        np.array(v["fc2"]["kernel"]["value"], np.float32), np.asarray(state["fc2"]["kernel"][...])
    )
    assert recs["params"]["shape"]["fc1"]["kernel"] == {"value": [3, 4]}
    assert recs["params"]["dtype"]["fc2"]["bias"] == {"value": "float32"}
    assert recs["kernel"]["shape"] == {"value": [3, 4]}
