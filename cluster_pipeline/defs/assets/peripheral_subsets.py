"""Stage 3: balanced down-sampling, keeping the peripheral samples of every cluster."""


import time
from typing import Literal

import dagster as dg
import polars as pl
from pydantic import Field

from cluster_pipeline.core import plots
from cluster_pipeline.core.selection import select
from cluster_pipeline.core.tables import write_table
from cluster_pipeline.defs.metadata import (
    latest_metadata,
    markdown_table,
    table_metadata,
    upstream_table,
)
from cluster_pipeline.defs.partitions import dataset_partitions
from cluster_pipeline.defs.resources import StorageResource


class PeripheralSubsetsConfig(dg.Config):
    selector: Literal["peripheral", "core", "random", "uniform", "random_global", "full"] = Field(
        default="peripheral",
        description="peripheral = farthest from centroid (CluSTER); core = nearest; random = "
        "within cluster; uniform = oversample every cluster to the largest; random_global = "
        "same budget without clusters; full = all data.",
    )
    ratio: float = Field(default=0.5, gt=0.0, le=1.0, description="Selection ratio r: every "
                         "cluster keeps floor(r * m) samples, m = smallest cluster size.")
    seed: int = Field(default=0, description="Seed of the random selectors.")


@dg.asset(
    partitions_def=dataset_partitions,
    deps=["balanced_clusters"],
    group_name="selection",
    kinds={"polars", "deltalake"},
    code_version="1",
    # Kept in sync with its parent; training and evaluation run only on request.
    automation_condition=dg.AutomationCondition.eager(),
)
def peripheral_subsets(
    context: dg.AssetExecutionContext, config: PeripheralSubsetsConfig, storage: StorageResource
) -> dg.MaterializeResult:
    """One row per clustered sample: ``selection_rank`` (0 = first chosen within its cluster by
    the selector), ``selected``, ``copies`` (times trained per epoch; > 1 only for uniform
    oversampling) and ``weight`` w_c = n_c K / N of its cluster (1 for selectors without
    re-weighting). DESIGN.md steps 3 and 5.
    """
    dataset = context.partition_key
    start = time.perf_counter()
    clusters = upstream_table(context, "balanced_clusters").read()
    k = int(latest_metadata(context, "balanced_clusters")["num_clusters"])
    try:
        result = select(clusters["cluster"].to_numpy(), clusters["sq_distance"].to_numpy(), k,
                        config.selector, config.ratio, config.seed)
    except ValueError as e:
        raise dg.Failure(description=f"{dataset}: {e}") from e
    frame = clusters.select("sample_id", "cluster", "sq_distance").with_columns(
        pl.Series("selection_rank", result.selection_rank),
        pl.Series("selected", result.selected),
        pl.Series("copies", result.copies),
        pl.Series("weight", result.weight),
    )
    ref = write_table(frame, storage.table_uri("peripheral_subsets", dataset))
    seconds = time.perf_counter() - start

    ids, matrix = upstream_table(context, "proxy_embeddings").read_vectors(
        "embedding_normalised", keep="skip_reason")
    position = ids.with_row_index("i").join(clusters.select("sample_id"), on="sample_id",
                                            how="right")["i"].to_numpy()
    x = matrix[position]
    labels = clusters["cluster"].to_numpy()
    map_png = plots.pca_map(x, labels, result.selected)
    per_cluster = frame.group_by("cluster").agg(
        pl.len().alias("n_c"), pl.col("copies").sum().alias("kept"), pl.col("weight").first().alias("w_c")
    ).sort("cluster")
    context.log.info(
        f"{config.selector} r={config.ratio}: {result.n_selected} of {len(labels)} samples "
        f"({100 * result.data_fraction:.1f}%)"
    )
    return dg.MaterializeResult(
        metadata={
            **table_metadata(ref, frame.filter(pl.col("selected")), seconds),
            "dagster/row_count": frame.height,
            "selector": config.selector,
            "ratio": config.ratio,
            "seed": config.seed,
            "per_cluster": result.per_cluster,
            "selected_samples": result.n_selected,
            "data_fraction": round(result.data_fraction, 4),
            "cluster_weights": dg.MetadataValue.json([round(float(w), 6) for w in result.cluster_weights]),
            "per_cluster_table": dg.MetadataValue.md(markdown_table(per_cluster, max_rows=64)),
            "pca_map_selected": dg.MetadataValue.md(plots.markdown_image(map_png, "selected")),
        },
    )

