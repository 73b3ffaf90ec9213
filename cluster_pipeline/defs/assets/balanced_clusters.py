"""Stage 2: k-means over the proxy embeddings, then the capacity-constrained assignment."""

import time

import dagster as dg

from cluster_pipeline.defs.configs import BalancedClustersConfig
from cluster_pipeline.defs.metadata import error_checks, table_display
from cluster_pipeline.defs.records import ProxyEmbeddingsRecord, clusters_record, read_record
from cluster_pipeline.defs.resources import StorageResource
from cluster_pipeline.defs.run_checks import refused_in_step
from cluster_pipeline.defs.stages import stage_asset
from cluster_pipeline.evaluation import plots
from cluster_pipeline.selection.clustering import check_capacity, cluster_frames, cluster_table
from cluster_pipeline.selection.embedding_table import REPRESENTATIONS
from cluster_pipeline.selection.selectors import cluster_weights
from cluster_pipeline.storage.names import BALANCED_CLUSTERS, CLUSTER_CENTROIDS, PROXY_EMBEDDINGS
from cluster_pipeline.storage.tables import content_digest, write_table


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
        raise refused_in_step(context, layout, f"{dataset}: {e}") from e
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
    for line in result.summary(cluster_weights(result.sizes)):
        context.log.info(line)
    capacity_check = check_capacity(
        frame["sample_id"],
        frame["cluster"].to_numpy(),
        config.num_clusters,
        frame.height,
        result.cap,
    )
    record = clusters_record(config, streamed, embeddings, table, centroids_table, seconds)
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
        data_version=dg.DataVersion(content_digest(frame, frame.columns)),
    )
