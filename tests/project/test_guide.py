"""docs/guide.md's training script runs as written (8 CPU devices, a
subprocess) and writes the records the guide promises; its reading
snippet runs on that file."""

from __future__ import annotations

import os
import re

import pmaptap
from conftest import ROOT, cli, run_python


def _blocks() -> list[str]:
    with open(os.path.join(ROOT, "docs", "guide.md"), encoding="utf-8") as f:
        return re.findall(r"```python\n(.*?)```", f.read(), re.S)


def test_the_guides_training_script_writes_what_it_promises(tmp_path):
    script, reading = _blocks()
    path = str(tmp_path / "guide.jsonl")
    proc = run_python(script.replace('"out/guide.jsonl"', repr(path)), devices=8, timeout=600)
    assert re.search(r"^run \S+ final loss [0-9.]+$", proc.stdout, re.M), proc.stdout
    names, values = re.search(r"^(LAYERS, .*) = (.*)$", script, re.M).groups()
    sizes = dict(zip(names.split(", "), map(int, values.split(", "))))
    steps, layers, every = sizes["STEPS"], sizes["LAYERS"], sizes["FINGERPRINT_EVERY"]

    loss = pmaptap.read(path, name="loss")
    assert [r["step"] for r in loss] == list(range(steps))
    assert all(r["kind"] == "replicated" and r["devices"] == list(range(8)) for r in loss)
    assert not any(r.get("divergent") for r in loss)

    fps = pmaptap.read(path, name="params")
    assert [r["step"] for r in fps] == list(range(0, steps, every))
    assert all(r["kind"] == "fingerprint" and r["replicas"] == 8 for r in fps)
    assert not any(r.get("divergent") for r in fps)

    act = pmaptap.read(path, name="act")
    assert len(act) == steps * layers
    assert all(set(r["value"]) == {"absmax", "mean"} for r in act)
    assert all(0 < r["value"]["absmax"] <= 1 for r in act)  # tanh
    # One record per layer and step, told apart by the loop iteration (was:
    # the layers' values of a step taken for copies that disagree).
    assert not any(r.get("divergent") for r in act)
    assert sorted(r["iteration"] for r in act if r["step"] == 0) == [[i] for i in range(layers)]

    out = cli("summary", path)
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines()[2:] if line.strip()]
    assert [r[0] for r in rows] == [
        *(f"act/{leaf}[{i}]" for leaf in ("absmax", "mean") for i in range(layers)),
        "loss",
        "params",
    ]
    assert all(r[-1] == "-" for r in rows), out.stdout  # no issues

    proc = run_python(reading.replace('"out/guide.jsonl"', repr(path)), devices=1)
    assert proc.stdout.startswith(f"{steps} losses; last step, layer by layer: [{{'absmax'")
