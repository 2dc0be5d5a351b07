"""Record format: strict JSON, dtypes, non-finite encoding, read()."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import pmaptap
from conftest import logs_warning, record_dict, run_python
from pmaptap._host.pipeline import encode_array
from pmaptap.tapfile.record.format import decode_value, encodable

pytestmark = pytest.mark.usefixtures("transport")


def _strict_lines(path):
    def no_constants(name):
        raise AssertionError(f"non-standard JSON token {name}")

    with open(path, encoding="utf-8") as f:
        return [json.loads(line, parse_constant=no_constants) for line in f]


def test_every_line_is_strict_json_with_required_fields(session, tap_path):
    jax.pmap(lambda v: pmaptap.tap(v / 0.0, "inf", dedup="per_device"))(jnp.arange(8.0) - 4)
    session.flush()
    raw = _strict_lines(tap_path)
    assert len(raw) == 8
    for d in raw:
        for k in (
            "run",
            "name",
            "step",
            "kind",
            "value",
            "dtype",
            "shape",
            "process",
            "time",
            "host",
            "device",
            "coords",
        ):
            assert k in d, k
        assert d["run"] == "test" and isinstance(d["time"], float)
    # raw encoding is documented: strings for non-finite numbers
    assert {d["value"] for d in raw} == {"-Infinity", "NaN", "Infinity"}
    decoded = {r["device"]: r["value"] for r in pmaptap.read(tap_path)}
    assert decoded[0] == -math.inf and decoded[5] == math.inf and math.isnan(decoded[4])


@pytest.mark.parametrize(
    "value, dtype, expect",
    [
        (jnp.array([1.5, -2.25], jnp.bfloat16), "bfloat16", [1.5, -2.25]),
        (jnp.array([0.1], jnp.float32), "float32", [0.1]),
        (jnp.array([1, -7], jnp.int32), "int32", [1, -7]),
        (jnp.array([True, False]), "bool", [True, False]),
        (jnp.array([1 + 2j], jnp.complex64), "complex64", [complex(1, 2)]),
        (jnp.array([0.5], jnp.float16), "float16", [0.5]),
        (jnp.array([], jnp.float32), "float32", []),
        (jnp.float32(3.0), "float32", 3.0),
    ],
)
def test_dtypes_round_trip(session, tap_path, value, dtype, expect):
    jax.jit(lambda v: pmaptap.tap(v, "d"))(value)
    session.flush()
    (r,) = pmaptap.read(tap_path)
    assert r["dtype"] == dtype
    assert r["value"] == expect
    assert r["shape"] == list(np.shape(value))


def test_an_eager_python_or_numpy_number_keeps_its_value(session, tap_path):
    # Eagerly a tap's value was made a JAX value first: with x64 off,
    # time.time() became float32 (1796571900.0 of 1796571845.16), a Python
    # int above int32 was an OverflowError and np.int64(2**40 + 1) wrapped
    # to 1. Now it reaches the host as NumPy holds it; under jit a Python
    # number is a constant of the trace and takes JAX's dtype, as any.
    now = 1796571845.16
    pmaptap.tap(now, "time")
    pmaptap.tap(2**40 + 1, "int")
    pmaptap.tap(2**64 - 1, "uint")
    pmaptap.tap({"t": now, "n": -(2**62), "ok": True, "z": 1 + 2j}, "tree")
    pmaptap.tap(np.float64(now), "np")
    pmaptap.tap(np.int64(2**40 + 1), "npint")
    jax.jit(lambda x: pmaptap.tap(0.1, "traced") + x)(1.0)
    with pytest.raises(TypeError, match=r"pmaptap.tap\('big'\): \['b'\] is the Python int"):
        pmaptap.tap({"b": 2**64}, "big")
    session.flush()
    got = {r["name"]: (r["value"], r["dtype"]) for r in pmaptap.read(tap_path)}
    assert got == {
        "time": (now, "float64"),
        "int": (2**40 + 1, "int64"),
        "uint": (2**64 - 1, "uint64"),
        "tree": (
            {"t": now, "n": -(2**62), "ok": True, "z": 1 + 2j},
            {"t": "float64", "n": "int64", "ok": "bool", "z": "complex128"},
        ),
        "np": (now, "float64"),
        "npint": (2**40 + 1, "int64"),
        "traced": (0.1, "float32"),  # float32 written as its shortest text
    }


def test_fp8_and_bf16_nonfinite():
    value, dtype, shape = encode_array(np.array([np.nan, 2.0], ml_dtypes.float8_e4m3fn))
    assert value == ["NaN", 2.0] and dtype == "float8_e4m3fn" and shape == [2]
    value, _, _ = encode_array(np.array([np.inf], ml_dtypes.bfloat16))
    assert value == ["Infinity"]


def test_name_with_quotes_newlines_and_unicode(session, tap_path):
    name = 'loss "main"\nλ✓'
    jax.jit(lambda v: pmaptap.tap(v, name))(jnp.float32(1))
    session.flush()
    with open(tap_path, encoding="utf-8") as f:
        assert len(f.read().splitlines()) == 1
    assert pmaptap.read(tap_path)[0]["name"] == name


def test_read_skips_garbage_and_torn_tail_with_a_warning(tmp_path, caplog):
    p = tmp_path / "f.jsonl"
    good = record_dict()
    p.write_text(
        json.dumps(good)
        + "\nnot json\n"
        + json.dumps({"x": 1})
        + "\n"
        + json.dumps(dict(good, step=1))
        + "\n"
        + '{"run": "r", "na'
    )
    with logs_warning(caplog, "skipped 3 invalid line"):
        recs = pmaptap.read(p)
    assert [r["step"] for r in recs] == [0, 1]


def test_read_never_evaluates_content(tmp_path, caplog):
    p = tmp_path / "evil.jsonl"
    p.write_text('__import__("os").system("touch %s")\n' % (tmp_path / "pwned"))
    with logs_warning(caplog):
        assert pmaptap.read(p) == []
    assert not (tmp_path / "pwned").exists()


@pytest.mark.callback_only("its steps run in a subprocess: the transport fixture cannot reach them")
def test_json_fallback_writes_the_same_records_as_orjson(tmp_path):
    """orjson is the fast path; without it (PMAPTAP_NO_ORJSON=1) the stdlib
    encoder must write the same values, non-finite markers included."""
    code = """
        import os, jax, jax.numpy as jnp, pmaptap
        with pmaptap.Session(os.environ["TAP"], run="enc"):
            jax.pmap(lambda v: pmaptap.tap({"x": v * 0.1, "n": v / 0.0,
                                            "i": v.astype(jnp.int32), "b": v > 1,
                                            "h": v.astype(jnp.bfloat16)},
                                           "t", dedup="per_device"))(jnp.arange(4.0) - 1)
    """
    keep = ("name", "step", "value", "dtype", "shape", "device", "coords")
    out = {}
    for mode in ("orjson", "json"):
        path = str(tmp_path / f"{mode}.jsonl")
        env = {"TAP": path}
        if mode == "json":
            env["PMAPTAP_NO_ORJSON"] = "1"
        run_python(code, devices=4, **env)
        _strict_lines(path)  # strict JSON either way
        out[mode] = sorted(
            json.dumps({k: r[k] for k in keep}, sort_keys=True, default=str)
            for r in pmaptap.read(path)
        )
    assert len(out["json"]) == 4 and out["json"] == out["orjson"]


@pytest.mark.parametrize(
    "stacked",
    [
        np.array([0.1, 1 / 3, 1e-8, -0.0, 3.4e38, 16777217.0, 2.5, 7e-45], np.float32),
        np.array([0.1, 1 / 3, 1e-300, -0.0, 1.7e308, 2.0**60], np.float64),
        np.array([np.iinfo(np.int32).min, -1, 0, np.iinfo(np.int32).max], np.int32),
        np.array([np.iinfo(np.int64).min, np.iinfo(np.int64).max], np.int64),
        np.array([0, np.iinfo(np.uint64).max], np.uint64),
        np.array([True, False, True], np.bool_),
        np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3) / 7,
        np.arange(24, dtype=np.int64).reshape(2, 3, 4),
        np.array([[1.0, np.nan], [np.inf, -np.inf]], np.float32),  # non-finite
        np.array([0.1, 2.5], ml_dtypes.bfloat16),  # widened
        np.array([1, 2], np.int8),  # not a fast dtype
    ],
    ids=lambda a: f"{a.dtype}{list(a.shape)}",
)
def test_encoding_gathered_rows_at_once_equals_row_by_row(stacked):
    # The gathered fast path (encode_rows) must write exactly the bytes that
    # encoding each device's copy on its own writes.
    from pmaptap._host.pipeline.encode import encode_rows, encode_tree
    from pmaptap.tapfile.record.format import encode_line

    treedef = jax.tree_util.tree_structure(0)
    rows = list(range(stacked.shape[0]))[::-1]
    fast = encode_rows(treedef, [stacked], rows)
    for k, (value, dtype, shape) in zip(rows, fast):
        v2, d2, s2 = encode_tree(treedef, [stacked[k]])
        assert encode_line({"v": value}) == encode_line({"v": v2})
        assert (dtype, shape) == (d2, s2)


def test_encoding_gathered_pytree_rows_equals_row_by_row():
    from pmaptap._host.pipeline.encode import encode_rows, encode_tree
    from pmaptap.tapfile.record.format import encode_line

    tree = {"a": np.float32(0), "b": np.zeros(2, np.int32)}
    treedef = jax.tree_util.tree_structure(tree)
    stacked = [np.array([0.1, 0.2], np.float32), np.arange(4, dtype=np.int32).reshape(2, 2)]
    for k, enc in zip([0, 1], encode_rows(treedef, stacked, [0, 1])):
        assert encode_line({"e": enc}) == encode_line(
            {"e": encode_tree(treedef, [a[k] for a in stacked])}
        )


# ------------------------------------------------------------ every JAX dtype


def _every_jax_dtype() -> list[np.dtype]:
    """Every dtype JAX knows, found at run time so that a dtype a later JAX
    adds is covered without editing this test: JAX's own set of valid dtypes
    (with float0 and the string dtype) plus every concrete scalar type
    jax.numpy exposes (in case the private set moves)."""
    from jax._src import dtypes as jax_dtypes

    found = set(getattr(jax_dtypes, "_jax_dtype_set", ()))
    for attr in dir(jnp):
        t = getattr(jnp, attr)
        if isinstance(t, type) and issubclass(t, np.generic):
            try:
                found.add(np.dtype(t))
            except TypeError:  # abstract: jnp.floating, jnp.number, ...
                pass
    assert len(found) > 20, found
    return sorted(found, key=str)


def _sample(dt: np.dtype) -> np.ndarray | None:
    """Three extreme values of ``dt`` (min, max, and 1 or the smallest
    normal float); None for a dtype with no numeric values (float0, str)."""
    if dt == np.bool_:
        return np.array([True, False, True])
    if jnp.issubdtype(dt, jnp.integer):
        info = jnp.iinfo(dt)
        return np.array([int(info.min), int(info.max), max(int(info.min), 1)], dt)
    if jnp.issubdtype(dt, jnp.floating):
        info = jnp.finfo(dt)
        return np.array([float(info.max), float(info.smallest_normal), float(info.min)], dt)
    if jnp.issubdtype(dt, jnp.complexfloating):
        return np.array([1 + 2j, -0.5j, 3.25], dt)
    return None


def _wide(dt: np.dtype) -> np.dtype:
    """A dtype JAX moves everywhere that holds every value of ``dt``."""
    if dt == np.bool_:
        return np.dtype(bool)
    if jnp.issubdtype(dt, jnp.unsignedinteger):
        return np.dtype(np.uint64)
    if jnp.issubdtype(dt, jnp.integer):
        return np.dtype(np.int64)
    return np.dtype(np.complex128 if jnp.issubdtype(dt, jnp.complexfloating) else np.float64)


def _bits_equal(value, sample: np.ndarray) -> bool:
    """Whether a record's value, put back into the sample's dtype, has the
    sample's exact bits (floats are written in the shortest repr of their
    own precision, which round-trips there; float8/float16/bfloat16 are
    widened to float32 first, so they are read back through float32)."""
    dt = sample.dtype
    if jnp.issubdtype(dt, jnp.floating) and dt.itemsize < 4:
        got = np.array(value, dtype=np.float32).astype(dt)
    else:
        got = np.array(value, dtype=dt)
    return got.shape == sample.shape and got.tobytes() == sample.tobytes()


@pytest.mark.parametrize("dt", _every_jax_dtype(), ids=str)
def test_every_jax_dtype_is_written_exactly_or_refused_at_trace_time(session, tap_path, dt):
    sample = _sample(dt)
    with jax.enable_x64(True):  # 64-bit dtypes reach the tap as themselves
        if sample is None:  # float0, strings
            odd = np.zeros(3, dt) if dt.kind == "V" else np.array(["a", "b", "c"], dtype=dt)
            for value in (odd, {"ok": np.float32(1), "odd": odd}):
                with pytest.raises(TypeError, match=r"pmaptap.tap\('odd'\)"):
                    pmaptap.tap(value, "odd")
            session.flush()
            assert pmaptap.read(tap_path) == []
            return
        # Values are made on device (from a wide dtype, exactly), as a
        # program makes them: JAX cannot pass some narrow dtypes in or out.
        src = jnp.asarray(sample.astype(_wide(dt)))
        if jnp.issubdtype(dt, jnp.integer) and jnp.iinfo(dt).bits == 1:
            with pytest.raises(TypeError, match=r"pmaptap.tap\('odd'\).*1-bit"):
                jax.jit(lambda v: pmaptap.tap(v.astype(dt), "odd"))(src)
            return
        try:
            jax.jit(lambda v: v.astype(dt).astype(_wide(dt)))(src).block_until_ready()
        except Exception as e:  # noqa: BLE001 - JAX's own limitation
            if encodable(dt):
                # The host side still writes it (for a backend that computes
                # it), and a reader gets the value back.
                value, dtype, shape = encode_array(sample)
                value = decode_value(np.asarray(value).tolist(), dtype, shape)  # as read
                assert (dtype, shape) == (dt.name, [3]) and _bits_equal(value, sample)
            else:  # one the format cannot hold (JAX 0.12's bcomplex32)
                with pytest.raises(TypeError, match=r"pmaptap.tap\('odd'\)"):
                    jax.jit(lambda v: pmaptap.tap(v.astype(dt), "odd"))(src)
            pytest.skip(
                f"JAX itself cannot compute with {dt} on "
                f"{jax.default_backend()}: {str(e).splitlines()[0][:80]}"
            )
        jax.jit(lambda v: pmaptap.tap(v.astype(dt), "jit"))(src)
        # Every copy differs: gathered per-device rows (a pytree of two
        # leaves: one packed collective, or one per leaf for sub-byte dtypes).
        rows = jnp.stack([jnp.roll(src, k) for k in range(8)])
        jax.pmap(
            lambda v: pmaptap.tap((v.astype(dt), v[::-1].astype(dt)), "pmap", dedup="per_device")
        )(rows)
        # Replicated above gather_max_bytes: hashes compared on device.
        with pmaptap.configured(gather_max_bytes=0):
            jax.pmap(lambda v: pmaptap.tap(v.astype(dt), "hashed", dedup="replicated"))(
                jnp.stack([src] * 8)
            )
    session.flush()
    recs = pmaptap.read(tap_path)
    (jit,) = [r for r in recs if r["name"] == "jit"]
    assert (jit["dtype"], jit["shape"]) == (dt.name, [3])
    assert _bits_equal(jit["value"], sample), (jit["value"], sample)
    if jnp.issubdtype(dt, jnp.integer):
        assert all(type(v) is int for v in jit["value"])
    (hashed,) = [r for r in recs if r["name"] == "hashed"]
    assert _bits_equal(hashed["value"], sample) and hashed["dtype"] == dt.name
    assert hashed["replicas"] == 8
    per_device = {r["device"]: r for r in recs if r["name"] == "pmap"}
    assert sorted(per_device) == list(range(8))
    for d, r in per_device.items():
        row = np.roll(sample, d)
        assert _bits_equal(r["value"][0], row) and _bits_equal(r["value"][1], row[::-1])
        assert r["dtype"] == [dt.name, dt.name]


def test_sub_byte_integers_are_plain_json_integers(session, tap_path):
    jax.jit(lambda v: pmaptap.tap(v, "q"))(jnp.array([-8, 7, 0], jnp.int4))
    session.flush()
    with open(tap_path, encoding="utf-8") as f:
        raw = json.loads(f.readline())
    assert raw["value"] == [-8, 7, 0] and raw["dtype"] == "int4"
    assert all(type(v) is int for v in raw["value"])


def test_sub_byte_values_reach_host_callback_functions_in_their_own_dtype():
    from pmaptap import host_callback as hcb

    seen = []
    x = jnp.array([[1, -2], [3, -4]], jnp.int4)
    jax.pmap(lambda v: hcb.id_tap(lambda a, _: seen.append(a), v))(x)
    hcb.barrier_wait()
    assert sorted(a.astype(int).tolist() for a in seen) == [[1, -2], [3, -4]]
    assert {a.dtype for a in seen} == {np.dtype(jnp.int4)}
