"""Summary and plot that help hunt: where the first NaN was, statistics of
array taps, auto taps told apart from divergence, and plot options."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pmaptap
from conftest import aligned_table as _table
from conftest import cli, per_device_dict, replicated_dict
from pmaptap.tapfile.analyze.summary import summarize_file, tap_summaries
from pmaptap.tapfile.analyze.table import summary_table


def _dev(step, device, value, name="g", **kw):
    shape = [] if not isinstance(value, list) else [len(value)]
    return per_device_dict(step, device, value, name, **{"shape": shape, **kw})


def _rep(step, value, name="loss", **kw):
    return replicated_dict(step, value, name, **kw)


def _write(tmp_path, recs) -> str:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return str(path)


def test_first_nonfinite_step_and_device(tmp_path):
    recs = [_dev(s, d, 1.0 + d) for s in range(8) for d in range(4)]
    recs[4 * 6 + 1]["value"] = "NaN"  # device 1 at step 6
    recs[4 * 4 + 3]["value"] = "Infinity"  # device 3 at step 4: first
    recs[4 * 5 + 2]["value"] = "-Infinity"
    recs += [_rep(s, "NaN" if s >= 3 else 0.5) for s in range(6)]
    path = _write(tmp_path, recs)
    streamed, _, _, _ = summarize_file(path)
    assert streamed == tap_summaries(pmaptap.read(path))  # same on decoded
    by = {s.name: s for s in streamed}
    assert by["g"].first_nonfinite_step == 4 and by["g"].first_nonfinite_devices == (3,)
    assert by["g"].nonfinite == 3
    assert by["loss"].first_nonfinite_step == 3 and by["loss"].first_nonfinite_devices == ()
    out = cli("summary", path)
    _, rows = _table("\n".join(out.stdout.splitlines()[1:]))
    issues = {r["name"]: r["issues"] for r in rows}
    assert "3 non-finite value(s), first at step 4 on device(s) 3" in issues["g"]
    assert "3 non-finite value(s), first at step 3" in issues["loss"]
    assert "device" not in issues["loss"]


def test_array_taps_get_min_max_mean_and_norm(tmp_path):
    rng = np.random.default_rng(0)
    vals = {(s, d): rng.normal(size=5).round(3) for s in range(3) for d in range(2)}
    recs = [_dev(s, d, v.tolist(), name="act") for (s, d), v in vals.items()]
    recs[-1]["value"][2] = "NaN"  # step 2, device 1
    path = _write(tmp_path, recs)
    (act,), _, _, _ = summarize_file(path)
    assert act == tap_summaries(pmaptap.read(path))[0]
    every = np.concatenate(list(vals.values()))
    finite = np.delete(every, len(every) - 3)  # the NaN'd element
    assert act.min == pytest.approx(finite.min()) and act.max == pytest.approx(finite.max())
    assert act.mean == pytest.approx(finite.mean())
    last_norms = [np.linalg.norm(vals[(2, 0)]), np.linalg.norm(np.delete(vals[(2, 1)], 2))]
    assert act.norm == pytest.approx(max(last_norms))
    assert act.first_nonfinite_step == 2 and act.first_nonfinite_devices == (1,)
    text = summary_table([act])
    _, rows = _table("\n".join(text.splitlines()[1:]))
    assert rows[0]["last"] == "(array)"
    assert float(rows[0]["norm"]) == pytest.approx(max(last_norms), rel=1e-4)
    assert float(rows[0]["mean"]) == pytest.approx(finite.mean(), rel=1e-3, abs=1e-4)


def test_auto_tap_with_differing_copies_is_per_device_data_until_it_agrees(tap_path):
    # Copies differ at steps 0-2, agree at 3, differ again at 4: only step 4
    # is a divergence.
    f = jax.pmap(
        lambda x: pmaptap.tap(x, "w", dedup="auto"), axis_name="i", devices=jax.devices()[:4]
    )
    with pmaptap.Session(tap_path, run="auto"):
        for step in range(5):
            x = jnp.ones(4) if step == 3 else jnp.arange(4.0) + step
            f(x)
    (w,) = tap_summaries(pmaptap.read(tap_path))
    assert w.kinds == ("per_device", "replicated")
    assert w.divergent_steps == (4,) and w.per_device_steps == (0, 1, 2)
    out = cli("summary", tap_path)
    _, rows = _table("\n".join(out.stdout.splitlines()[1:]))
    issues = rows[0]["issues"]
    assert "divergent at 1 step(s) (4)" in issues
    assert "per-device data at 3 step(s) before the copies first agreed (0,1,2)" in issues
    # Never agreed: plain per-device data, no divergence at all.
    only = [r for r in pmaptap.read(tap_path) if r["step"] != 3]
    (w2,) = tap_summaries(only)
    assert w2.divergent_steps == () and w2.kinds == ("per_device",)


@pytest.fixture
def plt():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    yield plt
    plt.close("all")


def test_plot_marks_nonfinite_points_at_the_edge(plt):
    from pmaptap.tapfile.export.plot import build_figure

    recs = [_rep(s, v) for s, v in enumerate([1.0, math.nan, 2.0, math.inf, -math.inf, 3.0])]
    fig = build_figure(recs, "loss")
    ax = fig.axes[0]
    got = {c.get_label(): c.get_offsets()[:, 0].tolist() for c in ax.collections}
    assert got == {"NaN": [1], "+inf": [3], "-inf": [4]}
    assert "3 non-finite value(s), marked" in ax.get_title()


def test_plot_logy_and_smooth(plt, tmp_path):
    from pmaptap.tapfile.export.plot import build_figure, smoothed

    ys = [10.0, 8.0, math.nan, 4.0, 2.0, 1.0]
    recs = [_rep(s, v) for s, v in enumerate(ys)]
    fig = build_figure(recs, "loss", logy=True, smooth=3)
    ax = fig.axes[0]
    assert ax.get_yscale() == "log"
    lines = {line.get_label(): line for line in ax.get_lines()}
    smooth = lines["replicated"].get_ydata()
    # Trailing mean of 3, the NaN skipped (not blanking its windows).
    want = [10.0, 9.0, 9.0, 6.0, 3.0, 7.0 / 3]
    assert np.allclose(smooth, want)
    assert smoothed([math.nan], 2)[0] != smoothed([math.nan], 2)[0]  # NaN
    raw = [line for line in ax.get_lines() if line is not lines["replicated"]]
    assert len(raw) == 1 and np.allclose(raw[0].get_ydata(), ys, equal_nan=True)
    path = _write(tmp_path, recs)
    png = str(tmp_path / "l.png")
    out = cli("plot", path, "--name", "loss", "--logy", "--smooth", "3", "-o", png)
    assert out.returncode == 0, out.stderr
    with open(png, "rb") as f:
        assert f.read(4) == b"\x89PNG"
    out = cli("plot", path, "--name", "loss", "--smooth", "-2", "-o", png)
    assert out.returncode == 2 and "--smooth" in out.stderr


def test_plot_auto_tap_marks_divergence_only_after_agreement(plt):
    from pmaptap.tapfile.export.plot import build_figure

    recs = [_dev(s, d, float(d + s), name="w") for s in (0, 1) for d in range(2)]
    recs.append(_rep(2, 5.0, name="w"))
    recs += [_dev(3, d, float(d), name="w") for d in range(2)]
    fig = build_figure(recs, "w")
    ax = fig.axes[0]
    marks = [c for c in ax.collections if c.get_label() == "divergent"]
    assert len(marks) == 1
    assert sorted(marks[0].get_offsets()[:, 0].tolist()) == [3, 3]


def test_plot_many_devices_draws_median_band_and_names_outliers(plt):
    from pmaptap.tapfile.export.plot import build_figure

    rng = np.random.default_rng(1)
    recs = []
    for s in range(20):
        for d in range(32):
            v = 1.0 + 0.01 * rng.normal()
            if d == 7 and s >= 10:
                v += 5.0  # one device strays
            recs.append(_dev(s, d, v, name="gn"))
    recs[5 * 32 + 3]["value"] = math.nan  # marked, not in the band
    fig = build_figure(recs, "gn")
    ax = fig.axes[0]
    labels = sorted(line.get_label() for line in ax.get_lines())
    assert labels == ["device 7", "median of 32 devices"]
    median = next(line for line in ax.get_lines() if line.get_label().startswith("median"))
    assert np.allclose(median.get_ydata(), 1.0, atol=0.05)
    band = [c for c in ax.collections if c.get_label() == "min-max of 32 devices"]
    assert len(band) == 1
    top = band[0].get_paths()[0].vertices[:, 1].max()
    assert top == pytest.approx(6.0, abs=0.1)  # the band spans the outlier
    assert [c.get_label() for c in ax.collections if c.get_label() == "NaN"] == ["NaN"]
    # 5-16 devices: a panel and a line each.
    fig = build_figure([r for r in recs if r["device"] < 16], "gn")
    assert [len(ax.get_lines()) for ax in fig.axes] == [1] * 16


def test_plot_of_a_few_devices_draws_small_multiples_with_their_own_marks(plt):
    from pmaptap.tapfile.export.plot import build_figure

    recs = [_dev(s, d, float(s + d), name="gn") for s in range(6) for d in range(8)]
    recs[3 * 8 + 5]["value"] = math.nan  # device 5, step 3
    fig = build_figure(recs, "gn")
    assert len(fig.axes) == 8
    for d, ax in enumerate(fig.axes):
        assert ax.get_title() == f"device {d}"
        (line,) = ax.get_lines()
        assert list(line.get_xdata()) == list(range(6))
        nan = [c for c in ax.collections if c.get_label() == "NaN"]
        assert [c.get_offsets()[:, 0].tolist() for c in nan] == ([[3]] if d == 5 else [])
    assert "1 non-finite value(s)" in fig._suptitle.get_text()
    # Up to 4 devices: one axes, a line each.
    fig = build_figure([r for r in recs if r["device"] < 4], "gn")
    assert len(fig.axes) == 1 and len(fig.axes[0].get_lines()) == 4
