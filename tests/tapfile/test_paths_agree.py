"""Cases where the ways of reading one run disagreed (found by a
differential fuzzing campaign: summary and validate with --jobs 1, 2, 3;
shard by shard and the merged stream; a sharded run and its ``pmaptap
merge``; ``read()`` and ``read(as_frame=True)``): each now gives the
answer of the definition, the merged stream."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from test_jobs import _cli, _dump

import pmaptap
from conftest import per_device_dict, record_dict
from pmaptap.tapfile.analyze import parallel as jobs
from pmaptap.tapfile.read.views import format_ids
from pmaptap.tapfile.source import run as runs
from pmaptap.writer import Writer


def _loss(process: int, time: float, **fields) -> dict:
    return record_dict(name="loss", value=1.5, vhash="aa", process=process, time=time, **fields)


def _write(path: str, lines: list[dict]) -> None:
    with open(path, "wb") as f:
        f.write(b"".join(_dump(d) + b"\n" for d in lines))


def _sharded(tmp_path, shared: list[dict], shards: dict[int, list[dict]]) -> str:
    path = str(tmp_path / "run.jsonl")
    os.makedirs(path + ".d")
    if shared:
        _write(path, shared)
    for p, lines in shards.items():
        _write(runs.shard_path(path, p), lines)
    return path


def _as_merged(capsys, path: str, tmp_path) -> str:
    one = str(tmp_path / "one.jsonl")
    code, _, err = _cli(capsys, "merge", path, "-o", one)
    assert code == 0, err
    return one


def _table(out: str) -> str:
    """A summary's output less its first line (which names the file)."""
    return out.split("\n", 1)[1]


def test_a_run_dir_spelled_with_a_slash_or_dot_keeps_its_shared_file(tmp_path, capsys):
    path = _sharded(tmp_path, [_loss(0, 1.0)], {0: [_loss(0, 5.0)], 1: [_loss(1, 3.0)]})
    want = _cli(capsys, "summary", path + ".d")
    assert "2 records" in want[1], want
    before = open(path, "rb").read()
    for spelled in (os.sep, os.sep + ".", os.sep + "." + os.sep):
        run = path + ".d" + spelled
        assert _cli(capsys, "summary", run)[1:] == want[1:], spelled
        assert len(pmaptap.read(run)) == len(pmaptap.read(path)) == 2
        code, _, err = _cli(capsys, "merge", run, "-o", path)
        assert code == 2 and "one of the files of run" in err, err
        code, _, err = _cli(capsys, "merge", run, "-o", runs.shard_path(path, 9))
        assert code == 2 and "shard directory" in err, err
    assert open(path, "rb").read() == before


def test_every_copy_of_the_first_process_is_kept_when_its_copies_are_in_two_sources(
    tmp_path, capsys
):
    """The merge keeps every copy of the process whose copy comes first, and
    drops the others'. Process 1's copies are in the shared file (time 4)
    and its shard (time 1, the first): both are kept, though process 5's
    copy (time 3) is read before the shard is."""
    path = _sharded(tmp_path, [_loss(5, 3.0), _loss(1, 4.0)], {1: [_loss(1, 1.0)]})
    one = _as_merged(capsys, path, tmp_path)
    assert [r["process"] for r in pmaptap.read(path)] == [1, 1]
    want_summary = _cli(capsys, "summary", one)
    want_validate = _cli(capsys, "validate", one)
    assert "2 records" in want_summary[1] and "duplicate of line 1" in want_validate[1]
    for n in ("1", "2"):
        code, out, _ = _cli(capsys, "summary", path, "--jobs", n)
        assert (code, _table(out)) == (want_summary[0], _table(want_summary[1])), n
        code, out, _ = _cli(capsys, "validate", path, "--jobs", n)
        assert code == 1 and "duplicate of line 1" in out, (n, out)


def test_copies_read_by_two_workers_are_kept_as_the_merge_keeps_them(tmp_path, capsys):
    """Process 0's copies: the shared file's (time 1, the first) and its
    shard's (time 5); process 1's (time 3) in between. With --jobs 2 the
    shared file and each shard are pieces of their own (states read apart,
    taken in by the parent)."""
    shared = [_loss(0, 1.0, pad="x" * 400)]  # the bytes of a worker's share
    path = _sharded(tmp_path, shared, {0: [_loss(0, 5.0)], 1: [_loss(1, 3.0)]})
    want = [_cli(capsys, cmd, path, "--jobs", "1") for cmd in ("summary", "validate")]
    assert "2 records" in want[0][1] and "duplicate of line 1" in want[1][1], want
    assert jobs.plan(path, 2).pieces == [[0], [1], [2]]
    assert [_cli(capsys, cmd, path, "--jobs", "2") for cmd in ("summary", "validate")] == want


def test_an_id_written_as_int_and_float_in_two_shards_is_shown_as_the_merge_has_it(
    tmp_path, capsys
):
    """Device 3.0 (time 1) comes first in the merge, device 3 (time 5) is
    read first shard by shard: the summary shows the merge's."""
    path = _sharded(
        tmp_path,
        [per_device_dict(0, 3, 1.5, process=1, time=5.0)],
        {1: [per_device_dict(0, 3.0, 1.5, process=1, time=1.0, coords={"dp": 3})]},
    )
    one = _as_merged(capsys, path, tmp_path)
    want = _table(_cli(capsys, "summary", one)[1])
    assert "3.0" in want, want
    for n in ("1", "2"):
        assert _table(_cli(capsys, "summary", path, "--jobs", n)[1]) == want, n


def test_validate_in_byte_ranges_names_a_duplicate_by_its_own_line(tmp_path, capsys):
    """Line 2's device 1.0 opens the key in the second range, line 3's
    device 1 repeats line 1: it is described by its own id."""
    path = str(tmp_path / "t.jsonl")
    _write(
        path,
        [
            per_device_dict(5, 1, 1.5, name="loss", pad="x" * 400),
            per_device_dict(3, 1.0, 1.5, name="loss", time=2.0, coords={"dp": 1}),
            per_device_dict(5, 1, 1.5, name="loss", time=3.0),
        ],
    )
    pieces = jobs.plan(path, 2)
    assert pieces is not None and len(pieces.pieces) == 2
    want = _cli(capsys, "validate", path, "--jobs", "1")
    assert "duplicate of line 1 (per_device 'loss' step 5 device 1)" in want[1], want
    assert _cli(capsys, "validate", path, "--jobs", "2") == want


def test_a_zero_min_and_max_have_no_sign_whatever_the_order(tmp_path, capsys):
    path = _sharded(
        tmp_path,
        [],
        {
            0: [per_device_dict(0, 0, -0.0, process=0, time=5.0)],
            1: [per_device_dict(0, 1, 0.0, process=1, time=1.0)],
        },
    )
    one = _as_merged(capsys, path, tmp_path)
    want = _table(_cli(capsys, "summary", one)[1])
    row = want.splitlines()[1].split()
    assert row[7:9] == ["0", "0"], want  # min, max
    for n in ("1", "2"):
        assert _table(_cli(capsys, "summary", path, "--jobs", n)[1]) == want, n


def test_a_frame_holds_a_step_past_int64_and_an_empty_pass_as_read(tmp_path):
    path = str(tmp_path / "t.jsonl")
    _write(
        path,
        [
            per_device_dict(2**63, 0, 1.5),
            per_device_dict(1, 0, 1.5, **{"pass": ""}),
            per_device_dict(1, 0, 1.5),
        ],
    )
    records = pmaptap.read(path)
    frame = pmaptap.read(path, as_frame=True)
    assert frame["step"].tolist() == [r["step"] for r in records] == [2**63, 1, 1]
    assert frame["pass"].tolist() == ["forward", "", "forward"]


def test_ids_of_other_types_are_shown_not_dropped():
    assert format_ids([0, 1, 2, 5, None]) == "0-2,5,?"
    assert format_ids([1, 0, 3.0, "d", True, None]) == '0-1,3.0,"d",true,?'
    assert format_ids([]) == "-"


def _divergent_everywhere(capsys, path: str, steps: str) -> None:
    """Every way of reading ``path`` calls replicated ``eval_loss`` divergent
    at ``steps`` (summary's text, e.g. "1 step(s) (0)") and nowhere else."""
    recs = [r for r in pmaptap.read(path) if r["name"] == "eval_loss"]
    div_recs = [r for r in recs if r.get("divergent")]
    div = {r["step"] for r in div_recs}
    assert div == {0}, recs
    frame = pmaptap.read(path, as_frame=True)
    assert set(frame[frame["divergent"].fillna(False).astype(bool)]["step"]) == {0}
    for n in ("1", "2", "3"):
        code, out, err = _cli(capsys, "summary", path, "--jobs", n)
        row = next(line for line in out.splitlines() if line.startswith("eval_loss"))
        assert code == 0 and f"divergent at {steps}" in row, (n, out, err)
        code, out, err = _cli(capsys, "validate", path, "--jobs", n)
        assert "1 divergent replicated step(s)" in out, (n, out, err)
    code, out, _ = _cli(capsys, "show", path, "--name", "eval_loss")
    assert code == 0 and out.count("DIVERGENT") == len(div_recs) == 2, out


def test_two_values_of_one_replicated_step_from_one_process_are_divergent(tmp_path, capsys):
    """docs/api.md: any replicated key with more than one distinct value is
    divergent on reading. Readers compared only different processes'
    copies, so two values of ``eval_loss`` step 0 from process 0 (an
    evaluation worker started twice on one run, without resume) passed as
    fine: read() left both unmarked, validate said OK, summary showed no
    issue. The same value written twice stays one story."""
    cases = {
        "file": ("file", "file"),
        "sharded": ("sharded", "sharded"),
        "both": ("file", "sharded"),
    }
    for label, layouts in cases.items():
        path = str(tmp_path / f"{label}.jsonl")
        for value, layout in zip((1.0, 2.0), layouts):
            with Writer(path, run="exp", process=0, layout=layout) as w:
                w.write("eval_loss", 0, value)
                w.write("eval_loss", 1, 0.5)  # the same value both times: no issue
        # Another process, so a sharded run has two shards and --jobs 2 and 3
        # read its sources (a one-file run its byte ranges) in workers.
        with Writer(path, run="exp", process=1, layout=layouts[1]) as w:
            w.write("lr", 0, 0.1)
        _divergent_everywhere(capsys, path, "1 step(s) (0)")


def test_two_sessions_on_one_run_are_divergent_a_resumed_one_supersedes(tmp_path, capsys):
    """A session of one process on run "exp" taps ``eval_loss`` step 0 as
    1.0, then one more process writes 2.0 for it: two values of one step,
    divergent. (A second plain session on "exp" is refused at open, since
    the file ends with that run: test_resume.py.) A session with
    ``resume=True`` is a later attempt instead: its 2.0 supersedes the 1.0,
    and no reader calls either divergent."""
    f = jax.pmap(lambda v: pmaptap.tap(v, "eval_loss", step=0, dedup="replicated"))
    twice, resumed = str(tmp_path / "twice.jsonl"), str(tmp_path / "resumed.jsonl")
    for path in (twice, resumed):
        with pmaptap.Session(path, run="exp"):
            f(jnp.full(8, 1.0))
    with pmaptap.Writer(twice, run="exp", process=0) as w:
        w.write("eval_loss", 0, 2.0)
    with pmaptap.Session(resumed, run="exp", resume=True):
        f(jnp.full(8, 2.0))
    _divergent_everywhere(capsys, twice, "1 step(s) (0)")
    recs = pmaptap.read(resumed, name="eval_loss")
    assert [(r["value"], r.get("divergent")) for r in recs] == [(2.0, None)], recs
    every = pmaptap.read(resumed, name="eval_loss", attempts="all")
    assert [(r["attempt"], r["value"], r.get("divergent")) for r in every] == [
        (0, 1.0, None),
        (1, 2.0, None),
    ]
    for n in ("1", "2"):
        for cmd in ("summary", "validate"):
            code, out, _ = _cli(capsys, cmd, resumed, "--jobs", n)
            assert code == 0 and "divergent" not in out, (cmd, n, out)
