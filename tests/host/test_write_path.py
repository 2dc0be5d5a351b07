"""The write path of array taps (issue 41): the callback's one copy (none
where the device-to-host transfer already made a host buffer), the writer
starting on a step's bytes at once, the .npy header made once per tap site,
no copy of a big value's bytes to compare copies, and the queue's bound
said once when it is met."""

from __future__ import annotations

import os
import threading
import time
import tracemalloc

import filelock
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pmaptap
from conftest import logs_warning, wait_for
from pmaptap._host.pipeline import queue as queue_mod
from pmaptap._host.pipeline import records, value_key
from pmaptap._trace import primitive


def _byte_files(tap_path: str) -> list[str]:
    d = tap_path + ".bytes"
    return [os.path.join(d, n) for n in os.listdir(d)] if os.path.isdir(d) else []


def _stored(tap_path: str) -> int:
    return sum(os.path.getsize(p) for p in _byte_files(tap_path))


def test_callback_arrays_are_kept_as_xla_hands_them_never_copied_again(
    monkeypatch, session, tap_path
):
    # XLA's python callback hands NumPy arrays that already hold their own
    # copy of the device's buffer (its wrapper copies a buffer it cannot
    # give an owner; a GPU's transfer buffer comes with one): the one copy.
    # pmaptap keeps them: plain jit on one device (the whole value) and on a
    # 4x2 mesh (one call per shard) alike.
    seen = []
    real = primitive.host_copy

    def spy(a):
        out = real(a)
        seen.append((a.flags.owndata or a.base is not None, out is a))
        return out

    monkeypatch.setattr(primitive, "host_copy", spy)
    jax.jit(lambda v: pmaptap.tap(v * 2, "whole"))(jnp.arange(4096.0))
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    x = jax.device_put(jnp.ones((128, 64)), NamedSharding(mesh, P("data", "model")))
    jax.jit(lambda v: pmaptap.tap(v * 3, "shards", dedup="per_device"))(x)
    session.flush()
    assert len(seen) >= 3 + 8 * 4, seen  # coords, step, leaf (+ partition)
    assert all(owned and kept for owned, kept in seen), seen
    by = {r["name"]: r for r in pmaptap.read(tap_path) if r["name"] == "whole"}
    assert np.array_equal(by["whole"]["value"], np.arange(4096.0, dtype=np.float32) * 2)
    assert np.array_equal(pmaptap.assemble(tap_path, "shards", 0), np.full((128, 64), 3.0))
    # Should a JAX hand over a view it does not own (no owner, valid only
    # during the call), that one is copied.
    backing = np.arange(6.0)

    class Borrowed:
        base = None
        flags = type("Flags", (), {"owndata": False})()

        def __array__(self, dtype=None, copy=None):
            return backing.copy() if copy else backing  # a view unless asked

    got = real(Borrowed())
    assert isinstance(got, np.ndarray) and got.flags.owndata
    assert np.array_equal(got, backing) and not np.shares_memory(got, backing)


def test_writer_starts_on_stored_bytes_without_waiting_its_linger(tap_path):
    # An hour's linger: lines wait for it, stored bytes (at least
    # LINGER_BYTES of them) do not.
    n = (queue_mod.LINGER_BYTES // 4) * 2  # float32: twice LINGER_BYTES
    with pmaptap.Session(tap_path, flush_interval=3600.0) as s:
        f = jax.jit(lambda v: pmaptap.tap(v + 1, "act"))
        f(jnp.zeros(n, jnp.float32)).block_until_ready()
        jax.effects_barrier()
        wait_for(lambda: _stored(tap_path) >= 4 * n, 30, "the bytes of one step on disk")
        # ...and their line with them (written in the same batch), no flush.
        wait_for(lambda: os.path.getsize(tap_path) > 0, 30, "the stored value's line")
        # A scalar tap's line still waits for the linger (or a flush).
        jax.jit(lambda v: pmaptap.tap(v, "loss"))(jnp.float32(3))
        jax.effects_barrier()
        time.sleep(0.5)
        assert [r["name"] for r in pmaptap.read(tap_path)] == ["act"]
        s.flush()
    assert [r["name"] for r in pmaptap.read(tap_path)] == ["act", "loss"]


def test_npy_header_is_made_once_per_tap_site_and_partition(monkeypatch, session, tap_path):
    made = []
    real = records.npy_header

    def counting(dtype, shape):
        made.append((dtype, shape))
        return real(dtype, shape)

    monkeypatch.setattr(records, "npy_header", counting)
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    x = jax.device_put(jnp.ones((128, 64), jnp.float32), NamedSharding(mesh, P("data", "model")))
    f = jax.jit(lambda v, i: pmaptap.tap(v * i, "act", dedup="per_device"))
    for i in range(5):
        f(x, i)
    session.flush()
    # 8 partitions, 5 steps: one header each partition, not one per shard.
    assert len(made) == 8 and set(made) == {(np.dtype(np.float32), (32, 32))}, made
    recs = [r for r in pmaptap.read(tap_path) if r["name"] == "act"]
    assert len(recs) == 40
    for step in range(5):
        assert np.array_equal(pmaptap.assemble(tap_path, "act", step), np.full((128, 64), step))


def test_value_key_hashes_a_big_leaf_in_place():
    # Copies of a replicated value are compared by this key: for an 8 MiB
    # leaf it holds a digest read from the array's own buffer, never a
    # copy of its bytes.
    a = np.arange(2 << 20, dtype=np.float32)
    tracemalloc.start()
    try:
        key = value_key([a])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 10, peak
    b = a.copy()
    assert value_key([b]) == key
    b[12345] = -1.0
    assert value_key([b]) != key
    # dtype and shape are part of the identity, as for small leaves.
    assert value_key([a.view(np.int32)]) != key
    assert value_key([a.reshape(2, -1)]) != key
    small = np.arange(8, dtype=np.float32)
    assert value_key([small]).endswith(small.tobytes())


def test_replicated_shards_still_compare_and_dedup_by_value(session, tap_path):
    # Replicated along "model": each slice has two holders, compared on the
    # host by value_key (digests now); one record per slice, and a slice
    # whose copies differ is flagged.
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    x = jax.device_put(
        jnp.arange(128 * 64, dtype=jnp.float32).reshape(128, 64),
        NamedSharding(mesh, P("data", None)),
    )
    jax.jit(lambda v: pmaptap.tap(v, "rep", dedup="replicated"))(x)
    session.flush()
    recs = [r for r in pmaptap.read(tap_path) if r["name"] == "rep"]
    assert len(recs) == 4 and all(r["replicas"] == 2 and not r.get("divergent") for r in recs)
    assert len({r["vhash"] for r in recs}) == 4
    assert np.array_equal(
        pmaptap.assemble(tap_path, "rep", 0), np.arange(128 * 64).reshape(128, 64)
    )


def test_queue_bound_is_said_once_and_block_waits_only_past_it(tap_path, caplog):
    # 10 arrays of 1 MiB against max_pending_bytes=3 MiB while another
    # process holds the file lock: under "block" the taps wait once the
    # bound is met (and pmaptap says so, once), and every one is written
    # when the lock comes back. Nothing is dropped.
    # Not thread-local: released from the thread below (a jit on one device
    # runs its callback, blocked here, on the main thread).
    lock = filelock.FileLock(tap_path + ".lock", thread_local=False)
    os.makedirs(os.path.dirname(tap_path), exist_ok=True)
    lock.acquire()
    released = threading.Event()

    def release_when_said():
        deadline = time.monotonic() + 60
        while "queue's bound" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # the taps keep waiting meanwhile
        released.set()
        lock.release()

    with logs_warning(caplog, r"queue's bound \(max_pending_bytes=3145728\)", count=1):
        with pmaptap.Session(
            tap_path, overflow="block", max_pending_bytes=3 << 20, lock_timeout=0.05
        ) as s:
            t = threading.Thread(target=release_when_said)
            t.start()
            f = jax.jit(lambda v, i: pmaptap.tap(v + i, "big", step=i))
            for i in range(10):
                f(jnp.zeros(1 << 18, jnp.float32), i)  # 1 MiB
            jax.effects_barrier()
            # The last taps could only be admitted once the writer had room.
            assert released.is_set()
            s.flush()
            t.join()
        assert "taps now wait for the writer" in caplog.text
    recs = pmaptap.read(tap_path)
    assert sorted(r["step"] for r in recs if r["name"] == "big") == list(range(10))
    assert not [r for r in recs if r["name"] == "pmaptap/dropped"]
