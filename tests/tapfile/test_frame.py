"""Analysis-ready data: ``pmaptap.read(..., as_frame=True)``'s tidy columns,
``pmaptap export --parquet`` (round trip with dtypes checked),
``pmaptap.per_device`` and the documented ``pandas.read_json`` one-liner."""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest

import pmaptap
from conftest import ROOT, run_python, subprocess_env

pd = pytest.importorskip("pandas")

# pmap on 8 devices: a replicated loss (NaN at step 1, inf at step 2), a
# per-device scalar, a per-device pytree with an array leaf, an eager int.
_PROGRAM = """
    import jax, jax.numpy as jnp, pmaptap

    def body(x, step):
        loss = jax.lax.pmean(jnp.mean(x), "dp")
        loss = jnp.where(step == 1, jnp.nan, jnp.where(step == 2, jnp.inf, loss))
        pmaptap.tap(loss, "loss", step=step, dedup="replicated")
        pmaptap.tap(jnp.sum(x), "gnorm", step=step, dedup="per_device")
        pmaptap.tap({"w": x, "b": jnp.sum(x) * 2}, "params", step=step,
                    dedup="per_device")
        return x + 1

    f = jax.pmap(body, axis_name="dp", in_axes=(0, None))
    with pmaptap.Session(PATH, run="frame"):
        x = jnp.arange(16.0).reshape(8, 2)
        for s in range(3):
            x = f(x, s)
            pmaptap.tap(jnp.int32(10 * s), "count", step=s)
"""
N = 3 * (1 + 8 + 8 + 1)


@pytest.fixture(scope="module")
def taps(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("frame") / "taps.jsonl")
    run_python(textwrap.dedent(_PROGRAM).replace("PATH", repr(path)))
    return path


def _check_tidy(df, recs) -> None:
    """The columns and dtypes a frame must have, whether built by read() or
    read back from Parquet."""
    assert len(df) == len(recs) == N
    assert str(df["step"].dtype) == "int64"
    for col in ("device", "process", "replicas", "coords.dp"):
        assert str(df[col].dtype) == "Int64", col
    assert str(df["value"].dtype) == "float64"
    assert str(df["value.b"].dtype) == "float64"
    assert str(df["divergent"].dtype) == "bool"
    assert isinstance(df["time"].dtype, pd.DatetimeTZDtype) and str(df["time"].dt.tz) == "UTC"
    assert list(df["name"]) == [r["name"] for r in recs]  # file order

    loss = df[df["name"] == "loss"].set_index("step")["value"]
    assert math.isnan(loss[1]) and loss[2] == math.inf  # real floats
    assert df.loc[df["name"] == "loss", "device"].isna().all()  # nullable
    gnorm = df[(df["name"] == "gnorm") & (df["device"] == 3)]
    want = next(r for r in recs if r["name"] == "gnorm" and r["device"] == 3)
    assert gnorm["value"].iloc[0] == pytest.approx(want["value"])
    assert gnorm["coords.dp"].iloc[0] == 3
    p = df[(df["name"] == "params") & (df["device"] == 5) & (df["step"] == 0)].iloc[0]
    assert list(p["value.w"]) == [10.0, 11.0] and p["value.b"] == 42.0
    assert math.isnan(p["value"])  # not this tap's column
    count = df[df["name"] == "count"]
    assert list(count["value"]) == [0.0, 10.0, 20.0]
    first = next(r for r in recs if r["name"] == "loss")
    assert df.loc[df["name"] == "loss", "time"].iloc[0].timestamp() == pytest.approx(
        first["time"], abs=1e-5
    )


def test_read_as_frame_has_tidy_columns(taps):
    recs = pmaptap.read(taps)
    df = pmaptap.read(taps, as_frame=True)
    _check_tidy(df, recs)
    # The public column order, pinned as users see it (format.RECORD_COLUMNS
    # is where it is made; this is what it must keep making).
    assert " ".join(df.columns[:11]) == (
        "run name step pass kind process device replicas divergent time host"
    )


def test_parquet_round_trip_keeps_dtypes(taps, tmp_path):
    pytest.importorskip("pyarrow")
    out = str(tmp_path / "t.parquet")
    proc = subprocess.run(
        [sys.executable, "-m", "pmaptap", "export", taps, "--parquet", out],
        env=subprocess_env(1),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {N} rows" in proc.stderr
    back = pd.read_parquet(out)
    frame = pmaptap.read(taps, as_frame=True)
    _check_tidy(back, pmaptap.read(taps))
    assert list(back.columns) == list(frame.columns)
    for col in frame.columns:
        if frame[col].dtype != object:
            assert back[col].dtype == frame[col].dtype, col
            pd.testing.assert_series_equal(back[col], frame[col], check_names=True)
    # dtype mixes names and pytree objects: JSON text in Parquet.
    p = back[back["name"] == "params"].iloc[0]
    assert (
        p["dtype"] == '{"b":"float32","w":"float32"}'
        or p["dtype"] == '{"w":"float32","b":"float32"}'
    )
    # A filter applies as for --csv.
    out2 = str(tmp_path / "loss.parquet")
    assert (
        subprocess.run(
            [sys.executable, "-m", "pmaptap", "export", taps, "--parquet", out2, "--name", "loss"],
            env=subprocess_env(1),
            cwd=ROOT,
            capture_output=True,
            timeout=60,
        ).returncode
        == 0
    )
    assert list(pd.read_parquet(out2)["step"]) == [0, 1, 2]


def test_parquet_keeps_nan_as_a_float_nan_and_empty_cells_null(taps, tmp_path):
    # The NaN hunt in pyarrow/polars/duckdb: a NaN loss was written as null
    # (pyarrow's from_pandas makes every NaN null), so none of them found it.
    pq = pytest.importorskip("pyarrow.parquet")
    pc = pytest.importorskip("pyarrow.compute")
    from pmaptap.tapfile.read.frame import write_parquet

    out = str(tmp_path / "nan.parquet")
    recs = pmaptap.read(taps)
    write_parquet(recs, out)
    table = pq.read_table(out)
    names, steps = table.column("name").to_pylist(), table.column("step").to_pylist()
    value = table.column("value")
    loss = {s: v for n, s, v in zip(names, steps, value.to_pylist()) if n == "loss"}
    assert math.isnan(loss[1]) and loss[2] == math.inf and loss[0] == pytest.approx(7.5)
    assert pc.sum(pc.is_nan(value)).as_py() == 1  # found by a NaN search
    # A row of another tap ("params" has value.w/value.b) is null, not NaN.
    is_params = [n == "params" for n in names]
    nulls = value.is_null().to_pylist()
    assert [x for x, p in zip(nulls, is_params) if p] == [True] * sum(is_params)
    assert not any(x for x, p in zip(nulls, is_params) if not p)
    b = table.column("value.b").to_pylist()
    assert [v is None for v in b] == [not p for p in is_params]


def test_time_is_exact_microseconds_in_the_frame_and_in_parquet(taps, tmp_path):
    """Writers round a record's time to the microsecond; the frame's and the
    Parquet file's time is that microsecond exactly, a timestamp[us] (was:
    timestamp[ns] with float noise below the microsecond, .635569096)."""
    pq = pytest.importorskip("pyarrow.parquet")
    from decimal import Decimal

    from pmaptap.tapfile.read.frame import write_parquet

    with open(taps) as f:
        # The times as written, exactly: their text in microseconds.
        want = [int(json.loads(ln, parse_float=Decimal)["time"] * 10**6) for ln in f]
    assert any(us % 1000 for us in want)  # times that need the microseconds
    out = str(tmp_path / "t.parquet")
    write_parquet(pmaptap.read(taps), out)
    table = pq.read_table(out)
    assert str(table.schema.field("time").type) == "timestamp[us, tz=UTC]"
    assert table.column("time").cast("int64").to_pylist() == want
    df = pmaptap.read(taps, as_frame=True)
    assert str(df["time"].dtype) == "datetime64[us, UTC]"
    assert df["time"].astype("int64").tolist() == want
    # The same through the command, which streams the records it writes.
    cmd = [sys.executable, "-m", "pmaptap", "export", taps, "--parquet", out]
    proc = subprocess.run(cmd, env=subprocess_env(1), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert pq.read_table(out).column("time").cast("int64").to_pylist() == want


def test_per_device_gives_step_by_device_tables(taps, tmp_path):
    recs = pmaptap.read(taps)
    df = pmaptap.read(taps, as_frame=True)
    g = df[df["name"] == "gnorm"].pipe(pmaptap.per_device)
    assert list(g.index) == [0, 1, 2] and list(g.columns) == list(range(8))
    for r in recs:
        if r["name"] == "gnorm":
            assert g.loc[r["step"], r["device"]] == pytest.approx(r["value"])
    # A replicated record fills every device that held it; NaN/inf stay.
    loss = df[df["name"] == "loss"].pipe(pmaptap.per_device)
    assert loss.shape == (3, 8)
    assert loss.loc[1].isna().all() and (loss.loc[2] == math.inf).all()
    # docs/api.md's recipe for the first non-finite step and device.
    import numpy as np

    bad = ~np.isfinite(loss)
    step = bad.any(axis=1).idxmax()
    assert (step, bad.loc[step].idxmax()) == (1, 0)
    # Several taps: (name, step) rows; a leaf column takes only its tap.
    both = df.pipe(pmaptap.per_device)
    assert set(both.index.get_level_values("name")) == {"loss", "gnorm", "count"}
    b = pmaptap.per_device(df, "value.b")
    assert list(b.index) == [0, 1, 2] and b.loc[0, 5] == 42.0
    with pytest.raises(KeyError, match="value columns"):
        pmaptap.per_device(df, "value.nope")
    pytest.importorskip("pyarrow")
    out = str(tmp_path / "t.parquet")
    from pmaptap.tapfile.read.frame import write_parquet

    write_parquet(recs, out)
    pd.testing.assert_frame_equal(pd.read_parquet(out).pipe(pmaptap.per_device), both)


def test_read_json_one_liner_from_the_docs(taps):
    # docs/api.md: plain pandas sees the non-finite markers as strings.
    df = pd.read_json(taps, lines=True)
    df["value"] = df["value"].map(lambda v: float(v) if isinstance(v, str) else v)
    loss = df[df["name"] == "loss"].set_index("step")["value"]
    assert math.isnan(loss[1]) and loss[2] == math.inf
    with open(os.path.join(ROOT, "docs", "api.md"), encoding="utf-8") as f:
        assert (
            'df["value"] = df["value"].map(lambda v: float(v) if isinstance(v, str) else v)'
        ) in f.read()


def test_missing_pyarrow_names_the_extra(taps, tmp_path):
    code = (
        "import sys; sys.modules['pyarrow'] = None\n"
        "from pmaptap.cli import main\n"
        f"sys.exit(main(['export', {taps!r}, '--parquet', "
        f"{str(tmp_path / 'x.parquet')!r}]))"
    )
    proc = run_python(code, check=False)
    assert proc.returncode == 2 and 'pip install "pmaptap[parquet]"' in proc.stderr
    assert not os.path.exists(tmp_path / "x.parquet")


def test_csv_frame_and_parquet_name_coordinates_alike(tmp_path):
    """One naming of coordinate columns (format.coords_column) for the CSV
    export and the frame (Parquet writes the frame's columns)."""
    import csv
    import json as _json

    from conftest import cli, record_dict
    from pmaptap.tapfile.record.format import coords_column

    path = tmp_path / "mesh.jsonl"
    recs = [
        record_dict(
            name="g",
            step=s,
            kind="per_device",
            value=1.0 * d,
            dtype="float32",
            device=d,
            coords={"dp": d // 2, "mp": d % 2},
        )
        for s in range(2)
        for d in range(4)
    ]
    path.write_text("".join(_json.dumps(r) + "\n" for r in recs))
    out = cli("export", str(path), "--csv", str(tmp_path / "g.csv"))
    assert out.returncode == 0, out.stderr
    with open(tmp_path / "g.csv", newline="") as f:
        header = next(csv.reader(f))
    frame = pmaptap.read(path, as_frame=True)
    want = [coords_column("dp"), coords_column("mp")]
    assert want == ["coords.dp", "coords.mp"]
    assert [c for c in header if "coord" in c] == want
    assert [c for c in frame.columns if "coord" in c] == want
    assert list(frame["coords.mp"]) == [d % 2 for _ in range(2) for d in range(4)]


def test_tables_of_records_share_the_record_columns(tmp_path):
    """One list of a record table's columns (format.RECORD_COLUMNS): the CSV
    export starts with it after the line, the frame (and Parquet) with the
    columns it types, ``show`` picks from it; each in this order."""
    import csv

    from read_definitions import load

    from conftest import cli, per_device_dict, replicated_dict
    from pmaptap.tapfile.export.csv_rows import FIXED, csv_row
    from pmaptap.tapfile.record.format import RECORD_COLUMNS

    path = tmp_path / "cols.jsonl"
    recs = [
        replicated_dict(0, 0.5, processes=[0], divergent=True, index=[[0, 1]], **{"pass": "b"}),
        per_device_dict(0, 1, 0.25),
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = cli("export", str(path), "--csv", "-")
    assert out.returncode == 0, out.stderr
    header = next(csv.reader(io.StringIO(out.stdout)))
    assert header == ["line", *RECORD_COLUMNS, "coords.dp", "value"]
    # Every record column has its cell in a row (none left to the default).
    for e in load(path)[0]:
        assert set(FIXED) <= csv_row(e).keys()
    frame = pmaptap.read(path, as_frame=True)
    # test_read_as_frame_has_tidy_columns pins the typed columns' names.
    typed = [c for c in RECORD_COLUMNS if c not in ("devices", "index", "dtype", "shape")]
    assert list(frame.columns) == [
        *typed,
        "coords.dp",
        "value",
        *("dtype", "shape", "devices", "processes", "vhash", "index"),
    ]
    out = cli("show", str(path))
    header = "line name step kind proc device coords value flags"
    assert out.stdout.split("\n")[0].split() == header.split()
    out = cli("show", "--all-attempts", str(path))
    assert out.stdout.split("\n")[0].split()[:5] == ["line", "name", "step", "attempt", "kind"]


def test_parquet_of_a_run_with_values_stored_as_bytes(tmp_path):
    """read() gives a value stored as bytes back as an array: Parquet holds
    its numbers as JSON text, exactly (bfloat16 and int4 widened exactly),
    beside the run's scalars."""
    pytest.importorskip("pyarrow")
    import json as _json

    import ml_dtypes
    import numpy as np

    from pmaptap.tapfile.read import frame

    path = str(tmp_path / "r.jsonl")
    act = np.linspace(-3, 3, 600, dtype=np.float32)
    w = pmaptap.Writer(path, run="r", process=0)
    w.write("act", 0, act)
    w.write("act", 1, act.astype(ml_dtypes.bfloat16))
    w.write("codes", 0, (np.arange(4096) % 15 - 7).astype(ml_dtypes.int4))
    w.write("loss", 0, 1.5)
    w.close()
    recs = pmaptap.read(path)
    assert any(isinstance(r["value"], np.ndarray) for r in recs)
    out = str(tmp_path / "r.parquet")
    assert frame.write_parquet(recs, out) == 4
    back = pd.read_parquet(out)
    cell = {(r["name"], r["step"]): r["value"] for _, r in back.iterrows()}
    assert _json.loads(cell[("act", 0)]) == act.tolist()
    assert _json.loads(cell[("act", 1)]) == act.astype(ml_dtypes.bfloat16).astype(float).tolist()
    assert _json.loads(cell[("codes", 0)]) == [int(v) % 15 - 7 for v in range(4096)]
    assert _json.loads(cell[("loss", 0)]) == 1.5


def test_frame_keeps_uint64_values_past_int64(tmp_path):
    """A uint64 tap's values past 2**63-1 make a UInt64 column (they raised
    OverflowError); integers no 64-bit type holds stay as they were."""
    import numpy as np

    path = str(tmp_path / "u.jsonl")
    w = pmaptap.Writer(path, run="r", process=0)
    w.write("u", 0, np.uint64(2**64 - 1))
    w.write("u", 1, np.uint64(3))
    w.close()
    df = pmaptap.read(path, as_frame=True)
    assert str(df["value"].dtype) == "UInt64"
    assert df["value"].tolist() == [2**64 - 1, 3]
    from pmaptap.tapfile.read.frame import _int_dtype

    assert _int_dtype([None, -(2**63), 2**63 - 1]) == "Int64"
    assert _int_dtype([-1, 2**63]) is object and _int_dtype([2**64]) is object
