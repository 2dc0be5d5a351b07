"""One definition of a record: format.RULES. validate_dict and
checks.schema_problems are made from the table; the fast checks are
hand-inlined copies of it (format.first_not_plain, checks._fields_clean,
summary_batch.BatchSummarizer._add_part). These tests derive from the table
a record breaking each rule, for every kind the rule applies to, and check
that every check refuses it, so that a copy cannot drift from the table; and
that records satisfying the table pass them all."""

from __future__ import annotations

import dataclasses
import json

import pytest

from conftest import per_device_dict, record_dict, replicated_dict
from pmaptap.tapfile import (
    _speedups,  # the C copies, whether readers use them or not
    parse,
)
from pmaptap.tapfile import format as fmt
from pmaptap.tapfile.checks import _fields_clean, schema_problems
from pmaptap.tapfile.summary_batch import BatchSummarizer

# Records that satisfy every rule of the table, reader's and format's, one
# per kind, each a usual record of summary's fast path.
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


def _plain(kind: str) -> bool:
    """Whether the fast checks take a plainly valid record of ``kind``
    (fingerprint records always take the full ones: format.UNPLAIN_KINDS)."""
    return kind not in fmt.UNPLAIN_KINDS


# Values of every JSON type, some of each field's forms (ids, ranges text,
# index pairs, coordinates); which of them a rule takes is the table's say.
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


def _name(rule: fmt.FieldRule) -> str:
    return rule.name


def _with(kind: str, field: str, value) -> dict:
    d = dict(BASE[kind])
    if value is _GONE:
        d.pop(field, None)
    else:
        d[field] = value
    return d


def _reader_cases(rule: fmt.FieldRule, accepted: bool) -> list[tuple[str, object]]:
    """(kind, value) for each kind whose records readers check ``rule``
    in (a required field in its kinds, an optional one in any) and each
    sample the rule takes (``accepted``) or refuses; a required field's
    absence counts as refused."""
    required = rule.required and rule.kinds != fmt.KINDS
    kinds = rule.kinds if required else fmt.KINDS
    values = [v for v in SAMPLES if rule.accepts(v) == accepted]
    if rule.required and not accepted:
        values.append(_GONE)
    return [(kind, v) for kind in kinds for v in values]


def _line(d: dict) -> bytes:
    return json.dumps(d, separators=(",", ":")).encode()


def _summary_refuses(d: dict, kind: str) -> bool:
    """Whether summary's fast path leaves ``d`` (an unchecked item, as
    ``pmaptap summary`` reads a file) to parse_line, which reports it: it
    follows a usual record of the same tap, device and coordinates, so
    only ``d``'s own fields decide."""
    first = dict(BASE[kind], step=0)
    items, lines = [first, d], [_line(first), _line(d)]
    bad: list = []
    BatchSummarizer().add_batch(items, lines, 1, bad)
    return [n for n, _ in bad] == [2]


def test_table_gives_the_required_fields_and_record_type():
    # The fields the Record type requires (those without a default), in
    # its order, which is the order a line holds them.
    assert fmt.REQUIRED == tuple(
        f.name for f in dataclasses.fields(fmt.Record) if f.default is dataclasses.MISSING
    )
    assert "run" in fmt.REQUIRED and "host" in fmt.REQUIRED and "pass" not in fmt.REQUIRED
    assert fmt.REQUIRED_BY_KIND["per_device"][len(fmt.REQUIRED) :] == ("device", "coords")
    assert fmt.REQUIRED_BY_KIND["replicated"][len(fmt.REQUIRED) :] == ("replicas",)
    assert fmt.REQUIRED_BY_KIND["meta"] == fmt.REQUIRED


def test_records_satisfying_the_table_pass_every_check():
    records = [d for kind, d in BASE.items() if _plain(kind)]
    assert fmt.first_not_plain(records) == len(records)
    for kind, d in BASE.items():
        assert fmt.validate_dict(d) is None, kind
        assert parse.parse_line(_line(d)) == (d, None)
        assert _fields_clean(d) == _plain(kind), kind
        assert fmt.first_not_plain([d]) == (1 if _plain(kind) else 0), kind
        assert schema_problems(d) == [], kind
        bad: list = []
        BatchSummarizer().add_batch([d], [_line(d)], 1, bad)
        assert bad == []


@pytest.mark.parametrize("rule", [r for r in fmt.RULES if r.types or r.ok or r.required], ids=_name)
def test_every_check_refuses_a_record_breaking_a_rule(rule):
    cases = _reader_cases(rule, accepted=False)
    assert cases, rule.name  # the samples break every rule that has one
    for kind, value in cases:
        d = _with(kind, rule.name, value)
        what = (kind, rule.name, value)
        problem = fmt.validate_dict(d)
        assert problem is not None, what
        assert fmt._record_problem(d) == problem, what
        if value is not _GONE and kind in fmt.KINDS and d["kind"] == kind:
            # The problem it names is this rule's (the record is
            # otherwise valid), or the record's kind lacks a field.
            assert problem == f"{rule.name} must be {rule.must}" or "without" in problem
        if _plain(kind):
            assert fmt.first_not_plain([BASE[kind], d, BASE[kind]]) == 1, what
        else:
            assert fmt.first_not_plain([d]) == 0, what
        assert parse.parse_line(_line(d))[0] is None, what
        assert _summary_refuses(d, kind), what


@pytest.mark.parametrize("rule", [r for r in fmt.RULES if r.types or r.ok], ids=_name)
def test_every_check_takes_what_a_rule_takes(rule):
    for kind, value in _reader_cases(rule, accepted=True):
        d = _with(kind, rule.name, value)
        if rule.name == "kind" and value != kind:
            continue  # another kind's record: its own fields decide
        assert fmt.validate_dict(d) is None, (kind, rule.name, value)
        # The fast check takes it too, unless the table leaves records
        # with this field to the full checks.
        plain = fmt.first_not_plain([d]) == 1
        assert plain == (rule.name not in fmt.NOT_PLAIN and _plain(d["kind"])), (
            kind,
            rule.name,
            value,
        )


@pytest.mark.parametrize("rule", fmt.STRICT_RULES, ids=_name)
def test_schema_check_flags_a_record_breaking_a_strict_rule(rule):
    flagged = taken = 0
    for kind in rule.kinds:
        for value in SAMPLES:
            d = _with(kind, rule.name, value)
            if fmt.validate_dict(d) is not None:
                continue  # not a record: readers refuse it (above)
            problem = rule.strict_problem.format(v=value)
            if rule.strict(value, d):
                assert problem not in schema_problems(d), (kind, rule.name, value)
                taken += 1
                continue
            flagged += 1
            assert problem in schema_problems(d), (kind, rule.name, value)
            # The inline copies leave it to the full checks (the C one,
            # _speedups.c scalar_clean, is built by the test extra's install).
            assert not (d.keys().isdisjoint(fmt.NOT_CLEAN) and _fields_clean(d)), (
                kind,
                rule.name,
                value,
            )
            assert not _speedups.scalar_clean(d, fmt.NOT_CLEAN), (kind, rule.name, value)
    assert flagged and taken, rule.name


def test_strict_rules_apply_only_to_their_kinds():
    # A per-device record's "replicas" is no field of its kind: the format
    # says nothing of it (as before the table).
    d = _with("per_device", "replicas", 0)
    assert fmt.validate_dict(d) is None
    assert schema_problems(d) == []
    d = _with("replicated", "device", "x")
    assert fmt.validate_dict(d) is None
    assert schema_problems(d) == []
