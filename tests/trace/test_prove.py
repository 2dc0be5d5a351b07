"""Replication proven at trace time (pmaptap/_trace/invariant.py): a
replicated tap of a value JAX shows to be the same on every device (a
``pmean`` loss) sends the leader's copy with no collective, and writes
exactly the records that comparing the copies would have written. Anything
not proven still compares copies, and a divergence is still flagged."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pmaptap
from pmaptap._common.spec import Layout
from pmaptap._trace import invariant, placement

pytestmark = pytest.mark.usefixtures("transport")


def test_jax_internals_the_proof_reads_are_still_there():
    # Fails loudly on a JAX upgrade that moves them (the proof itself would
    # quietly answer "not proven" and every replicated tap would gather).
    invariant.check_internals()
    assert placement.proven_invariant is invariant.proven_invariant


@pytest.fixture
def layouts(spy_deliveries):
    """(name, layout) of every tap payload reaching the host, group members
    one by one (with ("<group>", gathered) before them)."""

    def what(spec, arrays):
        members = getattr(spec, "members", None)
        if members is None:
            return [(spec.name, spec.transport.layout)]
        return [("<group>", spec.gathered)] + [(m.name, m.transport.layout) for m in members]

    return spy_deliveries(what, extend=True)


def _loss_step(v):
    loss = lax.pmean(jnp.sum(v * v), "i")
    pmaptap.tap(loss, "loss", dedup="replicated")
    return v


def _jaxpr_text(make, *args, **opts) -> str:
    """The jaxpr of ``make()`` (a fresh function: JAX caches traces per
    function, and options are read when a tap is traced)."""
    with pmaptap.configured(**opts):
        return str(jax.make_jaxpr(make())(*args))


def _collectives(text: str) -> dict[str, int]:
    return {p: text.count(p + "[") for p in ("all_gather", "psum", "psum_invariant")}


def test_pmean_loss_under_pmap_needs_no_gather():
    x = jnp.arange(8.0)
    make = lambda: jax.pmap(lambda v: _loss_step(v), axis_name="i")  # noqa: E731
    proven = _jaxpr_text(make, x)
    compared = _jaxpr_text(make, x, prove_replicated=False)
    # The step's own pmean is the only collective; comparing copies adds one.
    assert _collectives(proven) == {"all_gather": 0, "psum": 1, "psum_invariant": 0}
    assert _collectives(compared)["all_gather"] == 1


@pytest.mark.parametrize("check_vma", [True, False])
def test_pmean_loss_under_shard_map_needs_no_gather(check_vma):
    mesh = jax.make_mesh((8,), ("i",))
    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("i")))

    def step(v):
        _loss_step(v)
        return v

    def make():
        return jax.jit(
            jax.shard_map(
                lambda v: step(v), mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=check_vma
            )
        )

    proven = _jaxpr_text(make, x)
    compared = _jaxpr_text(make, x, prove_replicated=False)
    assert "all_gather[" not in proven
    assert "all_gather[" in compared


def _verdicts(body, x=None):
    """{label: proven} for the values ``body(v)`` returns, asked inside a
    pmap over "i" (what choose_layout asks)."""
    out = {}

    def fn(v):
        for label, value in body(v).items():
            out[label] = placement.proven_invariant(jax.tree.leaves(value), ("i",))
        return v

    jax.pmap(fn, axis_name="i")(jnp.arange(8.0) if x is None else x)
    return out


def test_what_is_and_is_not_proven_under_pmap():
    outer = jnp.ones(())

    def body(v):
        loss = lax.pmean(v, "i")
        return {
            "pmean": loss,
            "pmean*2+1": loss * 2 + 1,
            "psum/pmax/pmin": lax.psum(v, "i") + lax.pmax(v, "i") - lax.pmin(v, "i"),
            "all_gather": jnp.sum(lax.all_gather(v, "i")),
            "tiled all_gather": lax.all_gather(v[None], "i", tiled=True),
            "reductions, casts, dot": jnp.dot(jnp.full((3,), loss), jnp.arange(3.0)).astype(
                jnp.bfloat16
            ),
            "constant": jnp.float32(3.0) * 2,
            "pytree of proven": (loss, {"b": loss > 1}),
            "concrete closed-over": outer + loss,
            # Not proven:
            "argument": v,
            "argument*0": v * 0,
            "axis_index": lax.axis_index("i").astype(jnp.float32),
            "pmean+axis_index": loss + lax.axis_index("i"),
            "ppermute": lax.ppermute(loss, "i", [(k, (k + 1) % 8) for k in range(8)]),
            "through jit": jax.jit(lambda a: a * 2)(loss),
            "through cond": lax.cond(loss > 0, lambda: loss, lambda: -loss),
            "pytree with one argument": (loss, v),
            "psum with groups": lax.psum(v, "i", axis_index_groups=[[0, 1, 2, 3], [4, 5, 6, 7]]),
        }

    got = _verdicts(body)
    proven = {k for k, ok in got.items() if ok}
    assert proven == {
        "pmean",
        "pmean*2+1",
        "psum/pmax/pmin",
        "all_gather",
        "tiled all_gather",
        "reductions, casts, dot",
        "constant",
        "pytree of proven",
        "concrete closed-over",
    }


def test_a_pmap_argument_with_in_axes_none_is_proven_alike():
    """A ``jax.pmap`` argument with ``in_axes=None`` (a step counter, a
    learning rate) is the same on every device by construction, and so is
    what pure operations make of it; mapped arguments are not. Under the
    output transport the body is traced twice (lift.py): the same."""
    got: dict = {}

    def body(v, step, lr):
        for label, value in {
            "step": step,
            "lr schedule": lr * jnp.minimum(step, 10).astype(jnp.float32) + 1e-4,
            "step as a float, in a tree": {"s": step * 1.0, "neg": -step},
            "with a pmean": lax.pmean(v, "i") * lr,
            # Not proven:
            "mapped argument": v,
            "mapped + step": v + step,
            "step + axis_index": step + lax.axis_index("i"),
        }.items():
            got[label] = placement.proven_invariant(jax.tree.leaves(value), ("i",))
        return v

    jax.pmap(body, axis_name="i", in_axes=(0, None, None))(
        jnp.arange(8.0), jnp.int32(3), jnp.float32(0.1)
    )
    assert {k for k, ok in got.items() if ok} == {
        "step",
        "lr schedule",
        "step as a float, in a tree",
        "with a pmean",
    }, got


@pytest.mark.parametrize("check_vma", [True, False])
def test_a_shard_map_input_replicated_by_its_in_spec_is_proven(check_vma):
    """A shard_map input whose in_spec names no axis (``P()``) is the same on
    every device, with JAX's varying-axes typing on or off; one split over
    the axis (``P("i")``) is not."""
    mesh = jax.make_mesh((8,), ("i",))
    got: dict = {}

    def body(v, c):
        got["P()"] = placement.proven_invariant([c * 2], ("i",))
        got['P("i")'] = placement.proven_invariant([v * 2], ("i",))
        return v

    f = jax.shard_map(
        body, mesh=mesh, in_specs=(P("i"), P()), out_specs=P("i"), check_vma=check_vma
    )
    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("i")))
    jax.jit(f)(x, jnp.float32(2.0))
    assert got == {"P()": True, 'P("i")': False}


@pytest.mark.callback_only("spies on the callback layouts")
def test_taps_of_a_step_counter_passed_with_in_axes_none_send_one_copy(tmp_path, layouts):
    """The demo's pattern: ``step`` passed with ``in_axes=None``, the
    learning rate made from it, both tapped as replicated with ``step=step``:
    proven, so no copy is compared and no step is checked (before: both
    compared the 8 devices' copies, and each tap's step was all-gathered),
    and the records are those comparing writes."""

    def run(path, **opts):
        with pmaptap.configured(**opts):
            f = jax.pmap(
                lambda v, step: (
                    pmaptap.tap(0.1 * (step + 1).astype(jnp.float32), "lr", step=step),
                    pmaptap.tap(step, "step", step=step, dedup="replicated"),
                    v,
                )[-1],
                axis_name="i",
                in_axes=(0, None),
            )
            with pmaptap.Session(str(path), run="prove"):
                for i in range(3):
                    f(jnp.arange(8.0), jnp.int32(i))
        return pmaptap.read(str(path))

    proven = run(tmp_path / "p.jsonl")
    kinds = {(name, layout) for name, layout in layouts if name != "<group>"}
    layouts.clear()
    compared = run(tmp_path / "c.jsonl", prove_replicated=False)
    assert _without_time(proven) == _without_time(compared)
    assert sorted((r["name"], r["step"]) for r in proven) == sorted(
        (n, s) for n in ("lr", "step") for s in range(3)
    )
    assert all(r["kind"] == "replicated" and r["replicas"] == 8 for r in proven)
    assert kinds == {("lr", Layout.PROVEN), ("step", Layout.PROVEN)}, kinds
    text = _jaxpr_text(
        lambda: jax.pmap(
            lambda v, step: (pmaptap.tap(step * 2, "s", step=step), v)[-1],
            axis_name="i",
            in_axes=(0, None),
        ),
        jnp.arange(8.0),
        jnp.int32(0),
    )
    assert "all_gather[" not in text, text


def test_a_collective_over_one_axis_of_two_is_not_proven():
    mesh = jax.make_mesh((2, 4), ("i", "j"))
    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P(("i", "j"))))
    for check_vma in (True, False):
        out = {}

        def body(v):
            out["i only"] = placement.proven_invariant([lax.psum(v, "i")], ("i", "j"))
            out["j only"] = placement.proven_invariant([lax.pmean(v, "j")], ("i", "j"))
            out["both"] = placement.proven_invariant([lax.pmean(v, ("i", "j"))], ("i", "j"))
            out["i then j"] = placement.proven_invariant(
                [lax.psum(lax.psum(v, "i"), "j")], ("i", "j")
            )
            out["argument"] = placement.proven_invariant([v], ("i", "j"))
            return v

        jax.jit(
            jax.shard_map(
                body,
                mesh=mesh,
                in_specs=P(("i", "j")),
                out_specs=P(("i", "j")),
                check_vma=check_vma,
            )
        )(x)
        want = {"i only": False, "j only": False, "both": True, "argument": False}
        # With JAX's typing on, psum over i then over j is typed invariant on
        # both; the dataflow walk (typing off) proves only the last
        # collective's axes and stays conservative.
        want["i then j"] = check_vma
        assert out == want, check_vma


def test_a_value_of_an_enclosing_trace_is_not_proven():
    out = {}

    def step(v):
        loss = lax.pmean(v, "i")

        def inner(a):
            out["closed over"] = placement.proven_invariant([loss], ("i",))
            out["own"] = placement.proven_invariant([a], ("i",))
            return a

        lax.scan(lambda c, _: (inner(c), None), loss, None, length=2)
        return v

    jax.pmap(step, axis_name="i")(jnp.arange(8.0))
    assert out == {"closed over": False, "own": False}


def test_the_walk_is_bounded_and_never_raises(monkeypatch):
    def chain(n):
        def body(v):
            x = lax.pmean(v, "i")
            for _ in range(n):
                x = x + 1.0
            return {"x": x}

        return body

    assert _verdicts(chain(50)) == {"x": True}
    # Past the cap the answer is "not proven" (and the tap compares copies).
    assert _verdicts(chain(invariant.MAX_EQUATIONS + 10)) == {"x": False}

    def broken(*a, **k):
        raise RuntimeError("a JAX internal moved")

    monkeypatch.setattr(invariant, "_walk", broken)
    assert _verdicts(chain(1)) == {"x": False}


def _records(path, fn, x, steps=3, **opts):
    with pmaptap.configured(**opts):
        # A fresh function: JAX caches traces per function object.
        f = jax.pmap(lambda v: fn(v), axis_name="i")
        with pmaptap.Session(str(path), run="prove"):
            for i in range(steps):
                f(x + i)
    return pmaptap.read(str(path))


def _without_time(records):
    return sorted(tuple(sorted((k, repr(v)) for k, v in r.items() if k != "time")) for r in records)


def _mixed_step(v):
    loss = lax.pmean(jnp.sum(v * v), "i")
    pmaptap.tap(loss, "loss", dedup="replicated")
    pmaptap.tap({"scaled": loss * 2 + 1, "flag": loss > 3}, "tree", dedup="replicated")
    pmaptap.tap(loss - 1, "auto_proven")  # dedup="auto"
    pmaptap.tap(v, "mine", dedup="per_device")
    pmaptap.tap(jnp.full((3,), loss), "big", dedup="replicated")
    return v


@pytest.mark.callback_only("spies on the callback layouts")
@pytest.mark.parametrize("auto_group", [True, False])
def test_proven_records_equal_the_compared_records(tmp_path, layouts, auto_group):
    x = jnp.arange(8.0)
    proven = _records(tmp_path / "p.jsonl", _mixed_step, x, auto_group=auto_group)
    proven_layouts = list(layouts)
    layouts.clear()
    compared = _records(
        tmp_path / "c.jsonl", _mixed_step, x, auto_group=auto_group, prove_replicated=False
    )
    assert len(proven) == len(compared) == 3 * (4 + 8)
    assert _without_time(proven) == _without_time(compared)
    for r in proven:
        if r["name"] != "mine":
            assert r["kind"] == "replicated" and r["replicas"] == 8
            assert "verified" not in r and "divergent" not in r
    got = {name: layout for name, layout in proven_layouts if name != "<group>"}
    assert got == {
        "loss": Layout.PROVEN,
        "tree": Layout.PROVEN,
        "auto_proven": Layout.PROVEN,
        "big": Layout.PROVEN,
        "mine": Layout.GATHERED,
    }
    assert all(layout is not Layout.PROVEN for _, layout in layouts)


def test_big_proven_value_skips_the_hash_gather(tmp_path):
    # Above gather_max_bytes a compared replicated tap gathers hashes
    # (VERIFIED); a proven one does not.
    def step(v):
        loss = lax.pmean(v, "i")
        pmaptap.tap(jnp.full((64,), loss), "big", dedup="replicated")
        return v

    x = jnp.arange(8.0)
    make = lambda: jax.pmap(lambda v: step(v), axis_name="i")  # noqa: E731
    assert "all_gather[" not in _jaxpr_text(make, x, gather_max_bytes=16)
    assert "all_gather[" in _jaxpr_text(make, x, gather_max_bytes=16, prove_replicated=False)
    with pmaptap.configured(gather_max_bytes=16):
        recs = _records(tmp_path / "b.jsonl", step, x, steps=2)
    assert [r["value"] for r in recs] == [[3.5] * 64, [4.5] * 64]


@pytest.mark.callback_only("spies on the callback layouts")
def test_a_group_of_proven_taps_needs_no_gather(tmp_path, layouts):
    @pmaptap.group()
    def step(v):
        loss = lax.pmean(v, "i")
        pmaptap.tap(loss, "a", dedup="replicated")
        pmaptap.tap(loss * 3, "b", dedup="replicated")
        return v

    x = jnp.arange(8.0)
    assert "all_gather[" not in _jaxpr_text(lambda: jax.pmap(step, axis_name="i"), x)
    recs = _records(tmp_path / "g.jsonl", step, x, steps=2)
    assert ("<group>", False) in layouts
    assert sorted((r["name"], r["step"], r["value"]) for r in recs) == [
        ("a", 0, 3.5),
        ("a", 1, 4.5),
        ("b", 0, 10.5),
        ("b", 1, 13.5),
    ]
    assert all(r["kind"] == "replicated" and "verified" not in r for r in recs)


def test_auto_grouped_proven_and_per_device_equal_ungrouped(tmp_path):
    x = jnp.arange(8.0)
    grouped = _records(tmp_path / "g.jsonl", _mixed_step, x, auto_group=True)
    alone = _records(tmp_path / "a.jsonl", _mixed_step, x, auto_group=False)
    assert _without_time(grouped) == _without_time(alone)
    # One gather, for the per_device member only.
    text = _jaxpr_text(lambda: jax.pmap(_mixed_step, axis_name="i"), x, auto_group=True)
    assert text.count("all_gather[") == 1


def test_a_per_device_value_tapped_as_replicated_still_gathers_and_diverges(tmp_path):
    def step(v):
        pmaptap.tap(jnp.where(v >= 6, 1.0, 0.0), "loss", dedup="replicated")
        return v

    x = jnp.arange(8.0)
    assert "all_gather[" in _jaxpr_text(lambda: jax.pmap(step, axis_name="i"), x)
    recs = _records(tmp_path / "d.jsonl", step, x, steps=1)
    by_value = {r["value"]: r for r in recs}
    assert set(by_value) == {0.0, 1.0}
    assert all(r["divergent"] is True for r in recs)
    assert sorted(by_value[1.0]["devices"]) == [6, 7]


def test_verify_replicated_off_still_says_unverified(tmp_path):
    recs = _records(
        tmp_path / "v.jsonl", _loss_step, jnp.arange(8.0), steps=1, verify_replicated=False
    )
    assert [r["verified"] for r in recs] == [False]


def test_proven_tap_under_grad_of_a_pmean_loss(tmp_path):
    # The common training step: the loss is pmean'd outside value_and_grad.
    def step(w, v):
        loss, g = jax.value_and_grad(lambda w: jnp.sum((w * v) ** 2))(w)
        loss = lax.pmean(loss, "i")
        pmaptap.tap(loss, "loss", dedup="replicated")
        return w - 0.1 * lax.pmean(g, "i")

    w = jnp.ones((8,))
    f = jax.pmap(step, axis_name="i")
    text = _jaxpr_text(lambda: f, w, jnp.arange(8.0))
    assert text.count("all_gather[") == 0
    with pmaptap.Session(str(tmp_path / "t.jsonl"), run="prove"):
        np.asarray(f(w, jnp.arange(8.0)))
    (r,) = pmaptap.read(str(tmp_path / "t.jsonl"))
    assert r["value"] == pytest.approx(float(np.mean(np.arange(8.0) ** 2)))


@pytest.mark.parametrize("check_vma", [True, False])
def test_jax_typing_proves_through_control_flow_only_when_it_is_on(check_vma):
    # Source a (JAX's varying-axes typing) sees through jit and cond; the
    # dataflow walk (all there is with check_vma off, as under pmap) does not.
    mesh = jax.make_mesh((8,), ("i",))
    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("i")))
    out = {}

    def body(v):
        loss = lax.pmean(v, "i")
        values = {
            "cond": lax.cond(loss[0] > 0, lambda: loss, lambda: -loss),
            "jit": jax.jit(lambda a: a * 2)(loss),
            "argument": v,
        }
        for k, val in values.items():
            out[k] = placement.proven_invariant([val], ("i",))
        return v

    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=check_vma))(
        x
    )
    assert out == {"cond": check_vma, "jit": check_vma, "argument": False}


# ---------------------------------------------------------------- per-device sources
# JAX's varying-axes typing types a result from its operands: XLA's stateful
# rng_uniform (no operand varies) is typed the same on every device, and
# each device draws its own. Before, such a tap was written as ONE
# replicated record naming all 8 devices.


def _draws_step(dedup: str):
    def body(v):
        u = lax.rng_uniform(0.0, 1.0, (4,))
        pmaptap.tap(u, "u", dedup=dedup)
        return u[None]

    return body


@pytest.mark.parametrize("dedup", ["auto", "replicated"])
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_per_device_random_draws_are_written_per_device(tmp_path, dedup, jit):
    mesh = jax.make_mesh((8,), ("i",))
    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("i")))
    f = jax.shard_map(_draws_step(dedup), mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    f = jax.jit(f) if jit else f
    path = tmp_path / "u.jsonl"
    with pmaptap.Session(str(path), run="u"):
        rows = np.asarray(f(x))
    recs = pmaptap.read(str(path))
    assert len({tuple(r) for r in rows.tolist()}) == 8  # 8 different draws
    assert len(recs) == 8
    got = {(r["device"] if "device" in r else r["devices"][0]): r["value"] for r in recs}
    # Each device's record holds that device's draw (row k: device k).
    assert got == {k: pytest.approx(rows[k].tolist()) for k in range(8)}
    if dedup == "replicated":
        assert all(r["divergent"] is True for r in recs)
    else:
        assert all(r["kind"] == "per_device" for r in recs)


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg", "unsafe_rbg"])
def test_draws_from_a_key_alike_everywhere_are_proven_and_agree(tmp_path, impl):
    """What the proof trusts of jax.random holds on the devices: a key the
    same on every device draws the same bits on each (the copies, compared
    with prove_replicated=False, agree), written as one replicated record."""
    mesh = jax.make_mesh((8,), ("i",))
    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("i")))

    def body(v):
        pmaptap.tap(jax.random.uniform(jax.random.key(7, impl=impl), (4,)), "r")
        return v

    def run(path, **opts):
        with pmaptap.configured(**opts):
            f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i")))
            with pmaptap.Session(str(path), run="r"):
                f(x)
        return pmaptap.read(str(path))

    proven = run(tmp_path / "p.jsonl")
    assert _without_time(proven) == _without_time(run(tmp_path / "c.jsonl", prove_replicated=False))
    (r,) = proven
    assert r["kind"] == "replicated" and r["replicas"] == 8 and "divergent" not in r


def _typed_verdicts(body, axes=("i",), mesh_shape=(8,)) -> dict:
    """{label: proven} for the values ``body(v)`` returns, asked inside a
    shard_map with JAX's varying-axes typing on (traced only, so code
    that cannot run here, an FFI call, is asked about too)."""
    mesh = jax.make_mesh(mesh_shape, axes)
    out: dict = {}

    def fn(v):
        for label, value in body(v).items():
            out[label] = placement.proven_invariant(jax.tree.leaves(value), axes)
        return v

    spec = P(axes)
    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, spec))
    jax.make_jaxpr(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec))(x)
    return out


def test_what_per_device_sources_the_typing_proof_refuses():
    from jax.experimental import pallas as pl

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    def body(v):
        key = jnp.zeros((4,), jnp.uint32)
        u = lax.rng_uniform(0.0, 1.0, (4,))
        out = {
            # A function of a key the same everywhere draws the same bits.
            "rng_bit_generator": lax.rng_bit_generator(key, (4,))[1],
            "jax.random threefry": jax.random.uniform(jax.random.key(0), (4,)),
            "jax.random rbg": jax.random.normal(jax.random.key(0, impl="rbg"), (4,)),
            "jax.random unsafe_rbg": jax.random.bits(jax.random.key(0, impl="unsafe_rbg")),
            "a draw, all-reduced": lax.pmean(u, "i") * 2,
            # Not proven:
            "rng_uniform": u,
            "rng_uniform, used": jnp.sum(u * 2) + lax.pmean(v, "i"),
            "a key folded with axis_index": jax.random.uniform(
                jax.random.fold_in(jax.random.key(0), lax.axis_index("i")), (2,)
            ),
            "ffi_call": jax.ffi.ffi_call(
                "pmaptap_no_such_target", jax.ShapeDtypeStruct((), "f4")
            )(),
            # Declared the same on every device: a kernel may read the
            # device's index all the same.
            "pallas_call": pl.pallas_call(
                kernel,
                out_shape=jax.ShapeDtypeStruct(
                    (4,), jnp.float32, manual_axis_type=jax.sharding.ManualAxisType()
                ),
                interpret=True,
            )(jnp.ones((4,))),
        }
        with jax.threefry_partitionable(False):
            out["jax.random threefry, not partitionable"] = jax.random.uniform(
                jax.random.key(1), (4,)
            )
        return out

    got = _typed_verdicts(body)
    assert {k for k, ok in got.items() if ok} == {
        "rng_bit_generator",
        "jax.random threefry",
        "jax.random threefry, not partitionable",
        "jax.random rbg",
        "jax.random unsafe_rbg",
        "a draw, all-reduced",
    }, got


def test_a_draw_reaching_an_inner_body_is_not_proven_there():
    """A scan/jit/checkpoint body's input is a value of the body around it,
    not known which: proven by the typing only where nothing around it is a
    per-device source; a nested shard_map's input is the value passed in."""

    def asked(body_of):
        got: dict = {}

        def ask(label, value):
            got[label] = placement.proven_invariant([value], ("i",))
            return value

        def body(v):
            body_of(v, ask)
            return {}

        _typed_verdicts(body)
        return got

    def inner_bodies(value, ask):
        lax.scan(lambda c, _: (ask("scan", c), None), value, None, length=2)
        jax.jit(lambda a: ask("jit", a))(value)
        jax.checkpoint(lambda a: ask("checkpoint", a))(value)
        jax.jit(lambda a: lax.scan(lambda c, _: (ask("scan in jit", c), None), a, None, length=1))(
            value
        )

    clean = asked(lambda v, ask: inner_bodies(lax.pmean(v, "i"), ask))
    drawn = asked(lambda v, ask: inner_bodies(lax.rng_uniform(0.0, 1.0, (4,)), ask))
    assert clean == dict.fromkeys(clean, True) and len(clean) == 4
    assert drawn == dict.fromkeys(clean, False)

    mesh = jax.make_mesh((2, 4), ("i", "j"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    got: dict = {}

    def outer(v):
        u = lax.rng_uniform(0.0, 1.0, (4,))

        def inner(w, a, b):
            got["drawn"] = placement.proven_invariant([a], ("i", "j"))
            got["pmean"] = placement.proven_invariant([b], ("i", "j"))
            return w

        return jax.shard_map(
            inner, in_specs=(P("j"), P(), P()), out_specs=P("j"), axis_names={"j"}
        )(v, u, lax.pmean(v, "i").sum())

    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("i")))
    jax.make_jaxpr(
        jax.shard_map(outer, mesh=mesh, in_specs=P("i"), out_specs=P("i"), axis_names={"i"})
    )(x)
    assert got == {"drawn": False, "pmean": True}, got
