"""Figures for asset metadata and the report, each one meant to be read at a glance.

Every figure states what it shows in its title, labels both axes with their units, keeps its
legend outside the data and is saved whole (``bbox_inches="tight"``, nothing clipped). The
``*_figure`` functions build a :class:`matplotlib.figure.Figure` (tests inspect its titles and
labels); :func:`png` saves one. Figures are built without pyplot (no global state, safe in
Dagster's threads and processes), and PNG needs no display (Agg).
"""

from __future__ import annotations

import base64
import functools
import io
import math
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from cluster_pipeline.evaluation.statistics import Comparison, p_text

if TYPE_CHECKING:  # matplotlib is imported where a figure is drawn: loading the Definitions
    # (the web UI, every CLI run) does not pay for it
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

_DPI = 100
# The widest a figure is drawn (inches; pixels at _DPI): Dagster's Markdown dialog, where the
# asset pages open a figure, is 1,120 px wide in a 1,400-px browser window (issue 44: a
# 1,614-px metrics figure hid its last panel there). Figures with more panels than fit wrap
# onto more rows (:func:`panel_grid`); titles wrap at :data:`TITLE_CHARS`.
MAX_WIDTH_IN = 10.5
PANEL_WIDTH_IN = 4.4
TITLE_CHARS = 95
# Smaller than this many steps, a curve is drawn as it is: there is nothing to smooth.
_SMOOTH_MIN_STEPS = 6


@functools.cache
def _palette():
    from matplotlib import colormaps

    return colormaps["tab10"]  # 10 qualitative colours


def color(i: int) -> tuple[float, ...]:
    """The ``i``-th colour of the qualitative palette (tab10), cycling: (r, g, b, a)."""
    palette = _palette()
    return tuple(palette(i % palette.N))


def _figure(**kwargs) -> Figure:
    """A new figure (``layout="constrained"``, no pyplot); the one place matplotlib's figure
    module is imported."""
    from matplotlib.figure import Figure

    return Figure(layout="constrained", **kwargs)


def panel_grid(panels: int, extra_in: float = 1.5) -> tuple[int, int]:
    """(rows, columns) for ``panels`` panels of :data:`PANEL_WIDTH_IN` inches plus
    ``extra_in`` inches of labels, at most :data:`MAX_WIDTH_IN` wide: as many columns as fit,
    the rest on further rows (at least one of each)."""
    fit = max(1, int((MAX_WIDTH_IN - extra_in) // PANEL_WIDTH_IN))
    cols = max(1, min(panels, fit))
    return math.ceil(max(panels, 1) / cols), cols


def _integer_x_ticks(ax: Axes) -> None:
    """Ticks at whole numbers only on the x axis (steps, cluster indices)."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def png(fig: Figure, dpi: int = _DPI) -> bytes:
    """``fig`` as PNG bytes, cropped to what it draws (titles and outside legends included).

    Args:
        fig: a figure from one of this module's ``*_figure`` functions.
        dpi: pixels per inch (the figures are sized in inches, 5-11 wide).
    """
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight", pad_inches=0.15)
    return buf.getvalue()


def markdown_image(png_bytes: bytes, alt: str) -> str:
    """Markdown that embeds the PNG inline (a data URI), as the Dagster UI renders it."""
    return f"![{alt}](data:image/png;base64,{base64.b64encode(png_bytes).decode()})"


def wrap(text: str, width: int = 100) -> str:
    """``text`` broken into lines of at most ``width`` characters (a title that fits)."""
    return "\n".join(textwrap.wrap(text, width)) if text else text


def smoothing_window(steps: int) -> int:
    """The odd window (in optimizer steps) of :func:`smooth` for a curve of ``steps`` points:
    1 (no smoothing) under 6 points, else about a quarter of the curve, at least 3 (19 steps
    -> 5, 100 -> 25)."""
    if steps < _SMOOTH_MIN_STEPS:
        return 1
    return max(3, 2 * round(steps / 8) + 1)


def smooth(values: Sequence[float] | np.ndarray, window: int) -> np.ndarray:
    """Centred moving average of ``values`` over ``window`` points (odd), the window shrunk
    to the points that exist at either end and NaNs skipped; a point whose window holds no
    finite value stays NaN.

    Args:
        values: (n,) float, one value per optimizer step.
        window: points averaged, odd, >= 1 (1 returns ``values`` as floats).

    Raises:
        ValueError: ``window`` is even or below 1.
    """
    if window < 1 or window % 2 == 0:
        raise ValueError(f"smoothing window must be odd and >= 1, got {window}")
    v = np.asarray(values, dtype=float)
    half = window // 2
    out = np.full(v.shape, np.nan)
    for i in range(len(v)):
        part = v[max(0, i - half) : i + half + 1]
        part = part[np.isfinite(part)]
        if part.size:
            out[i] = part.mean()
    return out


def _outside_legend(fig: Figure, handles: list, labels: list[str], ncols: int = 3) -> None:
    """One legend for the whole figure, below the axes (it covers no data)."""
    fig.legend(
        handles,
        labels,
        loc="outside lower center",
        ncols=max(1, min(ncols, len(labels))),
        fontsize=8,
        frameon=False,
    )


# --- Clusters ---------------------------------------------------------------------------------


def cluster_sizes_figure(
    kmeans_sizes: Sequence[int] | np.ndarray, sizes: Sequence[int] | np.ndarray, cap: int
) -> Figure:
    """Bars of cluster sizes (samples) at the nearest centroid (k-means) and after the capacity
    step, the cap as a dashed line; counts on the bars up to 16 clusters.

    Args:
        kmeans_sizes: (K,) samples per cluster at the nearest centroid.
        sizes: (K,) samples per cluster after the capacity step.
        cap: the capacity ceil(alpha N / K), samples.
    """
    k = len(sizes)
    fig = _figure(figsize=(max(5.5, 0.55 * k + 3), 3.6))
    ax = fig.add_subplot()
    x = np.arange(k)
    before = ax.bar(x - 0.2, kmeans_sizes, width=0.4, color=color(0))
    after = ax.bar(x + 0.2, sizes, width=0.4, color=color(1))
    cap_line = ax.axhline(cap, color="k", linestyle="--", linewidth=1)
    if k <= 16:
        ax.bar_label(before, fontsize=7, padding=1)
        ax.bar_label(after, fontsize=7, padding=1)
    top = max([cap, *np.asarray(kmeans_sizes).tolist(), *np.asarray(sizes).tolist()])
    ax.set_ylim(0, top * 1.15)
    ax.set_xlabel("cluster (trained on the rank of the same number)")
    ax.set_ylabel("samples")
    if k <= 20:
        ax.set_xticks(x)
    else:
        _integer_x_ticks(ax)
    ax.set_title(f"Cluster sizes, K = {k}: k-means and after the capacity step", fontsize=10)
    _outside_legend(
        fig,
        [before, after, cap_line],
        ["nearest centroid (k-means)", "after the capacity step", f"cap = {cap} samples"],
    )
    return fig


def explained_variance(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 2-D PCA of (n, d) points and the share of their variance each axis explains.

    Returns:
        ((n, 2) float coordinates on PC 1 and PC 2, (2,) float fractions of the total
        variance, NaN when the points do not vary).
    """
    xs = np.asarray(x, dtype=np.float64)
    xs = xs - xs.mean(axis=0)
    _, s, vt = np.linalg.svd(xs, full_matrices=False)
    total = float((s**2).sum())
    var = s[:2] ** 2 / total if total > 0 else np.full(min(2, len(s)), np.nan)
    xy = xs @ vt[:2].T
    if xy.shape[1] < 2:  # one dimension, or one point: a flat second axis
        xy = np.column_stack([xy, np.zeros((len(xy), 2 - xy.shape[1]))])
        var = np.concatenate([var, np.full(2 - len(var), np.nan)])
    return xy, var


def _pct(v: float) -> str:
    return "n/a" if not math.isfinite(v) else f"{100 * v:.1f} %"


def pca_map_figure(
    x: np.ndarray,
    labels: np.ndarray,
    selected: np.ndarray | None = None,
    title: str = "Proxy embeddings by cluster",
    max_points: int = 20000,
    seed: int = 0,
) -> Figure:
    """Scatter of (N, d) embeddings on their first two principal components, coloured by
    cluster; ``selected`` samples ringed in black. Each axis says the share of the variance it
    explains (of a seeded sample of at most ``max_points`` rows).

    Args:
        x: (N, d) float embeddings (unit-normalised as clustered).
        labels: (N,) int cluster per row.
        selected: (N,) bool, the selected samples, or None.
        title: the figure's title (the sample size and the variance explained are appended).
        max_points: rows drawn at most (a seeded sample).
        seed: the sample's seed.
    """
    rng = np.random.default_rng(seed)
    idx = rng.choice(len(x), size=min(len(x), max_points), replace=False)
    xy, var = explained_variance(x[idx])
    lab = np.asarray(labels)[idx]
    fig = _figure(figsize=(7, 4.6))
    ax = fig.add_subplot()
    handles, names = [], []
    for c in np.unique(lab):
        mask = lab == c
        handles.append(ax.scatter(xy[mask, 0], xy[mask, 1], color=color(int(c)), s=9, alpha=0.75))
        names.append(f"cluster {c}: {int(mask.sum())} samples")
    if selected is not None:
        sel = np.asarray(selected)[idx]
        handles.append(
            ax.scatter(
                xy[sel, 0],
                xy[sel, 1],
                facecolors="none",
                edgecolors="k",
                s=24,
                linewidths=0.7,
            )
        )
        names.append(f"selected: {int(sel.sum())} samples")
    ax.set_xlabel(f"PC 1 ({_pct(var[0])} of the variance)")
    ax.set_ylabel(f"PC 2 ({_pct(var[1])} of the variance)")
    both = var[0] + var[1]
    shown = f"{len(idx)} samples" + ("" if len(idx) == len(x) else f" of {len(x)}")
    ax.set_title(
        f"{wrap(title, 70)}\n({shown}; PC 1 + PC 2 explain {_pct(both)} of the variance)",
        fontsize=10,
    )
    fig.legend(handles, names, loc="outside right upper", fontsize=8, frameon=False)
    return fig


# --- Training ---------------------------------------------------------------------------------


def _raw_and_smoothed(ax: Axes, steps, values, c, linestyle="-") -> Line2D:
    """Draw a curve's points faint and its :func:`smooth` line bold; returns the bold line."""
    v = np.asarray(values, dtype=float)
    window = smoothing_window(len(v))
    if window == 1:  # too few steps to smooth: the points themselves, marked
        (line,) = ax.plot(steps, v, color=c, linewidth=2.0, linestyle=linestyle, marker="o")
        return line
    ax.plot(steps, v, color=c, alpha=0.3, linewidth=0.8, marker=".", markersize=4)
    (line,) = ax.plot(steps, smooth(v, window), color=c, linewidth=2.0, linestyle=linestyle)
    return line


def loss_curves_figure(steps: Sequence[int], per_rank: Sequence[Sequence[float]]) -> Figure:
    """Training loss per rank against optimizer step: each step's value faint, a centred
    moving average (:func:`smooth`) bold.

    Args:
        steps: (S,) optimizer step numbers.
        per_rank: (S, K) loss per step and rank, nats/token: each rank's mean over its
            response tokens, before the rank weight w_c multiplies it.
    """
    arr = np.asarray(per_rank, dtype=float)
    ranks = arr.shape[1] if arr.ndim == 2 else 0
    fig = _figure(figsize=(7, 3.8))
    ax = fig.add_subplot()
    lines = [_raw_and_smoothed(ax, steps, arr[:, r], color(r)) for r in range(ranks)]
    window = smoothing_window(len(steps))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats/token)")
    _integer_x_ticks(ax)
    how = f"bold: mean over {window} steps, faint: each step" if window > 1 else "each step"
    ax.set_title(f"Training loss per rank, before the rank weight w_c\n({how})", fontsize=10)
    _outside_legend(fig, lines, [f"rank {r}" for r in range(ranks)], ncols=8)
    return fig


def useful_compute_figure(steps: Sequence[int], fractions: Sequence[float]) -> Figure:
    """The useful-compute fraction per optimizer step, on a 0-1 scale with 1 marked.

    Args:
        steps: (S,) optimizer step numbers.
        fractions: (S,) real tokens / (ranks x the busiest rank's tensor tokens) of the step
            (training/plan.py): 1 = no padding and no rank waits for another.
    """
    fig = _figure(figsize=(7, 3.6))
    ax = fig.add_subplot()
    (line,) = ax.plot(steps, fractions, marker=".", color=color(0), linewidth=1.5)
    ideal = ax.axhline(1.0, color="k", linestyle="--", linewidth=1)
    ax.set_ylim(0, 1.08)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("useful compute (fraction)")
    _integer_x_ticks(ax)
    mean = float(np.nanmean(np.asarray(fractions, dtype=float))) if len(fractions) else math.nan
    ax.set_title(
        f"Useful compute per step (mean {mean:.3f})\n"
        "real tokens / (ranks x the busiest rank's tensor tokens)",
        fontsize=10,
    )
    _outside_legend(fig, [line, ideal], ["this run", "1 = no padding, no rank waits"])
    return fig


def run_loss_curves_figure(
    curves: Mapping[str, Sequence[tuple[float, float]]], groups: Mapping[str, str]
) -> Figure:
    """Training loss of every compared run: one colour per group, one line style per run of a
    group (its seeds), each step faint and a centred moving average bold.

    Args:
        curves: run name -> (optimizer step, loss in nats/token, mean over ranks) per step.
        groups: run name -> its group (what seeds are averaged over).
    """
    fig = _figure(figsize=(7.5, 4))
    ax = fig.add_subplot()
    order = list(dict.fromkeys(groups[name] for name in curves))
    styles = ["-", "--", ":", "-."]
    seen: dict[str, int] = {}
    lines, names = [], []
    for name, points in curves.items():
        group = groups[name]
        k = seen[group] = seen.get(group, -1) + 1
        xs, ys = zip(*points, strict=True) if points else ((), ())
        lines.append(
            _raw_and_smoothed(ax, xs, ys, color(order.index(group)), styles[k % len(styles)])
        )
        names.append(name)
    longest = max((len(p) for p in curves.values()), default=0)
    window = smoothing_window(longest)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (nats/token, mean over ranks)")
    _integer_x_ticks(ax)
    how = "bold: smoothed, faint: each step" if window > 1 else "each step"
    ax.set_title(f"Training loss of each compared run ({how})", fontsize=10)
    _outside_legend(fig, lines, names, ncols=2)
    return fig


def time_vs_fraction_figure(
    points: Sequence[tuple[float, float, str]],
    estimate: tuple[float, float] | None = None,
) -> Figure:
    """Training seconds against data fraction, one colour per group; with ``estimate``, the
    dashed line of full-data training estimated as training / data fraction through that
    run.

    Args:
        points: (data fraction, training seconds, group) per run.
        estimate: (data fraction, training seconds) of the run the estimate starts from, or
            None when full-data training was measured.
    """
    fig = _figure(figsize=(7, 4))
    ax = fig.add_subplot()
    order = list(dict.fromkeys(g for _, _, g in points))
    handles, names = [], []
    for i, group in enumerate(order):
        xs = [x for x, _, g in points if g == group]
        ys = [y for _, y, g in points if g == group]
        handles.append(ax.scatter(xs, ys, color=color(i), s=30, zorder=3))
        names.append(f"{group} ({len(xs)} run{'s' if len(xs) > 1 else ''})")
    if estimate is not None and estimate[0] > 0:
        f, s = estimate
        (line,) = ax.plot([0, 1], [0, s / f], color="k", linestyle="--", linewidth=1)
        handles.append(line)
        names.append(f"full-data estimate: training / fraction = {s / f:.1f} s")
    ax.set_xlim(0, 1.05)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("data fraction (distinct samples trained / training pool)")
    ax.set_ylabel("training time (s)")
    ax.set_title("Training time against data fraction, one point per run", fontsize=10)
    _outside_legend(fig, handles, names, ncols=2)
    return fig


# --- Evaluation -------------------------------------------------------------------------------


def metric_differences_figure(
    comparisons: Sequence[Comparison],
    base_values: Mapping[str, float],
    units: Mapping[str, str],
) -> Figure:
    """Every fine-tuned group against the base model, one panel per metric: the difference
    with its 95 % paired bootstrap interval (the report's comparisons with ``base``), a
    dashed line at 0 (= the base model's value, in the panel title).

    Args:
        comparisons: the report's comparisons whose reference is the base model, in order.
        base_values: metric -> the base model's value.
        units: metric -> its unit (``nats/token``, ``fraction of problems``).
    """
    metrics = list(dict.fromkeys(c.metric for c in comparisons))
    groups = list(dict.fromkeys(c.candidate for c in comparisons))
    rows, cols = panel_grid(len(metrics))
    fig = _figure(
        figsize=(PANEL_WIDTH_IN * cols + 1.5, rows * (1.4 + 0.55 * max(2, len(groups))) + 0.4),
    )
    grid = fig.subplots(rows, cols, squeeze=False, sharey=True)
    axes = [ax for row in grid for ax in row]
    for ax in axes[len(metrics) :]:  # the last row's empty places
        ax.set_visible(False)
    for ax, metric in zip(axes, metrics, strict=False):
        rows = [c for c in comparisons if c.metric == metric]
        ys = [groups.index(c.candidate) for c in rows]
        diffs = np.asarray([c.difference for c in rows])
        err = np.asarray(
            [[c.difference - c.low for c in rows], [c.high - c.difference for c in rows]]
        )
        for j, c in enumerate(rows):
            ax.errorbar(
                [diffs[j]],
                [ys[j]],
                xerr=err[:, j : j + 1],
                fmt="o",
                color=color(groups.index(c.candidate)),
                markersize=6,
                capsize=3,
                linewidth=1.5,
                zorder=3,
            )
            # The verdict beside its interval: an interval clear of 0 with a large p (few
            # items) is no finding, and must not read as one.
            ax.annotate(
                f"{c.verdict}, p {p_text(c.p_value, equals=True)}",
                (diffs[j], ys[j]),
                xytext=(0, 7),
                textcoords="offset points",
                ha="center",
                fontsize=7,
            )
        ax.axvline(0.0, color="k", linestyle="--", linewidth=1)
        better = "lower" if rows[0].lower_is_better else "higher"
        unit = units.get(metric, "")
        ax.set_xlabel(f"difference from base{f' ({unit})' if unit else ''}; {better} is better")
        base = base_values.get(metric, math.nan)
        ax.set_title(f"{metric}\n(base model: {base:.4g})", fontsize=9)
        ax.margins(x=0.15)
    for row in grid:
        row[0].set_yticks(range(len(groups)), groups, fontsize=8)
        row[0].set_ylabel("fine-tuned model (group)")
    axes[0].set_ylim(len(groups) - 0.5, -0.5)
    fig.suptitle(
        wrap(
            "Fine-tuned models against the base model: difference, 95 % paired bootstrap "
            "interval (seeds resampled too), verdict and sign-flip test p",
            TITLE_CHARS,
        ),
        fontsize=10,
    )
    return fig


@dataclass(frozen=True)
class DecisionPoint:
    """One group's cost and quality against one reference, as :func:`decision_figure` draws it.

    Attributes:
        group: the candidate group (``peripheral r=0.5``).
        reference: the reference group (``random_global r=0.5``, ``full r=1.0``, ``base``).
        kind: which panel: ``random_global``, ``full`` or ``base``.
        saved_seconds: full-data training seconds - (selection + training seconds), mean over
            the group's runs; positive = time saved.
        saved_std: sample standard deviation of that over the runs (0 for one run).
        comparison: the paired comparison of ``group`` with ``reference`` on the metric.
        current: whether ``group`` holds this run's checkpoint.
        runs: how many runs (seeds) of ``group`` the means are over.
    """

    group: str
    reference: str
    kind: str
    saved_seconds: float
    saved_std: float
    comparison: Comparison
    current: bool
    runs: int = 1


_PANEL_TITLES = {
    "random_global": "against random_global at the same ratio (same budget, no clusters)",
    "full": "against full-data training",
    "base": "against the base model (no fine-tuning)",
}


def decision_figure(
    points: Sequence[DecisionPoint], unit: str, subtitle: str = "", full_note: str = ""
) -> Figure:
    """Was the subset worth it? Net time saved (x) against the quality difference with its 95 %
    interval (y), one panel per kind of reference (random_global at the same ratio, full data;
    the base model only when neither ran). The quadrant where time was saved and quality is
    better is shaded green, the one where time was lost and quality is worse red; this run's
    group is the star.

    Args:
        points: one per (group, reference), in panel order.
        unit: the metric's unit (``nats/token``).
        subtitle: the answer in words for this run's group (a line of the title).
        full_note: how full-data training time was obtained (measured or estimated), for the
            x label.
    """
    from matplotlib.patches import Patch

    kinds = list(dict.fromkeys(p.kind for p in points))
    groups = list(dict.fromkeys(p.group for p in points))
    rows, cols = panel_grid(len(kinds), extra_in=0.5)
    fig = _figure(figsize=(PANEL_WIDTH_IN * cols + 0.5, 4.0 * rows + 0.6))
    grid = fig.subplots(rows, cols, squeeze=False)
    axes = [ax for row in grid for ax in row]
    for ax in axes[len(kinds) :]:
        ax.set_visible(False)
    metric = points[0].comparison.metric if points else ""
    lower = points[0].comparison.lower_is_better if points else True
    handles: dict[str, object] = {}
    for ax, kind in zip(axes, kinds, strict=False):
        mine = [p for p in points if p.kind == kind]
        for p in mine:
            c, i = p.comparison, groups.index(p.group)
            handles[p.group] = ax.errorbar(
                [p.saved_seconds],
                [c.difference],
                yerr=[[c.difference - c.low], [c.high - c.difference]],
                xerr=[[p.saved_std], [p.saved_std]] if p.saved_std > 0 else None,
                fmt="*" if p.current else "o",
                markersize=14 if p.current else 7,
                color=color(i),
                capsize=3,
                linewidth=1.5,
                zorder=3,
            )
        _shade_quadrants(ax, mine, lower)
        refs = sorted({p.reference for p in mine})
        ax.set_title(f"{_PANEL_TITLES.get(kind, kind)}\n({', '.join(refs)})", fontsize=9)
        ax.set_xlabel(
            "net time saved (s): full-data training - selection - training"
            + (f"\n{full_note}" if full_note else ""),
            fontsize=8,
        )
        ax.set_ylabel(
            f"difference in {metric} ({unit}),\n{'below' if lower else 'above'} 0 = better",
            fontsize=8,
        )
    labels = [
        f"{g} (this run)" if any(p.current for p in points if p.group == g) else g for g in groups
    ]
    extra = [
        Patch(color="tab:green", alpha=0.15),
        Patch(color="tab:red", alpha=0.15),
    ]
    _outside_legend(
        fig,
        [*handles.values(), *extra],
        [*labels, "saves time and better: worth it", "costs time and worse"],
        ncols=2,
    )
    fig.suptitle(
        "Was the subset worth it?" + (f"\n{wrap(subtitle, TITLE_CHARS)}" if subtitle else ""),
        fontsize=10,
    )
    return fig


def _shade_quadrants(ax: Axes, points: Sequence[DecisionPoint], lower_is_better: bool) -> None:
    """Axes that show 0 on both axes with a margin around every point and interval; the
    good quadrant green, the bad one red, the zero lines dashed."""
    xs = [0.0] + [p.saved_seconds + s * p.saved_std for p in points for s in (-1, 1)]
    ys = [0.0] + [v for p in points for v in (p.comparison.low, p.comparison.high)]
    xs = [v for v in xs if math.isfinite(v)]
    ys = [v for v in ys if math.isfinite(v)]
    x_pad = 0.15 * ((max(xs) - min(xs)) or 1.0)
    y_pad = 0.15 * ((max(ys) - min(ys)) or 1.0)
    x0, x1 = min(xs) - x_pad, max(xs) + x_pad
    y0, y1 = min(ys) - y_pad, max(ys) + y_pad
    good_y = (y0, 0.0) if lower_is_better else (0.0, y1)
    bad_y = (0.0, y1) if lower_is_better else (y0, 0.0)
    ax.fill_between([0.0, x1], *good_y, color="tab:green", alpha=0.15, linewidth=0, zorder=0)
    ax.fill_between([x0, 0.0], *bad_y, color="tab:red", alpha=0.15, linewidth=0, zorder=0)
    ax.axhline(0.0, color="k", linestyle="--", linewidth=0.8, zorder=1)
    ax.axvline(0.0, color="k", linestyle="--", linewidth=0.8, zorder=1)
    ax.set_xlim(x0, x1)
    ax.set_ylim(y0, y1)
