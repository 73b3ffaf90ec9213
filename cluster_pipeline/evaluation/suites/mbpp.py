"""MBPP-style problems (Austin et al., 2021) from a MultiPL-E ``mbpp_reworded.json`` file in an
evaluation folder; no reference solutions."""

from __future__ import annotations

import json
import re
from pathlib import Path

from cluster_pipeline.evaluation.suites.base import file_of
from cluster_pipeline.evaluation.suites.code import STOP_SEQUENCES, CodeProblem, CodeSuite


def load_mbpp(path: Path, limit: int | None = None) -> list[CodeProblem]:
    """MBPP-style problems from a MultiPL-E ``mbpp_reworded.json`` (list of ``{name, prompt,
    tests, stop_tokens}``; ``tests`` calls the checks itself).

    Raises:
        ValueError: a record lacks those fields, or its prompt defines no function.
    """
    out = []
    for i, r in enumerate(json.loads(Path(path).read_text())[:limit]):
        try:
            match = re.search(r"^def (\w+)\(", r["prompt"], re.MULTILINE)
            if match is None:
                raise KeyError("def")
            out.append(
                CodeProblem(
                    r["name"],
                    r["prompt"],
                    match.group(1),
                    r["tests"],
                    tuple(r.get("stop_tokens", STOP_SEQUENCES)),
                )
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"{path}: record {i} is not an MBPP-style problem ({e})") from None
    return out


class Mbpp(CodeSuite):
    """MBPP, in file order."""

    name = "mbpp"
    listed = 20
    size_knob = "mbpp_problems"
    file = "mbpp_reworded.json"

    def load(self, path: Path | None, size: int) -> list:
        """The first ``size`` problems of the file."""
        return load_mbpp(file_of(path), size)
