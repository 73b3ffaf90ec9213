"""Issue 43: when a new selection replaced the one a killed run was training on, the training
run that follows says so as its first line and in ``trained_checkpoint``'s metadata, and keeps
the killed run's resumable checkpoint (before: it trained the new subset from scratch and left
1.6 GB behind, unsaid). The note's wording for each member of the kind (other manifests, other
training settings, no job file) is tested in training/test_resumable_runs.py; here the asset
runs for real, training the tiny model."""

import json
import logging

import dagster as dg
import pytest

from cluster_pipeline.storage.layout import DataLayout
from cluster_pipeline.training.checkpointing import TRAINING_STATE
from cluster_pipeline_tests.helpers import (
    materialize_partition,
    meta,
    pipeline_assets,
    resources,
    seed_embeddings,
)

pytestmark = pytest.mark.slow

ASSETS = pipeline_assets()
SELECTION, TRAINED = ASSETS[:5], ASSETS[5]
KILLED_SET = "aaaaaaaaaaaa" + "0" * 52  # the manifest set the killed run trained on
KILLED_RUN = "1a2b3c4d-0000-0000-0000-000000000000"


def test_training_a_new_selection_names_the_checkpoint_it_does_not_resume_first(
    tiny_data_dir, tiny_model_dir, tiny_embedding_cache
):
    seed_embeddings(tiny_embedding_cache, tiny_data_dir)
    res = resources(tiny_data_dir, tiny_model_dir)
    checkpoints = DataLayout.at(tiny_data_dir).checkpoints_dir("tiny")
    # The killed run: its intermediate folder with a complete step 4 (100 bytes) and its job
    # file, trained on manifests that the selection below replaces.
    killed = checkpoints / "aaaaaaaaaaaa-11111111"
    step = checkpoints / f"{killed.name}.checkpoints" / "step_0000004"
    step.mkdir(parents=True)
    (step / TRAINING_STATE).write_bytes(b"x" * 100)
    provenance = {"dagster_run_id": KILLED_RUN, "manifest_set_sha256": KILLED_SET}
    (checkpoints / f"{killed.name}.job.json").write_text(json.dumps({"provenance": provenance}))
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("datasets", ["tiny"])
        assert materialize_partition(SELECTION, instance, res).success
        new_set = str(meta(instance, "shard_manifests")["manifest_set_sha256"])
        result = materialize_partition([TRAINED], instance, res)
        assert result.success
        trained = meta(instance, "trained_checkpoint")
        own = str(trained["checkpoint_path"]).rsplit("/", 1)[1]
        expected = (
            f"dataset 'tiny': this run trains {own} from the start and does not resume: run "
            f"1a2b3c4d's resumable checkpoint {step} (step 4, 0.00 GiB) was trained on shard "
            f"manifests aaaaaaaaaaaa, which a new selection ({new_set[:12]}) replaced. Each is "
            "kept: to resume one, materialize the selection again with the settings of the run "
            "that made it (the same settings give the same manifests) and re-execute it; to "
            f"free its space, delete its folder ({killed}.checkpoints)"
        )
        # The step's first line (the messages the step logs, Dagster's own events aside).
        lines = [
            (e.level, e.user_message)
            for e in instance.all_logs(result.run_id)
            if e.step_key == "trained_checkpoint" and e.dagster_event is None
        ]
        assert lines[0] == (logging.WARNING, expected), lines[:3]
        assert trained["resumable_not_resumed"] == [
            {
                "path": str(step),
                "step": 4,
                "gib": 0.0,
                "run_id": KILLED_RUN,
                "manifest_set": "aaaaaaaaaaaa",
            }
        ]
    # Kept, as the note says.
    assert (step / TRAINING_STATE).read_bytes() == b"x" * 100
