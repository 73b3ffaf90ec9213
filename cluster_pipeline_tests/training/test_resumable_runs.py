"""A resumable checkpoint that a training run will not resume is named, never left behind
unsaid (issue 43: a new selection replaced the one a killed run was training on, and its
re-execution trained the new subset from scratch, orphaning 1.6 GB).

The kind, "a complete intermediate checkpoint of another run of the dataset": one of other
manifests (a new selection), one of the same manifests but other training settings, one whose
job file is gone; not members: the run's own folder (it resumes), a finished run, a folder with
no complete step (nothing to resume)."""

import json
from pathlib import Path

from cluster_pipeline.defs.pass_runner import TrainingPlan
from cluster_pipeline.training.checkpointing import (
    TRAINING_INFO,
    TRAINING_STATE,
    ResumableRun,
    resumable_runs,
)
from cluster_pipeline.training.memory import MemoryEstimate

OLD_SET = "aaaaaaaaaaaa" + "0" * 52
NEW_SET = "bbbbbbbbbbbb" + "0" * 52


def _run(root: Path, name: str, steps: list[int], *, run_id="", manifest_set="", bytes_=100):
    """A run's intermediate folder with complete ``steps`` (``bytes_`` bytes each), and its
    job file when ``run_id`` is given."""
    for step in steps:
        folder = root / f"{name}.checkpoints" / f"step_{step:07d}"
        folder.mkdir(parents=True)
        (folder / TRAINING_STATE).write_bytes(b"x" * bytes_)
    if run_id:
        provenance = {"dagster_run_id": run_id, "manifest_set_sha256": manifest_set}
        (root / f"{name}.job.json").write_text(json.dumps({"provenance": provenance}))


def test_every_other_resumable_run_is_found(tmp_path):
    _run(tmp_path, "aaaaaaaaaaaa-11111111", [4, 6], run_id="run-old-1", manifest_set=OLD_SET)
    _run(tmp_path, "bbbbbbbbbbbb-22222222", [2], run_id="run-old-2", manifest_set=NEW_SET)
    _run(tmp_path, "cccccccccccc-33333333", [8])  # no job file
    # Not resumable: finished, or no complete step.
    _run(tmp_path, "dddddddddddd-44444444", [2], run_id="run-done", manifest_set=OLD_SET)
    (tmp_path / "dddddddddddd-44444444").mkdir()
    (tmp_path / "dddddddddddd-44444444" / TRAINING_INFO).write_text("{}")
    (tmp_path / "eeeeeeeeeeee-55555555.checkpoints" / "step_0000002").mkdir(parents=True)
    found = resumable_runs(tmp_path)
    assert found == [
        ResumableRun(
            tmp_path / "aaaaaaaaaaaa-11111111",
            tmp_path / "aaaaaaaaaaaa-11111111.checkpoints" / "step_0000006",
            6,
            200,
            "run-old-1",
            OLD_SET,
        ),
        ResumableRun(
            tmp_path / "bbbbbbbbbbbb-22222222",
            tmp_path / "bbbbbbbbbbbb-22222222.checkpoints" / "step_0000002",
            2,
            100,
            "run-old-2",
            NEW_SET,
        ),
        ResumableRun(
            tmp_path / "cccccccccccc-33333333",
            tmp_path / "cccccccccccc-33333333.checkpoints" / "step_0000008",
            8,
            100,
            None,
            None,
        ),
    ]
    assert found[0].to_metadata() == {
        "path": str(tmp_path / "aaaaaaaaaaaa-11111111.checkpoints" / "step_0000006"),
        "step": 6,
        "gib": 0.0,
        "run_id": "run-old-1",
        "manifest_set": "aaaaaaaaaaaa",
    }
    assert resumable_runs(tmp_path / "absent") == []


def test_the_run_says_which_it_leaves_and_why(tmp_path):
    _run(tmp_path, "aaaaaaaaaaaa-11111111", [6], run_id="1a2b3c4d-x", manifest_set=OLD_SET)
    _run(tmp_path, "bbbbbbbbbbbb-22222222", [2], run_id="5e6f7a8b-y", manifest_set=NEW_SET)
    own = tmp_path / "bbbbbbbbbbbb-99999999"
    others = tuple(r for r in resumable_runs(tmp_path) if r.output_dir != own)
    plan = TrainingPlan(own, reused=False, memory_per_rank=MemoryEstimate(()), set_aside=others)
    assert plan.set_aside_note("tiny", NEW_SET) == (
        "dataset 'tiny': this run trains bbbbbbbbbbbb-99999999 from the start and does not "
        f"resume: run 1a2b3c4d's resumable checkpoint {others[0].latest} (step 6, 0.00 GiB) was "
        "trained on shard manifests aaaaaaaaaaaa, which a new selection (bbbbbbbbbbbb) "
        f"replaced; run 5e6f7a8b's resumable checkpoint {others[1].latest} (step 2, 0.00 GiB) "
        "was trained with other training settings, data or base model. Each is kept: to "
        "resume one, materialize the selection again with the settings of the run that made "
        "it (the same settings give the same manifests) and re-execute it; to free its space, "
        f"delete its folder ({others[0].intermediate}, {others[1].intermediate})"
    )
    assert TrainingPlan(own, False, MemoryEstimate(())).set_aside_note("tiny", NEW_SET) is None
    # Nothing was deleted.
    assert [r.step for r in resumable_runs(tmp_path)] == [6, 2]
