"""The comparison report: models side by side, seeds aggregated, Markdown and plots."""

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cluster_pipeline.core import plots
from cluster_pipeline.core.formats import EVAL_CONFIG_NAME

BENCHMARKS = ("humaneval", "mbpp", "mmlu", "mmlu_medical")
DEFAULT_BENCHMARKS = {"python_stdlib": ("humaneval", "mbpp")}


def dataset_benchmarks(dataset: str, raw_dir: Path) -> tuple[str, ...]:
    """The benchmarks that apply to a dataset partition: ``benchmarks`` in
    ``data/raw/<dataset>/eval.json`` if present, else the built-in default (code benchmarks for
    python_stdlib), else none (held-out loss only).

    Raises:
        ValueError: eval.json names an unknown benchmark.
    """
    path = raw_dir / dataset / EVAL_CONFIG_NAME
    if path.exists():
        try:
            names = tuple(json.loads(path.read_text()).get("benchmarks", ()))
        except (ValueError, AttributeError) as e:
            raise ValueError(f"{path}: expected a JSON object like "
                             '{"benchmarks": ["mmlu_medical"]} ' f"({e})") from None
        unknown = set(names) - set(BENCHMARKS)
        if unknown:
            raise ValueError(f"{path}: unknown benchmarks {sorted(unknown)}; choose from {BENCHMARKS}")
        return names
    return DEFAULT_BENCHMARKS.get(dataset, ())


@dataclass
class ModelResult:
    """Evaluation of one model. ``group`` names what seeds are aggregated over (e.g.
    ``peripheral r=0.5``); ``metrics`` maps metric name -> value."""

    name: str
    group: str
    path: str
    metrics: dict[str, float]
    train_seconds: float | None = None
    data_fraction: float | None = None
    current: bool = False
    loss_curve: list[tuple[int, float]] = field(default_factory=list)


def aggregate(results: list[ModelResult], metric_names: list[str]) -> list[dict]:
    """One row per group: n (runs), and mean / std (sample std, 0 for one run) of every metric,
    training seconds and data fraction. Groups keep the order of first appearance."""
    groups: dict[str, list[ModelResult]] = {}
    for r in results:
        groups.setdefault(r.group, []).append(r)
    rows = []
    for group, members in groups.items():
        row = {"group": group, "n": len(members), "current": any(m.current for m in members)}
        columns = {m: [x.metrics.get(m, math.nan) for x in members] for m in metric_names}
        columns["train_seconds"] = [x.train_seconds if x.train_seconds is not None else math.nan
                                    for x in members]
        columns["data_fraction"] = [x.data_fraction if x.data_fraction is not None else math.nan
                                    for x in members]
        for name, values in columns.items():
            arr = np.asarray(values, dtype=float)
            row[name] = float(np.nanmean(arr)) if np.isfinite(arr).any() else math.nan
            row[f"{name}_std"] = float(np.nanstd(arr, ddof=1)) if np.isfinite(arr).sum() > 1 else 0.0
        rows.append(row)
    return rows


def _fmt(value: float, std: float, n: int, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f} ± {std:.{digits}f}" if n > 1 else f"{value:.{digits}f}"


def markdown_table(rows: list[dict], metric_names: list[str]) -> str:
    """The side-by-side table: one line per group, ``mean ± std`` where several seeds ran."""
    head = ["model", "runs", "data fraction", "train s", *metric_names]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        name = f"**{r['group']}**" if r["current"] else r["group"]
        cells = [name, str(r["n"]), _fmt(r["data_fraction"], r["data_fraction_std"], r["n"], 3),
                 _fmt(r["train_seconds"], r["train_seconds_std"], r["n"], 1)]
        cells += [_fmt(r[m], r[f"{m}_std"], r["n"]) for m in metric_names]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report_plots(results: list[ModelResult], rows: list[dict], metric_names: list[str]) -> dict[str, bytes]:
    """PNG plots: metric bars per model group, training loss curves, time vs data fraction."""
    out = {"metrics.png": plots.metric_bars(
        {r["group"]: {m: r[m] for m in metric_names} for r in rows},
        errors={r["group"]: {m: r[f"{m}_std"] for m in metric_names} for r in rows})}
    curves = {r.name: r.loss_curve for r in results if r.loss_curve}
    if curves:
        out["loss_curves.png"] = plots.named_curves(curves, "optimizer step", "training loss")
    points = [(r.data_fraction, r.train_seconds, r.name) for r in results
              if r.data_fraction is not None and r.train_seconds is not None]
    if points:
        out["time_vs_fraction.png"] = plots.scatter_labelled(points, "data fraction",
                                                             "training seconds")
    return out
