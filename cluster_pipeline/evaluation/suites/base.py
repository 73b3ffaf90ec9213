"""What an evaluation suite is (:class:`Suite`) and what it reports: :class:`Metric`
declarations (name, unit, direction) and per-item scores (:class:`ItemScores`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal

import numpy as np

if TYPE_CHECKING:
    from cluster_pipeline.evaluation.suites import EvalSettings


@dataclass(frozen=True)
class Metric:
    """One number a suite reports, declared with what reading it needs.

    Attributes:
        key: the metric's name after its suite's: ``"pass@1"`` is reported as
            ``"humaneval_pass@1"`` by the ``humaneval`` suite.
        unit: the unit of its values, for axis labels (``"nats/token"``, ``"fraction of
            problems solved"``).
        lower_is_better: the direction in which a model improves (losses fall, pass rates
            rise); comparisons read their verdicts by it.
        all_zero_says_nothing: when every model scores 0 (pass@1 of models too small to
            solve a problem), the report neither compares nor plots it.
    """

    key: str
    unit: str
    lower_is_better: bool
    all_zero_says_nothing: bool = False


@dataclass(frozen=True)
class ItemScores:
    """One metric's per-item scores: ``ids`` (sample ids, task ids, question numbers),
    ``weights`` (response tokens for token-weighted metrics, 1 otherwise) and ``values``; the
    metric is the weighted mean of ``values``."""

    ids: list[str]
    weights: list[float]
    values: list[float]

    def mean(self) -> float:
        """The weighted mean of the values (nan when the weights sum to 0)."""
        w = np.asarray(self.weights, dtype=np.float64)
        return float((w * np.asarray(self.values)).sum() / w.sum()) if w.sum() > 0 else math.nan

    def to_dict(self) -> dict[str, list]:
        """The scores as lists, for JSON."""
        return asdict(self)


# A scorer's result: metric key (:attr:`Metric.key`) -> (value, per-item scores, per-item records
# or None).
Scored = dict[str, tuple[float, ItemScores, list[dict] | None]]


class Suite:
    """One benchmark: where its items come from, how a model is scored on them, and the metrics
    it reports.

    A suite is one class in a module of :mod:`cluster_pipeline.evaluation.suites` (found there,
    no list to edit; :mod:`cluster_pipeline.plugins`), usually a subclass of a kind's base
    (:class:`~cluster_pipeline.evaluation.suites.code.CodeSuite`,
    :class:`~cluster_pipeline.evaluation.suites.choice.ChoiceSuite`) that sets:

    - ``name``: the benchmark's name in run configs and ``eval.json``;
    - ``listed``: its place in the list of benchmarks;
    - ``kind``: ``"code"`` (generated code runs in the sandbox) or ``"choice"``;
    - ``size_knob``: the :class:`~cluster_pipeline.evaluation.suites.EvalSettings` field that
      sizes it (a new knob is a field there);
    - ``file``: the file it reads from an evaluation folder, or None (shipped in a package);
    - ``metrics``: what :meth:`score` reports, each reported as ``<name>_<key>``;

    and implements :meth:`load` and :meth:`score`.
    """

    name: ClassVar[str]
    listed: ClassVar[int]
    kind: ClassVar[Literal["code", "choice"]]
    size_knob: ClassVar[str]
    file: ClassVar[str | None]
    metrics: ClassVar[tuple[Metric, ...]]

    def metric_name(self, metric: Metric) -> str:
        """The name a metric of this suite is reported under: ``<suite>_<key>``."""
        return f"{self.name}_{metric.key}"

    def load(self, path: Path | None, size: int) -> list:
        """The first ``size`` items (problems, questions); ``path`` is :attr:`file` found in
        an evaluation folder, or None when the suite reads none."""
        raise NotImplementedError

    def score(
        self, model, tokenizer, items: list, settings: EvalSettings, log: Callable[[str], None]
    ) -> Scored:
        """The model's metrics on ``items``, by :attr:`Metric.key` (a subset of
        :attr:`metrics`: a metric the settings or items leave out is absent)."""
        raise NotImplementedError


def file_of(path: Path | None) -> Path:
    """The path :meth:`Suite.load` gets for a suite that reads a file (never None then)."""
    assert path is not None  # load_suites passes the file of every suite that has one
    return path
