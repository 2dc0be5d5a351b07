"""pmaptap.fingerprint: every device's copy fingerprinted on the device, the
copies that should be equal compared on the host, the odd one out named.

Faults are injected as DESIGN-style tests do: under pmap ``jnp.where`` on one
axis index; under jit a ``shard_map(check_vma=False)`` that changes one
device's block of a value jit holds replicated (or sharded)."""

from __future__ import annotations

import json
import re
import socket
import uuid
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pmaptap
from pmaptap._trace import fphash
from pmaptap._trace.fphash import FOLD, LANES, REGROUP, SMALL, fingerprint64
from pmaptap.tapfile.analyze.fingerprints import suspects
from pmaptap.tapfile.analyze.summary import tap_summaries
from pmaptap.tapfile.analyze.validate import validate_file

# Every test under both transports: fingerprints as host callbacks, and as
# outputs of pmaptap.jit / pmaptap.pmap steps (the same records).
pytestmark = pytest.mark.usefixtures("transport")
# Tests of the hash alone, or of an eager call: no step, nothing a transport
# carries (run once).
NO_STEP = pytest.mark.callback_only("no compiled step: the hash alone, or an eager call")

HOST = socket.gethostname()
_fp = jax.jit(fingerprint64)


def fp_records(path: str, name: str | None = None) -> list[dict]:
    return [
        r
        for r in pmaptap.read(path)
        if r["kind"] == "fingerprint" and (name is None or r["name"] == name)
    ]


def by_step(recs: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for r in recs:
        out.setdefault(r["step"], []).append(r)
    return out


def mesh42() -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))


# ------------------------------------------------------------------ the hash


def _flip(a: np.ndarray, i: int, bit: int) -> np.ndarray:
    b = a.copy().reshape(-1)
    raw = b.view(np.dtype(f"u{b.dtype.itemsize}"))
    raw[i] ^= raw.dtype.type(1) << raw.dtype.type(bit)
    return b.reshape(a.shape)


@NO_STEP
@pytest.mark.parametrize(
    "dtype", [np.float32, np.float16, ml_dtypes.bfloat16, np.int8, np.uint16, np.int32]
)
def test_one_flipped_bit_anywhere_changes_the_fingerprint(dtype):
    rng = np.random.default_rng(1)
    # Past one folded block (FOLD x LANES words) with a tail, odd sizes too.
    for n in (7, 1001, 2 * FOLD * LANES + 333):
        a = (rng.standard_normal(n) * 50).astype(dtype)
        base = np.asarray(_fp(a))
        assert np.array_equal(np.asarray(_fp(a.copy())), base)  # equal bits, equal print
        for _ in range(12):
            i, bit = int(rng.integers(n)), int(rng.integers(8 * a.itemsize))
            assert not np.array_equal(np.asarray(_fp(_flip(a, i, bit))), base), (n, i, bit)


@NO_STEP
def test_every_bit_counts_not_the_float_value():
    zeros = np.zeros(16, np.float32)
    minus = zeros.copy()
    minus[5] = -0.0
    assert not np.array_equal(_fp(zeros), _fp(minus))  # -0.0 == 0.0 as floats
    nan = np.full(16, np.nan, np.float32)
    payload = nan.copy()
    payload.view(np.uint32)[3] |= 1  # another NaN
    assert not np.array_equal(_fp(nan), _fp(payload))
    # Position counts: two elements swapped (the same multiset of bits).
    x = np.arange(3 * FOLD * LANES, dtype=np.float32)
    y = x.copy()
    y[[10, 70000]] = y[[70000, 10]]
    assert not np.array_equal(_fp(x), _fp(y))
    flags = np.array([True, False, True, True, False])
    assert not np.array_equal(_fp(flags), _fp(~flags))
    c = np.array([1 + 2j, 3 - 1j], np.complex64)
    assert not np.array_equal(_fp(c), _fp(c.conj()))


# Every dtype the issue names, in each layout: the CPU's (the small path on
# every platform too) and the TPU's (_tiled, whose arithmetic runs on the
# CPU as well; on a TPU the benchmark checks it: bench_fingerprint.py).
DTYPES = [
    np.float32,
    ml_dtypes.bfloat16,
    np.float16,
    np.int8,
    np.uint8,
    np.bool_,
    np.int16,
    np.complex64,
]


def _random(dtype, shape, rng) -> np.ndarray:
    n = int(np.prod(shape))
    if dtype == np.bool_:
        return rng.integers(0, 2, n).astype(bool).reshape(shape)
    raw = rng.integers(0, 256, n * np.dtype(dtype).itemsize, dtype=np.uint8)
    a = raw.view(np.dtype(dtype)).reshape(shape)
    return a


def _flips(a: np.ndarray, rng, count: int):
    """``count`` copies of ``a``, each with one random bit flipped (a bool's
    one bit)."""
    raw = a.reshape(-1).view(np.dtype(f"u{min(a.itemsize, 8)}"))  # complex128: two words
    for _ in range(count):
        i = int(rng.integers(raw.size))
        bit = 0 if a.dtype == np.bool_ else int(rng.integers(8 * raw.itemsize))
        b = raw.copy()
        b[i] ^= b.dtype.type(1) << b.dtype.type(bit)
        yield b.view(a.dtype).reshape(a.shape)


# The two layouts past the small path, of any dtype (a complex value's parts
# as the platform's branch of fingerprint64 takes them).
_tiled = jax.jit(lambda x: fphash._tiled_parts(fphash._parts(x), None))
_cpu = jax.jit(lambda x: fphash._flat(fphash._parts(x), None, FOLD, REGROUP))


@NO_STEP
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize(
    "shape",
    [(7,), (3, 333), (1 << 18,), (2048, 768), (3, 1000, 300), (1 << 20,)],
    ids=lambda s: "x".join(map(str, s)),
)
def test_every_flipped_bit_of_every_dtype_is_seen_in_every_layout(dtype, shape):
    """One flipped bit anywhere in any word changes the fingerprint: the
    small path, the CPU's packed or widened words with their lanes folded
    again, and the TPU's tiled rows (a whole number of tiles to a lane,
    whole columns where none divides the rows, the vector's 128 columns)."""
    rng = np.random.default_rng(hash((np.dtype(dtype).name, shape)) % 2**32)
    a = _random(dtype, shape, rng)
    fns = [_fp, _cpu] + ([_tiled] if len(shape) > 1 or shape[0] % 128 == 0 else [])
    for fn in fns:
        base = np.asarray(fn(a))
        assert np.array_equal(np.asarray(fn(a.copy())), base)
        for bad in _flips(a, rng, 6):
            assert not np.array_equal(np.asarray(fn(bad)), base), (fn, shape)


@NO_STEP
def test_the_cpu_layout_packs_narrow_values_without_a_second_pass():
    """The compiled program reads a bfloat16/int8/bool array in one fused
    loop: no instruction writes out words of the whole array (a bitcast to
    32 bits by a reshape to a minor dimension of 2 or 4 did, a pass of its
    own that cost 13-17x a float sum)."""
    n = 4 * SMALL
    for dtype in (jnp.bfloat16, jnp.float16, jnp.int8, jnp.bool_, jnp.float32):
        elements = n // jnp.dtype(dtype).itemsize
        txt = _hlo(jax.jit(fingerprint64), jnp.zeros((elements,), dtype))
        entry = txt.split("ENTRY", 1)[1]
        for m in re.finditer(r"= u32\[([\d,]+)\]", entry):
            size = int(np.prod([int(d) for d in m.group(1).split(",")]))
            # The lanes: one to FOLD elements at most.
            assert size <= elements // FOLD, (dtype, m.group(0))


# Each float dtype's quiet NaN and its quiet bit (the top bit of the mantissa).
NANS = {
    np.float32: (0x7FC00000, 0x00400000),
    ml_dtypes.bfloat16: (0x7FC0, 0x0040),
    np.float16: (0x7E00, 0x0200),
}


@NO_STEP
@pytest.mark.parametrize("dtype", list(NANS), ids=lambda d: np.dtype(d).name)
def test_minus_zero_and_nan_payloads_of_every_float_dtype(dtype):
    """-0.0 against 0.0, a signalling NaN against a quiet one, another
    payload: the bits count, in every layout (bfloat16 and float16 are never
    computed in float32 on the way, which would quiet a NaN)."""
    size = np.dtype(dtype).itemsize
    u = np.dtype(f"u{size}")
    n = 2 * SMALL // size  # past the small path, a whole number of 128s
    zeros = np.zeros(n, dtype)
    minus = zeros.copy()
    minus.view(u)[12345] = u.type(1) << u.type(8 * size - 1)
    qnan, quiet_bit = NANS[dtype]
    quiet = np.full(n, qnan, u)
    signalling = quiet.copy()
    signalling[777] = (qnan & ~quiet_bit) | 1
    payload = quiet.copy()
    payload[778] |= 1
    for fn in (_fp, _cpu, _tiled):
        assert not np.array_equal(fn(zeros), fn(minus)), fn
        base = np.asarray(fn(quiet.view(dtype)))
        assert not np.array_equal(fn(signalling.view(dtype)), base), fn
        assert not np.array_equal(fn(payload.view(dtype)), base), fn


@NO_STEP
def test_sign_bits_flipped_in_two_lanes_of_one_group_do_not_cancel():
    """The CPU's lanes are folded again REGROUP at a time after a xor-shift:
    two flipped sign bits in one column of two blocks of a group are seen.
    In one lane (two rows of one block) they cancel, as docs/api.md says
    (2**31 times the sum of two odd numbers is 0 mod 2**32)."""
    a = np.zeros(2 * FOLD * REGROUP * LANES, np.float32)
    base = np.asarray(_cpu(a))
    for k in range(1, REGROUP):
        b = a.copy()
        b[[7, 7 + k * FOLD * LANES]] = -0.0
        assert not np.array_equal(_cpu(b), base), k
    same_lane = a.copy()
    same_lane[[7, 7 + LANES]] = -0.0
    assert np.array_equal(_cpu(same_lane), base)


@NO_STEP
@pytest.mark.parametrize("x64", [False, True])
def test_the_words_of_one_element_share_a_lane_in_order(x64):
    """The CPU layout folds a 64-bit value's halves and a complex value's
    parts into one lane in one pass, each word with its own multiplier: the
    parts swapped, or the halves, is another fingerprint."""
    with jax.enable_x64(x64):
        rng = np.random.default_rng(9)
        dtypes = (np.complex64,) + ((np.complex128, np.float64, np.int64) if x64 else ())
        for dtype in dtypes:
            for shape in ((5,), (512, 1024)):
                a = _random(dtype, shape, rng)
                half = np.dtype(f"u{a.itemsize // 2}")  # real/imaginary, low/high
                swapped = a.view(half).reshape(-1, 2)[:, ::-1].copy().view(dtype).reshape(shape)
                for fn in (_fp, _cpu):
                    assert not np.array_equal(np.asarray(fn(a)), np.asarray(fn(swapped)))


@NO_STEP
def test_64_bit_dtypes_with_x64():
    with jax.enable_x64(True):  # jit traces again under it (part of its cache key)
        rng = np.random.default_rng(5)
        for dtype in (np.float64, np.int64, np.uint64, np.complex128):
            for shape in ((5,), (1 << 17,), (256, 1024)):
                a = _random(dtype, shape, rng)
                for fn in (_fp, _cpu, _tiled):
                    base = np.asarray(fn(a))
                    assert base.dtype == np.uint32 and base.shape == (2,)
                    for bad in _flips(a, rng, 8):
                        assert not np.array_equal(np.asarray(fn(bad)), base), (dtype, shape)


# ------------------------------------------------------------------ pmap


def _pmap_step(fault_device: int, fault_step: int):
    def body(p, step):
        p = jax.tree.map(lambda v: v * 1.5 + 1.0, p)
        hit = (lax.axis_index("i") == fault_device) & (step == fault_step)
        w = jnp.where(hit, _flip_jax(p["w"], 5, 3), p["w"])  # one bit, one element
        p = {"b": p["b"], "w": w}
        pmaptap.fingerprint(p, "params", step=step)
        return p

    return jax.pmap(body, axis_name="i", in_axes=(0, None))


def _flip_jax(x, i: int, bit: int):
    flat = lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
    flat = flat.at[i].set(flat[i] ^ jnp.uint32(1 << bit))
    return lax.bitcast_convert_type(flat, x.dtype).reshape(x.shape)


def test_pmap_names_the_device_whose_copy_differs(session, tap_path):
    step = _pmap_step(fault_device=3, fault_step=2)
    p = {"w": jnp.ones((8, 16, 32)), "b": jnp.zeros((8, 5))}
    for s in range(4):
        p = step(p, s)
        p = jax.tree.map(lambda v: np.broadcast_to(np.asarray(v)[0], v.shape).copy(), p)  # heal
    session.flush()
    steps = by_step(fp_records(tap_path))
    assert sorted(steps) == [0, 1, 2, 3]
    for s in (0, 1, 3):  # agreeing steps: one record each, every device
        (r,) = steps[s]
        assert r["devices"] == list(range(8)) and r["processes"] == [0]
        assert r["replicas"] == 8 and r["leaves"] == 2 and r["slices"] == 2
        assert not r.get("divergent") and r["value"] is None
        assert re.fullmatch(r"[0-9a-f]{16}", r["fingerprint"])
    majority, odd = steps[2]  # most holders first
    assert majority["devices"] == [0, 1, 2, 4, 5, 6, 7] and majority["replicas"] == 7
    assert odd["devices"] == [3] and odd["processes"] == [0] and odd["replicas"] == 1
    assert odd["holders"] == [{"device": 3, "process": 0, "host": HOST, "coords": {"i": 3}}]
    for r in (majority, odd):
        assert r["divergent"] is True and r["leaf"] == "w" and r["compared"] == 8
    assert majority["fingerprint"] != odd["fingerprint"]
    # The readers: summary names it, validate calls it data.
    (s,) = suspects(pmaptap.read(tap_path))[("test", "params")]
    assert (s.device, s.process, s.host, s.first_step, s.leaf, s.steps) == (
        3,
        0,
        HOST,
        2,
        "w",
        1,
    )
    (summary,) = tap_summaries(pmaptap.read(tap_path))
    assert "first at step 2, leaf w: suspect device 3 (process 0" in summary.fingerprint
    report = validate_file(tap_path)
    assert report.ok and report.divergent_fingerprints == 1, report.problems


def test_no_majority_names_every_copy(session, tap_path):
    def body(x):
        x = x + lax.axis_index("i").astype(jnp.float32)  # two different copies
        pmaptap.fingerprint(x, "two")
        return x

    jax.pmap(body, axis_name="i", devices=jax.devices()[:2])(jnp.zeros((2, 3)))
    session.flush()
    found = suspects(pmaptap.read(tap_path))[("test", "two")]
    assert sorted(s.device for s in found) == [0, 1]
    assert not any(s.majority for s in found)
    (summary,) = tap_summaries(pmaptap.read(tap_path))
    assert "no majority" in summary.fingerprint


# ------------------------------------------------------------------ plain jit


def _corrupt(mesh, spec, where: dict, step_hit):
    """A shard_map(check_vma=False) that flips one bit of the block held by
    the device at mesh coordinates ``where`` when ``step_hit``."""

    def f(block, hit):
        on = hit
        for axis, c in where.items():
            on = on & (lax.axis_index(axis) == c)
        # Element 1 (not 0.0, which times 1.0001 a denormal, flushed to 0).
        return jnp.where(on, _flip_jax(block, 1, 7), block)

    return lambda x: jax.shard_map(
        f, mesh=mesh, in_specs=(spec, P()), out_specs=spec, check_vma=False
    )(x, step_hit)


@pytest.mark.parametrize(
    "spec, where, device, index",
    [
        (P(None, "model"), {"data": 1, "model": 0}, 2, [[0, 8], [0, 4]]),
        (P(), {"data": 3, "model": 1}, 7, None),
        (P("data", "model"), {"data": 2, "model": 1}, 5, [[4, 6], [4, 8]]),
    ],
    ids=["sharded-over-model", "replicated", "no-replicas"],
)
def test_jit_compares_the_holders_of_each_slice(session, tap_path, spec, where, device, index):
    mesh = mesh42()
    w = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, spec))
    b = jax.device_put(jnp.ones(3), NamedSharding(mesh, P()))

    @jax.jit
    def step_fn(w, b, step):
        w = _corrupt(mesh, spec, where, step == 1)(w * 1.0001)
        pmaptap.fingerprint({"w": w, "b": b}, "params", step=step)
        return w, b

    for s in range(3):
        w, b = step_fn(w, b, s)
    session.flush()
    steps = by_step(fp_records(tap_path))
    assert sorted(steps) == [0, 1, 2]
    (clean,) = steps[0]
    assert clean["devices"] == list(range(8)) and not clean.get("divergent")
    groups = {P(None, "model"): 2, P(): 1, P("data", "model"): 8}[spec]
    assert clean["slices"] == groups + 1  # w's slices and b's one
    recs = steps[1] + steps[2]  # the corrupted bit stays in w
    odd = [r for r in recs if r["replicas"] == 1 and device in r["devices"]]
    if spec == P("data", "model"):
        # Every slice has one holder: nothing to compare, nothing flagged.
        assert not any(r.get("divergent") for r in recs)
        return
    assert len(odd) == 2 and {r["step"] for r in odd} == {1, 2}
    for r in odd:
        assert r["divergent"] is True and r["leaf"] == "w"
        assert r.get("index") == index
        assert r["holders"] == [
            {"device": device, "process": 0, "host": HOST, "coords": where},
        ]
    (s,) = suspects(pmaptap.read(tap_path))[("test", "params")]
    assert (s.device, s.first_step, s.steps) == (device, 1, 2)


def test_jit_uneven_sharding_ignores_padding(session, tap_path):
    mesh = mesh42()
    uneven = NamedSharding(mesh, P("data"))

    # The uneven value stays inside the step: JAX 0.9 and 0.12 refuse to
    # return a jit output sharded unevenly (IndivisibleError), with or
    # without a fingerprint; inside, every release shards it so.
    @jax.jit
    def f(x):
        y = lax.with_sharding_constraint(x * 2.0, uneven)
        pmaptap.fingerprint(y, "uneven")
        return y.sum()

    f(jnp.arange(30.0).reshape(6, 5))
    session.flush()
    (r,) = fp_records(tap_path, "uneven")
    # 6 rows over 4 data rows: tiles of 2, the last one padding only; the
    # model axis holds copies of each tile, and they agree.
    assert not r.get("divergent") and r["slices"] == 3
    assert r["devices"] == list(range(6))


def _hlo(fn, *args) -> str:
    return fn.lower(*args).compile().as_text()


def _fingerprint_reads(txt: str, buffer: str) -> list[str]:
    """Lines of ``txt`` computing uint32 values straight from the
    instruction ``buffer`` (the stored value; any operand of the fusion:
    JAX 0.12's XLA puts another leaf's buffer first), or from a bitcast of
    it (a view, no copy: JAX 0.12's XLA reshapes the pmap buffer so)."""
    names = [buffer] + re.findall(rf"%(\S+) = \S+ bitcast\(%{re.escape(buffer)}\)", txt)
    read = "|".join(re.escape(n) for n in names)
    return [
        ln
        for ln in txt.splitlines()
        if re.search(r"= u32\[", ln) and re.search(rf"fusion\((?:%[^,)]+, )*%(?:{read})[,)]", ln)
    ]


def _root(txt: str) -> tuple[str, str]:
    """The instruction the program returns (and its shape); with the output
    transport the root is a tuple: the step's own output, then the lifted
    fingerprints."""
    entry = txt.split("ENTRY", 1)[1]
    m = re.search(r"ROOT %(\S+) = (f32\[[^\]]*\])", entry)
    if m:
        return m.group(1), m.group(2)
    m = re.search(r"ROOT %\S+ = \((f32\[[^\]]*\])\{[^}]*\}.*? tuple\(%([^,)]+)", entry)
    assert m, entry
    return m.group(2), m.group(1)


@pytest.mark.parametrize("spec, local", [(P(), "f32[64,1024]"), (P(None, "model"), "f32[64,512]")])
def test_jit_hlo_one_fingerprint_per_device_buffer(spec, local, transport):
    """The compiled program: each device fingerprints its own buffer (the
    stored value, of the local shard's shape), and the rows are gathered:
    XLA did not take the copies' fingerprints for one value."""
    mesh = mesh42()
    x = jax.device_put(jnp.ones((64, 1024)), NamedSharding(mesh, spec))

    def body(x):
        y = x * 2.0
        pmaptap.fingerprint({"y": y, "z": y + 1}, "y")
        return y

    txt = _hlo(jax.jit(body), x)
    root, shape = _root(txt)
    assert shape == local  # the program is per device
    if transport == "callback":
        # From y's own buffer, not recomputed. A step that returns a tuple
        # (every pmaptap.jit step: its lifted outputs follow) has XLA fuse a
        # cheap producer into the fingerprint again (the optimization barrier
        # is expanded before fusion), under jax.jit alike: docs/faults.md.
        assert _fingerprint_reads(txt, root), txt
    gathers = [ln for ln in txt.splitlines() if " all-gather(" in ln]
    assert len(gathers) == 1 and "u32[8,2,2]" in gathers[0], gathers  # one row a device
    assert not re.search(r"f32\[[^\]]*\]\S* (all-gather|all-reduce)\(", txt)  # no value moved
    # One host call, or none: the rows leave the step as an output.
    assert txt.count("xla_ffi_python_cpu_callback") == (transport == "callback")


def test_pmap_hlo_one_fingerprint_per_device_buffer(transport):
    def body(x):
        y = x * 2.0
        pmaptap.fingerprint(y, "y")
        return y

    txt = _hlo(jax.pmap(body, axis_name="i"), jnp.ones((8, 64, 1024)))
    root, shape = _root(txt)
    assert shape == "f32[1,64,1024]"
    if transport == "callback":
        assert _fingerprint_reads(txt, root), txt
    gathers = [ln for ln in txt.splitlines() if " all-gather(" in ln]
    assert len(gathers) == 1 and "u32[8,1,2]" in gathers[0], gathers
    assert txt.count("xla_ffi_python_cpu_callback") == (transport == "callback")


# ------------------------------------------------------------------ shard_map


def test_inside_shard_map_the_varying_axes_pick_the_copies(session, tap_path):
    """check_vma=True: a block of a value split over "model" is compared with
    the copies of the same block (the same "model" coordinate), a psum'd
    value with every copy: different blocks are no divergence."""
    mesh = mesh42()
    x = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P(None, "model")))

    def body(block):
        total = lax.psum(jnp.sum(block), "model")
        pmaptap.fingerprint({"block": block * 2.0, "total": total}, "sm")
        return block

    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(None, "model"), out_specs=P(None, "model")))(
        x
    )
    session.flush()
    (clean,) = fp_records(tap_path, "sm")
    assert not clean.get("divergent") and clean["slices"] == 2 + 1
    assert clean["devices"] == list(range(8))


def test_inside_shard_map_without_varying_types_every_copy_is_compared(session, tap_path):
    """check_vma=False (as pmap): no type says what varies, the value is
    taken as replicated; the device holding another copy is named."""
    mesh = mesh42()
    x = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P()))

    def body(params, step):
        bad = (lax.axis_index("data") == 2) & (lax.axis_index("model") == 1) & (step == 1)
        params = jnp.where(bad, _flip_jax(params, 3, 0), params)
        pmaptap.fingerprint({"params": params}, "sm", step=step)
        return params

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False))
    f(x, 0)
    f(x, 1)
    session.flush()
    steps = by_step(fp_records(tap_path, "sm"))
    (clean,) = steps[0]
    assert not clean.get("divergent") and clean["slices"] == 1
    majority, odd = steps[1]
    assert majority["replicas"] == 7 and odd["devices"] == [5] and odd["leaf"] == "params"
    assert "slice_coords" not in odd and odd["compared"] == 8
    assert odd["holders"][0]["coords"] == {"data": 2, "model": 1}


def test_partially_manual_shard_map_is_refused():
    mesh = mesh42()

    def body(x):
        pmaptap.fingerprint(x, "partial")
        return x

    f = jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"), axis_names={"data"})
    with pytest.raises(ValueError, match="manual over"):
        jax.jit(f).lower(jnp.ones((8, 4)))


# ------------------------------------------------------------------ control flow, steps


def test_scan_with_a_traced_step_and_every(session, tap_path):
    @jax.pmap
    def f(x):
        def body(c, i):
            c = c + 1.0
            pmaptap.fingerprint(c, "scan", step=i, every=2)
            return c, None

        return lax.scan(body, x, jnp.arange(6))[0]

    f(jnp.ones((8, 4)))
    session.flush()
    assert sorted(r["step"] for r in fp_records(tap_path, "scan")) == [0, 2, 4]


def test_while_body_each_device_sends_its_own(session, tap_path):
    def f(x):
        def body(c):
            v, i = c
            v = v + jnp.where((lax.axis_index("i") == 5) & (i == 1), 1.0, 0.0)
            pmaptap.fingerprint(v, "while", step=i)
            return v + 1.0, i + 1

        return lax.while_loop(lambda c: c[1] < 2, body, (x, 0))[0]

    txt = _hlo(jax.pmap(f, axis_name="i"), jnp.ones((8, 4)))
    assert " all-gather(" not in txt  # no collective a device might not reach
    jax.pmap(f, axis_name="i")(jnp.ones((8, 4)))
    session.flush()
    steps = by_step(fp_records(tap_path, "while"))
    assert [r["devices"] for r in steps[0]] == [list(range(8))]
    assert [r["devices"] for r in steps[1]] == [[0, 1, 2, 3, 4, 6, 7], [5]]


def test_automatic_and_static_steps(session, tap_path):
    auto = jax.pmap(lambda x: pmaptap.fingerprint(x, "auto", every=2) + 1)
    for _ in range(5):
        auto(jnp.ones((8, 2)))

    def static(x, s):
        return pmaptap.fingerprint(x, f"static{s}", step=s, every=2)

    a = jax.make_jaxpr(lambda x: static(x, 7))(jnp.ones(2))
    assert "pmaptap" not in str(a)  # step 7 skipped by every=2: nothing compiled
    jax.jit(lambda x: static(x, 8))(jnp.ones(2))
    session.flush()
    assert sorted(r["step"] for r in fp_records(tap_path, "auto")) == [0, 2, 4]
    assert [r["step"] for r in fp_records(tap_path, "static8")] == [8]
    # One device: nothing to compare, its one copy named.
    (r,) = fp_records(tap_path, "static8")
    assert r["devices"] == [0] and r["replicas"] == 1


def test_untapped_removes_it(session, tap_path):
    f = jax.pmap(pmaptap.untapped(lambda x: pmaptap.fingerprint(x, "gone") + 1))
    assert "callback" not in _hlo(f, jnp.ones((8, 2)))
    f(jnp.ones((8, 2)))
    session.flush()
    assert fp_records(tap_path) == []


def test_vmap_fingerprints_the_batch_whole(session, tap_path):
    f = jax.pmap(jax.vmap(lambda x: pmaptap.fingerprint(x, "batch") * 2))
    f(jnp.ones((8, 3, 2)))
    session.flush()
    (r,) = fp_records(tap_path, "batch")  # one record: not one per element
    assert r["devices"] == list(range(8))


@NO_STEP
def test_eager_sharded_array_compiles_once(session, tap_path):
    mesh = mesh42()
    x = jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh, P("data")))
    from pmaptap._trace.fingerprint_jit import fingerprint_p

    for _ in range(3):
        assert pmaptap.fingerprint(x, "eager") is x
    session.flush()
    recs = fp_records(tap_path, "eager")
    assert [r["step"] for r in recs] == [0, 1, 2]
    assert recs[0]["slices"] == 4 and recs[0]["devices"] == list(range(8))
    del fingerprint_p


def test_gradients_flow_as_if_absent():
    def loss(w):
        return jnp.sum(pmaptap.fingerprint(w, "w") ** 2)

    assert np.allclose(jax.grad(loss)(jnp.arange(3.0)), 2 * np.arange(3.0))
    # In a step too (under the output transport, the mark under grad).
    assert np.allclose(jax.jit(jax.grad(loss))(jnp.arange(3.0)), 2 * np.arange(3.0))


@NO_STEP
@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(name=3), TypeError, "name must be a str"),
        (dict(name="x", every=0), ValueError, "every must be >= 1"),
        (dict(name="x", step=1.5), TypeError, "step must be None"),
    ],
)
def test_bad_arguments_are_refused_where_written(kwargs, error, match):
    name = kwargs.pop("name")
    with pytest.raises(error, match=match):
        pmaptap.fingerprint(jnp.ones(2), name, **kwargs)


@NO_STEP
def test_a_value_without_leaves_is_refused():
    with pytest.raises(ValueError, match="no array leaves"):
        pmaptap.fingerprint({}, "empty")


def test_jit_every_scan_and_while_keep_each_slices_copies(session, tap_path):
    """Under jit the fingerprints of a sharded value inside a traced-step
    `every` cond, a scan body and a while body: each slice's holders are
    compared (2 slices over "model"), the skipped steps write nothing."""
    mesh = mesh42()
    w = jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh, P(None, "model")))

    @jax.jit
    def every(w, step):
        w = w * 1.5
        pmaptap.fingerprint(w, "every", step=step, every=2)
        return w

    @jax.jit
    def scanned(w):
        def body(c, i):
            c = c + 1.0
            pmaptap.fingerprint(c, "scan", step=i)
            return c, None

        return lax.scan(body, w, jnp.arange(3))[0]

    @jax.jit
    def looped(w):
        def body(c):
            v, i = c
            pmaptap.fingerprint(v, "while", step=i)
            return v + 1, i + 1

        return lax.while_loop(lambda c: c[1] < 2, body, (w, 0))[0]

    for s in range(4):
        w = every(w, s)
    scanned(w)
    looped(w)
    session.flush()
    for name, steps in (("every", [0, 2]), ("scan", [0, 1, 2]), ("while", [0, 1])):
        recs = fp_records(tap_path, name)
        assert [r["step"] for r in recs] == steps, name
        for r in recs:
            assert r["devices"] == list(range(8)) and r["slices"] == 2 and not r.get("divergent")


# ------------------------------------------------------------------ dtypes end to end


def _flip_any(x, i: int):
    """``x`` with one bit of element ``i`` (flat) flipped: a bool negated,
    a complex value's imaginary sign bit, else bit 0 of its word."""
    flat = x.reshape(-1)
    if x.dtype == jnp.bool_:
        return flat.at[i].set(~flat[i]).reshape(x.shape)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return flat.at[i].set(lax.complex(flat[i].real, -flat[i].imag)).reshape(x.shape)
    bits = lax.bitcast_convert_type(flat, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.itemsize])
    bits = bits.at[i].set(bits[i] ^ jnp.ones((), bits.dtype))
    return lax.bitcast_convert_type(bits, x.dtype).reshape(x.shape)


END_TO_END = [jnp.bfloat16, jnp.float16, jnp.int8, jnp.uint8, jnp.bool_, jnp.complex64]


@pytest.mark.parametrize("dtype", END_TO_END, ids=lambda d: jnp.dtype(d).name)
def test_pmap_names_the_device_for_every_dtype(session, tap_path, dtype):
    """A copy of 1 MiB or more per device (the platform's layout, not the
    small path) with one flipped bit on device 6 at step 1."""

    def body(x, step):
        x = jnp.where((lax.axis_index("i") == 6) & (step == 1), _flip_any(x, 123457), x)
        pmaptap.fingerprint({"p": x}, "dt", step=step)
        return x

    f = jax.pmap(body, axis_name="i", in_axes=(0, None))
    x = jnp.broadcast_to(jnp.ones((1024, 1024), dtype), (8, 1024, 1024))
    for s in range(2):
        f(x, s)
    session.flush()
    steps = by_step(fp_records(tap_path, "dt"))
    (clean,) = steps[0]
    assert not clean.get("divergent") and clean["devices"] == list(range(8))
    majority, odd = steps[1]
    assert odd["devices"] == [6] and odd["divergent"] and majority["replicas"] == 7


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.int8], ids=lambda d: jnp.dtype(d).name)
def test_jit_uneven_slices_of_narrow_dtypes(session, tap_path, dtype):
    """Rows split unevenly over "data" (XLA pads the last tile; the padding
    is no element of the value): each slice's copies agree at every step,
    and one flipped bit of the value (in every copy of its slice) gives
    another fingerprint."""
    mesh = mesh42()
    uneven = NamedSharding(mesh, P("data"))

    @jax.jit
    def f(x, step):
        y = jnp.where(step == 1, _flip_any(x, 5000 * 1024 // 5), x)
        y = lax.with_sharding_constraint(y, uneven)
        pmaptap.fingerprint(y, "uneven_dt", step=step)
        return y.sum()  # not y: see test_jit_uneven_sharding_ignores_padding

    x = jnp.ones((4098, 1024), dtype)
    for s in range(3):
        f(x, s)
    session.flush()
    recs = fp_records(tap_path, "uneven_dt")
    assert [r["step"] for r in recs] == [0, 1, 2]
    for r in recs:
        assert not r.get("divergent") and r["slices"] == 4 and r["devices"] == list(range(8))
    assert recs[0]["fingerprint"] == recs[2]["fingerprint"] != recs[1]["fingerprint"]


# ------------------------------------------------------------------ as step outputs


def _every_layout(jit, pmap, path) -> None:
    """Fingerprints in every layout, each with a fault on one device, run
    with ``jit`` / ``pmap`` (JAX's, or pmaptap's: the output transport)."""
    mesh = mesh42()

    def mapped(x, step):
        x = jnp.where((lax.axis_index("i") == 3) & (step == 1), _flip_jax(x, 5, 3), x)
        pmaptap.fingerprint({"x": x}, "gathered", step=step)
        # Inside a cond branch: each device's own (no collective there).
        return lax.cond(step % 2 == 0, lambda v: pmaptap.fingerprint(v, "in_cond"), lambda v: v, x)

    def sharded(w, step):
        w = _corrupt(mesh, P(None, "model"), {"data": 1, "model": 0}, step == 1)(w * 1.5)

        def body(c, i):
            pmaptap.fingerprint(c, "scanned", step=2 * step + i, every=2)
            return c + 1.0, None

        pmaptap.fingerprint({"w": w}, "sharded", step=step)
        return lax.scan(body, w, jnp.arange(2))[0]

    def in_shard_map(x, step):
        def body(block):
            bad = (lax.axis_index("data") == 2) & (lax.axis_index("model") == 1) & (step == 1)
            block = jnp.where(bad, _flip_jax(block, 3, 0), block)
            pmaptap.fingerprint(block, "in_shard_map")
            return block

        return jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)(x)

    with pmaptap.Session(str(path), run="t"):
        f, g = pmap(mapped, axis_name="i", in_axes=(0, None)), jit(sharded)
        h, one = jit(in_shard_map), jit(lambda x: pmaptap.fingerprint(x, "one") + 1)
        w = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P(None, "model")))
        for s in range(3):
            f(jnp.ones((8, 4, 4)), s)
            w = g(w, s)
            h(jnp.ones((8, 8)), s)
            one(jnp.ones(3) * s)


def _records(path) -> list[dict]:
    """The records but their time, in a fixed order (the callback transport's
    order of two independent calls is XLA's schedule)."""
    recs = [{k: v for k, v in r.items() if k != "time"} for r in pmaptap.read(str(path))]
    return sorted(recs, key=lambda r: json.dumps(r, sort_keys=True))


@pytest.mark.callback_only("runs both transports itself, to compare them")
def test_fingerprints_as_outputs_write_the_callback_transports_records(tmp_path):
    _every_layout(jax.jit, jax.pmap, tmp_path / "callback.jsonl")
    _every_layout(pmaptap.jit, pmaptap.pmap, tmp_path / "outputs.jsonl")
    expected = _records(tmp_path / "callback.jsonl")
    assert _records(tmp_path / "outputs.jsonl") == expected
    # Every layout wrote, and each fault is named, by device.
    names = {r["name"] for r in expected}
    assert names == {"gathered", "in_cond", "sharded", "scanned", "in_shard_map", "one"}
    odd = {(r["name"], r["step"], tuple(r["devices"])) for r in expected if r["replicas"] == 1}
    assert {("gathered", 1, (3,)), ("sharded", 1, (2,)), ("in_shard_map", 1, (5,))} <= odd
    assert sorted({r["step"] for r in expected if r["name"] == "scanned"}) == [0, 2, 4]


@pytest.mark.callback_only("uses pmaptap.jit / pmaptap.pmap itself")
def test_the_output_transports_step_holds_no_host_callback():
    mesh = mesh42()
    w = jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh, P(None, "model")))
    steps = [
        (pmaptap.pmap(lambda x: pmaptap.fingerprint(x, "p") + 1, axis_name="i"), jnp.ones((8, 2))),
        (pmaptap.jit(lambda w: pmaptap.fingerprint(w * 2, "j")), w),
        (pmaptap.jit(lambda x: pmaptap.fingerprint(x, "one") + 1), jnp.ones(3)),
    ]
    for f, x in steps:
        txt = f.lower(x).as_text()
        assert "callback" not in txt, txt


def _notices(run) -> list[str]:
    """What ``run()`` says: warnings and pmaptap's log lines."""
    import logging

    got: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            got.append(record.getMessage())

    handler = Keep(logging.WARNING)
    logging.getLogger("pmaptap").addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run()
    finally:
        logging.getLogger("pmaptap").removeHandler(handler)
    return got + [str(w.message) for w in caught]


@pytest.mark.callback_only("runs both transports itself, to compare them")
def test_a_fingerprint_in_a_while_loop_keeps_its_callback_said_once(tmp_path):
    name = f"while_{uuid.uuid4().hex[:8]}"  # said once per process: a fresh site

    def mapped(x):
        def body(c):
            v, i = c
            v = v + jnp.where((lax.axis_index("i") == 5) & (i == 1), 1.0, 0.0)
            pmaptap.fingerprint(v, name, step=i)
            return v + 1.0, i + 1

        return lax.while_loop(lambda c: c[1] < 2, body, (x, 0))[0]

    def plain(w):
        def body(c):
            v, i = c
            pmaptap.fingerprint(v, name + "_jit", step=i)
            return v + 1, i + 1

        return lax.while_loop(lambda c: c[1] < 2, body, (w, 0))[0]

    mesh = mesh42()
    w = jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh, P(None, "model")))

    def run(jit, pmap, path):
        with pmaptap.Session(str(path), run="w"):
            for _ in range(2):  # a second call, and a second trace of the same sites
                pmap(mapped, axis_name="i")(jnp.ones((8, 4)))
                jit(plain)(w)

    run(jax.jit, jax.pmap, tmp_path / "callback.jsonl")
    said = _notices(lambda: run(pmaptap.jit, pmaptap.pmap, tmp_path / "outputs.jsonl"))
    said = [m for m in said if "while" in m and "host callback" in m]
    # Once per site, naming the fingerprint.
    assert len(said) == 2, said
    assert f"pmaptap.fingerprint({name!r})" in said[0]
    assert f"pmaptap.fingerprint({name + '_jit'!r})" in said[1]
    assert "callback" in pmaptap.pmap(mapped, axis_name="i").lower(jnp.ones((8, 4))).as_text()
    expected = _records(tmp_path / "callback.jsonl")
    assert _records(tmp_path / "outputs.jsonl") == expected
    odd = [r for r in expected if r["name"] == name and r["replicas"] == 1]
    assert [r["devices"] for r in odd] == [[5], [5]]  # step 1 of each call
