"""What an evaluation found, as plain data: one model's result (:class:`ModelResult`) and the
numbers a report states (:class:`ReportNumbers`). The report computes them
(:mod:`cluster_pipeline.evaluation.report`) and the renderer writes them
(:mod:`cluster_pipeline.evaluation.render`); both import this module, so neither imports the
other's types."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cluster_pipeline.evaluation.statistics import Comparison
from cluster_pipeline.evaluation.suites import ItemScores


@dataclass
class ModelResult:
    """Evaluation of one model. ``group`` names what seeds are aggregated over (e.g.
    ``peripheral r=0.5``); ``metrics`` maps metric name -> value, ``items`` metric name ->
    per-item scores. ``selection_seconds`` is the cost of the selection that produced the
    checkpoint (embedding pass, clustering, subsets, shards), ``gradient_diversity`` that of its
    subset, ``grad_cosine`` the mean inter-rank gradient cosine logged during training."""

    name: str
    group: str
    path: str
    metrics: dict[str, float]
    items: dict[str, ItemScores] = field(default_factory=dict)
    selector: str | None = None
    ratio: float | None = None
    train_seconds: float | None = None
    selection_seconds: float | None = None
    data_fraction: float | None = None
    gradient_diversity: float | None = None
    grad_cosine: float | None = None
    current: bool = False
    loss_curve: list[tuple[int, float]] = field(default_factory=list)
    setup: dict[str, Any] = field(default_factory=dict)
    rank_weights: list[float] | None = None
    # Real tokens / (ranks x the busiest rank's tensor tokens) over the run (training/plan.py).
    useful_compute_fraction: float | None = None
    # Model FLOPs utilisation of a CUDA run (training_info.json's ``mfu`` record,
    # training/mfu.py): ``mfu`` its value (None on CPU or a GPU of unknown peak), ``mfu_record``
    # the figures it was computed from.
    mfu: float | None = None
    mfu_record: dict[str, Any] | None = None
    # The selection's model passes (name, samples, seconds, backward, peaks: the
    # peripheral_subsets cost record), forward and backward passes and peak memory (MiB).
    selection_passes: list[dict[str, Any]] = field(default_factory=list)
    selection_forward_passes: int | None = None
    selection_backward_passes: int | None = None
    selection_peak_rss_mib: float | None = None


@dataclass(frozen=True)
class ReportNumbers:
    """Everything the report states, computed once (:func:`report_numbers`) and rendered by
    :mod:`cluster_pipeline.evaluation.render`.

    Attributes:
        metric_names: the metrics every model was scored on, in order.
        rows: one aggregate row per group (:func:`aggregate`).
        comparisons: every group against its references (:func:`compare_groups`).
        current_row / current_result: the group and the result of this run's checkpoint.
        train_seconds, data_fraction: of the current group.
        full_seconds: full-data training time, the ``full`` group's measured mean if there is
            one (``full_measured``), else the current run's training seconds / data fraction.
        zero_metrics: metrics where every model scored 0 that say nothing then (pass@1).
    """

    metric_names: list[str]
    rows: list[dict]
    comparisons: list[Comparison]
    current_row: dict
    current_result: ModelResult
    train_seconds: float
    data_fraction: float
    full_seconds: float
    full_measured: bool
    zero_metrics: list[str]
