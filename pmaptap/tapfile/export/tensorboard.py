"""``pmaptap export --tensorboard DIR``: records as TensorBoard event files
(docs/cli.md); a resumed run's replayed steps reopen the run's writer with
``purge_step``, so TensorBoard ends with one point per step."""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import itertools
import logging
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

from pmaptap._log import log
from pmaptap.errors import optional
from pmaptap.tapfile.analyze import divergence_series
from pmaptap.tapfile.read import Attempts, Filter, Stored, attempt_of, leaves, scan
from pmaptap.tapfile.record import FINGERPRINT, curve_tag, decode_record, first_holder
from pmaptap.tapfile.source import Run, iter_lines, parsed, records

_UNSAFE = re.compile(r"[^A-Za-z0-9._=+-]")


# Characters of a run's directory name at most (NAME_MAX is 255 bytes); a
# longer one is cut and ends in a hash of the whole run id.
RUN_DIRNAME_MAX = 128
_RUN_HASH_HEX = 16


def run_dirname(run: Any) -> str:
    """A run id as one directory name (never a path: a hand-edited run id
    cannot write outside DIR)."""
    text = str(run)
    name = _UNSAFE.sub("_", text)
    name = "_" + name if name in ("", ".", "..") else name
    return name if len(name) <= RUN_DIRNAME_MAX else _hashed(name, text)


def _hashed(name: str, run_id: str) -> str:
    """``name`` cut to leave room for ``-`` and a hash of the whole run id."""
    data = run_id.encode("utf-8", "surrogatepass")
    digest = hashlib.blake2b(data, digest_size=_RUN_HASH_HEX // 2).hexdigest()
    return name[: RUN_DIRNAME_MAX - _RUN_HASH_HEX - 1] + "-" + digest


def tag_parts(rec: dict, *, mark_divergent: bool = False) -> tuple[str, str]:
    """What a scalar's tag puts before and after its leaf path (docs/cli.md);
    ``mark_divergent``: a divergent copy's own series (docs/forwarders.md)."""
    # A looped tap: one series per iteration (act_rms/3).
    base = curve_tag(rec.get("name"), rec.get("iteration"))
    if rec.get("pass", "forward") != "forward":
        base += f"@{rec['pass']}"
    suffix = ""
    if rec.get("kind") == "per_device":
        d = rec.get("device")
        suffix = f"/device_{'unknown' if d is None else d}"
    elif mark_divergent and rec.get("divergent"):
        suffix = f"/divergent/device_{first_holder(rec)}"
    return base, suffix


def _flat(value: Any) -> Iterator[Any]:
    if isinstance(value, list):
        for v in value:
            yield from _flat(v)
    else:
        yield value


@dataclasses.dataclass
class Stats:
    """What an export wrote, for the closing message and for tests."""

    records: int = 0
    scalars: int = 0
    histograms: int = 0
    skipped_leaves: int = 0
    meta: int = 0
    superseded: int = 0  # late lines of an attempt a later one replaced
    runs: set[str] = dataclasses.field(default_factory=set)
    # Every name and run read (filtered out or not), to list them when
    # nothing matched.
    names: set = dataclasses.field(default_factory=set)
    all_runs: set = dataclasses.field(default_factory=set)

    def text(self) -> str:
        extra = ""
        if self.meta:
            extra += f"; {self.meta} meta record(s) not exported"
        if self.superseded:
            extra += f"; {self.superseded} record(s) superseded by a later attempt"
        if self.skipped_leaves:
            extra += f"; {self.skipped_leaves} non-numeric leaf value(s) skipped"
        return (
            f"{self.records} records as {self.scalars} scalar points and "
            f"{self.histograms} histograms in {len(self.runs)} run(s){extra}"
        )


# Event files opened by this process, for names that differ (see _open): one
# count for every export and forwarder of the process.
_FILE_IDS = itertools.count(1)


@dataclasses.dataclass
class _Attempt:
    """The latest attempt a run's writer wrote (its first step: purged from)."""

    attempt: int
    first: int
    last: int


class TensorBoardExport:
    """Decoded records to event files, a SummaryWriter per run."""

    def __init__(
        self,
        outdir: str | os.PathLike,
        path: str | os.PathLike = "",
        *,
        purge: bool = True,
        mark_divergent: bool = False,
    ) -> None:
        tensorboardx = optional("tensorboardX", "pmaptap export --tensorboard", "tensorboard")
        self._writer_cls = tensorboardx.SummaryWriter
        self._stored = Stored(path, [])  # the tap file's stored values
        self.outdir = os.fspath(outdir)
        self._writers: dict[str, Any] = {}
        self._logdirs: dict[Any, str] = {}
        # run -> its _Attempt: what the run's writer wrote, to purge when a
        # later attempt replays steps (off for --all-attempts).
        self._attempts: dict[Any, _Attempt] = {}
        self._purge = purge
        self._mark_divergent = mark_divergent
        self.stats = Stats()
        # tensorboardX warns on every NaN/inf it writes: in a tap file they are
        # the data being looked for (a filter per export: closing one leaves another's).
        self._quiet = lambda rec: "NaN or Inf found" not in rec.getMessage()
        self._x2num = logging.getLogger("tensorboardX.x2num")
        self._x2num.addFilter(self._quiet)

    def _logdir(self, run: Any) -> str:
        logdir = self._logdirs.get(run)
        if logdir is None:
            name = run_dirname(run)
            if name in self.stats.runs:
                # Another run id of this file made the same name ("a b" and
                # "a_b"): this one's series must not land in that run.
                name = _hashed(name, str(run))
            logdir = self._logdirs[run] = os.path.join(self.outdir, name)
            self.stats.runs.add(name)
        return logdir

    def _open(self, run: Any, purge_step: int | None, warn: bool = True) -> Any:
        logdir = self._logdir(run)
        if warn and purge_step is None and glob.glob(os.path.join(logdir, "events.out.tfevents.*")):
            log.warning(
                f"pmaptap export: {logdir} already holds event files; "
                "TensorBoard will show their points too (export into a "
                "new directory to avoid doubles)"
            )
        # tensorboardX names a file by the second it was opened: the suffix keeps
        # a writer reopened (purge) within that second from replacing the file before.
        suffix = f".{os.getpid()}.{next(_FILE_IDS):06d}"
        # flush_secs is a ceiling; follow mode flushes after each poll.
        return self._writer_cls(
            logdir=logdir, flush_secs=5, purge_step=purge_step, filename_suffix=suffix
        )

    def _writer(self, rec: dict) -> Any:
        """The writer of ``rec``'s run (None: a later attempt replaced it)."""
        run = rec.get("run")
        w = self._writers.get(run)
        if not self._purge:
            if w is None:
                w = self._writers[run] = self._open(run, None)
            return w
        step, attempt = rec.get("step"), attempt_of(rec)
        st = self._attempts.get(run)
        if st is None or attempt > st.attempt:
            # The first record of a later attempt: from its step on,
            # TensorBoard must show this attempt's points only.
            replays = attempt > 0 and (st is None or step <= st.last)
            if w is not None and replays:
                w.close()
            if w is None or replays:
                w = self._writers[run] = self._open(run, step if replays else None, warn=st is None)
            last = step if st is None or replays else max(st.last, step)
            self._attempts[run] = _Attempt(attempt, step, last)
            return w
        if attempt < st.attempt and step >= st.first:
            return None  # a late line of an earlier attempt, superseded
        st.last = max(st.last, step)
        if w is None:  # written to before close(): carry on, no purge
            w = self._writers[run] = self._open(run, None, warn=False)
        return w

    def add(self, rec: dict) -> None:
        """One decoded record (``decode_record``: NaN/inf as floats)."""
        kind = rec.get("kind")
        if kind == "meta":
            self.stats.meta += 1
            return
        w = self._writer(rec)
        if w is None:
            self.stats.superseded += 1
            return
        step = rec.get("step")
        wall = rec.get("time")
        wall = float(wall) if isinstance(wall, (int, float)) else None
        self.stats.records += 1
        if kind == FINGERPRINT:  # copies that differ, never the fingerprint
            series = divergence_series(rec)
        else:
            base, suffix = tag_parts(rec, mark_divergent=self._mark_divergent)
            series = (
                (base + path + suffix, v)
                for path, v, _ in leaves(rec.get("value"), rec.get("dtype"))
            )
        for tag, v in series:
            self._leaf(w, tag, v, step, wall)

    def _leaf(self, w: Any, tag: str, v: Any, step: int, wall: float | None) -> None:
        if isinstance(v, (int, float)):  # bool too
            w.add_scalar(tag, float(v), step, walltime=wall)
            self.stats.scalars += 1
        elif isinstance(v, complex):
            w.add_scalar(f"{tag}/real", v.real, step, walltime=wall)
            w.add_scalar(f"{tag}/imag", v.imag, step, walltime=wall)
            self.stats.scalars += 2
        elif isinstance(v, list) or (hasattr(v, "dtype") and hasattr(v, "shape")):
            self._histogram(w, tag, v, step, wall)  # a list, or a stored value loaded
        else:
            self.stats.skipped_leaves += 1

    def _histogram(self, w: Any, tag: str, v: Any, step: int, wall: float | None) -> None:
        """A histogram of ``v``'s finite numbers (complex: magnitude) and
        their others' count as ``<tag>/nonfinite`` (docs/cli.md)."""
        import numpy as np

        if isinstance(v, list):
            items = list(_flat(v))
            nums = [
                abs(x) if isinstance(x, complex) else float(x)
                for x in items
                if isinstance(x, (int, float, complex))
            ]
            if len(nums) < len(items):
                self.stats.skipped_leaves += 1
            arr = np.asarray(nums, dtype=np.float64)
        elif v.dtype.kind == "c":
            arr = np.abs(v).astype(np.float64).ravel()
        elif v.dtype.kind in "biufV":
            arr = v.astype(np.float64).ravel()  # bfloat16 / float8 widen exactly
        else:
            self.stats.skipped_leaves += 1
            return
        finite = arr[np.isfinite(arr)]
        if finite.size:
            w.add_histogram(tag, finite, step, walltime=wall)
            self.stats.histograms += 1
        if finite.size < arr.size:
            w.add_scalar(f"{tag}/nonfinite", float(arr.size - finite.size), step, walltime=wall)
            self.stats.scalars += 1

    def take(self, lineno: int, d: dict, flt: Filter, report: Callable[[int, str], None]) -> None:
        """``add`` the record ``d`` if ``flt`` keeps it (``report``: missing stored bytes)."""
        rec = decode_record(d)
        if not flt(rec):
            return
        if "bytes" in d and not self._stored.load(rec, lineno):
            report(*self._stored.bad.pop())
        else:
            self.add(rec)

    def flush(self) -> None:
        for w in self._writers.values():
            w.flush()

    def close_files(self) -> None:
        """Every event on disk (tensorboardX's ``flush()`` does not wait for
        its writer thread); a later ``add`` opens a new event file."""
        for w in self._writers.values():
            w.close()
        self._writers.clear()

    def close(self) -> None:
        self.close_files()
        self._x2num.removeFilter(self._quiet)


def export(
    path: str | os.PathLike, outdir: str | os.PathLike, flt: Filter
) -> tuple[Stats, list[tuple[int, str]]]:
    """The whole file converted, streamed (every value written: no divergence
    marks needed): the counts and the lines skipped."""
    path = Run.of(path)
    # The superseded records are left out below: nothing to purge.
    tb = TensorBoardExport(outdir, path, purge=False)
    bad: list[tuple[int, str]] = []
    # Steps a later attempt of a resumed run replayed: its values only.
    attempts = scan(path) if not flt.all_attempts else Attempts()
    try:
        for lineno, d in records(iter_lines(path), lambda n, why: bad.append((n, why))):
            tb.stats.names.add(d.get("name"))
            tb.stats.all_runs.add(d.get("run"))
            if not (attempts and attempts.superseded(d)):
                tb.take(lineno, d, flt, lambda n, why: bad.append((n, why)))
    finally:
        tb.close()
    return tb.stats, bad


def follow(
    path: str | os.PathLike,
    outdir: str | os.PathLike,
    flt: Filter,
    *,
    interval: float = 0.5,
    timeout: float | None = None,
) -> Stats:
    """``export --tensorboard --follow``: flushed after every poll."""
    from pmaptap.tapfile.read import open_follower, polls, stop_on_signals

    path = Run.of(path)
    tb = TensorBoardExport(outdir, path, purge=not flt.all_attempts)
    lf = open_follower(path)  # one file, or a sharded run's shards
    restarts = 0

    def report(lineno: int, problem: str) -> None:
        log.warning(f"pmaptap export: line {lineno}: {problem} (skipped)")

    try:
        with stop_on_signals() as stop:
            for _ in polls(stop, interval, timeout):
                for lineno, d in records(parsed(lf.poll()), report):
                    tb.take(lineno, d, flt, report)
                tb.flush()
                if lf.restarted != restarts:
                    restarts = lf.restarted
                    log.warning(
                        f"pmaptap export: {path} was replaced or truncated; "
                        "converting it again from its start"
                    )
        if lf.pending:
            log.warning(
                f"pmaptap export: the last line is unterminated "
                f"({len(lf.pending)} bytes: being written, or torn); "
                "not converted"
            )
    finally:
        lf.close()
        tb.close()
    return tb.stats
