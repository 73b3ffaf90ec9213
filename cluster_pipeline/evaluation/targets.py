"""Target sets: the samples a targeted selector (``rds``) selects towards, as instruction
samples the embedding pass can read.

A target set is named by ``peripheral_subsets.target``:

- a benchmark of :data:`~cluster_pipeline.evaluation.suites.SUITES`: its first
  ``target_size`` items, each as one exchange written the way the evaluation asks it:
  code problems (``humaneval``, ``mbpp``) as the user turn evaluation sends (complete the
  function) answered by the function in a ``python`` fence, its reference solution after the
  prompt where the benchmark has one (HumanEval's ``canonical_solution``; MBPP-style files have
  none, so the answer is the prompt's signature and docstring); multiple-choice questions
  (``mmlu``, ``mmlu_medical``) as the question, its options and ``Answer:``, answered by the
  correct letter and option;
- or a folder of samples in any input form (``data/formats.py``): its first ``target_size``
  distinct samples, in file order; a record's ``task`` field (else its file) is its task, the
  subtask LESS averages over and RDS+ round-robins over (:func:`target_tasks`).

The set is written as an instruction table (``raw_instructions``' schema, every sample in the
``train`` split) so the embedding pass reads it as it reads a pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import polars as pl

from cluster_pipeline.data.datasets import build_instruction_table
from cluster_pipeline.data.folders import TARGET_REMEDY, file_group, record_field_values
from cluster_pipeline.data.formats import Sample, read_dataset_folder

# evaluation.suites imports torch; it is imported where it is used, so that the run checks (and
# with them the Dagster definitions, loaded by every step process) import no torch.
if TYPE_CHECKING:
    from cluster_pipeline.evaluation.suites import CodeProblem

TARGET_FORM = "target"
# A target folder's record field that names its task (else the record's file is its task).
TASK_FIELDS = ("task",)


def _code_sample(name: str, i: int, problem: CodeProblem) -> Sample:
    from cluster_pipeline.evaluation.suites import code_request

    answer = problem.prompt + (problem.solution or "")
    return Sample(
        prompt=code_request(problem)[0]["content"],
        response=f"```python\n{answer}```",
        system="",
        form=TARGET_FORM,
        source_file=f"{name}:{problem.task_id}",
        source_line=i + 1,
        source_index=i,
    )


def _choice_sample(name: str, i: int, question: dict) -> Sample:
    letters = "ABCD"
    options = [str(question[f"answer_{c.lower()}"]) for c in letters]
    prompt = (
        question["question"]
        + "\n"
        + "\n".join(f"{c}. {o}" for c, o in zip(letters, options, strict=True))
        + "\nAnswer:"
    )
    correct = str(question["correct_answer"]).strip().upper()
    return Sample(
        prompt=prompt,
        response=f"{correct}. {options[letters.index(correct)]}",
        system="",
        form=TARGET_FORM,
        source_file=f"{name}:{question.get('topic', '')}",
        source_line=i + 1,
        source_index=i,
    )


def target_problem(
    target: str | None, folders: Sequence[Path] | None, selector: str = "rds"
) -> str | None:
    """Why ``target`` names no target set (None when it does): empty, neither a benchmark of
    :data:`SUITES` nor an existing folder, or a benchmark whose file is in none of ``folders``
    (not looked for when ``folders`` is None). Reads nothing but file names (run checks call
    it before any step); ``selector`` names who needs it."""
    from cluster_pipeline.evaluation.suites import SUITES, find_eval_file

    if not target:
        benchmarks = ", ".join(SUITES)
        return f"{selector} needs a target set: a benchmark ({benchmarks}) or a folder of samples"
    if target in SUITES:
        suite = SUITES[target]
        if folders is not None and suite.file and find_eval_file(folders, suite.file) is None:
            where = ", ".join(str(f) for f in folders)
            return f"benchmark {target!r} reads {suite.file}, found in none of {where}"
        return None
    if Path(target).is_file():
        return "a file, not a folder: give the folder that holds it (every data file in it is read)"
    if not Path(target).is_dir():
        return (
            f"neither a benchmark ({', '.join(SUITES)}) nor an existing folder of samples; "
            "give an absolute path"
        )
    return None


def target_tasks(frame: pl.DataFrame, target: str) -> list[str]:
    """The task of each target sample of ``frame`` (:func:`target_samples`' table, in its order):
    a multiple-choice benchmark's topic (MMLU's 57 subjects: the subtasks LESS averages over,
    ``less/data_selection/matching.py:26,78-79``); for a folder, a record's ``task`` field (a
    string or number, not empty: issue 41's "a `task` field"), else its file (one file per
    task, as RDS+ takes one file per evaluation set,
    ``minimal_multitask/get_top_aggregated_influences.py``); "" for every sample of a code
    benchmark and of a one-file folder without a ``task`` field (no tasks).

    Raises:
        ValueError: a folder's file is gone or changed since :func:`target_samples` read it.
    """
    from cluster_pipeline.evaluation.suites import SUITES

    files = frame["source_file"].to_list()
    if target in SUITES:
        if SUITES[target].kind == "code":
            return [""] * len(files)
        prefix = f"{target}:"
        return [f[len(prefix) :] if f.startswith(prefix) else f for f in files]
    # A table written before source_index (its records' places) keeps its files as tasks.
    indices: list[int | None] = (
        frame["source_index"].to_list() if "source_index" in frame.columns else [None] * len(files)
    )
    tasks = record_field_values(
        files,
        indices,
        TASK_FIELDS,
        f"target {target!r}'s tasks",
        (Path(target), frame["sample_id"].to_list()),
        TARGET_REMEDY,
    )
    groups = [file_group(file) for file in files]  # a sharded file's shards: one task
    if all(task is None for task in tasks) and len(set(groups)) == 1:
        return [""] * len(files)  # one file and no task field: no tasks, as a code benchmark
    return [group if task is None else task for group, task in zip(groups, tasks, strict=True)]


def target_samples(target: str, size: int, folders: Sequence[Path]) -> pl.DataFrame:
    """The target set ``target`` (module docstring) as an instruction table: at most ``size``
    distinct samples, columns of ``raw_instructions`` (split ``train``).

    Raises:
        ValueError: :func:`target_problem`'s reasons, the set holds no sample, or every
            sample's response is empty (nothing to pool or take a gradient over).
        DatasetFormatError: a folder's file or record cannot be read (names file and line).
    """
    from cluster_pipeline.evaluation.suites import SUITES, find_eval_file

    problem = target_problem(target, folders)
    if problem is not None:
        raise ValueError(f"target {target!r}: {problem}")
    samples: list[Sample] = []
    if target in SUITES:
        suite = SUITES[target]
        path = find_eval_file(folders, suite.file) if suite.file else None
        items = suite.load(path, size)
        for i, item in enumerate(items):
            if suite.kind == "code":
                samples.append(_code_sample(target, i, item))
            else:
                samples.append(_choice_sample(target, i, item))
    else:
        seen: set[str] = set()
        for sample in read_dataset_folder(Path(target)):
            if sample.sample_id not in seen:
                seen.add(sample.sample_id)
                samples.append(sample)
            if len(samples) >= size:
                break
    if not samples:
        raise ValueError(f"target {target!r} holds no sample")
    if not any(s.response.strip() for s in samples):
        raise ValueError(
            f"target {target!r}: every one of its {len(samples)} samples has an empty response; "
            "rds, less and cluster_less leave out a target sample without a response token, so "
            "none would be left: give samples with answers"
        )
    frame, _ = build_instruction_table(samples, 0.0, None, None, seed=0)
    return frame
