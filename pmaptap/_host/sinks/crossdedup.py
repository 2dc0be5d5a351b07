"""Cross-process dedup of replicated records at the shared file
(docs/architecture.md, "Dedup committed only after a write succeeds"):
per ``record_key``, the value hashes (``vhash``) other processes already
wrote; a replicated record whose key is there with the same hash is
skipped, with another hash written ``"divergent": true``. Only *other* processes' records
count: the same process writing a key again (a loop re-run with the same
explicit steps) is data, not a duplicate. The index keeps the newest
``max_keys`` keys: a process further behind may write a duplicate, which
``read`` and ``pmaptap validate`` report.

Lines are parsed by the readers' parser (tapfile/record/parse.py), which
never raises: a line that is not a record costs that line only (counted in
``corrupt``, the first one's offset and reason in ``first_corrupt``).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Sequence

from pmaptap.tapfile.record import Record, parse_line, record_key

_REPLICATED_MARK = b'"kind":"replicated"'


class CrossProcessIndex:
    def __init__(self, process: int = 0, max_keys: int = 200_000) -> None:
        self.process = process
        self.max_keys = max_keys
        # key -> {vhash: processes that wrote it}
        self._seen: OrderedDict[tuple, dict[str, set]] = OrderedDict()
        self.skipped = 0
        self.divergent = 0
        # Lines that looked replicated but were not records.
        self.corrupt = 0
        self.first_corrupt: tuple[int, str] | None = None  # (offset, why)

    def reset(self) -> None:
        """Forget the file's contents (it was truncated or replaced): records
        the others wrote there are gone, so ours must not be skipped for them."""
        self._seen.clear()

    def _remember(self, key: tuple, vhash: str, process: int) -> None:
        hashes = self._seen.get(key)
        if hashes is None:
            hashes = self._seen[key] = {}
            if len(self._seen) > self.max_keys:
                self._seen.popitem(last=False)
        hashes.setdefault(vhash, set()).add(process)

    def _others(self, key: tuple) -> set[str]:
        return {h for h, procs in self._seen.get(key, {}).items() if procs - {self.process}}

    def observe(self, data: bytes, offset: int = 0) -> None:
        """Index replicated records among bytes other processes appended
        (``data`` starts at byte ``offset`` of the file)."""
        pos = offset
        for line in data.split(b"\n"):
            start, pos = pos, pos + len(line) + 1
            if _REPLICATED_MARK not in line:
                continue
            d, problem = parse_line(line)
            if d is None:
                self.corrupt += 1
                if self.first_corrupt is None:
                    self.first_corrupt = (start, problem or "invalid")
                continue
            if d.get("vhash"):
                self._remember(record_key(d), d["vhash"], d["process"])

    def plan(
        self, records: Sequence[Record], left: list[int] | None = None
    ) -> tuple[list[Record], list[tuple]]:
        """Which records to write: replicated ones already in the file are
        dropped (their positions appended to ``left``), disagreeing ones
        flagged. Returns (records, keys to commit); call ``commit`` only once
        the write succeeded, so a failed write is retried in full rather than
        remembered as done."""
        out: list[Record] = []
        new: list[tuple] = []
        for i, r in enumerate(records):
            if r.kind != "replicated" or not r.vhash:
                out.append(r)
                continue
            key = record_key(r)
            others = self._others(key)
            if r.vhash in others:
                self.skipped += 1  # another process wrote this value
                if left is not None:
                    left.append(i)
                continue
            if others and not r.divergent:
                r = dataclasses.replace(r, divergent=True)
                self.divergent += 1
            new.append((key, r.vhash))
            out.append(r)
        return out, new

    def commit(self, new: list[tuple]) -> None:
        for key, vhash in new:
            self._remember(key, vhash, self.process)
