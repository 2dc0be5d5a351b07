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
from conftest import logs_warning, run_python
from pmaptap._host.encode import encode_array


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
        for k in ("run", "name", "step", "kind", "value", "dtype", "shape",
                  "process", "time", "host", "device", "coords"):
            assert k in d, k
        assert d["run"] == "test" and isinstance(d["time"], float)
    # raw encoding is documented: strings for non-finite numbers
    assert {d["value"] for d in raw} == {"-Infinity", "NaN", "Infinity"}
    decoded = {r["device"]: r["value"] for r in pmaptap.read(tap_path)}
    assert decoded[0] == -math.inf and decoded[5] == math.inf and math.isnan(decoded[4])


@pytest.mark.parametrize("value, dtype, expect", [
    (jnp.array([1.5, -2.25], jnp.bfloat16), "bfloat16", [1.5, -2.25]),
    (jnp.array([0.1], jnp.float32), "float32", [0.1]),
    (jnp.array([1, -7], jnp.int32), "int32", [1, -7]),
    (jnp.array([True, False]), "bool", [True, False]),
    (jnp.array([1 + 2j], jnp.complex64), "complex64", [complex(1, 2)]),
    (jnp.array([0.5], jnp.float16), "float16", [0.5]),
    (jnp.array([], jnp.float32), "float32", []),
    (jnp.float32(3.0), "float32", 3.0),
])
def test_dtypes_round_trip(session, tap_path, value, dtype, expect):
    jax.jit(lambda v: pmaptap.tap(v, "d"))(value)
    session.flush()
    (r,) = pmaptap.read(tap_path)
    assert r["dtype"] == dtype
    assert r["value"] == expect
    assert r["shape"] == list(np.shape(value))


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
    good = {"run": "r", "name": "a", "step": 0, "kind": "replicated", "value": 1,
            "dtype": "int32", "shape": [], "process": 0, "time": 1.0,
            "host": "h", "replicas": 1}
    p.write_text(json.dumps(good) + "\nnot json\n" + json.dumps({"x": 1}) + "\n"
                 + json.dumps(dict(good, step=1)) + "\n" + '{"run": "r", "na')
    with logs_warning(caplog, "skipped 3 invalid line"):
        recs = pmaptap.read(p)
    assert [r["step"] for r in recs] == [0, 1]


def test_read_never_evaluates_content(tmp_path, caplog):
    p = tmp_path / "evil.jsonl"
    p.write_text('__import__("os").system("touch %s")\n' % (tmp_path / "pwned"))
    with logs_warning(caplog):
        assert pmaptap.read(p) == []
    assert not (tmp_path / "pwned").exists()


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
        _strict_lines(path)                              # strict JSON either way
        out[mode] = sorted(json.dumps({k: r[k] for k in keep}, sort_keys=True,
                                      default=str)
                           for r in pmaptap.read(path))
    assert len(out["json"]) == 4 and out["json"] == out["orjson"]


@pytest.mark.parametrize("stacked", [
    np.array([0.1, 1 / 3, 1e-8, -0.0, 3.4e38, 16777217.0, 2.5, 7e-45], np.float32),
    np.array([0.1, 1 / 3, 1e-300, -0.0, 1.7e308, 2.0 ** 60], np.float64),
    np.array([np.iinfo(np.int32).min, -1, 0, np.iinfo(np.int32).max], np.int32),
    np.array([np.iinfo(np.int64).min, np.iinfo(np.int64).max], np.int64),
    np.array([0, np.iinfo(np.uint64).max], np.uint64),
    np.array([True, False, True], np.bool_),
    np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3) / 7,
    np.arange(24, dtype=np.int64).reshape(2, 3, 4),
    np.array([[1.0, np.nan], [np.inf, -np.inf]], np.float32),          # non-finite
    np.array([0.1, 2.5], ml_dtypes.bfloat16),                          # widened
    np.array([1, 2], np.int8),                                        # not a fast dtype
], ids=lambda a: f"{a.dtype}{list(a.shape)}")
def test_encoding_gathered_rows_at_once_equals_row_by_row(stacked):
    # The gathered fast path (encode_rows) must write exactly the bytes that
    # encoding each device's copy on its own writes.
    from pmaptap._host.encode import encode_rows, encode_tree
    from pmaptap.tapfile.format import encode_line
    treedef = jax.tree_util.tree_structure(0)
    rows = list(range(stacked.shape[0]))[::-1]
    fast = encode_rows(treedef, [stacked], rows)
    for k, (value, dtype, shape) in zip(rows, fast):
        v2, d2, s2 = encode_tree(treedef, [stacked[k]])
        assert encode_line({"v": value}) == encode_line({"v": v2})
        assert (dtype, shape) == (d2, s2)


def test_encoding_gathered_pytree_rows_equals_row_by_row():
    from pmaptap._host.encode import encode_rows, encode_tree
    from pmaptap.tapfile.format import encode_line
    tree = {"a": np.float32(0), "b": np.zeros(2, np.int32)}
    treedef = jax.tree_util.tree_structure(tree)
    stacked = [np.array([0.1, 0.2], np.float32), np.arange(4, dtype=np.int32).reshape(2, 2)]
    for k, enc in zip([0, 1], encode_rows(treedef, stacked, [0, 1])):
        assert encode_line({"e": enc}) == encode_line(
            {"e": encode_tree(treedef, [a[k] for a in stacked])})
