"""Bad input (issue 6): every case gets a clear error at trace/open time or a
documented, tested behaviour (docs/faults.md). Also the values above
``max_value_bytes`` that travel as statistics, and the security properties
of tap files.

Already covered elsewhere and not repeated here: a str leaf in a dict, bad
name/dedup/every/step values (test_core_steps.py), quotes/newline/unicode
names and bf16/f16/complex64/empty/0-d round trips under jit, garbage lines
and a Python expression in a file (test_core_records.py), a second open
session, a path under a file or a directory, a non-root unwritable
directory, appending never truncating (test_core_session.py).
"""

from __future__ import annotations

import ast
import dataclasses
import math
import os
import pickle
import re
import stat

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pmaptap
import pmaptap._trace.layouts
import pmaptap.cli
from conftest import logs_warning, mount_namespace_available, run_in_mount_namespace
from pmaptap import host_callback as hcb
from pmaptap._host.sinks import FileSink
from pmaptap.tapfile.record.format import encode_line

pytestmark = pytest.mark.usefixtures("transport")


def _named(recs: list[dict], name: str) -> list[dict]:
    return [r for r in recs if r["name"] == name]


# ====================================================== non-array leaves
@dataclasses.dataclass
class _Point:
    x: float


@pytest.mark.parametrize(
    "value, where, what",
    [
        ([jnp.ones(2), b"bytes"], r"\[1\]", "bytes"),
        ({"p": _Point(1.0)}, r"\['p'\]", "_Point"),
        ({"o": object()}, r"\['o'\]", "object"),
        (np.array([1, "a"], dtype=object), "the value", "dtype object"),
        (np.array(["a", "b"]), "the value", "dtype <U1"),
        (
            {"t": np.array(["2024-01-01"], dtype="datetime64[D]")},
            r"\['t'\]",
            r"dtype datetime64\[D\]",
        ),
    ],
)
def test_non_array_leaves_are_refused_at_trace_time_naming_the_leaf(
    session, tap_path, value, where, what
) -> None:
    for run in (
        lambda: pmaptap.tap(value, "bad"),  # eager
        lambda: jax.jit(lambda: pmaptap.tap(value, "bad"))(),
    ):
        with pytest.raises(TypeError, match=rf"pmaptap.tap\('bad'\): {where} is .*{what}"):
            run()
    session.flush()
    assert pmaptap.read(tap_path) == []  # nothing half-emitted


def test_none_is_an_empty_subtree_written_as_null(session, tap_path) -> None:
    # None is a pytree node with no leaves (JAX's rule), not an error.
    jax.jit(lambda: pmaptap.tap(None, "none"))()
    jax.jit(lambda v: pmaptap.tap([v, None], "some"))(jnp.float32(1))
    session.flush()
    recs = pmaptap.read(tap_path)
    (none,) = _named(recs, "none")
    assert (none["value"], none["dtype"], none["shape"]) == (None, None, None)
    (some,) = _named(recs, "some")
    assert some["value"] == [1.0, None] and some["dtype"] == ["float32", None]


# ====================================================== empty and 0-d
def test_empty_and_zero_d_values_under_jit_and_pmap(session, tap_path) -> None:
    jax.jit(lambda: pmaptap.tap(jnp.zeros((3, 0), jnp.int32), "e30"))()
    jax.jit(lambda: pmaptap.tap(jnp.bool_(True), "b0"))()
    # Under pmap an empty leaf next to a real one travels in the packed
    # gather (zero bytes of it) and comes back with its shape.
    jax.pmap(lambda v: pmaptap.tap({"e": v[:0], "v": v}, "mix", dedup="per_device"))(
        jnp.arange(8.0).reshape(8, 1)
    )
    session.flush()
    recs = pmaptap.read(tap_path)
    (e30,) = _named(recs, "e30")
    assert e30["value"] == [[], [], []] and e30["shape"] == [3, 0]
    assert _named(recs, "b0")[0]["value"] is True
    mix = sorted(_named(recs, "mix"), key=lambda r: r["device"])
    assert [r["value"] for r in mix] == [{"e": [], "v": [float(d)]} for d in range(8)]
    assert all(r["shape"] == {"e": [0], "v": [1]} for r in mix)


@pytest.mark.callback_only("as outputs, the empty values are recorded")
def test_pmap_of_only_empty_inputs_is_not_run_by_jax(session, tap_path) -> None:
    # Documented, not ours: JAX does not execute a pmap whose inputs are all
    # zero-sized, so no callback of any kind fires (jax.debug.callback
    # neither). Pinned here so a JAX change is noticed.
    calls = []

    def f(v):
        jax.debug.callback(lambda a: calls.append(a.shape), v)
        return pmaptap.tap(v, "empty_only")

    jax.pmap(f)(jnp.zeros((8, 0)))
    session.flush()
    assert calls == [] and pmaptap.read(tap_path) == []


# ====================================================== dtypes
def test_64_bit_values_without_x64_are_recorded_as_jax_computes_them(session, tap_path) -> None:
    # Without jax_enable_x64 JAX turns 64-bit inputs into 32-bit ones before
    # pmaptap sees them; the record says what the program computed with.
    big = np.arange(3, dtype=np.int64) + 2**33
    out = jax.jit(lambda v: pmaptap.tap(v, "i64") + 0)(big)  # silently int32
    jax.jit(
        lambda: pmaptap.tap(
            {"f": np.float64(0.1), "c": np.complex128(1 + 2j), "u": np.uint64(7)}, "wide"
        )
    )()
    session.flush()
    recs = pmaptap.read(tap_path)
    (i64,) = _named(recs, "i64")
    assert i64["dtype"] == "int32" and i64["value"] == np.asarray(out).tolist()
    (wide,) = _named(recs, "wide")
    assert wide["dtype"] == {"c": "complex64", "f": "float32", "u": "uint32"}
    assert wide["value"] == {"c": complex(1, 2), "f": 0.1, "u": 7}
    # A Python int that does not fit int32 is JAX's trace-time error.
    with pytest.raises(OverflowError, match="too large to convert to int32"):
        jax.jit(lambda: pmaptap.tap(2**40, "huge_int"))()


def test_complex_bf16_and_fp8_under_pmap_round_trip(session, tap_path) -> None:
    x = jnp.array([[1.5, jnp.nan], [jnp.inf, -2.0]] * 4)  # (8, 2)

    @jax.pmap
    def f(v):
        return pmaptap.tap(
            {
                "c": lax.complex(v, -v),
                "bf16": v.astype(jnp.bfloat16),
                "e4m3": jnp.where(jnp.isinf(v), 448.0, v).astype(jnp.float8_e4m3fn),
                "e5m2": v.astype(jnp.float8_e5m2),
            },
            "narrow",
            dedup="per_device",
        )

    f(x)
    session.flush()
    recs = sorted(_named(pmaptap.read(tap_path), "narrow"), key=lambda r: r["device"])
    assert len(recs) == 8
    r0, r1 = recs[0], recs[1]
    assert r0["dtype"] == {
        "bf16": "bfloat16",
        "c": "complex64",
        "e4m3": "float8_e4m3fn",
        "e5m2": "float8_e5m2",
    }
    assert r0["value"]["bf16"][0] == 1.5 and math.isnan(r0["value"]["bf16"][1])
    assert r1["value"]["e5m2"] == [math.inf, -2.0]
    assert r1["value"]["e4m3"] == [448.0, -2.0]
    c = r1["value"]["c"]
    assert c[1] == complex(-2.0, 2.0)
    assert math.isinf(c[0].real) and math.isinf(c[0].imag)


# ====================================================== huge values
def _stats(a: np.ndarray) -> dict:
    x = np.abs(a) if np.iscomplexobj(a) else a.astype(np.float64)
    fin = np.isfinite(x)
    return {
        "min": float(x[fin].min()),
        "max": float(x[fin].max()),
        "mean": float(x[fin].mean()),
        "std": float(x[fin].std()),
        "nan": int(np.isnan(x).sum()),
        "inf": int(np.isinf(x).sum()),
    }


def _close(got: dict, want: dict) -> bool:
    return got.keys() == want.keys() and all(
        got[k] == want[k]
        if k in ("nan", "inf")
        else math.isclose(got[k], want[k], rel_tol=1e-5, abs_tol=1e-5)
        for k in want
    )


@pytest.mark.callback_only("spies on the host callbacks")
def test_values_above_max_value_bytes_become_statistics_on_device(
    session, tap_path, spy_deliveries
) -> None:
    # 2 MiB of float32 (above a 1 MiB limit per leaf), with more NaNs and
    # infs than one float32 counts exactly in its low part (see
    # tapfile.record.format.COUNT_BASE).
    a = np.random.default_rng(0).standard_normal((512, 1024)).astype(np.float32)
    a.reshape(-1)[:5000] = np.nan
    a.reshape(-1)[5000:9097] = -np.inf
    # what reaches the host, in bytes
    sent = spy_deliveries(lambda spec, arrays: sum(np.asarray(x).nbytes for x in arrays))
    with pmaptap.configured(max_value_bytes=1 << 20):
        jax.jit(lambda v: pmaptap.tap({"big": v, "small": v.reshape(-1)[5000:5003]}, "act"))(a)
    session.flush()
    (r,) = pmaptap.read(tap_path)
    assert r["summarized"] is True
    assert r["dtype"] == {"big": "float32", "small": "float32"}
    assert r["shape"] == {"big": [512, 1024], "small": [3]}
    assert _close(r["value"]["big"], _stats(a))
    assert r["value"]["big"]["nan"] == 5000 and r["value"]["big"]["inf"] == 4097
    assert r["value"]["small"] == [-math.inf] * 3  # small leaves intact
    assert max(sent) < 1024  # the 2 MiB never left the device


def test_default_limit_sends_a_2_mib_leaf_whole_as_bytes(session, tap_path):
    # max_value_bytes is 16 MiB by default since values are stored as their
    # bytes (tapfile/source/arrays.py): a 2 MiB activation arrives exact.
    assert pmaptap.options().max_value_bytes == 16 << 20
    a = np.random.default_rng(1).standard_normal((512, 1024)).astype(np.float32)
    jax.jit(lambda v: pmaptap.tap(v, "act"))(a)
    session.flush()
    (r,) = pmaptap.read(tap_path)
    assert not r.get("summarized") and r["value"].tobytes() == a.tobytes()


def test_statistics_limit_is_configurable_and_per_leaf(session, tap_path):
    f = lambda name: jax.jit(lambda v: pmaptap.tap(v, name))  # noqa: E731
    with pmaptap.configured(max_value_bytes=16):
        f("at_limit")(jnp.arange(4.0))  # 16 bytes: kept whole
        f("over")(jnp.arange(5.0))  # 20 bytes: statistics
    with pmaptap.configured(max_value_bytes=None):
        f("never")(jnp.zeros((600, 1024)))  # 2.4 MB, but statistics are off
    session.flush()
    recs = {r["name"]: r for r in pmaptap.read(tap_path)}
    assert recs["at_limit"]["value"] == [0.0, 1.0, 2.0, 3.0]
    assert "summarized" not in recs["at_limit"]
    assert recs["over"]["summarized"] and recs["over"]["shape"] == [5]
    assert _close(recs["over"]["value"], _stats(np.arange(5.0)))
    assert len(recs["never"]["value"]) == 600 and "summarized" not in recs["never"]
    for bad in (-1, 1.5, True, "1MiB"):
        with pytest.raises(ValueError, match="max_value_bytes"):
            pmaptap.configure(max_value_bytes=bad)


def test_statistics_under_pmap_vmap_and_for_every_dtype(session, tap_path) -> None:
    with pmaptap.configured(max_value_bytes=64):
        # per device: each copy's own statistics (through the gather)
        jax.pmap(lambda v: pmaptap.tap(v, "pm", dedup="per_device"))(
            jnp.arange(8 * 32.0).reshape(8, 32)
        )
        # vmap: statistics per batch element, leading axes kept in shape
        jax.jit(jax.vmap(lambda v: pmaptap.tap(v, "vm")))(jnp.arange(3 * 40.0).reshape(3, 40))
        jax.jit(
            lambda: pmaptap.tap(
                {
                    "i": jnp.arange(100, dtype=jnp.int32) - 50,
                    "b": jnp.arange(100) % 4 == 0,
                    "c": jnp.full((20,), 3 + 4j, jnp.complex64),
                    "bf": jnp.full((100,), jnp.nan, jnp.bfloat16),
                },
                "kinds",
            )
        )()
    session.flush()
    recs = pmaptap.read(tap_path)
    for r in _named(recs, "pm"):
        d = r["device"]
        assert _close(r["value"], _stats(np.arange(32.0) + 32 * d))
        assert r["summarized"] and r["shape"] == [32]
    (vm,) = _named(recs, "vm")
    assert vm["batch_dims"] == 1 and vm["shape"] == [3, 40]
    assert vm["value"]["min"] == [0.0, 40.0, 80.0] and vm["value"]["nan"] == [0, 0, 0]
    (k,) = _named(recs, "kinds")
    v = k["value"]
    assert _close(v["i"], _stats(np.arange(100) - 50))
    assert v["b"]["mean"] == 0.25 and v["b"]["max"] == 1.0
    assert v["c"]["mean"] == 5.0 and k["dtype"]["c"] == "complex64"  # of |z|
    # No finite element: NaN statistics (read back as float NaN), counts kept.
    assert all(math.isnan(v["bf"][s]) for s in ("min", "max", "mean", "std"))
    assert v["bf"]["nan"] == 100 and k["dtype"]["bf"] == "bfloat16"


def test_host_callback_functions_always_get_the_whole_value() -> None:
    got = []
    with pmaptap.configured(max_value_bytes=16):
        jax.jit(lambda v: hcb.id_tap(lambda a, t: got.append(a.shape), v))(jnp.zeros((100,)))
        hcb.barrier_wait()
    assert got == [(100,)]


# ====================================================== names and arguments
def test_name_that_is_not_valid_unicode_is_refused_at_trace_time() -> None:
    # A lone surrogate (os.fsdecode of a non-UTF-8 file name) cannot be
    # written as UTF-8 JSON.
    with pytest.raises(ValueError, match="not valid Unicode"):
        jax.jit(lambda v: pmaptap.tap(v, "loss/\udcff"))(jnp.ones(1))
    with pytest.raises(ValueError, match="not valid Unicode"):
        pmaptap.Session("t.jsonl", run="run-\udcff")


def test_unencodable_record_never_blocks_the_ones_behind_it(tap_path, caplog) -> None:
    # A pytree key with a lone surrogate reaches the writer. It is replaced
    # by a pmaptap/unencodable record (and reported); the queue moves on.
    with pmaptap.Session(tap_path, run="test", close_timeout=5) as s:
        jax.jit(lambda v: pmaptap.tap({"k\udcff": v}, "bad_key"))(jnp.ones(1))
        jax.jit(lambda v: pmaptap.tap(v, "after"))(jnp.float32(2))
        with logs_warning(caplog), pytest.raises(pmaptap.TapError, match="could not be encoded"):
            s.flush(timeout=10)
    recs = pmaptap.read(tap_path)
    assert [r["name"] for r in recs] == ["pmaptap/unencodable", "after"]
    assert recs[0]["tap"] == "'bad_key'" and "surrogate" in recs[0]["error"]


def test_control_characters_and_long_names_round_trip(session, tap_path) -> None:
    names = ["nul\x00esc\x1b\x7f", "emoji 🚀 rtl \u202eabc", "x" * 10_000]
    for n in names:
        jax.jit(lambda v: pmaptap.tap(v, n))(jnp.float32(1))
    session.flush()
    with open(tap_path, "rb") as f:
        assert f.read().count(b"\n") == 3  # one physical line each
    assert [r["name"] for r in pmaptap.read(tap_path)] == names


@pytest.mark.parametrize(
    "kwargs, exc, text",
    [
        (dict(dedup=None), ValueError, "dedup must be one of"),
        (dict(dedup="Replicated"), ValueError, "dedup must be one of"),
        (dict(every=True), TypeError, "every must be an int"),
        (dict(every=-2), ValueError, "every must be >= 1"),
        (dict(every=np.int64(0)), ValueError, "every must be >= 1"),
        (dict(every="2"), TypeError, "every must be an int"),
    ],
)
def test_more_bad_dedup_and_every_values(kwargs, exc, text) -> None:
    with pytest.raises(exc, match=text):
        jax.pmap(lambda v: pmaptap.tap(v, "x", **kwargs))(jnp.ones(8))


def test_pmap_of_vmap_of_scan_with_auto_dedup_and_traced_every(session, tap_path) -> None:
    def inner(x):
        def body(c, i):
            # identical on every device: auto -> one replicated record
            pmaptap.tap(x.sum() * 0 + i, "deep", step=i, every=2)
            return c, None

        lax.scan(body, 0.0, jnp.arange(5))
        return x

    jax.pmap(jax.vmap(inner))(jnp.ones((8, 2, 3)))
    session.flush()
    recs = _named(pmaptap.read(tap_path), "deep")
    # every=2 decided on device per scan step; one record per kept step,
    # carrying the vmapped batch, replicated over the 8 devices.
    assert [(r["step"], r["kind"], r["replicas"], r["batch_dims"]) for r in recs] == [
        (s, "replicated", 8, 1) for s in (0, 2, 4)
    ]
    assert [r["value"] for r in recs] == [[0, 0], [2, 2], [4, 4]]


# ====================================================== sessions and paths
def test_failed_second_open_leaves_no_file_and_the_first_session_working(tmp_path) -> None:
    first = tmp_path / "first.jsonl"
    s = pmaptap.Session(first, run="first").open()
    try:
        with pytest.raises(pmaptap.SessionError, match="already open"):
            pmaptap.Session(tmp_path / "second.jsonl").open()
        jax.jit(lambda v: pmaptap.tap(v, "x"))(jnp.float32(3))
    finally:
        s.close()
    with pytest.raises(pmaptap.SessionError, match="already used"):
        s.open()  # a Session object opens once
    assert not (tmp_path / "second.jsonl").exists()
    assert [r["value"] for r in pmaptap.read(first)] == [3.0]


def test_symlinked_path_is_followed_and_the_lock_sits_by_the_target(tmp_path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    target = data / "real.jsonl"
    target.write_text("")
    links = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    for link in links:
        link.symlink_to(target)
    for i, link in enumerate(links):
        with pmaptap.Session(link, run=f"via{i}"):
            jax.jit(lambda v: pmaptap.tap(v, "x"))(jnp.float32(i))
    # Both links reached one file and one lock: a lock beside each link
    # would let two writers append at once.
    assert all(link.is_symlink() for link in links)
    assert [r["run"] for r in pmaptap.read(target)] == ["via0", "via1"]
    assert (data / "real.jsonl.lock").exists()
    assert not any((tmp_path / f"{c}.jsonl.lock").exists() for c in "ab")
    # A dangling link creates its target; a loop is an error at open.
    dangling = tmp_path / "dangling.jsonl"
    dangling.symlink_to(data / "new.jsonl")
    assert FileSink(str(dangling), process=0).path == str(data / "new.jsonl")
    loop = tmp_path / "loop.jsonl"
    loop.symlink_to(loop)
    with pytest.raises(pmaptap.TapError, match="cannot"):
        pmaptap.Session(loop).open()
    assert pmaptap.active_session() is None


def test_path_problems_are_oserrors_with_their_errno(tmp_path) -> None:
    # `except OSError` around file paths (what Python code writes) catches
    # pmaptap's path errors too, and they are still TapErrors.
    import errno as errno_mod

    (tmp_path / "file").write_text("x")
    # (os.makedirs reports a file in the way as EEXIST or ENOTDIR)
    cases = {
        str(tmp_path / "file" / "t.jsonl"): {errno_mod.EEXIST, errno_mod.ENOTDIR},
        str(tmp_path): {errno_mod.EISDIR},
    }
    for path, code in cases.items():
        with pytest.raises(OSError) as info:
            pmaptap.Session(path).open()
        assert isinstance(info.value, pmaptap.TapPathError)
        assert isinstance(info.value, pmaptap.TapError)
        assert info.value.errno in code and info.value.filename
        assert str(info.value).startswith(("cannot", "tap file"))  # not "[Errno N]"
    assert pmaptap.active_session() is None


@pytest.mark.skipif(
    not mount_namespace_available(), reason="needs root + unshare for a read-only bind mount"
)
@pytest.mark.callback_only("its steps run in a subprocess: the transport fixture cannot reach them")
def test_unwritable_directory_is_an_error_at_open_even_for_root(tmp_path) -> None:
    # Root ignores permission bits (the non-root case is in
    # test_core_session.py); a read-only mount stops root too.
    ro = tmp_path / "ro"
    ro.mkdir()
    proc = run_in_mount_namespace(
        'mount --bind "$RO" "$RO" && mount -o remount,ro,bind "$RO"',
        """
        import os, pmaptap
        try:
            pmaptap.Session(os.path.join(os.environ["RO"], "t.jsonl")).open()
            print("OPENED")
        except pmaptap.TapError as e:
            print("TAPERROR", e)
        print("active", pmaptap.active_session())
    """,
        RO=str(ro),
    )
    assert proc.returncode == 0, proc.stderr
    assert "TAPERROR" in proc.stdout and "not writable" in proc.stdout
    assert "Read-only file system" in proc.stdout
    assert "active None" in proc.stdout


def test_existing_file_with_garbage_is_appended_to_never_rewritten(tmp_path, caplog) -> None:
    path = tmp_path / "old.jsonl"
    garbage = (
        b"\x00\x01 binary \xff\xfe not utf-8\n"
        b'{"json": "but not a record"}\n'
        b"NaN\n" + b"z" * 100_000 + b"\n"
        b'{"run": "x", "name": "torn'
    )  # no newline
    path.write_bytes(garbage)
    with pmaptap.Session(path, run="new"):
        jax.jit(lambda v: pmaptap.tap(v, "x"))(jnp.float32(5))
    raw = path.read_bytes()
    assert raw.startswith(garbage)  # byte for byte
    with logs_warning(caplog, r"skipped 5 invalid line.*line 1:"):
        recs = pmaptap.read(path)
    assert [(r["run"], r["value"]) for r in recs] == [("new", 5.0)]


# ====================================================== security
class _Exploit:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))  # would create the marker file


def test_a_malicious_tap_file_is_only_invalid_lines(tmp_path, capsys, caplog) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.jsonl"
    record = {
        "run": "r",
        "name": "x",
        "step": 0,
        "kind": "replicated",
        "value": f"__import__('os').system('touch {marker}')",
        "dtype": "float32",
        "shape": [],
        "process": 0,
        "time": 0.0,
        "host": "h",
        "replicas": 1,
    }
    path.write_bytes(
        pickle.dumps(_Exploit(str(marker)))
        + b"\n"
        + b"!!python/object/apply:os.system ['touch "
        + bytes(marker)
        + b"']\n"
        + encode_line(record)
    )
    with logs_warning(caplog, "skipped 2 invalid"):
        recs = pmaptap.read(path)
    assert recs[0]["value"] == record["value"]  # a string, never run
    # The command-line tools read it the same way; validate flags it.
    codes = [
        pmaptap.cli.main(argv)
        for argv in (
            ["show", str(path)],
            ["summary", str(path)],
            ["validate", str(path)],
            ["export", str(path), "--csv", str(tmp_path / "out.csv")],
        )
    ]
    assert codes == [0, 0, 1, 0]
    assert "3 problem(s)" in capsys.readouterr().out
    assert not marker.exists()


_UNSAFE_MODULES = {
    "pickle",
    "cPickle",
    "_pickle",
    "dill",
    "cloudpickle",
    "marshal",
    "shelve",
    "yaml",
    "jsonpickle",
}


@pytest.mark.callback_only("no jit or pmap step: nothing a transport carries")
def test_pmaptap_never_imports_a_deserializer_that_runs_code() -> None:
    # Tap files are data: pmaptap parses them with json only. No module of
    # the package may import pickle & co or call eval/exec/compile.
    pkg = os.path.dirname(pmaptap.__file__)
    found = []
    sources = sorted(
        os.path.relpath(os.path.join(d, f), pkg)
        for d, _, files in os.walk(pkg)
        for f in files
        if f.endswith(".py")
    )
    assert len(sources) > 30, sources  # every subpackage is walked
    for fname in sources:
        with open(os.path.join(pkg, fname), encoding="utf-8") as f:
            tree = ast.parse(f.read(), fname)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [(node.module or "").split(".")[0]]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                names = [node.func.id] if node.func.id in ("eval", "exec", "compile") else []
            elif isinstance(node, ast.keyword) and node.arg == "allow_pickle":
                names = ["allow_pickle"]
            else:
                continue
            found += [
                f"{fname}:{node.lineno} {n}"
                for n in names
                if n in _UNSAFE_MODULES | {"eval", "exec", "compile", "allow_pickle"}
            ]
    assert found == []


@pytest.mark.parametrize("lock", ["flock", "soft"])
@pytest.mark.parametrize("umask", [0o077, 0o022])
def test_files_are_created_with_the_process_umask(tmp_path, umask, lock) -> None:
    path = tmp_path / "new" / "dir" / "t.jsonl"
    old = os.umask(umask)
    try:
        with pmaptap.Session(path, run="u", lock=lock) as s:
            jax.jit(lambda v: pmaptap.tap(v, "x"))(jnp.float32(1))
            s.flush()
            # soft mode: the marker exists only while held; take it the way
            # the writer does and look at it.
            sink = s.pipeline.sink
            sink._acquire()
            try:
                lock_file = sink._lock.lock_file
                lock_mode = stat.S_IMODE(os.stat(lock_file).st_mode)
            finally:
                sink._lock.release()
    finally:
        os.umask(old)
    modes = {p: stat.S_IMODE(os.stat(p).st_mode) for p in (path, path.parent, path.parent.parent)}
    modes[lock_file] = lock_mode
    for p, mode in modes.items():
        full = 0o777 if os.path.isdir(p) else 0o666
        assert mode == full & ~umask, (str(p), oct(mode))
        assert not mode & stat.S_IWOTH, str(p)  # never world-writable


# ------------------------------------------------------------ configure()

_GOOD_OPTIONS = {
    "gather": [True, False, np.bool_(True)],
    "verify_replicated": [True, False],
    "prove_replicated": [True, False, np.bool_(False)],
    "gather_max_bytes": [0, 1 << 20, np.int64(64)],
    "max_value_bytes": [None, 0, 4096],
    "auto_group": [True, False, np.bool_(False)],
    "max_in_flight_bytes": [0, 1 << 30, np.int64(4096)],
}
_BAD_OPTIONS = {
    "gather": ["yes", 1, None, "False"],
    "verify_replicated": ["no", 0, None],
    "prove_replicated": ["off", 0, None],
    "gather_max_bytes": [-1, 1.5, True, "1MiB", None],
    "max_value_bytes": [-1, 1.5, True, "1MiB"],
    "auto_group": ["on", 1, None],
    "max_in_flight_bytes": [-1, 1.5, True, "1GiB", None],
}


def test_every_configure_option_is_checked_and_says_what_is_allowed():
    from pmaptap._trace.options import Options

    fields = {f.name for f in dataclasses.fields(Options)}
    # A new option must come with its checks (and a line in this table).
    assert set(_GOOD_OPTIONS) == set(_BAD_OPTIONS) == fields
    before = pmaptap.configure()
    try:
        for name, values in _GOOD_OPTIONS.items():
            for v in values:
                pmaptap.configure(**{name: v})
                got = getattr(pmaptap.configure(), name)
                assert got == v and type(got) in (bool, int, type(None)), (name, v)
        kept = pmaptap.configure()
        allowed = {
            "gather": "True or False",
            "verify_replicated": "True or False",
            "prove_replicated": "True or False",
            "gather_max_bytes": "int >= 0",
            "max_value_bytes": r"int >= 0 \(bytes\) or None",
            "auto_group": "True or False",
            "max_in_flight_bytes": "int >= 0",
        }
        for name, values in _BAD_OPTIONS.items():
            for v in values:
                with pytest.raises(ValueError, match=f"{name} must be (an )?{allowed[name]}"):
                    pmaptap.configure(**{name: v})
                with pytest.raises(ValueError, match=name):
                    with pmaptap.configured(**{name: v}):
                        pass
        assert pmaptap.configure() == kept  # nothing bad was kept
    finally:
        pmaptap.configure(**dataclasses.asdict(before))


# ------------------------------------------------------------ dataclass pytrees


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _TrainState:
    step: jax.Array
    params: dict
    opt_state: tuple
    note: None = None
    name: str = dataclasses.field(default="ts", metadata=dict(static=True))


def test_registered_dataclass_pytree_is_written_with_its_field_names(session, tap_path):
    state = _TrainState(jnp.int32(7), {"w": jnp.ones(2), "b": jnp.float32(0.5)}, (jnp.zeros(1),))
    jax.jit(lambda s: pmaptap.tap(s, "state"))(state)
    jax.pmap(lambda v: pmaptap.tap(_TrainState(v, {"w": v}, (v > 3,)), "pm", dedup="per_device"))(
        jnp.arange(8.0)
    )
    session.flush()
    recs = pmaptap.read(tap_path)
    (r,) = [r for r in recs if r["name"] == "state"]
    assert r["value"] == {
        "step": 7,
        "params": {"b": 0.5, "w": [1.0, 1.0]},
        "opt_state": [[0.0]],
        "note": None,
    }
    assert r["dtype"] == {
        "step": "int32",
        "params": {"b": "float32", "w": "float32"},
        "opt_state": ["float32"],
        "note": None,
    }
    assert r["shape"] == {
        "step": [],
        "params": {"b": [], "w": [2]},
        "opt_state": [[1]],
        "note": None,
    }
    pm = {r["device"]: r["value"] for r in recs if r["name"] == "pm"}
    assert pm == {
        d: {"step": float(d), "params": {"w": float(d)}, "opt_state": [d > 3], "note": None}
        for d in range(8)
    }
    from pmaptap.tapfile.analyze.validate import validate_file

    assert validate_file(tap_path).ok


def test_custom_pytree_node_without_attribute_keys_stays_a_list(session, tap_path):
    class Pair:
        def __init__(self, a, b):
            self.a, self.b = a, b

    jax.tree_util.register_pytree_node(Pair, lambda p: ((p.a, p.b), None), lambda _, c: Pair(*c))
    jax.jit(lambda p: pmaptap.tap(p, "pair"))(Pair(jnp.float32(1), jnp.int32(2)))
    session.flush()
    (r,) = pmaptap.read(tap_path)
    assert r["value"] == [1.0, 2] and r["dtype"] == ["float32", "int32"]


# ====================================================== side writers, merge
def test_writer_refuses_the_steps_a_tap_refuses(tmp_path) -> None:
    """Steps outside 0..2**63-1: refused by Writer.write as by a tap (one
    check, one message), never written for validate to reject later."""
    path = str(tmp_path / "w.jsonl")
    with pmaptap.Writer(path, run="r", process=3) as w:
        for bad in (-1, 2**63, np.int64(-5)):
            with pytest.raises(ValueError) as got:
                w.write("x", bad, 1.0)
            with pytest.raises(ValueError) as want:
                jax.jit(lambda v, s=bad: pmaptap.tap(v, "x", step=s))(1.0)
            assert str(got.value) == str(want.value).replace(
                "pmaptap.tap('x')", "Writer.write('x')"
            )
        w.write("x", 2**63 - 1, 1.0)
    assert [r["step"] for r in pmaptap.read(path)] == [2**63 - 1]
    assert pmaptap.cli.main(["validate", path]) == 0


def test_writer_python_numbers_agree_with_the_jobs_values(tmp_path) -> None:
    """A side Writer's Python numbers get the dtype a tap gives them (float32,
    int32), so the job's float32 2.0 and a Writer's 2.0 are one value, not
    divergent; a different value still is."""
    path = str(tmp_path / "run.jsonl")
    tree = {"a": 2.0, "b": [1, 3.5]}
    f = jax.pmap(
        lambda x: [
            pmaptap.tap(lax.pmean(x, "i"), "lr", step=0, dedup="replicated"),
            pmaptap.tap(tree, "tree", step=0, dedup="replicated"),
            pmaptap.tap(3, "count", step=0, dedup="replicated"),
        ],
        axis_name="i",
    )
    with pmaptap.Session(path, run="r"):
        jax.block_until_ready(f(jnp.full((jax.local_device_count(),), 2.0, jnp.float32)))
    with pmaptap.Writer(path, run="r", process=100) as w:
        w.write("lr", 0, 2.0)
        w.write("tree", 0, tree)
        w.write("count", 0, 3)
        w.write("lr", 1, np.float64(2.0))  # a NumPy value keeps its dtype
    with pmaptap.Writer(path, run="r", process=101) as w:
        w.write("lr", 1, 2.5)  # another value: divergent from process 100's
    recs = pmaptap.read(path)
    step0 = [r for r in recs if r["step"] == 0]
    # One record per tap: the Writer's equal values were deduplicated.
    assert sorted(r["name"] for r in step0) == ["count", "lr", "tree"], step0
    assert not any(r.get("divergent") for r in step0)
    assert {r["process"] for r in step0} == {0}
    step1 = sorted((r["process"], r["dtype"], r.get("divergent")) for r in recs if r["step"] == 1)
    assert step1 == [(100, "float64", True), (101, "float32", True)]


def test_writer_stores_big_endian_values_as_their_values(tmp_path) -> None:
    """A big-endian array is written as its values, at any size (was: the
    stored bytes read back byte-swapped, validate OK), and hashes as the
    same value in this machine's order: one record, not divergent."""
    path = str(tmp_path / "run.jsonl")
    values = {
        "big": (np.arange(1000) - 0.5).astype(">f4"),  # stored as bytes
        "small": (np.arange(4) - 0.5).astype(">f4"),  # inline
        "ints": (np.arange(300) - 7).astype(">i8"),
        "cplx": (np.arange(200) * (1 + 2j)).astype(">c8"),
    }
    assert all(v.dtype.byteorder == ">" for v in values.values())
    with pmaptap.Writer(path, run="r", process=0) as w:
        for name, v in values.items():
            w.write(name, 0, v)
            w.write(name, 1, {"leaf": v})
    with pmaptap.Writer(path, run="r", process=1) as w:
        for name, v in values.items():
            w.write(name, 0, v.astype(v.dtype.newbyteorder("=")))
    recs = pmaptap.read(path)
    assert len(recs) == 2 * len(values), recs  # the native copies: deduplicated
    for r in recs:
        want = values[r["name"]]
        got = r["value"]["leaf"] if r["step"] == 1 else r["value"]
        assert np.asarray(got).tolist() == want.tolist(), r["name"]
        assert not r.get("divergent") and r["process"] == 0
        assert r["dtype"] in ({"leaf": want.dtype.name}, want.dtype.name)
    assert pmaptap.cli.main(["validate", path]) == 0


def test_writer_refuses_dict_keys_that_collide_as_text(tmp_path) -> None:
    """Keys are written as text: {1: 1.0, "1": 2.0} kept {"1": 2.0} and
    lost 1.0 without a word. Refused at write(), naming the leaf."""
    path = str(tmp_path / "run.jsonl")
    with pmaptap.Writer(path, run="r", process=0) as w:
        with pytest.raises(
            ValueError, match=r"Writer.write\('d'\): the dict at / has keys 1 and '1'"
        ):
            w.write("d", 0, {1: 1.0, "1": 2.0})
        with pytest.raises(ValueError, match=r"the dict at /params/2 has keys 0 and '0'"):
            w.write("d", 0, {"params": [1.0, 2.0, {0: 1.0, "0": 2.0}]})
        assert w.pending == 0
        w.write("d", 0, {1: 1.0, "2": 2.0})  # distinct as text: fine
    (r,) = pmaptap.read(path)
    assert r["value"] == {"1": 1.0, "2": 2.0}


def test_writer_writes_sub_byte_integers_as_taps_do(tmp_path, session, tap_path) -> None:
    """int4/uint4/int2/uint2 leaves, inline and stored as bytes: a Writer
    writes them as a tap does (was: "must be numeric"), the same value
    hashed alike (one record); 1-bit integers refused as taps refuse them."""
    import ml_dtypes

    small = np.array([1, -2, 7, -8], dtype=ml_dtypes.int4)
    values = {
        "int4": small,
        "uint4": np.array([0, 15, 3], dtype=ml_dtypes.uint4),
        "int2": np.array([1, -2, 0], dtype=ml_dtypes.int2),
        "uint2": np.array([3, 0, 1], dtype=ml_dtypes.uint2),
        "int4_big": np.tile(small, 600),  # 2,400 bytes: stored as bytes
    }
    f = jax.jit(lambda t: pmaptap.tap(t, "sub", step=0, dedup="replicated"))
    f({k: jnp.asarray(v) for k, v in values.items()})
    session.flush()
    with pmaptap.Writer(tap_path, run=session.run, process=7) as w:
        w.write("sub", 0, values)
        w.write("sub", 1, values)
        for bad in (ml_dtypes.int1, ml_dtypes.uint1):
            with pytest.raises(TypeError, match=r"1-bit integers cannot be written"):
                w.write("one", 0, np.array([1, 0], dtype=bad))
    recs = pmaptap.read(tap_path)
    assert sorted((r["step"], r["process"]) for r in recs) == [(0, 0), (1, 7)], recs
    for r in recs:
        assert not r.get("divergent")
        for k, v in values.items():
            assert r["dtype"][k] == v.dtype.name
            assert np.asarray(r["value"][k]).astype(int).tolist() == v.astype(int).tolist(), k
    assert pmaptap.cli.main(["validate", tap_path]) == 0


def _writer_under_fsize(tmp_path, body: str, wants: list[str], steps: int) -> None:
    """``body`` (a script using a Writer on $TAP) run in a process that can
    lower its RLIMIT_FSIZE (SIGXFSZ ignored, ``inf`` at hand): each of
    ``wants`` among its lines, and the file holds steps 0..steps-1 once."""
    from conftest import run_python

    preamble = """
        import os, resource, signal, numpy as np, pmaptap
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        inf = resource.RLIM_INFINITY
    """
    proc = run_python(preamble + body, devices=1, TAP=str(tmp_path / "run.jsonl"))
    for want in wants:
        assert want in proc.stdout, proc.stdout + proc.stderr
    assert [r["step"] for r in pmaptap.read(tmp_path / "run.jsonl")] == list(range(steps))


@pytest.mark.callback_only("its steps run in a subprocess: the transport fixture cannot reach them")
def test_a_writers_write_error_at_flush_is_a_tap_error(tmp_path) -> None:
    """EFBIG under a real RLIMIT_FSIZE at flush: a TapError as a session's
    (was: the bare OSError), the records still buffered and written once
    the limit is raised. A close() that fails so keeps the Writer open: its
    TapError said the records "stay buffered; flush() again", but close()
    had closed the file anyway (flush() then failed with EBADF, close()
    again returned with the records never written)."""
    _writer_under_fsize(
        tmp_path,
        """
        w = pmaptap.Writer(os.environ["TAP"], run="r", process=0, max_buffer=10**6,
                           flush_interval=3600)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, inf))
        for step in range(100):
            w.write("x", step, np.float32(step))
        try:
            w.flush()
            print("NO ERROR")
        except pmaptap.TapError as e:
            print("TAPERROR", type(e.__cause__).__name__, "File too large" in str(e),
                  w.pending, flush=True)
        try:
            w.close()
        except pmaptap.TapError as e:
            print("CLOSE FAILED", "File too large" in str(e), w.pending, w.closed, flush=True)
        resource.setrlimit(resource.RLIMIT_FSIZE, (inf, inf))
        w.close()
        print("CLOSED", w.written, w.pending, w.closed, flush=True)
        """,
        ["TAPERROR OSError True 100", "CLOSE FAILED True 100 False", "CLOSED 100 0 True"],
        steps=100,
    )


@pytest.mark.callback_only("its steps run in a subprocess: the transport fixture cannot reach them")
def test_a_writers_automatic_write_leaves_its_error_to_flush(tmp_path) -> None:
    """write() whose automatic write fails (a real RLIMIT_FSIZE) does not
    raise: the record is buffered, and a caller that retried a raising
    write() buffered it twice (was: the error raised from every write()).
    flush() says the error. Once 16 x max_buffer records wait and the file
    still takes none, write() refuses the next record, NOT buffered, so the
    buffer is bounded and nothing is duplicated. When the limit is raised,
    close() writes every accepted record once."""
    _writer_under_fsize(
        tmp_path,
        """
        w = pmaptap.Writer(os.environ["TAP"], run="r", process=0, max_buffer=2,
                           flush_interval=3600)
        resource.setrlimit(resource.RLIMIT_FSIZE, (256, inf))
        accepted, refused, said = [], 0, ""
        for step in range(40):
            try:
                w.write("x", step, np.float32(step))
                accepted.append(step)
            except pmaptap.TapError as e:
                refused += 1
                said = said or str(e)
        print("WRITES", len(accepted), refused, w.pending, "NOT buffered" in said, flush=True)
        try:
            w.flush()
        except pmaptap.TapError as e:
            print("FLUSH", "File too large" in str(e), w.pending, flush=True)
        resource.setrlimit(resource.RLIMIT_FSIZE, (inf, inf))
        w.close()
        print("CLOSED", w.written, accepted == list(range(32)), flush=True)
        """,
        ["WRITES 32 8 32 True", "FLUSH True 32", "CLOSED 32 True"],
        steps=32,
    )


def test_writer_refuses_text_and_ids_no_record_can_hold(tmp_path) -> None:
    """A name that is not valid Unicode is refused at write() with the
    tap's message (was: buffered, then written as pmaptap/unencodable at
    flush); a run or host that is not is refused at Writer() as Session()
    refuses its run (was: every record of the Writer unencodable). A device
    id that is not an int from 0 to 2**63-1 is refused (was: 2.7 written as
    device 2, "3" as a string, 2**70 unencodable at flush); a value nested
    past the recursion limit is a ValueError naming the tap (was: a bare
    RecursionError)."""
    path = str(tmp_path / "run.jsonl")
    for bad in ({"run": "r\udc80"}, {"run": "r", "host": "h\ud800"}):
        with pytest.raises(ValueError, match=r"is not valid Unicode text"):
            pmaptap.Writer(path, process=1, **bad)
    with pytest.raises(ValueError, match=r"process must be an int from 0 to 2\*\*63-1"):
        pmaptap.Writer(path, run="r", process=2**63)
    deep: object = 1.0
    for _ in range(5000):
        deep = [deep]
    with pmaptap.Writer(path, run="r", process=np.int64(1), layout="file") as w:
        with pytest.raises(ValueError) as got:
            w.write("x\ud800", 0, 1.0)
        with pytest.raises(ValueError) as want:
            jax.jit(lambda v: pmaptap.tap(v, "x\ud800"))(1.0)
        assert str(got.value) == str(want.value).replace("pmaptap.tap(", "Writer.write(")
        for device in (2.7, "3", True, -1, 2**70, np.float32(1)):
            with pytest.raises(ValueError, match=r"device must be an int from 0 to 2\*\*63-1"):
                w.write("d", 0, 1.0, kind="per_device", device=device)
        with pytest.raises(ValueError, match=r"Writer.write\('deep'\): the value nests too deep"):
            w.write("deep", 0, deep)
        assert w.pending == 0
        w.write("d", 0, 1.0, kind="per_device", device=np.int64(3))
    (r,) = pmaptap.read(path)
    assert (r["device"], r["process"]) == (3, 1)
    assert pmaptap.cli.main(["validate", path]) == 0


def test_numeric_options_of_session_and_writer_are_checked_where_given(tmp_path) -> None:
    """A Session's or Writer's count or timeout that is not a number of the
    right kind and range is refused at the constructor, naming the option
    and what it takes (was: ``max_buffer="x"`` and ``flush_interval="1"``
    accepted and failing later in the writer, ``processes="4"`` a bare
    TypeError, ``lock_timeout=-1`` a lock that waits forever). None stays
    allowed where it means "no limit"; NumPy numbers are numbers."""
    path = str(tmp_path / "run.jsonl")
    for bad, says in (
        ({"max_buffer": "x"}, "max_buffer must be an int >= 1"),
        ({"max_buffer": 0}, "max_buffer must be an int >= 1"),
        ({"processes": "4"}, "processes must be an int >= 1 or None"),
        ({"flush_interval": "1"}, "flush_interval must be a number of seconds >= 0"),
        ({"lock_timeout": -1}, "lock_timeout must be a number of seconds >= 0"),
        ({"flush_timeout": float("nan")}, "flush_timeout must be a number of seconds >= 0 or None"),
    ):
        ((_, value),) = bad.items()
        with pytest.raises(ValueError, match=re.escape(f"Writer: {says}; got {value!r}")):
            pmaptap.Writer(path, run="r", process=0, **bad)
    for bad, says in (
        ({"max_pending": 0}, "max_pending must be an int >= 1"),
        ({"max_pending_bytes": 2.5}, "max_pending_bytes must be an int >= 1"),
        ({"close_timeout": "60"}, "close_timeout must be a number of seconds >= 0"),
        ({"group_timeout": True}, "group_timeout must be a number of seconds >= 0"),
        ({"forward_timeout": -0.5}, "forward_timeout must be a number of seconds >= 0 or None"),
    ):
        with pytest.raises(ValueError, match=re.escape(f"Session: {says}; got ")):
            pmaptap.Session(path, **bad)
    with pmaptap.Writer(
        path, run="r", process=0, processes=None, max_buffer=np.int64(4), flush_timeout=None
    ) as w:
        w.write("x", 0, 1.0)
    pmaptap.Session(path, flush_timeout=None, forward_timeout=None, group_timeout=np.float32(1))
    assert [r["name"] for r in pmaptap.read(path)] == ["x"]


def test_session_resume_takes_true_or_false_only(tmp_path) -> None:
    """``resume`` is refused at the constructor unless a bool (was:
    ``bool(resume)``, so ``resume="no"`` resumed the file's last run, and
    readers then hid that run's earlier records of the replayed steps as
    superseded). A NumPy bool is a bool."""
    path = str(tmp_path / "run.jsonl")
    with pmaptap.Session(path, run="r"):
        pmaptap.tap(1.0, "x", step=0)
    for bad in ("no", "False", 1, 0.0, None):
        with pytest.raises(
            ValueError, match=re.escape(f"Session: resume must be True or False; got {bad!r}")
        ):
            pmaptap.Session(path, resume=bad)
    assert pmaptap.Session(path, resume=np.bool_(False)).resume is False
    assert [r.get("attempt", 0) for r in pmaptap.read(path, attempts="all")] == [0]


def test_text_options_of_session_and_writer_that_are_not_str_are_type_errors(tmp_path) -> None:
    """A Writer's host (or a Session's run) given as a number or bytes is a
    TypeError naming the option and what it takes (was: ``host=5`` a bare
    ``AttributeError: 'int' object has no attribute 'encode'``)."""
    path = str(tmp_path / "run.jsonl")
    for host in (5, b"h", ["h"]):
        with pytest.raises(
            TypeError,
            match=re.escape(f"Writer(host={host!r}): host must be a str (or None for the default)"),
        ):
            pmaptap.Writer(path, run="r", process=0, host=host)
    with pmaptap.Writer(path, run="r", process=0, host="node-7") as w:
        w.write("x", 0, 1.0)
    assert [r["host"] for r in pmaptap.read(path)] == ["node-7"]


def test_jits_ahead_of_time_api_is_offered_and_writes_the_taps(tmp_path) -> None:
    """What jax.jit's wrapped function offers works on the step, whichever
    transport (under "outputs" jax.jit is pmaptap.jit): ``eval_shape``
    (was: an AttributeError), ``clear_cache``, and ``lower(...).compile()``
    whose call returns the function's outputs and writes the tap as a call
    of the step does (was: ``(outputs, pmaptap's internal pytree)``, and
    nothing written)."""

    def f(x):
        pmaptap.tap(jnp.sum(x), "total")
        return {"y": x * 2}

    step = jax.jit(f)
    x = jnp.arange(4.0)
    shape = step.eval_shape(x)
    assert jax.tree_util.tree_structure(shape) == jax.tree_util.tree_structure({"y": 0})
    assert (shape["y"].shape, shape["y"].dtype) == ((4,), jnp.float32)
    compiled = step.lower(x).compile()
    path = str(tmp_path / "t.jsonl")
    with pmaptap.Session(path, run="r"):
        assert step(x)["y"].tolist() == [0.0, 2.0, 4.0, 6.0]
        out = compiled(x + 1)
        assert out["y"].tolist() == [2.0, 4.0, 6.0, 8.0]
        step.clear_cache()
        step(x)
    assert [(r["step"], r["value"]) for r in pmaptap.read(path)] == [(0, 6.0), (1, 10.0), (2, 6.0)]


@pytest.mark.callback_only("its steps run in a subprocess: the transport fixture cannot reach them")
def test_merge_refuses_an_output_inside_the_runs_shard_directory(tmp_path) -> None:
    import subprocess
    import sys

    from conftest import ROOT

    path = str(tmp_path / "run.jsonl")
    for p in (0, 1):
        with pmaptap.Writer(path, run="r", process=p, layout="sharded") as w:
            w.write("x", 0, float(p), kind="per_device", device=p)
    before = sorted(os.listdir(path + ".d"))
    for out, extra in (
        ("run.jsonl.d/p00009.jsonl", []),  # a new shard of the run itself
        ("run.jsonl.d/sub/m.jsonl", []),
        ("run.jsonl.d/p00009.jsonl", ["-f", "--timeout", "1"]),
    ):
        m = subprocess.run(
            [sys.executable, "-m", "pmaptap", "merge", path, "-o", out, *extra],
            capture_output=True,
            text=True,
            cwd=str(tmp_path),
            env=dict(os.environ, PYTHONPATH=ROOT),
            timeout=60,
        )
        assert m.returncode == 2 and "shard directory of run" in m.stderr, m
    assert sorted(os.listdir(path + ".d")) == before
    assert len(pmaptap.read(path)) == 2
