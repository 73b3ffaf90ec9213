"""Evaluation suites: held-out loss and the benchmarks (code pass@1 on HumanEval and MBPP,
multiple-choice accuracy on MMLU), one module per suite, each declaring the metrics it reports
with their units and direction.

- :mod:`.base`: what a suite is (:class:`Suite`), what it reports (:class:`Metric`,
  :class:`ItemScores`);
- :mod:`.heldout`: held-out loss and perplexity, measured on every model;
- :mod:`.code`, :mod:`.choice`: what the code suites and the multiple-choice suites share;
- :mod:`.humaneval`, :mod:`.mbpp`, :mod:`.mmlu`, :mod:`.mmlu_medical`: the benchmarks;
- here: the registry (:data:`SUITES`, found in this package by :mod:`cluster_pipeline.plugins`),
  every declared metric (:data:`METRICS`: the report, its rendering and its plots read units
  and directions from there), the knobs (:class:`EvalSettings`), which benchmarks a dataset is
  judged on, and one model's evaluation (:func:`evaluate_model`).

Adding a benchmark is one module here with one :class:`Suite` subclass (its name, kind, files,
size knob, metrics, ``load`` and ``score``; a code or multiple-choice benchmark subclasses
:class:`~.code.CodeSuite` or :class:`~.choice.ChoiceSuite` and only loads its items) and its
test; a size knob of its own is one field of :class:`EvalSettings`.

Every metric also keeps its per-item scores (:class:`ItemScores`: held-out sample, problem or
question), which the report compares between models with paired bootstrap intervals
(:mod:`cluster_pipeline.evaluation.statistics`).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import polars as pl
from pydantic import Field, field_validator

from cluster_pipeline.data import json_text
from cluster_pipeline.data.folders import EVAL_CONFIG_NAME
from cluster_pipeline.data.tokenization import PackingSettings, SequenceSettings
from cluster_pipeline.evaluation.generation import GenerationProgress, generate
from cluster_pipeline.evaluation.likelihood import response_losses, sequence_counts
from cluster_pipeline.evaluation.sandbox import check_sandbox
from cluster_pipeline.evaluation.suites import heldout
from cluster_pipeline.evaluation.suites.base import ItemScores, Metric, Scored, Suite
from cluster_pipeline.evaluation.suites.choice import load_mmlu, mmlu_accuracy, mmlu_items
from cluster_pipeline.evaluation.suites.code import (
    CHAT_STOP_SEQUENCES,
    STOP_SEQUENCES,
    CodeProblem,
    code_pass_at_1,
    code_prompt,
    code_request,
    encode_solution,
    extract_completion,
    solution_nll,
)
from cluster_pipeline.evaluation.suites.heldout import heldout_loss
from cluster_pipeline.evaluation.suites.humaneval import load_humaneval
from cluster_pipeline.evaluation.suites.mbpp import load_mbpp
from cluster_pipeline.evaluation.suites.mmlu_medical import MMLU_MEDICAL_TOPICS
from cluster_pipeline.plugins import discover
from cluster_pipeline.storage.job_files import JobFile, StrictModel

__all__ = [
    "BENCHMARKS",
    "CHAT_STOP_SEQUENCES",
    "CODE_BENCHMARKS",
    "DEFAULT_BENCHMARKS",
    "METRICS",
    "MMLU_MEDICAL_TOPICS",
    "STOP_SEQUENCES",
    "SUITES",
    "CodeProblem",
    "EvalJob",
    "EvalModel",
    "EvalSettings",
    "GenerationProgress",
    "ItemScores",
    "Metric",
    "Scored",
    "Suite",
    "code_pass_at_1",
    "code_prompt",
    "code_request",
    "dataset_benchmarks",
    "declared_metric",
    "encode_solution",
    "evaluate_model",
    "extract_completion",
    "find_eval_file",
    "generate",
    "heldout_loss",
    "load_humaneval",
    "load_mbpp",
    "load_mmlu",
    "load_suites",
    "lower_is_better",
    "metric_unit",
    "mmlu_accuracy",
    "mmlu_items",
    "plan_suites",
    "response_losses",
    "sequence_counts",
    "solution_nll",
]

# Name -> suite, in the order the benchmarks are listed.
SUITES: dict[str, Suite] = {
    s.name: s for s in sorted(discover(sys.modules[__name__], Suite), key=lambda s: s.listed)
}
BENCHMARKS: tuple[str, ...] = tuple(SUITES)
CODE_BENCHMARKS: tuple[str, ...] = tuple(n for n, s in SUITES.items() if s.kind == "code")


def _declared() -> dict[str, Metric]:
    out = {f"{heldout.PREFIX}_{m.key}": m for m in heldout.METRICS}
    for suite in SUITES.values():
        for m in suite.metrics:
            name = suite.metric_name(m)
            if name in out:
                raise ValueError(f"metric {name!r} is declared twice; rename a suite or metric")
            out[name] = m
    return out


# Every metric a model's evaluation can report, by the name it is reported under.
METRICS: dict[str, Metric] = _declared()


def declared_metric(metric: str) -> Metric:
    """The declaration of the metric reported as ``metric`` (:data:`METRICS`).

    Raises:
        ValueError: no suite declares it (names the declared ones).
    """
    try:
        return METRICS[metric]
    except KeyError:
        raise ValueError(
            f"metric {metric!r} is declared by no evaluation suite; declared: {sorted(METRICS)}"
        ) from None


def lower_is_better(metric: str) -> bool:
    """Whether the metric falls as models improve (losses, NLLs, perplexities), as its suite
    declares it.

    Raises:
        ValueError: no suite declares the metric.
    """
    return declared_metric(metric).lower_is_better


def metric_unit(metric: str) -> str:
    """The unit of a metric's values, for axis labels, as its suite declares it
    (``nats/token``, ``fraction of problems solved``, ...).

    Raises:
        ValueError: no suite declares the metric.
    """
    return declared_metric(metric).unit


class EvalSettings(SequenceSettings, PackingSettings):
    """Knobs of one model's evaluation (the ``eval_report`` run config inherits them); the
    sequence knobs (max_length, truncation, response_turns) apply to the held-out loss as in
    training, the batching knobs (packing, max_packed_length) to every likelihood pass."""

    batch_size: int = Field(default=8, ge=1, description="Samples per forward/generate batch.")
    # list[str], not list[Benchmark]: Dagster's run config cannot express a list of literals.
    benchmarks: list[str] | None = Field(
        default=None,
        description=f"Benchmarks beside held-out loss, from {list(BENCHMARKS)}. "
        'null = the dataset\'s own: data/raw/<dataset>/eval.json {"benchmarks": [...]}, or '
        "humaneval + mbpp for python_stdlib.",
    )
    humaneval_problems: int = Field(
        default=8, ge=0, le=164, description="First N HumanEval problems (0 = none; all 164)."
    )
    mbpp_problems: int = Field(default=8, ge=0, description="First N MBPP-style problems.")
    mmlu_questions: int = Field(
        default=200, ge=0, description="MMLU questions (a seeded sample over the chosen topics)."
    )
    max_new_tokens: int = Field(default=200, ge=1, description="Generation budget per problem.")
    timeout_s: float = Field(default=5.0, gt=0, description="Seconds per generated program.")
    unsafe_sandbox: bool = Field(
        default=False,
        description="Run generated code without isolation where bubblewrap cannot create "
        "namespaces (the report says so in its first lines). Off: such machines refuse to run "
        "it.",
    )
    generate: bool = Field(
        default=True,
        description="Generate completions for the code benchmarks' pass@1; off = likelihood "
        "metrics only (held-out loss, reference-solution NLL, MMLU), far cheaper on a CPU.",
    )
    eval_data_dir: str | None = Field(
        default=None,
        description="Folder with mbpp_reworded.json and mmlu.jsonl. null = "
        "data/eval/, else ../shared/datasets/eval/ beside the project.",
    )

    @field_validator("benchmarks")
    @classmethod
    def _known_benchmarks(cls, names: list[str] | None) -> list[str] | None:
        unknown = sorted(set(names or ()) - set(BENCHMARKS))
        if unknown:
            raise ValueError(f"unknown benchmarks {unknown}; choose from {list(BENCHMARKS)}")
        return names


def find_eval_file(folders: Sequence[Path], name: str) -> Path | None:
    """The first ``folder/name`` that exists."""
    return next((f / name for f in folders if (f / name).exists()), None)


def load_suites(
    names: Sequence[str], settings: EvalSettings, folders: Sequence[Path]
) -> tuple[dict[str, list], dict[str, str]]:
    """The problems or questions of each benchmark (:data:`SUITES`), sized by ``settings``,
    reading benchmark files from the first of ``folders`` that has them.

    Returns:
        (benchmark -> problems/questions, benchmark -> why it was skipped: a size of 0 or a
        missing file).
    """
    suites: dict[str, list] = {}
    skipped: dict[str, str] = {}
    for name in names:
        suite = SUITES[name]
        size = int(getattr(settings, suite.size_knob))
        path = find_eval_file(folders, suite.file) if suite.file else None
        if not size:
            skipped[name] = "size set to 0"
        elif suite.file and path is None:
            skipped[name] = f"{suite.file} not found in data/eval/ or eval_data_dir"
        else:
            suites[name] = suite.load(path, size)
    return suites, skipped


def evaluate_model(
    path: str,
    heldout: pl.DataFrame,
    suites: dict[str, list],
    settings: EvalSettings,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Load the model at ``path`` and measure held-out loss and every benchmark of ``suites``.

    Returns ``{"metrics": {name: value}, "items": {name: ItemScores.to_dict()}, "details":
    {benchmark: per-item records}, "heldout_tokens": int, "eval_seconds": float}``; metric
    names are those the suites declare (:data:`METRICS`): ``heldout_loss`` (nats/token),
    ``heldout_perplexity``, ``<code benchmark>_pass@1``, ``<code benchmark>_solution_nll``
    (where the benchmark has reference solutions) and ``<mmlu benchmark>_accuracy``. Every
    metric but perplexity has per-item scores.

    Raises:
        SandboxUnavailableError: code to generate and no sandbox (before the model loads).
        ValueError: no held-out sample keeps a response token, or a suite reported a metric
            it does not declare.
    """
    start = time.perf_counter()
    if settings.generate and any(name in CODE_BENCHMARKS for name in suites):
        check_sandbox(settings.unsafe_sandbox)  # refuse before any model is loaded
    import torch

    from cluster_pipeline.models.loading import load_model_and_tokenizer

    torch.manual_seed(0)
    model, tokenizer = load_model_and_tokenizer(path)
    log(f"held-out loss on {heldout.height} samples")
    loss = heldout_loss(model, tokenizer, heldout, settings, settings.batch_size)
    log(f"held-out loss: {loss['loss']:.4f} nats/token over {loss['tokens']} response tokens")
    metrics = {"heldout_loss": loss["loss"], "heldout_perplexity": loss["perplexity"]}
    items: dict[str, ItemScores] = {"heldout_loss": loss["items"]}
    details = {}
    for name, problems in suites.items():
        suite = SUITES[name]
        declared = {m.key: suite.metric_name(m) for m in suite.metrics}
        for key, (value, item_scores, records) in suite.score(
            model, tokenizer, problems, settings, log
        ).items():
            if key not in declared:
                raise ValueError(
                    f"suite {name!r} reported the metric {key!r}, which its metrics do not "
                    f"declare ({sorted(declared)}); declare it in the suite's module"
                )
            metrics[declared[key]] = value
            items[declared[key]] = item_scores
            if records is not None:
                details[name] = records
    return {
        "metrics": metrics,
        "items": {k: v.to_dict() for k, v in items.items()},
        "details": details,
        "heldout_tokens": loss["tokens"],
        "heldout_sequences": loss["sequences"],
        "eval_seconds": time.perf_counter() - start,
    }


class EvalModel(StrictModel):
    """One model of an evaluation job and the JSON file its outcome is written to."""

    model_path: str
    output: str


class EvalJob(JobFile):
    """One report's evaluations in one process: settings, the models (each with its outcome
    file), the pinned held-out split's table, the benchmarks and where their files are."""

    @classmethod
    def partial(
        cls, settings: EvalSettings, instructions, benchmarks: list[str], folders: Sequence[Path]
    ) -> Callable[[list[EvalModel]], EvalJob]:
        """``models -> EvalJob`` for one report: the same settings, held-out table version
        (``instructions``, a TableRef) and benchmarks for each model."""

        def job(models: list[EvalModel]) -> EvalJob:
            return cls(
                settings=settings,
                models=models,
                instructions_uri=instructions.uri,
                instructions_version=instructions.version,
                benchmarks=benchmarks,
                eval_folders=[str(f) for f in folders],
            )

        return job

    settings: EvalSettings
    models: list[EvalModel] = Field(min_length=1)
    instructions_uri: str
    instructions_version: int = Field(ge=0)
    benchmarks: list[str]
    eval_folders: list[str]


DEFAULT_BENCHMARKS = {"python_stdlib": ("humaneval", "mbpp")}


def dataset_benchmarks(dataset: str, raw_dir: Path) -> tuple[str, ...]:
    """The benchmarks that apply to a dataset partition: ``benchmarks`` in
    ``data/raw/<dataset>/eval.json`` if present, else the built-in default (code benchmarks for
    python_stdlib), else none (held-out loss only).

    Raises:
        ValueError: eval.json is not strict JSON (:class:`~cluster_pipeline.data.json_text.
            JsonTextError`, at ``file:line:column``), not such an object, or names an unknown
            benchmark.
    """
    path = raw_dir / dataset / EVAL_CONFIG_NAME
    if path.exists():
        value = json_text.load(path, 'Write one JSON object like {"benchmarks": ["mmlu_medical"]}.')
        listed = value.get("benchmarks", []) if isinstance(value, dict) else None
        if not isinstance(listed, list) or not all(isinstance(n, str) for n in listed):
            raise ValueError(
                f'{path}: expected a JSON object like {{"benchmarks": ["mmlu_medical"]}}, got '
                f"{json.dumps(value, ensure_ascii=False)[:120]}"
            )
        names = tuple(listed)
        unknown = set(names) - set(BENCHMARKS)
        if unknown:
            raise ValueError(
                f"{path}: unknown benchmarks {sorted(unknown)}; choose from {BENCHMARKS}"
            )
        return names
    return DEFAULT_BENCHMARKS.get(dataset, ())


def plan_suites(
    dataset: str, settings: EvalSettings, raw_dir: Path, default_folders: Sequence[Path]
) -> tuple[dict[str, list], dict[str, str], list[Path]]:
    """Which benchmarks a dataset is judged on and their items: ``settings.benchmarks``, else
    the dataset's own (:func:`dataset_benchmarks`), read from ``settings.eval_data_dir`` or else
    ``default_folders``; refuses, before any model is loaded, to run generated code where the
    sandbox cannot isolate it (unless ``unsafe_sandbox``).

    Returns:
        (benchmark -> items, benchmark -> why it was skipped, the folders searched).

    Raises:
        ValueError: the dataset's eval.json is malformed or names an unknown benchmark.
        SandboxUnavailableError: code benchmarks to generate and no sandbox.
    """
    names = (
        settings.benchmarks
        if settings.benchmarks is not None
        else dataset_benchmarks(dataset, raw_dir)
    )
    folders = [Path(settings.eval_data_dir)] if settings.eval_data_dir else list(default_folders)
    suites, skipped = load_suites(names, settings, folders)
    if settings.generate and any(name in CODE_BENCHMARKS for name in suites):
        check_sandbox(settings.unsafe_sandbox)
    return suites, skipped, folders
