"""eval_report compares selectors and seeds, with every benchmark format, and writes plots."""

import json
import math
from pathlib import Path

import dagster as dg
import pytest

from cluster_pipeline.core.report import ModelResult, aggregate, dataset_benchmarks, markdown_table
from cluster_pipeline.defs.partitions import DATASETS
from cluster_pipeline_tests.helpers import RUN_CONFIG, meta, pipeline_assets, resources

ASSETS = pipeline_assets()


def test_aggregate_gives_mean_and_sample_std_per_group():
    rs = [
        ModelResult("b", "base", "p", {"m": 1.0}),
        ModelResult("x0", "random_global r=0.5", "p", {"m": 2.0}, 10.0, 0.5),
        ModelResult("x1", "random_global r=0.5", "p", {"m": 4.0}, 20.0, 0.5, current=True),
    ]
    rows = aggregate(rs, ["m"])
    assert [r["group"] for r in rows] == ["base", "random_global r=0.5"]
    assert (
        rows[1]["n"] == 2
        and rows[1]["m"] == 3.0
        and rows[1]["m_std"] == pytest.approx(math.sqrt(2))
    )
    assert rows[1]["train_seconds"] == 15.0 and rows[1]["current"]
    table = markdown_table(rows, ["m"])
    assert "| **random_global r=0.5** | 2 | 0.500 ± 0.000 | 15.0 ± 7.1 | 3.0000 ± 1.4142 |" in table
    assert "| base | 1 | - | - | 1.0000 |" in table


def test_benchmarks_are_configured_per_dataset(tmp_path):
    (tmp_path / "med").mkdir()
    (tmp_path / "med" / "eval.json").write_text(json.dumps({"benchmarks": ["mmlu_medical"]}))
    assert dataset_benchmarks("med", tmp_path) == ("mmlu_medical",)
    assert dataset_benchmarks("python_stdlib", tmp_path) == ("humaneval", "mbpp")
    assert dataset_benchmarks("other", tmp_path) == ()
    (tmp_path / "med" / "eval.json").write_text(json.dumps({"benchmarks": ["gsm8k"]}))
    with pytest.raises(ValueError, match="unknown benchmarks"):
        dataset_benchmarks("med", tmp_path)


@pytest.mark.slow
def test_report_compares_selectors_and_seeds(tiny_data_dir, tiny_model_dir, tmp_path):
    eval_dir = tmp_path / "eval"
    eval_dir.mkdir()
    (eval_dir / "mbpp_reworded.json").write_text(
        json.dumps(
            [
                {
                    "name": "mbpp_1_double",
                    "prompt": 'def double(x: int) -> int:\n    """Double x."""\n',
                    "tests": (
                        "def check(candidate):\n    assert candidate(2) == 4\n\ncheck(double)\n"
                    ),
                    "stop_tokens": ["\ndef"],
                }
            ]
        )
    )
    (eval_dir / "mmlu.jsonl").write_text(
        "".join(
            json.dumps(
                {
                    "question": f"Q{i}?",
                    "answer_a": "yes",
                    "answer_b": "no",
                    "answer_c": "maybe",
                    "answer_d": "never",
                    "correct_answer": "ABCD"[i % 4],
                    "topic": "anatomy",
                }
            )
            + "\n"
            for i in range(4)
        )
    )
    res = resources(tiny_data_dir, tiny_model_dir)
    eval_cfg = {
        "ops": {
            "eval_report": {
                "config": {
                    "max_length": 64,
                    "benchmarks": ["mbpp", "mmlu_medical"],
                    "max_new_tokens": 8,
                    "eval_data_dir": str(eval_dir),
                }
            }
        }
    }
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(DATASETS, ["tiny"])
        assert dg.materialize(
            ASSETS[:6],
            partition_key="tiny",
            instance=instance,
            resources=res,
            run_config={"ops": {k: v for k, v in RUN_CONFIG["ops"].items() if k != "eval_report"}},
        ).success
        train_cfg = RUN_CONFIG["ops"]["trained_checkpoint"]["config"]
        for seed in (0, 1):
            cfg = {
                "ops": {
                    "peripheral_subsets": {
                        "config": {"selector": "random_global", "ratio": 0.5, "seed": seed}
                    },
                    "trained_checkpoint": {"config": {**train_cfg, "seed": seed}},
                }
            }
            assert dg.materialize(
                ASSETS[3:6], partition_key="tiny", instance=instance, resources=res, run_config=cfg
            ).success
            assert meta(instance, "trained_checkpoint")["reused_checkpoint"] is False
        # The same inputs and settings again: the finished checkpoint is reused, not retrained.
        assert dg.materialize(
            ASSETS[3:6], partition_key="tiny", instance=instance, resources=res, run_config=cfg
        ).success
        assert meta(instance, "trained_checkpoint")["reused_checkpoint"] is True
        assert dg.materialize(
            [ASSETS[6]], partition_key="tiny", instance=instance, resources=res, run_config=eval_cfg
        ).success
        m = meta(instance, "eval_report")
        assert m["models_compared"] == 4
        report = Path(str(m["report_path"]))
        text = report.read_text()
        assert "| peripheral r=0.5 | 1 |" in text
        assert "| **random_global r=0.5** | 2 |" in text and "±" in text
        for png in ("metrics.png", "loss_curves.png", "time_vs_fraction.png"):
            assert (report.parent / png).stat().st_size > 1000 and f"![{png}]({png})" in text
        assert {"base/mbpp_pass@1", "tuned/mmlu_medical_accuracy"} <= set(m)
        # Evaluations are cached: a second report evaluates nothing again.
        assert dg.materialize(
            [ASSETS[6]], partition_key="tiny", instance=instance, resources=res, run_config=eval_cfg
        ).success
        assert len(list((report.parent / "evals").glob("*.json"))) == 4
