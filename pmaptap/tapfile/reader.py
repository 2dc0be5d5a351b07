"""Reading tap files: every valid record in file order, never eval/pickle."""
from __future__ import annotations

import json
import os
import warnings
from typing import Iterator

from pmaptap.tapfile.format import decode_record, record_key, validate_dict


def iter_lines(path: str | os.PathLike) -> Iterator[tuple[int, dict | None, str | None]]:
    """(line number, record or None, problem or None) for every line."""
    with open(path, "rb") as f:
        data = f.read()
    lines = data.split(b"\n")
    torn_tail = bool(lines) and lines[-1] != b""
    if not torn_tail:
        lines = lines[:-1]
    for i, raw in enumerate(lines, start=1):
        d, problem = parse_line(raw)
        if problem is not None and problem.startswith("not valid JSON") and \
                i == len(lines) and torn_tail:
            problem = "torn last line (no newline)"
        yield i, d, problem


def parse_line(raw: bytes) -> tuple[dict | None, str | None]:
    """One line (without its newline) -> (undecoded record, None) or
    (None, why it is not a record). Shared by iter_lines and ``pmaptap tail
    -f``, which parses lines one at a time as writers append them."""
    if not raw.strip():
        return None, "empty line"
    try:
        d = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as e:
        return None, f"not valid JSON ({e})"
    problem = validate_dict(d)
    if problem:
        return None, f"not a pmaptap record: {problem}"
    return d, None


def _reject_constant(name: str):
    raise ValueError(f"non-standard JSON constant {name}")


def read(path: str | os.PathLike, *, as_frame: bool = False):
    """All valid records of a tap file, in file order, as dicts.

    Lines that are not valid records (garbage, a torn last line from a killed
    writer) are skipped with one warning that lists them. Non-finite numbers
    come back as float NaN/inf. ``as_frame=True`` returns a pandas DataFrame.
    """
    out: list[dict] = []
    bad: list[tuple[int, str]] = []
    for lineno, d, problem in iter_lines(path):
        if d is None:
            if problem != "empty line":
                bad.append((lineno, problem or "invalid"))
            continue
        out.append(decode_record(d))
    reconcile_divergence(out)
    if bad:
        shown = "; ".join(f"line {n}: {why}" for n, why in bad[:5])
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        warnings.warn(f"pmaptap.read({os.fspath(path)!r}) skipped {len(bad)} "
                      f"invalid line(s): {shown}{more}", RuntimeWarning,
                      stacklevel=2)
    if as_frame:
        try:
            import pandas as pd
        except ImportError as e:
            raise ImportError("pmaptap.read(..., as_frame=True) needs pandas: "
                              "pip install pandas (or 'pmaptap[frame]').") from e
        return pd.DataFrame(out)
    return out


def reconcile_divergence(records: list[dict]) -> None:
    """Mark every replicated record of a (run, name, step, pass) divergent when
    the file holds different values for it from different processes (the
    first writer could not know that a later process would disagree; see
    xdedup). One process re-writing a key with new values is not divergence."""
    seen: dict[tuple, dict[str, set]] = {}
    for r in records:
        if r.get("kind") == "replicated" and r.get("vhash"):
            seen.setdefault(record_key(r), {}).setdefault(r["vhash"], set()).add(
                r.get("process"))
    for r in records:
        if r.get("kind") != "replicated":
            continue
        hashes = seen.get(record_key(r), {})
        if len(hashes) > 1 and len(set().union(*hashes.values())) > 1:
            r["divergent"] = True
