"""How every stage asset is declared: partitioned per dataset, grouped by stage, and (for the
cheap selection chain) kept in sync with its parents by an eager automation condition.
Training and evaluation run only on request."""

import inspect
import re
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


def ui_description(docstring: str) -> str:
    """A docstring as the UI's Markdown shows it: dedented, paragraphs joined into lines, and
    reStructuredText's ``literal`` and :func:`role` marks as Markdown code (the UI would print
    the double backticks and roles as they are)."""
    text = inspect.cleandoc(docstring)
    text = re.sub(r":(?:func|class|mod|meth|data|attr):`~?([^`]+)`", r"`\1`", text)
    text = text.replace("``", "`")
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]
    return "\n\n".join(p for p in paragraphs if p)


def stage_asset(group: Group, **kwargs: Any) -> Callable[..., dg.AssetsDefinition]:
    """``@dg.asset`` with the dataset partitions and ``group_name`` set, and the function's
    docstring as its description in Markdown (:func:`ui_description`); selection stages get
    the eager automation condition unless ``automation_condition`` is given."""
    if group == "selection":
        kwargs.setdefault("automation_condition", dg.AutomationCondition.eager())

    def decorate(fn: Callable[..., Any]) -> dg.AssetsDefinition:
        if fn.__doc__ and "description" not in kwargs:
            kwargs["description"] = ui_description(fn.__doc__)
        return dg.asset(partitions_def=dataset_partitions, group_name=group, **kwargs)(fn)

    return decorate
