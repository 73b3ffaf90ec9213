"""The report's cost rows of a selection: its passes, forward/backward counts and peak memory."""

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
