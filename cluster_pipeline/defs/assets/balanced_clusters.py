"""Stage 2: k-means over the proxy embeddings, then the capacity-constrained assignment."""

import time
from typing import Literal

import dagster as dg
from pydantic import Field

from cluster_pipeline.defs.metadata import error_checks, table_display
from cluster_pipeline.defs.records import BalancedClustersRecord, ProxyEmbeddingsRecord, read_record
from cluster_pipeline.defs.resources import StorageResource
from cluster_pipeline.defs.stages import stage_asset
from cluster_pipeline.evaluation import plots
from cluster_pipeline.selection.clustering import (
    DEFAULT_ALPHA,
    KMEANS_NITER,
    KMEANS_RESTARTS,
    StreamedClusters,
    check_capacity,
    cluster_frames,
    cluster_table,
)
from cluster_pipeline.selection.embedding_table import REPRESENTATIONS
from cluster_pipeline.selection.selectors import cluster_weights
from cluster_pipeline.storage.names import BALANCED_CLUSTERS, CLUSTER_CENTROIDS, PROXY_EMBEDDINGS
from cluster_pipeline.storage.tables import TableRef, write_table


class BalancedClustersConfig(dg.Config):
    """The clustering knobs of a run (launchpad, YAML, CLI)."""

    num_clusters: int = Field(
        default=2,
        ge=1,
        description="K: clusters = data-parallel ranks "
        "(GPUs) that will train, one cluster per rank.",
    )
    alpha: float = Field(
        default=DEFAULT_ALPHA,
        ge=1.0,
        description="Capacity slack: no cluster exceeds ceil(alpha * N / K); the cap binds only "
        "when k-means leaves a cluster above it. 1.5 = the CluSTER reference's soft cap (unequal "
        "clusters stay unequal and their ranks are re-weighted); 1.0 = exact balance (every "
        "weight w_c = 1 when K divides N).",
    )
    seed: int = Field(default=0, ge=0, description="k-means seed (sample and restarts).")
    niter: int = Field(
        default=KMEANS_NITER,
        ge=1,
        description="Most Lloyd iterations per k-means run (a run stops once its objective "
        "stops falling); the reference's max_iter is 300.",
    )
    restarts: int = Field(
        default=KMEANS_RESTARTS,
        ge=1,
        description="k-means runs from different k-means++ seedings; the lowest inertia wins "
        "(the reference's n_init is 10).",
    )
    representation: Literal["gradient_proxy", "hidden_mean"] = Field(
        default="gradient_proxy",
        description="What to cluster: gradient_proxy = the CluSTER embedding e (default); "
        "hidden_mean = the mean final hidden state over the response, from the same pass.",
    )


@stage_asset(
    "selection",
    deps=[PROXY_EMBEDDINGS],
    kinds={"faiss", "deltalake"},
    check_specs=[
        dg.AssetCheckSpec(
            "capacity",
            asset=BALANCED_CLUSTERS,
            blocking=True,
            description="Every sample in exactly one cluster, sizes sum to N, none above the cap.",
        )
    ],
)
def balanced_clusters(
    context: dg.AssetExecutionContext, config: BalancedClustersConfig, storage: StorageResource
) -> dg.MaterializeResult:
    """One row per clustered sample: ``cluster`` (after the capacity step), ``kmeans_cluster``
    (nearest centroid) and ``sq_distance`` (squared L2 distance to its cluster's centroid, on
    normalised embeddings). No cluster holds more than ceil(alpha N / K). docs/design.md, step 2.
    A second table holds the K centroids.
    """
    dataset, layout = context.partition_key, storage.layout
    start = time.perf_counter()
    embeddings = read_record(context, ProxyEmbeddingsRecord)
    column = f"{REPRESENTATIONS[config.representation]}_normalised"
    try:
        streamed = cluster_table(
            embeddings.table,
            column,
            config.num_clusters,
            config.alpha,
            config.seed,
            config.niter,
            restarts=config.restarts,
        )
    except ValueError as e:
        raise dg.Failure(description=f"{dataset}: {e}") from e
    result = streamed.result
    frame, centroids = cluster_frames(streamed)
    table = write_table(
        frame,
        layout.table_uri(BALANCED_CLUSTERS, dataset),
        guard=storage.guard,
        inputs=embeddings.lineage(),
    )
    centroids_table = write_table(
        centroids, layout.table_uri(CLUSTER_CENTROIDS, dataset), guard=storage.guard
    )
    seconds = time.perf_counter() - start
    context.log.info(result.summary(cluster_weights(result.sizes)))
    capacity_check = check_capacity(
        frame["sample_id"],
        frame["cluster"].to_numpy(),
        config.num_clusters,
        frame.height,
        result.cap,
    )
    record = _record(config, streamed, embeddings, table, centroids_table, seconds)
    sizes_png = plots.png(plots.cluster_sizes_figure(result.kmeans_sizes, result.sizes, result.cap))
    map_png = plots.png(
        plots.pca_map_figure(
            streamed.kmeans_sample,
            streamed.kmeans_sample_labels,
            title=f"Proxy embeddings by cluster ({config.representation}, the k-means sample)",
        )
    )
    return dg.MaterializeResult(
        check_results=error_checks({"capacity": capacity_check}),
        metadata={
            **record.to_metadata(),
            **table_display(frame, BALANCED_CLUSTERS),
            "cluster_sizes_plot": dg.MetadataValue.md(
                plots.markdown_image(sizes_png, "cluster sizes")
            ),
            "pca_map": dg.MetadataValue.md(plots.markdown_image(map_png, "PCA map")),
        },
    )


def _record(
    config: BalancedClustersConfig,
    streamed: StreamedClusters,
    embeddings: ProxyEmbeddingsRecord,
    table: TableRef,
    centroids: TableRef,
    seconds: float,
) -> BalancedClustersRecord:
    """The record of a clustering that took ``seconds``, written as ``table`` and
    ``centroids``."""
    result, fit = streamed.result, streamed.result.kmeans_fit
    return BalancedClustersRecord(
        table=table,
        centroids=centroids,
        inputs=embeddings.lineage(),
        seconds=round(seconds, 3),
        selection_seconds=round(embeddings.selection_seconds + seconds, 2),
        num_clusters=config.num_clusters,
        representation=config.representation,
        alpha=config.alpha,
        cap=result.cap,
        cluster_sizes=result.sizes.tolist(),
        kmeans_cluster_sizes=result.kmeans_sizes.tolist(),
        kmeans_cost=round(result.kmeans_cost, 4),
        capacity_cost=round(result.cost, 4),
        capacity_cost_increase_pct=round(100 * result.cost_increase, 3),
        capacity_optimality_gap=float(f"{result.optimality_gap:.3g}"),
        capacity_boundary_samples=result.boundary_samples,
        cluster_weights=[round(float(w), 6) for w in cluster_weights(result.sizes)],
        kmeans_sample_size=fit.sample_size,
        kmeans_restarts=fit.restarts,
        kmeans_niter=fit.niter,
        kmeans_inertia=round(fit.inertia, 6),
        kmeans_restart_inertias=[round(v, 6) for v in fit.restart_inertias],
        kmeans_restart_iterations=list(fit.restart_iterations),
        quarantined_count=streamed.quarantined.len(),
        quarantined_non_finite=streamed.quarantined.to_list()[:100],
    )
