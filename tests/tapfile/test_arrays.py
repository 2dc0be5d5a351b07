"""Array values stored as bytes (tapfile/source/arrays.py) and pmaptap.assemble:
bit-exact for every dtype, crash-safe, in the one-file and sharded layouts
(object stores: tests/host/test_object_store.py), and every reader on them."""

from __future__ import annotations

import csv
import json
import os
import signal
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pmaptap
from conftest import (
    job_failed,
    logs_warning,
    python_cmd,
    run_launch,
    run_python,
    start_python,
    wait_for,
)
from pmaptap import cli
from pmaptap.tapfile.record.format import encodable, is_narrow_int
from pmaptap.tapfile.source.arrays import INLINE_MAX_BYTES, ByteStore, byte_leaves, stored_as_bytes

# ------------------------------------------------------------ helpers


def _lines(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _encodable_dtypes() -> list[np.dtype]:
    """Every dtype the record format holds (format.encodable), from NumPy's
    and ml_dtypes' own lists, sub-byte integers included but the 1-bit ones
    (which a Writer refuses, as a tap does)."""
    found = {np.dtype(t) for t in np.sctypeDict.values()}
    for name in dir(ml_dtypes):
        t = getattr(ml_dtypes, name)
        if isinstance(t, type) and issubclass(t, np.generic):
            found.add(np.dtype(t))
    out = [
        dt
        for dt in found
        if encodable(dt) and dt.kind != "O" and not (is_narrow_int(dt) and dt.name.endswith("int1"))
    ]
    assert len(out) > 25 and "int4" in {dt.name for dt in out}, out
    return sorted(out, key=str)


def _bits(dt: np.dtype, n: int, seed: int = 0) -> np.ndarray:
    """``n`` values of ``dt`` whose bits cover what JSON would lose: random
    bit patterns (NaN payloads, denormals, -0.0 among them for floats),
    plus explicit ones at the front."""
    rng = np.random.default_rng(seed)
    if dt == np.bool_:
        return rng.integers(0, 2, n).astype(bool)
    if dt.kind == "V" and dt.name.startswith(("int", "uint")):
        info = ml_dtypes.iinfo(dt)
        return rng.integers(int(info.min), int(info.max) + 1, n).astype(dt)
    raw = rng.integers(0, 256, n * dt.itemsize, dtype=np.uint8).view(dt).copy()
    if (dt.kind == "f" or "float" in dt.name) and dt.itemsize <= 8:  # (longdouble: random)
        width = np.dtype(f"u{dt.itemsize}")
        special = [
            1 << (dt.itemsize * 8 - 1),  # -0.0
            1,  # the smallest denormal
        ]
        if dt.itemsize >= 2:
            special.append(int(np.array(np.nan, dt).view(width)) | 1)  # a NaN payload
        raw.view(width)[: len(special)] = special
    return raw


def _same_bits(got, want: np.ndarray) -> bool:
    got = np.asarray(got)
    return got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()


# ------------------------------------------------------------ bit-exact


@pytest.mark.parametrize("layout", ["file", "sharded"])
def test_every_dtype_round_trips_bit_for_bit_through_the_bytes(tmp_path, layout):
    path = str(tmp_path / "run.jsonl")
    values = {
        dt.name: _bits(dt, 2048 // dt.itemsize + 7, seed=i)
        for i, dt in enumerate(_encodable_dtypes())
    }
    w = pmaptap.Writer(path, run="r", process=0, layout=layout)
    for name, a in values.items():
        w.write(name, 0, a)
        w.write(name, 1, {"big": a.reshape(-1, 1), "small": a[:2]}, kind="per_device", device=3)
    w.close()
    raw = {
        (d["name"], d["step"]): d
        for d in _lines(path if layout == "file" else path + ".d/p00000.jsonl")
    }
    recs = {(r["name"], r["step"]): r for r in pmaptap.read(path)}
    assert len(recs) == 2 * len(values)
    for name, a in values.items():
        line = raw[(name, 0)]
        assert line["value"] is None and line["dtype"] == name and line["shape"] == [a.size]
        assert line["bytes"]["file"].startswith("run.jsonl.bytes/p00000-")
        r = recs[(name, 0)]
        assert _same_bits(r["value"], a), name
        # read()'s contract for every storage.
        assert _same_bits(np.asarray(r["value"], dtype=r["dtype"]), a), name
        tree = recs[(name, 1)]
        assert _same_bits(tree["value"]["big"], a.reshape(-1, 1)), name
        if stored_as_bytes(a[:2].nbytes, a.dtype):
            # longdouble / clongdouble: JSON would round them, so bytes at
            # any size.
            assert raw[(name, 1)]["value"]["small"] is None, name
            assert raw[(name, 1)]["bytes"]["small"] is not None, name
            assert _same_bits(tree["value"]["small"], a[:2]), name
            continue
        assert raw[(name, 1)]["value"]["small"] is not None  # small leaves stay inline
        assert raw[(name, 1)]["bytes"]["small"] is None
        if a.dtype.isbuiltin != 2 and a.dtype.itemsize <= 8:
            # Inline JSON is exact for NumPy's own dtypes (longdouble is
            # stored as bytes), for these values (-0.0 and a denormal, no
            # NaN payload).
            assert _same_bits(np.asarray(tree["value"]["small"], dtype=name), a[:2]), name
    assert cli.main(["validate", path]) == 0


def test_complex32_inline_keeps_its_imaginary_part(tmp_path):
    # ml_dtypes' complex32 written inline (small): NumPy's .real/.imag of it
    # are the whole value and zeros, so the line held (re, 0) pairs, with a
    # ComplexWarning. Widened to complex64 (exact) first, it is (re, im).
    import warnings

    from pmaptap._host.pipeline import encode_array

    a = np.array([1 + 2j, -3.5 - 4j, complex(np.nan, 0.25)], np.complex64).astype(
        ml_dtypes.complex32
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", np.exceptions.ComplexWarning)
        value, dtype, shape = encode_array(a)
    assert (value, dtype, shape) == ([[1.0, 2.0], [-3.5, -4.0], ["NaN", 0.25]], "complex32", [3])
    path = str(tmp_path / "run.jsonl")
    w = pmaptap.Writer(path, run="r", process=0)
    w.write("z", 0, a[:2])
    w.close()
    (line,) = _lines(path)
    assert line["value"] == [[1.0, 2.0], [-3.5, -4.0]] and line["dtype"] == "complex32"
    (r,) = pmaptap.read(path)
    assert r["value"] == [1 + 2j, -3.5 - 4j]
    assert _same_bits(np.asarray(r["value"], dtype=r["dtype"]), a[:2])


def test_numpy_alone_reads_a_stored_value_as_the_docs_say(tmp_path):
    path = str(tmp_path / "run.jsonl")
    a = np.linspace(-1, 1, 4096, dtype=np.float32).reshape(64, 64)
    b = _bits(np.dtype(ml_dtypes.bfloat16), 1000)
    with pmaptap.Writer(path, run="r", process=0) as w:
        w.write("a", 0, a)
        w.write("b", 0, b)
    (la, lb) = _lines(path)
    # docs/api.md, "Array values": np.load at the reference's offset.
    for line, want in ((la, a), (lb, b)):
        ref = line["bytes"]
        with open(os.path.join(os.path.dirname(path), ref["file"]), "rb") as f:
            f.seek(ref["offset"])
            got = np.load(f)
            assert f.tell() == ref["offset"] + ref["nbytes"]
        if line["dtype"] == "bfloat16":
            assert got.dtype == np.uint16  # the bits, NumPy alone
            got = got.view(ml_dtypes.bfloat16)
        assert _same_bits(got, want)


_NARROW = ("int4", "uint4", "int2", "uint2")


def test_jit_taps_store_shards_as_exact_bytes_with_global_shape(session, tap_path):
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    sh = NamedSharding(mesh, P("data", "model"))
    # Shards of 32x32 (bfloat16: 2 KiB, above INLINE_MAX_BYTES).
    f32 = _bits(np.dtype(np.float32), 128 * 64).reshape(128, 64)  # NaN payloads, -0.0, denormals
    bf = _bits(np.dtype(ml_dtypes.bfloat16), 128 * 64, seed=1).reshape(128, 64)
    c64 = _bits(np.dtype(np.complex64), 128 * 64, seed=2).reshape(128, 64)
    # Sub-byte integers: made on device from int8 (JAX moves them in no
    # other way everywhere), each value in its range.
    narrow = {n: _bits(np.dtype(getattr(ml_dtypes, n)), 256 * 64, seed=3) for n in _NARROW}
    i8 = {n: a.astype(np.int8).reshape(256, 64) for n, a in narrow.items()}
    args = [jax.device_put(x, sh) for x in (f32, bf, c64)]
    args.append({n: jax.device_put(a, sh) for n, a in i8.items()})

    @jax.jit
    def step(a, b, c, d):
        # The inputs themselves: XLA copies their bits to the callback.
        pmaptap.tap(a, "f32", dedup="per_device")
        pmaptap.tap({"bf": b, "c": c}, "tree", dedup="per_device")
        for n, v in d.items():
            pmaptap.tap(v.astype(getattr(jnp, n)), n, dedup="per_device")
        return a

    step(*args)
    session.flush()
    raw = _lines(tap_path)
    assert all("bytes" in d and d["global_shape"] for d in raw), raw[0]
    for d in raw:
        if d["name"] == "tree":
            assert d["global_shape"] == [[128, 64], [128, 64]]
    assert _same_bits(pmaptap.assemble(tap_path, "f32", 0), f32)
    for n, a in narrow.items():
        got = pmaptap.assemble(tap_path, n, 0)
        assert got.dtype.name == n and _same_bits(got, a.reshape(256, 64)), n
    tree = pmaptap.assemble(tap_path, "tree", 0)
    assert _same_bits(tree["bf"], bf) and _same_bits(tree["c"], c64)
    assert _same_bits(pmaptap.assemble(tap_path, "tree", 0, leaf="c"), c64)
    assert _same_bits(pmaptap.assemble(tap_path, "tree", 0, leaf=("bf",)), bf)
    with pytest.raises(ValueError, match=r"no leaf 'x'.*\['bf', 'c'\]"):
        pmaptap.assemble(tap_path, "tree", 0, leaf="x")


def test_small_values_stay_inline(session, tap_path):
    small = np.arange(INLINE_MAX_BYTES // 4, dtype=np.float32)  # exactly the limit
    jax.jit(lambda v: pmaptap.tap(v, "small"))(small)
    jax.jit(lambda v: pmaptap.tap(v, "big"))(np.arange(INLINE_MAX_BYTES // 4 + 1, dtype=np.float32))
    session.flush()
    by = {d["name"]: d for d in _lines(tap_path)}
    assert "bytes" not in by["small"] and by["small"]["value"] == small.tolist()
    assert by["big"]["value"] is None and "bytes" in by["big"]


@pytest.mark.skipif(
    np.finfo(np.longdouble).nmant <= np.finfo(np.float64).nmant,
    reason="longdouble is a double on this platform: JSON holds it exactly",
)
def test_extended_precision_values_are_stored_exactly_at_any_size(tmp_path):
    """A Writer's longdouble / clongdouble leaves (float128 / complex256 on
    x86), scalars included, are stored as bytes: JSON numbers (doubles) would
    round them (before: written inline narrowed to float32, 1/3 read back
    as 0.33333334). A small float64 stays inline."""
    third = np.longdouble(1) / np.longdouble(3)
    path = str(tmp_path / "ld.jsonl")
    values = {
        "x": third,
        "y": np.array([third, 2 * third]),
        "z": np.clongdouble(third + 1j * third),
        "f": np.float64(1 / 3),
    }
    with pmaptap.Writer(path, run="r", process=0) as w:
        for name, v in values.items():
            w.write(name, 0, v)
    by = {d["name"]: d for d in _lines(path)}
    assert all(by[n]["value"] is None and "bytes" in by[n] for n in "xyz")
    assert by["x"]["dtype"] == np.dtype(np.longdouble).name and by["x"]["shape"] == []
    assert by["f"]["value"] == 1 / 3 and "bytes" not in by["f"]
    got = {r["name"]: r["value"] for r in pmaptap.read(path)}
    for name in "xyz":
        want = np.asarray(values[name])
        assert got[name].dtype == want.dtype and got[name].shape == want.shape
        # Equal as extended-precision values (x86 keeps 10 bytes of value in
        # 16: the other 6 are whatever was in memory, so bytes would not do),
        # and more precise than any double.
        assert np.array_equal(got[name], want), name
        assert not np.array_equal(got[name], want.astype(np.complex128 if name == "z" else float))
    assert cli.main(["validate", path]) == 0
    # Equal extended values hash alike whatever their padding bytes: a
    # second process's equal copy is the same value, not a divergence.
    copy = np.asarray(third).copy()
    if np.finfo(np.longdouble).nmant == 63:  # x87: bytes 10-15 are padding
        copy.reshape(1).view(np.uint8)[10:] = 0x5A
        assert copy == third and copy.tobytes() != np.asarray(third).tobytes()
    with pmaptap.Writer(path, run="r", process=1) as w:
        w.write("x", 0, copy)
    loss = [r for r in pmaptap.read(path) if r["name"] == "x"]
    assert len(loss) == 1 and not loss[0].get("divergent"), loss


# ------------------------------------------------------------ assemble


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))


def test_assemble_replicated_slices_unsharded_values_and_errors(session, tap_path):
    mesh = _mesh()
    full = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    rows = jax.device_put(full, NamedSharding(mesh, P(None, "model")))  # replicated on "data"

    @jax.jit
    def step(x):
        y = jnp.cos(x)
        pmaptap.tap(y, "rep", dedup="auto")  # one record per slice, written once
        pmaptap.tap(y, "pd", dedup="per_device")  # every holder's copy
        pmaptap.tap(y.sum(), "loss", dedup="replicated")
        pmaptap.tap(jnp.ones(300) * 2, "whole", dedup="replicated")
        return y, y.sum()

    y, total = map(np.asarray, step(rows))
    jax.pmap(lambda v: pmaptap.tap(v * 2, "pmapped", dedup="per_device"))(jnp.arange(8.0))
    session.flush()
    rep = [d for d in _lines(tap_path) if d["name"] == "rep"]
    assert len(rep) == 2 and all(d["kind"] == "replicated" for d in rep)
    for name in ("rep", "pd"):
        got = pmaptap.assemble(tap_path, name, 0)
        assert got.dtype == np.float32 and np.array_equal(got, y), name
    assert _same_bits(pmaptap.assemble(tap_path, "loss", 0), total)
    assert np.array_equal(pmaptap.assemble(tap_path, "whole", 0), np.full(300, 2, np.float32))
    with pytest.raises(ValueError, match=r"'pmapped' step 0 .*is per_device.*devices 0, 1, "):
        pmaptap.assemble(tap_path, "pmapped", 0)
    with pytest.raises(ValueError, match=r"no records of tap 'rep' step 5"):
        pmaptap.assemble(tap_path, "rep", 5)
    with pytest.raises(ValueError, match=r"no records of tap 'rep' step 0 \(backward\)"):
        pmaptap.assemble(tap_path, "rep", 0, backward=True)
    # One slice's record gone: named, with the global shape.
    gone = os.path.join(os.path.dirname(tap_path), "gone.jsonl")
    with open(tap_path) as f, open(gone, "w") as g:
        g.writelines(line for line in f if '"index":[[0,64],[16,32]]' not in line)
    with pytest.raises(
        ValueError, match=r"slice\(s\) \[0:64,16:32\] of the global shape \[64, 32\]"
    ):
        pmaptap.assemble(gone, "rep", 0)
    with pytest.raises(ValueError, match=r"slice\(s\) \[0:64,16:32\]"):
        pmaptap.assemble(gone, "pd", 0)


def test_assemble_the_backward_cotangent_and_a_summarized_tap(session, tap_path):
    mesh = _mesh()
    x = jax.device_put(jnp.ones((64, 64)), NamedSharding(mesh, P("data", "model")))

    def loss(x):
        h = pmaptap.tap_grad(jnp.sin(x), "h")
        return (h * h).sum()

    g = jax.jit(jax.grad(loss))(x)
    with pmaptap.configured(max_value_bytes=64):
        jax.jit(lambda v: pmaptap.tap(v * 3, "summ", dedup="per_device"))(x)
    session.flush()
    ct = pmaptap.assemble(tap_path, "h", 0, backward=True)
    np.testing.assert_allclose(ct, 2 * np.sin(np.ones((64, 64), np.float32)), rtol=1e-6)
    assert np.asarray(g).shape == ct.shape
    with pytest.raises(ValueError, match=r"'summ' step 0.*statistics.*max_value_bytes"):
        pmaptap.assemble(tap_path, "summ", 0)


ASSEMBLE_JOB = """
    import os, jax, jax.numpy as jnp, numpy as np, pmaptap
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from pmaptap import distributed
    distributed.initialize()
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    full = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    def put(spec):
        s = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(full.shape, s, lambda i: full[i])
    @jax.jit
    def step(a, b):
        pmaptap.tap(jnp.sin(a) * 2, "act", dedup="per_device")
        # Replicated along "data": each slice's holders on both processes.
        pmaptap.tap({"w": jnp.cos(b), "n": jnp.cos(b).sum()}, "tree", dedup="auto")
        return a
    for path, layout in ((os.environ["TAP"], "file"), (os.environ["SHARDED"], "sharded")):
        with pmaptap.Session(path, run="mp", layout=layout):
            for _ in range(2):
                step(put(P("data", "model")), put(P(None, "model")))
"""


def _shard_files(path: str) -> list[str]:
    d = path + ".d"
    return [os.path.join(d, n) for n in sorted(os.listdir(d)) if n.endswith(".jsonl")]


def test_assemble_a_two_process_job_in_both_layouts(tmp_path):
    path, sharded = str(tmp_path / "mp.jsonl"), str(tmp_path / "sh.jsonl")
    proc, _ = run_launch(
        2, 4, python_cmd(ASSEMBLE_JOB), timeout=300, launcher_timeout=260, TAP=path, SHARDED=sharded
    )
    assert proc.returncode == 0, job_failed(proc)
    full = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    want_act = np.sin(full) * 2
    want_w = np.cos(full)
    # What each process computed, bit for bit (same CPU kernels here).
    want_act = np.asarray(jax.jit(lambda v: jnp.sin(v) * 2)(full))
    want_w = np.asarray(jax.jit(jnp.cos)(full))
    for p in (path, sharded):
        files = os.listdir(p + ".bytes")
        assert sorted(f[:6] for f in files) == ["p00000", "p00001"], files
        for step in (0, 1):
            act = pmaptap.assemble(p, "act", step)
            assert act.dtype == np.float32 and np.array_equal(act, want_act), p
            w = pmaptap.assemble(p, "tree", step, leaf="w")
            assert np.array_equal(w, want_w), p
        # Every stored byte is pointed at exactly once: a replicated slice
        # held on both processes had its bytes written by one of them only
        # (one file: after the cross-process dedup; sharded: its owner).
        lines = _lines(p) if p == path else sum((_lines(f) for f in _shard_files(p)), [])
        refs = [ref for d in lines for _, ref, _, _ in byte_leaves(d["bytes"], d["dtype"], None)]
        on_disk = sum(os.path.getsize(os.path.join(p + ".bytes", f)) for f in files)
        assert sum(r["nbytes"] for r in refs) == on_disk, p
        assert len({(r["file"], r["offset"]) for r in refs}) == len(refs)
        recs = pmaptap.read(p, name="act")
        assert sorted({r["process"] for r in recs}) == [0, 1]
        assert all(r["global_shape"] == [64, 64] for r in recs)
        assert cli.main(["validate", p]) == 0
    # The file without process 1's records: its shards are named.
    part = str(tmp_path / "part.jsonl")
    with open(path) as f, open(part, "w") as g:
        g.writelines(line for line in f if '"process":1,' not in line)
    with pytest.raises(
        ValueError,
        match=r"'act' step 0 .*no record holds the slice\(s\) \[32:64,0:32\]; \[32:64,32:64\] of",
    ):
        pmaptap.assemble(part, "act", 0)


def test_assemble_a_pytree_of_sharded_and_replicated_leaves(session, tap_path):
    """A params dict under jit (Equinox's filtered model, a Flax state): a
    sharded weight beside replicated biases. Each record holds one slice of
    the weight and the whole of each bias, so the records' hashes differ
    while the biases' copies are bit-equal: compared leaf by leaf."""
    mesh = _mesh()
    w = np.arange(16 * 4, dtype=np.float32).reshape(16, 4)
    b = np.arange(512, dtype=np.float32) - 0.5  # 2 KiB: stored as bytes
    c = np.arange(16, dtype=np.float32)  # inline
    params = {
        "w": jax.device_put(w, NamedSharding(mesh, P("data"))),
        "b": jax.device_put(b, NamedSharding(mesh, P())),
        "c": jax.device_put(c, NamedSharding(mesh, P())),
    }
    jax.jit(lambda p: pmaptap.tap(p, "params", dedup="auto"))(params)
    session.flush()
    recs = [d for d in _lines(tap_path) if d["name"] == "params"]
    assert len({d["vhash"] for d in recs}) == 4, recs  # one per slice of w
    got = pmaptap.assemble(tap_path, "params", 0)
    assert set(got) == {"w", "b", "c"}
    for k, want in (("w", w), ("b", b), ("c", c)):
        assert _same_bits(got[k], want), k
        assert _same_bits(pmaptap.assemble(tap_path, "params", 0, leaf=k), want), k


def test_assemble_a_pytree_with_none_holes(session, tap_path):
    """``eqx.partition(model, eqx.is_array)`` leaves ``None`` where a leaf is
    no array (a bias-free Linear, a Lambda layer). JAX does not count a None
    as a leaf, so a record's ``index`` and ``global_shape`` hold one entry
    per array leaf; every leaf after a hole must still get its own slices,
    and the hole comes back as None."""
    mesh = _mesh()
    y = np.arange(16, dtype=np.float32).reshape(4, 4)
    z = np.arange(16, dtype=np.float32).reshape(8, 2) + 100
    w = np.arange(8 * 6, dtype=np.float32).reshape(8, 6) - 7
    b = np.arange(300, dtype=np.float32) / 3  # stored as bytes
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    # The shape of eqx.partition's output for an MLP of a bias-free Linear,
    # a Lambda and a Linear: holes before, between and after array leaves.
    model = (
        {"weight": put(w, P("data", "model")), "bias": None},
        {"fn": None},
        {"weight": put(z, P("data")), "bias": put(b, P())},
    )

    @jax.jit
    def step(y, z, model):
        pmaptap.tap({"a": None, "y": y * 1, "z": z * 1}, "issue")  # the example as filed
        pmaptap.tap({"a": None, "y": y * 1}, "one")  # one array leaf: the bare index
        pmaptap.tap(model, "model", dedup="per_device")
        return y

    step(put(y, P("data", "model")), put(z, P("data", None)), model)
    tree = {"a": None, "y": jnp.arange(3.0), "z": jnp.ones((2, 2))}
    jax.pmap(lambda v: pmaptap.tap(tree, "pm", dedup="replicated"))(jnp.arange(8.0))
    session.flush()
    issue = [d for d in _lines(tap_path) if d["name"] == "issue"]
    assert issue and all(len(d["index"]) == 2 for d in issue), issue  # y and z only
    got = pmaptap.assemble(tap_path, "issue", 0)
    assert got["a"] is None and set(got) == {"a", "y", "z"}
    assert _same_bits(got["y"], y) and _same_bits(got["z"], z)
    assert _same_bits(pmaptap.assemble(tap_path, "issue", 0, leaf="y"), y)
    assert _same_bits(pmaptap.assemble(tap_path, "issue", 0, leaf="z"), z)
    assert pmaptap.assemble(tap_path, "issue", 0, leaf="a") is None
    one = pmaptap.assemble(tap_path, "one", 0)
    assert one["a"] is None and _same_bits(one["y"], y)
    got = pmaptap.assemble(tap_path, "model", 0)
    assert got[0]["bias"] is None and got[1] == {"fn": None}
    assert _same_bits(got[0]["weight"], w)
    assert _same_bits(got[2]["weight"], z) and _same_bits(got[2]["bias"], b)
    assert _same_bits(pmaptap.assemble(tap_path, "model", 0, leaf="2/bias"), b)
    assert _same_bits(pmaptap.assemble(tap_path, "model", 0, leaf=(2, "weight")), z)
    assert pmaptap.assemble(tap_path, "model", 0, leaf="1/fn") is None
    # Under pmap: one replicated record, no index; the hole stays a hole.
    pm = pmaptap.assemble(tap_path, "pm", 0)
    assert pm["a"] is None and _same_bits(pm["y"], np.arange(3, dtype=np.float32))
    assert _same_bits(pmaptap.assemble(tap_path, "pm", 0, leaf="z"), np.ones((2, 2), np.float32))
    assert pmaptap.assemble(tap_path, "pm", 0, leaf="a") is None


def _shard_line(device, value, index, gshape, *, name="x", shape=None, **fields) -> dict:
    """A per-device float32 shard record of ``name`` at step 0, inline."""
    from conftest import record_dict

    base = dict(
        name=name,
        kind="per_device",
        value=value,
        dtype="float32",
        shape=[len(value)] if shape is None else shape,
        device=device,
        coords={"data": device},
        index=index,
        global_shape=gshape,
    )
    return record_dict(**{**base, **fields})


def _write_lines(path, records) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(d) + "\n" for d in records)
    return str(path)


def test_assemble_refuses_slices_that_disagree_or_do_not_fit(tmp_path):
    """Copies of one slice, and slices that overlap, are compared by their
    bits; a disagreement, or a value that does not fill its slice, is an
    AssembleError naming the tap, the step, the leaf and the devices, never
    an array with one copy's values picked silently."""
    from pmaptap.errors import AssembleError

    def run(name, *records):
        return _write_lines(tmp_path / f"{name}.jsonl", records)

    # Overlapping slices that agree where they meet: fine.
    ok = run(
        "agree",
        _shard_line(0, [1.0, 2.0], [[0, 2]], [4]),
        _shard_line(1, [2.0, 3.0], [[1, 3]], [4]),
        _shard_line(2, [3.0, 4.0], [[2, 4]], [4]),
        _shard_line(3, [3.0, 4.0], [[2, 4]], [4]),  # an equal copy
    )
    assert pmaptap.assemble(ok, "x", 0).tolist() == [1.0, 2.0, 3.0, 4.0]
    # [0:2]=[1,2] and [1:3]=[9,9] disagree at [1:2] (was: [1,9,9,4]).
    overlap = run(
        "overlap",
        _shard_line(0, [1.0, 2.0], [[0, 2]], [4]),
        _shard_line(1, [9.0, 9.0], [[1, 3]], [4]),
        _shard_line(2, [3.0, 4.0], [[2, 4]], [4]),
    )
    with pytest.raises(
        AssembleError,
        match=r"tap 'x' step 0 .*slices \[0:2\] \(device 0\) and \[1:3\] \(device 1\) "
        r"overlap at \[1:2\] and disagree",
    ):
        pmaptap.assemble(overlap, "x", 0)
    # Per-device records (no vhash) of one slice with different values
    # (was: the first one won).
    copies = run(
        "copies",
        _shard_line(0, [1.0, 2.0], [[0, 2]], [4]),
        _shard_line(1, [1.0, 5.0], [[0, 2]], [4]),
        _shard_line(2, [3.0, 4.0], [[2, 4]], [4]),
    )
    with pytest.raises(
        AssembleError,
        match=r"tap 'x' step 0 .*copies of slice \[0:2\] disagree: device 0 and device 1",
    ):
        pmaptap.assemble(copies, "x", 0)
    # -0.0 is not 0.0: bits, not values.
    zeros = run(
        "zeros",
        _shard_line(0, [0.0, 1.0], [[0, 2]], [2]),
        _shard_line(1, [-0.0, 1.0], [[0, 2]], [2]),
    )
    with pytest.raises(AssembleError, match=r"copies of slice \[0:2\] disagree"):
        pmaptap.assemble(zeros, "x", 0)
    # A value that does not fill its slice (was: NumPy's bare broadcast
    # error), and one that is not its line's shape.
    short = run(
        "short",
        _shard_line(0, [1.0, 2.0, 3.0], [[0, 2]], [4]),
        _shard_line(1, [3.0, 4.0], [[2, 4]], [4]),
    )
    with pytest.raises(
        AssembleError,
        match=r"tap 'x' step 0 .*the record of device 0 holds a value of shape \[3\] for its "
        r"slice \[0:2\], of shape \[2\]",
    ):
        pmaptap.assemble(short, "x", 0)
    mislabeled = run(
        "mislabeled",
        _shard_line(0, [1.0, 2.0, 3.0], [[0, 2]], [4], shape=[2]),
        _shard_line(1, [3.0, 4.0], [[2, 4]], [4]),
    )
    with pytest.raises(
        AssembleError, match=r"the record of device 0 holds a value that is not a float32\[2\]"
    ):
        pmaptap.assemble(mislabeled, "x", 0)
    # A pytree's replicated leaf whose copies really differ: that leaf and
    # those devices are named; the sharded leaf alone still assembles.
    tree = run(
        "tree",
        *(
            _shard_line(
                d,
                {"b": [1.0, 2.0 + (d == 1)], "w": [float(d)]},
                [[[0, 2]], [[d, d + 1]]],
                [[2], [2]],
                shape={"b": [2], "w": [1]},
                dtype={"b": "float32", "w": "float32"},
            )
            for d in (0, 1)
        ),
    )
    with pytest.raises(
        AssembleError,
        match=r"tap 'x' step 0 .* leaf 'b': the copies of slice \[0:2\] disagree: "
        r"device 0 and device 1",
    ):
        pmaptap.assemble(tree, "x", 0)
    assert pmaptap.assemble(tree, "x", 0, leaf="w").tolist() == [0.0, 1.0]
    assert issubclass(AssembleError, ValueError)


# ------------------------------------------------------------ crash safety

KILLED_WRITER = """
    import os, sys, numpy as np, pmaptap
    w = pmaptap.Writer(os.environ["TAP"], run="k", process=0, layout=os.environ["LAYOUT"])
    step = 0
    while True:  # ~8 MiB a step, flushed each step, until killed
        w.write("big", step, np.full((1024, 2048), step, np.float32))
        w.write("loss", step, float(step))
        w.flush()
        step += 1
"""


@pytest.mark.parametrize("layout", ["file", "sharded"])
def test_sigkill_mid_write_leaves_no_line_without_its_bytes(tmp_path, layout):
    path = str(tmp_path / "run.jsonl")
    lines_file = path if layout == "file" else path + ".d/p00000.jsonl"
    proc = start_python(KILLED_WRITER, TAP=path, LAYOUT=layout)
    try:
        wait_for(
            lambda: os.path.exists(lines_file) and os.path.getsize(lines_file) > 3000,
            timeout=120,
            what="the writer's first lines",
        )
        time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)  # anywhere: most likely inside a write
    finally:
        proc.kill()
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    store = ByteStore(path)
    raw = _lines(lines_file)
    big = [d for d in raw if d["name"] == "big"]
    assert big
    for d in big:  # every line's bytes are there and whole
        assert store.missing_problem(d["bytes"]) is None
    recs = pmaptap.read(path, name="big")
    assert [r["step"] for r in recs] == [d["step"] for d in big]
    for r in recs:
        assert _same_bits(r["value"], np.full((1024, 2048), r["step"], np.float32))
    assert cli.main(["validate", path]) == 0
    assert cli.main(["summary", path]) == 0


def test_a_line_whose_bytes_are_missing_is_reported_and_skipped(tmp_path, caplog, capsys):
    path = str(tmp_path / "run.jsonl")
    with pmaptap.Writer(path, run="r", process=0) as w:
        for step in range(3):
            w.write("big", step, np.full(1000, step, np.float64))
            w.write("loss", step, float(step))
    (blob,) = os.listdir(path + ".bytes")
    blob = os.path.join(path + ".bytes", blob)
    size = os.path.getsize(blob)
    os.truncate(blob, size - 10)  # the last value's bytes cut short
    with logs_warning(caplog, r"skipped 1 invalid line\(s\): line 5: 'big' step 2: its bytes"):
        recs = pmaptap.read(path)
    assert [(r["name"], r["step"]) for r in recs] == [
        ("big", 0),
        ("loss", 0),
        ("big", 1),
        ("loss", 1),
        ("loss", 2),
    ]
    assert cli.main(["validate", path]) == 1
    assert "run.jsonl:5: bytes: its bytes" in capsys.readouterr().out
    assert cli.main(["summary", path]) == 0  # never loads bytes
    assert cli.main(["show", path, "--name", "big"]) == 0
    with pytest.raises(ValueError, match=r"past the end of that file"):
        pmaptap.assemble(path, "big", 2)
    os.remove(blob)
    with pytest.raises(ValueError, match=r"file 'run.jsonl.bytes/p00000-.*' is missing"):
        pmaptap.assemble(path, "big", 0)


HOSTILE_READS = """
    import json, os, resource, sys
    import numpy as np, tensorboardX  # noqa: F401 (imported before the limit)
    import pmaptap
    from pmaptap import cli
    from pmaptap.tapfile.export import tensorboard  # noqa: F401
    from pmaptap.tapfile.read import assembly  # noqa: F401
    from pmaptap.tapfile.source import arrays  # noqa: F401

    # The address space this process has, plus 512 MiB: any buffer of the
    # sizes the hostile lines claim (1 GiB and more) is a MemoryError.
    with open("/proc/self/status") as f:
        vm = next(int(ln.split()[1]) for ln in f if ln.startswith("VmSize:")) << 10
    resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20),) * 2)
    path = os.environ["TAP"]
    out = {"read": sorted(r["step"] for r in pmaptap.read(path, name="big"))}
    out["frame"] = sorted(pmaptap.read(path, name="big", as_frame=True)["step"].unique().tolist())
    out["assemble"] = pmaptap.assemble(path, "big", 1).tolist()[:3]
    out["refused"] = {}
    for step in (10, 11, 12, 13):
        try:
            pmaptap.assemble(path, "big", step)
        except ValueError as e:
            out["refused"][step] = f"{type(e).__name__}: {e}"
    out["tensorboard"] = cli.main(["export", path, "--tensorboard", os.environ["TB"]])
    out["validate"] = cli.main(["validate", path])
    print("RESULT " + json.dumps(out), flush=True)
"""


def test_hostile_byte_references_are_bad_lines_not_a_memory_error(tmp_path):
    """A line's ``bytes`` reference is data: ``nbytes: 2**62``, ``offset:
    2**64-1``, ``nbytes`` of 1 GiB (with a shape that agrees) on a run of a
    few KB. Each is reported and skipped like any bad line, the rest of the
    run read, under a real memory limit (RLIMIT_AS): nothing is allocated or
    sought before the reference is checked against its dtype, shape and the
    file's size (was: MemoryError in read/assemble/export, OverflowError
    from seek failing the whole read)."""
    path = str(tmp_path / "run.jsonl")
    with pmaptap.Writer(path, run="r", process=0) as w:
        for step in range(3):
            w.write("big", step, np.arange(512, dtype=np.float32) + step)
    lines = open(path).read().splitlines()
    good = json.loads(lines[1])
    ref = good["bytes"]
    hostile = [
        {"step": 10, "bytes": {**ref, "nbytes": 2**62}},
        {"step": 11, "bytes": {**ref, "offset": 2**64 - 1}},
        {"step": 12, "bytes": {**ref, "nbytes": 1 << 30}},
        # dtype and shape that agree with a 1 GiB nbytes: only the byte
        # file's size (a few KB) says no.
        {"step": 13, "shape": [1 << 28], "bytes": {**ref, "nbytes": (1 << 30) + 128}},
    ]
    with open(path, "w") as f:
        f.write("\n".join([lines[0], *(json.dumps({**good, **h}) for h in hostile), *lines[1:]]))
        f.write("\n")
    assert os.path.getsize(path) < 4096
    proc = run_python(HOSTILE_READS, TAP=path, TB=str(tmp_path / "tb"), timeout=240)
    (result,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    out = json.loads(result[7:])
    assert out["read"] == out["frame"] == [0, 1, 2], out
    assert out["assemble"] == [1.0, 2.0, 3.0]
    refused = out["refused"]
    assert sorted(map(int, refused)) == [10, 11, 12, 13], out
    assert "not the .npy of a float32[512]" in refused["10"], refused
    assert "past the end of that file" in refused["11"], refused
    assert "not the .npy of a float32[512]" in refused["12"], refused
    assert "past the end of that file" in refused["13"], refused
    assert all(v.startswith("MissingBytes: ") for v in refused.values()), refused
    assert out["tensorboard"] == 0 and out["validate"] == 1, out
    assert "MemoryError" not in proc.stderr and "OverflowError" not in proc.stderr
    # read() named each skipped line; the export wrote the good steps.
    assert "skipped 4 invalid line(s): line 2: 'big' step 10" in proc.stderr, proc.stderr
    assert "wrote 3 records as 0 scalar points and 3 histograms" in proc.stderr, proc.stderr


# ------------------------------------------------------------ readers


@pytest.fixture
def stored_run(tmp_path):
    """A run with stored array values (per-device and replicated), a
    pytree with a stored leaf, and scalars."""
    path = str(tmp_path / "run.jsonl")
    with pmaptap.Writer(path, run="r", process=0) as w:
        for step in range(3):
            w.write(
                "act", step, np.arange(512, dtype=np.float32) * step, kind="per_device", device=1
            )
            w.write("tree", step, {"w": np.ones((32, 32), np.float32), "b": np.float32(step)})
            w.write("loss", step, 1.0 / (step + 1))
    return path


def test_show_summary_and_validate_on_stored_values(stored_run, capsys):
    assert cli.main(["show", stored_run]) == 0
    out = capsys.readouterr().out
    assert "<float32[512] as bytes>" in out and "<float32[32,32] as bytes>" in out
    assert cli.main(["summary", stored_run]) == 0
    out = capsys.readouterr().out
    assert "act" in out and "loss" in out
    assert cli.main(["validate", stored_run]) == 0


def test_csv_and_parquet_exports_name_the_bytes(stored_run, tmp_path):
    out = str(tmp_path / "out.csv")
    assert cli.main(["export", stored_run, "--csv", out]) == 0
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    act = [r for r in rows if r["name"] == "act"]
    assert len(act) == 3
    ref = json.loads(act[2]["bytes"])
    got = ByteStore(stored_run).load_leaf(ref, "float32", [512])
    assert np.array_equal(got, np.arange(512, dtype=np.float32) * 2)
    tree = [r for r in rows if r["name"] == "tree"]
    assert tree[1]["value.b"] == "1.0" and json.loads(tree[1]["bytes"])["b"] is None
    pq = pytest.importorskip("pyarrow.parquet")
    out = str(tmp_path / "out.parquet")
    assert cli.main(["export", stored_run, "--parquet", out]) == 0
    table = pq.read_table(out).to_pandas()
    act = table[table["name"] == "act"]
    assert len(act) == 3 and "bytes" in table.columns
    frame = pmaptap.read(stored_run, as_frame=True)
    cells = frame[frame["name"] == "act"]["value"].tolist()
    assert np.array_equal(cells[1], np.arange(512, dtype=np.float32))


def test_tensorboard_histograms_of_stored_values(stored_run, tmp_path):
    pytest.importorskip("tensorboardX")
    from pmaptap.tapfile.export import tensorboard
    from pmaptap.tapfile.read.query import Filter

    stats, bad = tensorboard.export(stored_run, str(tmp_path / "tb"), Filter())
    assert not bad
    # act: 3 histograms; tree/w: 3 histograms; tree/b and loss: scalars.
    assert stats.histograms == 6 and stats.scalars == 6


def test_sharded_layout_and_forwarders_see_arrays(tmp_path):
    path = str(tmp_path / "run.jsonl")
    got = []
    mesh = _mesh()
    x = jax.device_put(jnp.arange(64.0 * 64).reshape(64, 64), NamedSharding(mesh, P("data")))

    @jax.jit
    def step(v):
        y = v + 1
        pmaptap.tap(y, "act", dedup="per_device")
        return y

    with pmaptap.Session(path, run="s", layout="sharded", forward=[got.append]):
        y = step(x)
    assert os.listdir(path + ".bytes")[0].startswith("p00000-")
    assert np.array_equal(pmaptap.assemble(path, "act", 0), np.asarray(y))
    acts = [d for d in got if d["name"] == "act"]
    assert len(acts) == 8 and all(isinstance(d["value"], np.ndarray) for d in acts)
    for d in acts:
        (a, b), (c, e) = d["index"]
        assert np.array_equal(d["value"], np.asarray(y)[a:b, c:e])
    assert cli.main(["validate", path]) == 0


def test_bytes_leaves_walks_pytree_references(stored_run):
    (d,) = [d for d in _lines(stored_run) if d["name"] == "tree"][:1]
    leaves = list(byte_leaves(d["bytes"], d["dtype"], d["shape"]))
    assert [(p, dt, sh) for p, _ref, dt, sh in leaves] == [("/w", "float32", [32, 32])]


def test_references_never_reach_outside_the_run_directory(tmp_path, caplog, capsys):
    secret = tmp_path / "secret.npy"
    np.save(secret, np.arange(300, dtype=np.float64))
    run = tmp_path / "runs"
    run.mkdir()
    path = str(run / "run.jsonl")
    line = {
        "run": "r",
        "name": "x",
        "step": 0,
        "kind": "replicated",
        "value": None,
        "dtype": "float64",
        "shape": [300],
        "process": 0,
        "time": 1.0,
        "host": "h",
        "replicas": 1,
        "bytes": {"file": "../secret.npy", "offset": 0, "nbytes": os.path.getsize(secret)},
    }
    with open(path, "w") as f:
        f.write(json.dumps(line) + "\n")
    with logs_warning(caplog, r"line 1: 'x' step 0: .*not inside the run's directory"):
        assert pmaptap.read(path) == []
    assert cli.main(["validate", path]) == 1
    assert "bytes.file must be a path inside the run's directory" in capsys.readouterr().out
    with pytest.raises(ValueError, match="not inside the run's directory"):
        pmaptap.assemble(path, "x", 0)
    # Bytes are only ever read into the numeric dtypes a record holds, never
    # as objects (pointers).
    os.replace(secret, run / "run.jsonl.npy")
    line["dtype"] = "object"
    line["bytes"]["file"] = "run.jsonl.npy"
    with open(path, "w") as f:
        f.write(json.dumps(line) + "\n")
    with logs_warning(caplog, r"line 1: 'x' step 0: dtype 'object' is not one a record holds"):
        assert pmaptap.read(path) == []


def test_queued_records_count_the_bytes_of_their_stored_arrays(tap_path, caplog):
    # 10 arrays of 1 MiB against max_pending_bytes=3 MiB while the writer
    # cannot write: the records waiting for it hold their arrays, so at most
    # 3 are kept (counted as 256 bytes each they would all be).
    import filelock

    with logs_warning(caplog, "dropped"):
        with pmaptap.Session(
            tap_path,
            overflow="drop_newest",
            max_pending_bytes=3 << 20,
            lock_timeout=0.05,
        ) as s:
            lock = filelock.FileLock(tap_path + ".lock")
            lock.acquire()
            try:
                f = jax.jit(lambda v, i: pmaptap.tap(v + i, "big", step=i))
                for i in range(10):
                    f(jnp.zeros(1 << 18, jnp.float32), i)  # 1 MiB
                    jax.effects_barrier()
                    # Time for the aggregator to take it (it lingers ~20 ms):
                    # from then on only its record waits, holding the array.
                    time.sleep(0.15)
                time.sleep(0.5)
            finally:
                lock.release()
            s.flush()
    recs = pmaptap.read(tap_path)
    data = [r for r in recs if r["name"] == "big"]
    (meta,) = [r for r in recs if r["name"] == "pmaptap/dropped"]
    assert len(data) <= 3 and len(data) + meta["dropped_total"] == 10
    for r in data:
        assert np.array_equal(r["value"], np.full(1 << 18, r["step"], np.float32))


def test_a_bytes_field_of_another_nesting_than_dtype_is_no_crash(tmp_path, capsys):
    """A hand-edited ``bytes`` field that nests where its dtype is one leaf
    (``{"a": <reference>}`` for ``"float32"``): readers take the line, and
    its value comes back as written, nothing loaded (was: AttributeError
    out of read(), its value walked by the field's nesting)."""
    path = str(tmp_path / "run.jsonl")
    with pmaptap.Writer(path, run="r", process=0) as w:
        w.write("big", 0, np.arange(512, dtype=np.float32))
    (good,) = map(json.loads, open(path).read().splitlines())
    odd = {**good, "step": 1, "value": {"a": None}, "shape": [], "bytes": {"a": good["bytes"]}}
    with open(path, "a") as f:
        f.write(json.dumps(odd) + "\n")
    got = pmaptap.read(path, name="big")
    assert [r["step"] for r in got] == [0, 1]
    assert np.array_equal(got[0]["value"], np.arange(512, dtype=np.float32))
    assert got[1]["value"] == {"a": None}
    assert cli.main(["show", path]) == 0
    assert cli.main(["validate", path]) == 1
    assert "bytes" in capsys.readouterr().out


def test_complex32_of_an_older_ml_dtypes_is_encodable():
    # ml_dtypes before 0.7 (which JAX 0.10 allows) gave complex32 the kind
    # "W": Writer.write refused it and encode_array raised. Checked with
    # ml_dtypes 0.6.0 installed aside; here its dtype's two attributes that
    # the rule reads (the suite's ml_dtypes is 0.7).
    from types import SimpleNamespace

    from pmaptap.tapfile.record import encodable, is_complex

    old = SimpleNamespace(kind="W", name="complex32", fields=None)
    assert is_complex(old) and encodable(old)
    assert is_complex(np.dtype(ml_dtypes.complex32)) and not is_complex(np.dtype(np.float32))
