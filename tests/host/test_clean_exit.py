"""A pmaptap process ends with exit status 0: a job that opened a Session
and the ``pmaptap summary`` command, in fresh interpreters, and the record
types avoid the msgspec defect that aborted both at interpreter exit
(``double free or corruption``, SIGABRT) under msgspec before 0.23."""

from __future__ import annotations

import json

import msgspec
import msgspec.inspect as mi

from conftest import cli, replicated_dict, run_python
from pmaptap.tapfile.record import schema


def _all_subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_all_subclasses(sub)]
    return out


def _pattern_beside_container(t: mi.Type) -> bool:
    """Whether ``t`` is, or holds, a union of a str with a pattern and a
    container (list, set, tuple, dict): msgspec < 0.23 frees that pattern
    as if it were the container's type node when the decoder is freed."""
    if isinstance(t, mi.UnionType):
        pattern = any(isinstance(u, mi.StrType) and u.pattern for u in t.types)
        container = any(
            isinstance(u, (mi.CollectionType, mi.DictType, mi.TupleType)) for u in t.types
        )
        if pattern and container:
            return True
        return any(_pattern_beside_container(u) for u in t.types)
    if isinstance(t, mi.CollectionType):
        return _pattern_beside_container(t.item_type)
    if isinstance(t, mi.DictType):
        return _pattern_beside_container(t.key_type) or _pattern_beside_container(t.value_type)
    if isinstance(t, mi.TupleType):
        return any(map(_pattern_beside_container, t.item_types))
    return False


def test_no_record_field_puts_a_pattern_beside_a_container_in_a_union():
    structs = _all_subclasses(schema.AnyRecord)
    # the four kinds, their readers' level and the odd records of each
    assert len(structs) >= 12, structs
    found = [
        f"{cls.__name__}.{f.name}"
        for cls in structs
        for f in mi.type_info(cls).fields
        if _pattern_beside_container(f.type)
    ]
    assert found == []


def test_a_session_process_exits_zero(tmp_path):
    # A job as users write one: a tap under pmap, the session closed, the
    # file read back (the records' decoder built and used), then a normal
    # interpreter exit, where the decoder is freed.
    path = tmp_path / "t.jsonl"
    proc = run_python(
        f"""
        import jax, jax.numpy as jnp, pmaptap
        with pmaptap.Session({str(path)!r}):
            f = jax.pmap(lambda x: pmaptap.tap(x.sum(), "loss") + 0, axis_name="i")
            f(jnp.ones((8, 3))).block_until_ready()
        records = pmaptap.read({str(path)!r}, name="loss")
        print("records", len(records), records[0]["devices"])
        """,
        check=False,
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    assert "records 8" in proc.stdout or "records 1" in proc.stdout, proc.stdout
    assert "corruption" not in proc.stderr and "free()" not in proc.stderr


def test_summary_process_exits_zero(tmp_path):
    # Holders past 16 ids are written as ranges text ("0-31"): the field
    # type whose pattern tripped msgspec; the summary decodes every line.
    path = tmp_path / "t.jsonl"
    with open(path, "w") as f:
        for step in range(50):
            f.write(
                json.dumps(
                    replicated_dict(step, 1.0 + step, replicas=32, devices="0-31", processes="0-3")
                )
                + "\n"
            )
    proc = cli("summary", str(path))
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    assert "loss" in proc.stdout, proc.stdout
    assert "corruption" not in proc.stderr


def test_ranges_text_of_the_wrong_form_is_still_refused():
    # The form moved from a pattern on the type to the records' own check
    # (__post_init__): a line with a malformed holders text is no record.
    ok = json.dumps(replicated_dict(0, 1.0, replicas=32, devices="0-31")).encode()
    assert schema.DECODER.decode(ok).devices == "0-31"
    for bad in ("0-31,", "01-31", "5-3", "0-3,2-9", "a"):
        line = json.dumps(replicated_dict(0, 1.0, replicas=32, devices=bad)).encode()
        try:
            schema.DECODER.decode(line)
        except msgspec.ValidationError as e:
            assert "devices" in str(e), (bad, str(e))
        else:
            raise AssertionError(f"devices={bad!r} was taken")
