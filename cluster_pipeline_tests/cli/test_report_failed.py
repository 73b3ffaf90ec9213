"""``make run``'s last lines when its run failed (issue 44's trial: a malformed line's message,
which names the file and line, came among 16 stack frames and the lines of the skipped steps):
``cluster-pipeline report <dataset> --failed`` names the step and its own message. The kind: a
step that raises a ``dagster.Failure`` (its description), a run whose latest run did not fail
(nothing), a dataset with no run (nothing)."""

import dagster as dg

from cluster_pipeline.cli.report import failure_lines
from cluster_pipeline_tests.helpers import materialize_partition, pipeline_assets, resources


def test_the_failed_step_and_its_own_message(tmp_path, tiny_model_dir):
    data = tmp_path / "data"
    bad = data / "raw" / "bad" / "part.jsonl"
    bad.parent.mkdir(parents=True)
    bad.write_text('{"instruction": "q", "output": "r"}\n{"instruction": "q2" "output": "r2"}\n')
    good = data / "raw" / "good" / "part.jsonl"
    good.parent.mkdir(parents=True)
    good.write_text("".join(f'{{"instruction": "q{i}", "output": "r{i}"}}\n' for i in range(8)))
    res = resources(data, tiny_model_dir)
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("datasets", ["bad", "good"])
        assert failure_lines(instance, "bad") == []  # no run yet
        result = materialize_partition(
            pipeline_assets()[:1], instance, res, partition="bad", raise_on_error=False
        )
        assert not result.success
        lines = failure_lines(instance, "bad")
        assert lines[0] == (
            f"run {result.run_id[:8]} of dataset 'bad' failed at step raw_instructions:"
        )
        assert lines[1].startswith(f"  dataset 'bad': {bad}:2:"), lines
        assert "invalid JSON" in lines[1] and len(lines) == 2
        ok = materialize_partition(pipeline_assets()[:1], instance, res, partition="good")
        assert ok.success and failure_lines(instance, "good") == []
