"""The readers and pmaptap.fingerprint's records ("kind": "fingerprint",
written by hand here, as _host/pipeline/fingerprints.py writes them): the suspects
the summary names, validate's rules, the batched summary equal to the
reference, what forwarders, TensorBoard, plot and frames make of them."""

from __future__ import annotations

import json

import pytest

import pmaptap
from conftest import record_dict
from pmaptap._host.forward import scalar_series
from pmaptap.errors import PlotError
from pmaptap.tapfile.analyze.fingerprints import FingerprintAcc, divergence_series, suspects
from pmaptap.tapfile.analyze.summary import summarize_file, tap_summaries
from pmaptap.tapfile.analyze.validate import schema_problems, validate_file
from pmaptap.tapfile.export.plot import build_figure
from pmaptap.tapfile.record import validate_dict


def agree(step: int, devices=(0, 1, 2, 3), name: str = "params") -> dict:
    return record_dict(
        kind="fingerprint",
        name=name,
        step=step,
        value=None,
        dtype=None,
        shape=None,
        fingerprint=f"{step:016x}",
        replicas=len(devices),
        devices=list(devices),
        processes=[0],
        leaves=2,
        slices=2,
    )


def differ(step: int, devices, fp: str, *, compared=4, leaf="w", holders=True, **extra) -> dict:
    d = record_dict(
        kind="fingerprint",
        name=extra.pop("name", "params"),
        step=step,
        value=None,
        dtype=None,
        shape=None,
        fingerprint=fp,
        replicas=len(devices),
        devices=list(devices),
        processes=sorted({dev // 2048 for dev in devices}),
        divergent=True,
        leaf=leaf,
        compared=compared,
        **extra,
    )
    if holders:
        d["holders"] = [
            {"device": dev, "process": dev // 2048, "host": f"h{dev // 2048}", "coords": {"i": dev}}
            for dev in devices
        ]
    return d


def _write(path, records) -> str:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return str(path)


def test_the_suspect_is_the_copy_outside_the_majority(tmp_path):
    recs = [
        agree(0),
        differ(1, [0, 1, 3], "a" * 16),
        differ(1, [2], "b" * 16),
        differ(2, [0, 1, 3], "c" * 16),
        differ(2, [2], "d" * 16),
    ]
    (s,) = suspects(recs)[("r", "params")]
    assert (s.device, s.process, s.host, s.coords) == (2, 0, "h0", (("i", 2),))
    assert (s.first_step, s.leaf, s.steps, s.majority) == (1, "w", 2, True)
    path = _write(tmp_path / "r.jsonl", recs)
    (summary,) = summarize_file(path)[0]
    assert summary.fingerprint == (
        "fingerprints differ at 2 step(s) (1,2); first at step 1, leaf w: "
        "suspect device 2 (process 0, host h0, i=2) at 2 step(s)"
    )
    assert summary.divergent_steps == (1, 2)
    assert summary.kinds == ("fingerprint",) and summary.records == 5
    assert summary.devices == (0, 1, 2, 3) and summary.last == () and summary.min is None
    # The batched summary (pmaptap summary) equals the reference path.
    assert summarize_file(path)[0] == tap_summaries(pmaptap.read(path))
    report = validate_file(path)
    assert report.ok and report.divergent_fingerprints == 2, report.problems


def test_no_majority_and_a_slice_are_said(tmp_path):
    recs = [
        differ(5, [0], "a" * 16, compared=2, index=[[0, 4], [0, 8]]),
        differ(5, [1], "b" * 16, compared=2, index=[[0, 4], [0, 8]]),
    ]
    found = suspects(recs)[("r", "params")]
    assert [(s.device, s.majority, s.where) for s in found] == [
        (0, False, "0:4,0:8"),
        (1, False, "0:4,0:8"),
    ]
    acc = FingerprintAcc()
    for r in recs:
        acc.add(r)
    assert "copies disagree with no majority" in acc.text()
    assert "leaf w [0:4,0:8]" in acc.text()


def test_a_big_majority_without_holders_still_names_the_odd_one():
    # Past 16 holders a record lists devices only (ranges text).
    many = list(range(4095))
    recs = [
        differ(3, many, "a" * 16, compared=4096, holders=False),
        differ(3, [4095], "b" * 16, compared=4096),
    ]
    recs[0]["devices"] = "0-4094"
    (s,) = suspects(recs)[("r", "params")]
    assert s.device == 4095 and s.first_step == 3


@pytest.mark.parametrize(
    "field, value, problem",
    [
        ("fingerprint", "XYZ", "fingerprint must be 16 hexadecimal digits"),
        ("compared", 0, "compared must be an integer, at least replicas"),
        ("holders", [], "holders must list one object per replica"),
        ("leaf", 3, "leaf must be a string"),
        ("slice_coords", {"i": "a"}, "slice_coords must be an object"),
    ],
)
def test_validate_applies_the_kinds_rules(field, value, problem):
    d = differ(1, [2], "b" * 16)
    assert schema_problems(d) == []
    d[field] = value
    assert validate_dict(d) is None  # readers take it
    assert any(p.startswith(problem) for p in schema_problems(d)), schema_problems(d)


def test_readers_refuse_a_fingerprint_record_without_its_fields():
    d = agree(0)
    del d["fingerprint"]
    assert "fingerprint" in validate_dict(d)
    d = agree(0)
    d["fingerprint"] = 7
    assert validate_dict(d) == "fingerprint must be a string"


def test_forwarders_and_tensorboard_get_the_odd_copies_only():
    assert list(divergence_series(agree(0))) == []
    assert list(scalar_series(agree(0))) == []
    odd = differ(1, [2], "b" * 16)
    assert list(scalar_series(odd)) == [("params/w/divergent/device_2", 1.0)]
    bare = differ(1, [0, 1, 3], "a" * 16, leaf="")
    assert list(divergence_series(bare)) == [("params/divergent/device_0", 3.0)]


def test_tensorboard_export_writes_the_divergent_series(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from pmaptap.tapfile.export.tensorboard import export
    from pmaptap.tapfile.read.query import Filter

    recs = [agree(0), differ(1, [0, 1, 3], "a" * 16), differ(1, [2], "b" * 16)]
    path = _write(tmp_path / "r.jsonl", recs)
    out = tmp_path / "tb"
    export(path, str(out), Filter())
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert sorted(tags) == ["params/w/divergent/device_0", "params/w/divergent/device_2"]
    assert [(e.step, e.value) for e in acc.Scalars("params/w/divergent/device_2")] == [(1, 1.0)]


def test_plot_refuses_and_frames_keep_the_fingerprint(tmp_path):
    recs = [agree(0), differ(1, [2], "b" * 16)]
    with pytest.raises(PlotError, match="fingerprint"):
        build_figure(recs, "params")
    path = _write(tmp_path / "r.jsonl", recs)
    frame = pmaptap.read(path, as_frame=True)
    assert list(frame["fingerprint"]) == [f"{0:016x}", "b" * 16]
    assert list(frame["divergent"]) == [False, True]


def test_show_and_tail_print_the_fingerprint_not_none(tmp_path, capsys):
    # A fingerprint record's value is null: show's value column printed
    # "None" for every one of them.
    path = _write(tmp_path / "r.jsonl", [agree(0), differ(1, [2], "b" * 16)])
    for cmd in (["show", path], ["tail", "-n", "5", path]):
        assert pmaptap.cli.main(cmd) == 0
        out = capsys.readouterr().out
        assert "None" not in out
        assert f"{0:016x}" in out and f"leaf=w {'b' * 16}" in out
