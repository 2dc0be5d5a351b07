"""``pmaptap plot``: a PNG line plot of one tap's value against its step.

One line for a replicated tap, one line per device for a per-device tap.
Divergent points are marked with red crosses: replicated records flagged
``divergent`` (copies disagreed; every distinct value is drawn), and, for a
``dedup="auto"`` tap (a name with both kinds of records), the per-device
records, which exist only where the copies disagreed. matplotlib is an
optional extra (``pip install "pmaptap[plot]"``).
"""
from __future__ import annotations

import math
import os
from collections import defaultdict
from typing import Sequence

from pmaptap.tapfile.views import scalar
from pmaptap.errors import PlotError

MISSING_MATPLOTLIB = ('pmaptap plot needs matplotlib, an optional extra: '
                      'pip install "pmaptap[plot]" (or pip install matplotlib)')
_MAX_LEGEND = 16



def _import_pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError(MISSING_MATPLOTLIB) from e
    # No display on a cluster node: render to files only.
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _label(r: dict, multi_run: bool) -> str:
    if r.get("kind") == "per_device":
        d = r.get("device")
        coords = ",".join(f"{k}={v}" for k, v in (r.get("coords") or {}).items())
        label = f"device {d}" if d is not None else (coords or "device ?")
    else:
        label = "replicated"
    return f"{r.get('run')}: {label}" if multi_run else label


def _device_order(label: str) -> tuple:
    tail = label.rsplit("device ", 1)[-1]
    return (0, int(tail)) if tail.isdigit() else (1, label)


def build_figure(records: Sequence[dict], name: str):
    """The matplotlib Figure for tap ``name`` of ``records`` (decoded dicts).
    The caller closes it (``plt.close(fig)``)."""
    recs = [r for r in records if r.get("name") == name]
    if not recs:
        names = sorted({r.get("name") for r in records})
        raise PlotError(f"no records named {name!r}; taps in this file: "
                        f"{', '.join(names) or '(none)'}")
    bad = next((r for r in recs if scalar(r.get("value")) is None), None)
    if bad is not None:
        raise PlotError(f"tap {name!r} has non-scalar values (shape "
                        f"{bad.get('shape')}, step {bad.get('step')}); plot "
                        "draws scalar taps only. Try pmaptap export --csv.")
    plt = _import_pyplot()
    multi_run = len({r.get("run") for r in recs}) > 1
    auto = len({r.get("kind") for r in recs} & {"replicated", "per_device"}) == 2
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    marks: list[tuple[int, float]] = []
    nonfinite = 0
    for r in recs:
        x = scalar(r["value"])
        if not math.isfinite(x):
            nonfinite += 1
        divergent = bool(r.get("divergent")) or (auto and r.get("kind") == "per_device")
        if divergent:
            marks.append((r["step"], x))
        if divergent and r.get("kind") == "replicated":
            # A divergent replicated step has several values and no single
            # "replicated" point: it is drawn by its marks, and a NaN breaks
            # the line there instead of bridging the disagreement.
            x = math.nan
        series[_label(r, multi_run)].append((r["step"], x))
        if auto and r.get("kind") == "per_device":
            series[_label(dict(r, kind="replicated"), multi_run)].append(
                (r["step"], math.nan))   # break the replicated line here too
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for label in sorted(series, key=_device_order):
        pts = sorted(dict(series[label]).items())   # one point per step
        ax.plot([p[0] for p in pts], [p[1] for p in pts],
                marker="." if len(pts) < 50 else None, linewidth=1.2,
                label=label)
    if marks:
        ax.scatter([m[0] for m in marks], [m[1] for m in marks], marker="x",
                   color="red", s=40, zorder=5, label="divergent")
    title = name
    if nonfinite:
        title += f"  ({nonfinite} non-finite value(s) not drawn)"
    ax.set_title(title)
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))   # steps are ints
    ax.set_xlabel("step")
    ax.set_ylabel("value")
    ax.grid(True, alpha=0.3)
    if len(series) + bool(marks) <= _MAX_LEGEND:
        ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def plot_tap(records: Sequence[dict], name: str, out: str | os.PathLike) -> str:
    """Draw tap ``name`` of ``records`` (decoded dicts) into the PNG ``out``."""
    fig = build_figure(records, name)
    plt = _import_pyplot()
    try:
        fig.savefig(os.fspath(out), format="png")
    finally:
        plt.close(fig)
    return os.fspath(out)
