"""Reading tap files: every valid record in file order, never eval/pickle."""

from __future__ import annotations

import os
from collections.abc import Iterable
from operator import attrgetter
from typing import Any

from pmaptap.errors import MissingBytes
from pmaptap.tapfile.read.attempts import Attempts
from pmaptap.tapfile.read.divergence import DivergenceIndex, mark_divergent
from pmaptap.tapfile.read.query import Filter, read_filter
from pmaptap.tapfile.record import UNSET, PerDevice, as_dicts, decode_record, decoded
from pmaptap.tapfile.source import ByteStore, Run, collector_paused, iter_record_batches, load_value

# A per-device record's fields that make it more than its dict (none of
# which the usual one has), and the values that are already as read.
_EXTRA = attrgetter("attempt", "bytes", "devices", "processes")
_NONE4 = (UNSET,) * 4
_NUMBER = frozenset((float, int))
_MODES = ("latest", "all")

__all__ = ["read"]


def read(
    path: str | os.PathLike,
    *,
    as_frame: bool = False,
    name: str | Iterable[str] | None = None,
    step: int | str | tuple | range | None = None,
    run: str | None = None,
    device: int | None = None,
    process: int | None = None,
    attempts: str = "latest",
):
    """All valid records of a tap file, in file order, as dicts (a tidy
    pandas DataFrame with ``as_frame=True``): docs/api.md, "Reading a tap
    file" (the filters, ``attempts``, stored values, skipped lines)."""
    path = Run.of(path)  # how the run is stored, worked out once for the passes below
    if attempts not in _MODES:
        raise ValueError(f"attempts must be one of {_MODES}, got {attempts!r}")
    flt = read_filter(name, step, run, device, process)
    if as_frame:
        return _frame(path, flt, attempts)
    out: list[dict] = []
    bad: list[tuple[int, str]] = []
    stored = Stored(path, bad)
    index = DivergenceIndex()
    later = Attempts()  # steps a later attempt rewrote
    reps: list[dict] = []  # the replicated records of out: only they can be divergent
    with collector_paused():
        for first, records, problems in iter_record_batches(path):
            if flt is None and not problems and None not in records:
                # The common batch in C passes: each record's dict made in
                # one call (msgspec), then only the records that need more
                # looked at one by one: a replicated value, a later
                # attempt, a value or holders to decode, a stored value.
                ds = as_dicts(records)
                drop: set = set()
                special = [
                    i
                    for i, r in enumerate(records)
                    if type(r) is not PerDevice
                    or r.value.__class__ not in _NUMBER
                    or _EXTRA(r) != _NONE4
                ]
                for i in special:
                    r = records[i]
                    replicated = r.kind == "replicated"
                    if replicated and r.vhash:
                        index.add(r)
                    if r.attempt is not UNSET:
                        later.add(r)
                    d = ds[i] = decoded(r)
                    if r.bytes is not UNSET and not stored.load(d, first + i):
                        drop.add(i)
                        continue
                    if replicated:
                        reps.append(d)
                out += [d for i, d in enumerate(ds) if i not in drop] if drop else ds
                continue
            for lineno, r in enumerate(records, first):
                if r is None:
                    problem = problems.get(lineno)
                    if problem != "empty line":
                        bad.append((lineno, problem or "invalid"))
                    continue
                if flt is not None and not flt.key_match(r):
                    continue
                # Judged on every copy of a matched step, also those the
                # device or process filter leaves out: a copy filtered out
                # still disagrees, and an elastic restart supersedes a step
                # on every device.
                index.add(r)
                later.add(r)
                if flt is not None and not flt(r):
                    continue
                d = decoded(r)
                if r.bytes is not UNSET and not stored.load(d, lineno):
                    continue
                out.append(d)
                if r.kind == "replicated":
                    reps.append(d)
    mark_divergent(reps, index)
    if attempts == "all":
        for r in out:
            r.setdefault("attempt", 0)
    elif later:
        out = [r for r in out if not later.superseded(r)]
    _warn_skipped(path, bad)
    return out


class Stored:
    """Loads stored values into decoded records; a line whose bytes are
    missing goes to ``bad``."""

    def __init__(self, path: str | os.PathLike, bad: list[tuple[int, str]]) -> None:
        self._store, self.bad = ByteStore(path), bad

    def load(self, r: dict, lineno: int) -> bool:
        """``r``'s stored value loaded into it; False when its bytes are not there."""
        try:
            r["value"] = load_value(r, self._store)
        except (MissingBytes, OSError) as e:
            self.bad.append((lineno, f"{r['name']!r} step {r['step']}: {e}"))
            return False
        return True


def _warn_skipped(path: str | os.PathLike, bad: list[tuple[int, str]]) -> None:
    if bad:
        shown = "; ".join(f"line {n}: {why}" for n, why in bad[:5])
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        from pmaptap._log import log  # on use: a read that skips nothing loads no logging

        log.warning(
            f"pmaptap.read({os.fspath(path)!r}) skipped {len(bad)} invalid line(s): {shown}{more}"
        )


def _frame(path: str | os.PathLike, flt: Filter | None, attempts: str) -> Any:
    """``read(..., as_frame=True)``, streamed (read twice: stream.py), each
    record into the frame's columns as decoded, never held."""
    from pmaptap.tapfile.read.frame import FrameBuilder
    from pmaptap.tapfile.read.stream import first_pass, matching

    builder = FrameBuilder()  # pandas missing: said before the file is read
    fp = first_pass(path, flt)
    _warn_skipped(path, [(n, why) for n, why in fp.problems if why != "empty line"])
    every = attempts == "all"
    stored = Stored(path, [])
    for lineno, d, divergent in matching(path, flt, fp, all_attempts=every):
        r = decode_record(d)
        if "bytes" in d and not stored.load(r, lineno):
            continue
        if divergent:
            r["divergent"] = True
        if every:
            r.setdefault("attempt", 0)
        builder.add(r)
    _warn_skipped(path, stored.bad)
    del fp  # the indexes: their memory serves the frame's columns
    return builder.frame()
