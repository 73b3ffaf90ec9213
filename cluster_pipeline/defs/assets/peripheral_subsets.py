"""Stage 3: balanced down-sampling, keeping the peripheral samples of every cluster."""

import time

import dagster as dg

from cluster_pipeline.defs.configs import PeripheralSubsetsConfig
from cluster_pipeline.defs.metadata import (
    log_selection,
    selection_map,
    start_selection_run,
    subset_display,
    track_selection,
)
from cluster_pipeline.defs.pass_runner import DagsterPassRunner
from cluster_pipeline.defs.records import (
    BalancedClustersRecord,
    SelectionOutcome,
    read_record,
    selection_record,
)
from cluster_pipeline.defs.resources import StorageResource, TorchrunResource, TrackingResource
from cluster_pipeline.defs.run_checks import refused_in_step
from cluster_pipeline.defs.stages import stage_asset
from cluster_pipeline.evaluation.statistics import subset_and_pool_diversity
from cluster_pipeline.selection.passes import PassFailed, SelectionFacts
from cluster_pipeline.selection.selectors import (
    SelectionParams,
    empty_ranks,
    gather_inputs,
    knobs_of,
    per_cluster_summary,
    problems_before_passes,
    run_selector,
    subset_version,
    with_selection,
)
from cluster_pipeline.storage.names import BALANCED_CLUSTERS, PERIPHERAL_SUBSETS, PROXY_EMBEDDINGS
from cluster_pipeline.storage.tables import write_table


# proxy_embeddings: the PCA map of the selected samples reads the embeddings that were clustered.
@stage_asset("selection", deps=[BALANCED_CLUSTERS, PROXY_EMBEDDINGS], kinds={"polars", "deltalake"})
def peripheral_subsets(
    context: dg.AssetExecutionContext,
    config: PeripheralSubsetsConfig,
    storage: StorageResource,
    torchrun: TorchrunResource,
    pipes_subprocess_client: dg.PipesSubprocessClient,
    tracking: TrackingResource,
) -> dg.MaterializeResult:
    """One row per clustered sample: ``selection_rank`` (0 = first chosen within its cluster by
    a cluster selector, in the whole pool by the others), ``selected``, ``copies`` (times
    trained per epoch; > 1 only for uniform oversampling), ``weight`` w_c of its cluster
    (n_c K / N under sample balance, K R_c / R by response tokens under token balance; 1 for
    selectors without re-weighting) and ``score``, what the selector ranks by (null for the
    random orders). The metadata holds the selector's cost: its seconds and the forward/backward
    passes it needed; the selector's notes are warnings. docs/design.md, steps 3 and 5. Tracked
    as an MLflow run (a child of the pipeline run): knobs and configs as params, cost and subset
    figures as metrics, the pool as dataset input, the PCA map and run config as artifacts.
    """
    dataset, selector, start = context.partition_key, config.selector, time.perf_counter()
    clusters = read_record(context, BalancedClustersRecord)
    embeddings = clusters.inputs[PROXY_EMBEDDINGS]
    # The clustered pool, and what runs the selector's own model passes (defs/pass_runner.py).
    runner = DagsterPassRunner(context, storage, torchrun, pipes_subprocess_client, clusters)
    frame, pool, knobs = runner.frame, runner.pool, knobs_of(selector, config)
    facts = SelectionFacts(
        pool_size=pool.n, pool_is="clustered samples", world_size=pool.world_size
    )
    # Before any pass: the selector's own rules, and whether it can fill every rank at all.
    problems = problems_before_passes(selector, knobs, facts, pool, config.ratio, config.balance)
    if problems:
        raise refused_in_step(context, storage.layout, f"{dataset}: {'; '.join(problems)}")
    tracker = tracking.tracker(storage.layout, context.log.warning)
    run_id, pipeline_run = start_selection_run(tracker, context, config, clusters)
    with tracker.ending(run_id, pipeline_run):
        params = SelectionParams(config.ratio, config.seed, config.balance, knobs)
        try:
            inputs, gathered = gather_inputs(selector, knobs, pool, runner)
            result = run_selector(selector, inputs, params)
        except (PassFailed, ValueError) as e:
            raise refused_in_step(context, storage.layout, f"{dataset}: {e}") from e
        # The one place a subset is written: never one that leaves a rank with nothing.
        empty = empty_ranks(result, pool.labels, pool.k, config.ratio, pool.n)
        if empty is not None:
            raise refused_in_step(context, storage.layout, f"{dataset}: {empty}")
        frame = with_selection(frame, result)
        table = write_table(
            frame,
            storage.layout.table_uri(PERIPHERAL_SUBSETS, dataset),
            guard=storage.guard,
            inputs={**clusters.lineage(), **runner.tables},
        )
        # The selection's cost, not the tracking's (opening the MLflow run takes seconds).
        seconds = time.perf_counter() - start - tracker.seconds
        # Gradient diversity of the subset as trained and of the pool, streamed from the embeddings.
        diversity = subset_and_pool_diversity(
            embeddings.vector_batches("embedding", keep="skip_reason"),
            frame.select("sample_id", "copies"),
        )
        summary = per_cluster_summary(frame)
        outcome = SelectionOutcome(
            gathered.details, runner.tables, runner.wall_seconds, table, seconds, summary, diversity
        )
        record = selection_record(config, result, clusters, outcome)
        log_selection(context.log, record, result.notes, dataset)
        title = f"{selector} r={config.ratio}: selected samples ringed"
        map_png = selection_map(frame, embeddings, clusters.representation, result.selected, title)
        track_selection(tracker, run_id, record, map_png, dataset)
    return dg.MaterializeResult(
        metadata={
            **record.to_metadata(),
            **subset_display(frame, summary, map_png),
            **({"mlflow_run_id": run_id} if run_id else {}),
        },
        # The subset and what shard_manifests reads beside it (how it is dealt).
        data_version=dg.DataVersion(subset_version(frame, selector, result)),
    )
