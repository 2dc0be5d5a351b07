"""The host's fingerprint of arrays on a CPU device (issue 59, item 2:
compile time): fphash_host.fingerprints must give exactly the numbers
fphash.fingerprint64_many's CPU program gives, for every dtype and every
part of its layout, and pmaptap.jit on one CPU device must hash a step's
outputs on the host (no program of its own compiled) and write the records
jax.jit's program writes."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import pmaptap
from conftest import computed_step_number
from pmaptap._trace import fphash_host
from pmaptap._trace.fphash import FOLD, LANES, REGROUP, fingerprint64_many

BLOCK = FOLD * LANES
# Every part of the CPU layout, for every width (a block of 8-bit values is
# 4 * BLOCK of them): tails only, scalars, empty, whole blocks and a tail,
# whole groups of REGROUP blocks only, blocks not a multiple of REGROUP
# (padded rows) and more than one group, multi-dimensional shapes.
SHAPES = (
    (7,),
    (),
    (0, 3),
    (3, 5, 7),
    (BLOCK,),
    (2, BLOCK * 2 + 3),
    (BLOCK * 4 * (REGROUP + 3) + 11,),
    (BLOCK * 4 * REGROUP,),
    (300, 700),
)
DTYPES = (
    "float32", "int32", "uint32", "bfloat16", "float16", "int16", "uint16", "int8",
    "uint8", "bool", "complex64", "float8_e4m3fn", "float8_e5m2",
)  # fmt: skip
SUB_BYTE = ("int4", "uint4", "int2", "float4_e2m1fn")
WIDE = ("float64", "int64", "uint64", "complex128")  # under x64


def _leaf(dtype: str, shape: tuple, seed: int) -> np.ndarray:
    """Random bits of every pattern (NaN payloads, -0.0 included): the host
    and the program must read the same bits alike, whatever they mean."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    dt = np.dtype(getattr(ml_dtypes, dtype, None) or dtype)
    if dt == np.bool_:
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype in SUB_BYTE:
        info = ml_dtypes.iinfo(dt) if dtype.startswith(("int", "uint")) else None
        if info is not None:
            return rng.integers(int(info.min), int(info.max) + 1, size=shape).astype(dt)
        return rng.choice([-6.0, -1.5, -0.0, 0.0, 0.5, 1.0, 3.0, 6.0], size=shape).astype(dt)
    x = rng.integers(0, 256, size=n * dt.itemsize, dtype=np.uint8).view(dt).reshape(shape)
    if dtype == "float8_e5m2":
        # XLA:CPU's program reads this type's NaNs canonicalized in whole
        # blocks (the host as they lie: test_the_host_reads_nan_payloads_as_they_lie;
        # pmaptap.jit leaves such trees to the program: test_float8s_...).
        x = np.where(np.isfinite(x.astype(np.float32)), x, np.zeros((), dt))
    return x


def _program(leaves: list) -> np.ndarray:
    return np.asarray(jax.jit(lambda ls: fingerprint64_many(ls, platform="cpu"))(leaves))


@pytest.mark.parametrize("dtype", DTYPES + SUB_BYTE)
def test_the_host_hash_is_the_cpu_programs(dtype):
    device = [jnp.asarray(_leaf(dtype, s, seed)) for seed, s in enumerate(SHAPES)]
    host = fphash_host.fingerprints([np.asarray(x) for x in device])
    np.testing.assert_array_equal(host, _program(device))
    # Each leaf alone as in the tree (every leaf's sums are its own).
    alone = np.concatenate([fphash_host.fingerprints([np.asarray(x)]) for x in device])
    np.testing.assert_array_equal(alone, host)


def test_the_host_hash_is_the_cpu_programs_for_64_bit_values():
    with jax.enable_x64(True):
        device = [
            jnp.asarray(_leaf(d, s, 7 * k + j))
            for k, d in enumerate(WIDE)
            for j, s in enumerate(SHAPES)
        ]
        np.testing.assert_array_equal(
            fphash_host.fingerprints([np.asarray(x) for x in device]), _program(device)
        )


def test_one_changed_bit_changes_the_host_hash():
    x = _leaf("float32", (BLOCK * 3 + 5,), 1)
    base = fphash_host.fingerprints([x])
    for at in (0, BLOCK - 1, BLOCK * 3 + 4):
        y = x.copy()
        y.view(np.uint32)[at] ^= np.uint32(1 << 31)
        assert (fphash_host.fingerprints([y]) != base).any()


def test_the_host_reads_nan_payloads_as_they_lie():
    # float8_e5m2's signalling and quiet NaNs of one sign differ in one bit.
    x = np.full(BLOCK * 4 + 3, 0x7D, np.uint8)  # a signalling NaN
    y = x.copy()
    y[[0, BLOCK * 4 + 1]] = 0x7E  # a quiet one, in a block and past it
    e5m2 = ml_dtypes.float8_e5m2
    a, b = (fphash_host.fingerprints([v.view(e5m2)]) for v in (x, y))
    assert (a[0] != b[0]).all()


def _records(path: str) -> list[tuple]:
    return sorted(
        (r["name"], r["step"], r["fingerprint"], bool(r.get("divergent")))
        for r in pmaptap.read(path)
        if r["kind"] == "fingerprint"
    )


def _compiles() -> list[str]:
    """A list that gets the name of every function XLA compiles from now on."""
    got: list[str] = []

    def listener(event: str, duration: float, **kw) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            got.append(kw.get("fun_name", "?"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    return got


def _tree(seed: int) -> dict:
    return {
        f"{d}_{j}": jnp.asarray(_leaf(d, s, seed + 10 * j))
        for d in ("float32", "bfloat16", "int8", "bool", "complex64")
        for j, s in enumerate(SHAPES)
    }


@pytest.mark.parametrize("step_kind", ["python int", "the last step's output"])
def test_pmaptap_jit_on_one_cpu_device_hashes_outputs_on_the_host(tmp_path, step_kind):
    # A step updating a tree of every layout, its outputs fingerprinted
    # every 2 steps: pmaptap.jit hashes them on the host (one compile in
    # all: the step's) and writes what jax.jit's program writes; the step
    # donates its argument, whose buffers the host read holds.
    def step(t, s):
        t = jax.tree.map(lambda x: x + jnp.ones((), x.dtype) if x.dtype != jnp.bool_ else ~x, t)
        pmaptap.fingerprint(t, "params", step=s, every=2)
        return t, s + 1

    runs = {}
    for name, wrap in (("jax.jit", jax.jit), ("pmaptap.jit", pmaptap.jit)):
        path = str(tmp_path / f"{name}.jsonl")
        session = pmaptap.Session(path, run="host").open()
        stepped = wrap(step, donate_argnums=0)
        t, s = _tree(3), (0 if step_kind == "python int" else jnp.int32(0))
        compiles = _compiles()
        for k in range(5):
            t, s_next = stepped(t, s)
            s = k + 1 if step_kind == "python int" else s_next
        jax.block_until_ready(t)
        runs[name] = list(compiles)
        session.close()
        runs[name, "records"] = _records(path)
    assert runs["pmaptap.jit", "records"] == runs["jax.jit", "records"]
    assert [r[1] for r in runs["pmaptap.jit", "records"]] == [0, 2, 4]
    if step_kind != "python int":
        return  # (a step number still in flight at a call starts the program's compile)
    # The step's own compile, and no program of the hash (Later.hash), which
    # the program of jax.jit's transport holds (none of the step itself).
    assert [n for n in runs["pmaptap.jit"] if "step" in n] == ["jit(step)"], runs
    assert not [n for n in runs["pmaptap.jit"] if "hash" in n], runs


def test_the_program_takes_over_once_the_run_has_paid_for_it(tmp_path, monkeypatch):
    # After HOST_STEPS due steps hashed on the host, the program compiles on
    # a thread of its own while the steps go on, and hashes the due steps
    # once it is ready: the same records as jax.jit's throughout.
    import threading

    from pmaptap._outputs import later

    monkeypatch.setattr(later, "HOST_STEPS", 2)
    hosted = []
    real = later.fphash_host.fingerprints
    monkeypatch.setattr(
        later.fphash_host, "fingerprints", lambda leaves: hosted.append(1) or real(leaves)
    )

    def step(t, s):
        t = jax.tree.map(lambda x: x * 2 + 1, t)
        pmaptap.fingerprint(t, "params", step=s, every=2)
        return t

    tree = {"w": jnp.arange(3000.0).reshape(30, 100), "b": jnp.ones((7,), jnp.bfloat16)}
    for name, wrap in (("jax.jit", jax.jit), ("pmaptap.jit", pmaptap.jit)):
        compiles = _compiles()
        with pmaptap.Session(str(tmp_path / f"{name}.jsonl"), run="switch"):
            f, t = wrap(step), tree
            for s in range(10):
                t = f(t, s)
                if s == 3 and wrap is pmaptap.jit:
                    for th in threading.enumerate():
                        if th.name == "pmaptap-compile":
                            th.join(120)
    got = _records(str(tmp_path / "pmaptap.jit.jsonl"))
    assert got == _records(str(tmp_path / "jax.jit.jsonl"))
    assert [r[1] for r in got] == [0, 2, 4, 6, 8]
    # Due steps 0 and 2 on the host, then the program compiled (waited for
    # at step 3), due steps 4, 6 and 8 by the program.
    assert len(hosted) == 2, hosted
    assert "jit(hash)" in compiles, compiles


def test_a_failing_host_hash_hands_over_to_the_program(tmp_path, monkeypatch, caplog):
    # Whatever made the host's hash fail (a dtype it does not read), the
    # fingerprint is not lost: the program hashes it, said once.
    from conftest import logs_warning
    from pmaptap._outputs import later

    def broken(leaves):
        raise RuntimeError("no")

    monkeypatch.setattr(later.fphash_host, "fingerprints", broken)

    def step(t, s):
        t = jax.tree.map(lambda x: x - 1, t)
        pmaptap.fingerprint(t, "params", step=s, every=2)
        return t

    tree = {"w": jnp.arange(600.0).reshape(6, 100)}
    for name, wrap in (("jax.jit", jax.jit), ("pmaptap.jit", pmaptap.jit)):
        said = logs_warning(caplog, "host's hash failed", count=1)
        with said if wrap is pmaptap.jit else contextlib.nullcontext():
            with pmaptap.Session(str(tmp_path / f"{name}.jsonl"), run="broken"):
                f, t = wrap(step), tree
                for s in range(5):
                    t = f(t, s)
    got = _records(str(tmp_path / "pmaptap.jit.jsonl"))
    assert got == _records(str(tmp_path / "jax.jit.jsonl"))
    assert [r[1] for r in got] == [0, 2, 4]


def test_the_program_compiled_for_one_device_adapts_to_another(tmp_path, monkeypatch):
    # The program compiled on its thread is for the leaves' device then; a
    # step whose outputs later lie on another device is hashed all the same.
    import threading

    from pmaptap._outputs import later

    monkeypatch.setattr(later, "HOST_STEPS", 1)

    def step(p, s):
        p = p + 1
        pmaptap.fingerprint(p, "p", step=s, every=2)
        return p

    d0, d1 = jax.devices()[:2]
    for name, wrap in (("jax.jit", jax.jit), ("pmaptap.jit", pmaptap.jit)):
        with pmaptap.Session(str(tmp_path / f"{name}.jsonl"), run="moved"):
            f = wrap(step)
            p = f(jax.device_put(jnp.ones(8), d0), 0)  # on the host; the compile starts
            for t in threading.enumerate():
                if t.name == "pmaptap-compile":
                    t.join(120)
            p = f(p, 2)  # the program compiled for d0
            p = f(jax.device_put(p, d1), 4)  # outputs on d1
    got = _records(str(tmp_path / "pmaptap.jit.jsonl"))
    assert got == _records(str(tmp_path / "jax.jit.jsonl"))
    assert [r[1] for r in got] == [0, 2, 4]


def test_float8s_whose_nans_the_program_reads_otherwise_are_hashed_by_it(tmp_path, monkeypatch):
    # XLA:CPU's program reads the NaNs of IEEE-like 8-bit floats
    # canonicalized where it packs whole blocks; a tree holding one is the
    # program's to hash, so the records are jax.jit's whoever would hash.
    from pmaptap._outputs import later
    from pmaptap._trace.fphash_host import PROGRAM_ONLY

    hosted = []
    real = later.fphash_host.fingerprints
    monkeypatch.setattr(
        later.fphash_host, "fingerprints", lambda leaves: hosted.append(1) or real(leaves)
    )
    raw = np.random.default_rng(5).integers(0x70, 0x80, size=BLOCK * 4 + 9, dtype=np.uint8)
    for dt in sorted(PROGRAM_ONLY, key=str):
        assert np.isnan(raw.view(dt).astype(np.float32)).any()  # several NaN encodings
        tree = {"x": jnp.asarray(raw.view(dt)), "w": jnp.ones((4,))}

        def step(t, s):
            # An output of the step (flipped twice: the same bits), not the
            # argument handed back (which is hashed in the step).
            t = {"x": jnp.flip(jnp.flip(t["x"])), "w": t["w"] + 1}
            pmaptap.fingerprint(t, "f8", step=s, every=2)
            return t

        for name, wrap in (("jax.jit", jax.jit), ("pmaptap.jit", pmaptap.jit)):
            with pmaptap.Session(str(tmp_path / f"{dt}{name}.jsonl"), run="f8"):
                f, t = wrap(step), tree
                for s in range(3):
                    t = f(t, s)
        got = _records(str(tmp_path / f"{dt}pmaptap.jit.jsonl"))
        assert got == _records(str(tmp_path / f"{dt}jax.jit.jsonl")) and len(got) == 2
    assert not hosted


def test_the_program_compiles_after_several_calls_with_a_step_number_in_flight(
    tmp_path, monkeypatch
):
    # A step number still being computed at the call has the host wait for
    # it: the program compiles at the IN_FLIGHT_CALLS-th such call (a fresh
    # jnp.int32(s) caught on its way to the device now and then is not a
    # loop feeding its step numbers back), not before; records as jax.jit's.
    import threading

    from pmaptap._outputs import later

    compiles = []  # (the call, the calls whose step number was in flight)
    real = later.Later._compile_program

    def compile_program(self, *args, **kwargs):
        compiles.append((call, self._in_flight))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(later.Later, "_compile_program", compile_program)

    def step(t, s):
        t = jax.tree.map(lambda x: x * 2 + 1, t)
        pmaptap.fingerprint(t, "params", step=s, every=1000)
        return t

    tree = {"w": jnp.arange(3000.0).reshape(30, 100), "b": jnp.ones((7,), jnp.bfloat16)}
    started = []
    for name, wrap in (("jax.jit", jax.jit), ("pmaptap.jit", pmaptap.jit)):
        with pmaptap.Session(str(tmp_path / f"{name}.jsonl"), run="flight"):
            f, t = wrap(step), tree
            for call in range(later.IN_FLIGHT_CALLS + 4):
                t = f(t, computed_step_number(call))
                if wrap is pmaptap.jit:
                    for th in threading.enumerate():
                        if th.name == "pmaptap-compile":
                            started.append(call)
                            th.join(120)
    # The program's compile began at the call that made IN_FLIGHT_CALLS
    # (and not at an earlier one), on its thread.
    assert compiles and compiles[0][1] == later.IN_FLIGHT_CALLS, compiles
    assert compiles[0][0] >= later.IN_FLIGHT_CALLS - 1, compiles
    assert started and started[0] == compiles[0][0], (started, compiles)
    got = _records(str(tmp_path / "pmaptap.jit.jsonl"))
    assert got == _records(str(tmp_path / "jax.jit.jsonl")) and [r[1] for r in got] == [0]


def test_a_program_still_compiling_at_exit_is_waited_for(tmp_path):
    # The script ends while the program's compile (started by step numbers
    # in flight) runs on its thread: the exit waits for it. Before: the
    # process aborted ("terminate called after throwing an instance of
    # ''", XLA's thread ended inside C++ frames as the interpreter ended).
    from conftest import run_python

    proc = run_python(
        f"""
        import atexit, threading, jax, jax.numpy as jnp, pmaptap
        from pmaptap._outputs import later

        # Registered before pmaptap's (at the program's first compile), so
        # run after it (last in, first out), and before JAX's.
        atexit.register(lambda: print("compiling after pmaptap's exit handler:", any(
            th.name == "pmaptap-compile" and th.is_alive() for th in threading.enumerate())))

        @jax.jit
        def computed(x, k):
            for _ in range(20):
                x = jnp.tanh(x @ x)
            return (jnp.sum(x) * 0).astype(jnp.int32) + k

        def step(t, s):
            t = jax.tree.map(lambda x: x + 1, t)
            pmaptap.fingerprint(t, "params", step=s, every=1000)
            return t

        # Many leaves of many shapes: a program that takes a while to compile.
        t = {{f"w{{i}}": jnp.ones((8 + i, 3 + i % 7)) for i in range(150)}}
        big = jnp.eye(512) * 0.5
        with pmaptap.Session(r"{tmp_path}/exit.jsonl", run="exit"):
            f = pmaptap.jit(step)
            s = 0
            while not any(th.name == "pmaptap-compile" for th in threading.enumerate()):
                t = f(t, computed(big, s))
                s += 1
                assert s < 100, "no compile started"
        print("compiling at exit:", any(
            th.name == "pmaptap-compile" and th.is_alive() for th in threading.enumerate()))
        """,
        devices=1,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "compiling at exit: True" in proc.stdout, proc.stdout
    assert "compiling after pmaptap's exit handler: False" in proc.stdout, proc.stdout
    assert [r["step"] for r in pmaptap.read(str(tmp_path / "exit.jsonl"))] == [0]
