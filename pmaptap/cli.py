"""The ``pmaptap`` command (also ``python -m pmaptap``): show, tail,
summary, validate, plot, export, merge and launch, as docs/cli.md
describes them (their options, filters and exit statuses).
"""

from __future__ import annotations

import argparse
import collections
import os
import stat
import sys
from typing import TYPE_CHECKING, Sequence

from pmaptap.errors import CliError, WorkerError

# views (and through it NumPy and orjson) is imported by the commands that
# read, not here: `pmaptap --help` and argument errors stay fast.
if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable, Iterator

    from pmaptap.tapfile import read
    from pmaptap.tapfile.read import Filter, LineFollower, PendingFollower, RunFollower
    from pmaptap.tapfile.source import Run

PROG = "pmaptap"


# ------------------------------------------------------------------ helpers

# A tap file given as a pipe (`cat run.jsonl | pmaptap show /dev/stdin`, a
# FIFO) is read once, into a temporary copy the commands read as often as
# they need (most read a file twice, streaming: tapfile/read/stream.py); its
# copy's path -> the name it was given, for messages.
_SPOOLED: dict[str, str] = {}


def _shown(path: str) -> str:
    """The name the user gave for ``path`` (a pipe's, for its copy)."""
    return _SPOOLED.get(path, path)


def _spool_pipe(args: argparse.Namespace) -> str | None:
    """If ``args.file`` is a pipe, a FIFO, a terminal or a socket (no file
    to read twice: a second pass found it drained, and reported nothing),
    copy it to a temporary directory and read the copy; returns that
    directory (the caller removes it), None for a file. ``--follow`` needs
    a file that grows: refused. The run's stored values are found beside a
    named FIFO (its ``<name>.bytes``, linked next to the copy); a pipe has
    no directory, so they are reported missing."""
    path = getattr(args, "file", None)
    if not isinstance(path, str) or "://" in path:
        return None
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None  # missing: said by _check_file
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    if getattr(args, "follow", False):
        raise CliError(
            f"{path} is not a file but a pipe or device: there is nothing to follow "
            "(--follow waits for a file to grow); give the tap file's path"
        )
    import shutil
    import tempfile

    directory = tempfile.mkdtemp(prefix="pmaptap-")
    copy = os.path.join(directory, os.path.basename(path) or "stdin")
    try:
        with open(path, "rb") as src, open(copy, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        stored = os.path.abspath(path) + ".bytes"
        if os.path.isdir(stored):
            os.symlink(stored, copy + ".bytes")
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    _SPOOLED[copy] = path
    args.file = copy
    return directory


def _check_file(path: str) -> "Run":
    """``path`` resolved once into the Run that the command reads (a str:
    messages and the readers take it as the path it is); CliError when
    there is no run there."""
    from pmaptap.tapfile.source import Run, objects

    run = Run.of(path)
    if run.url:
        try:
            objects(run)  # a missing bucket or prefix: as a missing file
        except FileNotFoundError as e:
            raise CliError(e.strerror) from None
        return run
    if run.sharded:
        return run  # a sharded run (path.d/): read merged, as one file
    if not os.path.exists(run):
        raise CliError(f"no such file: {path}")
    if os.path.isdir(run):
        raise CliError(f"{path} is a directory; give the tap file (.jsonl)")
    return run


def _check_followed(path: str, command: str, follow: bool) -> "Run":
    """``_check_file``, or for a command that follows the run (``follow``):
    a run that does not exist yet (no file, no ``path.d/``, no chunks) is
    waited for, in whichever layout it appears (tapfile/read/follower.py)."""
    from pmaptap.tapfile.source import Run, objects

    if not follow:
        return _check_file(path)
    run = Run.of(path)
    if run.url:
        missing = not objects(run, missing_ok=True)
    else:
        missing = not (os.path.exists(run) or run.sharded)
    if missing:
        print(f"{PROG} {command}: waiting for {path} to appear", file=sys.stderr)
        return run
    return _check_file(run)


def _report_skipped(bad: list[tuple[int, str]], path: str, command: str) -> None:
    bad = [(n, why) for n, why in bad if why != "empty line"]
    if bad:
        from pmaptap.tapfile.analyze import line_text

        n, why = bad[0]
        print(
            f"{PROG} {command}: skipped {len(bad)} invalid line(s) (first: "
            f"{line_text(n)}: {why}); '{PROG} validate {_shown(path)}' lists them",
            file=sys.stderr,
        )


def _filter(args: argparse.Namespace) -> Filter:
    from pmaptap.tapfile.read import Filter, parse_steps

    try:
        steps = parse_steps(args.step) if args.step else (None, None)
    except ValueError as e:
        raise CliError(str(e)) from None
    return Filter(
        names=tuple(args.name or ()),
        steps=steps,
        process=args.process,
        device=args.device,
        run=args.run,
        all_attempts=getattr(args, "all_attempts", False),
    )


def _select_streamed(path: str, command: str, flt: Filter) -> "Callable[[], Iterator[read.Entry]]":
    """The records of ``path`` that ``flt`` keeps, as a function that
    streams them afresh on each call (tapfile/read/stream.py: the first pass is
    done here, once; nothing holds the records). An unknown --name or --run
    is an error and an empty result is said, both listing what the file
    has."""
    from pmaptap.tapfile import read
    from pmaptap.tapfile.read import first_pass

    path = _check_file(path)
    fp = first_pass(path, flt)
    _report_skipped(fp.problems, path, command)

    def entries() -> "Iterator[read.Entry]":
        return read.iter_entries(path, flt, fp)

    if not any(True for _ in read.iter_entries(path, flt, fp, 1)):
        _no_match(command, path, flt, fp.names, fp.runs)
    return entries


def _present(values: set) -> str:
    return ", ".join(sorted(map(str, values))) or "(none)"


def _no_match(command: str, path: str, flt: Filter, names: set, runs: set) -> None:
    """Raise for a --name/--run the file does not have (as ``plot`` does);
    otherwise say on stderr that nothing matched, with what is there."""
    have = f"taps in this file: {_present(names)}; runs: {_present(runs)}"
    unknown = [n for n in flt.names if n not in names]
    path = _shown(path)
    if flt.names and len(unknown) == len(flt.names):
        raise CliError(f"no records named {', '.join(map(repr, unknown))} in {path}; {have}")
    if flt.run is not None and flt.run not in runs:
        raise CliError(f"no run {flt.run!r} in {path}; {have}")
    print(f"{PROG} {command}: no matching records in {path} ({have})", file=sys.stderr)


def _whole(least: int, what: str) -> "Callable[[str], int]":
    """An argparse type: a whole number, ``least`` or more (``what``)."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"wants a whole number, got {text!r}") from None
        if n < least:
            raise argparse.ArgumentTypeError(f"wants {what}, got {n}")
        return n

    return parse


# Counts (-n, --limit, --max-records) and --jobs.
_count = _whole(0, "a count of 0 or more")
_jobs = _whole(1, "1 or more worker processes")


# ------------------------------------------------------------------ commands


def cmd_show(args: argparse.Namespace) -> int:
    """Streams: a first pass indexes divergence and attempts, a second prints
    (--json) or fits the columns, a third prints the table; nothing holds the
    records (tapfile/read/stream.py)."""
    from pmaptap.tapfile import read
    from pmaptap.tapfile.read import first_pass

    flt = _filter(args)
    args.file = _check_file(args.file)
    fp = first_pass(args.file, flt)
    _report_skipped(fp.problems, args.file, "show")

    def entries():
        return read.iter_entries(args.file, flt, fp, args.limit)

    shown = 0
    if args.json:
        for e in entries():
            print(read.json_line(e, attempt=flt.all_attempts))
            shown += 1
    else:
        columns = read.COLUMNS_ALL_ATTEMPTS if flt.all_attempts else read.COLUMNS
        table = read.Table(read.with_run(columns))
        runs = set()
        for e in entries():
            table.fit((read.row(e, args.width),))
            runs.add(e.rec.get("run"))
            shown += 1
        if len(runs) < 2:
            table.without(read.RUN)
        if shown:
            print(table.header())
            for e in entries():
                print(table.format(read.row(e, args.width)))
    if not shown:
        _no_match("show", args.file, flt, fp.names, fp.runs)
    return 0


def cmd_summary(args: argparse.Namespace) -> int:
    from pmaptap.tapfile.analyze import jobs_for, summarize_file, summary_table

    flt = _filter(args)
    args.file = _check_file(args.file)
    summaries, bad, names, runs = summarize_file(args.file, flt, jobs_for(args.file, args.jobs))
    _report_skipped(bad, args.file, "summary")
    if not summaries:
        _no_match("summary", args.file, flt, names, runs)
        return 0
    print(summary_table(summaries))
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from pmaptap.tapfile.analyze import jobs_for, validate_file

    args.file = _check_file(args.file)
    report = validate_file(args.file, jobs_for(args.file, args.jobs))
    shown = report.problems if not args.limit else report.problems[: args.limit]
    name = _shown(args.file)
    for line, why in shown:
        # A line of the file (or merged stream), or of a sharded run's source
        # (source.SourceLine: the shard file and its line).
        where = f"{name}:{line}" if type(line) is int else f"{line.path}:{line.line}"
        print(f"{where}: {why}")
    if len(shown) < len(report.problems):
        print(f"... and {len(report.problems) - len(shown)} more (--limit 0 lists all)")
    note = (
        f"; {report.divergent_keys} divergent replicated step(s) "
        "(data, not a file problem: see pmaptap summary)"
        if report.divergent_keys
        else ""
    )
    if report.divergent_fingerprints:
        note += (
            f"; {report.divergent_fingerprints} step(s) whose fingerprints differ "
            "(data, not a file problem: see pmaptap summary)"
        )
    if report.superseded:
        note += (
            f"; {report.superseded} record(s) superseded by a later "
            "attempt (a resumed run's replayed steps; --all-attempts "
            "shows them)"
        )
    if report.ok:
        print(f"{name}: OK, {report.records} records{note}")
        return 0
    print(
        f"{name}: {len(report.problems)} problem(s) in {report.lines} "
        f"lines, {report.records} valid records{note}"
    )
    return 1


def cmd_plot(args: argparse.Namespace) -> int:
    from pmaptap.tapfile.export import PlotError, per_leaf, plot_tap

    flt = _filter(args)
    flt.names = ()  # plot_tap picks the name and lists the others if absent
    name = args.name[0]
    # Streamed: the plotted tap's records, and one record of each other tap
    # for plot_tap's list of what the file holds (never the whole file).
    recs: list[dict] = []
    others: set = set()
    for e in _select_streamed(args.file, "plot", flt)():
        for r in per_leaf(e.rec):  # a pytree tap's leaves by their paths
            if r.get("name") == name:
                recs.append(r)
            elif r.get("name") not in others:
                others.add(r.get("name"))
                recs.append(r)
    out = args.output or f"{name.replace('/', '_')}.png"
    try:
        plot_tap(recs, name, out, logy=args.logy, smooth=args.smooth)
    except (PlotError, ImportError) as e:
        raise CliError(str(e)) from None
    print(f"wrote {out}", file=sys.stderr)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    if args.follow and not args.tensorboard:
        raise CliError("--follow works with --tensorboard only")
    if args.tensorboard:
        return _export_tensorboard(args)
    if args.parquet:
        return _export_parquet(args)
    from pmaptap.tapfile.export import write_csv

    # Streamed: one pass for the header's columns, one for the rows.
    entries = _select_streamed(args.file, "export", _filter(args))
    if args.csv == "-":
        n = write_csv(entries, sys.stdout)
    else:
        parent = os.path.dirname(os.path.abspath(args.csv))
        if not os.path.isdir(parent):
            raise CliError(f"cannot write {args.csv}: no directory {parent}")
        with open(args.csv, "w", newline="", encoding="utf-8") as f:
            n = write_csv(entries, f)
    print(f"wrote {n} rows to {args.csv}", file=sys.stderr)
    return 0


def _export_tensorboard(args: argparse.Namespace) -> int:
    from pmaptap.tapfile.export import export_tensorboard, follow_tensorboard

    flt = _filter(args)
    args.file = _check_followed(args.file, "export", args.follow)
    if os.path.exists(args.tensorboard) and not os.path.isdir(args.tensorboard):
        raise CliError(f"--tensorboard wants a directory; {args.tensorboard} is a file")
    try:
        if args.follow:
            stats = follow_tensorboard(
                args.file, args.tensorboard, flt, interval=args.interval, timeout=args.timeout
            )
        else:
            stats, bad = export_tensorboard(args.file, args.tensorboard, flt)
            _report_skipped(bad, args.file, "export")
            if not stats.records:
                _no_match("export", args.file, flt, stats.names, stats.all_runs)
    except ImportError as e:
        raise CliError(str(e)) from None
    print(f"wrote {stats.text()} to {args.tensorboard}", file=sys.stderr)
    return 0


def _export_parquet(args: argparse.Namespace) -> int:
    from pmaptap.tapfile.read import write_parquet

    entries = _select_streamed(args.file, "export", _filter(args))
    parent = os.path.dirname(os.path.abspath(args.parquet))
    if not os.path.isdir(parent):
        raise CliError(f"cannot write {args.parquet}: no directory {parent}")
    try:
        # The frame is built while streaming (read/frame.py: FrameBuilder).
        n = write_parquet((e.rec for e in entries()), args.parquet)
    except ImportError as e:
        raise CliError(str(e)) from None
    print(f"wrote {n} rows to {args.parquet}", file=sys.stderr)
    return 0


def cmd_tail(args: argparse.Namespace) -> int:
    """The last ``args.lines`` matching records, then with ``args.follow``
    every new one until a signal, the timeout or the count."""
    from pmaptap.tapfile.read import open_follower

    args.file = _check_followed(args.file, "tail", args.follow)
    lf = open_follower(args.file)
    try:
        return _tail(args, _filter(args), lf)
    finally:
        if lf.pending:
            print(
                f"{PROG} tail: the last line is unterminated "
                f"({len(lf.pending)} bytes: being written, or torn)",
                file=sys.stderr,
            )
        lf.close()


def _tail(
    args: argparse.Namespace,
    flt: Filter,
    lf: "LineFollower | RunFollower | PendingFollower",
) -> int:
    from pmaptap.tapfile.read import follow, matching, stop_on_signals

    # Initial part: keep only the last N matches, so a large file is streamed.
    last = collections.deque(matching(lf, flt), maxlen=max(args.lines, 0))
    printer = _TailPrinter(args)
    printer.emit(list(last))
    if not args.follow or printer.done:
        return 0

    def report(lineno: int, problem: str) -> None:
        print(f"{PROG} tail: line {lineno}: {problem} (skipped)", file=sys.stderr)

    with stop_on_signals() as stop:
        for batch in follow(
            lf, flt, stop=stop, interval=args.interval, timeout=args.timeout, report=report
        ):
            printer.emit(batch)
            if printer.done:
                break
    return 0


class _TailPrinter:
    """Prints tail output; columns are fitted to the first rows and then only
    grow (with room for typical values), since later rows are unknown."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.json = args.json
        self.follow = args.follow
        self.width = args.width
        self.max = args.max_records
        self.count = 0
        self.table: read.Table | None = None

    @property
    def done(self) -> bool:
        return bool(self.max) and self.count >= self.max

    def emit(self, entries: list[read.Entry]) -> None:
        from pmaptap.tapfile import read

        if self.max:
            entries = entries[: max(self.max - self.count, 0)]
        if not entries:
            return
        self.count += len(entries)
        if self.json:
            for e in entries:
                print(read.json_line(e))
        else:
            rows = [read.row(e, self.width) for e in entries]
            if self.table is None:
                self.table = read.Table()
                if self.follow:
                    # Room for rows not seen yet, so columns rarely shift.
                    self.table.widths.update(line=6, name=10, step=6, device=6, value=12)
                self.table.fit(rows)
                print(self.table.header())
            for r in rows:
                print(self.table.format(r))
        # Piped output is block-buffered: follow mode must show rows now.
        sys.stdout.flush()


def cmd_merge(args: argparse.Namespace) -> int:
    from pmaptap.tapfile.export import merge, merge_follow
    from pmaptap.tapfile.read import stop_on_signals

    def report(pos: int, problem: str) -> None:
        print(f"{PROG} merge: line {pos}: {problem} (skipped)", file=sys.stderr)

    try:
        if not args.follow:
            args.file = _check_file(args.file)
            n, bad = merge(args.file, args.output)
            _report_skipped(bad, args.file, "merge")
        else:
            with stop_on_signals() as stop:
                n = merge_follow(
                    args.file,
                    args.output,
                    stop=stop,
                    interval=args.interval,
                    timeout=args.timeout,
                    report=report,
                )
    except ValueError as e:
        raise CliError(str(e)) from None
    print(f"wrote {n} records to {args.output}", file=sys.stderr)
    return 0


def cmd_launch(argv: list[str]) -> int:
    # Imported lazily: the launcher is its own module and may be absent from a
    # trimmed installation; every other subcommand works without it.
    try:
        from pmaptap import launch
    except ImportError as e:
        if getattr(e, "name", None) not in ("pmaptap.launch", None):
            raise  # the launcher exists but one of its imports failed
        raise CliError(
            "the launcher (pmaptap.launch) is not available in this installation"
        ) from None
    rc = launch.main(argv)
    return int(rc or 0)


# ------------------------------------------------------------------ parser


def _add_filters(
    p: argparse.ArgumentParser, *, name_required: bool = False, attempts: bool = True
) -> None:
    g = p.add_argument_group("filters")
    g.add_argument(
        "--name",
        action="append",
        required=name_required,
        metavar="NAME",
        help="tap name (repeat for several)",
    )
    g.add_argument("--step", metavar="A:B", help="step N, or inclusive range A:B, A: or :B")
    g.add_argument("--process", type=int, metavar="P", help="process index")
    g.add_argument("--device", type=int, metavar="D", help="jax Device.id")
    g.add_argument("--run", metavar="RUN", help="run id (a file may hold several)")
    if attempts:
        g.add_argument(
            "--all-attempts",
            action="store_true",
            help="a resumed run: also the records of replayed steps "
            "that a later attempt superseded (each has its "
            "'attempt'); by default only the latest attempt's",
        )


def _add_jobs(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--jobs",
        "-j",
        type=_jobs,
        default=None,
        metavar="N",
        help="worker processes reading pieces of the run (default: the cores this "
        "process may use, fewer for a small run; 1: in this process); the output "
        "is the same",
    )


def _add_output(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="JSON lines, not a table")
    p.add_argument("--width", type=int, default=60, help="value column width")


def _add_export_targets(p: argparse.ArgumentParser) -> None:
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--csv", metavar="OUT", help="CSV file to write ('-' for stdout)")
    target.add_argument(
        "--parquet", metavar="OUT", help="Parquet file, one row per record (needs pyarrow)"
    )
    target.add_argument(
        "--tensorboard",
        metavar="DIR",
        help="TensorBoard event files, one run per DIR/<run>/ (needs tensorboardX)",
    )
    _add_follow(
        p.add_argument_group("--tensorboard --follow"),
        "with --tensorboard: keep converting what the job appends "
        "(Ctrl-C or SIGTERM stops, exit status 0)",
        0.5,
        flag="--follow",
        metavar="SECONDS",
    )


def _add_follow(
    p: argparse._ActionsContainer,
    follow_help: str,
    interval: float,
    *,
    flag: str = "-f",
    metavar: str | None = None,
) -> None:
    """-f/--follow, and the --timeout and --interval that go with it."""
    p.add_argument("-f", "--follow", action="store_true", help=follow_help)
    p.add_argument(
        "--timeout",
        type=float,
        metavar="SECONDS",
        help=f"with {flag}: stop after this many seconds",
    )
    p.add_argument(
        "--interval",
        type=float,
        default=interval,
        metavar=metavar,
        help=f"with {flag}: seconds between polls (default {interval:g})",
    )


class _Version(argparse.Action):
    """``--version``, worked out only when asked (the metadata lookup is
    not free, and every command builds this parser)."""

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
        from importlib.metadata import PackageNotFoundError, version

        import msgspec

        try:
            number = version("pmaptap")
        except PackageNotFoundError:  # run from a source tree
            number = "(not installed)"
        # The library every line is decoded with (tapfile/record/schema.py).
        print(f"{PROG} {number}: records decoded by msgspec {msgspec.__version__}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Look at pmaptap tap files (JSON lines).",
        epilog="Exit status: 0 ok, 1 validate found problems, 2 usage/input error.",
    )
    parser.add_argument(
        "--version",
        action=_Version,
        nargs=0,
        help="the version, and that of the library that decodes records (msgspec)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("show", help="aligned table of the matching records")
    p.add_argument("file")
    _add_filters(p)
    p.add_argument("--limit", type=_count, default=0, help="first N matches only")
    _add_output(p)
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("tail", help="last records; -f follows appends live")
    p.add_argument("file")
    _add_filters(p, attempts=False)
    p.add_argument(
        "-n",
        "--lines",
        type=_count,
        default=10,
        help="how many of the last matching records (default 10)",
    )
    _add_follow(
        p,
        "keep printing records as writers append them (Ctrl-C or SIGTERM stops, exit status 0)",
        0.2,
    )
    p.add_argument(
        "--max-records",
        type=_count,
        default=0,
        metavar="N",
        help="stop after printing N records (initial ones included)",
    )
    _add_output(p)
    p.set_defaults(func=cmd_tail)

    p = sub.add_parser("summary", help="per tap: counts, steps, stats, issues")
    p.add_argument("file")
    _add_filters(p)
    _add_jobs(p)
    p.set_defaults(func=cmd_summary)

    p = sub.add_parser("validate", help="check every line; exit 1 on problems")
    p.add_argument("file")
    p.add_argument(
        "--limit", type=_count, default=200, help="list at most N problems (0: all; default 200)"
    )
    _add_jobs(p)
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("plot", help="PNG line plot of one tap (needs matplotlib)")
    p.add_argument("file")
    _add_filters(p, name_required=True)
    p.add_argument("-o", "--output", metavar="PNG", help="output file (default NAME.png)")
    p.add_argument("--logy", action="store_true", help="log value axis (values <= 0 are not drawn)")
    p.add_argument(
        "--smooth",
        type=_count,
        default=0,
        metavar="N",
        help="draw the trailing mean over N points over the raw line",
    )
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("export", help="records as CSV, Parquet or TensorBoard event files")
    p.add_argument("file")
    _add_filters(p)
    _add_export_targets(p)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("merge", help="a sharded run (path.d/, s3://...) as one tap file")
    p.add_argument("file", help="the run: its path, its .d directory or its URL")
    p.add_argument("-o", "--output", required=True, metavar="OUT")
    _add_follow(p, "keep appending records as they are written (Ctrl-C or SIGTERM stops)", 0.5)
    p.set_defaults(func=cmd_merge)

    sub.add_parser(
        "launch", add_help=False, help="local multi-process launcher (pmaptap launch --help)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    command = args_list[0] if args_list else None
    try:
        if command == "launch":
            # Everything after "launch" belongs to the launcher, options too.
            return cmd_launch(args_list[1:])
        parser = build_parser()
        args = parser.parse_args(args_list)
        if args.command is None:
            parser.print_help(sys.stderr)
            return 2
        if args.command == "plot" and len(args.name) > 1:
            raise CliError("plot draws one tap: give --name once")
        spooled = _spool_pipe(args)
        try:
            return args.func(args)
        finally:
            if spooled is not None:
                import shutil

                _SPOOLED.pop(args.file, None)
                shutil.rmtree(spooled, ignore_errors=True)
    except CliError as e:
        print(f"{PROG} {command}: error: {e}", file=sys.stderr)
        return 2
    except WorkerError as e:  # --jobs N: a worker failed or was killed
        first, _, rest = str(e).partition("\n")
        print(f"{PROG} {command}: error: {first}", file=sys.stderr)
        if rest:
            print(rest, file=sys.stderr, end="" if rest.endswith("\n") else "\n")
        return 2
    except BrokenPipeError:
        # `pmaptap show f | head`: the reader left; exit quietly. Point
        # stdout at devnull so the interpreter's final flush cannot fail too.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except OSError as e:  # unreadable file, full disk for export, ...
        print(f"{PROG} {command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C during show/summary of a big file
        print(f"{PROG} {command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
