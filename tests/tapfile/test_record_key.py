"""A value's identity in a tap file is ``format.record_key`` (run, name,
step, pass, shard index, attempt); the keys readers build from parts of it
(a step of a tap, a key less its step) come from format.py too, and every
reader tells the values of one step apart as record_key does."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pmaptap
from conftest import record_dict
from pmaptap.tapfile.analyze.summary import summarize_file
from pmaptap.tapfile.analyze.validate import validate_file
from pmaptap.tapfile.read.divergence import DivergenceIndex
from pmaptap.tapfile.record import (
    Record,
    key_with_step,
    new_record,
    record_key,
    split_step,
    step_key,
)

RECORDS = [
    {"run": "r", "name": "a", "step": 3},
    {"run": "r", "name": "a", "step": 3, "pass": "backward"},
    {"run": "r", "name": "a", "step": 2**63 - 1, "attempt": 2},
    {"run": "q", "name": "b/c", "step": 0, "index": [[0, 2], [4, 8]], "attempt": 1},
    {"run": "q", "name": "b", "step": 7, "index": [[[0, 2]], [[2, 4]]], "pass": "backward"},
]


def test_the_parts_of_record_key_are_its_own():
    for d in RECORDS:
        key = record_key(d)
        assert step_key(d) == key[:4] == (d["run"], d["name"], d["step"], d.get("pass", "forward"))
        rest, step = split_step(key)
        assert step == d["step"]
        assert key_with_step(rest, step) == key
        # DivergenceIndex keeps a key's steps under split_step's rest, the
        # map steps_of gives.
        index = DivergenceIndex()
        index.add(dict(d, kind="replicated", vhash="h", process=0))
        assert index.steps_of(*rest) == {step: "h"}
        index.add(dict(d, kind="replicated", vhash="g", process=1))
        assert list(index.divergent_keys()) == [key]
    rec = new_record(**record_dict(step=5, index=[[0, 2]], attempt=3))
    assert record_key(rec) == record_key(json.loads(rec.encode()))
    assert record_key(Record.from_template(rec.template(), 6, 2, "int32", [], 1.0))[2] == 6


def test_summary_tells_equal_shards_of_a_replicated_value_apart(session, tap_path):
    # A weight sharded over "dp" and replicated over "mp", equal in every
    # shard (ones, as initialised): each step writes one replicated record
    # per shard, all with the same value hash. They are four values
    # (record_key holds the index), not one value and three duplicates,
    # which `pmaptap summary` reported (its per-tap key had no index).
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("dp", "mp"))

    @jax.jit
    def step(x):
        pmaptap.tap(x, "w", dedup="replicated")
        return x * 2

    x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("dp")))
    for _ in range(2):
        step(x).block_until_ready()
    session.close()
    recs = pmaptap.read(tap_path)
    assert len(recs) == 8 and len({r["vhash"] for r in recs}) == 1
    assert len({record_key(r) for r in recs}) == 8
    assert validate_file(tap_path).problems == []
    (s,), bad, _, _ = summarize_file(tap_path)
    assert bad == [] and s.records == 8 and s.duplicates == 0
    assert s.divergent_steps == ()


def test_summary_finds_a_divergent_shard_as_read_does(tmp_path):
    # Two processes wrote shard [0, 2) of step 1 with different values:
    # read() marks that step divergent, and so must `pmaptap summary`.
    def line(step, proc, vhash, index):
        return json.dumps(
            {
                "run": "r",
                "name": "x",
                "step": step,
                "kind": "replicated",
                "value": [1.0, 1.0],
                "dtype": "float32",
                "shape": [2],
                "process": proc,
                "time": 0,
                "host": "h",
                "replicas": 2,
                "devices": [0, 1],
                "processes": [0, 1],
                "vhash": vhash,
                "index": [index],
                "global_shape": [4],
            }
        )

    path = tmp_path / "t.jsonl"
    lines = [line(0, 0, "a", [0, 2]), line(0, 0, "a", [2, 4])]
    lines += [line(1, 0, "a", [0, 2]), line(1, 1, "b", [0, 2]), line(1, 0, "a", [2, 4])]
    path.write_text("\n".join(lines) + "\n")
    assert [r["step"] for r in pmaptap.read(path) if r.get("divergent")] == [1, 1]
    (s,), bad, _, _ = summarize_file(path)
    assert bad == [] and s.divergent_steps == (1,) and s.duplicates == 0


def test_summary_of_all_attempts_calls_no_replay_a_duplicate(tmp_path):
    """``pmaptap summary --all-attempts`` of a resumed run: a later attempt's
    replay of a step is not a duplicate of the step it superseded (attempt
    is part of record_key, as validate keys it), while the same record twice
    within one attempt still is (before: every replayed step counted as a
    duplicate, per-device and replicated alike, where validate said OK)."""
    from pmaptap.tapfile.read.query import Filter

    path = tmp_path / "resumed.jsonl"
    lines = []
    for attempt in (0, 1):
        for step in (0, 1):
            extra = {"attempt": attempt} if attempt else {}
            lines.append(record_dict(name="loss", step=step, vhash="ab" * 8, **extra))
            lines.append(
                record_dict(name="g", step=step, kind="per_device", device=0, coords={}, **extra)
            )
    path.write_text("".join(json.dumps(d) + "\n" for d in lines))
    summaries, bad, _, _ = summarize_file(path, Filter(all_attempts=True))
    assert not bad and {s.name: (s.records, s.duplicates) for s in summaries} == {
        "loss": (4, 0),
        "g": (4, 0),
    }
    report = validate_file(path)
    assert report.ok and report.superseded == 4
    # The same replay twice is a duplicate, in summary as in validate.
    with path.open("a") as f:
        f.write(json.dumps(lines[-1]) + "\n" + json.dumps(lines[-2]) + "\n")
    summaries, _, _, _ = summarize_file(path, Filter(all_attempts=True))
    assert {s.name: s.duplicates for s in summaries} == {"loss": 1, "g": 1}
    assert sum("duplicate of line" in why for _, why in validate_file(path).problems) == 2
