"""A :class:`~cluster_pipeline.selection.passes.PassRunner` for tests of a selector's
orchestration: it answers every request from hand-made arrays (no model, no process) and keeps
what was asked, so a test runs the selector's real ``gather`` and function and checks exact
selections, records and requests in milliseconds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import polars as pl

from cluster_pipeline.selection.passes import (
    PASS_EMBEDDING,
    BriefTraining,
    ForwardPass,
    PassCost,
    PassOutput,
    Pool,
    RunCheckpoint,
    TrainedRun,
)

# (request) -> (ran (n,) bool, {output: array}) for a forward pass.
Answer = Callable[[ForwardPass], tuple[np.ndarray, dict[str, np.ndarray]]]


def tiny_pool(labels: list[int], sq_distance: list[float] | None = None, length: int = 10) -> Pool:
    """A pool of ``len(labels)`` samples ``s0, s1, ...`` of ``length`` tokens each (half of
    them response), with a pool-pass cost of one forward per sample."""
    n = len(labels)
    return Pool(
        dataset="tiny",
        sample_ids=np.array([f"s{i}" for i in range(n)]),
        labels=np.asarray(labels, dtype=np.int64),
        k=int(max(labels)) + 1,
        sq_distance=np.asarray(sq_distance or [0.0] * n, dtype=np.float32),
        lengths=np.full(n, length, dtype=np.int64),
        response_tokens=np.full(n, length // 2, dtype=np.int64),
        world_size=2,
        max_length=64,
        cost=PassCost(PASS_EMBEDDING, samples=n, tokens=n * length, seconds=3.0),
    )


@dataclass
class FakeRunner:
    """Answers a selector's requests from hand-made arrays.

    Attributes:
        columns: the pool pass's table: column -> (N,) or (N, d) array (``mean_loss``,
            ``hidden_mean_normalised``).
        answer: the outputs of each forward pass (:data:`Answer`).
        target_samples: M, the size of any target set read.
        sources: (N,) the pool samples' sources (:meth:`pool_sources`).
        tasks: (M,) the target samples' tasks (:meth:`target_tasks`; "" each when not given).
        learning_rates: what a brief training run gives as its checkpoints' learning rates.
        requests: every request, in order (``("target_set", target, size)``, a
            :class:`ForwardPass` or a :class:`BriefTraining`).
        tables: the tables written, by name.
        logs: the log lines.
    """

    columns: dict[str, np.ndarray] = field(default_factory=dict)
    answer: Answer | None = None
    target_samples: int = 0
    sources: list[str] = field(default_factory=list)
    tasks: list[str] = field(default_factory=list)
    learning_rates: tuple[float, ...] = ()
    requests: list[object] = field(default_factory=list)
    tables: dict[str, pl.DataFrame] = field(default_factory=dict)
    logs: list[str] = field(default_factory=list)

    def pool_column(self, column: str) -> np.ndarray:
        return np.asarray(self.columns[column], dtype=np.float32)

    def pool_vectors(self, column: str) -> np.ndarray:
        return np.asarray(self.columns[column], dtype=np.float32)

    def pool_sources(self) -> np.ndarray:
        return np.asarray(self.sources, dtype=str)

    def target_tasks(self) -> np.ndarray:
        return np.asarray(self.tasks or [""] * self.target_samples, dtype=str)

    def target_set(self, target: str | None, size: int) -> int:
        self.requests.append(("target_set", target, size))
        return self.target_samples

    def forward(self, request: ForwardPass) -> PassOutput:
        self.requests.append(request)
        assert self.answer is not None, f"no answer for {request}"
        ran, values = self.answer(request)
        ran = np.asarray(ran, dtype=bool)
        # One forward per sample that ran, 2 tokens each, a second a sample.
        cost = PassCost(request.name, int(ran.sum()), 2 * int(ran.sum()), float(ran.sum()))
        return PassOutput(ran, values, cost, run_now=int(ran.sum()))

    def train(self, request: BriefTraining) -> TrainedRun:
        self.requests.append(request)
        steps = [request.every * (t + 1) for t in range(request.checkpoints)]
        visits = request.steps * 4
        return TrainedRun(
            tuple(RunCheckpoint(f"proxy/step_{s}", s) for s in steps),
            self.learning_rates if request.learning_rates else (),
            PassCost(request.name, visits, 10 * visits, 60.0, backward=visits),
        )

    def write_table(self, name: str, frame: pl.DataFrame) -> None:
        self.tables[name] = frame

    def log(self, message: str) -> None:
        self.logs.append(message)
