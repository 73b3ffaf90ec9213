"""Issue 43's sequence, end to end, through ``dagster`` as a user runs it: a partition launched
with the user's settings and its training killed; the data re-read from the CLI with unchanged
files; the automation sensor's evaluation; the sensor's kind of run (no config) of the
selection chain; the killed run re-executed. The user's settings stay the partition's at every
step, the selection stays the user's (same manifests, same weights) and the re-executed run
resumes the killed one's checkpoint. Before the fix the re-read counted as an update, the
sensor re-ran the chain with the schema defaults (max_length 256, alpha 1.5), wrote other
manifests, and the re-execution trained that new subset from scratch, saying nothing.

The control at the end: the same re-read after the data did change is followed by the sensor.
"""

import json
import signal
import time
from pathlib import Path

import dagster as dg
import pytest

from cluster_pipeline.definitions import defs
from cluster_pipeline.storage.layout import DataLayout
from cluster_pipeline_tests.helpers import RUN_CONFIG, meta, tiny_records, write_jsonl
from cluster_pipeline_tests.runs import TRAIN, Project, processes, runs_module, wait_for

pytestmark = pytest.mark.slow

SELECTION = [
    "raw_instructions",
    "proxy_embeddings",
    "balanced_clusters",
    "peripheral_subsets",
    "shard_manifests",
]
# Long enough (about 300 optimizer steps of the tiny model) to be killed after a checkpoint.
TRAINING = {"epochs": 30, "save_every_steps": 2, "keep_checkpoints": 1}


def _data_versions(instance: dg.DagsterInstance, asset: str, n: int) -> list[str]:
    """The data versions of the ``n`` latest materializations of ``asset``, newest first."""
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset), asset_partitions=["tiny"]), limit=n
    ).records
    found = [r.asset_materialization for r in records]
    return [m.tags["dagster/data_version"] for m in found if m is not None and m.tags is not None]


def _requested(instance: dg.DagsterInstance, cursor):
    """What the selection sensor's evaluation requests now, by stage, and its next cursor."""
    result = dg.evaluate_automation_conditions(
        defs=defs(),
        instance=instance,
        asset_selection=dg.AssetSelection.groups("selection", "inspection"),
        cursor=cursor,
    )
    counts = {stage: result.get_num_requested(dg.AssetKey(stage)) for stage in SELECTION[1:]}
    return counts, result.cursor


def _steps(checkpoints: Path) -> list[Path]:
    """The complete intermediate checkpoints under a dataset's checkpoint folder."""
    return sorted(checkpoints.glob("*.checkpoints/step_*/training_state.pt"))


def test_the_automation_sequence_keeps_the_users_settings(tmp_path, tiny_model_dir):
    with Project.create(tmp_path, tiny_model_dir) as project:
        layout = DataLayout.at(project.data)
        checkpoints = layout.checkpoints_dir("tiny")
        # 1. The user's run, with their settings (not the schema defaults: max_length 64, not
        #    256; alpha 1.3, not 1.5), killed during training after a resumable checkpoint.
        config = project.config(
            "user", [*SELECTION, "trained_checkpoint"], **{"trained_checkpoint": TRAINING}
        )
        run = project.start_materialize(",".join([*SELECTION, "trained_checkpoint"]), config)
        wait_for(
            lambda: _steps(checkpoints) or run.poll() is not None, 900, "a resumable checkpoint"
        )
        assert run.poll() is None, project.log()
        for rank in processes(runs_module(TRAIN, project)):
            rank.send_signal(signal.SIGKILL)
        assert run.wait(timeout=300) != 0, project.log()
        killed_at = int(_steps(checkpoints)[-1].parent.name.split("_")[-1])
        assert not any(p.name.endswith(".json") for p in checkpoints.glob("*/training_info.json"))
        with project.instance() as instance:
            failed = instance.get_runs(limit=1)[0]
            assert failed.status == dg.DagsterRunStatus.FAILURE
            users = meta(instance, "shard_manifests")
            user_raw = meta(instance, "raw_instructions")
        given = {s: RUN_CONFIG["ops"][s]["config"] for s in SELECTION if s in RUN_CONFIG["ops"]}
        stored = json.loads(layout.partition_settings("tiny").read_text())["stages"]
        assert stored == {**given, "trained_checkpoint": {**given_training(), **TRAINING}}

        # 2. The sensor's evaluation before anything changes: nothing to do.
        with project.instance() as instance:
            _, cursor = _requested(instance, None)
            counts, cursor = _requested(instance, cursor)
        assert counts == dict.fromkeys(SELECTION[1:], 0)

        # 3. The user re-reads the unchanged data from the CLI, without a config.
        project.materialize("raw_instructions", check=True)
        with project.instance() as instance:
            versions = _data_versions(instance, "raw_instructions", 2)
            assert versions[0] == versions[1]  # same rows: same data version
            # ... read with the partition's held-out split, not the default's.
            assert (
                meta(instance, "raw_instructions")["heldout_samples"]
                == (user_raw["heldout_samples"])
            )
            # 4. The sensor's evaluation: an unchanged input is no update.
            counts, cursor = _requested(instance, cursor)
        assert counts == dict.fromkeys(SELECTION[1:], 0)

        # 5. A run of the selection chain without a config (what the sensor, or the UI's
        #    Materialize, starts) takes the user's settings: the same manifests, same weights.
        out = project.materialize(",".join(SELECTION[1:]), check=True)
        assert "kept from the settings dataset partition 'tiny' was last launched with" in (
            out.stdout
        )
        with project.instance() as instance:
            embeddings = meta(instance, "proxy_embeddings")
            again = meta(instance, "shard_manifests")
            assert embeddings["embed_settings"]["max_length"] == 64
            assert embeddings["samples_embedded_now"] == 0  # the user's cache, not a new pass
            assert again["manifest_set_sha256"] == users["manifest_set_sha256"]
            assert again["rank_weights"] == users["rank_weights"]
            # The same content again: the sensor has nothing to follow either.
            counts, cursor = _requested(instance, cursor)
        assert counts == dict.fromkeys(SELECTION[1:], 0)

        # 6. The killed run, started from a shell, re-executed from failure (the UI's
        #    Re-execute cannot: Dagster wants a code location the shell run has not), by its
        #    first 8 characters as the UI shows them: it resumes.
        dry = project.cli("cluster-pipeline", "reexecute", failed.run_id[:8], "--dry-run")
        assert dry.stdout.strip() == (
            f"would re-execute run {failed.run_id} (__ASSET_JOB, dataset partition tiny): "
            "steps trained_checkpoint"
        ), dry.stdout
        out = project.cli("cluster-pipeline", "reexecute", failed.run_id[:8], check=True)
        assert out.stdout.strip().splitlines()[-1].endswith(": succeeded"), out.stdout[-3000:]
        with project.instance() as instance:
            trained = meta(instance, "trained_checkpoint")
        assert "resumable_not_resumed" not in trained
        info = json.loads((Path(trained["checkpoint_path"]) / "training_info.json").read_text())
        assert info["resumed_from_step"] == killed_at
        assert [m["sha256"] for m in info["manifests"]] == users["manifest_sha256"]
        # The killed run's training time counts in the resumed one's.
        assert info["killed_seconds"] >= 0 and info["train_seconds"] > info["killed_seconds"]

        # 7. The control: new data re-read the same way is followed by the sensor.
        write_jsonl(project.data / "raw" / "tiny" / "more.jsonl", tiny_records(70)[60:])
        time.sleep(0.01)
        project.materialize("raw_instructions", check=True)
        with project.instance() as instance:
            counts, _ = _requested(instance, cursor)
        assert counts["proxy_embeddings"] == 1


def given_training() -> dict:
    """The tests' training knobs (:data:`RUN_CONFIG`)."""
    return dict(RUN_CONFIG["ops"]["trained_checkpoint"]["config"])
