"""The one parser for bytes read from a tap file.

Every reader of tap files (``pmaptap.read``, ``validate``, ``tail -f``,
``show``/``summary``/``export``/``plot`` and the writers' cross-process dedup)
turns a line into a record here. A tap file is shared by every process of a
job and lives long; sooner or later it holds bytes pmaptap did not write. So
``parse_line`` never raises: any line either becomes a record or comes back
with a short reason, and what one line may cost is bounded:

- ``MAX_LINE_BYTES`` (64 MiB): a longer line is reported without being
  parsed (readers do not even keep its bytes).
- ``MAX_DEPTH`` (128): JSON nesting, the record object counting as one level.
  A deeper line is reported after a scan of its bytes, before any JSON parser
  sees it: ``json`` would recurse into it (RecursionError) and orjson stops at
  1024 levels. A tap's value nests as deep as its pytree plus the array's rank
  (plus one for complex), far less.
- Numbers: they must be finite as IEEE doubles (``1e400`` is refused); an
  integer outside [-2**63, 2**64) is read as the nearest float, and one beyond
  the double range is refused (so a 5,000-digit integer is).
- Text: valid UTF-8, strict JSON (RFC 8259: no ``NaN`` literal, no trailing
  comma, no control character in a string), no unpaired surrogate escape.

The writers apply the same limits to what they write (see
``_host/sink.py``), so every line pmaptap writes is read back.

orjson parses when it is installed; with ``PMAPTAP_NO_ORJSON=1`` (or without
orjson) ``json`` does, with hooks that make it accept and refuse exactly the
same lines and return the same values.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Iterable, Iterator

from pmaptap.tapfile import format as _format
from pmaptap.tapfile.speedups import SPEEDUPS

MAX_LINE_BYTES = 64 << 20
MAX_DEPTH = 128

# Integers orjson keeps exact; outside this range it returns a float, and the
# json fallback does the same so both read a file alike.
_INT_MIN, _INT_END = -(1 << 63), 1 << 64

# Scanning for depth: a whole JSON string (escapes included), a run of bytes
# outside strings, or a quote that opens a string never closed. A string the
# pattern cannot close ends the scan: a JSON parser stops there as well.
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[^"]+|"', re.DOTALL)
# Deleting every byte but the four brackets (bytes.translate's delete table).
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_OPENERS = b"[{"
# A \uD800-\uDFFF escape: only then can json's result hold a lone surrogate.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def exceeds_depth(raw: bytes, limit: int | None = None) -> bool:
    """Whether the JSON text ``raw`` nests deeper than ``limit`` (default
    MAX_DEPTH) levels, found without parsing it: bracket counts first (two
    C-speed passes), a scan outside strings only when those allow more.

    Exact up to the first point where a JSON parser would fail, which is
    all that matters: a parser never recurses past a syntax error."""
    limit = MAX_DEPTH if limit is None else limit
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    depth = 0
    for m in _TOKEN.finditer(raw):
        tok = m.group()
        if tok[0] == 0x22:  # '"'
            if len(tok) == 1:
                return False  # unterminated string
            continue
        opens = tok.count(b"[") + tok.count(b"{")
        closes = tok.count(b"]") + tok.count(b"}")
        if depth + opens <= limit:
            depth += opens - closes
            continue
        import numpy as np  # only for lines with more than MAX_DEPTH brackets

        brackets = np.frombuffer(tok.translate(None, _NOT_BRACKETS), np.uint8)
        openers = np.frombuffer(_OPENERS, np.uint8)
        steps = np.where(np.isin(brackets, openers), 1, -1).astype(np.int64)
        levels = depth + np.cumsum(steps)
        if int(levels.max()) > limit:
            return True
        depth = int(levels[-1])
    return False


def _parse_int(text: str) -> int | float:
    if len(text) < 19:
        return int(text)
    value = int(text)  # ValueError past 4300 digits: not read
    if _INT_MIN <= value < _INT_END:
        return value
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"number out of range ({len(text)} digits)") from None


def _parse_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number out of range ({text[:20]})")
    return value


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _has_lone_surrogate(obj: Any) -> bool:
    # Iterative: the depth is already bounded, but this may run deep in a
    # caller's stack.
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            if _SURROGATE.search(x):
                return True
        elif isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return False


def _loads(raw: bytes) -> tuple[Any, str | None]:
    orjson = _format.ORJSON
    if orjson is not None:
        try:
            return orjson.loads(raw), None
        except orjson.JSONDecodeError as e:
            return None, f"not valid JSON ({e})"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"not valid JSON (not UTF-8: {e})"
    try:
        obj = json.loads(
            text, parse_constant=_reject_constant, parse_int=_parse_int, parse_float=_parse_float
        )
    except ValueError as e:
        return None, f"not valid JSON ({e})"
    if _SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(obj):
        return None, "not valid JSON (an unpaired surrogate escape)"
    return obj, None


def parse_line(raw: bytes) -> tuple[dict | None, str | None]:
    """One line (without its newline) -> (undecoded record, None) or
    (None, why it is not a record). Never raises an Exception."""
    try:
        if len(raw) > MAX_LINE_BYTES:
            return None, (
                f"line too long ({len(raw)} bytes; readers take at most {MAX_LINE_BYTES})"
            )
        # The common case first, in as few calls as possible (this runs for
        # every line of every read): a line with at most MAX_DEPTH brackets
        # that orjson parses into a record that passes validate_dict's
        # exact-type checks. Anything else takes the full path below, which
        # gives the same answer for these lines.
        orjson = _format.ORJSON
        if orjson is not None and raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
            try:
                d = orjson.loads(raw)
            except orjson.JSONDecodeError:
                pass
            else:
                if type(d) is dict and _format._plainly_valid(d):
                    return d, None
        if not raw.strip():
            return None, "empty line"
        if exceeds_depth(raw):
            return None, f"nested deeper than {MAX_DEPTH} levels (not parsed)"
        d, problem = _loads(raw)
        if problem is not None:
            return None, problem
        problem = _format.validate_dict(d)
        if problem:
            return None, f"not a pmaptap record: {problem}"
        return d, None
    except Exception as e:  # noqa: BLE001 - the contract: no line raises
        # Not reached by any input the tests know; if it ever is, the line is
        # still reported rather than ending the reader (or a writer's dedup).
        return None, f"unreadable ({type(e).__name__}: {str(e)[:200]})"


Parsed = tuple[list, dict]


def parse_lines(
    lines: list[bytes], joined: bytes | None = None, seen: dict | None = None
) -> Parsed:
    """``parse_line`` of every line of ``lines`` (each without its newline),
    many lines per call: (records, problems), ``records[i]`` the record of
    ``lines[i]`` or None, ``problems[i]`` why it is not one. Exactly
    parse_line's answers (tests/tapfile/test_read_batch.py checks it on hostile
    lines); never raises an Exception.

    The common case costs a few C-level passes over the list instead of a
    Python call per line: every line short and shallow enough (byte counts),
    one orjson call per line through ``map`` (each line parsed on its own,
    so a line can never borrow bytes from its neighbour), then the plain
    record checks in one loop (format.first_not_plain). Anything
    else (a line orjson refuses, a record that is not plainly valid, a long
    or bracket-heavy line, no orjson) takes parse_line one line at a time,
    which is the definition. ``joined``: ``b"\\n".join(lines)`` (maybe with
    a newline after), if the caller has it.

    ``seen``: a sharded run's merge's (runs._Source), only there. In C, a
    line that is plainly a copy of a replicated value another process's
    line already gave (set_aside's test, _speedups.c scan_copy: only lines
    it can read exactly without building them) comes back as (line, time,
    info) instead of its record, for time_keys, which holds it as its
    line: the merge drops most copies, and building each was most of what
    it cost to read one."""
    try:
        orjson = _format.ORJSON
        if SPEEDUPS is not None and orjson is not None:
            # The same, one line at a time in C (tapfile/_speedups.c): a
            # line leaves the fast path alone, not its whole batch.
            records, slow = SPEEDUPS.plain_records(
                lines,
                orjson.loads,
                orjson.JSONDecodeError,
                MAX_DEPTH,
                MAX_LINE_BYTES,
                _format.id_ranges,
                seen,
            )
            return _by_definition(lines, records, slow)
        records = load_lines(lines, joined)
        if records is None:
            return _one_by_one(lines)
        # The plain records stand; the rest get parse_line's full path and
        # its exact reason.
        return _by_definition(lines, records, _not_plain(records))
    except Exception:  # noqa: BLE001 - the contract: no line raises
        return _one_by_one(lines)


def load_lines(lines: list[bytes], joined: bytes | None = None) -> list | None:
    """What orjson makes of each line, when every line is one parse_line
    would hand straight to orjson (short, at most MAX_DEPTH opening
    brackets) and orjson takes every one; else None. Not yet records: a
    reader that checks the records it knows itself (``pmaptap summary``)
    starts here and gives every other line to parse_line."""
    orjson = _format.ORJSON
    if orjson is None or not lines:
        return None
    if joined is None:
        joined = b"\n".join(lines)
    if len(joined) > MAX_LINE_BYTES and max(map(len, lines)) > MAX_LINE_BYTES:
        return None
    if _max_openers(joined) > MAX_DEPTH:
        return None
    try:
        return list(map(orjson.loads, lines))
    except orjson.JSONDecodeError:
        return None


def _one_by_one(lines: list[bytes]) -> Parsed:
    return _by_definition(lines, [None] * len(lines), range(len(lines)))


def _by_definition(lines: list[bytes], records: list, at: Iterable[int]) -> Parsed:
    """``records`` with the line of each index of ``at`` given parse_line's
    answer, the definition; (records, problems by index)."""
    problems: dict[int, str] = {}
    for i in at:
        d, problem = parse_line(lines[i])
        records[i] = d
        if problem is not None:
            problems[i] = problem
    return records, problems


def _not_plain(records: list) -> Iterator[int]:
    """The index of each item of ``records`` that format.first_not_plain
    does not take, found as the caller goes (it replaces each as it goes)."""
    n = len(records)
    i = _format.first_not_plain(records)
    while i < n:
        yield i
        i = _format.first_not_plain(records, i + 1)


def _max_openers(joined: bytes) -> int:
    """An upper bound of the opening brackets on any one line of ``joined``
    (lines joined by newlines, maybe one more at the end): parse_line's fast-path test (``[`` plus
    ``{`` at most MAX_DEPTH) holds for every line when this is at most
    MAX_DEPTH. One C pass keeps just the brackets and line ends (cheaper
    than counting line by line)."""
    kept = joined.translate(None, _NOT_BRACKETS_OR_NEWLINE)
    # The longest run of brackets between two newlines, found by a C scan:
    # none longer than MAX_DEPTH is the usual answer.
    if re.search(rb"[^\n]{%d}" % (MAX_DEPTH + 1), kept) is None:
        return MAX_DEPTH
    return max(map(len, kept.split(b"\n")))


_NOT_BRACKETS_OR_NEWLINE = bytes(b for b in range(256) if b not in b"[]{}\n")


def line_problem(line: bytes) -> str | None:
    """Why readers would refuse a line a writer is about to write (too long,
    too deep), else None. Cheap for ordinary lines (two byte counts)."""
    if len(line) > MAX_LINE_BYTES:
        return (
            f"the encoded record is {len(line)} bytes, more than the "
            f"{MAX_LINE_BYTES} readers take (lower max_value_bytes or "
            "tap smaller pieces)"
        )
    if exceeds_depth(line):
        return f"the record nests deeper than the {MAX_DEPTH} levels readers take"
    return None
