"""A value's identity in a tap file is ``format.record_key`` (run, name,
step, pass, shard index, attempt); the keys readers build from parts of it
(a step of a tap, a key less its step) come from format.py too."""

from __future__ import annotations

import json

from pmaptap.tapfile.divergence import DivergenceIndex
from pmaptap.tapfile.format import (
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
        # map that summary_batch.py reaches through steps_of.
        index = DivergenceIndex()
        index.add(dict(d, kind="replicated", vhash="h", process=0))
        assert index.steps_of(*rest) == {step: ("h", 0)}
        index.add(dict(d, kind="replicated", vhash="g", process=1))
        assert list(index.divergent_keys()) == [key]
    rec = new_record(
        run="r",
        name="a",
        step=5,
        kind="replicated",
        value=1,
        dtype="int32",
        shape=[],
        process=0,
        time=0.0,
        host="h",
        index=[[0, 2]],
        attempt=3,
    )
    assert record_key(rec) == record_key(json.loads(rec.encode()))
    assert record_key(Record.from_template(rec.template(), 6, 2, "int32", [], 1.0))[2] == 6
