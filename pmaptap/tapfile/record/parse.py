"""The one parser for bytes read from a tap file: a line becomes a record
or a short reason, never an exception, at a bounded cost (docs/faults.md,
"Hostile or damaged tap files"); writers apply the same limits. A line
schema.py's Structs refuse is parsed as any JSON, then validate_dict."""

from __future__ import annotations

import re
from typing import Any

import msgspec

from pmaptap.tapfile.record.schema import (
    DECODER,
    AnyRecord,
    as_dict,
    from_dict,
    validate_dict,
)

MAX_LINE_BYTES = 64 << 20
MAX_DEPTH = 128

# Integers kept exact; outside this range a reader reads the nearest float
# (as orjson does: a file reads the same through either).
_INT_MIN, _INT_END = -(1 << 63), 1 << 64

# Scanning for depth: a whole JSON string (escapes included), a run of bytes
# outside strings, or a quote that opens a string never closed (a JSON
# parser stops there as well).
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[^"]+|"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def exceeds_depth(raw: bytes) -> bool:
    """Whether ``raw`` nests deeper than MAX_DEPTH, without parsing it
    (exact up to where a JSON parser would fail)."""
    limit = MAX_DEPTH
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
        openers = np.frombuffer(b"[{", np.uint8)
        steps = np.where(np.isin(brackets, openers), 1, -1).astype(np.int64)
        levels = depth + np.cumsum(steps)
        if int(levels.max()) > limit:
            return True
        depth = int(levels[-1])
    return False


_ANY = msgspec.json.Decoder()


def _loads(raw: bytes) -> tuple[Any, str | None]:
    """The line's strict JSON value, integers outside [-2**63, 2**64) as
    the nearest float."""
    try:
        obj = _ANY.decode(raw)
    except msgspec.DecodeError as e:
        return None, f"not valid JSON ({e})"
    if _long_number(raw):
        try:
            obj = _as_read(obj)
        except OverflowError:
            return None, "not valid JSON (number out of range)"
    return obj, None


def _as_read(x: Any) -> Any:
    if type(x) is int:
        return x if _INT_MIN <= x < _INT_END else float(x)
    if type(x) is list:
        return [_as_read(v) for v in x]
    if type(x) is dict:
        return {k: _as_read(v) for k, v in x.items()}
    return x


def decode_line(raw: bytes) -> tuple[AnyRecord | None, str | None]:
    """One line -> (Struct, None) or (None, why it is no record)."""
    try:
        if len(raw) > MAX_LINE_BYTES:
            return None, (
                f"line too long ({len(raw)} bytes; readers take at most {MAX_LINE_BYTES})"
            )
        # A line with more brackets than MAX_DEPTH or a run of 19 digits (an
        # integer msgspec would keep past 64 bits) takes the definition.
        if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH and not _long_number(raw):
            try:
                return DECODER.decode(raw), None
            except (msgspec.ValidationError, msgspec.DecodeError):
                pass
        return _by_definition(raw)
    except Exception as e:  # noqa: BLE001 - the contract: no line raises
        # Not reached by any input the tests know; if it ever is, the line is
        # still reported rather than ending the reader (or a writer's dedup).
        return None, f"unreadable ({type(e).__name__}: {str(e)[:200]})"


def _by_definition(raw: bytes) -> tuple[AnyRecord | None, str | None]:
    """A line the format's Structs refuse, taken if readers take it."""
    if not raw.strip():
        return None, "empty line"
    if exceeds_depth(raw):
        return None, f"nested deeper than {MAX_DEPTH} levels (not parsed)"
    d, problem = _loads(raw)
    if problem is not None:
        return None, problem
    problem = validate_dict(d)
    if problem:
        return None, f"not a pmaptap record: {problem}"
    return from_dict(d), None


def parse_line(raw: bytes) -> tuple[dict | None, str | None]:
    """``decode_line`` with the record as its line's JSON object."""
    r, problem = decode_line(raw)
    return (None if r is None else as_dict(r)), problem


Decoded = tuple[list, dict]


def decode_block(block: bytes, lines: "list[bytes] | None" = None) -> Decoded:
    """``decode_line`` of each line of ``block``: (records, problems by
    index); the common block is one msgspec call. ``lines``: if known."""
    try:
        # The block's opening brackets (all as "[") and line ends, in order:
        # no line opens more than MAX_DEPTH, and its lines are counted here.
        kept = block.translate(_OPENERS_AS_ONE, _NOT_OPENERS_OR_NEWLINE)
        if (
            (len(block) <= MAX_LINE_BYTES or max(map(len, _split(block, lines))) <= MAX_LINE_BYTES)
            and kept.find(_TOO_DEEP) < 0
            and not _long_number(block)
        ):
            try:
                records = DECODER.decode_lines(block)
            except (msgspec.ValidationError, msgspec.DecodeError):
                pass
            else:
                n = kept.count(b"\n") + (not block.endswith(b"\n"))
                if len(records) == n:  # no blank line skipped
                    return records, {}
            return _each(_split(block, lines), gated=True)
        return _each(_split(block, lines), gated=False)
    except Exception:  # noqa: BLE001 - the contract: no line raises
        return _each(_split(block, lines), gated=False)


def _split(block: bytes, lines: "list[bytes] | None") -> list[bytes]:
    if lines is not None:
        return lines
    lines = block.split(b"\n")
    if block.endswith(b"\n"):
        lines.pop()
    return lines


def _each(lines: list[bytes], gated: bool) -> Decoded:
    """decode_line of each line (``gated``: the block's gate passed them)."""
    records: list = []
    problems: dict[int, str] = {}
    decode = DECODER.decode
    for i, raw in enumerate(lines):
        if not gated:
            r, problem = decode_line(raw)
        else:
            try:
                records.append(decode(raw))
                continue
            except (msgspec.ValidationError, msgspec.DecodeError):
                r, problem = _by_definition(raw)
        records.append(r)
        if problem is not None:
            problems[i] = problem
    return records, problems


def _long_number(raw: bytes) -> bool:
    """Whether ``raw`` may hold an integer of 19 digits or more (one past
    64 bits: the definition reads a float, msgspec keeps it), in C passes."""
    return raw.translate(_DIGITS).find(_LONG) >= 0


_DIGITS = bytes(0x30 if 0x30 <= b <= 0x39 else 0x2E if b in b".eE" else 0x20 for b in range(256))
_LONG = b" " + b"0" * 19
# Keeping only the opening brackets, each as "[", and newlines.
_OPENERS_AS_ONE = bytes(0x5B if b == 0x7B else b for b in range(256))
_NOT_OPENERS_OR_NEWLINE = bytes(b for b in range(256) if b not in b"[{\n")
_TOO_DEEP = b"[" * (MAX_DEPTH + 1)


def line_problem(line: bytes) -> str | None:
    """Why readers would refuse a line a writer is about to write, or None."""
    if len(line) > MAX_LINE_BYTES:
        return (
            f"the encoded record is {len(line)} bytes, more than the "
            f"{MAX_LINE_BYTES} readers take (lower max_value_bytes or "
            "tap smaller pieces)"
        )
    if exceeds_depth(line):
        return f"the record nests deeper than the {MAX_DEPTH} levels readers take"
    return None
