"""Target sets (rds): a benchmark's prompts with reference solutions, or a user's folder, as
instruction samples the embedding pass reads."""

import json

import pytest

from cluster_pipeline.evaluation.targets import target_problem, target_samples
from cluster_pipeline_tests.helpers import tiny_records, write_jsonl


def test_humaneval_targets_are_the_request_answered_by_the_reference_solution():
    frame = target_samples("humaneval", 3, [])
    assert frame.height == 3 and set(frame["split"]) == {"train"}
    first = frame.row(0, named=True)
    assert first["prompt"].startswith("Complete the following Python function.")
    assert first["response"].startswith("```python\nfrom typing import List")
    assert "return False" in first["response"] and first["response"].endswith("```")
    assert first["source_file"] == "humaneval:HumanEval/0" and first["system"] == ""


def test_mmlu_medical_targets_answer_with_the_correct_option(tmp_path):
    rows = [
        {
            "question": "Which bone?",
            "answer_a": "Femur",
            "answer_b": "Ulna",
            "answer_c": "Tibia",
            "answer_d": "Radius",
            "correct_answer": "B",
            "topic": "anatomy",
        },
        {**{"question": "Off topic?", "topic": "astronomy"}, **{f"answer_{c}": c for c in "abcd"}},
    ]
    (tmp_path / "mmlu.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    frame = target_samples("mmlu_medical", 10, [tmp_path])
    options = "A. Femur\nB. Ulna\nC. Tibia\nD. Radius"
    assert frame["prompt"].to_list() == [f"Which bone?\n{options}\nAnswer:"]
    assert frame["response"].to_list() == ["B. Ulna"]


def test_a_folder_gives_its_first_distinct_samples(tmp_path):
    records = tiny_records(10)
    write_jsonl(tmp_path / "t" / "a.jsonl", records + records)
    frame = target_samples(str(tmp_path / "t"), 4, [])
    assert frame["response"].to_list() == [r["output"] for r in records[:4]]


def test_bad_targets_are_named():
    assert "needs a target set" in (target_problem(None, None) or "")
    assert "nor an existing folder" in (target_problem("humaneva", None) or "")
    with pytest.raises(ValueError, match="mbpp_reworded.json, found in none"):
        target_samples("mbpp", 4, [])
