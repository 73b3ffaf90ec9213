"""Stage 2: k-means over the proxy embeddings, then the capacity-constrained assignment."""


import time

import dagster as dg
import numpy as np
import polars as pl
from pydantic import Field

from cluster_pipeline.core import plots
from cluster_pipeline.core.clustering import balanced_kmeans
from cluster_pipeline.core.tables import TableRef, vectors_to_series, write_table
from cluster_pipeline.defs.metadata import table_metadata, upstream_table
from cluster_pipeline.defs.partitions import dataset_partitions
from cluster_pipeline.defs.resources import StorageResource


class BalancedClustersConfig(dg.Config):
    num_clusters: int = Field(default=2, ge=1, description="K: clusters = data-parallel ranks "
                              "(GPUs) that will train, one cluster per rank.")
    alpha: float = Field(default=1.0, ge=1.0, description="Capacity slack: no cluster exceeds "
                         "ceil(alpha * N / K). 1.0 = exact balance.")
    seed: int = Field(default=0, description="k-means seed.")
    niter: int = Field(default=25, ge=1, description="k-means iterations.")


def clusterable(ref: TableRef) -> tuple[pl.DataFrame, np.ndarray, pl.DataFrame]:
    """Split embedded samples into (rows to cluster, their (N, d) float32 normalised
    embeddings, rows quarantined for non-finite values). Embeddings are read batch by batch."""
    rows, matrix = ref.read_vectors("embedding_normalised", keep="skip_reason")
    finite = np.isfinite(matrix).all(axis=1)
    if finite.all():
        return rows, matrix, rows.clear()
    keep = pl.Series(finite)
    return rows.filter(keep), matrix[finite], rows.filter(~keep)


@dg.asset(
    partitions_def=dataset_partitions,
    deps=["proxy_embeddings"],
    group_name="selection",
    kinds={"faiss", "deltalake"},
    code_version="1",
    # Kept in sync with its parent; training and evaluation run only on request.
    automation_condition=dg.AutomationCondition.eager(),
    check_specs=[
        dg.AssetCheckSpec(
            "capacity", asset="balanced_clusters", blocking=True,
            description="Every sample in exactly one cluster, sizes sum to N, none above the cap.",
        )
    ],
)
def balanced_clusters(
    context: dg.AssetExecutionContext, config: BalancedClustersConfig, storage: StorageResource
) -> dg.MaterializeResult:
    """One row per clustered sample: ``cluster`` (after the capacity step), ``kmeans_cluster``
    (nearest centroid) and ``sq_distance`` (squared L2 distance to its cluster's centroid, on
    normalised embeddings). No cluster holds more than ceil(alpha N / K). DESIGN.md step 2.
    A second table holds the K centroids.
    """
    dataset = context.partition_key
    start = time.perf_counter()
    rows, x, quarantined = clusterable(upstream_table(context, "proxy_embeddings"))
    try:
        result = balanced_kmeans(x, config.num_clusters, config.alpha, config.seed, config.niter)
    except ValueError as e:
        raise dg.Failure(description=f"{dataset}: {e}") from e
    frame = rows.with_columns(
        pl.Series("cluster", result.labels),
        pl.Series("kmeans_cluster", result.kmeans_labels),
        pl.Series("sq_distance", result.sq_distance),
    )
    ref = write_table(frame, storage.table_uri("balanced_clusters", dataset))
    centroids = pl.DataFrame({"cluster": np.arange(config.num_clusters)}).with_columns(
        vectors_to_series("centroid", result.centroids),
        pl.Series("size", result.sizes),
        pl.Series("kmeans_size", result.kmeans_sizes),
    )
    centroid_ref = write_table(centroids, storage.table_uri("cluster_centroids", dataset))
    seconds = time.perf_counter() - start
    sizes_png = plots.cluster_sizes(result.kmeans_sizes, result.sizes, result.cap)
    map_png = plots.pca_map(x, result.labels)
    context.log.info(
        f"K={config.num_clusters}: sizes {result.sizes.tolist()} (k-means "
        f"{result.kmeans_sizes.tolist()}), cap {result.cap}, cost +{100 * result.cost_increase:.2f}%"
    )
    sizes = np.bincount(frame["cluster"].to_numpy(), minlength=config.num_clusters)
    unique = frame["sample_id"].n_unique() == frame.height
    capacity_ok = unique and int(sizes.sum()) == len(x) and int(sizes.max()) <= result.cap
    return dg.MaterializeResult(
        check_results=[
            dg.AssetCheckResult(
                check_name="capacity", passed=bool(capacity_ok),
                severity=dg.AssetCheckSeverity.ERROR,
                description=f"sizes {sizes.tolist()} (sum {int(sizes.sum())}, N {len(x)}), "
                f"cap {result.cap}, sample ids unique: {unique}",
            )
        ],
        metadata={
            **table_metadata(ref, frame, seconds),
            "centroids_uri": dg.MetadataValue.path(centroid_ref.uri),
            "centroids_version": centroid_ref.version,
            "num_clusters": config.num_clusters,
            "cap": result.cap,
            "cluster_sizes": dg.MetadataValue.json(result.sizes.tolist()),
            "kmeans_cluster_sizes": dg.MetadataValue.json(result.kmeans_sizes.tolist()),
            "kmeans_cost": round(result.kmeans_cost, 4),
            "capacity_cost": round(result.cost, 4),
            "capacity_cost_increase_pct": round(100 * result.cost_increase, 3),
            "quarantined_non_finite": dg.MetadataValue.json(quarantined["sample_id"].to_list()[:100]),
            "quarantined_count": quarantined.height,
            "cluster_sizes_plot": dg.MetadataValue.md(plots.markdown_image(sizes_png, "cluster sizes")),
            "pca_map": dg.MetadataValue.md(plots.markdown_image(map_png, "PCA map")),
        },
    )
