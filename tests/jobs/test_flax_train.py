"""launch/flax_train.py, a real Flax NNX client (issue 26, point 6): data x
tensor parallel under plain jit, optax, taps in ``__call__``, ``tap_grad`` on
an activation, run by the launcher in 2 processes x 4 devices; it reads its
file back itself, and here the records are checked from outside."""

from __future__ import annotations

import numpy as np

import pmaptap
from conftest import job_failed, run_launch


def test_flax_train_two_processes_data_and_tensor_parallel(tmp_path):
    out = str(tmp_path / "flax.jsonl")
    cmd = ["python", "launch/flax_train.py", "--steps", "3", "--params-every", "2", "--out", out]
    proc, _ = run_launch(2, 4, cmd, timeout=300, launcher_timeout=240)
    assert proc.returncode == 0, job_failed(proc)
    assert "READBACK ok" in proc.stdout, proc.stdout
    recs = pmaptap.read(out)
    devices = sorted({r["device"] for r in recs if r["name"] == "h"})
    assert len(devices) == 8
    for name, pass_ in (("h", "forward"), ("dh", "backward")):
        for step in range(3):
            rs = [r for r in recs if r["name"] == name and r["step"] == step]
            assert sorted(r["device"] for r in rs) == devices, (name, step)
            # Each process wrote its own 4 devices' shards, once.
            assert sorted(r["process"] for r in rs) == [0] * 4 + [1] * 4
            assert all(r.get("pass", "forward") == pass_ for r in rs)
            cover = np.zeros((32, 32), int)  # (8 rows x 4 data slices, hidden 32)
            for r in rs:
                (a, b), (c, d) = r["index"]
                assert set(r["coords"]) == {"data", "model"}
                cover[a:b, c:d] += 1
            assert (cover == 1).all()  # the shards tile the global array
    loss = [r for r in recs if r["name"] == "loss"]
    assert [r["step"] for r in loss] == [0, 1, 2]
    for r in loss:
        assert r["processes"] == [0, 1] and sorted(r["devices"]) == devices
        assert r["replicas"] == 8 and r["copies_seen"] == 1
    params = [r for r in recs if r["name"] == "params"]
    # Steps 0 and 2; the "model" axis splits them in 2 slices, each held by
    # the 4 "data" devices of both processes, written once.
    assert sorted(r["step"] for r in params) == [0, 0, 2, 2]
    for r in params:
        assert set(r["value"]) == {"fc1", "fc2"}
        assert r["shape"]["fc1"]["kernel"] == {"value": [16, 16]}
        assert r["replicas"] == 4 and r["processes"] == [0, 1]
    from pmaptap import cli

    assert cli.main(["validate", out]) == 0
