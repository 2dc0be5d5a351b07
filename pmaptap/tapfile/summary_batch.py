"""The fast path of ``pmaptap summary``: ``BatchSummarizer.add_batch`` adds a
batch of records a tap at a time, the usual records of each tap's part in one
tight loop (``_add_part``), every other item through ``Summarizer.add`` (and
unchecked lines through ``parse.parse_line``, the one definition);
``summarize_file`` streams a file through it.

Contract: the batched path equals the reference path (``Summarizer.add``, in
summary.py): the same summaries, problems, names and runs for any input,
checked by tests/tapfile/test_read_fuzz.py and tests/tapfile/test_read_batch.py.
A change to what ``_TapAcc.add`` keeps must be made here too."""

from __future__ import annotations

import os
from itertools import compress, repeat
from typing import Any

from pmaptap.tapfile.attempts import Attempts, scan
from pmaptap.tapfile.format import _SCALAR_TYPES, REQUIRED_BY_KIND
from pmaptap.tapfile.lines import collector_paused as _collector_paused
from pmaptap.tapfile.lines import iter_batches, iter_file_batches
from pmaptap.tapfile.parse import parse_line
from pmaptap.tapfile.query import Filter
from pmaptap.tapfile.runs import is_sharded
from pmaptap.tapfile.speedups import SPEEDUPS
from pmaptap.tapfile.summary import _MASK_DEVICES, Summarizer, TapSummary, _int_values, _TapAcc

# The fields of a usual record of each kind (format.RULES): those its kind
# requires and, for a replicated one, its vhash; nothing else (no pass,
# attempt, index, divergent...), which _add_part checks by counting keys.
_USUAL_PER_DEVICE = len(REQUIRED_BY_KIND["per_device"])
_USUAL_REPLICATED = len(REQUIRED_BY_KIND["replicated"]) + 1


class BatchSummarizer(Summarizer):
    """A Summarizer that also takes a batch at a time (``add_batch``)."""

    def add_batch(
        self, rs: list, lines: list[bytes] | None = None, first: int = 1, bad: list | None = None
    ) -> None:
        """``add(r)`` for every r of ``rs``, a tap at a time, each tap's
        part in one tight loop (``pmaptap summary`` of a large file): the
        same summaries.

        ``rs``: records every reader accepts (format.first_not_plain), or,
        with ``lines``, what orjson made of each of those lines (line
        ``first`` on), not yet checked as records: then an item this loop
        does not take as a usual record goes through parse.parse_line, the
        one definition, and is added from there or its (line, problem)
        appended to ``bad``."""
        if not rs:
            return
        if lines is not None and set(map(type, rs)) != {dict}:
            rs, lines = _checked(rs, lines, first, bad)
            if not rs:  # no line of the batch was a record (``5``, ``[1]``)
                return
        try:
            names = list(map(dict.get, rs, repeat("name")))
            # A record without a run is no record: None, which is no str.
            runs = list(map(dict.get, rs, repeat("run")))
            if runs.count(runs[0]) == len(runs):
                parts = _parts_by_key(rs, names)
                keys = [(runs[0], p[0]) for p in parts]
            else:
                parts = _parts_by_key(rs, list(zip(runs, names)))
                keys = [p[0] for p in parts]
        except TypeError:  # an unhashable name or run: not a record
            rs, lines = _checked(rs, lines, first, bad)
            for r in rs:
                self.add(r)
            return
        for (run, name), (_, part, where) in zip(keys, parts):
            if type(run) is not str or type(name) is not str or not name:
                # Not records (or not plain ones): each on its own.
                for r, i in zip(part, where):
                    self._odd(r, i, lines, first, bad)
                continue
            by_run = self._taps.get(run)
            if by_run is None:
                by_run = self._taps[run] = {}
            acc = by_run.get(name)
            if acc is None:
                acc = by_run[name] = _TapAcc(run, name)
            self._add_part(acc, part, where, lines, first, bad)

    def _odd(self, r: Any, i: int, lines: list[bytes] | None, first: int, bad: list | None) -> None:
        """A batch item the tight loop does not take: a checked record is
        added as ``add`` adds it; an unchecked one is parsed again by
        parse_line, the definition, and added or reported."""
        if lines is not None:
            r, problem = parse_line(lines[i])
            if r is None:
                if bad is not None:
                    bad.append((first + i, problem or "invalid"))
                return
        self.add(r)

    def _add_part(
        self,
        acc: _TapAcc,
        part: list,
        where: list[int],
        lines: list[bytes] | None,
        first: int,
        bad: list | None,
    ) -> None:
        """``add`` of each item of one tap's part of a batch (all of the
        tap's run and name), the usual records inline: a finite number in
        the forward pass of the first attempt, not marked divergent, a
        per-device one at its device's usual coordinates, a replicated one
        with a vhash. The conditions imply every check format.validate_dict
        makes (an item that fails one is _odd). Any other item is _odd, in
        its place, so the file order the summary keeps is kept."""
        # format.RULES, hand-inlined with the table's constants (the tap's
        # hot loop); tests/tapfile/test_record_rules.py checks that an item
        # breaking any rule of the table is _odd here.
        scalar = _SCALAR_TYPES
        n_per_device, n_replicated = _USUAL_PER_DEVICE, _USUAL_REPLICATED
        kinds = acc.kinds
        processes = acc.processes
        pd_keys = acc.pd_keys
        masks = acc.pd_masks
        dev_coords = acc.dev_coords
        steps = acc.steps
        devices = acc.devices
        values: list[float] = []  # finite values, for acc.finite
        rep_steps = acc.rep_steps
        dup_keys = acc.dup_keys
        index = self._index
        # DivergenceIndex entries of this tap's forward, first-attempt steps.
        seen = index.steps_of(acc.run, acc.name) if index is not None else None
        last, last_vals = acc.last_step, acc.last_vals
        new_steps: list[int] = []  # steps of new per-device keys
        added = dups = 0
        prev_kind = prev_proc = None
        # orjson never makes a NaN or inf: only checked records (decoded
        # ones) need the finite test.
        decoded = lines is None
        # Runs of the simplest usual per-device records in C (_speedups.c
        # per_device_run: this loop's steps for them), the rest here.
        run_c = SPEEDUPS.per_device_run if SPEEDUPS is not None else None
        k, n = 0, len(part)
        while k < n:
            if run_c is not None:
                k, took, dup, last, last_vals, prev_proc = run_c(
                    part, k, decoded, n_per_device, dev_coords, masks, _MASK_DEVICES,
                    values, processes, last, last_vals, prev_proc,
                )  # fmt: skip
                if took:
                    added += took
                    dups += dup
                    if prev_kind != "per_device":
                        kinds.add("per_device")
                        prev_kind = "per_device"
                if k >= n:
                    break
            r, i = part[k], where[k]
            k += 1
            # The part's run and name are present; these four and dtype,
            # shape, time and host make format.REQUIRED. The usual
            # record has no other field than its kind's (so no pass,
            # attempt, index, divergent...): checked by counting its keys.
            try:
                v = r["value"]
                step = r["step"]
                kind = r["kind"]
                proc = r["process"]
            except KeyError:
                kind = None
            else:
                tv = type(v)
                tp = type(proc)
                if not (
                    (tv is float or tv is int)
                    and (not decoded or v - v == 0)
                    and type(step) is int
                    and (tp is int or tp in scalar)
                    and "dtype" in r
                    and "shape" in r
                    and "time" in r
                    and "host" in r
                ):
                    kind = None
            if kind == "per_device":
                # REQUIRED, device and coords.
                try:
                    dev = r["device"]
                    coords = r["coords"]
                    usual = len(r) == n_per_device and coords == dev_coords[dev]
                except (KeyError, TypeError):  # unknown or unhashable device
                    usual = False
                if usual:  # _int_values, inline (one axis the quickest)
                    try:
                        (c,) = coords.values()
                        usual = type(c) is int
                    except ValueError:
                        usual = _int_values(coords)
                if usual:
                    # _pd_key of a device at its usual coordinates, and _key
                    d = dev if type(dev) is int else int(dev)
                    if d < _MASK_DEVICES:
                        bit = 1 << d
                        mask = masks.get(step, 0)
                        if mask & bit:
                            dups += 1
                        else:
                            masks[step] = mask | bit
                    else:
                        key = step << 20 | d
                        if key in pd_keys:
                            dups += 1
                        else:
                            pd_keys.add(key)
                            new_steps.append(step)
            elif kind == "replicated":
                vhash = r.get("vhash")
                devs = r.get("devices")
                procs = r.get("processes")
                usual = (
                    type(vhash) is str
                    and vhash != ""
                    and "replicas" in r
                    and len(r) == n_replicated + (devs is not None) + (procs is not None)
                    and (devs is None or type(devs) is list and set(map(type, devs)) <= scalar)
                    and (procs is None or type(procs) is list and set(map(type, procs)) <= scalar)
                )
                if usual:
                    if procs:
                        # The writer's process first, as ``add`` does: of
                        # equal ids (1, 1.0, True) the set keeps the first.
                        processes.add(proc)
                        processes.update(procs)
                    steps.add(step)
                    if devs:
                        devices.update(devs)
                    rep_steps.add(step)
                    dup = (step, "forward", vhash)
                    if dup in dup_keys:
                        dups += 1
                    else:
                        dup_keys.add(dup)
                    if seen is not None:  # DivergenceIndex.add, inline
                        entry = (vhash, proc)
                        if seen.setdefault(step, entry) is not entry:
                            index.repeat(seen, step, entry)
            else:
                usual = False
            if not usual:
                acc.records += added
                acc.duplicates += dups
                acc.last_step, acc.last_vals = last, last_vals
                added = dups = 0
                self._odd(r, i, lines, first, bad)
                last, last_vals = acc.last_step, acc.last_vals
                continue
            # What every usual record adds (the key parts are done above).
            added += 1
            if kind != prev_kind:
                kinds.add(kind)
                prev_kind = kind
            if proc is not prev_proc:  # small ints are one object each
                processes.add(proc)
                prev_proc = proc
            if last is None or step > last:
                last, last_vals = step, [v]
            elif step == last:
                last_vals.append(v)
            values.append(v)
        acc.records += added
        acc.duplicates += dups
        acc.last_step, acc.last_vals = last, last_vals
        acc.pd_count.update(new_steps)
        acc.finite.extend(values)


def _parts_by_key(rs: list, keys: list) -> list[tuple[Any, list, list[int]]]:
    """``rs`` split by ``keys`` (one per item, hashable): (key, items,
    their positions in ``rs``) per key, each part in order, parts in the
    order their keys first appear. A few taps per batch (the usual case)
    take a few C-level passes each; many take one Python pass in all."""
    distinct = list(dict.fromkeys(keys))
    if len(distinct) == 1:
        return [(distinct[0], rs, range(len(rs)))]
    if len(distinct) <= 8 and all(type(k) is str for k in distinct):
        out = []
        for k in distinct:
            picked = list(map(k.__eq__, keys))
            out.append((k, list(compress(rs, picked)), list(compress(range(len(rs)), picked))))
        return out
    parts: dict = {}
    for i, (k, r) in enumerate(zip(keys, rs)):
        part = parts.get(k)
        if part is None:
            parts[k] = ([r], [i])
        else:
            part[0].append(r)
            part[1].append(i)
    return [(k, a, b) for k, (a, b) in parts.items()]


def _checked(
    rs: list, lines: list[bytes] | None, first: int, bad: list | None
) -> tuple[list, None]:
    """The records among unchecked items, each as parse.parse_line makes it
    (the others' (line, problem) appended to ``bad``); checked ones as they
    are."""
    if lines is None:
        return rs, None
    out = []
    for i, raw in enumerate(lines):
        d, problem = parse_line(raw)
        if d is None:
            if bad is not None:
                bad.append((first + i, problem or "invalid"))
        else:
            out.append(d)
    return out, None


def summarize_file(
    path: str | os.PathLike, flt: Filter | None = None
) -> tuple[list[TapSummary], list[tuple[int, str]], set, set]:
    """``pmaptap summary``: the summaries of the records of ``path`` that
    ``flt`` matches, streaming the file (records are parsed, summarized and
    dropped; values are never decoded). Also the (line, problem) list of
    lines that are not records and every name and run read."""
    flt = flt or Filter()
    if not flt.active and not flt.all_attempts:
        # The common case in one pass, assuming the run was never resumed;
        # a record of a later attempt means it was: then the pass below,
        # which first finds what later attempts superseded.
        with _collector_paused():
            if is_sharded(path):
                acc, bad = _summarize_merged(path)
            else:
                acc, bad = _summarize_plain(path)
        if not acc.resumed:
            names, runs = acc.names_and_runs()
            return acc.summaries(), bad, names, runs
    return _summarize_scanned(path, flt)


def _summarize_scanned(
    path: str | os.PathLike, flt: Filter
) -> tuple[list[TapSummary], list[tuple[int, str]], set, set]:
    """summarize_file for any filter and any run: what later attempts
    superseded found first (attempts.scan), then one pass."""
    acc = BatchSummarizer()
    # What a later attempt of a resumed run replaced is not part of the story.
    attempts = scan(path) if not flt.all_attempts else Attempts()
    bad: list[tuple[int, str]] = []
    names: set = set()
    runs: set = set()
    everything = not flt.active
    resumed = bool(attempts)
    # The loop allocates a few small objects per line and frees the record,
    # creating no reference cycles; the cyclic collector would still walk the
    # growing per-tap sets again and again (a third of the time of a large
    # file), so it waits until the file is read.
    with _collector_paused():
        for _, records, problems in iter_batches(path):
            if problems:
                bad.extend(problems.items())
                records = [d for d in records if d is not None]
            if resumed:
                kept = []
                for d in records:
                    if attempts.superseded(d):
                        names.add(d["name"])
                        runs.add(d["run"])
                    else:
                        kept.append(d)
                records = kept
            if everything:
                acc.add_batch(records)
                continue
            matched = []
            for d in records:
                if flt(d):
                    matched.append(d)
                    continue
                names.add(d["name"])
                runs.add(d["run"])
                if flt.key_match(d):
                    acc.see(d)
            acc.add_batch(matched)
    added_names, added_runs = acc.names_and_runs()
    return acc.summaries(), bad, names | added_names, runs | added_runs


def _summarize_merged(path: str | os.PathLike) -> tuple[BatchSummarizer, list[tuple[int, str]]]:
    """Every record of a sharded run's merged stream (checked records),
    until the first of a later attempt (then ``resumed``, and the caller
    starts again)."""
    acc = BatchSummarizer()
    bad: list[tuple[int, str]] = []
    for _, records, problems in iter_batches(path):
        if problems:
            bad.extend(problems.items())
            records = [d for d in records if d is not None]
        acc.add_batch(records)
        if acc.resumed:
            break
    return acc, bad


def _summarize_plain(path: str | os.PathLike) -> tuple[BatchSummarizer, list[tuple[int, str]]]:
    """Every record of one file, orjson's values straight into add_batch,
    which checks the usual records itself (parse_line the rest)."""
    acc = BatchSummarizer()
    bad: list[tuple[int, str]] = []
    for first, items, problems, lines in iter_file_batches(path, unchecked=True):
        if lines is not None:
            acc.add_batch(items, lines, first, bad)
            continue
        if problems:
            bad.extend(problems.items())
            items = [d for d in items if d is not None]
        acc.add_batch(items)
    bad.sort()  # found a tap at a time: back in line order
    return acc, bad
