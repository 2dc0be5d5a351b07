"""Per-device scalar records whose lines the aggregator builds from a
per-site template (format.py ``Record.line_pieces`` / ``put_lines``): every such line must be
byte for byte the line ``Record.to_json_dict`` + ``encode_line`` would write,
for every dtype, value and site, and a site whose template cannot be cut
keeps the ordinary encoding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import orjson
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import pmaptap
import pmaptap._host.sinks.file as sink_mod
from conftest import record_dict, run_python
from pmaptap.tapfile.record.format import _STEP_SENTINEL, MAX_STEP, Record, encode_line, new_record


@pytest.fixture
def written(monkeypatch):
    """Every Record handed to the file sink, in order."""
    seen = []
    real = sink_mod.FileSink.write

    def spy(self, records):
        seen.extend(records)
        return real(self, records)

    monkeypatch.setattr(sink_mod.FileSink, "write", spy)
    return seen


VALUES = {
    "float32": np.array([0.1, -0.0, 1e-7, 3.4e38, 16777216.0, -2.5, 1e20, 7.0], np.float32),
    "int32": np.array([0, -1, 2**31 - 1, -(2**31), 7, 8, 9, 10], np.int32),
    "bool": np.array([True, False] * 4),
    "uint8": np.array([0, 255, 1, 2, 3, 4, 5, 6], np.uint8),
    "float16": np.array([0.1, -0.0, 65504, 6e-8, 1.5, 2, 3, 4], np.float16),
}


@pytest.mark.parametrize("dtype", sorted(VALUES))
def test_template_lines_equal_the_ordinary_encoding(session, tap_path, written, dtype):
    name = 'n\u00e9 "q" \\ x'  # quotes, a backslash, non-ASCII

    def body(v):
        pmaptap.tap(v[0], name, dedup="per_device")
        pmaptap.tap(v[0], "stepped", dedup="per_device", step=2**40 + 3)
        return v

    f = jax.pmap(body, axis_name="dp")
    for _ in range(3):
        f(jnp.asarray(VALUES[dtype])[:, None]).block_until_ready()
    session.flush()
    fast = [r for r in written if r.__dict__.get("_line") is not None]
    assert len(written) == 48
    if dtype in ("float32", "int32", "bool"):  # encode_rows' one-round-trip dtypes
        assert len(fast) == 48
    for r in written:
        assert r.encode() == encode_line(r.to_json_dict()), r
    got = pmaptap.read(tap_path)
    assert sorted((r["name"], r["step"], r["device"]) for r in got) == sorted(
        (r.name, r.step, r.device) for r in written
    )


def test_two_axis_mesh_and_float_steps_of_a_shard_map(session, tap_path, written):
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("dp", "mp"))

    def body(v):
        pmaptap.tap(v.sum() * 0.37, "s", dedup="per_device")
        return v

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("dp", "mp"), out_specs=P("dp", "mp")))
    x = jax.device_put(jnp.arange(64.0).reshape(8, 8), jax.NamedSharding(mesh, P("dp", "mp")))
    for _ in range(2):
        f(x).block_until_ready()
    session.flush()
    assert written and all(r.__dict__.get("_line") is not None for r in written)
    for r in written:
        assert r.encode() == encode_line(r.to_json_dict())
    assert {tuple(sorted(r["coords"].items())) for r in pmaptap.read(tap_path)} == {
        (("dp", i), ("mp", j)) for i in range(2) for j in range(4)
    }


def test_non_finite_values_and_ambiguous_sites_keep_the_ordinary_encoding(
    session, tap_path, written
):
    # A name holding the step sentinel's text cannot be cut unambiguously.
    tricky = f'"step":{_STEP_SENTINEL}'

    def body(v):
        pmaptap.tap(v[0], tricky, dedup="per_device")
        pmaptap.tap(v[0] / 0.0, "inf", dedup="per_device")  # non-finite: slow path
        return v

    jax.pmap(body, axis_name="dp")(jnp.arange(8.0)[:, None]).block_until_ready()
    session.flush()
    assert len(written) == 16
    assert all(r.__dict__.get("_line") is None for r in written)
    recs = pmaptap.read(tap_path)
    assert {r["name"] for r in recs} == {tricky, "inf"}
    assert any(np.isnan(r["value"]) for r in recs if r["name"] == "inf")  # 0/0 on device 0


def _per_device_template(**fields) -> dict:
    """The fields of a float32 per_device record of device 3 (else
    conftest.record_dict's), for Record.line_pieces / from_template."""
    base = {"kind": "per_device", "dtype": "float32", "process": 1, "device": 3}
    return new_record(**record_dict(**{**base, "coords": {"dp": 3}, **fields})).template()


def test_line_pieces_rebuild_the_sentinel_line():
    template = _per_device_template()
    pieces = Record.line_pieces(template, "float32", [])
    assert pieces is not None
    line = b"".join((pieces[0], b"12", pieces[1], b"0.5", pieces[2], b"3.25", pieces[3]))
    want = Record(**dict(template, step=12, value=0.5, time=3.25))
    assert line == encode_line(want.to_json_dict())


def test_put_lines_write_what_encode_writes():
    # The step and time formatting of the fast line lives in put_lines, the
    # rest in the pieces: together, each record's line is its own encoding,
    # at the step's and time's extremes too.
    template = _per_device_template(name='n\u00e9 "q" \\ x', coords={"dp": 3, "mp": 0}, attempt=2)
    values = [0.1, -2.5, 1e20, 7, True]
    pieces = [Record.line_pieces(template, "float32", [])] * len(values)
    assert pieces[0] is not None
    for step, now in ((0, 0.0), (2**40 + 3, 1764600000.1234567), (MAX_STEP, 3.25)):
        recs = [Record.from_template(template, step, v, "float32", [], now) for v in values]
        Record.put_lines(recs, pieces, [orjson.dumps(v) for v in values], step, now)
        for r in recs:
            assert r.__dict__.get("_line") is not None
            assert r.encode() == encode_line(r.to_json_dict()), r
    # A template taken from a record that has its line never hands the line
    # on: a copy with another value encodes its own.
    again = Record.from_template(recs[0].template(), 5, 1.5, "float32", [], 1.0)
    assert again.encode() == encode_line(again.to_json_dict())
    assert b'"value":1.5' in again.encode()


def test_64_bit_scalars_under_x64():
    # float64/int64/uint64 only exist on device with jax_enable_x64.
    out = run_python(
        """
        import tempfile, numpy as np, jax, jax.numpy as jnp, pmaptap
        import pmaptap._host.sinks.file as sink_mod
        from pmaptap.tapfile.record.format import encode_line
        seen, real = [], sink_mod.FileSink.write
        sink_mod.FileSink.write = lambda self, rs: (seen.extend(rs), real(self, rs))[1]
        vals = {
            "f64": np.array([0.1, -0.0, 1e-300, 1.7e308, 2.0**53 + 2, -2.5, 1e16, 1 / 3]),
            "i64": np.array([0, -1, 2**63 - 1, -(2**63), 2**53 + 1, 5, 6, 7], np.int64),
            "u64": np.array([0, 2**64 - 1, 2**53 + 1, 3, 4, 5, 6, 7], np.uint64),
        }
        path = tempfile.mktemp(suffix=".jsonl")
        with pmaptap.Session(path):
            for name, v in vals.items():
                f = jax.pmap(lambda x, name=name: pmaptap.tap(x[0], name, dedup="per_device"))
                f(jnp.asarray(v)[:, None]).block_until_ready()
        fast = sum(r.__dict__.get("_line") is not None for r in seen)
        same = all(r.encode() == encode_line(r.to_json_dict()) for r in seen)
        back = {(r["name"], r["device"]): r["value"] for r in pmaptap.read(path)}
        exact = all(back[(n, d)] == v[d].item() for n, v in vals.items() for d in range(8))
        print("records", len(seen), "fast", fast, "same", same, "exact", exact)
        """,
        JAX_ENABLE_X64="1",
    ).stdout
    assert "records 24 fast 24 same True exact True" in out, out
