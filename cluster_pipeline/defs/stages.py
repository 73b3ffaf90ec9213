"""How every stage asset is declared: partitioned per dataset, grouped by stage, run with the
settings of its dataset partition (``defs/partition_settings.py``) and (for the cheap selection
chain) kept in sync with its parents by an eager automation condition, which follows a parent
only when its data changed (its data version). Training and evaluation run only on request."""

import functools
import inspect
import re
import time
from collections.abc import Callable
from typing import Any, Literal

import dagster as dg

from cluster_pipeline.defs.partition_settings import apply_to_step
from cluster_pipeline.defs.partitions import dataset_partitions
from cluster_pipeline.storage.disk import DiskFull
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

# Every run of one of the project's jobs (main_job*, selection_job) carries this tag.
JOB_RUN_TAG = "cluster_pipeline/job"

_ac = dg.AutomationCondition


def parents_updated():
    """True where a parent's data changed since the previous evaluation by a run that did not
    also target this asset, or will be requested on this tick: Dagster's ``any_deps_updated``,
    but counting only an update that changed the parent's data version (``data_version_changed``
    instead of ``newly_updated``), and ignoring a parent updated by a run of one of the
    project's jobs (tag :data:`JOB_RUN_TAG`).

    Every selection stage and ``raw_instructions`` record a data version computed from what
    they wrote (the table's content: :func:`~cluster_pipeline.storage.tables.content_digest`),
    so re-reading identical data, or recomputing a stage to the same result, is not news for
    its children (issue 43: a CLI re-read of unchanged files made the sensor re-run the whole
    selection chain). An asset without one of its own (``trained_checkpoint``) gets a new
    version from Dagster at every materialization, as before.

    Dagster skips a parent "executed with the root target" only when the run lists its assets
    (an asset-selection run). A run of a whole job lists none (``asset_selection`` is None), so
    the eager condition read every ``selection_job`` / ``main_job`` run's parent updates as
    news: when the sensor saw a parent's update while the child's step did not count as in
    progress (a second run of the partition, queued before the first one materialized; a child
    step that failed), it started the child again, unasked, with the stages' default config,
    e.g. a second embedding pass at other sizes. A job run already materializes every stage
    it holds, so the automation follows only updates made outside the jobs (the UI's
    *Materialize* of some assets, a reported event, its own runs)."""
    return _ac.any_deps_match(
        (
            _ac.data_version_changed()
            & ~_ac.executed_with_root_target()
            & ~_ac.executed_with_tags(tag_keys={JOB_RUN_TAG})
        ).with_label("data changed outside this asset's runs and the project's jobs")
        | _ac.will_be_requested()
    ).with_label("parents_updated")


def eager():
    """Dagster's ``AutomationCondition.eager()`` with :func:`parents_updated` in place of its
    ``any_deps_updated``: run when a parent updates (outside the project's jobs) or the
    partition becomes missing, unless a parent is missing or in progress, or this asset is in
    progress."""
    return (
        _ac.eager()
        .replace("any_deps_updated", parents_updated())
        .with_label("eager (the project's job runs aside)")
    )


def ui_description(docstring: str) -> str:
    """A docstring as the UI's Markdown shows it: dedented, paragraphs joined into lines, and
    reStructuredText's ``literal`` and :func:`role` marks as Markdown code (the UI would print
    the double backticks and roles as they are)."""
    text = inspect.cleandoc(docstring)
    text = re.sub(r":(?:func|class|mod|meth|data|attr):`~?([^`]+)`", r"`\1`", text)
    text = text.replace("``", "`")
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]
    return "\n\n".join(p for p in paragraphs if p)


def stage_step(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a stage asset's function) called with its ``config`` as the run uses it: the
    partition's settings under the run's own knobs
    (:func:`~cluster_pipeline.defs.partition_settings.apply_to_step`, which logs what it took
    and records it as metadata); a write that finds the disk full fails the step with the
    :class:`~cluster_pipeline.storage.disk.DiskFull` message alone (folder, bytes needed and
    free), not a traceback; a step that succeeds ends by logging ``<asset> done in N s`` (one
    such line per stage in the run's log, whatever else the stage says). ``functools.wraps``
    keeps the signature Dagster reads the config class and resources from."""

    @functools.wraps(fn)
    def run(context: dg.AssetExecutionContext, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        config, storage = kwargs.get("config"), kwargs.get("storage")
        if isinstance(config, dg.Config) and storage is not None and context.has_partition_key:
            kwargs["config"] = apply_to_step(context, storage.layout, config)
        try:
            result = fn(context, *args, **kwargs)
        except DiskFull as e:
            where = f"dataset {context.partition_key!r}: " if context.has_partition_key else ""
            raise dg.Failure(description=f"{where}{e}") from e
        context.log.info(f"{fn.__name__} done in {time.perf_counter() - start:.0f} s")
        return result

    return run


def stage_asset(group: Group, **kwargs: Any) -> Callable[..., dg.AssetsDefinition]:
    """``@dg.asset`` with the dataset partitions and ``group_name`` set, the function's
    docstring as its description in Markdown (:func:`ui_description`), and its config taken
    from the partition's settings where the run gives none (:func:`stage_step`);
    selection stages get the eager automation condition (:func:`eager`) unless
    ``automation_condition`` is given."""
    if group == "selection":
        kwargs.setdefault("automation_condition", eager())

    def decorate(fn: Callable[..., Any]) -> dg.AssetsDefinition:
        if fn.__doc__ and "description" not in kwargs:
            kwargs["description"] = ui_description(fn.__doc__)
        return dg.asset(partitions_def=dataset_partitions, group_name=group, **kwargs)(
            stage_step(fn)
        )

    return decorate
