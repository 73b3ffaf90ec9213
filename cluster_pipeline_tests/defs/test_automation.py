"""The selection chain's eager condition, evaluated by Dagster itself on a two-asset graph: a run
of one of the project's jobs never makes the automation sensor start a child again, unasked;
an update made outside the jobs still does, but only when it changed the parent's data: an
unchanged input (the same data version) is no update (issue 43).

The kind: Dagster's ``eager()`` skips a parent's update "executed with the root target" only
when the run lists its assets. A whole-job run lists none, so every way the child's own step of
that run did not count as done (a queued second run of the partition, planned before the first
one materialized, which the status cache then drops from "in progress"; a child step that
failed; the sensor's tick falling between the parent's and the child's steps) became a second,
unasked run with the stages' default config. Members tested here: the failed child step of a
job run (the deterministic one), a job run without the tag (Dagster's own behaviour, the
control), and the updates that must still be followed: an asset-selection run of the parent
alone and a reported (runless) parent materialization.

The second kind, "the parent was materialized again": with the same data version (the CLI's
re-read of unchanged files: issue 43's sensor then re-ran the whole chain with the default
config), with a new one, and without one of its own (Dagster gives each materialization a new
version: the training stage's case). The real stages' data versions are checked in
test_settings_kept_e2e.py.
"""

import dagster as dg
import pytest

from cluster_pipeline.definitions import defs
from cluster_pipeline.defs.stages import JOB_RUN_TAG, SELECTION_STAGES, eager


class ChildConfig(dg.Config):
    fail: bool = False


def _graph(condition: dg.AutomationCondition) -> tuple[dg.AssetsDefinition, dg.AssetsDefinition]:
    @dg.asset
    def parent() -> int:
        return 1

    @dg.asset(deps=[parent], automation_condition=condition)
    def child(config: ChildConfig) -> int:
        if config.fail:
            raise RuntimeError("the child's step failed")
        return 2

    return parent, child


def _requested(assets, instance, cursor) -> tuple[int, object]:
    """How many child materializations the automation requests now, and the next cursor."""
    result = dg.evaluate_automation_conditions(defs=assets, instance=instance, cursor=cursor)
    return result.get_num_requested(dg.AssetKey("child")), result.cursor


def _settled(assets, instance):
    """Both assets materialized and one evaluation done: the state before each case."""
    dg.materialize(assets, instance=instance)
    _, cursor = _requested(assets, instance, None)
    count, cursor = _requested(assets, instance, cursor)
    assert count == 0
    return cursor


def _job_run(assets, instance, tags: dict[str, str], *, child_fails: bool) -> None:
    job = dg.define_asset_job("some_job", selection=dg.AssetSelection.all(), tags=tags)
    result = (
        dg.Definitions(assets=assets, jobs=[job])
        .resolve_job_def("some_job")
        .execute_in_process(
            instance=instance,
            run_config={"ops": {"child": {"config": {"fail": child_fails}}}},
            raise_on_error=False,
        )
    )
    assert not result.dagster_run.asset_selection  # a whole-job run lists no assets
    assert result.success is not child_fails


@pytest.mark.parametrize(
    ("condition", "tags", "expected"),
    [
        # The product's condition: a job run's parent update is not news for the child.
        (eager(), {JOB_RUN_TAG: "some_job"}, 0),
        # Dagster's own eager() on the same run: the unasked second run (the defect's kind).
        (dg.AutomationCondition.eager(), {JOB_RUN_TAG: "some_job"}, 1),
        # A job without the tag reads as an outside update: the tag is what the rule keys on.
        (eager(), {}, 1),
    ],
)
def test_a_job_run_whose_child_step_failed_starts_nothing_unasked(condition, tags, expected):
    assets = _graph(condition)
    with dg.DagsterInstance.ephemeral() as instance:
        cursor = _settled(assets, instance)
        _job_run(assets, instance, tags, child_fails=True)
        count, cursor = _requested(assets, instance, cursor)
        assert count == expected
        # Nothing more on the next tick either.
        assert _requested(assets, instance, cursor)[0] == 0


def test_a_job_run_that_succeeds_starts_nothing():
    assets = _graph(eager())
    with dg.DagsterInstance.ephemeral() as instance:
        cursor = _settled(assets, instance)
        _job_run(assets, instance, {JOB_RUN_TAG: "some_job"}, child_fails=False)
        assert _requested(assets, instance, cursor)[0] == 0


def test_updates_outside_the_jobs_are_followed():
    assets = _graph(eager())
    parent = assets[0]
    with dg.DagsterInstance.ephemeral() as instance:
        cursor = _settled(assets, instance)
        # The UI's Materialize of the parent alone: an asset-selection run, no job tag.
        dg.materialize(assets, selection=[parent], instance=instance)
        count, cursor = _requested(assets, instance, cursor)
        assert count == 1
        # A materialization reported from outside Dagster (no run at all).
        dg.materialize(assets, instance=instance)
        _, cursor = _requested(assets, instance, cursor)
        instance.report_runless_asset_event(dg.AssetMaterialization(asset_key="parent"))
        assert _requested(assets, instance, cursor)[0] == 1


def test_every_job_run_carries_the_tag_and_every_selection_stage_uses_the_condition():
    definitions = defs()
    jobs = [j for j in definitions.jobs or [] if not j.name.startswith("__")]
    assert {j.name for j in jobs} >= {"main_job", "main_job_gpu8", "selection_job"}
    assert all(definitions.resolve_job_def(j.name).tags[JOB_RUN_TAG] == j.name for j in jobs)
    graph = definitions.resolve_asset_graph()
    for stage in [*SELECTION_STAGES[1:], "sample_lineage"]:
        condition = graph.get(dg.AssetKey(stage)).automation_condition
        assert condition is not None
        assert "parents_updated" in _labels(condition), stage


def _labels(condition: dg.AutomationCondition) -> set[str]:
    """Every label in a condition's tree."""
    return {condition.get_label() or "", *(x for c in condition.children for x in _labels(c))}


class VersionConfig(dg.Config):
    version: str | None = "v1"


def _versioned_graph(condition: dg.AutomationCondition) -> list[dg.AssetsDefinition]:
    @dg.asset
    def parent(config: VersionConfig) -> dg.MaterializeResult:
        version = None if config.version is None else dg.DataVersion(config.version)
        return dg.MaterializeResult(data_version=version)

    @dg.asset(deps=[parent], automation_condition=condition)
    def child() -> None:
        return None

    return [parent, child]


@pytest.mark.parametrize(
    ("condition", "version", "expected"),
    [
        (eager(), "v1", 0),  # the same content again: not an update
        (eager(), "v2", 1),  # new content
        (eager(), None, 1),  # no data version of its own: every materialization is new
        # Dagster's own eager() on the same re-read: the unasked run (the defect's kind).
        (dg.AutomationCondition.eager(), "v1", 1),
    ],
)
def test_only_a_parent_whose_data_changed_is_followed(condition, version, expected):
    assets = _versioned_graph(condition)
    with dg.DagsterInstance.ephemeral() as instance:
        cursor = _settled(assets, instance)
        dg.materialize(
            assets,
            selection=[assets[0]],
            instance=instance,
            run_config={"ops": {"parent": {"config": {"version": version}}}},
        )
        count, cursor = _requested(assets, instance, cursor)
        assert count == expected
        assert _requested(assets, instance, cursor)[0] == 0
