"""Stage 6: was the subset worth it? Base model, the CluSTER checkpoint and every other
checkpoint of the dataset, side by side."""

import json
from pathlib import Path

import dagster as dg
import polars as pl
from pydantic import Field

from cluster_pipeline.defs.records import EvalReportRecord, TrainedCheckpointRecord, read_record
from cluster_pipeline.defs.resources import (
    BaseModelResource,
    StorageResource,
    TorchrunResource,
    TrackingResource,
    run_tags,
)
from cluster_pipeline.defs.run_checks import recheck_settings
from cluster_pipeline.defs.stages import stage_asset
from cluster_pipeline.evaluation import plots
from cluster_pipeline.evaluation.report import (
    Report,
    evaluate_entries,
    item_scores_frame,
    model_entries,
    render_report,
)
from cluster_pipeline.evaluation.sandbox import sandbox_problem
from cluster_pipeline.evaluation.suites import EvalJob, EvalModel, EvalSettings, plan_suites
from cluster_pipeline.launch.torchrun import RECIPES
from cluster_pipeline.storage.cache import JsonCache, stable_hash
from cluster_pipeline.storage.layout import SHARED_EVAL_DIR
from cluster_pipeline.storage.names import EVAL_ITEM_SCORES, RAW_INSTRUCTIONS, TRAINED_CHECKPOINT
from cluster_pipeline.storage.tables import write_table
from cluster_pipeline.tracking.tracker import TAG_CHECKPOINT, Tracker
from cluster_pipeline.training.checkpointing import Checkpoint, list_checkpoints, read_checkpoint
from cluster_pipeline.training.config import settings_of


class EvalReportConfig(dg.Config, EvalSettings):
    """The evaluation knobs (:class:`~cluster_pipeline.evaluation.suites.EvalSettings`) plus which
    models the report compares."""

    compare_checkpoints: bool = Field(
        default=True,
        description="Also evaluate every other "
        "checkpoint of this dataset (other selectors, seeds).",
    )


@stage_asset("training", deps=[TRAINED_CHECKPOINT, RAW_INSTRUCTIONS], kinds={"pytorch", "markdown"})
def eval_report(
    context: dg.AssetExecutionContext,
    config: EvalReportConfig,
    storage: StorageResource,
    base_model: BaseModelResource,
    torchrun: TorchrunResource,
    pipes_subprocess_client: dg.PipesSubprocessClient,
    tracking: TrackingResource,
) -> dg.MaterializeResult:
    """Base model vs the CluSTER checkpoint (and, side by side, every other checkpoint of this
    dataset: other selectors, budgets, seeds; mean ± std over seeds): held-out loss and
    perplexity on the held-out split of the raw_instructions version the checkpoint was trained
    from, the dataset's benchmarks (HumanEval / MBPP pass@1, MMLU accuracy), training seconds
    and data fraction. Written as standalone Markdown with PNG plots to
    ``data/reports/<dataset>/``. The models without a cached evaluation are evaluated in one
    process (:mod:`cluster_pipeline.recipes.evaluate` under torchrun), so one killed by a signal
    is named with the likely cause; the models it finished before are cached. The metrics,
    the report and its plots also go into the checkpoint's MLflow run (the tracking resource).
    """
    dataset, layout = context.partition_key, storage.layout
    trained = read_record(context, TrainedCheckpointRecord)
    instructions = trained.inputs[RAW_INSTRUCTIONS]
    heldout = instructions.read().filter(pl.col("split") == "heldout")
    if heldout.height == 0:
        raise dg.Failure(
            f"{dataset}: the held-out split is empty; materialize raw_instructions "
            "with heldout_fraction > 0"
        )
    settings = settings_of(config, EvalSettings)
    try:  # refuses before any model is loaded
        suites, skipped, folders = plan_suites(
            dataset, settings, layout.raw_dir, [layout.eval_dir, SHARED_EVAL_DIR]
        )
    except ValueError as e:
        raise dg.Failure(f"{dataset}: {e}") from e
    for name, reason in skipped.items():
        context.log.info(f"benchmark {name} skipped: {reason}")
    current, checkpoints = _checkpoints(trained.checkpoint_path, config.compare_checkpoints)
    base_path = base_model.local_path(storage)
    recheck_settings(context, layout, base_path, torchrun.agents)  # before any model is loaded
    entries = model_entries(base_path, checkpoints)
    evaluate = _evaluator(
        context,
        torchrun,
        pipes_subprocess_client,
        EvalJob.partial(settings, instructions, list(suites), folders),
        layout.eval_cache_dir(dataset) / "jobs",
    )
    results, heldout_stats = evaluate_entries(
        entries,
        evaluate,
        JsonCache(layout.eval_cache_dir(dataset)),
        settings_key=stable_hash(
            settings.model_dump(), instructions.version, sorted(suites), length=12
        ),
        current=str(current.path),
        log=context.log.info,
    )
    report = render_report(
        dataset,
        results,
        heldout.height,
        heldout_stats["tokens"],
        {k: len(v) for k, v in suites.items()},
        skipped,
        trained.selection_seconds,
        heldout_sequences=heldout_stats["sequences"],
        unsafe_sandbox=(
            sandbox_problem() if settings.unsafe_sandbox and settings.generate else None
        ),
    )
    scores = write_table(
        item_scores_frame(results),
        layout.table_uri(EVAL_ITEM_SCORES, dataset),
        guard=storage.guard,
    )
    path = report.write(layout.reports_dir(dataset))
    # One line in the run's log; the whole report is the asset's ``report`` metadata and file.
    context.log.info(f"{report.headline} Report: {path}")
    record = _record(report, results, scores, path, str(current.path), heldout_stats)
    tracker = tracking.tracker(layout, context.log.warning)
    run_id = _track(tracker, context, record, path, report.pngs)
    return dg.MaterializeResult(
        metadata={
            **answer_first(report),
            **record.to_metadata(),
            **({"mlflow_run_id": run_id} if run_id else {}),
            "report": report_markdown(report),
        }
    )


def report_markdown(report: Report) -> dg.MetadataValue:
    """The whole report as one Markdown entry, its figures inline (the answer's first)."""
    return dg.MetadataValue.md(
        report.summary
        + "\n"
        + "\n".join(plots.markdown_image(p, n) for n, p in report.pngs.items())
    )


def answer_first(report: Report) -> dict[str, dg.MetadataValue]:
    """The entries the asset page lists first: ``was_it_worth_it``, the answer in a few lines
    (short Markdown, which Dagster 1.13 shows inline), and ``decision_plot``, the figure that
    answers it (a PNG is too long to show inline: Dagster opens it from "[Show Markdown]")."""
    out: dict[str, dg.MetadataValue] = {"was_it_worth_it": dg.MetadataValue.md(report.answer)}
    if "decision.png" in report.pngs:
        out["decision_plot"] = dg.MetadataValue.md(
            plots.markdown_image(report.pngs["decision.png"], "was the subset worth it?")
        )
    return out


def _track(
    tracker: Tracker,
    context: dg.AssetExecutionContext,
    record: EvalReportRecord,
    path: Path,
    pngs: dict[str, bytes],
) -> str | None:
    """The evaluation into the current checkpoint's MLflow run (the newest run tagged with its
    folder; a run of its own, ended at once, for a checkpoint trained untracked): both models'
    metrics (``eval/base/...``, ``eval/tuned/...``), the differences against each reference
    (``eval/difference/<reference>/<metric>``) with their verdicts as tags, and the report
    (Markdown, JSON, plots) under ``eval_report/``. Returns the run id (None: untracked)."""
    run_id = tracker.find_run({TAG_CHECKPOINT: record.checkpoint_path})
    opened = run_id is None
    if opened:
        run_id = tracker.start_run(
            f"{context.partition_key} eval {Path(record.checkpoint_path).name}",
            run_tags(context, **{TAG_CHECKPOINT: record.checkpoint_path}),
        )
    metrics: dict[str, float | None] = {
        **{f"eval/base/{m}": v for m, v in record.base.items()},
        **{f"eval/tuned/{m}": v for m, v in record.tuned.items()},
        "eval/train_seconds": record.train_seconds,
        "eval/full_training_seconds": record.full_training_seconds,
        "eval/data_fraction": record.data_fraction,
    }
    for v in record.verdicts:
        metrics[f"eval/difference/{v['reference']}/{v['metric']}"] = v["difference"]
    tracker.log_metrics(run_id, metrics)
    tracker.set_tags(
        run_id,
        {
            "eval_dagster_run_id": context.run.run_id,
            **{f"verdict/{v['reference']}/{v['metric']}": v["verdict"] for v in record.verdicts},
        },
    )
    for name in (path.name, "eval_report.json"):
        tracker.log_artifact(run_id, path.parent / name, "eval_report")
    for name, png in pngs.items():
        tracker.log_bytes(run_id, png, name, "eval_report")
    if opened:
        tracker.end_run(run_id)
    return run_id


def _checkpoints(checkpoint_path: str, compare: bool) -> tuple[Checkpoint, list[Checkpoint]]:
    """The trained checkpoint, and every finished checkpoint of its folder's runs when
    ``compare`` (itself among them in any case).

    Raises:
        dagster.Failure: ``checkpoint_path`` is not a finished checkpoint.
    """
    current = read_checkpoint(checkpoint_path)
    if current is None:
        raise dg.Failure(
            f"{checkpoint_path} is not a finished checkpoint; materialize trained_checkpoint again"
        )
    checkpoints = list_checkpoints(current.path.parent) if compare else []
    if current.path not in [c.path for c in checkpoints]:
        checkpoints.append(current)
    return current, checkpoints


def _record(report, results, scores, path, checkpoint: str, heldout_stats) -> EvalReportRecord:
    """The stage's record: the current run's verdicts, cost figures and both models' metrics."""
    current = next(r for r in results if r.current)
    kept = ("reference", "metric", "difference", "low", "high", "p_value", "verdict")
    return EvalReportRecord(
        item_scores=scores,
        verdicts=[
            {k: v for k, v in c.to_dict().items() if k in kept}
            for c in report.comparisons
            if c.candidate == current.group
        ],
        report_path=str(path),
        checkpoint_path=checkpoint,
        models_compared=len(results),
        train_seconds=round(report.train_seconds, 2),
        full_training_seconds=round(report.full_training_seconds, 2),
        full_training_measured=report.full_training_measured,
        data_fraction=report.data_fraction,
        heldout_sequences=heldout_stats["sequences"],
        base={m: round(float(v), 5) for m, v in results[0].metrics.items()},
        tuned={m: round(float(v), 5) for m, v in current.metrics.items()},
    )


def _evaluator(context, torchrun, pipes_client, job_of, run_dir: Path):
    """``(paths, done)``: the models at ``paths`` evaluated in one process (torchrun, one rank,
    on this machine), its job file and logs (``<job>.logs/``) under ``run_dir``, and one outcome
    file per model (``<hash of its path>.outcome.json``; a new evaluation of the same model
    replaces it: the cache keeps outcomes). ``done(path, outcome)`` is called for each model
    whose outcome the process wrote, also when the process then failed on a later one."""
    run_dir.mkdir(parents=True, exist_ok=True)

    def evaluate(paths: list[str], done) -> None:
        models = [
            EvalModel(
                model_path=p, output=str(run_dir / f"{stable_hash(p, length=12)}.outcome.json")
            )
            for p in paths
        ]
        for model in models:  # an outcome left by an earlier evaluation is not this one's
            Path(model.output).unlink(missing_ok=True)
        job_file = job_of(models).dump(run_dir / f"{stable_hash(paths, length=12)}.job.json")
        try:
            torchrun.run(context, pipes_client, RECIPES["evaluate"], 1, job_file, local=True)
        finally:
            for model in models:
                out = Path(model.output)
                if out.exists():
                    done(model.model_path, json.loads(out.read_text()))

    return evaluate
