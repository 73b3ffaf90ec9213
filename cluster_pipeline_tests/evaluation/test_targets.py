"""Target sets (rds): a benchmark's prompts with reference solutions, or a user's folder, as
instruction samples the embedding pass reads."""

import json

import pytest

from cluster_pipeline.evaluation.targets import target_problem, target_samples, target_tasks
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


def test_the_task_of_each_target_sample(tmp_path):
    """The subtasks LESS averages over and RDS+ round-robins over (issue 41): a code benchmark
    has none, MMLU's is the topic, a folder's is the record's ``task`` field, else its file."""
    assert target_tasks(target_samples("humaneval", 3, []), "humaneval") == ["", "", ""]
    rows = [
        {
            "question": f"Q{i}?",
            **{f"answer_{c}": c for c in "abcd"},
            "correct_answer": "A",
            "topic": topic,
        }
        for i, topic in enumerate(["anatomy", "medical genetics", "anatomy"])
    ]
    (tmp_path / "mmlu.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    frame = target_samples("mmlu_medical", 10, [tmp_path])
    # Each question's topic, whatever order the suite loads them in.
    topic = {f"Q{i}?": r["topic"] for i, r in enumerate(rows)}
    expected = [topic[p.split("\n", 1)[0]] for p in frame["prompt"].to_list()]
    assert sorted(expected) == ["anatomy", "anatomy", "medical genetics"]
    assert target_tasks(frame, "mmlu_medical") == expected
    folder = tmp_path / "t"
    records = tiny_records(6)
    write_jsonl(folder / "a.jsonl", [{**records[0], "task": "gsm8k"}, records[1]])
    # b.jsonl: a number is its text; an empty string and a bool are no task (the file is).
    write_jsonl(
        folder / "b.jsonl",
        [
            {**records[2], "task": 7},
            {**records[3], "task": ""},
            {**records[4], "task": True},
            {**records[5], "task": "gsm8k"},
        ],
    )
    frame = target_samples(str(folder), 10, [])
    a, b = str(folder / "a.jsonl"), str(folder / "b.jsonl")
    assert target_tasks(frame, str(folder)) == ["gsm8k", a, "7", b, b, "gsm8k"]
    # A target table written before source_index: its files are its tasks.
    old = frame.drop("source_index")
    assert target_tasks(old, str(folder)) == [a, a, b, b, b, b]
    # One file and no `task` field: no tasks ("", as a code benchmark; LESS then takes the max
    # over single targets); one file whose records all name one task: that task (LESS's mean).
    write_jsonl(tmp_path / "one" / "c.jsonl", records[:3])
    assert target_tasks(target_samples(str(tmp_path / "one"), 10, []), "one") == ["", "", ""]
    write_jsonl(tmp_path / "same" / "c.jsonl", [{**r, "task": "same"} for r in records[:3]])
    same = target_samples(str(tmp_path / "same"), 10, [])
    assert target_tasks(same, str(tmp_path / "same")) == ["same", "same", "same"]


def test_a_target_folder_whose_answers_are_all_empty_is_refused_at_launch(tmp_path):
    """Nothing to pool or take a gradient over: refused when the target set is read, which the
    launch check does (a helper's trial: it was refused only after less's warm-up and passes,
    blamed on max_length); one answer is enough."""
    from cluster_pipeline.defs.run_checks import _target_problem

    folder = tmp_path / "blank"
    write_jsonl(folder / "t.jsonl", [{**r, "output": ""} for r in tiny_records(3)])
    want = (
        f"target {str(folder)!r}: every one of its 3 samples has an empty response; rds, less "
        "and cluster_less leave out a target sample without a response token, so none would be "
        "left: give samples with answers"
    )
    with pytest.raises(ValueError) as e:
        target_samples(str(folder), 10, [])
    assert str(e.value) == want
    assert _target_problem(str(folder), 10, "less", ()) == want
    write_jsonl(folder / "u.jsonl", tiny_records(1))
    assert target_samples(str(folder), 10, []).height == 4
    assert _target_problem(str(folder), 10, "less", ()) is None
