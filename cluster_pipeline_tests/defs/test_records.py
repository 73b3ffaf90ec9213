"""Stage records survive the trip through Dagster metadata, and a record that lacks a field
fails with a message naming the stage to re-materialize."""

import dataclasses

import dagster as dg
import pytest

from cluster_pipeline.defs.records import (
    EvalReportRecord,
    PeripheralSubsetsRecord,
    TrainedCheckpointRecord,
    UpstreamNotMaterialized,
    latest_record,
)
from cluster_pipeline.storage.tables import TableRef

SUBSETS = PeripheralSubsetsRecord(
    table=TableRef("/d/tables/peripheral_subsets/x", 3),
    inputs={
        "raw_instructions": TableRef("/d/tables/raw_instructions/x", 1),
        "balanced_clusters": TableRef("/d/tables/balanced_clusters/x", 2),
    },
    seconds=0.5,
    selection_seconds=12.25,
    selector="core",
    ratio=0.25,
    seed=7,
    per_cluster=10,
    pool_size=80,
    selected_samples=20,
    data_fraction=0.25,
    cluster_weights=[1.5, 0.5],
    gradient_diversity=0.125,
    pool_gradient_diversity=0.0625,
)


def _stored(record):
    """The record as a downstream stage reads it back from a Dagster instance."""
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("datasets", ["x"])
        instance.report_runless_asset_event(
            dg.AssetMaterialization(record.ASSET, partition="x", metadata=record.to_metadata())
        )
        return latest_record(instance, type(record), "x")


def test_records_round_trip_through_metadata():
    meta = SUBSETS.to_metadata()
    assert meta["table_version"] == 3 and meta["selector"] == "core"
    assert meta["inputs"].value == {
        "raw_instructions": {"uri": "/d/tables/raw_instructions/x", "version": 1},
        "balanced_clusters": {"uri": "/d/tables/balanced_clusters/x", "version": 2},
    }
    assert _stored(SUBSETS) == SUBSETS
    # The selectors' record details are metadata entries of their own, as the fields they were
    # (a targeted selection's target, s2l's and less's checkpoints, less's learning rates).
    assert "details" not in meta
    assert meta["selection_target"] is None and meta["selection_target_samples"] == 0
    assert meta["s2l_checkpoint_steps"].value == [] and meta["less_learning_rates"].value == []
    targeted = dataclasses.replace(
        SUBSETS,
        details={**SUBSETS.details, "selection_target": "mbpp", "s2l_checkpoint_steps": [2, 4]},
    )
    stored = _stored(targeted)
    assert stored is not None and stored.details["selection_target"] == "mbpp"
    assert stored == targeted
    assert SUBSETS.lineage()["peripheral_subsets"] == TableRef("/d/tables/peripheral_subsets/x", 3)

    ckpt = TrainedCheckpointRecord(
        checkpoint_path="/d/checkpoints/x/abc",
        inputs=SUBSETS.lineage(),
        base_model="/m",
        world_size=2,
        manifest_sha256=["a", "b"],
        manifest_set_sha256="ab",
        reused_checkpoint=False,
        git_commit="None",
        resumed_from_step=None,
        steps=18,
        final_loss=1.25,
        seconds=300.0,
        train_seconds=290.0,
        samples_per_rank=142,
        selection_seconds=180.5,
        config={"seed": 0, "schedule": "cosine"},
    )
    assert _stored(ckpt) == ckpt


def test_eval_report_record_flattens_its_metrics():
    record = EvalReportRecord(
        report_path="/r.md",
        checkpoint_path="/c",
        models_compared=2,
        train_seconds=10.0,
        full_training_seconds=20.0,
        full_training_measured=False,
        item_scores=TableRef("/d/tables/eval_item_scores/x", 0),
        verdicts=[{"reference": "base", "metric": "heldout_loss", "verdict": "better"}],
        data_fraction=0.5,
        base={"heldout_loss": 1.5},
        tuned={"heldout_loss": 1.25},
    )
    meta = record.to_metadata()
    assert meta["base/heldout_loss"] == 1.5 and meta["tuned/heldout_loss"] == 1.25
    assert _stored(record) == record


def test_a_record_from_an_older_pipeline_names_the_stage_to_rerun():
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("datasets", ["x"])
        assert latest_record(instance, PeripheralSubsetsRecord, "x") is None
        old = {k: v for k, v in SUBSETS.to_metadata().items() if k != "pool_size"}
        instance.report_runless_asset_event(
            dg.AssetMaterialization("peripheral_subsets", partition="x", metadata=old)
        )
        with pytest.raises(
            UpstreamNotMaterialized, match="pool_size.*materialize peripheral_subsets again"
        ):
            latest_record(instance, PeripheralSubsetsRecord, "x")
