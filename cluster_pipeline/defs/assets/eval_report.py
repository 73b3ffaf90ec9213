"""Stage 6: was the subset worth it? Base model, the CluSTER checkpoint and every other
checkpoint of the dataset, side by side."""

import dagster as dg
import polars as pl

from cluster_pipeline.defs.configs import EvalReportConfig
from cluster_pipeline.defs.metadata import (
    answer_first,
    memory_display,
    report_markdown,
    track_evaluation,
)
from cluster_pipeline.defs.pass_runner import eval_suites, evaluate_models, models_to_compare
from cluster_pipeline.defs.records import TrainedCheckpointRecord, eval_record, read_record
from cluster_pipeline.defs.resources import (
    BaseModelResource,
    StorageResource,
    TorchrunResource,
    TrackingResource,
)
from cluster_pipeline.defs.run_checks import recheck_settings
from cluster_pipeline.defs.stages import stage_asset
from cluster_pipeline.evaluation.report import item_scores_frame, model_entries, render_report
from cluster_pipeline.evaluation.sandbox import sandbox_problem
from cluster_pipeline.evaluation.suites import EvalJob, EvalSettings
from cluster_pipeline.storage.cache import stable_hash
from cluster_pipeline.storage.names import EVAL_ITEM_SCORES, RAW_INSTRUCTIONS, TRAINED_CHECKPOINT
from cluster_pipeline.storage.tables import write_table
from cluster_pipeline.training.config import settings_of
from cluster_pipeline.training.memory import evaluation_estimate


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
    the report and its plots also go into the checkpoint's MLflow run (the tracking resource),
    and the metrics into an evaluation run of their own, a child of the Dagster run's pipeline
    run, with the held-out split as its dataset input.
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
    suites, skipped, folders = eval_suites(context, storage, settings)  # before any model
    current, checkpoints = models_to_compare(trained.checkpoint_path, config.compare_checkpoints)
    base_path = base_model.local_path(storage, context.log.info)
    recheck_settings(context, layout, base_path, torchrun.agents)  # before any model is loaded
    entries = model_entries(base_path, checkpoints)
    results, heldout_stats = evaluate_models(
        context,
        torchrun,
        pipes_subprocess_client,
        entries,
        EvalJob.partial(settings, instructions, list(suites), folders),
        layout.eval_cache_dir(dataset),
        stable_hash(settings.model_dump(), instructions.version, sorted(suites), length=12),
        str(current.path),
    )
    unsafe = sandbox_problem() if settings.unsafe_sandbox and settings.generate else None
    report = render_report(
        dataset,
        results,
        heldout.height,
        heldout_stats["tokens"],
        {k: len(v) for k, v in suites.items()},
        skipped,
        trained.selection_seconds,
        heldout_sequences=heldout_stats["sequences"],
        unsafe_sandbox=unsafe,
    )
    scores_uri = layout.table_uri(EVAL_ITEM_SCORES, dataset)
    scores = write_table(item_scores_frame(results), scores_uri, guard=storage.guard)
    path = report.write(layout.reports_dir(dataset))
    # Two lines in the run's log; the whole report is the asset's ``report`` metadata and file.
    context.log.info(report.headline)
    context.log.info(f"report: {path}")
    knobs = config.model_dump(mode="json")
    record = eval_record(report, results, scores, path, str(current.path), heldout_stats, knobs)
    tracker = tracking.tracker(layout, context.log.warning)
    run_id = track_evaluation(tracker, context, record, path, report.pngs, trained, config, heldout)
    peak = heldout_stats["peak_rss_bytes"]
    memory = memory_display(
        evaluation_estimate(base_path, settings, heldout.height * settings.max_length),
        [peak] if peak else None,
        context.log.info,
    )
    return dg.MaterializeResult(
        metadata={
            **answer_first(report),
            **record.to_metadata(),
            **memory,
            **({"mlflow_run_id": run_id} if run_id else {}),
            "report": report_markdown(report),
        }
    )
