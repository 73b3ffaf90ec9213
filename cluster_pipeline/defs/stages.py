"""How every stage asset is declared: partitioned per dataset, grouped by stage, and (for the
cheap selection chain) kept in sync with its parents by an eager automation condition.
Training and evaluation run only on request."""

from collections.abc import Callable
from typing import Any, Literal

import dagster as dg

from cluster_pipeline.defs.partitions import dataset_partitions
from cluster_pipeline.storage.names import (
    BALANCED_CLUSTERS,
    EVAL_REPORT,
    PERIPHERAL_SUBSETS,
    PROXY_EMBEDDINGS,
    RAW_INSTRUCTIONS,
    SHARD_MANIFESTS,
    TRAINED_CHECKPOINT,
)

# The pipeline, in docs/design.md order.
STAGES = [
    RAW_INSTRUCTIONS,
    PROXY_EMBEDDINGS,
    BALANCED_CLUSTERS,
    PERIPHERAL_SUBSETS,
    SHARD_MANIFESTS,
    TRAINED_CHECKPOINT,
    EVAL_REPORT,
]
SELECTION_STAGES = STAGES[:5]

Group = Literal["ingest", "selection", "training", "inspection"]


def stage_asset(group: Group, **kwargs: Any) -> Callable[..., dg.AssetsDefinition]:
    """``@dg.asset`` with the dataset partitions and ``group_name`` set; selection stages get
    the eager automation condition unless ``automation_condition`` is given."""
    if group == "selection":
        kwargs.setdefault("automation_condition", dg.AutomationCondition.eager())
    return dg.asset(partitions_def=dataset_partitions, group_name=group, **kwargs)
