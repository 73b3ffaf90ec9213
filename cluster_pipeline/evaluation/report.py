"""The comparison report: which models, evaluated once each (cached), seeds aggregated,
paired comparisons with verdicts, and the Markdown/JSON report with its plots.

The base model and every finished checkpoint of a dataset (other selectors, budgets, seeds)
are evaluated on the same held-out split and benchmarks. Checkpoints are grouped by
``<selector> r=<ratio>``; a group's metrics are the mean and sample standard deviation over its
seeds. Each group is compared, item by item, with its references: the ``random_global`` group at
the same ratio (the same budget without clusters), the ``full`` group (all data) and the base
model; each comparison is a paired bootstrap interval over items and seeds, a sign-flip test's
p and a verdict (:mod:`cluster_pipeline.evaluation.statistics`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from cluster_pipeline.evaluation import plots, render
from cluster_pipeline.evaluation.results import ModelResult, ReportNumbers
from cluster_pipeline.evaluation.statistics import Comparison, paired_bootstrap
from cluster_pipeline.evaluation.suites import (
    ItemScores,
    declared_metric,
    lower_is_better,
    metric_unit,
)
from cluster_pipeline.selection.selectors import REWEIGHTED_SELECTORS
from cluster_pipeline.storage.cache import JsonCache, file_stamp, model_fingerprint, stable_hash
from cluster_pipeline.training.checkpointing import TRAINING_INFO, Checkpoint


@dataclass(frozen=True)
class ModelEntry:
    """A model to evaluate: the base model (``checkpoint`` None) or a fine-tuned checkpoint."""

    name: str
    group: str
    path: str
    checkpoint: Checkpoint | None = None
    # The values of the setup settings that vary among the compared checkpoints.
    setup: dict[str, Any] = field(default_factory=dict)

    def cache_stamp(self) -> str:
        """Changes when the model changes: a checkpoint folder rewritten in place (resumed,
        retrained), or base model files replaced under the same path."""
        if self.checkpoint:
            return file_stamp(Path(self.path) / TRAINING_INFO)
        return model_fingerprint(self.path)


# Training settings that differ between runs of one setup (seeds) or do not change the model.
RUN_ONLY_SETTINGS = frozenset(
    {
        "seed",
        "resume",
        "save_every_steps",
        "keep_checkpoints",
        "grad_cosine_every",
        "grad_sketch_dim",
        # training/config.SPEED_ONLY_SETTINGS: a step's kernels, not what it trains.
        "fused_loss",
        "compile",
    }
)


# Selection settings (recorded in a checkpoint's provenance) that make runs of a selector
# different setups: the capacity slack alpha and the clustered representation change which
# samples every selector but ``full`` trains on.
SETUP_PROVENANCE = ("alpha", "representation", "balance")


def setup_values(ckpt: Checkpoint) -> dict[str, Any]:
    """The settings that define a checkpoint's setup, where they apply to its selector: every
    training setting but :data:`RUN_ONLY_SETTINGS` (``reweight`` only for the re-weighted
    selectors, whose weights it switches), :data:`SETUP_PROVENANCE` for every selector but
    ``full``, and the selector's own knobs (provenance ``selector_knobs``). A key recorded by
    none of its runs reads None."""
    selector = ckpt.provenance.get("selector")
    values = {k: v for k, v in ckpt.settings.items() if k not in RUN_ONLY_SETTINGS}
    if selector is not None and selector not in REWEIGHTED_SELECTORS:
        values.pop("reweight", None)
    if selector != "full":
        values |= {k: ckpt.provenance.get(k) for k in SETUP_PROVENANCE}
    # The selector's own knobs (recorded since issue 41's trial: two ifd runs under other knobs
    # were one group, shown as seeds): present only for the selectors that have them.
    values |= dict(ckpt.provenance.get("selector_knobs") or {})
    return values


def model_entries(base_path: str, checkpoints: list[Checkpoint]) -> list[ModelEntry]:
    """The base model, then each checkpoint named by selector, ratio (and target set, for a
    targeted selector: ``rds r=0.5 target=humaneval``) and its seeds in words
    (``peripheral r=0.5, training seed 0, selection seed 0``).
    Checkpoints written before provenance was recorded keep their folder name as their group.

    Checkpoints whose setups (:func:`setup_values`) differ, say in ``lora_r``, ``max_steps``,
    ``reweight`` or the capacity slack ``alpha``, are different setups, not seeds of one: each
    group then also names its values of the settings that vary among the checkpoints, e.g.
    ``peripheral r=0.5 (alpha=1.0)``; an unrecorded value reads ``unrecorded``. A group is
    compared only with references that agree with it on every setting both have
    (:func:`references_of`)."""
    values = [setup_values(c) for c in checkpoints]
    keys = sorted({k for v in values for k in v})
    varying = [
        k
        for k in keys
        if len({json.dumps(v[k], sort_keys=True, default=str) for v in values if k in v}) > 1
    ]
    entries = [ModelEntry("base", "base", base_path)]
    for ckpt, setup in zip(checkpoints, values, strict=True):
        prov = ckpt.provenance
        shown = {k: setup[k] for k in varying if k in setup}
        label = ", ".join(f"{k}={'unrecorded' if v is None else v}" for k, v in shown.items())
        target = f" target={prov['selection_target']}" if prov.get("selection_target") else ""
        group = (
            f"{prov['selector']} r={prov.get('ratio')}{target}"
            if "selector" in prov
            else f"checkpoint {ckpt.path.name}"
        ) + (f" ({label})" if label else "")
        seeds = (
            f"training seed {ckpt.settings.get('seed', 0)}, "
            f"selection seed {prov.get('selection_seed', 0)}"
        )
        entries.append(ModelEntry(f"{group}, {seeds}", group, str(ckpt.path), ckpt, shown))
    return entries


def evaluate_entries(
    entries: list[ModelEntry],
    evaluate: Callable[[list[str], Callable[[str, dict[str, Any]], None]], None],
    cache: JsonCache,
    settings_key: str,
    current: str,
    log: Callable[[str], None] = print,
) -> tuple[list[ModelResult], dict[str, Any]]:
    """Evaluate every entry (see :func:`~cluster_pipeline.evaluation.suites.evaluate_model`),
    reusing ``cache`` entries keyed by model path + stamp and ``settings_key``.

    ``evaluate(paths, done)`` evaluates the models at ``paths`` (those without a cached outcome,
    all in one call) and calls ``done(path, outcome)`` for each one finished, also when it then
    fails on a later one: finished outcomes are cached before its error propagates, so a rerun
    evaluates only the rest.

    Returns (one result per entry, in order; ``{"tokens": held-out response tokens,
    "sequences": skipped and truncated held-out samples}`` of the last entry, plus
    ``"peak_rss_bytes"``: the evaluating process's peak resident memory, the largest the
    outcomes evaluated now recorded, None when every outcome came from the cache).

    Raises:
        KeyError: ``evaluate`` returned without an outcome for a path it was given.
    """
    keys = {e.path: f"{stable_hash(e.cache_stamp(), length=12)}-{settings_key}" for e in entries}
    outcomes: dict[str, dict[str, Any]] = {}
    for entry in entries:
        outcome = cache.get(keys[entry.path])
        if outcome is not None and "items" in outcome:
            log(f"{entry.name}: cached evaluation {cache.path(keys[entry.path]).name}")
            outcomes[entry.path] = outcome
    missing = [e for e in entries if e.path not in outcomes]
    if missing:
        log(f"evaluating {len(missing)} model(s) in one process: {[e.name for e in missing]}")

        def done(path: str, outcome: dict[str, Any]) -> None:
            cache.put(keys[path], outcome)
            outcomes[path] = outcome

        evaluate([e.path for e in missing], done)
    peaks = [outcomes[e.path].get("peak_rss_bytes") for e in missing]
    peak = max((p for p in peaks if p is not None), default=None)
    results, heldout = [], {"tokens": 0, "sequences": {}}
    for entry in entries:
        outcome = outcomes[entry.path]
        heldout = {
            "tokens": outcome["heldout_tokens"],
            "sequences": outcome.get("heldout_sequences", {}),
        }
        ckpt = entry.checkpoint
        prov = ckpt.provenance if ckpt else {}
        results.append(
            ModelResult(
                name=entry.name,
                group=entry.group,
                path=entry.path,
                metrics=outcome["metrics"],
                items={k: ItemScores(**v) for k, v in outcome["items"].items()},
                selector=prov.get("selector"),
                ratio=prov.get("ratio"),
                train_seconds=ckpt.train_seconds if ckpt else None,
                selection_seconds=prov.get("selection_seconds"),
                data_fraction=ckpt.data_fraction if ckpt else None,
                gradient_diversity=prov.get("gradient_diversity"),
                grad_cosine=ckpt.mean_grad_cosine() if ckpt else None,
                useful_compute_fraction=ckpt.info.get("useful_compute_fraction") if ckpt else None,
                mfu=(ckpt.info.get("mfu") or {}).get("value") if ckpt else None,
                mfu_record=ckpt.info.get("mfu") if ckpt else None,
                selection_passes=list(prov.get("selection_passes") or []),
                selection_forward_passes=prov.get("selection_forward_passes"),
                selection_backward_passes=prov.get("selection_backward_passes"),
                selection_peak_rss_mib=prov.get("selection_peak_rss_mib"),
                current=Path(entry.path) == Path(current),
                loss_curve=ckpt.loss_curve() if ckpt else [],
                setup=entry.setup,
                rank_weights=ckpt.info.get("rank_weights") if ckpt else None,
            )
        )
    return results, {**heldout, "peak_rss_bytes": peak}


# Per-run quantities besides the metrics that the report aggregates over seeds.
RUN_COLUMNS = (
    "train_seconds",
    "selection_seconds",
    "data_fraction",
    "gradient_diversity",
    "grad_cosine",
    "useful_compute_fraction",
    "mfu",
)


def aggregate(results: list[ModelResult], metric_names: list[str]) -> list[dict]:
    """One row per group: n (runs), and mean / std (sample std, 0 for one run) of every metric
    and of :data:`RUN_COLUMNS`. Groups keep the order of first appearance."""
    groups: dict[str, list[ModelResult]] = {}
    for r in results:
        groups.setdefault(r.group, []).append(r)
    rows = []
    for group, members in groups.items():
        row: dict[str, Any] = {
            "group": group,
            "n": len(members),
            "current": any(m.current for m in members),
            "selector": members[0].selector,
            "ratio": members[0].ratio,
            "setup": members[0].setup,
        }
        columns = {m: [x.metrics.get(m, math.nan) for x in members] for m in metric_names}
        for name in RUN_COLUMNS:
            columns[name] = [getattr(x, name) for x in members]
        for name, values in columns.items():
            arr = np.asarray([math.nan if v is None else v for v in values], dtype=float)
            row[name] = float(np.nanmean(arr)) if np.isfinite(arr).any() else math.nan
            row[f"{name}_std"] = (
                float(np.nanstd(arr, ddof=1)) if np.isfinite(arr).sum() > 1 else 0.0
            )
        rows.append(row)
    return rows


ITEM_SCORE_SCHEMA = {
    "model": pl.String,
    "group": pl.String,
    "path": pl.String,
    "metric": pl.String,
    "item": pl.String,
    "weight": pl.Float64,
    "value": pl.Float64,
}


def item_scores_frame(results: list[ModelResult]) -> pl.DataFrame:
    """The ``eval_item_scores`` table: one row per (model, metric, item) with the item's weight
    (response tokens for token-weighted metrics) and score (e.g. the held-out sample's mean
    loss in nats/token, 1/0 for a solved problem)."""
    rows: dict[str, list] = {k: [] for k in ITEM_SCORE_SCHEMA}
    for r in results:
        for metric, scores in r.items.items():
            n = len(scores.ids)
            rows["model"] += [r.name] * n
            rows["group"] += [r.group] * n
            rows["path"] += [r.path] * n
            rows["metric"] += [metric] * n
            rows["item"] += scores.ids
            rows["weight"] += scores.weights
            rows["value"] += scores.values
    return pl.DataFrame(rows, schema=ITEM_SCORE_SCHEMA)


def _stack(members: list[ModelResult], metric: str, ids: list[str]) -> np.ndarray:
    """(seeds, items) scores of ``metric`` for ``ids``, one row per member."""
    rows = []
    for m in members:
        by_id = dict(zip(m.items[metric].ids, m.items[metric].values, strict=True))
        rows.append([by_id[i] for i in ids])
    return np.asarray(rows, dtype=np.float64)


def references_of(group: str, rows: list[dict]) -> list[str]:
    """The groups a group is compared with: random_global at the same ratio (unless it is
    one), full data, each agreeing with the group on every setup setting both have (so
    ``peripheral (reweight=False)`` meets the random_global and full runs, which have no
    weights to switch, and ``peripheral (alpha=1.0)`` the full runs, which no alpha changes),
    and the base model."""
    me = next(r for r in rows if r["group"] == group)
    mine = me.get("setup", {})

    def agrees(r: dict) -> bool:
        theirs = r.get("setup", {})
        return all(theirs[k] == v for k, v in mine.items() if k in theirs)

    same = [r for r in rows if r["group"] != group and agrees(r)]
    refs = [
        r["group"]
        for r in same
        if r["selector"] == "random_global"
        and r["ratio"] == me["ratio"]
        and me["selector"] != "full"
    ]
    refs += [r["group"] for r in same if r["selector"] == "full"]
    return [*refs, "base"]


def compare_groups(
    results: list[ModelResult],
    rows: list[dict],
    n_resamples: int = 2000,
    seed: int = 0,
    extra_pairs: Sequence[tuple[str, str]] = (),
) -> list[Comparison]:
    """Every non-base group against each of its :func:`references_of` (and each
    ``(candidate, reference)`` group pair of ``extra_pairs``), on every metric with per-item
    scores that both have (but those where every model scores 0), over the items all their runs
    share (at least 2)."""
    groups: dict[str, list[ModelResult]] = {}
    for r in results:
        groups.setdefault(r.group, []).append(r)
    zeros = set(zero_metrics(results))
    pairs = [(g, ref) for g in groups if g != "base" for ref in references_of(g, rows)]
    pairs += [p for p in extra_pairs if p not in pairs]
    out = []
    for group, ref in pairs:
        members, others = groups[group], groups[ref]
        both = [*members, *others]
        metrics = [
            m for m in members[0].items if m not in zeros and all(m in x.items for x in both)
        ]
        for metric in metrics:
            shared = set.intersection(*(set(x.items[metric].ids) for x in both))
            ids = [i for i in members[0].items[metric].ids if i in shared]
            if len(ids) < 2:
                continue
            weights = dict(
                zip(members[0].items[metric].ids, members[0].items[metric].weights, strict=True)
            )
            out.append(
                paired_bootstrap(
                    _stack(members, metric, ids),
                    _stack(others, metric, ids),
                    np.asarray([weights[i] for i in ids]),
                    metric=metric,
                    names=(group, ref),
                    lower_is_better=lower_is_better(metric),
                    n_resamples=n_resamples,
                    seed=seed,
                )
            )
    return out


def zero_metrics(results: list[ModelResult]) -> list[str]:
    """Metrics where every model scored 0 and whose suite declares that such a column says
    nothing (:attr:`~cluster_pipeline.evaluation.suites.Metric.all_zero_says_nothing`: pass@1),
    so there is nothing to plot or compare."""
    names = {m for r in results for m in r.metrics if declared_metric(m).all_zero_says_nothing}
    return sorted(m for m in names if all(r.metrics.get(m, 0.0) == 0.0 for r in results))


# The quality the decision figure weighs against time: the one metric every run has.
DECISION_METRIC = "heldout_loss"


def decision_points(
    results: list[ModelResult], numbers: ReportNumbers
) -> list[plots.DecisionPoint]:
    """What :func:`~cluster_pipeline.evaluation.plots.decision_figure` draws: every trained
    group's net time saved against its :data:`DECISION_METRIC` comparison with random_global at
    the same ratio and with full data; with the base model only when neither reference ran.

    A group's net time saved is full-data training seconds (``numbers.full_seconds``) minus
    each run's selection + training seconds, mean and sample std over its runs (a run without
    a recorded selection time counts 0 s of selection)."""
    selectors = {r["group"]: r["selector"] for r in numbers.rows}
    current = numbers.current_row["group"]
    totals: dict[str, list[float]] = {}
    for r in results:
        if r.group != "base" and r.train_seconds is not None:
            selection = r.selection_seconds if r.selection_seconds is not None else 0.0
            totals.setdefault(r.group, []).append(selection + r.train_seconds)

    def kind(c: Comparison) -> str | None:
        if c.reference == "base":
            return "base"
        selector = selectors.get(c.reference)
        return selector if selector in ("random_global", "full") else None

    chosen = [
        c
        for c in numbers.comparisons
        if c.metric == DECISION_METRIC and c.candidate in totals and kind(c) is not None
    ]
    kinds = {kind(c) for c in chosen}
    shown = ["random_global", "full"] if kinds - {"base"} else ["base"]
    out = []
    for k in shown:
        for c in chosen:
            if kind(c) != k:
                continue
            saved = numbers.full_seconds - np.asarray(totals[c.candidate])
            out.append(
                plots.DecisionPoint(
                    group=c.candidate,
                    reference=c.reference,
                    kind=k,
                    saved_seconds=float(saved.mean()),
                    saved_std=float(saved.std(ddof=1)) if len(saved) > 1 else 0.0,
                    comparison=c,
                    current=c.candidate == current,
                    runs=len(saved),
                )
            )
    return out


def report_plots(results: list[ModelResult], numbers: ReportNumbers) -> dict[str, bytes]:
    """PNG figures, the answer first: ``decision.png`` (net time saved against the quality
    difference, :func:`decision_points`), ``metrics.png`` (each trained group against the base
    model, metrics where every model scores 0 and perplexity, the exponential of held-out loss,
    left out), ``loss_curves.png`` (training loss of every run) and ``time_vs_fraction.png``.
    A figure with nothing to draw is left out."""
    out: dict[str, bytes] = {}
    points = decision_points(results, numbers)
    if points:
        out["decision.png"] = plots.png(
            plots.decision_figure(
                points,
                metric_unit(DECISION_METRIC),
                subtitle=render.decision_answer(points),
                full_note=render.full_seconds_note(numbers),
            )
        )
    skip = set(numbers.zero_metrics) | {"heldout_perplexity"}
    vs_base = [c for c in numbers.comparisons if c.reference == "base" and c.metric not in skip]
    if vs_base:
        base = next(r for r in numbers.rows if r["group"] == "base")
        out["metrics.png"] = plots.png(
            plots.metric_differences_figure(
                vs_base,
                {m: base[m] for m in numbers.metric_names},
                {m: metric_unit(m) for m in numbers.metric_names},
            )
        )
    curves = {r.name: r.loss_curve for r in results if r.loss_curve}
    if curves:
        out["loss_curves.png"] = plots.png(
            plots.run_loss_curves_figure(curves, {r.name: r.group for r in results})
        )
    runs = [
        (r.data_fraction, r.train_seconds, r.group)
        for r in results
        if r.data_fraction is not None and r.train_seconds is not None
    ]
    if runs:
        estimate = None if numbers.full_measured else (numbers.data_fraction, numbers.train_seconds)
        out["time_vs_fraction.png"] = plots.png(plots.time_vs_fraction_figure(runs, estimate))
    return out


@dataclass(frozen=True)
class Report:
    """The rendered comparison. ``summary`` is the Markdown without images; ``pngs`` maps file
    name -> PNG bytes, the answer (``decision.png``) first; ``document`` is the JSON form;
    ``answer`` the answer in a few Markdown lines (under 1,000 characters, which the Dagster UI
    shows inline)."""

    summary: str
    pngs: dict[str, bytes]
    document: dict[str, Any]
    rows: list[dict]
    comparisons: list[Comparison]
    train_seconds: float
    data_fraction: float
    full_training_seconds: float
    full_training_measured: bool
    answer: str = ""

    @property
    def headline(self) -> str:
        """The report's first statement (the net time saved and what it is made of), one
        line of plain text (:func:`~cluster_pipeline.evaluation.render.plain_text`: it goes to
        the run's log); empty for a report without one."""
        lines = [ln for ln in self.summary.splitlines() if ln.strip() and not ln.startswith("#")]
        return render.plain_text(lines[0]) if lines else ""

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


def report_numbers(results: list[ModelResult], n_resamples: int = 2000) -> ReportNumbers:
    """Aggregate ``results`` (one must be ``current``) and compare every group with its
    references. Full-data training time is the measured mean of the ``full`` group when there
    is one, else estimated as measured training seconds / data fraction (training time is
    linear in samples at a fixed number of epochs; docs/design.md, "Evaluation").

    Raises:
        StopIteration: no result is marked ``current``.
    """
    metric_names = list(results[0].metrics)
    rows = aggregate(results, metric_names)
    comparisons = compare_groups(results, rows, n_resamples=n_resamples)
    current_row = next(r for r in rows if r["current"])
    train_s = float(current_row["train_seconds"])
    fraction = float(current_row["data_fraction"])
    full_rows = [r for r in rows if r["selector"] == "full"]
    full_s = (
        float(full_rows[0]["train_seconds"])
        if full_rows
        else train_s / fraction
        if fraction > 0
        else float("nan")
    )
    return ReportNumbers(
        metric_names,
        rows,
        comparisons,
        current_row,
        next(r for r in results if r.current),
        train_s,
        fraction,
        full_s,
        bool(full_rows),
        zero_metrics(results),
    )


def render_report(
    dataset: str,
    results: list[ModelResult],
    heldout_samples: int,
    heldout_tokens: int,
    suite_sizes: dict[str, int],
    skipped: dict[str, str],
    selection_seconds: float,
    n_resamples: int = 2000,
    heldout_sequences: dict[str, dict[str, int]] | None = None,
    unsafe_sandbox: str | None = None,
) -> Report:
    """The report of ``results``: its numbers (:func:`report_numbers`), their Markdown
    (:func:`~cluster_pipeline.evaluation.render.summary_markdown`), the plots and the JSON
    document. ``unsafe_sandbox`` (why isolation was unavailable, when generated code ran
    without it) opens the report.

    Raises:
        StopIteration: no result is marked ``current``.
    """
    numbers = report_numbers(results, n_resamples)
    summary = render.summary_markdown(
        dataset,
        numbers,
        heldout_samples,
        heldout_tokens,
        suite_sizes,
        skipped,
        selection_seconds,
        heldout_sequences,
        unsafe_sandbox,
    )
    document = {
        "dataset": dataset,
        "rows": numbers.rows,
        "comparisons": [c.to_dict() for c in numbers.comparisons],
        "models": [{k: v for k, v in r.__dict__.items() if k != "items"} for r in results],
        "skipped": skipped,
        "selection_seconds": selection_seconds,
        "full_training_seconds": numbers.full_seconds,
        "full_training_measured": numbers.full_measured,
    }
    return Report(
        summary,
        report_plots(results, numbers),
        document,
        numbers.rows,
        numbers.comparisons,
        numbers.train_seconds,
        numbers.data_fraction,
        numbers.full_seconds,
        numbers.full_measured,
        render.worth_it_markdown(numbers, selection_seconds),
    )
