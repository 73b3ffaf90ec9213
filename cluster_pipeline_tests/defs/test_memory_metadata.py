"""A stage's memory in its metadata and log (issue 44): the pre-launch estimate part by part
beside each rank's measured peak, and their ratio."""

from cluster_pipeline.defs.metadata import memory_display
from cluster_pipeline.training.memory import GIB, MemoryEstimate


def test_the_metadata_gives_the_estimate_and_each_ranks_measured_peak():
    estimate = MemoryEstimate((("process", GIB // 2), ("weights", GIB // 2), ("activations", GIB)))
    lines: list[str] = []
    measured = [int(2.2 * GIB), int(2.1 * GIB)]
    assert memory_display(estimate, measured, lines.append) == {
        "memory_per_rank": (
            "estimated 2.00 GiB: process 0.50 + weights 0.50 + activations 1.00; measured peak "
            "[2.2, 2.1] GiB (1.10 of the estimate)"
        ),
        "estimated_memory_per_rank_gib": 2.0,
        "measured_memory_per_rank_gib": [2.2, 2.1],
    }
    assert lines == [
        "memory per rank: estimated 2.00 GiB, measured peak [2.2, 2.1] GiB (1.10 of the estimate)",
        "memory estimate per rank: 2.00 GiB: process 0.50 + weights 0.50 + activations 1.00",
    ]


def test_a_stage_that_ran_nothing_now_gives_the_estimate_alone():
    estimate = MemoryEstimate((("process", GIB), ("DDP buckets", 0)))
    lines: list[str] = []
    assert memory_display(estimate, None, lines.append) == {
        "memory_per_rank": "estimated 1.00 GiB: process 1.00",
        "estimated_memory_per_rank_gib": 1.0,
    }
    assert lines[0] == "memory per rank: estimated 1.00 GiB, not measured now"
