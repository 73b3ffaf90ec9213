"""The comparison report: which models, evaluated once each (cached), seeds aggregated, and
the Markdown/JSON report with its plots.

The base model and every finished checkpoint of a dataset (other selectors, budgets, seeds)
are evaluated on the same held-out split and benchmarks. Checkpoints are grouped by
``<selector> r=<ratio>``; a group's metrics are the mean and sample standard deviation over its
seeds.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cluster_pipeline.core import plots
from cluster_pipeline.core.cache import JsonCache, file_stamp, model_fingerprint, stable_hash
from cluster_pipeline.core.checkpoints import TRAINING_INFO, Checkpoint
from cluster_pipeline.core.evaluation import BENCHMARKS
from cluster_pipeline.core.formats import EVAL_CONFIG_NAME

DEFAULT_BENCHMARKS = {"python_stdlib": ("humaneval", "mbpp")}


def dataset_benchmarks(dataset: str, raw_dir: Path) -> tuple[str, ...]:
    """The benchmarks that apply to a dataset partition: ``benchmarks`` in
    ``data/raw/<dataset>/eval.json`` if present, else the built-in default (code benchmarks for
    python_stdlib), else none (held-out loss only).

    Raises:
        ValueError: eval.json is not such an object, or names an unknown benchmark.
    """
    path = raw_dir / dataset / EVAL_CONFIG_NAME
    if path.exists():
        try:
            names = tuple(json.loads(path.read_text()).get("benchmarks", ()))
        except (ValueError, AttributeError) as e:
            raise ValueError(
                f'{path}: expected a JSON object like {{"benchmarks": ["mmlu_medical"]}} ({e})'
            ) from None
        unknown = set(names) - set(BENCHMARKS)
        if unknown:
            raise ValueError(
                f"{path}: unknown benchmarks {sorted(unknown)}; choose from {BENCHMARKS}"
            )
        return names
    return DEFAULT_BENCHMARKS.get(dataset, ())


@dataclass(frozen=True)
class ModelEntry:
    """A model to evaluate: the base model (``checkpoint`` None) or a fine-tuned checkpoint."""

    name: str
    group: str
    path: str
    checkpoint: Checkpoint | None = None

    def cache_stamp(self) -> str:
        """Changes when the model changes: a checkpoint folder rewritten in place (resumed,
        retrained), or base model files replaced under the same path."""
        if self.checkpoint:
            return file_stamp(Path(self.path) / TRAINING_INFO)
        return model_fingerprint(self.path)


def model_entries(base_path: str, checkpoints: list[Checkpoint]) -> list[ModelEntry]:
    """The base model, then each checkpoint named by selector, ratio and its training /
    selection seeds. Checkpoints written before provenance was recorded keep their folder
    name as their group."""
    entries = [ModelEntry("base", "base", base_path)]
    for ckpt in checkpoints:
        prov = ckpt.provenance
        group = (
            f"{prov['selector']} r={prov.get('ratio')}"
            if "selector" in prov
            else f"checkpoint {ckpt.path.name}"
        )
        seeds = f"seed {ckpt.settings.get('seed', 0)}/{prov.get('selection_seed', 0)}"
        entries.append(ModelEntry(f"{group} {seeds}", group, str(ckpt.path), ckpt))
    return entries


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


def evaluate_entries(
    entries: list[ModelEntry],
    evaluate: Callable[[str], dict[str, Any]],
    cache: JsonCache,
    settings_key: str,
    current: str,
    log: Callable[[str], None] = print,
) -> tuple[list[ModelResult], int]:
    """Evaluate every entry with ``evaluate(path)`` (see
    :func:`~cluster_pipeline.core.evaluation.evaluate_model`), reusing ``cache`` entries keyed
    by model path + stamp and ``settings_key``.

    Returns (one result per entry, in order; held-out response tokens of the last evaluation).
    """
    results, heldout_tokens = [], 0
    for entry in entries:
        key = f"{stable_hash(entry.cache_stamp(), length=12)}-{settings_key}"
        outcome = cache.get(key)
        if outcome is not None:
            log(f"{entry.name}: cached evaluation {cache.path(key).name}")
        else:
            log(f"evaluating {entry.name}: {entry.path}")
            outcome = evaluate(entry.path)
            cache.put(key, outcome)
        heldout_tokens = outcome["heldout_tokens"]
        ckpt = entry.checkpoint
        results.append(
            ModelResult(
                name=entry.name,
                group=entry.group,
                path=entry.path,
                metrics=outcome["metrics"],
                train_seconds=ckpt.train_seconds if ckpt else None,
                data_fraction=ckpt.data_fraction if ckpt else None,
                current=Path(entry.path) == Path(current),
                loss_curve=ckpt.loss_curve() if ckpt else [],
            )
        )
    return results, heldout_tokens


def aggregate(results: list[ModelResult], metric_names: list[str]) -> list[dict]:
    """One row per group: n (runs), and mean / std (sample std, 0 for one run) of every metric,
    training seconds and data fraction. Groups keep the order of first appearance."""
    groups: dict[str, list[ModelResult]] = {}
    for r in results:
        groups.setdefault(r.group, []).append(r)
    rows = []
    for group, members in groups.items():
        row: dict[str, Any] = {
            "group": group,
            "n": len(members),
            "current": any(m.current for m in members),
        }
        columns = {m: [x.metrics.get(m, math.nan) for x in members] for m in metric_names}
        columns["train_seconds"] = [
            x.train_seconds if x.train_seconds is not None else math.nan for x in members
        ]
        columns["data_fraction"] = [
            x.data_fraction if x.data_fraction is not None else math.nan for x in members
        ]
        for name, values in columns.items():
            arr = np.asarray(values, dtype=float)
            row[name] = float(np.nanmean(arr)) if np.isfinite(arr).any() else math.nan
            row[f"{name}_std"] = (
                float(np.nanstd(arr, ddof=1)) if np.isfinite(arr).sum() > 1 else 0.0
            )
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
        cells = [
            name,
            str(r["n"]),
            _fmt(r["data_fraction"], r["data_fraction_std"], r["n"], 3),
            _fmt(r["train_seconds"], r["train_seconds_std"], r["n"], 1),
        ]
        cells += [_fmt(r[m], r[f"{m}_std"], r["n"]) for m in metric_names]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report_plots(
    results: list[ModelResult], rows: list[dict], metric_names: list[str]
) -> dict[str, bytes]:
    """PNG plots: metric bars per model group, training loss curves, time vs data fraction."""
    out = {
        "metrics.png": plots.metric_bars(
            {r["group"]: {m: r[m] for m in metric_names} for r in rows},
            errors={r["group"]: {m: r[f"{m}_std"] for m in metric_names} for r in rows},
        )
    }
    curves = {r.name: r.loss_curve for r in results if r.loss_curve}
    if curves:
        out["loss_curves.png"] = plots.named_curves(curves, "optimizer step", "training loss")
    points = [
        (r.data_fraction, r.train_seconds, r.name)
        for r in results
        if r.data_fraction is not None and r.train_seconds is not None
    ]
    if points:
        out["time_vs_fraction.png"] = plots.scatter_labelled(
            points, "data fraction", "training seconds"
        )
    return out


@dataclass(frozen=True)
class Report:
    """The rendered comparison. ``summary`` is the Markdown without images; ``pngs`` maps file
    name -> PNG bytes; ``document`` is the JSON form."""

    summary: str
    pngs: dict[str, bytes]
    document: dict[str, Any]
    rows: list[dict]
    train_seconds: float
    data_fraction: float
    full_training_estimate_seconds: float

    def markdown(self) -> str:
        """The standalone report: summary plus the plots as sibling PNG files."""
        return self.summary + "\n" + "\n".join(f"![{n}]({n})" for n in self.pngs) + "\n"

    def write(self, folder: Path) -> Path:
        """Write ``eval_report.md``, ``eval_report.json`` and the PNGs; returns the .md path."""
        folder.mkdir(parents=True, exist_ok=True)
        for name, png in self.pngs.items():
            (folder / name).write_bytes(png)
        (folder / "eval_report.json").write_text(json.dumps(self.document, indent=1, default=str))
        path = folder / "eval_report.md"
        path.write_text(self.markdown())
        return path


def render_report(
    dataset: str,
    results: list[ModelResult],
    heldout_samples: int,
    heldout_tokens: int,
    suite_sizes: dict[str, int],
    skipped: dict[str, str],
    selection_seconds: float,
) -> Report:
    """Aggregate ``results`` (one must be ``current``) and render the report: the side-by-side
    table, and the cost of the current run. Full-data training time is estimated as measured
    training seconds / data fraction (training time is linear in samples at a fixed number of
    epochs; docs/design.md, "Evaluation").

    Raises:
        StopIteration: no result is marked ``current``.
    """
    metric_names = list(results[0].metrics)
    rows = aggregate(results, metric_names)
    current_row = next(r for r in rows if r["current"])
    train_s = float(current_row["train_seconds"])
    fraction = float(current_row["data_fraction"])
    full_estimate = train_s / fraction if fraction > 0 else float("nan")
    summary = (
        f"## eval_report: `{dataset}`\n\n"
        f"Held-out split: {heldout_samples} samples, {heldout_tokens} response tokens. "
        f"Benchmarks: {', '.join(f'{k} ({v})' for k, v in suite_sizes.items()) or 'none'}"
        + (f"; skipped: {'; '.join(f'{k}: {v}' for k, v in skipped.items())}" if skipped else "")
        + ". Greedy decoding; bold = the checkpoint of this run; ± = std over seeds.\n\n"
        + markdown_table(rows, metric_names)
        + "\n\n| cost of the bold run | value |\n|---|---|\n"
        f"| selection: embedding pass + clustering + subsets + shards (model load excluded) | "
        f"{selection_seconds:.1f} s |\n"
        f"| training (measured) | {train_s:.1f} s at data fraction {fraction:.3f} |\n"
        f"| full-data training (estimate: measured / fraction) | {full_estimate:.1f} s |\n"
        f"| training time saved | {full_estimate - train_s:.1f} s |\n"
    )
    document = {
        "dataset": dataset,
        "rows": rows,
        "models": [r.__dict__ for r in results],
        "skipped": skipped,
        "selection_seconds": selection_seconds,
        "full_training_estimate_seconds": full_estimate,
    }
    return Report(
        summary,
        report_plots(results, rows, metric_names),
        document,
        rows,
        train_s,
        fraction,
        full_estimate,
    )
