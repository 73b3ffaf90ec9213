"""Stage 6: was the subset worth it? Base model, the CluSTER checkpoint and every other
checkpoint of the dataset, side by side."""

import json
from pathlib import Path

import dagster as dg
import polars as pl
from pydantic import Field

from cluster_pipeline.core import plots
from cluster_pipeline.core.cache import JsonCache, stable_hash
from cluster_pipeline.core.checkpoints import list_checkpoints, read_checkpoint
from cluster_pipeline.core.evaluation import CODE_BENCHMARKS, EvalSettings, load_suites
from cluster_pipeline.core.layout import SHARED_EVAL_DIR
from cluster_pipeline.core.report import (
    dataset_benchmarks,
    evaluate_entries,
    item_scores_frame,
    model_entries,
    render_report,
)
from cluster_pipeline.core.sandbox import check_sandbox, sandbox_problem
from cluster_pipeline.core.tables import write_table
from cluster_pipeline.defs.records import EvalReportRecord, TrainedCheckpointRecord, read_record
from cluster_pipeline.defs.resources import BaseModelResource, StorageResource, TorchrunResource
from cluster_pipeline.defs.run_checks import preflight
from cluster_pipeline.defs.stages import stage_asset
from cluster_pipeline.training.config import EvalJob, settings_of

EVAL_MODULE = "cluster_pipeline.training.evaluate"


class EvalReportConfig(dg.Config, EvalSettings):
    """The evaluation knobs (:class:`~cluster_pipeline.core.evaluation.EvalSettings`) plus which
    models the report compares."""

    compare_checkpoints: bool = Field(
        default=True,
        description="Also evaluate every other "
        "checkpoint of this dataset (other selectors, seeds).",
    )


@stage_asset(
    "training", deps=["trained_checkpoint", "raw_instructions"], kinds={"pytorch", "markdown"}
)
def eval_report(
    context: dg.AssetExecutionContext,
    config: EvalReportConfig,
    storage: StorageResource,
    base_model: BaseModelResource,
    torchrun: TorchrunResource,
    pipes_subprocess_client: dg.PipesSubprocessClient,
) -> dg.MaterializeResult:
    """Base model vs the CluSTER checkpoint (and, side by side, every other checkpoint of this
    dataset: other selectors, budgets, seeds; mean ± std over seeds): held-out loss and
    perplexity on the held-out split of the raw_instructions version the checkpoint was trained
    from, the dataset's benchmarks (HumanEval / MBPP pass@1, MMLU accuracy), training seconds
    and data fraction. Written as standalone Markdown with PNG plots to
    ``data/reports/<dataset>/``. Each model is evaluated in its own process
    (:mod:`cluster_pipeline.training.evaluate` under torchrun), so one killed by a signal is
    named with the likely cause.
    """
    dataset, layout = context.partition_key, storage.layout
    trained = read_record(context, TrainedCheckpointRecord)
    instructions = trained.inputs["raw_instructions"]
    heldout = instructions.read().filter(pl.col("split") == "heldout")
    if heldout.height == 0:
        raise dg.Failure(
            f"{dataset}: the held-out split is empty; materialize raw_instructions "
            "with heldout_fraction > 0"
        )
    settings = settings_of(config, EvalSettings)
    try:
        names = (
            settings.benchmarks
            if settings.benchmarks is not None
            else dataset_benchmarks(dataset, layout.raw_dir)
        )
    except ValueError as e:
        raise dg.Failure(f"{dataset}: {e}") from e
    folders = (
        [Path(settings.eval_data_dir)]
        if settings.eval_data_dir
        else [layout.eval_dir, SHARED_EVAL_DIR]
    )
    suites, skipped = load_suites(names, settings, folders)
    for name, reason in skipped.items():
        context.log.info(f"benchmark {name} skipped: {reason}")
    if settings.generate and any(name in CODE_BENCHMARKS for name in suites):
        check_sandbox(settings.unsafe_sandbox)  # refuse before any model is loaded

    current = read_checkpoint(trained.checkpoint_path)
    if current is None:
        raise dg.Failure(
            f"{trained.checkpoint_path} is not a finished checkpoint; materialize "
            "trained_checkpoint again"
        )
    checkpoints = list_checkpoints(current.path.parent) if config.compare_checkpoints else []
    if current.path not in [c.path for c in checkpoints]:
        checkpoints.append(current)
    base_path = base_model.local_path(storage)
    preflight(context, layout, base_path, torchrun.agents)  # before any model is loaded
    entries = model_entries(base_path, checkpoints)
    # Job files, per-process logs (<job>.logs/) and outcomes, one set per model (a new
    # evaluation of the same model replaces them; the cache keeps the outcomes).
    run_dir = layout.eval_cache_dir(dataset) / "jobs"
    run_dir.mkdir(parents=True, exist_ok=True)

    def evaluate(path: str) -> dict:
        name = stable_hash(path, length=12)
        job = EvalJob(
            settings=settings,
            model_path=path,
            instructions_uri=instructions.uri,
            instructions_version=instructions.version,
            benchmarks=list(suites),
            eval_folders=[str(f) for f in folders],
            output=str(run_dir / f"{name}.outcome.json"),
        )
        job_file = job.dump(run_dir / f"{name}.job.json")
        torchrun.run(context, pipes_subprocess_client, EVAL_MODULE, 1, job_file, local=True)
        return json.loads(Path(job.output).read_text())

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
        layout.table_uri("eval_item_scores", dataset),
        guard=storage.guard,
    )
    path = report.write(layout.reports_dir(dataset))
    context.log.info(report.summary)
    current_group = next(r.group for r in results if r.current)
    record = EvalReportRecord(
        item_scores=scores,
        verdicts=[
            {
                k: v
                for k, v in c.to_dict().items()
                if k in ("reference", "metric", "difference", "low", "high", "verdict")
            }
            for c in report.comparisons
            if c.candidate == current_group
        ],
        report_path=str(path),
        checkpoint_path=str(current.path),
        models_compared=len(results),
        train_seconds=round(report.train_seconds, 2),
        full_training_seconds=round(report.full_training_seconds, 2),
        full_training_measured=report.full_training_measured,
        data_fraction=report.data_fraction,
        heldout_sequences=heldout_stats["sequences"],
        base={m: round(float(v), 5) for m, v in results[0].metrics.items()},
        tuned={
            m: round(float(v), 5) for m, v in next(r for r in results if r.current).metrics.items()
        },
    )
    return dg.MaterializeResult(
        metadata={
            **record.to_metadata(),
            "report": dg.MetadataValue.md(
                report.summary
                + "\n"
                + "\n".join(plots.markdown_image(p, n) for n, p in report.pngs.items())
            ),
        }
    )
