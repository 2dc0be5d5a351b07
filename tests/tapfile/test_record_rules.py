"""One definition of a record: tapfile/record/schema.py's Structs (the format)
and what readers take (schema.READERS_TAKE, validate_dict). These tests
derive from the Structs' own field types a record breaking each field's
type, for every kind that has the field, and check every reader on it:
the Structs refuse it; a record readers take is still read (parse_line,
the summary, validate's count) and validate names the field's problem; a
record readers do not take is a bad line everywhere, named by its field.
And records satisfying every rule pass them all, taken by the Structs."""

from __future__ import annotations

import dataclasses
import json

import msgspec
import pytest

from conftest import per_device_dict, record_dict, replicated_dict
from pmaptap.tapfile import record as fmt
from pmaptap.tapfile.analyze.summary import summarize_file
from pmaptap.tapfile.analyze.validate import schema_problems, validate_file
from pmaptap.tapfile.record import parse, schema

# Records that satisfy every rule, one per kind.
BASE = {
    "replicated": replicated_dict(1, 0.5, replicas=2, devices=[0, 1], processes=[0]),
    "per_device": per_device_dict(1, 1, 0.5),
    "meta": record_dict(kind="meta", name=fmt.META_DROPPED, step=1, dtype="int64", value=2),
    # pmaptap.fingerprint's (a divergent one: every field its kind has).
    "fingerprint": record_dict(
        kind="fingerprint",
        step=1,
        value=None,
        dtype=None,
        shape=None,
        fingerprint="0123456789abcdef",
        replicas=1,
        devices=[3],
        processes=[0],
        divergent=True,
        leaf="w",
        compared=8,
        holders=[{"device": 3, "process": 0, "host": "h", "coords": {"i": 3}}],
    ),
}


# Values of every JSON type, some of each field's forms (ids, ranges text,
# index pairs, coordinates); which of them a rule takes is the types' say.
SAMPLES = [
    None,
    True,
    False,
    0,
    -1,
    1,
    7,
    2**63,
    1.5,
    "",
    "x",
    "0-3",
    "3-1",
    *fmt.KINDS,
    [],
    [0, 1],
    [None],
    [1.5],
    ["a"],
    [[0, 1]],
    [[0, 1], [2]],
    [[[0, 1]]],
    {},
    {"dp": 1},
    {"dp": "a"},
    "0123456789abcdef",  # a fingerprint
    [{"device": 1}],  # a fingerprint record's holders
]
_GONE = object()  # the field removed
# Fields whose value the rules beyond types (or a stored value's rules)
# judge with the rest of the record: their samples are left to those.
_WHOLE = {"value", "dtype", "shape", "bytes"}


def _with(kind: str, field: str, value) -> dict:
    d = dict(BASE[kind])
    if value is _GONE:
        d.pop(field, None)
    else:
        d[field] = value
    return d


def _line(d: dict) -> bytes:
    return json.dumps(d, separators=(",", ":")).encode()


def _takes(tp, value) -> bool:
    try:
        msgspec.convert(value, tp)
    except msgspec.ValidationError:
        return False
    return True


def _cases():
    """(kind, json name, value, the format takes it, readers take it)."""
    for kind, cls in schema.CLASSES.items():
        loose = {f.encode_name: f.type for f in msgspec.structs.fields(schema._LOOSE[kind])}
        for f in msgspec.structs.fields(cls):
            if f.encode_name in _WHOLE:
                continue
            for value in SAMPLES:
                d = _with(kind, f.encode_name, value)
                strict = _takes(f.type, value) and not schema.beyond_types(
                    schema.from_dict(d), readers=True
                )
                readers = _takes(loose[f.encode_name], value) and not schema.beyond_types(
                    schema.from_dict(d), readers=True
                )
                yield kind, f.encode_name, value, strict, readers
            if f.required:
                yield kind, f.encode_name, _GONE, False, False


CASES = list(_cases())


def test_required_fields_are_the_writers_record_type_s():
    # The fields the writers' Record type requires (those without a
    # default), in its order, which is the order a line holds them.
    assert schema.REQUIRED == tuple(
        f.name for f in dataclasses.fields(fmt.Record) if f.default is dataclasses.MISSING
    )
    assert schema.REQUIRED_BY_KIND["per_device"][len(schema.REQUIRED) :] == ("device", "coords")
    assert schema.REQUIRED_BY_KIND["replicated"][len(schema.REQUIRED) :] == ("replicas",)
    assert schema.REQUIRED_BY_KIND["meta"] == schema.REQUIRED


def test_records_satisfying_every_rule_pass_every_check(tmp_path):
    for kind, d in BASE.items():
        r = schema.DECODER.decode(_line(d))
        assert type(r) is schema.CLASSES[kind] and not r.odd, kind
        # Its fields: kind first, then in the order writers write them.
        assert schema.as_dict(r) == d, kind
        assert list(schema.as_dict(r)) == ["kind"] + [f[0] for f in schema.FIELDS if f[0] in d]
        assert schema.validate_dict(d) is None, kind
        assert parse.parse_line(_line(d)) == (d, None)
        assert schema_problems(d) == [], kind
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"".join(_line(d) + b"\n" for d in BASE.values()))
    assert validate_file(path).ok
    assert summarize_file(path)[1] == []


def test_the_samples_break_and_keep_each_rule():
    # Every field is broken by some sample, and for every field the
    # readers widen, some sample is a record readers take that breaks the
    # format.
    fields = {(k, n) for k, n, _, _, _ in CASES}
    broken = {(k, n) for k, n, _, strict, _ in CASES if not strict}
    assert broken == fields
    widened = {(k, n) for k, n, _, strict, readers in CASES if readers and not strict}
    assert {n for _, n in widened} >= {"process", "time", "host", "replicas", "device"}


@pytest.mark.parametrize("kind", fmt.KINDS)
def test_every_reader_judges_a_record_breaking_a_rule_by_the_types(kind, tmp_path):
    lines = []
    for k, name, value, strict, readers in CASES:
        if k != kind:
            continue
        d = _with(kind, name, value)
        line = _line(d)
        what = (kind, name, value)
        try:
            schema.DECODER.decode(line)
            decoded = True
        except msgspec.ValidationError:
            decoded = False
        got, problem = parse.parse_line(line)
        if strict:
            assert decoded and problem is None and got == d, what
            # Nothing but what the rules beyond the types say of the record
            # as a whole (one holder per replica, when replicas changes).
            assert schema_problems(d) == schema.beyond_types(schema.from_dict(d)), what
        elif readers:
            assert not decoded, what
            assert problem is None and got == d, what
            problems = schema_problems(d)
            assert problems and any(name in p for p in problems), (what, problems)
        else:
            assert not decoded and got is None, what
            assert problem.startswith("not a pmaptap record:"), (what, problem)
            assert name in problem or "without" in problem or "missing" in problem, (what, problem)
        lines.append((line, strict and not schema_problems(d), readers))
    # The same lines in a file: validate counts every record readers take
    # and names each line that breaks the format; summary skips the others.
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"".join(line + b"\n" for line, _, _ in lines))
    report = validate_file(path)
    assert report.records == sum(readers or clean for _, clean, readers in lines)
    flagged = {n for n, why in report.problems if not why.startswith("duplicate")}
    for n, (_, clean, _) in enumerate(lines, 1):
        assert (n in flagged) == (not clean), n
    _, bad, _, _ = summarize_file(path)
    assert [n for n, _ in bad] == [
        n for n, (_, clean, readers) in enumerate(lines, 1) if not (clean or readers)
    ]


def test_rules_beyond_types_are_named_by_validate():
    """One holder per replica, copies_seen at most replicas, a shard's
    global shape, the value against its dtype and shape: records readers
    take, whose problems validate names."""
    rep = BASE["replicated"]
    for d, text in [
        (dict(rep, devices=[0, 1, 2]), schema.FORMAT_PROBLEM["devices"]),
        (dict(rep, devices="0-40"), schema.FORMAT_PROBLEM["devices"]),
        (dict(rep, copies_seen=3), schema.FORMAT_PROBLEM["copies_seen"]),
        (dict(rep, global_shape=[[1], 2]), schema.FORMAT_PROBLEM["global_shape"]),
        (dict(rep, shape=[2]), "does not match shape"),
        (dict(rep, value="x"), "does not fit dtype"),
    ]:
        assert schema.validate_dict(d) is None, d
        r = parse.decode_line(_line(d))[0]
        assert r is not None and not r.odd, d
        assert any(text in p for p in schema_problems(d)), (d, schema_problems(d))


def test_strict_rules_apply_only_to_their_kinds():
    # A per-device record's "replicas" is no field of its kind: the format
    # says nothing of it (a newer writer's field, kept).
    d = _with("per_device", "replicas", 0)
    assert schema.validate_dict(d) is None
    assert schema_problems(d) == []
    assert parse.parse_line(_line(d))[0] == d
    d = _with("replicated", "device", "x")
    assert schema.validate_dict(d) is None
    assert schema_problems(d) == []


def test_fields_a_newer_writer_adds_are_kept_and_no_error(tmp_path):
    """Forward compatibility: a field no Struct declares (a newer writer's,
    or a meta record's counters) is kept as written, in every reader, and
    is no problem."""
    import pmaptap

    d = dict(BASE["per_device"], future={"a": [1, 2]}, weight=0.5)
    meta = dict(BASE["meta"], dropped_total=7)
    path = tmp_path / "t.jsonl"
    path.write_bytes(_line(d) + b"\n" + _line(meta) + b"\n")
    assert parse.parse_line(_line(d)) == (d, None)
    got = pmaptap.read(path)
    assert got[0]["future"] == {"a": [1, 2]} and got[0]["weight"] == 0.5
    assert got[1]["dropped_total"] == 7
    assert validate_file(path).ok
