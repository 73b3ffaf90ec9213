"""PNG plots for asset metadata and reports (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def markdown_image(png: bytes, alt: str) -> str:
    """Markdown that embeds the PNG inline (a data URI), as the Dagster UI renders it."""
    return f"![{alt}](data:image/png;base64,{base64.b64encode(png).decode()})"


def cluster_sizes(
    kmeans_sizes: Sequence[int] | np.ndarray, sizes: Sequence[int] | np.ndarray, cap: int
) -> bytes:
    """Bars of cluster sizes before and after the capacity step, with the cap as a line."""
    k = len(sizes)
    fig, ax = plt.subplots(figsize=(max(4, 0.6 * k + 2), 3))
    x = np.arange(k)
    ax.bar(x - 0.2, kmeans_sizes, width=0.4, label="k-means")
    ax.bar(x + 0.2, sizes, width=0.4, label="after capacity step")
    ax.axhline(cap, color="k", linestyle="--", linewidth=1, label=f"cap = {cap}")
    ax.set_xlabel("cluster")
    ax.set_ylabel("samples")
    ax.set_xticks(x)
    ax.legend(fontsize=8)
    return _png(fig)


def pca_map(
    x: np.ndarray,
    labels: np.ndarray,
    selected: np.ndarray | None = None,
    max_points: int = 20000,
    seed: int = 0,
) -> bytes:
    """2-D PCA of (N, d) embeddings coloured by cluster; selected samples ringed in black."""
    rng = np.random.default_rng(seed)
    idx = rng.choice(len(x), size=min(len(x), max_points), replace=False)
    xs = x[idx] - x[idx].mean(axis=0)
    _, _, vt = np.linalg.svd(xs, full_matrices=False)
    xy = xs @ vt[:2].T
    fig, ax = plt.subplots(figsize=(5.5, 4))
    lab = labels[idx]
    colors = plt.cm.tab10(np.arange(10))
    for c in np.unique(lab):
        mask = lab == c
        ax.scatter(
            xy[mask, 0],
            xy[mask, 1],
            color=colors[c % 10],
            s=8,
            alpha=0.7,
            label=f"cluster {c} ({int(mask.sum())})",
        )
    if selected is not None:
        sel = selected[idx]
        ax.scatter(
            xy[sel, 0],
            xy[sel, 1],
            facecolors="none",
            edgecolors="k",
            s=18,
            linewidths=0.6,
            label=f"selected ({int(sel.sum())})",
        )
    ax.legend(fontsize=7, loc="best")
    ax.set_xlabel("PC 1")
    ax.set_ylabel("PC 2")
    return _png(fig)


def loss_curves(steps: Sequence[int], per_rank: Sequence[Sequence[float]]) -> bytes:
    """Training loss per rank (un-weighted mean token loss) against optimizer step."""
    fig, ax = plt.subplots(figsize=(5, 3))
    arr = np.asarray(per_rank, dtype=float)
    for r in range(arr.shape[1] if arr.ndim == 2 else 0):
        ax.plot(steps, arr[:, r], marker=".", label=f"rank {r}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend(fontsize=8)
    return _png(fig)


def metric_bars(
    values: Mapping[str, Mapping[str, float]],
    title: str = "",
    errors: Mapping[str, Mapping[str, float]] | None = None,
) -> bytes:
    """One panel per metric, one bar per model (``values[model][metric]``), with error bars
    from ``errors[model][metric]`` (e.g. the std over seeds) where given."""
    models = list(values)
    metrics = sorted({m for v in values.values() for m in v})
    fig, axes = plt.subplots(1, len(metrics), figsize=(3 * len(metrics), 3), squeeze=False)
    for ax, metric in zip(axes[0], metrics, strict=True):
        heights = [values[m].get(metric, np.nan) for m in models]
        yerr = [(errors or {}).get(m, {}).get(metric, 0.0) for m in models]
        ax.bar(
            range(len(models)),
            heights,
            yerr=yerr if any(yerr) else None,
            capsize=3,
            color=plt.cm.tab10(np.arange(len(models)) % 10),
        )
        ax.set_xticks(range(len(models)))
        ax.set_xticklabels(models, rotation=20, fontsize=8)
        ax.set_title(metric, fontsize=9)
    if title:
        fig.suptitle(title, fontsize=10)
    return _png(fig)


def named_curves(
    curves: Mapping[str, Sequence[tuple[float, float]]], xlabel: str, ylabel: str
) -> bytes:
    """One line per name through its (x, y) points."""
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    for name, points in curves.items():
        xs, ys = zip(*points, strict=True) if points else ((), ())
        ax.plot(xs, ys, marker=".", label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
    return _png(fig)


def scatter_labelled(points: Sequence[tuple[float, float, str]], xlabel: str, ylabel: str) -> bytes:
    """(x, y, label) points, each labelled."""
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for x, y, label in points:
        ax.scatter([x], [y], s=25)
        ax.annotate(label, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    return _png(fig)


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both axes (lower x and lower y are
    better), sorted by x."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front, best = [], float("inf")
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return front


def decision(rows: Sequence[Mapping], metric: str) -> bytes:
    """Quality against cost: ``metric`` (lower is better) against selection + training seconds
    and against data fraction, one line per selector over its ratios, ``full`` as a star, the
    Pareto front (cost vs quality) ringed. ``rows`` are aggregated report rows (keys group,
    selector, ratio, data_fraction, train_seconds, selection_seconds, ``metric``,
    ``metric``_std)."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    seconds = [
        float(r["train_seconds"])
        + (float(r["selection_seconds"]) if np.isfinite(r["selection_seconds"]) else 0.0)
        for r in rows
    ]
    xs_by = {"seconds": seconds, "fraction": [float(r["data_fraction"]) for r in rows]}
    ys = [float(r[metric]) for r in rows]
    errs = [float(r.get(f"{metric}_std", 0.0)) for r in rows]
    front = set(pareto_front(list(zip(seconds, ys, strict=True))))
    for ax, (key, label) in zip(
        axes,
        (("seconds", "selection + training seconds"), ("fraction", "data fraction")),
        strict=True,
    ):
        xs = xs_by[key]
        for k, selector in enumerate(dict.fromkeys(r["selector"] for r in rows)):
            idx = sorted(
                (i for i, r in enumerate(rows) if r["selector"] == selector), key=lambda i: xs[i]
            )
            marker = "*" if selector == "full" else "o"
            ax.errorbar(
                [xs[i] for i in idx],
                [ys[i] for i in idx],
                yerr=[errs[i] for i in idx],
                marker=marker,
                markersize=9 if selector == "full" else 5,
                capsize=3,
                label=selector,
                color=plt.cm.tab10(k % 10),
            )
            for i in idx:
                ratio = rows[i]["ratio"]
                ax.annotate(
                    f"r={ratio}",
                    (xs[i], ys[i]),
                    fontsize=6,
                    xytext=(3, 3),
                    textcoords="offset points",
                )
        ax.scatter(
            [xs[i] for i in front],
            [ys[i] for i in front],
            s=160,
            facecolors="none",
            edgecolors="k",
            linewidths=1,
            label="Pareto front (time)",
        )
        ax.set_xlabel(label)
        ax.set_ylabel(metric)
    axes[0].legend(fontsize=7)
    return _png(fig)
