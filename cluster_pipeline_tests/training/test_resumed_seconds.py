"""Training time summed over resumed runs: a resumed run's ``train_seconds`` counts what the
killed run trained past its checkpoint (steps trained again), so the report's time saved
counts what the kill cost (issue 43: it counted only the resumed steps' part).

The kind, "how a run ended before its resumption": killed after logging steps past its
checkpoint (those seconds count), killed right at a checkpoint (nothing to add), a torn last
metrics line (skipped), and a second resumption (the first one's lost seconds are already in
its checkpoint)."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from cluster_pipeline.training.checkpointing import TRAINING_STATE, killed_seconds
from cluster_pipeline_tests.helpers import torchrun, train_job

TRAIN = "cluster_pipeline.recipes.train"


def _rows(*steps_and_seconds: tuple[int, float]) -> list[dict]:
    return [{"step": s, "elapsed_seconds": e, "loss": 1.0} for s, e in steps_and_seconds]


@pytest.mark.parametrize(
    ("rows", "step", "at", "expected"),
    [
        # Killed at step 7, resumed from step 4 (saved at 40 s): 70 - 40 s trained again.
        (
            _rows((1, 10.0), (2, 20.0), (3, 30.0), (4, 40.0), (5, 50.0), (6, 60.0), (7, 70.0)),
            4,
            40.0,
            30.0,
        ),
        # Killed right after its checkpoint: nothing past it.
        (_rows((1, 10.0), (2, 20.0)), 2, 20.5, 0.0),
        # A torn last line (no elapsed_seconds): the last whole one counts.
        ([*_rows((3, 30.0), (5, 50.0)), {"step": 6}], 4, 40.0, 10.0),
        # A second resumption: the checkpoint's time already holds the first kill's loss.
        (_rows((8, 130.0), (9, 140.0), (10, 155.0)), 8, 130.0, 25.0),
        # No metrics file (deleted): nothing known to add.
        ([], 4, 40.0, 0.0),
    ],
)
def test_the_seconds_a_kill_cost(rows, step, at, expected):
    assert killed_seconds(rows, step, at) == pytest.approx(expected)


def _elapsed(path: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["step"]: r["elapsed_seconds"] for r in rows}


@pytest.mark.slow
def test_a_resumed_run_counts_the_killed_runs_seconds(tmp_path, tiny_model_dir):
    cfg, _ = train_job(
        tmp_path,
        tiny_model_dir,
        [1.0],
        per_rank=8,
        per_device_batch_size=1,
        epochs=2,
        save_every_steps=4,
        keep_checkpoints=10,
    )
    done = torchrun(TRAIN, 1, ["--config", str(tmp_path / "train.json")])
    assert done.returncode == 0, done.stderr[-3000:]
    out = Path(cfg.output_dir)
    metrics = Path(f"{out}.metrics.jsonl")
    first = _elapsed(metrics)
    assert sorted(first) == list(range(1, 17))
    # As if killed after step 16's line, before the checkpoint was saved: the finished
    # folder and the resumable steps after 8 are gone, the metrics file is as it was.
    shutil.rmtree(out)
    steps = Path(f"{out}.checkpoints")
    assert sorted(p.name for p in steps.iterdir()) == [
        "step_0000004",
        "step_0000008",
        "step_0000012",
    ]  # the last step saves no resumable state
    shutil.rmtree(steps / "step_0000012")
    state = torch.load(steps / "step_0000008" / TRAINING_STATE, weights_only=False)
    expected = first[16] - state["elapsed_seconds"]
    assert expected > 0
    done = torchrun(TRAIN, 1, ["--config", str(tmp_path / "train.json")])
    assert done.returncode == 0, done.stderr[-3000:]
    info = json.loads((out / "training_info.json").read_text())
    assert info["resumed_from_step"] == 8 and info["steps"] == 16
    assert info["killed_seconds"] == round(expected, 3)
    # Everything the first run trained (all 16 steps' time), plus the 8 steps trained again.
    assert info["train_seconds"] > first[16]
    again = _elapsed(metrics)
    assert again[9] > first[16]  # the resumed steps count on from the kill's time
