"""``pmaptap plot``: a PNG of one tap's value against its step (docs/cli.md)."""

from __future__ import annotations

import math
import os
import warnings
from collections import defaultdict
from typing import Iterator, Sequence

from pmaptap.errors import PlotError, optional
from pmaptap.tapfile.read import leaves, scalar
from pmaptap.tapfile.record import FINGERPRINT, curve_tag

_MAX_LEGEND = 16
# More device series than this are drawn as small multiples (a panel each),
# up to _MAX_LEGEND; past that, as a median and band.
_MAX_LINES = 4


def _import_pyplot():
    matplotlib = optional("matplotlib", "pmaptap plot", "plot")
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
    it = r.get("iteration")
    if it is not None:
        # A looped tap: one curve per iteration (act_rms/3: replicated).
        label = f"{curve_tag(r.get('name'), it)}: {label}"
    return f"{r.get('run')}: {label}" if multi_run else label


def _device_order(label: str) -> tuple:
    tail = label.rsplit("device ", 1)[-1]
    return (0, int(tail)) if tail.isdigit() else (1, label)


def smoothed(ys: Sequence[float], n: int) -> list[float]:
    """Trailing mean of the last ``n`` finite points (NaN where none is)."""
    windows = [list(filter(math.isfinite, ys[max(0, i - n + 1) : i + 1])) for i in range(len(ys))]
    return [math.fsum(w) / len(w) if w else math.nan for w in windows]


def per_leaf(r: dict) -> Iterator[dict]:
    """``r``, or for a pytree value one record per leaf named by its path (``stats/mean``)."""
    dtype = r.get("dtype")
    if not isinstance(dtype, (dict, list)) or r.get("kind") == FINGERPRINT:
        yield r
        return
    shapes = {path: shape for path, shape, _ in leaves(r.get("shape"), dtype)}
    for path, v, leaf_dtype in leaves(r.get("value"), dtype):
        yield {
            **r,
            "name": f"{r.get('name')}{path}",
            "value": v,
            "dtype": leaf_dtype,
            "shape": shapes.get(path),
        }


def build_figure(records: Sequence[dict], name: str, *, logy: bool = False, smooth: int = 0):
    """The Figure of tap ``name`` (or leaf ``stats/mean``); the caller closes it."""
    if smooth < 0:
        raise PlotError(f"smooth must be a number of points >= 1 (or 0: off), got {smooth}")
    records = [leaf for r in records for leaf in per_leaf(r)]
    recs = [r for r in records if r.get("name") == name]
    if not recs:
        names = sorted({r.get("name") for r in records})
        of_tree = [n for n in names if str(n).startswith(f"{name}/")]
        if of_tree:
            raise PlotError(
                f"tap {name!r} is a pytree: plot one of its leaves, --name {' or '.join(of_tree)}"
            )
        raise PlotError(
            f"no records named {name!r}; taps in this file: {', '.join(names) or '(none)'}"
        )
    if any(r.get("kind") == FINGERPRINT for r in recs):
        raise PlotError(
            f"{name!r} is a pmaptap.fingerprint name: its records hold fingerprints "
            "of the devices' copies, no values to draw; pmaptap summary names "
            "where its copies differed."
        )
    bad = next((r for r in recs if scalar(r.get("value")) is None), None)
    if bad is not None:
        raise PlotError(
            f"tap {name!r} has non-scalar values (shape "
            f"{bad.get('shape')}, step {bad.get('step')}); plot "
            "draws scalar taps only. Try pmaptap export --csv."
        )
    plt = _import_pyplot()
    multi_run = len({r.get("run") for r in recs}) > 1
    auto = len({r.get("kind") for r in recs} & {"replicated", "per_device"}) == 2
    # An auto tap diverges only once its copies have agreed (see summary.py).
    agreed = min(r["step"] for r in recs if r.get("kind") == "replicated") if auto else None
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    # Per series (a panel of the small multiples draws its own): divergent points, non-finite steps.
    marks: dict[str, list[tuple[int, float]]] = defaultdict(list)
    bad: dict[str, dict[str, list[int]]] = defaultdict(lambda: {k: [] for k in _NONFINITE})
    for r in recs:
        label = _label(r, multi_run)
        x = scalar(r["value"])
        if not math.isfinite(x):
            bad[label]["NaN" if math.isnan(x) else "+inf" if x > 0 else "-inf"].append(r["step"])
        divergent = bool(r.get("divergent")) or (
            auto and r.get("kind") == "per_device" and r["step"] > agreed
        )
        if divergent:
            marks[label].append((r["step"], x))
        if divergent and r.get("kind") == "replicated":
            # A divergent replicated step has no single point: drawn by its
            # marks, with a NaN breaking the line there.
            x = math.nan
        series[label].append((r["step"], x))
        if auto and r.get("kind") == "per_device":  # break the replicated line here too
            series[_label(dict(r, kind="replicated"), multi_run)].append((r["step"], math.nan))
    nonfinite = sum(len(v) for b in bad.values() for v in b.values())
    title = name
    if nonfinite:
        title += f"  ({nonfinite} non-finite value(s), marked at the edge)"
    if smooth > 1:
        title += f"  [mean of {smooth}]"
    devices = [lb for lb in series if "device" in lb]
    if _MAX_LINES < len(devices) <= _MAX_LEGEND:
        return _small_multiples(plt, series, marks, bad, title, logy=logy, smooth=smooth)
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    if len(devices) > _MAX_LEGEND:
        # Too many devices for a panel each: median, band and outliers.
        series.update(_band(ax, {lb: series.pop(lb) for lb in devices}, smooth))
    every_mark = [m for lb in marks for m in marks[lb]]
    every_bad = {k: [s for b in bad.values() for s in b[k]] for k in _NONFINITE}
    _draw(ax, series, every_mark, every_bad, logy=logy, smooth=smooth)
    ax.set(title=title, xlabel="step", ylabel="value")
    if len(series) + bool(every_mark) <= _MAX_LEGEND:
        ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


_NONFINITE = ("NaN", "+inf", "-inf")


def _small_multiples(plt, series, marks, bad, title: str, *, logy: bool, smooth: int):
    """One panel per series (5-16 devices: one axes would be a tangle)."""
    labels = sorted(series, key=_device_order)
    ncols = 4
    nrows = math.ceil(len(labels) / ncols)
    fig, axes = plt.subplots(
        nrows,
        ncols,
        figsize=(3.2 * ncols, 2.3 * nrows + 0.7),
        dpi=100,
        sharex=True,
        sharey=True,
        squeeze=False,
    )
    flat = axes.ravel()
    for ax, label in zip(flat, labels):
        _draw(
            ax, {label: series[label]}, marks.get(label, []), bad[label], logy=logy, smooth=smooth
        )
        ax.set_title(label, fontsize="small")
        if marks.get(label) or any(bad[label].values()):
            ax.legend(fontsize="x-small")
    for ax in flat[len(labels) :]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    for ax in axes[:, 0]:
        ax.set_ylabel("value")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def _draw(ax, series, marks, bad, *, logy: bool, smooth: int) -> None:
    """``series``, divergent ``marks`` and non-finite steps ``bad`` in ``ax``."""
    for label in sorted(series, key=_device_order):
        pts = sorted(dict(series[label]).items())  # one point per step
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        if smooth > 1:
            (raw,) = ax.plot(xs, ys, linewidth=0.8, alpha=0.3)
            ax.plot(xs, smoothed(ys, smooth), linewidth=1.4, label=label, color=raw.get_color())
        else:
            ax.plot(xs, ys, marker="." if len(pts) < 50 else None, linewidth=1.2, label=label)
    if marks:
        ax.scatter(*zip(*marks), marker="x", color="red", s=40, zorder=5, label="divergent")
    if logy:
        # Values <= 0 have no place on a log axis: matplotlib masks them.
        ax.set_yscale("log", nonpositive="mask")
    # Non-finite values at the axes' edge (x in data, y in axes coordinates),
    # so a NaN step is seen where it happened rather than silently missing.
    edge = ax.get_xaxis_transform()
    for label, y, marker, color in (
        ("NaN", 0.98, "X", "purple"),
        ("+inf", 0.98, "^", "darkorange"),
        ("-inf", 0.02, "v", "darkorange"),
    ):
        if bad[label]:
            ax.scatter(
                bad[label],
                [y] * len(bad[label]),
                transform=edge,
                marker=marker,
                color=color,
                s=36,
                zorder=6,
                clip_on=False,
                label=label,
            )
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are ints
    ax.grid(True, alpha=0.3)


# At most this many outlying devices are drawn and named over the band.
_MAX_OUTLIERS = 5


def _band(
    ax, per_device: dict[str, list[tuple[int, float]]], smooth: int
) -> dict[str, list[tuple[int, float]]]:
    """Draw the per-step median and min-max band of many devices; return
    the outliers to draw as lines (docs/cli.md), farthest first."""
    import numpy as np

    steps = sorted({s for pts in per_device.values() for s, _ in pts})
    col = {s: i for i, s in enumerate(steps)}
    grid = np.full((len(per_device), len(steps)), np.nan)
    labels = list(per_device)
    for i, lb in enumerate(labels):
        for s, y in per_device[lb]:
            grid[i, col[s]] = y
    grid[~np.isfinite(grid)] = np.nan  # non-finite: marked at the edge
    with warnings.catch_warnings():  # an all-NaN step: NaN, quietly
        warnings.simplefilter("ignore", RuntimeWarning)
        med = np.nanmedian(grid, axis=0)
        lo, hi = np.nanmin(grid, axis=0), np.nanmax(grid, axis=0)
        dist = np.nanmean(np.abs(grid - med), axis=1)
    typical = np.nanmedian(dist) if np.isfinite(dist).any() else np.nan
    line = smoothed(med.tolist(), smooth) if smooth > 1 else med
    ax.fill_between(
        steps, lo, hi, alpha=0.2, color="tab:blue", label=f"min-max of {len(labels)} devices"
    )
    ax.plot(steps, line, color="tab:blue", linewidth=1.4, label=f"median of {len(labels)} devices")
    order = [
        i
        for i in np.argsort(-np.nan_to_num(dist, nan=-1.0))
        if np.isfinite(dist[i]) and dist[i] > 3 * typical and (typical > 0 or dist[i] > 0)
    ]
    return {labels[i]: per_device[labels[i]] for i in order[:_MAX_OUTLIERS]}


def plot_tap(
    records: Sequence[dict],
    name: str,
    out: str | os.PathLike,
    *,
    logy: bool = False,
    smooth: int = 0,
) -> str:
    """Draw tap ``name`` into the PNG ``out``."""
    fig = build_figure(records, name, logy=logy, smooth=smooth)
    plt = _import_pyplot()
    try:
        fig.savefig(os.fspath(out), format="png")
    finally:
        plt.close(fig)
    return os.fspath(out)
