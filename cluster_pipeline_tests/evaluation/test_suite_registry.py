"""The evaluation suites as a registry: one module per suite, every metric declared with its
unit and direction, and the report reading those declarations (not the metric's name)."""

from dataclasses import replace
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from cluster_pipeline.evaluation import suites
from cluster_pipeline.evaluation.report import ModelResult, aggregate, compare_groups, zero_metrics
from cluster_pipeline.evaluation.suites import (
    BENCHMARKS,
    CODE_BENCHMARKS,
    METRICS,
    SUITES,
    EvalSettings,
    ItemScores,
    Metric,
    Suite,
    evaluate_model,
    lower_is_better,
    metric_unit,
)

SHARED = {"__init__", "base", "code", "choice", "heldout"}


def test_every_suite_module_holds_one_registered_suite():
    folder = Path(suites.__file__).parent
    modules = {p.stem for p in folder.glob("*.py")} - SHARED
    assert sorted(type(s).__module__.rsplit(".", 1)[1] for s in SUITES.values()) == sorted(modules)
    assert BENCHMARKS == ("humaneval", "mbpp", "mmlu", "mmlu_medical")
    assert CODE_BENCHMARKS == ("humaneval", "mbpp")
    for suite in SUITES.values():
        assert suite.size_knob in EvalSettings.model_fields, suite.name


def test_every_metric_declares_its_unit_and_direction():
    assert {name: (m.unit, m.lower_is_better) for name, m in METRICS.items()} == {
        "heldout_loss": ("nats/token", True),
        "heldout_perplexity": ("exp(nats/token)", True),
        "humaneval_pass@1": ("fraction of problems solved", False),
        "humaneval_solution_nll": ("nats/token", True),
        "mbpp_pass@1": ("fraction of problems solved", False),
        "mbpp_solution_nll": ("nats/token", True),
        "mmlu_accuracy": ("fraction of questions right", False),
        "mmlu_medical_accuracy": ("fraction of questions right", False),
    }
    assert lower_is_better("mbpp_solution_nll") and not lower_is_better("mmlu_accuracy")
    assert metric_unit("heldout_loss") == "nats/token"


def test_a_metric_no_suite_declares_is_refused_by_name():
    with pytest.raises(ValueError) as e:
        lower_is_better("humaneval_accuracy")
    assert str(e.value) == (
        "metric 'humaneval_accuracy' is declared by no evaluation suite; declared: "
        f"{sorted(METRICS)}"
    )


def _results(metric: str, base: np.ndarray, tuned: np.ndarray) -> list[ModelResult]:
    ids = [str(i) for i in range(len(base))]
    return [
        ModelResult(
            name,
            group,
            "p",
            {metric: float(values.mean())},
            {metric: ItemScores(ids, [1.0] * len(ids), values.tolist())},
            selector,
            1.0 if selector else None,
        )
        for name, group, selector, values in (
            ("base", "base", None, base),
            ("tuned", "peripheral r=1.0", "peripheral", tuned),
        )
    ]


def test_the_report_reads_direction_and_zero_columns_from_the_declarations(monkeypatch):
    rng = np.random.default_rng(0)
    base = (rng.random(300) < 0.3).astype(float)
    tuned = np.maximum(base, (rng.random(300) < 0.3).astype(float))  # right where base was
    results = _results("mmlu_accuracy", base, tuned)
    rows = aggregate(results, ["mmlu_accuracy"])
    [c] = compare_groups(results, rows, n_resamples=200)
    assert c.difference > 0 and not c.lower_is_better and c.verdict == "better"
    # The same numbers under a declaration that says lower is better: the verdict follows it.
    flipped = replace(METRICS["mmlu_accuracy"], lower_is_better=True)
    monkeypatch.setitem(METRICS, "mmlu_accuracy", flipped)
    [c] = compare_groups(results, rows, n_resamples=200)
    assert c.lower_is_better and c.verdict == "worse"
    # Only a metric declared so is dropped when every model scores 0.
    zeros = np.zeros(300)
    assert zero_metrics(_results("mmlu_accuracy", zeros, zeros)) == []
    assert zero_metrics(_results("humaneval_pass@1", zeros, zeros)) == ["humaneval_pass@1"]


class _Undeclared(Suite):
    name = "undeclared"
    listed = 99
    kind = "choice"
    size_knob = "mmlu_questions"
    file = None
    metrics = (Metric("accuracy", "fraction of questions right", lower_is_better=False),)

    def load(self, path, size):
        return list(range(size))

    def score(self, model, tokenizer, items, settings, log):
        return {"accuracy": (1.0, ItemScores(["0"], [1.0], [1.0]), None), "f1": (0.5, None, None)}


def test_a_suite_that_reports_a_metric_it_does_not_declare_is_refused(tiny_model_dir, monkeypatch):
    monkeypatch.setitem(SUITES, "undeclared", _Undeclared())
    heldout = pl.DataFrame(
        {
            "sample_id": ["a"],
            "system": [""],
            "prompt": ["Add 3 and 4."],
            "response": ["7"],
        }
    )
    with pytest.raises(ValueError) as e:
        evaluate_model(
            str(tiny_model_dir), heldout, {"undeclared": [0]}, EvalSettings(), log=lambda _: None
        )
    assert str(e.value) == (
        "suite 'undeclared' reported the metric 'f1', which its metrics do not declare "
        "(['accuracy']); declare it in the suite's module"
    )
