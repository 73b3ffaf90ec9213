"""The report's cost rows of a selection: its passes, forward/backward counts and peak memory;
a CUDA run's MFU beside its useful compute."""

from pathlib import Path

import pytest

from cluster_pipeline.evaluation.render import selection_pass_rows
from cluster_pipeline.evaluation.report import ModelResult


def _result(**kw) -> ModelResult:
    return ModelResult("s2l r=0.5 seed 0", "s2l r=0.5", "/ckpt", {"heldout_loss": 1.0}, **kw)


def test_a_selections_passes_are_rows_of_the_cost_table():
    result = _result(
        selection_passes=[
            {"name": "embedding", "samples": 300, "seconds": 120.04, "backward": 0, "run_now": 0},
            {"name": "s2l_proxy", "samples": 64, "seconds": 30.5, "backward": 64, "run_now": 64},
        ],
        selection_forward_passes=364,
        selection_backward_passes=64,
        selection_peak_rss_mib=1830.4,
    )
    assert selection_pass_rows(result) == [
        ["  pass `embedding` (cached, at its measured rate)", "120.0 s, 300 samples"],
        ["  pass `s2l_proxy` (at its measured rate)", "30.5 s, 64 samples, 64 backward"],
        ["  per-sample forward / backward passes of the selection", "364 / 64"],
        ["  peak resident memory of the selection's largest rank", "1830 MiB"],
    ]


def test_a_checkpoint_without_a_cost_record_adds_no_rows():
    assert selection_pass_rows(_result()) == []


def _checkpoint(folder, seed: int, mfu: dict | None):
    """A finished checkpoint folder whose training_info.json records what the training loop
    writes (a CUDA run's ``mfu`` record where given)."""
    import json

    from cluster_pipeline.training.checkpointing import TRAINING_INFO, read_checkpoint

    folder.mkdir(parents=True)
    provenance = {"selector": "peripheral", "ratio": 0.5, "data_fraction": 0.4}
    info = {
        "config": {"settings": {"seed": seed}, "provenance": provenance},
        "train_seconds": 100.0 + seed,
        "useful_compute_fraction": 0.97,
        **({"mfu": mfu} if mfu is not None else {}),
    }
    (folder / TRAINING_INFO).write_text(json.dumps(info))
    ckpt = read_checkpoint(folder)
    assert ckpt is not None
    return ckpt


def _evaluated(tmp_path, mfus):
    from cluster_pipeline.evaluation.report import aggregate, evaluate_entries, model_entries
    from cluster_pipeline.storage.cache import JsonCache

    ckpts = [_checkpoint(tmp_path / f"c{i}", i, m) for i, m in enumerate(mfus)]
    entries = model_entries(str(tmp_path / "base"), ckpts)

    def evaluate(paths, done):
        for path in paths:
            done(path, {"metrics": {"heldout_loss": 1.0}, "items": {}, "heldout_tokens": 10})

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("cluster_pipeline.evaluation.report.model_fingerprint", lambda p: "base")
        results, _ = evaluate_entries(
            entries, evaluate, JsonCache(tmp_path / "cache"), "k", str(ckpts[0].path)
        )
    for r in results:
        r.selection_seconds = 0.0 if r.group != "base" else None
    return results, aggregate(results, ["heldout_loss"])


# What training/loop.py records on a CUDA run (training/mfu.mfu_record): 6 x 1.1e9 parameters
# x 2e6 real tokens / (100 s x 1 rank x 989 TFLOP/s) = 0.1335.
CUDA_MFU = {
    "value": 0.1335,
    "parameters": 1_100_000_000,
    "real_tokens": 2_000_000,
    "seconds": 100.0,
    "ranks": 1,
    "device": "NVIDIA H200",
    "peak_flops_per_rank": 989e12,
    "flops_per_token_per_parameter": 6,
}


def test_a_cuda_runs_mfu_stands_beside_its_useful_compute(tmp_path):
    from cluster_pipeline.evaluation.render import cost_table, run_cost_table
    from cluster_pipeline.evaluation.report import ReportNumbers

    second = {**CUDA_MFU, "value": 0.1435}
    results, rows = _evaluated(tmp_path, [CUDA_MFU, second])
    assert [r.mfu for r in results] == [None, 0.1335, 0.1435]
    table = cost_table(rows, 1000.0).splitlines()
    head = [c.strip() for c in table[0].strip("|").split("|")]
    assert head[5:7] == ["useful compute", "MFU"]
    cells = [c.strip() for c in table[2].strip("|").split("|")]
    # Two seeds of one group: mean ± sample std of 0.1335 and 0.1435.
    assert cells[5:7] == ["0.970 ± 0.000", "0.139 ± 0.007"]
    current = results[1]
    numbers = ReportNumbers(["heldout_loss"], rows, [], rows[1], current, 100.0, 0.4, 250.0,
                            False, [])  # fmt: skip
    assert (
        "| model FLOPs utilisation (6 x parameters x real tokens / (seconds x ranks x peak), "
        "training/mfu.py) | 0.134 (1.10B parameters, 2000000 real tokens, 100.0 s, 1 x NVIDIA "
        "H200 at 989 TFLOP/s) |"
    ) in run_cost_table(numbers, 0.0)


def test_runs_without_an_mfu_keep_the_cost_table_as_it_was(tmp_path):
    from cluster_pipeline.evaluation.render import cost_table

    results, rows = _evaluated(tmp_path, [None, {**CUDA_MFU, "value": None}])
    assert [r.mfu for r in results] == [None, None, None]
    head = cost_table(rows, 1000.0).splitlines()[0]
    assert "MFU" not in head and "useful compute" in head


def test_the_speed_knobs_are_left_out_of_a_checkpoints_identity():
    from cluster_pipeline.evaluation.report import RUN_ONLY_SETTINGS
    from cluster_pipeline.training.config import SPEED_ONLY_SETTINGS, TrainSettings
    from cluster_pipeline.training.preflight import checkpoint_folder

    assert SPEED_ONLY_SETTINGS <= RUN_ONLY_SETTINGS
    base = checkpoint_folder(Path("/r"), "a" * 64, "m", "d", TrainSettings())
    fast = checkpoint_folder(Path("/r"), "a" * 64, "m", "d", TrainSettings(compile=True))
    other = checkpoint_folder(Path("/r"), "a" * 64, "m", "d", TrainSettings(seed=1))
    assert base == fast != other
